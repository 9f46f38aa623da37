"""What the backward pass of one micro-batch keeps, as the step computes it, grouped by the
module and checkpoint name that made it."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..precision._policy import Policy
from ..train._loss import call_loss
from ._residuals import Residual, saved_residuals
from ._result import ActivationGroup

# Values XLA does not store for the backward pass: it fuses them into their consumers.
_NOT_STORED = {"intermediate broadcast_in_dim", "intermediate iota"}
# What an unnamed residual is, in words, by the operation that computed it.
_WORDS = {
    "max": "ReLU or max",
    "min": "min",
    "gt": "comparison mask",
    "ge": "comparison mask",
    "lt": "comparison mask",
    "le": "comparison mask",
    "eq": "comparison mask",
    "ne": "comparison mask",
    "select_n": "where / select",
    "exp": "exponential (softmax, sigmoid)",
    "exp2": "exponential",
    "log": "logarithm",
    "log1p": "logarithm",
    "logistic": "sigmoid",
    "tanh": "tanh",
    "erf": "GELU (erf)",
    "rsqrt": "normalisation scale",
    "sqrt": "square root",
    "div": "quotient",
    "mul": "product",
    "add": "sum",
    "add_any": "sum",
    "sub": "difference",
    "neg": "negation",
    "integer_pow": "power",
    "pow": "power",
    "dot_general": "matmul output",
    "conv_general_dilated": "convolution output",
    "reduce_sum": "sum over an axis",
    "reduce_max": "max over an axis",
    "cumsum": "cumulative sum",
    "dynamic_slice": "slice",
    "slice": "slice",
    "gather": "gathered values",
    "scatter": "scattered values",
    "scatter-add": "scattered values",
    "concatenate": "concatenation",
    "pad": "padded values",
    "sort": "sorted values",
    "argmax": "argmax",
    # An input of a loop or call body kept as it is: for a scan over layers, each layer's
    # input (what full recomputation keeps).
    "scan": "layer input",
    "remat2": "checkpointed input",
    "checkpoint": "checkpointed input",
    "remat": "checkpointed input",
    "pjit": "input of a jitted function",
    "jit": "input of a jitted function",
}


def micro_residuals(
    loss_fn: Callable[..., Any],
    policy: Policy,
    model: Any,
    batch: tuple,
    *,
    granularity: int,
    model_state: Any = None,
    key: Any = None,
) -> tuple[list[Residual], dict[str, Any]]:
    """What the backward pass of one micro-batch's loss keeps, and the dtypes of its inputs.

    The loss is called as the step calls it (`eqx_lowmem.train._loss.call_loss`: the
    policy's cast, the state, the key, per-sample weights) on a micro-batch of
    `batch_size // granularity` samples, differentiated with respect to the model's floating
    leaves only (the batch, the weights and the state are held fixed).

    Returns:
        The residuals, and `{"argument <path>": dtype}` for every input, to tell a cast copy
        of a parameter (a new buffer) from a view of it.
    """
    micro = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((s.shape[0] // granularity, *s.shape[1:]), s.dtype), batch
    )
    n = jax.tree.leaves(micro)[0].shape[0]
    weights = jax.ShapeDtypeStruct((n,), jnp.float32)

    def loss(model, batch, weights, model_state):
        # The step differentiates with respect to the model's floating leaves only;
        # saved_residuals traces its integer leaves (sparse indices) given as shapes.
        batch, weights, model_state = jax.lax.stop_gradient((batch, weights, model_state))
        out = call_loss(
            loss_fn, model, batch, weights, model_state=model_state, key=key, policy=policy
        )
        return jnp.sum(out.values * out.weights)

    args = (model, micro, weights, model_state)
    paths, _ = jax.tree_util.tree_flatten_with_path((args, {}))
    dtypes = {
        "argument args" + jax.tree_util.keystr(tuple(p[1:])): np.dtype(leaf.dtype)
        for p, leaf in paths
        if hasattr(leaf, "dtype")
    }
    return saved_residuals(loss, *args), dtypes


def _label(r: Residual, dtypes: dict[str, Any]) -> str | None:
    """The group label of a residual; None for one that is not a new buffer."""
    if r.source in _NOT_STORED:
        return None
    if r.source.startswith("argument"):
        original = dtypes.get(r.source.removesuffix(" (transformed)"))
        if not r.source.endswith("(transformed)") or original == r.dtype:
            return None  # the input itself, or a view of it: counted in its own part
        if r.source.startswith("argument args[0]"):
            return "parameters, compute dtype"
        return "batch, compute dtype"
    if r.name is not None:
        return r.name
    if r.source == "constant":
        return "unnamed constant"
    prim = r.source.split(" ", 1)[1]
    return f"unnamed {_WORDS.get(prim, 'intermediate')}"


def group_residuals(
    residuals: list[Residual], dtypes: dict[str, Any]
) -> tuple[ActivationGroup, ...]:
    """Residuals that are new buffers, grouped by label, module scope, loops and dtype;
    largest first. Inputs, views of inputs and broadcast constants are left out."""
    groups: dict[tuple, list[Residual]] = {}
    for r in residuals:
        label = _label(r, dtypes)
        if label is None:
            continue
        key = (label, r.name, r.scope, r.loops, str(r.dtype))
        groups.setdefault(key, []).append(r)
    out = [
        ActivationGroup(
            label, name, scope, loops, dtype, len(rs), sum(r.nbytes for r in rs), rs[0].shape
        )
        for (label, name, scope, loops, dtype), rs in groups.items()
    ]
    return tuple(sorted(out, key=lambda g: -g.nbytes))


def fused_slots(
    step: Any, model: Any, batch: tuple, *, model_state: Any = None, key: Any = None
) -> frozenset[int]:
    """The positions, among the model's floating leaves, whose micro-batch gradient the
    step's stacks fold straight into the accumulator (`make_step(fuse_accumulation=True)`,
    `eqx_lowmem.nn._fuse`): found by tracing one micro-batch's gradient function (shapes
    only, nothing compiled)."""
    from ..train._accumulate import FuseRequest, loss_grad

    c = step.config
    if step.accumulate <= 1 or not c.fuse_accumulation:
        return frozenset()
    micro = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((s.shape[0] // step.granularity, *s.shape[1:]), s.dtype),
        batch,
    )
    n = jax.tree.leaves(micro)[0].shape[0]
    weights = jax.ShapeDtypeStruct((n,), jnp.float32)
    arrays, skeleton = eqx.partition(model, lambda x: hasattr(x, "dtype"))
    found: dict[str, frozenset[int]] = {}

    def trace(arrays, micro, weights, model_state):
        params, static = eqx.partition(eqx.combine(arrays, skeleton), eqx.is_inexact_array)
        fn = loss_grad(step.loss_fn, static, step.policy, dtype=step.accumulate_dtype)
        acc = jax.tree.map(lambda p: jnp.zeros(p.shape, step.accumulate_dtype), params)
        request = FuseRequest(acc, 1.0 / step.accumulate)
        out = fn(params, model_state, micro, weights, key, jnp.float32(1), fuse=request)
        found["slots"] = request.fused
        return out.total

    jax.eval_shape(trace, arrays, micro, weights, model_state)
    return found["slots"]
