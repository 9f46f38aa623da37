"""The Trainer's training loop: updates over the stream's epochs, reading each update's
metrics while the next one runs, and saving, evaluating and stopping between them."""

import itertools
import math
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ..data import DataStream
from ._batches import concat, groups, pad
from ._checks import check_data
from ._progress import Progress
from ._resume import save
from ._run import Run, fresh_partial
from ._signals import check_interrupt


def train(trainer, run: Run) -> None:
    """Train `trainer` until `run` is done, then save."""
    _catch_up(trainer, run)
    bar = Progress(trainer.progress, trainer.log_seconds, run.target(trainer.updates))
    run.last_save = time.monotonic()
    try:
        while not run.done(trainer.updates):
            check_interrupt(trainer, run)
            _epoch(trainer, run, bar)
        save(trainer, run)
    finally:
        bar.close()


def _epoch(trainer, run: Run, bar: Progress) -> None:
    """Updates from the stream's position to the end of its epoch (or of the run)."""
    stream = run.stream
    epoch = stream.epoch
    check = _host_check(trainer) if trainer.check_data else None
    batches = stream.prefetch(sharding=_prefetch_sharding(trainer, stream), check=check)
    pending: tuple[dict, int] | None = None  # an update whose metrics are not read yet
    # Read an update's metrics while the next one runs, when no decision waits on them:
    # with a loss scale a non-finite update is skipped inside the step; without one it
    # must stop training before the next update is applied.
    overlap = trainer.step_fn.loss_scale is not None
    served = False
    try:
        for micro in groups(batches, trainer.accumulate):
            served = True
            batch, weights = _assemble(trainer, micro, stream.batch_size)
            assert trainer.state is not None
            trainer.state, metrics = trainer.step_fn(trainer.state, batch, weights)
            trainer.updates += 1
            if pending is not None:
                _finish(trainer, run, bar, *pending)
            pending = (metrics, epoch)
            ended = stream.epoch != epoch
            if not overlap or ended or _decision_due(trainer, run):
                _finish(trainer, run, bar, *pending)
                pending = None
                if ended:
                    _close_epoch(trainer, run, epoch)
                _act(trainer, run)
                if run.done(trainer.updates):
                    return
        if pending is not None:
            _finish(trainer, run, bar, *pending)
            pending = None
    except _BadBatch as bad:
        if pending is not None:  # keep the state and the history in step
            _finish(trainer, run, bar, *pending)
        raise ValueError(
            f"micro-batch {bad.index % trainer.accumulate + 1} of update "
            f"{run.partial['updates'] + 1} of epoch {epoch + 1} (before that update; "
            f"check_data=False skips this check): {bad.error}"
        ) from bad.error
    finally:
        batches.close()  # stops and joins the prefetch thread on every exit path
    if not served:
        raise ValueError(
            f"the stream served no batches in epoch {epoch + 1}: an empty source, "
            "drop_last with fewer samples than a batch, or a source function that "
            "returned an exhausted iterator (it must return a fresh one each call)."
        )
    if run.partial["epoch"] == epoch:  # the epoch ended without its last update
        _close_epoch(trainer, run, epoch)
        _act(trainer, run)


class _BadBatch(Exception):
    """`check_batch`'s `error` for the `index`-th batch (from 0) of an epoch's prefetch."""

    def __init__(self, index: int, error: ValueError):
        super().__init__(index, error)
        self.index, self.error = index, error


def _host_check(trainer) -> Callable[[tuple], None]:
    """`check_batch` for the prefetch thread: on each micro-batch's host arrays before
    they are copied to the device (on a GPU no copy back and no wait for the step), with
    the model's shapes only (nothing the running step donates)."""
    assert trainer.state is not None
    model = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
        trainer.state.model,
    )
    count = itertools.count()  # the batches of one epoch's prefetch start an update
    dtype = trainer.step_fn.policy.compute_dtype

    def check(batch: tuple) -> None:
        index = next(count)
        try:
            check_data(trainer.loss, model, tuple(batch), dtype)
        except ValueError as e:
            raise _BadBatch(index, e) from e

    return check


def _decision_due(trainer, run: Run) -> bool:
    """Whether the state just dispatched must be read now (a save, an evaluation, the
    end, an interrupt)."""
    u = trainer.updates
    return (
        trainer._interrupted
        or run.done(u)
        or (trainer.checkpoint_every is not None and u % trainer.checkpoint_every == 0)
        or (run.eval_every is not None and u % run.eval_every == 0)
        or _time_to_save(trainer, run)
    )


def _time_to_save(trainer, run: Run) -> bool:
    return (
        trainer.checkpoint_dir is not None
        and trainer.checkpoint_seconds is not None
        and time.monotonic() - run.last_save >= trainer.checkpoint_seconds
    )


def _act(trainer, run: Run) -> None:
    """After an update whose metrics are read: evaluate, save, stop on Ctrl-C."""
    u = trainer.updates
    if run.eval_every is not None and u % run.eval_every == 0:
        _evaluate_into(trainer, run)
    if (
        (trainer.checkpoint_every is not None and u % trainer.checkpoint_every == 0)
        or _time_to_save(trainer, run)
        or run.partial["updates"] == 0  # an epoch just ended
    ):
        save(trainer, run)
    check_interrupt(trainer, run)


