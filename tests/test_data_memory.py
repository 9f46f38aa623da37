"""Streaming a memory-mapped file many times larger than the shuffle buffer keeps the
process's own memory bounded.

Measured as RssAnon from /proc/self/status: the process's anonymous resident memory (heap,
NumPy arrays). Pages of the memory-mapped file that were read count in RssFile instead:
they are the kernel's page cache, shared and dropped under memory pressure, so a stream
that reads a 320 MiB file through a memory map may show up to 320 MiB of RssFile without
holding any of it.
"""

import gc
import sys

import numpy as np
import pytest

from eqx_lowmem.data import DataStream

MiB = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")


def test_streaming_a_large_memmap_keeps_memory_bounded(tmp_path):
    n, sample = 5120, (128, 128)  # 64 KiB samples, a 320 MiB file
    path = tmp_path / "x.npy"
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, *sample))
    for start in range(0, n, 256):
        x[start : start + 256] = np.arange(start, start + 256, dtype=np.float32)[:, None, None]
    x.flush()
    del x
    file_bytes = path.stat().st_size

    stream = DataStream((path,), 32, shuffle_buffer=512, key=0)  # batches of 2 MiB
    gc.collect()
    before = peak = rss_anon()
    seen = np.zeros(n, np.int64)
    for _ in range(2):
        for (batch,) in stream:
            seen[batch[:, 0, 0].astype(np.int64)] += 1
            peak = max(peak, rss_anon())
    assert (seen == 2).all()
    growth = peak - before
    assert growth < 48 * MiB, f"anonymous memory grew by {growth / MiB:.0f} MiB"
    assert growth < file_bytes / 6

    # The measure sees what a stream holds: copying 64 MiB of the file shows up.
    before = rss_anon()
    held = np.array(np.load(path, mmap_mode="r")[:1024])
    assert rss_anon() - before > 60 * MiB
    del held
