"""Integrity of orbax checkpoints' leaves and metadata, the same on any mesh.

A leaf's hash is a sum over its elements, so each process can hash the parts it holds and
the processes add their sums: a sum does not depend on how the leaf is split. Each
element's term mixes its bits with its position in the leaf, so swapped or moved elements
and changes that would cancel in a plain sum change it. The metadata's checksum is a
SHA-256 of its canonical JSON.
"""

import functools
import hashlib
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _words(a: np.ndarray) -> np.ndarray:
    """The bits of `a`'s elements as unsigned integers of their size (64-bit elements as
    two 32-bit words, complex ones as their parts), flat: the old fingerprint's words."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "c":
        a = a.view(a.real.dtype)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[a.dtype.itemsize]
    return a.reshape(-1).view(unsigned)


def _parts(x: Any) -> list[tuple[np.ndarray, tuple[slice, ...]]]:
    """The parts of `x` this process holds, each once (a replicated shard on the process
    holding its replica 0), with where each sits in the whole array."""
    if isinstance(x, jax.Array):
        return [(np.asarray(s.data), s.index) for s in x.addressable_shards if s.replica_id == 0]
    a = np.asarray(x)
    return [(a, tuple(slice(None) for _ in a.shape))]


def _local_sum(x: Any) -> int:
    """The old fingerprint (checkpoints written before the hash): the sum mod 2**32 of
    the words of the parts of `x` this process holds."""
    total = 0
    for part, _ in _parts(x):
        total += int(_words(part).sum(dtype=np.uint32))
    return total % 2**32


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 2**16  # elements hashed at a time: temporaries of half a MiB each


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on uint64 (a bijection that spreads every
    input bit over the output)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _starts(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[int]:
    """Where a part at `index` (a shard's) begins in the whole array of `shape`, per axis."""
    return [sl.indices(n)[0] for sl, n in zip(index, shape, strict=True)]


def _part_hash(part: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """Sum mod 2**64 over the part's elements of `mix(position * golden ^ bits)`: each
    element's position in the whole (C-order) array, its bits as uint64 (complex128: two
    words, at positions 2i and 2i + 1)."""
    a = np.ascontiguousarray(part)
    words = 2 if a.dtype.itemsize == 16 else 1
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}
    bits = a.reshape(-1).view(unsigned[a.dtype.itemsize])
    starts = _starts(index, shape)
    # Whole along every axis but the first: the part is one run of the flat array.
    contiguous = a.shape[1:] == tuple(shape[1:])
    first = int(np.ravel_multi_index(starts, shape)) * words if contiguous and a.size else 0
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for start in range(0, bits.size, _CHUNK):
            stop = min(start + _CHUNK, bits.size)
            if contiguous:
                position = np.arange(first + start, first + stop, dtype=np.uint64)
            else:
                local = np.arange(start, stop, dtype=np.int64)
                at = np.unravel_index(local // words, a.shape)
                at = tuple(i + s for i, s in zip(at, starts, strict=True))
                position = (np.ravel_multi_index(at, shape) * words + local % words).astype(
                    np.uint64
                )
            h = _mix((position * _GOLDEN) ^ bits[start:stop].astype(np.uint64))
            total = total + h.sum(dtype=np.uint64)
    return int(total)


def _device_words(a: jax.Array) -> jax.Array:
    """`_part_hash`'s words of `a` as uint64, shaped `a.shape + (words per element,)`."""
    size = a.dtype.itemsize
    if a.dtype == jnp.bool_:
        return a.astype(jnp.uint64)[..., None]
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        half = {4: jnp.uint32, 8: jnp.uint64}[size // 2]
        re, im = (lax.bitcast_convert_type(p, half).astype(jnp.uint64) for p in (a.real, a.imag))
        if size == 8:  # complex64: one 64-bit word, the real part's bits low
            return (re | (im << jnp.uint64(32)))[..., None]
        return jnp.stack([re, im], axis=-1)  # complex128: two words
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size]
    return lax.bitcast_convert_type(a, unsigned).astype(jnp.uint64)[..., None]


def _device_mix(z: jax.Array) -> jax.Array:
    z = (z ^ (z >> jnp.uint64(30))) * jnp.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> jnp.uint64(27))) * jnp.uint64(0x94D049BB133111EB)
    return z ^ (z >> jnp.uint64(31))


