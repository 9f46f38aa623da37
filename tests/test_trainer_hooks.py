"""The Trainer's hooks: each update's metrics under its own number (also with a loss scale,
where the Trainer reads an update's metrics while the next one runs), a user's own hooks
(recording, early stopping) with no library change, and the default hooks its keyword
arguments build."""

import jax.numpy as jnp
import jax.random as jr
import numpy as np
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


class Recorder(el.train.Hook):
    """A user's logger (as a W&B hook would be): every update's and epoch's numbers."""

    def __init__(self):
        self.updates, self.epochs, self.calls = [], [], []

    def on_start(self, info):
        self.calls.append(("start", info.update))

    def on_update(self, info):
        self.updates.append((info.update, info.epoch, info.epoch_update, dict(info.metrics)))

    def on_epoch_end(self, info):
        self.epochs.append((info.epoch, info.metrics["train_loss"]))

    def on_end(self, info):
        self.calls.append(("end", info.update))

    def close(self):
        self.calls.append(("close", None))


class StopAfter(el.train.Hook):
    """Early stopping: asks the Trainer to stop once `n` updates are done."""

    def __init__(self, n):
        self.n = n

    def due(self, update):  # read update n before starting n + 1
        return update >= self.n

    def on_update(self, info):
        if info.update >= self.n:
            info.stop()


def _trainer(**kwargs):
    kwargs.setdefault("progress", False)
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    return el.train.Trainer(model, el.train.mse, optax.sgd(0.05), **kwargs)


@pytest.mark.parametrize("precision", ["float32", "mixed_fp16"])
def test_a_recording_hook_hears_every_update_with_its_own_metrics(precision):
    X, y = _data()
    recorder = Recorder()
    trainer = _trainer(precision=precision, hooks=[recorder])
    history = trainer.fit(X, y, epochs=2, micro_batch=16, key=jr.PRNGKey(1), shuffle=False)
    assert [(u, e, k) for u, e, k, _ in recorder.updates] == [
        (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 0, 4), (5, 1, 1), (6, 1, 2), (7, 1, 3), (8, 1, 4)
    ]  # fmt: skip
    assert recorder.calls == [("start", 0), ("end", 8), ("close", None)]
    # The losses are the step's, update by update; each epoch's mean is theirs.
    step = el.train.make_step(el.train.mse, optax.sgd(0.05), precision=precision)
    state = step.init(el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)), key=jr.PRNGKey(0))
    for n in range(8):
        batch = (X[16 * (n % 4) : 16 * (n % 4 + 1)], y[16 * (n % 4) : 16 * (n % 4 + 1)])
        state, metrics = step(state, batch)
        heard = recorder.updates[n][3]
        assert heard["loss"] == pytest.approx(float(metrics["loss"]), rel=1e-5)
        assert heard["grad_norm"] == pytest.approx(float(metrics["grad_norm"]), rel=1e-5)
        assert isinstance(heard["loss"], float) and heard["finite"] == float(metrics["finite"])
    means = [sum(r[3]["loss"] for r in recorder.updates[4 * e : 4 * e + 4]) / 4 for e in (0, 1)]
    assert [e for e, _ in recorder.epochs] == [0, 1]
    assert [m for _, m in recorder.epochs] == pytest.approx(means, rel=1e-5)
    assert history["train_loss"] == [m for _, m in recorder.epochs]


@pytest.mark.parametrize("loss_scale", [False, True])
def test_an_early_stopping_hook_stops_after_n_updates(tmp_path, loss_scale):
    # 4 updates an epoch, 10 epochs asked for; the hook stops the run after update 6,
    # which is saved, and a later fit with the hook gone resumes from it.
    X, y = _data()
    scale = el.precision.dynamic_loss_scale() if loss_scale else None
    recorder = Recorder()
    trainer = _trainer(hooks=[recorder, StopAfter(6)], loss_scale=scale, checkpoint_dir=tmp_path)
    history = trainer.fit(X, y, epochs=10, micro_batch=16, key=jr.PRNGKey(1))
    assert trainer.updates == 6 and int(trainer.state.step) == 6
    assert [u for u, *_ in recorder.updates] == [1, 2, 3, 4, 5, 6]
    assert len(history["train_loss"]) == 1  # the second epoch did not end
    assert el.train.read_meta(trainer.checkpoint_path)["updates"] == 6
    resumed = _trainer(loss_scale=scale, checkpoint_dir=tmp_path)
    resumed.fit(X, y, epochs=2, micro_batch=16, key=jr.PRNGKey(1))
    assert resumed.updates == 8 and len(resumed.history["train_loss"]) == 2


def test_a_hook_may_add_numbers_to_the_history_and_the_hooks_after_it():
    X, y = _data()

    class Doubled(el.train.Hook):
        def on_update(self, info):
            return {"double_loss": 2 * info.metrics["loss"]}

    recorder = Recorder()
    trainer = _trainer(hooks=[Doubled(), recorder])
    history = trainer.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1))
    losses = [m["loss"] for *_, m in recorder.updates]
    assert history["double_loss"] == [2 * x for x in losses]
    assert [m["double_loss"] for *_, m in recorder.updates] == history["double_loss"]


def test_a_hook_gets_the_state_of_the_updates_it_is_due_at():
    # With a loss scale the Trainer reads update n while n + 1 runs: `state()` is None then,
    # except at the updates the hook said it was due at (or an epoch's last). (A float32
    # step with a loss scale: no update is skipped, so the step counts them.)
    X, y = _data()

    class Models(el.train.Hook):
        def __init__(self):
            self.seen = {}

        def due(self, update):
            return update == 2

        def on_update(self, info):
            state = info.state()
            self.seen[info.update] = None if state is None else int(state.step)

    hook = Models()
    trainer = _trainer(loss_scale=el.precision.dynamic_loss_scale(), hooks=[hook])
    trainer.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1), shuffle=False)
    assert hook.seen == {1: None, 2: 2, 3: None, 4: 4}


