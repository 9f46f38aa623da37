"""Batch-level layers inside loops: convolutions in the layout XLA:CPU runs fast everywhere
(`eqx_lowmem.nn._conv`) and `Stack.batched`, with the numbers of the per-example forms."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem import sparse as sp
from eqx_lowmem.nn import _conv as conv_module
from eqx_lowmem.nn._conv import conv2d

from .helpers import tree_allclose

CANONICAL = "b01f_01io->b01f"  # NHWC input, HWIO kernel, NHWC output
CANONICAL_HLO = "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]"  # the same, as StableHLO says it


def _f64(a):
    return np.asarray(a, np.float64)


def _conv_labels(compiled_text: str) -> list[str]:
    return re.findall(r"convolution\(.*dim_labels=(\S+?),", compiled_text)


@pytest.mark.parametrize(
    "c_in, c_out, kernel, stride, padding, dilation, size",
    [
        (3, 5, 3, 1, 1, 1, 9),
        (4, 6, 3, 2, 1, 1, 9),  # WRN's strided first block
        (4, 6, 1, 2, 0, 1, 8),  # its 1x1 shortcut
        (2, 3, 3, 1, "SAME", 2, 10),
        (2, 3, 3, 2, "VALID", 1, 11),
        (2, 3, 5, 3, ((1, 2), (0, 3)), 1, 12),
    ],
)
@pytest.mark.parametrize("contracted", [None, 16])
def test_conv2d_under_vmap_equals_the_equinox_layer(
    getkey, monkeypatch, c_in, c_out, kernel, stride, padding, dilation, size, contracted
):
    if contracted is not None:  # the weight gradient summed over chunks of 1-2 examples
        monkeypatch.setattr(conv_module, "_CPU_CONTRACTED", contracted)
    layer = eqx.nn.Conv2d(
        c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation, key=getkey()
    )
    x = jr.normal(getkey(), (5, c_in, size, size))

    def loss(layer, x, apply):
        y = jax.vmap(lambda e: apply(layer, e))(x)
        weights = jnp.linspace(-1.0, 1.0, y.size, dtype=y.dtype).reshape(y.shape)
        return jnp.sum(jnp.sin(y) * weights)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    loss_value, grads = grad(layer, x, conv2d)
    loss_ref, grads_ref = grad(layer, x, lambda c, e: c(e))
    assert tree_allclose(loss_value, loss_ref, rtol=1e-5, atol=1e-6)
    # The gradients against the Equinox layer in float64: within the bounds of it, beyond
    # what XLA's own float32 convolution misses. Summed over chunks, ours adds in another
    # order, and on an AMD EPYC XLA's float32 weight gradient is itself up to 2.6e-6
    # outside rtol 1e-5 / atol 1e-6 of float64 (ours 1.2e-6), so float32 against float32
    # measures XLA's rounding, not ours.
    with jax.enable_x64(True):
        layer64 = eqx.combine(jax.tree.map(_f64, eqx.filter(layer, eqx.is_array)), layer)
        _, exact = grad(layer64, _f64(x), lambda c, e: c(e))
    for ours, xla, true in zip(*map(jax.tree.leaves, (grads, grads_ref, exact)), strict=True):
        ours, xla, true = _f64(ours), _f64(xla), _f64(true)
        bound = 1e-6 + 1e-5 * np.abs(true) + np.abs(xla - true)
        assert np.all(np.abs(ours - true) <= bound)
    # One example without vmap: the layer itself.
    assert tree_allclose(conv2d(layer, x[0]), layer(x[0]), rtol=1e-5, atol=1e-6)


def test_a_large_batch_weight_gradient_is_a_sum_of_canonical_chunks(getkey, monkeypatch):
    monkeypatch.setattr(conv_module, "_CPU_CONTRACTED", 3 * 6 * 6)  # 3 examples of 6x6
    conv = ((1, 1), ((1, 1), (1, 1)), (1, 1))
    x, g = jr.normal(getkey(), (8, 4, 6, 6)), jr.normal(getkey(), (8, 5, 6, 6))
    dw = jax.jit(lambda x, g: conv_module.conv_weight_grad(x, g, (3, 3), conv))
    # JAX's own weight gradient of the same convolution (a vjp in NCHW)
    _, vjp = jax.vjp(
        lambda w: jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1))),
        jnp.zeros((5, 4, 3, 3)),
    )
    assert tree_allclose(dw(x, g), vjp(g)[0], rtol=1e-5, atol=1e-5)
    labels = _conv_labels(dw.lower(x, g).compile().as_text())
    assert labels == [CANONICAL] * 3  # chunks of 3, 3 and 2 examples


def _micro_batched_grad(layers, apply):
    """The gradient of a two-convolution network, summed over micro-batches by a scan."""

    def loss(layers, x):
        a, b = layers
        y = jax.vmap(lambda e: apply(b, jnp.tanh(apply(a, e))))(x)
        return jnp.sum(jnp.tanh(y))

    def run(layers, xs):
        params, static = eqx.partition(layers, eqx.is_inexact_array)

        def add(acc, x):
            grads = jax.grad(lambda p: loss(eqx.combine(p, static), x))(params)
            return jax.tree.map(jnp.add, acc, grads), None

        return jax.lax.scan(add, jax.tree.map(jnp.zeros_like, params), xs)[0]

    params, static = eqx.partition(layers, eqx.is_inexact_array)
    return jax.jit(lambda p, xs: run(eqx.combine(p, static), xs)), params


def test_convolutions_in_a_scan_stay_canonical(getkey):
    """XLA:CPU canonicalises convolutions in the entry computation only: in a loop body the
    forward and both gradients must already be NHWC/HWIO, or they run a generic loop nest
    (measured: a WRN-10-1 step with 10 micro-batches 15x slower)."""
    a = eqx.nn.Conv2d(4, 4, 3, padding=1, use_bias=False, key=getkey())
    b = eqx.nn.Conv2d(4, 6, 3, stride=2, padding=1, use_bias=False, key=getkey())
    xs = jr.normal(getkey(), (3, 2, 4, 8, 8))
    ours, params = _micro_batched_grad((a, b), conv2d)
    plain, _ = _micro_batched_grad((a, b), lambda c, e: c(e))
    text = ours.lower(params, xs).compile().as_text()
    labels = _conv_labels(text)
    # Two forward passes, two weight gradients, one input gradient (the input's is unused).
    assert len(labels) == 5 and set(labels) == {CANONICAL}, labels
    assert "reversal" not in text
    # The check can fail: JAX's own gradients in the same loop are not canonical.
    assert set(_conv_labels(plain.lower(params, xs).compile().as_text())) != {CANONICAL}
    assert tree_allclose(ours(params, xs), plain(params, xs), rtol=1e-5, atol=1e-5)


def test_sparse_convolution_in_a_scan_is_canonical(getkey):
    dense = eqx.nn.Conv2d(4, 6, 3, stride=2, padding=1, use_bias=False, key=getkey())
    layer = sp.SparseConv2d.from_dense(dense, 0.5, key=getkey())
    other = eqx.nn.Conv2d(4, 4, 1, use_bias=False, key=getkey())
    xs = jr.normal(getkey(), (3, 2, 4, 8, 8))
    grad, params = _micro_batched_grad((other, layer), conv2d)
    labels = _conv_labels(grad.lower(params, xs).compile().as_text())
    assert labels and set(labels) == {CANONICAL}, labels
    # Its gradient equals the dense layer's at the same weights, gathered at the indices.
    as_dense = eqx.tree_at(lambda c: c.weight, dense, layer.weight)
    dense_grad, dense_params = _micro_batched_grad((other, as_dense), lambda c, e: c(e))
    expected = dense_grad(dense_params, xs)
    got = grad(params, xs)
    assert tree_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    flat = expected[1].weight.reshape(-1)
    assert tree_allclose(got[1].values, flat[layer.indices], rtol=1e-5, atol=1e-5)


def test_wideresnet_micro_batched_step_has_only_canonical_convolutions(getkey):
    """The whole combination's step: each convolution sits in the micro-batch scan (and the
    groups' block scans), yet all of them, forward and backward, are canonical."""
    model, state = eqx.nn.make_with_state(el.nn.WideResNet)(
        16, 1, 10, key=getkey(), in_channels=1, remat="checkpoint-residual-1"
    )
    model = sp.sparsify(model, 0.5, key=getkey(), exclude=el.nn.WideResNet.keep_dense)

    def loss(model, state, x, y):
        logits, state = model.batched(x, state)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), state

    step = el.train.make_step(loss, optax.sgd(0.1), has_state=True, accumulate=2)
    train_state = step.init(model, key=getkey(), model_state=state)
    # 16x16: at 2x2 (the last group of 8x8 images) XLA swaps a weight gradient's operands
    # (its window exceeds its input), a rewrite of its own that only tiny images meet.
    batch = (jr.normal(getkey(), (4, 1, 16, 16)), jnp.zeros((4,), jnp.int32))
    labels = _conv_labels(step.lower(train_state, batch).compile().as_text())
    # WRN-16-1 has 15 convolutions: at least 15 forward, 15 weight and 14 input gradients.
    assert len(labels) >= 15 + 15 + 14 and set(labels) == {CANONICAL}, sorted(set(labels))


