"""The arithmetic a traced program asks for, with every loop counted as many times as it runs.

XLA's `compiled.cost_analysis()` counts the body of a `while` loop once, and a training step
is mostly loops: the micro-batches of `make_step(accumulate=k)` and the layers of
`transformer_encoder` are both `lax.scan`s. Its FLOPs for the guide's transformer are a
twelfth of the real figure. This module counts on the jaxpr instead, where every scan
states its length: the count includes the forward, the backward and every recomputation
that `remat` adds, as the program asks for them (before XLA fuses or simplifies anything).
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

# Operations that move or re-label data without arithmetic.
_FREE = {
    "reshape",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "transpose",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "concatenate",
    "pad",
    "rev",
    "convert_element_type",
    "reduce_precision",
    "bitcast_convert_type",
    "copy",
    "copy_p",
    "iota",
    "name",
    "split",
    "stop_gradient",
    "optimization_barrier",
    "random_bits",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "random_fold_in",
    "random_split",
    "threefry2x32",
    "device_put",
    "sharding_constraint",
    "pvary",
    "axis_index",
}
_TRANSCENDENTAL = {
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
    "erf",
    "erfc",
    "erf_inv",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "atan2",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "sqrt",
    "rsqrt",
    "cbrt",
    "pow",
    "lgamma",
    "digamma",
}
_REDUCTIONS = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
}


class Cost(NamedTuple):
    """The arithmetic of a program.

    Attributes:
        flops: floating-point (and integer) operations: `2 m n k` per matrix product, one per
            output element of element-wise work, one per input element of a reduction.
        matmul_flops: the part of `flops` in matrix products and convolutions.
        transcendentals: exponentials, logarithms, square roots and the like.
        unknown_loops: `while` loops whose trip count the trace does not state; each body is
            counted once (scans, which state their length, are counted exactly).
        flops_16bit: the part of `flops` computed in a 16-bit type (bfloat16, float16): of
            products, the 16-bit operands; of other work, the 16-bit results.
        matmul_flops_16bit: the part of `matmul_flops` with 16-bit operands.
    """

    flops: float = 0.0
    matmul_flops: float = 0.0
    transcendentals: float = 0.0
    unknown_loops: int = 0
    flops_16bit: float = 0.0
    matmul_flops_16bit: float = 0.0

    def __add__(self, other):  # type: ignore[override]
        """Field by field: the cost of running both."""
        return Cost(*(a + b for a, b in zip(self, other, strict=True)))

    def scale(self, n: int | float):
        """Every count but `unknown_loops` times `n` (a loop run `n` times)."""
        flops, matmul, transcendentals, unknown, half, half_matmul = self
        return Cost(flops * n, matmul * n, transcendentals * n, unknown, half * n, half_matmul * n)


class Throughput(NamedTuple):
    """Relative speeds of a kind of device, in operations per unit of time, for ranking.

    Only ratios matter: `relative_time` of two steps compares them on one device kind.

    Attributes:
        matmul32: matrix products with float32 operands.
        matmul16: matrix products with 16-bit operands.
        other32: other (element-wise, reduction) work in float32.
        other16: other work in 16 bits.
    """

    matmul32: float
    matmul16: float
    other32: float
    other16: float


# Rough, stated ratios (the planner says it ranks by them; measure=True times instead):
# - cpu: XLA:CPU converts 16-bit operands to float32 for every product and most element-wise
#   work, so 16 bits run slower there (about half speed).
# - gpu: tensor cores run 16-bit products at twice TensorFloat-32's rate (JAX's float32
#   default on Ampere and later: A100 312 vs 156 TFLOPS, H100 990 vs 495); element-wise work
#   is bound by memory bandwidth, about 1/100 of the product rate, and twice as fast at half
#   the bytes.
# - tpu: the MXU multiplies bfloat16; float32 products take several passes (about 1/3).
THROUGHPUTS: dict[str, Throughput] = {
    "cpu": Throughput(matmul32=1.0, matmul16=0.5, other32=0.1, other16=0.05),
    "gpu": Throughput(matmul32=1.0, matmul16=2.0, other32=0.01, other16=0.02),
    "tpu": Throughput(matmul32=1 / 3, matmul16=1.0, other32=0.02, other16=0.02),
}


def relative_time(cost: Cost, throughput: Throughput) -> float:
    """The time `cost` takes at `throughput`, in its relative units: each kind of work
    divided by its rate."""
    m16 = cost.matmul_flops_16bit
    m32 = cost.matmul_flops - m16
    o16 = cost.flops_16bit - m16
    o32 = cost.flops - cost.matmul_flops - o16
    t = throughput
    return m32 / t.matmul32 + m16 / t.matmul16 + o32 / t.other32 + o16 / t.other16


def _size(aval: Any) -> float:
    shape = getattr(aval, "shape", ())
    return float(np.prod(shape)) if shape else 1.0


def _is_16bit(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    if dtype is None or np.dtype(dtype).itemsize != 2:
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _eqn_cost(eqn, outs: tuple[bool, ...]) -> Cost:
    """The cost of `eqn` where only its outputs `outs` are used."""
    prim = eqn.primitive.name
    params = eqn.params
    _, body_used = _inner_used(eqn, outs)
    if prim == "scan":
        return _jaxpr_cost(params["jaxpr"], body_used).scale(int(params["length"]))
    if prim == "while":
        body = _jaxpr_cost(params["body_jaxpr"]) + _jaxpr_cost(params["cond_jaxpr"])
        return body + Cost(unknown_loops=1)
    if prim == "cond":
        branches = [_jaxpr_cost(b, body_used) for b in params["branches"]]
        return max(branches, key=lambda c: c.flops)
    if body_used is not None:  # a call: the cost of what its used outputs need
        return _jaxpr_cost(params[_CALLS[prim]], body_used)
    inner = list(jex_core.jaxprs_in_params(params))
    if inner:
        # Calls, checkpoints, custom derivatives, shard_map: the cost of what they run.
        total = Cost()
        for sub in inner:
            total = total + _jaxpr_cost(sub)
        return total
    if prim == "dot_general":
        (contract, _), _ = params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        k = float(np.prod([lhs.shape[d] for d in contract])) if contract else 1.0
        flops = 2.0 * _size(eqn.outvars[0].aval) * k
        half = flops if _is_16bit(lhs) else 0.0
        return Cost(flops, flops, flops_16bit=half, matmul_flops_16bit=half)
    if prim == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_features = rhs.shape[params["dimension_numbers"].rhs_spec[0]]
        flops = 2.0 * _size(eqn.outvars[0].aval) * _size(rhs) / out_features
        half = flops if _is_16bit(rhs) else 0.0
        return Cost(flops, flops, flops_16bit=half, matmul_flops_16bit=half)
    if prim in _FREE:
        return Cost()
    if prim in ("dynamic_slice", "dynamic_update_slice"):
        # Moves, as `slice` (free here too): reading one layer's slice of a stacked array,
        # or writing it back in place (a fused accumulator's update, `eqx_lowmem.nn._fuse`).
        return Cost()
    if prim in _REDUCTIONS:
        n = sum(_size(v.aval) for v in eqn.invars)
        return Cost(n, flops_16bit=n if _is_16bit(eqn.invars[0].aval) else 0.0)
    out = sum(_size(v.aval) for v in eqn.outvars)
    half = out if eqn.outvars and _is_16bit(eqn.outvars[0].aval) else 0.0
    return Cost(out, 0.0, out if prim in _TRANSCENDENTAL else 0.0, flops_16bit=half)


def jaxpr_cost(jaxpr: Any) -> Cost:
    """The `Cost` of a (closed) jaxpr, scans multiplied by their length.

    Args:
        jaxpr: a `Jaxpr` or `ClosedJaxpr`, e.g. `jax.make_jaxpr(f)(*args)` or the `.jaxpr`
            of `jax.jit(f).trace(*args)`.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return _jaxpr_cost(jaxpr)


