"""benchmarks/memory.py, the compile-only memory grid: its figures are deterministic, so the
slow suite compiles rows again and fails when `results/memory_grid.json` no longer matches
the code (rerun `python benchmarks/memory.py` then, and `python benchmarks/readme.py`)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import load_benchmark, users_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "memory.py"
COMMITTED = ROOT / "benchmarks" / "results" / "memory_grid.json"
# The rows compiled again by the slow suite (about 6 minutes on 2 cores): every row except
# the paper's and the frontier's, each a WideResNet compiled for XLA:CPU and an H100 (about
# a minute apiece: all 89 rows take about 29 minutes), and of those the paper's cheapest
# WRN combination, its transformer combination (the chunked LM loss) and the frontier's
# GroupNorm + WS combination. `python benchmarks/memory.py` compiles all.
REPRESENTATIVES = ("paper/fp16_checkpoint_micro100_sparse30",
                   "paper/transformer_fp16_checkpoint_micro250",
                   "frontier/combined_micro1_gnws")  # fmt: skip
# The H100 target compiles with JAX's CUDA plugin (the test extra installs it).
HAS_GPU_TARGET = importlib.util.find_spec("jax_cuda12_plugin") is not None

memory = load_benchmark("memory")
CHECKED = (*(n for n in memory.rows(smoke=False) if not n.startswith(("paper/", "frontier/"))),
           *REPRESENTATIVES)  # fmt: skip


def test_a_smoke_row_measures_what_remat_saves():
    cfg = memory.SMOKE["guide"]
    none, full = (memory.guide_row(cfg, {"remat": r}) for r in ("none", "full"))
    assert none["peak"] == none["argument"] + none["output"] + none["temp"] - none["alias"]
    assert full["temp"] < none["temp"] and full["argument"] == none["argument"]


def test_every_row_is_committed_and_named_once():
    rows = json.loads(COMMITTED.read_text())["rows"]
    names = [n for n in memory.rows(smoke=False) if n != "shard/"]
    assert set(names) | {f"shard/{n}" for n in (2, 4, 8)} == set(rows)


@pytest.mark.slow  # compiles most rows again (CHECKED)
def test_the_committed_figures_are_what_the_code_compiles(tmp_path):
    for_h100 = ("lm_loss/", "optimizer_state/", "paper/", "frontier/")  # rows with H100 figures
    checked = CHECKED if HAS_GPU_TARGET else tuple(c for c in CHECKED if not c.startswith(for_h100))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", *checked, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=2400, env=users_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    fresh = json.loads((tmp_path / "memory_grid.json").read_text())["rows"]
    committed = json.loads(COMMITTED.read_text())["rows"]
    assert set(fresh) == {n for n in committed if n.startswith(checked)}
    stale = [n for n in fresh if fresh[n] != committed[n]]
    assert not stale, (
        f"benchmarks/results/memory_grid.json is stale for {stale}: run "
        "`python benchmarks/memory.py` and `python benchmarks/readme.py`."
    )


@pytest.mark.slow  # compiles one WideResNet step
def test_a_smoke_frontier_row_compiles_at_micro_batches_of_one():
    # The smoke batch (20) is smaller than the row's 100 micro-batches: the row caps them
    # at the batch, as the paper's rows do, instead of failing.
    cfg = memory.SMOKE["frontier"]
    assert memory.quality.ALL_CONFIGS["combined_micro1"]["accumulate"] > cfg["batch"]
    row = memory.frontier_row(cfg, "combined_micro1", gpu=False)
    assert set(row) == {"peak"} and row["peak"] > 0
