"""Sparse layers whose parameters are the non-zero weights only.

A sparse layer stores a fixed number of slots (its `capacity`): `values[i]` is the weight at
flat position `indices[i]` of the dense weight (row-major over the dense layer's weight
shape). A slot whose index is the out-of-range position `size` (the dense weight's element
count) is empty: it is dropped when the dense weight is rebuilt, so its value gets a zero
gradient and, with a zero optimizer state, stays zero. Shapes never change, so rewiring under
`jax.jit` never recompiles.

Where the slots are stored (`storage=`: indices or a bit set) and the dense weight rebuilt
from them: `_storage.py`; the layer's forward and backward pass, which keep the dense
weight a temporary of one layer at a time: `_apply.py`.
"""

import functools
import math
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from ._apply import _apply
from ._storage import _dense_of, bits_of, bitset_bytes, index_dtype, is_bitset, positions_of


def _check_slots(layer: Any) -> None:
    values, indices = layer.values, layer.indices
    if not isinstance(values, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return  # a filtered or partitioned copy (None, or an object sentinel)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(f"{type(layer).__name__}.values must be floating, got {values.dtype}.")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{type(layer).__name__}.indices must be integers, got {indices.dtype}.")
    if is_bitset(indices):
        expected = (*values.shape[:-1], bitset_bytes(layer.size))
        if values.ndim < 1 or tuple(indices.shape) != expected:
            raise ValueError(
                f"{type(layer).__name__}: a bit set (uint8 indices) for values "
                f"{values.shape} must have shape {expected} (one bit per dense weight), "
                f"got {indices.shape}."
            )
        return
    if values.shape != indices.shape or values.ndim < 1:
        raise ValueError(
            f"{type(layer).__name__}: values {values.shape} and indices {indices.shape} must "
            "have the same shape (..., capacity)."
        )


# -- conversion from dense layers, shared by every sparse layer type ----------------------

_STORAGES = ("indices", "bits", "auto")


def check_density(density: Any, what: str = "density") -> float:
    """`density` as a float in (0, 1], or a ValueError naming `what`."""
    if (
        isinstance(density, bool)
        or not isinstance(density, (int, float, np.floating))
        or not 0.0 < float(density) <= 1.0
    ):
        raise ValueError(
            f"{what}={density!r}; expected the fraction of weights kept, in (0, 1] "
            "(0.3 keeps 30%; 1 is dense)."
        )
    return float(density)


def check_storage(storage: Any) -> str:
    if storage not in _STORAGES:
        raise ValueError(
            f"storage={storage!r}; expected one of {_STORAGES} ('indices': one integer per "
            "slot; 'bits': one bit per dense weight; 'auto': the smaller per layer)."
        )
    return storage


def check_key(key: Any, where: str) -> None:
    """A clear TypeError for a `key` that is not a JAX PRNG key (an int seed included)."""
    ok = isinstance(key, jax.Array) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.dtype == jnp.uint32 and key.shape in ((2,), (4,)))
    )
    if not ok:
        got = (
            f"an array of dtype {key.dtype} and shape {tuple(key.shape)}"
            if hasattr(key, "dtype") and hasattr(key, "shape")
            else f"{type(key).__name__} {key!r}"
        )
        raise TypeError(
            f"{where}(key=...) must be a JAX PRNG key such as jr.PRNGKey(0) or jr.key(0), "
            f"got {got}."
        )


def kept_count(size: int, density: float) -> int:
    """The non-zeros a layer of `size` weights keeps at `density` (at least one)."""
    return min(size, max(1, round(density * size)))


def _choose(key: PRNGKeyArray, size: int, nnz: int, capacity: int, dtype: Any) -> Array:
    """`nnz` distinct random positions in `[0, size)`, sorted, then empty slots (`size`)."""
    chosen = jnp.sort(jr.choice(key, size, (nnz,), replace=False))
    empty = jnp.full((capacity - nnz,), size, chosen.dtype)
    return jnp.concatenate([chosen, empty]).astype(dtype)