def _finish(trainer, run: Run, bar: Progress, metrics: dict, epoch: int) -> None:
    """Wait for an update's metrics; stop on a non-finite loss; update the running mean."""
    values = {k: v.item() for k, v in jax.device_get(metrics).items()}
    partial = run.partial
    if not values.get("params_finite", True):
        raise FloatingPointError(_nonfinite_parameters(trainer, run, epoch))
    if not values["finite"]:
        if trainer.step_fn.loss_scale is None:
            raise FloatingPointError(
                f"non-finite loss or gradient at update {partial['updates'] + 1} of epoch "
                f"{epoch + 1} (update {trainer.updates} of the run); that update was not "
                "applied, no checkpoint was written, and trainer.state is the last good "
                "state. Look for NaN or inf in the data"
                f"{_FLOAT16_HINT if _float16(trainer) else ''}, or lower the learning "
                "rate, clip gradients, or use a loss scale with 16-bit compute."
            )
        run.skips += 1
        if run.skips >= trainer.max_consecutive_skips:
            raise FloatingPointError(
                f"{run.skips} updates in a row were skipped for a non-finite loss or "
                f"gradient (the last: update {partial['updates'] + 1} of epoch "
                f"{epoch + 1}), down to a loss scale of {values['loss_scale']:g}: the "
                "data or the model, not the scale, is at fault (look for NaN or inf in "
                f"the data{_FLOAT16_HINT if _float16(trainer) else ''}). Raise "
                "max_consecutive_skips if the scale needs longer."
            )
    else:
        run.skips = 0
    if math.isfinite(values["loss"]):
        partial["sum"] += values["loss"] * values["weight"]
        partial["weight"] += values["weight"]
    partial["updates"] += 1
    bar.update(trainer.updates, values["loss"], epoch)
    if trainer._writer is not None:
        trainer._writer.update(trainer, values)
    if trainer.callback is not None:
        trainer.callback(
            trainer,
            {"epoch": epoch, "update": partial["updates"], "updates": trainer.updates, **values},
        )


_FLOAT16_HINT = (
    "; under float16 compute, activations or a loss beyond float16's largest value "
    "(65504) overflow to inf: normalise the inputs, or use precision='mixed_bf16' "
    "(bfloat16 has float32's range)"
)


def _float16(trainer) -> bool:
    return jnp.dtype(trainer.step_fn.policy.compute_dtype) == jnp.float16


def _nonfinite_parameters(trainer, run: Run, epoch: int) -> str:
    """The error for parameters that an update made non-finite from a finite gradient."""
    saved = run.saved[0] if run.saved is not None else None
    if trainer.checkpoint_dir is None:
        last = "there is no checkpoint_dir, so no good state is kept"
    elif saved is None:
        last = f"no checkpoint is in {trainer.checkpoint_dir} yet"
    else:
        last = (
            f"the last good state is the checkpoint of update {saved} in "
            f"{trainer.checkpoint_dir} (a rerun resumes from it)"
        )
    return (
        f"the parameters became non-finite (NaN or inf) at update "
        f"{run.partial['updates'] + 1} of epoch {epoch + 1} (update {trainer.updates} of "
        "the run, or just before it): the optimizer's update or the after_update hook made "
        "them so, from a finite loss and gradient. trainer.state holds those non-finite "
        f"parameters and was not saved; {last}. Look for a NaN or inf learning rate or "
        "schedule, an optimizer dividing by zero (optax.adam(eps=0) on a parameter that gets "
        "no gradient), or an after_update hook writing NaN."
    )


def _close_epoch(trainer, run: Run, epoch: int) -> None:
    partial = run.partial
    mean = partial["sum"] / partial["weight"] if partial["weight"] > 0 else math.nan
    run.history["train_loss"].append(mean)
    if trainer._writer is not None:
        trainer._writer.scalars(trainer.updates, {"train/epoch_loss": mean})
    if run.eval_stream is not None and run.eval_every is None:
        _evaluate_into(trainer, run)
    run.partial = fresh_partial(epoch + 1)


def _evaluate_into(trainer, run: Run) -> None:
    assert run.eval_stream is not None
    run.history["eval_loss"].append(trainer.evaluate(run.eval_stream))
    run.history["eval_update"].append(trainer.updates)
    if trainer._writer is not None:
        trainer._writer.scalars(trainer.updates, {"eval/loss": run.history["eval_loss"][-1]})


def _catch_up(trainer, run: Run) -> None:
    """Close an epoch that a checkpoint saw end but not closed (kept for checkpoints
    taken between an epoch's last update and its close)."""
    if run.partial["epoch"] < run.stream.epoch:
        _close_epoch(trainer, run, run.partial["epoch"])
        save(trainer, run)


def _prefetch_sharding(trainer, stream: DataStream) -> NamedSharding | None:
    """Batches go straight to their devices when every batch divides over them; a
    short last batch that does not is placed by the step instead."""
    if trainer.mesh is None:
        return None
    n = int(trainer.mesh.shape[trainer.data_axis])
    samples = stream.num_samples
    regular = stream.drop_last or (samples is not None and samples % stream.batch_size % n == 0)
    return NamedSharding(trainer.mesh, P(trainer.data_axis)) if regular else None


def _assemble(trainer, micro: list[tuple], size: int) -> tuple[tuple, jax.Array]:
    """The whole batch of one update from its micro-batches. A short last update is
    padded at weight 0 to the full size (one compilation), except for a stateful model,
    whose batch statistics must see only real samples."""
    if trainer.state is not None and trainer.state.model_state is not None:
        batch = concat(micro)
        return batch, jnp.ones((batch[0].shape[0],), jnp.float32)
    return pad(micro, trainer.accumulate * size)
