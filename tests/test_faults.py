"""Faults and bad inputs, round four (issue 37): a relaunch refused by the lock hurts
nothing of the running job's, non-finite parameters are never saved, SIGTERM and SIGHUP
save and stop as Ctrl-C does, and bad arguments are refused naming what arrived."""

import dataclasses
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.train import DirectoryLockedError
from eqx_lowmem.train._checkpoint import CHECKPOINT_NAME

ROOT = Path(__file__).parent.parent


def _data(n=16):
    x = jr.normal(jr.PRNGKey(2), (n, 2))
    return x, jnp.sin(x[:, :1])


def _trainer(directory=None, optimizer=None, **kwargs):
    kwargs.setdefault("progress", False)
    return el.train.Trainer(
        el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)),
        el.train.mse,
        optax.sgd(0.05) if optimizer is None else optimizer,
        checkpoint_dir=directory,
        **kwargs,
    )


# ------------------------------------------------------------------------ the run directory

# A running job, as far as the directory sees it: the lock, and a checkpoint half written.
_RUNNING = """
import sys, time
from pathlib import Path
from eqx_lowmem.train._lock import lock_directory
with lock_directory(sys.argv[1]) as d:
    (d / sys.argv[2]).write_bytes(b"half a checkpoint")
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_refused_relaunch_leaves_the_running_jobs_files_alone(tmp_path):
    temporary = f".{CHECKPOINT_NAME}.0123456789abcdef.tmp"  # as atomic_write names it
    x, y = _data()
    with subprocess.Popen(
        [sys.executable, "-c", _RUNNING, str(tmp_path), temporary],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as job:
        try:
            assert job.stdout is not None and job.stdout.readline() == "held\n"
            for _ in range(2):
                with pytest.raises(DirectoryLockedError, match=f"pid {job.pid}|unknown"):
                    _trainer(tmp_path).fit(x, y, epochs=1, micro_batch=8, key=jr.PRNGKey(1))
                assert (tmp_path / temporary).read_bytes() == b"half a checkpoint"
                assert not (tmp_path / CHECKPOINT_NAME).exists()
                # Deleting the lock file by hand does not admit a second writer.
                (tmp_path / el.train._lock.LOCK_NAME).unlink(missing_ok=True)
        finally:
            job.kill()
    # The job is dead: its temporary is stale, and the next run removes it.
    _trainer(tmp_path).fit(x, y, epochs=1, micro_batch=8, key=jr.PRNGKey(1))
    assert not (tmp_path / temporary).exists()


def test_fit_removes_only_its_own_temporaries(tmp_path):
    ours = [
        tmp_path / f".{CHECKPOINT_NAME}.0123456789abcdef.tmp",
        tmp_path / ".checkpoint-000000004.ckpt.fedcba9876543210.tmp",
    ]
    others = [
        tmp_path / f".{CHECKPOINT_NAME}.k2_9xq0a.tmp",  # tempfile.mkstemp's, not ours
        tmp_path / ".data.csv.abcdefgh.tmp",
        tmp_path / ".notes.txt.0123456789abcdef.tmp",  # another program using our scheme
    ]
    for p in ours + others:
        p.write_bytes(b"x")
    x, y = _data()
    _trainer(tmp_path).fit(x, y, epochs=1, micro_batch=8, key=jr.PRNGKey(1))
    assert not any(p.exists() for p in ours)
    assert all(p.read_bytes() == b"x" for p in others)


# ------------------------------------------------------------------------ non-finite parameters


class _WithUnused(eqx.Module):
    used: Any
    unused: jax.Array  # gets a zero gradient: Adam with eps=0 divides 0 by 0


def _unused_loss(model, x, y):
    return el.train.mse(model.used, x, y)


def _nan_at_update_3(state, info):
    nan = jnp.where(state.step >= 3, jnp.nan, 0.0)
    model = jax.tree.map(lambda p: p + nan if eqx.is_inexact_array(p) else p, state.model)
    return dataclasses.replace(state, model=model)


@pytest.mark.parametrize(
    "case, saved",
    [("nan_learning_rate", None), ("adam_eps_0", None), ("hook_writes_nan", 2)],
)
def test_nonfinite_parameters_stop_the_run_and_are_never_saved(tmp_path, case, saved):
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    loss, optimizer, hook = el.train.mse, optax.sgd(0.05), None
    if case == "nan_learning_rate":
        optimizer = optax.sgd(float("nan"))
    elif case == "adam_eps_0":
        model = _WithUnused(model, jnp.ones(3))
        loss, optimizer = _unused_loss, optax.adam(1e-3, eps=0.0)
    else:
        hook = _nan_at_update_3
    trainer = el.train.Trainer(
        model, loss, optimizer, after_update=hook, checkpoint_dir=tmp_path,
        checkpoint_every=1, progress=False,
    )  # fmt: skip
    x, y = _data()
    with pytest.raises(FloatingPointError, match="parameters became non-finite") as e:
        trainer.fit(x, y, epochs=4, micro_batch=4, key=jr.PRNGKey(1))
    assert "last good state" not in str(e.value).split("trainer.state")[1].split(";")[0]
    path = tmp_path / CHECKPOINT_NAME
    if saved is None:
        assert not path.exists() and "no checkpoint" in str(e.value)
        return
    assert f"checkpoint of update {saved}" in str(e.value)
    state, meta = el.train.load_checkpoint(path, trainer.state)
    assert meta["updates"] == saved
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(state.model))


# ------------------------------------------------------------------------ atomic writes

# The child loads eqx_lowmem/_io.py alone (no JAX to import): it starts in a tenth of a second.
_PRINT_JSON = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_io", {str(ROOT / "eqx_lowmem" / "_io.py")!r})
io = importlib.util.module_from_spec(spec)
spec.loader.exec_module(io)
io.write_json(sys.argv[1], [1, 2])
"""


