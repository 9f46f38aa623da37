"""The arithmetic a traced program asks for, with every loop counted as many times as it runs.

XLA's `compiled.cost_analysis()` counts the body of a `while` loop once, and a training step
is mostly loops: the micro-batches of `make_step(accumulate=k)` and the layers of
`transformer_encoder` are both `lax.scan`s. Its FLOPs for the guide's transformer are a
twelfth of the real figure. This module counts on the jaxpr instead, where every scan
states its length: the count includes the forward, the backward and every recomputation
that `remat` adds, as the program asks for them (before XLA fuses or simplifies anything).
"""

from typing import Any, NamedTuple

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
    """

    flops: float = 0.0
    matmul_flops: float = 0.0
    transcendentals: float = 0.0
    unknown_loops: int = 0

    def __add__(self, other: "Cost") -> "Cost":  # type: ignore[override]
        return Cost(
            self.flops + other.flops,
            self.matmul_flops + other.matmul_flops,
            self.transcendentals + other.transcendentals,
            self.unknown_loops + other.unknown_loops,
        )

    def scale(self, n: "int | float") -> "Cost":
        flops, matmul, transcendentals, unknown = self
        return Cost(flops * n, matmul * n, transcendentals * n, unknown)


def _size(aval: Any) -> float:
    shape = getattr(aval, "shape", ())
    return float(np.prod(shape)) if shape else 1.0


def _eqn_cost(eqn) -> Cost:
    prim = eqn.primitive.name
    params = eqn.params
    if prim == "scan":
        return jaxpr_cost(params["jaxpr"]).scale(int(params["length"]))
    if prim == "while":
        body = jaxpr_cost(params["body_jaxpr"]) + jaxpr_cost(params["cond_jaxpr"])
        return body + Cost(unknown_loops=1)
    if prim == "cond":
        branches = [jaxpr_cost(b) for b in params["branches"]]
        return max(branches, key=lambda c: c.flops)
    inner = list(jex_core.jaxprs_in_params(params))
    if inner:
        # Calls, checkpoints, custom derivatives, shard_map: the cost of what they run.
        total = Cost()
        for sub in inner:
            total = total + jaxpr_cost(sub)
        return total
    if prim == "dot_general":
        (contract, _), _ = params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        k = float(np.prod([lhs.shape[d] for d in contract])) if contract else 1.0
        flops = 2.0 * _size(eqn.outvars[0].aval) * k
        return Cost(flops, flops)
    if prim == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_features = rhs.shape[params["dimension_numbers"].rhs_spec[0]]
        flops = 2.0 * _size(eqn.outvars[0].aval) * _size(rhs) / out_features
        return Cost(flops, flops)
    if prim in _FREE:
        return Cost()
    if prim in _REDUCTIONS:
        return Cost(sum(_size(v.aval) for v in eqn.invars))
    out = sum(_size(v.aval) for v in eqn.outvars)
    return Cost(out, 0.0, out if prim in _TRANSCENDENTAL else 0.0)


def jaxpr_cost(jaxpr: Any) -> Cost:
    """The `Cost` of a (closed) jaxpr, scans multiplied by their length.

    Args:
        jaxpr: a `Jaxpr` or `ClosedJaxpr`, e.g. `jax.make_jaxpr(f)(*args)` or the `.jaxpr`
            of `jax.jit(f).trace(*args)`.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = Cost()
    for eqn in jaxpr.eqns:
        total = total + _eqn_cost(eqn)
    return total
