"""WideResNet: the architecture, BatchNorm state, recomputation, micro-batch statistics."""

import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el

from .helpers import compile_as_users, tree_allclose


def _build(depth=16, width=1, *, key, **kwargs):
    kwargs.setdefault("in_channels", 1)
    return eqx.nn.make_with_state(el.nn.WideResNet)(depth, width, 10, key=key, **kwargs)


def test_wrn_28_2_has_the_papers_parameter_count(getkey):
    shapes, state = eqx.filter_eval_shape(
        eqx.nn.make_with_state(el.nn.WideResNet), 28, 2, 10, key=getkey()
    )
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes) if hasattr(x, "shape"))
    assert count == 1_467_610
    # BatchNorm running statistics (mean and variance per channel) live in the state.
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == 2 * 1808
    # Three groups of four blocks: a first block (strided in groups 2 and 3, with a 1x1
    # shortcut where the width changes) and a stack of three identical blocks.
    assert [b.stride for b in shapes.firsts] == [1, 2, 2]
    assert [b.out_channels for b in shapes.firsts] == [32, 64, 128]
    assert all(b.shortcut is not None for b in shapes.firsts)
    assert [r.n_layers for r in shapes.rests] == [3, 3, 3]
    assert shapes.rests[2].blocks.shortcut is None
    assert shapes.rests[2].blocks.conv1.weight.shape == (3, 128, 128, 3, 3)


def _ref_bn(bn, x, stats, momentum=0.1, eps=1e-5):
    """Batch statistics over (batch, height, width), PyTorch's running update."""
    mean = jnp.mean(x, axis=(0, 2, 3))
    var = jnp.var(x, axis=(0, 2, 3))
    n = x.shape[0] * x.shape[2] * x.shape[3]
    y = (x - mean[None, :, None, None]) / jnp.sqrt(var[None, :, None, None] + eps)
    y = y * bn.weight[None, :, None, None] + bn.bias[None, :, None, None]
    new = (
        (1 - momentum) * stats[0] + momentum * mean,
        (1 - momentum) * stats[1] + momentum * var * n / (n - 1),
    )
    return jax.nn.relu(y), new


def _ref_block(block, x, st):
    a, s1 = _ref_bn(block.bn1, x, st["bn1"])
    h, s2 = _ref_bn(block.bn2, jax.vmap(block.conv1)(a), st["bn2"])
    h = jax.vmap(block.conv2)(h)
    skip = x if block.shortcut is None else jax.vmap(block.shortcut)(a)
    return skip + h, {"bn1": s1, "bn2": s2}


def _reference(model, state, x):
    """The network written out over the whole batch, block by block, in plain JAX."""
    h = jax.vmap(model.stem)(x)
    new = {}
    for g in range(3):
        h, new[("first", g)] = _ref_block(model.firsts[g], h, state.get(model.first_index[g]))
        rest, stacked = model.rests[g], state.get(model.rest_index[g])
        params, static = eqx.partition(rest.blocks, eqx.is_array)
        outs = []
        for i in range(rest.n_layers):
            block = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)
            h, s = _ref_block(block, h, jax.tree.map(lambda a, i=i: a[i], stacked))
            outs.append(s)
        new[("rest", g)] = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    h, new["bn"] = _ref_bn(model.bn, h, state.get(model.bn_index))
    return jax.vmap(model.head)(jnp.mean(h, axis=(2, 3))), new


def test_forward_matches_a_hand_written_network(getkey):
    model, state = _build(16, 2, key=getkey())
    x = jr.normal(getkey(), (6, 1, 12, 12))
    logits, new_state = eqx.filter_jit(model.batched)(x, state)
    names = [("first", g) for g in range(3)] + [("rest", g) for g in range(3)] + ["bn"]

    @eqx.filter_jit  # op by op, the reference takes seconds
    def reference(model, state, x):
        logits, new = _reference(model, state, x)
        return logits, [new[n] for n in names]  # keys of two types: no pytree dict

    ref_logits, ref_values = reference(model, state, x)
    ref_new = dict(zip(names, ref_values, strict=True))
    assert tree_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for g in range(3):
        assert tree_allclose(new_state.get(model.first_index[g]), ref_new[("first", g)], atol=1e-5)
        assert tree_allclose(new_state.get(model.rest_index[g]), ref_new[("rest", g)], atol=1e-5)
    assert tree_allclose(new_state.get(model.bn_index), ref_new["bn"], atol=1e-5)


