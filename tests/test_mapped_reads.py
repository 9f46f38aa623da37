"""Rows copied out of memory-mapped files by the kernel: the same bytes NumPy reads, and a
file truncated between the stream's check and its read is an error, not SIGBUS."""

import gc
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from eqx_lowmem.data import DataStream
from eqx_lowmem.data._mapped import POLL_S, MappedRows, _LeaseWatch, _process_vm_readv, _take_lease

METHODS = ["pread"] + (["process_vm_readv"] if _process_vm_readv() is not None else []) + ["lease"]


def _never_changed():
    raise AssertionError("the copy came back short")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "array",
    [
        np.arange(3000 * 5, dtype=np.float32).reshape(3000, 5),  # C order, 20-byte rows
        np.asfortranarray(np.arange(300 * 4 * 3, dtype=np.int16).reshape(300, 4, 3)),
        np.arange(2500, dtype=np.uint8),  # 1-D: one byte a row
        np.arange(50 * 2 * 2, dtype=np.float64).reshape(50, 2, 2)[:, :, :1].copy(),
    ],
    ids=["c", "fortran", "1d", "3d-c"],
)
def test_gather_and_slice_equal_numpys(tmp_path, method, array):
    path = tmp_path / "x.npy"
    np.save(path, array)
    mapped = np.load(path, mmap_mode="r").view(np.ndarray)
    with path.open("rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        offset = f.tell()
    rows = MappedRows(mapped, path, offset, _never_changed, method=method)
    assert rows.method == method
    rng = np.random.default_rng(0)
    n = array.shape[0]
    # More than 1,024 rows at once: several system calls of at most 1,024 runs.
    for indices in [np.array([0, n - 1]), np.sort(rng.choice(n, min(n, 2100), replace=False))]:
        got = rows.gather(indices)
        np.testing.assert_array_equal(got, array[indices])
        assert got.flags.c_contiguous and got.dtype == array.dtype
    np.testing.assert_array_equal(rows.slice(3, n - 2), array[3 : n - 2])
    assert rows.gather(np.array([], np.int64)).shape == (0, *array.shape[1:])


def test_an_unknown_method_is_refused(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    with pytest.raises(ValueError, match=r"method='mmap'; expected one of \('lease', "):
        MappedRows(x, tmp_path / "x.npy", 128, _never_changed, method="mmap")


# In a subprocess: before the kernel copied the rows, this read killed its process with
# SIGBUS (exit code -7), which no test in the same process could report.
TRUNCATED = """
import os, sys, time
import numpy as np
from eqx_lowmem.data import DataStream

path, method, safe = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
np.save(path, np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256))  # 4 MiB
stream = DataStream((path,), 64, key=0, safe_reads=safe)
if safe:
    from eqx_lowmem.data._mapped import MappedRows
    w = stream._watched[0]
    stream._mapped[0] = MappedRows(stream._arrays[0], path, w.data_offset, w.check,
                                   method=method)
rows = (stream._mapped[0].gather if safe else lambda i: stream._arrays[0][i].copy())
print(rows(np.array([1, 4000]))[:, 0].tolist(), flush=True)
t = time.perf_counter()
os.truncate(path, 8192)  # after the stream's check, before its read: pages gone
print(f"truncate waited {time.perf_counter() - t:.3f} s", file=sys.stderr, flush=True)
try:
    rows(np.array([1, 4000]))
except RuntimeError as e:
    print("RuntimeError:", e, flush=True)
"""


@pytest.mark.parametrize("method", METHODS)
def test_a_file_truncated_after_the_check_raises_instead_of_sigbus(tmp_path, method):
    path = tmp_path / "x.npy"
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRUNCATED), str(path), method, "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    # Under a lease the truncation in the same process waits for the lease to be given
    # up: a poll's time, not the kernel's lease-break-time (45 s by default).
    waited = float(run.stderr.split("truncate waited ")[1].split(" s")[0])
    assert waited < 1.0, run.stderr[-2000:]
    first, error = run.stdout.splitlines()
    assert first == "[256.0, 1024000.0]"
    assert error.startswith("RuntimeError: source[0] = ") and "x.npy' changed while" in error
    assert "size 4194432 -> 8192 bytes" in error


def test_reading_the_mapping_directly_is_the_sigbus_the_kernel_copy_avoids(tmp_path):
    # The same read with safe_reads=False: the process dies of SIGBUS. This is the failure
    # the default closes; it shows the test above would catch a return to plain reads.
    path = tmp_path / "x.npy"
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRUNCATED), str(path), "none", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == -7, (run.returncode, run.stdout, run.stderr[-2000:])


