"""Stochastic rounding of float32 values to 16-bit floats."""

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray


def stochastic_round(x: Float[Array, "*shape"], dtype, key: PRNGKeyArray) -> Float[Array, "*shape"]:
    """Round `x` to `dtype` up or down at random, in proportion to its distance to each.

    Unbiased: `E[stochastic_round(x)] == x`, so an update much smaller than the spacing of
    16-bit numbers around a parameter still moves it on average, where round-to-nearest
    would drop it every time (Gupta et al., 2015, "Deep Learning with Limited Numerical
    Precision", Section 3).
    """
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    nearest = x.astype(dtype)
    back = nearest.astype(jnp.float32)
    # The two representable neighbours that bracket x.
    other = jnp.where(
        back > x,
        jnp.nextafter(nearest, jnp.asarray(-jnp.inf, dtype)),
        jnp.nextafter(nearest, jnp.asarray(jnp.inf, dtype)),
    )
    lo = jnp.minimum(nearest, other)
    hi = jnp.maximum(nearest, other)
    lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
    gap = hi32 - lo32
    p_up = jnp.where(gap > 0, (x - lo32) / jnp.where(gap > 0, gap, 1.0), 0.0)
    up = jr.uniform(key, x.shape) < p_up
    exact = back == x
    out = jnp.where(up, hi, lo)
    return jnp.where(exact | ~jnp.isfinite(x), nearest, out)


def stochastic_round_tree(tree, dtype, key: PRNGKeyArray):
    """`stochastic_round` over the floating leaves of a pytree, each with its own key."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jr.split(key, max(len(leaves), 1))
    out = [
        stochastic_round(x, dtype, k) if jnp.issubdtype(x.dtype, jnp.floating) else x
        for x, k in zip(leaves, keys, strict=False)
    ]
    return jax.tree.unflatten(treedef, out)
