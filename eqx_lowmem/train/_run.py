"""One call of `Trainer.fit`: its targets and the progress that checkpoints record."""

import time
from typing import Any


def fresh_partial(epoch: int) -> dict[str, Any]:
    """The running sums of an epoch not yet closed."""
    return {"epoch": epoch, "sum": 0.0, "weight": 0.0, "updates": 0}


class Run:
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
        self.partial = fresh_partial(stream.epoch)
        self.start = 0  # updates taken before this fit (counted towards `updates` or not)
        self.skips = 0  # skipped updates in a row
        self.last_save = time.monotonic()
        self.saved: tuple | None = None

    def done(self, taken: int) -> bool:
        return (self.epochs is not None and self.stream.epoch >= self.epochs) or (
            self.updates is not None and taken - self.start >= self.updates
        )

    def target(self, taken: int) -> int | None:
        """The run's last update number, when it is known (`taken`: updates so far)."""
        targets = []
        if self.updates is not None:
            targets.append(self.start + self.updates)
        n = self.stream.num_batches
        if self.epochs is not None and n is not None:
            per_epoch = -(-n // self.accumulate)
            left = (self.epochs - self.stream.epoch) * per_epoch - self.partial["updates"]
            targets.append(taken + max(0, left))
        return min(targets, default=None)
