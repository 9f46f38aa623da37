"""Rewiring hooks (DSR, SET, RigL) inside the real training step: invariants, the paper's
threshold rule, a dense-mask reference, optimizer state, no recompilation, checkpoints."""

import dataclasses
import re
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem import sparse as sp


class Info(NamedTuple):  # the fields of eqx_lowmem.train's UpdateInfo that hooks read
    grads: Any
    key: Any
    grad_fn: Any


def _data(key, n=32):
    kx, ky = jr.split(key)
    return jr.normal(kx, (n, 8)), jr.normal(ky, (n, 3))


def _model(key, density=0.3, slack=0.2, storage="indices"):
    net = el.nn.mlp([8, 24, 24, 3], key=jr.fold_in(key, 0), activation=jnp.tanh)
    return sp.sparsify(net, density, key=jr.fold_in(key, 1), slack=slack, storage=storage)


def _moments(opt_state):
    """Every array subtree of the optimizer state that is shaped like the model."""
    found = []

    def visit(node):
        if isinstance(node, el.nn.MLP):
            found.append(node)
        return node

    jax.tree.map(visit, opt_state, is_leaf=lambda x: isinstance(x, el.nn.MLP))
    return found


def _check_in_position_order(layer):
    """Each stacked layer's occupied slots first, in increasing order of their positions,
    then the empty ones: the layout `sparsify` makes, which rewiring restores."""
    for row in np.asarray(layer.indices).reshape(-1, layer.capacity).astype(np.int64):
        n = int(np.sum(row < layer.size))
        assert np.all(np.diff(row[:n]) > 0) and np.all(row[n:] == layer.size), row


def _check_invariants(model, opt_state):
    for path, layer in sp._convert.sparse_layers(model):
        idx = np.asarray(layer.indices).reshape(-1)
        live = idx[idx < layer.size]
        assert len(set(live.tolist())) == live.size, f"{path}: an index repeats"
        assert idx.min() >= 0 and idx.max() <= layer.size
        empty = idx >= layer.size
        assert np.all(np.asarray(layer.values, np.float32).reshape(-1)[empty] == 0)
    for moment in _moments(opt_state):
        for (_, layer), m in zip(
            sp._convert.sparse_layers(model),
            [x for _, x in sp._convert.sparse_layers(moment)],
            strict=True,
        ):
            empty = np.asarray(layer.indices) >= layer.size
            assert np.all(np.asarray(m.values, np.float32)[empty] == 0)


_RIGL_TOTAL = 40


@pytest.fixture(scope="module")
def steps():
    """The rewiring steps the tests below share, by name: compiling one is seconds of CPU,
    so each is compiled once for the module (every test's model and batch have the same
    shapes: `_model`, `_data`)."""
    return {
        "dsr": el.train.make_step(
            el.train.mse,
            optax.adam(1e-2),
            after_update=sp.dsr(period=2, fraction=0.05, threshold=0.05),
        ),
        # SET's state is checked for an optax.chain and for half-precision AdamW state
        "set": el.train.make_step(
            el.train.mse,
            optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9)),
            after_update=sp.set_(period=1),
        ),
        "set_half": el.train.make_step(
            el.train.mse, optax.adamw(1e-2), precision="half_bf16", after_update=sp.set_(period=1)
        ),
        "rigl": el.train.make_step(
            el.train.mse, optax.adam(1e-2), after_update=sp.rigl(period=2, total_steps=_RIGL_TOTAL)
        ),
    }


