"""Fused accumulation (`make_step(fuse_accumulation=True)`, `eqx_lowmem.nn._fuse`): a
scanned, recomputed stack adds each layer's gradient into the accumulator inside its own
backward loop. The same numbers as the unfused step (bit for bit where the stack is used once
per micro-batch), one gradient-sized buffer less."""

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
from eqx_lowmem.memory._activations import fused_slots

from .helpers import compile_as_users


class Residual(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, *, key, width=16):
        self.linear = eqx.nn.Linear(width, width, key=key)

    def __call__(self, x, *, key=None):
        return x + jnp.tanh(self.linear(x))


def _floats(tree):
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return [np.asarray(a, np.float32) for a in leaves]


def _assert_same(a, b, tol=None):
    """Bit for bit (`tol` None): the fused backward loop adds the same gradients in the same
    order. With `tol`, equal to it (where a stack's weights also get gradient from outside
    its loop, the two sums are formed in another order)."""
    for x, y in zip(_floats(a), _floats(b), strict=True):
        if tol is None:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def _train(model, loss, batch, *, fuse, steps=2, **options):
    step = el.train.make_step(loss, optax.adam(1e-2), fuse_accumulation=fuse, **options)
    state = step.init(model, key=jr.PRNGKey(2))
    for _ in range(steps):
        state, metrics = step(state, batch)
    return state, step


@pytest.mark.parametrize(
    "precision, dtype",
    [("float32", jnp.float32), ("mixed_bf16", jnp.bfloat16)]
    + [pytest.param("half_fp16", jnp.float16, marks=pytest.mark.slow)],
)
def test_a_causal_lm_trains_the_same_fused_and_unfused(precision, dtype):
    model = el.nn.CausalLM(50, 12, 3, 16, 2, 32, key=jr.PRNGKey(0), remat=True,
                           tie_embeddings=True)  # fmt: skip
    tokens = jr.randint(jr.PRNGKey(1), (8, 13), 0, 50)
    opts = dict(accumulate=4, precision=precision, accumulate_dtype=dtype)
    fused, step = _train(model, el.train.next_token_loss, (tokens,), fuse=True, **opts)
    plain, _ = _train(model, el.train.next_token_loss, (tokens,), fuse=False, **opts)
    _assert_same(fused.model, plain.model)
    _assert_same(fused.opt_state, plain.opt_state)
    # The fused path really ran: every array of the stack (and nothing else) was taken.
    slots = fused_slots(step, fused.model, (jax.ShapeDtypeStruct(tokens.shape, tokens.dtype),))
    n_stack = len(jax.tree.leaves(eqx.filter(model.encoder, eqx.is_inexact_array)))
    assert len(slots) == n_stack


def test_fusion_drops_the_stacks_micro_batch_gradient_from_the_compiled_peak():
    model = el.nn.CausalLM(256, 32, 4, 128, 4, 256, key=jr.PRNGKey(0), remat=True,
                           tie_embeddings=True)  # fmt: skip
    tokens = jnp.zeros((8, 33), jnp.int32)
    stack_bytes = sum(a.nbytes for a in _floats(model.encoder))
    temps = {}
    for fuse in (False, True):
        step = el.train.make_step(el.train.next_token_loss, optax.adam(1e-3), accumulate=8,
                                  fuse_accumulation=fuse)  # fmt: skip
        state = step.init(model, key=jr.PRNGKey(0))
        compiled = compile_as_users(step.lower(state, (tokens,)))
        temps[fuse] = compiled.memory_analysis().temp_size_in_bytes
    # Measured: 0.75x the stack's float32 gradient (5.43 -> 3.83 MB of temporaries); the
    # rest of the freed room goes to XLA's other temporaries at the new peak.
    assert temps[False] - temps[True] >= 0.7 * stack_bytes, (temps, stack_bytes)


@pytest.mark.parametrize("remat, segment", [(True, None), (False, 2)])
def test_the_report_counts_no_micro_batch_gradient_for_a_fused_stack(remat, segment):
    blocks = el.nn.stack(lambda k: Residual(key=k), 4, key=jr.PRNGKey(0), remat=remat,
                         segment=segment)  # fmt: skip
    x = jnp.zeros((8, 16))
    stack_bytes = sum(a.nbytes for a in _floats(blocks))
    report = el.memory.memory_report(blocks, el.train.mse, optax.sgd(0.1), (x, x), accumulate=4)
    assert report.parts["gradients"] == 0 and report.parts["accumulator"] == stack_bytes
    # The parts are disjoint pieces of the compiled step: together within its peak.
    assert report.overlap_bytes == 0 and report.parts["other"] >= 0
    assert any("Fused accumulation" in n for n in report.notes)
    off = el.memory.memory_report(blocks, el.train.mse, optax.sgd(0.1), (x, x), accumulate=4,
                                  fuse_accumulation=False)  # fmt: skip
    assert off.parts["gradients"] == stack_bytes


