"""A stack of transformer blocks, run by `lax.scan` over stacked parameters."""

import functools
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ._block import TransformerBlock
from ._remat import RematArg


class TransformerEncoder(eqx.Module):
    """`n_layers` `TransformerBlock`s with their parameters stacked on a leading axis.

    Build it with `transformer_encoder`. Layer `i` receives the dropout key
    `jr.fold_in(key, i)`, derived inside the loop, so recomputation (remat) regenerates the
    same dropout masks.
    """

    blocks: TransformerBlock  # every array has a leading axis of size n_layers
    n_layers: int = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    segment: int | None = eqx.field(static=True)

    def __call__(
        self, x: Float[Array, "seq d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq d_model"]:
        """Apply the stack to one example; `jax.vmap` over a batch.

        Args:
            x: one sequence, `(seq, d_model)`.
            key: PRNG key for dropout; `None` turns dropout off.
        """
        d_model = self.blocks.d_model
        if x.ndim != 2 or x.shape[1] != d_model:
            raise ValueError(
                f"TransformerEncoder expects one example of shape (seq, {d_model}), got "
                f"{x.shape}; call it on a single sequence and jax.vmap over the batch."
            )
        params, static = eqx.partition(self.blocks, eqx.is_array)
        with jax.named_scope("eqx_lowmem.nn.TransformerEncoder"):
            if self.segment is None:
                return self._run_blocks(params, static, x, key, 0)
            return self._run_segments(params, static, x, key)

    def _run_blocks(self, params, static, x: Array, key, first) -> Array:
        """The blocks whose stacked parameters are `params`; layer indices start at `first`."""
        count = jax.tree.leaves(params)[0].shape[0]

        def body(h, layer):
            p, i = layer
            block = eqx.combine(p, static)
            layer_key = None if key is None else jr.fold_in(key, i)
            return block.apply(h, key=layer_key, prevent_cse=not self.scan), None

        indices = first + jnp.arange(count)
        if self.scan:
            x, _ = jax.lax.scan(body, x, (params, indices))
        else:
            for j in range(count):
                x, _ = body(x, jax.tree.map(lambda a, j=j: a[j], (params, indices)))
        return x

    def _run_segments(self, params, static, x: Array, key) -> Array:
        """Chen et al. (2016): keep each segment's input only; recompute a segment at a time."""
        seg = self.segment
        assert seg is not None
        n_full, rest = divmod(self.n_layers, seg)

        @functools.partial(
            jax.checkpoint,
            policy=jax.checkpoint_policies.nothing_saveable,
            prevent_cse=not self.scan,
        )
        def run_segment(p, h, first):
            return self._run_blocks(p, static, h, key, first)

        def take(start, stop):
            return jax.tree.map(lambda a: a[start:stop], params)

        if self.scan and n_full:
            # One scan over the equal segments: compile time does not grow with depth.
            stacked = jax.tree.map(
                lambda a: a[: n_full * seg].reshape(n_full, seg, *a.shape[1:]), params
            )
            x, _ = jax.lax.scan(
                lambda h, s: (run_segment(s[0], h, s[1]), None),
                x,
                (stacked, jnp.arange(n_full) * seg),
            )
        else:
            for i in range(n_full):
                x = run_segment(take(i * seg, (i + 1) * seg), x, i * seg)
        if rest:
            x = run_segment(take(n_full * seg, self.n_layers), x, n_full * seg)
        return x


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
) -> TransformerEncoder:
    """A stack of `n_layers` `TransformerBlock`s, parameters stacked with `eqx.filter_vmap`.

    Args:
        n_layers: number of blocks.
        d_model, n_heads, d_ff, dropout, causal, chunk_size: as `TransformerBlock`.
        key: PRNG key for the initial weights.
        remat: each block's recomputation (`TransformerBlock`): `False`, `True`/`"full"`,
            `"dots"`, `"minimal"` or `Save(*names)`.
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
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}.")
    if segment == "sqrt":
        segment = max(1, round(math.sqrt(n_layers)))
    if segment is not None and (not isinstance(segment, int) or segment < 1):
        raise ValueError(f"segment must be None, 'sqrt' or an int >= 1, got {segment!r}.")

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
        )

    blocks = eqx.filter_vmap(make_block)(jr.split(key, n_layers))
    return TransformerEncoder(blocks=blocks, n_layers=n_layers, scan=scan, segment=segment)
