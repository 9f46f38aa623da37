"""The Trainer: `fit` over arrays or a stream, with every memory tool, never losing a run."""

import functools
import json
import math
import numbers
import os
import re
import shutil
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PRNGKeyArray
from tqdm.auto import tqdm

from ..data import DataStream
from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy
from ._checkpoint import (
    CHECKPOINT_NAME,
    clean_stale_temporaries,
    load_checkpoint,
    lock_directory,
    read_meta,
    save_checkpoint,
)
from ._loss import call_loss
from ._losses import check_batch
from ._step import TrainState, make_step

_STREAM_AND_ARRAYS = """\
fit() takes either arrays or a stream, not both:

    trainer.fit(X, y, epochs=3, micro_batch=8, key=key)          # arrays
    trainer.fit(epochs=3, key=key, stream=DataStream(...))       # a stream
"""


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


def _int_arg(name: str, value: Any, minimum: int, none: bool = False) -> None:
    if value is None and none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        also = "None or " if none else ""
        raise ValueError(f"{name} must be {also}an int >= {minimum}, got {value!r}.")


def _seconds_arg(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be None or a number of seconds > 0, got {value!r}.")


def _check_key(key: Any) -> None:
    ok = isinstance(key, jax.Array) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.dtype == jnp.uint32 and key.shape in ((2,), (4,)))
    )
    if not ok:
        got = (
            f"{type(key).__name__} {key!r}"
            if not hasattr(key, "dtype")
            else (f"an array of dtype {key.dtype} and shape {tuple(key.shape)}")
        )
        raise TypeError(f"key must be a PRNG key such as jr.PRNGKey(0) or jr.key(0), got {got}.")


def _fingerprint(obj: Any, depth: int = 0, seen: dict[int, Any] | None = None) -> list[str]:
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
        return [obj.func.__qualname__] + _fingerprint((obj.args, obj.keywords), depth + 1, seen)
    if isinstance(obj, types.FunctionType):
        out = [obj.__qualname__]
        for cell in obj.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            out += _fingerprint(value, depth + 1, seen)
        return out + _fingerprint((obj.__defaults__, obj.__kwdefaults__), depth + 1, seen)
    if isinstance(obj, (tuple, list)):
        return [item for value in obj for item in _fingerprint(value, depth + 1, seen)]
    if isinstance(obj, dict):
        return [
            item
            for k in sorted(obj, key=repr)
            for item in [repr(k), *_fingerprint(obj[k], depth + 1, seen)]
        ]
    if isinstance(obj, (np.ndarray, jax.Array)):
        return [f"array{tuple(obj.shape)}:{np.asarray(obj).tobytes().hex()[:64]}"]
    return [type(obj).__qualname__]


