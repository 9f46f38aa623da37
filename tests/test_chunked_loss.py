"""The chunked LM loss (`chunked_cross_entropy`, `next_token_loss`'s default for a model
with `hidden_states` and `head_weights`): the naive loss's numbers without its logits."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_lowmem as el
from eqx_lowmem.train import chunked_cross_entropy, next_token_loss

from .helpers import compile_as_users, tree_allclose


def _mean_loss(model, tokens, mask, chunk):
    values, weights = next_token_loss(model, tokens, mask, chunk=chunk)
    return jnp.sum(values * weights) / jnp.sum(weights)


_grad = eqx.filter_jit(eqx.filter_value_and_grad(_mean_loss), donate="none")


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_the_naive_loss_and_gradients(tied):
    lm = el.nn.CausalLM(37, 12, 1, 16, 2, 32, key=jr.key(0), tie_embeddings=tied)
    tokens = jr.randint(jr.key(1), (3, 12), 0, 37)
    mask = (jr.uniform(jr.key(2), (3, 12)) > 0.3).astype(jnp.int32)
    want, want_grad = _grad(lm, tokens, mask, None)
    for chunk in (1, 8, 16, 37):  # 8 and 16 do not divide 37
        got, grad = _grad(lm, tokens, mask, chunk)
        assert abs(float(got - want)) <= 1e-5, chunk
        assert tree_allclose(grad, want_grad, rtol=1e-4, atol=1e-4), chunk
    # Per token, masked positions zero on both paths.
    values, weights = next_token_loss(lm, tokens, mask, chunk=8)
    naive, _ = next_token_loss(lm, tokens, mask, chunk=None)
    np.testing.assert_allclose(values, naive, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(values * (1 - weights)).max()) == 0.0


def test_chunked_cross_entropy_with_a_bias_large_logits_and_16_bit_compute():
    h = 30.0 * jr.normal(jr.key(0), (10, 8))  # logits in the hundreds: a naive exp overflows
    w, b = jr.normal(jr.key(1), (13, 8)), jr.normal(jr.key(2), (13,))
    t = jr.randint(jr.key(3), (10,), 0, 13)

    def naive(h, w, b):
        logp = jax.nn.log_softmax(h @ w.T + b[None, :], axis=-1)
        return -jnp.take_along_axis(logp, t[:, None], axis=1)[:, 0]

    def summed(fn, *args):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * jnp.arange(10.0)), argnums=(0, 1, 2))(*args)

    chunked = functools.partial(chunked_cross_entropy, targets=t, chunk=5)
    ours = lambda h, w, b: chunked(h, w, head_bias=b)  # noqa: E731
    np.testing.assert_allclose(ours(h, w, b), naive(h, w, b), rtol=1e-5, atol=1e-5)
    for g, want in zip(summed(ours, h, w, b), summed(naive, h, w, b), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)
    # 16-bit matmuls, float32 log-sum-exp: float32 losses, gradients in the inputs' dtypes.
    h16, w16 = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    loss16 = ours(h16, w16, b)
    assert loss16.dtype == jnp.float32 and bool(jnp.isfinite(loss16).all())
    want16 = naive(h16.astype(jnp.float32), w16.astype(jnp.float32), b)
    np.testing.assert_allclose(loss16, want16, rtol=2e-2, atol=2e-2)  # bf16 matmul inputs
    dh, dw, db = summed(ours, h16, w16, b)
    assert (dh.dtype, dw.dtype, db.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)


def test_ids_outside_the_vocabulary_are_refused_or_nan_on_the_chunked_path():
    lm = el.nn.CausalLM(16, 8, 1, 8, 2, 16, key=jr.key(0))
    loss = functools.partial(next_token_loss, chunk=5)
    good = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    for bad in (40, -1):
        tokens = good.at[0, 2].set(bad)
        with pytest.raises(ValueError, match=r"next_token_loss: tokens holds token ids.*\[0, 16\)"):
            loss(lm, tokens)
        # Traced: NaN where the target is out of range, never a clamped or wrapped id.
        last = good.at[0, 3].set(bad)
        nll, _ = jax.jit(loss)(lm, last)
        assert bool(jnp.isnan(nll[0, 2])) and bool(jnp.isfinite(nll[1]).all())
        # Masked, it never matters: finite loss and finite gradients.
        mask = jnp.ones_like(last).at[0, 3].set(0)
        value, grad = _grad(lm, last, mask, 5)
        assert bool(jnp.isfinite(value))
        assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grad))
        assert float(value) == pytest.approx(float(_grad(lm, last, mask, None)[0]), abs=1e-5)


class OwnLM(eqx.Module):
    """A user's model: an embedding and a tied head, exposing what the loss needs."""

    embed: jax.Array

    def __call__(self, tokens, *, key=None):
        return self.hidden_states(tokens) @ self.embed.T

    def hidden_states(self, tokens, *, key=None):
        return jnp.tanh(jnp.cumsum(self.embed[tokens], axis=0))

    def head_weights(self):
        return self.embed, None


