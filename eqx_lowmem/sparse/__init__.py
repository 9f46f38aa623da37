"""Dynamic sparse training that stores less: sparse layers whose parameters (and so the
optimizer's state) are the non-zero weights only, and rewiring hooks for the training step.

- `SparseLinear`, `SparseConv2d`: drop-in sparse versions of `eqx.nn.Linear` / `eqx.nn.Conv2d`.
- `sparsify`, `densify`: convert a model's layers (uniform or ERK densities) and back.
- `dsr`, `set_`, `rigl`: rewiring as `make_step(..., after_update=hook)` (`DSRState`: the
  threshold DSR keeps in `TrainState.hook_state`).
- `stats`, `density`, `sparse_layers`: what the sparse layers hold.
"""

from ._convert import (
    SparseStats as SparseStats,
    densify as densify,
    density as density,
    erk_densities as erk_densities,
    sparse_layers as sparse_layers,
    sparsify as sparsify,
    stats as stats,
)
from ._layers import (
    SparseConv2d as SparseConv2d,
    SparseLinear as SparseLinear,
    is_sparse as is_sparse,
)
from ._rules import (
    DSRState as DSRState,
    allocate as allocate,
    dsr as dsr,
    rigl as rigl,
    set_ as set_,
)
from ._storage import index_dtype as index_dtype
