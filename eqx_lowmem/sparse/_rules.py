"""DSR, SET and RigL as `after_update` hooks of `eqx_lowmem.train.make_step`: when each
rewires, which slots it prunes and where it grows them. The loops that apply a rule to the
sparse layers and their optimizer state, one layer at a time, are in `_rewire.py`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from ._convert import densify
from ._rewire import (
    _candidates_best,
    _flat2,
    _grow_random,
    _if_updated,
    _per_layer,
    _place,
    _positions,
    _prune,
    _rewire,
    _sparse_of,
    _when,
)

Hook = Callable[[Any, Any], Any]
_DECAYS = ("constant", "cosine")


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}; expected an int >= {low}.")
    return value


def _check_fraction(name: str, value: Any, low_open: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
        bounds = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name}={value!r}; expected a fraction in {bounds}.")
    return float(value)


# -- DSR ----------------------------------------------------------------------------------


def allocate(total: Int[Array, ""], weight: Array, room: Array) -> Array:
    """Split the integer `total` across layers in proportion to `weight`, never giving a
    layer more than its `room`: largest shares first, the integer remainder one by one,
    and what a full layer cannot take shared again among the others (water-filling).
    Layers without weight share equally when no layer with room has any.

    Returns the int32 share of every layer; it sums to `min(total, sum(room))`.

    Example:
        >>> import jax.numpy as jnp
        >>> allocate(jnp.int32(10), jnp.array([1, 1, 2]), jnp.array([9, 9, 3])).tolist()
        [4, 3, 3]
    """
    weight = weight.astype(jnp.float32)
    room = room.astype(jnp.int32)
    limit = 2 * weight.shape[0] + 4

    def body(carry):
        given, it = carry
        rem = total - jnp.sum(given)
        open_ = room - given > 0
        w = jnp.where(open_, weight, 0.0)
        w = jnp.where(jnp.sum(w) > 0, w, open_.astype(jnp.float32))
        exact = rem.astype(jnp.float32) * w / jnp.sum(w)
        share = jnp.minimum(jnp.floor(exact).astype(jnp.int32), room - given)
        # Float rounding must never hand out more than what remains.
        share = jnp.minimum(share, jnp.maximum(rem - (jnp.cumsum(share) - share), 0))
        # The remainder, one each, to the open layers with the largest fractional parts.
        left = rem - jnp.sum(share)
        frac = jnp.where(room - given - share > 0, exact - share.astype(jnp.float32), -1.0)
        order = jnp.argsort(-frac, stable=True)
        place = jnp.zeros_like(room).at[order].set(jnp.arange(room.shape[0], dtype=jnp.int32))
        share = share + ((place < left) & (frac >= 0)).astype(jnp.int32)
        return given + share, it + 1

    def cond(carry):
        given, it = carry
        return (jnp.sum(given) < total) & jnp.any(room > given) & (it < limit)

    given, _ = jax.lax.while_loop(cond, body, (jnp.zeros_like(room), jnp.int32(0)))
    return given


def _below(i: Array, v: Array, cut: Array, size: int) -> Array:
    """The occupied slots whose magnitude is below DSR's threshold `cut`."""
    return (i < size) & (jnp.abs(v).astype(jnp.float32) < cut)


