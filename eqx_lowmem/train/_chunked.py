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


def _steps(tokens: int, vocab: int, chunk: int) -> int:
    """Scan steps over the tokens: the fewest that divide `tokens` and hold at most
    `tokens * chunk` logits a step (`tokens / steps` whole rows of `vocab`)."""
    need = min(tokens, -(-vocab // chunk))
    return next(r for r in range(max(need, 1), tokens + 1) if tokens % r == 0)


def _strided(x: Array, steps: int) -> Array:
    """`(tokens, ...)` as `(steps, tokens / steps, ...)`: step `i` holds rows `i, i + steps,
    ...`, so a token-sharded array keeps its sharding (each shard holds part of every
    step) and nothing is gathered."""
    return jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)


def _unstrided(y: Array) -> Array:
    return jnp.swapaxes(y, 0, 1).reshape(-1, *y.shape[2:])


def _rows(h, w, b, targets):
    """Some tokens' whole float32 logits, their log-sum-exps and losses (NaN for an id
    outside `[0, vocab)`: never clamped or wrapped). The target's logit is its own row's
    dot product, not read from the logits: then nothing reads them after the softmax's
    gradient, which XLA writes over them (one logits-sized buffer a step, not two)."""
    z = _logits(h, w, b)
    lse = jax.nn.logsumexp(z, axis=1)
    return z, lse, lse - _target_logits(h, w, b, targets)


def _target_logits(h, w, b, targets):
    """`(h @ w.T + b)[i, targets[i]]` for each row `i`, from the targets' rows of the head."""
    valid = (targets >= 0) & (targets < w.shape[0])
    ids = jnp.where(valid, targets, 0)
    z = jnp.einsum("td,td->t", h, w[ids].astype(h.dtype), preferred_element_type=jnp.float32)
    z = z if b is None else z + b[ids].astype(jnp.float32)
    return jnp.where(valid, z, jnp.nan)


def _by_platform(vocab_way, token_way, *args):
    """`token_way(*args)` on a GPU, `vocab_way(*args)` elsewhere, chosen when the step is
    lowered for its platform (a compile-only GPU target gets the GPU's). Both ways run the
    same arithmetic in another order; which is faster depends on the platform:

    - by vocabulary chunks (`_lse`, `_recomputed`): a `(tokens, chunk)` block of logits
      a step, the head's gradient written once per chunk, a fourth matmul (the logits
      again, once the log-sum-exp is known). On XLA:CPU the loss-and-gradient of the
      benchmark's head took 0.82x the naive loss's time against 1.04x by token steps (2
      cores, side by side for 7fa9dde).
    - by token steps (`_token_steps`): whole rows of logits for a few tokens a step, the
      gradients in the same pass (the naive loss's three matmuls), the head's gradient
      summed into one buffer each step: on a GPU one matmul (cuBLAS's `beta = 1`)."""
    return jax.lax.platform_dependent(*args, default=vocab_way, cuda=token_way)


def _lse(h, w, b, chunk):
    """Each token's log-sum-exp over the vocabulary, one chunk of logits at a time (a
    running maximum and sum, rescaled as the maximum grows)."""

    def body(carry, i):
        top, total = carry
        _, wc, bc, _, fresh = _chunk_at(w, b, i, chunk)
        z = jnp.where(fresh[None, :], _logits(h, wc, bc), -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(z, axis=1))
        total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(z - new_top[:, None]), axis=1)
        return (new_top, total), None

    init = (jnp.full(h.shape[:1], -jnp.inf), jnp.zeros(h.shape[:1]))
    (top, total), _ = jax.lax.scan(body, init, jnp.arange(_n_chunks(w.shape[0], chunk)))
    return top + jnp.log(total)


def _token_losses(h, w, b, targets, chunk):
    steps = _steps(h.shape[0], w.shape[0], chunk)

    def body(_, xs):
        return None, _rows(w=w, b=b, h=xs[0], targets=xs[1])[2]

    _, nll = jax.lax.scan(body, None, (_strided(h, steps), _strided(targets, steps)))
    return _unstrided(nll)


