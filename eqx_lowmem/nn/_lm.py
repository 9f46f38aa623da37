"""A small causal language model for the examples: embeddings, a causal encoder, a head."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._checks import ids_outside
from ._encoder import TransformerEncoder, transformer_encoder
from ._norm import LayerNorm
from ._remat import RematArg


class CausalLM(eqx.Module):
    """Token and learned position embeddings, a causal `TransformerEncoder`, a final
    LayerNorm and an output head. `__call__` maps one sequence of token ids to logits.

    The head is a `Linear` layer of its own, or with `tie_embeddings=True` the token
    embedding itself, without a bias (as GPT-2, nanoGPT and fairseq's shared decoder
    embeddings): `vocab_size * (d_model + 1)` fewer parameters, and with them their
    gradients and optimizer state.

    `hidden_states` (the final LayerNorm's output) and `head_weights` (the head as
    `(weight, bias)`) are what `eqx_lowmem.train.next_token_loss` reads to compute the loss
    one vocabulary chunk at a time, never holding the whole logits (its default above a
    2,048-token vocabulary).
    """

    embed: Array  # (vocab, d_model)
    pos: Array  # (max_seq, d_model)
    encoder: TransformerEncoder
    ln_f: LayerNorm
    head: eqx.nn.Linear | None  # None: tied to `embed`
    vocab_size: int = eqx.field(static=True)
    max_seq: int = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        max_seq: int,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        key: PRNGKeyArray,
        dropout: float = 0.0,
        remat: RematArg = False,
        scan: bool = True,
        segment: int | Literal["sqrt"] | None = None,
        chunk_size: int | None | Literal["auto"] = "auto",
        attention: str = "auto",
        tie_embeddings: bool = False,
    ):
        """Args:
        vocab_size: number of token ids.
        max_seq: longest sequence the position embedding covers.
        n_layers, d_model, n_heads, d_ff, dropout, remat, scan, segment, chunk_size,
            attention: as `transformer_encoder` (the encoder is always causal).
        key: PRNG key for the initial weights.
        tie_embeddings: compute the logits with the token embedding (`x @ embed.T`)
            instead of a separate head.
        """
        for name, value in (("vocab_size", vocab_size), ("max_seq", max_seq)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if not isinstance(tie_embeddings, bool):
            raise TypeError(f"tie_embeddings must be a bool, got {tie_embeddings!r}.")
        embed_key, pos_key, enc_key, head_key = jr.split(key, 4)
        self.embed = 0.02 * jr.normal(embed_key, (vocab_size, d_model))
        self.pos = 0.02 * jr.normal(pos_key, (max_seq, d_model))
        self.encoder = transformer_encoder(
            n_layers,
            d_model,
            n_heads,
            d_ff,
            key=enc_key,
            dropout=dropout,
            causal=True,
            remat=remat,
            scan=scan,
            segment=segment,
            chunk_size=chunk_size,
            attention=attention,
        )
        self.ln_f = LayerNorm(d_model)
        self.head = None if tie_embeddings else eqx.nn.Linear(d_model, vocab_size, key=head_key)
        self.vocab_size = vocab_size
        self.max_seq = max_seq

    @jax.named_scope("eqx_lowmem.nn.CausalLM")
    def __call__(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq vocab"]:
        """Logits of the next token at every position of one sequence:
        `hidden_states(tokens) @ weight.T (+ bias)` with `(weight, bias) = head_weights()`.

        Args:
            tokens: token ids, `(seq,)` with `seq <= max_seq`, each in `[0, vocab_size)`.
            key: PRNG key for dropout; `None` turns dropout off.

        Raises:
            ValueError: for an id outside `[0, vocab_size)` in `tokens` known here (a call
                outside `jit`/`vmap`). Traced (inside `jit`, `vmap`, `grad`) such an id
                cannot be checked without a device round trip: its position's logits are
                NaN instead, and `jax.experimental.checkify.checkify(...,
                errors=checkify.index_checks)` reports it. The Trainer checks every batch on
                the host first.
        """
        x = self.hidden_states(tokens, key=key)
        weight, bias = self.head_weights()
        logits = x @ weight.T
        return logits if bias is None else logits + bias[None, :]

    def head_weights(self) -> tuple[Float[Array, "vocab d_model"], Float[Array, " vocab"] | None]:
        """The head as `(weight, bias)`: the token embedding and None when tied.

        With `hidden_states`, what `eqx_lowmem.train.next_token_loss` needs to compute the
        loss a vocabulary chunk at a time (`chunked_cross_entropy`) without the whole
        logits; a model of your own that defines both methods gets the same."""
        if self.head is None:
            return self.embed, None
        return self.head.weight, self.head.bias

    @jax.named_scope("eqx_lowmem.nn.CausalLM.hidden_states")
    def hidden_states(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq d_model"]:
        """The final LayerNorm's output at every position, the states the head reads.

        Args and Raises: as `__call__`.
        """
        if tokens.ndim != 1 or tokens.shape[0] > self.max_seq:
            raise ValueError(
                f"CausalLM expects one sequence of at most max_seq={self.max_seq} token ids, "
                f"got shape {tokens.shape}; jax.vmap over the batch."
            )
        bad = ids_outside(tokens, self.vocab_size)
        if bad is not None:
            raise ValueError(
                f"CausalLM: tokens holds token ids {bad[0]}, but vocab_size="
                f"{self.vocab_size}, so they must lie in [0, {self.vocab_size}); {bad[1]}. "
                "Map every id into the vocabulary (pad with an id below vocab_size and mask "
                "it in the loss)."
            )
        seq = tokens.shape[0]
        # Traced ids cannot be checked without a device round trip: one outside
        # [0, vocab_size) reads NaN here (not the clamped last row, nor a wrapped -1), so
        # its logits say so.
        embedded = self.embed.at[tokens].get(
            mode="fill", fill_value=jnp.nan, wrap_negative_indices=False
        )
        x = embedded + self.pos[:seq]  # (seq, d_model)
        x = self.encoder(x, key=key)
        return self.ln_f(x)
