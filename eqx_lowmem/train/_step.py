"""The training step: the composition of the pieces, in one jitted, donated call.

    batch ─ accumulate(loss_grad) ─ [shard_map over devices] ─ mean_gradient ─ [if_finite](
        optimizer_update ─ apply_updates) ─ after_update ─ loss scale ─ new TrainState

The finite branch (`skip_nonfinite`, on with a loss scale) is the only part a hand-written
step lacks: without it the update is the hand step's, as fast and as small.

Every piece is a pure function of its own module (`_loss`, `_accumulate`, `_gradient`,
`_update`, `_shard`; the state and its checks in `_state`); this file only wires them into
`Step`, which `make_step` (in `_make_step`, with the checks of its arguments) builds.
"""

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, PyTree

from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy
from ._batches import ones
from ._gradient import batch_sums
from ._shard import auto_mesh, fsdp_layout, in_auto_axes, state_shardings
from ._state import (
    Static,
    TrainState,
    check_hooked,
    check_init,
    copy_arrays,
    is_dynamic,
    merge,
    place,
    split,
)
from ._update import (
    UpdateInfo,
    all_finite,
    apply_updates,
    if_finite_cond,
    mean_gradient,
    optimizer_update,
    read_after,
    scaled,
    select,
)

_CONSUMED = (
    "the TrainState passed to this step was already consumed: a step donates the state's "
    "buffers to the new state it returns. Use the returned state:\n\n"
    "    state, metrics = step(state, batch)      # right: rebind `state`\n"
    "    new, metrics = step(state, batch); step(state, batch)   # wrong: reuses `state`\n"
)


def _leading(batch: tuple) -> int:
    # The common case first: a tuple of arrays sharing their first dimension (an update's
    # Python costs add up: 5 us a call here against 1 us, measured for bf9bdb4).
    shapes = [getattr(x, "shape", None) for x in batch]
    if all(type(s) is tuple and s for s in shapes):
        size = shapes[0][0]
        if all(s[0] == size for s in shapes):
            return int(size)
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or -1 in sizes:
        shapes = [np.shape(x) for x in jax.tree.leaves(batch)]
        raise ValueError(
            f"batch arrays must share their first (batch) dimension; got shapes {shapes}."
        )
    return sizes.pop()


@dataclasses.dataclass(frozen=True)
class _Config:
    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    accumulate: int
    policy: Policy
    loss_scale: DynamicLossScale | None
    has_state: bool
    mesh: Mesh | AbstractMesh | None  # abstract in the jitted body's config (`_inner`)
    data_axis: str
    shard: str
    after_update: Callable[[TrainState, UpdateInfo], TrainState] | None
    jit: bool
    accumulate_dtype: Any = jnp.dtype(jnp.float32)
    fuse_accumulation: bool = True
    skip_nonfinite: bool = False


