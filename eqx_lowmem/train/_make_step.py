"""`make_step`: the checks of its arguments and the `Step` they configure."""

import inspect
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from .._checks import check_int
from ..precision._loss_scale import DynamicLossScale, dynamic_loss_scale
from ..precision._optim import half_state
from ..precision._policy import Policy, get_policy
from ._accumulate import check_accumulate_dtype
from ._state import TrainState
from ._step import Step, _Config
from ._update import UpdateInfo

SHARDS: tuple[str, ...] = ("data", "fsdp")


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    accumulate: int = 1,
    precision: str | Policy | None = None,
    loss_scale: DynamicLossScale | Literal["auto"] | None = "auto",
    has_state: bool = False,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    shard: str = "data",
    after_update: Callable[[TrainState, UpdateInfo], TrainState] | None = None,
    jit: bool = True,
    accumulate_dtype: Any = jnp.float32,
    fuse_accumulation: bool = True,
    skip_nonfinite: bool | None = None,
) -> Step:
    """Build a training step: the gradient of a large batch with one micro-batch alive.

    The step splits the batch into `accumulate` micro-batches and runs them with
    `jax.lax.scan`, each taking `grad` of its own loss (never `grad` of a scanned loss, which
    would keep every iteration's activations) and adding it to a float32 accumulator; then
    it applies the optimizer once. The whole update is one jitted call, and the state is
    donated, so parameters and optimizer state are not held twice.

    Exact: the loss is the sum of the per-sample (or per-token) values times their weights
    over the whole batch, divided by the total weight; never a mean of micro-batch means.
    Micro-batches of unequal real size (a batch that `accumulate` does not divide, padded
    at weight 0) and masked tokens give the update of the whole batch. A stateful model's
    batch is never padded: its micro-batches are the real ones (30 samples in 4: 8, 8, 8, 6).

    Memory and time of `accumulate=k`: activations of one micro-batch (1/k of the batch)
    plus one float32 parameter-sized accumulator; the same arithmetic as the whole batch,
    in k smaller pieces (small pieces use the hardware less well).

    Args:
        loss_fn: `loss_fn(model, *batch)` (or `loss_fn(model, model_state, *batch)` with
            `has_state`) returning per-sample values `(batch, ...)`, or
            `(values, weights)`; with `has_state` it returns `(that, new_model_state)`. If it
            takes a `key` keyword, it gets a fresh key per micro-batch (for dropout).
        optimizer: any optax optimizer; clipping and schedules in it act on the accumulated
            gradient, once per update.
        accumulate: number of micro-batches per batch.
        precision: a preset name (`"float32"`, `"mixed_bf16"`,
            `"mixed_fp16"`, `"half_bf16"`, `"half_fp16"`) or a `Policy`. With a 16-bit
            compute dtype, the parameters of scanned stacks that recompute their blocks
            (`eqx_lowmem.nn.Stack`, `transformer_encoder` with `remat` or `segment`) are
            cast one block at a time inside the scan, so only one block's 16-bit copy is
            alive; other parameters (and stacks that recompute nothing, whose backward
            pass keeps every block's 16-bit weights anyway) are cast once per micro-batch,
            as a hand-written loop casts: one 16-bit copy, no more.
        loss_scale: `"auto"` (a dynamic loss scale when the policy uses float16), None, or a
            `DynamicLossScale`. A non-finite gradient skips the update (parameters,
            optimizer state, model state and the update counter unchanged) and halves it.
        has_state: the model has `eqx.nn.State` (BatchNorm). The state is threaded through
            the micro-batches in order: batch statistics are those of each micro-batch,
            and running averages are updated once per micro-batch (Sohoni et al., 2019,
            Section 3.3: micro-batching changes what BatchNorm normalises over).
        mesh: a `jax.sharding.Mesh` for data parallelism (`jax.make_mesh((n,),
            ("data",))`, whose axes are Explicit, or Auto axes): the batch is split over
            `data_axis`, each device accumulates its micro-batches, and the gradients are
            combined across devices once per update. Across several processes (hosts), call
            `jax.distributed.initialize` first, build the mesh over `jax.devices()` and pass
            each process its own part of the batch (`DataStream(process_index=...,
            process_count=...)`).
        data_axis: the mesh axis the batch is split over.
        shard: `"data"` replicates parameters and optimizer state on every device (memory:
            all of them per device; one all-reduce of the gradient per update). `"fsdp"`
            (ZeRO-3) splits each parameter and its optimizer state over `data_axis` along a
            dimension the axis size divides (replicated when none does): memory 1/n of them
            per device, plus one block's gathered weights at a time in scanned stacks;
            communication: an all-gather of each weight per micro-batch forward (and again in
            the recomputation of the backward) and a reduce-scatter of its gradient. On
            Explicit axes the state's arrays are typed as sharded (the step runs with
            every axis Auto inside); gather a model before calling it yourself:
            `jax.device_put(model, NamedSharding(mesh, P()))`.
        after_update: a hook `after_update(state, info) -> state`, run inside the jitted
            step on every step, after the update (or its skip, for a non-finite gradient),
            with an `UpdateInfo`: the mean gradient, a fresh key, `grad_fn` for another
            gradient of the batch, and `finite`, False when the update was skipped (gate
            on it: the sparse hooks rewire only after an applied update). It must keep
            every leaf's shape and dtype. A hook with an `init(model)` method keeps state
            between steps in `TrainState.hook_state`, which `Step.init` fills from it
            (DSR's threshold). Sparse training rewires there (`eqx_lowmem.sparse`).
        jit: False runs the step eagerly (for debugging).
        accumulate_dtype: the dtype of each micro-batch's gradient and of their
            accumulator: `jnp.float32` (default), or 16 bits (`jnp.float16`, which needs a
            loss scale, or `jnp.bfloat16`). Memory: 16 bits halve both (2 + 2 bytes per
            parameter while the micro-batches run, instead of 4 + 4); the gradient of the
            whole batch is formed in float32 after the last micro-batch, when its
            activations are gone, and the optimizer runs in float32 as before. The 16-bit
            accumulator holds the average of the micro-batches' loss-scaled gradients
            (never larger than the largest of them, so it overflows only where a
            micro-batch's gradient would), each addition rounded once: float16 keeps about
            3 significant digits, bfloat16 about 2. Time: the same.
        fuse_accumulation: with `accumulate > 1`, a scanned stack whose blocks are all
            recomputed (`el.nn.stack(..., remat=True)`, `transformer_encoder`, `CausalLM`,
            `WideResNet`'s groups under `checkpoint-residual-k`), or recomputed a segment
            at a time (`stack(..., segment=k)`), adds each layer's gradient straight into
            the accumulator in its backward loop, in place: the micro-batch's gradient of
            those parameters is never held whole beside the accumulator (one
            gradient-sized buffer less; the same additions, in the same order where
            the stack runs once per micro-batch: bit-identical updates). Stacks it
            cannot apply to run as before: those that keep activations, and FSDP's
            gathered stacks. `False` turns it off.

        skip_nonfinite: skip an update whose loss or gradient is not finite (parameters,
            optimizer state, model state and update counter unchanged; the `finite`
            metric False) and report `params_finite`. None (default): only with a loss
            scale, which needs it (an overflow halves the scale and retries). Without
            it, the update is applied whatever the gradient, as in a hand-written step
            (and `optax.apply_if_finite`'s opt-in): `finite` is still reported, so a
            caller can stop. Time: the skip's select on every leaf and the check of the
            new parameters cost, measured side by side for commit 48d82b8, 5% of an MLP
            step and 30% of a small language model's on XLA:CPU; memory:
            none (the gradient's norm is summed in slices for it).

    Optimizer state in host memory (memory kinds) is not offered: XLA:CPU has one memory
    kind, so it could not be tested here, and on a GPU an optimizer update over pinned host
    buffers runs at PCIe speed every step; FSDP (`shard="fsdp"`) and 16-bit state
    (`precision="half_bf16"`) cut the same bytes without that cost.

    Returns:
        A `Step`: `state = step.init(model, key=key)`, then
        `state, metrics = step(state, batch)`.

    Raises:
        ValueError: for `accumulate < 1`, a `data_axis` not in the mesh, an unknown `shard`.
            TypeError: for an `after_update` that cannot be called as `(state, info)`
            (a hook factory passed uncalled).
            The step raises for batches whose arrays differ in length or that are smaller
            than `accumulate`.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr, optax
        >>> import eqx_lowmem as el
        >>> model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
        >>> step = el.train.make_step(el.train.mse, optax.sgd(0.05), accumulate=4)
        >>> state = step.init(model, key=jr.PRNGKey(1))
        >>> x, y = jnp.ones((32, 2)), jnp.zeros((32, 1))
        >>> state, metrics = step(state, (x, y))
        >>> int(state.step)
        1
    """
    _check_args(loss_fn, accumulate, optimizer, mesh, data_axis, shard, after_update)
    policy = get_policy(precision)
    accumulate_dtype = check_accumulate_dtype(accumulate_dtype)
    loss_scale = _loss_scale(loss_scale, policy, accumulate_dtype)
    config = _Config(
        loss_fn=loss_fn,
        optimizer=half_state(optimizer, policy.opt_state_dtype) if policy.is_half else optimizer,
        accumulate=accumulate,
        policy=policy,
        loss_scale=loss_scale,
        has_state=bool(has_state),
        mesh=mesh,
        data_axis=data_axis,
        shard=shard,
        after_update=after_update,
        jit=jit,
        accumulate_dtype=accumulate_dtype,
        fuse_accumulation=bool(fuse_accumulation),
        skip_nonfinite=_skip_nonfinite(skip_nonfinite, loss_scale),
    )
    return Step(config)