def test_atomic_writes_keep_symlinks_pipes_and_devices(tmp_path):
    from eqx_lowmem._io import atomic_write, write_json

    # A symlink: its target is replaced, the link stays.
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")
    write_json(dangling, [3])
    assert dangling.is_symlink() and json.loads((tmp_path / "made.json").read_text()) == [3]
    # A named pipe: written into, still a pipe.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    atomic_write(fifo, lambda f: (f.write(b"hello"), f.seek(0), f.write(b"J")))
    reader.join(timeout=30)
    assert got == [b"Jello"] and stat.S_ISFIFO(fifo.lstat().st_mode)
    # The process's stdout through a link to it (as /dev/stdout is): printed, not replaced.
    out_link = tmp_path / "stdout"
    out_link.symlink_to("/proc/self/fd/1")
    for where in (str(out_link), "/dev/stdout"):
        out = subprocess.run(
            [sys.executable, "-c", _PRINT_JSON, where], cwd=ROOT, capture_output=True, text=True
        )
        assert out.returncode == 0 and json.loads(out.stdout) == [1, 2], out.stderr
    assert out_link.is_symlink()
    with pytest.raises(ValueError, match="empty path"):
        atomic_write("", b"x")


# ------------------------------------------------------------------------ evaluation data


@pytest.mark.parametrize(
    "case, match",
    [
        ("nan", r"eval_data .*batch\[0\] holds 1 non-finite"),
        ("label", r"eval_data .*batch\[1\] holds labels from 0 to 7"),
        ("shape", r"cannot be applied to the model and eval_data"),
    ],
)
def test_eval_data_is_checked_before_the_first_update(tmp_path, case, match):
    x = jr.normal(jr.PRNGKey(2), (16, 2))
    y = np.arange(16) % 3
    ex, ey = np.array(x[:8]), y[:8].copy()
    if case == "nan":
        ex[3, 1] = np.nan
    elif case == "label":
        ey[5] = 7
    else:
        ey = ey[:, None]
    seen = []
    trainer = el.train.Trainer(
        el.nn.mlp([2, 4, 3], key=jr.PRNGKey(0)), el.train.cross_entropy, optax.sgd(0.1),
        checkpoint_dir=tmp_path, progress=False, callback=lambda t, m: seen.append(m),
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        trainer.fit(x, y, epochs=1, micro_batch=8, key=jr.PRNGKey(1), eval_data=(ex, ey))
    assert seen == [] and not (tmp_path / CHECKPOINT_NAME).exists()
    if case != "shape":  # Trainer.evaluate checks what it is given too: arrays whole, a
        # stream that reads files batch by batch
        with pytest.raises(ValueError, match="the evaluation data, samples 0 to 7 "):
            trainer.evaluate((ex, ey))
        np.save(tmp_path / "ex.npy", ex)
        np.save(tmp_path / "ey.npy", ey)
        stream = el.data.DataStream((tmp_path / "ex.npy", tmp_path / "ey.npy"), 8)
        with pytest.raises(ValueError, match="evaluation data, batch 1: "):
            trainer.evaluate(stream)


# ------------------------------------------------------------------------ losses and arguments


def _int_loss(model, x, y):
    return (jax.vmap(model)(x)[:, 0] > 0).astype(jnp.int32)


def _bool_loss(model, x, y):
    return jax.vmap(model)(x)[:, 0] > 0


def _list_loss(model, x, y):
    values = el.train.mse(model, x, y)
    return [values, jnp.ones_like(values)]


def _own_loss(model, x, y):
    return el.train.mse(model, x.astype(jnp.float32), y)


@pytest.mark.parametrize(
    "loss, x_dtype, big, match",
    [
        (_int_loss, np.float32, False, "values of dtype int32; expected floating-point"),
        (_bool_loss, np.float32, False, "values of dtype bool; expected floating-point"),
        (_list_loss, np.float32, False, r"returned a list of 2 items.*tuple \(values, weights\)"),
        (_own_loss, np.int64, True, r"batch\[0\] holds int64 values from .* 32-bit range"),
    ],
    ids=["int", "bool", "list", "int64_beyond_int32"],
)
def test_losses_and_data_jax_would_misread_are_refused(loss, x_dtype, big, match):
    x = np.asarray(_data()[0] * 3).astype(x_dtype)
    if big:
        x[1, 1] = 2**33 + 1  # int32 would hold 1
    y = np.zeros((16, 1), np.float32)
    trainer = el.train.Trainer(el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)), loss, optax.sgd(0.1),
                               progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        trainer.fit(x, y, epochs=1, micro_batch=2, key=jr.PRNGKey(1), shuffle=False)
    assert trainer.updates == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"checkpoint_dir": ""}, ValueError, r"checkpoint_dir='' is empty; expected a directory"),
        ({"log_dir": ""}, ValueError, r"log_dir='' is empty"),
        ({"log_dir": "FILE"}, ValueError, r"log_dir=.* is a file; expected a directory"),
    ],
    ids=["checkpoint_dir_empty", "log_dir_empty", "log_dir_file"],
)
def test_empty_or_wrong_directories_are_refused_at_construction(tmp_path, kwargs, error, match):
    kwargs = {k: (str(tmp_path / "f") if v == "FILE" else v) for k, v in kwargs.items()}
    (tmp_path / "f").write_text("notes")
    with pytest.raises(error, match=match):
        el.train.Trainer(el.nn.mlp([2, 1], key=jr.PRNGKey(0)), el.train.mse, optax.sgd(0.1),
                         **kwargs)  # fmt: skip
    assert (tmp_path / "f").read_text() == "notes"


