"""GroupNorm (with Weight Standardization) and BatchNorm evaluated as trained: normalisation
that does not depend on, or matches, the micro-batch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el

from .helpers import tree_allclose


def _reference_group_norm(x, groups, weight, bias, eps=1e-5):
    c = x.shape[0]
    g = x.reshape(groups, -1)
    y = (g - g.mean(axis=1, keepdims=True)) / jnp.sqrt(g.var(axis=1, keepdims=True) + eps)
    shape = (c,) + (1,) * (x.ndim - 1)
    return y.reshape(x.shape) * weight.reshape(shape) + bias.reshape(shape)


def test_group_norm_matches_its_definition_and_gradients(getkey):
    gn = el.nn.GroupNorm(4, 8)
    gn = eqx.tree_at(lambda m: (m.weight, m.bias), gn, (jr.normal(getkey(), (8,)),
                     jr.normal(getkey(), (8,))))  # fmt: skip
    x = 3.0 + jr.normal(getkey(), (8, 5, 5))
    ref = _reference_group_norm(x, 4, gn.weight, gn.bias)
    np.testing.assert_allclose(gn(x), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gn(x, relu=True), jax.nn.relu(ref), rtol=1e-5, atol=1e-5)
    cot = jr.normal(getkey(), x.shape)

    def ours(x, w, b):
        return jnp.sum(eqx.tree_at(lambda m: (m.weight, m.bias), gn, (w, b))(x, relu=True) * cot)

    def theirs(x, w, b):
        return jnp.sum(jax.nn.relu(_reference_group_norm(x, 4, w, b)) * cot)

    args = (x, gn.weight, gn.bias)
    grads = jax.grad(ours, (0, 1, 2))(*args), jax.grad(theirs, (0, 1, 2))(*args)
    for g, want in zip(*grads, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    # With a state (BatchNorm's place in a stateful block): returned unchanged.
    y, stats = gn(x, gn.init_stats())
    assert stats == () and jnp.array_equal(y, gn(x))


def test_group_norm_refuses_groups_that_do_not_divide_the_channels(getkey):
    with pytest.raises(ValueError, match=r"groups must divide channels=12, got groups=5.*6, 12"):
        el.nn.GroupNorm(5, 12)
    with pytest.raises(ValueError, match=r"groups must be a positive int, got 0"):
        el.nn.GroupNorm(0, 12)
    # In a WideResNet: widths 16, 32, 64 at width 2 ... 24 groups divide none.
    with pytest.raises(ValueError, match=r"groups must divide channels=16, got groups=24"):
        el.nn.WideResNet(10, 2, 10, key=getkey(), norm="group", groups=24)
    with pytest.raises(ValueError, match=r"norm must be one of .*'group_ws'.*got 'layer'"):
        el.nn.WideResNet(10, 1, 10, key=getkey(), norm="layer")


def _loss(model, state, x, y):
    logits, state = model.batched(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y), state


@pytest.mark.parametrize("norm", ["group", "group_ws"])
def test_accumulation_with_group_norm_is_exact_for_any_micro_batch(getkey, norm):
    model, state = eqx.nn.make_with_state(el.nn.WideResNet)(
        10, 1, 10, key=getkey(), in_channels=1, norm=norm
    )
    x, y = jr.normal(getkey(), (8, 1, 8, 8)), jr.randint(getkey(), (8,), 0, 10)
    models = []
    for accumulate in (1, 4, 8):  # micro-batches of 8, 2 and 1 images
        step = el.train.make_step(_loss, optax.sgd(0.1), has_state=True, accumulate=accumulate)
        out, _ = step(step.init(model, key=jr.key(0), model_state=state), (x, y))
        models.append(eqx.filter(out.model, eqx.is_array))
    assert not tree_allclose(models[0], eqx.filter(model, eqx.is_array), atol=1e-4)  # it moved
    for other in models[1:]:
        assert tree_allclose(other, models[0], rtol=1e-4, atol=1e-4)


def test_weight_standardization_standardises_each_output_channel(getkey):
    w = 5.0 + 2.0 * jr.normal(getkey(), (6, 3, 3, 3))
    from eqx_lowmem.nn._norm import standardise_weight

    s = standardise_weight(w).reshape(6, -1)
    np.testing.assert_allclose(s.mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(s.std(axis=1), 1.0, atol=1e-4)
    # And it is in the WRN's forward pass: group_ws differs from group on the same weights.
    x = jr.normal(getkey(), (2, 1, 8, 8))
    key = getkey()
    outs = {}
    for norm in ("group", "group_ws"):
        m, st = eqx.nn.make_with_state(el.nn.WideResNet)(10, 1, 10, key=key, in_channels=1,
                                                         norm=norm)  # fmt: skip
        outs[norm] = m.batched(x, st)[0]
    assert not tree_allclose(outs["group"], outs["group_ws"], atol=1e-3)


@pytest.mark.parametrize("storage", ["indices", "bits"])
def test_weight_standardization_of_a_sparse_convolution_is_over_its_stored_weights(getkey, storage):
    from eqx_lowmem.nn._norm import standardise_weight

    conv = eqx.nn.Conv2d(3, 6, 3, use_bias=False, key=getkey())
    conv = eqx.tree_at(lambda c: c.weight, conv, 5.0 + 2.0 * jr.normal(getkey(), (6, 3, 3, 3)))
    # At density 1 every weight is stored: the dense layer's standardization.
    full = el.sparse.SparseConv2d.from_dense(conv, 1.0, key=getkey(), storage=storage)
    np.testing.assert_allclose(
        full.standardised().weight, standardise_weight(conv.weight), rtol=1e-5, atol=1e-5
    )
    # At density 0.3, with empty slots: each output channel over its stored weights only.
    sparse = el.sparse.SparseConv2d.from_dense(conv, 0.3, key=getkey(), capacity=60,
                                               storage=storage)  # fmt: skip
    w, got = np.asarray(sparse.weight), np.asarray(sparse.standardised().weight)
    stored = np.zeros(sparse.size, bool)
    positions = np.asarray(sparse.positions())
    stored[positions[positions < sparse.size]] = True
    stored = stored.reshape(w.shape)
    assert 0 < stored.sum() < sparse.capacity  # some slots empty
    for o in range(6):
        v = w[o][stored[o]]
        np.testing.assert_allclose(
            got[o][stored[o]], (v - v.mean()) / np.sqrt(v.var() + 1e-5), rtol=1e-5, atol=1e-5
        )
        assert not got[o][~stored[o]].any()  # positions with no weight stay 0
    empty = positions >= sparse.size
    if storage == "indices":
        assert not np.asarray(sparse.standardised().values)[empty].any()


def test_a_sparse_wideresnet_standardises_its_sparse_convolutions(getkey):
    # Every weight stored: the sparse WRN under group_ws computes the dense one's numbers.
    x = jr.normal(getkey(), (2, 1, 8, 8))
    dense, st = eqx.nn.make_with_state(el.nn.WideResNet)(10, 1, 10, key=getkey(), in_channels=1,
                                                         norm="group_ws")  # fmt: skip
    sparse = el.sparse.sparsify(dense, 1.0, key=getkey())
    n_sparse = sum(isinstance(m, el.sparse.SparseConv2d) for m in jax.tree.leaves(
        sparse, is_leaf=lambda m: isinstance(m, el.sparse.SparseConv2d)))  # fmt: skip
    assert n_sparse > 0
    np.testing.assert_allclose(sparse.batched(x, st)[0], dense.batched(x, st)[0], rtol=1e-4,
                               atol=1e-5)  # fmt: skip


def test_batch_statistics_evaluation_normalises_each_micro_batch_as_training(getkey):
    model, state = eqx.nn.make_with_state(el.nn.WideResNet)(10, 1, 10, key=getkey(),
                                                            in_channels=1)  # fmt: skip
    x = jr.normal(getkey(), (5, 1, 8, 8))
    got = el.nn.apply_with_batch_statistics(eqx.nn.inference_mode(model), state, x, micro_batch=2)
    want = jnp.concatenate([model.batched(x[i : i + 2], state)[0] for i in (0, 2, 4)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Not the running statistics' outputs (the usual evaluation).
    running = eqx.nn.inference_mode(model).batched(x, state)[0]
    assert not tree_allclose(got, running, atol=1e-3)
    # micro_batch=1: each image by its own statistics.
    one = el.nn.apply_with_batch_statistics(model, state, x, micro_batch=1)
    np.testing.assert_allclose(one[3], model.batched(x[3:4], state)[0][0], rtol=1e-5, atol=1e-5)


def test_batch_statistics_evaluation_refuses_models_without_batch_norm(getkey):
    build = eqx.nn.make_with_state(el.nn.WideResNet)
    model, state = build(10, 1, 10, key=getkey(), in_channels=1, norm="group")
    x = jnp.zeros((2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"no eqx_lowmem.nn.BatchNorm layer, got a WideResNet"):
        el.nn.apply_with_batch_statistics(model, state, x, micro_batch=2)
    bn_model, bn_state = eqx.nn.make_with_state(el.nn.WideResNet)(10, 1, 10, key=getkey(),
                                                                  in_channels=1)  # fmt: skip
    for bad in (0, True):
        with pytest.raises(ValueError, match=rf"micro_batch must be a positive int.*got {bad}"):
            el.nn.apply_with_batch_statistics(bn_model, bn_state, x, micro_batch=bad)


def test_group_norm_in_a_stack_block(getkey):
    class Block(eqx.Module):
        norm: el.nn.GroupNorm
        linear: eqx.nn.Linear

        def __init__(self, *, key):
            self.norm = el.nn.GroupNorm(2, 4)
            self.linear = eqx.nn.Linear(4, 4, key=key)

        def __call__(self, x, *, key=None):  # x: (4, positions)
            return x + jax.vmap(self.linear, in_axes=1, out_axes=1)(self.norm(x, relu=True))

    blocks = el.nn.stack(lambda k: Block(key=k), 3, key=getkey(), remat=True)
    x = jr.normal(getkey(), (6, 4, 5))
    y = jax.vmap(blocks)(x)
    one_by_one = jnp.stack([blocks(xi) for xi in x])
    np.testing.assert_allclose(y, one_by_one, rtol=1e-5, atol=1e-5)
