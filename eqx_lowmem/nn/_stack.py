"""A stack of identical blocks: parameters stacked on a leading axis, run by `lax.scan`,
each block (or each segment of blocks) recomputed in the backward pass."""

import functools
import math
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._fuse import active_fusion, fusion_candidate
from ._layers import active_hook, exact_hook, prepare_layer
from ._remat import Remat, RematArg, module_remat_names, remat_policy, resolve_remat
from ._trace import vmap_rule


class _Batch(NamedTuple):
    """`Stack.batched`'s mode: the vmap goes inside each layer, with this axis name."""

    axis_name: Hashable | None


class Stack(eqx.Module):
    """`n_layers` identical blocks whose arrays are stacked on a leading axis.

    Build one with `eqx_lowmem.nn.stack`. The blocks run one after another, each taking the
    previous block's output, by `jax.lax.scan` (or an equivalent Python loop with
    `scan=False`). Layer `i` of the stack receives the PRNG key `jr.fold_in(key, i)`,
    derived inside the loop, so recomputation regenerates the same dropout masks.

    Block convention (what a block's `__call__` must accept):

    - stateless: `block(x, *, key=None) -> y`, with `y` of the same shape and dtype as `x`
      (`x` may be any pytree of arrays);
    - stateful (`stack(..., stateful=True)`): `block(x, state, *, key=None) -> (y, state)`
      where `state` is that block's own pytree of arrays (for example BatchNorm running
      statistics), returned with the same structure, shapes and dtypes. The stack takes and
      returns the states of all its layers stacked on a leading axis.

    `key=None` means no randomness (evaluation); the stack then passes `key=None` to every
    block. Like every module here, a stack maps one example: `jax.vmap` over the batch.

    `layer_spec` is not read by the stack: a training step's per-layer hook
    (`eqx_lowmem.nn._layers.prepare_layer`, which the stack calls on each layer's arrays
    inside the recomputed region) may read it.
    """

    _scope: ClassVar[str] = "eqx_lowmem.nn.Stack"

    blocks: Any  # the block module; every array has a leading axis of size n_layers
    n_layers: int = eqx.field(static=True)
    remat: Remat = eqx.field(static=True)
    segment: int | None = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    stateful: bool = eqx.field(static=True)
    layer_spec: Any = eqx.field(static=True, default=None)

    def __call__(self, x: PyTree, state: PyTree = None, *, key: PRNGKeyArray | None = None):
        """Apply the blocks in order to one example.

        Args:
            x: the first block's input.
            state: stateful stacks only: every layer's state, stacked on a leading axis.
            key: PRNG key; layer `i` gets `jr.fold_in(key, i)`. `None`: no randomness.

        Returns:
            The last block's output; for a stateful stack `(output, new_states)`.
        """
        return self._run(x, state, key, None)

    def batched(
        self,
        x: PyTree,
        state: PyTree = None,
        *,
        key: Array | None = None,
        axis_name: Hashable | None = None,
    ):
        """The stack over a batch: equal to `jax.vmap(stack, in_axes=(0, None, 0),
        out_axes=(0, None), axis_name=axis_name)(x, state, key)`, with the vmap inside
        the loop and inside each block's recomputed region instead of around the stack.

        Then the innermost transformation a block's layers see is the vmap, so a layer
        with a batch-level implementation (`eqx_lowmem.nn`'s convolutions on XLA:CPU, the
        sparse layers) runs it once per batch in the loop body, instead of its per-example
        form batched after the fact.

        Args:
            x: the first block's input, batched on axis 0.
            state: stateful stacks only: every layer's state (not batched; a block's new
                state must not depend on the example except through `axis_name`
                collectives, as BatchNorm's batch statistics).
            key: one PRNG key per example, `(batch, ...)`, or None.
            axis_name: the vmap's axis name, for the blocks' collectives.
        """
        return self._run(x, state, key, _Batch(axis_name))

    def _run(self, x, state, key, batch):
        if self.stateful and state is None:
            raise ValueError(
                "this Stack is stateful (stack(..., stateful=True)): call it as "
                "stack(x, states, key=key), with the stacked states stack() returned."
            )
        if not self.stateful and state is not None:
            raise ValueError(
                "this Stack is stateless: call it as stack(x, key=key); build it with "
                "stack(..., stateful=True) for blocks that take and return a state."
            )
        params, static = eqx.partition(self.blocks, eqx.is_array)
        with jax.named_scope(self._scope):
            fused = self._try_fused(params, static, x, state, key, batch)
            if fused is not None:
                x, state = fused
            elif self.segment is None:
                x, state = self._run_blocks(params, static, x, state, key, 0, batch)
            else:
                x, state = self._run_segments(params, static, x, state, key, batch)
        return (x, state) if self.stateful else x

    def _layer(self, p, static, h, s, key, i, batch):
        """One block on its slice of the stacked arrays; `prepare_layer` is the step's seam."""
        p = prepare_layer(self, p)
        block = eqx.combine(p, static)

        def one(h, s, key):
            layer_key = None if key is None else jr.fold_in(key, i)
            if self.stateful:
                out = block(h, s, key=layer_key)
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError(
                        f"a block of this stateful Stack ({type(block).__name__}) must return "
                        f"(output, state), got {type(out).__name__}."
                    )
                _check_same("output", block, h, out[0])
                _check_same("state", block, s, out[1])
                return out
            y = block(h, key=layer_key)
            _check_same("output", block, h, y)
            return y, None

        if batch is None:
            return one(h, s, key)
        return jax.vmap(
            one,
            in_axes=(0, None, None if key is None else 0),
            out_axes=(0, None),
            axis_name=batch.axis_name,
        )(h, s, key)

    def _run_blocks(self, params, static, x, state, key, first, batch):
        """The blocks whose stacked arrays are `params`; layer indices start at `first`."""
        count = jax.tree.leaves(params)[0].shape[0]
        policy = remat_policy(self.remat, module_remat_names(static)[1])

        def layer(p, h, s, key, i):
            return self._layer(p, static, h, s, key, i, batch)

        if policy is not None:
            # Inside a scan, prevent_cse=False is safe and lets XLA optimise the body.
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=not self.scan)

        def body(h, xs):
            p, s, i = xs
            h, s = layer(p, h, s, key, i)
            return h, s

        indices = first + jnp.arange(count)
        if self.scan:
            x, state = jax.lax.scan(body, x, (params, state, indices))
        else:
            states = []
            for j in range(count):
                x, s = body(x, jax.tree.map(lambda a, j=j: a[j], (params, state, indices)))
                states.append(s)
            if self.stateful:
                state = jax.tree.map(lambda *a: jnp.stack(a), *states)
        return x, state

    def _try_fused(self, params, static, x, state, key, batch):
        """The stack with the step's accumulator fused into its backward loop
        (`eqx_lowmem.nn._fuse`), or None where that does not apply: no accumulator offered,
        a configuration that keeps activations, parameters the step does not differentiate,
        or a per-example call of a stateful stack (its blocks may use the batch's
        collectives, which the fused loop could not name)."""
        fusion = active_fusion()
        if fusion is None or not fusion_candidate(self):
            return None
        leaves = jax.tree.leaves(params)
        floats = [n for n, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)]
        slots = fusion.claim([leaves[n] for n in floats])
        if slots is None:
            return None
        run = functools.partial(self._fused, params, static, floats, fusion, slots)
        if batch is not None:
            return run(x, state, key, batch)
        if self.stateful:
            why = "a stateful stack is fused only through stack.batched(x, states, ...)"
            fusion.decline([leaves[n] for n in floats], why)
            return None
        return self._fused_per_example(params, static, floats, fusion, slots, x, key), None

    def _fused_per_example(self, params, static, floats, fusion, slots, x, key):
        """A per-example call: the fused loop over a batch of one, or under `jax.vmap` over
        the whole batch (its backward loop adds the batch's gradient into the accumulator
        once), which `vmap_rule` hands the vmap's batch. The accumulator is an argument:
        `vmap_rule`'s function closes over no array."""
        p_leaves, p_def = jax.tree.flatten(params)
        x_def = jax.tree.structure(x)
        keys = () if key is None else (key,)

        def run(p_leaves, acc, x_leaves, keys):  # `x_leaves` and `keys` with a batch axis
            p, h = jax.tree.unflatten(p_def, p_leaves), jax.tree.unflatten(x_def, x_leaves)
            k = keys[0] if keys else None
            y, _ = self._fused(p, static, floats, fusion, slots, h, None, k, _Batch(None), acc)
            return jax.tree.leaves(y)

        def one(p_leaves, acc, x_leaves, keys):
            y = run(p_leaves, acc, [a[None] for a in x_leaves], tuple(k[None] for k in keys))
            return [a[0] for a in y]

        def rule(axis_size, in_batched, p_leaves, acc, x_leaves, keys):
            p_in, acc_in, x_in, k_in = in_batched
            if any(p_in) or any(acc_in):  # pragma: no cover - see the message
                raise ValueError(
                    "a fused stack's parameters vary over a jax.vmap: the step claims only "
                    "its own parameter arrays for fusion, never arrays a vmap batches"
                )

            def batched(a, b):
                return a if b else jnp.broadcast_to(a, (axis_size, *a.shape))

            xb = [batched(a, b) for a, b in zip(x_leaves, x_in, strict=True)]
            kb = tuple(batched(k, b) for k, b in zip(keys, k_in, strict=True))
            return run(p_leaves, acc, xb, kb), True

        acc = fusion.accumulators(slots)
        y_leaves = vmap_rule(one, rule, p_leaves, acc, jax.tree.leaves(x), keys)
        return jax.tree.unflatten(x_def, y_leaves)

    def _fused(self, params, static, floats, fusion, slots, x, state, key, batch, acc=None):
        """Forward: a scan keeping each unit's input, a unit being one block (`segment`
        None) or one segment of `segment` blocks (a shorter last one after the loop).
        Backward: a reverse scan that recomputes one unit at a time and folds its
        parameters' gradient into that unit's slice of the accumulator in place. The
        accumulator's cotangent is the new one."""
        leaves, treedef = jax.tree.flatten(params)
        chosen = set(floats)
        others = [n for n in range(len(leaves)) if n not in chosen]
        pf = [leaves[n] for n in floats]
        po = [leaves[n] for n in others]
        acc = fusion.accumulators(slots) if acc is None else acc
        fold = fusion.fold
        units = _Units.of(self.n_layers, self.segment)
        seg, n_full, rest, start = units.seg, units.n_full, units.rest, units.start
        split, tail = units.split, units.tail
        unit = self._fused_unit(static, treedef, floats, others, seg, batch)
        firsts = jnp.arange(n_full) * (seg or 1)

        def forward(pf, po, x, state, key, keep):
            def body(h, xs):
                pf_u, po_u, s_u, first = xs
                h2, s2 = unit(pf_u, po_u, h, s_u, key, first)
                return h2, (s2, h if keep else None)

            h, (states, inputs) = jax.lax.scan(
                body, x, (split(pf), split(po), split(state), firsts)
            )
            if seg is not None:
                states = jax.tree.map(lambda a: a.reshape(start, *a.shape[2:]), states)
            last = h if keep and rest else None
            if rest:
                h, s_t = unit(tail(pf), tail(po), h, tail(state), key, start)
                states = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), states, s_t)
            return h, states, (inputs, last)

        @jax.custom_vjp
        def run(pf, acc, x, po, state, key):
            out, states, _ = forward(pf, po, x, state, key, False)
            return out, states

        def run_fwd(pf, acc, x, po, state, key):
            out, states, inputs = forward(pf, po, x, state, key, True)
            return (out, states), (pf, acc, po, state, key, inputs)

        def fold_at(acc, g, first):
            return [_fold_into(fold, seg, a, gi, first) for a, gi in zip(acc, g, strict=True)]

        def unit_vjp(pf_u, po_u, s_u, h_u, first, dh):
            _, vjp, _ = jax.vjp(
                lambda p, h: unit(p, po_u, h, s_u, key, first), pf_u, h_u, has_aux=True
            )
            return vjp(dh)

        def run_bwd(res, cts):
            pf, acc, po, state, key_, (inputs, last) = res
            del key_  # the same key, closed over by `unit_vjp`
            dh, _ = cts  # the new states are not differentiated
            if rest:
                g, dh = unit_vjp(tail(pf), tail(po), tail(state), last, start, dh)
                acc = fold_at(acc, g, start)

            def body(carry, xs):
                dh, acc = carry
                pf_u, po_u, s_u, h_u, first = xs
                g, dh = unit_vjp(pf_u, po_u, s_u, h_u, first, dh)
                return (dh, fold_at(acc, g, first)), None

            (dx, acc), _ = jax.lax.scan(
                body,
                (dh, acc),
                (split(pf), split(po), split(state), inputs, firsts),
                reverse=True,
            )
            return None, acc, dx, None, None, None

        run.defvjp(run_fwd, run_bwd)
        out = run(pf, acc, x, po, state, key)
        fusion.commit(slots)
        return out

    def _fused_unit(self, static, treedef, floats, others, seg, batch) -> Callable:
        """`unit(pf_u, po_u, h, s, key, first)` of `_fused`: one block (`seg` None) or one
        segment of blocks from its floating parameters `pf_u` (leaves `floats` of
        `treedef`) and the others `po_u` (leaves `others`), under the active layer hook."""
        hook = active_hook()
        # The hooks read the stack's static fields only: no array of it enters the loops.
        shell = eqx.tree_at(lambda s: s.blocks, self, static)

        def unit(pf_u, po_u, h, s, k, first):
            arrays: list[Any] = [None] * (len(floats) + len(others))
            for n, a in zip(floats, pf_u, strict=True):
                arrays[n] = a
            for n, a in zip(others, po_u, strict=True):
                arrays[n] = a
            p = treedef.unflatten(arrays)
            with exact_hook(hook):
                if seg is None:
                    return Stack._layer(shell, p, static, h, s, k, first, batch)
                return Stack._run_blocks(shell, p, static, h, s, k, first, batch)

        return unit

    def _run_segments(self, params, static, x, state, key, batch):
        """Chen et al. (2016): keep each segment's input only; recompute a segment at a time."""
        seg = self.segment
        assert seg is not None
        n_full, rest = divmod(self.n_layers, seg)

        @functools.partial(
            jax.checkpoint,
            policy=jax.checkpoint_policies.nothing_saveable,
            prevent_cse=not self.scan,
        )
        def run_segment(p, h, s, first):
            return self._run_blocks(p, static, h, s, key, first, batch)

        def take(tree, start, stop):
            return jax.tree.map(lambda a: a[start:stop], tree)

        outs = []
        if self.scan and n_full:
            # One scan over the equal segments: compile time does not grow with depth.
            def split(tree):
                return jax.tree.map(
                    lambda a: a[: n_full * seg].reshape(n_full, seg, *a.shape[1:]), tree
                )

            def seg_body(h, xs):
                p, s, first = xs
                return run_segment(p, h, s, first)

            x, s = jax.lax.scan(
                seg_body, x, (split(params), split(state), jnp.arange(n_full) * seg)
            )
            outs.append(jax.tree.map(lambda a: a.reshape(n_full * seg, *a.shape[2:]), s))
        else:
            for i in range(n_full):
                x, s = run_segment(
                    take(params, i * seg, (i + 1) * seg),
                    x,
                    take(state, i * seg, (i + 1) * seg),
                    i * seg,
                )
                outs.append(s)
        if rest:
            start = n_full * seg
            x, s = run_segment(
                take(params, start, self.n_layers), x, take(state, start, self.n_layers), start
            )
            outs.append(s)
        if self.stateful:
            state = jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
        return x, state