def test_progress_lines_and_tensorboard_number_updates_as_their_own(tmp_path, capfd):
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (.[test])",
    )
    X, y = _data()
    recorder = Recorder()
    trainer = _trainer(precision="mixed_fp16", hooks=[recorder], progress="log",
                       log_seconds=1e-9, log_dir=tmp_path)  # fmt: skip
    trainer.fit(X, y, epochs=1, micro_batch=16, key=jr.PRNGKey(1), shuffle=False)
    losses = [m["loss"] for *_, m in recorder.updates]
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("update ")]
    assert [ln.split()[1] for ln in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert [float(ln.split("loss ")[1].split()[0]) for ln in lines] == pytest.approx(
        losses, abs=1e-4
    )
    events = accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)


def test_hooks_that_are_not_hooks_are_refused():
    with pytest.raises(TypeError, match="hooks"):  # (the suite's type checker names it first)
        _trainer(hooks=Recorder())
    with pytest.raises(TypeError, match=r"hooks\[0\] \(object\) lacks"):
        _trainer(hooks=[object()])


def test_the_readmes_hook_example_logs_and_stops_early(capsys):
    # The README's code as written, on a model and data of its sizes (784 inputs, 10
    # classes): its logger prints every 10th update, its early stop ends the run.
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    after = text[text.index("<!-- hook-example -->") :]
    start = after.index("```python\n") + len("```python\n")
    code = after[start : after.index("```", start)]
    x = jr.normal(jr.PRNGKey(2), (256, 784))
    labels = jnp.argmax(x[:, :10], axis=1)
    scope = {"el": el, "jnp": jnp, "jr": jr, "optax": optax, "X": x, "y": labels,
             "my_model": el.nn.mlp([784, 32, 10], key=jr.PRNGKey(0)),
             "loss": el.train.cross_entropy}  # fmt: skip
    exec(code, scope)
    trainer, history = scope["trainer"], scope["history"]
    assert trainer.progress is True and trainer.hooks[1].target == 0.1
    epochs = len(history["train_loss"])
    assert 1 <= epochs < 50 and history["train_loss"][-1] < 0.1 <= min(history["train_loss"][:-1])
    assert trainer.updates == 2 * epochs  # 256 samples, updates of 4 x 32
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("update ")]
    assert [int(ln.split()[1].rstrip(":")) for ln in lines] == list(range(10, 2 * epochs + 1, 10))


class _Lead(el.train.Hook):
    """Records, for each update it hears of, how many updates were dispatched by then."""

    def __init__(self, every: bool):
        self.every, self.trainer, self.heard = every, None, []

    def due(self, update):
        return self.every

    def on_update(self, info):
        self.heard.append((info.update, self.trainer.updates, info.metrics["loss"]))


def test_on_the_cpu_backend_metrics_are_read_sixteen_updates_late_in_one_wait():
    # Each wait for a running step takes host CPU from the step's threads: on the CPU
    # backend the Trainer reads the metrics of up to 16 updates after one wait, while the
    # newest runs. A hook that is `due` every update still hears each one before the next.
    # Either way: every update once, in order, with the same losses.
    X, y = _data()
    runs = {}
    for every in (False, True):
        hook = _Lead(every)
        trainer = el.train.Trainer(el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)), el.train.mse,
                                   optax.sgd(0.05), hooks=[hook], progress=False)  # fmt: skip
        hook.trainer = trainer
        trainer.fit(X, y, epochs=2, micro_batch=2, key=jr.PRNGKey(1))  # 32 updates an epoch
        runs[every] = hook.heard
    late = [dispatched - update for update, dispatched, _ in runs[False]]
    assert max(late) == 16 and late[0] == 16
    assert all(d == u for u, d, _ in runs[True])
    assert [(u, v) for u, _, v in runs[False]] == [(u, v) for u, _, v in runs[True]]
    assert [u for u, _, _ in runs[False]] == list(range(1, 65))


def test_fewer_updates_are_read_late_where_their_batches_are_large():
    # An update in flight holds its batch: at most 64 MiB of them (and 16 updates).
    from eqx_lowmem.train._loop import host_lag

    mib = np.empty(2**20, np.uint8)
    assert host_lag((mib,)) == 16
    assert host_lag((np.empty(8 * 2**20, np.uint8), jnp.zeros(4))) == 7  # 64 MiB // (8 MiB + 16 B)
    assert host_lag((np.empty(65 * 2**20, np.uint8),)) == 1
    assert host_lag((jnp.zeros((2**20,), jnp.float32),) * 2) == 8  # device arrays: 4 MiB each


def test_two_tensorboard_writers_in_one_second_keep_both_runs(tmp_path):
    # tensorboardX names an events file by the second it was opened: a run resumed within
    # that second used to reopen (and truncate) the first run's file.
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (.[test])",
    )
    from eqx_lowmem.train._tensorboard import ScalarWriter

    first = ScalarWriter(tmp_path)
    for step in (1, 2):
        first.scalars(step, {"train/loss": float(step)})
    first.close()
    second = ScalarWriter(tmp_path, resumed_at=2)
    second.scalars(3, {"train/loss": 3.0})
    second.close()
    assert len(list(tmp_path.iterdir())) == 2
    events = accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1), (2, 2), (3, 3)]
