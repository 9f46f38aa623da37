"""Checkpoints: the training thread's stall per save, single file against orbax, and
SIGKILL at random moments of an orbax run (during asynchronous saves too).

1. Stall: a TrainState of about 100 MB (an MLP of 8 layers 1024x1024 with Adam: parameters
   and both moments) and a small one (the tests' MLP), each saved 5 times by
   `save_checkpoint` (today's synchronous single file), by `OrbaxCheckpoints` synchronously
   and asynchronously; the stall is the time the save call holds the caller (for an
   asynchronous save: fingerprints, the copy to host, orbax's set-up); the write's whole
   time is measured too (until `wait()` returns). Medians. Restores are timed as well.
2. SIGKILL: a Trainer with `checkpoint_format="orbax"` (a 36 MB state, a checkpoint every
   update) is killed 10 times at a random update and a random delay after it (up to 0.4 s,
   about one asynchronous write), then run again to the end; its final parameters,
   optimizer state, key and history must be bit-identical to a run never killed. A kill
   that left orbax's temporary step directory behind landed during an asynchronous save.

3. Soak (`--soak`, minutes; not part of CI): 10,000 updates of a Trainer over a prefetched,
   memory-mapped stream with a checkpoint every 500: the resident memory (RSS) at the start
   of every epoch after the first stays within 5 MiB; no prefetch thread is alive after
   `fit` returns or raises; the last checkpoint loads and is at the last update.

    python benchmarks/checkpoint.py [--kills 10]   # 1 and 2: results/checkpoint.json
    python benchmarks/checkpoint.py --soak [--updates 10000]  # 3: results/soak.json

Exits 1 if a goal (the stall at most 0.2x the synchronous save for the 100 MB state, every
resume bit-identical, the soak's checks) fails.
"""

import argparse
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

ROOT = Path(__file__).parent.parent
UPDATES = 12


def _state(width: int, depth: int):
    import equinox as eqx
    import jax.random as jr
    import optax

    import eqx_lowmem as el

    model = eqx.nn.MLP(width, width, width, depth, key=jr.PRNGKey(0))
    step = el.train.make_step(el.train.mse, optax.adam(1e-3))
    return step.init(model, key=jr.PRNGKey(1))


def _nbytes(tree) -> int:
    import equinox as eqx
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_stall(name: str, state, repeats: int = 5) -> dict:
    import jax

    from eqx_lowmem.train import OrbaxCheckpoints, load_checkpoint, save_checkpoint

    meta = {"updates": 1, "history": {"train_loss": [1.0]}}
    out: dict = {"state_mb": round(_nbytes(state) / 1e6, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = tmp / "checkpoint.ckpt"
        save_checkpoint(path, state, meta)  # warm: compile nothing, fill the page cache
        file_saves = [_timed(lambda: save_checkpoint(path, state, meta)) for _ in range(repeats)]
        file_loads = [_timed(lambda: jax.block_until_ready(load_checkpoint(path, state)))]
        out["file_save_s"] = statistics.median(file_saves)
        out["file_load_s"] = file_loads[0]
        for asynchronous in (False, True):
            kind = "orbax_async" if asynchronous else "orbax_sync"
            stalls, totals = [], []
            with OrbaxCheckpoints(tmp / kind, keep=2, asynchronous=asynchronous) as ck:
                ck.save(0, state, meta)  # warm: the fingerprints' compilation, threads
                ck.wait()
                for i in range(1, repeats + 1):
                    t0 = time.perf_counter()
                    ck.save(i, state, meta)
                    stalls.append(time.perf_counter() - t0)
                    ck.wait()
                    totals.append(time.perf_counter() - t0)
                out[f"{kind}_stall_s"] = statistics.median(stalls)
                out[f"{kind}_write_s"] = statistics.median(totals)
                if asynchronous:
                    out["orbax_load_s"] = _timed(lambda: jax.block_until_ready(ck.restore(state)))
    out["async_stall_vs_file_save"] = out["orbax_async_stall_s"] / out["file_save_s"]
    for k, v in out.items():
        if isinstance(v, float):
            out[k] = round(v, 4)
    print(name, json.dumps(out), flush=True)
    return out


# --------------------------------------------------------------------------- SIGKILL


def make_trainer(directory: str, callback=None):
    import equinox as eqx
    import jax.random as jr
    import optax

    import eqx_lowmem as el

    return el.train.Trainer(
        eqx.nn.MLP(1024, 8, 1024, 3, key=jr.PRNGKey(0)),
        el.train.mse,
        optax.adam(1e-3),
        accumulate=2,
        checkpoint_dir=directory,
        checkpoint_format="orbax",
        checkpoint_every=1,
        keep_checkpoints=2,
        progress=False,
        callback=callback,
    )


def fit(trainer):
    import jax.random as jr
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 1024)).astype(np.float32)
    y = rng.standard_normal((48, 8)).astype(np.float32)
    return trainer.fit(x, y, updates=UPDATES, micro_batch=4, key=jr.PRNGKey(1))


