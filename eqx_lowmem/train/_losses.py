"""Per-sample losses in the form the training step reduces exactly.

A loss for `make_step` returns one value per sample (or per token), never a mean: the step
sums them over the whole batch, however it is split into micro-batches, and divides by the
total weight. It may return `(values, weights)` to weight or mask them (for example
padding tokens). Every loss here computes in float32.
"""

import functools
import weakref
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import ids_outside, within
from ._chunked import DEFAULT_CHUNK, check_chunk, chunked_cross_entropy


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
    chunk: int | None | Literal["auto"] = "auto",
) -> tuple[Float[Array, "batch seq_minus_1"], Float[Array, "batch seq_minus_1"]]:
    """Cross-entropy of each next token of a causal language model (`eqx_lowmem.nn.CausalLM`).

    Two paths, the same losses (to 1e-5, gradients to 1e-4 in float32):

    - Chunked (`chunked_cross_entropy`): for a model with `hidden_states(tokens, *, key)`
      (`(seq, d_model)`) and `head_weights()` (`(weight (vocab, d_model), bias or None)`),
      as `CausalLM` has. The head runs one chunk of `chunk` vocabulary entries at a time
      and the whole `(batch, seq, vocab)` logits are never held, forward or backward.
    - Plain: `jax.vmap(model)` gives the whole logits, then a float32 log-softmax; both
      are kept for the backward pass (two `batch * seq * vocab` float32 arrays).

    `chunk="auto"` (the default) takes the chunked path, chunks of 2,048, when the model
    has both methods and its vocabulary is larger than 2,048 (at most one chunk would save
    nothing), else the plain path; `chunk=None` always the plain path; an int the chunked
    path with that chunk (the model must have both methods).

    Args:
        model: maps one sequence of token ids to `(seq, vocab)` logits.
        tokens: `(batch, seq)` token ids; position `t` predicts `tokens[:, t + 1]`.
        mask: optional `(batch, seq)`; 0 marks padding, which is not predicted.
        key: PRNG key for dropout, or None.
        chunk: `"auto"`, None or a vocabulary chunk size in `[1, vocab]` (above).

    Returns:
        `(losses, weights)` per predicted token, so the step averages over real tokens.

    Raises:
        ValueError: for tokens that are not `(batch, seq)` integers, a mask of another
            shape, a `chunk` outside `[1, vocab]` (or given for a model without
            `hidden_states` and `head_weights`), or (outside `jit`, where the values are
            known) a token id outside `[0, vocab)`. Traced, such an id's loss is NaN (never
            a clamped or wrapped id; masked positions excepted), which
            `checkify.index_checks` reports.
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
    weights = None if mask is None else mask[:, 1:].astype(jnp.float32)
    head = _chunked_head(model, chunk)
    if head is None:
        nll = _plain_nll(model, tokens, key)
    else:
        nll = _chunked_nll(model, head, tokens, key, chunk, weights)
    if weights is None:
        return nll, jnp.ones_like(nll)
    return jnp.where(weights > 0, nll, 0.0), weights  # a masked target never matters


def _chunked_head(model, chunk) -> tuple[Array, Array | None] | None:
    """The model's `(weight, bias)` when `chunk` asks for the chunked path, else None."""
    exposes = hasattr(model, "hidden_states") and hasattr(model, "head_weights")
    if chunk is None:
        return None
    if isinstance(chunk, str) and chunk == "auto":
        if not exposes:
            return None
        head = model.head_weights()
        return head if head[0].shape[0] > DEFAULT_CHUNK else None
    if not exposes:
        raise ValueError(
            f"next_token_loss: chunk={chunk!r} needs a model with hidden_states(tokens, *, "
            f"key) and head_weights() (as eqx_lowmem.nn.CausalLM); got a "
            f"{type(model).__name__}. Pass chunk=None (or 'auto') for the plain path."
        )
    return model.head_weights()


