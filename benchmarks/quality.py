"""Accuracy against memory: Sohoni et al. (2019)'s techniques on Fashion-MNIST, alone and
combined, against smaller dense models.

A WideResNet family (`CONFIGS`) trained side by side, one worker process each pinned to its
own core (XLA:CPU runs one small WRN update only 1.2x faster on two cores than on one).
Every configuration sees the same images in the same order from the same initial weights
per seed. Per configuration: the compiled peak of its training step (`memory_analysis()`),
the test accuracy over the seeds and the seconds per update; the Pareto front and, per
memory budget, the most accurate configuration that fits (`frontier.json` and `.png`; H100
peaks: `memory.py`'s `frontier/*`). The data: the Debian package `dataset-fashion-mnist`.

    python benchmarks/quality.py                   # the frontier (45 min): frontier.json
    python benchmarks/quality.py --configs fp32 combined --train 60000 --name frontier_long
    python benchmarks/quality.py --quick           # a smoke test

The paper's comparison of FP32 against the combination on a WRN-10-1 (`paper_quality.json`,
`paper_quality_6epochs.json`; the frontier's `fp32` and `combined` rows compare them too,
with 16-bit parameters) was this script's default until commit 80a7b30; the learning rate
(`paper_quality_lr.json`), each technique alone (`paper_quality_ablation.json`), DSR's
settings (`paper_quality_sparse.json`) and the 8-bit optimizer state's loss curves were its
`--select-lr`, `--ablation`, `--sparse-variants` and `--optimizer-state` until commit
837811e: check those commits out to run them again.
"""

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    RESULTS,
    compiled_memory,
    cores,
    run_workers,
    worker_main,
    write_json,
)

_START = time.perf_counter()
MB = 1e6
# WRN-10-2 (303,418 weights), 240 updates of 100 per seed (about 40 minutes).
FRONTIER = {"depth": 10, "width": 2, "train": 24_000, "test": 10_000, "epochs": 1,
            "seeds": [0, 1], "batch": 100, "lr": 0.2}  # lr: `paper_quality_lr.json`  # fmt: skip
