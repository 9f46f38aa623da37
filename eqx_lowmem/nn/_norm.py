"""LayerNorm that always normalises in float32, with a backward pass that keeps only its input."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def _stats(x32: Array, eps: float) -> tuple[Array, Array]:
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return mean, jax.lax.rsqrt(var + eps)


def _last_axis(v: Array, ndim: int) -> Array:
    """A vector shaped to broadcast along the last axis of an `ndim`-dimensional array."""
    return v.astype(jnp.float32).reshape((1,) * (ndim - 1) + (-1,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    mean, rstd = _stats(x32, eps)
    y = (x32 - mean) * rstd * _last_axis(weight, x.ndim) + _last_axis(bias, x.ndim)
    return y.astype(x.dtype)


def _layer_norm_fwd(x, weight, bias, eps):
    return _layer_norm(x, weight, bias, eps), (x, weight, bias)


def _layer_norm_bwd(eps, res, dy):
    # Recompute the normalised input from x rather than keep it: the backward pass holds
    # x (which the caller keeps anyway) instead of three activation-sized buffers.
    x, weight, bias = res
    x32 = x.astype(jnp.float32)
    mean, rstd = _stats(x32, eps)
    xhat = (x32 - mean) * rstd
    dy32 = dy.astype(jnp.float32)
    axes = tuple(range(dy.ndim - 1))
    dweight = jnp.sum(dy32 * xhat, axis=axes).astype(weight.dtype)
    dbias = jnp.sum(dy32, axis=axes).astype(bias.dtype)
    g = dy32 * _last_axis(weight, dy.ndim)
    dx = rstd * (
        g - jnp.mean(g, axis=-1, keepdims=True) - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
    )
    return dx.astype(x.dtype), dweight, dbias


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(eqx.Module):
    """Layer normalisation over the last axis, computed in float32 whatever the input dtype.

    The mean and variance of 16-bit activations lose too much precision, so the input is
    upcast, normalised and cast back: the output has the input's dtype. The backward pass
    keeps only the input and recomputes the normalised values, rather than keeping them.
    """

    weight: Array
    bias: Array
    eps: float = eqx.field(static=True)

    def __init__(self, size: int, *, eps: float = 1e-5, dtype=jnp.float32):
        self.weight = jnp.ones((size,), dtype)
        self.bias = jnp.zeros((size,), dtype)
        self.eps = eps

    @jax.named_scope("eqx_lowmem.nn.LayerNorm")
    def __call__(self, x: Float[Array, "*shape size"]) -> Float[Array, "*shape size"]:
        return _layer_norm(x, self.weight, self.bias, self.eps)
