"""Models: shapes, numerics of the custom backward passes, bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqx_lowmem as el
from eqx_lowmem.nn._activation import gelu
from eqx_lowmem.nn._attention import attention

from .helpers import tree_allclose


def test_mlp_guide_example(getkey):
    net = el.nn.mlp([2, 4, 1], key=getkey())
    assert [(lay.in_features, lay.out_features) for lay in net.layers] == [(2, 4), (4, 1)]
    x = jr.normal(getkey(), (2,))
    # One hidden ReLU layer, computed by hand.
    h = jax.nn.relu(net.layers[0].weight @ x + net.layers[0].bias)
    expected = net.layers[1].weight @ h + net.layers[1].bias
    assert tree_allclose(net(x), expected)


@pytest.mark.parametrize("sizes", [[2], [], [2, 0, 1], [2, -3, 1]])
def test_mlp_rejects_bad_sizes(getkey, sizes):
    with pytest.raises(ValueError, match="sizes must be"):
        el.nn.mlp(sizes, key=getkey())


def test_mlp_rejects_batched_input(getkey):
    net = el.nn.mlp([2, 4, 1], key=getkey())
    # Without runtime type checking our own error speaks; under the tests' jaxtyping hook its
    # shape check fires first. Both name the expected shape.
    with pytest.raises((ValueError, TypeError), match=r"shape \(2,\).*jax.vmap|in_features"):
        net(jnp.ones((3, 2)))
    with pytest.raises(ValueError, match=r"shape \(2,\).*jax.vmap"):
        net(jnp.ones((3,)))


def _reference_layer_norm(x, weight, bias, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * weight[None, :] + bias[None, :]


def test_layer_norm_value_and_grad_match_autodiff(getkey):
    ln = el.nn.LayerNorm(6)
    ln = eqx.tree_at(
        lambda m: (m.weight, m.bias), ln, (jr.normal(getkey(), (6,)), jr.normal(getkey(), (6,)))
    )
    x = 3.0 + jr.normal(getkey(), (5, 6))
    cot = jr.normal(getkey(), (5, 6))

    def ours(m, x):
        return jnp.sum(m(x) * cot)

    def reference(m, x):
        return jnp.sum(_reference_layer_norm(x, m.weight, m.bias) * cot)

    assert tree_allclose(ln(x), _reference_layer_norm(x, ln.weight, ln.bias), atol=1e-5)
    g_ours = eqx.filter_grad(ours)(ln, x), jax.grad(ours, argnums=1)(ln, x)
    g_ref = eqx.filter_grad(reference)(ln, x), jax.grad(reference, argnums=1)(ln, x)
    assert tree_allclose(g_ours, g_ref, rtol=1e-5, atol=1e-5)


def test_layer_norm_keeps_input_dtype_and_computes_in_float32(getkey):
    ln = el.nn.LayerNorm(8)
    x = (100.0 + jr.normal(getkey(), (4, 8))).astype(jnp.bfloat16)
    y = ln(x)
    assert y.dtype == jnp.bfloat16
    expected = _reference_layer_norm(x.astype(jnp.float32), ln.weight, ln.bias)
    assert tree_allclose(y.astype(jnp.float32), expected, atol=2e-2)


def test_gelu_value_and_grad_match_jax(getkey):
    x = 3.0 * jr.normal(getkey(), (64,))
    assert tree_allclose(gelu(x), jax.nn.gelu(x, approximate=True))
    ours = jax.grad(lambda x: jnp.sum(jnp.sin(gelu(x))))(x)
    ref = jax.grad(lambda x: jnp.sum(jnp.sin(jax.nn.gelu(x, approximate=True))))(x)
    assert tree_allclose(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 4, 7])
def test_chunked_attention_matches_whole(getkey, causal, chunk):
    q, k, v = (jr.normal(getkey(), (7, 2, 4)) for _ in range(3))
    cot = jr.normal(getkey(), (7, 2, 4))

    def loss(q, k, v, chunk):
        return jnp.sum(attention(q, k, v, causal=causal, chunk=chunk) * cot)

    whole = attention(q, k, v, causal=causal, chunk=None)
    assert tree_allclose(attention(q, k, v, causal=causal, chunk=chunk), whole, atol=1e-6)
    g_whole = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, None)
    g_chunk = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, chunk)
    assert tree_allclose(g_chunk, g_whole, rtol=1e-5, atol=1e-6)


def test_causal_attention_ignores_the_future(getkey):
    q, k, v = (jr.normal(getkey(), (6, 2, 4)) for _ in range(3))
    out = attention(q, k, v, causal=True)
    k2 = k.at[4:].set(jr.normal(getkey(), (2, 2, 4)))
    v2 = v.at[4:].set(jr.normal(getkey(), (2, 2, 4)))
    out2 = attention(q, k2, v2, causal=True)
    assert tree_allclose(out[:4], out2[:4])
    assert not tree_allclose(out[4:], out2[4:])


def test_block_shape_and_dtype(getkey):
    block = el.nn.TransformerBlock(16, 4, 32, key=getkey())
    x = jr.normal(getkey(), (5, 16))
    y = block(x)
    assert y.shape == (5, 16) and y.dtype == jnp.float32
    assert jax.vmap(block)(jnp.stack([x, x])).shape == (2, 5, 16)


def test_block_dropout_needs_key_and_is_deterministic_per_key(getkey):
    init = getkey()
    block = el.nn.TransformerBlock(16, 4, 32, key=init, dropout=0.5)
    x = jr.normal(getkey(), (5, 16))
    key = getkey()
    assert tree_allclose(block(x, key=key), block(x, key=key))
    assert not tree_allclose(block(x, key=key), block(x, key=getkey()))
    no_dropout = el.nn.TransformerBlock(16, 4, 32, key=init, dropout=0.0)
    assert tree_allclose(block(x), no_dropout(x))  # no key: dropout off


def test_causal_lm_is_causal(getkey):
    lm = el.nn.CausalLM(11, 8, 2, 16, 2, 32, key=getkey())
    tokens = jr.randint(getkey(), (8,), 0, 11)
    logits = lm(tokens)
    assert logits.shape == (8, 11)
    changed = lm(tokens.at[5:].set((tokens[5:] + 1) % 11))
    assert tree_allclose(logits[:5], changed[:5], atol=1e-6)
    assert not tree_allclose(logits[5:], changed[5:])


def test_causal_lm_tied_embeddings_share_the_token_embedding(getkey):
    init, tokens = getkey(), jr.randint(getkey(), (8,), 0, 11)
    untied = el.nn.CausalLM(11, 8, 1, 16, 2, 32, key=init)
    tied = el.nn.CausalLM(11, 8, 1, 16, 2, 32, key=init, tie_embeddings=True)
    size = lambda m: sum(x.size for x in jax.tree.leaves(eqx.filter(m, eqx.is_array)))  # noqa: E731
    assert tied.head is None and size(untied) - size(tied) == 11 * (16 + 1)
    # the same weights otherwise: the tied logits are the final features times embed.T
    features = untied.ln_f(untied.encoder(untied.embed[tokens] + untied.pos[:8]))
    assert tree_allclose(tied(tokens), features @ untied.embed.T, rtol=1e-5, atol=1e-6)
    # a row no token looks up still learns, through the output head
    unused = jnp.where(tokens == 10, 0, tokens)
    loss = lambda m: jnp.sum(jax.nn.log_softmax(m(unused))[:, 3])  # noqa: E731
    assert bool(jnp.all(eqx.filter_grad(loss)(tied).embed[10] != 0))
    with pytest.raises(TypeError, match="tie_embeddings"):
        el.nn.CausalLM(11, 8, 1, 16, 2, 32, key=init, tie_embeddings="yes")


def test_causal_lm_rejects_long_sequence(getkey):
    lm = el.nn.CausalLM(11, 8, 1, 16, 2, 32, key=getkey())
    with pytest.raises(ValueError, match="max_seq=8"):
        lm(jnp.zeros((9,), jnp.int32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=10, n_heads=3), "not divisible by n_heads=3"),
        (dict(remat="everything"), "not a preset"),
        (dict(remat=el.nn.Save("qkv", "attn_weights")), "attn_weights"),
        (dict(remat=1), "remat"),
        (dict(dropout=1.0), "dropout must be"),
        (dict(dropout=-0.1), "dropout must be"),
        (dict(d_ff=0), "d_ff must be a positive int"),
        (dict(chunk_size=0), "chunk_size must be"),
    ],
)
def test_block_rejects_bad_arguments(getkey, kwargs, match):
    args = dict(d_model=12, n_heads=3, d_ff=8)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        el.nn.TransformerBlock(
            args.pop("d_model"), args.pop("n_heads"), args.pop("d_ff"), key=getkey(), **args
        )


def test_block_rejects_wrong_input_shape(getkey):
    block = el.nn.TransformerBlock(16, 4, 32, key=getkey())
    with pytest.raises((ValueError, TypeError), match=r"\(seq, 16\).*jax.vmap|seq d_model"):
        block(jnp.ones((2, 5, 16)))
    with pytest.raises(ValueError, match=r"\(seq, 16\)"):
        block(jnp.ones((5, 8)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_layers=0), "n_layers must be"),
        (dict(segment=0), "segment must be"),
        (dict(segment="half"), "segment"),
    ],
)
def test_encoder_rejects_bad_arguments(getkey, kwargs, match):
    args = dict(n_layers=2)
    args.update(kwargs)
    # A wrong type may be caught by the tests' runtime type checker first; it names the
    # argument too.
    with pytest.raises((ValueError, TypeError), match=match):
        el.nn.transformer_encoder(args.pop("n_layers"), 8, 2, 16, key=getkey(), **args)


def test_remat_aliases():
    block = el.nn.TransformerBlock(8, 2, 8, key=jr.PRNGKey(0), remat=True)
    assert block.remat == "full" and block.chunk_size == 64
    assert el.nn.TransformerBlock(8, 2, 8, key=jr.PRNGKey(0), remat=False).remat == "none"
    assert el.nn.TransformerBlock(8, 2, 8, key=jr.PRNGKey(0), remat="dots").chunk_size is None
