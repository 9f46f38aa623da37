"""What the backward pass keeps: the residuals of `jax.vjp`, with names, shapes and bytes."""

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
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
    "remat2": "jaxpr",
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
    "stop_gradient",
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
        loops: the lengths of the `lax.scan`s it is stacked over, outermost first: its
            leading axes. For blocks run by a scan (`transformer_encoder`) this is
            `(n_layers,)`, and `nbytes / n_layers` is one layer's share.
        scope: the `jax.named_scope`s of the operation that computed it, outermost first,
            joined by "/" (e.g. `"eqx_lowmem.nn.TransformerEncoder/eqx_lowmem.nn.
            TransformerBlock"`); empty where none is known.
    """

    name: str | None
    source: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    loops: tuple[int, ...] = ()
    scope: str = ""


def _inner_jaxpr(eqn) -> Any | None:
    key = _SUBJAXPR_PARAMS.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    inner = eqn.params[key]
    return getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr


# Name-stack components that are transformations or control flow, not user scopes.
_TRANSFORM = re.compile(r"^[A-Za-z_]+\((.*)\)$")
_NOT_SCOPES = {"", "checkpoint", "remat", "rematted_computation", "while", "body", "cond"}


def _scopes(eqn) -> list[str]:
    """The named scopes of an equation, transformations (`jvp(...)`, `vmap(...)`) removed."""
    out = []
    for part in str(eqn.source_info.name_stack).split("/"):
        while (m := _TRANSFORM.match(part)) is not None:
            part = m.group(1)
        if part not in _NOT_SCOPES:
            out.append(part)
    return out


class _Origin(NamedTuple):
    name: str | None  # checkpoint name, if any
    prim: str  # the producing primitive ("input" for an input of the jaxpr)
    var: Any  # the var it was traced back to, at the level of the jaxpr searched
    loops: tuple[int, ...]  # lengths of the scans it is stacked over, outermost first
    scope: tuple[str, ...]  # named scopes, outermost first
    # The transparent operations between the residual and `var`, at the level searched,
    # those that only add or drop unit axes (views of the same bytes) left out.
    chain: tuple[str, ...] = ()


# Layout primitives that never move bytes when they only add or drop axes of length 1: a
# residual saved through one of them is the buffer of its operand (XLA bitcasts it).
_VIEWS = {"reshape", "squeeze", "expand_dims", "broadcast_in_dim"}


def _is_view(eqn) -> bool:
    """An operation that only adds or drops unit axes of its operand (the same bytes)."""
    if eqn.primitive.name not in _VIEWS:
        return False
    (out,), x = eqn.outvars, eqn.invars[0]
    drop = [d for d in x.aval.shape if d != 1]
    keep = [d for d in out.aval.shape if d != 1]
    if drop != keep:
        return False
    # broadcast_in_dim must map the operand's axes in order (no transposition).
    dims = eqn.params.get("broadcast_dimensions")
    return dims is None or list(dims) == sorted(dims)


def _forwarded_input(eqn, inner, var) -> Any | None:
    """The operand of call-like `eqn` that is `inner`'s input `var`, when the call's inputs
    map one to one onto its sub-jaxpr's (not a scan's); else None."""
    if eqn.primitive.name == "scan" or len(inner.invars) != len(eqn.invars):
        return None
    ids = [id(v) for v in inner.invars]
    if id(var) not in ids:
        return None
    outer = eqn.invars[ids.index(id(var))]
    return None if isinstance(outer, jex_core.Literal) else outer


def _is_no_op(eqn) -> bool:
    """A `copy` (lowered to no operation: the rules' `eqx_lowmem.nn._jvp.rule_input`) or a
    `reduce_precision` to its operand's own precision (`jax.checkpoint` puts one on each
    residual it forwards; XLA removes it): the same bytes."""
    if eqn.primitive.name == "copy":
        return True
    if eqn.primitive.name != "reduce_precision":
        return False
    dtype = eqn.invars[0].aval.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    finfo = jnp.finfo(dtype)
    return (eqn.params.get("exponent_bits"), eqn.params.get("mantissa_bits")) == (
        finfo.nexp,
        finfo.nmant,
    )


def _describe(var, jaxpr, depth: int = 0) -> _Origin:
    """Where a var of `jaxpr` comes from: its checkpoint name, primitive, loops and scopes."""
    producers = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    eqn = producers.get(id(var))
    chain: list[str] = []
    while eqn is not None and depth < 64:
        depth += 1
        prim = eqn.primitive.name
        scope = tuple(_scopes(eqn))
        if prim == "name":
            return _Origin(eqn.params["name"], prim, var, (), scope, tuple(chain))
        inner = _inner_jaxpr(eqn)
        if inner is not None:
            # Outputs of call-like primitives (and of scan: carries, then stacked per-iteration
            # values) are in the order of their sub-jaxpr's outputs.
            index = [id(v) for v in eqn.outvars].index(id(var))
            loops: tuple[int, ...] = ()
            if prim == "scan" and index >= eqn.params.get("num_carry", 0):
                loops = (int(eqn.params["length"]),)
            inner_var = inner.outvars[index]
            if isinstance(inner_var, jex_core.Literal):
                return _Origin(None, prim, var, loops, scope, tuple(chain))
            got = _describe(inner_var, inner, depth)
            forwarded = _forwarded_input(eqn, inner, got.var)
            if got.prim == "input" and forwarded is not None:
                # An input passed through the call (a `jax.checkpoint` forwarding its
                # input as a residual): the same buffer as that input, out here.
                chain.extend(got.chain)
                var = forwarded
                eqn = producers.get(id(var))
                continue
            return _Origin(
                got.name,
                prim if got.prim == "input" else got.prim,
                var,
                loops + got.loops,
                scope + got.scope,
                tuple(chain),
            )
        if prim in _TRANSPARENT and not isinstance(eqn.invars[0], jex_core.Literal):
            if not _is_view(eqn) and not _is_no_op(eqn):
                chain.append(f"{prim}{sorted((k, str(v)) for k, v in eqn.params.items())}")
            var = eqn.invars[0]
            eqn = producers.get(id(var))
            continue
        return _Origin(None, prim, var, (), scope, tuple(chain))
    return _Origin(None, "input", var, (), (), tuple(chain))


def _is_float(x: Any) -> bool:
    """A floating-point array, or a `jax.ShapeDtypeStruct` of one: differentiated."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(jnp.issubdtype(x.dtype, jnp.inexact))
    return eqx.is_inexact_array(x)


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """The arrays `jax.vjp` keeps between the forward and the backward pass of `fn`.

    Differentiates with respect to every floating-point array in `args` and `kwargs` (as
    `eqx.filter_vjp` does); other leaves are held fixed. Nothing runs and nothing is
    allocated: this traces only, so a model and batch given as `jax.ShapeDtypeStruct`s
    (from `eqx.filter_eval_shape`) work at any size.

    Args:
        fn: the function, for example `lambda model, x: model(x)`.
        *args, **kwargs: its inputs: arrays or `jax.ShapeDtypeStruct`s (floating ones are
            differentiated, others such as integer token ids are traced but not).

    Returns:
        One `Residual` per saved buffer, named where a `checkpoint_name` marks it: a value
        that several operations save (one activation feeding two convolutions) counts once.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr
        >>> import eqx_lowmem as el
        >>> block = el.nn.TransformerBlock(16, 2, 32, key=jr.PRNGKey(0), remat=True)
        >>> res = el.memory.saved_residuals(lambda b, x: b(x), block, jnp.ones((4, 16)))
        >>> [r.source for r in res if not r.source.startswith("argument args[0]")]
        ['argument args[1]']
    """
    diff, nondiff = eqx.partition((args, kwargs), _is_float)
    # Abstract non-float inputs (integer token ids given as shapes) are traced, not fixed.
    traced, fixed = eqx.partition(nondiff, _is_abstract)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(diff)
    traced_paths_leaves, traced_def = jax.tree_util.tree_flatten_with_path(traced)
    paths = [_path(p) for p, _ in paths_leaves + traced_paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]
    traced_leaves = [leaf for _, leaf in traced_paths_leaves]

    def vjp(leaves, traced_leaves):
        other = eqx.combine(jax.tree_util.tree_unflatten(traced_def, traced_leaves), fixed)

        def flat_fn(*flat):
            a, kw = eqx.combine(jax.tree_util.tree_unflatten(treedef, flat), other)
            return fn(*a, **kw)

        return jax.vjp(flat_fn, *leaves)

    closed, out_shape = jax.make_jaxpr(vjp, return_shape=True)(leaves, traced_leaves)
    jaxpr = closed.jaxpr
    n_res = len(jax.tree_util.tree_leaves(out_shape[1]))
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - n_res :]
    invar_path = {id(v): p for v, p in zip(jaxpr.invars, paths, strict=True)}
    const_ids = {id(v) for v in jaxpr.constvars}

    results: list[Residual] = []
    seen: set[int] = set()
    # One buffer, saved once: residuals that are the same traced value, or views of it that
    # only add or drop unit axes (two convolutions of one input each save their own
    # `broadcast_in_dim` of it; XLA keeps one buffer), count once.
    buffers: set[tuple] = set()
    for var in res_vars:
        if isinstance(var, jex_core.Literal) or id(var) in seen:
            continue
        seen.add(id(var))
        aval = var.aval
        origin = _describe(var, jaxpr)
        buffer = (id(origin.var), origin.chain, str(aval.dtype), int(np.prod(aval.shape)))
        if buffer in buffers:
            continue
        buffers.add(buffer)
        if id(origin.var) in invar_path:
            source = f"argument {invar_path[id(origin.var)]}"
            if origin.var is not var:
                source += " (transformed)"
        elif id(origin.var) in const_ids:
            source = "constant"
        else:
            source = f"intermediate {origin.prim}"
        shape = tuple(int(d) for d in aval.shape)
        dtype = np.dtype(aval.dtype)
        results.append(
            Residual(
                origin.name,
                source,
                shape,
                dtype,
                int(np.prod(shape)) * dtype.itemsize,
                origin.loops,
                "/".join(origin.scope),
            )
        )
    return results


def _path(path) -> str:
    # ((args, kwargs) path) -> "args[0].ln1.weight" or "kwargs['x']".
    head, *rest = path
    prefix = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
    return prefix + jax.tree_util.keystr(tuple(rest))


def residual_bytes(residuals: Sequence[Residual], *, arguments: bool = False) -> int:
    """Total bytes of `residuals`; arguments (parameters, inputs) only if `arguments=True`."""
    return sum(r.nbytes for r in residuals if arguments or not r.source.startswith("argument"))
