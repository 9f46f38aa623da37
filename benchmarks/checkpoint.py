"""Checkpoints: the training thread's stall per save, single file against orbax.

A TrainState of about 100 MB (an MLP of 8 layers 1024x1024 with Adam: parameters
and both moments) and a small one (the tests' MLP), each saved 5 times by `save_checkpoint`
(the synchronous single file), by `OrbaxCheckpoints` synchronously and asynchronously; the
stall is the time the save call holds the caller (for an asynchronous save: fingerprints,
the copy to host, orbax's set-up); the write's whole time is measured too (until `wait()`
returns). Medians.

That a run killed at any moment resumes bit-identically is the tests' to show
(`tests/test_interrupt.py`, `tests/test_orbax.py`: SIGKILL at every phase of an update and
during an asynchronous save). The 10 kills at random moments this script made until commit
8af4565 are in `checkpoint.json` at that commit (`sigkill`: all 10 resumed bit-identically).

    python benchmarks/checkpoint.py     # results/checkpoint.json

Exits 1 if the goal (the stall at most 0.2x the synchronous save for the 100 MB state) fails.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, write_json  # noqa: E402


def measure_stall(width: int, depth: int, repeats: int = 5) -> dict:
    """Medians of `repeats` saves of an Adam TrainState of an MLP `width` wide."""
    import equinox as eqx
    import jax
    import jax.random as jr
    import optax

    import eqx_lowmem as el
    from eqx_lowmem.train import OrbaxCheckpoints, save_checkpoint

    model = eqx.nn.MLP(width, width, width, depth, key=jr.PRNGKey(0))
    state = el.train.make_step(el.train.mse, optax.adam(1e-3)).init(model, key=jr.PRNGKey(1))
    meta = {"updates": 1, "history": {"train_loss": [1.0]}}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    out: dict = {"state_mb": round(nbytes / 1e6, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.ckpt"
        save_checkpoint(path, state, meta)  # warm: compile nothing, fill the page cache
        saves = interleaved({"file": lambda: save_checkpoint(path, state, meta)}, repeats)
        out["file_save_s"] = statistics.median(saves["file"])
        for kind, asynchronous in (("orbax_sync", False), ("orbax_async", True)):
            stalls, totals = [], []
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
    out["async_stall_vs_file_save"] = out["orbax_async_stall_s"] / out["file_save_s"]
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
    print(f"MLP {width}x{depth}", json.dumps(out), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON")
    args = parser.parse_args()
    load_before = os.getloadavg()
    stall = {"100mb": measure_stall(1024, 7), "small": measure_stall(16, 2)}
    goal = stall["100mb"]["async_stall_vs_file_save"] <= 0.2
    payload = {
        "what": "checkpoint save stall (single file vs orbax sync/async)",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "stall": stall, "goals": {"async_stall_at_most_0.2x_file_save_100mb": goal},
    }  # fmt: skip
    print(f"wrote {write_json('checkpoint', payload, args.out)}")
    return 0 if goal else 1


if __name__ == "__main__":
    raise SystemExit(main())