@pytest.mark.parametrize("name", ["dsr", "rigl"])
def test_a_bit_set_storage_rewires_exactly_as_indices(name, steps, getkey):
    # The same model stored both ways: after rewiring steps, the same slots, values and
    # optimizer state, bit for bit; the bit set stays one (one bit per dense weight).
    key, batch = getkey(), _data(getkey())
    out = {}
    for storage in ("indices", "bits"):
        state = steps[name].init(_model(key, storage=storage), key=jr.fold_in(key, 2))
        for _ in range(6):
            state, metrics = steps[name](state, batch)
            assert bool(metrics["finite"])
        out[storage] = state
    kept, bits = (sp._convert.sparse_layers(out[s].model) for s in ("indices", "bits"))
    for (_, a), (_, b) in zip(kept, bits, strict=True):
        assert b.indices.dtype == jnp.uint8 and b.indices.shape == (-(-b.size // 8),)
        np.testing.assert_array_equal(np.asarray(a.indices, np.int32), b.positions())
    assert any(  # rewiring moved slots
        not np.array_equal(np.asarray(b.positions()), np.asarray(m.indices))
        for (_, b), (_, m) in zip(bits, sp._convert.sparse_layers(_model(key)), strict=True)
    )
    floats = [eqx.filter(out[s], eqx.is_inexact_array) for s in ("indices", "bits")]
    for a, b in zip(*map(jax.tree.leaves, floats), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["dsr", "set", "rigl"])
def test_invariants_after_rewiring_in_the_step(name, steps, getkey):
    step = steps[name]
    model = _model(getkey())
    state = step.init(model, key=getkey())
    before = [np.asarray(x.nnz()) for _, x in sp._convert.sparse_layers(state.model)]
    first = [np.asarray(x.indices) for _, x in sp._convert.sparse_layers(state.model)]
    batch = _data(getkey())
    for i in range(8):
        state, metrics = step(state, batch)
        assert bool(metrics["finite"])
        if i == 0:
            compiled = step._jitted._cache_size()
    after = [np.asarray(x.nnz()) for _, x in sp._convert.sparse_layers(state.model)]
    if name == "dsr":
        assert sum(int(a.sum()) for a in after) == sum(int(b.sum()) for b in before)
        assert state.hook_state.threshold_exp.shape == ()  # one H for the whole model
        assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    else:
        for a, b in zip(after, before, strict=True):
            np.testing.assert_array_equal(a, b)
    moved = [
        not np.array_equal(np.asarray(x.indices), f)
        for (_, x), f in zip(sp._convert.sparse_layers(state.model), first, strict=True)
    ]
    assert all(moved)
    _check_invariants(state.model, state.opt_state)
    for _, layer in sp._convert.sparse_layers(state.model):  # the last step rewired
        _check_in_position_order(layer)
    # rewiring never recompiles (the step is shared: its programs are counted from the first)
    assert step._jitted._cache_size() == compiled


@pytest.mark.parametrize("name", ["dsr", "set", "rigl"])
def test_slots_change_only_inside_the_rewiring_loops(name, steps, getkey):
    # A step that does not rewire must not pay for rewiring: the values and every
    # optimizer-state entry shadowing them leave the step straight from a rewiring loop
    # (a while loop of zero or one trip that updates them in place), not from a pass
    # over every slot outside it, and XLA copies none of them.
    step = steps[name]
    state = step.init(_model(getkey()), key=getkey())
    batch = _data(getkey())
    traced = step.trace(state, batch)
    slots = {x.values.shape for _, x in sp._convert.sparse_layers(state.model)}
    producer = {v: eqn for eqn in traced.jaxpr.jaxpr.eqns for v in eqn.outvars}
    made_by = [
        producer[v].primitive.name if v in producer else "the input"
        for v in traced.jaxpr.jaxpr.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.shape in slots
    ]
    moments = len(_moments(state.opt_state))
    assert len(made_by) == (1 + moments) * len(slots), made_by
    assert set(made_by) == {"while"}, made_by
    # Copies inside loop bodies run on rewiring steps only (putting the slots in order);
    # anywhere else they would run on every step.
    text = traced.lower().compile().as_text()
    bodies = set(re.findall(r"body=%([\w.\-]+)", text))
    capacities = "|".join(str(s[-1]) for s in slots)
    copy = re.compile(rf"= b?f(?:16|32)\[(?:\d+,)*(?:{capacities})\]\S* copy\(")
    where, every_step = None, []
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        where = head.group(1) if head else where
        if copy.search(line) and where not in bodies:
            every_step.append((where, line.strip()))
    assert bodies and not every_step, every_step


def test_in_order_moves_every_array_with_its_index():
    from eqx_lowmem.sparse._rewire import _in_order

    rng = np.random.default_rng(0)
    size, cap = 300, 64  # int16 indices; positions on both sides of 32-bit word edges
    live = np.unique(np.concatenate([[0, 31, 32, 63, 64, 299], rng.choice(size, 44)]))
    idx = np.full(cap, size, np.int16)
    idx[: live.size] = live
    rng.shuffle(idx)
    values = [np.where(idx < size, rng.normal(size=cap), 0).astype(np.float32) for _ in "ab"]
    moved, arrays = jax.jit(lambda i, a: _in_order(i, a, size))(jnp.asarray(idx), values)
    assert moved.dtype == jnp.int16
    np.testing.assert_array_equal(moved[: live.size], live)
    np.testing.assert_array_equal(moved[live.size :], size)
    for before, after in zip(values, arrays, strict=True):
        pairs = dict(zip(idx.tolist(), before.tolist(), strict=True))
        np.testing.assert_array_equal(after[: live.size], [pairs[i] for i in live.tolist()])
        np.testing.assert_array_equal(after[live.size :], 0)


def test_dsr_threshold_rule_on_a_hand_made_set():
    # Two layers of 4x4 with 8 slots each (6 occupied, 2 free): known magnitudes.
    def layer(values, occupied):
        indices = np.full(8, 16, np.int8)
        indices[: len(occupied)] = occupied
        v = np.zeros(8, np.float32)
        v[: len(values)] = values
        return sp.SparseLinear(
            values=jnp.asarray(v),
            indices=jnp.asarray(indices),
            bias=None,
            in_features=4,
            out_features=4,
            use_bias=False,
        )

    a = layer([0.0005, 0.002, 0.5, -0.0001, 0.3, 0.7], [0, 1, 2, 3, 4, 5])
    b = layer([0.9, -0.8, 0.0009, 0.6, 0.5, 0.4], [10, 11, 12, 13, 14, 15])
    model = (a, b)
    momentum = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_inexact_array))
    dsr = sp.dsr(period=100, fraction=0.1, threshold=1e-3, tolerance=0.1)
    state = el.train.TrainState(
        step=jnp.asarray(100, jnp.int32),
        model=model,
        opt_state=(optax.TraceState(trace=momentum), optax.EmptyState()),
        key=jr.PRNGKey(0),
        hook_state=dsr.init(model),  # H as one scalar for the whole model
    )
    assert state.hook_state == sp._rules.DSRState(jnp.int32(0))
    # H = 1e-3 prunes |w| < 1e-3: a's 0.0005 and -0.0001, b's 0.0009 (3 weights). The
    # target is fraction * 32 = 3.2 weights, so 3 < (1 - 0.1) * 3.2 = 2.88 is false and
    # 3 > 3.52 is false: H stays.
    # jitted, as in a step (and one compilation a structure, not one per operation)
    hook = eqx.filter_jit(dsr)
    new = hook(state, Info(None, jr.PRNGKey(1), None))
    na, nb = new.model
    assert int(new.hook_state.threshold_exp) == 0
    for old, lay in ((a, na), (b, nb)):
        kept = {int(i): float(v) for i, v in zip(old.indices, old.values, strict=True) if i < 16}
        now = {int(i): float(v) for i, v in zip(lay.indices, lay.values, strict=True) if i < 16}
        survivors = {i for i, v in kept.items() if abs(v) >= 1e-3}
        assert survivors <= set(now) and all(now[i] == kept[i] for i in survivors)
        assert all(now[i] == 0.0 for i in set(now) - survivors)  # grown at zero
    # 3 regrown in proportion to survivors (a: 4, b: 5): allocate gives a 1 (+1), b 1 (+0)
    assert int(na.nnz()) + int(nb.nnz()) == 12
    np.testing.assert_array_equal(
        sp._rules.allocate(jnp.int32(3), jnp.array([4, 5]), jnp.array([4, 3])), [1, 2]
    )
    assert int(na.nnz()) == 4 + 1 and int(nb.nnz()) == 5 + 2
    # pruned and grown weights carry zero momentum, untouched ones keep theirs; by position,
    # as rewiring puts each layer's slots in the order of their positions (empty ones last)
    for old, lay, trace in zip((a, b), (na, nb), new.opt_state[0].trace, strict=True):
        pairs = zip(old.indices.tolist(), old.values.tolist(), strict=True)
        kept = {i for i, v in pairs if i < 16 and abs(v) >= 1e-3}
        _check_in_position_order(lay)
        for i, m in zip(lay.indices.tolist(), trace.values.tolist(), strict=True):
            assert m == (1.0 if i in kept else 0.0), (i, m)

    # Too few pruned: H doubles. 1 weight below 1e-3 in a set where the target is 3.2.
    few = (layer([0.0005, 0.5], [0, 1]), layer([0.9], [3]))
    st = el.train.TrainState(
        step=jnp.asarray(100, jnp.int32),
        model=few,
        opt_state=(),
        key=jr.PRNGKey(0),
        hook_state=dsr.init(few),
    )
    out = hook(st, Info(None, jr.PRNGKey(2), None))
    assert int(out.hook_state.threshold_exp) == 1
    # ... and the next rewiring prunes below the doubled H (2e-3: 0.0005 only, too few
    # again, so H doubles once more); a rewiring reads H from the state it is given.
    assert int(hook(out, Info(None, jr.PRNGKey(3), None)).hook_state.threshold_exp) == 2
    # Too many pruned: H halves (target 0.01 * 32 = 0.32 weights, 1 pruned).
    out = eqx.filter_jit(sp.dsr(period=100, fraction=0.01))(st, Info(None, jr.PRNGKey(2), None))
    assert int(out.hook_state.threshold_exp) == -1
    # Not a rewiring step: nothing changes.
    off = dataclasses.replace(st, step=jnp.asarray(101, jnp.int32))
    same = hook(off, Info(None, jr.PRNGKey(2), None))
    assert eqx.tree_equal(same.model, few)


