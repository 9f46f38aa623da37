"""Multi-head dot-product attention of one example: by hand over chunks of queries, or fused.

Implementations (`attention=` of `TransformerBlock`, `transformer_encoder`, `CausalLM`):

- `"chunked"`: computed here, over chunks of queries when a chunk size is given (each chunk
  recomputed in its own backward pass). The only one with dropout on the attention weights;
  what saves memory on a CPU.
- `"xla"`: `jax.nn.dot_product_attention(..., implementation="xla")`, the whole
  `(heads, seq, seq)` matrix at once.
- `"cudnn"`: `jax.nn.dot_product_attention(..., implementation="cudnn")`, cuDNN's flash
  attention: no `(heads, seq, seq)` matrix in either pass. Needs a CUDA GPU of compute
  capability 8.0 or more, float16 or bfloat16 inputs, a head dimension that is a multiple of
  8 and at most 128.
- `"auto"`: `"cudnn"` where it can run, else `"chunked"` (`resolve_attention`).
"""

import functools
import math

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ._chunk import map_chunks
from ._jvp import linear_tangent

ATTENTIONS: tuple[str, ...] = ("auto", "chunked", "xla", "cudnn")
# cuDNN's flash attention: 16-bit inputs, head dim a multiple of 8 up to 128 (256 on Hopper
# and later; 128 is the bound every supported GPU meets), compute capability 8.0 or more.
_CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_CUDNN_MAX_HEAD_DIM = 128
_CUDNN_MIN_CAPABILITY = (8, 0)


def _check_name(attention: object) -> str:
    if not isinstance(attention, str) or attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}.")
    return attention


def _check_dropout(attention: str, dropout: float) -> None:
    if dropout and attention in ("xla", "cudnn"):
        raise ValueError(
            f"attention={attention!r} has no dropout on the attention weights, but "
            f"attention_dropout={dropout!r}; use attention='chunked' (or 'auto', which picks "
            "it when attention_dropout > 0), or attention_dropout=0.0."
        )


def _cuda_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability when the default backend is CUDA, else None."""
    try:
        import jax.extend

        if "cuda" not in jax.extend.backend.get_backend().platform_version.lower():
            return None
        capability = jax.devices("gpu")[0].compute_capability
        major, minor = (int(p) for p in str(capability).split(".")[:2])
    except Exception:  # no GPU, or an unexpected device description: not CUDA as we know it
        return None
    return major, minor


def _cudnn_unusable(dtype: object, backend: str, head_dim: int | None) -> str | None:
    """Why cuDNN's flash attention cannot run here (None: it can)."""
    dtype = jnp.dtype(dtype)  # type: ignore[arg-type]
    if backend not in ("gpu", "cuda"):
        return f"it needs a CUDA GPU and the backend is {backend!r}"
    if dtype not in _CUDNN_DTYPES:
        return f"it needs float16 or bfloat16 inputs and they are {dtype.name}"
    if head_dim is not None and (head_dim % 8 or head_dim > _CUDNN_MAX_HEAD_DIM):
        return (
            f"it needs a head dimension that is a multiple of 8 and at most "
            f"{_CUDNN_MAX_HEAD_DIM}, got {head_dim}"
        )
    return None


