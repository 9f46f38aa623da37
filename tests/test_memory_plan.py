"""The planner: the fastest fitting combination, monotone in the budget; and the plots."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest
from hypothesis import given, settings, strategies as st

import eqx_lowmem as el
from eqx_lowmem.memory import _search

BATCH = 8


def make_model(remat):
    return el.nn.transformer_encoder(2, 32, 4, 64, key=jr.PRNGKey(0), remat=remat)


def _batch():
    x = jax.ShapeDtypeStruct((BATCH, 16, 32), jnp.float32)
    return (x, x)


@pytest.fixture(scope="module")
def planned():
    """A plan over 2 remats x 2 usable accumulates x 2 precisions, with room for all."""
    return el.memory.plan(
        make_model,
        el.train.mse,
        optax.adam(1e-3),
        _batch(),
        budget="1GiB",
        remats=(False, True),
        accumulates=(1, 2, 3),
        precisions=("float32", "mixed_bf16"),
        prune=False,
    )


def test_plan_returns_the_fastest_fitting_combination(planned):
    assert planned.budget == 2**30 and planned.peak == "compiled"
    assert len(planned.candidates) == 8
    assert planned.skipped == ("accumulate=3: does not divide the batch of 8",)
    best = planned.best
    assert best.fits and best.peak_bytes <= planned.budget
    # Everything fits: the fewest matrix FLOPs (no recomputation), one micro-batch, and on
    # XLA:CPU float32 compute (which it runs natively).
    assert (best.remat, best.accumulate, best.precision) == (False, 1, "float32")
    assert best.flops == min(c.flops for c in planned.candidates if c.precision == "float32")
    for c in planned.candidates:
        assert c.peak_bytes == c.report.peak_bytes
        assert c.flops == c.report.cost.flops
        assert c.report.config["accumulate"] == c.accumulate
        assert c.report.config["remat"] == ("full" if c.remat else "none")
    # Recomputation costs matrix FLOPs; micro-batches do not.
    by = {(c.remat, c.accumulate, c.precision): c for c in planned.candidates}
    assert by[True, 1, "float32"].report.cost.matmul_flops > best.report.cost.matmul_flops
    assert by[False, 2, "float32"].report.cost.matmul_flops == best.report.cost.matmul_flops
    text = str(planned)
    assert "<- best" in text and "skipped: accumulate=3" in text


def test_a_tighter_budget_trades_speed_for_memory(planned):
    smallest = min(c.peak_bytes for c in planned.candidates)
    tight = planned.within(smallest)
    assert tight.best.peak_bytes == smallest
    assert tight.best.fits and sum(c.fits for c in tight.candidates) >= 1
    # Between: the choice fits, and every faster candidate does not.
    middle = planned.within((smallest + planned.best.peak_bytes) // 2)
    assert middle.best.peak_bytes <= middle.budget
    assert middle.best.peak_bytes < planned.best.peak_bytes


def test_a_smaller_budget_never_returns_a_larger_peak(planned):
    peaks = sorted({c.peak_bytes for c in planned.candidates})
    budgets = sorted({p + d for p in peaks for d in (-1, 0, 1)} | {2**30}, reverse=True)
    chosen = []
    for budget in budgets:
        try:
            chosen.append(planned.within(budget).best.peak_bytes)
        except el.memory.BudgetError:
            assert budget < peaks[0]
    assert chosen == sorted(chosen, reverse=True)
    assert len(chosen) == sum(b >= peaks[0] for b in budgets)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_monotone_for_any_pair_of_budgets(planned, data):
    lo = min(c.peak_bytes for c in planned.candidates)
    hi = max(c.peak_bytes for c in planned.candidates)
    small = data.draw(st.integers(lo, hi))
    large = data.draw(st.integers(small, hi + 1))
    assert planned.within(small).best.peak_bytes <= planned.within(large).best.peak_bytes


def test_planning_for_an_accelerator_prefers_16_bit_compute(planned):
    # Same candidates, ranked for a GPU: equal matrix FLOPs go to bf16 compute.
    for_gpu = dataclasses.replace(planned, peak="accelerator").within(planned.budget)
    assert (for_gpu.best.remat, for_gpu.best.accumulate) == (False, 1)
    assert for_gpu.best.precision == "mixed_bf16"


@pytest.mark.parametrize("between", [0.0, 0.5, 1.0])
def test_pruning_compiles_less_for_the_same_choice(planned, between, monkeypatch):
    # A budget from the smallest peak to the largest: the pruned plan picks what the full
    # one picks, compiling the candidates ranked up to its choice and no other, and tracing
    # (for the estimated time) the first of each of the 4 groups that differ only in
    # accumulate, then one more of a group only after compiling the one before.
    peaks = sorted(c.peak_bytes for c in planned.candidates)
    budget = int(peaks[0] + between * (peaks[-1] - peaks[0]))
    full = planned.within(budget)
    args = (make_model, el.train.mse, optax.adam(1e-3), _batch())
    space = dict(remats=(False, True), accumulates=(1, 2, 3), precisions=("float32", "mixed_bf16"))
    traced = []
    cost = _search.Compiler.cost
    monkeypatch.setattr(_search.Compiler, "cost", lambda *a: traced.append(a[2]) or cost(*a))
    pruned = el.memory.plan(*args, budget=budget, **space)
    assert len(traced) <= 4 + len(pruned.candidates)
    assert pruned.best.label == full.best.label
    assert pruned.best.peak_bytes == full.best.peak_bytes
    assert len(pruned.candidates) + len(pruned.pruned) == len(planned.candidates)
    if between > 0:  # (the smallest budget fits only the last-ranked: all are compiled)
        assert len(pruned.candidates) < len(planned.candidates)
    assert all("not compiled: " in str(pruned) for _ in pruned.pruned)
    if pruned.pruned:
        with pytest.raises(ValueError, match="call plan again, or plan.*prune=False"):
            pruned.within(budget - 1)


def test_a_candidate_whose_state_alone_exceeds_the_budget_is_not_compiled():
    args = (make_model, el.train.mse, optax.adam(1e-3), _batch())
    space = dict(remats=(False,), accumulates=(1,), precisions=("float32",))
    state = el.memory.plan(*args, budget="1GiB", **space).best.report.parts["parameters"] * 4
    with pytest.raises(el.memory.BudgetError, match="state and batch alone take") as info:
        el.memory.plan(*args, budget=state // 2, **space)
    assert info.value.candidates == ()


def test_an_impossible_budget_names_the_smallest_peak_and_its_largest_part():
    with pytest.raises(el.memory.BudgetError) as info:
        el.memory.plan(
            make_model,
            el.train.mse,
            optax.adam(1e-3),
            _batch(),
            budget="64KiB",
            remats=(True,),
            accumulates=(2,),
            precisions=("float32",),
            prune=False,
        )
    error = info.value
    (only,) = error.candidates
    assert error.smallest is only and not only.fits
    part, _ = only.report.dominant
    message = str(error)
    assert "budget=64.0 KiB" in message
    assert el.memory._units.format_bytes(only.peak_bytes) in message
    assert "remat=full, accumulate=2, precision=float32" in message
    assert el.memory._result.PART_LABELS[part] in message


def test_errors_name_the_argument(planned):
    args = (make_model, el.train.mse, optax.sgd(0.1), _batch())
    with pytest.raises(ValueError, match="not a byte size"):
        el.memory.plan(*args, budget="lots")
    with pytest.raises(ValueError, match="no accumulate in .3, 5. divides the batch of 8"):
        el.memory.plan(*args, budget="1GiB", accumulates=(3, 5))
    with pytest.raises(ValueError, match="nothing to search"):
        el.memory.plan(*args, budget="1GiB", remats=())
    with pytest.raises(ValueError, match="target='tpu9' is not a known target"):
        el.memory.plan(*args, budget="1GiB", target="tpu9")
    with pytest.raises(ValueError, match="peak='gpu'; expected one of"):
        el.memory.plan(*args, budget="1GiB", peak="gpu")
    with pytest.raises(ValueError, match="plan needs budget= for target='cpu'"):
        el.memory.plan(*args)


def tiny(remat):
    return el.nn.transformer_encoder(1, 16, 2, 32, key=jr.PRNGKey(0), remat=remat)


def test_measured_plan_times_the_fitting_candidates():
    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    result = el.memory.plan(
        tiny,
        el.train.mse,
        optax.sgd(0.1),
        (x, x),
        budget="1GiB",
        remats=(False,),
        accumulates=(1,),
        precisions=("float32",),
        measure=True,
        steps=1,
    )
    assert result.ranked_by == "measured"
    assert result.best.seconds is not None and result.best.seconds > 0
    assert "s/step" in str(result)


def test_plan_json_and_plots(planned, tmp_path):
    payload = json.loads(planned.to_json(tmp_path / "plan.json"))
    assert json.loads((tmp_path / "plan.json").read_text()) == payload
    assert len(payload["candidates"]) == 8
    best = payload["candidates"][payload["best"]]
    assert (best["remat"], best["accumulate"], best["precision"]) == ("none", 1, "float32")

    scatter = tmp_path / "plan.png"
    el.memory.plot_plan(planned, scatter)
    reports = [c.report for c in planned.candidates[:3]]
    bars = tmp_path / "bars.png"
    el.memory.plot_report(reports, bars, budget=int(1.2 * max(r.peak_bytes for r in reports)))
    pie = tmp_path / "pie.png"
    el.memory.plot_report(reports[0], pie, kind="pie")
    image = pytest.importorskip("matplotlib.image")
    for path in (scatter, bars, pie):
        pixels = image.imread(path)
        assert pixels.shape[0] > 500 and pixels.shape[1] > 800  # 150 dpi, a few inches
        assert pixels.std() > 0.05  # not blank
    # Written atomically: nothing but the outputs is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bars.png",
        "pie.png",
        "plan.json",
        "plan.png",
    ]
    with pytest.raises(ValueError, match="2 labels for 3 reports"):
        el.memory.plot_report(reports, labels=["a", "b"])
    with pytest.raises(ValueError, match="kind="):
        el.memory.plot_report(reports, kind="donut")


# ------------------------------------------------------------- issues 10, 11, 14, 15


def test_ranking_knows_the_backend_and_says_what_it_is_based_on(planned):
    # Described as a GPU (16-bit products at twice float32's rate): bf16 wins; as a CPU
    # (which converts 16-bit operands to float32): float32 wins. Equal matrix FLOPs.
    for_gpu = dataclasses.replace(planned, rank_for="gpu").within(planned.budget)
    assert (for_gpu.best.remat, for_gpu.best.accumulate) == (False, 1)
    assert for_gpu.best.precision == "mixed_bf16"
    for_cpu = dataclasses.replace(planned, rank_for="cpu").within(planned.budget)
    assert for_cpu.best.precision == "float32"
    by = {(c.remat, c.accumulate, c.precision): c for c in planned.candidates}
    f32, bf16 = by[False, 1, "float32"].report.cost, by[False, 1, "mixed_bf16"].report.cost
    assert f32.matmul_flops == bf16.matmul_flops and f32.matmul_flops_16bit == 0
    assert bf16.matmul_flops_16bit == bf16.matmul_flops
    gpu = el.memory._cost.THROUGHPUTS["gpu"]
    assert el.memory._cost.relative_time(bf16, gpu) < el.memory._cost.relative_time(f32, gpu)
    assert "Ranked by estimated step time on a GPU" in str(for_gpu)
    assert "Ranked by estimated step time on a CPU" in str(planned)
    assert json.loads(for_gpu.to_json())["ranking"].startswith("estimated step time on a GPU")


def test_fits_follows_from_the_budget_and_the_peak(planned):
    smallest = min(c.peak_bytes for c in planned.candidates)
    tight = planned.within(smallest)
    for c in (*planned.candidates, *tight.candidates):
        assert c.fits == (c.peak_bytes <= c.budget)
    assert all(c.budget == smallest for c in tight.candidates)
    assert sum(c.fits for c in tight.candidates) < sum(c.fits for c in planned.candidates)


def test_plan_reports_progress_per_candidate():
    lines = []
    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    result = el.memory.plan(
        tiny,
        el.train.mse,
        optax.sgd(0.1),
        (x, x),
        budget="1GiB",
        remats=("none",),
        accumulates=(1, 2),
        precisions=("float32",),
        progress=lines.append,
        prune=False,
    )
    assert len(lines) == len(result.candidates) == 2
    assert lines[0].startswith("[1/2] remat=none, accumulate=1, precision=float32: peak ")
    assert lines[1].startswith("[2/2] remat=none, accumulate=2")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"accumulates": (0,)}, "accumulates=.0,.: 0 is not a number of micro-batches"),
        ({"accumulates": (2, -1)}, "-1 is not a number of micro-batches"),
        ({"accumulates": (True,)}, "True is not a number of micro-batches"),
        ({"densities": (0.0,)}, "0.0 is not a density"),
        ({"densities": (1.5,)}, "1.5 is not a density"),
        ({"shards": ("zero",)}, "'zero' is not one of"),
        ({"rank_for": "quantum"}, "rank_for='quantum'"),
    ],
)
def test_bad_search_spaces_are_refused_before_compiling(kwargs, match):
    def never(remat):
        raise AssertionError("make_model must not be called")

    with pytest.raises(ValueError, match=match):
        el.memory.plan(never, el.train.mse, optax.sgd(0.1), _batch(), budget="1GiB", **kwargs)


def test_densities_are_a_knob_and_the_densest_fitting_one_wins():
    pytest.importorskip("eqx_lowmem.sparse")

    def make(remat):
        return el.nn.mlp([64, 256, 256, 8], key=jr.PRNGKey(0))

    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    result = el.memory.plan(
        make,
        el.train.mse,
        optax.adam(1e-3),
        (x, y),
        budget="1GiB",
        remats=("none",),
        accumulates=(1,),
        precisions=("float32",),
        densities=(None, 0.3),
        prune=False,
    )
    dense, sparse = result.candidates
    assert (dense.density, sparse.density) == (None, 0.3)
    assert sparse.report.config["density"] == pytest.approx(0.3, abs=0.01)
    state = ("parameters", "optimizer")
    assert sum(sparse.report.parts[p] for p in state) < 0.5 * sum(
        dense.report.parts[p] for p in state
    )
    assert result.best is dense  # everything fits: the dense model
    assert "density=0.3" in sparse.label and "density" in str(result)
