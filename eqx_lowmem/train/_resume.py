"""The Trainer's checkpoint policy: what a run saves, the older checkpoints it keeps, the
settings a resumed run must share (with the optimizer's fingerprint), and the directory
claimed while it runs.

Two formats (`Trainer(checkpoint_format=...)`): one file per checkpoint (`_checkpoint`,
written synchronously), or orbax step directories (`_orbax`, written asynchronously; the
default for sharded and multi-process runs)."""

import contextlib
import dataclasses
import functools
import hashlib
import json
import numbers
import os
import re
import shutil
import time
import types
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    clean_stale_temporaries,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from ._hooks import Hook, StepInfo
from ._lock import lock_directory
from ._orbax import OrbaxCheckpoints, holds_orbax_steps, newest_step_directory
from ._run import RunState
from ._state import TrainState
from ._step import Step
from ._update import all_finite

FORMATS = ("auto", "file", "orbax")


def last_good(directory: Any, saved: int | None) -> str:
    """Where the last good state of a run is, for its errors."""
    if directory is None:
        return "there is no checkpoint_dir, so no good state is kept"
    if saved is None:
        return f"no checkpoint is in {directory} yet"
    return (
        f"the last good state is the checkpoint of update {saved} in {directory} (a rerun "
        "resumes from it)"
    )


def nonfinite_parameters(where: str, update: int, directory: Any, saved: int | None) -> str:
    """The error for parameters that an update made non-finite from a finite gradient."""
    last = last_good(directory, saved)
    return (
        f"the parameters became non-finite (NaN or inf) at {where} (update {update} of the "
        "run, or just before it): the "
        "optimizer's update or the after_update hook made them so, from a finite loss and "
        "gradient. trainer.state holds those non-finite parameters and was not saved; "
        f"{last}. Look for a NaN or inf learning rate or schedule, an optimizer dividing by "
        "zero (optax.adam(eps=0) on a parameter that gets no gradient), or an after_update "
        "hook writing NaN."
    )


@eqx.filter_jit
def _finite_parameters(model: Any, chunked: bool) -> jax.Array:
    """Whether every floating parameter of `model` is finite: one read of each."""
    return all_finite(eqx.filter(model, eqx.is_inexact_array), chunked=chunked)


