"""The Trainer: the guide's examples, streams, evaluation, bad input, non-finite losses."""

import json
import re
import threading
from pathlib import Path

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
    with pytest.raises(ValueError, match="accumulate must be an int >= 1 .*got 0"):
        el.train.Trainer(
            el.nn.mlp([2, 1], key=jr.PRNGKey(0)), el.train.mse, optax.sgd(0.1), accumulate=0
        )


def test_nonfinite_loss_stops_before_the_next_update_and_the_checkpoint(tmp_path):
    X, y = _guide_data()
    # The third update of the first epoch (batches of 16): finite data (the data check passes)
    # whose squared error overflows float32.
    y = y.at[40].set(1e30)
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
    with pytest.raises(FloatingPointError, match="update 3 of epoch 1") as e:
        trainer.fit(X, y, epochs=2, micro_batch=16, key=jr.PRNGKey(1), shuffle=False)
    meta = el.train.read_meta(tmp_path / "checkpoint.ckpt")
    assert seen == [1, 2] and meta["partial"]["updates"] == 2
    # The default step applied the bad update (as a hand-written step does): the error
    # says so and names the checkpoint of update 2, the last good state; no update after.
    assert "that update was applied" in str(e.value)
    assert f"checkpoint of update 2 in {tmp_path}" in str(e.value)
    ckpt_state, _ = el.train.load_checkpoint(tmp_path / "checkpoint.ckpt", trainer.state)
    assert int(ckpt_state.step) == 2 and int(trainer.state.step) == 3


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


def _trainer(**kwargs):
    kwargs.setdefault("progress", False)
    model = kwargs.pop("model", None) or el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    optimizer = kwargs.pop("optimizer", None) or optax.sgd(0.05)
    return el.train.Trainer(model, kwargs.pop("loss", el.train.mse), optimizer, **kwargs)


def test_a_model_read_before_a_second_fit_stays_usable():
    X, y = _guide_data()
    trainer = _trainer()
    fit = dict(epochs=1, micro_batch=8, key=jr.PRNGKey(1), shuffle=False)
    trainer.fit(X, y, **fit)
    kept = trainer.model
    before = jax.vmap(kept)(X)
    trainer.fit(X, y, **fit)
    # The steps of the second fit trained a copy; the model read is intact (its buffers
    # were donated before: "Array has been deleted").
    np.testing.assert_array_equal(jax.vmap(kept)(X), before)
    internal = trainer.state.model  # not handed out by `model`: donated by the next fit
    assert not np.array_equal(jax.vmap(internal)(X), before)  # the copy trained on
    trainer.fit(X, y, **fit)
    # A deleted model handed back to the library is named as such.
    with pytest.raises(ValueError, match=r"was deleted: a training step donated.*jnp.copy"):
        el.train.make_step(el.train.mse, optax.sgd(0.1)).init(internal, key=jr.PRNGKey(0))


def test_a_second_fit_over_the_same_stream_trains_its_epochs_more():
    # A stream keeps its epoch between fits: `epochs` counts from where it stands (as
    # for arrays), not from the stream's first epoch, which trained nothing.
    X, y = _guide_data()
    trainer = _trainer()
    stream = el.data.DataStream((np.asarray(X), np.asarray(y)), 16)
    histories = [trainer.fit(epochs=n, key=jr.PRNGKey(1), stream=stream) for n in (1, 2)]
    assert trainer.updates == 3 * 4 and stream.epoch == 3
    assert [len(h["train_loss"]) for h in histories] == [1, 2]


def test_the_model_is_held_once_and_a_second_fit_continues():
    X, y = _guide_data()
    once = _trainer()
    once.fit(X, y, epochs=4, micro_batch=8, key=jr.PRNGKey(1), shuffle=False)
    twice = _trainer()
    first = twice.fit(X, y, epochs=2, micro_batch=8, key=jr.PRNGKey(1), shuffle=False)
    assert twice.model is twice.state.model and twice._model is None
    second = twice.fit(X, y, epochs=2, micro_batch=8, key=jr.PRNGKey(1), shuffle=False)
    assert second["train_loss"][0] < first["train_loss"][-1]  # continued, not restarted
    assert int(twice.state.step) == int(once.state.step) == 4 * 8
    assert tree_allclose(twice.model, once.model, rtol=0, atol=0)


