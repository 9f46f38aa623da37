"""Memory of sparse training, from compilation alone (nothing runs): parameters plus Adam
state, and the compiled step's peak, against the dense model."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem import sparse as sp


def _state_bytes(state):
    leaves = jax.tree.leaves((state.model, state.opt_state))
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves if hasattr(x, "dtype"))


def _shapes(make, density=None):
    model = eqx.filter_eval_shape(make)
    if density is None:
        return model
    return eqx.filter_eval_shape(
        lambda m: sp.sparsify(m, density, key=jr.PRNGKey(1), slack=0.1), model
    )


def _step_memory(model, batch, loss, hook=None):
    step = el.train.make_step(loss, optax.adam(1e-3), after_update=hook)
    state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(0))
    m = step.lower(state, batch).compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return _state_bytes(state), peak - m.alias_size_in_bytes


def _mlp():
    return el.nn.mlp([1024, 1024, 1024, 1024, 10], key=jr.PRNGKey(0))


def test_mlp_at_30_percent_stores_and_peaks_less():
    batch = (
        jax.ShapeDtypeStruct((128, 1024), jnp.float32),
        jax.ShapeDtypeStruct((128,), jnp.int32),
    )
    dense_state, dense_peak = _step_memory(_shapes(_mlp), batch, el.train.cross_entropy)
    sparse = _shapes(_mlp, 0.3)
    state, peak = _step_memory(sparse, batch, el.train.cross_entropy)
    # every allocated slot counted: 10% slack, 16 bytes per slot against 12 per weight
    assert state <= 0.45 * dense_state, state / dense_state
    assert peak <= 0.6 * dense_peak, peak / dense_peak


def test_encoder_parameters_and_adam_at_30_percent():
    def make():
        return el.nn.transformer_encoder(4, 256, 4, 1024, key=jr.PRNGKey(0))

    def state_of(model):
        step = el.train.make_step(el.train.mse, optax.adam(1e-3))
        return _state_bytes(eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(0)))

    ratio = state_of(_shapes(make, 0.3)) / state_of(_shapes(make))
    assert ratio <= 0.45, ratio


@pytest.mark.parametrize("density", [0.0, 1.2])
def test_bad_density(density):
    with pytest.raises(ValueError, match="density="):
        _shapes(_mlp, density)