class Step:
    """A training step built by `make_step` (the only constructor); call it as
    `state, metrics = step(state, batch)`."""

    def __init__(self, config: _Config):
        if not isinstance(config, _Config):
            raise TypeError("build a Step with eqx_lowmem.train.make_step(loss, optimizer, ...).")
        self.config = config
        # The configuration the jitted body runs with: the mesh with every axis Auto (the
        # user's mesh places the state, see `_shard.in_auto_axes`).
        mesh = config.mesh
        self._inner = config if mesh is None else dataclasses.replace(config, mesh=auto_mesh(mesh))
        # jax.jit over the state's arrays (donated), its non-array part a static argument:
        # unlike eqx.filter_jit, lowering then accepts jax.ShapeDtypeStruct stand-ins, so
        # memory can be analysed without allocating anything.
        self._jitted = jax.jit(self._step_arrays, static_argnums=3, donate_argnums=2)
        self._jitted_packed = jax.jit(self._packed_arrays, static_argnums=3, donate_argnums=2)
        # The state this step returned last, with its split: a loop hands that state
        # straight back, and it is not flattened again (0.1-0.2 ms of a call on an MLP:
        # 8c0232b). Held weakly: dropping the state frees its arrays.
        self._returned: tuple[weakref.ref, list] | None = None

    # -- what callers read ---------------------------------------------------------------

    @property
    def loss_fn(self) -> Callable[..., Any]:
        return self.config.loss_fn

    @property
    def policy(self) -> Policy:
        return self.config.policy

    @property
    def optimizer(self) -> optax.GradientTransformation:
        """The optimizer as the step runs it (wrapped in `half_state` for 16-bit policies)."""
        return self.config.optimizer

    @property
    def loss_scale(self) -> DynamicLossScale | None:
        return self.config.loss_scale

    @property
    def accumulate(self) -> int:
        return self.config.accumulate

    @property
    def accumulate_dtype(self) -> Any:
        """The dtype of each micro-batch's gradient and of their accumulator."""
        return self.config.accumulate_dtype

    @property
    def skip_nonfinite(self) -> bool:
        """Whether an update with a non-finite loss or gradient is skipped (see
        `make_step`)."""
        return self.config.skip_nonfinite

    @property
    def has_state(self) -> bool:
        return self.config.has_state

    @property
    def mesh(self) -> Mesh | None:
        return self.config.mesh

    @property
    def data_axis(self) -> str:
        return self.config.data_axis

    @property
    def shard(self) -> str:
        return self.config.shard

    @property
    def n_shards(self) -> int:
        """Devices the batch is split over (1 without a mesh)."""
        mesh = self.config.mesh
        return 1 if mesh is None else int(mesh.shape[self.config.data_axis])

    @property
    def granularity(self) -> int:
        """Batches are padded (at weight 0) to a multiple of this: micro-batches x shards.
        A stateful model's batch is never padded (padding would enter BatchNorm's
        statistics): it must be a multiple of the device count instead."""
        return self.config.accumulate * self.n_shards

    # -- init ------------------------------------------------------------------------------

    def init(self, model: PyTree, *, key: Any, model_state: PyTree = None) -> TrainState:
        """The initial `TrainState`: parameters cast to the policy, a fresh optimizer state,
        placed on the mesh (replicated, or sharded with `shard="fsdp"`).

        The state owns copies of the model's arrays and of the key (steps donate the
        state's buffers), so `model` and `key` stay usable; drop `model` to free its memory.

        Args:
            model: the model to train.
            key: a JAX PRNG key (`jr.PRNGKey(0)` or `jr.key(0)`; checked here with a clear
                error, so not annotated for the run-time type checker).
            model_state: `eqx.nn.State` of a stateful model (`has_state=True`).

        Raises:
            ValueError: without `model_state` for `has_state=True`; for a model with no
                floating-point array (nothing to train); for a model with dropout and a
                loss that takes no `key` (dropout would never apply).
            TypeError: for a model leaf that is a non-numeric array, or a key that is not one.
        """
        c = self.config
        check_init(model, key, model_state, has_state=c.has_state, loss_fn=c.loss_fn)
        model = c.policy.cast_to_param(model)
        if c.shard == "fsdp":
            model = fsdp_layout(model, self.n_shards, c.data_axis).model
        # Copies: steps donate the state's buffers, and init may be called again.
        model, model_state, key, loss_scale = copy_arrays((model, model_state, key, c.loss_scale))
        with jax.numpy_dtype_promotion("standard"):
            opt_state = c.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        hook_init = getattr(c.after_update, "init", None)  # a hook's state (DSR's threshold)
        hook_state = None if hook_init is None else copy_arrays(hook_init(model))
        state = TrainState(
            step=jnp.asarray(0, jnp.int32),
            model=model,
            opt_state=opt_state,
            key=key,
            model_state=model_state,
            loss_scale=loss_scale,
            hook_state=hook_state,
        )
        if c.mesh is not None:
            shardings = self.state_shardings(state)
            state = jax.tree.map(
                lambda x, s: place(x, s) if eqx.is_array(x) else x, state, shardings,
                is_leaf=lambda x: x is None,
            )  # fmt: skip
        return state

    def state_shardings(self, state: TrainState) -> Any:
        """A `NamedSharding` per array leaf of `state` (None elsewhere): replicated with
        `shard="data"`; with `"fsdp"` the parameters and optimizer state split as
        `eqx_lowmem.train._shard.fsdp_layout` says, the rest replicated."""
        c = self.config
        assert c.mesh is not None
        return state_shardings(state, c.mesh, c.data_axis, c.shard)

    # -- call ------------------------------------------------------------------------------

    def __call__(
        self,
        state: TrainState,
        batch: tuple,
        weights: Float[Array, " batch"] | np.ndarray | None = None,
    ) -> tuple[TrainState, dict[str, Array]]:
        """One optimizer update from one batch.

        Args:
            state: from `init` or the previous call. Donated: do not use it afterwards.
            batch: a tuple of arrays with a common leading batch dimension, passed to the
                loss as `loss_fn(model, *batch)`: the whole batch of one update (with
                several processes, this process's part of it).
            weights: optional per-sample weights (0 drops a sample, e.g. padding).

        Returns:
            The new state and metrics: `loss` (the weighted mean over the batch),
            `weight` (total weight), `grad_norm` (of the accumulated gradient, before
            clipping), `finite` (False when the update was skipped), `loss_scale` (1.0
            without one), and with `skip_nonfinite`, `params_finite` (False when the new
            parameters hold NaN or inf: one more read of every parameter, after the
            update).
        """
        dynamic, static = self._split(state)
        new_dynamic, metrics = self.call_split(dynamic, static, batch, weights)
        new_state = merge(new_dynamic, static)
        parts = [(new_dynamic, static)]
        self._returned = (weakref.ref(new_state, lambda _, p=parts: p.clear()), parts)
        return new_state, metrics

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics in the order `call_split(..., packed=True)` stacks them."""
        last = ("params_finite",) if self.config.skip_nonfinite else ()
        return ("loss", "weight", "grad_norm", "finite", "loss_scale", *last)

    def call_split(
        self,
        dynamic: list,
        static: Static,
        batch: tuple,
        weights: Any = None,
        packed: bool = False,
    ) -> tuple[list, Any]:
        """`__call__` on a state split by `_state.split` into its arrays (`dynamic`,
        donated) and the rest (`static`): the new state's arrays and the metrics. A loop
        that keeps the state split (the Trainer's) builds no `TrainState` per update
        (about 15 us of an update's host time on an MLP, more while the step runs:
        bf9bdb4).

        `packed`: the metrics as one float32 vector in `metric_names`' order (`finite` 1 or
        0), the program's one output besides the state: a loop that reads every update's
        metrics (the Trainer's) then copies one array to the host, not five, and reads it
        in one conversion."""
        c = self.config
        batch = tuple(batch)
        size = self._check_batch(batch, weights)
        w = ones(size) if weights is None else weights
        local = 1 if c.mesh is None else max(1, self.n_shards // jax.process_count())
        if c.has_state:
            # Never pad a stateful model: repeats would enter BatchNorm's statistics. The
            # micro-batches are the real ones (`accumulate`); each device needs a share.
            if size % local:
                raise ValueError(
                    f"a batch of {size} samples cannot be split evenly over {local} devices "
                    "for a stateful model (BatchNorm): padding would change its statistics. "
                    f"Use a batch that is a multiple of {local}."
                )
        else:
            unit = c.accumulate * local
            padded = -(-size // unit) * unit
            if padded != size:
                # Pad with real samples (finite losses) at weight 0: the update is unchanged.
                index = np.arange(padded) % size
                batch = tuple(jnp.asarray(x)[index] for x in batch)
                w = jnp.concatenate([jnp.asarray(w, jnp.float32), jnp.zeros(padded - size)])
        if not (isinstance(w, jax.Array) and w.dtype == jnp.float32):
            w = jnp.asarray(w, jnp.float32)  # (0.03 ms a call even for such an array: 48d82b8)
        if c.mesh is not None:
            sharding = NamedSharding(c.mesh, P(c.data_axis))
            if jax.process_count() > 1:
                batch, w = jax.tree.map(
                    lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                    (batch, w),
                )
            else:
                batch, w = jax.device_put((batch, w), sharding)
        if packed:
            run = self._jitted_packed if c.jit else self._packed_arrays
        else:
            run = self._jitted if c.jit else self._step_arrays
        new_dynamic, metrics = run(batch, w, dynamic, static)
        if not packed and "loss_scale" not in metrics:
            # No loss scale: 1, not an output of the program (a constant output costs a
            # copy, a kernel on a GPU, and an output buffer: about 4 us of a small step,
            # measured for 9cfda2d).
            metrics["loss_scale"] = ones(())
        return new_dynamic, metrics

    def _split(self, state: TrainState) -> tuple[list, Static]:
        """`state`'s arrays and the rest (`_state.split`; kept for the state this step
        returned last), refusing a state whose arrays an earlier call donated."""
        returned, self._returned = self._returned, None
        if returned is not None and returned[0]() is state:
            return returned[1][0]  # this step's own output, not donated since
        dynamic, static = split(state)
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in dynamic):
            raise ValueError(_CONSUMED)
        return dynamic, static

    def trace(self, state: TrainState, batch: tuple, weights=None) -> jax.stages.Traced:
        """`jax.jit(...).trace(...)` of the step: its jaxpr (`.jaxpr`), and `.lower()`.

        `state` and `batch` may hold `jax.ShapeDtypeStruct`s (for example from
        `eqx.filter_eval_shape(step.init, model, key=key)`): nothing is allocated. The batch
        size must be a multiple of `granularity` (the call pads; this does not).
        """
        c = self.config
        size = self._check_batch(tuple(batch), weights)
        if size % self.granularity:
            raise ValueError(
                f"trace() and lower() need a batch size divisible by {self.granularity} "
                f"(accumulate x devices), got {size}."
            )
        sharding = None if c.mesh is None else NamedSharding(c.mesh, P(c.data_axis))
        batch = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding) for x in batch)
        w = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=sharding)
        if c.mesh is not None:
            shardings = self.state_shardings(state)
            state = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                if is_dynamic(x) else x,
                state, shardings, is_leaf=lambda x: x is None,
            )  # fmt: skip
        dynamic, static = split(state)
        return self._jitted.trace(batch, w, dynamic, static)

    def lower(self, state: TrainState, batch: tuple, weights=None) -> jax.stages.Lowered:
        """`jax.jit(...).lower(...)` of the step, for `.compile().memory_analysis()`: the
        very program a call runs, with the state donated. Arguments as `trace`."""
        return self.trace(state, batch, weights).lower()

    # -- internals -------------------------------------------------------------------------

    def _check_batch(self, batch: tuple, weights) -> int:
        if not batch:
            raise ValueError("batch is empty; expected a tuple of arrays such as (x, y).")
        size = _leading(batch)
        if size < self.config.accumulate:
            raise ValueError(
                f"a batch of {size} samples cannot be split into accumulate="
                f"{self.config.accumulate} micro-batches; use a batch of at least "
                f"{self.config.accumulate}."
            )
        if weights is not None and np.shape(weights) != (size,):
            raise ValueError(
                f"weights must have shape ({size},) (one per sample), got {np.shape(weights)}."
            )
        return size

    def _packed_arrays(self, batch, w, dynamic, static: Static):
        new_dynamic, metrics = self._step_arrays(batch, w, dynamic, static)
        metrics = {"loss_scale": jnp.ones((), jnp.float32), **metrics}
        return new_dynamic, jnp.stack([metrics[k].astype(jnp.float32) for k in self.metric_names])

    def _step_arrays(self, batch, w, dynamic, static: Static):
        def run(batch, w, dynamic):
            new_state, metrics = self._step(batch, w, merge(dynamic, static))
            new_dynamic, new_static = split(new_state)
            if new_static != static:
                raise ValueError(
                    "after_update changed the non-array structure of the state; a hook must "
                    "keep every leaf's structure, shape and dtype (rewiring changes values "
                    "only)."
                )
            return new_dynamic, metrics

        mesh = self.config.mesh
        if mesh is None:
            return run(batch, w, dynamic)
        # The new state leaves where `init` placed it; the metrics replicated.
        state = merge(dynamic, static)
        leaves = jax.tree.structure(state).flatten_up_to(self.state_shardings(state))
        placed = [s if d is not None else None for d, s in zip(dynamic, leaves, strict=True)]
        return in_auto_axes(run, mesh, (placed, NamedSharding(mesh, P())))(batch, w, dynamic)

    def _step(self, batch, w, state: TrainState):
        c = self._inner
        # This update's keys, from the state's key and the update count: where nothing
        # draws from them (no dropout, stochastic rounding or hook) XLA drops them, and a
        # small step spends no time deriving a new key (1.5% of the MLP benchmark's: 9b4b1f4).
        step_key, round_key, hook_key = jr.split(jr.fold_in(state.key, state.step), 3)
        scale = jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale.scale
        sums = batch_sums(c, state.model, state.model_state, batch, w, step_key, scale)
        # The norm's chunked loop keeps the select's skip from storing a float32 copy of
        # the gradient; without the select, XLA sums it inside the gradient's own passes.
        mean = mean_gradient(sums, scale, chunked=c.mesh is None and c.skip_nonfinite)
        params, static = eqx.partition(state.model, eqx.is_inexact_array)

        def grad_fn(model):
            # The mean gradient of this batch at another model (for after_update hooks).
            one = jnp.ones((), jnp.float32)
            return mean_gradient(batch_sums(c, model, state.model_state, batch, w, step_key, one),
                                 one).grads  # fmt: skip

        new = self._update(state, mean, sums, params, static, round_key)
        if c.after_update is not None:
            # After the update (or its skip): the hook gates itself on `info.finite`.
            hooked = c.after_update(new, UpdateInfo(mean.grads, hook_key, grad_fn, mean.finite))
            check_hooked(hooked, new)
            new = hooked
        if c.mesh is not None:
            new = self._constrain(new)
        loss_scale = None if state.loss_scale is None else state.loss_scale.adjust(mean.finite)
        new = dataclasses.replace(new, loss_scale=loss_scale)
        metrics = {"loss": mean.loss, "weight": mean.weight, "grad_norm": mean.norm,
                   "finite": mean.finite}  # fmt: skip
        if state.loss_scale is not None:  # else 1, added by `call_split`
            metrics["loss_scale"] = scale
        if c.skip_nonfinite:
            metrics["params_finite"] = all_finite(
                eqx.filter(new.model, eqx.is_inexact_array), chunked=c.mesh is None
            )
        return new, metrics

    def _update(self, state, mean, sums, params, static, round_key) -> TrainState:
        """The state after the optimizer's update: where `mean.finite` when the step skips
        non-finite updates, else always (a hand-written step's update, in one pass per
        leaf: measured for 48d82b8, any select on `finite` or read of the new parameters
        costs up to 30% of a small step's time)."""
        c = self.config
        finite = mean.finite

        def update(opt_state, grads=mean.grads):
            updates, opt_state = optimizer_update(c.optimizer, grads, opt_state, params)
            return apply_updates(params, updates, param_dtype=c.policy.param_dtype,
                                 key=round_key), opt_state  # fmt: skip

        def applied(grads=mean.grads) -> TrainState:
            new_params, opt_state = update(state.opt_state, grads)
            return dataclasses.replace(
                state, step=state.step + 1, model=eqx.combine(new_params, static),
                opt_state=opt_state, model_state=sums.model_state,
            )  # fmt: skip

        if not c.skip_nonfinite:
            return applied()
        if c.after_update is not None:
            # A rewiring hook overwrites the slots in place inside its loop: after a
            # select XLA copies them first (every step); out of a `lax.cond` it does not.
            dynamic, rest = eqx.partition(state, eqx.is_array)

            def apply():
                # The gradient formed again inside the branch, from the stored sums: a
                # value the branch closed over would be stored whole in float32 first.
                return eqx.filter(applied(scaled(sums, mean.factor)), eqx.is_array)

            return eqx.combine(if_finite_cond(finite, apply, dynamic), rest)
        new_params = select(finite, update(state.opt_state)[0], params)
        # The optimizer's new state, traced again from its old state read after the new
        # parameters exist (the same numbers; XLA keeps of each trace only what is used):
        # so the state is overwritten in place, not copied first (see `read_after`).
        old_opt = read_after(state.opt_state, new_params)
        return dataclasses.replace(
            state,
            step=jnp.where(finite, state.step + 1, state.step),
            model=eqx.combine(new_params, static),
            opt_state=select(finite, update(old_opt)[1], old_opt),
            model_state=select(finite, sums.model_state, state.model_state),
        )

    def _constrain(self, state: TrainState) -> TrainState:
        """Keep each array of the new state where `init` placed it (no silent re-layout)."""
        c = self._inner
        assert c.mesh is not None
        shardings = state_shardings(state, c.mesh, c.data_axis, c.shard)
        return jax.tree.map(
            lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s),
            state, shardings, is_leaf=lambda x: x is None,
        )  # fmt: skip