def resolve_attention(
    attention: str,
    dtype: object,
    backend: str | None = None,
    *,
    head_dim: int | None = None,
    dropout: float = 0.0,
) -> str:
    """The attention implementation that `attention=` runs for inputs of `dtype`.

    `"auto"` resolves to `"cudnn"` (cuDNN's flash attention: neither pass keeps a
    `(heads, seq, seq)` matrix, and it is the fastest) on a CUDA GPU of compute capability
    8.0 or more with float16 or bfloat16 inputs, a head dimension (when given) that is a
    multiple of 8 and at most 128, and no attention dropout; everywhere else to
    `"chunked"`. The other names resolve to themselves.

    Args:
        attention: `"auto"`, `"chunked"`, `"xla"` or `"cudnn"`.
        dtype: the dtype of the queries (the compute dtype: under mixed precision the 16-bit
            one).
        backend: `"cpu"`, `"gpu"`, `"tpu"`; `None` is the default backend. With `None` on a
            GPU the device itself is checked (CUDA, compute capability); a backend given by
            name is taken to be a capable CUDA GPU when it is `"gpu"`.
        head_dim: features per head, `d_model // n_heads`; `None` skips that check.
        dropout: the rate of dropout on the attention weights; only `"chunked"` has it.

    Returns:
        `"chunked"`, `"xla"` or `"cudnn"`.

    Raises:
        ValueError: for an unknown name, or attention dropout with `"xla"` or `"cudnn"`.

    Example:
        >>> import jax.numpy as jnp
        >>> resolve_attention("auto", jnp.float32, "cpu")
        'chunked'
        >>> resolve_attention("auto", jnp.bfloat16, "gpu", head_dim=64)
        'cudnn'
        >>> resolve_attention("auto", jnp.float32, "gpu")
        'chunked'
    """
    attention = _check_name(attention)
    _check_dropout(attention, dropout)
    if attention != "auto":
        return attention
    if dropout:
        return "chunked"
    if backend is None:
        backend = jax.default_backend()
        if backend == "gpu":
            capability = _cuda_capability()
            if capability is None or capability < _CUDNN_MIN_CAPABILITY:
                return "chunked"
    return "chunked" if _cudnn_unusable(dtype, backend, head_dim) else "cudnn"


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax(logits: Array, dtype: jnp.dtype) -> Array:
    """Softmax over the last axis computed in float32, returned in 16-bit `dtype`.

    The backward pass keeps only the 16-bit output, which the product with the values keeps
    anyway; autodiff of `jax.nn.softmax` followed by a cast would keep its float32
    exponentials and float32 output as well: three `(heads, q, kv)` arrays' worth of bytes
    instead of one. The gradient is computed in float32 from the 16-bit output (error of
    the order of the 16-bit rounding the logits' gradient gets anyway). Forward mode
    (`jax.jvp`) computes the tangent the same way (`eqx_lowmem.nn._jvp`).
    """
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)


def _softmax_tangent(y: Array, tangents: list) -> Array:
    (dlogits,) = tangents
    # Written so that its transpose, reverse mode's, is y * (g - sum(g * y)) op for op, as
    # the custom_vjp's backward pass was (XLA then packs the same temporaries).
    y32 = y.astype(jnp.float32)
    u = y32 * dlogits.astype(jnp.float32)
    return (u - y32 * jnp.sum(u, axis=-1, keepdims=True)).astype(y.dtype)


@functools.partial(_softmax.defjvp, symbolic_zeros=True)
def _softmax_jvp(dtype, primals, tangents):
    y = _softmax(*primals, dtype)
    return y, linear_tangent(_softmax_tangent, y, tangents, y)


def _dropout_weights(weights: Array, rate: float, key: PRNGKeyArray, q_start: Array) -> Array:
    """Dropout on `(heads, q, kv)` attention weights; query row r's mask comes from
    `fold_in(key, r)` (its absolute position), so any chunking draws the same masks and a
    recomputation regenerates them."""
    heads, n_q, n_kv = weights.shape
    rows = q_start + jnp.arange(n_q, dtype=jnp.int32)
    keep = jax.vmap(lambda r: jr.bernoulli(jr.fold_in(key, r), 1.0 - rate, (heads, n_kv)))(rows)
    keep = jnp.transpose(keep, (1, 0, 2))  # (heads, q, kv)
    scale = jnp.asarray(1.0 / (1.0 - rate), weights.dtype)
    return jnp.where(keep, weights * scale, jnp.zeros((), weights.dtype))