class _Residual(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x, *, key=None):
        h = jnp.tanh(self.linear(x))
        if key is not None:
            h = jnp.where(jr.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0)
        return x + h


class _Normalising(eqx.Module):
    """A stateful block whose state is a statistic of the batch (a collective), as
    BatchNorm's."""

    linear: eqx.nn.Linear

    def __call__(self, x, state, *, key=None):
        mean = jax.lax.pmean(x, "batch")
        return x + jnp.tanh(self.linear(x - mean)), {"mean": 0.9 * state["mean"] + 0.1 * mean}


@pytest.mark.parametrize("remat, segment", [(False, None), (True, None), (True, 2)])
@pytest.mark.parametrize("dropout", [False, True])
def test_stack_batched_equals_vmap_of_the_stack(getkey, remat, segment, dropout):
    net = el.nn.stack(
        lambda k: _Residual(eqx.nn.Linear(4, 4, key=k)), 5, key=getkey(), remat=remat,
        segment=segment,
    )  # fmt: skip
    x = jr.normal(getkey(), (3, 4))
    keys = jr.split(getkey(), 3) if dropout else None

    def by_vmap(net, x):
        return jnp.sum(jnp.sin(jax.vmap(lambda e, k: net(e, key=k))(x, keys)))

    def batched(net, x):
        return jnp.sum(jnp.sin(net.batched(x, key=keys)))

    expected = eqx.filter_jit(eqx.filter_value_and_grad(by_vmap))(net, x)
    got = eqx.filter_jit(eqx.filter_value_and_grad(batched))(net, x)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("segment", [None, 2])