# ------------------------------------------------------------------------ vague messages


def test_files_that_are_not_models_or_checkpoints_are_named(tmp_path):
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    (tmp_path / "empty.eqx").write_bytes(b"")
    with pytest.raises(el.train.CheckpointError, match=r"empty.eqx is empty \(0 bytes\)"):
        el.train.load_model(tmp_path / "empty.eqx", model)
    np.save(tmp_path / "a.npy", np.ones((3, 2), np.float32))
    with pytest.raises(el.train.CheckpointError, match="looks like a NumPy .npy file"):
        el.train.load_model(tmp_path / "a.npy", model)
    pytest.importorskip("orbax.checkpoint")
    with el.train.OrbaxCheckpoints(tmp_path / "run", asynchronous=False) as checkpoints:
        checkpoints.save(1, {"w": jnp.ones(2)}, {})
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoint_000000001"):
        with pytest.raises(el.train.CheckpointError, match="is an orbax checkpoint directory"):
            el.train.read_meta(where)
        with pytest.raises(el.train.CheckpointError, match=r"OrbaxCheckpoints\(run_directory\)"):
            el.train.load_checkpoint(where, {"w": jnp.ones(2)})


@pytest.mark.parametrize(
    "case, precision, match",
    [
        ("complex", None, r"batch\[0\] is complex \(complex64\)"),
        ("beyond_float16", "mixed_fp16", r"batch\[0\] holds 32 values beyond float16's range"),
    ],
)
def test_data_that_precision_or_jax_would_change_is_refused(case, precision, match):
    # Arrays in memory are checked whole: all 16 samples' 32 values are beyond float16's.
    x, y = _data()
    x = np.asarray(x).astype(np.complex64) if case == "complex" else np.asarray(x) + 1e5
    trainer = _trainer(precision=precision)
    with pytest.raises(ValueError, match=match):
        trainer.fit(x, y, epochs=1, micro_batch=8, key=jr.PRNGKey(1))
    assert trainer.updates == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_one_pass_data_check_neither_misses_nor_invents_bad_values(dtype):
    # `check_data` first bounds each array by its sum of squares (one BLAS pass) and scans
    # only where that bound fails: squares that overflow, or pass float16's largest value
    # squared, must not be mistaken for bad data, and one bad value among many is found.
    from eqx_lowmem.train._checks import check_data

    model, loss = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)), el.train.mse
    y = np.zeros((64, 1), dtype)
    check_data(loss, model, (np.full((64, 2), 1e30, dtype), y))  # squares overflow float32
    check_data(loss, model, (np.full((64, 2), 60000.0, dtype), y), jnp.float16)
    bad = [(np.nan, None, "1 non-finite values"), (-np.inf, None, "1 non-finite values"),
           (65520.0, jnp.float16, "1 values beyond float16's range")]  # fmt: skip
    for value, compute, match in bad:
        x = np.full((64, 2), 1e-3, dtype)
        x[17, 1] = value
        with pytest.raises(ValueError, match=rf"batch\[0\] holds {match}.*\(17, 1\)"):
            check_data(loss, model, (x, y), compute)