def _reference_rigl(model, batch, steps, period, fraction, total, lr):
    """RigL written with dense weights and dense masks: Adam on masked gradients, then
    every `period` updates drop the smallest active weights and grow where the dense
    gradient is largest (lax.top_k, as a dense score), new weights and state at 0."""
    dense = sp.densify(model)
    masks = [w.weight != 0 for w in dense.layers]
    opt = optax.adam(lr)
    params, static = eqx.partition(dense, eqx.is_inexact_array)
    opt_state = opt.init(params)

    @jax.jit
    @jax.grad
    def grad_of(p):
        return jnp.mean(el.train.mse(eqx.combine(p, static), *batch))

    @jax.jit
    def update(g, opt_state, params):
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for t in range(1, steps + 1):
        g = grad_of(params)
        g = eqx.tree_at(
            lambda p: [x.weight for x in p.layers],
            g,
            [jnp.where(m, x.weight, 0.0) for x, m in zip(g.layers, masks, strict=True)],
        )
        params, opt_state = update(g, opt_state, params)
        if t % period or t > int(0.75 * total):
            continue
        f = fraction / 2 * (1 + jnp.cos(jnp.pi * jnp.float32(t) / int(0.75 * total)))
        g = grad_of(params)
        new_weights, new_masks, changed_all = [], [], []
        for layer, grad, m in zip(params.layers, g.layers, masks, strict=True):
            w, m = np.asarray(layer.weight).reshape(-1), np.asarray(m).reshape(-1)
            n = int(m.sum())
            k = int(jnp.floor(f * jnp.float32(n)))
            mag = np.where(m, np.abs(w), np.inf)
            drop = np.argsort(mag, kind="stable")[:k]
            m2 = m.copy()
            m2[drop] = False
            score = jnp.where(jnp.asarray(m2), -jnp.inf, jnp.abs(grad.weight.reshape(-1)))
            k_max = max(1, int(np.ceil(fraction * _capacity(model, w.size))))
            _, grow = jax.lax.top_k(score, k_max)
            grow = np.asarray(grow)[:k]
            m3 = m2.copy()
            m3[grow] = True
            changed = np.zeros_like(m)
            changed[drop] = True
            changed[grow] = True
            w = np.where(m3 & ~changed, w, 0.0)
            new_weights.append(jnp.asarray(w.reshape(layer.weight.shape)))
            new_masks.append(jnp.asarray(m3.reshape(layer.weight.shape)))
            changed_all.append(jnp.asarray(changed.reshape(layer.weight.shape)))
        params = eqx.tree_at(lambda p: [x.weight for x in p.layers], params, new_weights)
        masks = new_masks

        def zero(tree, changed_all=changed_all):
            return eqx.tree_at(
                lambda p: [x.weight for x in p.layers],
                tree,
                [
                    jnp.where(c, 0.0, x.weight)
                    for x, c in zip(tree.layers, changed_all, strict=True)
                ],
            )

        adam = opt_state[0]
        opt_state = (adam._replace(mu=zero(adam.mu), nu=zero(adam.nu)), *opt_state[1:])
    return eqx.combine(params, static)