def test_a_stack_that_keeps_activations_is_not_fused_and_trains_the_same():
    blocks = el.nn.stack(lambda k: Residual(key=k), 3, key=jr.PRNGKey(0), remat=False)
    x = jr.normal(jr.PRNGKey(1), (8, 16))
    fused, step = _train(blocks, el.train.mse, (x, x), fuse=True, accumulate=4)
    plain, _ = _train(blocks, el.train.mse, (x, x), fuse=False, accumulate=4)
    assert fused_slots(step, blocks, (x, x)) == frozenset()
    _assert_same(fused.model, plain.model)


@pytest.mark.parametrize("segment", [2, 3, 8])  # 2 + 2 + 1 blocks; 3 + 2; one short
def test_segments_are_fused_and_train_the_same(segment):
    blocks = el.nn.stack(lambda k: Residual(key=k), 5, key=jr.PRNGKey(0), segment=segment)
    x = jr.normal(jr.PRNGKey(1), (8, 16))
    fused, step = _train(blocks, el.train.mse, (x, x), fuse=True, accumulate=4)
    plain, _ = _train(blocks, el.train.mse, (x, x), fuse=False, accumulate=4)
    assert len(fused_slots(step, blocks, (x, x))) == 2  # weight and bias
    _assert_same(fused.model, plain.model)
    _assert_same(fused.opt_state, plain.opt_state)


def _tied_loss(model, x, y):
    # The stack runs twice (the second call cannot take the accumulator again) and its
    # weights are also used outside it (a penalty): both gradients must still arrive.
    h = jax.vmap(model)(x)
    h = jax.vmap(model)(h)
    penalty = 1e-2 * jnp.sum(model.blocks.linear.weight**2)
    return jnp.mean((h - y) ** 2, axis=-1) + penalty


def test_a_stack_called_twice_and_weights_used_outside_it_give_the_unfused_gradient():
    blocks = el.nn.stack(lambda k: Residual(key=k), 3, key=jr.PRNGKey(0), remat=True)
    x = jr.normal(jr.PRNGKey(1), (8, 16))
    fused, step = _train(blocks, _tied_loss, (x, x), fuse=True, accumulate=4)
    plain, _ = _train(blocks, _tied_loss, (x, x), fuse=False, accumulate=4)
    assert len(fused_slots(step, blocks, (x, x))) == 2  # weight and bias, once
    _assert_same(fused.model, plain.model, tol=1e-6)  # measured: 1.5e-8 apart


def _one_example_loss(model, x, y):
    # No vmap: the stack sees one example at a time (a Python loop over the batch).
    rows = [jnp.mean((model(x[i]) - y[i]) ** 2) for i in range(x.shape[0])]
    return jnp.stack(rows)


def test_a_per_example_call_without_vmap_is_fused_and_trains_the_same():
    blocks = el.nn.stack(lambda k: Residual(key=k), 3, key=jr.PRNGKey(0), remat=True)
    x = jr.normal(jr.PRNGKey(1), (4, 16))
    fused, step = _train(blocks, _one_example_loss, (x, x), fuse=True, accumulate=2)
    plain, _ = _train(blocks, _one_example_loss, (x, x), fuse=False, accumulate=2)
    assert len(fused_slots(step, blocks, (x, x))) == 2
    # The examples' gradients are summed per example here: measured 1.5e-8 apart.
    _assert_same(fused.model, plain.model, tol=1e-6)


def test_a_remainder_micro_batch_is_fused_too():
    blocks = el.nn.stack(lambda k: Residual(key=k), 3, key=jr.PRNGKey(0), remat=True)
    x = jr.normal(jr.PRNGKey(1), (10, 16))  # 3 micro-batches of 4, 4 and 2
    opts = dict(accumulate=3, accumulate_dtype=jnp.bfloat16)
    fused, _ = _train(blocks, el.train.mse, (x, x), fuse=True, **opts)
    plain, _ = _train(blocks, el.train.mse, (x, x), fuse=False, **opts)
    _assert_same(fused.model, plain.model)


# WRN-16-1: each group's stack is one block; WRN-22-1's two blocks are one segment.
@pytest.mark.slow  # two WRNs, fused and not
@pytest.mark.parametrize("depth, remat", [(16, "checkpoint-residual-1"),
                                          (22, "checkpoint-residual-2")])  # fmt: skip