def test_the_runs_batch_check_raises_what_check_data_raises_and_nothing_else():
    # `BatchCheck` (each micro-batch of a fit) works out per dtype and sample shape which
    # arrays to scan (floats), which to bound (labels, token ids, 64-bit ints) and the
    # model's classes, once: every bad batch still raises check_data's own error, and a
    # good batch (of a signature seen before or not) passes.
    from eqx_lowmem.train._checks import BatchCheck, check_data

    model = el.nn.mlp([2, 4, 3], key=jr.PRNGKey(0))
    lm = el.nn.CausalLM(7, 8, 1, 8, 2, 16, key=jr.PRNGKey(0))
    x, labels = np.full((8, 2), 0.5, np.float32), np.array([0, 1, 2, 1, 0, 2, 1, 0], np.int32)
    tokens = np.tile(np.arange(7, dtype=np.int32), (2, 1))

    def changed(a, index, value, dtype=None):
        a = a.astype(dtype or a.dtype)
        a[index] = value
        return a

    bf16 = x.astype(jnp.bfloat16)
    bf16[3, 0] = np.nan
    cases = [  # (loss, model, batch, compute dtype, what check_data says or None)
        (el.train.cross_entropy, model, (x, labels), None, None),
        (el.train.cross_entropy, model, (np.full((8, 2), 1e30, np.float32), labels), None, None),
        (el.train.cross_entropy, model, (x.astype(np.float64), labels.astype(np.int64)), None,
         None),
        (el.train.cross_entropy, model, (changed(x, (5, 1), np.nan), labels), None,
         r"batch\[0\] holds 1 non-finite"),
        (el.train.cross_entropy, model, (changed(x, (5, 1), -np.inf, np.float64), labels), None,
         r"batch\[0\] holds 1 non-finite"),
        (el.train.cross_entropy, model, (x, changed(labels, 6, 3)), None,
         r"batch\[1\] holds labels from 0 to 3, but the model has 3 outputs"),
        (el.train.cross_entropy, model, (x, changed(labels, 2, -1, np.int64)), None,
         r"batch\[1\] holds labels from -1 to 2"),
        (el.train.cross_entropy, model, (bf16, labels), None, r"batch\[0\] holds 1 non-finite"),
        (el.train.cross_entropy, model, (x.astype(np.complex64), labels), None,
         r"batch\[0\] is complex"),
        (el.train.cross_entropy, model, (changed(x, (0, 0), 7e4), labels), jnp.float16,
         r"batch\[0\] holds 1 values beyond float16's range"),
        (el.train.mse, model, (changed(labels, 4, 2**33, np.int64), x), None,
         r"batch\[0\] holds int64 values from 0 to 8589934592, beyond the 32-bit range"),
        (el.train.mse, model, (x, changed(labels, 4, 2**40, np.uint64)), None,
         r"batch\[1\] holds uint64 values"),
        (el.train.next_token_loss, lm, (tokens,), None, None),
        (el.train.next_token_loss, lm, (changed(tokens, (1, 3), 7),), None,
         r"batch\[0\] holds token ids from 0 to 7, but the model has 7 outputs"),
    ]  # fmt: skip
    for loss, net, batch, compute, match in cases:
        check = BatchCheck(loss, net, compute)
        for _ in range(2):  # the plan worked out, then used
            if match is None:
                check(batch)
                check_data(loss, net, batch, compute)
                continue
            with pytest.raises(ValueError, match=match) as raised:
                check(batch)
            with pytest.raises(ValueError) as expected:
                check_data(loss, net, batch, compute)
            assert str(raised.value) == str(expected.value)
        good = (x, labels) if loss is el.train.cross_entropy else None
        if good is not None and batch[0].dtype == good[0].dtype:
            check(good)  # the same signature, good values: passes


