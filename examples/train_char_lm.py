"""Train a character-level language model on the source of Python's standard library.

The text is on every machine that has Python, so nothing is downloaded. The script

1. writes the text once as a `.npy` file of token windows (atomically, never over an
   existing file),
2. streams it from disk with `DataStream` (a bounded shuffle: only the batch being served
   is read),
3. trains a causal transformer with recomputation (`remat`), micro-batch accumulation and
   mixed bf16 through the `Trainer`, with a progress bar (or a log line every 30 s when
   the output is not a terminal) and checkpoints every 2 minutes and at every epoch's end;
   Ctrl-C saves and stops, and running it again resumes instead of starting over (pass a
   larger `--epochs` to train further),
4. prints where the memory of a training step goes (before training, from compilation
   alone), the loss curve against the unigram entropy of the text, and a sample of
   generated text.

The defaults run in a few minutes on 2 CPU cores. Scale it up on a GPU, for example:

    python examples/train_char_lm.py --layers 12 --d-model 512 --heads 8 --seq 256 \\
        --batch 256 --accumulate 4 --max-chars 50000000 --epochs 3 --run-dir runs/big
"""

import argparse
import math
import os
import sysconfig
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import eqx_lowmem as el

PRECISIONS = ("float32", "half_bf16", "half_fp16", "mixed_bf16", "mixed_fp16")