def test_a_sparse_wide_resnet_with_batchnorm_trains_the_same(depth, remat):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _steps import wrn_loss

    model, bn = eqx.nn.make_with_state(el.nn.WideResNet)(
        depth, 1, 10, key=jr.PRNGKey(0), in_channels=1, remat=remat
    )
    model = el.sparse.sparsify(model, 0.3, key=jr.PRNGKey(3), slack=0.1,
                               exclude=el.nn.WideResNet.keep_dense)  # fmt: skip
    x = jr.normal(jr.PRNGKey(1), (8, 1, 8, 8))
    y = jr.randint(jr.PRNGKey(2), (8,), 0, 10)
    out = {}
    for fuse in (False, True):
        step = el.train.make_step(
            wrn_loss, optax.sgd(0.1, momentum=0.9), has_state=True, accumulate=4,
            accumulate_dtype=jnp.bfloat16, fuse_accumulation=fuse,
        )  # fmt: skip
        state = step.init(model, key=jr.PRNGKey(2), model_state=bn)
        for _ in range(2):
            state, _ = step(state, (x, y))
        out[fuse] = state
    _assert_same(out[True].model, out[False].model)
    _assert_same(out[True].model_state, out[False].model_state)
    structs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
    assert fused_slots(step, out[True].model, structs, model_state=bn)  # the groups' stacks


# -- fusion says when it does not apply ------------------------------------------------------


def _copying_loss(model, x, y):
    # The loss makes new arrays from the model's before calling it (here an exact copy):
    # the stack then holds no parameter the step differentiates, so it cannot be fused.
    model = jax.tree.map(lambda a: a * jnp.ones((), a.dtype) if eqx.is_inexact_array(a) else a,
                         model)  # fmt: skip
    return el.train.mse(model, x, y)


def test_a_stack_the_loss_copies_is_not_fused_and_the_step_says_why():
    blocks = el.nn.stack(lambda k: Residual(key=k), 3, key=jr.PRNGKey(0), remat=True)
    x = jr.normal(jr.PRNGKey(1), (8, 16))
    match = (
        r"fused accumulation does not reach a stack of 2 arrays \(the first "
        r"float32\[3, 16, 16\]\).*made new ones from them"
    )
    with pytest.warns(el.nn.FusionWarning, match=match):
        fused, step = _train(blocks, _copying_loss, (x, x), fuse=True, accumulate=4)
    plain, _ = _train(blocks, _copying_loss, (x, x), fuse=False, accumulate=4)  # no warning
    _assert_same(fused.model, plain.model)


class _Counting(eqx.Module):
    """A stateful block whose state counts its calls (the same for every example)."""

    linear: eqx.nn.Linear

    def __call__(self, x, state, *, key=None):
        return x + jnp.tanh(self.linear(x)), state + 1


def _stateful(batched):
    def loss(model, state, x, y):
        if batched:
            h, state = model.batched(x, state)
        else:
            h, state = jax.vmap(model, in_axes=(0, None), out_axes=(0, None))(x, state)
        return jnp.mean((h - y) ** 2, axis=-1), state

    return loss


def test_a_stateful_stack_called_per_example_is_not_fused_and_the_step_says_why():
    def make(k):
        return _Counting(eqx.nn.Linear(16, 16, key=k)), jnp.zeros((), jnp.int32)

    blocks, states = el.nn.stack(make, 3, key=jr.PRNGKey(0), remat=True, stateful=True)
    x = jr.normal(jr.PRNGKey(1), (8, 16))
    out = {}
    for batched in (False, True):
        step = el.train.make_step(_stateful(batched), optax.sgd(0.1), has_state=True,
                                  accumulate=2)  # fmt: skip
        state = step.init(blocks, key=jr.PRNGKey(2), model_state=states)
        if batched:  # through stack.batched: fused, and nothing to say
            state, _ = step(state, (x, x))
        else:
            with pytest.warns(el.nn.FusionWarning, match=r"only through stack\.batched"):
                state, _ = step(state, (x, x))
        out[batched] = state
    _assert_same(out[True].model, out[False].model)


def test_a_stack_inside_a_function_compiled_before_the_step_is_named_not_silently_unfused():
    """A jitted function traced before the step, called with the same shapes inside the
    loss, reuses its earlier trace: the stack never sees the step's accumulator, and the
    step says so (the warning used to be lost with the fusion)."""
    blocks = el.nn.stack(lambda k: Residual(key=k), 3, key=jr.PRNGKey(0), remat=True)
    x = jr.normal(jr.PRNGKey(1), (8, 16))
    forward = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))
    forward(blocks, x[:2])  # traced now, outside any step, at the micro-batch's shape

    def loss(model, x, y):
        return (forward(model, x) - y) ** 2

    with pytest.warns(el.nn.FusionWarning, match=r"its call was not traced under the step"):
        fused, _ = _train(blocks, loss, (x, x), fuse=True, accumulate=4)
    plain, _ = _train(blocks, loss, (x, x), fuse=False, accumulate=4)
    _assert_same(fused.model, plain.model)
