"""Rewiring inside the jitted step: the machinery of the DSR, SET and RigL hooks.

Each hook is `hook(state, info) -> state` for `eqx_lowmem.train.make_step(...,
after_update=hook)`: it runs after a successful optimizer update (`state.step` already
counts it) and, on rewiring steps only (one loop of zero or one trip per layer, one layer
after the other), prunes some occupied slots of the sparse layers and grows as many new
positions into free slots. Shapes and dtypes never change: no host round trip, no
recompilation. Pruned and grown slots get value 0 and zero
optimizer state (every entry of the optimizer state laid out like the parameters: optax's
`mu`, `nu`, `trace`, ..., also under `optax.chain`, `masked`, `multi_transform`,
`inject_hyperparams`, `eqx_lowmem.precision.half_state` and `quantized_state`, whose
8-bit entries are dequantised, zeroed and requantised on rewiring steps; per-slot state laid out any
other way is refused with an error, see `_Slots`), inside the same loops, in place: a step
that does not rewire does no work on the slots.
After rewiring, each layer's slots are put back in the order of their positions, empty
ones last (as `sparsify` lays them out), which keeps the layers' scatter and gather fast.

The rules (when to rewire, what to prune, where to grow) are in `_rules.py`.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array

from .._layout import is_entry, is_masked, laid_out_like
from ..precision._quantized import QuantizedArray
from ._layers import is_sparse
from ._storage import bits_of, is_bitset, positions_of


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
    took 1.49x the dense step's CPU time instead of 1.22x: 4158085).

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


_is_masked, _is_entry, _laid_out_like = is_masked, is_entry, laid_out_like  # `.._layout`'s rule


def _dense(x: Any) -> Any:
    return x.dense() if isinstance(x, QuantizedArray) else x


def _pack(like: Any, x: Array) -> Any:
    return like.like(x) if isinstance(like, QuantizedArray) else x


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
            with_paths, node_def = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_entry)
            self.shadows[k] = ([leaf for _, leaf in with_paths], node_def)
            at = {_key(p): i for i, (p, leaf) in enumerate(with_paths) if not _is_masked(leaf)}
            for j, (x, path) in enumerate(zip(self.layers, paths, strict=True)):
                if path not in at:
                    continue  # under a MaskedNode: the optimizer keeps nothing for it
                entry = with_paths[at[path]][1]
                if (eqx.is_array(entry) or _is_entry(entry)) and entry.shape == x.values.shape:
                    self.entries[j].append((k, at[path]))
                elif not (eqx.is_array(entry) and entry.size == 1):
                    got = f"{entry.dtype}{list(entry.shape)}" if eqx.is_array(entry) else entry
                    raise ValueError(
                        f"the optimizer state at opt_state{_key(where)}{path} is {got}, "
                        f"for the values {list(x.values.shape)} of the sparse layer at "
                        f"{names[j] or 'the root'}: rewiring zeroes one entry per slot and "
                        f"cannot map this one (a factored or flattened statistic). {_FIX}"
                    )

    def get(self, j: int) -> list[Any]:
        """Layer `j`'s values, then its optimizer-state entries."""
        entries = [self.shadows[k][0][i] for k, i in self.entries[j]]
        return [self.layers[j].values, *entries]

    def set(self, j: int, slots: list[Any]) -> None:
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
            forms, (plan_j, keys_j) = rest[:-2], rest[-2:]  # carried, then read only
            arrays = [_dense(a) for a in forms]  # 8-bit state: this layer's, while it runs
            flat = [_flat2(a, n) for a in arrays]

            def layer(stored, plan, key, *flat):
                # `one` reads the values as they were before this rewiring zeroes any.
                i, reset = one(x, _positions(x, stored), plan, key, flat[0])
                zeroed = [jnp.where(reset, jnp.zeros((), a.dtype), a) for a in flat]
                i, moved = _in_order(i, zeroed, x.size)
                return _store(x, i, stored), *moved

            indices, *flat = _per_layer(layer, indices, plan_j, keys_j, *flat)
            out = [f.reshape(a.shape) for f, a in zip(flat, arrays, strict=True)]
            return indices, *[_pack(f, a) for f, a in zip(forms, out, strict=True)]

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
