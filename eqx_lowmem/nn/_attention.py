"""Multi-head dot-product attention of one example, whole or over chunks of queries."""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._chunk import map_chunks


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(logits: Array, dtype: jnp.dtype) -> Array:
    """Softmax over the last axis computed in float32, returned in 16-bit `dtype`.

    The backward pass keeps only the 16-bit output, which the product with the values keeps
    anyway; autodiff of `jax.nn.softmax` followed by a cast would keep its float32
    exponentials and float32 output as well: three `(heads, q, kv)` arrays' worth of bytes
    instead of one. The gradient is computed in float32 from the 16-bit output (error of
    the order of the 16-bit rounding the logits' gradient gets anyway).
    """
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)


def _softmax_fwd(logits, dtype):
    y = _softmax(logits, dtype)
    return y, y


def _softmax_bwd(dtype, y, g):
    del dtype
    y32, g32 = y.astype(jnp.float32), g.astype(jnp.float32)
    return (y32 * (g32 - jnp.sum(g32 * y32, axis=-1, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _attend(
    q: Float[Array, "q heads head_dim"],
    k: Float[Array, "kv heads head_dim"],
    v: Float[Array, "kv heads head_dim"],
    q_start: Array,
    *,
    causal: bool,
) -> Float[Array, "q heads head_dim"]:
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    logits = jnp.einsum("qhd,khd->hqk", q, k)  # (heads, q, kv)
    # Softmax in float32: 16-bit exponentials overflow and their sums lose the small terms.
    logits = logits.astype(jnp.float32)
    if causal:
        q_pos = q_start + jnp.arange(q.shape[0])
        k_pos = jnp.arange(k.shape[0])
        logits = jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], logits, -jnp.inf)
    if v.dtype == jnp.float32:
        weights = jax.nn.softmax(logits, axis=-1)
    else:
        weights = _softmax(logits, v.dtype)
    return jnp.einsum("hqk,khd->qhd", weights, v)


def attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq heads head_dim"],
    v: Float[Array, "seq heads head_dim"],
    *,
    causal: bool,
    chunk: int | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Softmax attention of one example.

    Args:
        q, k, v: queries, keys and values, `(seq, heads, head_dim)`.
        causal: mask the keys after each query's position.
        chunk: `None` computes the `(heads, seq, seq)` attention matrix at once; an int
            computes it `chunk` queries at a time, each chunk recomputed in its own backward
            pass, so the backward holds one `(heads, chunk, seq)` slice instead of the whole
            matrix (Rabe and Staats, 2021), for one more attention forward.

    Returns:
        The attention output, `(seq, heads, head_dim)`.
    """

    def attend(q_rows: Array, first: Array) -> Array:
        return _attend(q_rows, k, v, first, causal=causal)

    return map_chunks(attend, q, chunk)