def test_updates_and_eval_every_and_resume_to_more_updates(tmp_path):
    X, y = _guide_data()  # 64 samples, micro-batches of 4, accumulate 2: 8 updates an epoch
    kwargs = dict(optimizer=optax.adam(0.01), accumulate=2, checkpoint_every=5)
    full = _trainer(checkpoint_dir=tmp_path / "full", **kwargs)
    fit = dict(micro_batch=4, key=jr.PRNGKey(1), eval_data=(X[:16], y[:16]), eval_every=3)
    history = full.fit(X, y, updates=11, **fit)
    assert int(full.state.step) == full.updates == 11
    assert history["eval_update"] == [3, 6, 9] and len(history["eval_loss"]) == 3
    assert len(history["train_loss"]) == 1  # one whole epoch of 8 updates
    part = _trainer(checkpoint_dir=tmp_path / "part", **kwargs)
    part.fit(X, y, updates=4, **fit)
    resumed = _trainer(checkpoint_dir=tmp_path / "part", **kwargs)
    assert resumed.fit(X, y, updates=11, **fit) == history
    assert tree_allclose(resumed.model, full.model, rtol=0, atol=0)
    # The evaluation is the trained model's mean loss over its samples.
    expected = float(jnp.mean(el.train.mse(full.model, X[:16], y[:16])))
    assert abs(full.evaluate((X[:16], y[:16])) - expected) < 1e-5 * expected


def test_evaluate_before_any_fit_checks_its_arrays_and_reads_the_model():
    X, y = _guide_data()
    trainer, model = _trainer(), el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    expected = float(jnp.mean(el.train.mse(model, X, y)))
    assert abs(trainer.evaluate((X, y), micro_batch=16) - expected) < 1e-5 * expected
    bad = np.array(y)
    bad[40, 0] = np.nan
    with pytest.raises(ValueError, match=r"evaluation data, samples 0 to 63 .*\(40, 0\)"):
        trainer.evaluate((X, bad))


def test_checkpoints_on_time_keep_the_last_few(tmp_path):
    X, y = _guide_data()
    trainer = _trainer(checkpoint_dir=tmp_path, checkpoint_seconds=1e-9, keep_checkpoints=3)
    trainer.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1))
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["checkpoint-000000002.ckpt", "checkpoint-000000003.ckpt", "checkpoint.ckpt"]
    for name, updates in zip(names, (2, 3, 4), strict=True):
        state, meta = el.train.load_checkpoint(tmp_path / name, trainer.state)
        assert meta["updates"] == updates == int(state.step)
    # One call loads the model for inference, from a model of the same shape.
    fresh = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(5))
    loaded = el.train.load_model(tmp_path / el.train._checkpoint.CHECKPOINT_NAME, fresh)
    assert tree_allclose(loaded, trainer.model, rtol=0, atol=0)


def test_log_lines_when_stderr_is_not_a_terminal(capsys):
    X, y = _guide_data()
    trainer = _trainer(progress=True, log_seconds=1e-9)  # stderr is captured: not a terminal
    trainer.fit(X, y, epochs=2, micro_batch=16, key=jr.PRNGKey(1))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 8, lines  # one per update
    # The rate is measured from the first update on (which includes compiling).
    assert re.fullmatch(r"update 1/8  epoch 1  loss \d+\.\d{4}  - updates/s", lines[0])
    pattern = r"update (\d)/8  epoch [12]  loss \d+\.\d{4}  [\d.e+]+ updates/s  ETA \d+s"
    for n, line in enumerate(lines[1:], start=2):
        match = re.fullmatch(pattern, line)
        assert match and int(match.group(1)) == n, line


def test_a_rerun_with_other_settings_is_refused_in_one_line(tmp_path):
    X, y = _guide_data()
    _trainer(checkpoint_dir=tmp_path, optimizer=optax.adam(1e-3)).fit(
        X, y, epochs=1, micro_batch=8, key=jr.PRNGKey(1)
    )
    fit = dict(epochs=2, micro_batch=8, key=jr.PRNGKey(1))
    with pytest.raises(ValueError, match=r"different optimizer .*-0\.001 then, -0\.003 now") as e:
        _trainer(checkpoint_dir=tmp_path, optimizer=optax.adam(3e-3)).fit(X, y, **fit)
    assert "\n" not in str(e.value) and "new checkpoint_dir" in str(e.value)
    assert "scale.step_size was -0.001" in str(e.value)  # which hyperparameter differs
    with pytest.raises(ValueError, match="different micro_batch .*8 then, 16 now"):
        _trainer(checkpoint_dir=tmp_path, optimizer=optax.adam(1e-3)).fit(
            X, y, epochs=2, micro_batch=16, key=jr.PRNGKey(1)
        )
    with pytest.raises(ValueError, match="different accumulate"):
        _trainer(checkpoint_dir=tmp_path, optimizer=optax.adam(1e-3), accumulate=2).fit(X, y, **fit)
    with pytest.raises(ValueError, match="different config"):
        _trainer(checkpoint_dir=tmp_path, optimizer=optax.adam(1e-3), config={"d": 2}).fit(
            X, y, **fit
        )
    # The same settings resume.
    same = _trainer(checkpoint_dir=tmp_path, optimizer=optax.adam(1e-3))
    assert len(same.fit(X, y, **fit)["train_loss"]) == 2


