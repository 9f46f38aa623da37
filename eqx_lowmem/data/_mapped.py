"""Copying rows out of a memory-mapped file so that a file shrunk under the stream raises
`RuntimeError` instead of killing the process with SIGBUS.

A load from a mapped page that a truncation removed is a SIGBUS, and no Python code can
catch it. The stream checks each file before it reads (`Watched.check`), but a truncation
between that check and the copy would still be fatal. So the copy is done by the kernel:

- `process_vm_readv` on this process's own address space (Linux 3.2 or later) copies the
  rows from the mapping with one system call per 1,024 rows; a page past the end of the
  file makes the call return short with `EFAULT`, and no signal is sent.
- Where it is refused (a seccomp profile, another OS), `os.preadv` reads the same bytes
  from the file, one call per row: a short read is the same signal.

Either way a short copy is reported as the file having changed, naming it.
"""

import ctypes
import ctypes.util
import functools
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np

_IOV_MAX = 1024  # Linux's limit on the iovecs of one call (UIO_MAXIOV)


@functools.cache
def _process_vm_readv() -> Callable[..., int] | None:
    """libc's `process_vm_readv`, if this process may call it on itself; else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong]
    call.argtypes += [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    src = np.arange(8, dtype=np.uint8)
    dst = np.zeros(8, dtype=np.uint8)
    local = np.array([dst.ctypes.data, 8], np.uint64)
    remote = np.array([src.ctypes.data, 8], np.uint64)
    if call(os.getpid(), local.ctypes.data, 1, remote.ctypes.data, 1, 0) != 8:
        return None  # EPERM (seccomp) or ENOSYS
    return call if np.array_equal(src, dst) else None


class MappedRows:
    """Rows of a read-only memory-mapped array `array`, the data of file `path` from byte
    `data_offset`, copied into fresh arrays by the kernel (see the module's docstring).

    `changed()` is called when a copy comes back short; it raises the error that names
    the file and what happened to it. `method` is "process_vm_readv", "pread", or None
    for the first that this process may use.
    """

    def __init__(
        self,
        array: np.ndarray,
        path: os.PathLike,
        data_offset: int,
        changed: Callable[[], None],
        method: str | None = None,
    ):
        if method is None:
            method = "process_vm_readv" if _process_vm_readv() is not None else "pread"
        if method not in ("process_vm_readv", "pread"):
            raise ValueError(f"method={method!r}; expected 'process_vm_readv' or 'pread'.")
        if method == "process_vm_readv" and _process_vm_readv() is None:
            raise OSError("process_vm_readv is not available to this process.")
        self.method = method
        self._array = array  # keeps the mapping alive
        self._path = os.fspath(path)
        self._changed = changed
        self._sample_shape = array.shape[1:]
        self._dtype = array.dtype
        self._row_stride = array.strides[0]
        self._base = array.ctypes.data
        self._data_offset = data_offset
        # Each sample as byte runs from the start of its row: one run for a contiguous
        # sample, one per element otherwise (a Fortran-ordered file), in C order.
        sample = array[0]
        # Rows that follow one another with no gap: a slice of them is one run.
        self._rows_contiguous = sample.flags.c_contiguous and sample.nbytes == self._row_stride
        if sample.flags.c_contiguous:
            self._runs = np.zeros(1, np.int64)
            self._run_bytes = sample.nbytes
        else:
            index = np.indices(sample.shape).reshape(sample.ndim, -1).T
            self._runs = (index * np.asarray(array.strides[1:], np.int64)).sum(1)
            self._run_bytes = array.itemsize
        self._local = threading.local()  # each thread's iovec buffer
        self._fd: int | None = None
        if method == "pread":
            self._fd = os.open(self._path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Rows `indices` (non-negative, in range) as a fresh C-ordered array."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        out = np.empty((indices.size, *self._sample_shape), self._dtype)
        if out.nbytes == 0:
            return out
        starts = indices[:, None] * self._row_stride + self._runs[None, :]
        self._copy(starts.reshape(-1), out)
        return out

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` as a fresh array: one run when rows are contiguous."""
        if self._rows_contiguous:
            out = np.empty((stop - start, *self._sample_shape), self._dtype)
            if out.nbytes:
                self._copy(np.array([start * self._row_stride], np.int64), out, out.nbytes)
            return out
        return self.gather(np.arange(start, stop))

    def _copy(self, starts: np.ndarray, out: np.ndarray, run_bytes: int | None = None) -> None:
        """Copy the runs at byte offsets `starts` of the data, `run_bytes` each, into `out`."""
        run = self._run_bytes if run_bytes is None else run_bytes
        if self.method == "process_vm_readv":
            copied = self._copy_vm(starts, out, run)
        else:
            copied = self._copy_pread(starts, out, run)
        if copied != starts.size * run:
            self._changed()  # raises, naming the file
            raise RuntimeError(
                f"{self._path!r} returned {copied} of {starts.size * run} bytes; the stream "
                "memory-maps it: keep it unchanged while the stream runs."
            )

    def _iovecs(self) -> tuple[np.ndarray, int]:
        """This thread's iovec buffer (the local one, then `_IOV_MAX` remote ones) and its
        address: made once per thread, as a NumPy array and its address cost more than the
        system call on small rows."""
        try:
            return self._local.iov, self._local.address
        except AttributeError:
            iov = np.zeros((_IOV_MAX + 1, 2), np.uint64)
            self._local.iov, self._local.address = iov, iov.ctypes.data
            return iov, self._local.address

    def _copy_vm(self, starts: np.ndarray, out: np.ndarray, run: int) -> int:
        call = _process_vm_readv()
        assert call is not None
        iov, address = self._iovecs()
        local, remote = address, address + iov.strides[0]
        pid, copied, dst = os.getpid(), 0, out.ctypes.data
        for first in range(0, starts.size, _IOV_MAX):
            part = starts[first : first + _IOV_MAX]
            np.add(part, self._base, out=iov[1 : 1 + part.size, 0], casting="unsafe")
            iov[1 : 1 + part.size, 1] = run
            iov[0] = (dst + first * run, part.size * run)
            n = call(pid, local, 1, remote, part.size, 0)
            if n != part.size * run:
                return copied + max(int(n), 0)
            copied += n
        return copied

    def _copy_pread(self, starts: np.ndarray, out: np.ndarray, run: int) -> int:
        assert self._fd is not None
        view = memoryview(out.reshape(-1).view(np.uint8))
        copied = 0
        for k, start in enumerate(starts.tolist()):
            n = os.preadv(self._fd, [view[k * run : (k + 1) * run]], self._data_offset + start)
            copied += n
            if n != run:
                break
        return copied
