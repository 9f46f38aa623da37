"""The speed grid: every timed goal, side by side, on a CPU or a GPU (`--device gpu`).

Each configuration builds a training step, checks its first applied update (finite loss and
gradient norm, compared across the configurations that compute the same function), compiles
outside the timer, burns in and times updates synchronised with `jax.block_until_ready`.

- `--device gpu` (a run of at most 8 minutes): the guide's sizes, each configuration in a
  process of its own with `XLA_PYTHON_CLIENT_PREALLOCATE=false`, so that
  `device.memory_stats()["peak_bytes_in_use"]` is its peak; the memory report's prediction
  beside it (goal: within 5%). The `SIDE_BY_SIDE` kinds run as on a CPU instead. Writes
  `results/gpu.json`.
- `--device cpu`: reduced sizes; each group's configurations in one process, timed in
  rounds that alternate their order (ABBA), a ratio the median of per-round ratios: the
  drift of a shared machine cancels. Writes `results/speed.json`.
- `--smoke`: every configuration at tiny sizes in one process (a check of the script).

Groups: `CONFIGS`, each timed against its `BASELINES` row, the goals in `GOALS`. The steps are
`_steps.py`'s, one builder per kind; `memory.py` compiles the same steps (its `guide/*` rows
are the ones of the same names here).

    python benchmarks/speed.py --device gpu          # on a GPU: results/gpu.json
    python benchmarks/speed.py --device gpu --only guide/ accumulate/
    python benchmarks/speed.py                       # CPU: results/speed.json
    python benchmarks/speed.py --smoke --out /tmp/s.json
"""

import os

# Before anything imports jax, here and in the workers: the peak counter then sees the step.
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout, if not installed
import _steps  # noqa: E402
import jax  # noqa: E402
from _common import (  # noqa: E402
    ACCUMULATE,
    GUIDE,
    RESULTS,
    interleaved,
    median_ratio,
    run_workers,
    worker_main,
    write_json,
)
from _steps import (  # noqa: E402
    CHAR_LM_GUIDE,
    CHAR_LM_SMALL,
    OPTIMIZERS,
    SPARSE,
    SPARSE_MLP,
    STEP_CASES,
)

