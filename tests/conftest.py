import jax
import jax.random as jr
import pytest

# Strict promotion catches silent float64/int upcasts and accidental broadcasting.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """A function that returns a fresh PRNG key each call, deterministic per test."""
    key = jr.PRNGKey(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey
