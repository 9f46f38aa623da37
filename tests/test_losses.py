"""Built-in losses check shapes; `check_batch` reports bad data as bad data."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.experimental import checkify

import eqx_lowmem as el
from eqx_lowmem.train import cross_entropy, mse, next_token_loss
from eqx_lowmem.train._losses import check_batch


def test_mse_refuses_targets_that_would_broadcast():
    model = eqx.nn.Linear(3, 1, key=jr.PRNGKey(0))
    x = jnp.ones((16, 3))
    with pytest.raises(ValueError, match=r"outputs have shape \(16, 1\) but y has shape \(16,\)"):
        mse(model, x, jnp.ones(16))
    assert mse(model, x, jnp.ones((16, 1))).shape == (16,)
    scalar = eqx.nn.Linear(3, "scalar", key=jr.PRNGKey(0))
    assert mse(scalar, x, jnp.ones(16)).shape == (16,)


def test_cross_entropy_and_next_token_shapes():
    model = eqx.nn.Linear(3, 5, key=jr.PRNGKey(0))
    x = jnp.ones((4, 3))
    assert cross_entropy(model, x, jnp.arange(4)).shape == (4,)
    with pytest.raises(ValueError, match=r"labels of shape \(batch,\)"):
        cross_entropy(model, x, jnp.zeros((4, 1), jnp.int32))
    with pytest.raises(ValueError, match="integer class ids"):
        cross_entropy(model, x, jnp.zeros(4))
    lm = el.nn.CausalLM(11, 8, 1, 8, 2, 16, key=jr.PRNGKey(0))
    tokens = jnp.zeros((2, 6), jnp.int32)
    shapes = functools.partial(eqx.filter_eval_shape, next_token_loss, lm)  # no compute
    values, weights = shapes(tokens)
    assert values.shape == weights.shape == (2, 5)
    with pytest.raises(ValueError, match=r"\(batch, seq\) integer ids"):
        shapes(jnp.zeros((2, 6)))
    with pytest.raises(ValueError, match="mask has shape"):
        shapes(tokens, jnp.ones((2, 5)))


def test_check_batch_reports_labels_outside_the_classes_as_bad_data():
    model = eqx.nn.MLP(3, 4, 8, 1, key=jr.PRNGKey(0))
    x = np.zeros((6, 3), np.float32)
    check_batch(cross_entropy, model, (x, np.array([0, 1, 2, 3, 0, 1])))
    for labels, shown in ((np.array([0, 1, 4, 3, 0, 1]), "0 to 4"), (np.array([0, -1]), "-1 to 0")):
        with pytest.raises(ValueError, match="bad data") as info:
            check_batch(cross_entropy, model, (x[: labels.size], labels))
        message = str(info.value)
        assert "batch[1]" in message and shown in message and "[0, 4)" in message
        assert "learning rate fixes" in message  # it says that lowering it does not help
    # Through functools.partial too.
    with pytest.raises(ValueError, match="bad data"):
        check_batch(functools.partial(cross_entropy), model, (x[:1], np.array([7])))


def test_check_batch_asks_each_model_its_classes_and_keeps_none_alive():
    # The output size is remembered for the last model asked (a loop asks every batch):
    # another model with the same sample shape gets its own answer, and the one remembered
    # is held weakly.
    import weakref

    x, labels = np.zeros((2, 3), np.float32), np.array([0, 4])
    wide = eqx.nn.MLP(3, 5, 8, 1, key=jr.PRNGKey(0))
    narrow = eqx.nn.MLP(3, 4, 8, 1, key=jr.PRNGKey(0))
    check_batch(cross_entropy, wide, (x, labels))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        check_batch(cross_entropy, narrow, (x, labels))
    check_batch(cross_entropy, wide, (x, labels))
    held = weakref.ref(wide)
    del wide
    assert held() is None


def test_check_batch_token_ids_of_a_language_model():
    lm = el.nn.CausalLM(11, 8, 1, 8, 2, 16, key=jr.PRNGKey(0))
    tokens = np.zeros((2, 6), np.int32)
    check_batch(next_token_loss, lm, (tokens,))
    tokens[1, 5] = 11  # a target >= vocab: NaN in the step
    with pytest.raises(ValueError, match=r"token ids from 0 to 11.*\[0, 11\).*index \(1, 5\)"):
        check_batch(next_token_loss, lm, (tokens,))
    tokens[1, 5] = -1  # wrapped silently
    with pytest.raises(ValueError, match="bad data"):
        check_batch(next_token_loss, lm, (tokens,))


def test_check_batch_finds_non_finite_data_for_any_loss():
    def own_loss(model, x, y):
        return jnp.sum(x, axis=1)

    x = np.ones((4, 3), np.float32)
    check_batch(own_loss, None, (x, np.arange(4)))
    bits = x.view(np.uint32)
    bits[2, 1] |= 0x7F800000  # every exponent bit set: inf
    with pytest.raises(ValueError, match=r"batch\[0\] holds 1 non-finite .*index \(2, 1\).*bad"):
        check_batch(own_loss, None, (x, np.arange(4)))
    half = jnp.asarray([1.0, jnp.nan], jnp.bfloat16)
    with pytest.raises(ValueError, match=r"batch\[1\] holds 1 non-finite"):
        check_batch(own_loss, None, (np.ones((2, 1)), half))
    # A user's loss gets no label check: integers are its business.
    check_batch(own_loss, None, (np.ones((2, 1), np.float32), np.array([-5, 100])))


def test_check_batch_follows_the_model_it_is_given():
    # The class count is cached by the model's shapes: another head is another count.
    x = np.zeros((2, 3), np.float32)
    labels = np.array([0, 5])
    wide = eqx.nn.MLP(3, 6, 8, 1, key=jr.PRNGKey(0))
    narrow = eqx.nn.MLP(3, 4, 8, 1, key=jr.PRNGKey(0))
    for _ in range(2):
        check_batch(cross_entropy, wide, (x, labels))
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            check_batch(cross_entropy, narrow, (x, labels))


def test_out_of_range_ids_outside_the_trainer_are_refused_or_nan_never_clamped():
    lm = el.nn.CausalLM(16, 8, 1, 8, 2, 16, key=jr.PRNGKey(0))
    good = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    # Called directly (values known): refused, naming the ids and the vocabulary.
    for bad, one, both in ((40, "1 to 40", "1 to 40"), (-1, "-1 to 4", "-1 to 8")):
        tokens = good.at[0, 2].set(bad)
        said = rf"CausalLM: tokens holds token ids from {one}, but vocab_size=16.*index \(2,\)"
        with pytest.raises(ValueError, match=said):
            lm(tokens[0])
        said = rf"next_token_loss: tokens holds token ids from {both}.*\[0, 16\); 1 are outside"
        with pytest.raises(ValueError, match=said + r" \(first at index \(0, 2\)"):
            next_token_loss(lm, tokens)
    linear = eqx.nn.Linear(3, 5, key=jr.PRNGKey(0))
    with pytest.raises(ValueError, match=r"cross_entropy: labels holds labels from -1 to 2"):
        cross_entropy(linear, jnp.ones((2, 3)), jnp.array([2, -1]))
    # Traced (inside jit or vmap): NaN where the id is out of range (its sequence's
    # attention spreads it), not the clamped last id (40 in 16 read id 15's row) or the
    # wrapped -1; the other sequence is unchanged.
    for bad in (40, -1):
        tokens = good.at[0, 2].set(bad)
        logits = jax.vmap(lm)(tokens)
        assert bool(jnp.isnan(logits[0, 2]).all())
        assert jnp.array_equal(logits[1], jax.vmap(lm)(good)[1])
        nll, weights = jax.jit(next_token_loss)(lm, tokens)
        assert bool(jnp.isnan(nll[0, 1])) and bool(jnp.isfinite(nll[1]).all())
        # A masked target never matters, whatever its id (padding at the end).
        last = good.at[0, 3].set(bad)
        mask = jnp.ones_like(last).at[0, 3].set(0)
        nll, weights = jax.jit(next_token_loss)(lm, last, mask)
        assert bool(jnp.isfinite(nll).all()) and float(weights[0, 2]) == 0.0
        assert bool(jnp.isnan(jax.jit(next_token_loss)(lm, last)[0][0, 2]))
        ce = jax.jit(cross_entropy)(linear, jnp.ones((2, 3)), jnp.array([2, bad]))
        assert bool(jnp.isnan(ce[1])) and bool(jnp.isfinite(ce[0]))
    # checkify's index checks name it inside jit.
    err, _ = jax.jit(checkify.checkify(jax.vmap(lm), errors=checkify.index_checks))(
        good.at[1, 3].set(-1)
    )
    assert "index -1 is out of bounds" in str(err.get())
