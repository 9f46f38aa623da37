"""Stochastic rounding of float32 values to 16-bit floats."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray


def stochastic_round(
    x: Float[ArrayLike, "*shape"], dtype: Any, key: PRNGKeyArray
) -> Float[Array, "*shape"]:
    """Round `x` to `dtype` up or down at random, in proportion to its distance to each.

    Unbiased: `E[stochastic_round(x)] == x`, so an update much smaller than the spacing of
    16-bit numbers around a parameter still moves it on average, where round-to-nearest
    would drop it every time. Values exactly representable in `dtype` are returned
    unchanged, inf and nan as `x.astype(dtype)`; a finite value beyond the largest finite
    number of `dtype` becomes that number or inf.

    bfloat16 (the top half of a float32) adds 16 random bits below the kept ones and
    truncates; other dtypes compare a uniform draw with the position of `x` between its two
    neighbours. Memory and time: one 32-bit random number per element and a few
    element-wise operations.

    Args:
        x: the values, any floating dtype (computed in float32).
        dtype: the target dtype, for example `jnp.bfloat16`.
        key: PRNG key of the random draws.

    Returns:
        `x` rounded to `dtype`, same shape.

    Raises:
        ValueError: if `dtype` is not a floating-point type of at most 32 bits.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr
        >>> x = jnp.full((10000,), 1.0 + 2.0**-10)  # a quarter of bfloat16's step above 1
        >>> y = stochastic_round(x, jnp.bfloat16, jr.PRNGKey(0))
        >>> sorted(set(y.tolist()))
        [1.0, 1.0078125]
        >>> round(float(y.astype(jnp.float32).mean() - 1.0), 4)  # E[y] = x: 0.0010
        0.001

    References:
        Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015, Section 3.
    """
    dtype = _check_dtype(dtype)
    x = jnp.asarray(x)
    return _round(x, dtype, jr.bits(key, x.shape, jnp.uint32))


def _check_dtype(dtype: Any) -> Any:
    """The target dtype, refused unless a float of at most 32 bits."""
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        d = None
    if d is None or not jnp.issubdtype(d, jnp.floating) or d.itemsize > 4:
        raise ValueError(
            f"stochastic rounding to dtype={dtype!r}: expected a floating-point dtype of at "
            "most 32 bits (jnp.bfloat16, jnp.float16 or jnp.float32); rounding to an "
            "integer type is not stochastic rounding of floats (use jnp.round, then astype)."
        )
    return d


def _round(x: Array, dtype: Any, bits: Array) -> Array:
    """`stochastic_round` with given random `bits` (uint32, shaped as `x`)."""
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    if dtype == jnp.dtype(jnp.float32):
        return x
    if dtype == jnp.dtype(jnp.bfloat16):
        # bfloat16 is the top half of a float32: add 16 random bits below it and truncate.
        # The carry rounds the magnitude up with probability (dropped bits) / 2**16, exactly
        # the distance to the lower neighbour over the gap (also across exponents).
        noise = jax.lax.shift_right_logical(bits, jnp.uint32(16))
        raised = jax.lax.bitcast_convert_type(x, jnp.uint32) + noise
        truncated = raised & jnp.uint32(0xFFFF0000)
        out = jax.lax.bitcast_convert_type(truncated, jnp.float32).astype(dtype)  # exact
        return jnp.where(jnp.isfinite(x), out, x.astype(dtype))
    u = jax.lax.shift_right_logical(bits, jnp.uint32(8)).astype(jnp.float32) * 2.0**-24
    nearest = x.astype(dtype)
    back = nearest.astype(jnp.float32)
    # The two representable neighbours that bracket x: nearest, and the next one towards x.
    other = jnp.where(
        back > x,
        jnp.nextafter(nearest, jnp.asarray(-jnp.inf, dtype)),
        jnp.nextafter(nearest, jnp.asarray(jnp.inf, dtype)),
    )
    lo = jnp.minimum(nearest, other)
    hi = jnp.maximum(nearest, other)
    lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
    gap = hi32 - lo32
    # gap is inf (or nan) when x is not finite or beyond dtype's largest finite number.
    ordinary = jnp.isfinite(gap) & (gap > 0)
    p_up = jnp.where(ordinary, (x - lo32) / jnp.where(ordinary, gap, 1.0), 0.0)
    out = jnp.where(u < p_up, hi, lo)
    return jnp.where((back == x) | ~ordinary, nearest, out)


def stochastic_round_tree(tree: Any, dtype: Any, key: PRNGKeyArray) -> Any:
    """`stochastic_round` over the floating-point array leaves of a pytree (independent
    draws for every element); other leaves are returned unchanged.

    All the random numbers come from one draw, split between the leaves: one random number
    generator in the compiled program rather than one per leaf, which matters for compile
    time on CPU.
    """
    dtype = _check_dtype(dtype)
    leaves, treedef = jax.tree.flatten(tree)
    floating = [i for i, x in enumerate(leaves) if eqx.is_inexact_array(x)]
    if not floating:
        return tree
    sizes = [leaves[i].size for i in floating]
    bits = jr.bits(key, (sum(sizes),), jnp.uint32)
    start = 0
    for i, size in zip(floating, sizes, strict=True):
        x = leaves[i]
        leaves[i] = _round(x, dtype, bits[start : start + size].reshape(x.shape))
        start += size
    return jax.tree.unflatten(treedef, leaves)
