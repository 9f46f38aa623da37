"""The training step: the composition of the pieces, in one jitted, donated call.

    batch ─ accumulate(loss_grad) ─ [shard_map over devices] ─ mean_gradient ─ if_finite(
        optimizer_update ─ apply_updates) ─ after_update ─ loss scale ─ new TrainState

Every piece is a pure function of its own module (`_loss`, `_accumulate`, `_update`,
`_shard`); this file only wires them and checks what users pass in.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from ..nn._layers import layer_hook
from ..precision._loss_scale import DynamicLossScale, dynamic_loss_scale
from ..precision._optim import half_state
from ..precision._policy import Policy, get_policy
from ._accumulate import Sums, accumulate, check_accumulate_dtype, loss_grad
from ._loss import accepts_key
from ._shard import (
    fsdp_layout,
    gather_layer,
    gather_leaves,
    is_inexact_like,
    replace_fields,
    specs_like,
)
from ._update import (
    UpdateInfo,
    apply_updates,
    if_finite,
    mean_gradient,
    optimizer_update,
)

SHARDS: tuple[str, ...] = ("data", "fsdp")

_CONSUMED = (
    "the TrainState passed to this step was already consumed: a step donates the state's "
    "buffers to the new state it returns. Use the returned state:\n\n"
    "    state, metrics = step(state, batch)      # right: rebind `state`\n"
    "    new, metrics = step(state, batch); step(state, batch)   # wrong: reuses `state`\n"
)


class TrainState(eqx.Module):
    """Everything a step changes, as one pytree (saved whole by checkpoints).

    Attributes:
        step: optimizer updates applied so far (a skipped update does not count, so optax
            schedules count real updates).
        model: the model, parameters in the policy's `param_dtype`.
        opt_state: the optimizer's state.
        key: PRNG key; split on every call for dropout and stochastic rounding.
        model_state: `eqx.nn.State` of stateful layers (BatchNorm), or None.
        loss_scale: the `DynamicLossScale`, or None.
    """

    step: Int[Array, ""]
    model: Any
    opt_state: Any
    key: PRNGKeyArray
    model_state: Any = None
    loss_scale: DynamicLossScale | None = None


def _is_dynamic(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


class _Static:
    """The non-array part of a state as a static `jax.jit` argument: its treedef and its
    non-array leaves, hashed by value where they hash and by identity where they do not
    (a list-valued field, an optimizer's closure), as Equinox partitions for `filter_jit`."""

    def __init__(self, treedef: Any, leaves: tuple):
        self.treedef, self.leaves = treedef, leaves

    def __hash__(self) -> int:
        def h(x):
            try:
                return hash(x)
            except TypeError:
                return id(x)

        return hash((self.treedef, tuple(h(x) for x in self.leaves)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static) or self.treedef != other.treedef:
            return False
        return all(_same(a, b) for a, b in zip(self.leaves, other.leaves, strict=True))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _split(tree: Any) -> tuple[list, _Static]:
    leaves, treedef = jax.tree.flatten(tree)
    dynamic = [x if _is_dynamic(x) else None for x in leaves]
    static = tuple(None if _is_dynamic(x) else x for x in leaves)
    return dynamic, _Static(treedef, static)


def _merge(dynamic: list, static: _Static) -> Any:
    leaves = [d if s is None else s for d, s in zip(dynamic, static.leaves, strict=True)]
    return jax.tree.unflatten(static.treedef, leaves)


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def _leading(batch: tuple) -> int:
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or -1 in sizes:
        shapes = [np.shape(x) for x in jax.tree.leaves(batch)]
        raise ValueError(
            f"batch arrays must share their first (batch) dimension; got shapes {shapes}."
        )
    return sizes.pop()


def _place(x: Any, sharding: NamedSharding) -> Any:
    """Put a host-or-device array on `sharding`, also across processes (every process holds
    the same value, as after `init`)."""
    if _is_key(x):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(_place(jax.random.key_data(x), sharding), impl=impl)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    a = np.asarray(x)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def _check_leaves(model: Any) -> None:
    for path, x in jax.tree_util.tree_leaves_with_path(model):
        if isinstance(x, np.ndarray) and x.dtype.kind in "USOV":
            raise TypeError(
                f"model leaf {jax.tree_util.keystr(path)} is a numpy array of dtype {x.dtype}; "
                "a model's arrays must be numeric. Mark non-numeric data "
                "eqx.field(static=True) or keep it outside the model."
            )


def _dropout_rates(model: Any) -> list[tuple[str, float]]:
    """Modules of `model` with a dropout rate above 0 (`eqx.nn.Dropout.p`, `dropout` fields)."""
    found: list[tuple[str, float]] = []

    def visit(x: Any, path: str) -> None:
        if isinstance(x, eqx.Module):
            rate = x.p if isinstance(x, eqx.nn.Dropout) else getattr(x, "dropout", None)
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
                found.append((path or type(x).__name__, float(rate)))
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name, None), f"{path}.{f.name}")
        elif isinstance(x, (list, tuple)):
            for i, item in enumerate(x):
                visit(item, f"{path}[{i}]")
        elif isinstance(x, dict):
            for k, item in x.items():
                visit(item, f"{path}[{k!r}]")

    visit(model, "")
    return found