class _Units(NamedTuple):
    """How fused accumulation walks a stack: in units of one block (`seg` None) or of one
    segment of `seg` blocks, `n_full` equal units and then `rest` blocks from `start`."""

    seg: int | None
    n_full: int
    rest: int
    start: int

    @classmethod
    def of(cls, n_layers: int, segment: int | None) -> "_Units":
        seg = None if segment is None else min(segment, n_layers)  # one segment at most
        n_full, rest = divmod(n_layers, 1 if seg is None else seg)
        return cls(seg, n_full, rest, n_layers - rest)

    def split(self, tree: PyTree) -> PyTree:
        """The equal units' arrays, `(n_full, seg, ...)` (one block each: as they are)."""
        if self.seg is None:
            return tree
        shape = (self.n_full, self.seg)
        return jax.tree.map(lambda a: a[: self.start].reshape(*shape, *a.shape[1:]), tree)

    def tail(self, tree: PyTree) -> PyTree:
        """The shorter last unit's arrays."""
        return jax.tree.map(lambda a: a[self.start :], tree)


def _fold_into(fold: Callable, seg: int | None, acc: Array, g: Array, first: int | Array) -> Array:
    """`acc` with the unit's gradient `g` folded into its slice from block `first` on."""
    if seg is None:
        old = jax.lax.dynamic_index_in_dim(acc, first, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(acc, fold(old, g), first, 0)
    old = jax.lax.dynamic_slice_in_dim(acc, first, g.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(acc, fold(old, g), first, 0)


def _avals(tree: PyTree) -> str:
    """`tree`'s structure with each array as its dtype and shape, e.g. `float32[8]`."""
    return str(jax.tree.map(lambda a: f"{jnp.dtype(a.dtype).name}{list(jnp.shape(a))}", tree))


_SAME = {
    "output": ("an input", "an output", "the next block takes it. Put layers that change "
               "the shape or dtype (a projection, a cast) before or after the stack"),
    "state": ("a state", "a state", "the stack carries each layer's state unchanged in "
              "type (BatchNorm's running statistics keep their shapes)"),
}  # fmt: skip


def _check_same(what: str, block: Any, before: PyTree, after: PyTree) -> None:
    """A block's output (or new state) must match its input (state) in structure, shapes
    and dtypes: the next block takes it, and the loop's carry cannot change type."""
    seen_in, seen_out = _avals(before), _avals(after)
    if seen_in != seen_out:
        took, returned, why = _SAME[what]
        raise ValueError(
            f"a block of this Stack ({type(block).__name__}) took {took} of {seen_in} and "
            f"returned {returned} of {seen_out} (per example): a block's {what} must keep "
            f"its {took.split()[1]}'s structure, shapes and dtypes, since {why}."
        )


def _check_segment(segment: object, n_layers: int) -> int | None:
    if segment == "sqrt":
        return max(1, round(math.sqrt(n_layers)))
    if segment is not None and (
        isinstance(segment, bool) or not isinstance(segment, int) or segment < 1
    ):
        raise ValueError(f"segment must be None, 'sqrt' or an int >= 1, got {segment!r}.")
    return segment  # type: ignore[return-value]


def stack(
    make_block: Callable[[PRNGKeyArray], Any],
    n_layers: int,
    *,
    key: PRNGKeyArray,
    remat: RematArg = False,
    segment: int | Literal["sqrt"] | None = None,
    scan: bool = True,
    stateful: bool = False,
    layer_spec: Any = None,
):
    """Build `n_layers` identical blocks with `make_block(key)`, stacked with `eqx.filter_vmap`.

    Args:
        make_block: `make_block(key) -> block`, an Equinox module following the block
            convention of `Stack` (for `stateful=True`: `make_block(key) -> (block, state)`).
            Every call must give the same structure and shapes; only the arrays may differ.
        n_layers: number of blocks.
        key: PRNG key for the initial weights; block `i` is built with `jr.split(key,
            n_layers)[i]`.
        remat: recomputation of each block in the backward pass.
            `False`/`"none"`: keeps every intermediate (fastest, the most memory).
            `True`/`"full"`: keeps each block's input only; one more forward pass per step.
            `"dots"`, `"minimal"`, `"minimal_offloaded"`, `Save(*names, offload=...)`: keep
            the named intermediates the block declares (`checkpoint_names`,
            `remat_presets` class attributes, see `eqx_lowmem.nn.Save`); an error for a
            block that does not declare them.
        segment: checkpoint groups of this many consecutive blocks as a unit (Chen et al.,
            2016, "Training deep nets with sublinear memory cost", Section 4.3): only each
            segment's input is kept, and the backward pass recomputes one segment at a time,
            its blocks with their own `remat`. `"sqrt"` uses `round(sqrt(n_layers))`:
            O(sqrt(n_layers)) memory for one more forward pass. The last segment may be
            shorter.
        scan: `True` runs the blocks with `jax.lax.scan`: compile time does not grow with
            depth, and recomputation really frees memory (XLA sees one block body). `False`
            runs a Python loop with the same numbers; XLA then schedules the unrolled
            program freely and may run a block's recomputation early, keeping its
            activations alive (on XLA:CPU: no memory saved at all).
        stateful: the blocks take and return a state (see `Stack`).
        layer_spec: stored on the stack for a training step's per-layer hook; not read here.

    Returns:
        The `Stack`, or `(Stack, stacked_states)` when `stateful`.

    Raises:
        ValueError: on a non-positive `n_layers`, a bad `segment`, or a `remat` the block
            does not define.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr
        >>> import eqx_lowmem as el
        >>> class Residual(eqx.Module):
        ...     linear: eqx.nn.Linear
        ...     def __init__(self, *, key):
        ...         self.linear = eqx.nn.Linear(8, 8, key=key)
        ...     def __call__(self, x, *, key=None):
        ...         return x + jnp.tanh(self.linear(x))
        >>> net = el.nn.stack(lambda k: Residual(key=k), 4, key=jr.PRNGKey(0), remat=True)
        >>> jax.vmap(net)(jnp.ones((2, 8))).shape
        (2, 8)
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}.")
    segment = _check_segment(segment, n_layers)
    keys = jr.split(key, n_layers)
    built = eqx.filter_vmap(make_block)(keys)
    if stateful:
        if not (isinstance(built, tuple) and len(built) == 2):
            raise TypeError(
                "stack(..., stateful=True): make_block(key) must return (block, state), got "
                f"{type(built).__name__}."
            )
        blocks, states = built
    else:
        blocks, states = built, None
    if not isinstance(blocks, eqx.Module):
        raise TypeError(
            f"make_block(key) must return an equinox.Module, got {type(blocks).__name__}."
        )
    names, presets = module_remat_names(blocks)
    remat = resolve_remat(remat, names, presets, module=type(blocks).__name__)
    out = Stack(
        blocks=blocks,
        n_layers=n_layers,
        remat=remat,
        segment=segment,
        scan=scan,
        stateful=stateful,
        layer_spec=layer_spec,
    )
    return (out, states) if stateful else out