def _slots_of(
    weight: Array, rank: int, density: Any, key: Any, capacity: Any, storage: Any
) -> tuple[Array, Array]:
    """(values, indices) keeping `round(density * size)` random weights of each stacked
    layer of a dense `weight` whose last `rank` axes are one layer's."""
    density = check_density(density)
    stack, shape = tuple(weight.shape[:-rank]), tuple(weight.shape[-rank:])
    size = math.prod(shape)
    nnz = kept_count(size, density)
    if capacity is None:
        capacity = nnz
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not nnz <= capacity <= size:
        raise ValueError(
            f"capacity={capacity!r} for a layer of {size} weights at density={density}: "
            f"expected an int from the {nnz} non-zeros kept up to {size} (the dense size)."
        )
    storage = check_storage(storage)
    dtype = index_dtype(size)
    if storage == "auto":
        smaller = bitset_bytes(size) < capacity * jnp.dtype(dtype).itemsize
        storage = "bits" if smaller else "indices"
    n = math.prod(stack)
    keys = jr.split(key, n)
    indices = jnp.stack([_choose(k, size, nnz, capacity, dtype) for k in keys])
    flat = weight.reshape(n, size)
    picked = jnp.take_along_axis(flat, jnp.minimum(indices, size - 1).astype(jnp.int32), axis=1)
    values = jnp.where(indices < size, picked, jnp.zeros((), flat.dtype))
    values = values.reshape(*stack, capacity)
    if storage == "bits":  # the slots are in the order of their positions (`_choose`)
        indices = jax.vmap(lambda i: bits_of(i, size))(indices)
    return values, indices.reshape(*stack, indices.shape[-1])


def _with_weight(skeleton: Any, layer: "_Sparse") -> Any:
    """A dense layer `skeleton` (from `eqx.filter_eval_shape`: nothing allocated, no
    random numbers drawn) given the sparse `layer`'s dense weight and bias."""
    weight = layer.weight
    bias = layer.bias  # pyright: ignore[reportAttributeAccessIssue]
    if bias is None:
        return eqx.tree_at(lambda m: m.weight, skeleton, weight)
    return eqx.tree_at(lambda m: (m.weight, m.bias), skeleton, (weight, bias))


