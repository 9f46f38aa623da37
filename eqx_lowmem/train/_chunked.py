"""Cross-entropy through a linear head that never holds the whole logits.

A language model's loss is usually `log_softmax(hidden @ head.T)`: float32 logits of
`(tokens, vocab)` and a log-softmax of the same size, kept for the backward pass. At a
vocabulary of 32,000 and 2,048 tokens a micro-batch that is 262 MB each. Here the head's
matmul and the log-sum-exp run one vocabulary chunk at a time (a `lax.scan`), and a custom
backward pass recomputes each chunk's logits from the hidden states instead of keeping them
(as Cut Cross-Entropy, Wijmans et al. 2024, and Levanter's blockwise loss).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

DEFAULT_CHUNK = 2048


def check_chunk(chunk: object, vocab: int) -> int:
    """`chunk` as an int in `[1, vocab]`, else a ValueError naming it."""
    ok = isinstance(chunk, (int, np.integer)) and not isinstance(chunk, (bool, np.bool_))
    if not ok or not 1 <= chunk <= vocab:  # type: ignore[operator]
        raise ValueError(
            f"chunk must be a positive int no larger than the vocabulary ({vocab}), got "
            f"{type(chunk).__name__} {chunk!r}."
        )
    return int(chunk)  # type: ignore[arg-type]


def _logits(h: Array, w: Array, b: Array | None) -> Array:
    """One chunk's float32 logits: `h @ w.T (+ b)` in `h`'s dtype, accumulated in float32."""
    z = jnp.dot(h, w.astype(h.dtype).T, preferred_element_type=jnp.float32)
    return z if b is None else z + b.astype(jnp.float32)[None, :]


def _chunk_at(w: Array, b: Array | None, i: Array, chunk: int):
    """Chunk `i`'s rows of the head, read in place (`dynamic_slice`, no copy of the head):
    rows `[start, start + chunk)` with `start = min(i * chunk, vocab - chunk)`, so the last
    chunk overlaps the one before when `chunk` does not divide `vocab`; `fresh` marks the
    rows no earlier chunk covered, the only ones that count."""
    vocab = w.shape[0]
    start = jnp.minimum(i * chunk, vocab - chunk)
    wc = jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=0)
    bc = None if b is None else jax.lax.dynamic_slice_in_dim(b, start, chunk, axis=0)
    cols = start + jnp.arange(chunk)
    return start, wc, bc, cols, cols >= i * chunk


def _n_chunks(vocab: int, chunk: int) -> int:
    return -(-vocab // chunk)


def _lse_and_target(h, w, b, targets, chunk):
    """Per token: the float32 log-sum-exp of the logits, and the target's logit (NaN for an
    id outside `[0, vocab)`: it falls in no chunk, never clamped or wrapped)."""
    n = h.shape[0]

    def body(carry, i):
        m, s, picked = carry
        _, wc, bc, cols, fresh = _chunk_at(w, b, i, chunk)
        z = _logits(h, wc, bc)  # (tokens, chunk) float32
        hit = targets[:, None] == cols[None, :]
        picked = jnp.where(jnp.any(hit, axis=1), jnp.sum(jnp.where(hit, z, 0.0), axis=1), picked)
        z = jnp.where(fresh[None, :], z, -jnp.inf)
        new_m = jnp.maximum(m, jnp.max(z, axis=1))
        s = s * jnp.exp(m - new_m) + jnp.sum(jnp.exp(z - new_m[:, None]), axis=1)
        return (new_m, s, picked), None

    init = (
        jnp.full((n,), -jnp.inf, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.full((n,), jnp.nan, jnp.float32),
    )
    (m, s, picked), _ = jax.lax.scan(body, init, jnp.arange(_n_chunks(w.shape[0], chunk)))
    return m + jnp.log(s), picked


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_ce(h, w, b, targets, chunk):
    lse, picked = _lse_and_target(h, w, b, targets, chunk)
    return lse - picked


def _chunked_ce_fwd(h, w, b, targets, chunk):
    lse, picked = _lse_and_target(h, w, b, targets, chunk)
    return lse - picked, (h, w, b, targets, lse)


def _chunked_ce_bwd(chunk, res, g_loss):
    """Per chunk, recomputed logits give `(softmax - onehot) * g` (float32), from which the
    chunk's rows of the head's gradients (written in place into whole-head buffers) and its
    part of the hidden states' gradient (summed in float32)."""
    h, w, b, targets, lse = res
    g_loss = g_loss.astype(jnp.float32)

    def body(carry, i):
        dh, dw, db = carry
        start, wc, bc, cols, fresh = _chunk_at(w, b, i, chunk)
        z = _logits(h, wc, bc)
        p = jnp.where(fresh[None, :], jnp.exp(z - lse[:, None]), 0.0)
        onehot = (targets[:, None] == cols[None, :]) & fresh[None, :]
        g = (p - onehot.astype(p.dtype)) * g_loss[:, None]  # (tokens, chunk) float32
        gc = g.astype(h.dtype)
        dh = dh + jnp.dot(gc, wc.astype(h.dtype), preferred_element_type=jnp.float32)
        dw_c = jnp.dot(gc.T, h, preferred_element_type=jnp.float32)
        dw = _add_rows(dw, dw_c, start)
        db = None if db is None else _add_rows(db, jnp.sum(g, axis=0), start)
        return (dh, dw, db), None

    init = (
        jnp.zeros(h.shape, jnp.float32),
        jnp.zeros(w.shape, w.dtype),
        None if b is None else jnp.zeros(b.shape, b.dtype),
    )
    (dh, dw, db), _ = jax.lax.scan(body, init, jnp.arange(_n_chunks(w.shape[0], chunk)))
    return dh.astype(h.dtype), dw, db, None


