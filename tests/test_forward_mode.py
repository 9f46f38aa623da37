"""Forward-mode autodiff (`jax.jvp`, `jax.jacfwd`) through eqx_lowmem's layers with custom
rules: their tangents equal those of plain JAX reference code, alone and under vmap."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax.ad_checkpoint import checkpoint_name

import eqx_lowmem as el
from eqx_lowmem.nn._activation import gelu
from eqx_lowmem.nn._attention import _softmax
from eqx_lowmem.nn._conv import conv2d

from .helpers import tree_allclose


def _randomised(module, getkey):
    """`module` with its floating arrays replaced by random normals (not ones and zeros)."""
    params, static = eqx.partition(module, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    leaves = [1.0 + 0.3 * jr.normal(getkey(), a.shape, a.dtype) for a in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


def _jvp_both(f, ref, primals, tangents):
    y, t = jax.jvp(f, primals, tangents)
    y_ref, t_ref = jax.jvp(ref, primals, tangents)
    assert tree_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert tree_allclose(t, t_ref, rtol=1e-5, atol=1e-5)


def test_layer_norm_jvp_matches_eqx(getkey):
    ours = _randomised(el.nn.LayerNorm(6), getkey)
    ref = eqx.nn.LayerNorm(6)
    ref = eqx.tree_at(lambda m: (m.weight, m.bias), ref, (ours.weight, ours.bias))
    x, dx = 3.0 + jr.normal(getkey(), (5, 6)), jr.normal(getkey(), (5, 6))
    dm = _randomised(el.nn.LayerNorm(6), getkey)  # a tangent for the parameters too

    def f(m, x):
        return jax.vmap(m)(x)

    def g(m, x):
        r = eqx.tree_at(lambda r: (r.weight, r.bias), ref, (m.weight, m.bias))
        return jax.vmap(r)(x)

    _jvp_both(f, g, (ours, x), (dm, dx))
    # jacfwd of one example, and jvp under vmap of jvp's own batch.
    jac = jax.jacfwd(ours)(x[0])
    assert tree_allclose(jac, jax.jacfwd(ref)(x[0]), rtol=1e-5, atol=1e-5)
    per_example = jax.vmap(lambda x, dx: jax.jvp(ours, (x,), (dx,)))(x, dx)
    assert tree_allclose(per_example, jax.vmap(lambda x, dx: jax.jvp(ref, (x,), (dx,)))(x, dx))


@pytest.mark.parametrize("relu", [False, True])
def test_group_norm_jvp_matches_plain_jax(getkey, relu):
    gn = _randomised(el.nn.GroupNorm(2, 4), getkey)

    def reference(m, x):
        g = x.reshape(2, -1)
        mean = jnp.mean(g, axis=1, keepdims=True)
        var = jnp.mean(jnp.square(g - mean), axis=1, keepdims=True)
        y = ((g - mean) / jnp.sqrt(var + 1e-5)).reshape(x.shape)
        y = y * m.weight[:, None] + m.bias[:, None]
        return jax.nn.relu(y) if relu else y

    x, dx = jr.normal(getkey(), (3, 4, 5)), jr.normal(getkey(), (3, 4, 5))
    dm = _randomised(el.nn.GroupNorm(2, 4), getkey)

    def f(m, x):
        return jax.vmap(lambda e: m(e, relu=relu))(x)

    def g(m, x):
        return jax.vmap(lambda e: reference(m, e))(x)

    _jvp_both(f, g, (gn, x), (dm, dx))
    jac = jax.jacfwd(lambda e: gn(e, relu=relu))(x[0])
    assert tree_allclose(jac, jax.jacfwd(lambda e: reference(gn, e))(x[0]), atol=1e-5)


def test_gelu_jvp_matches_jax(getkey):
    x, dx = 2.0 * jr.normal(getkey(), (4, 7)), jr.normal(getkey(), (4, 7))
    _jvp_both(gelu, lambda x: jax.nn.gelu(x, approximate=True), (x,), (dx,))
    ref = jax.vmap(jax.jacfwd(lambda e: jax.nn.gelu(e, approximate=True)))(x)
    assert tree_allclose(jax.vmap(jax.jacfwd(gelu))(x), ref, rtol=1e-5, atol=1e-5)
    # bfloat16: computed in float32 and rounded once (one bfloat16 rounding, 8 bits).
    xb, dxb = x.astype(jnp.bfloat16), dx.astype(jnp.bfloat16)
    _, t = jax.jvp(gelu, (xb,), (dxb,))
    _, t_ref = jax.jvp(lambda x: jax.nn.gelu(x, approximate=True), (x,), (dx,))
    assert t.dtype == jnp.bfloat16
    assert tree_allclose(t.astype(jnp.float32), t_ref, rtol=2**-6, atol=2**-6)


def test_batch_norm_jvp_matches_plain_jax(getkey):
    bn = el.nn.BatchNorm(3)

    def reference(w, b, x):  # x: (batch, channels, width)
        mean = jnp.mean(x, axis=(0, 2), keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=(0, 2), keepdims=True)
        y = (x - mean) / jnp.sqrt(var + 1e-5)
        return jax.nn.relu(y * w[None, :, None] + b[None, :, None])

    def f(w, b, x):
        m = eqx.tree_at(lambda m: (m.weight, m.bias), bn, (w, b))
        call = jax.vmap(
            lambda e, s: m(e, s, relu=True), axis_name="batch", in_axes=(0, None),
            out_axes=(0, None),
        )  # fmt: skip
        return call(x, m.init_stats())[0]

    w, b, dw, db = (jr.normal(getkey(), (3,)) for _ in range(4))
    x, dx = 2.0 + jr.normal(getkey(), (4, 3, 5)), jr.normal(getkey(), (4, 3, 5))
    _jvp_both(f, reference, (w, b, x), (dw, db, dx))
    jac = jax.jacfwd(f, argnums=(0, 2))(w, b, x)
    assert tree_allclose(jac, jax.jacfwd(reference, argnums=(0, 2))(w, b, x), atol=1e-5)


def test_16_bit_softmax_jvp_matches_float32_softmax(getkey):
    logits, dl = jr.normal(getkey(), (2, 3, 7)), jr.normal(getkey(), (2, 3, 7))
    y, t = jax.jvp(lambda z: _softmax(z, jnp.dtype(jnp.bfloat16)), (logits,), (dl,))
    y_ref, t_ref = jax.jvp(lambda z: jax.nn.softmax(z, axis=-1), (logits,), (dl,))
    assert y.dtype == t.dtype == jnp.bfloat16
    # One bfloat16 rounding of each (8 bits of mantissa).
    assert tree_allclose(t.astype(jnp.float32), t_ref, rtol=2**-7, atol=2**-8)
    assert tree_allclose(y.astype(jnp.float32), y_ref, rtol=2**-7, atol=2**-8)


@pytest.mark.parametrize("remat", [False, True, "minimal"])
def test_transformer_block_jvp_agrees_with_its_gradient(getkey, remat):
    # <ct, J dx> from forward mode equals <J^T ct, dx> from reverse mode (which the other
    # tests check against plain autodiff), under vmap over a batch.
    block = el.nn.TransformerBlock(16, 2, 24, key=getkey(), remat=remat)
    params, static = eqx.partition(block, eqx.is_inexact_array)
    x, dx, ct = (jr.normal(getkey(), (3, 6, 16)) for _ in range(3))
    dp = jax.tree.map(lambda a: jr.normal(getkey(), a.shape), params)

    def f(p, x):
        return jax.vmap(eqx.combine(p, static))(x)

    _, t = jax.jvp(f, (params, x), (dp, dx))
    gp, gx = jax.grad(lambda p, x: jnp.sum(f(p, x) * ct), argnums=(0, 1))(params, x)
    pairs = jax.tree.leaves(jax.tree.map(lambda g, d: jnp.sum(g * d), (gp, gx), (dp, dx)))
    assert tree_allclose(jnp.sum(t * ct), sum(pairs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride, padding", [(1, 1), (2, "SAME")])
def test_convolution_jvp_under_vmap_matches_eqx(getkey, stride, padding):
    # Under vmap, conv2d runs one batched canonical convolution (a custom rule); its
    # tangent equals eqx.nn.Conv2d's, kernel and input both varying.
    layer = eqx.nn.Conv2d(3, 4, 3, stride=stride, padding=padding, key=getkey())
    dlayer = eqx.nn.Conv2d(3, 4, 3, stride=stride, padding=padding, key=getkey())
    x, dx = jr.normal(getkey(), (5, 3, 9, 9)), jr.normal(getkey(), (5, 3, 9, 9))
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    dparams = eqx.filter(dlayer, eqx.is_inexact_array)

    def ours(p, x):
        return jax.vmap(lambda e: conv2d(eqx.combine(p, static), e))(x)

    def ref(p, x):
        return jax.vmap(eqx.combine(p, static))(x)

    _jvp_both(ours, ref, (params, x), (dparams, dx))
    # jvp inside the vmap: per example, the plain layer.
    per = jax.vmap(lambda x, dx: jax.jvp(lambda e: ours(params, e[None])[0], (x,), (dx,)))(x, dx)
    assert tree_allclose(per, jax.jvp(lambda x: ref(params, x), (x,), (dx,)), atol=1e-5)
    jac = jax.jacfwd(ours)(params, x[:2])
    assert tree_allclose(jac, jax.jacfwd(ref)(params, x[:2]), rtol=1e-5, atol=1e-5)


def _vmapped_batch_norm(bn):
    call = jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    return lambda h: call(h, bn.init_stats())[0]


_CONV = eqx.nn.Conv2d(4, 4, 3, padding=1, key=jr.PRNGKey(0))
_LAYERS = {  # a layer over a batch, and the batch's shape
    "gelu": (gelu, (5, 6)),
    "LayerNorm": (jax.vmap(el.nn.LayerNorm(6)), (5, 6)),
    "GroupNorm": (jax.vmap(el.nn.GroupNorm(2, 4)), (2, 4, 6)),
    "BatchNorm": (_vmapped_batch_norm(el.nn.BatchNorm(4)), (2, 4, 6)),
    "conv2d": (jax.vmap(lambda e: conv2d(_CONV, e)), (2, 4, 5, 5)),
}


@pytest.mark.parametrize("name", list(_LAYERS))
def test_a_saved_input_is_not_kept_again_by_the_rule(getkey, name):
    # A loop of blocks, each checkpointed with a policy that saves the named input of the
    # layer: reverse mode keeps, per block, the block's input and that named value and
    # nothing more of their size. A rule's own jax.checkpoint would forward the saved
    # value as a residual of its own, which the loop stacks again (WideResNet's "minimal"
    # went from 0.78x to 0.99x of no remat that way).
    layer, shape = _LAYERS[name]
    policy = jax.checkpoint_policies.save_only_these_names("h")

    def body(c, _):
        h = checkpoint_name(jnp.sin(c), "h")
        return c + jnp.sin(layer(h)), None  # the layer's output is needed backward too

    def f(x):
        return jax.lax.scan(jax.checkpoint(body, policy=policy), x, None, length=3)[0]

    _, f_vjp = jax.vjp(f, jr.normal(getkey(), shape))
    stacked = [a for a in jax.tree.leaves(f_vjp) if getattr(a, "shape", None) == (3, *shape)]
    assert len(stacked) == 2


@pytest.mark.slow  # 14 s: a WideResNet forward, backward and jvp
def test_wide_resnet_jvp_agrees_with_its_gradient(getkey):
    model, state = eqx.nn.make_with_state(el.nn.WideResNet)(10, 1, 10, key=getkey(),
                                                          in_channels=1)  # fmt: skip
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x, dx = jr.normal(getkey(), (4, 1, 8, 8)), jr.normal(getkey(), (4, 1, 8, 8))
    dp = jax.tree.map(lambda a: jr.normal(getkey(), a.shape), params)
    ct = jr.normal(getkey(), (4, 10))

    def f(p, x):
        return eqx.combine(p, static).batched(x, state)[0]

    _, t = jax.jvp(f, (params, x), (dp, dx))
    gp, gx = jax.grad(lambda p, x: jnp.sum(f(p, x) * ct), argnums=(0, 1))(params, x)
    pairs = jax.tree.leaves(jax.tree.map(lambda g, d: jnp.sum(g * d), (gp, gx), (dp, dx)))
    assert tree_allclose(jnp.sum(t * ct), sum(pairs), rtol=1e-4, atol=1e-4)


def test_a_sparse_layer_jvp_of_one_example_matches_its_dense_layer(getkey):
    # Reverse mode only under vmap (a custom_vjp, README); one example takes jax.jvp.
    dense = eqx.nn.Linear(8, 4, key=getkey())
    sparse = el.sparse.SparseLinear.from_dense(dense, 0.5, key=getkey())
    x, dx = jr.normal(getkey(), (8,)), jr.normal(getkey(), (8,))
    _jvp_both(sparse, sparse.to_dense(), (x,), (dx,))
