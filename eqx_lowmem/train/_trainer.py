"""The Trainer: `fit` over arrays or a stream, with every memory tool, never losing a run.

The Trainer owns the loop: `fit` and its epochs and updates are its own methods, over one
`RunState` (`_run`). Everything optional is a hook (`_hooks.Hook`) that owns its state:
checkpoints and resume (`_resume`), stop signals (`_signals`), evaluation (`_evaluate`),
the progress bar (`_progress`), TensorBoard (`_tensorboard`); the Trainer's keyword
arguments build them for each `fit`, and `hooks=[...]` adds a user's own.
"""

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh

from .._checks import check_int
from ..data import DataStream
from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy
from ._batches import groups
from ._checks import (
    BatchCheck,
    check_directory,
    check_fit_args,
    check_mesh,
    check_model_accepts,
    check_trainer_args,
    make_eval_stream,
    make_stream,
)
from ._config import StepConfig, step_config as resolve_step_config
from ._evaluate import Evaluation, eval_function, mean_loss
from ._hooks import Callback, Hook, StepInfo, call_hooks, check_hooks
from ._loop import (
    NO_BATCHES,
    BadBatch,
    assemble,
    bad_batch_error,
    check_arrays,
    epoch_batches,
    host_check,
    host_lag,
    on_host,
    shapes_of,
    skip_or_stop,
)
from ._progress import Progress
from ._resume import Checkpoints, settings
from ._run import EpochSums, RunState
from ._signals import Interrupts
from ._state import TrainState, copy_arrays, merge, split
from ._tensorboard import TensorBoard