def _capacity(model, size):
    return next(x.capacity for _, x in sp._convert.sparse_layers(model) if x.size == size)


def test_rigl_step_equals_a_dense_mask_reference(steps, getkey):
    model = _model(getkey())
    batch = _data(getkey())
    n, period, total, lr = 6, 2, _RIGL_TOTAL, 1e-2  # as steps["rigl"]
    state = steps["rigl"].init(model, key=getkey())
    for _ in range(n):
        state, _ = steps["rigl"](state, batch)
    reference = _reference_rigl(model, batch, n, period, 0.3, total, lr)
    ours = sp.densify(state.model)
    for a, b in zip(ours.layers, reference.layers, strict=True):
        np.testing.assert_allclose(a.weight, b.weight, rtol=0, atol=1e-6)
        assert np.array_equal(np.asarray(a.weight) != 0, np.asarray(b.weight) != 0)
        np.testing.assert_allclose(a.bias, b.bias, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["set", "set_half"])  # an optax.chain; half-precision AdamW
def test_optimizer_state_zeroed_for_chains_and_half_state(name, steps, getkey):
    model = _model(getkey())
    step, half = steps[name], name == "set_half"
    state = step.init(model, key=getkey())
    batch = _data(getkey())
    for _ in range(3):
        state, _ = step(state, batch)
    moments = _moments(state.opt_state)
    assert len(moments) == (2 if half else 1)
    if half:
        assert state.model.layers[0].values.dtype == jnp.bfloat16
        assert state.model.layers[0].indices.dtype == jnp.int16
    _check_invariants(state.model, state.opt_state)
    # a slot grown in the last rewiring has value 0 and zero state everywhere
    for moment in moments:
        m = np.asarray(moment.layers[1].values, np.float32)
        v = np.asarray(state.model.layers[1].values, np.float32)
        live = np.asarray(state.model.layers[1].indices) < state.model.layers[1].size
        assert np.any(live & (v == 0)) and np.all(m[live & (v == 0)] == 0)


