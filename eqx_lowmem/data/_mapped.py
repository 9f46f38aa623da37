"""Copying rows out of a memory-mapped file so that a file shrunk under the stream raises
`RuntimeError` instead of killing the process with SIGBUS.

A load from a mapped page that a truncation removed is a SIGBUS, and no Python code can
catch it. The stream checks each file before it reads (`Watched.check`), but a truncation
between that check and the copy would still be fatal. Three ways to close that window, the
first this process may use:

- `"lease"`: a read lease on the file (`fcntl(F_SETLEASE, F_RDLCK)`, Linux). While it is
  held, the kernel makes any process (this one included) that opens the file for writing
  or truncates it wait until the lease is given up, so NumPy copies straight from the
  mapping, at NumPy's speed. A thread checks each lease every `POLL_S` seconds and gives
  up one that a writer is waiting on, after the copy in progress (at most `POLL_S` of
  delay for the writer); the file's rows are then copied by the kernel, as below. The
  kernel takes back a lease a writer has waited on for `/proc/sys/fs/lease-break-time`
  (45 s by default), so a copy under a lease not seen standing for half that time asks
  the kernel first: a lease taken back is never read through. Refused for a file open
  for writing anywhere, one owned by another user (without `CAP_LEASE`), or on a
  filesystem without leases (NFS). A forked child, which no thread of its own watches,
  opens each file again and leaves the lease to its parent: the kernel copies there.
- `"process_vm_readv"` on this process's own address space (Linux 3.2 or later) copies
  the rows from the mapping with one system call per 1,024 rows; a page past the end of
  the file makes the call return short with `EFAULT`, and no signal is sent.
- `"pread"` (where that is refused: a seccomp profile, another OS) reads the same bytes
  from the file, one call per row: a short read is the same signal.

Either kernel copy reports a short copy as the file having changed, naming it.
"""

import ctypes
import ctypes.util
import functools
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from ._sources import copy_rows, empty_rows, row_gather

if sys.platform != "win32":  # leases: Linux's fcntl; elsewhere `_take_lease` refuses
    import fcntl

_IOV_MAX = 1024  # Linux's limit on the iovecs of one call (UIO_MAXIOV)
POLL_S = 0.01  # how often each lease is checked for a waiting writer
_F_SETSIG = 10  # Linux's fcntl command (not in Python's fcntl module)
METHODS = ("lease", "process_vm_readv", "pread")


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


def _lease_break_s() -> float:
    """How long the kernel lets a lease holder make a writer wait (0 where unknown)."""
    try:
        with open("/proc/sys/fs/lease-break-time") as f:
            return float(f.read())
    except (OSError, ValueError):
        return 0.0


def _take_lease(fd: int) -> bool:
    """Whether a read lease on `fd`'s file was granted. Its break needs no signal (the
    watch thread polls), but the kernel sends one to the lease's taker, by default SIGIO,
    which ends the process: so the signal is set to SIGURG (ignored by default) before
    the lease is taken, and no process is named to receive it after."""
    if sys.platform == "win32" or not hasattr(fcntl, "F_SETLEASE") or _lease_break_s() < 1.0:
        return False
    try:
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # open for writing somewhere, another user's file, no leases here
        return False
    fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
    return True


class _LeaseWatch:
    """The thread that gives up each lease a writer waits on (at most one per process,
    running while any `MappedRows` holds a lease)."""

    lock = threading.Lock()
    leased: "weakref.WeakSet[MappedRows]" = weakref.WeakSet()
    thread: threading.Thread | None = None

    @classmethod
    def add(cls, rows: "MappedRows") -> None:
        with cls.lock:
            cls.leased.add(rows)
            if cls.thread is None:
                cls.thread = threading.Thread(target=cls._run, name="eqx_lowmem-leases",
                                              daemon=True)  # fmt: skip
                cls.thread.start()

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(POLL_S)
            with cls.lock:
                leased = list(cls.leased)
                if not leased:
                    cls.thread = None
                    return
            for rows in leased:
                rows._keep_lease()
            leased = rows = None  # no reference past the check: a stream's rows can go

    @classmethod
    def after_fork(cls) -> None:
        """In a forked child: the leases belong to the parent's open files, which the child
        shares, and no thread watches them here. Each file is opened again for the
        child's own reads, which the kernel copies."""
        cls.lock, cls.thread = threading.Lock(), None
        for rows in list(cls.leased):
            rows._lock = threading.Lock()
            try:
                fd = os.open(rows._path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # gone: the kernel's copy still reads the mapping
                fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            os.dup2(fd, rows._fd, inheritable=False)  # drops the child's hold on the lease
            os.close(fd)
            rows.method = rows._kernel
        cls.leased = weakref.WeakSet()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_LeaseWatch.after_fork)


