"""The update after the gradient, as small pure pieces: mean, finiteness, apply, hook.

`make_step` composes them in this order:

1. `mean_gradient`: the accumulated sums over the batch (and devices) to the exact weighted
   mean gradient and loss, the loss scale divided out.
2. `optimizer_update`: any optax optimizer (16-bit state through
   `eqx_lowmem.precision.half_state`), then `apply_updates`: plain for float32 parameters,
   stochastically rounded for 16-bit ones.
3. `if_finite`: the new state where the gradient is finite, else the old one unchanged
   (parameters, optimizer state, model state and update counter), as a `lax.cond`.
4. An `after_update` hook (`UpdateInfo`), after the finite branch (told whether the update
   was applied): sparse layers rewire there.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..precision._loss_scale import all_finite
from ..precision._rounding import stochastic_round_tree
from ._accumulate import Sums


class MeanGradient(NamedTuple):
    """The exact batch mean: `grads` of the mean loss, the `loss`, its total `weight`, and
    `finite` (every gradient entry and the loss are finite)."""

    grads: Any
    loss: Float[Array, ""]
    weight: Float[Array, ""]
    finite: Bool[Array, ""]


class UpdateInfo(NamedTuple):
    """What an `after_update` hook receives besides the new state.

    Attributes:
        grads: the mean gradient of this update (float32), structured as
            `eqx.filter(model, eqx.is_inexact_array)`.
        key: a fresh PRNG key for the hook.
        grad_fn: `grad_fn(model)` is the mean gradient of this update's batch at another
            model of the same structure as its argument's inexact leaves (for example a dense
            view of a sparse model, for RigL). It costs one more accumulated backward pass
            each time it is called: call it under `jax.lax.cond` on the steps that need it.
        finite: whether this step's update was applied (False: a non-finite gradient
            skipped it, and the state is the previous one). The hook runs on every step,
            after the update or its skip; a hook that should act only after an update
            gates its work on `finite` (`jax.lax.cond`, or `jnp.where`). None where a
            caller has no such check.
    """

    grads: Any
    key: PRNGKeyArray
    grad_fn: Callable[[Any], Any]
    finite: Bool[Array, ""] | None = None


def mean_gradient(sums: Sums, scale: Float[Array, ""]) -> MeanGradient:
    """Divide the summed gradient by the total weight and the loss scale (0 weight: 0)."""
    safe = jnp.where(sums.weight > 0, sums.weight, 1.0)
    grads = jax.tree.map(lambda g: g / (safe * scale), sums.grads)
    loss = sums.total / safe
    # One finiteness check per update, on the accumulated gradient, before clipping.
    return MeanGradient(grads, loss, sums.weight, all_finite(grads) & jnp.isfinite(loss))


def optimizer_update(
    optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any
) -> tuple[Any, Any]:
    """`optimizer.update`, under standard dtype promotion (optax mixes Python floats with
    int32 counters, e.g. Adam's bias correction, which strict promotion rejects)."""
    with jax.numpy_dtype_promotion("standard"):
        return optimizer.update(grads, opt_state, params)


def apply_updates(params: Any, updates: Any, *, param_dtype: Any, key: PRNGKeyArray) -> Any:
    """`params + updates`. 16-bit parameters (`param_dtype`) are rounded stochastically from
    the float32 sum, so updates smaller than half a 16-bit step still move them on average
    (`key` is used only then)."""
    if jnp.dtype(param_dtype).itemsize >= 4:
        return optax.apply_updates(params, updates)
    summed = jax.tree.map(
        lambda p, u: p.astype(jnp.float32) + u.astype(jnp.float32), params, updates
    )
    return stochastic_round_tree(summed, param_dtype, key)


def if_finite(finite: Bool[Array, ""], apply: Callable[[], Any], old: Any) -> Any:
    """`apply()` when `finite`, else `old` (same structure), without computing both at run
    time: a `lax.cond`."""
    return jax.lax.cond(finite, lambda _: apply(), lambda _: old, None)
