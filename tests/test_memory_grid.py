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
# The rows compiled again by the slow suite (about a minute on 2 cores): the README's remat
# figures, a precision and an accumulation row, the shards, sparse storage against dense and
# the paper's cheapest combination (on XLA:CPU and for an H100). `python benchmarks/memory.py`
# compiles all.
CHECKED = ("guide/none", "guide/full", "guide/minimal", "precision/mixed_bf16",
           "accumulate/k4", "shard/", "sparse/dense", "sparse/ours",
           "paper/fp16_checkpoint_micro100_sparse30")  # fmt: skip
# The H100 target compiles with JAX's CUDA plugin (the test extra installs it).
HAS_GPU_TARGET = importlib.util.find_spec("jax_cuda12_plugin") is not None

memory = load_benchmark("memory")


def test_a_smoke_row_measures_what_remat_saves():
    cfg = memory.SMOKE["guide"]
    none, full = (memory.guide_row(cfg, {"remat": r}) for r in ("none", "full"))
    assert none["peak"] == none["argument"] + none["output"] + none["temp"] - none["alias"]
    assert full["temp"] < none["temp"] and full["argument"] == none["argument"]


def test_every_row_is_committed_and_named_once():
    rows = json.loads(COMMITTED.read_text())["rows"]
    names = [n for n in memory.rows(smoke=False) if n != "shard/"]
    assert set(names) | {f"shard/{n}" for n in (2, 4, 8)} == set(rows)


@pytest.mark.slow  # compiles the guide's transformer and a WRN-28-2 again
def test_the_committed_figures_are_what_the_code_compiles(tmp_path):
    checked = CHECKED if HAS_GPU_TARGET else tuple(c for c in CHECKED if "paper/" not in c)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", *checked, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=users_env(),
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
