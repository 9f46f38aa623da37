"""Optimizer state stored in 16 bits, for any optax optimizer."""

from typing import Any, Literal, NamedTuple

import jax.numpy as jnp
import jax.random as jr
import optax

from ._policy import cast_floating
from ._rounding import stochastic_round_tree

_ROUNDINGS = ("stochastic", "nearest")


class HalfState(NamedTuple):
    """State of `half_state`: the wrapped optimizer's state in 16 bits, and the PRNG key of
    its stochastic rounding (None with `rounding="nearest"`)."""

    inner: Any
    key: Any


def half_state(
    inner: optax.GradientTransformation,
    dtype: Any = jnp.bfloat16,
    *,
    rounding: Literal["stochastic", "nearest"] = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformation:
    """Wrap an optax optimizer so its floating-point state is stored in `dtype`.

    Each update casts the state to float32, runs `inner` in float32, and stores the new
    state back in `dtype`. Integer state (step counters) is untouched.

    Rounding: `"stochastic"` (the default) rounds each new state value up or down at random
    in proportion to its distance to the two neighbouring 16-bit numbers, so it is right on
    average: an exponential moving average whose per-step change is below half a 16-bit
    step (Adam's second moment with `b2=0.999` changes by 0.1% per step; bfloat16 numbers
    are 0.4-0.8% apart) still moves. Round to nearest would freeze it: a second moment that
    should decay after a spike of gradients stays at the spike forever. The key lives in the
    state (8 bytes), so the result is deterministic and resumes from a checkpoint.

    Memory: half of the optimizer state (Adam: from 8 to 4 bytes per parameter). Time: two
    casts of the state per update, and one random number per state value with stochastic
    rounding.

    Args:
        inner: any optax optimizer.
        dtype: the storage dtype, `jnp.bfloat16` (recommended: float32's exponent range) or
            `jnp.float16` (the square of a gradient of 1e-4 underflows in it).
        rounding: `"stochastic"` or `"nearest"`.
        seed: the seed of the stochastic rounding's key.

    Returns:
        An optax `GradientTransformation` whose state is a `HalfState`.

    Raises:
        ValueError: for a `dtype` other than bfloat16/float16/float32 or an unknown
            `rounding`.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> opt = half_state(optax.adam(1e-3))
        >>> state = opt.init({"w": jnp.zeros(3)})
        >>> state.inner[0].mu["w"].dtype
        dtype(bfloat16)

    References:
        Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015, Section 3
        (stochastic rounding).
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(
            f"half_state(dtype={dtype}) is not supported; expected bfloat16 or float16 "
            "(or float32, which stores the state unchanged)."
        )
    if rounding not in _ROUNDINGS:
        raise ValueError(f"half_state(rounding={rounding!r}); expected one of {_ROUNDINGS}.")
    stochastic = rounding == "stochastic" and dtype != jnp.dtype(jnp.float32)

    def init(params):
        inner_state = cast_floating(inner.init(cast_floating(params, jnp.float32)), dtype)
        return HalfState(inner_state, jr.PRNGKey(seed) if stochastic else None)

    def update(updates, state, params=None):
        inner_state = cast_floating(state.inner, jnp.float32)
        params32 = None if params is None else cast_floating(params, jnp.float32)
        updates, inner_state = inner.update(
            cast_floating(updates, jnp.float32), inner_state, params32
        )
        if stochastic:
            key, round_key = jr.split(state.key)
            return updates, HalfState(stochastic_round_tree(inner_state, dtype, round_key), key)
        return updates, HalfState(cast_floating(inner_state, dtype), None)

    return optax.GradientTransformation(init, update)
