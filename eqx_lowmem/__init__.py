"""eqx_lowmem: train JAX/Equinox models when memory is the limit.

Subpackages, one concern each:

- `eqx_lowmem.nn`: models (MLP, transformer blocks and stacks) with recomputation (remat).
- `eqx_lowmem.train`: the accumulating training step, the Trainer, checkpoints.
- `eqx_lowmem.data`: a data stream over arrays, `.npy` memory maps and iterators.
- `eqx_lowmem.precision`: dtype policies, dynamic loss scaling, half-size optimizer state.
- `eqx_lowmem.memory`: where the memory of a training step goes, and a planner.

`save_model` and `load_model` (also in `eqx_lowmem.train`) write a model as plain
`eqx.tree_serialise_leaves` bytes and read it back, or from any checkpoint.
"""

import importlib.metadata
import pathlib
import re

from . import (
    data as data,
    memory as memory,
    nn as nn,
    precision as precision,
    sparse as sparse,
    train as train,
)
from .train import load_model as load_model, save_model as save_model


def _version() -> str:
    """The installed version; from an uninstalled checkout, the one its pyproject.toml
    states; otherwise "0+unknown". A bare checkout (`PYTHONPATH=.`) must import."""
    try:
        return importlib.metadata.version("eqx-lowmem")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = (pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text("utf-8")
    except OSError:
        return "0+unknown"
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "0+unknown"


__version__ = _version()
