"""The Trainer's evaluation: the mean loss over data, without an update."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..data import DataStream
from ..precision._policy import Policy
from ._batches import pad
from ._hooks import Hook, StepInfo
from ._loss import call_loss
from ._shard import in_auto_axes


def eval_function(loss, policy: Policy, jit: bool, mesh: Mesh | None = None):
    """`(model, model_state, batch, weights) -> (weighted loss sum, weight)`, jitted or not;
    with every axis of `mesh` Auto inside (FSDP's parameters sharded over Explicit axes
    are then gathered where the loss needs them, as on Auto axes)."""

    def eval_batch(model, model_state, batch, weights):
        (arrays, state_arrays), (static, state_static) = eqx.partition(
            (model, model_state), eqx.is_array
        )

        def sums(arrays, state_arrays, batch, weights):
            out = call_loss(
                loss,
                eqx.combine(arrays, static),
                batch,
                weights,
                model_state=eqx.combine(state_arrays, state_static),
                key=None,
                policy=policy,
            )
            return jnp.sum(out.values * out.weights), jnp.sum(out.weights)

        replicated = None if mesh is None else NamedSharding(mesh, P())
        return in_auto_axes(sums, mesh, replicated)(arrays, state_arrays, batch, weights)

    return eqx.filter_jit(eval_batch) if jit else eval_batch


def mean_loss(
    eval_fn: Callable[..., Any],
    model: Any,
    model_state: Any,
    stream: DataStream,
    check: Callable[[tuple], None] | None = None,
) -> float:
    """The mean loss of `model` over every sample of `stream` (`eval_fn` from
    `eval_function`), in `eqx.nn.inference_mode`; `check(batch)` on each batch's host
    arrays first, where given."""
    inference = eqx.nn.inference_mode(model)
    total = weight = 0.0
    for i, batch in enumerate(stream):
        if check is not None:  # as training batches are: NaN, labels out of range
            try:
                check(tuple(batch))
            except ValueError as e:
                raise ValueError(f"evaluation data, batch {i + 1}: {e}") from e
        batch, weights = pad([tuple(jnp.asarray(x) for x in batch)], stream.batch_size)
        s, w = eval_fn(inference, model_state, batch, weights)
        total += float(s)
        weight += float(w)
    if weight <= 0:
        raise ValueError("the evaluation data has no samples (or only zero weights).")
    return total / weight


class Evaluation(Hook):
    """The loss over `stream` (`fit(eval_data=...)`) after every epoch, or every `every`
    updates: returned as `eval_loss` (with `eval_update`), which the run's history keeps
    and the hooks after it (TensorBoard) hear."""

    def __init__(self, evaluate: Callable[[DataStream], float], stream: DataStream,
                 every: int | None = None):  # fmt: skip
        self.evaluate, self.stream, self.every = evaluate, stream, every

    def due(self, update: int) -> bool:
        return self.every is not None and update % self.every == 0

    def on_update(self, info: StepInfo) -> dict[str, float | int] | None:
        return self._loss(info) if self.due(info.update) else None

    def on_epoch_end(self, info: StepInfo) -> dict[str, float | int] | None:
        return self._loss(info) if self.every is None else None

    def _loss(self, info: StepInfo) -> dict[str, float | int]:
        return {"eval_loss": self.evaluate(self.stream), "eval_update": info.update}
