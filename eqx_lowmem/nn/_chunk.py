"""Apply a function to chunks of rows, each chunk recomputed in its own backward pass."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array


def map_chunks(fn: Callable[[Array, Array], Array], x: Array, chunk: int | None) -> Array:
    """`fn(rows, first_row)` over consecutive chunks of `chunk` rows of `x`, concatenated.

    Each chunk runs under `jax.checkpoint`, so the backward pass keeps only the chunk inputs
    and holds one chunk's intermediates at a time, for one more forward pass of `fn`. A
    length that `chunk` does not divide is padded; the padded rows are dropped.
    With `chunk=None` (or `chunk >= len(x)`) this is `fn(x, 0)`.
    """
    n = x.shape[0]
    if chunk is None or chunk >= n:
        return fn(x, jnp.zeros((), jnp.int32))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    if pad:
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
    chunks = x.reshape(n_chunks, chunk, *x.shape[1:])  # (n_chunks, chunk, ...)
    firsts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk
    one = jax.checkpoint(lambda c, first: fn(c, first))
    out = jax.lax.map(lambda args: one(*args), (chunks, firsts))
    return out.reshape(n_chunks * chunk, *out.shape[2:])[:n]
