"""Where each array of the training state lives on a mesh: replicated, or sharded (FSDP).

`shard="data"` replicates parameters and optimizer state on every device. `shard="fsdp"`
(ZeRO-3) splits every array along one dimension that the data axis's size divides (the
largest such; replicated when none does) so each device stores 1/n of the parameters and of
the optimizer state. The loss sees whole weights: arrays outside scanned stacks are
all-gathered when the loss is entered, and a scanned stack's (`eqx_lowmem.nn.Stack`) arrays
one layer at a time inside the layer's recomputation region (`prepare_layer`), so a gathered
weight lives for one block and is gathered again, not saved, for the backward pass. The
transpose of an all-gather is a reduce-scatter: gradients arrive summed and sharded.

Meshes with Explicit axes (`jax.make_mesh`'s default) hold the state where the user's mesh
says, typed as sharded; the step itself runs with every axis Auto (`in_auto_axes`), since
its optimizer updates and `after_update` hooks (a sparse layer's cumulative sums, top-k)
are written for whole arrays, and its collectives are explicit in `shard_map` anyway.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from ..nn._layers import is_stack


def is_arraylike(x: Any) -> bool:
    """An array, or a `jax.ShapeDtypeStruct` stand-in for one (compile-only analysis)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_inexact_like(x: Any) -> bool:
    """A floating (trainable) array or stand-in."""
    return is_arraylike(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def has_explicit_axes(mesh: Mesh | AbstractMesh | None) -> bool:
    """Whether `mesh` has an axis of type Explicit (as `jax.make_mesh` makes by default)."""
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def auto_mesh(mesh: Mesh) -> Mesh | AbstractMesh:
    """The mesh the step names inside `in_auto_axes` (its `shard_map` and sharding
    constraints): `mesh` itself without Explicit axes; otherwise the abstract mesh of
    `in_auto_axes`'s context, every axis Auto. Abstract, not a second concrete mesh: a
    program whose arguments sit on one concrete mesh and whose constraints name another
    does not lower where a primitive needs the devices (a callback)."""
    if not has_explicit_axes(mesh):
        return mesh
    return mesh.abstract_mesh.update_axis_types({a: AxisType.Auto for a in mesh.axis_names})


def in_auto_axes(fn: Any, mesh: Mesh | None, out_shardings: Any) -> Any:
    """`fn` run with every axis of `mesh` Auto (`jax.sharding.auto_axes`): its array
    arguments enter, and its outputs leave, typed as `out_shardings` say on `mesh`. `fn`
    itself when `mesh` has no Explicit axis. Arguments and outputs must be arrays (or None)."""
    if not has_explicit_axes(mesh):
        return fn
    return jax.sharding.auto_axes(fn, out_sharding=out_shardings)


def shard_dim(shape: tuple[int, ...], n: int, first: int = 0) -> int | None:
    """The dimension (at least `first`) to split over `n` devices: the largest that `n`
    divides, the earliest among equals; None when none does (the array is replicated)."""
    best = None
    for d in range(first, len(shape)):
        if shape[d] >= n and shape[d] % n == 0 and (best is None or shape[d] > shape[best]):
            best = d
    return best


def _spec(ndim: int, dim: int | None, axis: str) -> P:
    if dim is None:
        return P()
    return P(*([None] * dim), axis)


def replace_fields(module: Any, **fields: Any) -> Any:
    """A copy of a frozen dataclass module with `fields` replaced, without running its
    `__init__` (whose checks would reject, say, a tree of shardings in place of arrays)."""
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, fields.get(f.name, getattr(module, f.name)))
    return new


class FsdpLayout(NamedTuple):
    """The FSDP placement of a model: the model with each stack's per-layer gather dims
    (`layer_spec`) set, a `PartitionSpec` per array leaf, and the arrays left replicated."""

    model: Any
    specs: Any
    replicated: tuple[str, ...]


def fsdp_layout(model: Any, n: int, axis: str) -> FsdpLayout:
    """Choose how to split every array of `model` over `n` devices along `axis`."""
    replicated: list[str] = []

    def stack_specs(stack):
        arrays = eqx.filter(stack, is_arraylike)
        dims = [shard_dim(np.shape(x), n, first=1) for x in jax.tree.leaves(arrays)]
        spec = tuple(None if d is None else d - 1 for d in dims)
        return replace_fields(stack, layer_spec=spec)

    model = jax.tree.map(lambda x: stack_specs(x) if is_stack(x) else x, model, is_leaf=is_stack)

    def leaf_spec(path, x, first):
        if not is_arraylike(x):
            return None
        d = shard_dim(np.shape(x), n, first)
        if d is None and math.prod(np.shape(x)) > 1:
            replicated.append(f"{jax.tree_util.keystr(path)} {tuple(np.shape(x))}")
        return _spec(np.ndim(x), d, axis)

    def node_specs(path, x):
        if is_stack(x):
            return jax.tree_util.tree_map_with_path(lambda p, y: leaf_spec(path + p, y, 1), x)
        return leaf_spec(path, x, 0)

    specs = jax.tree_util.tree_map_with_path(node_specs, model, is_leaf=is_stack)
    return FsdpLayout(model, specs, tuple(replicated))


