"""Running a step for real: its measured peak, and its time."""

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import PRNGKeyArray


def random_batch(structs: tuple, key: PRNGKeyArray) -> tuple:
    """Device arrays of the batch's shapes: normal floats, zero integers (valid token ids)."""
    leaves, treedef = jax.tree.flatten(structs)
    keys = jr.split(key, max(len(leaves), 1))
    arrays = [
        jr.normal(k, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else jnp.zeros(x.shape, x.dtype)
        for x, k in zip(leaves, keys[: len(leaves)], strict=True)
    ]
    return jax.tree.unflatten(treedef, arrays)


def check_measurable(model: Any) -> None:
    """Raise a clear error unless a step of `model` can run and be measured here."""
    device = jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        raise ValueError(
            f"measure=True needs a device that reports memory statistics (a GPU or TPU); "
            f"{device} gives memory_stats()={stats}. Use measure=False on CPU."
        )
    abstract = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise ValueError(
            "measure=True runs a step, so the model needs its arrays; got a model with "
            f"{len(abstract)} jax.ShapeDtypeStruct leaves. Pass the built model."
        )


def measure_peak(step: Any, model: Any, structs: tuple, model_state: Any, key: Any) -> int:
    """Run one step and return its measured peak: peak_bytes_in_use less what was in use."""
    device = jax.devices()[0]
    before = device.memory_stats()["bytes_in_use"]
    state = step.init(model, key=key, model_state=model_state)
    batch = random_batch(structs, jr.fold_in(key, 1))
    jax.block_until_ready((state, batch))
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    peak = device.memory_stats()["peak_bytes_in_use"]
    del state, metrics, batch
    return int(peak - before)


def time_step(
    step: Any, model: Any, structs: tuple, key: Any, steps: int, model_state: Any = None
) -> float:
    """Median seconds of `steps` steps after one untimed step (which compiles)."""
    state = step.init(model, key=key, model_state=model_state)
    batch = random_batch(structs, jr.fold_in(key, 1))
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
