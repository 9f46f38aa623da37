"""Sparse layers whose parameters are the non-zero weights only.

A sparse layer stores a fixed number of slots (its `capacity`): `values[i]` is the weight at
flat position `indices[i]` of the dense weight (row-major over the dense layer's weight
shape). A slot whose index is the out-of-range position `size` (the dense weight's element
count) is empty: it is dropped when the dense weight is rebuilt, so its value gets a zero
gradient and, with a zero optimizer state, stays zero. Shapes never change, so rewiring under
`jax.jit` never recompiles.

The forward pass rebuilds the dense weight (`zeros.at[indices].set(values, mode="drop")`)
inside a `jax.checkpoint` region together with the matmul or convolution that uses it: the
backward pass keeps only the values, indices and input, rebuilds the dense weight once more,
and gathers the dense weight gradient at the indices. The dense weight and its dense gradient
are temporaries of one layer at a time, never residuals kept for the whole network.
"""

import functools
import math
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

_INDEX_DTYPES = (jnp.int8, jnp.int16, jnp.int32)


def index_dtype(size: int) -> Any:
    """The narrowest signed integer dtype holding every position `0..size` of a dense
    weight of `size` elements (`size` itself marks an empty slot).

    Memory: 1, 2 or 4 bytes per slot. int8 fits layers of up to 127 weights, int16 up to
    32,767 (a 181x181 matrix, or a 3x3 convolution of 60 to 60 channels), int32 the rest.

    Raises:
        ValueError: for a layer of 2**31 or more weights (JAX without x64 has no int64).

    Example:
        >>> index_dtype(1024 * 1024)
        dtype('int32')
        >>> index_dtype(3 * 3 * 16 * 16)
        dtype('int16')
    """
    for dtype in _INDEX_DTYPES:
        if size <= jnp.iinfo(dtype).max:
            return jnp.dtype(dtype)
    raise ValueError(
        f"a sparse layer of {size} weights needs 64-bit indices, which JAX without x64 "
        "lacks; split the layer, or keep it dense (sparsify(..., exclude=...))."
    )


def _scatter(values: Array, indices: Array, shape: tuple[int, ...]) -> Array:
    """The dense weight of one layer: zeros with `values` at the flat `indices` (empty
    slots, at index `size`, dropped)."""
    size = math.prod(shape)
    flat = jnp.zeros((size,), values.dtype)
    flat = flat.at[indices.astype(jnp.int32)].set(values, mode="drop")
    return flat.reshape(shape)


def _dense_of(values: Array, indices: Array, shape: tuple[int, ...]) -> Array:
    """`_scatter` over any leading (stacked-layer) axes."""
    fn = functools.partial(_scatter, shape=shape)
    for _ in range(values.ndim - 1):
        fn = jax.vmap(fn)
    return fn(values, indices)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _matvec(values: Array, indices: Array, x: Array, shape: tuple[int, int]) -> Array:
    # Checkpointed: the dense (out, in) weight is rebuilt in the backward pass, not saved.
    return _scatter(values, indices, shape) @ x


@functools.partial(jax.checkpoint, static_argnums=(3, 4, 5, 6, 7))
def _conv(
    values: Array,
    indices: Array,
    x: Array,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    padding: Any,
    dilation: tuple[int, ...],
    groups: int,
) -> Array:
    # Checkpointed like _matvec: one dense kernel alive at a time.
    weight = _scatter(values, indices, shape)
    out = jax.lax.conv_general_dilated(
        lhs=x[None],
        rhs=weight,
        window_strides=stride,
        padding=padding,
        rhs_dilation=dilation,
        feature_group_count=groups,
    )
    return out[0]