class Trainer:
    """Train a model with micro-batch accumulation, remat, precision and several devices.

    A run is never lost: with `checkpoint_dir`, `fit` saves atomically at the end of every
    epoch, every few minutes (`checkpoint_seconds`), every `checkpoint_every` updates, at
    the end and on Ctrl-C, keeps the last `keep_checkpoints` files, and a rerun of the same
    script resumes bit for bit where the last checkpoint left off.

    The Trainer holds the model once, in `trainer.state` (its parameters, optimizer state,
    PRNG key and loss scale); a second `fit` continues from it.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr, optax
        >>> import eqx_lowmem as el
        >>> model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
        >>> trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.05), accumulate=4,
        ...                            progress=False)
        >>> X, y = jnp.ones((64, 2)), jnp.zeros((64, 1))
        >>> history = trainer.fit(X, y, epochs=5, micro_batch=8, key=jr.PRNGKey(1))
        >>> len(history["train_loss"])
        5
    """

    def __init__(
        self,
        model: Any,
        loss: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        accumulate: int = 1,
        compile: bool = True,
        precision: str | Policy | None = None,
        loss_scale: DynamicLossScale | Literal["auto"] | None = "auto",
        model_state: Any = None,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        shard: Literal["data", "fsdp"] = "data",
        after_update: Callable[..., Any] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        checkpoint_seconds: float | int | None = 300.0,
        keep_checkpoints: int = 3,
        max_consecutive_skips: int = 25,
        progress: bool | Literal["bar", "log"] = True,
        log_seconds: float | int = 30.0,
        interrupt: Literal["exit", "raise"] = "exit",
        check_data: bool = True,
        config: dict[str, Any] | None = None,
        check_resume: bool = True,
        callback: Callable[["Trainer", dict[str, Any]], None] | None = None,
    ):
        """Args:
        model: an Equinox model (the loss calls it). The Trainer keeps its own copy in
            `state`; drop yours (`del model`) to free its memory.
        loss: per-sample loss, `loss(model, *batch)` (or `loss(model, model_state, *batch)`
            with `model_state`), taking a `key` keyword if it uses randomness (dropout);
            see `make_step`. For example `el.train.mse`.
        optimizer: an optax optimizer.
        accumulate: micro-batches per update: each update uses `accumulate * micro_batch`
            samples while only `micro_batch` samples of activations are alive. Memory:
            activations of one micro-batch and one float32 gradient accumulator.
        compile: jit the step (False runs it eagerly, for debugging).
        precision, loss_scale, mesh, data_axis, shard, after_update: as `make_step`
            (`precision="mixed_bf16"`; `shard="fsdp"` shards parameters and optimizer state
            over the mesh's data axis; `after_update` for sparse rewiring).
        model_state: `eqx.nn.State` for stateful layers (BatchNorm); the loss then takes and
            returns it.
        checkpoint_dir: where `fit` saves `checkpoint-<updates>.eqxlowmem` files (model,
            optimizer state, update counter, PRNG key, loss scale, the stream's position,
            the history and the settings of the run) and from where it resumes. The
            directory is locked while `fit` runs (a second process gets a clear error) and
            temporary files that a killed run left are removed.
        checkpoint_every: also checkpoint every this many updates.
        checkpoint_seconds: also checkpoint when this many seconds have passed since the
            last one (None: never on time). Time: one save (a copy of the state to the
            host and a file write) at most this often.
        keep_checkpoints: how many of the newest checkpoint files to keep (>= 1).
        max_consecutive_skips: with a loss scale, a non-finite update is skipped (the scale
            is lowered); after this many skipped in a row `fit` stops with a
            FloatingPointError, since the data or the model, not the scale, is at fault.
        progress: `True`: a progress bar when stderr is a terminal, otherwise (nohup, a
            batch scheduler, CI) a line every `log_seconds` seconds with the update, loss,
            updates per second and time left. `"bar"` or `"log"` force one; False: silent.
        log_seconds: seconds between progress lines.
        interrupt: on Ctrl-C (SIGINT), `fit` finishes the update in flight, saves a
            checkpoint, and then `"exit"`s the program with the one line "interrupted at
            update N; run again to resume" (exit status 130), or `"raise"`s
            KeyboardInterrupt (for notebooks: `trainer.state` is the saved state). A second
            Ctrl-C stops at once, without saving.
        check_data: check every micro-batch on the host before its update for data a loss
            would silently accept (`eqx_lowmem.train._losses.check_batch`: NaN or inf, and
            labels or token ids outside the model's classes for the built-in losses). Time:
            one pass over each batch on the host (on a GPU, a copy of it back). False
            checks only the first batch.
        config: a JSON-serialisable dict of your own settings (model size, data file, ...)
            recorded in every checkpoint; a rerun with a different one is refused.
        check_resume: refuse to resume a checkpoint made with other settings: the
            optimizer's hyperparameters (as far as its closures show them: a learning rate
            or schedule change is seen; a value read from a global is not, nor is a changed
            loss function or model code that keeps the shapes), `accumulate`, the micro-batch,
            the precision, the loss scale, sharding, the number of devices and `config`.
            With `optax.inject_hyperparams` the hyperparameters are in the optimizer state
            and the checkpoint's values are used. False resumes anyway.
        callback: called after every update with the trainer and a dict of `epoch`
            (counted from 0), `update` (the update's number within the epoch, from 1),
            `updates` (updates of the whole run so far) and the step's metrics as Python
            numbers (`loss`, `weight`, `grad_norm`, `finite`, `loss_scale`).
        """
        _int_arg("checkpoint_every", checkpoint_every, 1, none=True)
        _int_arg("keep_checkpoints", keep_checkpoints, 1)
        _int_arg("max_consecutive_skips", max_consecutive_skips, 1)
        _seconds_arg("checkpoint_seconds", checkpoint_seconds)
        _seconds_arg("log_seconds", log_seconds)
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to write to.")
        if progress not in (True, False, "bar", "log"):
            raise ValueError(f"progress must be True, False, 'bar' or 'log', got {progress!r}.")
        if interrupt not in ("exit", "raise"):
            raise ValueError(f"interrupt must be 'exit' or 'raise', got {interrupt!r}.")
        if config is not None:
            try:
                config = json.loads(json.dumps(config))
            except (TypeError, ValueError) as e:
                raise ValueError(f"config must be a JSON-serialisable dict: {e}") from e
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self._check_directory()
        self.step_fn = make_step(
            loss,
            optimizer,
            accumulate=accumulate,
            precision=precision,
            loss_scale=loss_scale,
            has_state=model_state is not None,
            mesh=mesh,
            data_axis=data_axis,
            shard=shard,
            after_update=after_update,
            jit=compile,
        )
        self.loss = loss
        self.optimizer = optimizer
        self.accumulate = accumulate
        self.mesh = mesh
        self.data_axis = data_axis
        self.shard = shard
        self.checkpoint_every = checkpoint_every
        self.checkpoint_seconds = checkpoint_seconds
        self.keep_checkpoints = keep_checkpoints
        self.max_consecutive_skips = max_consecutive_skips
        self.progress = progress
        self.log_seconds = log_seconds
        self.interrupt = interrupt
        self.check_data = check_data
        self.config = config
        self.check_resume = check_resume
        self.callback = callback
        # Until the first fit; then the model lives only in `state`.
        self._model = model
        self._model_state = model_state
        self.state: TrainState | None = None
        self.history: dict[str, list[float]] = {"train_loss": []}
        self.updates = 0  # updates taken in the run (skipped ones included)
        self._interrupted = False
        self._eval_fn = eqx.filter_jit(self._eval_batch) if compile else self._eval_batch

    @property
    def model(self) -> Any:
        """The trained model (parameters in the policy's storage dtype)."""
        return self._model if self.state is None else self.state.model

    @property
    def model_state(self) -> Any:
        return self._model_state if self.state is None else self.state.model_state

    @property
    def checkpoint_path(self) -> Path | None:
        """`checkpoint_dir / CHECKPOINT_NAME`: the newest checkpoint (None without a
        `checkpoint_dir`). Older ones are kept as `checkpoint-<updates>.ckpt`."""
        return None if self.checkpoint_dir is None else self.checkpoint_dir / CHECKPOINT_NAME

    # ---------------------------------------------------------------------------------- fit

    def fit(
        self,
        X: Any = None,
        y: Any = None,
        *,
        epochs: int | None = None,
        updates: int | None = None,
        micro_batch: int | None = None,
        key: PRNGKeyArray,
        shuffle: bool = True,
        stream: DataStream | None = None,
        eval_data: tuple | DataStream | None = None,
        eval_every: int | None = None,
    ) -> dict[str, list[float]]:
        """Train for `epochs` epochs or `updates` updates, or resume the run in `checkpoint_dir`.

        Args:
            X, y: arrays with the same first dimension (y may be None for a loss of X
                alone). More inputs: pass a `DataStream` over all of them.
            epochs: epochs to train. With a checkpoint to resume, the run's total: it
                continues up to this many. Without one, a second `fit` trains this many
                more from the current state.
            updates: updates to train (counted like `epochs`), the usual measure for
                language models; with `epochs` too, whichever comes first.
            micro_batch: samples per micro-batch (an update uses `accumulate` of them). With
                a stream: None or the stream's `batch_size`, which is the micro-batch.
            key: PRNG key: the data order (with `shuffle`), dropout and stochastic
                rounding derive from it.
            shuffle: shuffle the arrays each epoch (a global permutation).
            stream: a `DataStream` to train from instead of arrays; its batches are the
                micro-batches, `accumulate` of them per update.
            eval_data: `(X, y)` arrays or a `DataStream`; its loss (dropout off, via
                `eqx.nn.inference_mode`) goes into `history["eval_loss"]` after every epoch,
                or every `eval_every` updates, and the update count into
                `history["eval_update"]`.
            eval_every: evaluate every this many updates instead of after every epoch.

        Returns:
            The history: `train_loss` holds each finished epoch's mean loss over its
            samples (mean of the loss over every sample, whatever the micro-batching;
            samples of a skipped update with a non-finite loss are left out), `eval_loss`
            and `eval_update` the evaluations.

        Raises:
            ValueError: before any work, for X and y of different lengths, a stream with X,
                a bad `micro_batch` (not an int >= 1, different from the stream's, not
                divisible by the mesh's devices), neither `epochs` nor `updates`, a stream
                with no batches, a model that does not accept the data, a `checkpoint_dir`
                that is a file, or a checkpoint made with other settings. TypeError: for a
                key that is not a PRNG key. `DirectoryLockedError`: if another process is
                training in `checkpoint_dir`.
            FloatingPointError: for a non-finite loss without a loss scale (the update is
                not applied, no checkpoint is written, and `trainer.state` is the last good
                state), or `max_consecutive_skips` skipped updates in a row with one.
        """
        _check_key(key)
        _int_arg("epochs", epochs, 0, none=True)
        _int_arg("updates", updates, 0, none=True)
        _int_arg("eval_every", eval_every, 1, none=True)
        if epochs is None and updates is None:
            raise ValueError("fit() needs epochs=... or updates=... (or both).")
        if eval_every is not None and eval_data is None:
            raise ValueError("eval_every needs eval_data to evaluate on.")
        data_key, state_key = jr.split(key)
        stream = self._make_stream(X, y, micro_batch, data_key, shuffle, stream)
        self._check_mesh(stream.batch_size)
        eval_stream = self._make_eval_stream(eval_data, stream.batch_size)
        self._check_directory()
        with self._claim_directory():
            if self.state is None:
                self.state = self.step_fn.init(
                    self._model, key=state_key, model_state=self._model_state
                )
                self._model = self._model_state = None  # held once, in the state
            self._check_model_accepts(stream)
            run = _Run(
                stream=stream,
                accumulate=self.accumulate,
                epochs=epochs,
                updates=updates,
                eval_stream=eval_stream,
                eval_every=eval_every,
                settings=self._settings(stream),
            )
            path = self.checkpoint_path
            if path is not None and path.exists():
                self._resume(path, run)
            else:
                # Counted from here: a second fit without a checkpoint trains this many more.
                run.start = self.updates
            self.history = run.history
            with self._sigint():
                self._train(run)
        return run.history

    def _train(self, run: "_Run") -> None:
        self._catch_up(run)
        bar = _Progress(self.progress, self.log_seconds, run, self.updates)
        run.last_save = time.monotonic()
        try:
            while not run.done(self.updates):
                self._check_interrupt(run)
                self._epoch(run, bar)
            self._save(run)
        finally:
            bar.close()

    def _epoch(self, run: "_Run", bar: "_Progress") -> None:
        """Updates from the stream's position to the end of its epoch (or of the run)."""
        stream = run.stream
        epoch = stream.epoch
        batches = stream.prefetch(sharding=self._prefetch_sharding(stream))
        pending: tuple[dict, int] | None = None  # an update whose metrics are not read yet
        # Read an update's metrics while the next one runs, when no decision waits on them:
        # with a loss scale a non-finite update is skipped inside the step; without one it
        # must stop training before the next update is applied.
        overlap = self.step_fn.loss_scale is not None
        served = False
        try:
            for micro in _groups(batches, self.accumulate):
                served = True
                if self.check_data:
                    try:
                        self._check_data(micro, run, epoch)
                    except ValueError:
                        if pending is not None:  # keep the state and the history in step
                            self._finish(run, bar, *pending)
                        raise
                batch, weights = self._assemble(micro, stream.batch_size)
                assert self.state is not None
                self.state, metrics = self.step_fn(self.state, batch, weights)
                self.updates += 1
                if pending is not None:
                    self._finish(run, bar, *pending)
                pending = (metrics, epoch)
                ended = stream.epoch != epoch
                if not overlap or ended or self._decision_due(run):
                    self._finish(run, bar, *pending)
                    pending = None
                    if ended:
                        self._close_epoch(run, epoch)
                    self._act(run)
                    if run.done(self.updates):
                        return
            if pending is not None:
                self._finish(run, bar, *pending)
                pending = None
        finally:
            batches.close()  # stops and joins the prefetch thread on every exit path
        if not served:
            raise ValueError(
                f"the stream served no batches in epoch {epoch + 1}: an empty source, "
                "drop_last with fewer samples than a batch, or a source function that "
                "returned an exhausted iterator (it must return a fresh one each call)."
            )
        if run.partial["epoch"] == epoch:  # the epoch ended without its last update
            self._close_epoch(run, epoch)
            self._act(run)

    def _check_data(self, micro: list[tuple], run: "_Run", epoch: int) -> None:
        assert self.state is not None
        for i, m in enumerate(micro):
            try:
                check_batch(self.loss, self.state.model, tuple(m))
            except ValueError as e:
                raise ValueError(
                    f"micro-batch {i + 1} of update {run.partial['updates'] + 1} of epoch "
                    f"{epoch + 1} (before that update; check_data=False skips this check): {e}"
                ) from e

    def _decision_due(self, run: "_Run") -> bool:
        """Whether the state just dispatched must be read now (a save, an evaluation, the
        end, an interrupt)."""
        u = self.updates
        return (
            self._interrupted
            or run.done(u)
            or (self.checkpoint_every is not None and u % self.checkpoint_every == 0)
            or (run.eval_every is not None and u % run.eval_every == 0)
            or self._time_to_save(run)
        )

    def _time_to_save(self, run: "_Run") -> bool:
        return (
            self.checkpoint_dir is not None
            and self.checkpoint_seconds is not None
            and time.monotonic() - run.last_save >= self.checkpoint_seconds
        )

    def _act(self, run: "_Run") -> None:
        """After an update whose metrics are read: evaluate, save, stop on Ctrl-C."""
        u = self.updates
        if run.eval_every is not None and u % run.eval_every == 0:
            self._evaluate_into(run)
        if (
            (self.checkpoint_every is not None and u % self.checkpoint_every == 0)
            or self._time_to_save(run)
            or run.partial["updates"] == 0  # an epoch just ended
        ):
            self._save(run)
        self._check_interrupt(run)

    def _finish(self, run: "_Run", bar: "_Progress", metrics: dict, epoch: int) -> None:
        """Wait for an update's metrics; stop on a non-finite loss; update the running mean."""
        values = {k: v.item() for k, v in jax.device_get(metrics).items()}
        partial = run.partial
        if not values["finite"]:
            if self.step_fn.loss_scale is None:
                raise FloatingPointError(
                    f"non-finite loss or gradient at update {partial['updates'] + 1} of epoch "
                    f"{epoch + 1} (update {self.updates} of the run); that update was not "
                    "applied, no checkpoint was written, and trainer.state is the last good "
                    "state. Look for NaN or inf in the data, or lower the learning rate, clip "
                    "gradients, or use a loss scale with 16-bit compute."
                )
            run.skips += 1
            if run.skips >= self.max_consecutive_skips:
                raise FloatingPointError(
                    f"{run.skips} updates in a row were skipped for a non-finite loss or "
                    f"gradient (the last: update {partial['updates'] + 1} of epoch "
                    f"{epoch + 1}), down to a loss scale of {values['loss_scale']:g}: the "
                    "data or the model, not the scale, is at fault (look for NaN or inf in "
                    "the data). Raise max_consecutive_skips if the scale needs longer."
                )
        else:
            run.skips = 0
        if math.isfinite(values["loss"]):
            partial["sum"] += values["loss"] * values["weight"]
            partial["weight"] += values["weight"]
        partial["updates"] += 1
        bar.update(self.updates, values["loss"], epoch)
        if self.callback is not None:
            self.callback(
                self,
                {"epoch": epoch, "update": partial["updates"], "updates": self.updates, **values},
            )

    def _close_epoch(self, run: "_Run", epoch: int) -> None:
        partial = run.partial
        mean = partial["sum"] / partial["weight"] if partial["weight"] > 0 else math.nan
        run.history["train_loss"].append(mean)
        if run.eval_stream is not None and run.eval_every is None:
            self._evaluate_into(run)
        run.partial = _fresh_partial(epoch + 1)

    def _evaluate_into(self, run: "_Run") -> None:
        assert run.eval_stream is not None
        run.history["eval_loss"].append(self.evaluate(run.eval_stream))
        run.history["eval_update"].append(self.updates)

    def _catch_up(self, run: "_Run") -> None:
        """Close an epoch that a checkpoint saw end but not closed (kept for checkpoints
        taken between an epoch's last update and its close)."""
        if run.partial["epoch"] < run.stream.epoch:
            self._close_epoch(run, run.partial["epoch"])
            self._save(run)

    # ------------------------------------------------------------------------ checkpoints

    def _save(self, run: "_Run") -> None:
        """Write the state and the run's progress to `checkpoint_path` atomically, keeping
        the checkpoint it replaces as `checkpoint-<updates>.ckpt` (a hard link: no copy) and
        the newest `keep_checkpoints` in all. Killed at any moment, the directory holds a
        whole `checkpoint_path`: the old one or the new one."""
        run.last_save = time.monotonic()
        if self.checkpoint_dir is None:
            return
        key = (self.updates, json.dumps(run.history), json.dumps(run.partial))
        if key == run.saved:
            return  # nothing changed since the last save
        meta = {
            "stream": run.stream.state(),
            "history": run.history,
            "partial": dict(run.partial),
            "updates": self.updates,
            "run": run.settings,
        }
        path = self.checkpoint_dir / CHECKPOINT_NAME
        if self.keep_checkpoints > 1 and path.exists():
            before = run.saved[0] if run.saved else read_meta(path).get("updates", 0)
            _keep(path, self.checkpoint_dir / _previous_name(before))
        save_checkpoint(path, self.state, meta)
        run.saved = key
        previous = _previous(self.checkpoint_dir)
        for old in previous[: max(0, len(previous) - (self.keep_checkpoints - 1))]:
            old.unlink(missing_ok=True)

    def _resume(self, path: Path, run: "_Run") -> None:
        meta = read_meta(path)
        saved = meta.get("run")
        if self.check_resume and saved is not None:
            for name, now in run.settings.items():
                before = saved.get(name)
                if before != now:
                    raise ValueError(_changed(path, name, before, now))
        assert self.state is not None
        self.state, meta = load_checkpoint(path, self.state)
        run.stream.set_state(meta["stream"])
        run.history = meta["history"]
        if run.eval_stream is not None:
            run.history.setdefault("eval_loss", [])
            run.history.setdefault("eval_update", [])
        run.partial = meta["partial"]
        self.updates = meta.get("updates", 0)
        run.start = 0
        run.saved = (self.updates, json.dumps(run.history), json.dumps(run.partial))

    def _settings(self, stream: DataStream) -> dict[str, Any]:
        """What a resumed run must share with the run that wrote the checkpoint."""
        policy = self.step_fn.policy
        scale = self.step_fn.loss_scale
        return {
            "optimizer": _fingerprint((self.optimizer.init, self.optimizer.update)),
            "accumulate": self.accumulate,
            "micro_batch": stream.batch_size,
            "precision": f"params {jnp.dtype(policy.param_dtype).name}, compute "
            f"{jnp.dtype(policy.compute_dtype).name}",
            "loss_scale": None if scale is None else type(scale).__name__,
            "shard": self.shard,
            "devices": 1 if self.mesh is None else int(self.mesh.shape[self.data_axis]),
            "config": self.config,
        }

    def _check_directory(self) -> None:
        d = self.checkpoint_dir
        if d is not None and d.exists() and not d.is_dir():
            raise ValueError(
                f"checkpoint_dir={str(d)!r} is a file; expected a directory (it is created "
                "if missing). Pass a directory path."
            )

    def _claim_directory(self):
        """Lock `checkpoint_dir` for this run and remove temporaries a killed run left."""
        if self.checkpoint_dir is None:
            return _nothing()
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_directory(self.checkpoint_dir)
        clean_stale_temporaries(self.checkpoint_dir)
        return lock

    # --------------------------------------------------------------------------- Ctrl-C

    def _sigint(self):
        """Turn the first Ctrl-C into a request to stop after the update in flight."""
        self._interrupted = False
        if threading.current_thread() is not threading.main_thread():
            return _nothing()  # signals reach only the main thread

        def handler(signum, frame):
            if self._interrupted:  # a second Ctrl-C: stop now, without saving
                raise KeyboardInterrupt
            self._interrupted = True

        return _handling(signal.SIGINT, handler)

    def _check_interrupt(self, run: "_Run") -> None:
        if not self._interrupted:
            return
        self._save(run)
        saved = self.checkpoint_dir is not None
        if self.interrupt == "raise":
            raise KeyboardInterrupt(f"interrupted at update {self.updates}")
        line = (
            f"interrupted at update {self.updates}; run again to resume"
            if saved
            else f"interrupted at update {self.updates}; no checkpoint_dir, nothing was saved"
        )
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(130)

    # ---------------------------------------------------------------------------- evaluate

    def _eval_batch(self, model, model_state, batch, weights):
        out = call_loss(
            self.loss,
            model,
            batch,
            weights,
            model_state=model_state,
            key=None,
            policy=self.step_fn.policy,
        )
        return jnp.sum(out.values * out.weights), jnp.sum(out.weights)

    def evaluate(self, data: tuple | DataStream, micro_batch: int | None = None) -> float:
        """Mean loss over every sample of `data` (arrays or a `DataStream`), no update.

        The model runs in `eqx.nn.inference_mode` and the loss gets no key: dropout is off
        and BatchNorm uses its running statistics.
        """
        stream = (
            data
            if isinstance(data, DataStream)
            else self._make_eval_stream(data, micro_batch or 256)
        )
        assert stream is not None
        model = eqx.nn.inference_mode(self.model)
        total = weight = 0.0
        for batch in stream:
            batch, weights = _pad([tuple(jnp.asarray(x) for x in batch)], stream.batch_size)
            s, w = self._eval_fn(model, self.model_state, batch, weights)
            total += float(s)
            weight += float(w)
        if weight <= 0:
            raise ValueError("the evaluation data has no samples (or only zero weights).")
        return total / weight

    # ---------------------------------------------------------------------------- checks

    def _make_stream(self, X, y, micro_batch, key, shuffle, stream) -> DataStream:
        if stream is not None:
            if X is not None or y is not None:
                raise ValueError(_STREAM_AND_ARRAYS)
            if not isinstance(stream, DataStream):
                raise TypeError(
                    f"stream must be an eqx_lowmem.data.DataStream, got {type(stream).__name__}."
                )
            if micro_batch is not None and micro_batch != stream.batch_size:
                raise ValueError(
                    f"micro_batch={micro_batch!r} but the stream serves batches of "
                    f"{stream.batch_size} (the micro-batches); pass micro_batch=None (or the "
                    "stream's)."
                )
            if stream.process_count != jax.process_count():
                raise ValueError(
                    f"the stream is one of process_count={stream.process_count} parts, but "
                    f"JAX runs {jax.process_count()} process(es): call "
                    "jax.distributed.initialize(...) in every process before building the "
                    "model and the stream, or build the stream with process_count=1."
                )
            return stream
        if X is None:
            raise ValueError("fit() needs arrays X (and y) or stream=DataStream(...).")
        if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
            raise ValueError(
                f"micro_batch must be an int >= 1 (samples per micro-batch; an update uses "
                f"accumulate={self.accumulate} of them), got {micro_batch!r}."
            )
        arrays = (X,) if y is None else (X, y)
        lengths = [len(a) for a in arrays]
        if len(set(lengths)) != 1:
            raise ValueError(
                f"X and y must have the same number of samples, got len(X)={lengths[0]} and "
                f"len(y)={lengths[1]}."
            )
        return DataStream(
            tuple(np.asarray(a) for a in arrays),
            micro_batch,
            key=key if shuffle else None,
        )

    def _make_eval_stream(self, eval_data, micro_batch) -> DataStream | None:
        if eval_data is None or isinstance(eval_data, DataStream):
            return eval_data
        if not isinstance(eval_data, (tuple, list)):
            raise TypeError(
                f"eval_data must be a tuple of arrays such as (X, y) or a DataStream, got "
                f"{type(eval_data).__name__}."
            )
        arrays = tuple(np.asarray(a) for a in eval_data if a is not None)
        lengths = {len(a) for a in arrays}
        if len(lengths) != 1:
            raise ValueError(
                f"eval_data arrays must have the same number of samples, got {sorted(lengths)}."
            )
        return DataStream(arrays, micro_batch)

    def _check_mesh(self, micro_batch: int) -> None:
        if self.mesh is None:
            return
        n = int(self.mesh.shape[self.data_axis])
        if micro_batch % n:
            raise ValueError(
                f"micro_batch={micro_batch} is not divisible by the {n} devices of the mesh's "
                f"{self.data_axis!r} axis; every micro-batch is split over them: use a "
                f"multiple of {n}. Batch sizes are global (over all devices)."
            )

    def _prefetch_sharding(self, stream: DataStream) -> NamedSharding | None:
        """Batches go straight to their devices when every batch divides over them; a
        short last batch that does not is placed by the step instead."""
        if self.mesh is None:
            return None
        n = int(self.mesh.shape[self.data_axis])
        samples = stream.num_samples
        regular = stream.drop_last or (samples is not None and samples % stream.batch_size % n == 0)
        return NamedSharding(self.mesh, P(self.data_axis)) if regular else None

    def _assemble(self, micro: list[tuple], size: int) -> tuple[tuple, jax.Array]:
        """The whole batch of one update from its micro-batches. A short last update is
        padded at weight 0 to the full size (one compilation), except for a stateful model,
        whose batch statistics must see only real samples."""
        if self.state is not None and self.state.model_state is not None:
            batch = _concat(micro)
            return batch, jnp.ones((batch[0].shape[0],), jnp.float32)
        return _pad(micro, self.accumulate * size)

    def _check_model_accepts(self, stream: DataStream) -> None:
        """Trace one micro-batch through the loss before any work, for a clear error."""
        first = next(iter(_peek(stream)), None)
        if first is None:
            raise ValueError(
                f"the stream has no batches in epoch {stream.epoch + 1} (an empty source, "
                "or drop_last with fewer samples than a batch); nothing to train on."
            )
        state = self.state
        assert state is not None
        check_batch(self.loss, state.model, tuple(first))  # bad data, on the host
        policy = self.step_fn.policy

        def trace(model, model_state, batch, key):
            return call_loss(
                self.loss, model, batch, model_state=model_state, key=key, policy=policy
            )

        specs = tuple(jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in first)
        try:
            eqx.filter_eval_shape(trace, state.model, state.model_state, specs, jr.PRNGKey(0))
        except Exception as e:
            shapes = ", ".join(f"{tuple(s.shape)} {s.dtype}" for s in specs)
            raise ValueError(
                f"the loss cannot be applied to the model and a micro-batch of ({shapes}) "
                f"(called as the step calls it, with a key if the loss takes one): "
                f"{type(e).__name__}: {e}"
            ) from e


