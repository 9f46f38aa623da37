"""Activations whose backward pass keeps only their input."""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@jax.custom_jvp
def gelu(x: Array) -> Array:
    """tanh-approximated GELU (as `jax.nn.gelu`), whose backward pass keeps one array the
    size of `x`: its slope, in `x`'s dtype.

    Autodiff of `jax.nn.gelu` keeps the tanh and several products for the backward pass,
    each the size of the feed-forward hidden layer, the largest activation of a transformer
    block. This version computes the slope in float32 in one fused element-wise expression
    and keeps only it (rounded once to `x`'s dtype: a 16-bit gradient gets one more 16-bit
    rounding); under `remat`, which keeps the block's `ffn_hidden`, the slope is
    recomputed from it instead. Forward mode (`jax.jvp`, `jax.jacfwd`) works as for
    `jax.nn.gelu`.
    """
    return jax.nn.gelu(x, approximate=True)


def _slope(x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    inner = _SQRT_2_OVER_PI * (x32 + 0.044715 * x32**3)
    t = jnp.tanh(inner)
    dinner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x32**2)
    return (0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * dinner).astype(x.dtype)


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    # No jax.checkpoint around the tangent (as the other rules of eqx_lowmem.nn._jvp have):
    # it would forward `x` as a residual of its own, which a scan under a selective remat
    # policy that saves `ffn_hidden` (= x) stacks a second time.
    (x,), (dx,) = primals, tangents
    slope = _slope(x)
    return gelu(x), (dx.astype(jnp.float32) * slope.astype(jnp.float32)).astype(x.dtype)
