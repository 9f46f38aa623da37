"""Atomic file output: a reader never sees a half-written checkpoint, report or plot.

One writer for the whole library (checkpoints, memory reports, plots, benchmark results):
the data goes to a temporary file in the destination's directory, is flushed to disk
(`fsync`), and is renamed over the destination (`os.replace`, atomic on POSIX and Windows).
A process killed at any moment leaves the old file or the whole new one, never a torn one;
at worst a `.<name>.<random>.tmp` file beside it, which `clean_stale_temporaries` deletes.

The file gets the mode any file a program opens gets: `0o666 & ~umask` (`tempfile.mkstemp`
alone would leave it `0o600`, readable by its owner only).
"""

import io
import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

# Temporaries are named `.<name>.<16 hex digits>.tmp` beside their destination.
TEMP_SUFFIX = ".tmp"


def _umask() -> int:
    # The only portable way to read the umask is to set it; restore it at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temporary(path: Path) -> tuple[int, Path]:
    """A new file beside `path`, opened for writing, with the mode the umask allows."""
    mode = 0o666 & ~_umask()
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            # O_EXCL: never reuse another writer's temporary. The mode passed to open is
            # filtered by the umask, as for any file; fchmod makes it exact even where a
            # default ACL would narrow it.
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode
            )
        except FileExistsError:
            continue
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        return fd, tmp


def atomic_write(
    path: str | os.PathLike, data: bytes | bytearray | memoryview | Callable[[BinaryIO], Any]
) -> Path:
    """Write `data` to `path` atomically: whole or not at all, also when the process dies.

    A symlink is followed: its target is replaced, the link kept. A named pipe or a
    character device (`/dev/stdout`, a terminal) is written into as it is, not replaced
    (not atomic: there is no file to rename).

    Args:
        path: the destination. Its directory is created if missing.
        data: the bytes to write, or a function that writes them to the binary file object it
            is given (e.g. `lambda f: np.save(f, x)` or `figure.savefig`).

    Returns:
        `path`, as a `Path`.

    Raises:
        TypeError: if `data` is neither bytes nor callable.
        IsADirectoryError: if `path` is a directory.
        ValueError: for an empty path, a socket or a block device.
        Whatever `data(file)` raises; the temporary file is removed first.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> p = atomic_write(os.path.join(d, "a.bin"), b"hello")
        >>> p.read_bytes()
        b'hello'
        >>> os.listdir(d)  # no temporary left behind
        ['a.bin']
    """
    if not (isinstance(data, (bytes, bytearray, memoryview)) or callable(data)):
        raise TypeError(
            f"atomic_write(data=...) got a {type(data).__name__}; expected bytes or a function "
            "that writes to a binary file object."
        )
    if os.fspath(path) == "":
        raise ValueError("cannot write '': expected a file name, got an empty path.")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {str(path)!r}: it is a directory.")
    if path.exists() and not path.is_file():
        return _write_through(path, data)
    if path.is_symlink():  # to a regular file, or dangling: replace (or create) its target
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _write_through(path: Path, data: Any) -> Path:
    """Write into `path` as it is: a named pipe, a terminal, `/dev/stdout` or another device
    (a temporary renamed over it would replace it by a regular file). Not atomic (there is
    nothing to rename); a writing function gets a seekable buffer, written out whole."""
    if not stat.S_ISFIFO(path.stat().st_mode) and not stat.S_ISCHR(path.stat().st_mode):
        raise ValueError(
            f"cannot write {str(path)!r}: it is neither a regular file, a named pipe nor a "
            "character device (a socket or block device); give a file name."
        )
    if callable(data):
        buffer = io.BytesIO()
        data(buffer)
        data = buffer.getbuffer()
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data).cast("B")
        while view:
            view = view[f.write(view) :]
    return path


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> Path:
    """Write `obj` as JSON (UTF-8, a final newline) to `path`, atomically.

    Example:
        >>> import os, tempfile, json
        >>> p = write_json(os.path.join(tempfile.mkdtemp(), "r.json"), {"a": 1})
        >>> json.loads(p.read_text())
        {'a': 1}
    """
    text = json.dumps(obj, indent=indent) + "\n"
    return atomic_write(path, text.encode("utf-8"))


def _is_token(token: str) -> bool:
    """The random part of a temporary's name as `atomic_write` makes it: 16 hex digits.
    (Eight-character `tempfile.mkstemp` names are other programs': never ours to delete.)"""
    return len(token) == 16 and all(c in "0123456789abcdef" for c in token)


def clean_stale_temporaries(
    directory: str | os.PathLike, name: str | Callable[[str], bool] | None = None
) -> list[Path]:
    """Delete the temporaries that killed writers left in `directory`.

    Only files named as `atomic_write` names them (`.<name>.<16 hex digits>.tmp`) are
    removed; with `name` (a destination's name, or a test of one) only those of the
    destinations it names. Call it only while no other writer can use the directory (e.g.
    while holding the directory's lock): a live writer's temporary looks the
    same as a dead one's.

    Returns:
        The paths removed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    wanted = (lambda stem: stem == name) if isinstance(name, str) else name
    removed = []
    for p in directory.iterdir():
        n = p.name
        if not (n.startswith(".") and n.endswith(TEMP_SUFFIX)):
            continue
        stem, _, token = n[1 : -len(TEMP_SUFFIX)].rpartition(".")
        if not stem or not _is_token(token):
            continue
        if wanted is not None and not wanted(stem):
            continue
        if p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)
            removed.append(p)
    return sorted(removed)
