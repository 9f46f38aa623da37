"""`TransformerBlock(remat=True)` a chunk of rows at a time: the numbers of the whole-sequence
block, in both autodiff modes, for a third fewer temporaries."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqx_lowmem as el

from .helpers import compile_as_users, tree_allclose


def _value_and_grads(block, x, key):
    """The loss, then its gradients with respect to the block's arrays and the input."""

    def loss(block_x):
        block, x = block_x
        keys = None if key is None else jr.split(key, x.shape[0])
        y = jax.vmap(lambda xi, k: block(xi, key=k))(x, keys)
        return jnp.sum(jnp.sin(y))

    value, grads = eqx.filter_value_and_grad(loss)((block, x))
    return [value, *jax.tree.leaves(grads)]  # the blocks differ in static fields only


@pytest.mark.parametrize(
    "causal, chunk, dropout, attention_dropout",
    [(True, 3, 0.0, 0.0), (False, 4, 0.0, 0.0), (True, 4, 0.2, 0.3)],
)
def test_a_chunked_block_equals_the_whole_sequence_block(
    getkey, causal, chunk, dropout, attention_dropout
):
    # seq 10: chunks of 3 leave a padded last chunk; dropout masks must be the same.
    key, x, dkey = getkey(), jr.normal(getkey(), (2, 10, 16)), getkey()
    kwargs = dict(causal=causal, dropout=dropout, attention_dropout=attention_dropout)
    whole = el.nn.TransformerBlock(16, 2, 24, key=key, chunk_size=None, **kwargs)
    rows = el.nn.TransformerBlock(16, 2, 24, key=key, remat=True, chunk_size=chunk, **kwargs)
    assert rows._by_rows(x[0]) and not whole._by_rows(x[0])
    dkey = dkey if dropout else None
    got, expected = (_value_and_grads(b, x, dkey) for b in (rows, whole))
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_chunked_block_forward_mode_equals_the_whole_sequence_block(getkey):
    key = getkey()
    whole = el.nn.TransformerBlock(16, 2, 24, key=key, causal=True, chunk_size=None)
    rows = el.nn.TransformerBlock(16, 2, 24, key=key, causal=True, remat=True, chunk_size=4)
    p0, static0 = eqx.partition(whole, eqx.is_inexact_array)
    p1, static1 = eqx.partition(rows, eqx.is_inexact_array)
    x, dx = jr.normal(getkey(), (3, 9, 16)), jr.normal(getkey(), (3, 9, 16))
    dp = [jr.normal(getkey(), a.shape) for a in jax.tree.leaves(p0)]

    def jvp(params, static):
        leaves, treedef = jax.tree.flatten(params)

        def f(leaves, x):
            return jax.vmap(eqx.combine(jax.tree.unflatten(treedef, leaves), static))(x)

        return jax.jvp(f, (leaves, x), (dp, dx))

    (y0, t0), (y1, t1) = jvp(p0, static0), jvp(p1, static1)
    assert tree_allclose(y1, y0, rtol=1e-5, atol=1e-5)
    assert tree_allclose(t1, t0, rtol=1e-5, atol=1e-5)


def test_a_chunked_causal_lm_equals_the_whole_sequence_model(getkey):
    key, tokens = getkey(), jr.randint(getkey(), (3, 21), 0, 50)
    whole = el.nn.CausalLM(50, 20, 2, 32, 4, 48, key=key, chunk_size=None)
    rows = el.nn.CausalLM(50, 20, 2, 32, 4, 48, key=key, remat=True, chunk_size=6)

    def loss(model):
        values, weights = el.train.next_token_loss(model, tokens, chunk=None)
        return jnp.sum(values * weights) / jnp.sum(weights)

    v0, g0 = eqx.filter_jit(eqx.filter_value_and_grad(loss))(whole)
    v1, g1 = eqx.filter_jit(eqx.filter_value_and_grad(loss))(rows)
    assert tree_allclose(v1, v0, rtol=1e-4, atol=1e-4)
    leaves = [jax.tree.leaves(eqx.filter(g, eqx.is_array)) for g in (g0, g1)]
    assert tree_allclose(leaves[1], leaves[0], rtol=1e-4, atol=1e-5)