def _skip_nonfinite(skip: bool | None, loss_scale: DynamicLossScale | None) -> bool:
    if skip is None:
        return loss_scale is not None
    if not isinstance(skip, bool):
        raise TypeError(f"skip_nonfinite must be True, False or None, got {skip!r}.")
    if not skip and loss_scale is not None:
        raise ValueError(
            "skip_nonfinite=False with a loss scale: a dynamic loss scale skips the update "
            "it overflowed (and halves the scale); pass skip_nonfinite=None or True, or "
            "loss_scale=None."
        )
    return skip


def _check_args(loss_fn, accumulate, optimizer, mesh, data_axis, shard, after_update) -> None:
    check_int("accumulate", accumulate, 1, alternative="micro-batches per batch")
    if not callable(loss_fn) or isinstance(loss_fn, str):
        raise TypeError(
            f"loss must be a function loss(model, *batch) returning per-sample values, got "
            f"{type(loss_fn).__name__} {loss_fn!r}; for example eqx_lowmem.train.mse."
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation, got "
            f"{type(optimizer).__name__}; for example optax.sgd(0.05)."
        )
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
    if mesh is not None and data_axis not in mesh.axis_names:
        raise ValueError(
            f"data_axis={data_axis!r} is not an axis of the mesh, whose axes are "
            f"{mesh.axis_names}; pass data_axis= one of them."
        )
    if shard not in SHARDS:
        raise ValueError(f"shard={shard!r}; expected one of {SHARDS}.")
    if shard != "data" and mesh is None:
        raise ValueError(
            f"shard={shard!r} shards over a mesh's {data_axis!r} axis: pass mesh= (e.g. "
            "jax.make_mesh((jax.device_count(),), ('data',)))."
        )
    if after_update is not None:
        _check_hook(after_update)
    if jax.process_count() > 1 and mesh is None:
        raise ValueError(
            f"this is one of {jax.process_count()} processes but make_step has no mesh; "
            "pass mesh=jax.make_mesh((jax.device_count(),), ('data',)) so they train "
            "together."
        )


