"""A 16-bit gradient accumulator (`make_step(accumulate_dtype=...)`): the step of the float32
accumulator within 16-bit rounding, finite where a 16-bit sum would overflow, half the bytes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.train._accumulate import accumulate, loss_grad

U16 = 2.0**-11  # float16's unit roundoff


def _data(n: int = 32):
    x = jr.normal(jr.PRNGKey(1), (n, 8))
    y = jnp.sin(x[:, :1]) + 0.1
    return x, y


def _delta(model, dtype, k, scale=None, precision="mixed_fp16"):
    """The parameter change of one SGD step (lr 1), and its metrics."""
    loss_scale = "auto" if scale is None else el.precision.dynamic_loss_scale(scale)
    step = el.train.make_step(
        el.train.mse,
        optax.sgd(1.0),
        accumulate=k,
        precision=precision,
        accumulate_dtype=dtype,
        loss_scale=loss_scale,
    )
    state = step.init(model, key=jr.PRNGKey(2))
    old = eqx.filter(state.model, eqx.is_inexact_array)
    old = jax.tree.map(lambda p: np.asarray(p, np.float32), old)
    state, metrics = step(state, _data())
    new = eqx.filter(state.model, eqx.is_inexact_array)
    return jax.tree.map(lambda a, b: np.asarray(b, np.float32) - a, old, new), metrics


@pytest.mark.parametrize("k", [1, 4])
def test_float16_accumulator_step_equals_the_float32_one_within_its_rounding(k):
    model = el.nn.mlp([8, 32, 32, 1], key=jr.PRNGKey(0))
    d32, m32 = _delta(model, jnp.float32, k)
    d16, m16 = _delta(model, jnp.float16, k)
    assert bool(m32["finite"]) and bool(m16["finite"])
    assert float(m16["loss"]) == float(m32["loss"])  # the losses are float32 in both
    for a, b in zip(jax.tree.leaves(d32), jax.tree.leaves(d16), strict=True):
        # The micro-batch gradients are the same float16 numbers; the 16-bit accumulator
        # rounds each of k additions (and the one cast) to float16, relative to its size.
        bound = (k + 1) * U16 * np.max(np.abs(a))
        assert np.max(np.abs(a - b)) <= bound
        assert np.max(np.abs(a)) > 0


def test_float16_accumulator_stays_finite_where_a_float16_sum_would_overflow():
    model = el.nn.mlp([8, 32, 32, 1], key=jr.PRNGKey(0))
    d32, m32 = _delta(model, jnp.float32, 4, precision="float32", scale=1.0)
    g = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(d32))  # the mean gradient
    # A loss scale putting the largest scaled mean gradient at 16384 (in float16's range):
    # the sum over the 32 samples (as the float32 accumulator holds it) would be 2**19.
    scale = 2.0 ** np.floor(np.log2(16384 / g))
    assert 32 * g * scale > float(jnp.finfo(jnp.float16).max)
    d16, m16 = _delta(model, jnp.float16, 4, scale=scale)
    ref, mref = _delta(model, jnp.float32, 4, scale=scale)
    assert bool(m16["finite"]) and bool(mref["finite"])
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(d16), strict=True):
        assert np.max(np.abs(a - b)) <= 5 * U16 * np.max(np.abs(a))


def test_bfloat16_accumulator_and_an_uneven_last_micro_batch():
    """accumulate() itself: 30 samples in 4 micro-batches (8, 8, 8, 6), bfloat16 sums."""
    model = el.nn.mlp([8, 16, 1], key=jr.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    policy = el.precision.get_policy("float32")
    x, y = _data(30)
    w = jnp.ones((30,), jnp.float32)
    key, scale = jr.PRNGKey(3), jnp.float32(1.0)
    ref = accumulate(loss_grad(el.train.mse, static, policy), 4)(params, None, (x, y), w, key,
                                                                   scale)  # fmt: skip
    fn = accumulate(
        loss_grad(el.train.mse, static, policy, dtype=jnp.bfloat16), 4, dtype=jnp.bfloat16
    )
    raw = fn(params, None, (x, y), w, key, scale)
    # The 16-bit accumulator comes back as it is, in units of the count (no float32 copy
    # of the gradient is formed inside the step); exact() is the float32 gradient of the sum.
    assert float(raw.unit) == 30.0
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(raw.grads))
    got = raw.exact()
    assert float(got.total) == float(ref.total) and float(got.weight) == 30.0
    u = 2.0**-8  # bfloat16's unit roundoff
    for a, b in zip(jax.tree.leaves(ref.grads), jax.tree.leaves(got.grads), strict=True):
        assert b.dtype == jnp.float32  # the gradient of the sum, in float32 as before
        # Each micro-batch's gradient rounded to bfloat16, then 4 roundings of the sum.
        assert float(jnp.max(jnp.abs(a - b))) <= 6 * u * float(jnp.max(jnp.abs(a)))


def test_report_counts_16_bit_gradients_and_accumulator():
    model = el.nn.mlp([8, 64, 1], key=jr.PRNGKey(0))
    batch = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _data())
    kwargs = dict(accumulate=4, precision="half_fp16")
    r32 = el.memory.memory_report(model, el.train.mse, optax.sgd(0.1), batch, **kwargs)
    r16 = el.memory.memory_report(
        model, el.train.mse, optax.sgd(0.1), batch, accumulate_dtype=jnp.float16, **kwargs
    )
    n = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    assert r32.sizes["gradients"] == r32.sizes["accumulator"] == 4 * n
    assert r16.sizes["gradients"] == r16.sizes["accumulator"] == 2 * n
    assert r16.config["accumulate_dtype"] == "float16"
    assert any("accumulate_dtype" in note for note in r16.notes)


def test_accumulate_dtype_errors_name_the_fix():
    with pytest.raises(ValueError, match="accumulate_dtype="):
        el.train.make_step(el.train.mse, optax.sgd(0.1), accumulate_dtype=jnp.int8)
    with pytest.raises(ValueError, match="needs a loss scale"):
        el.train.make_step(
            el.train.mse, optax.sgd(0.1), accumulate_dtype=jnp.float16, loss_scale=None
        )
    # float16 alone asks for a loss scale ("auto").
    step = el.train.make_step(el.train.mse, optax.sgd(0.1), accumulate_dtype=jnp.float16)
    assert step.loss_scale is not None and step.accumulate_dtype == jnp.float16
