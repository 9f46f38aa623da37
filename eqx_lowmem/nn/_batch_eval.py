"""Evaluation that normalises as training did: BatchNorm with each micro-batch's statistics."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._norm import BatchNorm
from ._wrn import WideResNet  # noqa: F401  (the example)


def _has_batch_norm(model: Any) -> bool:
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, BatchNorm))
    return any(isinstance(x, BatchNorm) for x in leaves)


def apply_with_batch_statistics(
    model: Any, state: eqx.nn.State, x: Array, *, micro_batch: int
) -> Array:
    """The outputs of a BatchNorm model on `x`, normalised the way training normalised
    them: `x` in micro-batches of `micro_batch` examples, each by its own batch statistics
    (the last one, if smaller, by its own), the running statistics neither used nor
    changed.

    The usual evaluation (`eqx.nn.inference_mode(model)`) normalises with the running
    statistics instead. Trained with micro-batches of one or two examples
    (`make_step(..., accumulate=k)` over a BatchNorm model), those averages describe none of
    the statistics the network learned with, and accuracy falls (issue 36: WRN-10-2 on
    Fashion-MNIST, micro-batches of one image, two seeds: 28.7% with running statistics,
    `frontier.json`, against 77.1% evaluated this way, `frontier_norm.json`). Pass the
    training micro-batch size: the outputs then depend on the other examples of each
    micro-batch, exactly as in training. `eqx_lowmem.nn.GroupNorm`
    avoids the choice (no batch statistics at all).

    Memory and time: as the usual evaluation of `x` at once (all whole micro-batches run
    in one call, an outer `jax.vmap` over them; a smaller last one in a second call, one
    more compilation): pass `x` in pieces to hold less.

    Args:
        model: a model with `eqx_lowmem.nn.BatchNorm` layers (in training or inference
            mode: training mode is used), called as `model.batched(x, state)` if it has
            that method (`WideResNet`), else as `jax.vmap(model, axis_name="batch",
            in_axes=(0, None), out_axes=(0, None))(x, state)`.
        state: its `eqx.nn.State`.
        x: the examples, `(n, ...)`.
        micro_batch: examples normalised together, the training micro-batch size.

    Returns:
        The outputs for every example of `x`, in order.

    Raises:
        ValueError: for a model without `BatchNorm` (its evaluation does not depend on
            the batch: call it as usual), or a `micro_batch` that is not a positive int.

    Example:
        >>> import equinox as eqx, jax.numpy as jnp, jax.random as jr
        >>> model, state = eqx.nn.make_with_state(WideResNet)(10, 1, 3, key=jr.key(0),
        ...     in_channels=1)
        >>> x = jr.normal(jr.key(1), (5, 1, 8, 8))
        >>> logits = apply_with_batch_statistics(model, state, x, micro_batch=2)
        >>> bool(jnp.allclose(logits[4], model.batched(x[4:], state)[0][0], atol=1e-5))
        True
    """
    if not _has_batch_norm(model):
        raise ValueError(
            "apply_with_batch_statistics: the model has no eqx_lowmem.nn.BatchNorm layer, "
            f"got a {type(model).__name__}: its outputs do not depend on the batch, so "
            "evaluate it as usual (eqx.nn.inference_mode(model))."
        )
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(
            f"apply_with_batch_statistics: micro_batch must be a positive int (the training "
            f"micro-batch size), got {micro_batch!r}."
        )
    training = eqx.nn.inference_mode(model, value=False)
    whole = len(x) // micro_batch * micro_batch
    outputs = []
    if whole:
        groups = x[:whole].reshape((whole // micro_batch, micro_batch) + x.shape[1:])
        out = _apply_groups(training, state, groups)  # (groups, micro_batch, ...)
        outputs.append(out.reshape((whole,) + out.shape[2:]))
    if whole < len(x):
        outputs.append(_apply(training, state, x[whole:]))
    return jnp.concatenate(outputs)


def _call(model: Any, state: eqx.nn.State, x: Array) -> Array:
    if hasattr(model, "batched"):
        out, _ = model.batched(x, state)
    else:
        call = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        out, _ = call(x, state)
    return out


_apply = eqx.filter_jit(_call)


@eqx.filter_jit
def _apply_groups(model: Any, state: eqx.nn.State, groups: Array) -> Array:
    """Every micro-batch at once: an outer vmap over them, each with its own statistics."""
    return jax.vmap(lambda xb: _call(model, state, xb))(groups)
