"""`eqx_lowmem.nn.Stack`: a user's identical blocks, scanned and recomputed, with the numbers
of a plain Python loop."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax.ad_checkpoint import checkpoint_name

import eqx_lowmem as el
from eqx_lowmem.nn._layers import layer_hook

from .helpers import compile_as_users, tree_allclose


class Residual(eqx.Module):
    """A user's block: x + W2 dropout(tanh(W1 x)), with two checkpoint names."""

    checkpoint_names: ClassVar[tuple[str, ...]] = ("hidden", "out")
    remat_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "dots": ("hidden", "out"),
        "minimal": ("hidden",),
    }

    w1: eqx.nn.Linear
    w2: eqx.nn.Linear

    def __init__(self, width, *, key):
        k1, k2 = jr.split(key)
        self.w1 = eqx.nn.Linear(width, 2 * width, key=k1)
        self.w2 = eqx.nn.Linear(2 * width, width, key=k2)

    def __call__(self, x, *, key=None):
        h = jnp.tanh(checkpoint_name(self.w1(x), "hidden"))
        if key is not None:
            h = jnp.where(jr.bernoulli(key, 0.7, h.shape), h / 0.7, 0.0)
        return x + checkpoint_name(self.w2(h), "out")


class Plain(eqx.Module):
    """A block that declares nothing: only "none" and "full" apply."""

    w: eqx.nn.Linear

    def __call__(self, x, *, key=None):
        return x + jnp.sin(self.w(x))


class Counting(eqx.Module):
    """A stateful block: its state is a running mean of its input, as BatchNorm keeps."""

    w: eqx.nn.Linear

    def __call__(self, x, state, *, key=None):
        mean = 0.9 * state["mean"] + 0.1 * x
        return x + jnp.tanh(self.w(x)) * mean, {"mean": mean, "count": state["count"] + 1}


def make_counting(key):
    return Counting(eqx.nn.Linear(6, 6, key=key)), {
        "mean": jnp.zeros(6),
        "count": jnp.zeros((), jnp.int32),
    }


def _layers(stacked):
    """The stack's blocks as a list of ordinary modules."""
    return _unstack(stacked.blocks, stacked.n_layers)


def _unstack(blocks, n_layers):
    params, static = eqx.partition(blocks, eqx.is_array)
    return [eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static) for i in range(n_layers)]


def _loop_blocks(blocks, n_layers, x, key):
    for i, block in enumerate(_unstack(blocks, n_layers)):
        x = block(x, key=None if key is None else jr.fold_in(key, i))
    return x


def _loop(stacked, x, key):
    return _loop_blocks(stacked.blocks, stacked.n_layers, x, key)


def _value_and_grads(fn, model, x, key):
    def loss(mx):
        m, xs = mx
        keys = None if key is None else jr.split(key, xs.shape[0])
        return jnp.sum(jnp.sin(jax.vmap(lambda xi, k: fn(m, xi, k))(xs, keys)))

    value, grads = eqx.filter_value_and_grad(loss)((model, x))
    return [value, *jax.tree.leaves(grads)]


@eqx.filter_jit
def _stack_value_and_grads(net, x, key):
    return _value_and_grads(lambda m, xi, k: m(xi, key=k), net, x, key)


@eqx.filter_jit
def _loop_value_and_grads(blocks, n_layers, x, key):
    """The reference, a Python loop over the blocks. It takes the blocks (the stack's only
    arrays: the same gradient leaves in the same order), not the stack, so that stacks that
    differ only in remat, segment or scan share one compilation of it."""
    return _value_and_grads(lambda b, xi, k: _loop_blocks(b, n_layers, xi, k), blocks, x, key)


