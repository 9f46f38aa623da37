"""Fashion-MNIST from the Debian package `dataset-fashion-mnist`, read with numpy."""

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

DEFAULT_PATH = Path("/usr/share/datasets/fashion-mnist")
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# idx type codes (LeCun's format): 0x08 unsigned byte is the only one Fashion-MNIST uses.
_UBYTE = 0x08
MISSING = (
    "Fashion-MNIST is not installed at {path}: install the Debian package with "
    "`sudo apt-get install dataset-fashion-mnist`, or pass path= to a folder holding "
    "{files}."
)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one gzipped idx file (unsigned bytes) into a uint8 array of its shape.

    Format: two zero bytes, the type code (0x08), the number of dimensions, then each
    dimension as a big-endian uint32, then the data in row-major order.

    Raises:
        ValueError: naming the file, for one that is not gzip (or is a truncated or
            corrupt one), not an unsigned-byte idx file, or whose length does not match
            its header.
    """
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(
            f"{path} is not a readable gzip file ({type(e).__name__}: {e}): it is truncated "
            "or corrupt. Reinstall the package (sudo apt-get install --reinstall "
            "dataset-fashion-mnist) or pass path= to a folder of intact files."
        ) from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an idx file (its magic number must start 0x0000).")
    if data[2] != _UBYTE:
        raise ValueError(f"{path}: idx type code 0x{data[2]:02x}; expected 0x08 (unsigned byte).")
    ndim = data[3]
    shape = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    start = 4 + 4 * ndim
    if len(data) - start != int(np.prod(shape)):
        raise ValueError(
            f"{path}: header says shape {shape} ({int(np.prod(shape))} bytes) but the file "
            f"holds {len(data) - start} bytes of data; it is truncated or corrupt."
        )
    return np.frombuffer(data, np.uint8, offset=start).reshape(shape).copy()


def fashion_mnist(
    split: str = "train", path: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST images and labels, read from the idx files of the Debian package
    `dataset-fashion-mnist` (no download at run time).

    Memory: the split in uint8, 47 MB for train (60,000 images), 7.8 MB for test (10,000).

    Args:
        split: `"train"` (60,000 samples) or `"test"` (10,000).
        path: the folder holding the four `*-idx?-ubyte.gz` files; default the package's
            `/usr/share/datasets/fashion-mnist`.

    Returns:
        `(images, labels)`: uint8 arrays of shape `(n, 28, 28)` and `(n,)`, labels 0-9.

    Raises:
        ValueError: for an unknown split, or files whose images and labels disagree.
        FileNotFoundError: when the files are absent, naming the package to install.

    A call on a machine with the package: `images, labels = fashion_mnist("test")` gives
    shapes `(10000, 28, 28)` and `(10000,)`.

    """
    if split not in _FILES:
        raise ValueError(f"split={split!r}; expected 'train' or 'test'.")
    folder = DEFAULT_PATH if path is None else Path(path)
    names = _FILES[split]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(MISSING.format(path=folder, files=", ".join(missing)))
    images = read_idx(folder / names[0])
    labels = read_idx(folder / names[1])
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{folder}: images {images.shape} and labels {labels.shape} do not match; "
            "expected (n, 28, 28) and (n,)."
        )
    return images, labels
