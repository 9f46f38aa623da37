"""2-D convolutions that XLA:CPU runs with its fast kernel wherever they sit in a program.

XLA:CPU has a fast convolution only for the "canonical" layout: input NHWC, kernel HWIO,
output NHWC, no window reversal. Its `ConvCanonicalization` pass rewrites other
convolutions into that layout, but only in the program's entry computation: a convolution in
a loop body (a `lax.scan` over micro-batches or over a `Stack`'s blocks) keeps its layout
and runs a generic loop nest instead. Measured on 2 cores for af5fa8a: a WRN-10-1 step with
10 micro-batches, 1.43 s with the convolutions in the scan, 0.20 s unrolled. JAX's own
backward pass of an NCHW convolution is never canonical (its input gradient reverses the
window and swaps the kernel's features; its weight gradient puts the batch on the feature
axis).

On CPU every convolution is therefore written canonical by hand: the forward pass and both
gradients transpose their operands to NHWC/HWIO, flip the kernel explicitly instead of
reversing the window, and express the weight gradient as a canonical convolution of the
input (channels on the batch axis) with the output gradient (the batch on the contracted
axis). The numbers are those of `jax.lax.conv_general_dilated` (the same sums, in another
order). Other backends need none of it (cuDNN picks its own layouts): there the same three
functions are XLA's own NCHW convolution and its transposes, as JAX's autodiff writes them.
The choice is made when the program is lowered (`jax.lax.platform_dependent`), so a program
lowered for a GPU carries no CPU layout, whatever machine traced it.
Inside a `jax.vmap` (the usual `jax.vmap(model)(batch)`) the layer runs once over the whole
batch with this backward pass; elsewhere it is `eqx.nn.Conv2d` itself.
"""

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._jvp import linear_tangent, rule_input
from ._trace import vmap_rule

# (window strides, explicit (low, high) padding per spatial axis, kernel dilation)
Conv = tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]
_NHWC = ("NHWC", "HWIO", "NHWC")


def explicit_padding(
    padding: Any, spatial: tuple[int, ...], kernel: tuple[int, ...], stride, dilation
) -> tuple[tuple[int, int], ...]:
    """`padding` as `((low, high), ...)`: a string ("SAME", "VALID", ...) resolved for these
    spatial sizes, an int or a sequence of ints or pairs as `eqx.nn.Conv` reads them."""
    if isinstance(padding, str):
        dilated = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation, strict=True))
        pads = jax.lax.padtype_to_pads(spatial, dilated, stride, padding)
        return tuple((int(lo), int(hi)) for lo, hi in pads)
    if isinstance(padding, int):
        return tuple((padding, padding) for _ in spatial)
    return tuple(
        (int(p), int(p)) if isinstance(p, int) else (int(p[0]), int(p[1])) for p in padding
    )


def _dilated(n: int, d: int) -> int:
    return 0 if n == 0 else 1 + d * (n - 1)


def conv_forward(x: Array, w: Array, conv: Conv) -> Array:
    """`x` `(n, c_in, *spatial)`, `w` `(c_out, c_in, *kernel)` -> `(n, c_out, *out)`:
    canonical on CPU, XLA's own convolution elsewhere."""
    return _per_platform(_canonical_forward, _xla_forward, x, w, conv=conv)


def _per_platform(canonical: Callable, xla: Callable, *args: Array, **static: Any) -> Array:
    """`canonical(*args, **static)` in a program lowered for the CPU, `xla(...)` in one
    lowered for any other backend: chosen at lowering, the other never compiled."""
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(canonical, **static),
        default=functools.partial(xla, **static),
    )  # fmt: skip


def _xla_forward(x: Array, w: Array, conv: Conv) -> Array:
    stride, padding, dilation = conv
    return jax.lax.conv_general_dilated(
        x, w, window_strides=stride, padding=padding, rhs_dilation=dilation
    )


def _canonical_forward(x: Array, w: Array, conv: Conv) -> Array:
    stride, padding, dilation = conv
    y = jax.lax.conv_general_dilated(
        jnp.moveaxis(x, 1, -1),  # (n, h, w, c_in)
        jnp.moveaxis(w, (0, 1), (-1, -2)),  # (kh, kw, c_in, c_out)
        window_strides=stride,
        padding=padding,
        rhs_dilation=dilation,
        dimension_numbers=_NHWC,
    )
    return jnp.moveaxis(y, -1, 1)