def _add_rows(total: Array, part: Array, start: Array) -> Array:
    """`total[start:start + len(part)] += part`, in place inside the loop."""
    rows = jax.lax.dynamic_slice_in_dim(total, start, part.shape[0], axis=0)
    new = (rows.astype(jnp.float32) + part).astype(total.dtype)
    return jax.lax.dynamic_update_slice_in_dim(total, new, start, axis=0)


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def chunked_cross_entropy(
    hidden: Float[Array, "tokens d_model"],
    head_weight: Float[Array, "vocab d_model"],
    targets: Int[Array, " tokens"],
    *,
    head_bias: Float[Array, " vocab"] | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> Float[Array, " tokens"]:
    """Softmax cross-entropy of the logits `hidden @ head_weight.T (+ head_bias)` against
    `targets`, one vocabulary chunk at a time: the whole logits are never held, forward or
    backward.

    Memory: `tokens * chunk` float32 logits at a time (and as many for the softmax's
    gradient in the backward pass) instead of two `tokens * vocab` arrays kept from the
    forward pass to the backward; the backward pass keeps only `hidden`, the head and one
    float32 log-sum-exp per token. Time: the head's matmul runs twice (once more in the
    backward pass to recompute each chunk's logits); measured side by side in
    `benchmarks/memory.py --lm-loss`. Smaller chunks hold less, larger ones run fewer, wider
    matmuls.

    The matmuls run in `hidden`'s dtype (16-bit under mixed precision) with float32
    accumulation; the log-sum-exp, the losses and the softmax's gradient are float32. The
    head's gradients have the head's dtype, the hidden states' gradient `hidden`'s.

    A target outside `[0, vocab)` gets a NaN loss (never a clamped or wrapped id); a
    position whose loss gets a zero cotangent (a masked one, `jnp.where(mask, loss, 0)`)
    adds nothing to any gradient.

    Args:
        hidden: the states the head reads, one row per token (reshape `(batch, seq, d)`
            to `(batch * seq, d)`).
        head_weight: the head's `(vocab, d_model)` weight (a tied head: the token
            embedding itself).
        targets: integer class ids, one per row of `hidden`.
        head_bias: the head's bias, if it has one.
        chunk: vocabulary entries per chunk, in `[1, vocab]`; need not divide `vocab`.

    Returns:
        float32 `-log softmax(logits)[target]` per token.

    Raises:
        ValueError: for a `chunk` that is not an int in `[1, vocab]`, or shapes that do not
            match.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr
        >>> h, w = jr.normal(jr.key(0), (6, 4)), jr.normal(jr.key(1), (10, 4))
        >>> t = jnp.array([0, 3, 9, 2, 2, 7])
        >>> naive = -jnp.take_along_axis(jax.nn.log_softmax(h @ w.T), t[:, None], 1)[:, 0]
        >>> bool(jnp.allclose(chunked_cross_entropy(h, w, t, chunk=3), naive, atol=1e-5))
        True
    """
    if hidden.ndim != 2 or head_weight.ndim != 2 or hidden.shape[1] != head_weight.shape[1]:
        raise ValueError(
            f"chunked_cross_entropy: expected hidden (tokens, d_model) and head_weight "
            f"(vocab, d_model), got {hidden.shape} and {head_weight.shape}."
        )
    if targets.shape != hidden.shape[:1] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"chunked_cross_entropy: targets must be ({hidden.shape[0]},) integer ids, got "
            f"shape {targets.shape} and dtype {targets.dtype}."
        )
    if head_bias is not None and head_bias.shape != head_weight.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy: head_bias has shape {head_bias.shape}, expected "
            f"({head_weight.shape[0]},)."
        )
    chunk = check_chunk(chunk, head_weight.shape[0])
    return _chunked_ce(hidden, head_weight, head_bias, targets.astype(jnp.int32), chunk)
