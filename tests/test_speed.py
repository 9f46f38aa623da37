"""benchmarks/speed.py, the speed grid (`--device gpu` is the GPU run): its smoke mode runs
every configuration at tiny sizes in a real worker process and writes the JSON a GPU run
would; its goal and consistency logic, on made-up figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py"


gpu = load_benchmark("speed")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed") / "speed.json"
    scratch = tmp_path_factory.mktemp("tmpdir")  # the run's temporary files, and workers'
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), out, proc.stdout, scratch


@pytest.mark.slow  # the whole script's smoke run
def test_smoke_runs_every_configuration(smoke):
    record, *_ = smoke
    configs = record["configs"]
    assert list(configs) == list(gpu.CONFIGS)
    for name, result in configs.items():
        assert "error" not in result, (name, result.get("error"), result.get("traceback"))
        assert "skipped" not in result, name
        assert result["step_s"] > 0 and result["updates_per_s"] > 0, name
    # The memory report records the attention implementation the model's "auto" resolves to.
    assert configs["guide/none"]["report"]["attention"] == {"auto": "chunked"}


@pytest.mark.slow  # the whole script's smoke run
def test_smoke_records_null_peaks_on_cpu_and_the_environment(smoke):
    record, *_ = smoke
    assert record["mode"] == "smoke"
    env = record["environment"]
    assert env["backend"] == "cpu" and env["date"]
    assert {"jax", "jaxlib", "equinox", "optax", "numpy"} <= set(env["versions"])
    assert record["environment_variables"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    for name, result in record["configs"].items():
        if "step_s" in result:
            assert result["peak"] is None, name  # device.memory_stats() is None on CPU
    # Compile-only figures still exist: the memory report and the host-memory figures.
    report = record["configs"]["guide/none"]["report"]
    assert report["predicted"] > 0 and report["trusted"] == "peak_bytes"
    compiled = record["configs"]["guide/minimal"]["compiled"]
    assert compiled["peak"] > 0 and compiled["host_temp"] == 0  # CPU drops host placement


@pytest.mark.slow  # the whole script's smoke run
def test_smoke_evaluates_goals_and_checks(smoke):
    record, _, stdout, _ = smoke
    goals = record["goals"]
    assert set(goals) == set(gpu.GOALS) | {"report_within_5_percent"}
    for name in ("full_remat_peak", "selective_remat_peak", "report_within_5_percent"):
        assert goals[name]["ratio"] is None and goals[name]["met"] is None, name  # no peaks
    for name in ("full_remat_time", "accumulate_vs_multisteps", "check_data_stall"):
        assert goals[name]["ratio"] > 0 and goals[name]["met"] in (True, False), name
    # Remat and accumulation change the schedule, not the arithmetic.
    assert record["checks"]["float32"]["ok"], record["checks"]
    assert "guide/full_accumulate_4" in record["checks"]["float32"]["names"]
    accumulate = record["checks"]["accumulate"]
    assert accumulate["ok"] and accumulate["names"] == ["accumulate/k1", "accumulate/k4"]
    assert "wrote" in stdout
    # Each row against its group's baseline, timed in the same rounds.
    none, full = record["configs"]["guide/none"], record["configs"]["guide/full"]
    assert none["time_vs_base"] == 1.0 and full["time_vs_base"] > 0
    assert len(none["step_s_all"]) == len(full["step_s_all"]) >= 2


@pytest.mark.slow  # the whole script's smoke run
def test_smoke_runs_configurations_in_a_worker_process(smoke):
    record, out, _, scratch = smoke
    pids = {r["pid"] for r in record["configs"].values()}
    assert len(pids) == 1 and pids != {os.getpid()}
    # Written atomically: no temporary left beside the JSON.
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    # Nor anywhere else: the workers' results and the compilation cache go with the run.
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_refuses_the_gpu_run_without_a_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "gpu", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "not a GPU: run with --smoke (tiny sizes) or --device cpu" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def _gpu_like() -> dict:
    mib = 2**20
    return {
        "guide/none": {"peak": 1000 * mib, "step_s": 0.100, "updates_per_s": 10.0},
        "guide/full": {"peak": 190 * mib, "step_s": 0.125, "updates_per_s": 8.0},
        # dots: less memory but too slow; minimal meets the time goal.
        "guide/dots": {"peak": 400 * mib, "step_s": 0.120, "updates_per_s": 8.3},
        "guide/minimal": {"peak": 550 * mib, "step_s": 0.105, "updates_per_s": 9.5},
        "accumulate/k1": {"peak": 1000 * mib, "step_s": 0.100, "updates_per_s": 10.0},
        "accumulate/k4": {"peak": 400 * mib, "step_s": 0.104, "updates_per_s": 9.6},
        "accumulate/multisteps_k4": {"peak": 600 * mib, "step_s": 0.150, "updates_per_s": 6.6},
        "fit/trainer": {"step_s": 0.11, "updates_per_s": 9.0},
        "fit/trainer_unchecked": {"step_s": 0.1, "updates_per_s": 10.0},
    }


def test_goals_on_gpu_like_figures():
    results = _gpu_like()
    results["guide/none"]["report"] = {"predicted": 1030 * 2**20}
    results["guide/full"]["report"] = {"predicted": 180 * 2**20}
    goals = gpu.evaluate_goals(results)
    assert goals["full_remat_peak"]["ratio"] == pytest.approx(0.19)
    assert goals["full_remat_peak"]["met"] is True
    assert goals["full_remat_time"]["ratio"] == pytest.approx(1.25)
    # The selective preset is minimal: the one of those meeting the time goal.
    assert goals["selective_remat_peak"]["of"].startswith("guide/minimal /")
    assert goals["selective_remat_peak"]["met"] is True
    assert goals["accumulate_vs_whole_batch"]["met"] is True  # 0.96
    assert goals["accumulate_vs_multisteps"]["met"] is True  # 9.6 / 6.6
    assert goals["check_data_stall"]["met"] is False  # 0.9
    report = goals["report_within_5_percent"]
    assert report["ratio"] == pytest.approx(180 / 190 - 1)  # the worst, -5.3%
    assert report["met"] is False
    assert set(report["of"]) == {"guide/none", "guide/full"}


def test_goals_missing_figures_are_none_not_failures():
    results = _gpu_like()
    del results["guide/full"]
    results["accumulate/multisteps_k4"] = {"error": "a broken piece"}
    goals = gpu.evaluate_goals(results)
    assert goals["full_remat_peak"]["ratio"] is None and goals["full_remat_peak"]["met"] is None
    assert goals["accumulate_vs_multisteps"]["met"] is None
    assert goals["report_within_5_percent"]["met"] is None


def test_times_taken_side_by_side_compare_round_by_round():
    # In one process (CPU), a ratio is the median of the rounds' ratios, not of the medians:
    # a round slowed for both by the machine's load cancels out.
    results = _gpu_like()
    results["guide/none"] |= {"pid": 7, "step_s_all": [1.0, 2.0, 10.0]}
    results["guide/full"] |= {"pid": 7, "step_s_all": [1.3, 2.4, 11.0]}
    goals = gpu.evaluate_goals(results)
    assert goals["full_remat_time"]["ratio"] == pytest.approx(1.2)  # of 1.3, 1.2, 1.1
    assert goals["full_remat_time"]["met"] is True
    # Timed in another process: no pairs, the ratio of their step times.
    results["guide/full"]["pid"] = 8
    assert gpu.evaluate_goals(results)["full_remat_time"]["ratio"] == pytest.approx(0.125 / 0.1)


def test_consistency_check_flags_a_different_loss():
    same = {"loss": 1.0, "grad_norm": 2.0}
    results = {
        "guide/none": same,
        "guide/full": {"loss": 1.0 + 1e-4, "grad_norm": 2.0},
        "accumulate/k1": same,
        "accumulate/k4": {"loss": 1.2, "grad_norm": 2.0},
    }
    checks = gpu.check_consistency(results)
    assert checks["float32"]["ok"] and checks["float32"]["names"] == ["guide/none", "guide/full"]
    assert not checks["accumulate"]["ok"]
    assert checks["accumulate"]["max_rel_diff"] == pytest.approx(0.2)
