"""The summed gradient of one batch: its micro-batches accumulated on each device, then
combined over the devices of the mesh (all-reduced, or reduce-scattered under FSDP)."""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec as P

from ..nn._layers import layer_hook
from ._accumulate import Sums, accumulate, loss_grad
from ._shard import fsdp_layout, gather_layer, gather_leaves


def grad_function(c: Any, static: Any, prepare: Callable[[Any], Any] | None = None):
    """The accumulated gradient function of the loss, for a model split off `static`
    (`c`: a `Step`'s config)."""
    dtype = c.accumulate_dtype
    grad_fn = loss_grad(c.loss_fn, static, c.policy, prepare=prepare, dtype=dtype)
    if c.accumulate == 1 and jnp.dtype(dtype).itemsize == 4:
        # One micro-batch: its gradient in units of the count (`Sums.unit`), which the mean
        # divides out, so no scaled float32 copy of it is stored for the norm's loop.
        return functools.partial(grad_fn, in_units=True)
    return accumulate(grad_fn, c.accumulate, dtype=dtype, fuse=c.fuse_accumulation)


def batch_sums(c: Any, model: Any, model_state, batch, w, key, scale) -> Sums:
    """The summed gradient of the batch w.r.t. the inexact leaves of `model`, over every
    micro-batch and device (`c`: a `Step`'s config)."""
    if c.mesh is None:
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return grad_function(c, static)(params, model_state, batch, w, key, scale)

    axis, n = c.data_axis, int(c.mesh.shape[c.data_axis])
    if c.shard == "fsdp":
        model, specs = fsdp_layout(model, n, axis)[:2]
    else:
        specs = jax.tree.map(lambda x: P(), eqx.filter(model, eqx.is_array))
    arrays, skeleton = eqx.partition(model, eqx.is_array)
    param_specs = jax.tree.map(
        lambda x, s: s if eqx.is_inexact_array(x) else None, model, specs,
        is_leaf=lambda x: x is None,
    )  # fmt: skip

    def local(arrays, model_state, batch, w, key, scale):
        key = jr.fold_in(key, jax.lax.axis_index(axis))
        params, others = eqx.partition(arrays, eqx.is_inexact_array)
        static = eqx.combine(others, skeleton)
        prepare = None
        if c.shard == "fsdp":

            def prepare(model):
                return gather_leaves(model, specs, axis)

        with layer_hook(gather_layer(axis) if c.shard == "fsdp" else None):
            sums = grad_function(c, static, prepare)(params, model_state, batch, w, key, scale)
        sums = sums.exact()  # reduced over devices in float32
        # Sharded leaves arrive reduce-scattered (the transpose of their all-gather);
        # replicated ones are summed here, once per update, after the micro-batches.
        grads = jax.tree.map(
            lambda g, s: jax.lax.psum(g, axis) if s == P() else g,
            sums.grads, param_specs, is_leaf=lambda x: x is None,
        )  # fmt: skip
        total, weight = jax.lax.psum((sums.total, sums.weight), axis)
        mstate = jax.tree.map(
            lambda x: jax.lax.pmean(x, axis) if eqx.is_inexact_array(x) else x,
            sums.model_state,
        )
        return Sums(grads, total, weight, mstate)

    return jax.shard_map(
        local,
        mesh=c.mesh,
        in_specs=(specs, P(), P(axis), P(axis), P(), P()),
        out_specs=Sums(param_specs, P(), P(), P()),
        check_vma=False,
    )(arrays, model_state, batch, w, key, scale)