class MappedRows:
    """Rows of a read-only memory-mapped array `array`, the data of file `path` from byte
    `data_offset`, copied into fresh arrays under a read lease or by the kernel (see the
    module's docstring).

    `changed()` is called when a kernel copy comes back short; it raises the error that
    names the file and what happened to it. `method` is one of `METHODS`, or None for the
    first that this process may use; `.method` says which copies now (a lease given up
    leaves the kernel's).
    """

    def __init__(
        self,
        array: np.ndarray,
        path: os.PathLike,
        data_offset: int,
        changed: Callable[[], None],
        method: str | None = None,
    ):
        if method is not None and method not in METHODS:
            raise ValueError(f"method={method!r}; expected one of {METHODS} or None.")
        if method == "process_vm_readv" and _process_vm_readv() is None:
            raise OSError("process_vm_readv is not available to this process.")
        self._fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self._fd)  # closing it ends the lease
        if method in (None, "lease") and _take_lease(self._fd):
            method = "lease"
        elif method == "lease":
            raise OSError(f"no read lease on {os.fspath(path)!r} for this process.")
        self._lock = threading.Lock()  # the lease is given up between copies only
        self._seen = time.monotonic()  # when the lease was last seen standing
        self._trust_s = _lease_break_s() / 2
        self._kernel = "process_vm_readv" if _process_vm_readv() is not None else "pread"
        self.method = method or self._kernel
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
        # Under the lease: NumPy's copy, C-ordered as the kernel's.
        self._numpy_gather = row_gather(array)
        self._numpy_slice = copy_rows(array)
        if self.method == "lease":
            _LeaseWatch.add(self)

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Rows `indices` (non-negative, in range) as a fresh C-ordered array."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        with self._lock:
            if self._leased():
                return self._numpy_gather(indices)
        out = empty_rows(indices.size, self._sample_shape, self._dtype)
        if out.nbytes == 0:
            return out
        starts = indices[:, None] * self._row_stride + self._runs[None, :]
        self._copy(starts.reshape(-1), out)
        return out

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` as a fresh array: one run when rows are contiguous."""
        with self._lock:
            if self._leased():
                return self._numpy_slice(start, stop)
        if self._rows_contiguous:
            out = empty_rows(stop - start, self._sample_shape, self._dtype)
            if out.nbytes:
                self._copy(np.array([start * self._row_stride], np.int64), out, out.nbytes)
            return out
        return self.gather(np.arange(start, stop))

    def _leased(self) -> bool:
        """Whether the lease still stands (called holding `_lock`): while it does, no
        truncation can complete before `_lock` is released. Else the kernel copies.

        A lease seen standing less than `_trust_s` (half the kernel's lease-break-time)
        ago is not asked again: a writer that came since has waited less than that, so
        the kernel has not taken the lease back, and a copy takes far less than the
        other half. (The question is a system call, a tenth of a small batch's copy.)
        """
        if self.method == "lease" and time.monotonic() - self._seen > self._trust_s:
            if not self._lease_stands():
                self._give_up_lease()
        return self.method == "lease"

    def _lease_stands(self) -> bool:
        """No writer waits on the lease, and the kernel has not taken it back."""
        seen = time.monotonic()
        try:
            stands = fcntl.fcntl(self._fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK
        except OSError:
            return False
        if stands:
            self._seen = seen
        return stands

    def _keep_lease(self) -> None:
        """Give the lease up, after the copy in progress, if a writer waits on it."""
        if self.method == "lease" and not self._lease_stands():
            with self._lock:
                self._give_up_lease()

    def _give_up_lease(self) -> None:
        """From now on the kernel copies (called holding `_lock`)."""
        if self.method != "lease":
            return
        self.method = self._kernel
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass  # already taken back by the kernel
        with _LeaseWatch.lock:
            _LeaseWatch.leased.discard(self)

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
        view = memoryview(out.reshape(-1).view(np.uint8))
        copied = 0
        for k, start in enumerate(starts.tolist()):
            n = os.preadv(self._fd, [view[k * run : (k + 1) * run]], self._data_offset + start)
            copied += n
            if n != run:
                break
        return copied
