"""The training step: micro-batch accumulation in one jitted call, with every memory tool."""

import inspect
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

from ..precision._loss_scale import DynamicLossScale, all_finite, dynamic_loss_scale
from ..precision._optim import half_state
from ..precision._policy import Policy, cast_floating, get_policy
from ..precision._rounding import stochastic_round_tree


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


def _accepts_key(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def _is_dynamic(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _leading(batch: tuple) -> int:
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or -1 in sizes:
        shapes = [np.shape(x) for x in jax.tree.leaves(batch)]
        raise ValueError(
            f"batch arrays must share their first (batch) dimension; got shapes {shapes}."
        )
    return sizes.pop()


class Step:
    """A training step built by `make_step`; call it as `state, metrics = step(state, batch)`."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        accumulate: int = 1,
        precision: "str | Policy | None" = None,
        loss_scale: "DynamicLossScale | Literal['auto'] | None" = "auto",
        has_state: bool = False,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        jit: bool = True,
    ):
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
        if mesh is not None and data_axis not in mesh.axis_names:
            raise ValueError(
                f"data_axis={data_axis!r} is not an axis of the mesh {mesh.axis_names}."
            )
        self.loss_fn = loss_fn
        self.policy = get_policy(precision)
        self.optimizer = (
            half_state(optimizer, self.policy.opt_state_dtype) if self.policy.is_half else optimizer
        )
        if loss_scale == "auto":
            loss_scale = dynamic_loss_scale() if self.policy.needs_loss_scale else None
        elif loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
            raise TypeError(
                "loss_scale must be 'auto', None or an eqx_lowmem.precision.DynamicLossScale, "
                f"got {type(loss_scale).__name__}."
            )
        self.loss_scale = loss_scale
        self.accumulate = accumulate
        self.has_state = has_state
        self.mesh = mesh
        self.data_axis = data_axis
        self.n_shards = 1 if mesh is None else int(mesh.shape[data_axis])
        self._pass_key = _accepts_key(loss_fn)
        self._jit = jit
        # jax.jit over the state's arrays (donated), its static part a static argument: unlike
        # eqx.filter_jit, lowering then accepts jax.ShapeDtypeStruct stand-ins, so memory
        # can be analysed without allocating anything.
        self._jitted = jax.jit(self._step_arrays, static_argnums=3, donate_argnums=2)

    # -- public ---------------------------------------------------------------------------

    def init(self, model: PyTree, *, key: PRNGKeyArray, model_state: PyTree = None) -> TrainState:
        """The initial `TrainState`: parameters cast to the policy, a fresh optimizer state.

        The state owns copies of the model's arrays and of the key (steps donate the
        state's buffers), so `model` and `key` stay usable; drop `model` to free its memory.
        """
        if self.has_state and model_state is None:
            raise ValueError(
                "make_step(..., has_state=True) needs the model's state: "
                "init(model, key=key, model_state=state), e.g. from eqx.nn.make_with_state."
            )
        # Copies: steps donate the state's buffers, and init may be called again.
        model, model_state, key, loss_scale = _copy(
            (self.policy.cast_to_param(model), model_state, key, self.loss_scale)
        )
        with jax.numpy_dtype_promotion("standard"):
            opt_state = self.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        state = TrainState(
            step=jnp.asarray(0, jnp.int32),
            model=model,
            opt_state=opt_state,
            key=key,
            model_state=model_state,
            loss_scale=loss_scale,
        )
        if self.mesh is not None:
            state = eqx.filter_shard(state, NamedSharding(self.mesh, P()))
        return state

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
                loss as `loss_fn(model, *batch)`.
            weights: optional per-sample weights (0 drops a sample, e.g. padding).

        Returns:
            The new state and metrics: `loss` (the weighted mean over the batch),
            `weight` (total weight), `grad_norm` (of the accumulated gradient, before
            clipping), `finite` (False when the update was skipped), `loss_scale`.
        """
        batch = tuple(batch)
        size = self._check_batch(batch, weights)
        padded = -(-size // self.granularity) * self.granularity
        w = np.ones((size,), np.float32) if weights is None else weights
        if padded != size:
            # Pad with real samples (finite losses) at weight 0: the update is unchanged.
            index = np.arange(padded) % size
            batch = tuple(jnp.asarray(x)[index] for x in batch)
            w = jnp.concatenate([jnp.asarray(w, jnp.float32), jnp.zeros(padded - size)])
        w = jnp.asarray(w, jnp.float32)
        if self.mesh is not None:
            sharding = NamedSharding(self.mesh, P(self.data_axis))
            batch, w = jax.device_put((batch, w), sharding)
        if not self._jit:
            return self._step(batch, w, state)
        dynamic, static = eqx.partition(state, _is_dynamic)
        new_dynamic, metrics = self._jitted(batch, w, dynamic, static)
        return eqx.combine(new_dynamic, static), metrics

    @property
    def granularity(self) -> int:
        """Batches are padded (at weight 0) to a multiple of this: micro-batches x shards."""
        return self.accumulate * self.n_shards

    def trace(self, state: TrainState, batch: tuple, weights=None) -> jax.stages.Traced:
        """`jax.jit(...).trace(...)` of the step: its jaxpr (`.jaxpr`), and `.lower()`.

        `state` and `batch` may hold `jax.ShapeDtypeStruct`s (for example from
        `eqx.filter_eval_shape(step.init, model, key=key)`): nothing is allocated. The batch
        size must be a multiple of `granularity` (the call pads; this does not).
        """
        size = self._check_batch(tuple(batch), weights)
        if size % self.granularity:
            raise ValueError(
                f"trace() and lower() need a batch size divisible by {self.granularity} "
                f"(accumulate x devices), got {size}."
            )
        sharding = None if self.mesh is None else NamedSharding(self.mesh, P(self.data_axis))
        batch = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding) for x in batch)
        w = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=sharding)
        dynamic, static = eqx.partition(state, _is_dynamic)
        return self._jitted.trace(batch, w, dynamic, static)

    def lower(self, state: TrainState, batch: tuple, weights=None) -> jax.stages.Lowered:
        """`jax.jit(...).lower(...)` of the step, for `.compile().memory_analysis()`: the
        very program a call runs, with the state donated. Arguments as `trace`."""
        return self.trace(state, batch, weights).lower()

    # -- internals ------------------------------------------------------------------------

    def _check_batch(self, batch: tuple, weights) -> int:
        if not batch:
            raise ValueError("batch is empty; expected a tuple of arrays such as (x, y).")
        size = _leading(batch)
        if size < self.accumulate:
            raise ValueError(
                f"a batch of {size} samples cannot be split into accumulate="
                f"{self.accumulate} micro-batches; use a batch of at least {self.accumulate}."
            )
        if weights is not None and np.shape(weights) != (size,):
            raise ValueError(
                f"weights must have shape ({size},) (one per sample), got {np.shape(weights)}."
            )
        return size

    def _micro(self, params, static, model_state, batch, w, key, scale):
        """Gradient of the scaled weighted loss sum of one micro-batch, and its aux."""

        def f(params):
            model = eqx.combine(self.policy.cast_to_compute(params), static)
            inputs = self.policy.cast_to_compute(batch)
            kwargs = {"key": key} if self._pass_key else {}
            if self.has_state:
                out, new_state = self.loss_fn(model, model_state, *inputs, **kwargs)
            else:
                out, new_state = self.loss_fn(model, *inputs, **kwargs), None
            values, weights = out if isinstance(out, tuple) else (out, None)
            values = values.astype(jnp.float32)
            weights = jnp.ones_like(values) if weights is None else weights.astype(jnp.float32)
            if values.shape[:1] != w.shape or weights.shape != values.shape:
                raise ValueError(
                    "the loss must return one value per sample (or per token) with the batch "
                    f"first, e.g. shape ({w.shape[0]},); got {values.shape}"
                    + ("" if weights.shape == values.shape else f" and weights {weights.shape}")
                    + ". Return per-sample values, not their mean: the step reduces them."
                )
            weights = weights * w.reshape(w.shape + (1,) * (values.ndim - 1))
            total = jnp.sum(values * weights)
            # Differentiate total * scale / count: gradients of mean-like magnitude (what
            # a loss scale is tuned for); the step rescales to the exact batch mean later.
            count = values.size
            return total * (scale / count), (total, jnp.sum(weights), new_state, count)

        grads, (total, weight, new_state, count) = jax.grad(f, has_aux=True)(params)
        return cast_floating(grads, jnp.float32), total, weight, new_state, count

    def _accumulate(self, params, static, model_state, batch, w, key, scale):
        """Sum of the micro-batch gradients over this device's part of the batch."""
        k = self.accumulate
        if k == 1:
            grads, total, weight, model_state, count = self._micro(
                params, static, model_state, batch, w, key, scale
            )
        else:
            # (k, micro, ...): micro-batch i is samples [i * micro, (i + 1) * micro).
            split = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
            w_split = w.reshape(k, -1)
            shapes = eqx.filter_eval_shape(
                lambda: self._micro(
                    params,
                    static,
                    model_state,
                    jax.tree.map(lambda x: x[0], split),
                    w_split[0],
                    key,
                    scale,
                )
            )
            count = shapes[4]

            def body(carry, xs):
                acc, total, weight, mstate = carry
                mb, mw, i = xs
                g, t, n, mstate, _ = self._micro(
                    params, static, mstate, mb, mw, jr.fold_in(key, i), scale
                )
                acc = jax.tree.map(jnp.add, acc, g)
                return (acc, total + t, weight + n, mstate), None

            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes[0])
            init = (zeros, jnp.zeros(()), jnp.zeros(()), model_state)
            (grads, total, weight, model_state), _ = jax.lax.scan(
                body, init, (split, w_split, jnp.arange(k))
            )
        if self.mesh is not None:
            # One reduction per update, after the micro-batch loop.
            grads, total, weight = jax.lax.psum((grads, total, weight), self.data_axis)
            model_state = jax.tree.map(
                lambda x: jax.lax.pmean(x, self.data_axis) if eqx.is_inexact_array(x) else x,
                model_state,
            )
        return grads, total, weight, model_state, count

    def _step_arrays(self, batch, w, dynamic, static):
        new_state, metrics = self._step(batch, w, eqx.combine(dynamic, static))
        return eqx.filter(new_state, _is_dynamic), metrics

    def _step(self, batch, w, state: TrainState):
        params, static = eqx.partition(state.model, eqx.is_inexact_array)
        key, step_key, round_key = jr.split(state.key, 3)
        scale = jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale.scale
        if self.mesh is None:
            grads, total, weight, model_state, count = self._accumulate(
                params, static, state.model_state, batch, w, step_key, scale
            )
        else:
            axis = self.data_axis

            def local(params, model_state, batch, w, key, scale):
                key = jr.fold_in(key, jax.lax.axis_index(axis))
                g, t, n, ms, _ = self._accumulate(params, static, model_state, batch, w, key, scale)
                return g, t, n, ms

            count = self._local_count(params, static, state.model_state, batch, w, step_key)
            grads, total, weight, model_state = jax.shard_map(
                local,
                mesh=self.mesh,
                in_specs=(P(), P(), P(axis), P(axis), P(), P()),
                out_specs=(P(), P(), P(), P()),
                check_vma=False,
            )(params, state.model_state, batch, w, step_key, scale)

        safe_weight = jnp.where(weight > 0, weight, 1.0)
        grads = jax.tree.map(lambda g: g * (count / (safe_weight * scale)), grads)
        loss = total / safe_weight
        # One finiteness check per update, on the accumulated gradient, before clipping.
        finite = all_finite(grads) & jnp.isfinite(loss)

        def apply(_):
            # Optax mixes Python floats with int32 counters (Adam's bias correction), which
            # strict dtype promotion rejects; its arithmetic is its own business.
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = self.optimizer.update(grads, state.opt_state, params)
            if self.policy.is_half:
                # 16-bit parameters: round the float32 result stochastically, so updates
                # smaller than half a 16-bit step still move the parameters on average.
                summed = jax.tree.map(
                    lambda p, u: p.astype(jnp.float32) + u.astype(jnp.float32), params, updates
                )
                new_params = stochastic_round_tree(summed, self.policy.param_dtype, round_key)
            else:
                new_params = optax.apply_updates(params, updates)
            return new_params, opt_state, model_state, state.step + 1

        def skip(_):
            return params, state.opt_state, state.model_state, state.step

        new_params, opt_state, new_model_state, step = jax.lax.cond(finite, apply, skip, None)
        loss_scale = None if state.loss_scale is None else state.loss_scale.adjust(finite)
        new_state = TrainState(
            step=step,
            model=eqx.combine(new_params, static),
            opt_state=opt_state,
            key=key,
            model_state=new_model_state,
            loss_scale=loss_scale,
        )
        metrics = {
            "loss": loss,
            "weight": weight,
            "grad_norm": optax.tree.norm(grads),
            "finite": finite,
            "loss_scale": scale,
        }
        return new_state, metrics

    def _local_count(self, params, static, model_state, batch, w, key) -> int:
        n = self.n_shards * self.accumulate
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // n,) + x.shape[1:], x.dtype), batch
        )
        mw = jax.ShapeDtypeStruct((w.shape[0] // n,), w.dtype)
        out = eqx.filter_eval_shape(
            lambda mb, mw: self._micro(
                params, static, model_state, mb, mw, key, jnp.ones((), jnp.float32)
            ),
            micro,
            mw,
        )
        return out[4]


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    accumulate: int = 1,
    precision: "str | Policy | None" = None,
    loss_scale: "DynamicLossScale | Literal['auto'] | None" = "auto",
    has_state: bool = False,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    jit: bool = True,
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
    at weight 0) and masked tokens give the update of the whole batch.

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
            `"mixed_fp16"`, `"half_bf16"`, `"half_fp16"`) or a `Policy`.
        loss_scale: `"auto"` (a dynamic loss scale when the policy uses float16), None, or a
            `DynamicLossScale`. A non-finite gradient skips the update (parameters,
            optimizer state, model state and the update counter unchanged) and halves it.
        has_state: the model has `eqx.nn.State` (BatchNorm). The state is threaded through
            the micro-batches in order: batch statistics are those of each micro-batch,
            and running averages are updated once per micro-batch (Sohoni et al., 2019,
            Section 3.3: micro-batching changes what BatchNorm normalises over).
        mesh: a `jax.sharding.Mesh` for data parallelism: the batch is split over
            `data_axis`, each device accumulates its micro-batches, and the gradients are
            summed across devices once per update.
        data_axis: the mesh axis the batch is split over.
        jit: False runs the step eagerly (for debugging).

    Returns:
        A `Step`: `state = step.init(model, key=key)`, then
        `state, metrics = step(state, batch)`.

    Raises:
        ValueError: for `accumulate < 1` or a `data_axis` not in the mesh. The step raises
            for batches whose arrays differ in length or that are smaller than `accumulate`.

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
    return Step(
        loss_fn,
        optimizer,
        accumulate=accumulate,
        precision=precision,
        loss_scale=loss_scale,
        has_state=has_state,
        mesh=mesh,
        data_axis=data_axis,
        jit=jit,
    )
