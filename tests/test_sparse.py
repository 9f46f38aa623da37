"""Sparse layers and the conversions: values-only parameters that equal the dense layer."""

import ast
import dataclasses
import pathlib
import re
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_lowmem as el
from eqx_lowmem import sparse as sp
from eqx_lowmem.sparse._layers import _Sparse


def _dense_grad_at_indices(layer, grad_weight):
    """The dense weight gradient gathered at each slot's index (0 at empty slots)."""
    flat = grad_weight.reshape(-1)
    idx = np.asarray(layer.indices).astype(np.int64)
    gathered = np.where(idx < layer.size, np.asarray(flat)[np.minimum(idx, layer.size - 1)], 0.0)
    return gathered


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_value_gradient_is_dense_gradient_at_indices(kind, getkey):
    if kind == "linear":
        dense = eqx.nn.Linear(12, 7, key=getkey())
        x = jr.normal(getkey(), (5, 12))
    else:
        dense = eqx.nn.Conv2d(3, 4, 3, padding=1, stride=2, key=getkey())
        x = jr.normal(getkey(), (5, 3, 7, 7))
    sparse = sp.sparsify(dense, 0.4, key=getkey(), slack=0.25)
    assert type(sparse) is (sp.SparseLinear if kind == "linear" else sp.SparseConv2d)
    assert int(sparse.nnz()) < sparse.capacity  # some empty slots, which must get zero

    def loss(model):
        return jnp.sum(jnp.sin(jax.vmap(model)(x)))

    g_sparse = eqx.filter_grad(loss)(sparse)
    g_dense = eqx.filter_grad(loss)(sp.densify(sparse))
    expected = _dense_grad_at_indices(sparse, g_dense.weight)
    np.testing.assert_allclose(np.asarray(g_sparse.values), expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(g_sparse.bias, g_dense.bias, rtol=0, atol=1e-6)
    empty = np.asarray(sparse.indices) >= sparse.size
    assert np.all(np.asarray(g_sparse.values)[empty] == 0.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda k: eqx.nn.Linear(6, 5, key=k),
        lambda k: eqx.nn.Linear(6, 5, use_bias=False, key=k),
        lambda k: eqx.nn.Linear("scalar", 3, key=k),
        lambda k: eqx.nn.Linear(4, "scalar", key=k),
        lambda k: eqx.nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, key=k),
        lambda k: eqx.nn.Conv2d(4, 6, (3, 2), padding="SAME", groups=2, key=k),
        lambda k: eqx.nn.Conv2d(2, 3, 3, padding=1, padding_mode="REFLECT", key=k),
        lambda k: eqx.nn.Conv2d(2, 3, 3, padding="SAME", padding_mode="CIRCULAR", key=k),
    ],
)
def test_density_one_equals_the_dense_layer(make, getkey):
    dense = make(getkey())
    sparse = sp.sparsify(dense, 1.0, key=getkey())
    assert sparse.capacity == sparse.size and int(sparse.nnz()) == sparse.size
    if isinstance(dense, eqx.nn.Linear):
        shape = () if dense.in_features == "scalar" else (dense.in_features,)
    else:
        shape = (dense.in_channels, 9, 8)
    x = jr.normal(getkey(), (3, *shape))
    np.testing.assert_allclose(jax.vmap(sparse)(x), jax.vmap(dense)(x), rtol=1e-5, atol=1e-6)
    assert eqx.tree_equal(sp.densify(sparse), dense)


def test_sparse_forward_equals_densified_model(getkey):
    net = el.nn.mlp([10, 32, 32, 3], key=getkey())
    sparse = sp.sparsify(net, 0.3, key=getkey())
    x = jr.normal(getkey(), (4, 10))
    dense = sp.densify(sparse)
    np.testing.assert_allclose(jax.vmap(sparse)(x), jax.vmap(dense)(x), rtol=1e-5, atol=1e-6)
    # densify keeps the dense weights only where the slots point
    for (_, s), d in zip(sp._convert.sparse_layers(sparse), dense.layers, strict=True):
        assert int(jnp.sum(d.weight != 0)) == int(s.nnz())