class _Sparse(eqx.Module):
    """What every sparse layer has: values and indices.

    A sparse layer type is one subclass: its fields, `weight_shape`, `__call__`, the rank
    of one dense weight (`dense_rank`), and its conversions: `converts` (which dense
    layers it replaces), `_from_slots` (itself from such a layer and the slots kept) and
    `to_dense`. `sparsify`, `densify` and the rewiring hooks find it through this class
    (`sparse_type_of`): no list to extend, no switch on types.
    """

    dense_rank: ClassVar[int] = 0  # axes of one dense weight (2: a matrix)

    @classmethod
    def converts(cls, layer: Any) -> bool:
        """Whether `from_dense` takes the dense `layer`."""
        del layer
        return False

    @classmethod
    def _from_slots(cls, layer: Any, values: Array, indices: Array) -> Any:
        """The sparse layer from the dense `layer`'s other fields and the slots kept."""
        raise NotImplementedError

    def to_dense(self) -> Any:
        """The equal dense layer (stacked layers stay stacked). Memory: its dense weight."""
        raise NotImplementedError

    @classmethod
    def from_dense(
        cls,
        layer: Any,
        density: float,
        *,
        key: PRNGKeyArray,
        capacity: int | None = None,
        storage: str = "indices",
    ) -> Any:
        """Keep `round(density * size)` weights of the dense `layer` at random positions
        (Mostafa and Wang thin an initialised dense network the same way).

        Args:
            layer: the dense layer (its weight may have leading stacked-layer axes).
            density: fraction of weights kept, in (0, 1].
            key: picks the positions (each stacked layer its own).
            capacity: slots per layer, at least the count kept (default: that count);
                extra slots start empty, for rewiring that moves weights between layers.
            storage: where the slots are: `"indices"` (one integer per slot), `"bits"`
                (one bit per dense weight) or `"auto"` (the smaller of the two).

        Raises:
            TypeError: for a layer this type does not convert, or a key that is not one.
            ValueError: for a density outside (0, 1] or a capacity below the count kept.
        """
        if not cls.converts(layer):
            raise TypeError(
                f"{cls.__name__}.from_dense cannot convert a {type(layer).__name__}; "
                "eqx_lowmem.sparse.sparsify picks the sparse type of each layer."
            )
        check_key(key, f"{cls.__name__}.from_dense")
        values, indices = _slots_of(layer.weight, cls.dense_rank, density, key, capacity, storage)
        return cls._from_slots(layer, values, indices)

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
        indices = self.indices  # pyright: ignore[reportAttributeAccessIssue]
        if is_bitset(indices):
            return jnp.sum(jax.lax.population_count(indices).astype(jnp.int32), axis=-1)
        return jnp.sum(indices < self.size, axis=-1)

    def positions(self) -> Array:
        """Every slot's flat position (stacked axes first), `size` for an empty slot, for
        either storage (a bit set's are derived: int32)."""
        indices = self.indices  # pyright: ignore[reportAttributeAccessIssue]
        if not is_bitset(indices):
            return indices
        fn = functools.partial(positions_of, size=self.size, capacity=self.capacity)
        for _ in range(indices.ndim - 1):
            fn = jax.vmap(fn)
        return fn(indices)

    def standardised(self, eps: float = 1e-5) -> Any:
        """This layer with Weight Standardization (Qiao et al., 2019) over its stored
        weights: each output unit's (axis 0 of the dense weight) occupied slots less their
        mean, over their standard deviation, in float32, stored in the values' dtype.
        Empty slots stay 0; at density 1 it is `eqx_lowmem.nn`'s `standardise_weight`
        of the dense weight. Memory: a few arrays of the slots' size, no dense weight."""
        out = self.weight_shape[0]
        fan = self.size // out

        def one(values: Array, positions: Array) -> Array:
            occupied = positions < self.size
            unit = jnp.where(occupied, positions // fan, out)  # empty slots: a unit of their own
            v = jnp.where(occupied, values.astype(jnp.float32), 0.0)
            count = jnp.maximum(jax.ops.segment_sum(occupied.astype(jnp.float32), unit, out + 1), 1)
            d = jnp.where(occupied, v - (jax.ops.segment_sum(v, unit, out + 1) / count)[unit], 0.0)
            var = jax.ops.segment_sum(d * d, unit, out + 1) / count
            return (d * jax.lax.rsqrt(var + eps)[unit]).astype(values.dtype)

        for _ in self.stack_shape:
            one = jax.vmap(one)
        values = one(self.values, self.positions())  # pyright: ignore[reportAttributeAccessIssue]
        return eqx.tree_at(lambda layer: layer.values, self, values)

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
    `bias`; `indices` are integers (not touched by optimizers; rewiring hooks change them).

    Memory per slot: the value (4 or 2 bytes), the optimizer's state for it (Adam: 8 bytes in
    float32) and the index (1, 2 or 4 bytes, `index_dtype`; or, as a bit set, one bit per
    dense weight), against 12 bytes per dense weight with Adam. Time: one scatter of the
    values per forward and one more in the backward pass (cheap next to the matmul), and
    one gather of the weight gradient; a bit set instead walks the dense weight's bits for
    each of the three (see the note on storage in `_storage.py`).

    Reverse mode only under `jax.vmap`: over a batch the layer is a `jax.custom_vjp` whose
    backward pass rebuilds the dense weight after the output gradient arrives and frees it
    before the weight gradient (`_apply.py`), an order a tangent that JAX transposes
    cannot set; `jax.jvp` of one example (no `vmap`) works.

    Attributes:
        values: `(..., capacity)` weights; empty slots hold 0.
        indices: `(..., capacity)` flat positions, an empty slot holding `size`; or, with
            `storage="bits"`, a bit set `(..., ceil(size / 8))` uint8 (slots in the order
            of their positions, empty ones last; `positions()` derives them).
        bias: `(..., out_features)` dense bias, or None.
        in_features, out_features, use_bias: as `eqx.nn.Linear`.

    Example:
        >>> import equinox as eqx, jax.random as jr
        >>> dense = eqx.nn.Linear(8, 4, key=jr.PRNGKey(0))
        >>> sparse = SparseLinear.from_dense(dense, 0.5, key=jr.PRNGKey(1))
        >>> sparse.capacity, int(sparse.nnz()), type(sparse.to_dense()).__name__
        (16, 16, 'Linear')
    """

    values: Array
    indices: Array
    bias: Array | None
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

    dense_rank: ClassVar[int] = 2

    @classmethod
    def converts(cls, layer: Any) -> bool:
        return isinstance(layer, eqx.nn.Linear)

    @classmethod
    def _from_slots(cls, layer, values, indices) -> "SparseLinear":
        return cls(
            values=values,
            indices=indices,
            bias=layer.bias,
            in_features=layer.in_features,
            out_features=layer.out_features,
            use_bias=layer.use_bias,
        )

    def to_dense(self) -> eqx.nn.Linear:
        def skeleton():
            return eqx.nn.Linear(
                self.in_features,
                self.out_features,
                self.use_bias,
                dtype=self.values.dtype,
                key=jr.PRNGKey(0),
            )

        return _with_weight(eqx.filter_eval_shape(skeleton), self)

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
        y = _apply(("linear",), self.weight_shape, self.values, self.indices, x)
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
        values, indices: as `SparseLinear`.
        bias: `(..., out_channels, 1, 1)` dense bias, or None.
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
        use_bias, padding_mode: as `eqx.nn.Conv2d`.

    Example:
        >>> import equinox as eqx, jax.random as jr
        >>> dense = eqx.nn.Conv2d(4, 8, 3, padding=1, key=jr.PRNGKey(0))
        >>> sparse = SparseConv2d.from_dense(dense, 0.25, key=jr.PRNGKey(1))
        >>> sparse.size, sparse.capacity
        (288, 72)
    """

    values: Array
    indices: Array
    bias: Array | None
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

    dense_rank: ClassVar[int] = 4

    @classmethod
    def converts(cls, layer: Any) -> bool:
        return isinstance(layer, eqx.nn.Conv) and layer.num_spatial_dims == 2

    @classmethod
    def _from_slots(cls, layer, values, indices) -> "SparseConv2d":
        return cls(
            values=values,
            indices=indices,
            bias=layer.bias,
            in_channels=layer.in_channels,
            out_channels=layer.out_channels,
            kernel_size=tuple(layer.kernel_size),
            stride=tuple(layer.stride),
            padding=layer.padding,
            dilation=tuple(layer.dilation),
            groups=layer.groups,
            use_bias=layer.use_bias,
            padding_mode=layer.padding_mode,
        )

    def to_dense(self) -> eqx.nn.Conv2d:
        def skeleton():
            return eqx.nn.Conv2d(
                self.in_channels,
                self.out_channels,
                self.kernel_size,
                self.stride,
                self.padding,
                self.dilation,
                self.groups,
                self.use_bias,
                self.padding_mode,
                dtype=self.values.dtype,
                key=jr.PRNGKey(0),
            )

        return _with_weight(eqx.filter_eval_shape(skeleton), self)

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
        op = ("conv", self.stride, padding, self.dilation, self.groups)
        y = _apply(op, self.weight_shape, self.values, self.indices, x)
        if self.bias is not None:
            y = y + self.bias
        return y


def is_sparse(x: Any) -> bool:
    """True for a sparse layer of `eqx_lowmem.sparse`."""
    return isinstance(x, _Sparse)


def sparse_type_of(layer: Any) -> type[_Sparse] | None:
    """The sparse layer type whose `from_dense` converts the dense `layer`, or None: every
    subclass of the sparse layers' base is asked (`converts`)."""
    todo = list(_Sparse.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls.converts(layer):
            return cls
        todo.extend(cls.__subclasses__())
    return None
