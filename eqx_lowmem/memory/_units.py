"""Sizes and settings as people write them: "2GiB", "512MiB", "1.5GB"; "remat=full"."""

import re
from typing import Any

import numpy as np

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(size: object, name: str = "size") -> int:
    """Bytes from an int or a string with a unit: `"2GiB"`, `"512MiB"`, `"1.5GB"`, `"4096"`.

    Takes any object (so that a wrong one gets this function's own clear error): an int of
    bytes or a str.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of
    1000; case is ignored. Fractions round down to whole bytes.

    Raises:
        TypeError: for anything but an int or a str (a float such as 2.5, a bool).
        ValueError: for a negative size, an unknown unit or text that is not a size.

    Example:
        >>> parse_size("1.5GiB"), parse_size("512MiB"), parse_size("2GB")
        (1610612736, 536870912, 2000000000)
    """
    if isinstance(size, np.integer):
        size = int(size)
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        hint = " (a fraction needs a unit: '2.5GiB')" if isinstance(size, float) else ""
        raise TypeError(
            f"{name} must be an int (bytes) or a string such as '2GiB', got "
            f"{type(size).__name__} {size!r}{hint}."
        )
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {size}.")
        return size
    match = _SIZE.match(size)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{name}={size!r} is not a byte size; expected a number and a unit such as "
            f"'2GiB', '512MiB', '1.5GB' or '4096' (units: KiB MiB GiB TiB KB MB GB TB)."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1: `"1.50 GiB"`, `"512.0 MiB"`.

    Example:
        >>> format_bytes(3 * 2**29), format_bytes(-2048), format_bytes(12)
        ('1.50 GiB', '-2.00 KiB', '12 B')
    """
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{sign}{value:.2f} {unit}" if value < 10 else f"{sign}{value:.1f} {unit}"
    return f"{sign}{int(n)} B"


def format_flops(flops: int | float) -> str:
    """A count of operations with an SI prefix: `"3.2 G"`."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} "


def remat_text(remat: Any) -> str:
    """A `remat=` setting by its preset name: `False` -> `"none"`, `True` -> `"full"`."""
    if remat is False or remat is None:
        return "none"
    if remat is True:
        return "full"
    return str(remat)
