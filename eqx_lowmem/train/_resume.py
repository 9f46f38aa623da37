"""The Trainer's checkpoint policy: what a run saves, the older checkpoints it keeps, the
settings a resumed run must share (with the optimizer's fingerprint), and the directory
claimed while it runs.

Two formats (`Trainer(checkpoint_format=...)`): one file per checkpoint (`_checkpoint`,
written synchronously), or orbax step directories (`_orbax`, written asynchronously; the
default for sharded and multi-process runs)."""

import contextlib
import functools
import json
import numbers
import os
import re
import shutil
import time
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..data import DataStream
from ._checkpoint import (
    CHECKPOINT_NAME,
    clean_stale_temporaries,
    load_checkpoint,
    lock_directory,
    read_meta,
    save_checkpoint,
)
from ._orbax import OrbaxCheckpoints, holds_orbax_steps, newest_step_directory
from ._run import Run

FORMATS = ("auto", "file", "orbax")


def checkpoint_format(trainer) -> str:
    """The format of `trainer`'s checkpoints: the one its directory holds; otherwise
    `checkpoint_format`, where "auto" is orbax for a run whose state is sharded (FSDP) or
    spans processes, and the single file for the rest."""
    d, chosen = trainer.checkpoint_dir, trainer.checkpoint_format
    held = None
    if d is not None and holds_orbax_steps(d):
        held = "orbax"
    elif d is not None and (d / CHECKPOINT_NAME).exists():
        held = "file"
    if held is not None and chosen not in ("auto", held):
        raise ValueError(
            f"checkpoint_format={chosen!r} but {d} holds {held} checkpoints; pass "
            f"checkpoint_format={held!r} (or 'auto') to resume it, or use a new checkpoint_dir."
        )
    if held is not None:
        return held
    if chosen != "auto":
        return chosen
    return "orbax" if trainer.shard == "fsdp" or jax.process_count() > 1 else "file"


def newest(trainer) -> Path | None:
    """The newest checkpoint in `trainer.checkpoint_dir` (a file or an orbax step
    directory), or None."""
    d = trainer.checkpoint_dir
    if d is None:
        return None
    if holds_orbax_steps(d):
        return newest_step_directory(d)
    path = d / CHECKPOINT_NAME
    return path if path.exists() else None


@contextlib.contextmanager
def checkpoints(trainer):
    """Open `trainer`'s checkpoint engine for one `fit`: orbax's is closed after it, waiting
    for the save in flight (also when `fit` raises)."""
    trainer._orbax = None
    if trainer.checkpoint_dir is not None and checkpoint_format(trainer) == "orbax":
        trainer._orbax = OrbaxCheckpoints(trainer.checkpoint_dir, keep=trainer.keep_checkpoints)
    try:
        yield trainer._orbax
    finally:
        if trainer._orbax is not None:
            trainer._orbax.close()
            trainer._orbax = None


def save(trainer, run: Run) -> None:
    """Write the state and the run's progress to `checkpoint_path` atomically, keeping
    the checkpoint it replaces as `checkpoint-<updates>.ckpt` (a hard link: no copy) and
    the newest `keep_checkpoints` in all. Killed at any moment, the directory holds a
    whole `checkpoint_path`: the old one or the new one."""
    run.last_save = time.monotonic()
    if trainer.checkpoint_dir is None:
        return
    key = (trainer.updates, json.dumps(run.history), json.dumps(run.partial))
    if key == run.saved:
        return  # nothing changed since the last save
    meta = {
        "stream": run.stream.state(),
        "history": run.history,
        "partial": dict(run.partial),
        "updates": trainer.updates,
        "run": run.settings,
    }
    if trainer._orbax is not None:
        trainer._orbax.save(trainer.updates, trainer.state, meta)
        run.saved = key
        return
    path = trainer.checkpoint_dir / CHECKPOINT_NAME
    if trainer.keep_checkpoints > 1 and path.exists():
        before = run.saved[0] if run.saved else read_meta(path).get("updates", 0)
        _keep(path, trainer.checkpoint_dir / _previous_name(before))
    save_checkpoint(path, trainer.state, meta)
    run.saved = key
    previous = _previous(trainer.checkpoint_dir)
    for old in previous[: max(0, len(previous) - (trainer.keep_checkpoints - 1))]:
        old.unlink(missing_ok=True)


def resume(trainer, path: Path, run: Run) -> None:
    """Load the checkpoint at `path` into `trainer` and `run`, refusing one made with other
    settings (unless `check_resume=False`)."""
    engine = trainer._orbax
    meta = read_meta(path) if engine is None else engine.read_meta()
    saved = meta.get("run")
    if trainer.check_resume and saved is not None:
        for name, now in run.settings.items():
            before = saved.get(name)
            if before != now:
                raise ValueError(_changed(path, name, before, now))
    assert trainer.state is not None
    if engine is None:
        trainer.state, meta = load_checkpoint(path, trainer.state)
    else:
        trainer.state, meta = engine.restore(trainer.state)
    run.stream.set_state(meta["stream"])
    run.history = meta["history"]
    if run.eval_stream is not None:
        run.history.setdefault("eval_loss", [])
        run.history.setdefault("eval_update", [])
    run.partial = meta["partial"]
    trainer.updates = meta.get("updates", 0)
    run.start = 0
    run.saved = (trainer.updates, json.dumps(run.history), json.dumps(run.partial))