def _plain_nll(model, tokens: Array, key) -> Array:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = _apply(model, inputs, key).astype(jnp.float32)  # (batch, seq - 1, vocab)
    _check_lm_shape(inputs, targets, logits.shape)
    _refuse_ids("next_token_loss", "tokens", tokens, logits.shape[-1], "token ids")
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -_pick(logp, targets)


def _chunked_nll(model, head, tokens: Array, key, chunk, weights: Array | None) -> Array:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    weight, bias = head
    vocab = weight.shape[0]
    size = check_chunk(DEFAULT_CHUNK if chunk == "auto" else chunk, vocab)
    _refuse_ids("next_token_loss", "tokens", tokens, vocab, "token ids")
    hidden = _apply(model.hidden_states, inputs, key)  # (batch, seq - 1, d_model)
    _check_lm_shape(inputs, targets, hidden.shape[:2] + (vocab,))
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_weights = None if weights is None else jnp.where(weights > 0, weights, 0.0).reshape(-1)
    nll = chunked_cross_entropy(
        flat, weight, targets.reshape(-1), head_bias=bias, weights=flat_weights, chunk=size
    )
    return nll.reshape(targets.shape)


def _check_lm_shape(inputs: Array, targets: Array, shape: tuple[int, ...]) -> None:
    if tuple(shape[:2]) != targets.shape:
        raise ValueError(
            f"next_token_loss: the model maps {inputs.shape[1]} tokens to logits of shape "
            f"{tuple(shape[1:])}; expected (seq, vocab) = ({inputs.shape[1]}, vocab)."
        )


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


# The last model asked about (held weakly), its sample's shape and dtype, and the answer:
# a loop asks about the same model every batch, and flattening it cost more than the check.
_LAST: list[Any] = [None, None, None]


def _classes(model: Any, sample: np.ndarray) -> int | None:
    """The size of the last output axis of `model` on one sample, from shapes alone (no
    compute); None when the model cannot be traced this way (the step reports that)."""
    ref, of, classes = _LAST
    if ref is not None and ref() is model and of == (sample.shape, sample.dtype):
        return classes
    classes = _structural_classes(model, sample)
    try:
        _LAST[:] = [weakref.ref(model), (sample.shape, sample.dtype), classes]
    except TypeError:  # not weakly referenceable
        pass
    return classes


def _structural_classes(model: Any, sample: np.ndarray) -> int | None:
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
        if within(a):  # the common case, in one pass
            continue
        if np.issubdtype(a.dtype, np.floating) or a.dtype == jnp.bfloat16:
            finite = np.isfinite(a.astype(np.float32) if a.dtype == jnp.bfloat16 else a)
            if not finite.all():
                bad = np.flatnonzero(~finite)
                first = np.unravel_index(bad[0], a.shape)
                raise ValueError(
                    f"batch[{i}] holds {bad.size} non-finite values (NaN or inf; first at "
                    f"index {tuple(int(j) for j in first)}: {a[first]}). {_BAD_DATA}"
                )
    for i, classes in id_fields(loss_fn, model, arrays).items():
        _check_ids(f"batch[{i}]", arrays[i], classes, "labels" if i else "token ids")


def id_fields(loss_fn: Callable[..., Any], model: Any, arrays: list[np.ndarray]) -> dict:
    """The fields of a batch that hold ids for a built-in loss, each with the model's
    number of classes (None where unknown): `cross_entropy`'s labels (`batch[1]`) and
    `next_token_loss`'s token ids (`batch[0]`); from the arrays' shapes and dtypes only."""
    builtin = _builtin(loss_fn)
    if builtin is cross_entropy and len(arrays) >= 2 and arrays[0].ndim >= 1:
        return {1: _classes(model, arrays[0][0])}
    if builtin is next_token_loss and arrays and arrays[0].ndim == 2:
        tokens = arrays[0]
        return {0: _classes(model, tokens[0, :-1]) if tokens.shape[1] > 1 else None}
    return {}
