"""Accuracy against memory: which of eqx_lowmem's techniques to turn on for a memory budget.

One small WideResNet family on Fashion-MNIST (the Debian package `dataset-fashion-mnist`),
trained as `paper_quality.py` trains it (its data, step, training loop and workers: this
script imports them), over a grid of configurations: the FP32 baseline, each technique
alone (16-bit storage and compute, block checkpointing, the finer "minimal" recomputation,
micro-batches, DSR sparsity at 50% / 30% / 10% density), the paper's combination and its
variants with micro-batches of 2 and 1 images, and dense models, smaller in depth or width,
with the dense techniques. For each configuration: the compiled peak of its training step
(`memory_analysis()` of the very program it trains with, argument + output + temp - alias,
XLA's default flags, at the run's batch), test accuracy over two seeds (mean and spread),
and the median seconds per update. Each configuration trains both seeds in one worker
process pinned to one core (`paper_quality.run_workers`), so it compiles once.

Writes `results/frontier.json` and `frontier.png` (accuracy against compiled peak, the
Pareto front drawn) and prints the budget table the README shows: per memory budget, the
most accurate configuration that fits.

    python benchmarks/frontier.py             # the full grid (about 45 minutes, 2 cores)
    python benchmarks/frontier.py --quick     # a smoke test (the test suite runs it)
    python benchmarks/frontier.py --configs fp32 combined --train 60000 --name frontier_long
    python benchmarks/frontier.py --configs combined_micro1_bn_eval combined_micro1_gn \
        combined_dense_micro1_gnws combined_micro2_bn_eval combined_gn --name frontier_norm
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paper_quality as pq  # noqa: E402
from _common import RESULTS, compiled_memory, environment, pinned_worker, write_json  # noqa: E402

_START = time.perf_counter()
MB = 1e6

# The family's largest model, WRN-10-2 (one block per group at 32, 64 and 128 channels;
# 303,418 weights), and the run. Sized from CPU seconds per update measured on one core of
# the 2-core machine (2026-12-03, `time.process_time`, as the machine was shared): FP32
# 0.54, FP16 0.54, checkpoint-residual-1 0.54, minimal 0.69, micro-batches of 10 0.44, 50%
# DSR 0.65, the combination 0.41 (0.52 with micro-batches of 2, 0.80 with micro-batches of
# one image), the combination without sparsity 0.69; WRN-10-1 about half. The 15 rows
# sum to about 8.6 s per update and seed, so 2 seeds x 240 updates take about 4,100 core
# seconds, plus about 25 s to compile each row: 40 minutes on two cores. The whole
# training set (600 updates) would take 1.8 hours.
FRONTIER = {
    "depth": 10,
    "width": 2,
    "train": 24_000,
    "test": 10_000,
    "epochs": 1,
    "seeds": [0, 1],
    "batch": 100,
    "lr": pq.QUALITY["lr"],
}
QUICK = {**FRONTIER, "train": 40, "test": 100, "batch": 20}

_FP32 = {"precision": "float32", "remat": False, "accumulate": 1, "density": None}
_HALF = {"precision": "half_fp16", "accumulate_dtype": "float16"}  # micro-batched 16 bits
_COMBINED = {**_FP32, **_HALF, "remat": "checkpoint-residual-1", "accumulate": 10, "density": 0.3}
_DENSE = {**_COMBINED, "density": None}
_SMALL = {"depth": 10, "width": 1}  # WRN-10-1: a quarter of the blocks' weights
# name: settings (`paper_quality.make_config_step`'s, with `depth` and `width` where the
# model is not the family's largest). The slowest first (by the seconds above), so that
# two workers finish together.
CONFIGS = {
    "combined_micro1": {**_COMBINED, "accumulate": 100},
    "minimal": {**_FP32, "remat": "minimal"},
    "combined_dense": _DENSE,
    "dsr10": {**_FP32, "density": 0.1},
    "dsr50": {**_FP32, "density": 0.5},
    "dsr30": {**_FP32, "density": 0.3},
    "fp32": _FP32,
    "fp16": {**_FP32, "precision": "half_fp16"},
    "checkpoint1": {**_FP32, "remat": "checkpoint-residual-1"},
    "combined_micro2": {**_COMBINED, "accumulate": 50},
    "micro10": {**_FP32, "accumulate": 10},
    "combined": _COMBINED,
    # Dense and smaller, at the combinations' compiled peaks.
    "small_combined_dense_micro1": {**_DENSE, **_SMALL, "accumulate": 100},
    "small_fp32": {**_FP32, **_SMALL},
    "small_combined_dense": {**_DENSE, **_SMALL},
}
# Normalisation at micro-batches of 10, 2 and 1 images (issue 36), not in the default grid
# (`--configs`): BatchNorm evaluated as it trained (each micro-batch of test images by its
# own statistics, `el.nn.apply_with_batch_statistics`), GroupNorm (8 groups) in
# BatchNorm's place, and GroupNorm with Weight Standardization on the dense combination
# (standardisation applies to dense convolutions only).
NORM_CONFIGS = {
    "combined_micro1_bn_eval": {**_COMBINED, "accumulate": 100, "eval_stats": "micro_batch"},
    "combined_micro1_gn": {**_COMBINED, "accumulate": 100, "norm": "group"},
    "combined_dense_micro1_gnws": {**_DENSE, "accumulate": 100, "norm": "group_ws"},
    "combined_micro2_bn_eval": {**_COMBINED, "accumulate": 50, "eval_stats": "micro_batch"},
    "combined_gn": {**_COMBINED, "norm": "group"},
}
ALL_CONFIGS = {**CONFIGS, **NORM_CONFIGS}
# The grid `--quick` trains (dense and sparse, micro-batched, smaller): three rows, so
# that its two workers finish within a minute (the combination compiles for about 26 s).
QUICK_CONFIGS = ["combined", "fp32", "small_combined_dense"]
# The goal's question: at a combination's compiled peak, does a dense row do better?
COMBINATIONS = ["combined", "combined_micro2", "combined_micro1"]
NOTES = [
    "checkpoint-residual-3 is not a row: on a depth-10 WideResNet (one block per group) "
    "checkpoint-residual-k is the same program for every k, each block recomputed on its own "
    "(the checkpoint1 row).",
]


def model_name(opts: dict, cfg: dict) -> str:
    return f"WRN-{opts.get('depth', cfg['depth'])}-{opts.get('width', cfg['width'])}"


def uses(opts: dict, cfg: dict) -> str:
    """A configuration's settings in words."""
    parts = [model_name(opts, cfg)]
    parts.append({"float32": "FP32", "half_fp16": "FP16"}[opts["precision"]])
    if opts["remat"]:
        parts.append(str(opts["remat"]))
    if opts["accumulate"] > 1:
        parts.append(f"micro-batches of {cfg['batch'] // opts['accumulate']}")
    if opts["density"] is not None:
        parts.append(f"{opts['density']:.0%} DSR")
    norm = {"group": "GroupNorm", "group_ws": "GroupNorm + WS"}.get(opts.get("norm", "batch"))
    if norm:
        parts.append(norm)
    if opts.get("eval_stats") == "micro_batch":
        parts.append("BatchNorm evaluated per micro-batch")
    return " + ".join(parts)