class Trainer:
    """Train a model with micro-batch accumulation, remat, precision and several devices.

    A run is never lost: with `checkpoint_dir`, `fit` saves atomically at the end of every
    epoch, every few minutes (`checkpoint_seconds`), every `checkpoint_every` updates, at
    the end and on Ctrl-C, keeps the last `keep_checkpoints` files, and a rerun of the same
    script resumes bit for bit where the last checkpoint left off.

    Everything optional (checkpoints, Ctrl-C, evaluation, progress, TensorBoard, `callback`)
    is a `Hook` built from the arguments; `hooks=[...]` adds your own (a logger, a stop).

    The Trainer holds the model once, in `trainer.state` (its parameters, optimizer state,
    PRNG key and loss scale); a second `fit` continues from it. Its steps donate the state's
    buffers, so a model read from `trainer.model` (or `model_state`) before a later `fit`
    would be deleted by it: that `fit` starts from a copy of the model instead, and the
    one read stays usable (memory: one more copy of the parameters while it is kept;
    `trainer.state.model` is not copied).

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

    # The state as a `TrainState`, or as the arrays and the rest a step takes (`_state.split`:
    # during `fit` it lives there, and `state` builds the TrainState when read). Both None
    # before the first `fit`.
    _state: TrainState | None = None
    _arrays: tuple[list, Any] | None = None

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
        checkpoint_format: Literal["auto", "file", "orbax"] = "auto",
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
        log_dir: str | os.PathLike | None = None,
        hooks: Sequence[Any] = (),
        step_config: StepConfig | None = None,
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
        step_config: every option of the step in one `StepConfig` (the same value
            `memory_report` and `plan` take), instead of the keyword arguments above
            (which must then be left at their defaults).
        model_state: `eqx.nn.State` for stateful layers (BatchNorm); the loss then takes and
            returns it.
        checkpoint_dir: where `fit` saves checkpoints (model, optimizer state, update
            counter, PRNG key, loss scale, the stream's position, the history and the
            settings of the run) and from where it resumes. The directory is locked while
            `fit` runs (a second process gets a clear error) and temporary files that a
            killed run left are removed.
        checkpoint_format: `"file"`: `checkpoint.ckpt`, one file written synchronously
            (older ones kept as `checkpoint-<updates>.ckpt`); `"orbax"`: orbax step
            directories `checkpoint_<updates>`, written asynchronously (training goes on
            while they are written), readable by orbax's own API onto any mesh; needs
            orbax-checkpoint (`pip install -e '.[orbax]'`). `"auto"`: the format the
            directory holds; else orbax for `shard="fsdp"` or several processes, the file
            otherwise.
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
        interrupt: on Ctrl-C (SIGINT), SIGTERM (a cluster's or cloud's preemption) or
            SIGHUP (a closed terminal; not under `nohup`, which ignores it), `fit` finishes
            the update in flight, saves a checkpoint, and then `"exit"`s the program with
            the one line "interrupted at update N; run again to resume" ("stopped by
            SIGTERM at ...") and exit status 128 + the signal's number (130 for Ctrl-C,
            143 for SIGTERM), or `"raise"`s KeyboardInterrupt (for notebooks:
            `trainer.state` is the saved state). A second signal stops at once, without
            saving. Only in the main thread (Python delivers signals there).
        check_data: check the data on the host for what a loss would silently accept
            (`eqx_lowmem.train._losses.check_batch`: NaN or inf, and labels or token ids
            outside the model's classes for the built-in losses), before it trains on it.
            Arrays in memory (`fit(X, y)`, `eval_data=(X, y)`, a `DataStream` over them)
            are checked whole once, before the first update (evaluation arrays again at
            each evaluation): one pass over them, as fast as the memory reads. A stream
            that reads files or runs an iterator has each micro-batch checked before its
            update, as it is read (one pass over its host arrays, in the prefetch thread:
            no copy back, no wait for the step). False checks only the first batch.
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
        log_dir: write TensorBoard scalars here (loss, evaluation loss, learning rate
            where the optimizer state holds it, loss scale, skipped updates, updates per
            second, device memory in use where reported; see
            `eqx_lowmem.train._tensorboard`). Needs tensorboardX
            (`pip install -e '.[tensorboard]'`).
        hooks: your own `Hook`s (a logger, early stopping), called after the ones the
            arguments above build (evaluation, progress, TensorBoard, `callback`) and
            before the checkpoints', in order. See `Hook`.
        """
        config = check_trainer_args(
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_seconds=checkpoint_seconds,
            keep_checkpoints=keep_checkpoints,
            max_consecutive_skips=max_consecutive_skips,
            progress=progress,
            log_seconds=log_seconds,
            interrupt=interrupt,
            config=config,
            checkpoint_format=checkpoint_format,
            log_dir=log_dir,
            callback=callback,
        )
        self.hooks: list[Hook] = check_hooks(hooks)
        step = resolve_step_config(
            step_config,
            accumulate=accumulate,
            precision=precision,
            loss_scale=loss_scale,
            mesh=mesh,
            data_axis=data_axis,
            shard=shard,
            after_update=after_update,
            jit=compile,
        )
        if model_state is not None and not step.has_state:
            step = step.replace(has_state=True)
        self.step_config = step
        self.step_fn = step.build(loss, optimizer)
        self.loss = loss
        self.optimizer = optimizer
        self.accumulate = step.accumulate
        self.mesh = step.mesh
        self.data_axis = step.data_axis
        self.shard = step.shard
        # The settings of the hooks each `fit` builds (read then: they may be changed).
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.checkpoint_format = checkpoint_format
        self.checkpoint_every = checkpoint_every
        self.checkpoint_seconds = checkpoint_seconds
        self.keep_checkpoints = keep_checkpoints
        self.check_resume = check_resume
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.progress = progress
        self.log_seconds = log_seconds
        self.interrupt = interrupt
        self.callback = callback
        self.max_consecutive_skips = max_consecutive_skips
        self.check_data = check_data
        self.config = config
        # Until the first fit; then the model lives only in `state`.
        self._model = model
        self._model_state = model_state
        self._handed_out: TrainState | None = None  # the state `model` last handed out
        self._run: RunState | None = None  # the last fit's (its counters carry over)
        self._target: int | None = None  # the run's last update, where known
        self._fitting = threading.Lock()  # held while `fit` runs
        self._eval_fn = eval_function(loss, self.step_fn.policy, jit=step.jit, mesh=step.mesh)
        self._traced: set = set()  # (model, batch) shapes the loss was traced on

    @property
    def state(self) -> TrainState | None:
        """The run's `TrainState` (parameters, optimizer state, key, loss scale), None
        before the first `fit`. The next update donates its arrays: copy what you keep."""
        if self._state is None and self._arrays is not None:
            self._state = merge(*self._arrays)
        return self._state

    @state.setter
    def state(self, state: TrainState | None) -> None:
        self._state, self._arrays = state, None

    @property
    def updates(self) -> int:
        """Updates taken in the run (skipped ones included); a later `fit` continues it."""
        return 0 if self._run is None else self._run.updates

    @property
    def history(self) -> dict[str, list]:
        """The run's history (what `fit` returns): `train_loss` per epoch, and what hooks
        added (`eval_loss`, `eval_update`)."""
        return {"train_loss": []} if self._run is None else self._run.history

    @property
    def model(self) -> Any:
        """The trained model (parameters in the policy's storage dtype). It stays usable
        after a later `fit` (which then trains a copy)."""
        if self.state is None:
            return self._model
        self._handed_out = self.state
        return self.state.model

    @property
    def model_state(self) -> Any:
        if self.state is None:
            return self._model_state
        self._handed_out = self.state
        return self.state.model_state

    def _held(self) -> tuple[Any, Any]:
        """`(model, model_state)` for the Trainer's own use (not handed out)."""
        if self.state is None:
            return self._model, self._model_state
        return self.state.model, self.state.model_state

    def _keep_handed_out(self) -> None:
        """Before steps donate the state: if `model` or `model_state` handed out this
        state's arrays, train copies of them, so what the caller holds stays usable."""
        handed, self._handed_out = self._handed_out, None
        state = self.state
        if state is not None and handed is state:
            model, model_state = copy_arrays((state.model, state.model_state))
            self.state = dataclasses.replace(state, model=model, model_state=model_state)

    @property
    def checkpoint_path(self) -> Path | None:
        """The newest checkpoint: `checkpoint_dir / "checkpoint.ckpt"` (older ones kept as
        `checkpoint-<updates>.ckpt`), or orbax's newest step directory
        `checkpoint_dir / "checkpoint_<updates>"`; None without one."""
        return None if self.checkpoint_dir is None else self._checkpoints().path

    # ---------------------------------------------------------------------------------- fit

    def fit(
        self,
        X: Any = None,
        y: Any = None,
        *,
        epochs: int | None = None,
        updates: int | None = None,
        micro_batch: int | None = None,
        key: Any,
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
            key: PRNG key (`jr.PRNGKey(0)` or `jr.key(0)`, as `Step.init` takes; checked
                here with a clear error): the data order (with `shuffle`), dropout and
                stochastic rounding derive from it.
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
                training in `checkpoint_dir`. RuntimeError: if this Trainer's `fit` is
                running already (another thread).
            FloatingPointError: for a non-finite loss without a loss scale (the update is
                not applied, no checkpoint is written, and `trainer.state` is the last good
                state), or `max_consecutive_skips` skipped updates in a row with one.
        """
        if not self._fitting.acquire(blocking=False):
            raise RuntimeError(
                "this Trainer's fit is already running (in another thread, or re-entered "
                "from a callback): one Trainer trains one run at a time. Wait for it to "
                "return, or train a second model with a second Trainer (and its own "
                "checkpoint_dir)."
            )
        try:
            return self._fit(X, y, epochs, updates, micro_batch, key, shuffle, stream,
                             eval_data, eval_every)  # fmt: skip
        finally:
            self._fitting.release()

    def _fit(self, X, y, epochs, updates, micro_batch, key, shuffle, stream, eval_data,
             eval_every) -> dict[str, list[float]]:  # fmt: skip
        check_fit_args(key, epochs, updates, eval_every, eval_data)
        data_key, state_key = jr.split(key)
        stream = make_stream(X, y, micro_batch, data_key, shuffle, stream, self.accumulate)
        check_mesh(self.mesh, self.data_axis, stream.batch_size)
        eval_stream = make_eval_stream(eval_data, stream.batch_size)
        check_directory(self.checkpoint_dir)
        if self.state is None:
            model, model_state = self._model, self._model_state
            self.state = self.step_fn.init(model, key=state_key, model_state=model_state)
            self._model = self._model_state = None  # held once, in the state
        self._keep_handed_out()
        # The data's values are checked before the loss is traced on them (a complex array
        # or a float16 overflow gets its own error) and before their use: arrays in memory
        # whole, once, here; a stream that reads (files, an iterator) batch by batch as it
        # serves them (`_epoch`, `evaluate`), and its first batch here.
        for data, what, named in ((stream, "a micro-batch", "the training data"),
                                  (eval_stream, "eval_data", "eval_data")):  # fmt: skip
            if data is None:
                continue
            whole = self.check_data and data.in_memory
            if whole:
                self._check_arrays(data, f"{named} (checked before the first update)",
                                   self.state.model)  # fmt: skip
            check_model_accepts(self.step_fn, self.loss, self.state, data, what, self._traced,
                                check_values=not whole)  # fmt: skip
        # Counted from here: a second fit without a checkpoint trains this many more.
        run = RunState(
            stream=stream,
            settings=settings(self.step_fn, self.optimizer, stream.batch_size, self.config),
            epochs=epochs,
            limit=updates,
            updates=self.updates,
            start=self.updates,
            start_epoch=stream.epoch,
            sums=EpochSums(stream.epoch),
        )
        if eval_stream is not None:
            run.history.update(eval_loss=[], eval_update=[])
        checkpoints = None if self.checkpoint_dir is None else self._checkpoints()
        hooks = self._hooks(eval_stream, eval_every, checkpoints)
        with contextlib.ExitStack() as stack:
            if checkpoints is not None:
                stack.enter_context(checkpoints.opened(run))
                restored = checkpoints.restore(self.state)
                self.state = self.state if restored is None else restored
            self._run = run
            for hook in hooks:
                stack.callback(hook.close)  # closed in reverse order, also on an error
            self._train(run, hooks, checkpoints)
        return run.history

    def _checkpoints(self) -> Checkpoints:
        assert self.checkpoint_dir is not None
        return Checkpoints(self.checkpoint_dir, format=self.checkpoint_format,
                           every=self.checkpoint_every, seconds=self.checkpoint_seconds,
                           keep=self.keep_checkpoints, check_resume=self.check_resume,
                           sharded=self.shard == "fsdp")  # fmt: skip

    def _hooks(self, eval_stream: DataStream | None, eval_every: int | None,
               checkpoints: Checkpoints | None) -> list[Hook]:  # fmt: skip
        """One `fit`'s hooks in call order: evaluation (the others hear its loss), progress,
        TensorBoard, `callback`, yours, checkpoints (saving all that), stop signals."""
        hooks: list[Hook] = []
        if eval_stream is not None:
            hooks.append(Evaluation(self.evaluate, eval_stream, eval_every))
        progress = Progress(self.progress, self.log_seconds)
        if progress.mode is not None:  # progress=False: nothing to call per update
            hooks.append(progress)
        if self.log_dir is not None:
            hooks.append(TensorBoard(self.log_dir, loss_scale=self.step_fn.loss_scale is not None))
        if self.callback is not None:
            hooks.append(Callback(self.callback, self))
        hooks += self.hooks
        if checkpoints is not None:
            hooks.append(checkpoints)
        hooks.append(Interrupts(self.interrupt, saving=checkpoints is not None))
        return hooks

    # ------------------------------------------------------------------------- the loop

    def _train(self, run: RunState, hooks: list[Hook], checkpoints: Checkpoints | None) -> None:
        """Train until `run` is done (or a hook stops it), then tell the hooks."""
        self._target = run.target(self.accumulate)
        call_hooks(hooks, "on_start", self._info(run, run.updates, run.sums.epoch), run.history)
        if run.sums.epoch < run.stream.epoch:
            # A checkpoint taken between an epoch's last update and its close.
            self._close_epoch(run, hooks, run.sums.epoch)
        while not run.done():
            self._epoch(run, hooks, checkpoints)
        call_hooks(hooks, "on_end", self._info(run, run.updates, run.sums.epoch), run.history)

    def _epoch(self, run: RunState, hooks: list[Hook], checkpoints: Checkpoints | None) -> None:
        """Updates from the stream's position to the end of its epoch (or of the run).

        Update n's metrics are read while update n + 1 runs (on the CPU backend, while
        updates n + 1 to n + `host_lag` run: up to 16), unless a hook is `due` at n or the
        epoch or run ends there, or the step skips a non-finite update without a loss scale
        (`skip_nonfinite=True`): then trainer.state must stay the last good state, and a
        non-finite update stops training before the next is applied."""
        assert self.state is not None
        stream, epoch = run.stream, run.stream.epoch
        check = None
        if self.check_data and not stream.in_memory:  # arrays in memory: checked by `_fit`
            dtype = self.step_fn.policy.compute_dtype
            check = host_check(self.loss, shapes_of(self.state.model), dtype)
        batches = epoch_batches(stream, self.mesh, self.data_axis, check)
        size, stateful = self.accumulate * stream.batch_size, self.state.model_state is not None
        overlap = self.step_fn.loss_scale is not None or not self.step_fn.skip_nonfinite
        pending: list[tuple[Any, int]] = []  # (metrics, update) dispatched, not read yet
        copy_ahead = not on_host(self.mesh)  # on the CPU backend already in host memory
        lag = 1 if copy_ahead else None  # on the CPU backend, from the first batch's bytes
        served = False
        # Only the hooks with something to do are called each update.
        dues = [h for h in hooks if _overrides(h, "due")]
        listening = [h for h in hooks if _overrides(h, "on_update")]
        # The state stays split into what the step takes (its TrainState is built only
        # when read: `state`), and the step is called on that (`Step.call_split`).
        step, (dynamic, static) = self.step_fn.call_split, self._arrays or split(self.state)
        try:
            for micro in groups(batches, self.accumulate):
                served = True
                batch, weights = assemble(micro, size, stateful)
                lag = lag or host_lag(batch)
                dynamic, metrics = step(dynamic, static, batch, weights, packed=True)
                self._state, self._arrays = None, (dynamic, static)
                run.updates += 1
                if copy_ahead:  # to the host as soon as computed
                    metrics.copy_to_host_async()
                pending.append((metrics, run.updates))
                if len(pending) > lag:  # all but this update's, while it runs
                    self._finish(run, listening, checkpoints, pending, epoch, keep=1)
                ended = stream.epoch != epoch
                if not overlap or ended or run.done() or any(h.due(run.updates) for h in dues):
                    self._finish(run, listening, checkpoints, pending, epoch, last=ended)
                    if ended:
                        self._close_epoch(run, hooks, epoch)
                    if run.done():
                        return
            self._finish(run, listening, checkpoints, pending, epoch)
        except BadBatch as bad:
            self._finish(run, listening, checkpoints, pending, epoch)  # state and history in step
            raise bad_batch_error(bad, self.accumulate, run.sums.updates + 1, epoch) from bad.error
        finally:
            batches.close()  # stops the prefetch thread on every exit path
        if not served:
            raise ValueError(NO_BATCHES.format(epoch=epoch + 1))
        if run.sums.epoch == epoch:  # the epoch ended without its last update
            self._close_epoch(run, hooks, epoch)

    def _finish(self, run: RunState, hooks: list[Hook], checkpoints: Checkpoints | None,
                pending: list, epoch: int, keep: int = 0, last: bool = False) -> None:  # fmt: skip
        """For each `(metrics, update)` of `pending` but the newest `keep`, after one wait
        (for the newest of them): stop on a non-finite loss; add it to the epoch's sums;
        tell the `hooks` (those with an `on_update`; `last`: the last of them ends the
        epoch)."""
        count, names = max(len(pending) - keep, 0), self.step_fn.metric_names
        if count:  # the newest: the others come from earlier programs
            jax.block_until_ready(pending[count - 1][0])
        for _ in range(count):
            metrics, update = pending.pop(0)  # packed: one vector (`Step.metric_names`)
            values = dict(zip(names, np.asarray(metrics).tolist(), strict=True))
            sums = run.sums
            if values["finite"] and values.get("params_finite", 1.0):
                run.skips = 0
            else:
                where = f"update {sums.updates + 1} of epoch {epoch + 1}"
                saved = None if checkpoints is None else checkpoints.saved_update
                limit, directory = self.max_consecutive_skips, self.checkpoint_dir
                run.skips = skip_or_stop(
                    values, run.skips, where, update, self.step_fn, limit, directory, saved
                )
            if math.isfinite(values["loss"]):
                sums.sum += values["loss"] * values["weight"]
                sums.weight += values["weight"]
            sums.updates += 1
            if hooks:
                info = self._info(run, update, epoch, sums.updates, values, last and not pending)
                call_hooks(hooks, "on_update", info, run.history)

    def _close_epoch(self, run: RunState, hooks: list[Hook], epoch: int) -> None:
        """Record epoch `epoch`'s mean loss, start the next one's sums, tell the hooks."""
        sums = run.sums
        run.history["train_loss"].append(sums.mean)
        run.sums = EpochSums(epoch + 1)
        info = self._info(run, run.updates, epoch, sums.updates, {"train_loss": sums.mean})
        call_hooks(hooks, "on_epoch_end", info, run.history)

    def _info(self, run: RunState, update: int, epoch: int, epoch_update: int = 0,
              metrics: dict | None = None, last: bool = False) -> StepInfo:  # fmt: skip
        return StepInfo(
            update=update,
            epoch=epoch,
            epoch_update=epoch_update,
            metrics={} if metrics is None else metrics,
            target=self._target,
            last_in_epoch=last,
            read_state=self._state_after,
            request_stop=self._stop,
        )

    def _state_after(self, update: int) -> TrainState | None:  # `StepInfo.state`
        return self.state if update == self.updates else None

    def _stop(self) -> None:  # `StepInfo.stop`: the loop ends after the update in flight
        if self._run is not None:
            self._run.stop = True

    # ------------------------------------------------------------------------ evaluate

    def evaluate(self, data: tuple | DataStream, micro_batch: int | None = None) -> float:
        """Mean loss over every sample of `data` (arrays or a `DataStream`), no update.

        The model runs in `eqx.nn.inference_mode` and the loss gets no key: dropout is off
        and BatchNorm uses its running statistics.
        """
        check_int("micro_batch", micro_batch, 1, none=True, alternative="samples per batch")
        stream = (
            data if isinstance(data, DataStream) else make_eval_stream(data, micro_batch or 256)
        )
        assert stream is not None
        model, model_state = self._held()
        check = None  # the data checked as `fit` checks it: arrays whole, else batch by batch
        if self.check_data and not stream.in_memory:
            check = BatchCheck(self.loss, model, self.step_fn.policy.compute_dtype)
        elif self.check_data:
            self._check_arrays(stream, "the evaluation data", model)
        return mean_loss(self._eval_fn, model, model_state, stream, check)

    def _check_arrays(self, stream: DataStream, what: str, model: Any) -> None:
        """`check_data` on the arrays in memory that `stream` serves, whole."""
        assert stream.arrays is not None
        dtype = self.step_fn.policy.compute_dtype
        check_arrays(self.loss, shapes_of(model), dtype, stream.arrays, what)


def _overrides(hook: Any, method: str) -> bool:
    """Whether `hook` has its own `method` (a `Hook` subclass's default does nothing)."""
    return getattr(type(hook), method, None) is not getattr(Hook, method)
