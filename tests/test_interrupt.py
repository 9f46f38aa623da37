"""Real processes stopped while they train: Ctrl-C (SIGINT), SIGTERM and SIGHUP save and exit
with one line; SIGKILL at every phase of a checkpoint write (and between an epoch's last
update and its save) resumes with parameters, optimizer state, stream position and history
bit-identical to a run that was never stopped; a second process on the same directory is
refused."""

import os
import signal
import subprocess
import sys
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

from .helpers import own_lines

ROOT = Path(__file__).parent.parent
EPOCHS = 3  # 32 samples, micro-batches of 4, accumulate 2: 4 updates an epoch, 12 in all


def data():
    x = jr.normal(jr.PRNGKey(2), (32, 2))
    return x, jnp.sin(x[:, :1]) + x[:, 1:] ** 2


def make_trainer(directory, callback=None):
    return el.train.Trainer(
        el.nn.mlp([2, 16, 1], key=jr.PRNGKey(0)),
        el.train.mse,
        optax.adam(0.01),
        accumulate=2,
        checkpoint_dir=directory,
        checkpoint_every=2,
        keep_checkpoints=2,
        progress=False,
        callback=callback,
    )


def fit(trainer):
    x, y = data()
    return trainer.fit(
        x, y, epochs=EPOCHS, micro_batch=4, key=jr.PRNGKey(1), eval_data=(x[:8], y[:8])
    )


# The child trains as above and kills itself at one phase (argv: directory, phase, n).
CHILD = """
import os, signal, sys, time
from pathlib import Path
import eqx_lowmem as el
import eqx_lowmem.train._checkpoint as ckpt
from eqx_lowmem import _io
from tests.test_interrupt import fit, make_trainer

directory, phase, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as launched from a terminal, also under nohup
count = {"leaf": 0, "replace": 0, "link": 0, "eval": 0}

def die():
    os.kill(os.getpid(), signal.SIGKILL)

raw = ckpt._raw
def leaf(a):  # each leaf's bytes while a checkpoint is written
    count["leaf"] += 1
    if phase == "mid_write" and count["leaf"] == n:
        die()
    return raw(a)
ckpt._raw = leaf

replace = os.replace
def replace_hook(src, dst):
    name = Path(dst).name
    if name == ckpt.CHECKPOINT_NAME:
        count["replace"] += 1
        if phase == "before_rename" and count["replace"] == n:
            die()  # the temporary is whole and synced, not yet renamed
        replace(src, dst)
        if phase == "after_rename" and count["replace"] == n:
            die()  # renamed; the oldest checkpoint not yet removed
        return
    replace(src, dst)
    if name.startswith("checkpoint-"):
        count["link"] += 1
        if phase == "after_link" and count["link"] == n:
            die()  # the old checkpoint kept under its number; the new one not yet written
os.replace = replace_hook

evaluate = el.train.Trainer.evaluate
def evaluate_hook(self, *args, **kwargs):
    count["eval"] += 1
    if phase == "eval" and count["eval"] == n:
        die()  # the epoch's train loss is recorded in memory, not yet saved
    return evaluate(self, *args, **kwargs)
el.train.Trainer.evaluate = evaluate_hook

def callback(trainer, metrics):
    print("update", metrics["updates"], flush=True)
    if phase == "last_update" and metrics["updates"] == n:
        die()  # the epoch's last update is done; its end-of-epoch save is not
    if phase == "sigint":  # from update 5 on, time for the parent to try the directory
        time.sleep(0.5 if metrics["updates"] >= 5 else 0.05)

fit(make_trainer(directory, callback))
print("finished", flush=True)
"""


def _child(directory, phase, n, env):
    # `env` (conftest): the children compile the same programs; the first compiles, the
    # others load them from the module's cache. They run one after another and die only
    # outside compilation.
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), phase, str(n)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _arrays(tree):
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _same(a, b):
    xs, ys = _arrays(a), _arrays(b)
    return len(xs) == len(ys) > 0 and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(xs, ys, strict=True)
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("full")
    trainer = make_trainer(directory)
    history = fit(trainer)
    return trainer, history, el.train.read_meta(directory / el.train._checkpoint.CHECKPOINT_NAME)


def _check_resumes_exactly(directory, uninterrupted):
    full, full_history, full_meta = uninterrupted
    trainer = make_trainer(directory)
    history = fit(trainer)
    meta = el.train.read_meta(directory / el.train._checkpoint.CHECKPOINT_NAME)
    assert history == full_history
    assert meta["stream"] == full_meta["stream"] and meta["history"] == full_meta["history"]
    assert int(trainer.state.step) == int(full.state.step) == 4 * EPOCHS
    assert _same(trainer.state.model, full.state.model)
    assert _same(trainer.state.opt_state, full.state.opt_state)
    assert _same(jax.random.key_data(trainer.state.key), jax.random.key_data(full.state.key))
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith(".eqx"))
    # No temporary left; the newest checkpoint and one older (keep_checkpoints=2).
    assert names == ["checkpoint-000000010.ckpt", "checkpoint.ckpt"], names