class Checkpoints(Hook):
    """The checkpoints of a run in `directory` (`Trainer(checkpoint_dir=...)`): saved at
    every epoch's end, every `every` updates, when `seconds` have passed since the last,
    at the end of `fit` and on a stop; the newest `keep` kept; and the run resumed from
    the newest on the next `fit`, refused when made with other settings (`check_resume`).

    Two formats: one file per checkpoint (`_checkpoint`, written synchronously), or orbax
    step directories (`_orbax`, written asynchronously; "auto" picks it for a sharded or
    multi-process run)."""

    def __init__(
        self,
        directory: Path,
        *,
        format: str = "auto",
        every: int | None = None,
        seconds: float | int | None = 300.0,
        keep: int = 3,
        check_resume: bool = True,
        sharded: bool = False,
    ):
        self.directory = directory
        self.format = format
        self.every = every
        self.seconds = seconds
        self.keep = keep
        self.check_resume = check_resume
        self.sharded = sharded  # the state is split over devices (FSDP): orbax by default
        self.saved: tuple | None = None  # (updates, history, partial) of the last save
        self._run: RunState | None = None
        self._orbax: OrbaxCheckpoints | None = None
        self._last_save = time.monotonic()

    @property
    def path(self) -> Path | None:
        """The newest checkpoint (a file or an orbax step directory), or None."""
        d = self.directory
        if holds_orbax_steps(d):
            return newest_step_directory(d)
        path = d / CHECKPOINT_NAME
        return path if path.exists() else None

    @property
    def saved_update(self) -> int | None:
        """The update of the newest checkpoint this run wrote or resumed from, or None."""
        return None if self.saved is None else self.saved[0]

    def resolved_format(self) -> str:
        """The format of the checkpoints: the one the directory holds; otherwise `format`,
        where "auto" is orbax for a sharded (FSDP) or multi-process run, else the file."""
        d, chosen = self.directory, self.format
        held = None
        if holds_orbax_steps(d):
            held = "orbax"
        elif (d / CHECKPOINT_NAME).exists():
            held = "file"
        if held is not None and chosen not in ("auto", held):
            raise ValueError(
                f"checkpoint_format={chosen!r} but {d} holds {held} checkpoints; pass "
                f"checkpoint_format={held!r} (or 'auto') to resume it, or use a new "
                "checkpoint_dir."
            )
        if held is not None:
            return held
        if chosen != "auto":
            return chosen
        return "orbax" if self.sharded or jax.process_count() > 1 else "file"

    @contextlib.contextmanager
    def opened(self, run: RunState):
        """Claim the directory for one `fit` of `run` (locked, stale temporaries removed),
        with its checkpoint engine: orbax's is closed after it, waiting for the save in
        flight (also when `fit` raises)."""
        with claim_directory(self.directory):
            self._run, self.saved = run, None
            if self.resolved_format() == "orbax":
                self._orbax = OrbaxCheckpoints(self.directory, keep=self.keep)
            try:
                yield self
            finally:
                self._run = None
                if self._orbax is not None:
                    self._orbax.close()
                    self._orbax = None

    def restore(self, state: TrainState) -> TrainState | None:
        """The state of the newest checkpoint (None without one), with the run's progress
        restored into the opened run; refused when made with other settings (unless
        `check_resume=False`)."""
        path, run = self.path, self._run
        assert run is not None, "restore() inside opened()"
        if path is None:
            return None
        engine = self._orbax
        meta = read_meta(path) if engine is None else engine.read_meta()
        _check_meta(path, meta)
        saved = meta.get("run")
        if self.check_resume and saved is not None:
            for name, now in run.settings.items():
                before = saved.get(name)
                if name == "optimizer" and isinstance(before, list):
                    continue  # an earlier version's fingerprint (a list): not comparable
                if before != now:
                    raise ValueError(_changed(path, name, before, now))
        if engine is None:
            state, meta = load_checkpoint(path, state)
        else:
            state, meta = engine.restore(state)
        run.restore(meta)
        self.saved = _saved_key(run)
        return state

    # -- the hook --------------------------------------------------------------------------

    def on_start(self, info: StepInfo) -> None:
        self._last_save = time.monotonic()

    def due(self, update: int) -> bool:
        return (self.every is not None and update % self.every == 0) or (
            self.seconds is not None and time.monotonic() - self._last_save >= self.seconds
        )

    def on_update(self, info: StepInfo) -> None:
        # An epoch's last update is saved at `on_epoch_end`, with the epoch closed. The
        # state is None only when the time to save came after the next update started:
        # then the next update is saved.
        if not info.last_in_epoch and self.due(info.update):
            state = info.state()
            if state is not None:
                self.save(state)

    def on_epoch_end(self, info: StepInfo) -> None:
        self.save(info.state())

    def on_end(self, info: StepInfo) -> None:
        self.save(info.state())

    def save(self, state: TrainState | None) -> None:
        """Write `state` and the run's progress atomically, keeping the checkpoint it
        replaces as `checkpoint-<updates>.ckpt` (a hard link: no copy) and the newest
        `keep` in all. Killed at any moment, the directory holds a whole checkpoint: the
        old one or the new one. Nothing is written when nothing changed since the last,
        and never parameters holding NaN or inf (FloatingPointError: the last good
        checkpoint stays the newest)."""
        self._last_save = time.monotonic()
        run = self._run
        assert run is not None and state is not None, "save() of the state after an update"
        key = _saved_key(run)
        if key == self.saved:
            return
        if not bool(_finite_parameters(state.model, chunked=not self.sharded)):
            # A step that applies every update (no skip_nonfinite) can leave NaN here.
            where = f"update {run.sums.updates} of epoch {run.sums.epoch + 1}"
            raise FloatingPointError(
                nonfinite_parameters(where, run.updates, self.directory, self.saved_update)
            )
        meta = run.progress()
        if self._orbax is not None:
            self._orbax.save(run.updates, state, meta)
            self.saved = key
            return
        path = self.directory / CHECKPOINT_NAME
        if self.keep > 1 and path.exists():
            before = self.saved[0] if self.saved else read_meta(path).get("updates", 0)
            _keep(path, self.directory / _previous_name(before))
        save_checkpoint(path, state, meta)
        self.saved = key
        previous = _previous(self.directory)
        for old in previous[: max(0, len(previous) - (self.keep - 1))]:
            old.unlink(missing_ok=True)