def _check_hook(hook: Any) -> None:
    """`hook` is called as `hook(state, info)`: refuse what cannot be, such as a hook
    factory passed uncalled (`after_update=el.sparse.dsr` for `el.sparse.dsr()`)."""
    if not callable(hook):
        raise TypeError(f"after_update must be callable, got {type(hook).__name__}.")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(hook, "__qualname__", type(hook).__name__)
        raise TypeError(
            f"after_update={name} takes {signature}, but the step calls it as "
            f"after_update(state, info). If {name} makes hooks, pass what it returns: "
            f"after_update={name}(...) (e.g. after_update=el.sparse.dsr(period=100))."
        ) from None


def _loss_scale(loss_scale: Any, policy: Policy, accumulate_dtype: Any) -> DynamicLossScale | None:
    """`loss_scale` resolved ("auto": a dynamic scale where float16 needs one) and checked."""
    if loss_scale == "auto":
        needs = policy.needs_loss_scale or accumulate_dtype == jnp.dtype(jnp.float16)
        loss_scale = dynamic_loss_scale() if needs else None
    elif loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(
            "loss_scale must be 'auto', None or an eqx_lowmem.precision.DynamicLossScale, "
            f"got {type(loss_scale).__name__}."
        )
    if accumulate_dtype == jnp.dtype(jnp.float16) and loss_scale is None:
        raise ValueError(
            "accumulate_dtype=float16 keeps gradients in float16, where values below 6e-8 "
            "flush to zero: it needs a loss scale. Use loss_scale='auto' (or a "
            "DynamicLossScale), or accumulate_dtype=jnp.bfloat16."
        )
    return loss_scale