def worker(spec: dict) -> None:
    """Train in `spec["dir"]`; kill this process `spec["delay"]` s after update
    `spec["update"]` (when given); at the end write the final arrays and history."""
    import threading

    import equinox as eqx
    import jax
    import numpy as np

    def kill_later(trainer, info):
        if info["updates"] == spec.get("update"):
            delay = spec["delay"]
            threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()

    trainer = make_trainer(spec["dir"], kill_later)
    history = fit(trainer)
    state = jax.tree.map(
        lambda x: (
            jax.random.key_data(x) if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ),
        eqx.filter(trainer.state, eqx.is_array),
    )
    np.savez(spec["out"], *[np.asarray(x) for x in jax.tree.leaves(state)])
    Path(spec["out"] + ".json").write_text(json.dumps(history))
    print(_common.MARKER + json.dumps({"finished": True}), flush=True)


def _run(spec: dict, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def _load(out: str):
    import numpy as np

    with np.load(out + ".npz") as f:
        arrays = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    return arrays, json.loads(Path(out + ".json").read_text())


def sigkill(kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp / "cache"))
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        full = _run({"dir": str(tmp / "full"), "out": str(tmp / "full")}, env)
        assert full.returncode == 0, full.stderr[-3000:]
        expected_arrays, expected_history = _load(str(tmp / "full"))
        for i in range(kills):
            spec = {
                "dir": str(tmp / f"run{i}"),
                "out": str(tmp / f"out{i}"),
                "update": rng.randint(1, UPDATES - 1),
                "delay": round(rng.uniform(0.0, 0.4), 3),
            }
            killed = _run(spec, env)
            directory = Path(spec["dir"])
            names = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
            in_flight = any("orbax-checkpoint-tmp" in n for n in names)
            steps = [n for n in names if n.startswith("checkpoint_") and "tmp" not in n]
            resumed = _run({"dir": spec["dir"], "out": spec["out"]}, env)
            ok = resumed.returncode == 0
            same = False
            if ok:
                arrays, history = _load(spec["out"])
                same = history == expected_history and all(
                    a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
                    for a, b in zip(arrays, expected_arrays, strict=True)
                )
            results.append(
                {
                    **{k: spec[k] for k in ("update", "delay")},
                    "killed": killed.returncode == -signal.SIGKILL,
                    "during_async_save": in_flight,
                    "checkpoints_left": steps,
                    "resumed_bit_identical": same,
                }
            )
            print("kill", json.dumps(results[-1]), flush=True)
    return {
        "kills": kills,
        "killed": sum(r["killed"] for r in results),
        "during_async_save": sum(r["during_async_save"] for r in results),
        "bit_identical_resumes": sum(r["resumed_bit_identical"] for r in results),
        "runs": results,
    }


# ------------------------------------------------------------------------------ soak

_PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLES, FEATURES, MICRO_BATCH = 2000, 16, 20  # 100 updates an epoch
LIMIT_MIB = 5.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def prefetch_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name == "eqx_lowmem.data.prefetch" and t.is_alive()
    ]


def make_data(directory: Path) -> tuple[Path, Path]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    w = rng.standard_normal((FEATURES, 1)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.1 * rng.standard_normal((SAMPLES, 1))).astype(np.float32)
    paths = directory / "x.npy", directory / "y.npy"
    for path, array in zip(paths, (x, y), strict=True):
        np.save(path, array)
    return paths


def soak_trainer(checkpoint_dir: Path, callback=None):
    import equinox as eqx
    import jax.random as jr
    import optax

    import eqx_lowmem as el

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


def make_stream(paths):
    import eqx_lowmem as el

    return el.data.DataStream(tuple(str(p) for p in paths), MICRO_BATCH, 256, key=0)


def soak(updates: int) -> dict:
    """The soak run (3.): its figures and checks."""
    import equinox as eqx
    import jax.random as jr
    import numpy as np

    import eqx_lowmem as el

    per_epoch = SAMPLES // MICRO_BATCH
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = make_data(tmp)
        epoch_rss: dict[int, int] = {}

        def record(trainer, info):
            epoch_rss.setdefault(info["epoch"], rss_bytes())

        trainer = soak_trainer(tmp / "run", record)
        start = time.perf_counter()
        history = trainer.fit(stream=make_stream(paths), updates=updates, key=jr.PRNGKey(1))
        seconds = time.perf_counter() - start
        threads_after_return = len(prefetch_threads())
        losses = history["train_loss"]

        # The last checkpoint: checksums verified, at the last update.
        like = soak_trainer(tmp / "other").step_fn.init(
            eqx.nn.MLP(FEATURES, 1, 32, 2, key=jr.PRNGKey(0)), key=jr.PRNGKey(0)
        )
        state, meta = el.train.load_checkpoint(trainer.checkpoint_path, like)
        checkpoint_step = int(state.step)

        # A run that raises midway (the callback fails at update 150).
        def fail(trainer, info):
            if info["updates"] >= 150:
                raise RuntimeError("planted failure")

        raised = soak_trainer(tmp / "raises", fail)
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
        "checkpoint_at_last_update": checkpoint_step == updates,
        "loss_finite_and_fell": bool(np.isfinite(losses).all()) and losses[-1] < losses[0],
    }
    payload = {
        "what": "soak: updates over a prefetched memmap DataStream with checkpoints every 500",
        "updates": updates,
        "updates_per_epoch": per_epoch,
        "epochs": len(losses),
        "seconds": round(seconds, 2),
        "updates_per_second": round(updates / seconds, 1),
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
    return payload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--soak", action="store_true", help="3.: the soak run, minutes")
    parser.add_argument("--updates", type=int, default=10_000, help="the soak's updates")
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    if args.soak:
        payload = soak(args.updates)
        print(f"wrote {_common.write_json('soak', payload)}: {payload['checks']}")
        return 0 if all(payload["checks"].values()) else 1
    load_before = os.getloadavg()
    stall = {
        "100mb": measure_stall("100mb", _state(1024, 7)),
        "small": measure_stall("small", _state(16, 2)),
    }
    kills = sigkill(args.kills, args.seed)
    goal = stall["100mb"]["async_stall_vs_file_save"] <= 0.2
    resumes = kills["bit_identical_resumes"] == kills["kills"] == kills["killed"]
    payload = {
        "what": "checkpoint save stall (single file vs orbax sync/async) and SIGKILL resumes",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "stall": stall,
        "sigkill": kills,
        "goals": {
            "async_stall_at_most_0.2x_file_save_100mb": goal,
            "all_resumes_bit_identical": resumes,
        },
    }
    out = _common.write_json("checkpoint", payload)
    print(f"wrote {out}")
    return 0 if goal and resumes else 1


if __name__ == "__main__":
    raise SystemExit(main())
