"""The language-model loss's two paths side by side in one process (issue 36).

`next_token_loss(..., chunk=None)` (whole float32 logits and log-softmax) against the
chunked default (`chunked_cross_entropy`), on a 2-layer `CausalLM(remat=True)` at a
vocabulary of 32,000, d_model 512, one micro-batch of 8 x 256 predicted tokens: the
loss-and-gradient's compiled temporaries (the whole model's; the head's alone; the body's
alone, the same model at a vocabulary of 128, which the chunked loss cannot go below), the
largest differences of loss and gradients, and the median ratio of step times
(interleaved rounds). Goals: >= 10x fewer temporaries, <= 1.0x the time. Any backend: on
a GPU it writes `lm_loss_h200.json`-style records under `--name`. `--target h100` adds the
same temporaries compiled for a GPU this machine does not have (compile-only: needs the
CUDA plugin, `pip install -e '.[gpu-plan]'`), nothing run.

    python benchmarks/lm_loss.py                 # writes benchmarks/results/lm_loss.json
    python benchmarks/lm_loss.py --target h100   # adds "target_h100" to lm_loss.json
    python benchmarks/lm_loss.py --name lm_loss_h200
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout, if not installed
from _common import write_json  # noqa: E402

LM_LOSS = {"vocab": 32_000, "d_model": 512, "layers": 2, "heads": 8, "d_ff": 2048}
LM_LOSS.update(remat=True, batch=8, seq=256, rounds=7)


def _head_temps(c: dict, chunk: int, target=None) -> dict[str, int]:
    """The head alone (hidden states and head in, loss out): its loss-and-gradient
    temporaries, naive (whole logits and log-softmax) and chunked; for `target`'s device
    when given (compile-only)."""
    import jax
    import jax.numpy as jnp

    import eqx_lowmem as el

    n, d, v = c["batch"] * c["seq"], c["d_model"], c["vocab"]
    shapes = ((n, d, jnp.float32), (v, d, jnp.float32), (v, jnp.float32), (n, jnp.int32))
    args = tuple(_placed(s[:-1], s[-1], target) for s in shapes)

    def naive(h, w, b, t):
        logp = jax.nn.log_softmax(h @ w.T + b[None, :], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, t[:, None], axis=1))

    def chunked(h, w, b, t):
        return jnp.mean(el.train.chunked_cross_entropy(h, w, t, head_bias=b, chunk=chunk))

    def temp(f):
        lowered = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).lower(*args)
        return _compile(lowered, target).memory_analysis().temp_size_in_bytes

    return {"naive": temp(naive), "chunked": temp(chunked)}


def _placed(shape: tuple, dtype, target):
    """An array of `shape` (zeros), or for a compile-only `target` its shape placed on the
    target's device (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    if target is None:
        return jnp.zeros(shape, dtype)
    sharding = jax.sharding.SingleDeviceSharding(target.devices_of_topology()[0])
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _compile(lowered, target):
    """`lowered.compile()`, with a compile-only target's options (cuBLAS for the products
    whose Triton tiles need the device)."""
    from eqx_lowmem.memory._compile import NO_TRITON_GEMM

    if target is None:
        return lowered.compile()
    return lowered.compile(compiler_options={**target.options(), **NO_TRITON_GEMM})


def _compiled(target, vocab: int, chunk) -> dict:
    """The compiled loss-and-gradient memory of the benchmark's model at `vocab`, for
    `target` (None: this machine; nothing runs)."""
    import equinox as eqx
    import jax
    import jax.random as jr
    from _common import compiled_memory

    import eqx_lowmem as el

    c = LM_LOSS
    model = el.nn.CausalLM(
        vocab, c["seq"], c["layers"], c["d_model"], c["heads"], c["d_ff"],
        key=jr.key(0), remat=c["remat"],
    )  # fmt: skip
    arrays, static = eqx.partition(model, eqx.is_array)
    arrays = jax.tree.map(lambda a: _placed(a.shape, a.dtype, target), arrays)
    tokens = _placed((c["batch"], c["seq"] + 1), jax.numpy.int32, target)

    def grad(arrays, tokens):
        loss = lambda a: _mean_loss(eqx.combine(a, static), tokens, chunk)  # noqa: E731
        return jax.value_and_grad(loss)(arrays)

    return compiled_memory(_compile(jax.jit(grad).lower(arrays, tokens), target))