def _dsr_plan(
    layers: list, do: Array, *, exp: Array, threshold: float, fraction: float, tolerance: float
):
    """Mostafa and Wang's global decision, for `_rewire`: the count each layer regrows
    (freed weights across layers in proportion to survivors), the threshold it prunes
    below (`threshold * 2**exp`), and the adapted exponent.

    Each layer's counts come from its own loop of zero or one trip, chained one after the
    other, so that only one layer's temporaries exist at a time; the layer's rewiring finds
    the same slots again from the values it carries (`_dsr_one`)."""
    counts = [math.prod(x.stack_shape) for x in layers]
    cut = threshold * jnp.exp2(exp.astype(jnp.float32))

    survivors, removed = [], []
    chain = jnp.zeros((), jnp.int32)
    for x, n in zip(layers, counts, strict=True):

        def count(kept, pruned, i, v, chain, size=x.size, x=x):
            del kept, pruned, chain
            i = jax.vmap(functools.partial(_positions, x))(i)
            pruned = jnp.sum(_below(i, v, cut, size).astype(jnp.int32), axis=-1)
            return jnp.sum((i < size).astype(jnp.int32), axis=-1) - pruned, pruned

        zeros = jnp.zeros((n,), jnp.int32)
        extra = (_flat2(x.indices, n), _flat2(x.values, n), chain)
        kept, pruned = _when(do, count, (zeros, zeros), extra)
        chain = pruned[0]
        survivors.append(kept)
        removed.append(pruned)
    survived = jnp.concatenate(survivors)
    total_removed = jnp.sum(jnp.concatenate(removed))
    capacity = jnp.concatenate(
        [jnp.full((n,), x.capacity, jnp.int32) for x, n in zip(layers, counts, strict=True)]
    )
    # Mostafa and Wang: regrow the freed count across layers in proportion to survivors.
    grow = allocate(total_removed, survived, capacity - survived)
    # ... and adapt the threshold to prune about `fraction` of all sparse weights next time.
    target = fraction * sum(x.size * n for x, n in zip(layers, counts, strict=True))
    found = total_removed.astype(jnp.float32)
    new_exp = (
        exp
        + (found < (1.0 - tolerance) * target).astype(jnp.int32)
        - (found > (1.0 + tolerance) * target).astype(jnp.int32)
    )
    new_exp = jnp.where(do, new_exp, exp)
    starts = np.cumsum([0, *counts])
    spans = zip(starts[:-1], starts[1:], strict=True)
    return [(grow[a:b], jnp.broadcast_to(cut, (b - a,))) for a, b in spans], new_exp


def _dsr_one(x, i, plan, key, v, *, fraction: float):
    """One layer for `_rewire`: prune its slots below the global threshold (those
    `_dsr_plan` counted), regrow its share at random free positions."""
    grow, cut = plan
    prune = _below(i, v, cut, x.size)
    draws = min(x.capacity, max(256, math.ceil(4 * fraction * x.size)))
    ni, taken = _grow_random(_prune(i, prune, x.size), grow, key, size=x.size, draws=draws)
    return ni, prune | taken


def _dsr_period(step: Array, period: int, total_steps: int | None) -> Array:
    """The authors' schedule: the period doubles at 20%, 40% and 60% of training and
    rewiring stops at 80% (epochs 40, 80, 120 and 160 of 200); 0 means stopped."""
    if total_steps is None:
        return jnp.int32(period)
    t = step.astype(jnp.float32) / total_steps
    factor = jnp.where(t < 0.2, 1, jnp.where(t < 0.4, 2, jnp.where(t < 0.6, 4, 8)))
    return jnp.where(t < 0.8, factor * period, 0).astype(jnp.int32)


