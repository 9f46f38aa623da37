"""The one place that calls a user's loss: casts, state, key, shape check, named results.

The training step, the Trainer's evaluation and its up-front check, and the memory report
all call the loss through `call_loss`, so they cannot drift apart.
"""

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..nn._layers import is_stack, layer_hook
from ..precision._policy import Policy, cast_floating

_MEAN_LOSS = """\
the loss must return one value per sample (or per token) with the batch first, e.g. shape
({n},); got {got}. Return per-sample values, not their mean: the step reduces them exactly.

    def loss(model, x, y):                      # wrong: a mean
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def loss(model, x, y):                      # right: one value per sample
        return jnp.mean((jax.vmap(model)(x) - y) ** 2, axis=-1)
"""


class LossOutput(NamedTuple):
    """What one call of the loss gives back.

    Attributes:
        values: float32 per-sample (or per-token) values, batch first.
        weights: float32, the shape of `values`: the loss's own weights (token masks) times
            the sample weights.
        model_state: the new `eqx.nn.State` of a stateful model, else None.
    """

    values: Float[Array, "batch ..."]
    weights: Float[Array, "batch ..."]
    model_state: Any


def accepts_key(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes a `key` keyword (or `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def cast_outside_stacks(model: Any, dtype: Any) -> Any:
    """Cast the floating leaves of `model` to `dtype`, except those of stacks whose blocks
    are recomputed (`eqx_lowmem.nn.Stack` with `remat` or `segment`), which cast one layer
    at a time inside their scan (so only one block's 16-bit copy is alive, not a copy of
    every parameter for the whole step).

    A stack that recomputes nothing is cast whole here, as a hand-written loop casts: its
    backward pass keeps every layer's 16-bit weights anyway, and cast inside the scan they
    would be stored once more, stacked as the scan's residuals (one more 16-bit copy of
    the stack's parameters)."""
    return jax.tree.map(
        lambda x: x if _recomputed(x) else cast_floating(x, dtype), model, is_leaf=is_stack
    )


def _recomputed(x: Any) -> bool:
    """Whether `x` is a stack that may recompute its blocks (or segments) in the backward
    pass: any stack but one that says it does not (`remat="none"`, no `segment`)."""
    if not is_stack(x):
        return False
    return getattr(x, "remat", None) != "none" or getattr(x, "segment", None) is not None


def call_loss(
    loss_fn: Callable[..., Any],
    model: Any,
    batch: tuple,
    weights: Float[Array, " batch"] | None = None,
    *,
    model_state: Any = None,
    key: PRNGKeyArray | None = None,
    policy: Policy | None = None,
) -> LossOutput:
    """Call `loss_fn` on `model` and `batch` the way every part of the library does.

    Args:
        loss_fn: `loss_fn(model, *batch)`, or `loss_fn(model, model_state, *batch)` when
            `model_state` is given, returning per-sample values `(batch, ...)` or
            `(values, weights)`; with a state it returns `(that, new_model_state)`.
        model: the model, passed as is after the policy's cast.
        batch: tuple of arrays with a common leading batch dimension.
        weights: optional per-sample weights `(batch,)` (0 drops a sample).
        model_state: `eqx.nn.State` of a stateful model, or None.
        key: passed as `key=` when the loss accepts one (dropout); None passes nothing.
        policy: casts the batch's and the model's floating leaves to its `compute_dtype`;
            the leaves of scanned stacks are cast one layer at a time inside the scan.

    Returns:
        A `LossOutput` of float32 values and weights and the new model state.

    Raises:
        ValueError: if the values are not batch-first with one row per sample, or the
            loss's weights do not match its values. TypeError: for values that are not
            floating point (integers, booleans, complex numbers) or returned as a list.
    """
    kwargs = {"key": key} if key is not None and accepts_key(loss_fn) else {}
    cast = None
    if policy is not None:
        dtype = policy.compute_dtype
        model = cast_outside_stacks(model, dtype)
        batch = cast_floating(tuple(batch), dtype)

        def cast(stack, params):
            return cast_floating(params, dtype)

    with layer_hook(cast):
        if model_state is not None:
            out, new_state = loss_fn(model, model_state, *batch, **kwargs)
        else:
            out, new_state = loss_fn(model, *batch, **kwargs), None
    values, own = _values_and_weights(out)
    values = values.astype(jnp.float32)
    n = batch[0].shape[0] if batch and jnp.ndim(batch[0]) else None
    if values.ndim == 0 or (n is not None and values.shape[0] != n):
        raise ValueError(_MEAN_LOSS.format(n=n, got=values.shape))
    own = jnp.ones_like(values) if own is None else jnp.asarray(own).astype(jnp.float32)
    if own.shape != values.shape:
        raise ValueError(
            f"the loss returned weights of shape {own.shape} for values of shape "
            f"{values.shape}; they must match (one weight per value)."
        )
    if weights is not None:
        if weights.shape != values.shape[:1]:
            raise ValueError(
                f"weights must have shape ({values.shape[0]},) (one per sample), got "
                f"{weights.shape}."
            )
        own = own * weights.astype(jnp.float32).reshape(weights.shape + (1,) * (own.ndim - 1))
    return LossOutput(values, own, new_state)


def _values_and_weights(out: Any) -> tuple[Array, Any]:
    """The loss's values (floating point, checked) and its own weights (or None)."""
    if isinstance(out, list):
        raise TypeError(
            f"the loss returned a list of {len(out)} items; return an array of per-sample "
            "values, or a tuple (values, weights). (A list is ambiguous: [values, weights] "
            "and the values of a micro-batch of 2 look alike.)"
        )
    values, own = out if isinstance(out, tuple) else (out, None)
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(
            f"the loss returned values of dtype {values.dtype}; expected floating-point "
            "values (float32, bfloat16, ...). "
            + (
                "A complex loss would train on its real part only: return a real one "
                "(e.g. jnp.abs(z) ** 2)."
                if jnp.issubdtype(values.dtype, jnp.complexfloating)
                else "Integer or boolean values have no gradient, so nothing would train: "
                "compute the loss in floating point (e.g. x.astype(jnp.float32))."
            )
        )
    return values, own


def mean_loss(out: LossOutput) -> Float[Array, ""]:
    """The weighted mean `sum(values * weights) / sum(weights)` of one call (0 if no weight)."""
    total, weight = jnp.sum(out.values * out.weights), jnp.sum(out.weights)
    return total / jnp.where(weight > 0, weight, 1.0)