_FP32 = {"precision": "float32", "remat": False, "accumulate": 1, "density": None}
FRONTIER_QUICK = {**FRONTIER, "train": 40, "test": 100, "batch": 20}
_HALF = {"precision": "half_fp16", "accumulate_dtype": "float16"}  # micro-batched 16 bits
_COMBINED = {**_FP32, **_HALF, "remat": "checkpoint-residual-1", "accumulate": 10, "density": 0.3}
_DENSE, _SMALL = {**_COMBINED, "density": None}, {"depth": 10, "width": 1}
CONFIGS = {  # the slowest first, so that two workers finish together
    "combined_micro1": {**_COMBINED, "accumulate": 100},
    "minimal": {**_FP32, "remat": "minimal"},
    "combined_dense": _DENSE,
    **{f"dsr{d}": {**_FP32, "density": d / 100} for d in (10, 50, 30)},
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
# Normalisation at small micro-batches (issue 36; `--configs`): BatchNorm evaluated as it
# trained (`el.nn.apply_with_batch_statistics`), GroupNorm, GroupNorm with WS.
NORM_CONFIGS = {
    "combined_micro1_bn_eval": {**_COMBINED, "accumulate": 100, "eval_stats": "micro_batch"},
    "combined_micro1_gn": {**_COMBINED, "accumulate": 100, "norm": "group"},
    "combined_dense_micro1_gnws": {**_DENSE, "accumulate": 100, "norm": "group_ws"},
    "combined_micro1_gnws": {**_COMBINED, "accumulate": 100, "norm": "group_ws"},
    "combined_micro2_bn_eval": {**_COMBINED, "accumulate": 50, "eval_stats": "micro_batch"},
    "combined_gn": {**_COMBINED, "norm": "group"},
}
ALL_CONFIGS = {**CONFIGS, **NORM_CONFIGS}
QUICK_CONFIGS = ["combined", "fp32", "small_combined_dense"]
COMBINATIONS = ["combined", "combined_micro2", "combined_micro1"]  # the goal: dense beats?
NOTES = ["checkpoint-residual-3 is checkpoint-residual-1 on one block per group"]


# ------------------------------------------------------------------------ data and steps


def _images(split: str, n: int | None = None) -> tuple[Any, Any]:
    import numpy as np

    import eqx_lowmem as el

    images, labels = el.data.fashion_mnist(split)
    x = (images[:n].astype(np.float32) / 255.0 - 0.2860) / 0.3530  # the training set's stats
    return x[:, None], labels[:n].astype(np.int32)  # (n, 1, 28, 28)


def total_steps(cfg: dict) -> int:
    return (cfg["train"] // cfg["batch"]) * cfg["epochs"]


def dsr_period(total: int) -> int:
    """DSR's base period: about 10 rewirings in a run (`dsr` doubles the period at 20%, 40%
    and 60% and stops at 80%), the authors' 100 at most."""
    return max(1, min(100, round(0.375 * total / 10)))


def make_config_step(cfg: dict, opts: dict, mesh=None) -> Any:
    """The training step of the configuration `opts` (`mesh` places it)."""
    import jax.numpy as jnp
    import optax
    from _steps import wrn_loss

    import eqx_lowmem as el

    total, after_update = total_steps(cfg), None
    if opts["density"] is not None and opts.get("rewire", True):
        after_update = el.sparse.dsr(period=dsr_period(total), total_steps=total)
    schedule = optax.cosine_decay_schedule(cfg["lr"], max(total, 1))
    optimizer = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(schedule, momentum=0.9))
    dtype = jnp.dtype(opts.get("accumulate_dtype", "float32"))
    return el.train.make_step(wrn_loss, optimizer, has_state=True, accumulate=opts["accumulate"],
                              precision=opts["precision"], accumulate_dtype=dtype,
                              after_update=after_update, mesh=mesh)  # fmt: skip


def init_state(seed: int, cfg: dict, step: Any, opts: dict) -> Any:
    """The initial state of one configuration and seed: per seed the same dense weights in
    every configuration of one architecture (`opts` may set `depth` and `width`)."""
    import jax.random as jr
    from _steps import wide_resnet

    key = jr.PRNGKey(seed)
    depth, width = opts.get("depth", cfg["depth"]), opts.get("width", cfg["width"])
    model, state = wide_resnet({"slack": 0.1, **opts}, depth, width, key, in_channels=1)
    return step.init(model, key=jr.fold_in(key, 2), model_state=state)


def _predict(model, state, x, micro_batch=None):
    """Predicted classes: BatchNorm's running statistics, or (`micro_batch`) each
    micro-batch normalised by its own statistics, as the training step did."""
    import equinox as eqx
    import jax.numpy as jnp

    import eqx_lowmem as el

    x = x.astype(model.stem.weight.dtype)  # 16-bit parameters take 16-bit images
    if micro_batch is not None:
        logits = el.nn.apply_with_batch_statistics(model, state, x, micro_batch=micro_batch)
    else:
        logits, _ = eqx.nn.inference_mode(model).batched(x, state)
    return jnp.argmax(logits, axis=-1)


def train_one(name, seed, cfg, data, step, opts) -> dict:
    """Train one configuration; test accuracy after every epoch, the first call's seconds
    and the median seconds of the other updates."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqx_lowmem as el

    (x_train, y_train), (x_test, y_test) = data
    ts = init_state(seed, cfg, step, opts)
    predict = eqx.filter_jit(_predict)
    if opts.get("eval_stats") == "micro_batch":  # BatchNorm evaluated as it trained
        predict = functools.partial(_predict, micro_batch=cfg["batch"] // opts["accumulate"])
    rng, b = np.random.default_rng(seed), cfg["batch"]
    curve, losses, skipped, step_s, t0 = [], [], 0, [], time.perf_counter()
    for epoch in range(cfg["epochs"]):
        order, epoch_losses = rng.permutation(len(x_train)), []
        for i in range(len(x_train) // b):
            idx = np.sort(order[i * b : (i + 1) * b])
            t1 = time.perf_counter()
            ts, metrics = step(ts, (jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])))
            jax.block_until_ready(metrics)
            step_s.append(time.perf_counter() - t1)
            epoch_losses.append(float(metrics["loss"]))
            skipped += not bool(metrics["finite"])
        correct = sum(int(jnp.sum(predict(ts.model, ts.model_state, jnp.asarray(x_test[j:j + 500]))
                                  == jnp.asarray(y_test[j:j + 500])))
                      for j in range(0, len(x_test), 500))  # fmt: skip
        curve.append(correct / len(x_test))
        losses.append(float(np.mean(epoch_losses)))
        print(f"{name} seed {seed} epoch {epoch + 1}: loss {losses[-1]:.4f} test accuracy "
              f"{curve[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    out = {"test_accuracy": curve, "train_loss": losses, "skipped_updates": skipped,
           "final_loss_scale": float(metrics["loss_scale"]), "first_call_s": step_s[0],
           "step_s": statistics.median(step_s[1:]) if len(step_s) > 1 else None,
           "seconds": time.perf_counter() - t0}  # fmt: skip
    if opts["density"] is not None:
        out["density"] = float(el.sparse.density(ts.model))
    return out


# -------------------------------------------------------------------------------- workers


def _train_spec(spec: dict) -> dict:
    """A worker's job: one configuration (`opts`) trained on each of the run's seeds, after
    its step's compiled peak at the run's batch, a program the first update then reads back
    from the persistent cache that the run's workers share (`run`)."""
    import jax.numpy as jnp

    name, opts, cfg = spec["label"], spec["opts"], spec["cfg"]
    data = (_images("train", cfg["train"]), _images("test", cfg["test"]))
    step = make_config_step(cfg, opts)
    state, t0 = init_state(cfg["seeds"][0], cfg, step, opts), time.perf_counter()
    (x, y), _ = data
    batch = (jnp.asarray(x[: cfg["batch"]]), jnp.asarray(y[: cfg["batch"]]))
    out = {"memory": compiled_memory(step.lower(state, batch).compile())}
    out["compile_s"] = time.perf_counter() - t0
    out["runs"] = {str(s): train_one(name, s, cfg, data, step, opts=opts) for s in cfg["seeds"]}
    return out


def run(cfg: dict, configs: dict, workers=None) -> dict:
    """Each of `configs` (name: options) trained on `cfg`'s seeds, a job per configuration,
    in worker processes pinned one per core, at most `workers` at a time (1: all here); the
    frontier's record."""
    load_before, t0 = os.getloadavg(), time.perf_counter()
    jobs = [{"label": n, "opts": o, "cfg": cfg} for n, o in configs.items()]
    workers = min(len(cores()) if workers is None else workers, len(jobs))
    with tempfile.TemporaryDirectory(prefix="quality_cache_") as cache:
        if workers > 1:
            env = {  # every program into the shared cache, however quick or small
                "JAX_COMPILATION_CACHE_DIR": cache,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
            }
            outs = run_workers(__file__, jobs, parallel=workers, pin=True, env=env)
        else:
            outs = [_train_spec(j) for j in jobs]
    load = {"before": list(load_before), "after": list(os.getloadavg())}
    record = frontier(cfg, configs, dict(zip(configs, outs, strict=True)))
    result = {"config": cfg, "workers": workers, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "load_average": load, **record}  # fmt: skip
    return result | {"run_seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------ frontier


def uses(opts: dict, cfg: dict) -> str:
    """A configuration's settings in words."""
    parts = [f"WRN-{opts.get('depth', cfg['depth'])}-{opts.get('width', cfg['width'])}",
             {"float32": "FP32", "half_fp16": "FP16"}[opts["precision"]]]  # fmt: skip
    parts += [str(opts["remat"])] if opts["remat"] else []
    parts += [f"micro-batches of {cfg['batch'] // opts['accumulate']}"] * (opts["accumulate"] > 1)
    parts += [f"{opts['density']:.0%} DSR"] if opts["density"] is not None else []
    norm = {"group": "GroupNorm", "group_ws": "GroupNorm + WS"}.get(opts.get("norm", "batch"))
    parts += [norm] if norm else []
    parts += ["BatchNorm evaluated per micro-batch"] * (opts.get("eval_stats") == "micro_batch")
    return " + ".join(parts)


def frontier(cfg: dict, configs: dict, out: dict) -> dict:
    """The frontier's record: per configuration its compiled peak, mean accuracy and spread
    over the seeds and median seconds per update; the Pareto front, the goal and the budget
    table."""
    rows, updates = [], total_steps(cfg)
    for name, opts in configs.items():
        final = [r["test_accuracy"][-1] for r in out[name]["runs"].values()]
        steps = [r["step_s"] for r in out[name]["runs"].values() if r["step_s"] is not None]
        rows.append({"config": name, "compiled_peak_bytes": out[name]["memory"]["peak"],
                     "test_accuracy": statistics.mean(final),
                     "test_accuracy_spread": max(final) - min(final),
                     "step_s": statistics.median(steps) if steps else None,
                     "uses": uses(opts, cfg), "opts": opts, "dense": opts["density"] is None,
                     **out[name], "trained": {"updates": updates,
                                              "images": updates * cfg["batch"]}})  # fmt: skip
    result = {"timing_note": "the 2 cores were shared with other work: compare step times "
              "within one run only", "notes": NOTES, "rows": rows,
              "pareto_front": pareto_front(rows),
              "goal": [goal(rows, c) for c in COMBINATIONS if c in configs]}  # fmt: skip
    return result | {"budget_table": budget_table(result)}


def pareto_front(rows: list[dict]) -> list[str]:
    """The configurations no other beats (every row with no more compiled peak is less
    accurate), in order of compiled peak."""
    front, best = [], float("-inf")
    for r in sorted(rows, key=lambda r: (r["compiled_peak_bytes"], -r["test_accuracy"])):
        if r["test_accuracy"] > best:
            front.append(r["config"])
            best = r["test_accuracy"]
    return front


def budget_table(result: dict) -> list[str]:
    """Markdown lines: per memory budget, the most accurate configuration that fits."""
    rows = {r["config"]: r for r in result["rows"]}
    front = [rows[name] for name in result["pareto_front"]]
    lines = ["| budget (compiled peak) | use | test accuracy | spread (2 seeds) | s / update |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    for i, r in enumerate(front):
        low = r["compiled_peak_bytes"] / MB
        high = None if i + 1 == len(front) else front[i + 1]["compiled_peak_bytes"] / MB
        budget = f"{low:.1f} MB or more" if high is None else f"{low:.1f} - {high:.1f} MB"
        step = "" if r["step_s"] is None else f"{r['step_s']:.2f}"
        lines.append(f"| {budget} | `{r['config']}`: {r['uses']} | {100 * r['test_accuracy']:.2f}% "
                     f"| {100 * r['test_accuracy_spread']:.2f} | {step} |")  # fmt: skip
    return lines


def goal(rows: list[dict], combination: str) -> dict:
    """Whether a dense configuration that fits in `combination`'s compiled peak is more
    accurate than it by more than the seeds' spread (the larger of the two rows')."""
    c = next(r for r in rows if r["config"] == combination)
    fits = [r for r in rows if r["dense"] and r["compiled_peak_bytes"] <= c["compiled_peak_bytes"]]
    spread = lambda r: max(r["test_accuracy_spread"], c["test_accuracy_spread"])  # noqa: E731
    better = [r["config"] for r in fits if r["test_accuracy"] - c["test_accuracy"] > spread(r)]
    return {"combination": combination, "compiled_peak_bytes": c["compiled_peak_bytes"],
            "test_accuracy": c["test_accuracy"],
            "dense_that_fit": {r["config"]: r["test_accuracy"] for r in fits},
            "dense_better_by_more_than_spread": better, "met": not better}  # fmt: skip


# ---------------------------------------------------------------------------------- plots


def plot(result: dict, path: Path) -> None:
    """The frontier's accuracy against compiled peak, with its Pareto front (drawn and saved
    atomically as the library's `--plot` does)."""
    from eqx_lowmem.memory._plot import _figure, _save

    fig = _figure(8.0, 5.0)
    ax = fig.subplots()
    cfg = result["config"]
    points = {r["config"]: (r["compiled_peak_bytes"] / MB, 100 * r["test_accuracy"])
              for r in result["rows"]}  # fmt: skip
    for r in result["rows"]:
        ax.plot(*points[r["config"]], "o", color="C0" if r["dense"] else "C3")
        ax.annotate(r["config"], points[r["config"]], fontsize=6, xytext=(3, 3),
                    textcoords="offset points")  # fmt: skip
    front = zip(*(points[n] for n in result["pareto_front"]), strict=True)
    ax.step(*front, where="post", color="k", label="Pareto front (blue: dense, red: DSR)")
    ax.set_xscale("log")
    ax.set_xlabel(f"compiled peak of the training step, MB (batch {cfg['batch']}, XLA:CPU)")
    ax.set_ylabel(f"test accuracy ({cfg['test']:,} images)")
    ax.set_title(f"Fashion-MNIST, WRN-{cfg['depth']}-{cfg['width']} family")
    ax.legend(fontsize=7)
    _save(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and plot")
    p.add_argument("--name", help="file name of the JSON and plot (default: the run's)")
    for field in ("depth", "width", "train", "test", "epochs", "batch", "lr"):
        what = f"override the configuration's {field}"
        p.add_argument(f"--{field}", type=type(FRONTIER[field]), help=what)
    p.add_argument("--seeds", type=int, nargs="+", help="override the configuration's seeds")
    p.add_argument("--configs", nargs="+", choices=list(ALL_CONFIGS), help="frontier rows")
    p.add_argument("--workers", type=int, help="processes, one core each (1: all here)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker, _train_spec)
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    if args.lr is not None and not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    cfg = FRONTIER_QUICK if args.quick else FRONTIER
    cfg = {**cfg, **{k: getattr(args, k) for k in FRONTIER if getattr(args, k) is not None}}
    names = args.configs or (QUICK_CONFIGS if args.quick else CONFIGS)
    result = run(cfg, {n: ALL_CONFIGS[n] for n in names}, args.workers)
    print("\n".join(result["budget_table"]))
    result["wall_seconds"] = time.perf_counter() - _START  # imports and data included
    name = (args.name or "frontier") + ("_quick" if args.quick else "")
    write_json(name, result, args.out)
    plot(result, args.out / f"{name}.png")
    print(f"wrote {args.out / name}.json in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
