"""Write the README's measured figures from the committed JSON in `benchmarks/results/`.

Each generated part of README.md stands between `<!-- figures:NAME -->` and
`<!-- /figures:NAME -->`: a line naming its JSON files and their dates, then tables. A table
is a spec: a header per column and, per row, the row's figures (`table`); or goals, each
with what it reached and its bound (`goals`). `SECTIONS[NAME]` writes a part from the JSON
alone, so a figure in a part cannot drift from its measurement; `tests/test_readme_figures.py`
fails when they disagree: rerun a benchmark, then this script. The prose around the parts is
written by hand; where it quotes a figure it names the JSON (or the commit whose JSON) that
holds it, which nothing checks: put a figure that should stay current in a part.

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


def grid() -> dict:
    """The compile-only rows of `benchmarks/memory.py`."""
    return result("memory_grid")["rows"]


# JSON files of runs the scripts no longer make: the last commit that had each.
RETIRED = {"optimizer_state": "837811e", "remat": "f5092dd", "memory_and_data": "f5092dd",
           "speed_stream": "80a7b30", "speed_plan": "80a7b30"}  # fmt: skip


def cite(name: str) -> str:
    """A figure's source: its JSON and the day it was measured (and a retired run's commit)."""
    retired = f", a run retired after commit {RETIRED[name]}" if name in RETIRED else ""
    return f"`{name}.json`, {result(name)['environment']['date'][:10]}{retired}"


def sources(*names: str, by: str = "", note: str = "") -> str:
    """A part's first line: the script, its JSON files and their dates, and a note."""
    script = f"`{by}`: " if by else ""
    line = f"{script}{'; '.join(map(cite, names))}{f'; {note}' if note else ''}."
    return textwrap.fill(line, width=92, break_long_words=False, break_on_hyphens=False)