# The model without a vocabulary to speak of: what its body (embedding, blocks) holds.
BODY_VOCAB = 128


def _memory(target) -> dict:
    """The model's and the head's loss-and-gradient memory, naive and chunked, and the
    body's alone (vocabulary 128), for `target` (None: this machine); nothing runs."""
    from eqx_lowmem.train._chunked import DEFAULT_CHUNK

    vocab = LM_LOSS["vocab"]
    memory = {p: _compiled(target, vocab, ch) for p, ch in (("naive", None), ("chunked", "auto"))}
    head = _head_temps(LM_LOSS, DEFAULT_CHUNK, target)
    return {
        "memory": memory,
        "temp_ratio": memory["naive"]["temp"] / memory["chunked"]["temp"],
        "body_temp": _compiled(target, BODY_VOCAB, None)["temp"],
        "head_temp": head,
        "head_temp_ratio": head["naive"] / head["chunked"],
    }


def _mean_loss(model, tokens, chunk):
    import jax.numpy as jnp

    import eqx_lowmem as el

    values, weights = el.train.next_token_loss(model, tokens, chunk=chunk)
    return jnp.sum(values * weights) / jnp.sum(weights)


def lm_loss() -> dict:
    """The naive and the chunked LM loss side by side (see the module's docstring)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    from _common import interleaved, median_ratio

    import eqx_lowmem as el
    from eqx_lowmem.train._chunked import DEFAULT_CHUNK

    c = LM_LOSS
    model = el.nn.CausalLM(
        c["vocab"], c["seq"], c["layers"], c["d_model"], c["heads"], c["d_ff"],
        key=jr.key(0), remat=c["remat"],
    )  # fmt: skip
    tokens = jr.randint(jr.key(1), (c["batch"], c["seq"] + 1), 0, c["vocab"])

    paths = {"naive": None, "chunked": "auto"}
    fns = {n: eqx.filter_jit(eqx.filter_value_and_grad(_mean_loss)) for n in paths}
    out = {n: jax.block_until_ready(fns[n](model, tokens, ch)) for n, ch in paths.items()}
    (l0, g0), (l1, g1) = out["naive"], out["chunked"]
    grad_diff = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), g0, g1))
    rounds = interleaved(
        {n: lambda n=n: jax.block_until_ready(fns[n](model, tokens, paths[n])) for n in paths},
        c["rounds"],
    )
    return {
        "config": {**c, "chunk": DEFAULT_CHUNK},
        **_memory(None),
        "loss_abs_diff": float(jnp.abs(l0 - l1)),
        "grad_max_abs_diff": float(max(grad_diff)),
        "seconds": rounds.wall,
        "time_ratio": median_ratio(rounds.wall["chunked"], rounds.wall["naive"]),
        "goals": {"temp_ratio_at_least": 10.0, "time_ratio_at_most": 1.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--name", default="lm_loss", help="the JSON's name in results/")
    parser.add_argument("--target", help="add compile-only figures for this GPU (h100)")
    args = parser.parse_args()
    if args.target:  # added to the record of the last run on this machine
        from _common import add_to_record, environment

        import eqx_lowmem as el

        target = el.memory.Target(args.target)
        found = {"target": target.describe(), **_memory(target), "environment": environment()}
        print(json.dumps(found, indent=1))
        print(f"wrote {add_to_record(args.name, {f'target_{args.target}': found})}")
        return
    result = lm_loss()
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
    print(f"wrote {write_json(args.name, result)}")


if __name__ == "__main__":
    main()
