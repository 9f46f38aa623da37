"""The pre-LayerNorm transformer block, with named intermediates for remat policies."""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from ._activation import gelu
from ._attention import _attend, _check_dropout, _check_name, attention, resolve_attention
from ._chunk import map_chunks
from ._norm import LayerNorm
from ._remat import BLOCK_NAMES, Remat, RematArg, remat_policy, resolve_remat

DEFAULT_CHUNK_SIZE = 64


def _dense(layer: Any, x: Float[Array, "seq d_in"]) -> Float[Array, "seq d_out"]:
    # `layer`: an eqx.nn.Linear or anything with its `weight` and `bias` (a SparseLinear).
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias[None, :]


def _keep(rate: float, key: PRNGKeyArray | None, shape: tuple) -> Array | None:
    """Dropout's mask of kept entries (None: no dropout)."""
    if key is None or rate == 0.0:
        return None
    return jr.bernoulli(key, 1.0 - rate, shape)


def _masked(x: Array, rate: float, keep: Array | None) -> Array:
    if keep is None:
        return x
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def _dropout(x: Array, rate: float, key: PRNGKeyArray | None) -> Array:
    return _masked(x, rate, _keep(rate, key, x.shape))


class TransformerBlock(eqx.Module):
    """Pre-LayerNorm multi-head self-attention and feed-forward, each a residual.

    `y = h + ffn(ln2(h))` with `h = x + attn(ln1(x))`, the feed-forward being
    `Linear(d_model, d_ff) -> GELU -> Linear(d_ff, d_model)`. Layer norms and the softmax
    compute in float32 whatever the parameters' dtype; the backward passes of the norms and
    of GELU keep only their inputs. Dropout (when `dropout > 0` and a key is
    passed) applies to the output of each sub-layer before its residual add.

    Checkpoint names, which `remat=Save(...)` may keep:
    `attn_in` (LayerNorm 1 output), `qkv`, `attn_context` (softmax(qk^T)v, heads merged),
    `attn_out`, `ffn_in` (LayerNorm 2 output), `ffn_hidden` (before the activation), `ffn_out`.

    `remat` trades time for memory in the backward pass:

    - `False` / `"none"`: keeps every intermediate, including the `(heads, seq, seq)`
      attention weights. Fastest; the most memory.
    - `True` / `"full"`: keeps only the block input; the backward pass runs the block's forward
      again (about one more forward pass per step). With chunking on (the default) and
      the `"chunked"` attention, the block then runs a chunk of `chunk_size` rows at a
      time (the Mini-Sequence Transformer, Luo et al. 2024, extended to attention): only
      the keys and values span the sequence; LayerNorm 1, the query projection,
      attention over all keys, the output projection, LayerNorm 2, the feed-forward and
      both residuals are computed per chunk, each chunk recomputed in its own backward.
      So one block's backward holds the block input, its keys and values and their
      gradients and one chunk's working set, never the whole `(heads, seq, seq)`
      attention matrix, `(seq, d_ff)` hidden layer or sequence-long projections (a
      2-layer d_model-512 `CausalLM` on 8 x 256 tokens: 78.7 MB of temporaries instead
      of 111.2 MB on XLA:CPU, measured for 76e6529). Time: the query projection is
      computed once more than with whole-sequence projections, and the products are a
      chunk's (that model's step on 2 CPU cores: 1.03-1.07x the whole-sequence block's,
      1.00-1.03x with a 32,000-token vocabulary's loss: 9416f36). The numbers are the
      same to rounding.
    - `"dots"`: keeps the projections (`qkv`, `attn_out`, `ffn_hidden`, `ffn_out`) and
      recomputes the norms, the activation and the attention matrix (cheap element-wise work
      and two small batched matmuls).
    - `"minimal"`: keeps `qkv` and `ffn_hidden` only; recomputes in addition the output
      projection. Close to `"dots"` in speed, less memory.
    - `Save(*names)`: keeps exactly the named intermediates.

    Recomputation saves memory reliably only when the blocks run in a `jax.lax.scan` (see
    `transformer_encoder`); in an unrolled loop XLA may schedule the recomputation early.

    `attention` chooses how softmax(q k^T) v is computed (`resolve_attention`
    says what `"auto"` runs for a dtype and backend; the numbers agree to rounding):

    - `"chunked"`: by hand, over chunks of `chunk_size` queries when chunking is on (each
      chunk recomputed in its own backward, so the backward holds one `(heads, chunk, seq)`
      slice); the whole `(heads, seq, seq)` matrix when it is off. Supports
      `attention_dropout`. What saves memory on a CPU.
    - `"xla"`: `jax.nn.dot_product_attention(implementation="xla")`, the whole matrix at
      once (no chunking; `chunk_size` then applies to the feed-forward only).
    - `"cudnn"`: cuDNN's flash attention (`implementation="cudnn"`): no `(heads, seq, seq)`
      matrix in either pass, and the fastest. A CUDA GPU (compute capability 8.0+), float16
      or bfloat16 activations (e.g. `precision="mixed_bf16"`), a head dimension
      `d_model // n_heads` that is a multiple of 8 and at most 128; a clear error elsewhere.
    - `"auto"` (default): `"cudnn"` where it can run, `"chunked"` elsewhere (always
      `"chunked"` with `attention_dropout > 0`). Decided when the block is traced, from the
      activations' dtype, so a float32 model trained with a 16-bit policy gets cuDNN.
    """

    ln1: LayerNorm
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    ln2: LayerNorm
    ff1: eqx.nn.Linear
    ff2: eqx.nn.Linear
    d_model: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    remat: Remat = eqx.field(static=True)
    chunk_size: int | None = eqx.field(static=True)
    attention: str = eqx.field(static=True)
    attention_dropout: float = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        key: PRNGKeyArray,
        dropout: float = 0.0,
        causal: bool = False,
        remat: RematArg = False,
        chunk_size: int | None | Literal["auto"] = "auto",
        attention: str = "auto",
        attention_dropout: float = 0.0,
    ):
        """Args:
        d_model: width of the residual stream; divisible by `n_heads`.
        n_heads: number of attention heads.
        d_ff: hidden width of the feed-forward layer.
        key: PRNG key for the initial weights.
        dropout: rate in [0, 1) for the output of each sub-layer; needs a key at call time.
        causal: each position attends only to itself and earlier positions.
        remat: `False`, `True`/`"full"`, `"dots"`, `"minimal"` or `Save(*names)` (above).
        chunk_size: rows per chunk of the attention (queries) and the feed-forward (tokens),
            and with `remat="full"` of the whole block (above). `"auto"`: 64 with
            `remat="full"`, else no chunking. `None`: never chunk. Chunks cap the backward
            pass's activations at one chunk's, for one more forward pass of each chunk
            (with `remat="full"` the block's own recomputation covers most of it). Smaller
            chunks hold less (the model above: 68.2 MB with 32) for more, smaller products.
        attention: `"auto"`, `"chunked"`, `"xla"` or `"cudnn"` (above).
        attention_dropout: rate in [0, 1) of dropout on the attention weights (`"chunked"`
            only; an error with `"xla"` or `"cudnn"`); needs a key at call time.
        """
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("d_ff", d_ff)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}; each head takes "
                f"d_model // n_heads features. Use a divisor of {d_model} for n_heads."
            )
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"dropout must be a rate in [0, 1), got {dropout!r}.")
        _check_name(attention)
        if not (isinstance(attention_dropout, (int, float)) and 0.0 <= attention_dropout < 1.0):
            raise ValueError(
                f"attention_dropout must be a rate in [0, 1), got {attention_dropout!r}."
            )
        _check_dropout(attention, attention_dropout)
        head_dim = d_model // n_heads
        if attention == "cudnn" and (head_dim % 8 or head_dim > 128):
            raise ValueError(
                f"attention='cudnn' needs a head dimension d_model // n_heads that is a "
                f"multiple of 8 and at most 128, got {d_model} // {n_heads} = {head_dim}; "
                "change n_heads or use attention='auto'."
            )
        remat = resolve_remat(remat, BLOCK_NAMES)
        if chunk_size == "auto":
            chunk_size = DEFAULT_CHUNK_SIZE if remat == "full" else None
        elif chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be 'auto', None or an int >= 1, got {chunk_size!r}.")
        qkv_key, proj_key, ff1_key, ff2_key = jr.split(key, 4)
        self.ln1 = LayerNorm(d_model)
        self.qkv = eqx.nn.Linear(d_model, 3 * d_model, key=qkv_key)
        self.proj = eqx.nn.Linear(d_model, d_model, key=proj_key)
        self.ln2 = LayerNorm(d_model)
        self.ff1 = eqx.nn.Linear(d_model, d_ff, key=ff1_key)
        self.ff2 = eqx.nn.Linear(d_ff, d_model, key=ff2_key)
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_ff = d_ff
        self.dropout = float(dropout)
        self.causal = causal
        self.remat = remat
        self.chunk_size = chunk_size
        self.attention = attention
        self.attention_dropout = float(attention_dropout)

    def resolved_attention(self, dtype: object, backend: str | None = None) -> str:
        """What `attention` runs as for activations of `dtype` on `backend` (default: the
        default backend): `resolve_attention` (private) with this block's head
        dimension and attention dropout."""
        return resolve_attention(
            self.attention,
            dtype,
            backend,
            head_dim=self.d_model // self.n_heads,
            dropout=self.attention_dropout,
        )

    def __call__(
        self, x: Float[Array, "seq d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq d_model"]:
        """Apply the block to one example; `jax.vmap` over a batch.

        Args:
            x: one sequence, `(seq, d_model)`.
            key: PRNG key for dropout; `None` turns dropout off (evaluation).

        Returns:
            The block output, same shape and dtype as `x`.
        """
        return self.apply(x, key=key)

    def apply(
        self,
        x: Float[Array, "seq d_model"],
        *,
        key: PRNGKeyArray | None = None,
        prevent_cse: bool = True,
    ) -> Float[Array, "seq d_model"]:
        """`__call__` with control over `jax.checkpoint`'s `prevent_cse`.

        Inside a `lax.scan` (as `transformer_encoder` runs blocks) `prevent_cse=False` is safe
        and lets XLA optimise across the recomputation; elsewhere keep the default `True`.
        """
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ValueError(
                f"TransformerBlock expects one example of shape (seq, {self.d_model}), got "
                f"{x.shape}; call it on a single sequence and jax.vmap over the batch."
            )
        policy = remat_policy(self.remat)
        forward = type(self)._forward
        if policy is not None:
            forward = eqx.filter_checkpoint(forward, policy=policy, prevent_cse=prevent_cse)
        return forward(self, x, key)

    def _ffn(self, h: Array, first: Array) -> Array:
        del first
        hidden = checkpoint_name(_dense(self.ff1, h), "ffn_hidden")
        return _dense(self.ff2, gelu(hidden))

    @jax.named_scope("eqx_lowmem.nn.TransformerBlock")
    def _forward(self, x: Array, key: PRNGKeyArray | None) -> Array:
        if self._by_rows(x):
            return self._rows(x, key)
        seq = x.shape[0]
        head_dim = self.d_model // self.n_heads
        attn_key, ffn_key = (None, None) if key is None else jr.split(key)

        h = checkpoint_name(self.ln1(x), "attn_in")
        qkv = checkpoint_name(_dense(self.qkv, h), "qkv")
        q, k, v = jnp.split(qkv.reshape(seq, 3, self.n_heads, head_dim), 3, axis=1)
        # (seq, heads, head_dim) each
        # Attention dropout's key is derived from the sub-layer's, so the residual dropout
        # masks stay what they are without it.
        weights_key = None
        if attn_key is not None and self.attention_dropout:
            weights_key = jr.fold_in(attn_key, 1)
        context = attention(
            q[:, 0],
            k[:, 0],
            v[:, 0],
            causal=self.causal,
            chunk=self.chunk_size,
            implementation=self.attention,
            dropout=self.attention_dropout,
            key=weights_key,
        )
        context = checkpoint_name(context.reshape(seq, self.d_model), "attn_context")
        attn_out = checkpoint_name(_dense(self.proj, context), "attn_out")
        x = x + _dropout(attn_out, self.dropout, attn_key)

        h = checkpoint_name(self.ln2(x), "ffn_in")
        ffn_out = checkpoint_name(map_chunks(self._ffn, h, self.chunk_size), "ffn_out")
        return x + _dropout(ffn_out, self.dropout, ffn_key)

    def _by_rows(self, x: Array) -> bool:
        """Whether `remat="full"` runs the block a chunk of rows at a time (`_rows`)."""
        return (
            self.remat == "full"
            and self.chunk_size is not None
            and self.chunk_size < x.shape[0]
            and self.resolved_attention(x.dtype) == "chunked"
        )

    def _rows(self, x: Array, key: PRNGKeyArray | None) -> Array:
        """`_forward` with every sequence-length intermediate held a chunk at a time.

        Only the keys and values span the sequence; everything else is computed per chunk
        of `chunk_size` rows in three loops (`map_chunks`, each chunk recomputed in its
        own backward pass): keys and values (LayerNorm 1 and their projection); then for
        each chunk of queries LayerNorm 1, the query projection, attention over all keys,
        the output projection and the residual; then LayerNorm 2, the feed-forward and the
        residual (the Mini-Sequence Transformer, Luo et al. 2024, here for attention as
        well). So the backward pass of the block holds the block input, its keys and
        values and their gradients, and one chunk's working set, instead of the whole
        sequence's projections, attention output and normalised inputs. The same
        numbers as the whole-sequence path (to rounding) and the same dropout masks.
        """
        seq, d = x.shape[0], self.d_model
        n_heads, head_dim = self.n_heads, d // self.n_heads
        attn_key, ffn_key = (None, None) if key is None else jr.split(key)
        weights_key = None
        if attn_key is not None and self.attention_dropout:
            weights_key = jr.fold_in(attn_key, 1)
        w, b = self.qkv.weight, self.qkv.bias  # rows: queries, keys, values

        def project(rows: Array, part: slice) -> Array:
            y = self.ln1(rows) @ w[part].T
            return y if b is None else y + b[None, part]

        kv = map_chunks(lambda rows, _: project(rows, slice(d, None)), x, self.chunk_size)
        # (heads, seq, head_dim) each: heads first, as the batched products read them
        k, v = jnp.transpose(kv.reshape(seq, 2, n_heads, head_dim), (1, 2, 0, 3))

        def attend(xs: tuple[Array, Array | None], first: Array) -> Array:
            rows, keep = xs
            q = project(rows, slice(0, d)).reshape(rows.shape[0], n_heads, head_dim)
            context = _attend(
                q, k, v, first, causal=self.causal, dropout=self.attention_dropout,
                key=weights_key, kv="hkd",
            )  # fmt: skip
            attn_out = _dense(self.proj, context.reshape(rows.shape[0], d))
            return rows + _masked(attn_out, self.dropout, keep)

        def feed_forward(xs: tuple[Array, Array | None], first: Array) -> Array:
            rows, keep = xs
            ffn_out = self._ffn(self.ln2(rows), first)
            return rows + _masked(ffn_out, self.dropout, keep)

        x = map_chunks(attend, (x, _keep(self.dropout, attn_key, x.shape)), self.chunk_size)
        keep = _keep(self.dropout, ffn_key, x.shape)
        return map_chunks(feed_forward, (x, keep), self.chunk_size)
