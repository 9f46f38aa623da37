"""Names that left a package's public listing, kept for one release with a warning."""

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each of `names` (name -> the private module,
    relative to `package`, that holds it) still resolves, with a DeprecationWarning."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(
            f"{package}.{name} is no longer part of the public API and will be removed in "
            f"the next release (it stays in the private module {package}.{names[name]}, "
            "which may change without notice).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("." + names[name], package), name)

    return __getattr__
