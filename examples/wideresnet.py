"""Train a small WideResNet on Fashion-MNIST with the paper's whole low-memory combination.

Sohoni et al. (2019) cut WideResNet training memory 60.7x with four techniques together;
this trains a WRN-10-1 with all of them: 16-bit compute (`precision="mixed_fp16"`),
recomputation of every residual block ("checkpoint-residual-1"), micro-batches of 10 images
(`accumulate=10` at batch 100, BatchNorm statistics per micro-batch) and 30% of the 3x3
convolutions' weights, rewired by DSR. It prints the step's memory report (compile only),
then trains and prints the test accuracy.

Needs the Debian package `dataset-fashion-mnist` (apt-get install dataset-fashion-mnist).

    python examples/wideresnet.py                  # 1,500 training images, 2 epochs
    python examples/wideresnet.py --train 60000 --epochs 10
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import eqx_lowmem as el

PRECISIONS = ("float32", "half_bf16", "half_fp16", "mixed_bf16", "mixed_fp16")


def loss(model, state, x, y):
    """Per-image cross-entropy; the BatchNorm state goes in and comes out."""
    logits, state = model.batched(x, state)  # vmapped with axis_name="batch"
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y), state


def images(split: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = el.data.fashion_mnist(split)
    x = (x[:n].astype(np.float32) / 255.0 - 0.2860) / 0.3530
    return x[:, None], y[:n].astype(np.int32)  # (n, 1, 28, 28) and (n,)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=1500, help="training images used")
    p.add_argument("--test", type=int, default=2000, help="test images used")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=100, help="the whole batch of one update")
    p.add_argument("--accumulate", type=int, default=10, help="micro-batches per batch")
    p.add_argument("--density", type=float, default=0.3)
    p.add_argument(
        "--precision",
        default="mixed_fp16",
        choices=("float32", "half_bf16", "half_fp16", "mixed_bf16", "mixed_fp16"),
    )
    # The rate benchmarks/quality.py --select-lr chose on held-out training images.
    p.add_argument("--lr", type=float, default=0.2, help="peak learning rate (cosine decay)")
    args = p.parse_args()
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")

    key = jr.PRNGKey(0)
    model, state = eqx.nn.make_with_state(el.nn.WideResNet)(
        10, 1, 10, key=key, in_channels=1, remat="checkpoint-residual-1"
    )
    # Only the blocks' 3x3 convolutions become sparse; DSR moves weights between them.
    model = el.sparse.sparsify(
        model,
        args.density,
        key=jr.fold_in(key, 1),
        slack=0.1,
        exclude=el.nn.WideResNet.keep_dense,
        storage="bits",  # where the non-zeros are: one bit per dense weight
    )
    steps = args.epochs * (args.train // args.batch)
    # DSR's schedule doubles the period at 20%, 40% and 60% of the steps and stops at 80%:
    # 0.375 * steps / period rewirings. The authors' period of 100 suits 100,000 updates;
    # for a short run, about 10 rewirings.
    dsr = el.sparse.dsr(period=max(1, min(100, round(0.375 * steps / 10))), total_steps=steps)
    optimizer = optax.sgd(optax.cosine_decay_schedule(args.lr, steps), momentum=0.9)
    options = dict(accumulate=args.accumulate, precision=args.precision, has_state=True)
    batch = (
        jax.ShapeDtypeStruct((args.batch, 1, 28, 28), jnp.float32),
        jax.ShapeDtypeStruct((args.batch,), jnp.int32),
    )
    print(el.memory.memory_report(model, loss, optimizer, batch, model_state=state, **options))

    step = el.train.make_step(loss, optimizer, after_update=dsr, **options)
    train_state = step.init(model, key=jr.fold_in(key, 2), model_state=state)
    (x, y), (x_test, y_test) = images("train", args.train), images("test", args.test)
    rng = np.random.default_rng(0)

    @eqx.filter_jit
    def predict(model, state, x):
        # Evaluation uses BatchNorm's running statistics.
        logits, _ = eqx.nn.inference_mode(model).batched(x, state)
        return jnp.argmax(logits, axis=-1)

    for epoch in range(args.epochs):
        order = rng.permutation(len(x))
        for i in range(len(x) // args.batch):
            idx = np.sort(order[i * args.batch : (i + 1) * args.batch])
            train_state, metrics = step(train_state, (jnp.asarray(x[idx]), jnp.asarray(y[idx])))
        pred = np.concatenate(
            [
                np.asarray(predict(train_state.model, train_state.model_state, x_test[j : j + 500]))
                for j in range(0, len(x_test), 500)
            ]
        )
        print(
            f"epoch {epoch + 1}: last loss {float(metrics['loss']):.4f}, test accuracy "
            f"{np.mean(pred == y_test):.4f}, density {el.sparse.density(train_state.model):.3f}"
        )


if __name__ == "__main__":
    main()