def dsr(
    *,
    period: int = 100,
    fraction: float = 0.01,
    threshold: float = 1e-3,
    tolerance: float = 0.1,
    total_steps: int | None = None,
) -> Hook:
    """Dynamic sparse reparameterization (Mostafa and Wang, 2019) as an `after_update` hook.

    Every `period` updates: prune every weight of every sparse layer whose magnitude is
    below one global threshold `H`; regrow as many weights, shared across layers in
    proportion to each layer's surviving weights (`allocate`), at uniformly random free
    positions, with value 0 and zero optimizer state; then double `H` if fewer than
    `(1 - tolerance) * fraction * N` weights were pruned, or halve it if more than
    `(1 + tolerance) * fraction * N` (N: all the sparse layers' dense weights). The total
    count of non-zeros never changes. A layer grows into its free slots only: build the
    model with `sparsify(..., slack=0.1)`. Without slack every layer can only regrow what
    it pruned (the authors' `within_param` heuristic, not DSR's reallocation).

    Memory and time on rewiring steps only, one layer at a time: one dense bool occupancy
    mask (1 byte per dense weight) and a few int32 arrays of the layer's slots. A step
    that does not rewire makes no pass over any slot (its loops take zero trips).

    Args:
        period: updates between rewirings. Paper and authors' code: 100 (CIFAR WRN).
        fraction: target pruned per rewiring, as a fraction of the sparse layers' dense
            weights (the paper's N_p; the authors' default `fraction_to_prune=1e-2`).
        threshold: the initial `H` (authors' code: 1e-3).
        tolerance: the paper's fractional tolerance delta, 0.1.
        total_steps: when given, the authors' CIFAR schedule: the period doubles at 20%,
            40% and 60% of `total_steps` and rewiring stops at 80%. None: every
            `period` updates for ever.

    Returns:
        `hook(state, info) -> state`, for `make_step(..., after_update=hook)`. `H` is the
        hook's state between steps, one scalar in the training state
        (`TrainState.hook_state`, a `DSRState`), which `hook.init(model)` makes and
        `Step.init` calls.

    Raises:
        ValueError: for a non-positive `period`, `threshold` or `total_steps`, or a
            `fraction` or `tolerance` outside (0, 1]; at `init` or when first run, for a
            model without sparse layers; when run on a state without its `DSRState`.

    Example:
        >>> hook = dsr(period=100, total_steps=10_000)

    References:
        Mostafa and Wang, "Parameter Efficient Training of Deep Convolutional Neural
        Networks by Dynamic Sparse Reparameterization", ICML 2019, Algorithm 1 and
        Appendix (hyperparameters); the authors' code, github.com/caseus-viridis/dst,
        `DSModel.reparameterize` (prune, adjust the threshold, reallocate) and
        `experiments/train_cifar_wrn.py` (period 100, fraction 1e-2, threshold 1e-3,
        tolerance 0.1, the schedule of `total_steps`).
    """
    _check_int("period", period, 1)
    fraction = _check_fraction("fraction", fraction)
    tolerance = _check_fraction("tolerance", tolerance)
    if not (isinstance(threshold, (int, float)) and threshold > 0):
        raise ValueError(f"threshold={threshold!r}; expected a positive float (paper: 1e-3).")
    if total_steps is not None:
        _check_int("total_steps", total_steps, 1)

    return _DSR(period, fraction, threshold, tolerance, total_steps)


class DSRState(NamedTuple):
    """DSR's state between steps (`TrainState.hook_state`): its global pruning threshold
    `H = threshold * 2**threshold_exp`, as the exponent (Mostafa and Wang double or halve
    `H`); 4 bytes for the whole model."""

    threshold_exp: Int[Array, ""]


_NO_DSR_STATE = (
    "dsr keeps its threshold in the training state's hook_state, which Step.init makes: "
    "state = make_step(..., after_update=hook).init(model, key=key). A TrainState built "
    "by hand needs TrainState(..., hook_state=hook.init(model)); got hook_state={!r}."
)


@dataclasses.dataclass(frozen=True)
class _DSR:
    """The hook `dsr` returns: `hook(state, info) -> state`, and `init(model)` for its
    `DSRState`."""

    period: int
    fraction: float
    threshold: float
    tolerance: float
    total_steps: int | None

    def init(self, model: Any) -> DSRState:
        """DSR's part of the training state: `H` at its initial `threshold`."""
        _sparse_of(model)  # a clear error for a dense model, before any step
        return DSRState(jnp.zeros((), jnp.int32))

    def __call__(self, state: Any, info: Any) -> Any:
        _sparse_of(state.model)  # a clear error for a dense model, before tracing more
        hook_state = getattr(state, "hook_state", None)
        if not isinstance(hook_state, DSRState):
            raise ValueError(_NO_DSR_STATE.format(hook_state))
        p = _dsr_period(state.step, self.period, self.total_steps)
        do = _if_updated((p > 0) & (state.step % jnp.maximum(p, 1) == 0), info)
        plan = functools.partial(
            _dsr_plan,
            exp=hook_state.threshold_exp,
            threshold=self.threshold,
            fraction=self.fraction,
            tolerance=self.tolerance,
        )
        one = functools.partial(_dsr_one, fraction=self.fraction)
        new, exp = _rewire(state, do, plan, one, info.key)
        return dataclasses.replace(new, hook_state=DSRState(exp))


