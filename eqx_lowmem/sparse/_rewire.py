"""Rewiring inside the jitted step: DSR, SET and RigL as `after_update` hooks.

Each hook is `hook(state, info) -> state` for `eqx_lowmem.train.make_step(...,
after_update=hook)`: it runs after a successful optimizer update (`state.step` already
counts it) and, on rewiring steps only (one loop of zero or one trip per layer, one layer
after the other), prunes some occupied slots of the sparse layers and grows as many new
positions into free slots. Shapes and dtypes never change: no host round trip, no
recompilation. Pruned and grown slots get value 0 and zero
optimizer state (every entry of the optimizer state laid out like the parameters: optax's
`mu`, `nu`, `trace`, ..., also under `optax.chain`, `masked`, `multi_transform`,
`inject_hyperparams` and `eqx_lowmem.precision.half_state`; per-slot state laid out any
other way is refused with an error, see `_Slots`), inside the same loops, in place: a step
that does not rewire does no work on the slots.
After rewiring, each layer's slots are put back in the order of their positions, empty
ones last (as `sparsify` lays them out), which keeps the layers' scatter and gather fast.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Int

from ._convert import densify
from ._layers import bits_of, is_bitset, is_sparse, positions_of

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


def _positions(layer: Any, stored: Array) -> Array:
    """One layer's slot positions `(capacity,)` from its stored `indices` row (a bit set's
    derived, inside the rewiring loops: on rewiring steps only)."""
    if is_bitset(stored):
        return positions_of(stored, layer.size, layer.capacity)
    return stored


def _store(layer: Any, positions: Array, like: Array) -> Array:
    """One layer's stored `indices` row for slot `positions` in the order of their
    positions (what `_in_order` leaves): a bit set again, or the positions."""
    if is_bitset(like):
        return bits_of(positions, layer.size)
    return positions.astype(like.dtype)


def _per_layer(fn: Callable, *args: Any) -> Any:
    """`fn` on each layer of a stack (leading axis of every array in `args`), one after the
    other (`lax.map`, not `vmap`: one layer's temporaries at a time, and unbatched while
    loops)."""
    if jax.tree.leaves(args)[0].shape[0] == 1:
        return jax.tree.map(lambda y: y[None], fn(*jax.tree.map(lambda a: a[0], args)))
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


def _candidates_best(indices, score, *, size: int, k_max: int) -> Array:
    """The `k_max` free positions (not in `indices`) of highest dense `score`, best first
    (distinct: `lax.top_k` over the dense score with occupied positions at -inf)."""
    score = jnp.where(_occupied(indices, size), -jnp.inf, score.astype(jnp.float32))
    return jax.lax.top_k(score, k_max)[1]


def _place(indices, n_grow, candidates, *, size: int):
    """Fill up to `n_grow` free slots (index `size`) of one layer, in slot order, with
    `candidates` in order. Returns the new indices and the mask of slots filled."""
    k_max = candidates.shape[0]
    free = indices >= size
    rank, _ = _slot_of_rank(free)
    take = free & (rank < n_grow)
    chosen = candidates[jnp.clip(rank, 0, k_max - 1)].astype(indices.dtype)
    return jnp.where(take, chosen, indices), take


_MAX_ROUNDS = 1 << 16


def _grow_random(indices, n_grow, key, *, size: int, draws: int, max_rounds: int = _MAX_ROUNDS):
    """Fill up to `n_grow` free slots of one layer with positions drawn uniformly at random
    among the free ones, without a dense score: rounds of `draws` random positions, each
    kept if free and not drawn before (rejection sampling), until `n_grow` are placed.
    Placing fewer within `max_rounds` rounds (free positions too rare to draw: a nearly
    dense layer) raises an error at run time (`eqx.error_if`) rather than leaving the
    layer with fewer non-zeros than it should hold.

    Memory: the dense occupancy mask (1 byte per weight), one int32 map of the free slots
    and a few arrays of `draws`. Returns the new indices and the mask of slots filled."""
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
        return (carry[2] < n_grow) & (carry[5] < max_rounds)

    init = (indices, _occupied(indices, size), jnp.int32(0), jnp.zeros((cap,), bool), key, 0)
    indices, _, placed, taken, _, _ = jax.lax.while_loop(cond, body, init)
    short = (
        f"sparse rewiring drew {max_rounds} rounds of {draws} random positions in a layer "
        f"of {size} weights ({cap} slots) without finding as many free positions as it "
        "pruned, so the layer would keep fewer non-zeros than it should: its free "
        "positions are too rare. Keep such a nearly dense layer dense "
        "(sparsify(..., exclude=...)) or give it a lower density."
    )
    return eqx.error_if(indices, placed < n_grow, short), taken


_CHUNK = 1 << 14  # slots placed per trip of `_in_order`'s loop


def _in_order(indices: Array, arrays: list[Array], size: int) -> tuple[Array, list[Array]]:
    """One layer's slots moved into the order of their positions, the empty ones last (the
    layout `sparsify` makes), each of `arrays` (`(capacity,)`, zero at empty slots) moving
    with its index. Rewiring leaves grown positions in whatever slots were free, and the
    layer's scatter and gather are fastest walking the dense weight in order (measured on
    CPU at 1M weights, 346k slots: scatter 0.5 ms in order against 1.4-3.9 ms in random
    order; left as rewiring leaves them, the benchmark MLP's step after 30 DSR rewirings
    took 1.49x the dense step's CPU time instead of 1.22x).

    No sort: a slot's new place is the count of occupied positions before its own, from
    the occupancy as a bit set (one bit per dense weight, 32 to a word; the positions are
    distinct) and the prefix sum of its words' population counts; then one gather per
    array. Memory, on rewiring steps only: 1 bit per dense weight and a few int32 arrays
    of the layer's slots (the step's peak is unchanged at the benchmark's shapes)."""
    cap = indices.shape[0]

    def word_bit(i):
        pos = jnp.where(i < size, i, 0).astype(jnp.uint32)
        return pos // 32, jnp.left_shift(jnp.uint32(1), pos % 32)

    word, bit = word_bit(indices)
    # distinct positions set distinct bits: adding them is or-ing them
    bit = jnp.where(indices < size, bit, 0)
    bits = jnp.zeros((-(-size // 32),), jnp.uint32).at[word].add(bit, mode="drop")
    counts = jax.lax.population_count(bits).astype(jnp.int32)
    start = jnp.cumsum(counts) - counts

    # The slot of each rank, a chunk of slots at a time (a whole-layer rank and iota
    # would be two more int32 arrays of the layer's slots alive at once); a last chunk
    # that overlaps the one before writes the same entries again.
    chunk = min(cap, _CHUNK)

    def place(k, slot):
        first = jnp.minimum(k * chunk, cap - chunk)
        i = jax.lax.dynamic_slice_in_dim(indices, first, chunk)
        word, bit = word_bit(i)
        below = jax.lax.population_count(bits[word] & (bit - 1)).astype(jnp.int32)
        rank = jnp.where(i < size, start[word] + below, cap)
        return slot.at[rank].set(first + jnp.arange(chunk, dtype=jnp.int32), mode="drop")

    empty = jnp.full((cap,), cap, jnp.int32)
    slot = jax.lax.fori_loop(0, -(-cap // chunk), place, empty)
    moved = [a.at[slot].get(mode="fill", fill_value=0) for a in arrays]
    return indices.at[slot].get(mode="fill", fill_value=size), moved


def _prune(indices, prune, size: int):
    return jnp.where(prune, jnp.asarray(size, indices.dtype), indices)


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _laid_out_like(node: Any, params: Any) -> bool:
    """Whether `node` is laid out like `params`: the same tree with an array at each of
    their leaves, where an `optax.MaskedNode` may stand for any part (`optax.masked`)."""
    if eqx.is_array(node) or _is_masked(node):
        return False
    ok = True

    def visit(entry: Any, part: Any) -> None:
        nonlocal ok
        if not _is_masked(entry) and not jax.tree_util.treedef_is_leaf(jax.tree.structure(part)):
            ok = False  # one entry for a whole subtree of parameters

    try:
        jax.tree.map(visit, node, params, is_leaf=_is_masked)
    except (ValueError, TypeError):
        return False
    return ok


_FIX = (
    "Rewiring zeroes the state of grown and pruned slots, so it must find all of it: use "
    "an optimizer that keeps its per-parameter state laid out like the parameters (optax's "
    "transformations, also under optax.chain, masked, multi_transform, inject_hyperparams "
    "and eqx_lowmem.precision.half_state), or keep the layer dense "
    "(sparsify(..., exclude=...))."
)


class _Slots:
    """Where each sparse layer's slot arrays live in a state: its `values`, and every
    optimizer-state entry that holds one number per slot of them.

    The rule: per-parameter optimizer state lives in subtrees laid out like the parameters
    (`eqx.filter(model, eqx.is_inexact_array)`), where an `optax.MaskedNode` stands for
    what the optimizer does not see (`_laid_out_like`): optax's `mu`, `nu`, `trace`, ...,
    also inside `optax.chain`, `masked`, `multi_transform`, `inject_hyperparams` and
    `eqx_lowmem.precision.half_state`. In each such subtree a sparse layer's entry is an
    array shaped like its values (zeroed where rewiring resets slots), a `MaskedNode` (no
    state) or one number for the whole tensor (no per-slot state; left as it is). Anything
    else fails loudly, naming where: an entry of another shape, or a floating array with
    an axis outside every such subtree (per-slot state laid out some other way, which
    grown slots would otherwise inherit in silence).
    """

    def __init__(self, state: Any):
        self.flat, self.treedef, self.where = _sparse_of(state.model)
        self.layers = [self.flat[i][1] for i in self.where]
        params = eqx.filter(state.model, eqx.is_inexact_array)
        values_key = jax.tree_util.GetAttrKey("values")
        names = [_key(self.flat[i][0]) for i in self.where]
        paths = [_key((*self.flat[i][0], values_key)) for i in self.where]
        nodes, self.odef = jax.tree_util.tree_flatten_with_path(
            state.opt_state, is_leaf=lambda x: _laid_out_like(x, params)
        )
        self.nodes = [node for _, node in nodes]
        self.shadows: dict[int, tuple[list, Any]] = {}  # node -> (its leaves, treedef)
        self.entries: list[list[tuple[int, int]]] = [[] for _ in self.where]
        for k, (where, node) in enumerate(nodes):
            if not _laid_out_like(node, params):
                if eqx.is_inexact_array(node) and node.ndim >= 1:
                    raise ValueError(
                        f"the optimizer state holds a {node.dtype}{list(node.shape)} at "
                        f"opt_state{_key(where)}, outside every subtree laid out like the "
                        "model's parameters (where optax keeps mu, nu, trace, ...): "
                        "rewiring cannot tell whether it holds state of the sparse layers' "
                        f"slots. {_FIX}"
                    )
                continue
            with_paths, node_def = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_masked)
            self.shadows[k] = ([leaf for _, leaf in with_paths], node_def)
            at = {_key(p): i for i, (p, leaf) in enumerate(with_paths) if not _is_masked(leaf)}
            for j, (x, path) in enumerate(zip(self.layers, paths, strict=True)):
                if path not in at:
                    continue  # under a MaskedNode: the optimizer keeps nothing for it
                entry = with_paths[at[path]][1]
                if eqx.is_array(entry) and entry.shape == x.values.shape:
                    self.entries[j].append((k, at[path]))
                elif not (eqx.is_array(entry) and entry.size == 1):
                    got = f"{entry.dtype}{list(entry.shape)}" if eqx.is_array(entry) else entry
                    raise ValueError(
                        f"the optimizer state at opt_state{_key(where)}{path} is {got}, "
                        f"for the values {list(x.values.shape)} of the sparse layer at "
                        f"{names[j] or 'the root'}: rewiring zeroes one entry per slot and "
                        f"cannot map this one (a factored or flattened statistic). {_FIX}"
                    )

    def get(self, j: int) -> list[Array]:
        """Layer `j`'s values, then its optimizer-state entries."""
        entries = [self.shadows[k][0][i] for k, i in self.entries[j]]
        return [self.layers[j].values, *entries]

    def set(self, j: int, slots: list[Array]) -> None:
        self.layers[j] = dataclasses.replace(self.layers[j], values=slots[0])
        for (k, i), s in zip(self.entries[j], slots[1:], strict=True):
            self.shadows[k][0][i] = s

    def state(self, state: Any) -> Any:
        leaves = [x for _, x in self.flat]
        for i, x in zip(self.where, self.layers, strict=True):
            leaves[i] = x
        nodes = list(self.nodes)
        for k, (node_leaves, node_def) in self.shadows.items():
            nodes[k] = jax.tree.unflatten(node_def, node_leaves)
        model = jax.tree_util.tree_unflatten(self.treedef, leaves)
        opt_state = jax.tree_util.tree_unflatten(self.odef, nodes)
        return dataclasses.replace(state, model=model, opt_state=opt_state)


def _key(path: tuple) -> str:
    return jax.tree_util.keystr(path)


def _when(do: Array, fn: Callable, carry: Any, extra: Any) -> Any:
    """`fn(*carry, *extra)` if `do`, else `carry`: a while loop of zero or one trip, which
    updates `carry` in place and whose body's temporaries exist only while it runs (a
    `lax.cond` returning `carry` from one branch makes XLA copy its operands first)."""

    def body(c):
        _, carry = c
        return jnp.bool_(False), fn(*carry, *extra)

    return jax.lax.while_loop(lambda c: c[0], body, (do, carry))[1]


def _rewire(state: Any, do: Array, plan: Callable, one: Callable, keys: Array) -> tuple:
    """Rewire the sparse layers of `state` if `do`, strictly one layer after the other;
    returns the new state and what `plan` returned besides the plans.

    `plan(layers, do)` returns, per sparse layer, a small plan with the layer's
    stacked-layer count as leading axis (anything when not `do`), and anything else the
    hook needs back (DSR: its new threshold exponent). Then for each layer a loop of zero or one
    trip (`_when`) runs `one(x, indices, plan, key, values) -> (indices, reset)` on every
    stacked layer (flat `(capacity,)` arrays), zeroes the values and every
    optimizer-state entry shadowing them at the `reset` slots, and puts the slots back in
    the order of their positions (`_in_order`). The loop carries the layer's indices,
    values and optimizer-state entries and updates them in place: XLA copies none of them
    into it (the hook runs after `make_step`'s finiteness cond, so these are fresh
    buffers of this step that nothing reads after the loop); its temporaries are that
    layer's only. A step that does not rewire runs no pass over any slot.
    """
    slots = _Slots(state)
    layers = slots.layers
    counts = [math.prod(x.stack_shape) for x in layers]
    plans, extra = plan(list(layers), do)
    for j, (x, n, k) in enumerate(zip(layers, counts, jr.split(keys, len(layers)), strict=True)):
        arrays = slots.get(j)

        def rewired(indices, *rest, x=x, n=n):
            arrays, (plan_j, keys_j) = rest[:-2], rest[-2:]  # carried, then read only
            flat = [_flat2(a, n) for a in arrays]

            def layer(stored, plan, key, *flat):
                # `one` reads the values as they were before this rewiring zeroes any.
                i, reset = one(x, _positions(x, stored), plan, key, flat[0])
                zeroed = [jnp.where(reset, jnp.zeros((), a.dtype), a) for a in flat]
                i, moved = _in_order(i, zeroed, x.size)
                return _store(x, i, stored), *moved

            indices, *flat = _per_layer(layer, indices, plan_j, keys_j, *flat)
            return indices, *[f.reshape(a.shape) for f, a in zip(flat, arrays, strict=True)]

        carry = (_flat2(x.indices, n), *arrays)
        indices, *arrays = _when(do, rewired, carry, (plans[j], jr.split(k, n)))
        slots.set(j, arrays)
        layers[j] = dataclasses.replace(slots.layers[j], indices=indices.reshape(x.indices.shape))
    return slots.state(state), extra


def _if_updated(do: Array, info: Any) -> Array:
    """`do`, and only after an update that happened: `eqx_lowmem.train.make_step` calls
    its hook on every step, after its finiteness check, and says in `info.finite` whether
    the update was applied (a caller without that field calls the hook after applied
    updates only)."""
    finite = getattr(info, "finite", None)
    return do if finite is None else do & finite


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