def test_causal_lm_loss_and_gradient_temporaries():
    # A 2-layer CausalLM(remat=True), 4 x 128 tokens, d_model 128, chunks of 32; compile
    # only. Unit: one (batch, seq, d_model) float32 array. Measured on XLA:CPU: 26.3 units
    # with the whole-sequence projections and norms held across the block's backward pass
    # and the backward loops' accumulators allocated up front (before this design), 18.6
    # now (the benchmark's 8 x 256 tokens at d_model 512: 111.2 -> 78.7 MB).
    batch, seq, d_model = 4, 128, 128
    model = eqx.filter_eval_shape(
        lambda k: el.nn.CausalLM(64, seq, 2, d_model, 4, 512, key=k, remat=True, chunk_size=32),
        jr.key(0),
    )
    arrays, static = eqx.partition(model, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def grad(arrays, tokens):
        def loss(a):
            values, weights = el.train.next_token_loss(eqx.combine(a, static), tokens)
            return jnp.sum(values * weights) / jnp.sum(weights)

        return jax.value_and_grad(loss)(arrays)

    compiled = compile_as_users(jax.jit(grad).lower(arrays, tokens))
    units = compiled.memory_analysis().temp_size_in_bytes / (batch * seq * d_model * 4)
    assert units <= 20.0, units


def test_map_chunks_reads_and_writes_rows_of_a_pytree(getkey):
    from eqx_lowmem.nn._chunk import map_chunks

    x, scale = jr.normal(getkey(), (7, 3)), jr.normal(getkey(), (7, 1))
    firsts = (jnp.arange(7) // 3 * 3)[:, None].astype(x.dtype)  # chunks of 3, padded

    def fn(rows, first):
        a, none, s = rows
        assert none is None
        return jnp.tanh(a) * s + first.astype(a.dtype)

    def chunked(x):
        return jnp.sum(map_chunks(fn, (x, None, scale), 3) ** 2)

    def whole(x):
        return jnp.sum((jnp.tanh(x) * scale + firsts) ** 2)

    for f in (lambda x: x, jax.jit):
        assert tree_allclose(f(jax.value_and_grad(chunked))(x), jax.value_and_grad(whole)(x),
                             rtol=1e-6, atol=1e-6)  # fmt: skip


def test_map_chunks_of_a_residual_function_equals_it_in_both_modes(getkey):
    # One array in and rows of its shape out: the path whose backward pass writes the input's
    # gradient over the output's (`_in_place`). It closes over weights, an integer array and
    # a traced PRNG key, which reach the rule as arguments (only the weights differentiated).
    from eqx_lowmem.nn._chunk import map_chunks

    x, w = jr.normal(getkey(), (7, 4)), jr.normal(getkey(), (4, 4))
    offsets = (jnp.arange(7) % 2)[:, None]

    def chunked(x, w, key):
        def fn(rows, first):
            at = jnp.minimum(first + jnp.arange(rows.shape[0]), 6)  # the padded rows: 6
            scale = offsets[at].astype(rows.dtype)
            return rows + jnp.tanh(rows @ w) * scale + jr.normal(key, (7, 4))[at]

        return map_chunks(fn, x, 3)  # chunks of 3, the last padded

    def whole(x, w, key):
        return x + jnp.tanh(x @ w) * offsets.astype(x.dtype) + jr.normal(key, (7, 4))

    key = getkey()
    loss = lambda f: lambda x, w, k: jnp.sum(jnp.sin(f(x, w, k)))  # noqa: E731
    tangents = (jr.normal(getkey(), x.shape), jr.normal(getkey(), w.shape))
    want = jax.value_and_grad(loss(whole), argnums=(0, 1))(x, w, key)
    want_jvp = jax.jvp(lambda x, w: whole(x, w, key), (x, w), tangents)
    # Eagerly, jitted, and recomputed (a checkpoint traces the rule again).
    for f, g in ((lambda h: h, chunked), (jax.jit, chunked), (jax.jit, jax.checkpoint(chunked))):
        grads = f(jax.value_and_grad(loss(g), argnums=(0, 1)))(x, w, key)
        assert tree_allclose(grads, want, rtol=1e-5, atol=1e-5)
        jvp = f(lambda x, w, k, g=g: jax.jvp(lambda x, w: g(x, w, k), (x, w), tangents))
        assert tree_allclose(jvp(x, w, key), want_jvp, rtol=1e-5, atol=1e-5)
