"""Dynamic sparse training that stores less: sparse layers whose parameters (and so the
optimizer's state) are the non-zero weights only, and rewiring hooks for the training step.

- `SparseLinear`, `SparseConv2d`: drop-in sparse versions of `eqx.nn.Linear` / `eqx.nn.Conv2d`.
- `sparsify`, `densify`: convert a model's layers (uniform or ERK densities) and back.
- `dsr`, `set_`, `rigl`: rewiring as `make_step(..., after_update=hook)` (DSR keeps its
  threshold in `TrainState.hook_state`).
- `stats`, `density`: what the sparse layers hold.
"""

from .._deprecated import moved as _moved
from ._convert import (
    densify as densify,
    density as density,
    sparsify as sparsify,
    stats as stats,
)
from ._layers import (
    SparseConv2d as SparseConv2d,
    SparseLinear as SparseLinear,
)
from ._rules import (
    dsr as dsr,
    rigl as rigl,
    set_ as set_,
)

__getattr__ = _moved(
    __name__,
    {
        "DSRState": "_rules",
        "SparseStats": "_convert",
        "allocate": "_rules",
        "erk_densities": "_convert",
        "index_dtype": "_storage",
        "is_sparse": "_layers",
        "sparse_layers": "_convert",
    },
)