def test_the_optimizer_fingerprint_holds_whole_arrays_and_names_what_differs():
    """Two schedules over 100 rates that differ in the last one only (past the 32 bytes
    the fingerprint once kept) are different optimizers, and the refusal says where."""
    from eqx_lowmem.train._resume import _changed, fingerprint

    def scheduled(rates):
        opt = optax.chain(optax.scale_by_adam(b1=0.8), optax.scale_by_schedule(lambda s: rates[s]))
        return fingerprint((opt.init, opt.update))

    rates = jnp.linspace(0.1, 0.2, 100)
    same, other = scheduled(rates), scheduled(rates.at[-1].set(0.5))
    assert same == scheduled(jnp.array(rates)) and same != other
    said = _changed(Path("ckpt"), "optimizer", same, other)
    shown = r"scheduled\.rates was float32\[100\] sha256:\w+ then, float32\[100\] sha256:\w+ now"
    assert re.search(shown + r" \(at optimizer\[1\]>.*scale_by_schedule", said), said
    b1 = {k: "0.9" if k.endswith("scale_by_adam.b1") else v for k, v in same.items()}
    assert "scale_by_adam.b1 was 0.8 then, 0.9 now" in _changed(Path("c"), "optimizer", same, b1)
    assert json.loads(json.dumps(same)) == same  # stored in the checkpoint's header as is


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda m: m.pop("partial"), r"'partial' \(missing\)"),
        (lambda m: m.update(history=[1.0]), r"'history' \(a list\)"),
        (lambda m: m["partial"].pop("weight"), r"'partial' \(without \['weight'\]\)"),
    ],
)
def test_a_forged_checkpoint_header_is_named_not_a_key_error(tmp_path, edit, said):
    from .test_checkpoint import _rewrite_header

    X, y = _guide_data()
    fit = dict(epochs=1, micro_batch=8, key=jr.PRNGKey(1))
    _trainer(checkpoint_dir=tmp_path).fit(X, y, **fit)

    def forge(raw):  # the metadata edited, the header's checksum valid
        header = json.loads(raw)
        edit(header["meta"])
        return json.dumps(header).encode()

    _rewrite_header(tmp_path / "checkpoint.ckpt", forge)
    with pytest.raises(el.train.CheckpointError, match=said + ".*not written by Trainer.fit"):
        _trainer(checkpoint_dir=tmp_path).fit(X, y, **dict(fit, epochs=2))


class _NoKeyModel(eqx.Module):
    """A model whose `__call__` takes no `key`."""

    w: jax.Array

    def __call__(self, x):
        return x[:1] * self.w