def test_inference_mode_uses_running_statistics(getkey):
    model, state = _build(10, 1, key=getkey())
    x = jr.normal(getkey(), (4, 1, 8, 8))
    _, state = model.batched(x, state)  # running statistics that are not the initial ones
    evaluating = eqx.nn.inference_mode(model)
    logits, same = evaluating.batched(x, state)
    assert tree_allclose(same, state)  # the state is not updated
    # Each image's logits are its own: no batch statistics.
    alone, _ = evaluating.batched(x[:1], state)
    assert tree_allclose(alone, logits[:1], atol=1e-5)
    training, _ = model.batched(x, state)
    assert not tree_allclose(training, logits, atol=1e-3)
    # Running statistics by hand: the first BatchNorm sees the stem's output.
    mean, var = state.get(model.first_index[0])["bn1"]
    stem = jax.vmap(model.stem)(x)
    bn = model.firsts[0].bn1
    expected = (stem - mean[None, :, None, None]) * jax.lax.rsqrt(var + bn.eps)[None, :, None, None]
    got = jax.vmap(eqx.nn.inference_mode(bn), in_axes=(0, None), out_axes=(0, None))(
        stem, (mean, var)
    )[0]
    assert tree_allclose(got, expected, atol=1e-5)


def _loss(model, state, x, y):
    logits, state = model.batched(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y), state


def _grads(model, state, x, y):
    def mean_loss(m):
        values, st = _loss(m, state, x, y)
        return jnp.mean(values), (values, st)

    return eqx.filter_jit(eqx.filter_grad(mean_loss, has_aux=True))(model)


@pytest.fixture(scope="module")
def plain_wrn():
    """WRN-22-1 without recomputation, a batch, and its loss values, state and gradients."""
    key, data = jr.split(jr.PRNGKey(42))
    x, y = jr.normal(data, (4, 1, 8, 8)), jr.randint(jr.fold_in(data, 1), (4,), 0, 10)
    model, state = _build(22, 1, key=key)
    return key, state, x, y, _grads(model, state, x, y)


@pytest.mark.parametrize(
    "remat, scan", [(True, True), ("checkpoint-residual-2", True), ("minimal", False)]
)
def test_recomputation_keeps_outputs_gradients_and_statistics(plain_wrn, remat, scan):
    key, state, x, y, (grads, (values, new)) = plain_wrn
    rematted, _ = _build(22, 1, key=key, remat=remat, scan=scan)
    r_grads, (r_values, r_new) = _grads(rematted, state, x, y)
    assert tree_allclose(r_values, values, rtol=1e-5, atol=1e-5)
    assert tree_allclose(jax.tree.leaves(r_new), jax.tree.leaves(new), rtol=1e-5, atol=1e-6)
    assert tree_allclose(
        jax.tree.leaves(eqx.filter(r_grads, eqx.is_array)),
        jax.tree.leaves(eqx.filter(grads, eqx.is_array)),
        rtol=1e-4,
        atol=1e-5,
    )


def _step_bytes(remat, batch=32):
    model, state = _build(22, 1, key=jr.PRNGKey(0), remat=remat)
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.ShapeDtypeStruct((batch, 1, 16, 16), jnp.float32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def step(params, x, y):
        def mean_loss(p):
            values, st = _loss(eqx.combine(p, static), state, x, y)
            return jnp.mean(values), st

        grads, st = jax.grad(mean_loss, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), st

    lowered = jax.jit(step, donate_argnums=0).lower(params, x, y)
    memory = compile_as_users(lowered).memory_analysis()
    return memory.temp_size_in_bytes


@pytest.mark.slow  # WRN-22-1's step compiled three times
def test_checkpoint_residual_cuts_compiled_memory():
    # Compile only, on XLA:CPU, where unrolled checkpointing would save nothing.
    # Measured at these shapes: 0.68 and 0.78 (the baseline's BatchNorm already keeps
    # only four activation-sized buffers per block; at WRN-28-2, batch 100: 0.57).
    none = _step_bytes(False)
    assert _step_bytes("checkpoint-residual-1") <= 0.7 * none
    assert _step_bytes("minimal") <= 0.8 * none


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(depth=12), "depth must be 6n"),
        (dict(width=0), "width must be"),
        (dict(remat="checkpoint-residual-0"), "not a WideResNet option"),
        (dict(remat="qkv"), "not a WideResNet option"),
        (dict(remat=el.nn.Save("qkv")), "WideBlock does not define"),
    ],
)
def test_wrn_rejects_bad_arguments(getkey, kwargs, match):
    args = dict(depth=10, width=1)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        el.nn.WideResNet(args.pop("depth"), args.pop("width"), 10, key=getkey(), **args)