@pytest.mark.parametrize(
    "remat, segment, scan",
    [
        (False, None, True),
        (True, None, True),
        ("dots", None, True),
        ("minimal", None, False),
        (el.nn.Save("out", offload=("hidden",)), None, True),
        ("minimal_offloaded", None, True),
        (False, 2, True),  # 5 layers: segments of 2, 2 and a shorter 1
        (True, "sqrt", True),
        ("minimal", 2, False),
    ],
)
@pytest.mark.parametrize("dropout", [False, True])
def test_stack_equals_a_python_loop(getkey, remat, segment, scan, dropout):
    init, dkey = getkey(), getkey()
    net = el.nn.stack(
        lambda k: Residual(4, key=k), 5, key=init, remat=remat, segment=segment, scan=scan
    )
    x = jr.normal(getkey(), (3, 4))
    key = dkey if dropout else None
    expected = _loop_value_and_grads(net.blocks, net.n_layers, x, key)
    got = _stack_value_and_grads(net, x, key)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # Block i is built from jr.split(key, n)[i], as a user's own loop would build it.
    first = Residual(4, key=jr.split(init, 5)[0])
    assert tree_allclose(_layers(net)[0].w1.weight, first.w1.weight)


def test_sqrt_segment_and_fields(getkey):
    net = el.nn.stack(lambda k: Residual(2, key=k), 10, key=getkey(), segment="sqrt")
    assert (net.n_layers, net.segment, net.remat, net.scan) == (10, 3, "none", True)
    assert net.blocks.w1.weight.shape == (10, 4, 2)
    assert el.nn.stack(lambda k: Residual(2, key=k), 2, key=getkey(), remat=True).remat == "full"


@pytest.mark.parametrize("segment", [None, 2])
@pytest.mark.parametrize("remat", [False, True])
def test_stateful_stack_threads_each_layers_state(getkey, segment, remat):
    net, states = el.nn.stack(
        make_counting, 3, key=getkey(), stateful=True, segment=segment, remat=remat
    )
    assert states["mean"].shape == (3, 6) and states["count"].shape == (3,)
    x = jr.normal(getkey(), (6,))
    y, new = net(x, states)
    h, expected = x, []
    for i, block in enumerate(_layers(net)):
        h, s = block(h, jax.tree.map(lambda a, i=i: a[i], states))
        expected.append(s)
    expected = jax.tree.map(lambda *a: jnp.stack(a), *expected)
    assert tree_allclose(y, h, atol=1e-6)
    assert tree_allclose(new, expected, atol=1e-6)
    assert new["count"].tolist() == [1, 1, 1]
    grads = jax.grad(lambda m: jnp.sum(m(x, states)[0]))(net)
    assert jnp.all(jnp.isfinite(grads.blocks.w.weight))


def test_prepare_layer_sees_each_layer_inside_the_recomputed_body(getkey):
    net = el.nn.stack(lambda k: Residual(4, key=k), 3, key=getkey(), remat=True, layer_spec="spec")
    seen = []

    def hook(stack, params):
        seen.append((stack.layer_spec, params.w1.weight.shape))
        return jax.tree.map(lambda a: 2 * a, params)

    x = jr.normal(getkey(), (4,))
    with layer_hook(hook):
        y = net(x)
        grads = jax.grad(lambda m: jnp.sum(m(x)))(net)
    doubled = eqx.tree_at(lambda m: m.blocks, net, jax.tree.map(lambda a: 2 * a, net.blocks))
    assert tree_allclose(y, _loop(doubled, x, None), atol=1e-6)
    # One layer's slice at a time, and again in the backward pass's recomputation.
    assert seen[0] == ("spec", (8, 4)) and len(seen) >= 2
    expected = jax.grad(lambda m: jnp.sum(_loop(m, x, None)))(doubled)
    assert tree_allclose(grads.blocks.w1.weight, 2 * expected.blocks.w1.weight, atol=1e-5)
    assert tree_allclose(net(x), _loop(net, x, None), atol=1e-6)  # outside: identity


def _residual_bytes(net, x):
    kept = el.memory.saved_residuals(lambda m, x: jax.vmap(m)(x), net, x)
    return {r.name for r in kept if r.source.startswith("intermediate")}


def test_presets_keep_the_blocks_declared_names(getkey):
    x = jr.normal(getkey(), (3, 4))

    def names(remat):
        net = el.nn.stack(lambda k: Residual(4, key=k), 2, key=getkey(), remat=remat)
        return _residual_bytes(net, x)

    assert "hidden" in names("minimal") and "out" not in names("minimal")
    assert "hidden" not in names("full") and "out" not in names("full")