TINY = {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_ff": 32, "seq": 8, "batch": 4}
SIZES = {
    "gpu": {"transformer": GUIDE, "accumulate": GUIDE, "mlp": SPARSE_MLP, "step_scale": 8,
            "char_lm": CHAR_LM_GUIDE,
            "timing": {"burn_in": 3, "repeats": 10, "repeats_short": 61}},
}  # fmt: skip
# Each mode as the one before, but for what it names.
# A CPU update of the guide's size takes seconds: 4 blocks of width 128 (about 0.07 s).
SIZES["cpu"] = {**SIZES["gpu"], "accumulate": ACCUMULATE,
                "transformer": {"n_layers": 4, "d_model": 128, "n_heads": 4, "d_ff": 512,
                                "seq": 128, "batch": 8},
                "step_scale": 1, "char_lm": CHAR_LM_SMALL,
                "timing": {"burn_in": 1, "repeats": 9, "repeats_short": 31}}  # fmt: skip
SIZES["smoke"] = {**SIZES["cpu"], "transformer": TINY, "accumulate": TINY,
                  "mlp": {**SPARSE_MLP, "width": 32, "batch": 8}, "fit_updates": 2,
                  "char_lm": {**CHAR_LM_SMALL, "layers": 1, "d_model": 16, "d_ff": 32, "seq": 8},
                  "timing": {"burn_in": 1, "repeats": 1}}  # fmt: skip
BUDGET_S = 450  # the GPU run; issue 13's bound is 8 minutes
WORKER_TIMEOUT_S = 150
CONFIGS: dict[str, dict] = {  # name: spec; order is priority (the budget drops the last)
    **{f"guide/{p}": {"kind": "transformer", "remat": p, "report": True, "host": "minimal" in p}
       for p in ("none", "full", "dots", "minimal", "minimal_offloaded")},
    "accumulate/k1": {"kind": "transformer", "size": "accumulate"},
    "accumulate/k4": {"kind": "transformer", "size": "accumulate", "accumulate": 4,
                      "report": True},
    "accumulate/multisteps_k4": {"kind": "multisteps", "accumulate": 4},
    **{f"optimizer_state/{v}": {"kind": "optimizer_state", "variant": v} for v in OPTIMIZERS},
    **{f"step_{c}/{way}": {"kind": "step", "case": c, "hand": way == "hand"}
       for c in STEP_CASES for way in ("hand", "library")},
    **{f"sparse/{v}": {"kind": "sparse", "variant": v} for v in SPARSE},
    "fit/hand": {"kind": "fit", "hand": True},
    "fit/trainer": {"kind": "fit", "hand": False},
    "fit/hand_prefetch": {"kind": "fit", "hand": True, "prefetch": True},
    "fit/trainer_unchecked": {"kind": "fit", "hand": False, "check_data": False},
    # The rest of the guide's table (memory.py's `guide/*` rows of the same names).
    "guide/segments": {"kind": "transformer", "segment": "sqrt"},
    "guide/accumulate_4": {"kind": "transformer", "accumulate": 4},
    "guide/full_accumulate_4": {"kind": "transformer", "remat": "full", "accumulate": 4},
    "guide/mixed_bf16": {"kind": "transformer", "precision": "mixed_bf16"},
    "guide/plain_eqx_checkpoint": {"kind": "plain"},
}  # fmt: skip
# Each group's baseline: the rows of a group are compared with it (on a CPU, side by side).
BASELINES = {"guide": "guide/none", "accumulate": "accumulate/k1", "sparse": "sparse/dense",
             "optimizer_state": "optimizer_state/16bit", "fit": "fit/hand",
             **{f"step_{c}": f"step_{c}/hand" for c in STEP_CASES}}  # fmt: skip
NONE, UPS = "guide/none", "updates_per_s"
GOALS = {  # name: (numerator, denominator, quantity, sense, bound)
    "full_remat_peak": ("guide/full", NONE, "peak", "<=", 0.20),
    "full_remat_time": ("guide/full", NONE, "step_s", "<=", 1.30),
    "selective_remat_peak": ("guide/{selective}", NONE, "peak", "<=", 0.60),
    "selective_remat_time": ("guide/{selective}", NONE, "step_s", "<=", 1.10),
    "accumulate_vs_whole_batch": ("accumulate/k4", "accumulate/k1", UPS, ">=", 0.95),
    "accumulate_vs_multisteps": ("accumulate/k4", "accumulate/multisteps_k4", UPS, ">=", 1.20),
    "state_8bit_time": ("optimizer_state/8bit", "optimizer_state/16bit", "step_s", "<=", 1.15),
    "fit_vs_hand_loop": ("fit/trainer", "fit/hand", UPS, ">=", 0.97),
    "fit_vs_prefetching_hand_loop": ("fit/trainer", "fit/hand_prefetch", UPS, ">=", 0.97),
    "check_data_stall": ("fit/trainer", "fit/trainer_unchecked", UPS, ">=", 0.95),
    # Their compiled peaks (<= 1.01x): memory.py's `step/*` rows, tests/test_step_memory.py.
    **{
        f"step_{c}_time": (f"step_{c}/library", f"step_{c}/hand", UPS, ">=", 0.97)
        for c in STEP_CASES
    },
}
# Kinds whose calls take about 0.1 s and whose 3% goals need more rounds than 9: timed in
# `timing["repeats_short"]` rounds; a GPU run times them side by side too, a group in one
# process (a process of its own would add the drift between processes; their memory
# figures come from the compiler, not the process's peak).
SIDE_BY_SIDE = ("step", "fit")
REPORT_TOLERANCE = 0.05
# The first update's loss and gradient norm, relative, between configurations computing the
# same function, all in float32 (a GPU's matmuls may use TF32).
CHECK_RTOL = 2e-3


# ------------------------------------------------------------------------------- worker


def _base(name: str) -> str | None:
    """The baseline of `name`'s group."""
    return BASELINES.get(name.split("/")[0])


def worker(payload: dict) -> dict:
    """Build each named configuration, then time them in rounds that alternate their order
    (ABBA): a result per name. A process of one configuration (the GPU run's) records its
    peak too."""
    sizes = {"name": payload["size"], **SIZES[payload["size"]]}
    timing, built, results = sizes["timing"], {}, {}
    for name in payload["names"]:
        spec, t0 = CONFIGS[name], time.perf_counter()
        try:
            built[name], info = getattr(_steps, spec["kind"])(name, spec, sizes)
        except Exception as e:  # recorded: one broken piece must not hide the rest
            info = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        results[name] = {**info, "wall_s": time.perf_counter() - t0, "pid": os.getpid()}
    for update in built.values():
        for _ in range(timing["burn_in"]):
            update()

    repeats = timing["repeats"]
    if all(CONFIGS[n]["kind"] in SIDE_BY_SIDE for n in built):
        repeats = timing.get("repeats_short", repeats)
    wall = interleaved(built, max(repeats, 2))
    per_call = {n: [t / results[n].get("per_call", 1) for t in wall[n]] for n in wall}
    for name in built:
        results[name] |= {"step_s_all": per_call[name], "step_s": statistics.median(per_call[name])}
        if _base(name) in wall:  # the median of per-round ratios: drift cancels
            results[name]["time_vs_base"] = median_ratio(per_call[name], per_call[_base(name)])
    alone = len(payload["names"]) == 1  # a process of its own (the GPU run's): its peak
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use") if alone else None
    for name, r in results.items():
        if "step_s" in r:
            r["updates_per_s"] = 1.0 / r["step_s"]
        r["peak"] = peak if name in built else None
    return results


# ------------------------------------------------------------------------------- parent


def _ratio(results: dict, num: str, den: str, quantity: str) -> float | None:
    """`num`'s figure over `den`'s; for times taken side by side in one process, the median
    of the rounds' ratios."""
    a, b = results.get(num, {}), results.get(den, {})
    if a.get(quantity) is None or not b.get(quantity):
        return None
    paired = "step_s_all" in a and "step_s_all" in b  # timed in the same rounds
    if quantity != "peak" and a.get("pid") == b.get("pid") and paired:
        ratio = median_ratio(a["step_s_all"], b["step_s_all"])
        return ratio if quantity == "step_s" else 1 / ratio
    return a[quantity] / b[quantity]


def evaluate_goals(results: dict) -> dict:
    """Each goal's ratio and whether it is met (None where a figure is missing: peaks on a
    CPU, a configuration that did not run); and the memory report against the peaks."""
    # The selective preset: the one of least peak among those meeting the time goal, else
    # the fastest.
    vs_none = lambda n, quantity: _ratio(results, f"guide/{n}", NONE, quantity)  # noqa: E731
    time_of = {n: t for n in ("dots", "minimal") if (t := vs_none(n, "step_s")) is not None}
    bound = GOALS["selective_remat_time"][-1]
    fast = [n for n, t in time_of.items() if t <= bound and vs_none(n, "peak")]
    selective = (min(fast, key=lambda n: vs_none(n, "peak")) if fast
                 else min(time_of, key=time_of.get, default=None))  # fmt: skip
    goals = {}
    for name, (num, den, quantity, sense, bound) in GOALS.items():
        num = num.format(selective=selective)
        r = _ratio(results, num, den, quantity)
        met = None if r is None else (r <= bound if sense == "<=" else r >= bound)
        goals[name] = {"ratio": r, "goal": f"{sense} {bound}", "met": met,
                       "of": f"{num} / {den} ({quantity})"}  # fmt: skip
    errors = {n: r["report"]["predicted"] / r["peak"] - 1 for n, r in results.items()
              if r.get("peak") and "predicted" in r.get("report", {})}  # fmt: skip
    compile_only = {n: r["report"]["compile_only_peak_bytes"] / r["peak"] - 1
                    for n, r in results.items()
                    if n in errors and r["report"].get("compile_only_peak_bytes")}  # fmt: skip
    worst = max(errors.values(), key=abs) if errors else None
    goals["report_within_5_percent"] = {
        "ratio": worst, "goal": f"|predicted / measured - 1| <= {REPORT_TOLERANCE}",
        "met": None if worst is None else abs(worst) <= REPORT_TOLERANCE, "of": errors,
        "compile_only_of": compile_only,  # what figures planned without the GPU are worth
    }  # fmt: skip
    return goals


def check_consistency(results: dict) -> dict:
    """The first update's loss and gradient norm agree between configurations computing the
    same function from the same parameters and batch (remat and accumulation change the
    schedule, not the arithmetic)."""
    out = {}
    for group in ("float32", "accumulate", "optimizer_state"):
        # Its rows the library trains in float32 (not plain Equinox's or MultiSteps' hand steps).
        prefix = "guide/" if group == "float32" else f"{group}/"
        names = [n for n, s in CONFIGS.items() if n.startswith(prefix) and "precision" not in s]
        names = [n for n in names if CONFIGS[n]["kind"] not in ("plain", "multisteps")]
        names = [n for n in names if "loss" in results.get(n, {})]
        if len(names) > 1:
            ref = results[names[0]]
            worst = max(abs(results[n][q] / ref[q] - 1) for n in names[1:]
                        for q in ("loss", "grad_norm"))  # fmt: skip
            out[group] = {"names": names, "max_rel_diff": worst, "rtol": CHECK_RTOL,
                          "ok": worst <= CHECK_RTOL}  # fmt: skip
    return out


def _run(names: list[str], size: str, timeout: float) -> dict:
    """One worker process for `names`; where it fails, each records why."""
    try:
        return run_workers(__file__, [{"size": size, "names": names}], timeout=timeout)[0]
    except RuntimeError as e:
        return {n: {"error": str(e)} for n in names}


def run_all(names: list[str], mode: str, budget: float) -> dict:
    """CPU: the configurations sharing a baseline in one process, timed side by side. GPU:
    so for the `SIDE_BY_SIDE` kinds, the others each in a process of its own (its peak);
    all within `budget`. Smoke: one process."""
    if mode == "smoke":
        return _run(names, mode, 900)
    groups: dict[str, list[str]] = {}
    for n in names:
        if mode == "gpu" and CONFIGS[n]["kind"] not in SIDE_BY_SIDE:
            groups[n] = [n]
        else:  # with its baseline, where `names` lack it
            groups.setdefault(_base(n), [_base(n)]).append(n)
    results, start = {}, time.perf_counter()
    for group in map(list, map(dict.fromkeys, groups.values())):
        left = budget - (time.perf_counter() - start) if mode == "gpu" else 3600
        timeout = 3600 if mode == "cpu" else min(left, WORKER_TIMEOUT_S * len(group))
        skipped = {"skipped": f"the time budget of {budget:.0f} s was spent"}
        results |= _run(group, mode, timeout) if left > 10 else dict.fromkeys(group, skipped)
        for n in group:
            print(f"  {n:<36} {json.dumps(results[n])[:150]}", flush=True)
    return {n: results[n] for n in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any backend, quick")
    parser.add_argument("--only", nargs="+", default=None, help="configuration name prefixes")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="GPU: seconds for all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, worker)
    names = [n for n in CONFIGS if not args.only or any(n.startswith(p) for p in args.only)]

    if args.device == "gpu" and jax.default_backend() != "gpu" and not args.smoke:
        parser.error(f"--device gpu: the default backend is {jax.default_backend()!r}, not a "
                     "GPU: run with --smoke (tiny sizes) or --device cpu.")  # fmt: skip
    # One compilation cache for the run's workers: a memory report compiles the program its
    # configuration ran, then served from the cache (compile time only).
    cache = tempfile.TemporaryDirectory(prefix="eqx_lowmem_speed_cache_")
    os.environ |= {"JAX_COMPILATION_CACHE_DIR": cache.name,
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}  # fmt: skip
    t0, mode = time.perf_counter(), "smoke" if args.smoke else args.device
    results = run_all(names, mode, args.budget)
    cache.cleanup()
    default = RESULTS / ("gpu.json" if args.device == "gpu" else "speed.json")
    out = args.out or (Path(tempfile.gettempdir()) / "speed_smoke.json" if args.smoke else default)
    record = {"mode": mode, "sizes": SIZES[mode],
              "environment_variables": {k: os.environ.get(k) for k in
                                        ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")},
              "configs": results, "goals": evaluate_goals(results),
              "checks": check_consistency(results), "wall_s": time.perf_counter() - t0}  # fmt: skip
    path = write_json(out.stem, record, directory=out.parent)
    for name, g in record["goals"].items():
        shown = "n/a" if g["ratio"] is None else f"{g['ratio']:.3f}"
        print(f"  goal {name:<28} {shown:>8}  {g['goal']:<10} met={g['met']}")
    for name, c in record["checks"].items():
        print(f"  check {name}: max rel diff {c.get('max_rel_diff', 0):.2e} ok={c['ok']}")
    print(f"wrote {path} in {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