# Saves come at updates 2, 4 (an epoch's end), 6, 8, 10 and 12: the third is at update 6.
PHASES = [
    ("mid_write", 2 * 15 + 5),  # the 3rd save, at its 5th of 15 leaves
    ("before_rename", 3),
    ("after_rename", 3),
    ("after_link", 2),
    ("last_update", 8),  # epoch 2's last update, before its save
    ("eval", 2),  # epoch 2's evaluation, after its train loss is recorded
]


@pytest.mark.parametrize(
    "phase, n",
    [  # a process each: two in the default suite, every phase in CI
        p if p[0] in ("mid_write", "after_link") else pytest.param(*p, marks=pytest.mark.slow)
        for p in PHASES
    ],
    ids=[p for p, _ in PHASES],
)
def test_sigkill_at_every_phase_resumes_bit_identically(tmp_path, uninterrupted, env, phase, n):
    with _child(tmp_path, phase, n, env) as proc:
        out, err = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, (out, err)
    assert "finished" not in out
    updates = [int(line.split()[1]) for line in out.splitlines() if line.startswith("update")]
    assert updates and max(updates) < 4 * EPOCHS
    # Whatever phase it died in, the directory holds a whole checkpoint.
    meta = el.train.read_meta(tmp_path / el.train._checkpoint.CHECKPOINT_NAME)
    assert 0 < meta["updates"] <= max(updates)
    _check_resumes_exactly(tmp_path, uninterrupted)


@pytest.mark.parametrize(
    "signum, how",
    [
        (signal.SIGINT, "interrupted"),  # (SIGTERM in the default suite: in-process, below)
        pytest.param(signal.SIGTERM, "stopped by SIGTERM", marks=pytest.mark.slow),
        pytest.param(signal.SIGHUP, "stopped by SIGHUP", marks=pytest.mark.slow),
    ],
    ids=["SIGINT", "SIGTERM", "SIGHUP"],
)
def test_a_stop_signal_saves_and_exits_with_one_line_then_resumes(
    tmp_path, uninterrupted, env, signum, how
):
    with _child(tmp_path, "sigint", 0, env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("update 5"):
                break
        # A second run on the same directory is refused while the first holds it.
        with pytest.raises(el.train.DirectoryLockedError, match="in use by another run"):
            fit(make_trainer(tmp_path))
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, (out, err)
    lines = own_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    stopped = int(lines[0].split(" at update ")[1].split(";")[0])
    assert lines[0] == f"{how} at update {stopped}; run again to resume"
    assert 5 <= stopped < 4 * EPOCHS
    meta = el.train.read_meta(tmp_path / el.train._checkpoint.CHECKPOINT_NAME)
    assert meta["updates"] == stopped  # saved at the update it stopped at, not before
    _check_resumes_exactly_after_interrupt(tmp_path, uninterrupted, stopped)


def _check_resumes_exactly_after_interrupt(directory, uninterrupted, stopped):
    full, full_history, _ = uninterrupted
    seen = []
    trainer = make_trainer(directory, callback=lambda t, m: seen.append(m["updates"]))
    history = fit(trainer)
    assert seen == list(range(stopped + 1, 4 * EPOCHS + 1))  # nothing trained twice
    assert history == full_history
    assert _same(trainer.state.model, full.state.model)
    assert _same(trainer.state.opt_state, full.state.opt_state)


@pytest.mark.parametrize(
    "signum, how", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM")]
)
def test_interrupt_raise_keeps_the_saved_state_in_memory(tmp_path, signum, how):
    # interrupt="raise" (notebooks): the same save, then KeyboardInterrupt. Update 3's
    # metrics are read while update 4 runs (a step that applies every update), so the run
    # stops after update 4, the update in flight, and keeps it.
    def callback(trainer, metrics):
        if metrics["updates"] == 3:
            os.kill(os.getpid(), signum)  # handled by fit: stop after this update

    trainer = make_trainer(tmp_path, callback)
    trainer.interrupt = "raise"
    handler = signal.getsignal(signum)  # SIG_IGN in a background job, else the default
    with pytest.raises(KeyboardInterrupt, match=f"{how} at update 4"):
        fit(trainer)
    state, meta = el.train.load_checkpoint(
        tmp_path / el.train._checkpoint.CHECKPOINT_NAME, trainer.state
    )
    assert meta["updates"] == 4 and int(state.step) == 4
    assert _same(state.model, trainer.state.model)
    assert signal.getsignal(signum) is handler  # restored
    assert not [t for t in threading.enumerate() if t.name.startswith("eqx_lowmem.data.")]