def settings(trainer, stream: DataStream) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint."""
    policy = trainer.step_fn.policy
    scale = trainer.step_fn.loss_scale
    mesh = trainer.mesh
    return {
        "optimizer": fingerprint((trainer.optimizer.init, trainer.optimizer.update)),
        "accumulate": trainer.accumulate,
        "micro_batch": stream.batch_size,
        "precision": f"params {jnp.dtype(policy.param_dtype).name}, compute "
        f"{jnp.dtype(policy.compute_dtype).name}",
        "loss_scale": None if scale is None else type(scale).__name__,
        "shard": trainer.shard,
        "devices": 1 if mesh is None else int(mesh.shape[trainer.data_axis]),
        "config": trainer.config,
    }


def claim_directory(checkpoint_dir: Path | None):
    """Lock `checkpoint_dir` for this run and remove temporaries a killed run left (on
    process 0 of a multi-process run: the others share its directory)."""
    if checkpoint_dir is None or jax.process_index() != 0:
        return contextlib.nullcontext()
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_directory(checkpoint_dir)
    clean_stale_temporaries(checkpoint_dir)
    return lock


def fingerprint(obj: Any, depth: int = 0, seen: dict[int, Any] | None = None) -> list[str]:
    """The numbers, flags and function names an optax optimizer closes over, in order.

    Optax keeps hyperparameters (the learning rate, betas, a schedule's numbers) in the
    closures of its `init`/`update` functions, so two optimizers built with different
    numbers give different lists. It cannot see values read from globals at call time.
    """
    # Objects seen are kept alive in `seen`, so that their ids are not reused.
    seen = {} if seen is None else seen
    if depth > 16 or id(obj) in seen:
        return []
    if obj is None or isinstance(obj, (bool, str)):
        return [repr(obj)]
    if isinstance(obj, numbers.Number) and not isinstance(obj, np.ndarray):
        return [repr(obj)]
    seen[id(obj)] = obj
    if isinstance(obj, functools.partial):
        return [obj.func.__qualname__] + fingerprint((obj.args, obj.keywords), depth + 1, seen)
    if isinstance(obj, types.FunctionType):
        out = [obj.__qualname__]
        for cell in obj.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            out += fingerprint(value, depth + 1, seen)
        return out + fingerprint((obj.__defaults__, obj.__kwdefaults__), depth + 1, seen)
    if isinstance(obj, (tuple, list)):
        return [item for value in obj for item in fingerprint(value, depth + 1, seen)]
    if isinstance(obj, dict):
        return [
            item
            for k in sorted(obj, key=repr)
            for item in [repr(k), *fingerprint(obj[k], depth + 1, seen)]
        ]
    if isinstance(obj, (np.ndarray, jax.Array)):
        return [f"array{tuple(obj.shape)}:{np.asarray(obj).tobytes().hex()[:64]}"]
    return [type(obj).__qualname__]


def _changed(path: Path, name: str, before: Any, now: Any) -> str:
    what = {
        "optimizer": "optimizer (a learning rate, schedule or other hyperparameter)",
        "micro_batch": "micro_batch (the stream's batch size)",
        "config": "config",
    }.get(name, name)
    if name == "optimizer" and isinstance(before, list) and isinstance(now, list):
        diff = next(
            (i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b),
            min(len(before), len(now)),
        )
        old = before[diff] if diff < len(before) else "(nothing)"
        new = now[diff] if diff < len(now) else "(nothing)"
        detail = f"{old} then, {new} now"
    else:
        detail = f"{before!r} then, {now!r} now"
    return (
        f"{path} was made with a different {what}: {detail}. Resume with the same settings, "
        "or use a new checkpoint_dir for a new run (check_resume=False resumes anyway)."
    )


def _previous_name(updates: int) -> str:
    """The name an older checkpoint keeps (`checkpoint-<updates>.ckpt`) once a newer one
    has taken `CHECKPOINT_NAME`."""
    stem, dot, suffix = CHECKPOINT_NAME.rpartition(".")
    return f"{stem}-{updates:09d}{dot}{suffix}"


def _previous(directory: Path) -> list[Path]:
    """The older checkpoints kept in `directory`, oldest first."""
    stem, _, suffix = CHECKPOINT_NAME.rpartition(".")
    pattern = re.compile(re.escape(stem) + r"-(\d{9,})\." + re.escape(suffix))
    named = [(pattern.fullmatch(p.name), p) for p in directory.iterdir()]
    return [p for _, p in sorted((int(m.group(1)), p) for m, p in named if m)]


def _keep(path: Path, older: Path) -> None:
    """`older` becomes a second name of the file at `path` (a copy where the filesystem
    has no hard links), replacing any file of that name atomically."""
    if older.exists() and os.path.samefile(path, older):
        return  # kept already (a run killed after keeping it, before replacing `path`)
    # Named as atomic_write names its temporaries, so clean_stale_temporaries finds it.
    tmp = older.with_name(f".{older.name}.{os.urandom(8).hex()}.tmp")
    try:
        os.link(path, tmp)
    except OSError:
        shutil.copyfile(path, tmp)
    os.replace(tmp, older)
