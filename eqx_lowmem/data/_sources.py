"""What a stream reads: arrays, `.npy` memory maps, or samples from an iterator, validated."""

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

SOURCE_KINDS = """\
source must be one of:
    DataStream((x, y), batch_size)                # arrays with the same first dimension
    DataStream(("x.npy", "y.npy"), batch_size)    # .npy files, read as memory maps
    DataStream(lambda: iter(samples), batch_size) # a function returning an iterator of
                                                  # sample tuples, e.g. (x_i, y_i)
"""


def _numeric(dtype: np.dtype) -> bool:
    """Numbers and booleans, what a device holds: not strings, objects, records, dates."""
    if dtype.fields is not None or dtype.hasobject:
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.number) or dtype == np.dtype(bool))
    except TypeError:
        return False


def _dtype_error(name: str, dtype: np.dtype) -> ValueError:
    what = (
        "holds Python objects"
        if dtype.hasobject
        else "is a structured (record) dtype"
        if dtype.fields is not None
        else "is not numeric"
    )
    return ValueError(
        f"{name} has dtype {dtype}, which {what}; a stream serves numeric arrays (numbers "
        "or booleans, what a device holds): convert it first, e.g. np.asarray(x, np.float32),"
        " or one array per field of a record."
    )


class Watched(NamedTuple):
    """A memory-mapped file and what it was when opened: a change means its pages are no
    longer the data (or no longer exist: reading a truncated mapping is SIGBUS)."""

    source_index: int
    path: Path
    size: int
    mtime_ns: int
    inode: int
    data_offset: int  # where the array's bytes start (after the .npy header)

    def check(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise RuntimeError(
                f"source[{self.source_index}] = {str(self.path)!r} can no longer be read ({e}); "
                "the stream memory-maps it: keep the file in place while the stream runs."
            ) from None
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (self.size, self.mtime_ns, self.inode):
            raise RuntimeError(
                f"source[{self.source_index}] = {str(self.path)!r} changed while the stream was "
                f"reading it (size {self.size} -> {st.st_size} bytes"
                f"{', rewritten' if st.st_size == self.size else ''}); the stream "
                "memory-maps it, so its batches would be torn or the process killed by "
                "SIGBUS. Do not write the data files during training; write new files and "
                "build a new stream."
            )


def _open_npy(path: Path, i: int) -> tuple[np.ndarray, Watched]:
    """A read-only memory map of a `.npy` file; reading it reads only the pages touched."""
    if not path.is_file():
        raise FileNotFoundError(
            f"source[{i}] = {str(path)!r} does not exist or is not a file; "
            "pass the path of a file written by np.save."
        )
    name = f"source[{i}] = {str(path)!r}"
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        magic = f.read(len(np.lib.format.MAGIC_PREFIX))
        if path.suffix != ".npy" or magic != np.lib.format.MAGIC_PREFIX:
            raise ValueError(
                f"{name} is not a .npy file (expected the '.npy' suffix and content "
                f"starting with {np.lib.format.MAGIC_PREFIX!r}, got suffix {path.suffix!r} "
                f"and {magic!r}); save each array with np.save."
            )
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except (ValueError, SyntaxError, EOFError, OSError) as e:
            raise ValueError(
                f"{name} has a corrupt or truncated .npy header ({e}); write it again with np.save."
            ) from None
        offset = f.tell()
    if dtype.hasobject:
        raise ValueError(
            f"{name} holds Python objects (a pickled array, dtype {dtype}); a stream never "
            "unpickles: save a numeric array instead."
        )
    if not _numeric(dtype):
        raise _dtype_error(name, dtype)
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if st.st_size != expected:
        raise ValueError(
            f"{name} is {'truncated' if st.st_size < expected else 'corrupt'}: its header "
            f"says shape {shape} of {dtype} ({expected} bytes with the header) but the file "
            f"has {st.st_size} bytes; write it again with np.save."
        )
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    # A plain ndarray over the same mapping: np.memmap's per-slice bookkeeping costs more
    # than copying a small batch, and the mapping stays alive through `.base`.
    watched = Watched(i, path, st.st_size, st.st_mtime_ns, st.st_ino, offset)
    return array.view(np.ndarray), watched


def open_arrays(source: Sequence[Any]) -> tuple[list[np.ndarray], list[Watched]]:
    """Each element of `source` as an array (paths opened as memory maps), checked to have
    a sample axis, a numeric dtype, and the same number of samples; and the files mapped."""
    if len(source) == 0:
        raise ValueError(f"source is an empty {type(source).__name__}.\n{SOURCE_KINDS}")
    arrays, watched = [], []
    for i, item in enumerate(source):
        if isinstance(item, (str, os.PathLike)):
            array, w = _open_npy(Path(item), i)
            watched.append(w)
        else:
            array = np.asarray(item)
        if not _numeric(array.dtype):
            raise _dtype_error(f"source[{i}]", array.dtype)
        if not array.dtype.isnative:
            where = (
                f"{item} (source[{i}])"
                if isinstance(item, (str, os.PathLike))
                else (f"source[{i}]")
            )
            raise ValueError(
                f"{where} is big-endian ({array.dtype.str}); JAX takes arrays in this "
                "machine's byte order only. Convert it once: "
                "a = a.astype(a.dtype.newbyteorder('=')) (for a .npy file: "
                f"np.save(path, np.load(path).astype('{array.dtype.newbyteorder('=').str}')))."
            )
        if array.ndim == 0:
            raise ValueError(
                f"source[{i}] is a scalar; each array needs a first axis of samples, "
                "e.g. shape (num_samples, ...)."
            )
        if array.shape[0] == 0:
            raise ValueError(f"source[{i}] has no samples (shape {array.shape}).")
        if arrays and array.shape[0] != arrays[0].shape[0]:
            raise ValueError(
                f"source[{i}] has {array.shape[0]} samples but source[0] has "
                f"{arrays[0].shape[0]}; every array needs the same first dimension."
            )
        arrays.append(array)
    return arrays, watched


class SampleReader:
    """Samples from `factory()`, checked against the first one, with one sample lookahead so
    the end of the iterator is known as soon as the last sample is taken."""

    def __init__(self, factory: Callable[[], Iterable[Any]]):
        self._iterator: Iterator[Any] = iter(factory())
        self._count = 0  # samples read so far, lookahead included
        self.spec: list[tuple[tuple[int, ...], np.dtype]] | None = None
        self._next = self._read()

    @property
    def exhausted(self) -> bool:
        return self._next is None

    def _read(self) -> tuple[np.ndarray, ...] | None:
        try:
            sample = next(self._iterator)
        except StopIteration:
            return None
        i = self._count
        self._count += 1
        if not isinstance(sample, (tuple, list)):
            raise TypeError(
                f"sample {i} from source() is a {type(sample).__name__}; each sample must be "
                "a tuple of arrays, e.g. (x_i, y_i), or (x_i,) for one array."
            )
        fields = tuple(np.asarray(v) for v in sample)
        if self.spec is None:
            for j, field in enumerate(fields):
                if not _numeric(field.dtype):
                    raise _dtype_error(f"sample {i} from source(), field {j},", field.dtype)
            self.spec = [(f.shape, f.dtype) for f in fields]
            return fields
        if len(fields) != len(self.spec):
            raise ValueError(
                f"sample {i} from source() has {len(fields)} fields but sample 0 has "
                f"{len(self.spec)}; every sample needs the same fields."
            )
        for j, (field, (shape, dtype)) in enumerate(zip(fields, self.spec, strict=True)):
            if field.shape != shape or field.dtype != dtype:
                raise ValueError(
                    f"sample {i} from source(), field {j}, has shape {field.shape} and dtype "
                    f"{field.dtype} but sample 0 has shape {shape} and dtype {dtype}; every "
                    "sample needs the same shapes and dtypes (pad or cast them in source)."
                )
        return fields

    def take(self, count: int) -> list[tuple[np.ndarray, ...]]:
        """Up to `count` samples; fewer only at the end of the iterator."""
        samples = []
        while len(samples) < count and self._next is not None:
            samples.append(self._next)
            self._next = self._read()
        return samples


# From this many bytes, a batch's arrays start on a 64-byte boundary, XLA:CPU's alignment:
# `jax.device_put` (and a jitted step given the array) then uses the host array in place.
# An array that does not start there is copied, and from about 128 KiB the copy is slow
# (measured for 423dbdc): 256 KiB took 123 microseconds against 32 in place, 1 MiB 186
# against 31, 4 MiB 630 against 32; up to 96 KiB both took 32-35. The aligned allocation
# costs 5 microseconds (also 423dbdc).
_ALIGN_BYTES = 64 << 10


def empty_rows(count: int, sample_shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A fresh C-ordered array for `count` samples; from `_ALIGN_BYTES`, one whose data
    starts on a 64-byte boundary (NumPy's own start on 16 bytes, on 64 only by chance)."""
    dtype = np.dtype(dtype)
    nbytes = count * math.prod(sample_shape) * dtype.itemsize
    if nbytes < _ALIGN_BYTES:
        return np.empty((count, *sample_shape), dtype)
    block = np.empty(nbytes + 63, np.uint8)
    skip = -block.__array_interface__["data"][0] % 64
    return block[skip : skip + nbytes].view(dtype).reshape(count, *sample_shape)


def copy_rows(array: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """A function copying rows `start:stop` of `array` into a fresh array (`empty_rows`)."""
    sample_shape, dtype = array.shape[1:], array.dtype

    def copy(start: int, stop: int) -> np.ndarray:
        out = empty_rows(stop - start, sample_shape, dtype)
        out[...] = array[start:stop]
        return out

    return copy


# From this many bytes gathered, `np.take` beats the gather of whole rows (below; measured
# for d68d487): 256 rows of 3 KiB (784 float32) took 47 against 72 microseconds, 256 of
# 1 KiB 18 against 32; at 64 KiB they were even, and below it the whole rows were faster
# (1 KiB x 32: 2.6 against 3.3).
_TAKE_BYTES = 64 << 10


def row_gather(array: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A function that copies the rows `indices` (in range) of `array` into a fresh
    C-ordered array.

    From `_TAKE_BYTES` gathered, `np.take` along the first axis into `empty_rows`. Below,
    for C-contiguous rows of several elements, it gathers a 1-D view whose elements are
    whole rows (one memcpy per row), which costs a third less than NumPy's general
    fancy indexing on small rows (1 KiB: 1.1 against 1.45 microseconds a batch of 32,
    measured for 2ed537c).
    """
    row_bytes = array.itemsize * math.prod(array.shape[1:])
    sample_shape, dtype = array.shape[1:], array.dtype
    take_rows = -(-_TAKE_BYTES // row_bytes) if row_bytes else None
    rows = None
    if array.ndim >= 2 and row_bytes and array.flags.c_contiguous:
        rows = array.reshape(array.shape[0], -1).view(np.dtype((np.void, row_bytes)))
        rows = rows.reshape(array.shape[0])

    def gather(indices: np.ndarray) -> np.ndarray:
        if take_rows is not None and indices.size >= take_rows:
            out = empty_rows(indices.size, sample_shape, dtype)
            # "clip" writes straight into `out` ("raise" buffers it); indices are in range.
            return array.take(indices, axis=0, out=out, mode="clip")
        if rows is None:
            return np.ascontiguousarray(array[indices])
        return np.ndarray((indices.size, *sample_shape), dtype, rows[indices])

    return gather
