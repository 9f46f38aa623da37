"""Per-sample losses in the form the training step reduces exactly.

A loss for `make_step` returns one value per sample (or per token), never a mean: the step
sums them over the whole batch, however it is split into micro-batches, and divides by the
total weight. It may return `(values, weights)` to weight or mask them (for example
padding tokens). Every loss here computes in float32.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import ids_outside


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
    features (the guide's MSE when reduced over the batch).

    Raises:
        ValueError: if the outputs and `y` differ in shape (`y` of shape `(16,)` against
            outputs `(16, 1)` would broadcast to `(16, 16)`).
    """
    pred = _apply(model, x, key).astype(jnp.float32)
    if pred.shape != y.shape:
        raise ValueError(
            f"mse: the model's outputs have shape {pred.shape} but y has shape {y.shape}; "
            f"they must be equal (no broadcasting). E.g. y.reshape{pred.shape} if y holds "
            "one target per sample."
        )
    return _mean_trailing(jnp.square(pred - y.astype(jnp.float32)))


def cross_entropy(model, x: Array, labels: Array, *, key=None) -> Float[Array, " batch"]:
    """Softmax cross-entropy of the logits `jax.vmap(model)(x)` against integer labels
    of shape `(batch,)` (checked here, with a message that says what to fix).

    Labels outside `[0, classes)`: refused when their values are known here (a call
    outside `jit`); traced, their loss is NaN (never a clamped or wrapped class), which
    `jax.experimental.checkify.checkify(..., errors=checkify.index_checks)` reports. The
    Trainer checks every batch on the host first (`check_batch`).

    Raises:
        ValueError: if the logits are not `(batch, classes)`, the labels not `(batch,)`
            integers, or (outside `jit`) a label outside `[0, classes)`.
    """
    logits = _apply(model, x, key).astype(jnp.float32)
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy: expected logits of shape (batch, classes) and labels of shape "
            f"(batch,); got logits {logits.shape} and labels {labels.shape}."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"cross_entropy: labels must be integer class ids, got dtype {labels.dtype}."
        )
    _refuse_ids("cross_entropy", "labels", labels, logits.shape[-1], "labels")
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -_pick(logp, labels)


def next_token_loss(
    model,
    tokens: Array,
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

    Raises:
        ValueError: for tokens that are not `(batch, seq)` integers, a mask of another
            shape, or (outside `jit`, where the values are known) a token id outside
            `[0, vocab)`. Traced, such an id's loss is NaN (never a clamped or wrapped id;
            masked positions excepted), which `checkify.index_checks` reports.
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"next_token_loss: tokens must be (batch, seq) integer ids, got shape "
            f"{tokens.shape} and dtype {tokens.dtype}."
        )
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError(
            f"next_token_loss: mask has shape {mask.shape}, expected the tokens' {tokens.shape}."
        )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = _apply(model, inputs, key).astype(jnp.float32)  # (batch, seq - 1, vocab)
    if logits.shape[:2] != targets.shape:
        raise ValueError(
            f"next_token_loss: the model maps {inputs.shape[1]} tokens to logits of shape "
            f"{logits.shape[1:]}; expected (seq, vocab) = ({inputs.shape[1]}, vocab)."
        )
    _refuse_ids("next_token_loss", "tokens", tokens, logits.shape[-1], "token ids")
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -_pick(logp, targets)
    if mask is None:
        return nll, jnp.ones_like(nll)
    weights = mask[:, 1:].astype(jnp.float32)
    return jnp.where(weights > 0, nll, 0.0), weights  # a masked target never matters


def _pick(logp: Array, ids: Array) -> Array:
    """`logp[..., ids]` along the last axis; NaN for an id outside it (JAX would clamp a
    large id and wrap a negative one)."""
    picked = jnp.take_along_axis(
        logp, ids[..., None], axis=-1, mode="fill", fill_value=jnp.nan,
        wrap_negative_indices=False,
    )  # fmt: skip
    return picked[..., 0]


def _refuse_ids(loss: str, name: str, ids: Array, size: int, what: str) -> None:
    """Ids outside `[0, size)`, where their values are known here (outside `jit`)."""
    bad = ids_outside(ids, size)
    if bad is not None:
        raise ValueError(
            f"{loss}: {name} holds {what} {bad[0]}, but the model has {size} outputs, so "
            f"they must lie in [0, {size}); {bad[1]}. {_BAD_DATA}"
        )


# ----------------------------------------------------------------------------- host checks

_BAD_DATA = (
    "this is bad data, not a training problem (no learning rate fixes it): clean or filter "
    "the data before training."
)


