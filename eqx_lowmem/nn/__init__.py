"""Models with recomputation (remat) that really saves memory.

Every module's `__call__` takes one example; `jax.vmap` over the batch.
"""

from ._attention import ATTENTIONS as ATTENTIONS, resolve_attention as resolve_attention
from ._block import TransformerBlock as TransformerBlock
from ._encoder import (
    TransformerEncoder as TransformerEncoder,
    transformer_encoder as transformer_encoder,
)
from ._lm import CausalLM as CausalLM
from ._mlp import MLP as MLP, mlp as mlp
from ._norm import BatchNorm as BatchNorm, LayerNorm as LayerNorm
from ._remat import (
    BLOCK_NAMES as BLOCK_NAMES,
    DOTS_NAMES as DOTS_NAMES,
    MINIMAL_NAMES as MINIMAL_NAMES,
    PRESETS as PRESETS,
    Save as Save,
)
from ._stack import Stack as Stack, stack as stack
from ._wrn import WideBlock as WideBlock, WideResNet as WideResNet