def test_a_users_model_with_hidden_states_and_head_weights_gets_the_chunked_path():
    model = OwnLM(jr.normal(jr.key(0), (30, 6)))
    tokens = jr.randint(jr.key(1), (2, 9), 0, 30)
    mask = jnp.ones_like(tokens)
    want, want_grad = _grad(model, tokens, mask, None)
    got, grad = _grad(model, tokens, mask, 7)
    assert abs(float(got - want)) <= 1e-5 and tree_allclose(grad, want_grad, atol=1e-4)


def test_bad_chunks_are_refused_naming_the_argument():
    lm = el.nn.CausalLM(16, 8, 1, 8, 2, 16, key=jr.key(0))
    tokens = jnp.zeros((2, 5), jnp.int32)
    for chunk in (0, -3, 17, True):  # (a float or other string: beartype refuses it first)
        said = (
            rf"chunk must be a positive int no larger than the vocabulary \(16\), got .*{chunk!r}"
        )
        with pytest.raises(ValueError, match=said.replace("'", ".")):
            next_token_loss(lm, tokens, chunk=chunk)
    with pytest.raises(ValueError, match=r"chunk must be .*\(13\), got int 0"):
        chunked_cross_entropy(jnp.ones((2, 4)), jnp.ones((13, 4)), jnp.zeros(2, jnp.int32), chunk=0)
    linear = eqx.nn.Linear(3, 5, key=jr.key(0))
    with pytest.raises(ValueError, match=r"chunk=4 needs a model with hidden_states.*Linear"):
        next_token_loss(linear, tokens, chunk=4)


def _temp_bytes(model, tokens, chunk) -> int:
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params):
        return _mean_loss(eqx.combine(params, static), tokens, None, chunk)

    compiled = compile_as_users(jax.jit(jax.value_and_grad(loss)).lower(params))
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_chunked_loss_and_gradient_hold_a_tenth_of_the_naive_temporaries():
    # Compile only (no compute): a 32,000-token vocabulary over 4 x 64 tokens.
    lm = el.nn.CausalLM(32_000, 65, 1, 32, 2, 64, key=jr.key(0), tie_embeddings=True)
    tokens = jnp.zeros((4, 65), jnp.int32)
    naive = _temp_bytes(lm, tokens, None)
    auto = _temp_bytes(lm, tokens, "auto")  # vocab > 2,048 and CausalLM: the chunked path
    assert naive >= 10 * auto, (naive, auto)
    # At or below one default chunk of vocabulary, "auto" keeps the plain path.
    small = el.nn.CausalLM(2048, 65, 1, 32, 2, 64, key=jr.key(0), tie_embeddings=True)
    assert _temp_bytes(small, tokens, "auto") == _temp_bytes(small, tokens, None)


def test_the_heads_gradient_is_summed_in_place_not_formed_whole_each_step():
    # The forward pass writes each vocabulary chunk's rows of the head's gradient into one
    # buffer: no second head-sized (vocab, d) buffer beside it.
    n, d, v = 256, 256, 4096
    args = (jnp.ones((n, d)), jnp.ones((v, d)), jnp.zeros((n,), jnp.int32))

    def mean(h, w, t):
        return jnp.mean(chunked_cross_entropy(h, w, t, chunk=256))

    grad = jax.jit(jax.value_and_grad(mean, argnums=(0, 1)))
    temp = compile_as_users(grad.lower(*args)).memory_analysis().temp_size_in_bytes
    assert temp < v * d * 4 // 2, temp  # the head is v * d * 4 bytes


@pytest.mark.parametrize("bias", [False, True])
def test_a_step_of_the_loss_and_gradient_holds_its_logits_once(bias):
    # The softmax's gradient is written over the step's logits: nothing reads them after
    # it (the target's logit comes from its own row). Reading the target's logit from the
    # logits kept them beside the gradient: 2.3 steps of logits, against 1.6.
    n, d, v, chunk = 128, 32, 2048, 256  # 8 vocabulary chunks: 16 tokens a step
    args = (jnp.ones((n, d)), jnp.ones((v, d)), jnp.zeros((n,), jnp.int32))
    b = jnp.zeros((v,)) if bias else None

    def mean(h, w, t):
        return jnp.mean(chunked_cross_entropy(h, w, t, head_bias=b, chunk=chunk))

    grad = jax.jit(jax.value_and_grad(mean, argnums=(0, 1)))
    temp = compile_as_users(grad.lower(*args)).memory_analysis().temp_size_in_bytes
    assert temp < 2 * n * chunk * 4, temp  # a step's logits: n * chunk float32