# ----------------------------------------------------------------------------- the run


def _fresh_partial(epoch: int) -> dict[str, Any]:
    return {"epoch": epoch, "sum": 0.0, "weight": 0.0, "updates": 0}


class _Run:
    """One call of `fit`: its targets and the progress that checkpoints record."""

    def __init__(self, *, stream, accumulate, epochs, updates, eval_stream, eval_every, settings):
        self.stream = stream
        self.accumulate = accumulate
        self.epochs = epochs
        self.updates = updates
        self.eval_stream = eval_stream
        self.eval_every = eval_every
        self.settings = settings
        self.history: dict[str, list] = {"train_loss": []}
        if eval_stream is not None:
            self.history.update(eval_loss=[], eval_update=[])
        self.partial = _fresh_partial(stream.epoch)
        self.start = 0  # updates taken before this fit (counted towards `updates` or not)
        self.skips = 0  # skipped updates in a row
        self.last_save = time.monotonic()
        self.saved: tuple | None = None

    def done(self, taken: int) -> bool:
        return (self.epochs is not None and self.stream.epoch >= self.epochs) or (
            self.updates is not None and taken - self.start >= self.updates
        )


class _Progress:
    """A bar on a terminal; a line every `seconds` otherwise; or nothing."""

    def __init__(self, progress, seconds: float, run: _Run, taken: int):
        mode = progress
        if progress is True:
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode = mode if mode in ("bar", "log") else None
        self.seconds = seconds
        self.target = _target(run, taken)
        self.first: tuple[float, int] | None = None  # (time, updates) after the first update
        self.last_line = time.monotonic()
        self.bar = None
        if self.mode == "bar":
            self.bar = tqdm(total=self.target, file=sys.stderr, leave=False, unit="update")

    def update(self, updates: int, loss: float, epoch: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = (now, updates)  # after the first update: it includes compiling
            if self.bar is not None:
                self.bar.n = updates - 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}", refresh=False)
        elif self.mode == "log" and now - self.last_line >= self.seconds:
            self.last_line = now
            print(self.line(updates, loss, epoch, now), file=sys.stderr, flush=True)

    def line(self, updates: int, loss: float, epoch: int, now: float) -> str:
        assert self.first is not None
        t0, u0 = self.first
        rate = (updates - u0) / (now - t0) if updates > u0 and now > t0 else None
        of = f"/{self.target}" if self.target is not None else ""
        parts = [f"update {updates}{of}", f"epoch {epoch + 1}", f"loss {loss:.4f}"]
        parts.append(f"{rate:.3g} updates/s" if rate else "- updates/s")
        if rate and self.target is not None:
            parts.append(f"ETA {_duration((self.target - updates) / rate)}")
        return "  ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _target(run: _Run, taken: int) -> int | None:
    """The run's last update number, when it is known (`taken`: updates so far)."""
    targets = []
    if run.updates is not None:
        targets.append(run.start + run.updates)
    n = run.stream.num_batches
    if run.epochs is not None and n is not None:
        per_epoch = -(-n // run.accumulate)
        left = (run.epochs - run.stream.epoch) * per_epoch - run.partial["updates"]
        targets.append(taken + max(0, left))
    return min(targets, default=None)


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


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


# ---------------------------------------------------------------------------- helpers


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _handling:
    """Install a signal handler for a `with` block, restoring the previous one after."""

    def __init__(self, signum, handler):
        self.signum, self.handler = signum, handler

    def __enter__(self):
        self.previous = signal.signal(self.signum, self.handler)
        return self

    def __exit__(self, *exc):
        signal.signal(self.signum, self.previous)
        return False


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


def _peek(stream: DataStream) -> Iterator[tuple]:
    """The first batch of the stream's current epoch, leaving its position unchanged."""
    position = stream.state()
    try:
        for batch in stream:
            yield batch
            break
    finally:
        stream.set_state(position)


def _groups(batches, k: int):
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def _concat(micro: list[tuple]) -> tuple:
    fields = [[m[i] for m in micro] for i in range(len(micro[0]))]  # one list per array
    return tuple(jnp.concatenate(f) if len(f) > 1 else jnp.asarray(f[0]) for f in fields)


def _pad(micro: list[tuple], size: int) -> tuple[tuple, jax.Array]:
    """Concatenate micro-batches and pad to `size` samples at weight 0 (one compilation)."""
    batch = _concat(micro)
    n = batch[0].shape[0]
    weights = jnp.ones((max(n, size),), jnp.float32)
    if n < size:
        index = jnp.arange(size) % n
        batch = tuple(x[index] for x in batch)
        weights = (jnp.arange(size) < n).astype(jnp.float32)
    return batch, weights