@pytest.mark.parametrize(
    "make, call, error, match",
    [
        (dict(checkpoint_dir="FILE"), None, ValueError, "is a file"),
        # Under /proc nothing can be created: named, before any work.
        (
            dict(checkpoint_dir="/proc/eqx_lowmem_run"),
            None,
            ValueError,
            r"checkpoint_dir='/proc/eqx_lowmem_run' cannot be created: .*runs/run1",
        ),  # fmt: skip
        # (jaxtyping and beartype, on in the tests, see some first: their errors also name
        # the argument, the value and what was expected.)
        ({}, dict(key=0), TypeError, r"key=0 is an int.*jr.PRNGKey\(0\)|parameter 'key'"),
        ({}, dict(micro_batch=True), TypeError, "micro_batch must be an int"),
        ({}, dict(micro_batch=2.5), (TypeError, ValueError), "micro_batch must be|'micro_batch'"),
        ({}, dict(epochs=None), ValueError, "needs epochs=... or updates="),
        ({}, dict(eval_every=2), ValueError, "eval_every needs eval_data"),
        (dict(keep_checkpoints=0), None, ValueError, "keep_checkpoints must be"),
        (dict(max_consecutive_skips=True), None, TypeError, "max_consecutive_skips must be"),
        (dict(checkpoint_seconds=-1), None, ValueError, "checkpoint_seconds must be"),
        (dict(progress="yes"), None, (TypeError, ValueError), "progress must be|'progress'"),
        (dict(config={"f": object()}), None, ValueError, "JSON-serialisable"),
        # The loss passes a key to the model, which takes none: found before the first step.
        (dict(model=_NoKeyModel(jnp.ones(1))), {}, ValueError, "cannot be applied"),
    ],
)
def test_more_bad_input_fails_before_any_work(tmp_path, make, call, error, match):
    X, y = _guide_data()
    if make.get("checkpoint_dir") == "FILE":
        (tmp_path / "file").write_text("")
        make = dict(checkpoint_dir=tmp_path / "file")
    with pytest.raises(error, match=match):
        trainer = _trainer(**make)
        kwargs = dict(epochs=1, micro_batch=8, key=jr.PRNGKey(0)) | (call or {})
        trainer.fit(X, y, **kwargs)
    assert not list(tmp_path.glob("**/*.ckpt"))


def test_empty_and_exhausted_streams_are_errors_not_a_zero_loss():
    X, y = _guide_data()
    with pytest.raises(ValueError, match="no batches"):  # the stream or the Trainer says so
        empty = el.data.DataStream((np.asarray(X[:3]), np.asarray(y[:3])), 4, drop_last=True)
        _trainer().fit(epochs=1, key=jr.PRNGKey(0), stream=empty)
    with pytest.raises(ValueError, match="no batches|no samples|empty"):
        _trainer().fit(epochs=1, key=jr.PRNGKey(0), stream=el.data.DataStream(lambda: iter(()), 4))
    samples = [(np.asarray(a), np.asarray(b)) for a, b in zip(X[:8], y[:8], strict=True)]
    exhausted = iter(())
    calls = []

    def source():  # fresh for the up-front check and epoch 1, then an exhausted generator
        calls.append(1)
        return iter(samples) if len(calls) <= 2 else exhausted

    once = el.data.DataStream(source, 4)
    trainer = _trainer()
    with pytest.raises(ValueError, match="no batches|exhausted|no samples"):
        trainer.fit(epochs=2, key=jr.PRNGKey(0), stream=once)
    assert len(trainer.history["train_loss"]) == 1 and trainer.history["train_loss"][0] > 0


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("eqx_lowmem.data.prefetch")]


class _ThreadsSeen(el.train.Hook):
    def __init__(self):
        self.seen = []

    def due(self, update):  # each update read before the next starts, not in a batch later
        return True

    def on_update(self, info):
        self.seen.append(bool(_prefetch_threads()))


def test_arrays_in_memory_on_cpu_are_read_inline_and_files_by_a_thread(tmp_path):
    # On the CPU backend the step runs on the host's cores: a thread reading arrays that
    # are already in memory overlaps nothing and takes cores from it. A memory-mapped
    # file may wait on the disk, so it keeps the thread. Either way the updates are equal.
    X, y = (np.asarray(a) for a in _guide_data())
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", y)
    sources = {
        "arrays": (X, y),
        "files": (tmp_path / "x.npy", tmp_path / "y.npy"),
        "memmaps": (np.load(tmp_path / "x.npy", mmap_mode="r"), y),
    }
    seen, models = {}, {}
    for name, source in sources.items():
        hook = _ThreadsSeen()
        trainer = _trainer(hooks=[hook])
        stream = el.data.DataStream(source, 16, shuffle_buffer=64, key=0)
        trainer.fit(stream=stream, epochs=2, key=jr.PRNGKey(1))
        seen[name], models[name] = any(hook.seen), trainer.model  # (a thread ends with
        assert stream.in_memory == (name == "arrays")  # its epoch's last batch read)
    assert seen == {"arrays": False, "files": True, "memmaps": True}
    assert tree_allclose(models["arrays"], models["files"], rtol=0, atol=0)
    assert tree_allclose(models["arrays"], models["memmaps"], rtol=0, atol=0)
    assert not _prefetch_threads()


