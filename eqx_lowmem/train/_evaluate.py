"""The Trainer's evaluation: the mean loss over data, without an update."""

import equinox as eqx
import jax.numpy as jnp

from ..data import DataStream
from ..precision._policy import Policy
from ._batches import pad
from ._checks import make_eval_stream
from ._loss import call_loss


def eval_function(loss, policy: Policy, jit: bool):
    """`(model, model_state, batch, weights) -> (weighted loss sum, weight)`, jitted or not."""

    def eval_batch(model, model_state, batch, weights):
        out = call_loss(
            loss,
            model,
            batch,
            weights,
            model_state=model_state,
            key=None,
            policy=policy,
        )
        return jnp.sum(out.values * out.weights), jnp.sum(out.weights)

    return eqx.filter_jit(eval_batch) if jit else eval_batch


def evaluate(trainer, data: tuple | DataStream, micro_batch: int | None = None) -> float:
    """`Trainer.evaluate`: the mean loss over every sample of `data`."""
    stream = data if isinstance(data, DataStream) else make_eval_stream(data, micro_batch or 256)
    assert stream is not None
    model = eqx.nn.inference_mode(trainer.model)
    total = weight = 0.0
    for batch in stream:
        batch, weights = pad([tuple(jnp.asarray(x) for x in batch)], stream.batch_size)
        s, w = trainer._eval_fn(model, trainer.model_state, batch, weights)
        total += float(s)
        weight += float(w)
    if weight <= 0:
        raise ValueError("the evaluation data has no samples (or only zero weights).")
    return total / weight