def test_stateful_stack_batched_shares_the_batch_statistics(getkey, segment):
    def make(k):
        return _Normalising(eqx.nn.Linear(4, 4, key=k)), {"mean": jnp.zeros(4)}

    net, states = el.nn.stack(make, 3, key=getkey(), stateful=True, segment=segment)
    x = jr.normal(getkey(), (5, 4))
    vmapped = jax.vmap(net, in_axes=(0, None), out_axes=(0, None), axis_name="batch")
    expected_y, expected_states = vmapped(x, states)
    y, new_states = net.batched(x, states, axis_name="batch")
    assert tree_allclose(y, expected_y, rtol=1e-5, atol=1e-6)
    assert tree_allclose(new_states, expected_states, rtol=1e-5, atol=1e-6)
    assert not tree_allclose(new_states, states)  # the statistics moved


_CONFIGS = [  # c_in, c_out, kernel, stride, padding, dilation, size
    (3, 5, 3, 1, ((1, 1), (1, 1)), 1, 9),
    (4, 6, 3, 2, ((1, 1), (1, 1)), 1, 9),
    (4, 6, 1, 2, ((0, 0), (0, 0)), 1, 8),
    (2, 3, 3, 1, ((2, 2), (2, 2)), 2, 10),
    (2, 3, 5, 3, ((1, 2), (0, 3)), 1, 12),
]


