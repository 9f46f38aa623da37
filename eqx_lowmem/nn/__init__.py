"""Models with recomputation (remat) that really saves memory.

Every module's `__call__` takes one example; `jax.vmap` over the batch.

What a model family provides to get the step's per-block features
-----------------------------------------------------------------
Three features of `eqx_lowmem.train.make_step` act on a model one block at a time, and only
inside an `eqx_lowmem.nn.Stack` (`stack(make_block, n, key=key, ...)`; `transformer_encoder`,
`CausalLM` and `WideResNet` keep their repeated blocks in stacks). Everything outside a stack
gets the whole-model form of each feature instead, with no error and no warning.

- Blocks: built by one function of a key with the same structure, static fields and
  shapes; each maps one example `x` to the same shape and dtype, `block(x, *, key=None)`
  (with `stateful=True`: `block(x, state, *, key=None) -> (y, state)`). Layer `i` gets
  the key `jr.fold_in(key, i)`; a module with a `dropout` field above 0 (or an
  `eqx.nn.Dropout`) makes `Step.init` require a loss that takes a `key`.
- Per-block 16-bit casting (`precision="mixed_*"`): a stack's parameters are cast one
  layer at a time inside its loop; every other floating array is cast when the loss is
  entered and its 16-bit copy lives through the step.
- Per-layer FSDP gathering (`shard="fsdp"`): every module with a static `layer_spec` field
  is treated as a stack: the step writes into `layer_spec` the axis each of its arrays is
  split on, passes those arrays into the loss sharded, and gathers one layer's slices
  where the module calls `eqx_lowmem.nn._layers.prepare_layer(self, layer_arrays)` inside
  its recomputed region (`Stack` does both). Other arrays are gathered whole at the loss.
- Fused accumulation (`accumulate > 1`, `fuse_accumulation=True`, the default): a stack
  run by `lax.scan` (`scan=True`) whose every block is recomputed (`remat=True`) or every
  segment (`segment=k`), called on the very arrays the step differentiates (not a copy
  made in the loss), per example under `jax.vmap` or through `Stack.batched` (a stateful
  stack: `batched` only). A stack set up so but not fused makes the step warn
  (`FusionWarning`, with the reason); any other array keeps a micro-batch gradient beside
  the accumulator (`memory_report` counts it under "gradients").
"""

from .._deprecated import moved as _moved
from ._batch_eval import apply_with_batch_statistics as apply_with_batch_statistics
from ._block import TransformerBlock as TransformerBlock
from ._encoder import (
    TransformerEncoder as TransformerEncoder,
    transformer_encoder as transformer_encoder,
)
from ._fuse import FusionWarning as FusionWarning
from ._lm import CausalLM as CausalLM
from ._mlp import MLP as MLP, mlp as mlp
from ._norm import BatchNorm as BatchNorm, GroupNorm as GroupNorm, LayerNorm as LayerNorm
from ._remat import (
    Save as Save,
)
from ._stack import Stack as Stack, stack as stack
from ._wrn import WideResNet as WideResNet

__getattr__ = _moved(
    __name__,
    {
        "ATTENTIONS": "_attention",
        "BLOCK_NAMES": "_remat",
        "DOTS_NAMES": "_remat",
        "MINIMAL_NAMES": "_remat",
        "PRESETS": "_remat",
        "WideBlock": "_wrn",
        "resolve_attention": "_attention",
    },
)