def test_wrn_rejects_bad_calls(getkey):
    model, state = _build(10, 1, key=getkey())
    with pytest.raises(ValueError, match="axis_name='batch'"):
        jax.vmap(model, in_axes=(0, None), out_axes=(0, None))(jnp.zeros((2, 1, 8, 8)), state)
    with pytest.raises((ValueError, TypeError), match=r"\(1, height, width\)|channels"):
        model.batched(jnp.zeros((2, 3, 8, 8)), state)


def test_batch_norm_statistics_are_float32_for_16_bit_input(getkey):
    bn = el.nn.BatchNorm(4)
    x = (100.0 + jr.normal(getkey(), (8, 4, 3, 3))).astype(jnp.bfloat16)
    vmapped = jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    y, (mean, var) = vmapped(x, bn.init_stats())
    assert y.dtype == jnp.bfloat16 and mean.dtype == var.dtype == jnp.float32
    x32 = x.astype(jnp.float32)
    assert tree_allclose(mean, 0.1 * jnp.mean(x32, axis=(0, 2, 3)), rtol=1e-6)
    # In bfloat16 the variance of values near 100 would be lost entirely.
    unbiased = jnp.var(x32, axis=(0, 2, 3)) * 72 / 71
    assert tree_allclose(var, 0.9 + 0.1 * unbiased, rtol=1e-5)


def _hand_loop(model, state, x, y, k, lr):
    """Micro-batches one after another: statistics per micro-batch, state threaded."""
    grads = None
    for xb, yb in zip(jnp.split(x, k), jnp.split(y, k), strict=True):
        g, (_, state) = _grads(model, state, xb, yb)
        g = eqx.filter(g, eqx.is_inexact_array)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    params = eqx.filter(model, eqx.is_inexact_array)
    params = jax.tree.map(lambda p, g: p - lr * g / k, params, grads)
    return eqx.combine(params, model), state


# float32 against the hand loop; a mixed and a half policy for BatchNorm's float32 state.
@pytest.mark.parametrize(
    "precision", ["float32", "mixed_bf16", pytest.param("half_fp16", marks=pytest.mark.slow)]
)
def test_micro_batches_use_their_own_statistics(getkey, precision):
    model, state = _build(10, 1, key=getkey())
    x, y = jr.normal(getkey(), (8, 1, 8, 8)), jr.randint(getkey(), (8,), 0, 10)
    step = el.train.make_step(
        _loss, optax.sgd(0.1), has_state=True, accumulate=2, precision=precision
    )
    out, metrics = step(step.init(model, key=getkey(), model_state=state), (x, y))
    # BatchNorm's state stays float32 under every precision policy.
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(out.model_state))
    assert bool(metrics["finite"])
    if precision != "float32":
        return
    expected_model, expected_state = _hand_loop(model, state, x, y, 2, 0.1)
    assert tree_allclose(out.model_state, expected_state, rtol=1e-5, atol=1e-6)
    assert tree_allclose(
        eqx.filter(out.model, eqx.is_array),
        eqx.filter(expected_model, eqx.is_array),
        rtol=1e-4,
        atol=1e-5,
    )
    # Not the whole batch's statistics: one update of the running mean from all 8 images
    # is not two from 4 each.
    _, whole = model.batched(x, state)
    assert not tree_allclose(out.model_state, whole, atol=1e-4)


QUALITY_SCRIPT = Path(__file__).parent.parent / "benchmarks" / "quality.py"

# The script as the suite checks the package: jaxtyping and beartype on eqx_lowmem.
TYPE_CHECKED_RUN = """
import runpy, sys
from jaxtyping import install_import_hook
with install_import_hook("eqx_lowmem", "beartype.beartype"):
    import eqx_lowmem
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _need_fashion_mnist():
    fashion_mnist = getattr(el.data, "fashion_mnist", None)
    if fashion_mnist is None:
        pytest.skip("eqx_lowmem.data.fashion_mnist is not available in this checkout")
    try:
        fashion_mnist("test")
    except (FileNotFoundError, OSError, ValueError) as e:
        pytest.skip(f"Fashion-MNIST is not installed (dataset-fashion-mnist): {e}")


@pytest.mark.slow  # the benchmark script, two workers
def test_a_failing_quality_worker_stops_the_run_with_its_error(tmp_path):
    # A depth the WideResNet rejects fails inside the workers: the run exits at once with
    # the workers' own error and the configurations that failed, and writes no JSON.
    _need_fashion_mnist()
    bad = ["--quick", "--depth", "11", "--out", tmp_path]
    proc = subprocess.run(
        [sys.executable, QUALITY_SCRIPT, *map(str, bad)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "depth must be 6n + 4" in proc.stderr and "got 11" in proc.stderr
    assert "quality workers failed" in proc.stderr and "exit code 1" in proc.stderr
    assert not (tmp_path / "frontier_quick.json").exists()
