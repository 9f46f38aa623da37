"""Recomputation changes memory, never the numbers."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqx_lowmem as el

from .helpers import compile_as_users, tree_allclose

# False with chunk_size=3 runs the chunked attention and feed-forward without remat.
REMATS = [False, True, "dots", "minimal", el.nn.Save("qkv", "attn_context", "ffn_in")]


def _loss(model, x, key):
    keys = None if key is None else jr.split(key, x.shape[0])
    y = jax.vmap(lambda xi, k: model(xi, key=k))(x, keys)
    return jnp.mean(jnp.sin(y))


@eqx.filter_jit
def _value_and_grads(model, x, key):
    # The loss, its gradients with respect to the parameters and the input, as a flat list
    # (models with different remat settings differ in their static fields).
    value, grads = eqx.filter_value_and_grad(lambda mx, k: _loss(*mx, k))((model, x), key)
    return [value, *jax.tree.leaves(grads)]


def _encoder(key, **kwargs):
    # seq 7 with chunk_size 3 exercises padded chunks.
    return el.nn.transformer_encoder(3, 16, 2, 24, key=key, **kwargs)


@pytest.mark.parametrize("remat", REMATS)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_remat_preserves_outputs_and_gradients(getkey, remat, dropout):
    key, x, dkey = getkey(), jr.normal(getkey(), (2, 7, 16)), getkey()
    plain = _encoder(key, dropout=dropout, causal=True)
    rematted = _encoder(key, dropout=dropout, causal=True, remat=remat, chunk_size=3)
    expected = _value_and_grads(plain, x, dkey if dropout else None)
    got = _value_and_grads(rematted, x, dkey if dropout else None)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "remat, segment",
    # 3 layers: segments of 2 leave a shorter last segment; 3 is one segment of all layers.
    [(True, None), (False, 2)]
    + [
        pytest.param(*p, marks=pytest.mark.slow)  # three compiles each: the rest in CI
        for p in [(False, None), ("dots", None), (True, 2), ("minimal", 3)]
    ],
)
def test_scan_loop_and_segments_agree(getkey, remat, segment):
    key, x, dkey = getkey(), jr.normal(getkey(), (2, 5, 16)), getkey()
    reference = el.nn.transformer_encoder(3, 16, 2, 24, key=key, dropout=0.2)
    expected = _value_and_grads(reference, x, dkey)
    for scan in (True, False):
        model = el.nn.transformer_encoder(
            3, 16, 2, 24, key=key, dropout=0.2, remat=remat, scan=scan, segment=segment
        )
        assert tree_allclose(_value_and_grads(model, x, dkey), expected, rtol=1e-5, atol=1e-6)


def test_sqrt_segments(getkey):
    def segment(n_layers):  # a static field: the model's shapes are enough
        def make(key):
            return el.nn.transformer_encoder(n_layers, 8, 2, 8, key=key, segment="sqrt")

        return eqx.filter_eval_shape(make, getkey()).segment

    assert segment(12) == 3
    assert segment(2) == 1


def test_dropout_masks_differ_between_layers(getkey):
    # One key per layer, derived inside the scan: identical layers given identical inputs
    # would produce identical outputs if the key were shared.
    block = el.nn.TransformerBlock(16, 2, 24, key=getkey(), dropout=0.5)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), eqx.filter(block, eqx.is_array))
    enc = el.nn.transformer_encoder(2, 16, 2, 24, key=getkey(), dropout=0.5)
    enc = eqx.tree_at(
        lambda e: e.blocks,
        enc,
        eqx.combine(stacked, eqx.filter(enc.blocks, eqx.is_array, inverse=True)),
    )
    x, key = jr.normal(getkey(), (4, 16)), getkey()
    call = eqx.filter_jit(lambda m, x, k: m(x, key=k))  # compiled: op by op is slower
    once = call(block, call(block, x, jr.fold_in(key, 0)), jr.fold_in(key, 1))
    assert tree_allclose(call(enc, x, key), once, atol=1e-6)
    same_key = call(block, call(block, x, jr.fold_in(key, 0)), jr.fold_in(key, 0))
    assert not tree_allclose(call(enc, x, key), same_key)


def _kept(remat, getkey):
    block = el.nn.TransformerBlock(16, 2, 24, key=getkey(), remat=remat)
    x = jr.normal(getkey(), (6, 16))
    return el.memory.saved_residuals(lambda b, x: b(x), block, x)


def test_full_remat_keeps_only_the_block_input(getkey):
    kept = _kept(True, getkey)
    non_parameters = [r for r in kept if not r.source.startswith("argument args[0]")]
    assert [(r.source, r.shape) for r in non_parameters] == [("argument args[1]", (6, 16))]
    # The guide's check: the first feed-forward layer no longer holds its input.
    assert "ffn_in" not in {r.name for r in kept}


def test_without_remat_the_feed_forward_input_is_kept(getkey):
    kept = _kept(False, getkey)
    names = {r.name for r in kept}
    assert {"ffn_in", "ffn_hidden", "qkv" if False else "attn_in"} <= names
    assert el.memory._residuals.residual_bytes(kept) > 6 * 16 * 4 * 5


@pytest.mark.parametrize(
    "remat, names",
    [
        ("dots", set(el.nn._remat.DOTS_NAMES) - {"ffn_out"}),  # ffn_out is never needed backward
        ("minimal", set(el.nn._remat.MINIMAL_NAMES)),
        (el.nn.Save("attn_context", "ffn_in"), {"attn_context", "ffn_in"}),
    ],
)
def test_selective_presets_keep_exactly_their_names(getkey, remat, names):
    kept = _kept(remat, getkey)
    intermediates = [r for r in kept if r.source.startswith("intermediate")]
    assert {r.name for r in intermediates} == names


def _sgd_step_memory(model, batch):
    # `model` of shapes (`jax.ShapeDtypeStruct` leaves): compiling needs no weights.
    params, static = eqx.partition(model, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    x = jax.ShapeDtypeStruct((batch, 256, 512), jnp.float32)

    def step(params, x, y):
        def loss(p):
            return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    compiled = compile_as_users(jax.jit(step, donate_argnums=0).lower(params, x, x))
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # two compiles at the guide's size
def test_guide_configuration_temporaries():
    # The guide's benchmark: 12 blocks, d_model 512, 8 heads, d_ff 2048, seq 256, batch 32,
    # MSE, SGD. Compile only. Floor: parameter gradients + 12 saved block inputs + one
    # block's activations = 640 MiB.
    def make(remat):
        return eqx.filter_eval_shape(
            lambda k: el.nn.transformer_encoder(12, 512, 8, 2048, key=k, remat=remat),
            jr.PRNGKey(0),
        )

    mib = 2**20
    none = _sgd_step_memory(make(False), 32)
    full = _sgd_step_memory(make(True), 32)
    assert full <= 0.15 * none, (full / mib, none / mib)
    assert full <= 832 * mib, full / mib


OFFLOADED = ["minimal_offloaded", el.nn.Save("attn_out", offload=("qkv", "ffn_hidden"))]


@pytest.mark.parametrize(
    "remat, segment, scan",
    [("minimal_offloaded", None, True)]
    + [  # two compiles each: the rest in CI
        pytest.param(r, *where, marks=pytest.mark.slow)
        for r in OFFLOADED
        for where in [(None, True), (2, True), (None, False)]
        if (r, *where) != ("minimal_offloaded", None, True)
    ],
)
def test_host_offload_keeps_the_numbers(getkey, remat, segment, scan):
    # XLA:CPU drops the host placement, so offloading must be exactly saving: with scan,
    # segments, chunked attention (chunk_size 3 over seq 7, padded) and dropout.
    key, x, dkey = getkey(), jr.normal(getkey(), (2, 7, 16)), getkey()
    kwargs = dict(dropout=0.2, causal=True, chunk_size=3, segment=segment, scan=scan)
    expected = _value_and_grads(_encoder(key, **kwargs), x, dkey)
    got = _value_and_grads(_encoder(key, remat=remat, **kwargs), x, dkey)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_offloaded_residuals_are_placed_on_the_host(getkey, capsys):
    # JAX traces the offloaded intermediates (qkv (6, 48) and ffn_hidden (6, 24)) into
    # pinned host memory; XLA:CPU later drops that placement, a GPU keeps it.
    block = el.nn.TransformerBlock(16, 2, 24, key=getkey(), remat="minimal_offloaded")
    jax.ad_checkpoint.print_saved_residuals(block, jr.normal(getkey(), (6, 16)))
    printed = capsys.readouterr().out
    assert "f32<host>[6,48]" in printed and "f32<host>[6,24]" in printed, printed
    kept = _kept(el.nn.Save("attn_context", offload=("ffn_in",)), getkey)
    intermediates = [r for r in kept if r.source.startswith("intermediate")]
    assert {r.name for r in intermediates} == {"attn_context", None}  # None: the host copy
    assert sorted(r.shape for r in intermediates) == [(6, 16), (6, 16)]


def test_transformer_block_presets_are_declared():
    names, presets = el.nn._remat.module_remat_names(el.nn.TransformerBlock)
    assert names == el.nn._remat.BLOCK_NAMES
    assert (
        presets["dots"] == el.nn._remat.DOTS_NAMES
        and presets["minimal"] == el.nn._remat.MINIMAL_NAMES
    )
    with pytest.raises(ValueError, match="offload_me"):
        el.nn.TransformerBlock(
            8, 2, 8, key=jr.PRNGKey(0), remat=el.nn.Save(offload=("offload_me",))
        )
