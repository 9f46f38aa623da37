"""Per-sample losses in the form the training step reduces exactly.

A loss for `make_step` returns one value per sample (or per token), never a mean: the step
sums them over the whole batch, however it is split into micro-batches, and divides by the
total weight. It may return `(values, weights)` to weight or mask them (for example
padding tokens). Every loss here computes in float32.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray


def _apply(model, x: Array, key: PRNGKeyArray | None) -> Array:
    if key is None:
        return jax.vmap(model)(x)
    keys = jr.split(key, x.shape[0])
    return jax.vmap(lambda xi, k: model(xi, key=k))(x, keys)


def _mean_trailing(v: Array) -> Array:
    return jnp.mean(v.reshape(v.shape[0], -1), axis=1)


def mse(
    model, x: Float[Array, "batch ..."], y: Float[Array, "batch ..."], *, key=None
) -> Float[Array, " batch"]:
    """Squared error of `jax.vmap(model)(x)` against `y`, averaged over each sample's
    features (the guide's MSE when reduced over the batch)."""
    pred = _apply(model, x, key).astype(jnp.float32)
    return _mean_trailing(jnp.square(pred - y.astype(jnp.float32)))


def cross_entropy(
    model, x: Array, labels: Int[Array, " batch"], *, key=None
) -> Float[Array, " batch"]:
    """Softmax cross-entropy of the logits `jax.vmap(model)(x)` against integer labels."""
    logits = _apply(model, x, key).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def next_token_loss(
    model,
    tokens: Int[Array, "batch seq"],
    mask: Array | None = None,
    *,
    key=None,
) -> tuple[Float[Array, "batch seq_minus_1"], Float[Array, "batch seq_minus_1"]]:
    """Cross-entropy of each next token of a causal language model (`eqx_lowmem.nn.CausalLM`).

    Args:
        model: maps one sequence of token ids to `(seq, vocab)` logits.
        tokens: `(batch, seq)` token ids; position `t` predicts `tokens[:, t + 1]`.
        mask: optional `(batch, seq)`; 0 marks padding, which is not predicted.

    Returns:
        `(losses, weights)` per predicted token, so the step averages over real tokens.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = _apply(model, inputs, key).astype(jnp.float32)  # (batch, seq - 1, vocab)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    weights = jnp.ones_like(nll) if mask is None else mask[:, 1:].astype(jnp.float32)
    return nll, weights