def test_both_ways_give_the_losses_and_gradients_of_the_whole_logits():
    # By vocabulary chunks (off a GPU) and by token steps (a GPU's way: run here directly),
    # with a chunk that does not divide the vocabulary (the last one overlaps): the losses,
    # the log-sum-exps and d(sum(weights * loss)) of the whole logits.
    from eqx_lowmem.train._chunked import _token_steps, _vocab_pass

    k = jr.split(jr.key(3), 5)
    h, w, b = jr.normal(k[0], (12, 8)), jr.normal(k[1], (13, 8)), jr.normal(k[2], (13,))
    t = jr.randint(k[3], (12,), 0, 13)
    weights = (jr.uniform(k[4], (12,)) > 0.3).astype(jnp.float32)
    logits = h @ w.T + b[None, :]

    def naive(h, w, b):
        logp = jax.nn.log_softmax(h @ w.T + b[None, :], axis=-1)
        return -jnp.take_along_axis(logp, t[:, None], axis=1)[:, 0]

    nll, vjp = jax.vjp(naive, h, w, b)
    for way in (_vocab_pass, _token_steps):
        got, lse, *grads = jax.jit(way, static_argnames="chunk")(h, w, b, t, weights, chunk=5)
        np.testing.assert_allclose(got, nll, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, axis=1), rtol=1e-5, atol=1e-5)
        for g, want in zip(grads, vjp(weights), strict=True):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def test_the_step_trains_the_same_with_the_chunked_loss_fused_and_accumulated():
    import optax

    model = el.nn.CausalLM(50, 12, 2, 16, 2, 32, key=jr.key(0), remat=True, tie_embeddings=True)
    tokens = jr.randint(jr.key(1), (8, 13), 0, 50)
    models = []
    for chunk in (None, 16):  # fused accumulation runs through hidden_states as well
        # (SGD: Adam would turn rounding-level gradient differences into whole steps)
        loss = functools.partial(next_token_loss, chunk=chunk)
        step = el.train.make_step(loss, optax.sgd(0.5), accumulate=4)
        state = step.init(model, key=jr.key(2))
        for _ in range(2):
            state, _ = step(state, (tokens,))
        models.append(eqx.filter(state.model, eqx.is_inexact_array))
    assert tree_allclose(models[0], models[1], rtol=1e-4, atol=1e-4)


def test_a_weighted_mean_takes_the_gradients_of_the_forward_pass_scaled():
    """Differentiated, the forward pass computes the gradients for a cotangent equal to
    `weights`; the backward pass scales them (no recomputed logits) when its cotangent is
    `weights` times one number, and recomputes them for any other (above: exact)."""
    from eqx_lowmem.train._chunked import _chunked_ce_bwd, _chunked_ce_fwd

    h, w = jr.normal(jr.key(0), (12, 8)), jr.normal(jr.key(1), (13, 8))
    t = jr.randint(jr.key(2), (12,), 0, 13)
    weights = (jr.uniform(jr.key(3), (12,)) > 0.3).astype(jnp.float32)
    _, res = _chunked_ce_fwd(h, w, None, t, weights, 5)
    kept_dh, kept_dw = res[6], res[7]
    dh, dw, _, _, _ = _chunked_ce_bwd(5, res, 0.25 * weights)
    assert bool(jnp.all(dh == 0.25 * kept_dh)) and bool(jnp.all(dw == 0.25 * kept_dw))
    # Another cotangent: recomputed, not the kept gradients scaled, and still exact.
    other = weights * jnp.arange(12.0)
    dh2, dw2, _, _, _ = _chunked_ce_bwd(5, res, other)

    def naive(h, w):
        logp = jax.nn.log_softmax(h @ w.T, axis=-1)
        return -jnp.take_along_axis(logp, t[:, None], axis=1)[:, 0]

    want_dh, want_dw = jax.vjp(naive, h, w)[1](other)
    np.testing.assert_allclose(dh2, want_dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw2, want_dw, rtol=1e-5, atol=1e-5)
    # The kept gradients are those of sum(weights * loss).
    want_dh, want_dw = jax.vjp(naive, h, w)[1](weights)
    np.testing.assert_allclose(kept_dh, want_dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kept_dw, want_dw, rtol=1e-5, atol=1e-5)


def test_the_backward_pass_recomputes_the_heads_gradient_in_the_heads_dtype():
    # A float32 head-sized buffer there raised 16-bit models' compiled peak on the H100
    # target (the paper's transformer combination: 347.7 -> 360.6 MB). The forward pass
    # off a GPU asks for float32, the dtype of the GPU's residuals.
    from eqx_lowmem.train._chunked import _recomputed

    k = jr.split(jr.key(5), 3)
    h, w = jr.normal(k[0], (6, 4), jnp.float16), jr.normal(k[1], (10, 4), jnp.float16)
    b, t = jnp.zeros((10,), jnp.float16), jr.randint(k[2], (6,), 0, 10)
    lse = jax.nn.logsumexp(h.astype(jnp.float32) @ w.astype(jnp.float32).T, axis=1)
    own = _recomputed(h, w, b, t, lse, jnp.ones(6), 3)
    wide = _recomputed(h, w, b, t, lse, jnp.ones(6), 3, float32=True)
    assert [x.dtype for x in own] == [jnp.float32, jnp.float16, jnp.float16]
    assert [x.dtype for x in wide] == [jnp.float32] * 3
    for a, b32 in zip(own[1:], wide[1:], strict=True):  # the same sums, rounded once
        np.testing.assert_array_equal(a, b32.astype(jnp.float16))