# -- SET and RigL -------------------------------------------------------------------------


def _drop_fraction(
    step: Array, fraction: float, decay: str, end: int | None
) -> tuple[Array, Array]:
    """(fraction to drop now, whether rewiring is still on)."""
    t = step.astype(jnp.float32)
    if end is None:
        return jnp.float32(fraction), jnp.bool_(True)
    on = step <= end
    if decay == "cosine":
        return fraction / 2 * (1 + jnp.cos(jnp.pi * t / end)), on
    return jnp.float32(fraction), on


def _swap_prune(i, v, f, *, size: int, k_max: int):
    """(count, prune mask) of one layer: its `floor(f * nnz)` smallest magnitudes (at
    most `k_max`), ties broken by slot order."""
    cap = i.shape[0]
    active = i < size
    count = jnp.floor(f * jnp.sum(active).astype(jnp.float32)).astype(jnp.int32)
    count = jnp.minimum(count, k_max)
    mag = jnp.where(active, jnp.abs(v).astype(jnp.float32), jnp.inf)
    order = jnp.argsort(mag, stable=True)
    rank = jnp.zeros((cap,), jnp.int32).at[order].set(jnp.arange(cap, dtype=jnp.int32))
    return count, rank < count


def _swap_hook(
    name: str,
    period: int,
    fraction: float,
    total_steps: int | None,
    end: float,
    decay: str,
    gradient: bool,
) -> Hook:
    _check_int("period", period, 1)
    fraction = _check_fraction("fraction", fraction)
    end = _check_fraction("end", end)
    if decay not in _DECAYS:
        raise ValueError(f"{name}(decay={decay!r}); expected one of {_DECAYS}.")
    if total_steps is not None:
        _check_int("total_steps", total_steps, 1)
    stop = None if total_steps is None else int(end * total_steps)

    def k_max_of(x: Any) -> int:
        return max(1, math.ceil(fraction * x.capacity))

    def hook(state: Any, info: Any) -> Any:
        _sparse_of(state.model)  # a clear error for a dense model, before tracing more
        f, on = _drop_fraction(state.step, fraction, decay, stop)
        do = _if_updated(on & (state.step % period == 0), info)

        def plan(layers, do):
            if not gradient:  # SET: every layer decides alone
                return [None] * len(layers), None
            return jax.lax.cond(do, best_free, idle, layers), None

        def idle(layers):
            return [jnp.zeros((math.prod(x.stack_shape), k_max_of(x)), jnp.int32) for x in layers]

        def best_free(layers):
            # RigL: the dense gradient of every layer (one more backward pass), reduced
            # here to each layer's k_max best free positions: all a layer's rewiring needs.
            plans = []
            for x, score in zip(layers, _dense_grads(state.model, info.grad_fn), strict=True):
                n, k_max = math.prod(x.stack_shape), k_max_of(x)

                def best(i, v, s, x=x, k_max=k_max):
                    i = _positions(x, i)
                    _, prune = _swap_prune(i, v, f, size=x.size, k_max=k_max)
                    pi = _prune(i, prune, x.size)
                    return _candidates_best(pi, jnp.abs(s), size=x.size, k_max=k_max)

                score = score.reshape(n, x.size)
                plans.append(_per_layer(best, _flat2(x.indices, n), _flat2(x.values, n), score))
            return plans

        def one(x, i, candidates, key, v):
            k_max = k_max_of(x)
            count, prune = _swap_prune(i, v, f, size=x.size, k_max=k_max)
            pi = _prune(i, prune, x.size)
            if gradient:
                ni, taken = _place(pi, count, candidates, size=x.size)
            else:
                ni, taken = _grow_random(pi, count, key, size=x.size, draws=k_max)
            return ni, prune | taken

        return _rewire(state, do, plan, one, info.key)[0]

    return hook