VOCAB = 128  # ASCII: every byte of the corpus is below 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/char_lm", help="data, checkpoint and outputs")
    p.add_argument("--max-chars", type=int, default=600_000, help="characters of corpus")
    p.add_argument("--seq", type=int, default=128, help="context length")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=None, help="default 4 * d_model")
    p.add_argument("--batch", type=int, default=32, help="sequences per update (the whole batch)")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per update")
    p.add_argument("--remat", default="full", choices=["none", "full", "dots", "minimal"])
    p.add_argument(
        "--precision",
        default="mixed_bf16",
        choices=("float32", "half_bf16", "half_fp16", "mixed_bf16", "mixed_fp16"),
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--shuffle-buffer", type=int, default=1024)
    p.add_argument("--checkpoint-every", type=int, default=None, help="updates (also on time)")
    p.add_argument("--checkpoint-seconds", type=float, default=120.0)
    p.add_argument("--sample-chars", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    if args.batch % args.accumulate:
        p.error(f"--batch {args.batch} is not divisible by --accumulate {args.accumulate}")
    return args


# ------------------------------------------------------------------------------ the corpus


def stdlib_text(max_chars: int) -> bytes:
    """ASCII text of the standard library's .py files, in a fixed order, up to max_chars."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data.isascii():
            continue
        parts.append(data + b"\n\n")
        total += len(data) + 2
        if total >= max_chars:
            break
    return b"".join(parts)[:max_chars]


def write_windows(path: Path, text: bytes, seq: int) -> None:
    """Split the text into windows of seq + 1 tokens (inputs and shifted targets) and save
    them as one `.npy`."""
    tokens = np.frombuffer(text, np.uint8)
    n = len(tokens) // (seq + 1)
    save_new(path, tokens[: n * (seq + 1)].reshape(n, seq + 1))


def save_new(path: Path, array: np.ndarray) -> None:
    """Save `array` as `path` unless that file exists: written beside it and renamed, so a
    run killed while writing leaves no torn file (open() honours the umask)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def unigram_entropy(path: Path) -> float:
    """Entropy of the character distribution, in nats: the loss of the best model that
    ignores context."""
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=VOCAB).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------- generation


@eqx.filter_jit
def _sample(model, window, length, key, n: int, temperature: float):
    """n tokens sampled one at a time in one compiled loop; the window slides once full."""
    seq = window.shape[0]

    def body(i, carry):
        window, length, out = carry
        logits = model(window)[length - 1].astype(jnp.float32)
        token = jr.categorical(jr.fold_in(key, i), logits / temperature).astype(jnp.int32)
        full = length == seq
        window = jnp.where(
            full, jnp.roll(window, -1).at[-1].set(token), window.at[length].set(token)
        )
        return window, jnp.minimum(length + 1, seq), out.at[i].set(token)

    out = jnp.zeros((n,), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (window, length, out))[2]


def generate(model, prompt: str, n: int, *, key, temperature: float = 0.8) -> str:
    """Sample n characters after the prompt."""
    seq = model.max_seq
    context = list(prompt.encode())[-seq:]
    window = jnp.zeros((seq,), jnp.int32).at[: len(context)].set(jnp.asarray(context))
    tokens = _sample(model, window, jnp.asarray(len(context)), key, n, temperature)
    return prompt + bytes(np.asarray(tokens).astype(np.uint8)).decode("ascii", errors="replace")


def curve(losses: list[float], width: int = 40, rows: int = 12) -> str:
    """A text plot of the loss per update, `rows` lines."""
    if not losses:
        return "  (no updates in this run)"
    lo, hi = min(losses), max(losses)
    lines = []
    for r in range(rows):
        i = min(len(losses) - 1, round(r * (len(losses) - 1) / max(rows - 1, 1)))
        bar = "#" * max(1, round(width * (losses[i] - lo) / max(hi - lo, 1e-9)))
        lines.append(f"  update {i + 1:5d}  loss {losses[i]:.3f}  {bar}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    run = Path(args.run_dir)
    d_ff = args.d_ff or 4 * args.d_model
    data = run / f"stdlib_{args.max_chars}_{args.seq}.npy"
    if not data.exists():
        t0 = time.perf_counter()
        write_windows(data, stdlib_text(args.max_chars), args.seq)
        print(f"wrote {data} in {time.perf_counter() - t0:.1f}s")
    windows = np.load(data, mmap_mode="r", allow_pickle=False)
    micro = args.batch // args.accumulate
    n_eval = max(micro, len(windows) // 20)  # the last 5% for evaluation
    train_path = run / f"train_{data.stem}.npy"
    if not train_path.exists():
        save_new(train_path, np.asarray(windows[:-n_eval]))
    entropy = unigram_entropy(data)
    print(
        f"corpus: {windows.size:,} characters of the standard library in {len(windows):,} "
        f"windows of {args.seq + 1}; unigram entropy {entropy:.3f} nats "
        f"({entropy / math.log(2):.2f} bits) per character"
    )

    key = jr.PRNGKey(args.seed)
    model_key, fit_key, sample_key = jr.split(key, 3)
    model = el.nn.CausalLM(
        VOCAB,
        args.seq,
        args.layers,
        args.d_model,
        args.heads,
        d_ff,
        key=model_key,
        remat=args.remat,
    )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=20, decay_steps=10_000, end_value=args.lr / 10
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )
    stream = el.data.DataStream(
        (str(train_path),),
        micro,  # the stream serves micro-batches; the Trainer takes `accumulate` per update
        shuffle_buffer=args.shuffle_buffer,
        key=args.seed,
        drop_last=True,
    )
    eval_tokens = np.asarray(windows[-n_eval:]).astype(np.int32)

    losses: list[float] = []

    def int_tokens(model, tokens, *, key=None):
        return el.train.next_token_loss(model, tokens.astype(jnp.int32), key=key)

    trainer = el.train.Trainer(
        model,
        int_tokens,
        optimizer,
        accumulate=args.accumulate,
        precision=args.precision,
        checkpoint_dir=run / "checkpoint",
        checkpoint_every=args.checkpoint_every,
        checkpoint_seconds=args.checkpoint_seconds,
        progress=not args.no_progress,
        config={"corpus": data.name, "layers": args.layers, "d_model": args.d_model},
        callback=lambda trainer, m: losses.append(m["loss"]),
    )
    if trainer.checkpoint_path is not None and trainer.checkpoint_path.exists():
        meta = el.train.read_meta(trainer.checkpoint_path)
        done = len(meta["history"]["train_loss"])
        print(
            f"resuming from {trainer.checkpoint_path}: {done} epoch(s) done, "
            f"{meta['partial']['updates']} update(s) into the next"
        )
    del model  # the Trainer holds its own copy (trainer.model)

    n_params = sum(a.size for a in jax.tree.leaves(eqx.filter(trainer.model, eqx.is_array)))
    print(
        f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, d_ff {d_ff}, "
        f"{n_params:,} parameters; "
        f"remat={args.remat}, batch {args.batch} = accumulate {args.accumulate} x {micro}, "
        f"precision={args.precision}"
    )
    report = el.memory.memory_report(
        trainer.model,
        int_tokens,
        optimizer,
        (jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.uint8),),  # the whole batch
        accumulate=args.accumulate,
        precision=args.precision,
        name="char LM",
    )
    print(report.table(max_groups=4))

    t0 = time.perf_counter()
    history = trainer.fit(epochs=args.epochs, key=fit_key, stream=stream, eval_data=(eval_tokens,))
    seconds = time.perf_counter() - t0
    print(f"\ntrained {len(losses)} update(s) in this run ({seconds:.0f}s)")
    print(curve(losses))
    print("\nepoch  train loss  eval loss   (nats per character)")
    for i, (tr, ev) in enumerate(zip(history["train_loss"], history["eval_loss"], strict=True)):
        print(f"{i + 1:5d}  {tr:10.3f}  {ev:9.3f}")
    final = history["eval_loss"][-1] if history["eval_loss"] else float("nan")
    print(
        f"final eval loss {final:.3f} nats against the unigram entropy {entropy:.3f} "
        f"({final / entropy:.2f}x)"
    )
    print("\nsample:\n" + "-" * 60)
    print(generate(trainer.model, "def ", args.sample_chars, key=sample_key))
    print("-" * 60)


if __name__ == "__main__":
    main()
