"""Stochastic rounding of float32 values to 16-bit floats."""

import math
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
    neighbours. The random bits are a counter-based hash of each element's index and the
    key (`counter_bits`), computed inside the rounding's own element-wise pass: no random
    array is ever stored, where `jax.random.bits` would hold 4 bytes per element (and
    threefry's loop on CPU several such arrays at once). Time: a few integer operations
    per element.

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
        >>> x = jnp.full((100_000,), 1.0 + 2.0**-10)  # an eighth of bfloat16's step above 1
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
    return _round(x, dtype, counter_bits(key, x.shape))


def _mix(h: Array) -> Array:
    """Chris Wellons' `lowbias32`: a bijective 32-bit mixer whose output bits each depend
    on every input bit (bias 0.17 of an ideal mixer's)."""
    h = h ^ jax.lax.shift_right_logical(h, jnp.uint32(16))
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ jax.lax.shift_right_logical(h, jnp.uint32(15))
    h = h * jnp.uint32(0x846CA68B)
    return h ^ jax.lax.shift_right_logical(h, jnp.uint32(16))


def _seed_words(key: PRNGKeyArray) -> tuple[Array, Array]:
    """Two 32-bit words of a PRNG key (raw `uint32[2]` or typed), mixed once."""
    data = jr.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    words = jnp.ravel(data).astype(jnp.uint32)
    return _mix(words[0]), _mix(words[-1] ^ jnp.uint32(0x9E3779B9))


def counter_bits(key: PRNGKeyArray, shape: tuple[int, ...], offset: int = 0) -> Array:
    """32 random bits per element of `shape`: a hash of the element's flat index (plus
    `offset`) and `key`, computed element-wise (XLA fuses it into its consumer, so no
    random array is stored). Distinct `offset` ranges give independent streams of one key.

    Not a cryptographic generator: a counter-based hash (two rounds of a 32-bit mixer
    keyed by both words of the key), ample for the noise of stochastic rounding. Indices
    wrap modulo 2**32.
    """
    size = math.prod(shape)
    s0, s1 = _seed_words(key)
    index = jax.lax.iota(jnp.uint32, size) + jnp.uint32(offset % 2**32)
    return _mix(_mix(index ^ s0) + s1).reshape(shape)


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

    Each leaf's bits are `counter_bits` over its own range of indices (one stream of the
    key across the leaves), computed inside that leaf's rounding: no random array of the
    whole tree (4 bytes per element) is ever held.
    """
    dtype = _check_dtype(dtype)
    leaves, treedef = jax.tree.flatten(tree)
    floating = [i for i, x in enumerate(leaves) if eqx.is_inexact_array(x)]
    if not floating:
        return tree
    start = 0
    for i in floating:
        x = leaves[i]
        leaves[i] = _round(x, dtype, counter_bits(key, x.shape, start))
        start += x.size
    return jax.tree.unflatten(treedef, leaves)
