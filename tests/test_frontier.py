"""benchmarks/quality.py: accuracy against compiled memory, the Pareto front and the
README's budget table read from its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from .test_wrn import TYPE_CHECKED_RUN, _need_fashion_mnist

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "benchmarks" / "quality.py"


def _frontier():
    import importlib.util

    sys.path.insert(0, str(SCRIPT.parent))  # it imports _common
    spec = importlib.util.spec_from_file_location("quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(name, peak, accuracy, spread=0.002, dense=True):
    return {
        "config": name,
        "compiled_peak_bytes": peak,
        "test_accuracy": accuracy,
        "test_accuracy_spread": spread,
        "step_s": 0.1,
        "uses": name,
        "dense": dense,
    }


def test_the_front_keeps_what_nothing_cheaper_beats_and_the_goal_compares_dense_rows():
    frontier = _frontier()
    rows = [
        _row("big", 80e6, 0.91),
        _row("big_worse", 90e6, 0.90),  # more memory, less accuracy: off the front
        _row("combined", 7e6, 0.89, spread=0.004, dense=False),
        _row("tiny", 2e6, 0.85),
        _row("dense_same", 7e6, 0.886),  # within the spread of the combination
        _row("dense_better", 6e6, 0.895),  # 0.6 points better, spread 0.4: a finding
        _row("dense_above", 9e6, 0.95),  # does not fit the combination's peak
    ]
    front = frontier.pareto_front(rows)
    assert front == ["tiny", "dense_better", "dense_above"]
    goal = frontier.goal(rows, "combined")
    assert set(goal["dense_that_fit"]) == {"tiny", "dense_same", "dense_better"}
    assert goal["dense_better_by_more_than_spread"] == ["dense_better"]
    assert goal["met"] is False
    assert frontier.goal([r for r in rows if r["config"] != "dense_better"], "combined")["met"]
    table = frontier.budget_table({"rows": rows, "pareto_front": front})
    assert table[2].startswith("| 2.0 - 6.0 MB | `tiny`")
    assert table[-1].startswith("| 9.0 MB or more | `dense_above`")
    assert len(table) == 2 + len(front)


@pytest.mark.slow  # builds every configuration of the benchmark's grid
def test_every_configuration_of_the_grid_reaches_its_step_and_model():
    # Each row's settings must reach make_step (precision, micro-batches, their dtype,
    # DSR's hook) and the model (depth, width, recomputation, density), or the grid would
    # train other configurations than its names say.
    import eqx_lowmem as el

    frontier = _frontier()
    cfg = frontier.FRONTIER_QUICK
    assert len(frontier.CONFIGS) >= 10 and set(frontier.COMBINATIONS) <= set(frontier.CONFIGS)
    for name, opts in frontier.CONFIGS.items():
        step = frontier.make_config_step(cfg, opts)
        c = step.config
        assert c.accumulate == opts["accumulate"], name
        assert c.accumulate_dtype == jnp.dtype(opts.get("accumulate_dtype", "float32")), name
        half = opts["precision"] == "half_fp16"
        assert c.policy.param_dtype == (jnp.float16 if half else jnp.float32), name
        assert (c.after_update is not None) == (opts["density"] is not None), name
        model = frontier.init_state(0, cfg, step, opts).model
        assert model.depth == opts.get("depth", cfg["depth"]), name
        assert model.width == opts.get("width", cfg["width"]), name
        density = el.sparse.density(model) if opts["density"] is not None else None
        if density is not None:
            assert abs(density - opts["density"]) < 0.01, name
        else:
            assert not el.sparse._convert.sparse_layers(model), name


@pytest.mark.slow  # traces the benchmark's WideResNet three times
def test_checkpoint_residual_3_is_checkpoint_residual_1_on_the_grids_depth():
    # The JSON's note: with one block per group, no segment of 3 exists, so the row
    # checkpoint3 would train the very program of checkpoint1 (the same gradient's jaxpr).
    import equinox as eqx
    import jax.random as jr

    import eqx_lowmem as el

    frontier = _frontier()
    cfg = frontier.FRONTIER
    x = jnp.zeros((2, 1, 28, 28))

    def gradient_jaxpr(remat):
        model, state = eqx.nn.make_with_state(el.nn.WideResNet)(
            cfg["depth"], cfg["width"], 10, key=jr.PRNGKey(0), in_channels=1, remat=remat
        )
        loss = lambda m: jnp.sum(m.batched(x, state)[0])  # noqa: E731
        return str(eqx.filter_make_jaxpr(eqx.filter_grad(loss))(model)[0])

    assert gradient_jaxpr("checkpoint-residual-3") == gradient_jaxpr("checkpoint-residual-1")
    assert gradient_jaxpr("checkpoint-residual-1") != gradient_jaxpr(False)


@pytest.mark.slow
def test_quick_frontier_run_writes_rows_front_table_and_plot(tmp_path):
    # The script as a user runs it, at the suite's size: 3 configurations of the grid, each
    # in its own worker (two at a time), 2 seeds of 2 updates on real Fashion-MNIST.
    _need_fashion_mnist()
    env = dict(os.environ)
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
    env["JAX_NUMPY_RANK_PROMOTION"] = "raise"
    proc = subprocess.run(
        [sys.executable, "-c", TYPE_CHECKED_RUN, SCRIPT, "--quick", "--out",
         tmp_path],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "frontier_quick.json").read_text())
    assert (tmp_path / "frontier_quick.png").stat().st_size > 0
    frontier = _frontier()
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == frontier.QUICK_CONFIGS
    assert len(result["load_average"]["before"]) == 3 and result["workers"] == 2
    for name, r in rows.items():
        m = r["memory"]
        assert r["compiled_peak_bytes"] == m["argument"] + m["output"] + m["temp"] - m["alias"]
        accuracies = [run["test_accuracy"][-1] for run in r["runs"].values()]
        assert list(r["runs"]) == ["0", "1"] and all(0 <= a <= 1 for a in accuracies)
        assert r["test_accuracy"] == pytest.approx(np.mean(accuracies))
        assert r["test_accuracy_spread"] == pytest.approx(abs(accuracies[0] - accuracies[1]))
        assert r["step_s"] is not None and r["step_s"] > 0
        assert r["trained"]["updates"] == 2 and r["trained"]["images"] == 40
        assert r["dense"] == (frontier.CONFIGS[name]["density"] is None)
    # Micro-batches of 2 keep a tenth of the activations: the compiled peak says so.
    assert rows["combined"]["compiled_peak_bytes"] < rows["fp32"]["compiled_peak_bytes"] / 2
    assert rows["combined"]["runs"]["0"]["density"] == pytest.approx(0.3, abs=0.01)
    # The front: increasing peak and accuracy, and every row off it beaten by a cheaper one.
    front = [rows[n] for n in result["pareto_front"]]
    peaks = [r["compiled_peak_bytes"] for r in front]
    accuracy = [r["test_accuracy"] for r in front]
    assert peaks == sorted(peaks) and accuracy == sorted(accuracy)
    for name, r in rows.items():
        if name not in result["pareto_front"]:
            assert any(
                f["compiled_peak_bytes"] <= r["compiled_peak_bytes"]
                and f["test_accuracy"] >= r["test_accuracy"]
                for f in front
            ), name
    assert result["budget_table"] == frontier.budget_table(result)
    assert [g["combination"] for g in result["goal"]] == ["combined"]


def test_the_committed_frontier_is_what_its_rows_give():
    # benchmarks/results/frontier.json: the front, the budget table (which the README
    # prints) and the goal recomputed from its rows; a hand edit of any of them fails here.
    frontier = _frontier()
    result = json.loads((ROOT / "benchmarks" / "results" / "frontier.json").read_text())
    rows = result["rows"]
    assert len(rows) >= 10 and all(len(r["runs"]) == 2 for r in rows)  # the grid
    for r in rows:
        final = [run["test_accuracy"][-1] for run in r["runs"].values()]
        assert r["test_accuracy"] == pytest.approx(sum(final) / 2, abs=1e-12)
        assert r["test_accuracy_spread"] == pytest.approx(max(final) - min(final), abs=1e-12)
        assert r["compiled_peak_bytes"] == r["memory"]["peak"]
    assert result["pareto_front"] == frontier.pareto_front(rows)
    assert result["budget_table"] == frontier.budget_table(result)
    combinations = [g["combination"] for g in result["goal"]]
    assert result["goal"] == [frontier.goal(rows, c) for c in combinations]