def test_checkpoint_resume_is_bit_identical(tmp_path, steps, getkey):
    model = _model(getkey())
    step = steps["dsr"]
    batch = _data(getkey())
    key = getkey()
    straight = step.init(model, key=key)
    for _ in range(6):
        straight, _ = step(straight, batch)
    half = step.init(model, key=key)
    for _ in range(3):
        half, _ = step(half, batch)
    el.train.save_checkpoint(tmp_path / "ckpt", half, {"step": 3})
    like = step.init(model, key=key)
    resumed, meta = el.train.load_checkpoint(tmp_path / "ckpt", like)
    assert meta["step"] == 3
    for _ in range(3):
        resumed, _ = step(resumed, batch)
    assert eqx.tree_equal(resumed, straight)
    # a dense model's checkpoint does not load into the sparse state
    dense_step = el.train.make_step(el.train.mse, optax.adam(1e-2))
    dense_state = dense_step.init(sp.densify(model), key=key)
    el.train.save_checkpoint(tmp_path / "dense", dense_state, {})
    with pytest.raises(ValueError):
        el.train.load_checkpoint(tmp_path / "dense", like)


def test_bad_arguments(getkey):
    for make in (sp.dsr, sp.set_, sp.rigl):
        with pytest.raises(ValueError, match="period=0"):
            make(period=0)
        with pytest.raises(ValueError, match=r"fraction=0.0; expected a fraction in \(0, 1\]"):
            make(fraction=0.0)
        with pytest.raises(ValueError, match="total_steps=-5"):
            make(total_steps=-5)
    with pytest.raises(ValueError, match="tolerance=2.0"):
        sp.dsr(tolerance=2.0)
    with pytest.raises(ValueError, match="threshold=0.0"):
        sp.dsr(threshold=0.0)
    with pytest.raises(ValueError, match="decay='linear'"):
        sp.rigl(decay="linear")
    dense = el.nn.mlp([4, 3], key=getkey())
    state = el.train.TrainState(
        step=jnp.asarray(0, jnp.int32), model=dense, opt_state=(), key=getkey()
    )
    with pytest.raises(ValueError, match="no sparse layers"):
        sp.dsr()(state, Info(None, getkey(), None))
    with pytest.raises(ValueError, match="no sparse layers"):  # at init, before any step
        el.train.make_step(el.train.mse, optax.sgd(0.1), after_update=sp.dsr()).init(
            dense, key=getkey()
        )
    sparse = dataclasses.replace(state, model=_model(getkey()))
    with pytest.raises(ValueError, match=r"hook_state=hook.init\(model\)\); got hook_state=None"):
        sp.dsr()(sparse, Info(None, getkey(), None))


