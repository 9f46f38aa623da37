"""The Trainer's hooks: each update's metrics under its own number (also with a loss scale,
where the Trainer reads an update's metrics while the next one runs), a user's own hooks
(recording, early stopping) with no library change, and the default hooks its keyword
arguments build."""

import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqx_lowmem as el


def _data():
    x = jr.normal(jr.PRNGKey(2), (64, 2))
    return x, jnp.sum(x, axis=1, keepdims=True) + 0.5


@pytest.mark.parametrize("precision", ["float32", "mixed_fp16"])
def test_the_callback_numbers_every_update_as_its_own(precision):
    # 64 samples, micro-batches of 16: 4 updates. With "mixed_fp16" (a loss scale) the
    # Trainer reads update n's metrics after dispatching update n + 1: the numbers must
    # still be n's, and the loss reported must be the one the step returned for n.
    X, y = _data()
    seen = []
    trainer = el.train.Trainer(
        el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)), el.train.mse, optax.sgd(0.05),
        precision=precision, progress=False,
        callback=lambda t, m: seen.append((m["updates"], m["update"], m["loss"])),
    )  # fmt: skip
    trainer.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1), shuffle=False)
    assert [(u, k) for u, k, _ in seen] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    # Each update's loss is that of the model before it, on its own batch.
    step = el.train.make_step(el.train.mse, optax.sgd(0.05), precision=precision)
    state = step.init(el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)), key=jr.PRNGKey(0))
    for n in range(4):
        batch = (X[16 * n : 16 * (n + 1)], y[16 * n : 16 * (n + 1)])
        state, metrics = step(state, batch)
        assert seen[n][2] == pytest.approx(float(metrics["loss"]), rel=1e-5)
