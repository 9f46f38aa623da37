"""Peak memory, step time and compile time of the remat presets, each variant in its own process.

Variants: remat `none`, `full`, `dots`, `minimal`, and `segments` (checkpointed segments of
round(sqrt(n_layers)) blocks, no remat inside), each with the blocks run by `lax.scan`
(`/scan`) and by a Python loop (`/loop`). The step is the library's own: `make_step` with
`eqx_lowmem.train.mse` and `optax.sgd(0.01)`, on the guide's configuration (12 blocks,
d_model 512, 8 heads, d_ff 2048, seq 256, batch 32, float32).

- Peak bytes. CPU: argument + output + temp - alias from `memory_analysis()` of the guide's
  step, compiled only (`device.memory_stats()` is None on CPU). GPU: `peak_bytes_in_use` of
  the process that built, compiled and ran the guide's step, with
  `XLA_PYTHON_CLIENT_PREALLOCATE=false`.
- Steps per second. GPU: the guide's configuration. CPU: its widths at 4 blocks and batch 2
  (a guide step takes 10 s or more on two cores).
- Compile seconds: lowering and compiling the guide's step with `remat="full"`, scanned, at
  4, 12 and 48 blocks, each in a fresh process.

Every process first checks its step against the others (loss and gradient norm of the first
two updates from the same initial parameters), then burns in and times single steps, each
synchronised with `jax.block_until_ready`; the figure is the median. Each variant runs in a
process of its own. On a CPU shared with other work, times taken in different processes
minutes apart are not comparable, so each process also builds none/scan's step from the
same parameters and times the two in alternation (ABBA); the time ratio is the median of the
pairs' ratios (none/scan paired with itself gives the A/A ratio: the noise floor). On a
GPU, whose peak memory would include the second step, ratios come from the processes'
medians. `--rounds` > 1 repeats the timing processes, later rounds in reverse order.

    python benchmarks/remat.py               # writes benchmarks/results/remat.json
"""

import os

# Before anything imports jax, in this process and in the workers it starts: a GPU's
# peak_bytes_in_use only measures the step when the allocator does not grab memory up front.
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo, if not installed
from _common import (  # noqa: E402
    MARKER,
    compiled_memory,
    interleaved,
    median_ratio,
    spawn as _spawn,
    write_json,
)

GUIDE = {"n_layers": 12, "d_model": 512, "n_heads": 8, "d_ff": 2048, "seq": 256, "batch": 32}
CPU_TIMING = {**GUIDE, "n_layers": 4, "batch": 2}
COMPILE_LAYERS = (4, 12, 48)
LEARNING_RATE = 0.01
# name: (remat, segment)
PRESETS = {
    "none": ("none", None),
    "full": ("full", None),
    "dots": ("dots", None),
    "minimal": ("minimal", None),
    "segments": ("none", "sqrt"),
}
SELECTIVE = ("dots", "minimal")
# Whole-model scalars (loss, gradient norm) of differently scheduled but equal arithmetic.
RTOL = 1e-4
MIB = 2**20


# ------------------------------------------------------------------------------- workers


def _encoder(cfg: dict, remat: str, segment, scan: bool, key):
    import eqx_lowmem as el

    return el.nn.transformer_encoder(
        cfg["n_layers"],
        cfg["d_model"],
        cfg["n_heads"],
        cfg["d_ff"],
        key=key,
        remat=remat,
        scan=scan,
        segment=segment,
    )


def _make_step():
    import optax

    import eqx_lowmem as el

    return el.train.make_step(el.train.mse, optax.sgd(LEARNING_RATE), accumulate=1)


