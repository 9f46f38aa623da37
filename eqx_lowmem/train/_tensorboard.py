"""TensorBoard scalars of a run (`Trainer(..., log_dir=...)`), written by tensorboardX.

tensorboardX is an optional dependency (`pip install -e '.[tensorboard]'`), imported when a
writer is made. Only process 0 writes. Tags, each at the run's update count:

- `train/loss`, `train/grad_norm`, `train/loss_scale` (with a loss scale),
  `train/skipped` (1 for an update skipped for a non-finite loss, else 0),
  `train/learning_rate` (when the optimizer keeps it in its state: `optax.inject_hyperparams`),
  `train/updates_per_second`, `train/memory_bytes_in_use` (where the backend reports it: GPUs
  and TPUs, not XLA:CPU);
- `train/epoch_loss` at the end of every epoch, `eval/loss` at every evaluation.
"""

import os
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._hooks import Hook, StepInfo

_INSTALL = "pip install -e '.[tensorboard]' (or: pip install 'tensorboardX>=2.6,<3')"


def _summary_writer():
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise ImportError(
            f"Trainer(log_dir=...) writes TensorBoard files with tensorboardX, which is not "
            f"installed ({e}). Install it with: {_INSTALL}."
        ) from e
    return SummaryWriter


def learning_rate(opt_state: Any) -> float | None:
    """The learning rate an optax state holds (`optax.inject_hyperparams`), or None."""
    found = []

    def visit(x: Any) -> Any:
        hyper = getattr(x, "hyperparams", None)
        if isinstance(hyper, dict) and "learning_rate" in hyper and not found:
            found.append(hyper["learning_rate"])
        return x

    jax.tree.map(visit, opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
    return float(np.asarray(jax.device_get(found[0]))) if found else None


def memory_in_use() -> int | None:
    """Bytes in use on the first local device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_in_use")


class ScalarWriter:
    """Scalars of one run into a TensorBoard log directory.

    Example:
        >>> import tempfile
        >>> writer = ScalarWriter(tempfile.mkdtemp())
        >>> writer.scalars(1, {"train/loss": 0.5})
        >>> writer.close()
    """

    def __init__(self, log_dir: str | os.PathLike, *, resumed_at: int | None = None):
        """Args:
        log_dir: the directory (created); each writer adds an events file.
        resumed_at: the update a resumed run continues from: TensorBoard then drops the
            earlier files' events after it (those a killed run wrote past its checkpoint).
        """
        self.log_dir = Path(log_dir)
        self._writer = None
        if jax.process_index() != 0:
            return
        purge = None if resumed_at is None else resumed_at + 1
        # tensorboardX names a file by the second it opened it: two writers in one second
        # (a run resumed at once) would write one file, the second truncating the first.
        # A suffix of nanoseconds keeps them apart, in order.
        suffix = f".{time.time_ns():020d}"
        self._writer = _summary_writer()(str(self.log_dir), purge_step=purge,
                                         filename_suffix=suffix)  # fmt: skip

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """Write each value that is not None at `step`."""
        for tag, value in values.items():
            if value is not None:
                if self._writer is None or not self._room():
                    return
                self._writer.add_scalar(tag, float(value), step)

    def _room(self) -> bool:
        """Whether an event can be queued: tensorboardX's writer thread still runs, and its
        queue has room (waiting while the thread drains it). The thread dies on a write
        error (a full disk, a removed directory), after which every scalar would be dropped
        silently and, once its queue is full, the next one would block the run forever:
        then warn once and stop writing."""
        file_writer = getattr(self._writer, "file_writer", None)
        event_writer = getattr(file_writer, "event_writer", None)
        worker = getattr(event_writer, "_worker", None)
        events = getattr(event_writer, "_event_queue", None)
        if worker is None:  # another tensorboardX layout: trust it
            return True
        while worker.is_alive():
            if events is None or not events.full():
                return True
            time.sleep(0.005)
        self._writer = None  # not closed: closing waits on the dead thread's queue
        warnings.warn(
            f"TensorBoard scalars can no longer be written to {self.log_dir}: tensorboardX's "
            "writer stopped on an error (a full disk, or the directory removed or made "
            "read-only). Training goes on without them and the checkpoints are unaffected; "
            "free space and run again to log again (a resumed run appends).",
            RuntimeWarning,
            stacklevel=2,
        )
        return False

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None and self._room():  # a dead writer is dropped, warned
            writer, self._writer = self._writer, None
            writer.close()


class TensorBoard(Hook):
    """The run's scalars into `log_dir` (`Trainer(log_dir=...)`), one writer per `fit`."""

    def __init__(self, log_dir: str | os.PathLike, loss_scale: bool = False):
        self.log_dir = Path(log_dir)
        self.loss_scale = loss_scale  # the step has one: log it
        self.writer: ScalarWriter | None = None
        self._clock: tuple[float, int] | None = None  # (time, update) of the last update
        self._reads_rate: Any = None  # the optimizer state's learning rate: read it each update

    def on_start(self, info: StepInfo) -> None:
        self.writer = ScalarWriter(self.log_dir, resumed_at=info.update or None)
        self._clock = None
        state = info.state()
        self._reads_rate = state is not None and learning_rate(state.opt_state) is not None

    def due(self, update: int) -> bool:
        # The learning rate is read from the state after each update, so with a loss
        # scale the metrics are not read while the next update runs.
        return bool(self._reads_rate)

    def on_update(self, info: StepInfo) -> None:
        assert self.writer is not None
        now, step, values = time.monotonic(), info.update, info.metrics
        rate = None
        if self._clock is not None and step > self._clock[1] and now > self._clock[0]:
            rate = (step - self._clock[1]) / (now - self._clock[0])
        self._clock = (now, step)
        state = info.state() if self._reads_rate else None
        self.writer.scalars(
            step,
            {
                "train/loss": values.get("loss"),
                "train/grad_norm": values.get("grad_norm"),
                "train/loss_scale": values.get("loss_scale") if self.loss_scale else None,
                "train/skipped": 0.0 if values.get("finite", 1.0) else 1.0,
                "train/learning_rate": None if state is None else learning_rate(state.opt_state),
                "train/updates_per_second": rate,
                "train/memory_bytes_in_use": memory_in_use(),
                "eval/loss": values.get("eval_loss"),
            },
        )

    def on_epoch_end(self, info: StepInfo) -> None:
        assert self.writer is not None
        self.writer.scalars(
            info.update,
            {"train/epoch_loss": info.metrics.get("train_loss"),
             "eval/loss": info.metrics.get("eval_loss")},
        )  # fmt: skip

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
