"""Checkpoints: the training thread's stall per save, single file against orbax, and
SIGKILL at random moments of an orbax run (during asynchronous saves too).

1. Stall: a TrainState of about 100 MB (an MLP of 8 layers 1024x1024 with Adam: parameters
   and both moments) and a small one (the tests' MLP), each saved 5 times by
   `save_checkpoint` (the synchronous single file), by `OrbaxCheckpoints` synchronously and
   asynchronously; the stall is the time the save call holds the caller (for an
   asynchronous save: fingerprints, the copy to host, orbax's set-up); the write's whole
   time is measured too (until `wait()` returns). Medians. Restores are timed as well.
2. SIGKILL: a Trainer with `checkpoint_format="orbax"` (a 36 MB state, a checkpoint every
   update) is killed 10 times at a random update and a random delay after it (up to 0.4 s,
   about one asynchronous write), then run again to the end; its final parameters,
   optimizer state, key and history must be bit-identical to a run never killed. A kill
   that left orbax's temporary step directory behind landed during an asynchronous save.

    python benchmarks/checkpoint.py [--kills 10]   # results/checkpoint.json

Exits 1 if a goal (the stall at most 0.2x the synchronous save for the 100 MB state, every
resume bit-identical) fails.
"""

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import MARKER, spawn, write_json  # noqa: E402

UPDATES = 12  # the SIGKILL run's


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_stall(width: int, depth: int, repeats: int = 5) -> dict:
    """Medians of `repeats` saves of an Adam TrainState of an MLP `width` wide."""
    import equinox as eqx
    import jax
    import jax.random as jr
    import optax

    import eqx_lowmem as el
    from eqx_lowmem.train import OrbaxCheckpoints, load_checkpoint, save_checkpoint

    model = eqx.nn.MLP(width, width, width, depth, key=jr.PRNGKey(0))
    state = el.train.make_step(el.train.mse, optax.adam(1e-3)).init(model, key=jr.PRNGKey(1))
    meta = {"updates": 1, "history": {"train_loss": [1.0]}}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    out: dict = {"state_mb": round(nbytes / 1e6, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.ckpt"
        save_checkpoint(path, state, meta)  # warm: compile nothing, fill the page cache
        saves = [_timed(lambda: save_checkpoint(path, state, meta)) for _ in range(repeats)]
        out["file_save_s"] = statistics.median(saves)
        out["file_load_s"] = _timed(lambda: jax.block_until_ready(load_checkpoint(path, state)))
        for kind in ("orbax_sync", "orbax_async"):
            stalls, totals = [], []
            asynchronous = kind == "orbax_async"
            with OrbaxCheckpoints(Path(tmp) / kind, keep=2, asynchronous=asynchronous) as ck:
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
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
    print(f"MLP {width}x{depth}", json.dumps(out), flush=True)
    return out


# --------------------------------------------------------------------------- SIGKILL


def worker(spec: dict) -> None:
    """Train (MSE, Adam, orbax checkpoints) in `spec["dir"]`; kill this process
    `spec["delay"]` s after update `spec["update"]` (when given); at the end write the final
    arrays and history."""
    import equinox as eqx
    import jax
    import jax.random as jr
    import numpy as np
    import optax

    import eqx_lowmem as el

    def kill_later(trainer, info):
        if info["updates"] == spec.get("update"):
            kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
            threading.Timer(spec["delay"], kill).start()

    t = el.train.Trainer(eqx.nn.MLP(1024, 8, 1024, 3, key=jr.PRNGKey(0)), el.train.mse,
                         optax.adam(1e-3), checkpoint_dir=spec["dir"], progress=False,
                         callback=kill_later, accumulate=2, checkpoint_format="orbax",
                         checkpoint_every=1, keep_checkpoints=2)  # fmt: skip
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((48, n)).astype(np.float32) for n in (1024, 8))
    history = t.fit(x, y, updates=UPDATES, micro_batch=4, key=jr.PRNGKey(1))
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    leaves = jax.tree.leaves(eqx.filter(t.state, eqx.is_array))
    leaves = [jax.random.key_data(x) if is_key(x) else x for x in leaves]
    np.savez(spec["out"], *[np.asarray(x) for x in leaves])
    Path(spec["out"] + ".json").write_text(json.dumps(history))
    print(MARKER + json.dumps({"finished": True}), flush=True)


def sigkill(kills: int, seed: int) -> dict:
    import numpy as np

    rng, results = random.Random(seed), []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"JAX_COMPILATION_CACHE_DIR": str(Path(tmp) / "cache"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip

        def run(spec: dict) -> tuple[int | None, list, list]:
            proc = spawn(__file__, spec, timeout=600, env=env)[1]
            if proc is None or proc.returncode:
                return proc and proc.returncode, [], []
            with np.load(spec["out"] + ".npz") as f:
                arrays = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
            return 0, arrays, json.loads(Path(spec["out"] + ".json").read_text())

        code, expected, expected_history = run({"dir": f"{tmp}/full", "out": f"{tmp}/full"})
        assert code == 0, f"the run never killed failed with exit code {code}"
        for i in range(kills):
            update, delay = rng.randint(1, UPDATES - 1), round(rng.uniform(0, 0.4), 3)
            spec = {
                "dir": f"{tmp}/run{i}",
                "out": f"{tmp}/out{i}",
                "update": update,
                "delay": delay,
            }
            killed = run(spec)[0]
            left = sorted(p.name for p in Path(spec["dir"]).glob("*"))
            code, arrays, history = run({"dir": spec["dir"], "out": spec["out"]})
            same = code == 0 and history == expected_history and all(
                a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
                for a, b in zip(arrays, expected, strict=True))  # fmt: skip
            results.append({"update": spec["update"], "delay": spec["delay"],
                            "killed": killed == -signal.SIGKILL,
                            "during_async_save": any("orbax-checkpoint-tmp" in n for n in left),
                            "checkpoints_left": [n for n in left if n.startswith("checkpoint_")
                                                 and "tmp" not in n],
                            "resumed_bit_identical": same})  # fmt: skip
            print("kill", json.dumps(results[-1]), flush=True)
    count = lambda key: sum(r[key] for r in results)  # noqa: E731
    return {"kills": kills, "killed": count("killed"), "during_async_save":
            count("during_async_save"), "bit_identical_resumes": count("resumed_bit_identical"),
            "runs": results}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    load_before = os.getloadavg()
    stall = {"100mb": measure_stall(1024, 7), "small": measure_stall(16, 2)}
    kills = sigkill(args.kills, args.seed)
    goal = stall["100mb"]["async_stall_vs_file_save"] <= 0.2
    resumes = kills["bit_identical_resumes"] == kills["kills"] == kills["killed"]
    payload = {
        "what": "checkpoint save stall (single file vs orbax sync/async) and SIGKILL resumes",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "stall": stall, "sigkill": kills,
        "goals": {"async_stall_at_most_0.2x_file_save_100mb": goal,
                  "all_resumes_bit_identical": resumes},
    }  # fmt: skip
    print(f"wrote {write_json('checkpoint', payload, args.out)}")
    return 0 if goal and resumes else 1


if __name__ == "__main__":
    raise SystemExit(main())
