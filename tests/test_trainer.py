"""The Trainer: the guide's examples, streams, evaluation, bad input, non-finite losses."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el

from .helpers import tree_allclose


def _guide_data():
    x = jr.normal(jr.PRNGKey(2), (64, 2))
    return x, jnp.sum(x, axis=1, keepdims=True) + 0.5


def test_guide_example_accumulation_equals_the_large_batch():
    # mlp([2, 4, 1]), MSE, SGD(0.05), 64 samples, 5 epochs without shuffling.
    X, y = _guide_data()
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    runs = {}
    for batch_size, accumulate in ((32, 1), (8, 4)):
        trainer = el.train.Trainer(
            model, el.train.mse, optax.sgd(0.05), accumulate=accumulate, progress=False
        )
        history = trainer.fit(
            X, y, epochs=5, micro_batch=batch_size, key=jr.PRNGKey(1), shuffle=False
        )
        runs[accumulate] = (history["train_loss"], trainer.model)
    (loss1, model1), (loss4, model4) = runs[1], runs[4]
    assert len(loss1) == 5 and loss1[-1] < loss1[0]
    assert tree_allclose(jnp.asarray(loss1), jnp.asarray(loss4), rtol=1e-5)
    assert tree_allclose(model1, model4, rtol=1e-5, atol=1e-7)


def test_train_loss_is_the_mean_over_samples_with_a_short_last_update():
    # 10 samples, micro-batches of 2, accumulate 2: updates of 4, 4 and 2 samples. With
    # lr 0 nothing changes, so the epoch's loss is the plain mean over the 10 samples.
    X, y = _guide_data()
    X, y = X[:10], y[:10]
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.0), accumulate=2, progress=False)
    history = trainer.fit(X, y, epochs=1, micro_batch=2, key=jr.PRNGKey(1))
    expected = jnp.mean(el.train.mse(model, X, y))
    assert abs(history["train_loss"][0] - float(expected)) < 1e-6 * abs(float(expected))


def test_fit_from_a_stream_of_npy_files(tmp_path):
    # The guide's second example: two .npy files, batches of 8, three epochs.
    X, y = _guide_data()
    np.save(tmp_path / "x.npy", np.asarray(X))
    np.save(tmp_path / "y.npy", np.asarray(y))
    stream = el.data.DataStream(
        (str(tmp_path / "x.npy"), str(tmp_path / "y.npy")), 8, shuffle_buffer=16, key=0
    )
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.05), progress=False)
    history = trainer.fit(epochs=3, key=jr.PRNGKey(1), stream=stream, eval_data=(X, y))
    assert len(history["train_loss"]) == 3 and len(history["eval_loss"]) == 3
    assert history["train_loss"][2] < history["train_loss"][0]
    assert int(trainer.state.step) == 3 * 8
    # eval_loss is the trained model's loss over every sample.
    expected = float(jnp.mean(el.train.mse(trainer.model, X, y)))
    assert abs(history["eval_loss"][-1] - expected) < 1e-5 * expected


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda t, X, y: t.fit(X, y[:-1], epochs=1, micro_batch=8, key=jr.PRNGKey(0)),
            "same number of samples",
        ),
        (
            lambda t, X, y: t.fit(X, y, epochs=1, micro_batch=0, key=jr.PRNGKey(0)),
            "micro_batch must be",
        ),
        (
            lambda t, X, y: t.fit(
                X, y, epochs=1, key=jr.PRNGKey(0), stream=el.data.DataStream((np.asarray(X),), 8)
            ),
            "either arrays or a stream",
        ),
        (
            lambda t, X, y: t.fit(
                epochs=1,
                micro_batch=4,
                key=jr.PRNGKey(0),
                stream=el.data.DataStream((np.asarray(X),), 8),
            ),
            "micro_batch=4 but the stream",
        ),
        (
            lambda t, X, y: t.fit(X[:, :1], y, epochs=1, micro_batch=8, key=jr.PRNGKey(0)),
            "cannot be applied",
        ),
        (
            lambda t, X, y: t.fit(X, y, epochs=-1, micro_batch=8, key=jr.PRNGKey(0)),
            "epochs must be",
        ),
    ],
)
def test_bad_input_fails_before_any_work(tmp_path, call, match):
    X, y = _guide_data()
    trainer = el.train.Trainer(
        el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)),
        el.train.mse,
        optax.sgd(0.05),
        checkpoint_dir=tmp_path,
        progress=False,
    )
    with pytest.raises(ValueError, match=match):
        call(trainer, X, y)
    assert not (tmp_path / "checkpoint.ckpt").exists()
    assert trainer.state is None or int(trainer.state.step) == 0


def test_accumulate_must_be_positive():
    with pytest.raises(ValueError, match="accumulate=0"):
        el.train.Trainer(
            el.nn.mlp([2, 1], key=jr.PRNGKey(0)), el.train.mse, optax.sgd(0.1), accumulate=0
        )


def test_nonfinite_loss_stops_before_the_update_and_the_checkpoint(tmp_path):
    X, y = _guide_data()
    y = y.at[40].set(jnp.inf)  # the third update of the first epoch (batches of 16)
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    seen = []
    trainer = el.train.Trainer(
        model,
        el.train.mse,
        optax.sgd(0.05),
        checkpoint_dir=tmp_path,
        checkpoint_every=1,
        progress=False,
        callback=lambda t, m: seen.append(m["update"]),
    )
    with pytest.raises(FloatingPointError, match="update 3 of epoch 1"):
        trainer.fit(X, y, epochs=2, micro_batch=16, key=jr.PRNGKey(1), shuffle=False)
    meta = el.train.read_meta(tmp_path / "checkpoint.ckpt")
    assert seen == [1, 2] and meta["partial"]["updates"] == 2
    # The checkpoint holds the state after update 2, and the bad update was skipped.
    ckpt_state, _ = el.train.load_checkpoint(tmp_path / "checkpoint.ckpt", trainer.state)
    assert int(ckpt_state.step) == 2
    assert all(
        bool(jnp.all(jnp.isfinite(a)))
        for a in jax.tree.leaves(eqx.filter(trainer.model, eqx.is_array))
    )


def test_resume_continues_exactly(tmp_path):
    X, y = _guide_data()
    model = el.nn.mlp([2, 8, 1], key=jr.PRNGKey(0))

    def trainer(directory):
        return el.train.Trainer(
            model,
            el.train.mse,
            optax.adam(0.01),
            accumulate=2,
            checkpoint_dir=directory,
            checkpoint_every=3,
            progress=False,
        )

    full = trainer(tmp_path / "full")
    full_history = full.fit(X, y, epochs=4, micro_batch=4, key=jr.PRNGKey(1))
    first = trainer(tmp_path / "split")
    first.fit(X, y, epochs=2, micro_batch=4, key=jr.PRNGKey(1))
    resumed = trainer(tmp_path / "split")
    history = resumed.fit(X, y, epochs=4, micro_batch=4, key=jr.PRNGKey(1))
    assert history == full_history
    assert tree_allclose(resumed.model, full.model, rtol=0, atol=0)
    assert int(resumed.state.step) == int(full.state.step)