def _check_slots(layer: Any) -> None:
    values, indices = layer.values, layer.indices
    if not isinstance(values, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return  # a filtered or partitioned copy (None, or an object sentinel)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(f"{type(layer).__name__}.values must be floating, got {values.dtype}.")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{type(layer).__name__}.indices must be integers, got {indices.dtype}.")
    if values.shape != indices.shape or values.ndim < 1:
        raise ValueError(
            f"{type(layer).__name__}: values {values.shape} and indices {indices.shape} must "
            "have the same shape (..., capacity)."
        )


class _Sparse(eqx.Module):
    """What every sparse layer has: values, indices and DSR's threshold exponent."""

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The shape of one dense weight (without stacked-layer axes)."""
        raise NotImplementedError

    @property
    def size(self) -> int:
        """The element count of one dense weight; also the index of an empty slot."""
        return math.prod(self.weight_shape)

    @property
    def capacity(self) -> int:
        """Slots per layer: the most non-zeros the layer can hold."""
        return int(self.values.shape[-1])  # pyright: ignore[reportAttributeAccessIssue]

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading axes of stacked layers (`()` for one layer)."""
        return tuple(self.values.shape[:-1])  # pyright: ignore[reportAttributeAccessIssue]

    @property
    def weight(self) -> Array:
        """The dense weight (stacked axes first), rebuilt from the slots.

        A dense temporary of the full weight's size: `__call__` does not use it (its own
        rebuild is freed after the layer); this is for code that reads `.weight` directly.
        """
        return _dense_of(self.values, self.indices, self.weight_shape)  # pyright: ignore

    def nnz(self) -> Array:
        """The count of occupied slots, per layer (shape `stack_shape`)."""
        return jnp.sum(self.indices < self.size, axis=-1)  # pyright: ignore

    def _check_one(self) -> None:
        if self.stack_shape:
            raise ValueError(
                f"this {type(self).__name__} holds {self.stack_shape} stacked layers; call "
                "one layer (slice the arrays, or jax.vmap / lax.scan over the stack)."
            )


class SparseLinear(_Sparse):
    """`eqx.nn.Linear` with only `capacity` weights stored: `values[i]` at flat position
    `indices[i]` of the `(out_features, in_features)` weight.

    Build one with `SparseLinear.from_dense(linear, density, key=key)` or
    `eqx_lowmem.sparse.sparsify(model, density, key=key)`. Trainable leaves: `values` and
    `bias`; `indices` and `threshold_exp` are integers (not touched by optimizers; rewiring
    hooks change them).

    Memory per slot: the value (4 or 2 bytes), the optimizer's state for it (Adam: 8 bytes in
    float32) and the index (1, 2 or 4 bytes, `index_dtype`), against 12 bytes per dense
    weight with Adam. Time: one scatter of the values per forward and one more in the
    backward pass (cheap next to the matmul), and one gather of the weight gradient.

    Attributes:
        values: `(..., capacity)` weights; empty slots hold 0.
        indices: `(..., capacity)` flat positions; an empty slot holds `size`.
        bias: `(..., out_features)` dense bias, or None.
        threshold_exp: `(...)` int32, DSR's pruning threshold as `initial * 2**threshold_exp`
            (Mostafa and Wang double or halve it); 4 bytes a layer, unused by SET and RigL.
        in_features, out_features, use_bias: as `eqx.nn.Linear`.
    """

    values: Array
    indices: Array
    bias: Array | None
    threshold_exp: Array
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    def __check_init__(self):
        _check_slots(self)

    @property
    def weight_shape(self) -> tuple[int, int]:
        n_in = 1 if self.in_features == "scalar" else self.in_features
        n_out = 1 if self.out_features == "scalar" else self.out_features
        return (n_out, n_in)

    @classmethod
    def from_dense(
        cls,
        linear: eqx.nn.Linear,
        density: float,
        *,
        key: PRNGKeyArray,
        capacity: int | None = None,
    ) -> "SparseLinear":
        """Keep `round(density * size)` weights of `linear` at random positions.

        Args:
            linear: the dense layer (its weight may have leading stacked-layer axes).
            density: fraction of weights kept, in (0, 1].
            key: picks the positions (each stacked layer its own).
            capacity: slots per layer, at least the count kept (default: that count);
                extra slots start empty, for rewiring that moves weights between layers.

        Raises:
            ValueError: for a density outside (0, 1] or a capacity below the count kept.

        Example:
            >>> import equinox as eqx, jax.random as jr
            >>> dense = eqx.nn.Linear(8, 4, key=jr.PRNGKey(0))
            >>> sparse = SparseLinear.from_dense(dense, 0.5, key=jr.PRNGKey(1))
            >>> sparse.capacity, int(sparse.nnz())
            (16, 16)
        """
        from ._convert import from_dense  # the one conversion, shared with sparsify

        return from_dense(linear, density, key=key, capacity=capacity)

    @jax.named_scope("eqx_lowmem.sparse.SparseLinear")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """Apply the layer to one example, `(in_features,)` (or `()` for `"scalar"`);
        `jax.vmap` over a batch. Equals `eqx.nn.Linear` with the dense weight."""
        del key
        self._check_one()
        if self.in_features == "scalar":
            if jnp.shape(x) != ():
                raise ValueError(f"x must have scalar shape, got {jnp.shape(x)}.")
            x = jnp.broadcast_to(x, (1,))
        elif x.shape != (self.in_features,):
            raise ValueError(
                f"SparseLinear expects one example of shape ({self.in_features},), got "
                f"{x.shape}; jax.vmap over the batch."
            )
        y = _matvec(self.values, self.indices, x, self.weight_shape)
        if self.bias is not None:
            y = y + self.bias
        if self.out_features == "scalar":
            y = jnp.squeeze(y)
        return y


def _pad_nonzero(x: Array, layer: "SparseConv2d") -> tuple[Array, Any]:
    """`eqx.nn.Conv`'s padding modes other than zeros: pad by hand, then convolve VALID."""
    if layer.padding_mode == "ZEROS":
        return x, layer.padding
    if isinstance(layer.padding, str):
        rhs = tuple(d * (k - 1) + 1 for k, d in zip(layer.kernel_size, layer.dilation, strict=True))
        pads = jax.lax.padtype_to_pads(x.shape[1:], rhs, layer.stride, layer.padding)
    else:
        pads = list(layer.padding)
    mode = {"REFLECT": "reflect", "REPLICATE": "edge", "CIRCULAR": "wrap"}[layer.padding_mode]
    return jnp.pad(x, [(0, 0), *pads], mode=mode), "VALID"


class SparseConv2d(_Sparse):
    """`eqx.nn.Conv2d` with only `capacity` kernel weights stored: `values[i]` at flat
    position `indices[i]` of the `(out_channels, in_channels // groups, kh, kw)` kernel.

    Build one with `SparseConv2d.from_dense(conv, density, key=key)` or
    `eqx_lowmem.sparse.sparsify`. Memory and time as `SparseLinear`: the dense kernel is
    rebuilt inside the layer's checkpointed region, once in the forward and once in the
    backward pass.

    Attributes:
        values, indices, threshold_exp: as `SparseLinear`.
        bias: `(..., out_channels, 1, 1)` dense bias, or None.
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
        use_bias, padding_mode: as `eqx.nn.Conv2d`.
    """

    values: Array
    indices: Array
    bias: Array | None
    threshold_exp: Array
    in_channels: int = eqx.field(static=True)
    out_channels: int = eqx.field(static=True)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: Any = eqx.field(static=True)
    dilation: tuple[int, ...] = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    padding_mode: str = eqx.field(static=True)
    num_spatial_dims: int = eqx.field(static=True, default=2)

    def __check_init__(self):
        _check_slots(self)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.out_channels, self.in_channels // self.groups, *self.kernel_size)

    @classmethod
    def from_dense(
        cls,
        conv: eqx.nn.Conv2d,
        density: float,
        *,
        key: PRNGKeyArray,
        capacity: int | None = None,
    ) -> "SparseConv2d":
        """Keep `round(density * size)` kernel weights of `conv` at random positions
        (arguments as `SparseLinear.from_dense`).

        Example:
            >>> import equinox as eqx, jax.random as jr
            >>> dense = eqx.nn.Conv2d(4, 8, 3, padding=1, key=jr.PRNGKey(0))
            >>> sparse = SparseConv2d.from_dense(dense, 0.25, key=jr.PRNGKey(1))
            >>> sparse.size, sparse.capacity
            (288, 72)
        """
        from ._convert import from_dense

        return from_dense(conv, density, key=key, capacity=capacity)

    @jax.named_scope("eqx_lowmem.sparse.SparseConv2d")
    def __call__(
        self, x: Float[Array, "channels height width"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "out_channels new_height new_width"]:
        """Apply the layer to one example, `(in_channels, height, width)`; `jax.vmap` over
        a batch. Equals `eqx.nn.Conv2d` with the dense kernel."""
        del key
        self._check_one()
        if x.shape[0] != self.in_channels:
            raise ValueError(
                f"SparseConv2d expects one example of shape ({self.in_channels}, height, "
                f"width), got {x.shape}; jax.vmap over the batch."
            )
        x, padding = _pad_nonzero(x, self)
        y = _conv(
            self.values,
            self.indices,
            x,
            self.weight_shape,
            self.stride,
            padding,
            self.dilation,
            self.groups,
        )
        if self.bias is not None:
            y = y + self.bias
        return y


SPARSE_LAYERS: tuple[type, ...] = (SparseLinear, SparseConv2d)


def is_sparse(x: Any) -> bool:
    """True for a sparse layer of `eqx_lowmem.sparse`."""
    return isinstance(x, _Sparse)