@dataclasses.dataclass(frozen=True)
class _Config:
    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    accumulate: int
    policy: Policy
    loss_scale: DynamicLossScale | None
    has_state: bool
    mesh: Mesh | None
    data_axis: str
    shard: str
    after_update: Callable[[TrainState, UpdateInfo], TrainState] | None
    jit: bool
    accumulate_dtype: Any = jnp.dtype(jnp.float32)
    fuse_accumulation: bool = True


class Step:
    """A training step built by `make_step` (the only constructor); call it as
    `state, metrics = step(state, batch)`."""

    def __init__(self, config: _Config):
        if not isinstance(config, _Config):
            raise TypeError("build a Step with eqx_lowmem.train.make_step(loss, optimizer, ...).")
        self.config = config
        # jax.jit over the state's arrays (donated), its non-array part a static argument:
        # unlike eqx.filter_jit, lowering then accepts jax.ShapeDtypeStruct stand-ins, so
        # memory can be analysed without allocating anything.
        self._jitted = jax.jit(self._step_arrays, static_argnums=3, donate_argnums=2)

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
            ValueError: without `model_state` for `has_state=True`; for a model with dropout
                and a loss that takes no `key` (dropout would never apply).
            TypeError: for a model leaf that is a non-numeric array, or a key that is not one.
        """
        c = self.config
        if c.has_state and model_state is None:
            raise ValueError(
                "make_step(..., has_state=True) needs the model's state: "
                "init(model, key=key, model_state=state), e.g. from eqx.nn.make_with_state."
            )
        if not (_is_key(key) or (isinstance(key, jax.Array) and key.dtype == jnp.uint32)):
            raise TypeError(
                f"key must be a JAX PRNG key (jr.PRNGKey(0) or jr.key(0)), got "
                f"{type(key).__name__} {key!r}."
            )
        _check_leaves(model)
        dropout = _dropout_rates(model)
        if dropout and not accepts_key(c.loss_fn):
            where = ", ".join(f"{p} ({r})" for p, r in dropout[:3])
            raise ValueError(
                f"the model has dropout ({where}) but the loss takes no `key`, so dropout "
                "would never apply. Give the loss a `key=None` keyword and pass it to the "
                "model (the built-in losses do), or set dropout to 0."
            )
        model = c.policy.cast_to_param(model)
        if c.shard == "fsdp":
            model = fsdp_layout(model, self.n_shards, c.data_axis).model
        # Copies: steps donate the state's buffers, and init may be called again.
        model, model_state, key, loss_scale = _copy((model, model_state, key, c.loss_scale))
        with jax.numpy_dtype_promotion("standard"):
            opt_state = c.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        state = TrainState(
            step=jnp.asarray(0, jnp.int32),
            model=model,
            opt_state=opt_state,
            key=key,
            model_state=model_state,
            loss_scale=loss_scale,
        )
        if c.mesh is not None:
            shardings = self.state_shardings(state)
            state = jax.tree.map(
                lambda x, s: _place(x, s) if eqx.is_array(x) else x, state, shardings,
                is_leaf=lambda x: x is None,
            )  # fmt: skip
        return state

    def state_shardings(self, state: TrainState) -> Any:
        """A `NamedSharding` per array leaf of `state` (None elsewhere): replicated with
        `shard="data"`; with `"fsdp"` the parameters and optimizer state split as
        `eqx_lowmem.train._shard.fsdp_layout` says, the rest replicated."""
        c = self.config
        assert c.mesh is not None
        mesh, axis, n = c.mesh, c.data_axis, self.n_shards

        def named(spec):
            return None if spec is None else NamedSharding(mesh, spec)

        replicated = jax.tree.map(lambda x: NamedSharding(mesh, P()) if _is_dynamic(x) else None,
                                  state)  # fmt: skip
        if c.shard != "fsdp":
            return replicated
        model_specs = fsdp_layout(state.model, n, axis).specs
        opt_specs = self._opt_specs(state, model_specs)
        return replace_fields(
            replicated,
            model=jax.tree.map(named, model_specs, is_leaf=lambda x: isinstance(x, P)),
            opt_state=jax.tree.map(named, opt_specs, is_leaf=lambda x: isinstance(x, P)),
        )

    def _opt_specs(self, state: TrainState, model_specs: Any) -> Any:
        """Optimizer-state specs: a subtree shaped like the parameters (Adam's moments) gets
        the parameters' specs; any other array the plain rule."""
        c = self.config
        params = eqx.filter(state.model, is_inexact_like)
        param_specs = jax.tree.map(
            lambda p, s: s if p is not None else None, params, model_specs,
            is_leaf=lambda x: x is None,
        )  # fmt: skip
        treedef = jax.tree.structure(params)

        def like_params(x):
            try:
                return jax.tree.structure(x) == treedef and x is not None
            except Exception:
                return False

        def node(x):
            if like_params(x):
                shapes = [np.shape(a) for a in jax.tree.leaves(x)]
                if shapes == [np.shape(a) for a in jax.tree.leaves(params)]:
                    return param_specs
            return specs_like(x, self.n_shards, c.data_axis)

        return jax.tree.map(node, state.opt_state, is_leaf=like_params)

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
            clipping), `finite` (False when the update was skipped), `loss_scale`.
        """
        c = self.config
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
            raise ValueError(_CONSUMED)
        batch = tuple(batch)
        size = self._check_batch(batch, weights)
        w = np.ones((size,), np.float32) if weights is None else weights
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
        w = jnp.asarray(w, jnp.float32)
        if c.mesh is not None:
            sharding = NamedSharding(c.mesh, P(c.data_axis))
            if jax.process_count() > 1:
                batch, w = jax.tree.map(
                    lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                    (batch, w),
                )
            else:
                batch, w = jax.device_put((batch, w), sharding)
        if not c.jit:
            return self._step(batch, w, state)
        dynamic, static = _split(state)
        new_dynamic, metrics = self._jitted(batch, w, dynamic, static)
        return _merge(new_dynamic, static), metrics

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
                if _is_dynamic(x) else x,
                state, shardings, is_leaf=lambda x: x is None,
            )  # fmt: skip
        dynamic, static = _split(state)
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

    def _step_arrays(self, batch, w, dynamic, static: _Static):
        new_state, metrics = self._step(batch, w, _merge(dynamic, static))
        new_dynamic, new_static = _split(new_state)
        if new_static != static:
            raise ValueError(
                "after_update changed the non-array structure of the state; a hook must keep "
                "every leaf's structure, shape and dtype (rewiring changes values only)."
            )
        return new_dynamic, metrics

    def _grad_fn(self, static: Any, prepare: Callable[[Any], Any] | None = None):
        """The accumulated gradient function of the loss, for a model split off `static`."""
        c = self.config
        dtype = c.accumulate_dtype
        grad_fn = loss_grad(c.loss_fn, static, c.policy, prepare=prepare, dtype=dtype)
        return accumulate(grad_fn, c.accumulate, dtype=dtype, fuse=c.fuse_accumulation)

    def _sums(self, model: Any, model_state, batch, w, key, scale) -> Sums:
        """The summed gradient of the batch w.r.t. the inexact leaves of `model`, over every
        micro-batch and device."""
        c = self.config
        if c.mesh is None:
            params, static = eqx.partition(model, eqx.is_inexact_array)
            return self._grad_fn(static)(params, model_state, batch, w, key, scale)

        axis, n = c.data_axis, self.n_shards
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
                sums = self._grad_fn(static, prepare)(params, model_state, batch, w, key, scale)
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

    def _step(self, batch, w, state: TrainState):
        c = self.config
        key, step_key, round_key, hook_key = jr.split(state.key, 4)
        scale = jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale.scale
        sums = self._sums(state.model, state.model_state, batch, w, step_key, scale)
        mean = mean_gradient(sums, scale)
        params, static = eqx.partition(state.model, eqx.is_inexact_array)

        def grad_fn(model):
            # The mean gradient of this batch at another model (for after_update hooks).
            one = jnp.ones((), jnp.float32)
            return mean_gradient(self._sums(model, state.model_state, batch, w, step_key, one),
                                 one).grads  # fmt: skip

        def apply() -> TrainState:
            updates, opt_state = optimizer_update(c.optimizer, mean.grads, state.opt_state, params)
            new_params = apply_updates(
                params, updates, param_dtype=c.policy.param_dtype, key=round_key
            )
            new = dataclasses.replace(
                state,
                step=state.step + 1,
                model=eqx.combine(new_params, static),
                opt_state=opt_state,
                model_state=sums.model_state,
            )
            return new

        dynamic, state_static = eqx.partition(state, eqx.is_array)
        new = eqx.combine(
            if_finite(mean.finite, lambda: eqx.filter(apply(), eqx.is_array), dynamic),
            state_static,
        )
        if c.after_update is not None:
            # After the finiteness cond, not inside it: a hook that reads the optimizer's
            # outputs inside the cond's branch makes XLA keep a second copy of the
            # parameters and optimizer state (0.85x instead of 0.58x of a dense step's
            # peak for DSR at 30%). The hook gates itself on `info.finite`.
            hooked = c.after_update(new, UpdateInfo(mean.grads, hook_key, grad_fn, mean.finite))
            _check_hooked(hooked, new)
            new = hooked
        if c.mesh is not None:
            new = self._constrain(new)
        loss_scale = None if state.loss_scale is None else state.loss_scale.adjust(mean.finite)
        new = dataclasses.replace(new, key=key, loss_scale=loss_scale)
        metrics = {
            "loss": mean.loss,
            "weight": mean.weight,
            "grad_norm": optax.tree.norm(mean.grads),
            "finite": mean.finite,
            "loss_scale": scale,
        }
        return new, metrics

    def _constrain(self, state: TrainState) -> TrainState:
        """Keep each array of the new state where `init` placed it (no silent re-layout)."""
        shardings = self.state_shardings(state)
        return jax.tree.map(
            lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s),
            state, shardings, is_leaf=lambda x: x is None,
        )  # fmt: skip


def _check_hooked(hooked: Any, state: TrainState) -> None:
    """An `after_update` hook must return a TrainState of the same structure, shapes and
    dtypes (rewiring changes values only)."""

    def avals(tree):
        # The array tree's structure holds the places of the non-array leaves too.
        arrays = eqx.filter(tree, eqx.is_array)
        return jax.tree.structure(arrays), [(x.shape, x.dtype) for x in jax.tree.leaves(arrays)]

    if not isinstance(hooked, TrainState) or avals(hooked) != avals(state):
        raise ValueError(
            "after_update must return a TrainState of the same structure, shapes and dtypes "
            "as it received (rewiring changes values only)."
        )


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
        precision: a preset of `eqx_lowmem.precision.PRESETS` (`"float32"`, `"mixed_bf16"`,
            `"mixed_fp16"`, `"half_bf16"`, `"half_fp16"`) or a `Policy`. With a 16-bit
            compute dtype, the parameters of scanned stacks (`eqx_lowmem.nn.Stack`,
            `transformer_encoder`) are cast one block at a time inside the scan, so only one
            block's 16-bit copy is alive; other parameters are cast once per micro-batch.
        loss_scale: `"auto"` (a dynamic loss scale when the policy uses float16), None, or a
            `DynamicLossScale`. A non-finite gradient skips the update (parameters,
            optimizer state, model state and the update counter unchanged) and halves it.
        has_state: the model has `eqx.nn.State` (BatchNorm). The state is threaded through
            the micro-batches in order: batch statistics are those of each micro-batch,
            and running averages are updated once per micro-batch (Sohoni et al., 2019,
            Section 3.3: micro-batching changes what BatchNorm normalises over).
        mesh: a `jax.sharding.Mesh` for data parallelism: the batch is split over
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
            the recomputation of the backward) and a reduce-scatter of its gradient.
        after_update: a hook `after_update(state, info) -> state`, run inside the jitted
            step on every step, after the update (or its skip, for a non-finite gradient),
            with an `UpdateInfo`: the mean gradient, a fresh key, `grad_fn` for another
            gradient of the batch, and `finite`, False when the update was skipped (gate
            on it: the sparse hooks rewire only after an applied update). It must keep
            every leaf's shape and dtype. Sparse training rewires there
            (`eqx_lowmem.sparse`).
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
            gradient-sized buffer less; the same additions, in the same order). Stacks it
            cannot apply to run as before: those that keep activations, and FSDP's
            gathered stacks. `False` turns it off.

    Optimizer state in host memory (memory kinds) is not offered: XLA:CPU has one memory
    kind, so it could not be tested here, and on a GPU an optimizer update over pinned host
    buffers runs at PCIe speed every step; FSDP (`shard="fsdp"`) and 16-bit state
    (`precision="half_bf16"`) cut the same bytes without that cost.

    Returns:
        A `Step`: `state = step.init(model, key=key)`, then
        `state, metrics = step(state, batch)`.

    Raises:
        ValueError: for `accumulate < 1`, a `data_axis` not in the mesh, an unknown `shard`.
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
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(
            f"accumulate={accumulate!r}; expected an int >= 1 (the number of "
            "micro-batches each batch is split into)."
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
            "jax.sharding.Mesh(jax.devices(), ('data',)))."
        )
    if after_update is not None and not callable(after_update):
        raise TypeError(f"after_update must be callable, got {type(after_update).__name__}.")
    if jax.process_count() > 1 and mesh is None:
        raise ValueError(
            f"this is one of {jax.process_count()} processes but make_step has no mesh; "
            "pass mesh=jax.sharding.Mesh(jax.devices(), ('data',)) so they train together."
        )
    policy = get_policy(precision)
    accumulate_dtype = check_accumulate_dtype(accumulate_dtype)
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
    )
    return Step(config)
