"""Soak: 10,000 updates over a prefetched, memory-mapped stream with checkpoints.

Not part of CI (minutes on two cores). It checks what a long run must not do:

- grow: the process's resident memory (RSS, from /proc/self/statm) at the start of every
  epoch after the first stays within 5 MiB of its value at the start of epoch 2 (epoch 1
  compiles, fills the allocator's pools and the page cache of the mapped files);
- leak threads: no prefetch thread is alive after `fit` returns, or after it raises;
- lose the checkpoint: the last checkpoint loads with its checksums and resumes at the
  last update.

Run: `.venv/bin/python benchmarks/soak.py [--updates 10000]`; writes
`benchmarks/results/soak.json`. Exits 1 if a check fails.
"""

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import equinox as eqx
import jax.random as jr
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))
from _common import write_json  # noqa: E402

import eqx_lowmem as el  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")
PREFETCH_THREAD = "eqx_lowmem.data.prefetch"
SAMPLES, FEATURES, MICRO_BATCH = 2000, 16, 20  # 100 updates an epoch
LIMIT_MIB = 5.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PREFETCH_THREAD and t.is_alive()]


def make_data(directory: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    w = rng.standard_normal((FEATURES, 1)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.1 * rng.standard_normal((SAMPLES, 1))).astype(np.float32)
    paths = directory / "x.npy", directory / "y.npy"
    for path, array in zip(paths, (x, y), strict=True):
        np.save(path, array)
    return paths


def make_trainer(checkpoint_dir: Path, callback=None) -> el.train.Trainer:
    model = eqx.nn.MLP(FEATURES, 1, 32, 2, key=jr.PRNGKey(0))
    return el.train.Trainer(
        model,
        el.train.mse,
        optax.adam(1e-3),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=500,
        progress=False,
        callback=callback,
    )


def make_stream(paths) -> el.data.DataStream:
    return el.data.DataStream(tuple(str(p) for p in paths), MICRO_BATCH, 256, key=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=10_000)
    args = parser.parse_args()
    per_epoch = SAMPLES // MICRO_BATCH
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = make_data(tmp)
        epoch_rss: dict[int, int] = {}

        def record(trainer, info):
            epoch_rss.setdefault(info["epoch"], rss_bytes())

        trainer = make_trainer(tmp / "run", record)
        start = time.perf_counter()
        history = trainer.fit(stream=make_stream(paths), updates=args.updates, key=jr.PRNGKey(1))
        seconds = time.perf_counter() - start
        threads_after_return = len(prefetch_threads())
        losses = history["train_loss"]

        # The last checkpoint: checksums verified, at the last update.
        like = make_trainer(tmp / "other").step_fn.init(
            eqx.nn.MLP(FEATURES, 1, 32, 2, key=jr.PRNGKey(0)), key=jr.PRNGKey(0)
        )
        state, meta = el.train.load_checkpoint(trainer.checkpoint_path, like)
        checkpoint_step = int(state.step)

        # A run that raises midway (the callback fails at update 150).
        def fail(trainer, info):
            if info["updates"] >= 150:
                raise RuntimeError("planted failure")

        raised = make_trainer(tmp / "raises", fail)
        try:
            raised.fit(stream=make_stream(paths), updates=1_000, key=jr.PRNGKey(1))
            raised_ok = False
        except RuntimeError as e:
            raised_ok = "planted failure" in str(e)
        threads_after_raise = len(prefetch_threads())

    epochs = sorted(epoch_rss)
    baseline = epoch_rss[epochs[1]] if len(epochs) > 1 else epoch_rss[epochs[0]]
    later = [epoch_rss[e] for e in epochs[1:]]
    growth_mib = (max(later) - baseline) / 2**20 if later else 0.0
    spread_mib = (max(later) - min(later)) / 2**20 if later else 0.0
    checks = {
        "rss_flat_within_5_mib_after_epoch_1": spread_mib <= LIMIT_MIB,
        "no_thread_after_fit_returns": threads_after_return == 0,
        "no_thread_after_fit_raises": threads_after_raise == 0 and raised_ok,
        "checkpoint_at_last_update": checkpoint_step == args.updates,
        "loss_finite_and_fell": bool(np.isfinite(losses).all()) and losses[-1] < losses[0],
    }
    payload = {
        "what": "soak: updates over a prefetched memmap DataStream with checkpoints every 500",
        "updates": args.updates,
        "updates_per_epoch": per_epoch,
        "epochs": len(losses),
        "seconds": round(seconds, 2),
        "updates_per_second": round(args.updates / seconds, 1),
        "rss_mib_epoch_2": round(baseline / 2**20, 2),
        "rss_mib_growth_after_epoch_1": round(growth_mib, 3),
        "rss_mib_spread_after_epoch_1": round(spread_mib, 3),
        "rss_mib_by_epoch": {str(e): round(epoch_rss[e] / 2**20, 2) for e in epochs},
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "train_loss_first_last": [round(losses[0], 5), round(losses[-1], 5)],
        "threads_after_return": threads_after_return,
        "threads_after_raise": threads_after_raise,
        "checkpoint_step": checkpoint_step,
        "checks": checks,
    }
    out = write_json("soak", payload)
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(
        f"{args.updates} updates in {seconds:.1f} s; RSS spread after epoch 1 "
        f"{spread_mib:.2f} MiB; wrote {out}"
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
