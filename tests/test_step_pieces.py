"""The step's pieces, each on its own: the one loss call, accumulation over a gradient
function, the update pieces, the after_update hook, and the inputs that used to go wrong."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.train._accumulate import accumulate, loss_grad
from eqx_lowmem.train._loss import call_loss, mean_loss
from eqx_lowmem.train._update import apply_updates, if_finite_cond, mean_gradient

from .helpers import compile_as_users, tree_allclose


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def _host(tree):
    return jax.tree.map(np.array, tree)


# -- call_loss ---------------------------------------------------------------------------


def test_call_loss_casts_passes_key_and_weights(getkey):
    model = el.nn.mlp([3, 4, 1], key=getkey())
    x, y = jr.normal(getkey(), (6, 3)), jr.normal(getkey(), (6, 1))
    seen = {}

    def loss(model, x, y, *, key=None):
        seen["dtype"] = model.layers[0].weight.dtype
        seen["x"] = x.dtype
        seen["key"] = key
        return el.train.mse(model, x, y)

    w = jnp.array([1.0, 0.0, 2.0, 1.0, 1.0, 0.5])
    policy = el.precision.get_policy("mixed_bf16")
    out = call_loss(loss, model, (x, y), w, key=getkey(), policy=policy)
    assert seen["dtype"] == jnp.bfloat16 and seen["x"] == jnp.bfloat16
    assert seen["key"] is not None
    assert out.values.dtype == jnp.float32 and out.values.shape == (6,)
    np.testing.assert_array_equal(out.weights, w)
    assert out.model_state is None
    # Without a key keyword, no key is passed; the mean is the weighted one.
    plain = call_loss(lambda m, x, y: el.train.mse(m, x, y), model, (x, y), w, key=getkey())
    expected = jnp.sum(el.train.mse(model, x, y) * w) / jnp.sum(w)
    np.testing.assert_allclose(mean_loss(plain), expected, rtol=1e-6)


def test_call_loss_refuses_a_mean_and_mismatched_weights(getkey):
    model = el.nn.mlp([3, 1], key=getkey())
    x, y = jnp.ones((4, 3)), jnp.ones((4, 1))
    with pytest.raises(ValueError, match="one value per sample"):
        call_loss(lambda m, x, y: jnp.mean(el.train.mse(m, x, y)), model, (x, y))
    with pytest.raises(ValueError, match="weights of shape"):
        call_loss(lambda m, x, y: (el.train.mse(m, x, y), jnp.ones((3,))), model, (x, y))


# -- accumulation ------------------------------------------------------------------------


@pytest.mark.parametrize("size, k", [(12, 1), (12, 4), (10, 4), (7, 3), (9, 4)])
def test_accumulate_equals_the_gradient_function_on_the_whole_batch(size, k, getkey):
    model = el.nn.mlp([3, 8, 2], key=getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x, y = jr.normal(getkey(), (size, 3)), jr.normal(getkey(), (size, 2))
    w = jr.uniform(getkey(), (size,), minval=0.5, maxval=2.0)
    policy = el.precision.get_policy(None)
    fn = loss_grad(el.train.mse, static, policy)
    scale = jnp.float32(8.0)
    whole = fn(params, None, (x, y), w, getkey(), scale)
    micro = accumulate(fn, k)(params, None, (x, y), w, getkey(), scale)
    assert tree_allclose(micro.grads, whole.grads, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(micro.total, whole.total, rtol=1e-5)
    np.testing.assert_allclose(micro.weight, whole.weight, rtol=1e-6)
    # The sums are of `scale * sum(values * weights)`: the mean gradient divides both out.
    ref = eqx.filter_grad(lambda m: jnp.sum(el.train.mse(m, x, y) * w) / jnp.sum(w))(model)
    assert tree_allclose(mean_gradient(micro, scale).grads, _params(ref), rtol=1e-5, atol=1e-6)


def _bn_model():
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        3, axis_name="batch", momentum=0.5, mode="batch"
    )


def _bn_loss(model, state, x):
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.sum(out**3, axis=1), state


def test_stateful_step_uses_the_real_micro_batches_never_padding(getkey):
    """30 samples in 4 micro-batches are 8, 8, 8 and 6: no repeated sample enters the
    batch statistics, and the update is that of the real micro-batches."""
    model, bn_state = _bn_model()
    model = eqx.tree_at(lambda m: m.weight, model, jnp.array([1.0, 2.0, 3.0]))
    x = 1.0 + jr.normal(getkey(), (30, 3))
    step = el.train.make_step(_bn_loss, optax.sgd(0.1), accumulate=4, has_state=True)
    state, metrics = step(step.init(model, key=getkey(), model_state=bn_state), (x,))

    grads, mstate, total = None, bn_state, 0.0
    for start, stop in ((0, 8), (8, 16), (16, 24), (24, 30)):

        def f(m, mstate=mstate, start=start, stop=stop):
            values, new = _bn_loss(m, mstate, x[start:stop])
            return jnp.sum(values), (new, jnp.sum(values))

        (_, (mstate, t)), g = eqx.filter_value_and_grad(f, has_aux=True)(model)
        total += float(t)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / 30, grads)
    expected = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
    assert tree_allclose(_params(state.model), _params(expected), rtol=1e-5, atol=1e-6)
    assert tree_allclose(
        jax.tree.leaves(state.model_state), jax.tree.leaves(mstate), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(float(metrics["loss"]), total / 30, rtol=1e-5)


# -- the update pieces --------------------------------------------------------------------


def test_mean_gradient_zero_weight_and_nonfinite():
    sums = el.train._accumulate.Sums({"w": jnp.ones(3)}, jnp.float32(0.0), jnp.float32(0.0), None)
    mean = mean_gradient(sums, jnp.float32(2.0))
    assert float(mean.loss) == 0.0 and bool(mean.finite)
    np.testing.assert_allclose(mean.grads["w"], 0.5)
    bad = el.train._accumulate.Sums({"w": jnp.array([1.0, jnp.inf, 0.0])}, jnp.float32(1.0),
                        jnp.float32(1.0), None)  # fmt: skip
    assert not bool(mean_gradient(bad, jnp.float32(1.0)).finite)


def test_apply_updates_plain_and_stochastic(getkey):
    params = {"w": jr.normal(getkey(), (64,))}
    updates = {"w": jr.normal(getkey(), (64,)) * 1e-3}
    plain = apply_updates(params, updates, param_dtype=jnp.float32, key=getkey())
    np.testing.assert_array_equal(plain["w"], optax.apply_updates(params, updates)["w"])
    half = {"w": params["w"].astype(jnp.bfloat16)}
    out = apply_updates(half, updates, param_dtype=jnp.bfloat16, key=getkey())
    assert out["w"].dtype == jnp.bfloat16
    exact = half["w"].astype(jnp.float32) + updates["w"]
    # Stochastic rounding lands on one of the two bfloat16 neighbours of the exact sum.
    ulp = jnp.abs(exact) * 2.0**-7 + 1e-30
    assert bool(jnp.all(jnp.abs(out["w"].astype(jnp.float32) - exact) <= ulp))


def test_if_finite_cond_keeps_the_old_state_and_skips_the_update():
    # The step's own selection (`make_step` calls `if_finite_cond`): the update is not
    # computed on a skipped step (its side effect, a callback, does not run).
    ran = []

    def apply():
        jax.debug.callback(lambda: ran.append(1))
        return {"a": jnp.ones(2)}

    old = {"a": jnp.zeros(2)}
    step = jax.jit(lambda finite: if_finite_cond(finite, apply, old))
    np.testing.assert_array_equal(jax.block_until_ready(step(jnp.bool_(False)))["a"], 0.0)
    assert ran == []
    np.testing.assert_array_equal(jax.block_until_ready(step(jnp.bool_(True)))["a"], 1.0)
    assert ran == [1]


# -- after_update ------------------------------------------------------------------------


def test_after_update_sees_the_new_state_and_can_take_another_gradient(getkey):
    model = el.nn.mlp([3, 8, 1], key=getkey())
    x, y = jr.normal(getkey(), (8, 3)), jr.normal(getkey(), (8, 1))
    opt = optax.sgd(0.1)

    def hook(state, info):
        # Replace the parameters by the gradient of this batch at the updated model, and
        # count the hook's calls in the step counter's place of a second field.
        grads = info.grad_fn(state.model)
        static = eqx.filter(state.model, eqx.is_inexact_array, inverse=True)
        return eqx.tree_at(lambda s: s.model, state, eqx.combine(grads, static))

    step = el.train.make_step(el.train.mse, opt, accumulate=2, after_update=hook)
    state, _ = step(step.init(model, key=getkey()), (x, y))
    plain = el.train.make_step(el.train.mse, opt, accumulate=2)
    updated, _ = plain(plain.init(model, key=getkey()), (x, y))
    expected = eqx.filter_grad(lambda m: jnp.mean(el.train.mse(m, x, y)))(updated.model)
    assert int(state.step) == 1
    assert tree_allclose(_params(state.model), _params(expected), rtol=1e-5, atol=1e-6)


def test_after_update_is_told_whether_the_update_was_skipped_and_must_keep_shapes(getkey):
    model = el.nn.mlp([2, 3, 1], key=getkey())
    seen = []

    def hook(state, info):
        # Runs on every step, after the update or its skip; this one counts both kinds.
        seen.append(info.finite)
        bump = jnp.where(info.finite, 100, 1000)
        return eqx.tree_at(lambda s: s.step, state, state.step + bump)

    step = el.train.make_step(el.train.mse, optax.sgd(0.1), after_update=hook,
                              skip_nonfinite=True)  # fmt: skip
    state = step.init(model, key=getkey())
    before = jax.tree.map(np.array, _params(state.model))  # the step donates its input
    state, m = step(state, (jnp.full((4, 2), jnp.nan), jnp.zeros((4, 1))))
    # skipped: the parameters are the old ones and the hook saw finite=False
    assert not bool(m["finite"]) and int(state.step) == 1000
    after = jax.tree.map(np.array, _params(state.model))
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)
    )
    state, m = step(state, (jnp.ones((4, 2)), jnp.zeros((4, 1))))
    assert bool(m["finite"]) and int(state.step) == 1101
    assert seen, "the hook was never traced"

    def bad(state, info):
        return eqx.tree_at(lambda s: s.step, state, jnp.zeros((2,), jnp.int32))

    step = el.train.make_step(el.train.mse, optax.sgd(0.1), after_update=bad)
    with pytest.raises((ValueError, TypeError), match="after_update|shape|branch"):
        step(step.init(model, key=getkey()), (jnp.ones((4, 2)), jnp.zeros((4, 1))))


# -- inputs that used to go wrong ---------------------------------------------------------


class _ListModel(eqx.Module):
    layers: list
    note: object  # an unhashable non-array leaf

    def __call__(self, x, *, key=None):
        for layer in self.layers:
            x = layer(x)
        return x


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return isinstance(other, _Unhashable)


@pytest.mark.parametrize(
    "optimizer, precision",
    [
        (optax.adam(1e-2), None),
        (
            optax.multi_transform(
                {"a": optax.adam(1e-2), "b": optax.sgd(0.1)},
                lambda p: jax.tree.map(lambda _: "a", p),
            ),
            None,
        ),  # fmt: skip
        (optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), None),
        (optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), "half_bf16"),
    ],
)
def test_any_model_and_optimizer_train(optimizer, precision, getkey):
    k1, k2 = jr.split(getkey())
    model = _ListModel([eqx.nn.Linear(2, 4, key=k1), eqx.nn.Linear(4, 1, key=k2)], _Unhashable())
    step = el.train.make_step(el.train.mse, optimizer, precision=precision)
    state = step.init(model, key=getkey())
    x, y = jr.normal(getkey(), (8, 2)), jr.normal(getkey(), (8, 1))
    losses = []
    for _ in range(5):
        state, m = step(state, (x, y))
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] and all(np.isfinite(losses))


def test_reusing_a_donated_state_is_a_clear_error(getkey):
    step = el.train.make_step(el.train.mse, optax.sgd(0.1))
    state = step.init(el.nn.mlp([2, 1], key=getkey()), key=getkey())
    batch = (jnp.ones((4, 2)), jnp.zeros((4, 1)))
    step(state, batch)
    with pytest.raises(ValueError, match="already consumed"):
        step(state, batch)


def test_a_state_passed_back_runs_as_a_rebuilt_one_and_is_not_kept_alive(getkey):
    # The step keeps the split of the state it returned, so that a loop passing it back
    # skips a flatten: the same updates as a state it never saw, and dropping the state
    # frees its arrays (the step holds it weakly).
    import weakref

    step = el.train.make_step(el.train.mse, optax.adam(0.1))
    model = el.nn.mlp([2, 4, 1], key=getkey())
    batches = [(jr.normal(getkey(), (8, 2)), jr.normal(getkey(), (8, 1))) for _ in range(3)]
    passed, rebuilt = (step.init(model, key=jr.PRNGKey(0)) for _ in range(2))
    for batch in batches:
        passed, _ = step(passed, batch)
        rebuilt, _ = step(jax.tree.map(lambda x: x, rebuilt), batch)  # a new object
    assert tree_allclose(passed, rebuilt, rtol=0, atol=0)
    weight = weakref.ref(passed.model.layers[0].weight)
    del passed
    assert weight() is None


@pytest.mark.parametrize(
    "key, said",
    [
        (0, r"key=0 is an int; key must be a JAX PRNG key: pass key=jr.PRNGKey\(0\)"),
        (jnp.zeros(5, jnp.uint32), r"got an array of dtype uint32 and shape \(5,\)"),
        (jr.split(jr.key(0), 3), r"one JAX PRNG key \(shape \(\)\), got keys of shape \(3,\)"),
        (np.zeros(2, np.uint32), r"key is a numpy array.*jnp.asarray\(key\)"),
    ],
)
def test_step_init_and_fit_refuse_the_same_keys_alike(getkey, key, said):
    """One rule for PRNG keys (`eqx_lowmem._checks.check_prng_key`): `Step.init` took any
    uint32 array and a batch of keys, which the Trainer's fit refused or took differently."""
    model = el.nn.mlp([2, 1], key=getkey())
    step = el.train.make_step(el.train.mse, optax.sgd(0.1))
    trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.1), progress=False)
    x = np.ones((4, 2), np.float32)
    for call in (lambda: step.init(model, key=key),
                 lambda: trainer.fit(x, x[:, :1], epochs=1, micro_batch=2, key=key)):  # fmt: skip
        with pytest.raises(TypeError, match=said):
            call()
    assert trainer.state is None  # refused before any work
    for good in (jr.PRNGKey(0), jr.key(0)):
        step.init(model, key=good)