def table(head: list[str], rows: list[list], right: int = 1) -> str:
    """A Markdown table; columns from `right` on are right-aligned."""
    rule = ["---" if i < right else "---:" for i in range(len(head))]
    lines = [head, rule, *[[str(c) for c in row] for row in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def spec_table(label: str, columns: dict[str, str], rows: dict[str, dict]) -> str:
    """A table from a spec: a row per `rows` item, its name under `label`, then a column
    per `columns` item, header -> a `str.format` template of the row's figures
    (`"{time:.2f}x"`)."""
    cells = [[name, *(t.format(**r) for t in columns.values())] for name, r in rows.items()]
    return table([label, *columns], cells)


def goal(met) -> str:
    return "not measured" if met is None else "met" if met else "**not met**"


def goals(rows: list[tuple]) -> str:
    """A table of goals: (what, reached, bound, met); bound "" for a figure with no goal."""
    cells = [[what, got, bound, goal(met) if bound else ""] for what, got, bound, met in rows]
    return table(["goal", "reached", "bound", ""], cells)


def bound(g: dict) -> str:
    """A speed goal's bound (`">= 0.97"`) in words."""
    sense, value = g["goal"].split()
    return f"{'at least' if sense == '>=' else 'at most'} {value}x"


def limit(what: str, value: float, bound: float, most: bool = True, digits: int = 2) -> tuple:
    """A goals row for a ratio worked out here: `value` at most (or at least) `bound`."""
    met = value <= bound if most else value >= bound
    return what, x(value, digits), f"{'at most' if most else 'at least'} {bound}x", met


def timed(what: str, g: dict, digits: int = 2) -> tuple:
    """A goals row from a speed goal: its ratio, its bound and whether it is met."""
    return what, x(g["ratio"], digits), bound(g), g["met"]


def part(*blocks: str) -> str:
    return "\n\n".join(blocks)


def x(ratio: float, digits: int = 2) -> str:
    return f"{ratio:.{digits}f}x"


def peak_vs(name: str, base: str = "guide/none") -> float:
    return grid()[name]["peak"] / grid()[base]["peak"]


# ---------------------------------------------------------------- checkpoints and shards


def checkpoint() -> str:
    d = result("checkpoint")
    loads = [*d["load_average_before"], *d["load_average_after"]]
    big = d["stall"]["100mb"]
    rows = {f"{big['state_mb']:.0f} MB (MLP 8 x 1024x1024, Adam)": big,
            "the tests' small MLP": d["stall"]["small"]}  # fmt: skip
    columns = {"single file": "{file_save_s:.3f} s", "orbax async: stall":
               "{orbax_async_stall_s:.3f} s", "its write": "{orbax_async_write_s:.2f} s",
               "orbax sync": "{orbax_sync_write_s:.2f} s"}  # fmt: skip
    return part(
        sources("checkpoint", by="benchmarks/checkpoint.py",
                note=f"2 CPU cores at a load average of {min(loads):.1f}-{max(loads):.1f}, "
                "medians of 5 saves"),  # fmt: skip
        spec_table("state", columns, rows),
        goals([("the asynchronous stall against the single file's save (the larger state)",
                x(big["async_stall_vs_file_save"]), "at most 0.2x",
                d["goals"]["async_stall_at_most_0.2x_file_save_100mb"])]),
    )  # fmt: skip


def shard() -> str:
    rows = {n: {k: grid()[f"shard/{n}"]["fsdp"][k] / grid()[f"shard/{n}"]["data"][k]
                for k in ("argument", "temp")} for n in (2, 4, 8)}  # fmt: skip
    return part(
        sources("memory_grid", by="benchmarks/memory.py --only shard/"),
        spec_table("devices", {"arguments": "{argument:.2f}x", "temporaries": "{temp:.2f}x"}, rows),
    )


# ----------------------------------------------------------------------------- sparse


def sparse() -> str:
    """Sparse storage against dense: memory compiled (`memory.py`), time side by side
    (`speed.py`), on the same MLP."""
    from memory import SPARSE

    g, t = grid(), result("speed")["configs"]
    vs = lambda n, k: g[f"sparse/{n}"][k] / g["sparse/dense"][k]  # noqa: E731
    rows = {n: {"stored": vs(n, "params_opt_bytes"), "peak": vs(n, "peak"),
                "time": t[f"sparse/{n}"]["time_vs_base"]} for n in SPARSE}  # fmt: skip
    columns = {"parameters + Adam": "{stored:.2f}x", "step's peak": "{peak:.2f}x",
               "step's time": "{time:.2f}x"}  # fmt: skip
    return part(
        sources("speed", "memory_grid", by="benchmarks/speed.py --only sparse/, memory.py"),
        spec_table("variant", columns, {SPARSE[n][0]: r for n, r in rows.items()}),
        goals([limit(f"{SPARSE[n][0]}: {what} against dense", rows[n][what], bound)
               for n in ("ours", "ours_dsr100", "rewired_dsr100", "bits")
               for what, bound in (("time", 1.3), ("peak", 0.6))]),
    )  # fmt: skip


def optimizer_state() -> str:
    """Adam's state in float32, 16 and 8 bits: its bytes a parameter and the guide LM's
    compiled step (`memory.py`), a small LM's step time side by side (`speed.py`), and the
    held-out losses of a retired run."""
    g, t, run = grid(), result("speed"), result("optimizer_state")
    summary, most = run["summary"], run["goals"]["bytes_per_param_8bit"]
    names = {"float32": "float32", "16bit": "16 bits (`half_state`)",
             "8bit": "8 bits (`quantized_state`)"}  # fmt: skip
    rows = {label: {"bytes": g[f"optimizer_state/{v}"]["bytes_per_param"],
                    "cpu": g[f"optimizer_state/{v}"]["peak_bytes"] / MB,
                    "h100": g[f"optimizer_state/{v}"]["h100"]["peak_bytes"] / MB,
                    "time": t["configs"][f"optimizer_state/{v}"]["time_vs_base"],
                    "losses": " / ".join(f"{v:.3f}" for v in summary["held_out_loss"][v])}
            for v, label in names.items()}  # fmt: skip
    columns = {"bytes a parameter": "{bytes:.3f}", "compiled peak MB": "{cpu:,.1f}",
               "H100 MB": "{h100:,.1f}", "step time vs 16 bits": "{time:.2f}x",
               "held-out loss (seeds 0 / 1)": "{losses}"}  # fmt: skip
    eight = rows[names["8bit"]]["bytes"]
    return part(
        sources("memory_grid", "speed", "optimizer_state",
                by="benchmarks/memory.py, speed.py --only optimizer_state/",
                note="peaks: the guide's LM (12 layers, d_model 512, batch 32 x 256, full "
                "recomputation); times: a 2-layer LM of width 128; losses: 300 updates of "
                "that LM on the standard library's source"),
        spec_table("Adam's state", columns, rows),
        goals([
            ("8 bits: bytes a parameter", f"{eight:.3f}", f"at most {most}", eight <= most),
            timed("8 bits: step time against 16 bits", t["goals"]["state_8bit_time"]),
            ("8 bits: held-out loss against float32's (mean of the seeds)",
             f"{summary['held_out_gap_8bit_vs_float32']:+.3f}",
             f"within the seeds' spread ({summary['float32_seed_spread']:.3f})",
             summary["loss_goal_met"]),
        ]),
    )  # fmt: skip


# ------------------------------------------------------------------- memory and speed

# (label, the row's name in both grids: memory.py's and speed.py's `guide/*`)
_GUIDE_ROWS = (
    ("plain Equinox: `lax.scan`, body in `eqx.filter_checkpoint`", "plain_eqx_checkpoint"),
    ("`remat=True`", "full"),
    ('`remat="dots"`', "dots"),
    ('`remat="minimal"`', "minimal"),
    ("`accumulate=4` (4 x 8)", "accumulate_4"),
    ("`remat=True`, `accumulate=4`", "full_accumulate_4"),
    ('`segment="sqrt"` (3 blocks)', "segments"),
    ('`precision="mixed_bf16"` (XLA:CPU computes bf16 in float32)', "mixed_bf16"),
)  # fmt: skip


def guide() -> str:
    ref, g, s = result("memory_and_data")["reference_t4"], grid(), result("speed")
    compile_s = result("remat")["compile_s"]
    time = lambda n: s["configs"][f"guide/{n}"]["time_vs_base"]  # noqa: E731
    rows = [
        ["guide's reference: per-block `jax.checkpoint`", "T4", "", f"{ref['peak_ratio']:.3f}",
         f"{ref['time_ratio']:.2f}"],
        ["baseline", "CPU", f"{g['guide/none']['peak'] / MIB:,.0f}", "1.000", "1.00"],
        *([label, "CPU", f"{g['guide/' + n]['peak'] / MIB:,.0f}", f"{peak_vs('guide/' + n):.3f}",
           f"{time(n):.2f}"] for label, n in _GUIDE_ROWS),
    ]  # fmt: skip
    goal_of = s["goals"]
    sense, most = goal_of["full_remat_peak"]["goal"].split()  # speed.py's, on the compiled peak
    return part(
        sources("memory_grid", "speed", "memory_and_data", "remat",
                by="benchmarks/memory.py, speed.py --only guide/",
                note="peaks compiled, times side by side; the T4 row is the guide's own; "
                f"compiling 48 scanned layers took {compile_s['48'] / compile_s['4']:.3f}x the "
                "time of 4 (`remat.json`)"),
        table(["configuration", "device", "peak MiB", "peak vs baseline",
               "step time vs baseline"], rows, 2),
        goals([limit("`remat=True`: compiled peak", peak_vs("guide/full"), float(most),
                     most=sense == "<=", digits=3),
               timed("`remat=True`: time", goal_of["full_remat_time"])]),
    )  # fmt: skip


def accumulate() -> str:
    s, g = result("speed")["goals"], grid()
    peaks = " against ".join(f"{g[f'accumulate/k{k}']['peak'] / MIB:.0f} MiB" for k in (4, 1))
    return part(
        sources("speed", "memory_grid", by="benchmarks/speed.py --only accumulate/, memory.py",
                note="times side by side, then peaks"),
        goals([
            timed("4 micro-batches of 8: updates per second against the whole batch",
                  s["accumulate_vs_whole_batch"]),
            ("4 micro-batches of 8: compiled peak against the whole batch", peaks, "", None),
            timed("4 micro-batches of 8: updates per second against `optax.MultiSteps`",
                  s["accumulate_vs_multisteps"]),
        ]),
    )  # fmt: skip


def precision() -> str:
    g = grid()
    saved = g["precision/mixed_bf16"]["saved_bytes"] / g["precision/float32"]["saved_bytes"]
    state = g["precision/half_bf16"]["param_opt_bytes"] / g["precision/float32"]["param_opt_bytes"]
    return part(
        sources("memory_grid", by="benchmarks/memory.py", note="the guide's configuration"),
        goals([
            limit("bytes the backward pass keeps, mixed bf16 against float32", saved, 0.55),
            limit("parameters and Adam state, 16-bit storage against float32", state, 0.55),
        ]),
    )  # fmt: skip


def data() -> str:
    d, p = result("stream"), result("speed_stream")
    prefetch, sizes = p["goals"]["stream_vs_resident"], ("64KiB", "1KiB")
    rates = [d[f"rates_{k}"]["methods"] for k in sizes]
    rows = [[n, *(f"{r[n]['vs_in_order']:.2f}x" for r in rates)]
            for n in ("bounded_shuffle_512", "global_shuffle")]  # fmt: skip
    rows.append(["global shuffle, `safe_reads` (a lease) vs NumPy's copy",
                 *(x(d["achieved"][f"safe_vs_plain_reads_{k}"]) for k in sizes)])  # fmt: skip
    safe = min(d["achieved"][f"safe_vs_plain_reads_{k}"] for k in sizes)
    # rounded down, as the goal compares: 4.9999 is not 5.0
    grain = math.floor(10 * d["achieved"]["shuffled_vs_grain"]) / 10
    return part(
        sources("stream", "speed_stream", by="benchmarks/stream.py",
                note=f"rates against reading in order, batch {d['batch']}, {d['samples']:,} "
                "samples in a `.npy`, every batch copied out of the file"),
        table(["read", "64 KiB samples", "1 KiB samples"], rows),
        goals([
            ("shuffled reads (the slower shuffle) against reading in order: 64 KiB; 1 KiB "
             "samples", "; ".join(x(d["achieved"][f"shuffled_vs_in_order_{k}"]) for k in sizes),
             "at least " + "; ".join(f"{d['goals'][f'shuffled_vs_in_order_{k}']}x" for k in sizes),
             all(d["goals_met"][f"shuffled_vs_in_order_{k}"] for k in sizes)),
            ("safe reads (the default) against NumPy's copy from the mapping", x(safe),
             f"at least {d['goals']['safe_vs_plain_reads_1KiB']}x",
             all(d["goals_met"][f"safe_vs_plain_reads_{k}"] for k in sizes)),
            ("shuffled reads against grain's fastest shuffled setting", f"{grain:.1f}x",
             f"at least {d['goals']['shuffled_vs_grain']}x", d["goals_met"]["shuffled_vs_grain"]),
            ("a step fed by `prefetch()` against batches already on the device (updates per "
             "second; on the CPU the reading thread and the step share the 2 cores)",
             x(prefetch["ratio"]), f"{bound(prefetch)} on a GPU",
             prefetch["met"] if p["mode"] == "gpu" else None),
        ]),
    )  # fmt: skip


# The `step/*` models (`_steps.step_cases`), each with the step a user writes by hand.
_HAND_CASES = {"mlp": "MLP 784-512-512-10, batch 256",
               "lm": "`CausalLM`, 4 layers of width 128, 8 x 64 tokens",
               "wrn": "WRN-10-2 (GroupNorm), batch 16",
               "encoder64": "64-block encoder (`remat=True`), width 64, 4 x 16"}  # fmt: skip


def hand_written() -> str:
    """The library against what a user writes by hand: each step's time (side by side) and
    compiled peak, `Trainer.fit` against a hand loop, `plan` against one compile."""
    s, p, g = result("speed_steps")["goals"], result("speed_plan"), grid()
    rows = {label: {"time": s[f"step_{c}_time"]["ratio"],
                    "peak": g[f"step/{c}"]["library"]["peak"] / g[f"step/{c}"]["hand"]["peak"]}
            for c, label in _HAND_CASES.items()}  # fmt: skip
    times, peaks = [r["time"] for r in rows.values()], [r["peak"] for r in rows.values()]
    compiled = {n: p["configs"][f"plan/{n}"]["compiled"] for n in ("pruned", "every")}
    same = "the same choice as" if p["checks"]["plan"]["ok"] else "**not the choice of**"
    return part(
        sources("speed_steps", "speed_plan", "memory_grid",
                by="benchmarks/speed.py --only step_ fit/, memory.py",
                note="times against the hand-written way side by side, peaks compiled"),
        spec_table("against a hand-written step (Adam)",
                   {"updates per second": "{time:.3f}x", "compiled peak": "{peak:.4f}x"}, rows),
        goals([
            ("every step's updates per second", x(min(times), 3), bound(s["step_mlp_time"]),
             all(s[f"step_{c}_time"]["met"] for c in _HAND_CASES)),
            limit("every step's compiled peak", max(peaks), 1.01, digits=4),
            timed("`Trainer.fit` against a hand loop (the MLP, an epoch of 40 updates a call, "
                  "its data check included)", s["fit_vs_hand_loop"], 3),
            timed("`Trainer.fit` against a hand loop fed by `DataStream.prefetch()`",
                  s["fit_vs_prefetching_hand_loop"], 3),
            timed("`plan` (its default candidates) against one compile of the step (4-block "
                  f"encoder; candidates compiled: {compiled['pruned']} of {compiled['every']}, "
                  f"{same} compiling all)", p["goals"]["plan_vs_one_compile"]),
        ]),
    )  # fmt: skip


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

    def at_least(what: str, value: float, bound: float = 60.7) -> tuple:
        return limit(what, value, bound, most=False, digits=1)

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
    where = ((True, "H100"), (False, "XLA:CPU"))
    return part(
        sources("memory_grid", note="the paper's reduction of its combinations is "
                "9.5x, 33.2x and 60.7x (WRN) and 8.7x (transformer)"),
        *tables,
        goals([
            ("FP32 baseline against the paper's 404.8 MB (H100)", f"{baseline_mb:.1f} MB",
             "within 2%", abs(baseline_mb / 404.8 - 1) <= 0.02),
            *(at_least(f"WRN combination, micro-batches of 10 ({w})",
                       reduction(base, combo, gpu=gpu)) for gpu, w in where),
            *(at_least(f"WRN combination, any micro-batch ({w})", best[gpu]) for gpu, w in where),
            at_least(f"WRN combination at FP32's accuracy (GroupNorm + WS, micro-batches of 1, "
                     f"30% DSR: {100 * gnws:.2f}% against {100 * fp32:.2f}% on the frontier; "
                     "H100)", reduction(base, "gnws_fp16_checkpoint_micro100_sparse30", gpu=True)),
            *(at_least(f"transformer combination ({w})", reduction(*lm_combo, gpu=gpu), 8.7)
              for gpu, w in where),
            at_least("sum of parts, checkpoint-residual-3",
                     reduction(base, "fp16_checkpoint3_micro10_sparse30", "sum_of_parts")),
            at_least("sum of parts, checkpoint-residual-1", reduction(base, combo, "sum_of_parts")),
            ("the report's parts against the compiled peak", f"{100 * error:.1f}%", "within 10%",
             error <= 0.10),
        ]),
    )  # fmt: skip


def frontier() -> str:
    """Accuracy against compiled peak: every row, the budget table, the longer run and the
    normalisations at one image per micro-batch. The peaks are the memory grid's (the code
    as it compiles now, which the slow tests check), so the front, the budgets and the goal
    are worked out again here from them and the run's accuracies."""
    import quality

    rows = [{**r, "compiled_peak_bytes": grid()["frontier/" + r["config"]]["peak"]}
            for r in result("frontier")["rows"]]  # fmt: skip
    fresh = {"rows": rows, "pareto_front": quality.pareto_front(rows)}
    cells = [[f"`{r['config']}`", r["uses"], f"{r['compiled_peak_bytes'] / MB:.1f}",
              f"{grid()['frontier/' + r['config']]['h100'] / MB:.1f}",
              f"{100 * r['test_accuracy']:.2f}%", f"{100 * r['test_accuracy_spread']:.2f}",
              "" if r["step_s"] is None else f"{r['step_s']:.2f}",
              "yes" if r["config"] in fresh["pareto_front"] else ""]
             for r in sorted(rows, key=lambda r: r["compiled_peak_bytes"])]  # fmt: skip
    more = [[f"`{r['config']}` ({cite(n)}, {r['trained']['updates']} updates)", r["uses"],
             f"{100 * r['test_accuracy']:.2f}%", f"{100 * r['test_accuracy_spread']:.2f}"]
            for n in ("frontier_long", "frontier_norm", "frontier_norm_sparse")
            for r in result(n)["rows"]]  # fmt: skip
    beaten = [c for c in quality.COMBINATIONS
              if quality.goal(rows, c)["dense_better_by_more_than_spread"]]  # fmt: skip
    head = ["configuration", "uses", "compiled MB", "H100 MB", "test accuracy",
            "spread (2 seeds)", "s / update", "front"]  # fmt: skip
    return part(
        sources("frontier", "memory_grid", by="benchmarks/quality.py, memory.py",
                note="accuracies and times the training run's, peaks the memory grid's"),
        table(head, cells, 2),
        "\n".join(quality.budget_table(fresh)),
        goals([("combinations beaten by a dense configuration in their memory, by more than "
                "the seeds' spread", ", ".join(beaten) or "none", "none", not beaten)]),
        table(["configuration", "uses", "test accuracy", "spread (2 seeds)"], more, 2),
    )  # fmt: skip


# A section's marker is its function's name, with hyphens.
SECTIONS: dict[str, Callable[[], str]] = {f.__name__.replace("_", "-"): f for f in (
    checkpoint, shard, sparse, optimizer_state, guide, accumulate, precision, data,
    hand_written, paper, frontier,
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
