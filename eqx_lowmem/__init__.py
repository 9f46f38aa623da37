"""eqx_lowmem: train JAX/Equinox models when memory is the limit.

Subpackages, one concern each:

- `eqx_lowmem.nn`: models (MLP, transformer blocks and stacks) with recomputation (remat).
- `eqx_lowmem.train`: the accumulating training step, the Trainer, checkpoints.
- `eqx_lowmem.data`: a data stream over arrays, `.npy` memory maps and iterators.
- `eqx_lowmem.precision`: dtype policies, dynamic loss scaling, half-size optimizer state.
- `eqx_lowmem.memory`: where the memory of a training step goes, and a planner.
"""

import importlib.metadata

from . import data as data, memory as memory, nn as nn, precision as precision, train as train

__version__ = importlib.metadata.version("eqx-lowmem")
