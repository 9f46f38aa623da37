"""The accumulating step: exact, composable, lean."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import eqx_lowmem as el
from eqx_lowmem.train._state import split

from .helpers import compile_as_users, tree_allclose


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def _copy(tree):
    # Steps donate their input state: keep host copies of what a test compares later.
    return jax.tree.map(np.array, tree)


def _token_loss(model, x, mask):
    # Per-token values and weights: (batch, tokens).
    pred = jax.vmap(jax.vmap(model))(x)[..., 0]
    return jnp.sin(pred) + pred**2, mask


@eqx.filter_jit
def _whole_batch(model, x, mask, sample_weights):
    """Reference: loss and gradient of sum(values * weights) / sum(weights), whole batch."""

    def loss(m):
        values, w = _token_loss(m, x, mask)
        w = w * sample_weights[:, None]
        return jnp.sum(values * w) / jnp.sum(w)

    return eqx.filter_value_and_grad(loss)(model)


def _keep_gradient() -> optax.GradientTransformation:
    """An optimizer whose state is the last gradient and whose update is zero."""

    def update(grads, state, params=None):
        del state, params
        return jax.tree.map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


@settings(max_examples=8, deadline=None)
@given(
    # Few distinct shapes, so compilations are reused across examples.
    size=st.sampled_from([1, 5, 7, 12]),
    accumulate=st.sampled_from([1, 2, 3, 4]),
    seed=st.integers(0, 2**16),
)
def test_accumulated_loss_and_gradient_equal_the_whole_batch(size, accumulate, seed):
    if accumulate > size:
        accumulate = size
    keys = jr.split(jr.PRNGKey(seed), 5)
    model = el.nn.mlp([3, 5, 1], key=keys[0])
    x = jr.normal(keys[1], (size, 4, 3))
    mask = (jr.uniform(keys[2], (size, 4)) < 0.7).astype(jnp.float32)
    mask = mask.at[0, 0].set(1.0)  # at least one real token
    sample_weights = jr.uniform(keys[3], (size,), minval=0.5, maxval=2.0)
    expected_loss, expected_grads = _whole_batch(model, x, mask, sample_weights)

    # The optimizer keeps the gradient it receives as its state: read directly, not as a
    # difference of parameters (which would cost it the parameters' rounding).
    step = el.train.make_step(_token_loss, _keep_gradient(), accumulate=accumulate)
    state = step.init(model, key=keys[4])
    new_state, metrics = step(state, (x, mask), sample_weights)
    assert tree_allclose(metrics["loss"], expected_loss, rtol=1e-5, atol=1e-6)
    assert tree_allclose(new_state.opt_state, _params(expected_grads), rtol=1e-5, atol=1e-6)
    assert int(new_state.step) == 1


def test_clipping_acts_on_the_accumulated_gradient(getkey):
    model = el.nn.mlp([3, 8, 1], key=getkey())
    x, y = jr.normal(getkey(), (16, 3)), 10.0 * jr.normal(getkey(), (16, 1))
    opt = optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(1.0))
    results = []
    for k in (1, 4):
        step = el.train.make_step(el.train.mse, opt, accumulate=k)
        state, metrics = step(step.init(model, key=getkey()), (x, y))
        results.append(_params(state.model))
    assert tree_allclose(results[0], results[1], rtol=1e-5, atol=1e-7)
    # Clipped to norm 0.01 (the gradient norm is far above it): the change has that norm.
    change = jax.tree.map(lambda a, b: a - b, _params(model), results[1])
    assert abs(float(optax.tree.norm(change)) - 0.01) < 1e-6
    assert float(metrics["grad_norm"]) > 0.1


def test_schedules_count_updates_not_micro_batches(getkey):
    model = el.nn.mlp([2, 4, 1], key=getkey())

    def schedule(count):  # lr 1 for updates 0 and 1, then 0
        return jnp.where(count < 2, 1.0, 0.0)

    step = el.train.make_step(el.train.mse, optax.sgd(schedule), accumulate=4)
    state = step.init(model, key=getkey())
    x, y = jr.normal(getkey(), (8, 2)), jr.normal(getkey(), (8, 1))
    snapshots = []
    for _ in range(3):
        state, _ = step(state, (x, y))
        snapshots.append(_copy(_params(state.model)))
    assert int(state.step) == 3
    assert optax.tree_utils.tree_get(state.opt_state, "count") == 3
    assert not tree_allclose(snapshots[0], snapshots[1])  # update 2 still at lr 1
    assert tree_allclose(snapshots[1], snapshots[2])  # update 3 at lr 0


def _bn_model(key):
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        3, axis_name="batch", momentum=0.5, mode="batch"
    )


def _bn_loss(model, state, x):
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.sum(out**3, axis=1), state


def test_batchnorm_state_is_threaded_through_micro_batches(getkey):
    model, bn_state = _bn_model(getkey())
    model = eqx.tree_at(lambda m: m.weight, model, jnp.array([1.0, 2.0, 3.0]))
    x = 1.0 + jr.normal(getkey(), (8, 3))
    step = el.train.make_step(_bn_loss, optax.sgd(0.0), accumulate=2, has_state=True)
    state, _ = step(step.init(model, key=getkey(), model_state=bn_state), (x,))
    # Reference: the two micro-batches in order, each with its own batch statistics.
    _, s1 = _bn_loss(model, bn_state, x[:4])
    _, s2 = _bn_loss(model, s1, x[4:])
    assert tree_allclose(
        jax.tree.leaves(state.model_state), jax.tree.leaves(s2), rtol=1e-6, atol=1e-7
    )


def test_nonfinite_update_is_skipped_and_state_unchanged(getkey):
    model = el.nn.mlp([2, 4, 1], key=getkey())

    def loss(model, x, poison):
        return el.train.mse(model, x, jnp.zeros((x.shape[0], 1))) * poison

    x = jr.normal(getkey(), (4, 2))
    poisoned = (x, jnp.array([1.0, 1.0, jnp.inf, 1.0]))
    for skip in (True, None):  # None: the default without a loss scale applies it
        step = el.train.make_step(loss, optax.adam(0.1), accumulate=2, skip_nonfinite=skip)
        assert step.skip_nonfinite is bool(skip)
        state = step.init(model, key=getkey())
        state, metrics = step(state, (x, jnp.ones(4)))
        assert bool(metrics["params_finite"]) if skip else "params_finite" not in metrics
        before = _copy((state.model, state.opt_state))
        state, metrics = step(state, poisoned)
        assert not bool(metrics["finite"])
        assert int(state.step) == (1 if skip else 2)
        after = jax.tree.map(np.asarray, (state.model, state.opt_state))
        same = [
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
        ]
        assert all(same) if skip else not any(same)


def test_each_update_draws_new_numbers_and_a_step_that_draws_none_derives_no_key(getkey):
    model, x = el.nn.mlp([2, 4, 1], key=getkey()), jr.normal(getkey(), (4, 2))
    y = jnp.zeros((4, 1))

    def noisy(model, x, y, *, key=None):  # the loss draws from its key
        return el.train.mse(model, x, y) + jr.normal(key, (x.shape[0],))

    for loss, draws in ((noisy, True), (el.train.mse, False)):  # mse: a key, no dropout
        step = el.train.make_step(loss, optax.sgd(0.0))
        state = step.init(model, key=getkey())
        key = np.asarray(jr.key_data(state.key))
        text = step.lower(state, (x, y)).compile().as_text()
        assert ("threefry" in text) is draws  # the derivation is compiled only when used
        state, first = step(state, (x, y))
        state, second = step(state, (x, y))  # same model (rate 0), same batch
        assert np.array_equal(jr.key_data(state.key), key)  # the state's key is kept
        assert (float(first["loss"]) != float(second["loss"])) is draws


def test_a_step_without_a_loss_scale_compiles_no_constant_scale_metric(getkey):
    # A constant output costs the program a copy (a kernel on a GPU) and an output buffer:
    # about 4 us of a small step's host time. The metric is still there, 1.0.
    model, x = el.nn.mlp([2, 4, 1], key=getkey()), jr.normal(getkey(), (4, 2))
    for precision, scale in ((None, 1.0), ("mixed_fp16", 2.0**16)):
        step = el.train.make_step(el.train.mse, optax.sgd(0.1), precision=precision)
        state = step.init(model, key=getkey())
        compiled = step.lower(state, (x, jnp.zeros((4, 1)))).out_info[1]
        assert ("loss_scale" in compiled) is (precision is not None)
        _, metrics = step(state, (x, jnp.zeros((4, 1))))
        assert isinstance(metrics["loss_scale"], jax.Array)
        assert float(metrics["loss_scale"]) == scale


def test_packed_metrics_are_the_calls_metrics_in_one_float32_vector(getkey):
    # The Trainer's way to read them (`call_split(..., packed=True)`): one output and one
    # transfer an update, in `metric_names`' order, equal to the dict a call returns.
    model, x = el.nn.mlp([2, 4, 1], key=getkey()), jr.normal(getkey(), (4, 2))
    batch = (x, jnp.zeros((4, 1)))
    for options in ({}, {"precision": "mixed_fp16"}, {"skip_nonfinite": True}):
        step = el.train.make_step(el.train.mse, optax.adam(0.1), **options)
        key = getkey()
        _, metrics = step(step.init(model, key=key), batch)
        dynamic, static = split(step.init(model, key=key))  # the same state again
        _, packed = step.call_split(dynamic, static, batch, packed=True)
        assert packed.dtype == jnp.float32 and set(step.metric_names) == set(metrics)
        dict_values = [float(metrics[k]) for k in step.metric_names]
        np.testing.assert_array_equal(np.asarray(packed), np.float32(dict_values))


def test_skip_nonfinite_is_refused_off_with_a_loss_scale_and_of_the_wrong_type():
    with pytest.raises(ValueError, match="skip_nonfinite=False with a loss scale"):
        el.train.make_step(el.train.mse, optax.sgd(0.1), precision="mixed_fp16",
                           skip_nonfinite=False)  # fmt: skip
    with pytest.raises(TypeError, match="skip_nonfinite"):
        el.train.make_step(el.train.mse, optax.sgd(0.1), skip_nonfinite=1)
    assert el.train.make_step(el.train.mse, optax.sgd(0.1), precision="mixed_fp16").skip_nonfinite


@pytest.mark.parametrize(
    "kwargs, batch, match",
    [
        (dict(accumulate=0), None, "accumulate must be an int >= 1 .*got 0"),
        (dict(accumulate=4), (np.ones((3, 2)), np.ones((3, 1))), "at least 4"),
        (dict(), (np.ones((3, 2)), np.ones((4, 1))), "first .batch. dimension"),
    ],
)
def test_bad_input(getkey, kwargs, batch, match):
    model = el.nn.mlp([2, 4, 1], key=getkey())
    with pytest.raises(ValueError, match=match):
        step = el.train.make_step(el.train.mse, optax.sgd(0.1), **kwargs)
        step(step.init(model, key=getkey()), batch)


def test_loss_returning_a_mean_is_refused(getkey):
    model = el.nn.mlp([2, 4, 1], key=getkey())
    step = el.train.make_step(
        lambda m, x, y: jnp.mean(el.train.mse(m, x, y)), optax.sgd(0.1), accumulate=2
    )
    with pytest.raises(ValueError, match="per-sample values, not their mean"):
        step(step.init(model, key=getkey()), (np.ones((4, 2)), np.ones((4, 1))))


def test_accumulation_cuts_temporaries_and_keeps_no_parameter_sized_optimizer_buffer():
    # A transformer whose whole batch fits; compile only.
    model = el.nn.transformer_encoder(2, 128, 4, 512, key=jr.PRNGKey(0))
    x = jax.ShapeDtypeStruct((32, 128, 128), jnp.float32)
    temps = {}
    for k in (1, 4):
        step = el.train.make_step(el.train.mse, optax.sgd(0.01), accumulate=k)
        state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(1))
        compiled = compile_as_users(step.lower(state, (x, x)))
        temps[k] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[4] <= 0.30 * temps[1], temps
    # SGD holds no state; optax.MultiSteps would hold a parameter-sized buffer.
    state = step.init(model, key=jr.PRNGKey(1))
    assert jax.tree.leaves(eqx.filter(state.opt_state, eqx.is_inexact_array)) == []
    multi = optax.MultiSteps(optax.sgd(0.01), every_k_schedule=4).init(_params(model))
    n_params = sum(a.size for a in jax.tree.leaves(_params(model)))
    assert sum(a.size for a in jax.tree.leaves(eqx.filter(multi, eqx.is_inexact_array))) >= n_params