def train_config(spec: dict) -> dict:
    """One worker's job: the compiled peak of one configuration's step at the run's batch,
    then each seed trained with that step."""
    import jax
    import jax.numpy as jnp

    name, opts, cfg = spec["name"], spec["opts"], spec["cfg"]
    if spec.get("cache"):
        # The step compiled for memory_analysis() is the one the first call runs: read it
        # back from a persistent cache instead of compiling it twice.
        jax.config.update("jax_compilation_cache_dir", spec["cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    data = pq.load_data(cfg)
    step = pq.make_config_step(name, cfg, opts=opts)
    state = pq.init_state(name, cfg["seeds"][0], cfg, step, opts)
    (x, y), _ = data
    batch = (jnp.asarray(x[: cfg["batch"]]), jnp.asarray(y[: cfg["batch"]]))
    t0 = time.perf_counter()
    memory = compiled_memory(step.lower(state, batch).compile())
    compile_s = time.perf_counter() - t0
    del state
    runs = {str(s): pq.train_one(name, s, cfg, data, step, opts=opts) for s in cfg["seeds"]}
    return {"memory": memory, "compile_s": compile_s, "runs": runs}


def _parameters(opts: dict, cfg: dict) -> int:
    """Trainable weights of the configuration's dense model (before sparsity)."""
    import equinox as eqx
    import jax
    import jax.random as jr

    import eqx_lowmem as el

    depth, width = opts.get("depth", cfg["depth"]), opts.get("width", cfg["width"])
    # Shapes only: building the weights op by op took 2.4 s a model.
    model, _ = eqx.filter_eval_shape(
        eqx.nn.make_with_state(el.nn.WideResNet), depth, width, 10, key=jr.PRNGKey(0),
        in_channels=1,
    )  # fmt: skip
    arrays = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    return sum(x.size for x in arrays if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))


def row(name: str, opts: dict, cfg: dict, out: dict) -> dict:
    """One configuration's row of the JSON: the issue's five fields first."""
    runs = out["runs"]
    final = [r["test_accuracy"][-1] for r in runs.values()]
    steps = [r["step_s"] for r in runs.values() if r["step_s"] is not None]
    updates = pq.total_steps(cfg)
    return {
        "config": name,
        "compiled_peak_bytes": out["memory"]["peak"],
        "test_accuracy": statistics.mean(final),
        "test_accuracy_spread": max(final) - min(final),
        "step_s": statistics.median(steps) if steps else None,
        "uses": uses(opts, cfg),
        "opts": opts,
        "dense": opts["density"] is None,
        "parameters": _parameters(opts, cfg),
        "memory": out["memory"],
        "compile_s": out["compile_s"],
        "trained": {
            "updates": updates,
            "images": updates * cfg["batch"],
            "epochs": cfg["epochs"],
            "train_images": cfg["train"],
            "batch": cfg["batch"],
            "seconds": {seed: r["seconds"] for seed, r in runs.items()},
        },
        "runs": runs,
    }


def pareto_front(rows: list[dict]) -> list[str]:
    """The configurations no other beats: every row with less or equal compiled peak is
    less accurate. In order of compiled peak."""
    front, best = [], float("-inf")
    for r in sorted(rows, key=lambda r: (r["compiled_peak_bytes"], -r["test_accuracy"])):
        if r["test_accuracy"] > best:
            front.append(r["config"])
            best = r["test_accuracy"]
    return front


def budget_table(result: dict) -> list[str]:
    """Markdown lines: per memory budget (a compiled peak up to the next row's), the most
    accurate configuration that fits, from the Pareto front."""
    rows = {r["config"]: r for r in result["rows"]}
    front = [rows[name] for name in result["pareto_front"]]
    lines = [
        "| budget (compiled peak) | use | test accuracy | spread (2 seeds) | s / update |",
        "|---|---|---:|---:|---:|",
    ]
    for i, r in enumerate(front):
        low = r["compiled_peak_bytes"] / MB
        budget = (
            f"{low:.1f} MB or more"
            if i + 1 == len(front)
            else f"{low:.1f} - {front[i + 1]['compiled_peak_bytes'] / MB:.1f} MB"
        )
        step = "" if r["step_s"] is None else f"{r['step_s']:.2f}"
        lines.append(
            f"| {budget} | `{r['config']}`: {r['uses']} | {100 * r['test_accuracy']:.2f}% "
            f"| {100 * r['test_accuracy_spread']:.2f} | {step} |"
        )
    return lines


def goal(rows: list[dict], combination: str) -> dict:
    """Whether a dense configuration that fits in `combination`'s compiled peak is more
    accurate than it by more than the seeds' spread (the larger of the two rows')."""
    by = {r["config"]: r for r in rows}
    c = by[combination]
    fits = [r for r in rows if r["dense"] and r["compiled_peak_bytes"] <= c["compiled_peak_bytes"]]
    better = [
        r["config"]
        for r in fits
        if r["test_accuracy"] - c["test_accuracy"]
        > max(r["test_accuracy_spread"], c["test_accuracy_spread"])
    ]
    return {
        "combination": combination,
        "compiled_peak_bytes": c["compiled_peak_bytes"],
        "test_accuracy": c["test_accuracy"],
        "dense_that_fit": {r["config"]: r["test_accuracy"] for r in fits},
        "dense_better_by_more_than_spread": better,
        "met": not better,
    }


def run_frontier(cfg: dict, names: list[str], workers: int | None = None) -> dict:
    """Every configuration of `names` on `cfg`, one worker per configuration (both seeds),
    at most one per core."""
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    workers = pq.default_workers(len(names)) if workers is None else min(workers, len(names))
    with tempfile.TemporaryDirectory(prefix="frontier_cache_") as cache:
        specs = [
            {"name": n, "opts": ALL_CONFIGS[n], "cfg": cfg, "label": n, "cache": cache}
            for n in names
        ]
        outs = pq.run_workers(specs, workers, script=__file__, run_here=_in_process)
    rows = [row(n, ALL_CONFIGS[n], cfg, out) for n, out in zip(names, outs, strict=True)]
    result = {
        "config": cfg,
        "workers": workers,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # the compiled peaks: XLA's defaults
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "timing_note": "the machine's 2 cores were shared with other work: step times are "
        "noisy (compare them within one run only); compiled peaks and accuracies are not "
        "affected",
        "notes": NOTES,
        "rows": rows,
        "run_seconds": time.perf_counter() - t0,
    }
    result["pareto_front"] = pareto_front(rows)
    result["goal"] = [goal(rows, c) for c in COMBINATIONS if c in names]
    result["budget_table"] = budget_table(result)
    return result


def _in_process(spec: dict) -> dict:
    return train_config({**spec, "cache": None})  # this process's JAX settings untouched


def plot_frontier(result: dict, path: Path) -> None:
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    front = [r for name in result["pareto_front"] for r in rows if r["config"] == name]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels: dict[tuple[float, float], list[str]] = {}  # rows at one point share a label
    for r in rows:
        peak, acc = r["compiled_peak_bytes"] / MB, 100 * r["test_accuracy"]
        seeds = [100 * run["test_accuracy"][-1] for run in r["runs"].values()]
        color = "C0" if r["dense"] else "C3"
        ax.errorbar(
            peak, acc, yerr=[[acc - min(seeds)], [max(seeds) - acc]], fmt="o", color=color,
            capsize=2,
        )  # fmt: skip
        labels.setdefault((round(peak, 2), round(acc, 3)), []).append(r["config"])
    ax.set_xscale("log")
    ax.autoscale_view()
    _place_labels(ax, labels)
    ax.step(
        [r["compiled_peak_bytes"] / MB for r in front],
        [100 * r["test_accuracy"] for r in front],
        where="post", color="k", linewidth=1, label="Pareto front",
    )  # fmt: skip
    ax.plot([], [], "o", color="C0", label="dense")
    ax.plot([], [], "o", color="C3", label="sparse (DSR)")
    cfg = result["config"]
    ax.set_xlabel(f"compiled peak of the training step, MB (batch {cfg['batch']}, XLA:CPU)")
    ax.set_ylabel(f"test accuracy, % ({cfg['test']:,} images; bars: 2 seeds)")
    ax.set_title(
        f"Fashion-MNIST, {pq.total_steps(cfg):,} updates of {cfg['batch']}: accuracy against memory"
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _place_labels(ax, labels: dict[tuple[float, float], list[str]]) -> None:
    """Each point's label beside it, moved down in steps until it overlaps no label placed
    before it (points taken from the right, where the grid's rows crowd)."""
    placed: list[tuple[float, float, float, float]] = []  # label boxes, display pixels
    for (x, y), names in sorted(labels.items(), key=lambda kv: (-kv[0][0], -kv[0][1])):
        text = " = ".join(names)
        px, py = ax.transData.transform((x, y))
        width, height = 4.4 * len(text), 9.0
        dy = 3.0
        while any(
            px + 4 < bx + bw and bx < px + 4 + width and py + dy < by + bh and by < py + dy + height
            for bx, by, bw, bh in placed
        ):
            dy -= 10.0
        placed.append((px + 4, py + dy, width, height))
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, dy), fontsize=7,
                    arrowprops=None if dy == 3.0 else {"arrowstyle": "-", "lw": 0.4})  # fmt: skip


