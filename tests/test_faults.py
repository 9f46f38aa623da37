"""Faults and bad inputs, round four (issue 37): a relaunch refused by the lock hurts
nothing of the running job's, non-finite parameters are never saved, SIGTERM and SIGHUP
save and stop as Ctrl-C does, and bad arguments are refused naming what arrived."""

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.train import CHECKPOINT_NAME, DirectoryLockedError

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
from eqx_lowmem.train import lock_directory
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
                (tmp_path / el.train._checkpoint.LOCK_NAME).unlink(missing_ok=True)
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
