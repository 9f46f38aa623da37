"""The Trainer's evaluation: the mean loss over data, without an update."""

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._checks import check_int
from ..data import DataStream
from ..precision._policy import Policy
from ._batches import pad
from ._checks import check_data, make_eval_stream
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


def evaluate(trainer, data: tuple | DataStream, micro_batch: int | None = None) -> float:
    """`Trainer.evaluate`: the mean loss over every sample of `data`."""
    check_int("micro_batch", micro_batch, 1, none=True, alternative="samples per batch")
    stream = data if isinstance(data, DataStream) else make_eval_stream(data, micro_batch or 256)
    assert stream is not None
    held, model_state = trainer._held()
    model = eqx.nn.inference_mode(held)
    total = weight = 0.0
    for i, batch in enumerate(stream):
        if trainer.check_data:  # as training batches are: NaN, labels out of range
            try:
                check_data(trainer.loss, held, tuple(batch), trainer.step_fn.policy.compute_dtype)
            except ValueError as e:
                raise ValueError(f"evaluation data, batch {i + 1}: {e}") from e
        batch, weights = pad([tuple(jnp.asarray(x) for x in batch)], stream.batch_size)
        s, w = trainer._eval_fn(model, model_state, batch, weights)
        total += float(s)
        weight += float(w)
    if weight <= 0:
        raise ValueError("the evaluation data has no samples (or only zero weights).")
    return total / weight