class _IntegerModel(eqx.Module):
    """A model whose only array is integer: a step differentiates nothing in it."""

    w: jax.Array

    def __call__(self, x, *, key=None):
        return x @ self.w.astype(x.dtype)


def test_a_model_with_nothing_to_train_and_an_uncalled_hook_factory_are_refused():
    model = _IntegerModel(jnp.ones((2, 1), jnp.int32))
    x = np.ones((4, 2), np.float32)
    trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.1), progress=False)
    said = r"no floating-point arrays to train \(found 1: int32\[2, 1\]\)"
    with pytest.raises(ValueError, match=said):
        trainer.fit(x, x[:, :1], epochs=2, micro_batch=2, key=jr.PRNGKey(0))
    with pytest.raises(ValueError, match="found no arrays at all"):
        el.train.make_step(el.train.mse, optax.sgd(0.1)).init(lambda x: x, key=jr.PRNGKey(0))
    # el.sparse.dsr makes a hook: passed uncalled, it is named at once, not at the first step.
    said = r"after_update=dsr takes \(\*, period.*after_update=dsr\(\.\.\.\)"
    with pytest.raises(TypeError, match=said):
        el.train.make_step(el.train.mse, optax.sgd(0.1), after_update=el.sparse.dsr)
    with pytest.raises(TypeError, match=said):
        el.train.Trainer(el.nn.mlp([2, 1], key=jr.PRNGKey(0)), el.train.mse, optax.sgd(0.1),
                         after_update=el.sparse.dsr)  # fmt: skip
    el.train.make_step(el.train.mse, optax.sgd(0.1), after_update=el.sparse.dsr())


