"""Rows copied out of memory-mapped files by the kernel: the same bytes NumPy reads, and a
file truncated between the stream's check and its read is an error, not SIGBUS."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from eqx_lowmem.data import DataStream
from eqx_lowmem.data._mapped import MappedRows, _process_vm_readv

METHODS = ["pread"] + (["process_vm_readv"] if _process_vm_readv() is not None else [])


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
    with pytest.raises(ValueError, match="method='mmap'; expected 'process_vm_readv' or 'pread'"):
        MappedRows(x, tmp_path / "x.npy", 128, _never_changed, method="mmap")


# In a subprocess: before the kernel copied the rows, this read killed its process with
# SIGBUS (exit code -7), which no test in the same process could report.
TRUNCATED = """
import os, sys
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
os.truncate(path, 8192)  # after the stream's check, before its read: pages gone
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
