"""Write the README's measured figures from the committed JSON in `benchmarks/results/`.

Each generated part of README.md stands between `<!-- figures:NAME -->` and
`<!-- /figures:NAME -->`; `SECTIONS[NAME]` writes it from the JSON alone, so a figure in the
README cannot drift from its measurement. `tests/test_readme_figures.py` fails when they
disagree: rerun a benchmark, then this script.

    python benchmarks/readme.py          # rewrite README.md's generated parts
    python benchmarks/readme.py --check  # exit 1, naming the parts that differ
"""

import argparse
import json
import math
import re
import sys
import textwrap
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
MIB, MB = 2**20, 1e6  # MB: the paper's
MARKER = re.compile(r"<!-- figures:([\w-]+) -->\n(.*?)<!-- /figures:\1 -->\n", re.S)
sys.path.insert(0, str(ROOT / "benchmarks"))  # `memory.py`'s row names


@cache
def result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def date(name: str) -> str:
    return result(name)["environment"]["date"][:10]


def cite(name: str) -> str:
    """A figure's source: its JSON and the day it was measured."""
    return f"`{name}.json`, {date(name)}"


def para(text: str) -> str:
    return textwrap.fill(text, width=92, break_long_words=False, break_on_hyphens=False)


def table(head: list[str], rows: list[list], right: int = 1) -> str:
    """A Markdown table; columns from `right` on are right-aligned."""
    rule = ["---" if i < right else "---:" for i in range(len(head))]
    lines = [head, rule, *[[str(c) for c in row] for row in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def spec_table(label: str, columns: dict[str, str], rows: dict[str, dict], right: int = 1) -> str:
    """A Markdown table from a spec: a row per `rows` item, its name under `label`, then a
    column per `columns` item, header -> a `str.format` template filled from the row's
    figures (`"{time:.2f}x"`)."""
    cells = [[name, *(t.format(**r) for t in columns.values())] for name, r in rows.items()]
    return table([label, *columns], cells, right)


def x(ratio: float, digits: int = 2) -> str:
    return f"{ratio:.{digits}f}x"


def goal(met) -> str:
    return (
        "not measured" if met is None or isinstance(met, str) else "met" if met else "**not met**"
    )


def goal_of(d: dict, key: str) -> str:
    """A goal of a JSON that keeps `goals` and `goals_met`: "the goal of 0.95x: met"."""
    return f"the goal of {d['goals'][key]}x: {goal(d['goals_met'][key])}"


def pc(value) -> str:
    """A percentage (or points) to two places, rounded half up from the JSON's decimals."""
    return str(Decimal(str(value)).quantize(Decimal("0.01"), ROUND_HALF_UP))


def acc(*runs: dict) -> Decimal:
    """The mean final accuracy of `runs` in percent, exact (the JSON's short decimals)."""
    finals = [Decimal(str((r.get("test_accuracy") or r["validation_accuracy"])[-1])) for r in runs]
    return 100 * sum(finals) / len(finals)


# ----------------------------------------------------------------------- the examples


def _run_time(run: str) -> str:
    r = result("examples")[run]
    return (f"measured on {date('examples')} (`benchmarks/examples.py`): {r['cpu_s']:,.0f} s of "
            f"CPU time, {r['wall_s']:,.0f} s of wall time on 2 CPU cores shared with other work "
            f"(load average {r['load_before'][0]:.1f} at the start)")  # fmt: skip


def main_job_setup() -> str:
    updates = result("examples")["main_job"]["updates"]
    return para(f"It trains {updates} updates; {_run_time('main_job')}.")


def short_example_time() -> str:
    return para(f"M{_run_time('short_example')[1:]}, mostly compiling.")


def main_job() -> str:
    m = result("examples")["main_job"]
    return para(
        f"**The main job** (`examples/train_char_lm.py`, default settings, 2 CPU cores; "
        f"`benchmarks/examples.py`, {date('examples')}): {m['updates']} updates; the evaluation "
        f"loss fell to {m['final_eval_loss']:.3f} nats per character against the text's "
        f"unigram entropy of {m['unigram_entropy']:.3f}, in {m['cpu_s']:,.0f} s of CPU time and "
        f"{m['wall_s']:,.0f} s of wall time (training {m['train_seconds']:,.0f} s)."
    )


# ---------------------------------------------------------------- checkpoints and shards


def checkpoint() -> str:
    d = result("checkpoint")
    loads = [*d["load_average_before"], *d["load_average_after"]]
    big, kills = d["stall"]["100mb"], d["sigkill"]
    met = d["goals"]["async_stall_at_most_0.2x_file_save_100mb"]
    rows = {f"{big['state_mb']:.0f} MB (MLP 8 x 1024x1024, Adam)": big,
            "the tests' small MLP": d["stall"]["small"]}  # fmt: skip
    columns = {"single file": "{file_save_s:.3f} s", "orbax async: stall":
               "{orbax_async_stall_s:.3f} s", "its write": "{orbax_async_write_s:.2f} s",
               "orbax sync": "{orbax_sync_write_s:.2f} s"}  # fmt: skip
    return "\n\n".join([
        para(f"Measured (`benchmarks/checkpoint.py`, {cite('checkpoint')}, 2 CPU cores at a load "
             f"average of {min(loads):.1f}-{max(loads):.1f}, medians of 5 saves; seconds the save "
             "holds the caller, and the asynchronous write's whole time):"),
        spec_table("state", columns, rows),
        para(f"The asynchronous stall is {x(big['async_stall_vs_file_save'])} the single file's "
             f"save (the goal of at most 0.2x: {goal(met)}). Killed {kills['killed']} times at "
             f"random moments ({kills['during_async_save']} during an asynchronous save), the "
             f"orbax run resumed bit-identically {kills['bit_identical_resumes']} times."),
    ])  # fmt: skip


def shard() -> str:
    rows = {n: {k: grid()[f"shard/{n}"]["fsdp"][k] / grid()[f"shard/{n}"]["data"][k]
                for k in ("argument", "temp")} for n in (2, 4, 8)}  # fmt: skip
    return "\n\n".join([
        para("Compiled for XLA:CPU host devices (`python benchmarks/memory.py --only shard/`, "
             f"{cite('memory_grid')}, a 4-block encoder with Adam): FSDP's per-device bytes "
             "against the replicated step's."),
        spec_table("devices", {"arguments": "{argument:.2f}x", "temporaries": "{temp:.2f}x"}, rows),
    ])  # fmt: skip


# ----------------------------------------------------------------------------- sparse


def sparse() -> str:
    """Sparse storage against dense: memory compiled (`memory.py`), time side by side
    (`speed.py`), on the same MLP."""
    from memory import SPARSE

    g, t = grid(), result("speed")["configs"]
    vs = lambda n, k: g[f"sparse/{n}"][k] / g["sparse/dense"][k]  # noqa: E731
    rows = {n: {"stored": vs(n, "params_opt_bytes"), "peak": vs(n, "peak"),
                "time": t[f"sparse/{n}"]["time_vs_base"]} for n in SPARSE}  # fmt: skip
    goals = [f"{SPARSE[n][0]}: {what} <= {bound}x dense: {goal(rows[n][what] <= bound)}"
             for n in ("ours", "ours_dsr100", "rewired_dsr100", "bits")
             for what, bound in (("time", 1.3), ("peak", 0.6))]  # fmt: skip
    columns = {"parameters + Adam": "{stored:.2f}x", "step's peak": "{peak:.2f}x",
               "step's time": "{time:.2f}x"}  # fmt: skip
    return "\n\n".join([
        para(f"Measured (`benchmarks/speed.py --only sparse/`, {cite('speed')}, 2 CPU cores, "
             "times side by side in one process; memory compiled by `benchmarks/memory.py`, "
             f"{cite('memory_grid')}; an MLP of three 1024x1024 layers and a head, batch 128, "
             "Adam, 30% density and 10% slack), against dense:"),
        spec_table("variant", columns, {SPARSE[n][0]: r for n, r in rows.items()}),
        para("Goals: " + "; ".join(goals) + "."),
    ])  # fmt: skip


def sparse_bits() -> str:
    t = result("speed")["configs"]
    return para(
        f"On the MLP above (the same run) a bit set takes {x(t['sparse/bits']['time_vs_base'])} "
        f"the dense step's time against {x(t['sparse/ours']['time_vs_base'])} with indices: "
        "each step walks every layer's bits three times (two rebuilds of the dense weight and "
        "the value gradient), a chunk of positions at a time, so that no positions array is "
        "ever held."
    )


def sparse_quality() -> str:
    d = result("frontier")
    r, cfg = {r["config"]: r for r in d["rows"]}, d["config"]
    dsr, dense = r["dsr30"], r["fp32"]
    return para(
        f"On Fashion-MNIST (`benchmarks/quality.py --frontier`, `frontier.json`, "
        f"{date('frontier')}: a WRN-{cfg['depth']}-{cfg['width']}, {dsr['trained']['updates']} "
        f"updates of {cfg['batch']}, seeds {' and '.join(map(str, cfg['seeds']))}), DSR at 30% "
        f"density reaches {100 * dsr['test_accuracy']:.2f}% test accuracy against "
        f"{100 * dense['test_accuracy']:.2f}% dense (the seeds' spreads "
        f"{100 * dsr['test_accuracy_spread']:.2f} and {100 * dense['test_accuracy_spread']:.2f} "
        "points)."
    )


# ------------------------------------------------------------------- memory and speed


def grid() -> dict:
    """The compile-only rows of `benchmarks/memory.py`."""
    return result("memory_grid")["rows"]


def peak_vs(name: str, base: str = "guide/none") -> float:
    return grid()[name]["peak"] / grid()[base]["peak"]


# (label, memory grid row, configuration of memory_and_data.json's timing)
_GUIDE_ROWS = (
    ("plain Equinox: `lax.scan`, body in `eqx.filter_checkpoint`", "plain_eqx_checkpoint",
     "plain_eqx_checkpoint"),
    ("`remat=True`", "full", "remat_full"),
    ("`accumulate=4` (4 x 8)", "accumulate_4", "accumulate_4"),
    ("`remat=True`, `accumulate=4`", "full_accumulate_4", "remat_full_accumulate_4"),
    ('`segment="sqrt"` (3 blocks)', "segments", "segments_sqrt"),
    ('`precision="mixed_bf16"` (XLA:CPU computes bf16 in float32)', "mixed_bf16", "mixed_bf16"),
)  # fmt: skip


def guide() -> str:
    d = result("memory_and_data")
    ref, c, g = d["reference_t4"], d["configs"], grid()
    rows = [["guide's reference: per-block `jax.checkpoint`", "T4", f"{ref['peak_ratio']:.3f}",
             f"{ref['time_ratio']:.2f}"]]  # fmt: skip
    rows += [[label, "CPU", f"{peak_vs('guide/' + n):.3f}", f"{c[t]['time_vs_baseline']:.2f}"]
             for label, n, t in _GUIDE_ROWS]  # fmt: skip
    claims = {k["id"]: k for k in d["claims"]}
    return "\n\n".join([
        table(["configuration", "device", "peak vs baseline", "step time vs baseline"], rows, 2),
        para(f"Peaks compiled on {date('memory_grid')} (`benchmarks/memory.py`, "
             f"`memory_grid.json`), times measured on {date('memory_and_data')} "
             "(`memory_and_data.json`). The baseline's peak is "
             f"{g['guide/none']['peak'] / MIB:,.0f} MiB; with `remat=True` it is "
             f"{g['guide/full']['peak'] / MIB:,.0f} MiB. The claims written before the run: "
             f"remat's peak at most {claims['remat_peak']['threshold']}x "
             f"({goal(peak_vs('guide/full') <= claims['remat_peak']['threshold'])}), its time "
             f"at most {claims['remat_time']['threshold']}x ({goal(claims['remat_time']['met'])}), "
             "and 4 micro-batches of 8 equal to a batch of 32 "
             f"({claims['accumulate_equal']['measured']:.0e} relative)."),
    ])  # fmt: skip


def remat() -> str:
    d = result("remat")
    v = d["variants"]
    rows = [[n, f"{peak_vs('guide/' + n):.3f}", f"{v[f'{n}/scan']['time_vs_none']:.2f}"]
            for n in ("full", "dots", "minimal")]  # fmt: skip
    return "\n\n".join([
        para(f"**Recomputation presets** (memory at the guide's size, {cite('memory_grid')}; "
             f"time at 4 layers, batch 2, {cite('remat')}; compiling 48 scanned layers took "
             f"{d['compile_s']['48'] / d['compile_s']['4']:.3f}x the time of 4):"),
        table(["preset", "peak vs none", "time vs none"], rows),
    ])  # fmt: skip


def accumulate() -> str:
    d, g = result("accumulate"), grid()
    a, m = d["achieved"], d["model"]
    return para(
        f"**Accumulation** ({m['n_layers']} blocks, d_model {m['d_model']}, seq {d['seq']}, "
        f"batch {d['batch']}, SGD; times {cite('accumulate')}, peaks `memory_grid.json`): 4 "
        f"micro-batches of 8 ran at {x(a['scan_k4_vs_whole_batch'])} the whole batch's updates "
        f"per second with a peak of {g['accumulate/k4']['peak'] / MIB:.0f} MiB against "
        f"{g['accumulate/k1']['peak'] / MIB:.0f} MiB ({goal_of(d, 'scan_k4_vs_whole_batch')}), "
        f"and at {x(a['scan_k4_vs_multisteps_k4'])} `optax.MultiSteps`, which keeps a "
        f"parameter-sized buffer in its optimizer state ({goal_of(d, 'scan_k4_vs_multisteps_k4')})."
    )


def precision() -> str:
    g = grid()
    saved = g["precision/mixed_bf16"]["saved_bytes"] / g["precision/float32"]["saved_bytes"]
    state = g["precision/half_bf16"]["param_opt_bytes"] / g["precision/float32"]["param_opt_bytes"]
    return para(
        f"**Precision** (`benchmarks/memory.py`, {cite('memory_grid')}, guide configuration): "
        f"the backward pass keeps {x(saved)} the bytes in mixed bf16 that it keeps in float32; "
        f"16-bit storage holds parameters and Adam state in {x(state)} the bytes (both goals of "
        f"at most 0.55x: {goal(max(saved, state) <= 0.55)})."
    )


def data() -> str:
    d, p = result("stream"), result("speed_stream")
    mix, prefetch, sizes = d["mixing"], p["goals"]["stream_vs_resident"], ("64KiB", "1KiB")
    rates, dist = [d[f"rates_{k}"]["methods"] for k in sizes], mix["distinct_classes_per_batch"]
    rows = [[n, *(f"{r[n]['vs_in_order']:.2f}x" for r in rates)]
            for n in ("bounded_shuffle_512", "global_shuffle")]  # fmt: skip
    rows.append(["global shuffle, `safe_reads` (a lease) vs NumPy's copy",
                 *(x(d["achieved"][f"safe_vs_plain_reads_{k}"]) for k in sizes)])  # fmt: skip
    safe_met = all(d["goals_met"][f"safe_vs_plain_reads_{k}"] for k in sizes)
    return "\n\n".join([
        para(f"**Data** (`benchmarks/stream.py`, {date('stream')}; {d['samples']:,} samples in a "
             f"`.npy`, batch {d['batch']}, every batch copied out of the file), rates against "
             "reading in order:"),
        table(["read", "64 KiB samples", "1 KiB samples"], rows),
        para(f"Safe reads (the default), at least {d['goals']['safe_vs_plain_reads_1KiB']}x "
             f"NumPy's copy from the mapping (the goal): {goal(safe_met)}; "
             # rounded down, as the goal compares: 4.9999 is not 5.0
             f"{math.floor(10 * d['achieved']['shuffled_vs_grain']) / 10:.1f}x grain's fastest "
             f"shuffled setting ({goal_of(d, 'shuffled_vs_grain')}); on {mix['samples']:,} "
             f"samples sorted into {mix['classes']} classes a buffer of {mix['buffer']:,} gives "
             f"{dist['bounded_shuffle_1000']:.2f} distinct classes per batch of {mix['batch']} (a "
             f"full shuffle {dist['full_random']:.2f}, a sliding buffer "
             f"{dist['sliding_sample_buffer_1000']:.2f}); a step fed by `prefetch()` ran at "
             f"{prefetch['ratio']:.2f}x the updates per second of the same step on batches "
             f"already on the device (`benchmarks/speed.py --only stream/`, "
             f"{cite('speed_stream')}), on the CPU, where the reading thread and the step share "
             f"the 2 cores (the goal of {prefetch['goal'][3:]}x is for a GPU: "
             f"{goal(prefetch['met'] if p['mode'] == 'gpu' else None)})."),
    ])  # fmt: skip


# ----------------------------------------------------------------------------- the paper


def paper() -> str:
    """The paper's two tables (`memory_grid.json`'s `paper/*` rows) and its goals."""
    from memory import PAPER_LM, PAPER_WRN

    g = {n: grid()[f"paper/{n}"] for n in (*PAPER_WRN, *PAPER_LM)}
    head = ["row", "model MB", "gradients MB", "optimizer MB", "activations MB", "batch MB",
            "compiled MB", "reduction", "live at peak MB", "f32 copies MB", "sum of parts MB",
            "reduction", "H100 MB", "reduction"]  # fmt: skip
    parts = ("model", "gradients", "optimizer", "activations", "batch")

    def reduction(base: str, row: str, key: str = "total", gpu: bool = False) -> float:
        b, r = (g[base]["h100"], g[row]["h100"]) if gpu else (g[base], g[row])
        return b[key] / r[key]

    tables = [table(head, [
        [n, *(f"{g[n][k] / MB:.2f}" for k in parts), f"{g[n]['total'] / MB:.1f}",
         x(reduction(base, n), 1), f"{g[n]['live_at_peak'] / MB:.1f}",
         f"{g[n]['backend_upcast_bytes'] / MB:.1f}", f"{g[n]['sum_of_parts'] / MB:.1f}",
         x(reduction(base, n, "sum_of_parts"), 1), f"{g[n]['h100']['total'] / MB:.1f}",
         x(reduction(base, n, gpu=True), 1)] for n in rows])
        for base, rows in (("baseline_fp32", PAPER_WRN), ("transformer_baseline_fp32", PAPER_LM))
    ]  # fmt: skip
    base, combo, lm = "baseline_fp32", "fp16_checkpoint_micro10_sparse30", "transformer_"
    lm_combo = (lm + "baseline_fp32", lm + "fp16_checkpoint_micro250")
    combos = [n for n in PAPER_WRN if n.startswith("fp16_checkpoint") and n.endswith("sparse30")]
    best = {gpu: max(reduction(base, n, gpu=gpu) for n in combos) for gpu in (True, False)}
    error = max(abs(r["live_at_peak"] + r["packing"] - r["total"]) / r["total"] for r in g.values())
    # The combination at FP32's accuracy: its frontier configuration (WRN-10-2) against FP32's.
    runs = (("frontier_norm_sparse", "combined_micro1_gnws"), ("frontier", "fp32"))
    gnws, fp32 = (next(r["test_accuracy"] for r in result(n)["rows"] if r["config"] == c)
                  for n, c in runs)  # fmt: skip
    baseline_mb = g[base]["h100"]["total"] / MB
    goals = [
        ("FP32 baseline within 2% of the paper's 404.8 MB (H100)", f"{baseline_mb:.1f} MB",
         abs(baseline_mb / 404.8 - 1) <= 0.02),
        *((f"WRN combination (micro-batches of 10) >= 60.7x ({where})",
           reduction(base, combo, gpu=gpu), 60.7) for gpu, where in ((True, "H100"),
                                                                    (False, "XLA:CPU"))),
        *((f"WRN combination at any micro-batch >= 60.7x ({where})", best[gpu], 60.7)
          for gpu, where in ((True, "H100"), (False, "XLA:CPU"))),
        (f"WRN combination at FP32's accuracy (GroupNorm + WS, micro-batches of 1, 30% DSR: "
         f"{100 * gnws:.2f}% against {100 * fp32:.2f}% on the frontier) >= 60.7x (H100)",
         reduction(base, "gnws_fp16_checkpoint_micro100_sparse30", gpu=True), 60.7),
        *((f"transformer combination >= 8.7x ({where})", reduction(*lm_combo, gpu=gpu), 8.7)
          for gpu, where in ((True, "H100"), (False, "XLA:CPU"))),
        ("sum of parts, checkpoint-residual-3 >= 60.7x",
         reduction(base, "fp16_checkpoint3_micro10_sparse30", "sum_of_parts"), 60.7),
        ("sum of parts, checkpoint-residual-1 >= 60.7x",
         reduction(base, combo, "sum_of_parts"), 60.7),
        ("the report's parts within 10% of the compiled peak", f"{100 * error:.1f}%",
         error <= 0.10),
    ]  # fmt: skip
    goals = [(a, x(b, 1), b >= c) if isinstance(b, float) else (a, b, c) for a, b, c in goals]
    times = result("paper")["step_time"]
    times = ", ".join(f"`{k}` {x(v['ratio'])}" for k, v in times.items() if "ratio" in v)
    return "\n\n".join([
        *tables, para(f"{cite('memory_grid')}; the paper's reduction of its combinations is "
                      "9.5x, 33.2x and 60.7x (WRN) and 8.7x (transformer)."),
        table(["goal", "reached", ""], [[a, b, goal(c)] for a, b, c in goals], 1),
        para("Step time against the paper's combination (WRN-16-1, batch 100, side by side, "
             f"2 cores under load; {cite('paper')}): {times}."),
    ])  # fmt: skip


def quality() -> str:
    """The paper's accuracy comparison: every run of `quality.py`, one row each."""
    d, sel = result("paper_quality"), result("paper_quality_lr")
    rows = [[f"learning rate {lr} (held out, `paper_quality_lr.json`)", "FP32 dense",
             f"{pc(acc(sel['runs'][str(lr)]))}%", ""] for lr in sel["candidates"]]  # fmt: skip
    for name, label in (("paper_quality", "3 epochs"), ("paper_quality_6epochs", "6 epochs"),
                        ("paper_quality_ablation", "ablation"),
                        ("paper_quality_sparse", "DSR variants (held out)")):  # fmt: skip
        for config, seeds in result(name)["runs"].items():
            each = " and ".join(f"{pc(acc(s))}%" for s in seeds.values())
            mean = f"{pc(acc(*seeds.values()))}%" if len(seeds) > 1 else ""
            rows.append([f"{label} ({cite(name)})", config, each, mean])
    gaps = [(n, acc(*result(n)["runs"]["baseline_fp32"].values())
             - acc(*result(n)["runs"]["combined"].values()))
            for n in ("paper_quality", "paper_quality_6epochs")]  # fmt: skip
    t, comb = result("paper_quality_timing")["steps"], d["runs"]["combined"]
    c, wall = d["config"], d["wall_seconds"]
    return "\n\n".join([
        para(f"**The paper's accuracy comparison** (`benchmarks/quality.py`, "
             f"`paper_quality.json` and `.png`): a WRN-{c['depth']}-{c['width']} on "
             f"{c['train']:,} Fashion-MNIST training images, batch {c['batch']}, momentum SGD with "
             f"a cosine decay from {c['lr']} (chosen on held-out training images); FP32 dense "
             "against the paper's combination (FP16 with a dynamic loss scale, "
             "checkpoint-residual-1, micro-batches of 10, 30% of the 3x3 convolutions with DSR). "
             "Test accuracy per seed:"),
        table(["run", "configuration", "accuracy per seed", "mean"], rows, 2),
        para("The combination's gap to FP32 (the goal of at most 0.5 points): "
             + "; ".join(f"{pc(v)} points at `{n}.json` ({goal(v <= Decimal('0.5'))})"
                         for n, v in gaps)
             + f". Skipped updates by the loss scale per run: "
             f"{', '.join(str(r['skipped_updates']) for r in comb.values())}. The script took "
             f"{wall:,.0f} s on {d['environment']['cpu_count']} cores (the goal of at most 30 "
             f"minutes: {goal(wall <= 1800)}); `--timing-only` ({cite('paper_quality_timing')}): "
             "FP32 "
             f"{t['baseline_fp32']['step_s']:.2f} s per update, the combination "
             f"{t['combined_fp16']['step_s']:.2f} s in FP16 and {t['combined_bf16']['step_s']:.2f} "
             "s in bf16."),
    ])  # fmt: skip


def frontier() -> str:
    """Accuracy against compiled peak: every row, the budget table, the longer run and the
    normalisations at one image per micro-batch."""
    d = result("frontier")
    cfg, front = d["config"], set(d["pareto_front"])
    rows = [[f"`{r['config']}`", r["uses"], f"{r['compiled_peak_bytes'] / MB:.1f}",
             f"{grid()['frontier/' + r['config']]['h100'] / MB:.1f}",
             f"{100 * r['test_accuracy']:.2f}%", f"{100 * r['test_accuracy_spread']:.2f}",
             "" if r["step_s"] is None else f"{r['step_s']:.2f}",
             "yes" if r["config"] in front else ""]
            for r in sorted(d["rows"], key=lambda r: r["compiled_peak_bytes"])]  # fmt: skip
    more = [[f"`{r['config']}` ({cite(n)}, {r['trained']['updates']} updates)", r["uses"],
             f"{100 * r['test_accuracy']:.2f}%", f"{100 * r['test_accuracy_spread']:.2f}"]
            for n in ("frontier_long", "frontier_norm", "frontier_norm_sparse")
            for r in result(n)["rows"]]  # fmt: skip
    beaten = [g["combination"] for g in d["goal"] if g["dense_better_by_more_than_spread"]]
    head = ["configuration", "uses", "compiled MB", "H100 MB", "test accuracy",
            "spread (2 seeds)", "s / update", "front"]  # fmt: skip
    return "\n\n".join([
        para(f"**Accuracy against memory** (`benchmarks/quality.py --frontier`, "
             f"{date('frontier')}; `frontier.json` and `frontier.png`): a WRN-{cfg['depth']}-"
             f"{cfg['width']} family on Fashion-MNIST, each configuration trained on "
             f"{cfg['train']:,} images in batches of {cfg['batch']} with seeds "
             f"{' and '.join(map(str, cfg['seeds']))}, tested on {cfg['test']:,}; compiled peak "
             "at batch 100; H100: the same step compiled for an H100 (`memory_grid.json`'s "
             "`frontier/*` rows, sparse ones without DSR's host callback). Rows on the Pareto "
             "front are marked."),
        table(head, rows, 2),
        "Per memory budget, the most accurate configuration that fits:",
        "\n".join(d["budget_table"]),
        para("A dense configuration in the combinations' memory more accurate by more than the "
             f"seeds' spread: {', '.join(beaten) or 'none'}. Longer and renormalised runs:"),
        table(["configuration", "uses", "test accuracy", "spread (2 seeds)"], more, 2),
    ])  # fmt: skip


# A section's marker is its function's name, with hyphens.
SECTIONS: dict[str, Callable[[], str]] = {f.__name__.replace("_", "-"): f for f in (
    main_job_setup, short_example_time, main_job, checkpoint, shard, sparse, sparse_bits,
    sparse_quality, guide, remat, accumulate, precision, data, paper, quality, frontier,
)}  # fmt: skip


def render(readme: str) -> tuple[str, list[str]]:
    """`readme` with every generated part rewritten, and the names of the parts that changed.

    Raises:
        ValueError: when a marker names no section here, or a section has no marker.
    """
    names = [name for name, _ in MARKER.findall(readme)]
    unknown, missing = sorted(set(names) - set(SECTIONS)), sorted(set(SECTIONS) - set(names))
    if unknown or missing or len(names) != len(set(names)):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"README.md's figure markers: unknown {unknown}, missing {missing}, {repeated=}."
        )
    texts = {name: SECTIONS[name]() + "\n" for name in names}
    changed = [name for name, body in MARKER.findall(readme) if body != texts[name]]
    fill = lambda m: f"<!-- figures:{m[1]} -->\n{texts[m[1]]}<!-- /figures:{m[1]} -->\n"  # noqa: E731
    return MARKER.sub(fill, readme), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say what differs")
    args = parser.parse_args(argv)
    text, changed = render(README.read_text())
    if args.check:
        print(f"README.md differs from the JSON in: {', '.join(changed) or 'nothing'}")
        return 1 if changed else 0
    if changed:
        sys.path.insert(0, str(ROOT))
        from eqx_lowmem._io import atomic_write

        atomic_write(README, text.encode())
    print(f"rewrote {', '.join(changed) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