def test_bad_models_and_keys_are_refused_before_work(getkey):
    step = el.train.make_step(el.train.mse, optax.sgd(0.1))
    model = el.nn.mlp([2, 1], key=getkey())
    stringy = eqx.tree_at(lambda m: m.layers[0].bias, model, np.array(["a"]))
    with pytest.raises(TypeError, match=r"layers\[0\]\.bias.*<U1"):
        step.init(stringy, key=getkey())
    with pytest.raises(TypeError, match="key must be a JAX PRNG key"):
        step.init(model, key=0)

    def no_key(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2, axis=(1, 2))

    enc = el.nn.transformer_encoder(1, 8, 2, 16, key=getkey(), dropout=0.1)
    with pytest.raises(ValueError, match="dropout.*takes no `key`"):
        el.train.make_step(no_key, optax.sgd(0.1)).init(enc, key=getkey())


def test_mixed_bf16_casts_one_block_at_a_time_and_peaks_below_float32():
    """Under full remat and accumulation, a bf16 copy of every parameter kept for the whole
    step made mixed_bf16 peak above float32; cast just in time inside the scanned blocks,
    only one block's copy is alive (compile only)."""

    def loss(model, x, *, key=None):
        return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2, axis=(1, 2))

    enc = eqx.filter_eval_shape(  # shapes only: compiling needs no weights
        lambda k: el.nn.transformer_encoder(4, 256, 4, 1024, key=k, remat=True), jr.PRNGKey(0)
    )
    batch = (jax.ShapeDtypeStruct((16, 32, 256), jnp.float32),)
    peak = {}
    for precision in ("float32", "mixed_bf16"):
        step = el.train.make_step(loss, optax.sgd(0.1), accumulate=4, precision=precision)
        state = eqx.filter_eval_shape(step.init, enc, key=jr.PRNGKey(1))
        m = compile_as_users(step.lower(state, batch)).memory_analysis()
        peak[precision] = (
            m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )  # fmt: skip
    assert peak["mixed_bf16"] < peak["float32"], peak
