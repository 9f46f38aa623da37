"""Where a sparse layer's slots are, and its dense weight rebuilt from them.

Two ways to store where the slots are (`storage=` of `sparsify` and `from_dense`):

- `"indices"`: one signed integer per slot (`index_dtype`: 1, 2 or 4 bytes);
- `"bits"`: a bit set, one bit per dense weight (`uint8`, 8 to a byte, little-endian), with
  the slots in the order of their positions and the empty ones last (the order `sparsify`
  and rewiring keep). At density `d` that is `1 / d` bits per slot: 3.3 at 30%, against 16
  or 32 for indices; indices are smaller below a density of 1/16 (int16) or 1/32 (int32).
  Where the layer runs, each dense position's slot is derived from the bits (its word's
  running population count plus the set bits below it), a chunk of positions at a time,
  never stored: three passes over the dense weight per step (two rebuilds and the value
  gradient): the benchmark MLP's step is slower than with indices (the README's sparse
  table, `benchmarks/speed.py --only sparse/`), for 0.34x the dense parameters and Adam
  state against 0.44x.

A slot whose index is `size` (the dense weight's element count) is empty: the rebuild
drops it.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

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


def is_bitset(indices: Any) -> bool:
    """Whether a sparse layer's `indices` array is a bit set (`storage="bits"`, uint8)."""
    return jnp.dtype(indices.dtype) == jnp.uint8


def bitset_bytes(size: int) -> int:
    """Bytes of one layer's bit set: one bit per dense weight, rounded up to a byte."""
    return -(-size // 8)


def bits_of(positions: Array, size: int) -> Array:
    """One layer's bit set `(ceil(size / 8),)` uint8 from its slots' flat positions
    `(capacity,)` (empty slots, at `size`, set no bit)."""
    mask = jnp.zeros((size,), jnp.uint8).at[positions.astype(jnp.int32)].set(1, mode="drop")
    return jnp.packbits(mask, bitorder="little")


_CHUNK = 1 << 15  # dense positions per trip of `_walk`'s loop


def _walk(bits: Array, size: int, capacity: int, fn: Callable, carry: Any) -> Any:
    """`carry = fn(carry, first, slots)` over one layer's dense positions, a chunk at a
    time: `slots` (int32) holds, for positions `first, first + 1, ...`, the slot of each
    set bit (its rank among the set bits) and `capacity` for a clear one.

    A position's rank is its word's running population count plus the set bits below it
    in the word (at most `capacity`). The temporaries are one int32 per 32-bit word and a
    few per position of a chunk: never one per dense weight (a prefix sum over the
    unpacked bits would be 4 bytes per weight), nor one per slot (the int32 indices the
    bit set replaces). A last chunk that overlaps the one before visits its positions
    again, so `fn` must be idempotent per position (a set, not an add)."""
    pad = -bits.shape[0] % 4
    b = jnp.pad(bits, (0, pad)).reshape(-1, 4).astype(jnp.uint32)
    words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)  # little-endian
    counts = jax.lax.population_count(words).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    chunk = min(size, _CHUNK)

    def slots(first):
        p = first + jnp.arange(chunk, dtype=jnp.int32)
        w, bit = p // 32, (p % 32).astype(jnp.uint32)
        word = words[w]
        below = jax.lax.population_count(word & ((jnp.uint32(1) << bit) - 1))
        is_set = ((word >> bit) & 1).astype(bool)
        # (a set with more bits than slots, built by hand, sends the extra ones nowhere)
        return jnp.where(is_set, jnp.minimum(starts[w] + below.astype(jnp.int32), capacity),
                         capacity)  # fmt: skip

    if chunk == size:
        return fn(carry, 0, slots(0))

    def body(c, carry):
        first = jnp.minimum(c * chunk, size - chunk)
        return fn(carry, first, slots(first))

    return jax.lax.fori_loop(0, -(-size // chunk), body, carry)


def positions_of(bits: Array, size: int, capacity: int) -> Array:
    """One layer's slot positions `(capacity,)` int32 from its bit set: the set bits in
    increasing order, then `size` for each empty slot."""

    def put(out, first, slots):
        here = first + jnp.arange(slots.shape[0], dtype=jnp.int32)
        return jax.lax.scatter(out, slots[:, None], here, _SCATTER, mode=_IN_BOUNDS)

    # as `_gather`: a clear position writes to one extra slot, dropped after
    out = jnp.full((capacity + 1,), size, jnp.int32)
    return _walk(bits, size, capacity, put, out)[:capacity]


# One flat position per slot. `lax.scatter` / `lax.gather` directly: `.at[]` would first
# normalise negative indices (a select over every slot, which ours never need) and cast
# to int32; measured on CPU at 1M weights and 346k slots, scatter 1.5 -> 1.1 ms, gather
# 1.4 -> 0.7 ms (ea812f7).
_SCATTER = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
_GATHER = jax.lax.GatherDimensionNumbers(
    offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,)
)
_DROP = jax.lax.GatherScatterMode.FILL_OR_DROP
_IN_BOUNDS = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS


def _scatter(
    values: Array, indices: Array, shape: tuple[int, ...], base: Array | None = None
) -> Array:
    """The dense weight of one layer: zeros (or `base`, flat zeros) with `values` at the
    flat `indices` (empty slots, at index `size`, dropped)."""
    size = math.prod(shape)
    flat = jnp.zeros((size,), values.dtype) if base is None else base
    if is_bitset(indices):  # a chunk of dense positions at a time: each gathers its value

        def put(flat, first, slots):
            got = jax.lax.gather(values, slots[:, None], _GATHER, (1,), mode=_DROP,
                                 fill_value=0)  # fmt: skip
            return jax.lax.dynamic_update_slice(flat, got, (first,))

        flat = _walk(indices, size, values.shape[0], put, flat)
    else:
        flat = jax.lax.scatter(flat, indices[:, None], values, _SCATTER, mode=_DROP)
    return flat.reshape(shape)


def _gather(flat: Array, indices: Array, capacity: int) -> Array:
    """`flat` at each slot's position; 0 for an empty slot (index `size`)."""
    if is_bitset(indices):  # each set position's value to its slot

        def put(out, first, slots):
            here = jax.lax.dynamic_slice_in_dim(flat, first, slots.shape[0])
            return jax.lax.scatter(out, slots[:, None], here, _SCATTER, mode=_IN_BOUNDS)

        # A clear position writes to one extra slot (index `capacity`), dropped after: an
        # in-bounds scatter runs twice as fast on XLA:CPU as one that drops 70% of its
        # updates (measured for 5c2fd69 at 1M weights, 346k slots: 2.5 against 5.5 ms).
        out = jnp.zeros((capacity + 1,), flat.dtype)
        return _walk(indices, flat.shape[0], capacity, put, out)[:capacity]
    return jax.lax.gather(flat, indices[:, None], _GATHER, (1,), mode=_DROP, fill_value=0)


def _dense_of(values: Array, indices: Array, shape: tuple[int, ...]) -> Array:
    """`_scatter` over any leading (stacked-layer) axes."""
    fn = functools.partial(_scatter, shape=shape)
    for _ in range(values.ndim - 1):
        fn = jax.vmap(fn)
    return fn(values, indices)