@pytest.mark.parametrize("c_in, c_out, kernel, stride, padding, dilation, size", _CONFIGS)
def test_the_non_cpu_convolution_equals_the_cpu_one(
    getkey, c_in, c_out, kernel, stride, padding, dilation, size
):
    # The branches `conv_forward`, `conv_input_grad` and `conv_weight_grad` choose from at
    # lowering: canonical on CPU, XLA's own NCHW convolution and transposes elsewhere.
    # Both run here, on the CPU, and against JAX's own gradient of the convolution.
    conv = ((stride, stride), padding, (dilation, dilation))
    x = jr.normal(getkey(), (4, c_in, size, size))
    w = jr.normal(getkey(), (c_out, c_in, kernel, kernel))
    y, vjp = jax.vjp(lambda x, w: conv_module._xla_forward(x, w, conv), x, w)
    g = jr.normal(getkey(), y.shape)
    dx, dw = vjp(g)
    pairs = [
        (conv_module._canonical_forward(x, w, conv), conv_module._xla_forward(x, w, conv), y),
        (
            conv_module._canonical_input_grad(g, w, x.shape[2:], conv),
            conv_module._xla_input_grad(g, w, x.shape[2:], conv),
            dx,
        ),
        (
            conv_module._canonical_weight_grad(x, g, w.shape[2:], conv),
            conv_module._xla_weight_grad(x, g, w.shape[2:], conv),
            dw,
        ),
    ]
    for cpu, other, jax_own in pairs:
        assert tree_allclose(other, jax_own, rtol=1e-5, atol=1e-5)
        assert tree_allclose(cpu, other, rtol=1e-5, atol=1e-5)


def _exported_convolutions(fn, args, platform):
    """The convolutions' dimension numbers in `fn` lowered for `platform` (lowering only:
    no such device is needed)."""
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    text = jax.export.export(jax.jit(fn), platforms=[platform])(*specs).mlir_module()
    return re.findall(r"stablehlo\.convolution\(.*dim_numbers = (\[.*?\]x\[.*?\]->\[.*?\])", text)


def test_a_gpu_program_runs_xla_own_convolutions(getkey):
    # Lowered for CUDA, the WRN's convolutions (dense and sparse, forward and both
    # gradients) are exactly those of JAX's own gradient of eqx.nn.Conv2d: no CPU layout.
    dense = eqx.nn.Conv2d(4, 6, 3, stride=2, padding=1, key=getkey())
    sparse = sp.SparseConv2d.from_dense(dense, 0.5, key=getkey())
    x = jr.normal(getkey(), (2, 4, 8, 8))

    def convolutions(layer, apply, platform):
        params, static = eqx.partition(layer, eqx.is_inexact_array)

        def loss(params, x):
            layer = eqx.combine(params, static)
            return jnp.sum(jnp.sin(jax.vmap(lambda e: apply(layer, e))(x)))

        return _exported_convolutions(jax.grad(loss, argnums=(0, 1)), (params, x), platform)

    own = convolutions(dense, lambda c, e: c(e), "cuda")
    assert len(own) == 3 and CANONICAL_HLO not in own, own
    for layer in (dense, sparse):
        ours = convolutions(layer, conv2d, "cuda")
        assert sorted(ours) == sorted(own), (type(layer).__name__, ours)
        # the same program lowered for the CPU is canonical throughout
        cpu = convolutions(layer, conv2d, "cpu")
        assert len(cpu) == 3 and set(cpu) == {CANONICAL_HLO}, cpu


@pytest.mark.parametrize("kind", ["conv", "sparse_conv", "sparse_linear"])
def test_per_example_gradients_under_vmap_of_grad_equal_the_plain_layers(getkey, kind):
    # vmap(grad(f)): differentiation reaches the layer before the vmap, so the layer's
    # batch-level rule (whose weight gradient is summed over the batch) must not run.
    dense = eqx.nn.Conv2d(3, 4, 3, stride=2, padding=1, key=getkey())
    x = jr.normal(getkey(), (5, 3, 8, 8))
    if kind == "sparse_linear":
        dense = eqx.nn.Linear(12, 7, key=getkey())
        x = jr.normal(getkey(), (5, 12))
    layer = dense if kind == "conv" else sp.sparsify(dense, 0.5, key=getkey())
    apply = conv2d if kind == "conv" else (lambda c, e: c(e))
    plain = layer if kind == "conv" else sp.densify(layer)

    def loss(layer, e, apply):
        return jnp.sum(jnp.sin(apply(layer, e)))

    per_example = jax.vmap(eqx.filter_grad(loss), in_axes=(None, 0, None))
    ours = per_example(layer, x, apply)
    ref = per_example(plain, x, lambda c, e: c(e))
    if kind != "conv":  # the dense weight's gradient at the sparse layer's indices
        flat = ref.weight.reshape(5, -1)
        ref = (flat[:, layer.indices], ref.bias)
        ours = (ours.values, ours.bias)
    assert tree_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    # and grad of vmap: their sum
    total = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(lambda e: loss(m, e, apply))(x)))(layer)
    summed = jax.tree.map(lambda a: a.sum(0), ours)
    got = (total.weight, total.bias) if kind == "conv" else (total.values, total.bias)
    if kind == "conv":
        summed = (summed.weight, summed.bias)
    assert tree_allclose(got, summed, rtol=1e-5, atol=1e-5)


