"""Multi-head dot-product attention of one example, whole or over chunks of queries."""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._chunk import map_chunks


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
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
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
