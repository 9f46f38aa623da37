"""Activations whose backward pass keeps only their input."""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._jvp import linear_tangent, rule_input

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@jax.custom_jvp
def gelu(x: Array) -> Array:
    """tanh-approximated GELU (as `jax.nn.gelu`), whose backward pass keeps only `x`.

    Autodiff of `jax.nn.gelu` keeps the tanh and several products for the backward pass,
    each the size of the feed-forward hidden layer, the largest activation of a transformer
    block. This version recomputes them from `x` in one fused element-wise expression.
    Forward mode (`jax.jvp`, `jax.jacfwd`) works as for `jax.nn.gelu` (`eqx_lowmem.nn._jvp`).
    """
    return jax.nn.gelu(x, approximate=True)


def _gelu_tangent(x: Array, tangents: list) -> Array:
    (dx,) = tangents
    x32 = x.astype(jnp.float32)
    inner = _SQRT_2_OVER_PI * (x32 + 0.044715 * x32**3)
    t = jnp.tanh(inner)
    dinner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x32**2)
    slope = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * dinner
    return (dx.astype(jnp.float32) * slope).astype(dx.dtype)


@functools.partial(gelu.defjvp, symbolic_zeros=True)
def _gelu_jvp(primals, tangents):
    (x,) = primals
    y = gelu(x)
    return y, linear_tangent(_gelu_tangent, rule_input(x), tangents, y)