def _builtin(loss_fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The built-in loss `loss_fn` is (also through `functools.partial`), else None."""
    fn = loss_fn
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn if fn in (mse, cross_entropy, next_token_loss) else None


# Output sizes already found, by the model's leaf shapes and the sample's shape: the check
# then costs one trace per model and sample shape, not one per batch.
_CLASSES: dict[Any, int | None] = {}


def _classes(model: Any, sample: np.ndarray) -> int | None:
    """The size of the last output axis of `model` on one sample, from shapes alone (no
    compute); None when the model cannot be traced this way (the step reports that)."""
    leaves, treedef = jax.tree.flatten(model)
    shapes = tuple([(getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves])
    try:
        key = (treedef, shapes, sample.shape, str(sample.dtype))
        hash(key)
    except TypeError:  # a static field that does not hash: no cache
        return _trace_classes(model, sample)
    if key not in _CLASSES:
        if len(_CLASSES) > 64:
            _CLASSES.clear()
        _CLASSES[key] = _trace_classes(model, sample)
    return _CLASSES[key]


def _trace_classes(model: Any, sample: np.ndarray) -> int | None:
    spec = jax.ShapeDtypeStruct(sample.shape, sample.dtype)
    for kwargs in ({}, {"key": jr.PRNGKey(0)}):
        try:
            out = eqx.filter_eval_shape(lambda m, x, kw=kwargs: m(x, **kw), model, spec)
        except Exception:
            continue
        leaves = jax.tree.leaves(out)
        if len(leaves) == 1 and leaves[0].ndim >= 1:
            return int(leaves[0].shape[-1])
        return None
    return None


def _check_ids(name: str, ids: np.ndarray, classes: int | None, what: str) -> None:
    bad = ids_outside(ids, classes)  # non-integer ids: the loss itself refuses them
    if bad is None:
        return
    expected = (
        "they must be >= 0"
        if classes is None
        else f"the model has {classes} outputs, so they must lie in [0, {classes})"
    )
    raise ValueError(
        f"{name} holds {what} {bad[0]}, but {expected}; {bad[1]}. Inside the step their "
        f"loss would be NaN. {_BAD_DATA}"
    )


def check_batch(loss_fn: Callable[..., Any], model: Any, batch: tuple[Any, ...]) -> None:
    """Check a batch on the host for data a loss would silently accept (or turn into NaN).

    - Every floating-point array is finite: a NaN or inf in the data (a flipped exponent
      bit) would give a non-finite loss that looks like divergence.
    - For the built-in losses: `cross_entropy`'s labels (`batch[1]`) and
      `next_token_loss`'s token ids (`batch[0]`) lie in `[0, classes)`, with `classes` the
      size of the model's last output axis (from `eqx.filter_eval_shape`, no compute).
      Inside the step such ids give a NaN loss (a skipped update), which says less than
      naming them here.

    A user's own loss gets the finiteness check only. Time: one pass over the batch on the
    host (device arrays are copied to the host first), and once per model and sample shape
    a trace of the model's shapes; cheap enough for every batch.

    Args:
        loss_fn: the loss the step is built with.
        model: the model (its output size is read from shapes only).
        batch: the tuple of arrays one step receives (host or device arrays).

    Raises:
        ValueError: naming the batch field, what was expected and what arrived, and saying
            it is bad data.

    Example:
        >>> import numpy as np, equinox as eqx, jax.random as jr
        >>> model = eqx.nn.Linear(2, 3, key=jr.key(0))
        >>> x = np.zeros((4, 2), np.float32)
        >>> check_batch(cross_entropy, model, (x, np.array([0, 1, 2, 1])))
        >>> check_batch(cross_entropy, model, (x, np.array([0, 1, 3, 1])))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: batch[1] holds labels from 0 to 3, but the model has 3 outputs, so ...
    """
    if not isinstance(batch, (tuple, list)):
        raise TypeError(f"batch must be a tuple of arrays, got a {type(batch).__name__}.")
    arrays = [np.asarray(x) for x in batch]
    for i, a in enumerate(arrays):
        if np.issubdtype(a.dtype, np.floating) or a.dtype == jnp.bfloat16:
            finite = np.isfinite(a.astype(np.float32) if a.dtype == jnp.bfloat16 else a)
            if not finite.all():
                bad = np.flatnonzero(~finite)
                first = np.unravel_index(bad[0], a.shape)
                raise ValueError(
                    f"batch[{i}] holds {bad.size} non-finite values (NaN or inf; first at "
                    f"index {tuple(int(j) for j in first)}: {a[first]}). {_BAD_DATA}"
                )
    builtin = _builtin(loss_fn)
    if builtin is cross_entropy and len(arrays) >= 2 and arrays[0].ndim >= 1:
        _check_ids("batch[1]", arrays[1], _classes(model, arrays[0][0]), "labels")
    elif builtin is next_token_loss and arrays and arrays[0].ndim == 2:
        tokens = arrays[0]
        classes = _classes(model, tokens[0, :-1]) if tokens.shape[1] > 1 else None
        _check_ids("batch[0]", tokens, classes, "token ids")
