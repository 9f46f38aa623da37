"""A stack of transformer blocks: an `eqx_lowmem.nn.Stack` of `TransformerBlock`s."""

from typing import ClassVar, Literal

import equinox as eqx
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ._block import TransformerBlock
from ._remat import (
    BLOCK_NAMES,
    TRANSFORMER_PRESETS,
    RematArg,
    register_remat_names,
)
from ._stack import Stack, _check_segment

register_remat_names(TransformerBlock, BLOCK_NAMES, TRANSFORMER_PRESETS)


class TransformerEncoder(Stack):
    """`n_layers` `TransformerBlock`s with their parameters stacked on a leading axis.

    A `Stack` (see `eqx_lowmem.nn.stack`) of `TransformerBlock`s; build it with
    `transformer_encoder`. Layer `i` receives the dropout key `jr.fold_in(key, i)`, derived
    inside the loop, so recomputation (remat) regenerates the same dropout masks.
    """

    _scope: ClassVar[str] = "eqx_lowmem.nn.TransformerEncoder"

    def __call__(
        self, x: Float[Array, "seq d_model"], state: None = None, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq d_model"]:
        """Apply the stack to one example; `jax.vmap` over a batch.

        Args:
            x: one sequence, `(seq, d_model)`.
            state: unused (transformer blocks have no state).
            key: PRNG key for dropout; `None` turns dropout off.
        """
        d_model = self.blocks.d_model
        if x.ndim != 2 or x.shape[1] != d_model:
            raise ValueError(
                f"TransformerEncoder expects one example of shape (seq, {d_model}), got "
                f"{x.shape}; call it on a single sequence and jax.vmap over the batch."
            )
        return super().__call__(x, state, key=key)


def transformer_encoder(
    n_layers: int,
    d_model: int,
    n_heads: int,
    d_ff: int,
    *,
    key: PRNGKeyArray,
    dropout: float = 0.0,
    causal: bool = False,
    remat: RematArg = False,
    scan: bool = True,
    segment: int | Literal["sqrt"] | None = None,
    chunk_size: int | None | Literal["auto"] = "auto",
    attention: str = "auto",
) -> TransformerEncoder:
    """A stack of `n_layers` `TransformerBlock`s, parameters stacked with `eqx.filter_vmap`.

    Args:
        n_layers: number of blocks.
        d_model, n_heads, d_ff, dropout, causal, chunk_size, attention: as `TransformerBlock`.
        key: PRNG key for the initial weights.
        remat: each block's recomputation (`TransformerBlock`): `False`, `True`/`"full"`,
            `"dots"`, `"minimal"`, `"minimal_offloaded"` or `Save(*names, offload=...)`.
        scan: `True` runs the blocks with `jax.lax.scan`: compile time does not grow with
            depth, and recomputation really frees memory (XLA sees one block body). `False`
            runs the same blocks in a Python loop with the same numbers; XLA then schedules
            the unrolled program freely and may run a block's recomputation early, keeping
            its activations alive (measured on XLA:CPU: no memory saved at all).
        segment: checkpoint groups of this many consecutive blocks as a unit (Chen et al.,
            2016, "Training deep nets with sublinear memory cost", Section 4.3): only each
            segment's input is kept, and the backward pass recomputes one segment at a time
            with its blocks' own `remat`. `"sqrt"` uses `round(sqrt(n_layers))`, which makes
            memory O(sqrt(n_layers)) for one more forward pass. Any `n_layers` works; the last
            segment may be shorter.

    Returns:
        A `TransformerEncoder`, whose `__call__` maps one `(seq, d_model)` example.

    Raises:
        ValueError: on a non-positive `n_layers`, a bad `segment`, or any argument
            `TransformerBlock` rejects.

    Example:
        >>> import jax, jax.numpy as jnp, jax.random as jr
        >>> enc = transformer_encoder(4, 32, 4, 64, key=jr.PRNGKey(0), remat=True)
        >>> jax.vmap(enc)(jnp.ones((2, 10, 32))).shape
        (2, 10, 32)
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}.")
    segment = _check_segment(segment, n_layers)

    def make_block(k):
        return TransformerBlock(
            d_model,
            n_heads,
            d_ff,
            key=k,
            dropout=dropout,
            causal=causal,
            remat=remat,
            chunk_size=chunk_size,
            attention=attention,
        )

    blocks = eqx.filter_vmap(make_block)(jr.split(key, n_layers))
    return TransformerEncoder(
        blocks=blocks,
        n_layers=n_layers,
        remat=blocks.remat,
        segment=segment,
        scan=scan,
        stateful=False,
    )