def test_one_trainers_fit_from_two_threads_is_refused():
    errors = []

    def second_fit(trainer, metrics):
        if metrics["updates"] == 1:
            t = threading.Thread(target=lambda: errors.append(_second(trainer)))
            t.start()
            t.join()

    def _second(trainer):
        try:
            trainer.fit(*_data(), epochs=1, micro_batch=8, key=jr.PRNGKey(1))
        except RuntimeError as e:
            return str(e)

    trainer = _trainer(callback=second_fit)
    trainer.fit(*_data(), epochs=1, micro_batch=8, key=jr.PRNGKey(1))
    assert len(errors) == 1 and "fit is already running" in errors[0], errors
    assert trainer.updates == 2  # the first fit went on; the second trained nothing
    trainer.callback = None
    trainer.fit(*_data(), epochs=1, micro_batch=8, key=jr.PRNGKey(1))  # free again
    assert trainer.updates == 4


def _source_with_an_argument(path):
    return iter([(np.zeros(2, np.float32),)])


def test_arguments_of_the_wrong_kind_are_named_or_accepted():
    from eqx_lowmem.data._prefetch import check_depth  # the suite's beartype would catch it first

    with pytest.raises(TypeError, match=r"prefetch depth='2' is a str; expected an int >= 1"):
        check_depth("2")
    with pytest.raises(TypeError, match=r"source is a function taking arguments \(path\)"):
        el.data.DataStream(_source_with_an_argument, 2)
    assert el.memory._units.parse_size(np.int64(2**30), "budget") == 2**30
    with pytest.raises(TypeError, match="budget must be an int .*got float 2.5"):
        el.memory._units.parse_size(2.5, "budget")
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    x = jax.ShapeDtypeStruct((4, 2), jnp.float32)
    wanted = r"(?s)plan\(make_model=...\) takes a function .*got a\nMLP"
    with pytest.raises(TypeError, match=wanted):
        el.memory.plan(model, el.train.mse, optax.sgd(0.1), (x, x), budget=np.int64(2**30))