def conv_input_grad(g: Array, w: Array, in_spatial: tuple[int, ...], conv: Conv) -> Array:
    """The gradient with respect to the input of `conv_forward`, given its output
    gradient `g` `(n, c_out, *out)`: on CPU a canonical stride-1 convolution of `g`
    dilated by the stride with the spatially flipped kernel, input and output features
    swapped; elsewhere XLA's own transpose of the convolution."""
    return _per_platform(
        _canonical_input_grad, _xla_input_grad, g, w, in_spatial=in_spatial, conv=conv
    )


def _xla_input_grad(g: Array, w: Array, in_spatial: tuple[int, ...], conv: Conv) -> Array:
    x = jax.ShapeDtypeStruct((g.shape[0], w.shape[1], *in_spatial), g.dtype)
    (dx,) = jax.linear_transpose(lambda x: _xla_forward(x, w, conv), x)(g)
    return dx


def _canonical_input_grad(g: Array, w: Array, in_spatial: tuple[int, ...], conv: Conv) -> Array:
    stride, padding, dilation = conv
    pads = []
    for n, k, s, d, (lo, _), o in zip(
        in_spatial, w.shape[2:], stride, dilation, padding, g.shape[2:], strict=True
    ):
        before = _dilated(k, d) - lo - 1
        pads.append((before, n + _dilated(k, d) - 1 - _dilated(o, s) - before))
    kernel = jnp.flip(w, axis=tuple(range(2, w.ndim)))  # explicit flip, no window reversal
    dx = jax.lax.conv_general_dilated(
        jnp.moveaxis(g, 1, -1),  # (n, ho, wo, c_out)
        jnp.moveaxis(kernel, (0, 1), (-2, -1)),  # (kh, kw, c_out, c_in)
        window_strides=(1,) * len(stride),
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=_NHWC,
    )
    return jnp.moveaxis(dx, -1, 1)


# XLA:CPU's convolution slows down sharply when the contracted extent of the weight
# gradient (examples x output positions) is large: measured on 2 cores for 2cb45bb, a
# 32-channel 3x3 layer at 28x28 took 66-76 ms per 10 images at a batch of 100 against 8 at
# a batch of 10. Its weight gradient is therefore a sum over chunks of examples whose
# contracted extent stays under this many output positions (on CPU only).
_CPU_CONTRACTED = 8192


def conv_weight_grad(x: Array, g: Array, kernel: tuple[int, ...], conv: Conv) -> Array:
    """The gradient with respect to the kernel of `conv_forward`: `(c_out, c_in, *kernel)`.

    On CPU `dw[o, i, a, b] = sum_{n, y, z} x_pad[n, i, y * s + a * d, z * s + b * d]
    g[n, o, y, z]`, a canonical convolution whose batch is the input channels, whose
    contracted feature is the examples, and whose window is the output gradient (strides
    and dilation trade places), a large batch summed in chunks of examples
    (`_CPU_CONTRACTED`); elsewhere XLA's own transpose of the convolution."""
    return _per_platform(_canonical_weight_grad, _xla_weight_grad, x, g, kernel=kernel, conv=conv)


def _xla_weight_grad(x: Array, g: Array, kernel: tuple[int, ...], conv: Conv) -> Array:
    w = jax.ShapeDtypeStruct((g.shape[1], x.shape[1], *kernel), x.dtype)
    (dw,) = jax.linear_transpose(lambda w: _xla_forward(x, w, conv), w)(g)
    return dw


