"""Low precision: policies, dynamic loss scaling (GradScaler's rules), skipped updates,
stochastic rounding, 16-bit optimizer state, and what each preset keeps in memory."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.nn._attention import attention
from eqx_lowmem.precision import Policy, dynamic_loss_scale
from eqx_lowmem.precision._policy import PRESETS

from .helpers import tree_allclose

BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7
FP16_EPS = float(jnp.finfo(jnp.float16).eps)  # 2**-10


def _snapshot(tree):
    """Host copies of the arrays of `tree` (steps donate their input state)."""
    return jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, tree)


def _identical(a, b) -> bool:
    """Same structure, dtypes and bits."""
    a, b = _snapshot(a), _snapshot(b)
    same_structure = jax.tree.structure(a) == jax.tree.structure(b)
    return same_structure and all(
        x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        if isinstance(x, np.ndarray)
    )


def _params(state):
    return eqx.filter(state.model, eqx.is_inexact_array)


def _relative_error(x, y) -> float:
    """||x - y|| / ||y|| over all floating leaves, in float64."""
    xs = [np.asarray(a, np.float64) for a in jax.tree.leaves(x)]
    ys = [np.asarray(b, np.float64) for b in jax.tree.leaves(y)]
    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(xs, ys, strict=True))
    den = sum(float(np.sum(b**2)) for b in ys)
    return (num / den) ** 0.5


# -- policies ---------------------------------------------------------------------------------


def test_presets():
    f32, bf16, f16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
    expected = {
        "float32": (f32, f32, None, False),
        "mixed_bf16": (f32, bf16, None, False),
        "mixed_fp16": (f32, f16, None, True),
        "half_bf16": (bf16, bf16, bf16, False),
        # float16 parameters, but bfloat16 optimizer state (float16 flushes Adam's v to 0).
        "half_fp16": (f16, f16, bf16, True),
    }
    got = {
        name: (p.param_dtype, p.compute_dtype, p.opt_state_dtype, p.needs_loss_scale)
        for name, p in PRESETS.items()
    }
    assert got == expected
    assert all(p.output_dtype == f32 for p in PRESETS.values())
    assert el.precision.get_policy(None) == PRESETS["float32"]
    assert el.precision.get_policy("half_bf16") is PRESETS["half_bf16"]
    mixed = Policy(jnp.float32, jnp.bfloat16)
    assert el.precision.get_policy(mixed) is mixed and mixed == PRESETS["mixed_bf16"]


def test_policy_casts_only_floating_leaves():
    tree = {"w": jnp.ones(2), "i": jnp.arange(2), "f": 1.5, "n": None}
    out = PRESETS["half_fp16"].cast_to_param(tree)
    assert out["w"].dtype == jnp.float16 and out["i"].dtype == jnp.int32
    assert out["f"] == 1.5 and out["n"] is None


def test_policy_and_preset_errors():
    with pytest.raises(ValueError, match=r"precision='bf16' is not a preset.*mixed_bf16"):
        el.precision.get_policy("bf16")
    with pytest.raises(ValueError, match=r"Policy\(compute_dtype=.*float64.*expected one of"):
        Policy(jnp.float32, jnp.float64)
    with pytest.raises(ValueError, match=r"output_dtype=bfloat16.*always float32"):
        Policy(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
    with pytest.raises(ValueError, match="precision='fp8'"):
        el.train.make_step(el.train.mse, optax.sgd(0.1), precision="fp8")


# -- dynamic loss scale: GradScaler's rules ----------------------------------------------------


def test_loss_scale_arguments():
    ls = dynamic_loss_scale()
    assert (float(ls.scale), int(ls.good_steps)) == (2.0**16, 0)
    assert (ls.growth_interval, ls.growth_factor, ls.backoff_factor) == (2000, 2.0, 0.5)
    for kwargs, match in [
        ({"initial": 0.0}, "initial loss scale"),
        ({"initial": float("inf")}, "initial loss scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
    ]:
        with pytest.raises(ValueError, match=match):
            dynamic_loss_scale(**kwargs)
    # Our TypeError, or the tests' runtime type checker first; both name the argument.
    with pytest.raises(TypeError, match="loss_scale"):
        el.train.make_step(el.train.mse, optax.sgd(0.1), loss_scale=2.0**16)


def test_scale_and_unscale_float16_values():
    # 2**16 is beyond float16's largest number (65504): scaling must happen in float32.
    ls = dynamic_loss_scale()
    assert ls.scale_loss(jnp.asarray(3.0, jnp.float16)) == 3.0 * 2.0**16
    # 1 / 2**-20 overflows float16 too: unscaling computes in float32 and casts back.
    small = dynamic_loss_scale(2.0**-20)
    g = {"w": jnp.asarray([2.0**-20, 2.0**-18], jnp.float16), "i": jnp.arange(2)}
    out = small.unscale(g)
    assert out["w"].dtype == jnp.float16 and out["w"].tolist() == [1.0, 4.0]
    assert out["i"] is g["i"]


def test_growth_stops_at_float32_range():
    # GradScaler keeps the scale when growing would overflow float32.
    ls = dynamic_loss_scale(2.0**127, growth_interval=1)
    grown = ls.adjust(jnp.asarray(True))
    assert float(grown.scale) == 2.0**127 and int(grown.good_steps) == 0


def _flagged_mse(model, x, y, flag):
    # A planted overflow: a flagged sample's loss, and so every gradient, is not finite.
    return el.train.mse(model, x, y) * jnp.where(flag > 0, jnp.inf, 1.0)


def _run_trace(trace, loss_scale, *, accumulate=1):
    """Drive the real step through `trace` (True: a finite batch; False: one with a planted
    overflow). Returns the scale each update used and the final scale, and checks that every
    non-finite update left parameters, optimizer state and the counter bit-identical."""
    model = el.nn.mlp([2, 3, 2], key=jr.PRNGKey(0))
    optimizer = optax.sgd(0.05, momentum=0.9)
    step = el.train.make_step(_flagged_mse, optimizer, loss_scale=loss_scale, accumulate=accumulate)
    state = step.init(model, key=jr.PRNGKey(1))
    x = jr.normal(jr.PRNGKey(2), (4, 2))
    good, bad = jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32).at[1].set(1)
    used, updates = [], 0
    for finite in trace:
        before = _snapshot((_params(state), state.opt_state, state.step)) if not finite else None
        state, metrics = step(state, (x, -x, good if finite else bad))
        used.append(metrics["loss_scale"])
        updates += finite
        if not finite:
            assert not bool(metrics["finite"])
            assert _identical((_params(state), state.opt_state, state.step), before)
    assert int(state.step) == updates
    return [float(s) for s in jnp.stack(used)], float(state.loss_scale.scale)


T, N = True, False


@pytest.mark.parametrize(
    "initial, trace, expected_used, expected_final",
    [
        # growth_interval 3, written out from GradScaler's rules: a finite update counts a
        # good step and the third in a row doubles the scale (the count restarts); a
        # non-finite one halves it and restarts the count.
        (
            2.0**16,
            [T, T, T, N, T, T, N, N, T, T, T, T, T, T],
            [2**16, 2**16, 2**16, 2**17, 2**16, 2**16, 2**16, 2**15]
            + [2**14, 2**14, 2**14, 2**15, 2**15, 2**15],
            2.0**16,
        ),
        # The scale may fall below 1, and grows back from there.
        (1.0, [N, N, T, T, T, N, T], [1.0, 0.5, 0.25, 0.25, 0.25, 0.5, 0.25], 0.25),
    ],
)
def test_loss_scale_trace_matches_gradscaler(initial, trace, expected_used, expected_final):
    loss_scale = dynamic_loss_scale(initial, growth_interval=3)
    used, final = _run_trace(trace, loss_scale)
    assert used == expected_used
    assert final == expected_final


def test_loss_scale_default_interval_is_2000_finite_updates():
    # GradScaler's defaults: 2**16, doubled after the 2000th finite update in a row, halved
    # by an overflow. A short trace through the step: nothing grows.
    used, final = _run_trace([T, N, T, T], dynamic_loss_scale())
    assert used == [2.0**16, 2.0**16, 2.0**15, 2.0**15] and final == 2.0**15
    # A scale restored after 1997 finite updates: the 2000th doubles it.
    restored = eqx.tree_at(lambda s: s.good_steps, dynamic_loss_scale(), jnp.asarray(1997))
    used, final = _run_trace([T, T, T, N], restored)
    assert used == [2.0**16, 2.0**16, 2.0**16, 2.0**17] and final == 2.0**16
    # From a fresh scale, 1999 finite updates keep it, the 2000th doubles it; after an
    # overflow the count restarts (the rule alone, scanned).

    def adjust(ls, finite):
        return ls.adjust(finite), ls.scale

    trace = jnp.asarray([T] * 2000 + [N] + [T] * 1999 + [T])
    final, used = jax.lax.scan(adjust, dynamic_loss_scale(), trace)
    expected = [2.0**16] * 2000 + [2.0**17] + [2.0**16] * 2000
    assert used.tolist() == expected and float(final.scale) == 2.0**17


def _bn_loss(model, state, x, y, flag):
    pred, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
    )
    values = jnp.mean(jnp.square(pred - y), axis=-1) * jnp.where(flag > 0, jnp.inf, 1.0)
    return values, state


def test_overflow_in_one_micro_batch_skips_the_whole_update_and_keeps_batchnorm_state():
    # One check per update on the accumulated gradient, before the optimizer: an overflow in
    # one of 4 micro-batches skips the update, although clipping then optax.zero_nans would
    # turn it into a finite (zero) update that a check after them would let through.
    # Parameters, optimizer state (momentum, zero_nans' flag), BatchNorm's running
    # statistics and the update counter stay bit-identical; the scale halves; the next batch
    # trains exactly as if the bad one had never come.
    def build(key):
        return eqx.nn.make_with_state(eqx.nn.Sequential)(
            [
                eqx.nn.Linear(3, 8, key=key),
                eqx.nn.BatchNorm(8, axis_name="batch", mode="ema"),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(8, 3, key=jr.fold_in(key, 1)),
            ]
        )

    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.zero_nans(), optax.sgd(0.1, momentum=0.9)
    )
    step = el.train.make_step(
        _bn_loss, optimizer, accumulate=4, has_state=True, loss_scale=dynamic_loss_scale()
    )
    xs = jr.normal(jr.PRNGKey(3), (3, 16, 3))
    ok = jnp.zeros((16,), jnp.int32)
    bad = ok.at[9].set(1)  # the third micro-batch of 4

    def run(batches):
        model, model_state = build(jr.PRNGKey(0))
        state = step.init(model, key=jr.PRNGKey(1), model_state=model_state)
        history = []
        for x, flag in batches:
            state, metrics = step(state, (x, jnp.sin(x), flag))
            history.append((_snapshot(state), bool(metrics["finite"])))
        return history

    with_bad = run([(xs[0], ok), (xs[1], bad), (xs[2], ok)])
    without = run([(xs[0], ok), (xs[2], ok)])
    (first, f0), (skipped, f1), (after, f2) = with_bad
    assert (f0, f1, f2) == (True, False, True)
    kept = lambda s: (s.model, s.opt_state, s.model_state, s.step)  # noqa: E731
    assert _identical(kept(skipped), kept(first))
    assert float(skipped.loss_scale.scale) == 2.0**15
    assert int(after.step) == 2
    # Scales differ by a power of two, so the later update is the same up to rounding.
    assert tree_allclose(kept(after), kept(without[1][0]), rtol=1e-6, atol=1e-7)


def test_loss_scale_state_round_trips_through_serialisation(tmp_path):
    ls = dynamic_loss_scale(2.0**10, growth_interval=7).adjust(jnp.asarray(True))
    path = tmp_path / "ls.eqx"
    eqx.tree_serialise_leaves(path, ls)
    like = dynamic_loss_scale(1.0, growth_interval=7)
    loaded = eqx.tree_deserialise_leaves(path, like)
    assert _identical(loaded, ls) and int(loaded.good_steps) == 1


# -- float16 underflow --------------------------------------------------------------------------


def _small_loss(model, x, y):
    # A loss with a small weight (e.g. an auxiliary term): the gradient reaching the float16
    # output, 1e-7 * 2 * error / (8 features * 16 samples), is under 3e-8 for errors below
    # 19, so it rounds to zero in float16 (smallest subnormal 6e-8).
    return 1e-7 * el.train.mse(model, x, y)


@functools.cache
def _small_run(precision, loss_scale, steps=30):
    """SGD on a linear regression with `_small_loss`: initial and final parameters, and
    every step's loss and gradient norm. Cached: float32's run serves both tests."""
    x = jr.normal(jr.PRNGKey(0), (16, 8))
    y = x @ jr.normal(jr.PRNGKey(1), (8, 8)) / 3.0
    model = el.nn.mlp([8, 8], key=jr.PRNGKey(2))
    optimizer = optax.sgd(2e6)  # the loss is 1e-7 times a usual one
    step = el.train.make_step(_small_loss, optimizer, precision=precision, loss_scale=loss_scale)
    state = step.init(model, key=jr.PRNGKey(3))
    start = _snapshot(_params(state))
    losses, norms = [], []
    for _ in range(steps):
        state, metrics = step(state, (x, y))
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    return start, _snapshot(_params(state)), np.array(losses), np.array(norms)


@pytest.mark.parametrize("preset", ["mixed_fp16", "half_fp16"])
def test_float16_gradients_underflow_without_scaling_and_train_with_it(preset):
    start, end, _, norms = _small_run(preset, None, steps=5)
    assert np.all(norms == 0.0)  # every gradient flushed to zero
    assert _identical(end, start)  # nothing trains

    # With the dynamic scale (2**16 by default, "auto" for float16) the gradient matches
    # float32's within float16 precision: the forward and backward passes round each value
    # to float16 a few times, each within FP16_EPS / 2. And training follows float32.
    _, _, losses16, norms16 = _small_run(preset, "auto")
    _, _, losses32, norms32 = _small_run("float32", None)
    assert np.all(norms16 > 0)
    assert abs(norms16[0] - norms32[0]) <= 4 * FP16_EPS * norms32[0]
    assert losses32[-1] < 0.2 * losses32[0]  # float32 trains ...
    assert abs(losses16[-1] - losses32[-1]) <= 0.02 * losses32[-1]  # ... and so does fp16


# -- stochastic rounding ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_round_is_unbiased_between_neighbours(dtype):
    n = 20000
    base = jnp.asarray([1.0, -3.0, 1e-3, 300.0], dtype)
    step = jnp.nextafter(base, jnp.asarray(jnp.inf, dtype)).astype(jnp.float32) - base.astype(
        jnp.float32
    )
    frac = jnp.asarray([0.25, 0.5, 0.9, 0.1], jnp.float32)
    x = base.astype(jnp.float32) + frac * step  # between two neighbours
    y = el.precision._rounding.stochastic_round(
        jnp.broadcast_to(x, (n, 4)), dtype, jr.PRNGKey(0)
    ).astype(jnp.float32)
    lo, hi = base.astype(jnp.float32), base.astype(jnp.float32) + step
    assert bool(jnp.all((y == lo[None, :]) | (y == hi[None, :])))
    p_up = jnp.mean((y == hi[None, :]).astype(jnp.float32), axis=0)
    # Binomial: 5 standard deviations of a proportion over n draws.
    assert bool(jnp.all(jnp.abs(p_up - frac) < 5 * jnp.sqrt(frac * (1 - frac) / n)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_round_keeps_exact_and_special_values(dtype):
    x = jnp.asarray([1.0, -0.5, 0.0, 2.0**-20, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    y = el.precision._rounding.stochastic_round(jnp.broadcast_to(x, (100, 7)), dtype, jr.PRNGKey(0))
    assert y.dtype == dtype
    expected = np.broadcast_to(np.asarray(x.astype(dtype), np.float32), (100, 7))
    assert np.array_equal(np.asarray(y, np.float32), expected, equal_nan=True)
    # Past the largest finite number: that number or infinity, never nan.
    top = float(jnp.finfo(dtype).max)
    big = jnp.asarray([top * 1.001, -top * 1.001, top * 1.003], jnp.float32)
    y = np.asarray(el.precision._rounding.stochastic_round(big, dtype, jr.PRNGKey(1)), np.float32)
    assert np.all(np.isin(np.abs(y), [np.float32(top), np.inf])) and np.all(
        np.sign(y) == np.sign(np.asarray(big))
    )


def _pull(w, target):
    return jnp.sum(jnp.square(w - target))


def test_half_step_moves_parameters_that_round_to_nearest_would_freeze():
    # A parameter of 1.0 pulled towards 1 + 3 * 2**-9 by SGD: each update (at most 1.2e-4)
    # is under half of bfloat16's spacing above 1 (2**-7 = 7.8e-3), so rounding every
    # update to nearest never moves it. The step's stochastic rounding moves it on average
    # as float32 does.
    n, lr, steps = 2048, 0.01, 200
    target = 1.0 + 3 * 2.0**-9

    class Vector(eqx.Module):
        w: jax.Array

    def loss(model, x):
        # In float32: in bfloat16 the target itself would round to 1 + 2**-7.
        return jnp.broadcast_to(_pull(model.w.astype(jnp.float32), target), x.shape)

    x = jnp.zeros((2,))
    start = Vector(jnp.ones((n,), jnp.float32))

    # float32, and round-to-nearest bfloat16, by hand.
    def sgd(w, dtype):
        for _ in range(steps):
            g = jax.grad(_pull)(w.astype(jnp.float32), target)
            w = (w.astype(jnp.float32) - lr * g).astype(dtype)
        return w.astype(jnp.float32)

    w32, w_nearest = sgd(start.w, jnp.float32), sgd(start.w.astype(jnp.bfloat16), jnp.bfloat16)
    assert bool(jnp.all(w_nearest == 1.0))  # frozen
    step = el.train.make_step(loss, optax.sgd(lr), precision="half_bf16")
    state = step.init(start, key=jr.PRNGKey(0))
    for _ in range(steps):
        state, _ = step(state, (x,))
    w = state.model.w
    assert w.dtype == jnp.bfloat16
    moved = float(jnp.mean(w.astype(jnp.float32))) - 1.0
    expected = float(jnp.mean(w32)) - 1.0
    # Rounding is unbiased and the update linear, so E[w] follows float32 exactly. Each
    # element ends within a step or two of 1 (2**-7 above, 2**-8 below): the mean over
    # n = 2048 elements has a standard deviation near 2**-7 / (2 * sqrt(n)) = 8.6e-5, and
    # 5e-4 is ~6 of those, against a float32 move of 5.8e-3.
    assert abs(moved - expected) < 5e-4, (moved, expected)
    assert expected > 2e-3


def test_half_state_stochastic_rounding_lets_a_slow_average_decay():
    # RMSProp's second moment with decay 0.999 changes by 0.1% per step once gradients stop;
    # bfloat16 numbers are 0.4-0.8% apart, so round to nearest never lets it decay, and the
    # updates stay too small forever. Stochastic rounding decays it as float32 does.
    n = 4096
    inner = optax.rmsprop(1.0, decay=0.999)
    params = {"w": jnp.zeros((n,))}
    ones, zeros = {"w": jnp.ones((n,))}, {"w": jnp.zeros((n,))}

    def nu(opt):
        state = opt.init(params)
        update = jax.jit(opt.update)
        for i in range(300):
            _, state = update(ones if i < 10 else zeros, state)
        leaves = state.inner if isinstance(state, el.precision._optim.HalfState) else state
        return jax.tree.leaves(leaves)[0].astype(jnp.float32)

    exact = nu(inner)
    nearest = nu(el.precision.half_state(inner, rounding="nearest"))
    stochastic = nu(el.precision.half_state(inner))
    peak = 1.0 - 0.999**10
    assert float(exact[0]) == pytest.approx(peak * 0.999**290, rel=1e-4)
    # Nearest: stuck at (the bfloat16 rounding of) its peak.
    assert float(jnp.max(jnp.abs(nearest - peak))) <= BF16_EPS * peak
    # Stochastic: the mean over elements follows float32 within ~0.5%.
    assert float(jnp.mean(stochastic)) == pytest.approx(float(exact[0]), rel=5e-3)


def test_float16_optimizer_state_loses_small_second_moments():
    # Why half_fp16 keeps its optimizer state in bfloat16: with gradients of 1e-4, RMSProp's
    # second moment (~1e-9) flushes to zero in float16 and the update explodes.
    inner = optax.rmsprop(1e-3, decay=0.999, eps=1e-12)
    params = {"w": jnp.zeros((64,))}
    grads = {"w": jnp.full((64,), 1e-4)}

    def last_update(opt):
        state = opt.init(params)
        update = jax.jit(opt.update)
        for _ in range(20):
            updates, state = update(grads, state)
        return updates["w"]

    exact = last_update(inner)
    bf16 = last_update(el.precision.half_state(inner, jnp.bfloat16))
    fp16 = last_update(el.precision.half_state(inner, jnp.float16))
    assert tree_allclose(bf16, exact, rtol=2 * BF16_EPS)
    assert float(jnp.min(jnp.abs(fp16))) > 3 * float(jnp.max(jnp.abs(exact)))
    step = el.train.make_step(el.train.mse, optax.adam(1e-3), precision="half_fp16")
    state = step.init(el.nn.mlp([2, 3, 1], key=jr.PRNGKey(0)), key=jr.PRNGKey(1))
    moments = [x for x in jax.tree.leaves(state.opt_state) if eqx.is_inexact_array(x)]
    assert moments and all(m.dtype == jnp.bfloat16 for m in moments)
    assert all(p.dtype == jnp.float16 for p in jax.tree.leaves(_params(state)))


def test_half_state_errors():
    with pytest.raises((ValueError, TypeError), match="rounding"):
        el.precision.half_state(optax.sgd(0.1), rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype=int8"):
        el.precision.half_state(optax.sgd(0.1), jnp.int8)


# -- bf16 attention -----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_attention_gradients_follow_float32(getkey, causal):
    # The 16-bit softmax keeps only its bfloat16 output for the backward pass; its gradients
    # stay within bfloat16 precision of float32's.
    q, k, v = (jr.normal(getkey(), (12, 2, 8)) for _ in range(3))
    cot = jr.normal(getkey(), (12, 2, 8))

    def loss(q, k, v):
        out = attention(q, k, v, causal=causal)
        return jnp.sum(out.astype(jnp.float32) * cot)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grads32 = grad(q, k, v)
    grads16 = grad(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    for g16, g32 in zip(grads16, grads32, strict=True):
        assert g16.dtype == jnp.bfloat16
        assert _relative_error(g16.astype(jnp.float32), g32) < 4 * BF16_EPS


# -- every preset with accumulation and remat, and training quality ---------------------------

# The guide's transformer, small: MSE regression on synthetic data whose target needs the
# attention (the mean over the sequence) and the feed-forward layer (a sine).
STEPS = 100
XS = jr.normal(jr.PRNGKey(5), (STEPS, 8, 4, 8))  # (steps, batch, seq, d_model)


def _target(x):
    return jnp.sin(x) + jnp.mean(x, axis=-2, keepdims=True)


def _encoder():
    return el.nn.transformer_encoder(1, 8, 2, 16, key=jr.PRNGKey(1), remat=True)


@functools.cache
def _encoder_step(preset, accumulate):
    # Shared by the tests below, so each step is compiled once.
    return el.train.make_step(el.train.mse, optax.sgd(1.0), precision=preset, accumulate=accumulate)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_accumulate_with_remat_matches_the_whole_batch(preset):
    # Three SGD updates of a rematerialised transformer, from the whole batch and from 4
    # micro-batches. Within each preset's precision:
    # - float32: the updates agree to 1e-5 (only the order of the sums differs).
    # - mixed: each micro-batch's gradient is rounded to the compute dtype once (within
    #   eps / 2) before the float32 sum, the whole batch's once: updates within eps.
    # - half: parameters are stored in 16 bits with stochastic rounding, drawn from the same
    #   key in both runs; a value whose float32 update differs by a rounding may land on the
    #   other neighbour, so the parameters agree to the storage's precision (eps / 2).
    # And every step's loss agrees within the compute dtype's eps (float32: 1e-5).
    policy = PRESETS[preset]
    batch = (XS[0], _target(XS[0]))

    def run(accumulate):
        step = _encoder_step(preset, accumulate)
        state = step.init(_encoder(), key=jr.PRNGKey(2))
        start = _snapshot(_params(state))
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            assert bool(metrics["finite"])
            losses.append(float(metrics["loss"]))
        end = _snapshot(_params(state))
        delta = jax.tree.map(lambda a, b: np.float64(a) - np.float64(b), end, start)
        return end, delta, np.array(losses)

    end1, delta1, losses1 = run(1)
    end4, delta4, losses4 = run(4)
    eps = 1e-5 if preset == "float32" else float(jnp.finfo(policy.compute_dtype).eps)
    assert np.all(np.abs(losses4 - losses1) <= eps * np.abs(losses1)), (losses1, losses4)
    if policy.is_half:
        assert _relative_error(end4, end1) <= float(jnp.finfo(policy.param_dtype).eps) / 2
    else:
        assert _relative_error(delta4, delta1) <= eps


def test_mixed_bf16_and_half_bf16_train_as_float32():
    # 100 steps on fresh batches: the mean loss of the last 10 within 2% of float32's.
    def final_loss(preset):
        step = _encoder_step(preset, 1)
        state = step.init(_encoder(), key=jr.PRNGKey(2))
        losses = []
        for x in XS:
            state, metrics = step(state, (x, _target(x)))
            losses.append(metrics["loss"])
        losses = np.array(losses)
        return float(np.mean(losses[-10:])), float(losses[0])

    f32, first = final_loss("float32")
    assert f32 < 0.35 * first  # it learns
    for preset in ("mixed_bf16", "half_bf16"):
        got, _ = final_loss(preset)
        assert abs(got - f32) <= 0.02 * f32, (preset, got, f32)


# -- memory -------------------------------------------------------------------------------------

# The guide's configuration: 12 blocks, d_model 512, 8 heads, d_ff 2048, seq 256, batch 32.
GUIDE = dict(n_layers=12, d_model=512, n_heads=8, d_ff=2048)


def _guide_residuals(preset, remat):
    """The residuals of the guide's MSE loss on a batch, as the step computes it: parameters
    and floating inputs cast to the compute dtype inside the differentiated function.
    Traced only (abstract shapes), nothing runs."""
    policy = PRESETS[preset]
    found = []

    def loss(params, x, y):
        model = policy.cast_to_compute(params)
        x, y = policy.cast_to_compute((x, y))
        return jnp.sum(el.train.mse(model, x, y))

    def trace(x):
        model = el.nn.transformer_encoder(**GUIDE, key=jr.PRNGKey(0), remat=remat)
        model = policy.cast_to_param(model)  # as the step's state stores it
        found.extend(el.memory.saved_residuals(loss, model, x, x))
        return jnp.zeros(())

    jax.eval_shape(trace, jax.ShapeDtypeStruct((32, 256, 512), jnp.float32))
    return found


def _new_buffers(residuals):
    # Everything saved that is not an input as given: intermediates, and the compute-dtype
    # copies of parameters and inputs ("argument ... (transformed)").
    return sum(
        r.nbytes
        for r in residuals
        if not r.source.startswith("argument") or r.source.endswith("(transformed)")
    )


def _intermediates(residuals):
    return sum(r.nbytes for r in residuals if r.source.startswith("intermediate"))


def test_mixed_bf16_halves_what_the_guide_backward_keeps():
    # No remat (the guide's step): everything saved, the bfloat16 parameter copies included,
    # is at most 0.55x float32's. The softmax computes in float32 but keeps only its
    # bfloat16 output; layer norms and GELU keep only their (bfloat16) inputs.
    f32, bf16 = _guide_residuals("float32", False), _guide_residuals("mixed_bf16", False)
    assert _new_buffers(bf16) <= 0.55 * _new_buffers(f32), (_new_buffers(bf16), _new_buffers(f32))
    assert not [r for r in bf16 if r.dtype == np.float32 and r.shape[-2:] == (256, 256)]
    # With remat the activations kept (the blocks' inputs, and the float32 loss's residual)
    # still halve; the bfloat16 copy of the parameters (72 MiB, 2 bytes per parameter) is then
    # larger than the activations and is counted with the parameters, not here.
    f32, bf16 = _guide_residuals("float32", True), _guide_residuals("mixed_bf16", True)
    assert _intermediates(bf16) <= 0.55 * _intermediates(f32)


def _state_bytes(preset):
    step = el.train.make_step(el.train.mse, optax.adam(1e-3), precision=preset)
    state = eqx.filter_eval_shape(
        lambda: step.init(el.nn.transformer_encoder(**GUIDE, key=jr.PRNGKey(0)), key=jr.PRNGKey(1))
    )
    arrays = [x for x in jax.tree.leaves((state.model, state.opt_state)) if hasattr(x, "dtype")]
    n_params = sum(x.size for x in jax.tree.leaves(state.model) if hasattr(x, "dtype"))
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in arrays), n_params


def test_half_storage_halves_parameters_and_adam_state():
    # Adam: float32 stores 4 (parameter) + 8 (two moments) bytes per parameter; mixed keeps
    # float32 master parameters (the same 12); half stores 2 + 2 + 2 (moments in bfloat16).
    f32, n = _state_bytes("float32")
    assert f32 == pytest.approx(12 * n, abs=64)  # + Adam's step counter
    assert _state_bytes("mixed_bf16")[0] == f32
    for preset in ("half_bf16", "half_fp16"):
        half, _ = _state_bytes(preset)
        assert half == pytest.approx(6 * n, abs=64)  # + counter and rounding key
        assert half <= 0.55 * f32


# -- robustness: GradScaler's rounding for any factor, hyperparameters, bad arguments -------


def _gradscaler(scale: np.ndarray, factor: float) -> np.ndarray:
    """What `_amp_update_scale_` stores: float * double, computed in double, stored as float."""
    with np.errstate(over="ignore"):
        return (scale.astype(np.float64) * factor).astype(np.float32)


@pytest.mark.parametrize("factor", [0.3, 0.7, 0.9, 1 / 3])
def test_backoff_rounds_once_as_gradscaler_for_any_factor(factor):
    # Scales across float32's normal range, including every product that lands exactly
    # halfway between two float32 numbers, where a float32 factor (rounded first) or a
    # product rounded once from the exact value would differ by an ulp.
    rng = np.random.default_rng(0)
    exponents = rng.integers(4, 255, 5000).astype(np.uint32) << 23  # results stay normal
    scales = (rng.integers(0, 2**23, 5000).astype(np.uint32) | exponents).view(np.float32)
    ls = dynamic_loss_scale(backoff_factor=factor)
    adjust = jax.jit(jax.vmap(lambda s: eqx.tree_at(lambda t: t.scale, ls, s).adjust(False).scale))
    got = np.asarray(adjust(jnp.asarray(scales)))
    want = _gradscaler(scales, factor)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    naive = scales * np.float32(factor)  # the old float32 product
    assert (naive != want).any()


@pytest.mark.parametrize("factor", [1.1, 1.3, 3.0])
def test_growth_over_many_changes_stays_on_gradscalers_scales(factor):
    ls = dynamic_loss_scale(1.0, growth_interval=1, growth_factor=factor, backoff_factor=0.3)
    grow = jax.jit(lambda s, f: s.adjust(f))
    expected = np.float32(1.0)
    for i in range(60):
        finite = i % 3 != 2
        ls = grow(ls, jnp.asarray(finite))
        expected = _gradscaler(np.asarray(expected), factor if finite else 0.3)
        assert np.asarray(ls.scale).view(np.uint32) == expected.view(np.uint32), i


def test_loss_scale_refuses_non_numbers():
    for kwargs in ({"initial": "big"}, {"growth_factor": "2"}, {"backoff_factor": None}):
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            dynamic_loss_scale(**kwargs)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match="growth_interval"):
        dynamic_loss_scale(growth_interval=True)


def test_half_state_keeps_hyperparameters_and_counts_in_their_dtype():
    # optax's bias correction (b1 ** count, float32 ** int32) needs standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        _half_state_hyperparameters()


def _half_state_hyperparameters():
    params = {"w": jnp.asarray([0.5, -1.0, 2.0]), "b": jnp.asarray(0.25)}
    grads = {"w": jnp.asarray([0.1, -0.2, 0.3]), "b": jnp.asarray(-0.05)}
    inner = optax.inject_hyperparams(optax.adam)(1e-3)
    opt = el.precision.half_state(inner)
    state = opt.init(params)
    hyper = state.inner.hyperparams
    assert hyper["b2"].dtype == jnp.float32 and float(hyper["b2"]) == np.float32(0.999)
    assert float(hyper["learning_rate"]) == np.float32(1e-3)
    adam = state.inner.inner_state[0]
    assert adam.count.dtype == jnp.int32
    assert adam.mu["w"].dtype == adam.nu["w"].dtype == jnp.bfloat16  # the moment buffers
    assert adam.mu["b"].dtype == jnp.float32  # a scalar parameter's: 4 bytes, kept
    updates, state = opt.update(grads, state, params)
    reference, _ = inner.update(grads, inner.init(params), params)
    # The first update from zero moments is float32 Adam's exactly: nothing rounded yet.
    assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
    assert tree_allclose(updates, reference, rtol=1e-6, atol=0)
    assert state.inner.hyperparams["b2"].dtype == jnp.float32
    assert state.inner.inner_state[0].mu["w"].dtype == jnp.bfloat16
    # And under the half_bf16 policy, through the real step.
    step = el.train.make_step(el.train.mse, inner, precision="half_bf16")
    model = el.nn.mlp([2, 3, 1], key=jr.PRNGKey(0))
    train_state = step.init(model, key=jr.PRNGKey(1))
    x = jr.normal(jr.PRNGKey(2), (4, 2))
    train_state, metrics = step(train_state, (x, x[:, :1]))
    assert bool(metrics["finite"])
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(_params(train_state)))
    hyper = train_state.opt_state.inner.hyperparams
    assert hyper["b2"].dtype == jnp.float32 and float(hyper["b2"]) == np.float32(0.999)


def test_stochastic_rounding_to_an_integer_dtype_is_refused():
    x = jnp.asarray([0.5, 1.5])
    for dtype in (jnp.int8, jnp.int32, jnp.float64, "int4"):
        with pytest.raises(ValueError, match="floating-point dtype of at most 32 bits"):
            el.precision._rounding.stochastic_round(x, dtype, jr.PRNGKey(0))
    with pytest.raises(ValueError, match="integer type"):
        el.precision._rounding.stochastic_round_tree({"a": x}, jnp.int16, jr.PRNGKey(0))