def test_sparsify_exclude_as_one_string_is_one_path():
    sparse = pytest.importorskip("eqx_lowmem.sparse")
    model = el.nn.mlp([2, 8, 8, 1], key=jr.PRNGKey(0))
    one = sparse.sparsify(model, 0.5, exclude=".layers[0]", key=jr.PRNGKey(1))
    listed = sparse.sparsify(model, 0.5, exclude=[".layers[0]"], key=jr.PRNGKey(1))
    assert isinstance(one.layers[0], eqx.nn.Linear) and not isinstance(one.layers[1], eqx.nn.Linear)
    assert eqx.tree_equal(one, listed)


def test_an_optimizer_needing_a_line_search_is_named():
    step = el.train.make_step(el.train.mse, optax.lbfgs())
    state = step.init(el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)), key=jr.PRNGKey(1))
    x = np.ones((4, 2), np.float32)
    with pytest.raises(TypeError, match=r"line search \(optax.lbfgs needs value, grad"):
        step(state, (x, x[:, :1]))


def test_float16_overflow_of_activations_is_named_as_overflow():
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    model = jax.tree.map(lambda p: p * 1000.0 if eqx.is_inexact_array(p) else p, model)
    x = np.full((16, 2), 100.0, np.float32)  # finite in float16; the activations are not
    trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.1), precision="mixed_fp16",
                               max_consecutive_skips=2, progress=False)  # fmt: skip
    with pytest.raises(FloatingPointError, match=r"beyond float16's largest value \(65504\)"):
        trainer.fit(x, np.zeros((16, 1), np.float32), epochs=1, micro_batch=8, key=jr.PRNGKey(1))


def test_big_endian_arrays_are_refused_when_the_stream_is_built(tmp_path):
    x = np.arange(8.0, dtype=">f4").reshape(4, 2)
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(ValueError, match=r"x.npy \(source\[0\]\) is big-endian \(>f4\)"):
        el.data.DataStream((str(tmp_path / "x.npy"),), 2)
    with pytest.raises(ValueError, match=r"source\[1\] is big-endian .*astype\('<f4'\)"):
        el.data.DataStream((x.astype("<f4"), x), 2)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: el.train.save_checkpoint("", {"w": jnp.ones(2)}, {}), ValueError, "path=''"),
        (lambda m: el.train.read_meta(""), ValueError, "path='' is empty; expected a file path"),
        (lambda m: el.train.load_model("", m), ValueError, "path='' is empty"),
        (lambda m: el.train.save_model("", m), ValueError, "path='' is empty"),
        (lambda m: el.train._lock.lock_directory("").__enter__(), ValueError, "checkpoint_dir=''"),
        (lambda m: el.train.save_model("m.eqx", None), TypeError, "holds no arrays"),
        (lambda m: _trainer().evaluate(_data(), micro_batch=0), ValueError, "micro_batch must"),
    ],
    ids=["save_checkpoint", "read_meta", "load_model", "save_model", "lock_directory",
         "save_model_none", "evaluate_micro_batch_0"],
)  # fmt: skip
def test_empty_paths_and_models_are_refused_by_name(tmp_path, monkeypatch, call, error, match):
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(error, match=match):
        call(el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)))
    assert sorted(tmp_path.iterdir()) == before  # nothing written into the working directory


_FULL_LOG_DISK = """
import resource, signal, sys, time, warnings
from eqx_lowmem.train._tensorboard import ScalarWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))  # as a full disk
writer = ScalarWriter(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(2000):
        writer.scalars(step, {"train/loss": 0.5})
        if step % 100 == 0:
            time.sleep(0.05)  # let the writer thread write (and fail)
        if caught:
            break
print("warned at", step, ":", caught[0].message if caught else None, flush=True)
writer.close()
"""


def test_tensorboard_scalars_that_cannot_be_written_are_named_once(tmp_path):
    pytest.importorskip("tensorboardX")
    out = subprocess.run(
        [sys.executable, "-c", _FULL_LOG_DISK, str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"can no longer be written to {tmp_path}" in out.stdout, (out.stdout, out.stderr)
    assert "checkpoints are unaffected" in out.stdout
