"""The update after the gradient, as small pure pieces: mean, finiteness, apply, hook.

`make_step` composes them in this order (3 and 5 only with `skip_nonfinite`, the default
with a loss scale; without it the update is applied as in a hand-written step):

1. `mean_gradient`: the accumulated sums over the batch (and devices) to the exact weighted
   mean gradient and loss, the loss scale divided out.
2. `optimizer_update`: any optax optimizer (16-bit state through
   `eqx_lowmem.precision.half_state`), then `apply_updates`: plain for float32 parameters,
   stochastically rounded for 16-bit ones.
3. `if_finite`: the new state where the gradient is finite, else the old one unchanged
   (parameters, optimizer state, model state and update counter), selected leaf by leaf.
4. An `after_update` hook (`UpdateInfo`), after the finite branch (told whether the update
   was applied): sparse layers rewire there.
5. `all_finite` on the new parameters: the step's `params_finite` metric (a finite gradient
   can still give non-finite parameters: a NaN learning rate, a hook).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..precision._rounding import stochastic_round_tree
from ._accumulate import Sums


class MeanGradient(NamedTuple):
    """The exact batch mean: `grads` of the mean loss, the `loss`, its total `weight`,
    `finite` (every gradient entry and the loss are finite), `norm`, the gradient's global
    norm, and `factor`: `grads` is `scaled(sums, factor)` (to form it again elsewhere)."""

    grads: Any
    loss: Float[Array, ""]
    weight: Float[Array, ""]
    finite: Bool[Array, ""]
    norm: Float[Array, ""]
    factor: Float[Array, ""]


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


def mean_gradient(sums: Sums, scale: Float[Array, ""], *, chunked: bool = True) -> MeanGradient:
    """Divide the summed gradient by the total weight and the loss scale (0 weight: 0).

    `finite` is one check per update, on the accumulated gradient, before clipping: the
    loss and the gradient's norm are finite (a gradient whose squared norm overflows
    float32, entries beyond about 1e19, counts as non-finite: one reduction for both).

    Memory: `grads` is element-wise in the accumulated sums, so XLA computes it inside each
    consumer (the optimizer's update of each leaf) and never stores it whole in float32.
    The norm is chosen when the step is lowered for its platform (a compile-only GPU target
    gets the GPU's). XLA:CPU stores the whole input of a reduction before reducing it, so
    there the norm sums the squares of the accumulated sums (times `factor` once, after:
    no float32 copy of a 16-bit or stacked gradient) and, `chunked`, in a `lax.scan` over
    slices of 2**16 elements of each large leaf (256 KiB of squares at a time;
    `chunked=False` for sharded gradients, which the partitioner would gather to loop
    over). Elsewhere it sums the squares of `grads` itself, the expression the optimizer
    reads, which XLA:GPU reduces where it forms it: compiled for an H100, a WideResNet's
    step then peaks where a hand-written step without a norm does (1.0001x; the sums' own
    squares left it at 1.0165x, the same buffers live at the peak but packed worse: b8df35b).
    """
    safe = jnp.where(sums.weight > 0, sums.weight, 1.0)
    # A product with one float32 factor, not a division: XLA recomputes a cheap element-wise
    # producer inside each of its consumers but stores an expensive one (a division) whole.
    factor = (1.0 if sums.unit is None else sums.unit) / (safe * scale)
    grads = scaled(sums, factor)
    loss = sums.total / safe

    def squares(x):
        return jnp.sum(jnp.square(x.astype(jnp.float32)))

    def norm_of(leaves, *, chunked: bool) -> Array:
        total = jnp.zeros((), jnp.float32)
        for g in leaves:
            total += _chunked(squares, g) if chunked else squares(g)
        return jnp.sqrt(total)

    def on_cpu(sums_grads, factor, _):
        return norm_of(sums_grads, chunked=chunked) * jnp.abs(factor)

    def elsewhere(_, __, grads):
        return norm_of(grads, chunked=False)

    inexact = lambda tree: [g for g in jax.tree.leaves(tree) if eqx.is_inexact_array(g)]  # noqa: E731
    norm = jax.lax.platform_dependent(
        inexact(sums.grads), factor, inexact(grads), cpu=on_cpu, default=elsewhere
    )
    finite = jnp.isfinite(norm) & jnp.isfinite(loss)
    return MeanGradient(grads, loss, sums.weight, finite, norm, factor)


def scaled(sums: Sums, factor: Float[Array, ""]) -> Any:
    """The accumulated gradient times `factor`, in float32 (element-wise: XLA forms it
    inside its consumers)."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) * factor, sums.grads)


CHUNK = 2**16


def _chunked(fn: Callable[[Array], Array], x: Array) -> Array:
    """The sum of `fn` over consecutive slices of `CHUNK` elements of `x` (flattened), read
    in a scan by `dynamic_slice` (no slice of `x` is stored), and its remainder."""
    flat = jnp.ravel(x)
    n = flat.size // CHUNK
    if n <= 1:
        return fn(flat)

    def body(total, i):
        return total + fn(jax.lax.dynamic_slice_in_dim(flat, i * CHUNK, CHUNK)), None

    total = jax.lax.scan(body, jnp.zeros((), jnp.float32), jnp.arange(n))[0]
    return total + fn(flat[n * CHUNK :]) if flat.size % CHUNK else total


def optimizer_update(
    optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any
) -> tuple[Any, Any]:
    """`optimizer.update`, under standard dtype promotion (optax mixes Python floats with
    int32 counters, e.g. Adam's bias correction, which strict promotion rejects)."""
    with jax.numpy_dtype_promotion("standard"):
        try:
            return optimizer.update(grads, opt_state, params)
        except TypeError as e:
            if "missing" not in str(e) or "argument" not in str(e):
                raise
            raise TypeError(_EXTRA_ARGS.format(error=e)) from e


_EXTRA_ARGS = (
    "the optimizer's update needs arguments the step does not pass ({error}): the step "
    "calls optimizer.update(grads, opt_state, params) once per update, from the "
    "accumulated gradient. Optimizers with a line search (optax.lbfgs needs value, grad "
    "and value_fn; optax.polyak_sgd needs value) are not supported: use a first-order one "
    "such as optax.adam or optax.sgd."
)


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
    """`apply()` where `finite`, else `old` (same structure), selected leaf by leaf.

    Memory: a select is element-wise, so XLA computes each leaf's update, its rounding and
    the select in one pass that writes the (donated) old buffer in place. A `lax.cond`
    would compute the update only when it is applied, but stores every operand of its
    branch whole first (the float32 mean gradient) and copies the state that the other
    branch returns unchanged. Time: the update is computed on skipped steps too (rare: a
    loss-scale overflow).
    """
    return select(finite, apply(), old)


def if_finite_cond(finite: Bool[Array, ""], apply: Callable[[], Any], old: Any) -> Any:
    """`apply()` when `finite`, else `old`, as a `lax.cond`: the update is computed only
    when applied, but every operand of its branch is stored whole first and the state the
    other branch returns is copied (see `if_finite`)."""
    return jax.lax.cond(finite, lambda _: apply(), lambda _: old, None)


def select(finite: Bool[Array, ""], new: Any, old: Any) -> Any:
    """`new` where `finite`, else `old`: `jnp.where` on each array leaf (see `if_finite`);
    other leaves are `new`'s."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o) if eqx.is_array(n) else n, new, old)


def all_finite(tree: Any, *, chunked: bool = True) -> Bool[Array, ""]:
    """Whether every floating entry of `tree`'s arrays is finite (no NaN, no inf).

    The step checks its new parameters with it, after the update and any `after_update`
    hook: a NaN learning rate, `optax.adam(eps=0)` on a parameter with no gradient (0/0),
    or a hook can make them non-finite from a finite gradient. `x * 0` is 0 for a finite
    `x` and NaN otherwise, so the sum of the products is exactly 0 or NaN (it never
    overflows). Summed `chunked` as the gradient's norm is (`mean_gradient`), so XLA:CPU
    holds a float32 slice, never a float32 copy of a 16-bit parameter; `chunked=False` for
    sharded parameters. Time: one read of each parameter.
    """

    def zeros(x):
        return jnp.abs(jnp.sum((x * 0).astype(jnp.float32)))

    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        if eqx.is_inexact_array(x) and x.size:
            total = total + (_chunked(zeros, x) if chunked else zeros(x))
    return jnp.isfinite(total)


def _unsigned(dtype: Any) -> Any:
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def read_after(tree: Any, done: Any) -> Any:
    """`tree`, bit for bit, but computed only once every floating array of `done` is.

    XLA:CPU writes each output array of the step in a pass of its own. When the new
    parameters' pass reads the old optimizer state (Adam recomputes its new moments from
    the old ones there) and the new state overwrites the old in place, XLA must either
    order the parameters' pass first or copy the whole old state at the start of the step
    (Adam: twice the parameters' bytes, held through the step). It copies. Reading the old
    state for the new state through this function orders it: each of its floating arrays
    is OR-ed, bit for bit, with an unsigned zero that XLA cannot fold away
    (`min(bits of an element of each array of done, 0)`).
    """
    zero = jnp.zeros((), jnp.uint32)
    for x in jax.tree.leaves(done):
        if eqx.is_inexact_array(x) and x.size:
            first = jax.lax.bitcast_convert_type(jnp.ravel(x)[0], _unsigned(x.dtype))
            zero = zero | jnp.minimum(first.astype(jnp.uint32), jnp.uint32(0))

    def depend(a):
        if not (eqx.is_inexact_array(a) and a.size):
            return a
        kind = _unsigned(a.dtype)
        bits = jax.lax.bitcast_convert_type(a, kind) | zero.astype(kind)
        return jax.lax.bitcast_convert_type(bits, a.dtype)

    return jax.tree.map(depend, tree)