def compile_only(cfg: dict, remat: str, segment, scan: bool) -> dict:
    """Lower and compile one step on shapes alone: nothing is allocated."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    model = eqx.filter_eval_shape(lambda k: _encoder(cfg, remat, segment, scan, k), jr.PRNGKey(0))
    step = _make_step()
    state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(1))
    x = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"], cfg["d_model"]), jnp.float32)
    t0 = time.perf_counter()
    lowered = step.lower(state, (x, x))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "memory": compiled_memory(compiled)}


def run_steps(
    cfg: dict, remat: str, segment, scan: bool, burn_in: int, repeats: int, paired: bool
) -> dict:
    """Build, compile, check and time the real step; on a GPU also its measured peak.

    `paired`: also build none/scan's step from the same parameters and time the two in
    alternation (ABBA), so the ratio of their times is robust to a machine shared with
    other work. Only where memory is not measured by the process's peak (CPU).
    """
    import equinox as eqx
    import jax
    import jax.random as jr

    device = jax.devices()[0]
    model_key, x_key, y_key = jr.split(jr.PRNGKey(0), 3)
    model = _encoder(cfg, remat, segment, scan, model_key)
    step = _make_step()
    # A fresh key for each state: init keeps the key array itself, which the step donates.
    state = step.init(model, key=jr.PRNGKey(1))
    ref_step = ref_state = None
    if paired:
        # The same parameters in none/scan's module (they differ in static fields only).
        shapes = eqx.filter_eval_shape(lambda k: _encoder(cfg, "none", None, True, k), model_key)
        ref_model = jax.tree.unflatten(jax.tree.structure(shapes), jax.tree.leaves(model))
        ref_step = _make_step()
        ref_state = ref_step.init(ref_model, key=jr.PRNGKey(1))
        del ref_model
    del model
    shape = (cfg["batch"], cfg["seq"], cfg["d_model"])
    batch = (jr.normal(x_key, shape), jr.normal(y_key, shape))
    jax.block_until_ready((state, ref_state, batch))

    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()  # the step's own call reuses it
    compile_s = time.perf_counter() - t0
    stats = device.memory_stats() or {}
    peak_after_compile = stats.get("peak_bytes_in_use")
    if ref_step is not None:
        ref_step.lower(ref_state, batch).compile()

    # Correctness first: the first two updates from the same parameters (the second's loss
    # and gradient depend on the first update).
    check, ref_check = [], []
    for _ in range(2):
        state, metrics = step(state, batch)
        check.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
        if ref_step is not None:
            ref_state, metrics = ref_step(ref_state, batch)
            ref_check.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
    for _ in range(burn_in):
        state, _ = step(state, batch)
        if ref_step is not None:
            ref_state, _ = ref_step(ref_state, batch)
    jax.block_until_ready((state, ref_state))

    states = {"run": state, "reference": ref_state}
    steps = {"run": step, "reference": ref_step}

    def timed(name: str):
        def run():
            states[name], _ = steps[name](states[name], batch)
            jax.block_until_ready(states[name])

        return run

    calls = {name: timed(name) for name in states if steps[name] is not None}
    rounds = interleaved(calls, repeats).wall
    times, ref_times = rounds["run"], rounds.get("reference", [])
    stats = device.memory_stats() or {}
    return {
        "config": cfg,
        "compile_s": compile_s,
        "memory_analysis": compiled_memory(compiled),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "peak_bytes_in_use_after_compile": peak_after_compile,
        "check": check,
        "reference_check": ref_check or None,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "reference_step_s_all": ref_times or None,
        "time_vs_none_scan": median_ratio(times, ref_times) if ref_times else None,
    }


def worker(spec: dict) -> dict:
    import jax

    on_gpu = jax.default_backend() == "gpu"
    out: dict = {"backend": jax.default_backend()}
    if spec["kind"] == "compile":
        cfg = {**GUIDE, "n_layers": spec["n_layers"]}
        out.update(compile_only(cfg, "full", None, True))
        return out
    remat, segment = PRESETS[spec["preset"]]
    scan = spec["scan"]
    if spec["memory"] and not on_gpu:
        out["guide_compile"] = compile_only(GUIDE, remat, segment, scan)
    burn_in, repeats = (3, 20) if on_gpu else (1, 6)
    cfg = GUIDE if on_gpu else CPU_TIMING
    # none/scan's own process pairs it with a second copy of itself: an A/A ratio that
    # shows how far the pairing is from 1.0 when nothing differs.
    paired = not on_gpu
    out["steps"] = run_steps(cfg, remat, segment, scan, burn_in, repeats, paired)
    return out


# -------------------------------------------------------------------------------- parent


def variant_name(preset: str, scan: bool) -> str:
    return f"{preset}/{'scan' if scan else 'loop'}"


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def print_goals(goals: list[dict]) -> None:
    print("goals:")
    for g in goals:
        shown = g["achieved"]
        if shown is None:
            print(f"  {g['goal']}: {g.get('note', 'not measured')}")
            continue
        if isinstance(shown, float):
            shown = f"{shown:.3f}"
        else:  # the selective presets' (memory, time) ratios
            shown = ", ".join(
                f"{p} {m:.2f}x memory at {t:.2f}x time" for p, (m, t) in shown.items()
            )
        print(f"  {g['goal']}: bound {g['bound']}, achieved {shown}, met: {g['met']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="timing processes per variant")
    parser.add_argument("--compile-rounds", type=int, default=2, help="processes per depth")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(MARKER + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    start = time.perf_counter()
    names = [(p, s) for s in (True, False) for p in PRESETS]
    runs: dict[str, list[dict]] = {variant_name(p, s): [] for p, s in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for preset, scan in order:
            name = variant_name(preset, scan)
            out = _spawn(
                __file__, {"kind": "variant", "preset": preset, "scan": scan, "memory": r == 0}
            )
            runs[name].append(out)
            s = out["steps"]
            paired = "" if s["time_vs_none_scan"] is None else f", {s['time_vs_none_scan']:.2f}x"
            print(
                f"  round {r + 1} {name:14s} step {s['step_s']:.3f} s{paired}"
                f"  ({time.perf_counter() - start:.0f} s elapsed)",
                flush=True,
            )
    backend = runs["none/scan"][0]["backend"]
    on_gpu = backend == "gpu"

    compiles: dict[int, list[dict]] = {n: [] for n in COMPILE_LAYERS}
    for r in range(args.compile_rounds):
        order = COMPILE_LAYERS if r % 2 == 0 else COMPILE_LAYERS[::-1]
        for n in order:
            compiles[n].append(_spawn(__file__, {"kind": "compile", "n_layers": n}))
    compile_s = {
        n: statistics.median(c["lower_s"] + c["compile_s"] for c in compiles[n])
        for n in COMPILE_LAYERS
    }

    # Correctness: every process's first two updates (and those of its paired none/scan
    # step) against none/scan's own process.
    ref = runs["none/scan"][0]["steps"]["check"]
    checks = [
        check
        for outs in runs.values()
        for out in outs
        for check in (out["steps"]["check"], out["steps"]["reference_check"])
        if check is not None
    ]
    worst = max(
        relative(c[k], rc[k])
        for check in checks
        for c, rc in zip(check, ref, strict=True)
        for k in ("loss", "grad_norm")
    )
    correct = worst <= RTOL

    variants = {}
    for name, outs in runs.items():
        first = outs[0]
        step_s = statistics.median(o["steps"]["step_s"] for o in outs)
        if on_gpu:
            analysis = first["steps"]["memory_analysis"]
            # The measured peak; memory_analysis's should a backend not report one.
            peak = first["steps"]["peak_bytes_in_use"] or analysis["peak"]
            compiled_s = first["steps"]["compile_s"]
        else:
            peak = first["guide_compile"]["memory"]["peak"]
            analysis = first["guide_compile"]["memory"]
            compiled_s = first["guide_compile"]["lower_s"] + first["guide_compile"]["compile_s"]
        variants[name] = {
            "peak_bytes": peak,
            "memory_analysis": analysis,
            "guide_compile_s": compiled_s,
            "steps_per_s": 1.0 / step_s,
            "step_s_per_round": [o["steps"]["step_s"] for o in outs],
            # CPU: paired with none/scan in the same process; GPU: across processes.
            "time_vs_none_scan": 1.0
            if on_gpu or name == "none/scan"
            else statistics.median(o["steps"]["time_vs_none_scan"] for o in outs),
            "timing_steps_memory_analysis": first["steps"]["memory_analysis"],
            "check": first["steps"]["check"],
            "raw": outs,
        }
    a_a = None
    if not on_gpu:
        a_a = statistics.median(o["steps"]["time_vs_none_scan"] for o in runs["none/scan"])
    if on_gpu:
        for row in variants.values():
            row["time_vs_none_scan"] = variants["none/scan"]["steps_per_s"] / row["steps_per_s"]
    for name, row in variants.items():
        # "vs none": against no remat with the same scan setting.
        same = variants[variant_name("none", name.endswith("/scan"))]
        row["memory_vs_none"] = row["peak_bytes"] / same["peak_bytes"]
        row["memory_vs_none_loop"] = row["peak_bytes"] / variants["none/loop"]["peak_bytes"]
        row["time_vs_none"] = row["time_vs_none_scan"] / same["time_vs_none_scan"]

    # Goals, on the library's default (scanned) blocks against no remat, also scanned.
    full = variants["full/scan"]
    ratios = {
        p: (
            variants[variant_name(p, True)]["memory_vs_none"],
            variants[variant_name(p, True)]["time_vs_none"],
        )
        for p in SELECTIVE
    }
    best_sel = min(SELECTIVE, key=lambda p: ratios[p][0])
    compile_ratio = compile_s[48] / compile_s[4]

    def goal(text, bound, achieved, met, gpu_only=False, **extra):
        if gpu_only and not on_gpu:
            achieved, met, extra = None, None, {"note": "not measured (no GPU)"}
        return {"goal": text, "bound": bound, "achieved": achieved, "met": met, **extra}

    goals = [
        goal(
            "full remat peak memory vs none",
            0.20,
            full["memory_vs_none"],
            full["memory_vs_none"] <= 0.20,
            measured_as="peak_bytes_in_use" if on_gpu else "memory_analysis, compile only",
        ),
        goal(
            f"a selective preset's peak memory vs none (best: {best_sel})",
            0.6,
            ratios[best_sel][0],
            ratios[best_sel][0] <= 0.6,
        ),
        goal(
            "GPU: full remat step time vs none",
            1.30,
            full["time_vs_none"],
            full["time_vs_none"] <= 1.30,
            gpu_only=True,
        ),
        goal(
            "GPU: a selective preset at most 0.6x the memory at most 1.10x the time",
            [0.6, 1.10],
            {p: list(r) for p, r in ratios.items()},
            any(m <= 0.6 and t <= 1.10 for m, t in ratios.values()),
            gpu_only=True,
        ),
        goal(
            "compile seconds, 48 scanned layers vs 4",
            1.5,
            compile_ratio,
            compile_ratio <= 1.5,
        ),
    ]
    if not on_gpu:
        goals.insert(
            2,
            goal(
                "CPU: full remat step time vs none",
                1.35,
                full["time_vs_none"],
                full["time_vs_none"] <= 1.35,
            ),
        )
    for g in goals:  # met only if the variants also computed the same numbers
        g["met"] = None if g["met"] is None else bool(g["met"] and correct)

    timing_cfg = GUIDE if on_gpu else CPU_TIMING
    results = {
        "step": "eqx_lowmem.train.make_step(mse, optax.sgd(0.01), accumulate=1), float32",
        "memory_config": GUIDE,
        "timing_config": timing_cfg,
        "compile_config": {**GUIDE, "remat": "full", "scan": True, "n_layers": COMPILE_LAYERS},
        "rounds": args.rounds,
        "reference": "per-block jax.checkpoint on a T4: peak 0.224x at 1.41x the step time",
        "correctness": {"max_relative_difference": worst, "rtol": RTOL, "passed": correct},
        "a_a_time_ratio": a_a,
        "variants": variants,
        "compile_s": {str(n): compile_s[n] for n in COMPILE_LAYERS},
        "compile_raw": {str(n): compiles[n] for n in COMPILE_LAYERS},
        "goals": goals,
        "wall_s": time.perf_counter() - start,
    }

    print(
        f"\nremat on {backend}: peak memory of the guide's step "
        f"({'measured' if on_gpu else 'memory_analysis, compile only'}); steps/s at "
        f"{timing_cfg['n_layers']} blocks, batch {timing_cfg['batch']}"
    )
    print(
        f"  {'variant':14s} {'peak MiB':>9s} {'mem x':>7s} {'mem x loop':>10s}"
        f" {'steps/s':>8s} {'time x':>7s} {'time x scan':>11s} {'compile s':>9s}"
    )
    for name, row in variants.items():
        print(
            f"  {name:14s} {row['peak_bytes'] / MIB:9,.0f} {row['memory_vs_none']:7.3f}"
            f" {row['memory_vs_none_loop']:10.3f} {row['steps_per_s']:8.3f}"
            f" {row['time_vs_none']:7.2f} {row['time_vs_none_scan']:11.2f}"
            f" {row['guide_compile_s']:9.1f}"
        )
    print(
        "  (x: against none with the same scan setting; 'mem x loop' against none/loop, "
        "'time x scan' against none/scan)"
    )
    print(
        "compile s (full remat, scanned): "
        + ", ".join(f"{n} layers {compile_s[n]:.1f}" for n in COMPILE_LAYERS)
    )
    print(f"correctness: max relative difference {worst:.1e} (rtol {RTOL:g}): {correct}")
    if a_a is not None:
        print(f"timing noise: none/scan paired with itself ran {a_a:.3f}x its own time")
    print_goals(goals)
    print(f"wrote {write_json('remat', results)} ({results['wall_s']:.0f} s)")
    if not correct:
        sys.exit("correctness check failed: the variants' losses or gradients differ")


if __name__ == "__main__":
    main()
