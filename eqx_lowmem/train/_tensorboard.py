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

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

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
        self._writer = _summary_writer()(str(self.log_dir), purge_step=purge)
        self._clock: tuple[float, int] | None = None

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """Write each value that is not None at `step`."""
        for tag, value in values.items():
            if value is not None:
                if self._writer is None or not self._room():
                    return
                self._writer.add_scalar(tag, float(value), step)

    def update(self, trainer: Any, values: dict[str, Any]) -> None:
        """The scalars of one update (`values`: its metrics as Python numbers)."""
        if self._writer is None:
            return
        now, step = time.monotonic(), trainer.updates
        rate = None
        if self._clock is not None and step > self._clock[1] and now > self._clock[0]:
            rate = (step - self._clock[1]) / (now - self._clock[0])
        self._clock = (now, step)
        scale = values.get("loss_scale") if trainer.step_fn.loss_scale is not None else None
        self.scalars(
            step,
            {
                "train/loss": values.get("loss"),
                "train/grad_norm": values.get("grad_norm"),
                "train/loss_scale": scale,
                "train/skipped": 0.0 if values.get("finite", True) else 1.0,
                "train/learning_rate": learning_rate(trainer.state.opt_state),
                "train/updates_per_second": rate,
                "train/memory_bytes_in_use": memory_in_use(),
            },
        )

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


@contextlib.contextmanager
def tensorboard(trainer):
    """`trainer._writer` for one `fit` when it has a `log_dir`, closed after it."""
    trainer._writer = None
    if trainer.log_dir is not None:
        trainer._writer = ScalarWriter(trainer.log_dir, resumed_at=trainer.updates or None)
    try:
        yield trainer._writer
    finally:
        if trainer._writer is not None:
            trainer._writer.close()
            trainer._writer = None
