"""The Fashion-MNIST loader: the idx format on hand-made files, and the real package."""

import gzip

import numpy as np
import pytest

import eqx_lowmem as el
from eqx_lowmem.data._fashion_mnist import DEFAULT_PATH, read_idx


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    with gzip.open(path, "wb") as f:
        f.write(header + np.ascontiguousarray(array, np.uint8).tobytes())


def test_reads_hand_made_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 0, 9, 1, 1], np.uint8)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels)
    x, y = el.data.fashion_mnist("test", path=tmp_path)
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(y, labels)
    assert x.dtype == np.uint8 and y.dtype == np.uint8 and x.flags.writeable


def test_bad_files_and_arguments(tmp_path):
    with pytest.raises(ValueError, match="split='valid'"):
        el.data.fashion_mnist("valid")
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        el.data.fashion_mnist("train", path=tmp_path)
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"\x12\x34\x08\x01" + np.asarray([3], ">u4").tobytes() + b"ab")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(bad)
    with gzip.open(bad, "wb") as f:
        f.write(b"\x00\x00\x08\x01" + np.asarray([3], ">u4").tobytes() + b"ab")
    with pytest.raises(ValueError, match="truncated"):
        read_idx(bad)
    with gzip.open(bad, "wb") as f:
        f.write(b"\x00\x00\x0d\x01" + np.asarray([1], ">u4").tobytes() + b"abcd")
    with pytest.raises(ValueError, match="type code 0x0d"):
        read_idx(bad)
    # Garbage and a gzip cut short: named, not a bare BadGzipFile or EOFError.
    (tmp_path / "garbage.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"garbage.gz is not a readable gzip file.*reinstall"):
        read_idx(tmp_path / "garbage.gz")
    _write_idx(tmp_path / "cut.gz", np.zeros((100, 28, 28), np.uint8))
    (tmp_path / "cut.gz").write_bytes((tmp_path / "cut.gz").read_bytes()[:60])
    with pytest.raises(ValueError, match=r"cut.gz is not a readable gzip file \(EOFError"):
        read_idx(tmp_path / "cut.gz")
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", np.zeros((4, 28, 28), np.uint8))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros((3,), np.uint8))
    with pytest.raises(ValueError, match="do not match"):
        el.data.fashion_mnist("test", path=tmp_path)


@pytest.mark.skipif(
    not (DEFAULT_PATH / "t10k-labels-idx1-ubyte.gz").exists(),
    reason="Fashion-MNIST absent: install the Debian package dataset-fashion-mnist",
)
def test_the_real_dataset():
    x, y = el.data.fashion_mnist("test")
    assert x.shape == (10000, 28, 28) and y.shape == (10000,)
    np.testing.assert_array_equal(np.bincount(y), [1000] * 10)  # balanced classes
    assert 60 < x.mean() < 90  # grey images, not noise or zeros
    x, y = el.data.fashion_mnist("train")
    assert x.shape == (60000, 28, 28) and np.bincount(y).tolist() == [6000] * 10
