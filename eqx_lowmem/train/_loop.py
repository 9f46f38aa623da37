"""The pieces of the Trainer's update loop that need no Trainer: the host check of each
micro-batch, where batches go, one update's batch, and the loop's errors."""

import itertools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..data import DataStream
from ..data._prefetch import checked
from ._batches import concat, ones, pad
from ._checks import BatchCheck
from ._resume import last_good, nonfinite_parameters
from ._step import Step


class BadBatch(Exception):
    """`check_batch`'s `error` for the `index`-th batch (from 0) of an epoch's prefetch."""

    def __init__(self, index: int, error: ValueError):
        super().__init__(index, error)
        self.index, self.error = index, error


def shapes_of(tree: Any) -> Any:
    """`tree` with each array replaced by its shape and dtype (nothing a step donates)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree
    )


def host_check(loss: Callable[..., Any], model: Any, dtype: Any) -> Callable[[tuple], None]:
    """`check_data` for the prefetch thread: on each micro-batch's host arrays before they
    are copied to the device (on a GPU no copy back and no wait for the step), with the
    model's shapes only. Raises `BadBatch` with the batch's index in the epoch."""
    count = itertools.count()  # the batches of one epoch's prefetch start an update
    check_one = BatchCheck(loss, model, dtype)

    def check(batch: tuple) -> None:
        index = next(count)
        try:
            check_one(batch)
        except ValueError as e:
            raise BadBatch(index, e) from e

    return check


# `check_arrays`' block: bounded temporaries (a copy of a block of strided rows, the
# boolean masks of an error's report) at a pass over memory much larger than a cache.
_BLOCK_BYTES = 64 * 2**20


def check_arrays(loss: Callable[..., Any], model: Any, dtype: Any, arrays: tuple,
                 what: str, block_bytes: int = _BLOCK_BYTES) -> None:  # fmt: skip
    """`check_data` on arrays held in memory, whole, before training (`fit`'s `check_data`
    for arrays: a batch is a copy of their rows, so checking them once spares a check of
    every batch in every epoch, which on a CPU backend takes host time from the step): a
    block of rows at a time, `BatchCheck`'s one pass per array. An error names `what` and
    the block's samples, and says its indices count from the block's first sample."""
    check = BatchCheck(loss, model, dtype)
    n = arrays[0].shape[0]
    row_bytes = sum(a[:1].nbytes for a in arrays)
    rows = max(1, block_bytes // max(row_bytes, 1))
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        try:
            check(tuple(a[start:stop] for a in arrays))
        except ValueError as e:
            offset = f"; its indices count from sample {start}" if start else ""
            raise ValueError(
                f"{what}, samples {start} to {stop - 1} (check_data=False skips this "
                f"check{offset}): {e}"
            ) from e


def prefetch_sharding(mesh: Mesh | None, data_axis: str, stream: DataStream) -> Any:
    """Batches go straight to their devices when every batch divides over them; a short
    last batch that does not is placed by the step instead."""
    if mesh is None:
        return None
    n = int(mesh.shape[data_axis])
    samples = stream.num_samples
    regular = stream.drop_last or (samples is not None and samples % stream.batch_size % n == 0)
    return NamedSharding(mesh, P(data_axis)) if regular else None


def on_host(mesh: Mesh | None) -> bool:
    """Whether the step runs on the host's own cores (the CPU backend)."""
    return (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform == "cpu"


# On the CPU backend a wait for a running step takes CPU from its threads (about 0.25 ms
# of host CPU each, measured for 921daca): there the metrics are read every `_HOST_LAG`
# updates after one wait, or fewer where the batches in flight would pass `_HOST_LAG_BYTES`
# (an update in flight holds its batch; its new state takes the donated buffers). MLP
# 784-512-512-10, batch 256 (4.5 ms a step): reading every 4 updates cost 72-80 us an
# update against never waiting, every 16 nothing measurable (measured for a910f6e).
_HOST_LAG = 16
_HOST_LAG_BYTES = 64 << 20


def host_lag(batch: tuple) -> int:
    """Updates whose metrics are read after one wait on the CPU backend, for batches like
    `batch` (host or device arrays)."""
    return max(1, min(_HOST_LAG, _HOST_LAG_BYTES // max(sum(x.nbytes for x in batch), 1)))


def epoch_batches(stream: DataStream, mesh: Mesh | None, data_axis: str, check: Any) -> Any:
    """The stream's batches for one epoch of updates, each `check`ed (when given) before
    its update; the iterator's `close()` stops any reading ahead.

    A background thread reads, checks and places them two ahead (`stream.prefetch`),
    except where the step runs on the host's own cores (the CPU backend) and every batch is
    a copy of arrays in memory: there a thread overlaps nothing that a read could wait on
    (a disk, an iterator) and takes cores from the step, so each batch is read and checked
    when it is needed and handed to the step as host arrays, as a hand-written loop does."""
    if on_host(mesh) and stream.in_memory:
        return (checked(batch, check) for batch in stream)
    return stream.prefetch(sharding=prefetch_sharding(mesh, data_axis, stream), check=check)


def assemble(micro: list[tuple], size: int, stateful: bool) -> tuple[tuple, jax.Array]:
    """The whole batch of one update from its micro-batches. A short last update is padded
    at weight 0 to `size` samples (one compilation), except for a stateful model, whose
    batch statistics must see only real samples."""
    if stateful:
        batch = concat(micro)
        return batch, ones(batch[0].shape[0])
    return pad(micro, size)


def bad_batch_error(bad: BadBatch, accumulate: int, update: int, epoch: int) -> ValueError:
    return ValueError(
        f"micro-batch {bad.index % accumulate + 1} of update {update} of epoch {epoch + 1} "
        f"(before that update; check_data=False skips this check): {bad.error}"
    )


NO_BATCHES = (
    "the stream served no batches in epoch {epoch}: an empty source, drop_last with fewer "
    "samples than a batch, or a source function that returned an exhausted iterator (it "
    "must return a fresh one each call)."
)

_FLOAT16_HINT = (
    "; under float16 compute, activations or a loss beyond float16's largest value "
    "(65504) overflow to inf: normalise the inputs, or use precision='mixed_bf16' "
    "(bfloat16 has float32's range)"
)


def nonfinite_loss(where: str, float16: bool, applied: bool, saved: str) -> str:
    """The error for a non-finite loss or gradient without a loss scale: `applied` when
    the step does not skip such updates (`saved`: where the last good state is then)."""
    if applied:
        state = (
            "that update was applied (the step's default without a loss scale, as a "
            "hand-written step), so trainer.state holds its result and was not saved; "
            f"{saved}. make_step(skip_nonfinite=True) (StepConfig) skips such updates and "
            "keeps the last good state in trainer.state instead, at a cost in time"
        )
    else:
        state = (
            "that update was not applied, no checkpoint was written, and trainer.state is "
            "the last good state"
        )
    return (
        f"non-finite loss or gradient at {where}; {state}. Look for NaN or inf in the "
        f"data{_FLOAT16_HINT if float16 else ''}, or lower the learning rate, clip "
        "gradients, or use a loss scale with 16-bit compute."
    )


def too_many_skips(skips: int, where: str, scale: float, float16: bool) -> str:
    return (
        f"{skips} updates in a row were skipped for a non-finite loss or gradient (the "
        f"last: {where}), down to a loss scale of {scale:g}: the data or the model, not "
        "the scale, is at fault (look for NaN or inf in the data"
        f"{_FLOAT16_HINT if float16 else ''}). Raise max_consecutive_skips if the scale "
        "needs longer."
    )


def skip_or_stop(values: dict[str, float], skips: int, where: str, update: int, step: Step,
                 max_skips: int, directory: Any, saved: int | None) -> int:  # fmt: skip
    """Update `update` (`where` in its epoch) was not finite (its metrics `values`): the
    skips in a row after it, where a loss scale lowers itself and goes on; otherwise the
    error that stops the run, naming the last good checkpoint (`saved` in `directory`)."""
    float16 = jnp.dtype(step.policy.compute_dtype) == jnp.float16
    if not values.get("params_finite", 1.0):
        raise FloatingPointError(nonfinite_parameters(where, update, directory, saved))
    if step.loss_scale is None:
        where = f"{where} (update {update} of the run)"
        good = last_good(directory, saved)
        raise FloatingPointError(nonfinite_loss(where, float16, not step.skip_nonfinite, good))
    if skips + 1 >= max_skips:
        raise FloatingPointError(too_many_skips(skips + 1, where, values["loss_scale"], float16))
    return skips + 1