def _attend(
    q: Float[Array, "q heads head_dim"],
    k: Float[Array, "..."],
    v: Float[Array, "..."],
    q_start: Array,
    *,
    causal: bool,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
    kv: str = "khd",
) -> Float[Array, "q heads head_dim"]:
    # `kv`: the keys' and values' layout, "khd" (kv, heads, head_dim) or "hkd" (heads
    # first: what the batched products read without a transposed copy of k and v).
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    logits = jnp.einsum(f"qhd,{kv}->hqk", q, k)  # (heads, q, kv)
    n_kv = k.shape[kv.index("k")]
    # Softmax in float32: 16-bit exponentials overflow and their sums lose the small terms.
    logits = logits.astype(jnp.float32)
    if causal:
        q_pos = q_start + jnp.arange(q.shape[0])
        k_pos = jnp.arange(n_kv)
        logits = jnp.where(k_pos[None, None, :] <= q_pos[None, :, None], logits, -jnp.inf)
    if v.dtype == jnp.float32:
        weights = jax.nn.softmax(logits, axis=-1)
    else:
        weights = _softmax(logits, v.dtype)
    if dropout and key is not None:
        weights = _dropout_weights(weights, dropout, key, q_start)
    return jnp.einsum(f"hqk,{kv}->qhd", weights, v)


def _fused_call(q: Array, k: Array, v: Array, causal: bool, implementation: str) -> Array:
    # JAX's own attention promotes 16-bit inputs against float32 inside, which the strict
    # dtype promotion mode rejects while tracing; the promotion is JAX's, not the caller's.
    # (Its backward pass in 16 bits also lowers a bf16 x bf16 -> f32 dot that strict mode
    # rejects when the program is lowered: differentiate it under standard promotion.)
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )


def attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq heads head_dim"],
    v: Float[Array, "seq heads head_dim"],
    *,
    causal: bool,
    chunk: int | None = None,
    implementation: str = "chunked",
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Softmax attention of one example.

    Args:
        q, k, v: queries, keys and values, `(seq, heads, head_dim)`.
        causal: mask the keys after each query's position.
        chunk: for `"chunked"`: `None` computes the `(heads, seq, seq)` attention matrix at
            once; an int computes it `chunk` queries at a time, each chunk recomputed in its
            own backward pass, so the backward holds one `(heads, chunk, seq)` slice instead
            of the whole matrix (Rabe and Staats, 2021), for one more attention forward.
            The fused implementations ignore it.
        implementation: `"auto"`, `"chunked"`, `"xla"` or `"cudnn"` (`resolve_attention`).
        dropout: rate of dropout on the attention weights (`"chunked"` only); applied when
            `key` is given.
        key: PRNG key for that dropout; `None` turns it off.

    Returns:
        The attention output, `(seq, heads, head_dim)`.

    Raises:
        ValueError: for an unknown implementation, attention dropout with a fused one, or
            `"cudnn"` where it cannot run (the reason is named).
    """
    backend = jax.default_backend()
    implementation = resolve_attention(
        implementation, q.dtype, head_dim=q.shape[-1], dropout=dropout
    )
    if implementation == "chunked":

        def attend(q_rows: Array, first: Array) -> Array:
            return _attend(q_rows, k, v, first, causal=causal, dropout=dropout, key=key)

        return map_chunks(attend, q, chunk)
    if implementation == "cudnn":
        reason = _cudnn_unusable(q.dtype, backend, q.shape[-1])
        if reason is None and backend == "gpu":
            capability = _cuda_capability()
            if capability is None or capability < _CUDNN_MIN_CAPABILITY:
                reason = (
                    f"it needs a CUDA GPU of compute capability "
                    f"{'.'.join(map(str, _CUDNN_MIN_CAPABILITY))} or more, found {capability}"
                )
        if reason is not None:
            raise ValueError(
                f"attention='cudnn' cannot run here: {reason}. Use attention='auto' (cuDNN "
                "where it can run, the chunked attention elsewhere) or 'xla'."
            )
    return _fused_call(q, k, v, causal, implementation)