def test_consecutive_skipped_updates_stop_with_a_clear_error_and_no_thread_left():
    X, y = _guide_data()
    trainer = _trainer(precision="mixed_fp16", max_consecutive_skips=3)
    assert trainer.step_fn.loss_scale is not None
    with pytest.raises(FloatingPointError, match="3 updates in a row were skipped"):
        # Targets within float16's range (the data check passes; beyond it they are refused
        # as data), errors so large that the scaled float16 gradient overflows every update.
        trainer.fit(X, y * 1e4, epochs=1, micro_batch=8, key=jr.PRNGKey(0))
    assert int(trainer.state.step) == 0  # every update was skipped
    assert not _prefetch_threads()


def test_a_nonfinite_loss_leaves_the_last_good_state_and_no_thread(tmp_path):
    X, y = _guide_data()
    y = y.at[40].set(1e30)  # the third update (batches of 16): its squared error is inf
    config = el.train.StepConfig(skip_nonfinite=True)  # keeps it in trainer.state
    trainer = _trainer(checkpoint_dir=tmp_path, checkpoint_every=1, step_config=config)
    with pytest.raises(FloatingPointError, match="trainer.state is the last good state"):
        trainer.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1), shuffle=False)
    assert not _prefetch_threads()
    saved, meta = el.train.load_checkpoint(tmp_path / "checkpoint.ckpt", trainer.state)
    assert int(trainer.state.step) == int(saved.step) == 2 and meta["updates"] == 2
    assert tree_allclose(trainer.state.model, saved.model, rtol=0, atol=0)
    assert tree_allclose(trainer.state.opt_state, saved.opt_state, rtol=0, atol=0)