def test_counts_uniform_and_erk(getkey):
    net = el.nn.mlp([64, 128, 128, 10], key=getkey())
    for distribution in ("uniform", "erk"):
        sparse = sp.sparsify(net, 0.3, key=getkey(), distribution=distribution)
        s = sp.stats(sparse)
        assert s.layers == 3 and s.size == 64 * 128 + 128 * 128 + 128 * 10
        assert abs(s.nnz - 0.3 * s.size) <= 3  # one rounding per layer
        assert s.capacity == s.nnz
        for _, layer in sp._convert.sparse_layers(sparse):
            live = np.asarray(layer.indices)
            assert len(set(live.tolist())) == live.size and live.max() < layer.size
    erk = sp.sparsify(net, 0.3, key=getkey(), distribution="erk")
    dens = [int(x.nnz()) / x.size for _, x in sp._convert.sparse_layers(erk)]
    assert dens[2] == 1.0 and dens[0] > dens[1]  # small layers denser; the last one dense
    assert sp._convert.erk_densities([(10, 10)], 0.5) == [0.5]


def test_slack_and_index_dtypes(getkey):
    net = el.nn.mlp([8, 16, 4], key=getkey())
    sparse = sp.sparsify(net, 0.5, key=getkey(), slack=0.5)
    first, last = sparse.layers
    assert first.indices.dtype == jnp.int16 and last.indices.dtype == jnp.int8
    assert first.capacity == 96 and int(first.nnz()) == 64
    assert np.all(np.asarray(first.values)[64:] == 0) and np.all(first.indices[64:] == 128)
    assert sp._storage.index_dtype(127) == jnp.int8 and sp._storage.index_dtype(128) == jnp.int16
    assert (
        sp._storage.index_dtype(32767) == jnp.int16 and sp._storage.index_dtype(32768) == jnp.int32
    )
    assert sp.stats(sparse).index_bytes == 96 * 2 + 48 * 1


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_bit_set_storage_gives_the_same_layer(kind):
    key = jr.PRNGKey(0)
    if kind == "linear":
        dense, x = eqx.nn.Linear(40, 24, key=key), jr.normal(jr.PRNGKey(1), (5, 40))
        cls, capacity = sp.SparseLinear, 300
    else:
        dense, x = eqx.nn.Conv2d(4, 8, 3, padding=1, key=key), jr.normal(key, (5, 4, 7, 7))
        cls, capacity = sp.SparseConv2d, 100
    kept = cls.from_dense(dense, 0.3, key=jr.PRNGKey(2), capacity=capacity)
    bits = cls.from_dense(dense, 0.3, key=jr.PRNGKey(2), capacity=capacity, storage="bits")
    # one bit per dense weight, against one int16 per slot; the same slots and values
    size = kept.size
    assert bits.indices.dtype == jnp.uint8 and bits.indices.shape == (-(-size // 8),)
    assert kept.indices.dtype == jnp.int16 and kept.indices.shape == (capacity,)
    np.testing.assert_array_equal(bits.positions(), kept.indices)
    assert int(bits.nnz()) == int(kept.nnz()) == round(0.3 * size)
    _same(bits.values, kept.values)
    _same(bits.weight, kept.weight)

    def loss(layer, x):
        return jnp.sum(jnp.sin(jax.vmap(layer)(x)))

    for fn in (loss, lambda layer, x: loss(layer, x[:1])):  # batched; one example
        grad = eqx.filter_jit(eqx.filter_value_and_grad(fn))
        (v1, g1), (v2, g2) = (grad(m, x) for m in (bits, kept))
        _same(v1, v2)
        _same(g1.values, g2.values)
        assert np.all(np.asarray(g1.values)[int(bits.nnz()) :] == 0)  # empty slots
    assert cls.from_dense(dense, 0.3, key=key, storage="auto").indices.dtype == jnp.uint8
    small = cls.from_dense(dense, 0.02, key=key, storage="auto")  # 1 slot per 50 weights
    assert small.indices.dtype == jnp.int16


def test_a_bit_set_with_more_bits_than_slots_keeps_the_first_ones():
    # Built by hand: all 32 positions set, 5 slots. The first 5 positions take the slots;
    # the rest are zero and get no gradient (they write nowhere, not out of bounds).
    dense = eqx.nn.Linear(8, 4, use_bias=False, key=jr.PRNGKey(0))
    layer = sp.SparseLinear.from_dense(dense, 5 / 32, key=jr.PRNGKey(1), storage="bits")
    values = jnp.arange(1.0, 6.0)
    layer = dataclasses.replace(layer, values=values, indices=jnp.full((4,), 255, jnp.uint8))
    np.testing.assert_array_equal(layer.positions(), np.arange(5))
    expected = np.zeros(32, np.float32)
    expected[:5] = values
    np.testing.assert_array_equal(layer.weight.reshape(-1), expected)
    x = jr.normal(jr.PRNGKey(2), (3, 8))
    grad = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(layer)
    np.testing.assert_allclose(grad.values, np.sum(x, axis=0)[:5], rtol=1e-6)


@pytest.mark.slow  # a stacked encoder in both storages, compiled twice each
def test_bit_set_storage_of_stacked_layers_and_its_bytes(getkey):
    enc = el.nn.transformer_encoder(3, 16, 2, 32, key=getkey(), remat=True)
    key = getkey()
    kept = sp.sparsify(enc, 0.3, key=key, slack=0.1)
    bits = sp.sparsify(enc, 0.3, key=key, slack=0.1, storage="bits")
    qkv = bits.blocks.qkv
    assert qkv.indices.shape == (3, qkv.size // 8) and qkv.positions().shape == (3, qkv.capacity)
    for (_, a), (_, b) in zip(
        sp._convert.sparse_layers(kept), sp._convert.sparse_layers(bits), strict=True
    ):
        np.testing.assert_array_equal(a.indices, b.positions())
    x = jr.normal(getkey(), (2, 5, 16))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    _same(run(bits, x), run(kept, x))
    densify = eqx.filter_jit(sp.densify)
    _same(densify(bits), densify(kept))
    # int16 indices: 2 bytes a slot; bits: 1/8 byte a dense weight
    s_kept, s_bits = sp.stats(kept), sp.stats(bits)
    assert s_kept.index_bytes == 2 * s_kept.capacity
    assert s_bits.index_bytes == s_bits.size // 8
    with pytest.raises(ValueError, match=r"storage='bitset'; expected one of"):
        sp.sparsify(enc, 0.3, key=key, storage="bitset")
    with pytest.raises(ValueError, match=r"must have shape \(3, 96\).*got \(3, 95\)"):
        dataclasses.replace(qkv, indices=qkv.indices[:, 1:])


def test_stacked_layers_of_the_encoder(getkey):
    enc = el.nn.transformer_encoder(3, 16, 2, 32, key=getkey(), remat=True)
    sparse = sp.sparsify(enc, 0.3, key=getkey(), slack=0.1)
    paths = [p for p, _ in sp._convert.sparse_layers(sparse)]
    assert len(paths) == 4 and all(p.endswith(("qkv", "proj", "ff1", "ff2")) for p in paths)
    qkv = sparse.blocks.qkv
    assert qkv.stack_shape == (3,) and qkv.values.shape == (3, qkv.capacity)
    # each layer of the stack has its own positions, the same count
    assert not np.array_equal(qkv.indices[0], qkv.indices[1])
    np.testing.assert_array_equal(qkv.nnz(), [round(0.3 * qkv.size)] * 3)
    assert eqx.tree_equal(sp.densify(sp.sparsify(enc, 1.0, key=getkey())), enc)
    with pytest.raises(ValueError, match="stacked layers"):
        qkv(jnp.ones(16))


def test_sparse_encoder_forward(getkey):
    enc = el.nn.transformer_encoder(2, 16, 2, 32, key=getkey(), remat=True)
    sparse = sp.sparsify(enc, 0.3, key=getkey())
    x = jr.normal(getkey(), (2, 5, 16))
    np.testing.assert_allclose(
        jax.vmap(sparse)(x), jax.vmap(sp.densify(sparse))(x), rtol=1e-5, atol=1e-5
    )


def test_sixteen_bit_values_keep_integer_indices(getkey):
    net = sp.sparsify(el.nn.mlp([8, 16, 4], key=getkey()), 0.5, key=getkey())
    half = el.precision.get_policy("half_bf16").cast_to_param(net)
    layer = half.layers[0]
    assert layer.values.dtype == jnp.bfloat16 and layer.indices.dtype == jnp.int16
    y = half(jnp.ones(8, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and y.shape == (4,)


def test_bad_inputs(getkey):
    net = el.nn.mlp([8, 16, 4], key=getkey())
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density="):
            sp.sparsify(net, bad, key=getkey())
    with pytest.raises(ValueError, match="capacity"):
        sp.SparseLinear.from_dense(net.layers[0], 0.5, key=getkey(), capacity=10)
    with pytest.raises(ValueError, match="capacity"):
        sp.SparseLinear.from_dense(net.layers[0], 0.5, key=getkey(), capacity=1000)
    with pytest.raises(ValueError, match="slack=-0.1 would give a capacity below"):
        sp.sparsify(net, 0.5, key=getkey(), slack=-0.1)
    with pytest.raises(ValueError, match="distribution='erdos'"):
        sp.sparsify(net, 0.5, key=getkey(), distribution="erdos")
    with pytest.raises(ValueError, match=r"exclude names \['.layers\[5\]'\]"):
        sp.sparsify(net, 0.5, key=getkey(), exclude=[".layers[5]"])
    with pytest.raises(ValueError, match="no eqx.nn.Linear"):
        sp.sparsify(net, 0.5, key=getkey(), exclude=[".layers[0]", ".layers[1]"])
    with pytest.raises(ValueError, match=r"density\('.layers\[1\]'\)=2"):
        sp.sparsify(net, lambda path, layer: 2 if "1" in path else 0.5, key=getkey())
    model = (net, eqx.nn.Conv1d(2, 3, 3, key=getkey()), eqx.nn.Embedding(10, 4, key=getkey()))
    with pytest.raises(TypeError, match=r"equinox.*Conv1d at '\[1\]'.*exclude=\['\[1\]'\]"):
        sp.sparsify(model, 0.5, key=getkey())
    with pytest.raises(TypeError, match=r"Embedding at '\[2\]'"):
        sp.sparsify(model, 0.5, key=getkey(), exclude=["[1]"])
    kept = sp.sparsify(model, 0.5, key=getkey(), exclude=lambda p, x: p != "[0].layers[0]")
    assert sp.stats(kept).layers == 1 and isinstance(kept[0].layers[1], eqx.nn.Linear)
    with pytest.raises(TypeError, match="indices must be integers"):
        sp.SparseLinear(
            values=jnp.zeros(3),
            indices=jnp.zeros(3),
            bias=None,
            in_features=2,
            out_features=2,
            use_bias=False,
        )
    with pytest.raises(ValueError, match="expects one example of shape \\(8,\\)"):
        sp.sparsify(net, 0.5, key=getkey()).layers[0](jnp.ones((2, 8)))
    # A seed where a key belongs, as a user sees it (it used to fail inside jax.random;
    # the suite's runtime type checker answers first, so call past it).
    unchecked = getattr(sp.sparsify, "__wrapped__", sp.sparsify)
    with pytest.raises(TypeError, match=r"sparsify\(key=...\) must be a JAX PRNG key.*got int 0"):
        unchecked(net, 0.5, key=0)
    # each type converts its own dense layers only
    with pytest.raises(TypeError, match="SparseConv2d.from_dense cannot convert a Linear"):
        sp.SparseConv2d.from_dense(net.layers[0], 0.5, key=getkey())


def test_per_layer_density_function(getkey):
    net = el.nn.mlp([8, 16, 16, 4], key=getkey())
    sparse = sp.sparsify(
        net, lambda path, layer: 1.0 if path == ".layers[2]" else 0.25, key=getkey()
    )
    counts = [int(x.nnz()) for _, x in sp._convert.sparse_layers(sparse)]
    assert counts == [32, 64, 64]
    assert sp.density(net) == 1.0 and sp.stats(net).layers == 0


def test_densify_builds_no_random_dense_layer(getkey):
    # densify runs inside the jitted RigL step: its dense layers must be the sparse ones'
    # weights, not freshly initialised layers whose weights are then replaced.
    net = sp.sparsify(el.nn.mlp([8, 16, 4], key=getkey()), 0.5, key=getkey())
    conv = sp.sparsify(eqx.nn.Conv2d(2, 4, 3, key=getkey()), 0.5, key=getkey())
    jaxpr = jax.make_jaxpr(sp.densify)((net, conv))
    names = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert not {n for n in names if "random" in n or "threefry" in n}, names
    assert eqx.tree_equal(sp.densify(net).layers[0].weight, net.layers[0].weight)


def test_no_import_cycle_in_sparse():
    # The modules of eqx_lowmem/sparse and the sibling modules each imports, anywhere in
    # the file (function bodies too): a layer type owns its conversions, so the layers
    # never import the conversions back.
    folder = pathlib.Path(sp.__file__).parent
    imports = {
        path.stem: {
            node.module
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        }
        for path in folder.glob("_*.py")
        if path.name != "__init__.py"
    }
    assert imports["_convert"] == {"_layers"}

    def reach(start, here, seen):
        for nxt in imports.get(here, ()):
            assert nxt != start, f"{start} imports itself through {here}"
            if nxt not in seen:
                seen.add(nxt)
                reach(start, nxt, seen)

    for name in imports:
        reach(name, name, set())


class _Scale(eqx.Module):
    """A dense layer type of this test: `weight * x`, elementwise."""

    weight: jax.Array

    def __call__(self, x, *, key=None):
        return self.weight * x


class _SparseScale(_Sparse):
    """Its sparse type, written as one class: nothing else in eqx_lowmem.sparse changes."""

    values: jax.Array
    indices: jax.Array
    features: int = eqx.field(static=True)
    bias: Any = None
    dense_rank = 1

    @property
    def weight_shape(self):
        return (self.features,)

    @classmethod
    def converts(cls, layer):
        return isinstance(layer, _Scale)

    @classmethod
    def _from_slots(cls, layer, values, indices):
        return cls(values, indices, layer.weight.shape[-1])

    def to_dense(self):
        return _Scale(self.weight)

    def __call__(self, x, *, key=None):
        return self.weight * x


class _Info(NamedTuple):
    grads: Any
    key: Any
    grad_fn: Any


def test_a_new_sparse_layer_type_is_one_class(getkey):
    model = {"scale": _Scale(jr.normal(getkey(), (40,)))}
    sparse = sp.sparsify(model, 0.5, key=getkey(), slack=0.2)
    layer = sparse["scale"]
    assert type(layer) is _SparseScale and layer.capacity == 24
    assert int(layer.nnz()) == 20 and sp.stats(sparse).layers == 1
    dense = sp.densify(sparse)["scale"]
    assert type(dense) is _Scale
    kept = np.asarray(dense.weight) != 0
    np.testing.assert_array_equal(np.asarray(dense.weight)[kept], model["scale"].weight[kept])
    # the rewiring hooks move its slots too
    state = el.train.TrainState(
        step=jnp.asarray(1, jnp.int32), model=sparse, opt_state=(), key=getkey()
    )
    new = eqx.filter_jit(sp.set_(period=1, fraction=0.5))(state, _Info(None, getkey(), None))
    assert int(new.model["scale"].nnz()) == 20
    assert not np.array_equal(new.model["scale"].indices, layer.indices)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_a_sparse_layer_on_the_data_computes_no_input_gradient(getkey, kind):
    # The first layer's input is the data: nobody asks for its gradient. The compiled
    # gradient step runs as many products (dots or convolutions) as the dense layer's.
    if kind == "linear":
        dense, x = eqx.nn.Linear(8, 16, key=getkey()), jr.normal(getkey(), (5, 8))
    else:
        dense, x = eqx.nn.Conv2d(3, 4, 3, key=getkey()), jr.normal(getkey(), (5, 3, 8, 8))

    def products(model):
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def loss(p):
            return jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2)

        hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
        return len(re.findall(r"= \S+ (?:dot|convolution)\(", hlo))

    assert products(sp.sparsify(dense, 0.5, key=getkey())) == products(dense) == 2