@pytest.mark.parametrize("shuffle", [None, 7])
def test_safe_and_plain_reads_serve_the_same_batches(tmp_path, shuffle):
    x = np.arange(103 * 6, dtype=np.int32).reshape(103, 6)
    y = np.arange(103, dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    key = None if shuffle is None else 0
    streams = [
        DataStream((tmp_path / "x.npy", y), 10, shuffle, key=key, safe_reads=safe)
        for safe in (True, False)
    ]
    assert streams[0]._mapped and not streams[1]._mapped
    safe, plain = (list(s) for s in streams)
    assert len(safe) == len(plain) == 11
    for a, b in zip(safe, plain, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[0][:, 0] // 6, a[1])  # rows stay with their labels


def test_safe_reads_must_be_a_bool():
    # The suite's run-time type checker or, without it, the stream's own check.
    with pytest.raises(TypeError, match=r"(?s)safe_reads.*'yes'"):
        DataStream((np.zeros(4),), 2, safe_reads="yes")


def _npy(tmp_path, rows=4096):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(rows * 256, dtype=np.float32).reshape(rows, 256))
    return path


def _leases_granted(tmp_path) -> bool:
    path = tmp_path / "probe"
    path.write_bytes(b"0")
    fd = os.open(path, os.O_RDONLY)
    try:
        return _take_lease(fd)
    finally:
        os.close(fd)


def test_a_file_open_for_writing_is_copied_by_the_kernel_and_others_under_a_lease(tmp_path):
    if not _leases_granted(tmp_path):
        pytest.skip("this filesystem or kernel grants no read leases")
    path = _npy(tmp_path)
    assert DataStream((path,), 64, key=0)._mapped[0].method == "lease"
    with path.open("r+b"):  # a writer: no lease, the kernel copies
        stream = DataStream((path,), 64, key=0)
        assert stream._mapped[0].method in ("process_vm_readv", "pread")
        batch = next(iter(stream))[0]
    ids = batch[:, 0] // 256
    np.testing.assert_array_equal(batch, ids[:, None] * 256 + np.arange(256, dtype=np.float32))


# Another process truncates the file the stream reads under a lease.
TRUNCATE = (
    "import os, sys, time; t = time.perf_counter(); os.truncate(sys.argv[1], 8192); "
    "print(time.perf_counter() - t)"
)


def test_a_writer_in_another_process_waits_for_the_lease_and_the_stream_then_raises(tmp_path):
    if not _leases_granted(tmp_path):
        pytest.skip("this filesystem or kernel grants no read leases")
    path = _npy(tmp_path)
    stream = DataStream((path,), 64, key=0)
    rows = stream._mapped[0]
    assert rows.method == "lease"
    assert rows.gather(np.array([4000]))[0, 0] == 4000 * 256
    run = subprocess.run([sys.executable, "-c", TRUNCATE, str(path)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout) < 1.0  # the lease was given up at once, not after 45 s
    assert os.path.getsize(path) == 8192
    assert rows.method in ("process_vm_readv", "pread")  # the kernel copies from now on
    with pytest.raises(RuntimeError, match=r"x\.npy' changed while.*4194432 -> 8192 bytes"):
        rows.gather(np.array([4000]))
    with pytest.raises(RuntimeError, match="changed while"):
        next(iter(stream))


def test_a_dropped_stream_gives_its_lease_up_and_the_watch_ends(tmp_path):
    if not _leases_granted(tmp_path):
        pytest.skip("this filesystem or kernel grants no read leases")
    stream = DataStream((_npy(tmp_path),), 64, key=0)
    assert stream._mapped[0] in _LeaseWatch.leased
    del stream
    gc.collect()
    deadline = time.monotonic() + 100 * POLL_S
    while _LeaseWatch.thread is not None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert not _LeaseWatch.leased and _LeaseWatch.thread is None


# A child forked while the parent's stream holds a lease, the parent's stream then dropped.
FORKED = """
import gc, os, sys, time
import numpy as np
from eqx_lowmem.data import DataStream

path = sys.argv[1]
np.save(path, np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256))
stream = DataStream((path,), 64, key=0)
rows = stream._mapped[0]
assert rows.method == "lease", rows.method
ready, go = os.pipe(), os.pipe()
if os.fork() == 0:  # the child: reads through the kernel, on a file of its own
    os.close(go[1])  # so that a parent gone early ends the wait below
    ok = rows.method != "lease" and rows.gather(np.array([7]))[0, 0] == 7 * 256
    os.write(ready[1], b"1" if ok else b"0")
    os.read(go[0], 1)  # the parent has truncated the file
    try:
        rows.gather(np.array([4000]))
        os._exit(3)
    except RuntimeError:
        os._exit(0)
os.close(go[0])
assert os.read(ready[0], 1) == b"1", "the child did not read through the kernel"
del stream, rows
gc.collect()
t = time.perf_counter()
os.truncate(path, 8192)  # the child still runs: does it hold the lease?
print(f"{time.perf_counter() - t:.3f}", flush=True)
os.write(go[1], b"1")
_, status = os.wait()
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_holds_no_lease_and_reads_through_the_kernel(tmp_path):
    if not _leases_granted(tmp_path):
        pytest.skip("this filesystem or kernel grants no read leases")
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(FORKED), str(tmp_path / "x.npy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    waited, child = run.stdout.split()
    assert float(waited) < 1.0  # not the kernel's 45 s for a lease nobody watches
    assert child == "0"  # the child's read of the truncated file raised, no SIGBUS


@pytest.mark.parametrize("method", METHODS)
def test_large_reads_start_on_a_64_byte_boundary(tmp_path, method):
    # From 64 KiB a read lands where XLA:CPU uses it in place (see test_data_stream).
    array = np.arange(96 * 1024, dtype=np.float32).reshape(96, 1024)  # 4 KiB rows
    path = tmp_path / "x.npy"
    np.save(path, array)
    with path.open("rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        offset = f.tell()
    mapped = np.load(path, mmap_mode="r").view(np.ndarray)
    rows = MappedRows(mapped, path, offset, _never_changed, method=method)
    indices = np.arange(1, 96, 3)  # 32 rows: 128 KiB
    for got, want in [(rows.gather(indices), array[indices]), (rows.slice(5, 37), array[5:37])]:
        np.testing.assert_array_equal(got, want)
        assert got.ctypes.data % 64 == 0 and got.flags.c_contiguous