def _dense_grads(model: Any, grad_fn: Callable[[Any], Any]) -> list[Array]:
    """The dense weight gradient of every sparse layer (stacked axes first), from the
    step's `grad_fn` at the densified model."""
    flat, _, where = _sparse_of(model)
    grads = grad_fn(densify(model))
    # Each sparse layer's dense layer (`to_dense`) sits at its path, its weight at `.weight`.
    found = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    weight = jax.tree_util.GetAttrKey("weight")
    return [found[(*flat[i][0], weight)] for i in where]


def set_(
    *,
    period: int = 100,
    fraction: float = 0.3,
    total_steps: int | None = None,
    end: float = 0.75,
    decay: str = "constant",
) -> Hook:
    """Sparse Evolutionary Training (Mocanu et al., 2018) as an `after_update` hook.

    Every `period` updates, in every sparse layer: drop the `fraction` of its non-zeros
    with the smallest magnitude and grow as many at uniformly random free positions, with
    value 0 and zero optimizer state. Each layer keeps its count of non-zeros (no slack
    needed). The trailing underscore keeps Python's `set` builtin usable.

    Memory and time on rewiring steps only, one layer at a time: a dense bool occupancy
    mask and a sort of the layer's slots; none on other steps.

    Args:
        period: updates between rewirings. Mocanu et al. rewire once per epoch; RigL's
            comparison (Evci et al., 2020) every 100 updates, the default here.
        fraction: the paper's zeta, 0.3.
        total_steps: when given, rewiring stops after `end * total_steps` updates (and
            `decay="cosine"` decays the fraction to 0 there), as in Evci et al.'s
            comparison.
        end: fraction of `total_steps` after which the pattern is fixed (Evci et al.: 0.75).
        decay: `"constant"` (Mocanu et al.) or `"cosine"` (Evci et al.'s schedule).

    Returns:
        `hook(state, info) -> state`.

    Raises:
        ValueError: for a non-positive `period` or `total_steps`, a `fraction` or `end`
            outside (0, 1], an unknown `decay`; when first run, for a dense model.

    Example:
        >>> hook = set_(period=100, fraction=0.3)

    References:
        Mocanu et al., "Scalable training of artificial neural networks with adaptive sparse
        connectivity inspired by network science", Nature Communications 9, 2383 (2018),
        Methods ("SET procedure", zeta = 0.3). Their new weights start random; here at
        zero, as jaxpruner's SET and RigL.
    """
    return _swap_hook("set_", period, fraction, total_steps, end, decay, gradient=False)


def rigl(
    *,
    period: int = 100,
    fraction: float = 0.3,
    total_steps: int | None = None,
    end: float = 0.75,
    decay: str = "cosine",
) -> Hook:
    """RigL (Evci et al., 2020) as an `after_update` hook.

    Every `period` updates, in every sparse layer: drop the `f(t)` fraction of its
    non-zeros with the smallest magnitude and grow as many where the magnitude of the dense
    gradient is largest among free positions, with value 0 and zero optimizer state;
    `f(t) = fraction / 2 * (1 + cos(pi * t / T_end))` with `T_end = end * total_steps`.

    The dense gradient comes from the step's `info.grad_fn` at the densified model, on
    rewiring steps only (one more backward pass every `period` updates; dense weights and
    dense gradients of all sparse layers alive at once on those steps, a dense model's
    parameter memory twice over).

    Args:
        period: the paper's Delta T, 100.
        fraction: the paper's alpha, 0.3.
        total_steps: the length of training; rewiring stops at `end * total_steps`.
            None: rewire for ever at the constant `fraction`.
        end: the paper's T_end as a fraction of training, 0.75.
        decay: `"cosine"` (the paper) or `"constant"`.

    Returns:
        `hook(state, info) -> state`.

    Raises:
        ValueError: as `set_`.

    Example:
        >>> hook = rigl(total_steps=10_000)

    References:
        Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020,
        Section 3 (Algorithm 1; alpha = 0.3, Delta T = 100, T_end = 0.75 of training,
        cosine decay) .
    """
    return _swap_hook("rigl", period, fraction, total_steps, end, decay, gradient=True)