# -- finding the optimizer state to zero ----------------------------------------------------


def _values_only(params):
    """True at the sparse layers' values, False at every other parameter."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: jax.tree_util.keystr(path).endswith(".values"), params
    )


def _labels(params):
    return jax.tree.map(lambda v: "sparse" if v else "dense", _values_only(params))


_LAID_OUT = {  # optimizer, and how many of its entries shadow each sparse layer's values
    "masked": (optax.masked(optax.adam(1e-2), _values_only), 2),
    "multi_transform": (
        optax.multi_transform(
            {"sparse": optax.adam(1e-2), "dense": optax.sgd(0.05, momentum=0.9)}, _labels
        ),
        2,
    ),
    "inject_hyperparams": (optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), 2),
}  # the 16-bit state (half_state): test_optimizer_state_zeroed_for_chains_and_half_state


def _entries(opt_state, path):
    """Every array in the optimizer state at a sparse layer's values `path` (below a
    subtree shaped like the model)."""
    return [
        leaf
        for p, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
        if jax.tree_util.keystr(p).endswith(path) and leaf.ndim == 1
    ]


@pytest.mark.parametrize("name", sorted(_LAID_OUT))
def test_grown_slots_get_zero_state_under_optimizer_wrappers(name, getkey):
    # Under optax.masked and multi_transform the moments hold a MaskedNode where the
    # optimizer sees no parameter; rewiring must still find them (it used to match only
    # subtrees of exactly the parameters' structure and left grown slots stale there).
    optimizer, per_layer = _LAID_OUT[name]
    step = el.train.make_step(el.train.mse, optimizer, after_update=sp.set_(period=1))
    state = step.init(_model(getkey()), key=getkey())
    batch = _data(getkey())
    for _ in range(3):
        before = [np.asarray(x.positions()) for _, x in sp._convert.sparse_layers(state.model)]
        state, metrics = step(state, batch)
        assert bool(metrics["finite"])
    for (path, layer), old in zip(sp._convert.sparse_layers(state.model), before, strict=True):
        entries = _entries(state.opt_state, f"{path}.values")
        assert len(entries) == per_layer, (path, len(entries))
        now = np.asarray(layer.positions())
        grown = (now < layer.size) & ~np.isin(now, old)
        kept = (now < layer.size) & ~grown
        assert grown.any() and kept.any()
        assert np.all(np.asarray(layer.values, np.float32)[grown] == 0)
        for entry in entries:
            entry = np.asarray(entry, np.float32)
            assert np.all(entry[grown] == 0), (path, entry[grown])
            assert np.any(entry[kept] != 0)  # the slots kept keep their state


class _FlatTrace(NamedTuple):
    trace: Any


def _flat_momentum():
    """Momentum SGD keeping its state as one flat vector (per-slot state that is not laid
    out like the parameters)."""

    def init(params):
        return _FlatTrace(jax.flatten_util.ravel_pytree(params)[0] * 0)

    def update(updates, state, params=None):
        del params
        flat, unravel = jax.flatten_util.ravel_pytree(updates)
        trace = 0.9 * state.trace + flat
        return unravel(-0.05 * trace), _FlatTrace(trace)

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize(
    "optimizer, match",
    [
        (_flat_momentum(), r"float32\[\d+\] at opt_state\.trace, outside every subtree"),
        (optax.lbfgs(), r"opt_state\[0\]\.diff_params_memory\.layers\[0\]\.values is float32"),
    ],
)
def test_optimizer_state_rewiring_cannot_find_is_refused(optimizer, match, getkey):
    model = _model(getkey())
    params = eqx.filter(model, eqx.is_inexact_array)
    for hook in (sp.set_(period=1), sp.dsr(period=1)):
        state = el.train.TrainState(
            step=jnp.asarray(1, jnp.int32),
            model=model,
            opt_state=optimizer.init(params),
            key=getkey(),
            hook_state=hook.init(model) if hasattr(hook, "init") else None,
        )
        with pytest.raises(ValueError, match=match):
            hook(state, Info(None, getkey(), None))


def test_random_regrowth_that_cannot_place_every_weight_fails_loudly(getkey):
    from eqx_lowmem.sparse._rewire import _grow_random

    # 1,000 positions, 999 occupied: the one free position is drawn with probability
    # 1/1000 per draw, so one round of one draw misses it.
    size = 1000
    indices = jnp.concatenate([jnp.arange(1, size, dtype=jnp.int32), jnp.full((1,), size)])
    grow = eqx.filter_jit(_grow_random)
    key = jr.PRNGKey(0)
    assert int(jr.randint(jr.split(key)[1], (1,), 0, size)[0]) != 0  # the draw misses
    with pytest.raises(Exception, match="without finding as many free positions"):
        jax.block_until_ready(grow(indices, 1, key, size=size, draws=1, max_rounds=1))
    # with rounds enough it places it
    out, taken = grow(indices, 1, key, size=size, draws=64)
    assert int(out[-1]) == 0 and bool(taken[-1])


def test_rewiring_zeroes_the_slots_of_8_bit_moments(getkey):
    opt = el.precision.quantized_state(optax.adam(1e-2), block=16)  # the layers' values: > 16
    step = el.train.make_step(el.train.mse, opt, after_update=sp.set_(period=1))
    state = step.init(_model(getkey()), key=getkey())
    batch = _data(getkey())
    for _ in range(3):
        state, _ = step(state, batch)
    adam = state.opt_state.inner[0]
    layer = state.model.layers[1]
    for moment in (adam.mu, adam.nu):
        packed = moment.layers[1].values
        assert isinstance(packed, el.precision._quantized.QuantizedArray)
        m = np.asarray(packed.dense())
        v = np.asarray(layer.values)
        live = np.asarray(layer.indices) < layer.size
        grown = live & (v == 0)
        assert np.any(grown) and np.all(m[grown] == 0) and np.any(m[live & (v != 0)] != 0)
        assert np.all(m[~live] == 0)  # empty slots hold no state