def test_a_jit_or_checkpoint_between_vmap_and_the_layer_keeps_the_batched_rule(getkey):
    # The batch-level convolution is the vmap's own rule: a jit or a checkpoint traced
    # inside the vmap (its body batched afterwards) still gets one canonical convolution
    # over the batch, forward and backward, in a loop body (micro-batches) too.
    layer = eqx.nn.Conv2d(4, 6, 3, padding=1, use_bias=False, key=getkey())
    xs = jr.normal(getkey(), (2, 3, 4, 8, 8))

    def loss(layer, xs, wrap, apply):
        def body(total, x):
            return total + jnp.sum(jnp.sin(jax.vmap(wrap(lambda e: apply(layer, e)))(x))), None

        return jax.lax.scan(body, 0.0, xs)[0]

    for wrap in (jax.jit, jax.checkpoint):
        grad = jax.jit(jax.grad(loss), static_argnums=(2, 3))
        text = grad.lower(layer, xs, wrap, conv2d).compile().as_text()
        labels = _conv_labels(text)
        assert len(labels) == 2 and set(labels) == {CANONICAL}, (wrap, labels)
        ref = grad(layer, xs, wrap, lambda c, e: c(e))
        assert tree_allclose(grad(layer, xs, wrap, conv2d), ref, rtol=1e-5, atol=1e-5)


def test_vmap_rule_is_the_vmaps_rule_and_differentiation_sees_the_plain_function():
    from eqx_lowmem.nn._trace import vmap_rule

    calls = []

    def plain(w, xs):
        return {"y": jnp.sin(w * xs[0]) + xs[1]}

    def rule(size, in_batched, w, xs):
        calls.append((size, in_batched))
        return {"y": jnp.sin(w[None] * xs[0]) + xs[1]}, {"y": True}

    def f(w, x):
        return jnp.sum(vmap_rule(plain, rule, w, (x, 1.0))["y"])

    w, x = jnp.array([0.5, -1.0]), jr.normal(jr.PRNGKey(0), (4, 2))
    wx = w[None] * x
    ref = jnp.sum(jnp.sin(wx) + 1.0, axis=1)
    cases = {
        "vmap": lambda: jax.vmap(f, (None, 0))(w, x),
        "grad of vmap": lambda: jax.grad(lambda w: jax.vmap(f, (None, 0))(w, x).sum())(w),
        "vmap of jit": lambda: jax.vmap(jax.jit(f), (None, 0))(w, x),
        "jvp of vmap": lambda: jax.jvp(lambda w: jax.vmap(f, (None, 0))(w, x), (w,), (w,))[1],
        "vmap of grad": lambda: jax.vmap(jax.grad(f), (None, 0))(w, x),
        "no vmap": lambda: f(w, x[0]),
    }
    expected = {
        "vmap": ref,
        "grad of vmap": jnp.sum(x * jnp.cos(wx), axis=0),
        "vmap of jit": ref,
        "jvp of vmap": jnp.sum(wx * jnp.cos(wx), axis=1),
        "vmap of grad": x * jnp.cos(wx),
        "no vmap": ref[0],
    }
    for name, run in cases.items():
        calls.clear()
        assert tree_allclose(run(), expected[name], rtol=1e-5, atol=1e-6), name
        # The rule runs where a vmap reaches the call first, never under differentiation.
        rules = [] if name in ("vmap of grad", "no vmap") else [(4, (False, (True, False)))]
        assert calls == rules, (name, calls)

    def wrong(size, in_batched, w, xs):
        return [jnp.sin(w[None] * xs[0])], True

    with pytest.raises(ValueError, match="the rule returned"):
        jax.vmap(lambda x: vmap_rule(plain, wrong, w, (x, 1.0)))(x)