@functools.partial(jax.jit, static_argnames="shape")
def _device_part_hash(part: jax.Array, starts: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`_part_hash` of a part on its device (run with 64-bit types on): `starts` (uint64)
    where it sits in the whole array of `shape`. XLA:GPU fuses it into one reduction that
    reads the part in place (XLA:CPU would hold its words as uint64, whole: there the
    host's NumPy reads the part instead, in chunks)."""
    words = _device_words(part)
    position = lax.broadcasted_iota(jnp.uint64, words.shape, words.ndim - 1)
    for axis in range(len(shape)):
        at = lax.broadcasted_iota(jnp.uint64, words.shape, axis) + starts[axis]
        position = position + at * jnp.uint64(math.prod(shape[axis + 1 :]) * words.shape[-1])
    return jnp.sum(_device_mix((position * _GOLDEN) ^ words), dtype=jnp.uint64)


def _whole_bytes(dtype: Any) -> bool:
    """Whether each element fills its bytes (not int4 or float4, which NumPy stores a byte
    each and JAX cannot view as a byte): those the device hashes."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits == 8 * dtype.itemsize
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits == 8 * dtype.itemsize
    return True  # bool, complex


def _device_hash(x: jax.Array) -> int:
    """`_local_hash` of a JAX array, each part hashed on the device that holds it (only
    the sums come to the host): a GPU's way, which XLA:CPU runs too."""
    shape, sums = tuple(x.shape), []
    with jax.enable_x64(True):
        for s in (s for s in x.addressable_shards if s.replica_id == 0):
            starts = jax.device_put(np.asarray(_starts(s.index, shape), np.uint64), s.device)
            sums.append(_device_part_hash(s.data, starts, shape))
    return sum(int(v) for v in sums) % 2**64


def _local_hash(x: Any) -> int:
    """The sum of `_part_hash` over the parts of `x` this process holds, mod 2**64: for a
    JAX array on accelerators on their devices (`_device_hash`), else on the host."""
    if (isinstance(x, jax.Array) and _whole_bytes(x.dtype)
            and all(d.platform != "cpu" for d in x.devices())):  # fmt: skip
        return _device_hash(x)
    shape = tuple(x.shape)
    return sum(_part_hash(part, index, shape) for part, index in _parts(x)) % 2**64


def hashes(stored: Any) -> list[str]:
    """Each leaf's hash: a sum over its elements of a 64-bit mix of each element's bits and
    its position in the leaf. A sum does not depend on how the leaf is split, so every
    mesh and process count gives the same one (the processes' sums are added); the
    position makes it see swapped or moved elements, and the mix changes that cancel out
    (each changed element changes the hash but for a chance of 2**-64). One pass over the
    bytes: on an accelerator where each part lives (only its sum comes to the host),
    else on the host (NumPy, in chunks of `_CHUNK` elements)."""
    sums = [_local_hash(x) for x in jax.tree.leaves(stored)]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # As two 32-bit halves: without x64, JAX would cut uint64 words to 32 bits.
        halves = np.asarray([[v >> 32, v & 0xFFFFFFFF] for v in sums], np.uint32)
        gathered = np.asarray(multihost_utils.process_allgather(halves), np.uint64)
        sums = [
            sum((int(hi) << 32) | int(lo) for hi, lo in gathered[:, i]) % 2**64
            for i in range(len(sums))
        ]
    return [f"{v:016x}" for v in sums]


def fingerprints(stored: Any) -> list[str]:
    """The old fingerprints (sums of bits, blind to swapped elements): verified for
    checkpoints written before the hash, never written."""
    sums = np.asarray([_local_sum(x) for x in jax.tree.leaves(stored)], np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        gathered = np.asarray(multihost_utils.process_allgather(sums), np.uint64)
        sums = (gathered.sum(axis=0) % 2**32).astype(np.uint32)
    return [f"{int(v):08x}" for v in sums]


def checksum(meta: Any, records: list[dict[str, Any]]) -> str:
    """SHA-256 of the `meta` item's content (canonical JSON): an edit of the metadata (the
    stream position, the history, a record) is refused at the next read."""
    text = json.dumps({"meta": meta, "leaves": records}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