# Effects that do not keep an unused equation alive (JAX's own dead-code elimination drops
# them too): reading a reference, naming a vmap/shard_map axis, a mutable array's internals.
_DROPPABLE_EFFECTS = {"ReadEffect", "NamedAxisEffect", "InternalMutableArrayEffect"}
# Calls whose outputs are their inner jaxpr's outputs, one for one: the parameter naming it.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "shard_map": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def _live(jaxpr: Any, used: tuple[bool, ...]) -> tuple[list, list[bool]]:
    """The equations of `jaxpr` that its `used` outputs need (XLA drops the others too),
    each with which of its own outputs are used, and which inputs are used.

    A traced backward pass may compute a primal output it then discards (`jax.vjp` inside
    a custom backward loop, as fused accumulation's), which would otherwise count as work.
    Walks the equations backwards, keeping those with a used output or an effect; calls,
    scans and conds pass the question on to their bodies (JAX's own dead-code elimination,
    `pe.dce_jaxpr`, in the public API's terms)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    live = {v for v, u in zip(jaxpr.outvars, used, strict=True) if u and _is_var(v)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        outs = tuple(v in live for v in eqn.outvars)
        effects = {type(e).__name__ for e in eqn.effects} - _DROPPABLE_EFFECTS
        if not any(outs) and not effects:
            continue
        ins, _ = _inner_used(eqn, outs)
        live.update(v for v, u in zip(eqn.invars, ins, strict=True) if u and _is_var(v))
        kept.append((eqn, outs))
    kept.reverse()
    return kept, [v in live for v in jaxpr.invars]


def _is_var(v: Any) -> bool:
    return not isinstance(v, jex_core.Literal)


def _inner_used(eqn: Any, outs: tuple[bool, ...]) -> tuple[list[bool], tuple[bool, ...] | None]:
    """Which inputs of `eqn` its used outputs `outs` need, and which outputs of its body
    (a call's, a scan's or a cond's branches') are used: None where the body counts whole."""
    prim, params, n = eqn.primitive.name, eqn.params, len(eqn.invars)
    if prim in _CALLS and params.get(_CALLS[prim]) is not None:
        _, ins = _live(params[_CALLS[prim]], outs)
        if prim.startswith("custom_"):
            ins = [True] * n  # their derivative rules may read any input
        return ins, outs
    if prim == "scan":
        return _scan_used(eqn, outs)
    if prim == "cond":
        ins = [False] * (n - 1)
        for branch in params["branches"]:
            _, b = _live(branch, outs)
            ins = [x or y for x, y in zip(ins, b, strict=True)]
        return [True, *ins], outs
    return [True] * n, None


def _scan_used(eqn: Any, outs: tuple[bool, ...]) -> tuple[list[bool], tuple[bool, ...]]:
    """A scan's used inputs and body outputs: a carry is used if its next value is, until
    nothing changes."""
    consts, carry = eqn.params["num_consts"], eqn.params["num_carry"]
    used_carry, used_ys = list(outs[:carry]), list(outs[carry:])
    for _ in range(carry + 1):
        body_used = (*used_carry, *used_ys)
        _, ins = _live(eqn.params["jaxpr"], body_used)
        ins_carry = ins[consts : consts + carry]
        ins[consts : consts + carry] = used_carry  # the carry a used output reads is kept
        if all(c or not i for c, i in zip(used_carry, ins_carry, strict=True)):
            return ins, body_used
        used_carry = [c or i for c, i in zip(used_carry, ins_carry, strict=True)]
    raise AssertionError("a scan's carries reached no fixed point")  # pragma: no cover


def _jaxpr_cost(jaxpr: Any, used: tuple[bool, ...] | None = None) -> Cost:
    """The cost of the equations of `jaxpr` that its `used` outputs (all where None) need."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if used is None:
        used = (True,) * len(jaxpr.outvars)
    kept, _ = _live(jaxpr, used)
    total = Cost()
    zeros: set[Any] = set()  # variables known to be all zeros (instantiated zero gradients)
    for eqn, outs in kept:
        prim = eqn.primitive.name
        ins = [v for v in eqn.invars if _is_var(v)]
        if prim == "broadcast_in_dim" and _is_zero_literal(eqn.invars[0]):
            zeros.update(eqn.outvars)
        elif prim in ("convert_element_type", "mul") and any(v in zeros for v in ins):
            zeros.update(eqn.outvars)  # a cast or a multiple of zeros: still zeros, free
            continue
        elif prim == "add" and any(v in zeros for v in ins):
            continue  # x + 0: XLA drops it
        total = total + _eqn_cost(eqn, outs)
    return total


def _is_zero_literal(v: Any) -> bool:
    if not isinstance(v, jex_core.Literal):
        return False
    try:
        return bool(np.all(np.asarray(v.val) == 0))
    except (TypeError, ValueError):
        return False
