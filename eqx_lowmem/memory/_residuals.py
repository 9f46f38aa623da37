"""What the backward pass keeps: the residuals of `jax.vjp`, with names, shapes and bytes."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.extend import core as jex_core

# Higher-order primitives whose outputs map one to one onto the outputs of a sub-jaxpr
# (parameter name of the sub-jaxpr), through which a residual's name is looked up.
_SUBJAXPR_PARAMS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "scan": "jaxpr",
}
# Element-wise or layout primitives a name is looked through (a saved value may be a cast,
# copy or reshape of the named one).
_TRANSPARENT = {
    "convert_element_type",
    "reduce_precision",
    "copy",
    "copy_p",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "broadcast_in_dim",
}


class Residual(NamedTuple):
    """One array the backward pass keeps.

    Attributes:
        name: the checkpoint name of the value (`jax.ad_checkpoint.checkpoint_name`), when
            it has one; else `None`.
        source: where it comes from: `"argument <path>"` for an input of the function (for
            example a parameter), `"intermediate <primitive>"` for a computed value,
            `"constant"` for a closed-over array.
        shape: its shape; a residual saved inside a `lax.scan` (one per iteration) has the
            loop length as its leading axis.
        dtype: its dtype.
        nbytes: its size in bytes.
    """

    name: str | None
    source: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


def _inner_jaxpr(eqn) -> Any | None:
    key = _SUBJAXPR_PARAMS.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    inner = eqn.params[key]
    return getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr


def _describe(var, jaxpr, depth: int = 0) -> tuple[str | None, str, Any]:
    """(checkpoint name or None, producing primitive, var it was traced back to)."""
    producers = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    eqn = producers.get(id(var))
    while eqn is not None and depth < 64:
        depth += 1
        prim = eqn.primitive.name
        if prim == "name":
            return eqn.params["name"], prim, var
        inner = _inner_jaxpr(eqn)
        if inner is not None:
            # Outputs of call-like primitives (and of scan: carries, then stacked per-iteration
            # values) are in the order of their sub-jaxpr's outputs.
            inner_var = inner.outvars[[id(v) for v in eqn.outvars].index(id(var))]
            if isinstance(inner_var, jex_core.Literal):
                return None, prim, var
            name, inner_prim, _ = _describe(inner_var, inner, depth)
            return name, prim if inner_prim == "input" else inner_prim, var
        if prim in _TRANSPARENT and not isinstance(eqn.invars[0], jex_core.Literal):
            var = eqn.invars[0]
            eqn = producers.get(id(var))
            continue
        return None, prim, var
    return None, "input", var


def saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """The arrays `jax.vjp` keeps between the forward and the backward pass of `fn`.

    Differentiates with respect to every floating-point array in `args` and `kwargs` (as
    `eqx.filter_vjp` does); other leaves are held fixed. Nothing runs: this traces only.

    Args:
        fn: the function, for example `lambda model, x: model(x)`.
        *args, **kwargs: its inputs (arrays, or `jax.ShapeDtypeStruct`s).

    Returns:
        One `Residual` per saved array, named where a `checkpoint_name` marks it.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr
        >>> import eqx_lowmem as el
        >>> block = el.nn.TransformerBlock(16, 2, 32, key=jr.PRNGKey(0), remat=True)
        >>> res = el.memory.saved_residuals(lambda b, x: b(x), block, jnp.ones((4, 16)))
        >>> [r.source for r in res if not r.source.startswith("argument args[0]")]
        ['argument args[1]']
    """
    diff, nondiff = eqx.partition((args, kwargs), eqx.is_inexact_array)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(diff)
    paths = [_path(p) for p, _ in paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]

    def flat_fn(*flat):
        a, kw = eqx.combine(jax.tree_util.tree_unflatten(treedef, flat), nondiff)
        return fn(*a, **kw)

    closed, out_shape = jax.make_jaxpr(lambda *xs: jax.vjp(flat_fn, *xs), return_shape=True)(
        *leaves
    )
    jaxpr = closed.jaxpr
    n_res = len(jax.tree_util.tree_leaves(out_shape[1]))
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - n_res :]
    invar_path = {id(v): p for v, p in zip(jaxpr.invars, paths, strict=True)}
    const_ids = {id(v) for v in jaxpr.constvars}

    results: list[Residual] = []
    seen: set[int] = set()
    for var in res_vars:
        if isinstance(var, jex_core.Literal) or id(var) in seen:
            continue
        seen.add(id(var))
        aval = var.aval
        name, prim, origin = _describe(var, jaxpr)
        if id(origin) in invar_path:
            source = f"argument {invar_path[id(origin)]}"
            if origin is not var:
                source += " (transformed)"
        elif id(origin) in const_ids:
            source = "constant"
        else:
            source = f"intermediate {prim}"
        shape = tuple(int(d) for d in aval.shape)
        dtype = np.dtype(aval.dtype)
        results.append(Residual(name, source, shape, dtype, int(np.prod(shape)) * dtype.itemsize))
    return results


def _path(path) -> str:
    # ((args, kwargs) path) -> "args[0].ln1.weight" or "kwargs['x']".
    head, *rest = path
    prefix = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
    return prefix + jax.tree_util.keystr(tuple(rest))


def residual_bytes(residuals: Sequence[Residual], *, arguments: bool = False) -> int:
    """Total bytes of `residuals`; arguments (parameters, inputs) only if `arguments=True`."""
    return sum(r.nbytes for r in residuals if arguments or not r.source.startswith("argument"))
