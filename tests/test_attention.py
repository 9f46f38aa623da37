"""Attention implementations: the same numbers from the chunked and the fused (XLA) paths,
what "auto" resolves to, attention dropout, and clear errors where a choice cannot run."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqx_lowmem as el
from eqx_lowmem.nn._attention import attention

from .helpers import tree_allclose

ATOL = 1e-5  # a layer, float32


def _qkv(getkey, seq=7, heads=2, head_dim=4):
    return tuple(jr.normal(getkey(), (seq, heads, head_dim)) for _ in range(3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [None, 3])
def test_xla_matches_chunked_outputs_and_gradients(getkey, causal, chunk):
    q, k, v = _qkv(getkey)
    cot = jr.normal(getkey(), q.shape)

    def loss(q, k, v, implementation):
        out = attention(q, k, v, causal=causal, chunk=chunk, implementation=implementation)
        return jnp.sum(out * cot)

    chunked = attention(q, k, v, causal=causal, chunk=chunk, implementation="chunked")
    fused = attention(q, k, v, causal=causal, chunk=chunk, implementation="xla")
    assert tree_allclose(fused, chunked, rtol=ATOL, atol=ATOL)
    g_chunked = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "chunked")
    g_fused = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "xla")
    assert tree_allclose(g_fused, g_chunked, rtol=ATOL, atol=ATOL)
    # Not vacuous: the causal mask changes the numbers.
    other = attention(q, k, v, causal=not causal, implementation="xla")
    assert not tree_allclose(other, fused, rtol=ATOL, atol=ATOL)


def test_xla_in_bfloat16_close_to_float32_and_differentiable(getkey):
    # jax's own XLA attention promotes bf16 against float32 inside: its forward must trace
    # under the tests' strict promotion. Its backward lowers a bf16 x bf16 -> f32 dot that
    # strict promotion rejects at lowering time (JAX's, not ours): differentiate, jitted and
    # inside a scan and a vmap as a model runs it, under standard promotion.
    q, k, v = _qkv(getkey, seq=8, head_dim=8)
    half = tuple(a.astype(jnp.bfloat16) for a in (q, k, v))
    out = attention(*half, causal=True, implementation="xla")
    assert out.dtype == jnp.bfloat16
    ref = attention(q, k, v, causal=True, implementation="chunked")
    assert tree_allclose(out.astype(jnp.float32), ref, rtol=5e-2, atol=5e-2)

    def loss(q, implementation):
        def body(h, _):
            o = jax.vmap(
                lambda a: attention(a, *half[1:], causal=True, implementation=implementation)
            )
            return o(h[None])[0], None

        out, _ = jax.lax.scan(body, q, None, length=2)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.numpy_dtype_promotion("standard"):
        g_xla = jax.jit(jax.grad(loss), static_argnums=1)(half[0], "xla")
        g_chunked = jax.jit(jax.grad(loss), static_argnums=1)(half[0], "chunked")
    assert g_xla.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g_xla)))
    scale = float(jnp.max(jnp.abs(g_chunked.astype(jnp.float32))))
    assert tree_allclose(
        g_xla.astype(jnp.float32), g_chunked.astype(jnp.float32), atol=0.05 * scale
    )


def _block(key, **kwargs):
    return el.nn.TransformerBlock(16, 2, 24, key=key, **kwargs)


def _value_and_grads(model, x, key):
    """The loss and its gradients' leaves (models with different static fields, such as
    `attention`, have different tree structures but the same arrays)."""

    def loss(model):
        return jnp.sum(jnp.sin(jax.vmap(lambda xi: model(xi, key=key))(x)))

    value, grads = eqx.filter_value_and_grad(loss)(model)
    return value, jax.tree.leaves(grads)


@pytest.mark.parametrize(
    "remat, causal",
    [(True, True), ("dots", False)]
    + [  # two compiles each: the rest in CI
        pytest.param(r, c, marks=pytest.mark.slow)
        for r in (False, True, "dots", "minimal")
        for c in (False, True)
        if (r, c) not in ((True, True), ("dots", False))
    ],
)
def test_block_xla_matches_chunked_with_remat_and_dropout(getkey, causal, remat):
    init, dkey = getkey(), getkey()
    x = jr.normal(getkey(), (2, 7, 16))
    kwargs = dict(causal=causal, remat=remat, dropout=0.3, chunk_size=3)
    chunked = _block(init, attention="chunked", **kwargs)
    fused = _block(init, attention="xla", **kwargs)
    # Same parameters; residual dropout masks do not depend on the implementation.
    value_c, grads_c = _value_and_grads(chunked, x, dkey)
    value_f, grads_f = _value_and_grads(fused, x, dkey)
    assert tree_allclose(value_f, value_c, rtol=ATOL, atol=ATOL)
    assert tree_allclose(grads_f, grads_c, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_encoder_and_lm_pass_the_choice_through(getkey, causal):
    init = getkey()
    x = jr.normal(getkey(), (2, 6, 16))
    encs = {
        a: el.nn.transformer_encoder(
            2, 16, 2, 24, key=init, causal=causal, remat=True, chunk_size=4, attention=a
        )
        for a in ("chunked", "xla")
    }
    assert encs["xla"].blocks.attention == "xla"
    value_c, grads_c = _value_and_grads(encs["chunked"], x, None)
    value_f, grads_f = _value_and_grads(encs["xla"], x, None)
    assert tree_allclose(value_f, value_c, rtol=1e-4, atol=1e-4)  # a model
    assert tree_allclose(grads_f, grads_c, rtol=1e-4, atol=1e-4)
    if causal:
        tokens = jr.randint(getkey(), (6,), 0, 11)
        lms = {a: el.nn.CausalLM(11, 8, 2, 16, 2, 24, key=init, attention=a) for a in encs}
        assert tree_allclose(lms["xla"](tokens), lms["chunked"](tokens), rtol=1e-4, atol=1e-4)


def test_auto_resolves_to_chunked_on_cpu_and_cudnn_for_16bit_on_gpu():
    resolve = el.nn._attention.resolve_attention
    assert jax.default_backend() == "cpu"
    assert resolve("auto", jnp.float32) == "chunked"
    assert resolve("auto", jnp.bfloat16) == "chunked"  # CPU: no fused kernel
    assert resolve("auto", jnp.bfloat16, "gpu", head_dim=64) == "cudnn"
    assert resolve("auto", jnp.float16, "gpu") == "cudnn"
    assert resolve("auto", jnp.float32, "gpu") == "chunked"  # cuDNN: 16-bit only
    assert resolve("auto", jnp.bfloat16, "gpu", head_dim=12) == "chunked"
    assert resolve("auto", jnp.bfloat16, "gpu", head_dim=256) == "chunked"
    assert resolve("auto", jnp.bfloat16, "gpu", dropout=0.1) == "chunked"
    assert resolve("auto", jnp.bfloat16, "tpu") == "chunked"
    for name in ("chunked", "xla", "cudnn"):
        assert resolve(name, jnp.float32, "cpu") == name
    block = _block(jr.PRNGKey(0))  # head_dim 16 // 2 = 8
    assert block.attention == "auto"
    assert block.resolved_attention(jnp.bfloat16, "gpu") == "cudnn"
    assert block.resolved_attention(jnp.bfloat16) == "chunked"
    odd = el.nn.TransformerBlock(12, 1, 8, key=jr.PRNGKey(0))  # head_dim 12
    assert odd.resolved_attention(jnp.bfloat16, "gpu") == "chunked"
    dropped = _block(jr.PRNGKey(0), attention_dropout=0.1)
    assert dropped.resolved_attention(jnp.bfloat16, "gpu") == "chunked"


def test_auto_block_equals_chunked_on_cpu(getkey):
    init = getkey()
    x = jr.normal(getkey(), (7, 16))
    assert tree_allclose(_block(init)(x), _block(init, attention="chunked")(x))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attention="flash"), "attention must be one of"),
        (dict(attention=None), "attention"),
        (dict(attention="xla", attention_dropout=0.1), "attention='xla' has no dropout"),
        (dict(attention="cudnn", attention_dropout=0.1), "attention='cudnn' has no dropout"),
        (dict(attention_dropout=1.0), "attention_dropout must be"),
        (dict(attention_dropout=-0.5), "attention_dropout must be"),
    ],
)
def test_block_rejects_bad_attention_arguments(getkey, kwargs, match):
    # A wrong type may be caught by the tests' runtime type checker first; it names the
    # argument too.
    with pytest.raises((ValueError, TypeError), match=match):
        _block(getkey(), **kwargs)


def test_resolve_rejects_bad_names_and_dropout():
    with pytest.raises(ValueError, match="attention must be one of"):
        el.nn._attention.resolve_attention("flash", jnp.float32)
    with pytest.raises(ValueError, match="has no dropout"):
        el.nn._attention.resolve_attention("xla", jnp.float32, dropout=0.1)


def test_cudnn_head_dim_checked_when_built(getkey):
    # 16 // 2 = 8 is fine; 12 // 1 = 12 is not a multiple of 8.
    _block(getkey(), attention="cudnn")
    with pytest.raises(ValueError, match="head dimension.*12"):
        el.nn.TransformerBlock(12, 1, 8, key=getkey(), attention="cudnn")


def test_cudnn_on_cpu_is_a_clear_error_at_call_time(getkey):
    # Building is allowed (a model may be built on one machine for another); running is not.
    block = _block(getkey(), attention="cudnn")
    x = jr.normal(getkey(), (8, 16))
    with pytest.raises(ValueError, match="attention='cudnn' cannot run here: it needs a CUDA"):
        block(x)
    with pytest.raises(ValueError, match="cannot run here"):
        attention(*_qkv(getkey, 8, 2, 8), causal=False, implementation="cudnn")


def test_attention_dropout_is_chunk_independent_and_recomputed_exactly(getkey):
    init, dkey = getkey(), getkey()
    x = jr.normal(getkey(), (2, 7, 16))
    kwargs = dict(causal=True, attention_dropout=0.4, attention="chunked")
    whole = _block(init, chunk_size=None, **kwargs)
    value_w, grads_w = _value_and_grads(whole, x, dkey)
    # Masks are drawn per query position: chunking, remat (recomputation regenerates them)
    # and their combination give the same numbers.
    for remat, chunk in ((False, 3), (True, 2), ("minimal", None)):
        other = _block(init, chunk_size=chunk, remat=remat, **kwargs)
        value_o, grads_o = _value_and_grads(other, x, dkey)
        assert tree_allclose(value_o, value_w, rtol=ATOL, atol=ATOL)
        assert tree_allclose(grads_o, grads_w, rtol=ATOL, atol=ATOL)
    # It does something, differs per key, and is off without a key.
    no_dropout = _block(init, chunk_size=None, causal=True)
    assert not tree_allclose(whole(x[0], key=dkey), no_dropout(x[0], key=dkey))
    assert not tree_allclose(whole(x[0], key=dkey), whole(x[0], key=getkey()))
    assert tree_allclose(whole(x[0]), no_dropout(x[0]))
    # "auto" with attention dropout runs the chunked attention.
    auto = _block(init, chunk_size=None, causal=True, attention_dropout=0.4)
    assert tree_allclose(auto(x[0], key=dkey), whole(x[0], key=dkey))


def test_attention_dropout_keeps_rows_unbiased(getkey):
    # Each kept weight is scaled by 1 / (1 - rate): averaged over many keys the output is
    # the dropout-free one.
    q, k, v = _qkv(getkey, seq=4, heads=1, head_dim=4)
    ref = attention(q, k, v, causal=False)
    keys = jr.split(getkey(), 4000)
    outs = jax.vmap(lambda key: attention(q, k, v, causal=False, dropout=0.5, key=key))(keys)
    assert tree_allclose(jnp.mean(outs, axis=0), ref, atol=0.1)
    assert not tree_allclose(outs[0], ref, atol=0.1)