def _saved_key(run: RunState) -> tuple:
    """What a checkpoint of `run` records that can change between saves."""
    return (run.updates, json.dumps(run.history), json.dumps(dataclasses.asdict(run.sums)))


def settings(
    step: Step, optimizer: Any, micro_batch: int, config: dict[str, Any] | None
) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint (`optimizer`:
    the one given, before the step wraps it)."""
    policy, scale = step.policy, step.loss_scale
    return {
        "optimizer": fingerprint((optimizer.init, optimizer.update)),
        "accumulate": step.accumulate,
        "micro_batch": micro_batch,
        "precision": f"params {jnp.dtype(policy.param_dtype).name}, compute "
        f"{jnp.dtype(policy.compute_dtype).name}",
        "loss_scale": None if scale is None else type(scale).__name__,
        "shard": step.shard,
        "devices": step.n_shards,
        "config": config,
    }


# What `save` writes into a checkpoint's metadata, and `resume` reads back.
_META = {"stream": dict, "history": dict, "partial": dict, "updates": int}  # updates: optional
_PARTIAL = ("epoch", "sum", "weight", "updates")


def _check_meta(path: Path, meta: Any) -> None:
    """A checkpoint's metadata holds what a resume reads: refused naming what is missing
    (a header that verifies but was not written by `Trainer.fit`, or was edited)."""
    wrong = [] if isinstance(meta, dict) else ["the metadata itself (not a JSON object)"]
    if not wrong:
        wrong = [
            f"{k!r} (missing)" if k not in meta else f"{k!r} (a {type(meta[k]).__name__})"
            for k, kind in _META.items()
            if (k in meta or k != "updates")
            and (not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool))
        ]
    if not wrong and not all(k in meta["partial"] for k in _PARTIAL):
        wrong = [f"'partial' (without {[k for k in _PARTIAL if k not in meta['partial']]})"]
    if wrong:
        raise CheckpointError(
            f"{path}: its metadata cannot be resumed from: {', '.join(wrong)}, where "
            f"Trainer.fit writes {list(_META)}. It was not written by Trainer.fit, or its "
            "header was edited. Resume from an older checkpoint in the directory "
            "(checkpoint-<updates>.ckpt renamed to checkpoint.ckpt), or use a new "
            "checkpoint_dir."
        )


def claim_directory(checkpoint_dir: Path | None):
    """Lock `checkpoint_dir` for this run and remove temporaries a killed run left (on
    process 0 of a multi-process run: the others share its directory)."""
    if checkpoint_dir is None or jax.process_index() != 0:
        return contextlib.nullcontext()
    fix = "Pass a directory this process can create and write, e.g. checkpoint_dir='runs/run1'."
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # under /proc or /sys, a read-only filesystem, no permission
        where = "" if e.filename in (None, str(checkpoint_dir)) else f" ({e.filename})"
        raise ValueError(
            f"checkpoint_dir={str(checkpoint_dir)!r} cannot be created: "
            f"{e.strerror or e}{where}. {fix}"
        ) from e
    if not os.access(checkpoint_dir, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint_dir={str(checkpoint_dir)!r} is not writable. {fix}")
    return _claimed(checkpoint_dir)


@contextlib.contextmanager
def _claimed(checkpoint_dir: Path):
    """Hold the lock, then remove what a killed run of ours left: only temporaries of the
    files `save` writes, and only once no live run can be writing them (the lock)."""
    with lock_directory(checkpoint_dir):
        clean_stale_temporaries(checkpoint_dir, _ours)
        yield


def _ours(name: str) -> bool:
    """A file `save` writes: the checkpoint, or an older one kept under its update count."""
    return name == CHECKPOINT_NAME or _PREVIOUS.fullmatch(name) is not None


def fingerprint(obj: Any) -> dict[str, str]:
    """What an optax optimizer closes over, by where it sits: every number, flag and
    string, every array (its shape, dtype and a SHA-256 of all its bytes; small ones
    written out), and which function sits where (a transformation's identity).

    Optax keeps hyperparameters (the learning rate, betas, a schedule's numbers) in the
    closures of its `init`/`update` functions; a path names each by the functions and
    closure variables that lead to it, ending in the innermost's `<function>.<variable>`
    (`...>scale_by_adam.b1`). Two optimizers built with different numbers differ at the
    paths that say which. It cannot see values read from globals at call time.
    """
    found: dict[str, str] = {}
    seen: dict[int, Any] = {}  # kept alive, so that ids are not reused

    def visit(x: Any, path: str, depth: int) -> None:
        if depth > 24:
            return
        if x is None or isinstance(x, (bool, str)):
            found[path] = repr(x)
        elif isinstance(x, numbers.Number) and not isinstance(x, np.ndarray):
            found[path] = repr(x)
        elif isinstance(x, (np.ndarray, jax.Array)):
            found[path] = _array_value(x)
        elif id(x) in seen:
            return
        elif isinstance(x, functools.partial):
            seen[id(x)] = x
            found[path] = f"partial({x.func.__qualname__})"
            owner = _owner(x.func)
            for i, value in enumerate(x.args):
                visit(value, f"{path}>{owner}[{i}]", depth + 1)
            for name in sorted(x.keywords):
                visit(x.keywords[name], f"{path}>{owner}.{name}", depth + 1)
        elif isinstance(x, types.FunctionType):
            seen[id(x)] = x
            found[path] = x.__qualname__
            owner, code = _owner(x), x.__code__
            for name, cell in zip(code.co_freevars, x.__closure__ or (), strict=True):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                visit(value, f"{path}>{owner}.{name}", depth + 1)
            defaults = x.__defaults__ or ()
            with_defaults = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
            for name, value in zip(with_defaults, defaults, strict=True):
                visit(value, f"{path}>{owner}.{name}", depth + 1)
            for name, value in sorted((x.__kwdefaults__ or {}).items()):
                visit(value, f"{path}>{owner}.{name}", depth + 1)
        elif isinstance(x, (tuple, list)):
            seen[id(x)] = x
            for i, value in enumerate(x):
                visit(value, f"{path}[{i}]", depth + 1)
        elif isinstance(x, dict):
            seen[id(x)] = x
            for k in sorted(x, key=repr):
                visit(x[k], f"{path}[{k!r}]", depth + 1)
        else:
            found[path] = type(x).__qualname__

    visit(obj, "optimizer", 0)
    return found


def _owner(fn: Any) -> str:
    """`scale_by_adam` for `scale_by_adam.<locals>.update_fn`: the function that made it."""
    parts = getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>.")
    return parts[-2] if len(parts) > 1 else parts[0]


def _array_value(x: Any) -> str:
    """An array as a fingerprint keeps it: whole (a hash of every byte, 64 bits of it
    kept), small ones shown."""
    a = np.asarray(x)
    text = f"{a.dtype}{list(a.shape)}"
    if a.size <= 8:
        return f"{text} {a.tolist()}"
    digest = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
    return f"{text} sha256:{digest[:16]}"


def _optimizer_diff(before: dict[str, str], now: dict[str, str]) -> str:
    """The paths where two fingerprints differ, the first three with both values."""
    paths = [p for p in dict.fromkeys([*before, *now]) if before.get(p) != now.get(p)]
    shown = [
        f"{p.rsplit('>', 1)[-1]} was {before.get(p, '(absent)')} then, "
        f"{now.get(p, '(absent)')} now (at {p})"
        for p in paths[:3]
    ]
    more = f"; and {len(paths) - 3} more" if len(paths) > 3 else ""
    return "; ".join(shown) + more


def _changed(path: Path, name: str, before: Any, now: Any) -> str:
    what = {
        "optimizer": "optimizer (a learning rate, schedule or other hyperparameter)",
        "micro_batch": "micro_batch (the stream's batch size)",
        "config": "config",
    }.get(name, name)
    if name == "optimizer" and isinstance(before, dict) and isinstance(now, dict):
        detail = _optimizer_diff(before, now)
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


_STEM, _, _SUFFIX = CHECKPOINT_NAME.rpartition(".")
_PREVIOUS = re.compile(re.escape(_STEM) + r"-(\d{9,})\." + re.escape(_SUFFIX))


def _previous(directory: Path) -> list[Path]:
    """The older checkpoints kept in `directory`, oldest first."""
    named = [(_PREVIOUS.fullmatch(p.name), p) for p in directory.iterdir()]
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