def gpu_peaks(name: str, target: str, directory: Path) -> dict:
    """Every row of `<name>.json` compiled again for a compile-only GPU `target` (nothing
    trained): its step on the GPU's devices at the run's batch, `memory_analysis()`'s peak
    as `<target>_peak_bytes` beside the XLA:CPU one (sparse rows without DSR's rewiring
    hook, whose host callback compiles only where it runs), the JSON rewritten in place."""
    import equinox as eqx
    import jax

    import eqx_lowmem as el
    from eqx_lowmem._io import write_json as atomic_write_json

    path = directory / f"{name}.json"
    result = json.loads(path.read_text())
    cfg = result["config"]
    gpu = el.memory.Target(target)
    mesh = gpu.mesh((1,), ("data",))
    (x, y), _ = pq.load_data(cfg)
    batch = tuple(jax.ShapeDtypeStruct((cfg["batch"], *a.shape[1:]), a.dtype) for a in (x, y))
    for r in result["rows"]:
        # Without DSR's rewiring hook: its host callback (a placement count) compiles only
        # for a backend this process runs, not for a compile-only target.
        opts = {**r["opts"], "rewire": False}
        step = pq.make_config_step(r["config"], cfg, opts=opts, mesh=mesh)
        state = eqx.filter_eval_shape(
            lambda name, opts, step: pq.init_state(name, cfg["seeds"][0], cfg, step, opts),
            r["config"], opts, step,
        )  # fmt: skip
        r[f"{target}_peak_bytes"] = compiled_memory(step.lower(state, batch).compile())["peak"]
        print(r["config"], r["compiled_peak_bytes"], r[f"{target}_peak_bytes"], flush=True)
    result["gpu_target"] = {**environment(), "name": target, "target_device": gpu.description}
    atomic_write_json(path, result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 3 configurations")
    p.add_argument("--out", default=str(RESULTS), help="directory for the JSON and plot")
    p.add_argument("--name", default="frontier", help="file name of the JSON and plot")
    for field in ("train", "test", "epochs", "batch"):
        p.add_argument(f"--{field}", type=int, help=f"override the run's {field}")
    p.add_argument("--configs", nargs="+", choices=list(ALL_CONFIGS), help="a part of the grid")
    p.add_argument("--workers", type=int, help="processes (default one per core)")
    p.add_argument(
        "--gpu-peaks",
        metavar="TARGET",
        help="compile every row of --name's JSON for this compile-only GPU (e.g. h100) and "
        "add its peak to the JSON; trains nothing",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run_workers's child
    args = p.parse_args(argv)
    if args.gpu_peaks:
        gpu_peaks(args.name, args.gpu_peaks, Path(args.out))
        return 0
    if args.worker is not None:
        return pinned_worker(args.worker, train_config)
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    cfg = dict(QUICK if args.quick else FRONTIER)
    for field in ("train", "test", "epochs", "batch"):
        value = getattr(args, field)
        if value is not None:
            if value < 1:
                p.error(f"--{field} must be at least 1, got {value}")
            cfg[field] = value
    names = args.configs or (QUICK_CONFIGS if args.quick else list(CONFIGS))
    result = run_frontier(cfg, names, args.workers)
    result["wall_seconds"] = time.perf_counter() - _START
    out = Path(args.out)
    name = args.name + ("_quick" if args.quick else "")
    print("\n".join(result["budget_table"]))
    print(json.dumps(result["goal"], indent=1))
    print(f"whole run: {result['wall_seconds']:.0f} s")
    write_json(name, result, out)
    plot_frontier(result, out / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
