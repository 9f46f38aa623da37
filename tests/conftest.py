import os

# Compile faster: on XLA:CPU, LLVM's optimisation of the generated machine code is most of
# the compile time, and the tests compile hundreds of small programs. It changes neither
# buffer assignment (the memory figures tests assert) nor floating-point semantics (no
# fast-math). Must be set before JAX starts its backend; subprocesses inherit it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402

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