def _canonical_weight_grad(x: Array, g: Array, kernel: tuple[int, ...], conv: Conv) -> Array:
    stride, padding, dilation = conv
    pads = []
    for n, k, s, d, (lo, _), o in zip(
        x.shape[2:], kernel, stride, dilation, padding, g.shape[2:], strict=True
    ):
        pads.append((lo, _dilated(o, s) - n + _dilated(k, d) - lo - 1))

    def one(x: Array, g: Array) -> Array:
        dw = jax.lax.conv_general_dilated(
            jnp.moveaxis(x, 0, -1),  # (c_in, h, w, n)
            jnp.moveaxis(g, (0, 1), (-2, -1)),  # (ho, wo, n, c_out)
            window_strides=dilation,
            padding=pads,
            rhs_dilation=stride,
            dimension_numbers=_NHWC,
        )  # (c_in, kh, kw, c_out)
        return jnp.moveaxis(dw, (0, -1), (1, 0))

    n = x.shape[0]
    chunk = max(1, _CPU_CONTRACTED // max(1, math.prod(g.shape[2:])))
    parts = [one(x[i : i + chunk], g[i : i + chunk]) for i in range(0, n, chunk)]
    return functools.reduce(operator.add, parts)


@functools.cache
def batch_conv(conv: Conv) -> Callable[[Array, Array], Array]:
    """`f(w, x)`: `conv_forward` over a batch with the canonical backward pass above.

    A `jax.custom_jvp` whose tangent is written as the transposes of the two gradients
    (`jax.linear_transpose` of `conv_input_grad` and `conv_weight_grad`): reverse mode
    transposes them back into exactly those gradients' convolutions, and forward mode
    (`jax.jvp`) computes the tangent with the same canonical convolutions. A symbolically
    zero tangent (an input or a kernel nobody differentiates) is left out: its gradient is
    never computed.
    """

    @jax.custom_jvp
    def f(w, x):
        return conv_forward(x, w, conv)

    @functools.partial(f.defjvp, symbolic_zeros=True)
    def f_jvp(primals, tangents):
        w, x = primals
        y = f(w, x)
        rule = functools.partial(_tangent, conv)
        return y, linear_tangent(rule, (w, rule_input(x)), tangents, y)

    return f


def _tangent(conv: Conv, primals: tuple[Array, Array], tangents: list) -> Array:
    """The output's tangent: the transposes of the input and weight gradients (each left
    out where its tangent is a symbolic zero, None here)."""
    w, x = primals
    dw, dx = tangents
    g = jax.ShapeDtypeStruct((x.shape[0], w.shape[0], *_out_spatial(x, w, conv)), x.dtype)
    t = []
    if dx is not None:
        input_grad = functools.partial(conv_input_grad, w=w, in_spatial=x.shape[2:], conv=conv)
        t.append(jax.linear_transpose(lambda g: input_grad(g).astype(x.dtype), g)(dx)[0])
    if dw is not None:
        weight_grad = functools.partial(conv_weight_grad, x, kernel=w.shape[2:], conv=conv)
        t.append(jax.linear_transpose(lambda g: weight_grad(g).astype(w.dtype), g)(dw)[0])
    return functools.reduce(operator.add, t)


def _out_spatial(x: Array, w: Array, conv: Conv) -> tuple[int, ...]:
    return jax.eval_shape(lambda x, w: conv_forward(x, w, conv), x, w).shape[2:]


@functools.cache
def _batch_rule(conv: Conv) -> Callable:
    """`jax.vmap` of one example's convolution: one `batch_conv` call over the batch."""

    def rule(axis_size, in_batched, w, x):
        w_batched, x_batched = in_batched
        if w_batched:  # batched kernels (an ensemble): JAX's own convolution per example
            one = functools.partial(_plain, conv)
            return jax.vmap(one, in_axes=(0, 0 if x_batched else None))(w, x), True
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        return batch_conv(conv)(w, x), True

    return rule


def _plain(conv: Conv, w: Array, x: Array) -> Array:
    stride, padding, dilation = conv
    return jax.lax.conv_general_dilated(
        x[None], w, window_strides=stride, padding=padding, rhs_dilation=dilation
    )[0]


def _fast(layer: Any) -> bool:
    return (
        type(layer) is eqx.nn.Conv2d
        and layer.groups == 1
        and layer.padding_mode == "ZEROS"
        and isinstance(layer.weight, jax.Array)  # tracers included
    )


def conv2d(layer: Any, x: Array) -> Array:
    """`layer(x)` for one example `x` `(c_in, h, w)`: an `eqx.nn.Conv2d` (ungrouped, zero
    padding) under `jax.vmap` runs as one canonical batched convolution (see the module),
    the vmap's own rule (`eqx_lowmem.nn._trace.vmap_rule`); without a vmap, or where
    differentiation comes first (`vmap(grad(f))`), it is the layer's own convolution. Any
    other layer calls `layer(x)`. Same numbers either way."""
    if not _fast(layer):
        return layer(x)
    conv = (
        tuple(layer.stride),
        explicit_padding(layer.padding, x.shape[1:], layer.kernel_size, layer.stride,
                         layer.dilation),
        tuple(layer.dilation),
    )  # fmt: skip
    y = vmap_rule(functools.partial(_plain, conv), _batch_rule(conv), layer.weight, x)
    if layer.use_bias:
        y = y + layer.bias
    return y
