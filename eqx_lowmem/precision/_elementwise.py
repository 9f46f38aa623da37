"""Whether an optimizer's update is element-wise per parameter, read from its jaxpr.

`quantized_state` updates a large leaf a chunk of elements at a time, with the rest of
the parameters empty, which gives the whole update's result only when every output
element depends on the same element of its own parameter's gradient, parameter and state,
and on scalars (counts, learning rates): Adam, AdamW, SGD with momentum, Lion, RMSProp.
Global-norm clipping, trust ratios (LAMB, LARS), factored statistics (Adafactor) and noise
are not: their updates run whole.
"""

from typing import Any

import jax
from jax.extend import core as jcore

# Primitives whose output element i depends on input elements i only (scalars broadcast).
_ELEMENTWISE = frozenset(
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type "
    "copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow "
    "is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real "
    "reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor".split()
)
_FILL, _SHARED = "fill", "shared"  # broadcast scalars; arrays of no single parameter


class _NotElementwise(Exception):
    pass


def _sub_jaxpr(eqn: Any) -> Any:
    """The jaxpr that a call-like equation (jit, custom_jvp/vjp, remat) runs on its
    operands, or None."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jcore.Jaxpr) and len(sub.invars) == len(eqn.invars):
            return sub
    return None


def _label(env: dict, v: Any) -> Any:
    return None if isinstance(v, jcore.Literal) else env.get(v)


def _eqn_labels(eqn: Any, labels: list) -> list:
    """The labels of `eqn`'s outputs: a parameter's index, `_FILL`, `_SHARED` or None
    (a scalar)."""
    sub = _sub_jaxpr(eqn)
    if sub is not None:
        return _walk(sub, labels)
    owners = {x for x in labels if isinstance(x, int)}
    scalar_out = all(v.aval.shape == () for v in eqn.outvars)
    name = eqn.primitive.name
    if name == "broadcast_in_dim" and eqn.invars[0].aval.shape == ():
        return [_FILL]
    if name in _ELEMENTWISE:
        shapes = {v.aval.shape for v in (*eqn.invars, *eqn.outvars)} - {()}
        if len(owners) > 1 or len(shapes) > 1 or (owners and _SHARED in labels):
            raise _NotElementwise(name)
        if owners:
            return [owners.pop()] * len(eqn.outvars)
        if scalar_out:
            return [None] * len(eqn.outvars)
        return [_SHARED if _SHARED in labels else _FILL] * len(eqn.outvars)
    if owners:  # a reduction, a reshape, a gather, ... of a parameter's elements
        raise _NotElementwise(name)
    return [None if v.aval.shape == () else _SHARED for v in eqn.outvars]


def _walk(jaxpr: Any, labels: list) -> list:
    env: dict = {}
    for v in jaxpr.constvars:
        env[v] = None if v.aval.shape == () else _SHARED
    for v, x in zip(jaxpr.invars, labels, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        out = _eqn_labels(eqn, [_label(env, v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, out, strict=True):
            env[v] = x
    return [_label(env, v) for v in jaxpr.outvars]


def _signature(jaxpr: Any) -> list[str]:
    """The primitives a jaxpr runs, in order, into its calls."""
    out = []
    for eqn in jaxpr.eqns:
        sub = _sub_jaxpr(eqn)
        out += [eqn.primitive.name] if sub is None else _signature(sub)
    return out


def elementwise_labels(fn: Any, args: list, owners: list) -> tuple[list, list[str]] | None:
    """Trace `fn(*args)` (flat array leaves; nothing runs) with `owners[i]` the parameter
    index of `args[i]` (None: a scalar or shared leaf). Returns each output's parameter
    index (or `"fill"`, `"shared"`, None) and the primitives it runs, or None when some
    output element depends on elements of other positions or other parameters."""
    closed = jax.make_jaxpr(fn)(*args)
    labels = [x if x is not None or getattr(a, "shape", ()) == () else _SHARED
              for x, a in zip(owners, args, strict=True)]  # fmt: skip
    try:
        return _walk(closed.jaxpr, labels), _signature(closed.jaxpr)
    except _NotElementwise:
        return None


def signature(fn: Any, args: list) -> list[str]:
    """The primitives `fn(*args)` runs (traced, nothing runs)."""
    return _signature(jax.make_jaxpr(fn)(*args).jaxpr)
