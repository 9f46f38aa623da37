"""One run's state: everything `Trainer.fit` tracks besides the model, in one record."""

import dataclasses
from typing import Any

from ..data import DataStream


@dataclasses.dataclass
class EpochSums:
    """The running sums of an epoch not yet closed (what a checkpoint records of it)."""

    epoch: int
    sum: float = 0.0  # of loss x weight over its updates' samples (finite losses only)
    weight: float = 0.0
    updates: int = 0  # its updates read so far

    @property
    def mean(self) -> float:
        return self.sum / self.weight if self.weight > 0 else float("nan")


@dataclasses.dataclass
class RunState:
    """One call of `fit`: its data, targets, counters and history.

    `updates` counts the run's updates (dispatched to the device; a skipped one included)
    and carries over to a later `fit` of the same Trainer; `start` is where this `fit`'s
    `limit` counts from, and `start_epoch` where its `epochs` do (a stream keeps its epoch
    from one `fit` to the next; both are 0 for a run resumed from a checkpoint). `history`
    and `sums` are what checkpoints record besides the model, with the stream's position
    and `settings`."""

    stream: DataStream
    settings: dict[str, Any]
    epochs: int | None = None  # epochs to train (from `start_epoch`)
    limit: int | None = None  # updates to train (from `start`)
    updates: int = 0
    start: int = 0
    start_epoch: int = 0
    history: dict[str, list] = dataclasses.field(default_factory=lambda: {"train_loss": []})
    sums: EpochSums = dataclasses.field(default_factory=lambda: EpochSums(0))
    skips: int = 0  # skipped updates in a row
    stop: bool = False  # a hook asked to stop

    def done(self) -> bool:
        """Whether the run has what it asked for (or was asked to stop)."""
        return (
            self.stop
            or (self.epochs is not None and self.stream.epoch >= self.start_epoch + self.epochs)
            or (self.limit is not None and self.updates - self.start >= self.limit)
        )

    def target(self, accumulate: int) -> int | None:
        """The run's last update number, when it is known."""
        targets = []
        if self.limit is not None:
            targets.append(self.start + self.limit)
        n = self.stream.num_batches
        if self.epochs is not None and n is not None:
            per_epoch = -(-n // accumulate)
            epochs_left = self.start_epoch + self.epochs - self.stream.epoch
            left = epochs_left * per_epoch - self.sums.updates
            targets.append(self.updates + max(0, left))
        return min(targets, default=None)

    def progress(self) -> dict[str, Any]:
        """What a checkpoint records of the run besides the model (JSON)."""
        return {
            "stream": self.stream.state(),
            "history": self.history,
            "partial": dataclasses.asdict(self.sums),
            "updates": self.updates,
            "run": self.settings,
        }

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue from a checkpoint's `progress()` (checked by `_resume`)."""
        self.stream.set_state(meta["stream"])
        self.history = {**self.history, **meta["history"]}
        sums = meta["partial"]
        self.sums = EpochSums(int(sums["epoch"]), float(sums["sum"]), float(sums["weight"]),
                              int(sums["updates"]))  # fmt: skip
        self.updates = int(meta.get("updates", 0))
        self.start = self.start_epoch = 0