class _Normed(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(2, 3, key=key)
        self.norm = eqx.nn.BatchNorm(3, axis_name="batch", mode="batch")


def _normed_loss(model, state, x, y):
    def one(x, state):
        h, state = model.norm(model.linear(x), state)
        return jnp.sum(h, keepdims=True), state

    pred, state = jax.vmap(one, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean((pred - y) ** 2, axis=-1), state


def test_a_stateful_models_short_last_update_gets_only_real_samples():
    # 30 samples, micro-batches of 8, accumulate 4: one update of 8/8/8/6 real samples.
    X, y = _guide_data()
    X, y = X[:30], y[:30]
    model, model_state = eqx.nn.make_with_state(_Normed)(key=jr.PRNGKey(0))
    trainer = el.train.Trainer(
        model,
        _normed_loss,
        optax.sgd(0.1),
        accumulate=4,
        model_state=model_state,
        progress=False,
    )
    trainer.fit(X, y, epochs=1, micro_batch=8, key=jr.PRNGKey(1), shuffle=False)
    step = el.train.make_step(_normed_loss, optax.sgd(0.1), accumulate=4, has_state=True)
    state = step.init(model, key=jr.split(jr.PRNGKey(1))[1], model_state=model_state)
    state, _ = step(state, (X, y))
    assert tree_allclose(trainer.state.model, state.model, rtol=1e-6, atol=1e-7)
    assert tree_allclose(trainer.state.model_state, state.model_state, rtol=1e-6, atol=1e-7)


def test_the_callback_gets_the_update_within_the_epoch_and_of_the_run():
    X, y = _guide_data()
    seen = []
    trainer = _trainer(callback=lambda t, m: seen.append((m["epoch"], m["update"], m["updates"])))
    trainer.fit(X, y, epochs=2, micro_batch=32, key=jr.PRNGKey(1))
    assert seen == [(0, 1, 1), (0, 2, 2), (1, 1, 3), (1, 2, 4)]


def test_after_update_and_shard_pass_through_to_the_step():
    X, y = _guide_data()

    def zero_last_bias(state, info):  # runs inside the step, after each applied update
        model = eqx.tree_at(lambda m: m.layers[-1].bias, state.model, replace_fn=jnp.zeros_like)
        return eqx.tree_at(lambda s: s.model, state, model)

    hooked = _trainer(after_update=zero_last_bias)
    hooked.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1))
    assert bool(jnp.all(hooked.model.layers[-1].bias == 0))
    plain = _trainer()
    plain.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1))
    # (shard="fsdp" is passed the same way; tests/test_subprocess.py runs the Trainer on
    # 4 devices.)
    meshed = _trainer(mesh=jax.make_mesh((1,), ("data",)), shard="data")
    meshed.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1))
    assert tree_allclose(meshed.model, plain.model, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_scale", [None, "dynamic"])
def test_bad_labels_in_a_later_batch_of_a_file_stop_before_that_update(tmp_path, loss_scale):
    # A stream that reads files has each micro-batch checked on the host before it is put
    # on the device (in the prefetch thread); the error names it when its update comes,
    # also while the previous update's metrics are still being read (with a loss scale,
    # which overlaps them).
    X, _ = _guide_data()
    labels = np.zeros(64, np.int32)
    labels[58] = 7  # the model has 3 classes; samples 56-63: micro-batch 2 of update 4
    np.save(tmp_path / "x.npy", np.asarray(X))
    np.save(tmp_path / "y.npy", labels)
    stream = el.data.DataStream((tmp_path / "x.npy", tmp_path / "y.npy"), 8)
    scale = None if loss_scale is None else el.precision.dynamic_loss_scale()
    trainer = _trainer(model=el.nn.mlp([2, 4, 3], key=jr.PRNGKey(0)), loss=el.train.cross_entropy,
                       accumulate=2, loss_scale=scale)  # fmt: skip
    with pytest.raises(ValueError, match="micro-batch 2 of update 4 of epoch 1 .*batch\\[1\\]"):
        trainer.fit(epochs=1, key=jr.PRNGKey(1), stream=stream)
    assert int(trainer.state.step) == 3 and trainer.updates == 3
    assert trainer.history["train_loss"] == []  # the epoch did not end


@pytest.mark.parametrize("where", ["X", "y", "eval_data"])
def test_bad_arrays_in_memory_stop_fit_before_the_first_update(tmp_path, where):
    # Arrays in memory are checked whole before training, once: the error names the
    # sample, and nothing was trained or saved.
    X, _ = _guide_data()
    X, labels = np.array(X), np.zeros(64, np.int32)
    eval_x, eval_y = X[:16].copy(), labels[:16].copy()
    if where == "X":
        X[58, 1] = np.inf
    elif where == "y":
        labels[58] = 7  # the model has 3 classes
    else:
        eval_y[9] = -1
    trainer = _trainer(model=el.nn.mlp([2, 4, 3], key=jr.PRNGKey(0)), loss=el.train.cross_entropy,
                       checkpoint_dir=tmp_path)  # fmt: skip
    before = r" \(checked before the first update\), samples 0 to "
    what = {
        "X": rf"the training data{before}63 .*batch\[0\] holds 1 non-finite.*\(58, 1\)",
        "y": rf"the training data{before}63 .*batch\[1\] holds labels from 0 to 7.*58",
        "eval_data": rf"eval_data{before}15 .*batch\[1\] holds labels from -1.*9",
    }
    with pytest.raises(ValueError, match=what[where]):
        trainer.fit(X, labels, epochs=2, micro_batch=8, key=jr.PRNGKey(1),
                    eval_data=(eval_x, eval_y))  # fmt: skip
    assert int(trainer.state.step) == 0 and trainer.updates == 0
    assert not (tmp_path / el.train._checkpoint.CHECKPOINT_NAME).exists()


def test_arrays_are_checked_in_blocks_whose_samples_the_error_names():
    from eqx_lowmem.train._loop import check_arrays

    model = el.nn.mlp([2, 4, 3], key=jr.PRNGKey(0))
    x, y = np.zeros((40, 2), np.float32), np.zeros(40, np.int64)
    check_arrays(el.train.cross_entropy, model, None, (x, y), "data", block_bytes=128)
    y[37] = 3
    # 16 bytes a sample (two float32 and an int64): blocks of 8 samples, the last 32-39.
    with pytest.raises(ValueError, match=r"32 to 39 .*count from sample 32.*3.*index \(5,\)"):
        check_arrays(el.train.cross_entropy, model, None, (x, y), "data", block_bytes=128)
    y[37], x[3, 0] = 0, np.nan
    with pytest.raises(ValueError, match=r"data, samples 0 to 7 .*non-finite.*\(3, 0\)"):
        check_arrays(el.train.cross_entropy, model, None, (x, y), "data", block_bytes=128)


def test_a_stream_split_over_processes_without_jax_distributed_is_refused(tmp_path):
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    stream = el.data.DataStream((x, x[:, :1]), 4, process_index=0, process_count=2)
    trainer = el.train.Trainer(el.nn.mlp([2, 1], key=jr.PRNGKey(0)), el.train.mse,
                               optax.sgd(0.1), progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"process_count=2.*jax\.distributed\.initialize"):
        trainer.fit(epochs=1, key=jr.PRNGKey(1), stream=stream)