def specs_like(tree: Any, n: int, axis: str) -> Any:
    """A `PartitionSpec` per array leaf of any tree (optimizer state): the same rule as the
    parameters outside stacks, so each moment of a plain leaf lands where its parameter is."""
    return jax.tree.map(
        lambda x: _spec(np.ndim(x), shard_dim(np.shape(x), n), axis) if is_arraylike(x) else None,
        tree,
    )


def gather_leaves(tree: Any, specs: Any, axis: str) -> Any:
    """Inside `shard_map`: all-gather every sharded leaf outside stacks to its whole shape."""

    def gather(x, spec):
        if x is None or spec is None:
            return x
        dims = [i for i, s in enumerate(spec) if s is not None]
        return x if not dims else jax.lax.all_gather(x, axis, axis=dims[0], tiled=True)

    def node(x, spec):
        if is_stack(x):
            return x  # gathered per layer by `gather_layer`
        return gather(x, spec)

    return jax.tree.map(node, tree, specs, is_leaf=lambda x: x is None or is_stack(x))


def gather_layer(axis: str):
    """The `prepare_layer` hook of FSDP: all-gather one layer's slices along its dims."""

    def hook(stack, params):
        spec = stack.layer_spec
        if spec is None:
            return params
        leaves, treedef = jax.tree.flatten(params)
        if len(leaves) != len(spec):
            raise ValueError(
                f"{type(stack).__name__}.layer_spec has {len(spec)} entries for a layer of "
                f"{len(leaves)} arrays; build the step from the model it will train."
            )
        gathered = [
            x if d is None else jax.lax.all_gather(x, axis, axis=d, tiled=True)
            for x, d in zip(leaves, spec, strict=True)
        ]
        return jax.tree.unflatten(treedef, gathered)

    return hook


def state_shardings(state: Any, mesh: Mesh | AbstractMesh, axis: str, shard: str) -> Any:
    """A `NamedSharding` per array leaf of a `TrainState` (None elsewhere): replicated with
    `shard="data"`; with `"fsdp"` the parameters and optimizer state split as `fsdp_layout`
    says, the rest replicated."""
    n = int(mesh.shape[axis])

    def named(spec):
        return None if spec is None else NamedSharding(mesh, spec)

    replicated = jax.tree.map(lambda x: NamedSharding(mesh, P()) if is_arraylike(x) else None,
                              state)  # fmt: skip
    if shard == "fsdp":
        model_specs = fsdp_layout(state.model, n, axis).specs
        opt_specs = _opt_specs(state, model_specs, n, axis)
        replicated = replace_fields(
            replicated,
            model=jax.tree.map(named, model_specs, is_leaf=lambda x: isinstance(x, P)),
            opt_state=jax.tree.map(named, opt_specs, is_leaf=lambda x: isinstance(x, P)),
        )

    def full_rank(x, s):
        # Explicit axes: `P("data", None)`, not `P("data")`, as a step returns its arrays
        # typed (Auto axes: the short form): jit would compile the step again for the
        # second call otherwise.
        if s is None or not is_arraylike(x) or not has_explicit_axes(mesh):
            return s
        return NamedSharding(mesh, P(*s.spec, *[None] * (np.ndim(x) - len(s.spec))))

    return jax.tree.map(full_rank, state, replicated, is_leaf=lambda x: x is None)


def _opt_specs(state: Any, model_specs: Any, n: int, axis: str) -> Any:
    """Optimizer-state specs: a subtree shaped like the parameters (Adam's moments) gets
    the parameters' specs; any other array the plain rule."""
    params = eqx.filter(state.model, is_inexact_like)
    param_specs = jax.tree.map(
        lambda p, s: s if p is not None else None, params, model_specs,
        is_leaf=lambda x: x is None,
    )  # fmt: skip
    treedef = jax.tree.structure(params)

    def like_params(x):
        try:
            return jax.tree.structure(x) == treedef and x is not None
        except Exception:
            return False

    def node(x):
        if like_params(x):
            shapes = [np.shape(a) for a in jax.tree.leaves(x)]
            if shapes == [np.shape(a) for a in jax.tree.leaves(params)]:
                return param_specs
        return specs_like(x, n, axis)

    return jax.tree.map(node, state.opt_state, is_leaf=like_params)