def _temp_bytes(remat):
    net = el.nn.stack(lambda k: Residual(64, key=k), 8, key=jr.PRNGKey(0), remat=remat)
    params, static = eqx.partition(net, eqx.is_array)
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)

    def step(p, x):
        def loss(p):
            return jnp.mean(jnp.sin(jax.vmap(eqx.combine(p, static))(x)))

        g = jax.grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    compiled = compile_as_users(jax.jit(step, donate_argnums=0).lower(params, x))
    return compiled.memory_analysis().temp_size_in_bytes


def test_recomputation_cuts_compiled_memory():
    none, full = _temp_bytes(False), _temp_bytes(True)
    # 8 blocks each keeping (256, 128) hidden values twice; full keeps 8 block inputs.
    assert full <= 0.5 * none, (full, none)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(remat="dots"), "Plain does not define what 'dots' keeps"),
        (dict(remat="minimal_offloaded"), "does not define what 'minimal'"),
        (dict(remat=el.nn.Save("hidden")), r"names \['hidden'\], which Plain"),
        (dict(remat="everything"), "not a preset"),
        (dict(segment=0), "segment must be"),
        (dict(segment=True), "segment must be"),
    ],
)
def test_stack_rejects_what_the_block_does_not_define(getkey, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        el.nn.stack(lambda k: Plain(eqx.nn.Linear(2, 2, key=k)), 3, key=getkey(), **kwargs)


def test_stack_rejects_bad_use(getkey):
    with pytest.raises(ValueError, match="n_layers must be a positive int"):
        el.nn.stack(lambda k: Residual(2, key=k), 0, key=getkey())
    with pytest.raises(TypeError, match=r"must return \(block, state\)"):
        el.nn.stack(lambda k: Residual(2, key=k), 2, key=getkey(), stateful=True)
    with pytest.raises(TypeError, match="must return an equinox.Module"):
        el.nn.stack(lambda k: jnp.zeros(2), 2, key=getkey())
    net, states = el.nn.stack(make_counting, 2, key=getkey(), stateful=True)
    with pytest.raises(ValueError, match="stateful"):
        net(jnp.zeros(6))
    plain = el.nn.stack(lambda k: Residual(2, key=k), 2, key=getkey())
    with pytest.raises(ValueError, match="stateless"):
        plain(jnp.zeros(2), {"a": jnp.zeros(2)})


class Narrowing(eqx.Module):
    """A block that changes its input's shape (8 -> 4) or, with `cast`, its dtype."""

    w: eqx.nn.Linear
    cast: bool = eqx.field(static=True, default=False)

    def __call__(self, x, *, key=None):
        y = self.w(x)
        return y.astype(jnp.float16) if self.cast else y


@pytest.mark.parametrize("scan", [True, False])
def test_a_block_that_changes_shape_or_dtype_is_named(getkey, scan):
    wide = el.nn.stack(lambda k: Narrowing(eqx.nn.Linear(8, 4, key=k)), 3, key=getkey(), scan=scan)
    said = r"\(Narrowing\) took an input of float32\[8\] and returned an output of float32\[4\]"
    with pytest.raises(ValueError, match=said + r".*output must keep its input's"):
        jax.vmap(wide)(jnp.ones((2, 8)))
    cast = el.nn.stack(
        lambda k: Narrowing(eqx.nn.Linear(8, 8, key=k), cast=True), 2, key=getkey(),
        remat=True, segment=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"returned an output of float16\[8\]"):
        cast(jnp.ones(8))
    growing, states = el.nn.stack(
        lambda k: (GrowingState(jnp.ones(2)), jnp.zeros(2)), 2, key=getkey(), stateful=True
    )
    said = r"took a state of float32\[2\] and returned a state of float32\[4\]"
    with pytest.raises(ValueError, match=said):
        growing(jnp.ones(2), states)


class GrowingState(eqx.Module):
    """A stateful block whose new state is longer than the one it took."""

    w: jax.Array

    def __call__(self, x, state, *, key=None):
        return x * self.w, jnp.concatenate([state, x])


def test_save_offload_validation():
    assert el.nn.Save("a", offload=["b"]).offload == ("b",)
    with pytest.raises(ValueError, match="both saved on the device and offloaded"):
        el.nn.Save("a", offload=("a",))
    with pytest.raises(TypeError, match="tuple of str|offload"):
        el.nn.Save("a", offload="b")
    assert "minimal_offloaded" in el.nn._remat.PRESETS
