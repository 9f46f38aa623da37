"""Optimizer state stored in 16 bits, for any optax optimizer."""

from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from ._policy import cast_floating
from ._rounding import stochastic_round_tree

_ROUNDINGS = ("stochastic", "nearest")


def _is_buffer(x: Any) -> bool:
    """A leaf of optimizer state stored in 16 bits: a floating array with an axis."""
    return eqx.is_inexact_array(x) and x.ndim >= 1 and jnp.issubdtype(x.dtype, jnp.floating)


def _is_packed(x: Any) -> bool:
    """A leaf `quantized_state` packed (codes and scales): left as it is in 16-bit state."""
    from ._quantized import QuantizedArray  # noqa: PLC0415 (it imports this module)

    return isinstance(x, QuantizedArray)


def _nearest(dtype: Any):
    return lambda x: x.astype(dtype) if _is_buffer(x) else x


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
    state back in `dtype`. Only the buffers are stored in `dtype`: the floating-point
    leaves with at least one axis (moments, traces). Scalars keep their dtype: step
    counters, and the hyperparameters of `optax.inject_hyperparams` (a `b2` of 0.999 is
    1.0 in bfloat16, and a learning rate of 1e-3 becomes 0.00099945), as do the moments of
    a scalar parameter (4 bytes each).

    Rounding: `"stochastic"` (the default) rounds each new state value up or down at random
    in proportion to its distance to the two neighbouring 16-bit numbers, so it is right on
    average: an exponential moving average whose per-step change is below half a 16-bit
    step (Adam's second moment with `b2=0.999` changes by 0.1% per step; bfloat16 numbers
    are 0.4-0.8% apart) still moves. Round to nearest would freeze it: a second moment that
    should decay after a spike of gradients stays at the spike forever. The key lives in the
    state (8 bytes), so the result is deterministic and resumes from a checkpoint.

    Memory: half of the optimizer state (Adam: from 8 to 4 bytes per parameter). Time: two
    casts of the state per update, and with stochastic rounding a few integer operations per
    state value (a counter-based hash, computed inside the rounding pass: no random array is
    stored).

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

    def store(inner_state, key):
        """The buffers of `inner_state` in `dtype`, everything else as it is."""
        leaves, treedef = jax.tree.flatten(inner_state, is_leaf=_is_packed)
        slots = [i for i, x in enumerate(leaves) if _is_buffer(x)]
        buffers = [leaves[i] for i in slots]
        if stochastic:
            buffers = stochastic_round_tree(buffers, dtype, key)
        else:
            buffers = cast_floating(buffers, dtype)
        for i, x in zip(slots, buffers, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def init(params):
        inner_state = inner.init(cast_floating(params, jnp.float32))
        key = jr.PRNGKey(seed) if stochastic else None
        # The first state is exact in any dtype (zeros, usually): nearest is enough, and
        # `key` stays unused until the first update.
        return HalfState(jax.tree.map(_nearest(dtype), inner_state, is_leaf=_is_packed), key)

    def update(updates, state, params=None):
        # Buffers to float32; scalars (counts, hyperparameters) were never cast.
        inner_state = jax.tree.map(_nearest(jnp.float32), state.inner, is_leaf=_is_packed)
        params32 = None if params is None else cast_floating(params, jnp.float32)
        updates, inner_state = inner.update(
            cast_floating(updates, jnp.float32), inner_state, params32
        )
        if stochastic:
            key, round_key = jr.split(state.key)
            return updates, HalfState(store(inner_state, round_key), key)
        return updates, HalfState(store(inner_state, None), None)

    return optax.GradientTransformation(init, update)