def _vocab_losses(h, w, b, targets, chunk):
    return _lse(h, w, b, chunk) - _target_logits(h, w, b, targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunked_ce(h, w, b, targets, weights, chunk):
    ways = (functools.partial(f, chunk=chunk) for f in (_vocab_losses, _token_losses))
    return _by_platform(*ways, h, w, b, targets)


def _chunked_ce_fwd(h, w, b, targets, weights, chunk):
    """The losses and the gradients for a cotangent equal to `weights`: `d(sum(weights *
    loss))` for the hidden states (per token), the head's weight and bias, float32."""
    ways = (functools.partial(f, chunk=chunk) for f in (_vocab_pass, _token_steps))
    nll, lse, dh, dw, db = _by_platform(*ways, h, w, b, targets, weights)
    return nll, (h, w, b, targets, weights, lse, dh, dw, db)


def _vocab_pass(h, w, b, targets, weights, chunk):
    lse = _lse(h, w, b, chunk)
    nll = lse - _target_logits(h, w, b, targets)
    return nll, lse, *_recomputed(h, w, b, targets, lse, weights, chunk, float32=True)


def _token_steps(h, w, b, targets, weights, chunk):
    steps = _steps(h.shape[0], w.shape[0], chunk)

    def body(carry, xs):
        dw, db = carry
        hs, ts, ws = xs
        z, lse, nll = _rows(hs, w, b, ts)
        onehot = ts[:, None] == jnp.arange(w.shape[0])[None, :]
        g = (jnp.exp(z - lse[:, None]) - onehot.astype(z.dtype)) * ws[:, None]  # float32
        gc = g.astype(h.dtype)
        dh = jnp.dot(gc, w.astype(h.dtype), preferred_element_type=jnp.float32)
        dw = dw + jnp.dot(gc.T, hs, preferred_element_type=jnp.float32)  # into dw on a GPU
        db = None if db is None else db + jnp.sum(g, axis=0)
        return (dw, db), (nll, dh, lse)

    init = (
        jnp.zeros(w.shape, jnp.float32),
        None if b is None else jnp.zeros(b.shape, jnp.float32),
    )
    xs = (_strided(h, steps), _strided(targets, steps), _strided(weights, steps))
    (dw, db), (nll, dh, lse) = jax.lax.scan(body, init, xs)
    return _unstrided(nll), _unstrided(lse), _unstrided(dh), dw, db


def _chunked_ce_bwd(chunk, res, g_loss):
    """The forward pass's gradients scaled, when the cotangent is `weights` times one
    number (a weighted mean of the losses, as every loss of the library takes); else
    recomputed for any cotangent, one vocabulary chunk at a time."""
    h, w, b, targets, weights, lse, dh, dw, db = res
    g_loss = g_loss.astype(jnp.float32)
    scale = jnp.sum(g_loss * weights) / jnp.maximum(jnp.sum(weights * weights), 1e-30)
    proportional = jnp.all(jnp.abs(g_loss - scale * weights) <= 1e-6 * jnp.max(jnp.abs(g_loss)))

    def cast(dh, dw, db):
        return dh.astype(h.dtype), dw.astype(w.dtype), None if b is None else db.astype(b.dtype)

    def scaled(_):
        return cast(scale * dh, scale * dw, None if db is None else scale * db)

    def recomputed(_):
        return cast(*_recomputed(h, w, b, targets, lse, g_loss, chunk))

    dh, dw, db = jax.lax.cond(proportional, scaled, recomputed, None)
    return dh, dw, db, None, None


def _recomputed(h, w, b, targets, lse, g_loss, chunk, float32=False):
    """Per vocabulary chunk, recomputed logits give `(softmax - onehot) * g` (float32),
    from which the chunk's rows of the head's gradients (written in place into whole-head
    buffers, in the head's dtypes or `float32`) and its part of the hidden states' gradient
    (summed in float32)."""

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
        jnp.zeros(w.shape, jnp.float32 if float32 else w.dtype),
        None if b is None else jnp.zeros(b.shape, jnp.float32 if float32 else b.dtype),
    )
    (dh, dw, db), _ = jax.lax.scan(body, init, jnp.arange(_n_chunks(w.shape[0], chunk)))
    return dh, dw, db


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
    weights: Float[Array, " tokens"] | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> Float[Array, " tokens"]:
    """Softmax cross-entropy of the logits `hidden @ head_weight.T (+ head_bias)` against
    `targets`, a few tokens' logits at a time: the whole logits are never held, forward or
    backward.

    Memory: about `tokens * chunk` float32 logits at a time instead of two `tokens *
    vocab` arrays kept from the forward pass to the backward: a `(tokens, chunk)` block of
    the logits a step, or on a GPU whole rows of the logits for `tokens * chunk / vocab`
    tokens a step. Smaller chunks hold less, larger ones run fewer, wider matmuls.

    Time: differentiated, the forward pass also computes the gradients for a cotangent
    proportional to `weights`, kept as one float32 head-sized gradient and one float32 row
    per token. Off a GPU it runs over vocabulary chunks: the log-sum-exp, then each chunk's
    logits again for its rows of the gradients (four matmuls; the chunk's rows of the
    head's gradient written once). On a GPU it runs over token steps: the naive loss's
    three matmuls, the head's gradient summed into its buffer by one matmul a step. The
    backward pass scales them when its cotangent is `weights` times one number, which is
    what every weighted mean of the losses gives (the library's steps, `next_token_loss`).
    Any other cotangent is exact too: the backward pass then recomputes the logits one
    vocabulary chunk of `chunk` at a time. Memory: `benchmarks/memory.py --only lm_loss/`;
    time: `speed_lm_loss.json`, from `benchmarks/speed.py` at commit 80a7b30.

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
        weights: how the caller weighs each token's loss (a mask of 0 and 1, say); None
            for equal weights. Only speed depends on it (above), never the result.
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
    if weights is not None and weights.shape != targets.shape:
        raise ValueError(
            f"chunked_cross_entropy: weights has shape {weights.shape}, expected the "
            f"targets' {targets.shape}."
        )
    chunk = check_chunk(chunk, head_weight.shape[0])
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    return _chunked_ce(
        hidden, head_weight, head_bias, targets.astype(jnp.int32),
        jax.lax.stop_gradient(weights.astype(jnp.float32)), chunk,
    )  # fmt: skip
