"""The run directory's lock: one run writes checkpoints in a directory at a time.

An OS lock (`fcntl.flock`) held for the run, on the directory itself and on a lock file
that names the holder: the operating system releases it however the process ends, and
deleting the file by hand cannot admit a second writer.
"""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .._checks import check_path

LOCK_NAME = ".eqx_lowmem.lock"


class DirectoryLockedError(RuntimeError):
    """Another process holds the run directory (`lock_directory`)."""


@contextlib.contextmanager
def lock_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """Hold `directory` for one run: a second process (or a second holder in this one)
    gets `DirectoryLockedError` naming the holder, instead of both writing checkpoints.

    Creates the directory. The lock is `fcntl.flock` on the directory itself (deleting a
    file by hand cannot release it) and on `directory / LOCK_NAME`, which holds the
    holder's pid and host for the message; the operating system releases both when the
    process exits, however it exits (SIGKILL included), so a stale lock file does not block
    the next run. Not enforced on Windows (no `fcntl`) or on filesystems where `flock` is
    local to one host (some NFS set-ups); with several processes of one run, lock on
    process 0 only.

    Yields:
        The directory, as a `Path`.

    Raises:
        NotADirectoryError: if `directory` is a file.
        DirectoryLockedError: if another holder has it.
    """
    check_path("checkpoint_dir", directory, kind="directory")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"checkpoint_dir={str(directory)!r} is a file; pass a directory (it is created)."
        )
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory lock
        yield directory
        return
    with contextlib.ExitStack() as stack:
        dir_fd = _open_fd(stack, directory, os.O_RDONLY)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(directory, _holder(directory / LOCK_NAME)) from None
        except OSError:
            pass  # no flock on directories here: the lock file alone
        else:
            stack.callback(fcntl.flock, dir_fd, fcntl.LOCK_UN)
        fd = _open_fd(stack, directory / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise _locked(directory, _holder(directory / LOCK_NAME)) from None
        stack.callback(fcntl.flock, fd, fcntl.LOCK_UN)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {_host()}\n".encode(), 0)
        stack.callback(os.ftruncate, fd, 0)
        yield directory


def _open_fd(stack: contextlib.ExitStack, path: Path, flags: int) -> int:
    fd = os.open(path, flags, 0o666)
    stack.callback(os.close, fd)
    return fd


def _holder(lock_path: Path) -> str:
    try:
        return lock_path.read_text("utf-8", "replace").strip() or "unknown"
    except OSError:
        return "unknown"


def _locked(directory: Path, holder: str) -> DirectoryLockedError:
    return DirectoryLockedError(
        f"{directory} is in use by another run ({holder}); wait for it to finish, "
        "or give this run its own checkpoint_dir."
    )


def _host() -> str:
    try:
        return os.uname().nodename
    except AttributeError:  # Windows
        return os.environ.get("COMPUTERNAME", "this host")
