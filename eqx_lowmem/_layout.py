"""Which leaves of an optimizer state belong to which parameter: the one rule that 8-bit
state (`precision.quantized_state`) and sparse rewiring (`sparse`'s hooks) share.

Per-parameter optimizer state lives in subtrees laid out like the parameters (`laid_out_like`):
optax's `mu`, `nu`, `trace`, ..., also inside `optax.chain`, `masked` (an
`optax.MaskedNode` stands for what the optimizer does not see), `multi_transform`,
`inject_hyperparams`, `precision.half_state` and `quantized_state` (whose `Packed` entries
stand for one array each). An entry of such a subtree whose shape is its parameter's holds
one number per element of it (`owners`); anything else (counts, hyperparameters, factored
statistics, state laid out some other way) belongs to no single element.
"""

from typing import Any

import equinox as eqx
import jax
import optax


class Packed(eqx.Module):
    """An entry of per-parameter state stored in another form (8-bit codes and scales):
    one leaf of the state's layout, standing for an array of `shape`."""

    shape: eqx.AbstractVar[tuple[int, ...]]


def is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def is_entry(x: Any) -> bool:
    """One parameter's entry that is not an array: a `MaskedNode` or a `Packed` entry."""
    return is_masked(x) or isinstance(x, Packed)


def laid_out_like(node: Any, params: Any) -> bool:
    """Whether `node` is laid out like `params`: the same tree with an array at each of
    their leaves, where an `optax.MaskedNode` may stand for any part (`optax.masked`)."""
    if eqx.is_array(node) or is_entry(node):
        return False
    ok = True

    def visit(entry: Any, part: Any) -> None:
        nonlocal ok
        if not is_masked(entry) and not jax.tree_util.treedef_is_leaf(jax.tree.structure(part)):
            ok = False  # one entry for a whole subtree of parameters

    try:
        jax.tree.map(visit, node, params, is_leaf=is_entry)
    except (ValueError, TypeError):
        return False
    return ok


def owners(opt_state: Any, params: Any) -> tuple[list, Any, list[int | None]]:
    """The leaves of `opt_state` (a `Packed` entry or `MaskedNode` as one leaf), with
    their paths, its treedef, and for each leaf the index (in `jax.tree.leaves(params)`)
    of the parameter it holds one number per element of, or None."""
    shapes = [getattr(p, "shape", None) for p in jax.tree.leaves(params)]
    index = jax.tree.unflatten(jax.tree.structure(params), list(range(len(shapes))))
    nodes, _ = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: is_entry(x) or laid_out_like(x, params)
    )
    leaves, who = [], []
    for path, node in nodes:
        if not laid_out_like(node, params):
            leaves.append((path, node))
            who.append(None)
            continue
        sub, node_def = jax.tree_util.tree_flatten_with_path(node, is_leaf=is_entry)
        for (p, leaf), i in zip(sub, node_def.flatten_up_to(index), strict=True):
            leaves.append(((*path, *p), leaf))
            shaped = isinstance(i, int) and getattr(leaf, "shape", None) == shapes[i]
            who.append(i if shaped and not is_masked(leaf) else None)
    treedef = jax.tree.structure(opt_state, is_leaf=is_entry)
    return leaves, treedef, who
