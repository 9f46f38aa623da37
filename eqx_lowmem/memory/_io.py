"""Atomic file output: a reader never sees a half-written JSON or PNG."""

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(
    path: "str | os.PathLike[str]", write: Callable[[Any], None], *, binary: bool
) -> Path:
    """Call `write(file)` on a temporary file beside `path`, then rename it over `path`.

    The rename is atomic on POSIX and Windows: `path` holds either its old content or the
    whole new one, also when the process dies midway.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_json(path: "str | os.PathLike[str]", payload: Any) -> Path:
    """Write `payload` as indented JSON to `path`, atomically."""

    def write(f):
        json.dump(payload, f, indent=2)
        f.write("\n")

    return atomic_write(path, write, binary=False)
