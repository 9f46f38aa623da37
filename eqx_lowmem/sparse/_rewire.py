"""Rewiring inside the jitted step: DSR, SET and RigL as `after_update` hooks.

Each hook is `hook(state, info) -> state` for `eqx_lowmem.train.make_step(...,
after_update=hook)`: it runs after a successful optimizer update (`state.step` already
counts it) and, on rewiring steps only (a `lax.cond`), prunes some occupied slots of the
sparse layers and grows as many new positions into free slots. Shapes and dtypes never
change: no host round trip, no recompilation. Pruned and grown slots get value 0 and zero
optimizer state (every optimizer-state subtree shaped like the parameters: optax's `mu`,
`nu`, `trace`, ..., also inside `eqx_lowmem.precision.half_state` and `optax.chain`).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Int

from ._convert import densify
from ._layers import _after, is_sparse

Hook = Callable[[Any, Any], Any]
_DECAYS = ("constant", "cosine")


# -- shared machinery ---------------------------------------------------------------------


def _sparse_of(model: Any) -> tuple[list, Any, list[int]]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_sparse)
    where = [i for i, (_, x) in enumerate(flat) if is_sparse(x)]
    if not where:
        raise ValueError(
            "the model has no sparse layers to rewire; make it sparse first: "
            "model = eqx_lowmem.sparse.sparsify(model, density, key=key)."
        )
    return flat, treedef, where


def _flat2(x: Array, n: int) -> Array:
    return x.reshape(n, x.shape[-1])


def _per_layer(fn: Callable, *args: Array) -> Any:
    """`fn` on each layer of a stack (leading axis), one after the other (`lax.map`, not
    `vmap`: one layer's temporaries at a time, and unbatched while loops)."""
    if args[0].shape[0] == 1:
        return jax.tree.map(lambda y: y[None], fn(*(a[0] for a in args)))
    return jax.lax.map(lambda a: fn(*a), args)


def _occupied(indices: Array, size: int) -> Array:
    """A dense bool mask of the occupied positions (1 byte per dense weight)."""
    return jnp.zeros((size,), bool).at[indices.astype(jnp.int32)].set(True, mode="drop")


def _slot_of_rank(free: Array) -> tuple[Array, Array]:
    """(rank of each free slot, slot of each rank): the j-th free slot takes the j-th new
    position."""
    cap = free.shape[0]
    rank = jnp.cumsum(free.astype(jnp.int32)) - 1
    where = jnp.where(free, rank, cap)
    slot = jnp.zeros((cap,), jnp.int32).at[where].set(jnp.arange(cap, dtype=jnp.int32), mode="drop")
    return rank, slot


def _grow_best(indices, n_grow, score, *, size: int, k_max: int):
    """Fill up to `n_grow` free slots (index `size`) of one layer with the free positions
    of highest `score` (a dense score; occupied positions never chosen).

    Returns the new indices and the mask of slots filled."""
    score = jnp.where(_occupied(indices, size), -jnp.inf, score.astype(jnp.float32))
    _, candidates = jax.lax.top_k(score, k_max)  # distinct positions, best first
    free = indices >= size
    rank, _ = _slot_of_rank(free)
    take = free & (rank < n_grow)
    chosen = candidates[jnp.clip(rank, 0, k_max - 1)].astype(indices.dtype)
    return jnp.where(take, chosen, indices), take


_MAX_ROUNDS = 1 << 16


def _grow_random(indices, n_grow, key, *, size: int, draws: int):
    """Fill up to `n_grow` free slots of one layer with positions drawn uniformly at random
    among the free ones, without a dense score: rounds of `draws` random positions, each
    kept if free and not drawn before (rejection sampling), until `n_grow` are placed.

    Memory: the dense occupancy mask (1 byte per weight) and a few arrays of `draws`.
    Returns the new indices and the mask of slots filled."""
    cap = indices.shape[0]
    free = indices >= size
    _, slot_of = _slot_of_rank(free)

    def body(carry):
        indices, occupied, filled, taken, key, it = carry
        key, sub = jr.split(key)
        cand = jr.randint(sub, (draws,), 0, size, dtype=jnp.int32)
        order = jnp.argsort(cand)
        ordered = cand[order]
        first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
        unique = jnp.zeros((draws,), bool).at[order].set(first)
        ok = unique & ~occupied[cand]
        pos = filled + jnp.cumsum(ok.astype(jnp.int32)) - 1
        use = ok & (pos < n_grow)
        slot = jnp.where(use, slot_of[jnp.clip(pos, 0, cap - 1)], cap)
        indices = indices.at[slot].set(cand.astype(indices.dtype), mode="drop")
        taken = taken.at[slot].set(True, mode="drop")
        occupied = occupied.at[jnp.where(use, cand, size)].set(True, mode="drop")
        return indices, occupied, filled + jnp.sum(use.astype(jnp.int32)), taken, key, it + 1

    def cond(carry):
        return (carry[2] < n_grow) & (carry[5] < _MAX_ROUNDS)

    init = (indices, _occupied(indices, size), jnp.int32(0), jnp.zeros((cap,), bool), key, 0)
    indices, _, _, taken, _, _ = jax.lax.while_loop(cond, body, init)
    return indices, taken


def _prune(indices, prune, size: int):
    return jnp.where(prune, jnp.asarray(size, indices.dtype), indices)


def _zero_slots(opt_state: Any, model: Any, resets: dict[str, Array]) -> Any:
    """Zero, in every optimizer-state subtree structured like the parameters, the entries
    of the values leaves named in `resets` (keystr path -> mask) where the mask is True."""
    params = eqx.filter(model, eqx.is_inexact_array)
    pdef = jax.tree.structure(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    masks = [resets.get(p) for p in paths]

    def matches(node: Any) -> bool:
        return jax.tree.structure(node) == pdef

    def fix(node: Any) -> Any:
        if not matches(node):
            return node
        leaves = jax.tree.leaves(node)
        out = [
            x
            if m is None or not eqx.is_array(x) or x.shape != m.shape
            else jnp.where(m, jnp.zeros((), x.dtype), x)
            for x, m in zip(leaves, masks, strict=True)
        ]
        return jax.tree.unflatten(pdef, out)

    return jax.tree.map(fix, opt_state, is_leaf=matches)


def _rewire(state: Any, do: Array, changes: Callable[[list], list]) -> Any:
    """Rewire the sparse layers of `state.model` if `do`.

    `changes(layers)` returns, per sparse layer, its new indices, the mask of slots that
    changed (pruned or grown) and its new threshold exponent. Only these small arrays come
    out of the `lax.cond` (not a copy of the whole state); then the changed slots' values
    and optimizer state are zeroed outside it (a no-op mask on other steps).
    """
    flat, treedef, where = _sparse_of(state.model)
    layers = [flat[i][1] for i in where]

    def keep(_):
        return [(x.indices, jnp.zeros(x.indices.shape, bool), x.threshold_exp) for x in layers]

    out = jax.lax.cond(do, lambda _: changes(layers), keep, None)
    leaves = [x for _, x in flat]
    resets = {}
    for i, x, (indices, reset, exp) in zip(where, layers, out, strict=True):
        values = jnp.where(reset, jnp.zeros((), x.values.dtype), x.values)
        leaves[i] = dataclasses.replace(x, values=values, indices=indices, threshold_exp=exp)
        resets[jax.tree_util.keystr((*flat[i][0], jax.tree_util.GetAttrKey("values")))] = reset
    model = jax.tree_util.tree_unflatten(treedef, leaves)
    opt_state = _zero_slots(state.opt_state, state.model, resets)
    return dataclasses.replace(state, model=model, opt_state=opt_state)


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


def _dsr_changes(layers: list, key: Array, *, threshold: float, fraction: float, tolerance: float):
    """Mostafa and Wang's reallocation for `_rewire`: prune below the global threshold,
    regrow across layers in proportion to survivors, adapt the threshold."""
    counts = [math.prod(x.stack_shape) for x in layers]
    exp = layers[0].threshold_exp.reshape(-1)[0]
    cut = threshold * jnp.exp2(exp.astype(jnp.float32))
    pruned, survivors, removed = [], [], []
    for x, n in zip(layers, counts, strict=True):
        v, i = _flat2(x.values, n), _flat2(x.indices, n)
        prune = (i < x.size) & (jnp.abs(v).astype(jnp.float32) < cut)
        pi = _prune(i, prune, x.size)
        pruned.append((pi, prune))
        survivors.append(jnp.sum((pi < x.size).astype(jnp.int32), axis=-1))
        removed.append(jnp.sum(prune.astype(jnp.int32), axis=-1))
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
    out, start = [], 0
    keys = jr.split(key, len(layers))
    for x, n, (pi, prune), k in zip(layers, counts, pruned, keys, strict=True):
        g = grow[start : start + n]
        start += n
        if out:  # one layer after the other: one layer's temporaries alive at a time
            pi = _after(pi, out[-1][0])
        draws = min(x.capacity, max(256, math.ceil(4 * fraction * x.size)))
        ni, taken = _per_layer(
            lambda i, c, k, size=x.size, draws=draws: _grow_random(i, c, k, size=size, draws=draws),
            pi,
            g,
            jr.split(k, n),
        )
        out.append(
            (
                ni.reshape(x.indices.shape),
                (prune | taken).reshape(x.values.shape),
                jnp.broadcast_to(new_exp, x.threshold_exp.shape),
            )
        )
    return out


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

    Memory and time on rewiring steps only: one dense bool mask, one dense random score
    and a top-k over it per layer (a dense weight's size, one layer at a time).

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
        `hook(state, info) -> state`, for `make_step(..., after_update=hook)`.

    Raises:
        ValueError: for a non-positive `period`, `threshold` or `total_steps`, or a
            `fraction` or `tolerance` outside (0, 1]; when first run, for a model without
            sparse layers.

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

    def hook(state: Any, info: Any) -> Any:
        _sparse_of(state.model)  # a clear error for a dense model, before tracing more
        p = _dsr_period(state.step, period, total_steps)
        do = (p > 0) & (state.step % jnp.maximum(p, 1) == 0)

        def changes(layers):
            return _dsr_changes(
                layers, info.key, threshold=threshold, fraction=fraction, tolerance=tolerance
            )

        return _rewire(state, do, changes)

    return hook


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


def _swap_changes(layers: list, key: Array, f: Array, k_max_of, dense_scores):
    """Per layer, for `_rewire`: drop the `floor(f * nnz)` smallest-magnitude weights and
    grow as many: at the free positions of highest dense score (`dense_scores[j]`, the
    j-th sparse layer's) or, with `dense_scores=None`, at uniformly random free positions."""
    out = []
    for j, (x, k) in enumerate(zip(layers, jr.split(key, len(layers)), strict=True)):
        n = math.prod(x.stack_shape)
        v, i = _flat2(x.values, n), _flat2(x.indices, n)
        if out:  # one layer after the other: one layer's temporaries alive at a time
            v, i = _after(v, out[-1][0]), _after(i, out[-1][0])
        size, cap, k_max = x.size, x.capacity, k_max_of(x)

        def one(v, i, s, size=size, cap=cap, k_max=k_max):
            active = i < size
            count = jnp.floor(f * jnp.sum(active).astype(jnp.float32)).astype(jnp.int32)
            count = jnp.minimum(count, k_max)
            mag = jnp.where(active, jnp.abs(v).astype(jnp.float32), jnp.inf)
            order = jnp.argsort(mag, stable=True)
            rank = jnp.zeros((cap,), jnp.int32).at[order].set(jnp.arange(cap, dtype=jnp.int32))
            prune = rank < count
            pi = _prune(i, prune, size)
            if dense_scores is None:
                ni, taken = _grow_random(pi, count, s, size=size, draws=k_max)
            else:
                ni, taken = _grow_best(pi, count, s, size=size, k_max=k_max)
            return ni, prune | taken

        s = jr.split(k, n) if dense_scores is None else jnp.abs(dense_scores[j]).reshape(n, size)
        ni, reset = _per_layer(one, v, i, s)
        out.append((ni.reshape(x.indices.shape), reset.reshape(x.values.shape), x.threshold_exp))
    return out


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
        do = on & (state.step % period == 0)

        def changes(layers):
            dense = _dense_grads(state.model, info.grad_fn) if gradient else None
            return _swap_changes(layers, info.key, f, k_max_of, dense)

        return _rewire(state, do, changes)

    return hook


def _dense_grads(model: Any, grad_fn: Callable[[Any], Any]) -> list[Array]:
    """The dense weight gradient of every sparse layer (stacked axes first), from the
    step's `grad_fn` at the densified model."""
    flat, _, where = _sparse_of(model)
    paths = [jax.tree_util.keystr(flat[i][0]) for i in where]
    grads = grad_fn(densify(model))

    def is_layer(x):
        return isinstance(x, (eqx.nn.Linear, eqx.nn.Conv))

    found = {
        jax.tree_util.keystr(p): g.weight
        for p, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_layer)[0]
        if is_layer(g)
    }
    return [found[p] for p in paths]


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

    Memory and time on rewiring steps only: a dense random score, a bool mask and a top-k
    per layer (one layer at a time), and a sort of each layer's slots.

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
