"""The batches of one update: micro-batches grouped, concatenated and padded at weight 0."""

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ..data import DataStream


def peek(stream: DataStream) -> Iterator[tuple]:
    """The first batch of the stream's current epoch, leaving its position unchanged."""
    position = stream.state()
    try:
        for batch in stream:
            yield batch
            break
    finally:
        stream.set_state(position)


def groups(batches, k: int):
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def concat(micro: list[tuple]) -> tuple:
    """One batch of the micro-batches' arrays; a single one's arrays as they are (host
    arrays go to the device inside the step's call, as in a hand-written loop)."""
    fields = [[m[i] for m in micro] for i in range(len(micro[0]))]  # one list per array
    return tuple(jnp.concatenate(f) if len(f) > 1 else f[0] for f in fields)


_ONES: dict[int | tuple[int, ...], jax.Array] = {}


def ones(n: int | tuple[int, ...]) -> jax.Array:
    """Float32 ones of shape `n` (an int: weights of 1 for `n` samples; `()`: the unit
    `loss_scale` metric of a step without a loss scale), put on the device once per shape
    (a transfer per call cost 1 ms an update of a 6 ms MLP step, measured for 11bd16a, as
    much as the rest of its dispatch); never donated, so they are reused. Never kept from
    inside a trace."""
    weights = _ONES.get(n)
    if weights is None:
        weights = jnp.ones(n, jnp.float32)
        if not isinstance(weights, jax.core.Tracer):
            _ONES[n] = weights
    return weights


def pad(micro: list[tuple], size: int) -> tuple[tuple, jax.Array]:
    """Concatenate micro-batches and pad to `size` samples at weight 0 (one compilation)."""
    batch = concat(micro)
    n = batch[0].shape[0]
    weights = ones(max(n, size))
    if n < size:
        index = np.arange(size) % n
        batch = tuple(x[index] for x in batch)
        weights = (jnp.arange(size) < n).astype(jnp.float32)
    return batch, weights
