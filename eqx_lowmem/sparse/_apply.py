"""A sparse layer's dense operation, forward and backward, on one example or a batch.

The forward pass rebuilds the dense weight (a scatter of the values into zeros, empty slots dropped)
inside a `jax.checkpoint` region together with the matmul or convolution that uses it: the
backward pass keeps only the values, indices and input, rebuilds the dense weight once more,
and gathers the dense weight gradient at the indices. The dense weight and its dense gradient
are temporaries of one layer at a time, never residuals kept for the whole network.
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..nn._conv import (
    Conv,
    conv_forward,
    conv_input_grad,
    conv_weight_grad,
    explicit_padding,
)
from ..nn._jvp import is_zero
from ..nn._trace import vmap_rule
from ._storage import _gather, _scatter, is_bitset

# The dense operation of a layer over a batch `(n, *example)`, from its static description:
# ("linear",) or ("conv", stride, padding, dilation, groups).


def _batched_op(op: tuple, weight: Array, x: Array) -> Array:
    if op[0] == "linear":
        return x @ weight.T
    _, stride, padding, dilation, groups = op
    if groups == 1:  # the layout XLA:CPU runs fast in loops too (eqx_lowmem.nn._conv)
        return conv_forward(x, weight, _canonical(op, weight, x))
    return jax.lax.conv_general_dilated(
        lhs=x,
        rhs=weight,
        window_strides=stride,
        padding=padding,
        rhs_dilation=dilation,
        feature_group_count=groups,
    )


def _canonical(op: tuple, weight: Array | jax.ShapeDtypeStruct, x: Array) -> Conv:
    """A convolution op's (stride, explicit padding, dilation) for a batch `x`."""
    _, stride, padding, dilation, _ = op
    pads = explicit_padding(padding, x.shape[2:], weight.shape[2:], stride, dilation)
    return tuple(stride), pads, tuple(dilation)


@functools.partial(jax.checkpoint, static_argnums=(0, 1))
def _one(op: tuple, shape: tuple[int, ...], values: Array, indices: Array, x: Array) -> Array:
    """One example, checkpointed: the dense weight is rebuilt in the backward pass, not
    saved. Autodiff batches this well where a batch axis is added later (a `lax.scan` body
    that is then vmapped), as one matmul for the weight gradient."""
    return _batched_op(op, _scatter(values, _late(indices, x), shape), x[None])[0]


def _after(x: Array, dep: Array) -> Array:
    """`x`, computed only once `dep` exists: `x + 0 * dep[0]`.

    A data dependency that XLA cannot see through (`0 * d` is NaN for a non-finite `d`),
    unlike `jax.lax.optimization_barrier`, which XLA:CPU removes before merging equal
    computations. Used to rebuild one layer's dense weight at the moment it is needed and
    not before, and to stop XLA from merging the backward pass's rebuild with the forward's
    (which would keep every layer's dense weight alive until the backward pass). A
    non-finite `dep` makes the result non-finite: only where the true gradient is already
    non-finite, so the step's finiteness check (`finite`) is unchanged.
    """
    first = dep.reshape(-1)[0]
    if not jnp.issubdtype(first.dtype, jnp.floating):
        first = first.astype(jnp.float32)  # integer x * 0 would be folded away
    return x + (first * 0).astype(x.dtype)


def _late(indices: Array, dep: Array) -> Array:
    """A bit set whose positions are derived only once `dep` exists (`_after`): derived
    from the parameters alone, XLA would hoist the derivation out of the step's
    micro-batch loop and keep every layer's int32 positions alive through it. Indices
    pass unchanged."""
    return _after(indices, dep) if is_bitset(indices) else indices


@functools.cache
def _batch_vjp(op: tuple, shape: tuple[int, ...]) -> Callable:
    """The layer over a batch `(n, *example)` with a hand-written backward pass that
    rebuilds the dense weight after the output gradient arrives and frees it before the
    dense weight gradient is built: one dense matrix alive at a time, per layer."""
    size = math.prod(shape)

    def forward(values, indices, x):
        base = _after(jnp.zeros((size,), values.dtype), x)
        return _batched_op(op, _scatter(values, _late(indices, x), shape, base), x)

    @jax.custom_vjp
    def f(values, indices, x):
        return forward(values, indices, x)

    def fwd(values, indices, x):
        # symbolic_zeros: each primal comes with whether it is differentiated. An input
        # nobody differentiates (the data into the first layer) gets no gradient: the
        # residuals' structure says so (None), and the backward pass skips that product.
        values, indices, wants_x = values.value, indices.value, x.perturbed
        x = x.value
        out = forward(values, indices, x)
        return out, (values, indices, x, () if wants_x else None)

    def bwd(res, grad):
        values, indices, x, wants_x = res
        if is_zero(grad):  # the output unused: no gradient at all
            return jnp.zeros_like(values), None, None if wants_x is None else jnp.zeros_like(x)
        indices = _late(indices, grad)  # a bit set: walked again, after the gradient
        grad_x, after = None, grad
        if wants_x is not None:
            grad_x = _input_grad(values, indices, x, grad)
            after = grad_x  # the dense weight is dead once grad_x exists
        grad_weight = _weight_grad(x, grad, after, values.dtype)
        grad_values = _gather(grad_weight.reshape(-1), indices, values.shape[-1])
        return grad_values.astype(values.dtype), None, grad_x

    def _input_grad(values, indices, x, grad):
        weight = _scatter(values, indices, shape, _after(jnp.zeros((size,), values.dtype), grad))
        if op[0] == "conv" and op[4] == 1:  # canonical on XLA:CPU (eqx_lowmem.nn._conv)
            conv = _canonical(op, weight, x)
            return conv_input_grad(grad, weight, x.shape[2:], conv).astype(x.dtype)
        _, vjp_x = jax.vjp(lambda x: _batched_op(op, weight, x), x)
        return vjp_x(grad)[0]

    def _weight_grad(x, grad, after, dtype):
        # Built after `after` (the input gradient, when there is one).
        x_late = _after(x, after)
        if op[0] == "conv" and op[4] == 1:
            conv = _canonical(op, jax.ShapeDtypeStruct(shape, dtype), x)
            return conv_weight_grad(x_late, grad, shape[2:], conv)
        zeros = jnp.zeros(shape, dtype)
        _, vjp_w = jax.vjp(lambda w: _batched_op(op, w, x_late), zeros)
        return vjp_w(grad)[0]

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


@functools.cache
def _batch_rule(op: tuple, shape: tuple[int, ...], rank: int) -> Callable:
    """`jax.vmap` of the layer on inputs with any leading axes `(*lead, *example)` (`rank`
    = the example's rank): the new axis folded into the batch of one matmul/convolution
    instead of a vmapped backward pass (which would build one dense weight gradient per
    example)."""

    def rule(axis_size, in_batched, values, indices, x):
        values_b, indices_b, x_b = in_batched
        if values_b or indices_b:
            # Batched weights (an ensemble, a vmapped stack): plain per-example layers.
            one = functools.partial(_leading_one, op, shape, rank)
            axes = tuple(0 if b else None for b in in_batched)
            return jax.vmap(one, in_axes=axes)(values, indices, x), True
        if not x_b:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        return _dispatch(op, shape, rank, values, indices, x), True

    return rule


def _leading_one(op, shape, rank, values, indices, x):
    lead = x.shape[: x.ndim - rank]
    flat = x.reshape(-1, *x.shape[x.ndim - rank :])
    out = jax.vmap(lambda e: _one(op, shape, values, indices, e))(flat)
    return out.reshape(*lead, *out.shape[1:])


def _dispatch(op, shape, rank, values, indices, x):
    """`x` with leading axes: one batched call of `_batch_vjp` (a further `vmap` folds its
    axis in too, `_batch_rule`)."""
    plain = functools.partial(_leading, op, shape, rank)
    return vmap_rule(plain, _batch_rule(op, shape, rank), values, indices, x)


def _leading(op, shape, rank, values, indices, x):
    lead = x.shape[: x.ndim - rank]
    flat = x.reshape(-1, *x.shape[x.ndim - rank :])
    out = _batch_vjp(op, shape)(values, indices, flat)
    return out.reshape(*lead, *out.shape[1:])


def _apply(op: tuple, shape: tuple[int, ...], values: Array, indices: Array, x: Array) -> Array:
    """The layer on one example `x`.

    Under `jax.vmap` (the usual `jax.vmap(model)(batch)`) one batched matmul/convolution
    with a hand-written backward pass runs for the whole batch: the dense weight is rebuilt
    once in the forward and once in the backward pass, after the output gradient arrives,
    and the weight gradient is one matmul gathered at the indices. Elsewhere (no vmap,
    `vmap` of `grad`) the checkpointed per-example form (`eqx_lowmem.nn._trace`)."""
    plain = functools.partial(_one, op, shape)
    return vmap_rule(plain, _batch_rule(op, shape, x.ndim), values, indices, x)
