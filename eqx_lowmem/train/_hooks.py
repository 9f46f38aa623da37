"""What runs beside the Trainer's loop: the `Hook` protocol and the `StepInfo` it hears.

Everything optional in a run is a hook that owns its state (checkpoints, the progress bar,
TensorBoard, evaluation, stop signals): the Trainer calls each in order and knows nothing of
what they do. A user's hook (a W&B logger, early stopping) is written the same way and
passed as `Trainer(..., hooks=[...])`, with no change to the library.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ._state import TrainState


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook hears of an update (or of an epoch's end, or of a run's start and end).

    Attributes:
        update: updates of the run so far, this one included (from 1; at `on_start`, the
            updates taken before this `fit`, which a resumed run continues from).
        epoch: the epoch (from 0).
        epoch_update: the update's number within its epoch (from 1; at `on_epoch_end`,
            the epoch's updates).
        metrics: numbers as Python floats. After an update: the step's `loss` (the
            weighted mean over the batch), `weight`, `grad_norm`, `finite` (0.0 for a
            non-finite loss or gradient: an update skipped with `skip_nonfinite`),
            `loss_scale`, and with `skip_nonfinite` `params_finite`; at
            `on_epoch_end`: `train_loss`, the epoch's mean loss over its samples. What an
            earlier hook returned is added (the evaluation's `eval_loss`).
        target: the run's last update number where it is known (for progress), else None.
        last_in_epoch: this update ends its epoch (`on_epoch_end` follows).
    """

    update: int
    epoch: int
    epoch_update: int
    metrics: Mapping[str, float | int]
    target: int | None = None
    last_in_epoch: bool = False
    # The Trainer's accessors, bound to the run (not part of the record's value).
    read_state: Callable[[int], TrainState | None] = dataclasses.field(
        default=lambda update: None, repr=False, compare=False
    )
    request_stop: Callable[[], None] = dataclasses.field(
        default=lambda: None, repr=False, compare=False
    )

    def state(self) -> TrainState | None:
        """The Trainer's `TrainState` after this update; None once the next update has
        started (with a loss scale the Trainer reads an update's metrics while the next
        runs: a hook whose `due(update)` is True gets the state of that update).

        The next update donates its arrays: copy what you keep
        (`jax.tree.map(jnp.copy, info.state().model)`)."""
        return self.read_state(self.update)

    @property
    def model(self) -> Any:
        """The model after this update (as `state().model`), or None (see `state`)."""
        state = self.state()
        return None if state is None else state.model

    def stop(self) -> None:
        """Ask the Trainer to stop: `fit` ends after the update in flight (saving a
        checkpoint with `checkpoint_dir`) and returns its history."""
        self.request_stop()


class Hook:
    """Something that runs beside the Trainer's loop; every method is optional.

    The Trainer calls its hooks in order: those its keyword arguments build (evaluation,
    progress, TensorBoard, `callback`), then `Trainer(hooks=[...])`, then checkpoints and
    stop signals (which save what the others recorded). A value a hook returns from
    `on_update` or `on_epoch_end` (a dict of floats) is added to the run's history (one
    list per name) and to the `metrics` the hooks after it hear.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr, optax
        >>> import eqx_lowmem as el
        >>> class StopAfter(el.train.Hook):
        ...     def __init__(self, n):
        ...         self.n, self.losses = n, []
        ...     def due(self, update):  # read update n's state before starting n + 1
        ...         return update >= self.n
        ...     def on_update(self, info):
        ...         self.losses.append((info.update, info.metrics["loss"]))
        ...         if info.update >= self.n:
        ...             info.stop()
        >>> hook = StopAfter(3)
        >>> trainer = el.train.Trainer(el.nn.mlp([2, 1], key=jr.PRNGKey(0)), el.train.mse,
        ...                            optax.sgd(0.1), hooks=[hook], progress=False)
        >>> _ = trainer.fit(jnp.ones((64, 2)), jnp.ones((64, 1)), epochs=10, micro_batch=8,
        ...                 key=jr.PRNGKey(1))
        >>> [u for u, _ in hook.losses], trainer.updates
        ([1, 2, 3], 3)
    """

    def on_start(self, info: StepInfo) -> None:
        """Before the first update of a `fit` (after a resume: `info.update` is where it
        continues from)."""

    def due(self, update: int) -> bool:
        """Whether this hook needs the state after update `update` (to save or evaluate
        it, or to stop there): the Trainer then reads that update before starting the
        next. Default False: the metrics may be read while later updates run (the next
        one; on the CPU backend, where each wait takes CPU from the step, up to 16, fewer
        where their batches pass 64 MiB)."""
        return False

    def on_update(self, info: StepInfo) -> Mapping[str, float | int] | None:
        """After each update, in order, with its metrics."""

    def on_epoch_end(self, info: StepInfo) -> Mapping[str, float | int] | None:
        """After an epoch's last update (and that update's `on_update`)."""

    def on_end(self, info: StepInfo) -> None:
        """After the last update of a `fit` that ends without an error (its target met, or
        a stop asked for)."""

    def close(self) -> None:
        """At the end of every `fit`, also one that raises: release what it held."""


def call_hooks(hooks: list[Hook], method: str, info: StepInfo, history: dict[str, list]) -> None:
    """`hook.<method>(info)` for each hook in order; what one returns goes into `history`
    and into the `metrics` of the `info` the next ones get."""
    for hook in hooks:
        added = getattr(hook, method)(info)
        if added:
            for name, value in added.items():
                history.setdefault(name, []).append(value)
            info = dataclasses.replace(info, metrics={**info.metrics, **added})


class Callback(Hook):
    """`Trainer(callback=fn)`: `fn(trainer, metrics)` after every update, with `epoch`
    (from 0), `update` (within the epoch, from 1), `updates` (of the run) and the step's
    metrics."""

    def __init__(self, fn: Callable[[Any, dict[str, Any]], None], trainer: Any):
        self.fn, self.trainer = fn, trainer

    def on_update(self, info: StepInfo) -> None:
        numbers = {"epoch": info.epoch, "update": info.epoch_update, "updates": info.update}
        self.fn(self.trainer, {**numbers, **info.metrics})


_HOOK_METHODS = ("on_start", "due", "on_update", "on_epoch_end", "on_end", "close")


def check_hooks(hooks: Any) -> list[Hook]:
    """`Trainer(hooks=...)` as a list, each checked to have every method of `Hook` (a
    subclass of it has them all)."""
    if isinstance(hooks, Hook) or not isinstance(hooks, (list, tuple)):
        raise TypeError(
            f"hooks must be a list of eqx_lowmem.train.Hook objects, got "
            f"{type(hooks).__name__}; e.g. hooks=[MyHook()]."
        )
    for i, hook in enumerate(hooks):
        missing = [m for m in _HOOK_METHODS if not callable(getattr(hook, m, None))]
        if missing:
            raise TypeError(
                f"hooks[{i}] ({type(hook).__name__}) lacks {missing}; subclass "
                "eqx_lowmem.train.Hook, whose methods do nothing by default."
            )
    return list(hooks)
