"""The training state: `TrainState`, the checks of what `Step.init` builds it from, and the
split of a state into its arrays and its static rest for `jax.jit`."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Int, PRNGKeyArray

from .._checks import check_prng_key
from ..precision._loss_scale import DynamicLossScale
from ._loss import accepts_key


class TrainState(eqx.Module):
    """Everything a step changes, as one pytree (saved whole by checkpoints).

    Attributes:
        step: optimizer updates applied so far (a skipped update does not count, so optax
            schedules count real updates).
        model: the model, parameters in the policy's `param_dtype`.
        opt_state: the optimizer's state.
        key: PRNG key, kept: each update draws (dropout, stochastic rounding, a hook)
            from `jax.random.fold_in(key, step)`, so an update that was skipped (a
            non-finite gradient) draws the same numbers again for the next batch.
        model_state: `eqx.nn.State` of stateful layers (BatchNorm), or None.
        loss_scale: the `DynamicLossScale`, or None.
        hook_state: what the `after_update` hook keeps between steps (DSR's threshold:
            `dsr`'s state), from the hook's `init(model)`; None for a
            hook without `init`, or without a hook.
    """

    step: Int[Array, ""]
    model: Any
    opt_state: Any
    key: PRNGKeyArray
    model_state: Any = None
    loss_scale: DynamicLossScale | None = None
    hook_state: Any = None


def is_dynamic(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


class Static:
    """The non-array part of a state as a static `jax.jit` argument: its treedef and its
    non-array leaves, hashed by value where they hash and by identity where they do not
    (a list-valued field, an optimizer's closure), as Equinox partitions for `filter_jit`."""

    def __init__(self, treedef: Any, leaves: tuple):
        self.treedef, self.leaves = treedef, leaves
        self._hash: int | None = None  # computed once: jax.jit hashes it every call

    def __hash__(self) -> int:
        def h(x):
            try:
                return hash(x)
            except TypeError:
                return id(x)

        if self._hash is None:
            self._hash = hash((self.treedef, tuple(h(x) for x in self.leaves)))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Static) or self.treedef != other.treedef:
            return False
        return all(_same(a, b) for a, b in zip(self.leaves, other.leaves, strict=True))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def split(tree: Any) -> tuple[list, Static]:
    leaves, treedef = jax.tree.flatten(tree)
    dynamic = [x if is_dynamic(x) else None for x in leaves]
    static = tuple(None if is_dynamic(x) else x for x in leaves)
    return dynamic, Static(treedef, static)


def merge(dynamic: list, static: Static) -> Any:
    leaves = [d if s is None else s for d, s in zip(dynamic, static.leaves, strict=True)]
    return jax.tree.unflatten(static.treedef, leaves)


def copy_arrays(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def place(x: Any, sharding: NamedSharding) -> Any:
    """Put a host-or-device array on `sharding`, also across processes (every process holds
    the same value, as after `init`)."""
    if is_key(x):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(place(jax.random.key_data(x), sharding), impl=impl)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    a = np.asarray(x)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def check_init(model: Any, key: Any, model_state: Any, *, has_state: bool, loss_fn) -> None:
    """The checks of `Step.init`'s arguments (see its `Raises:`)."""
    if has_state and model_state is None:
        raise ValueError(
            "make_step(..., has_state=True) needs the model's state: "
            "init(model, key=key, model_state=state), e.g. from eqx.nn.make_with_state."
        )
    check_prng_key("key", key)  # what the Trainer's fit accepts
    _check_leaves(model)
    _check_trainable(model)
    dropout = _dropout_rates(model)
    if dropout and not accepts_key(loss_fn):
        where = ", ".join(f"{p} ({r})" for p, r in dropout[:3])
        raise ValueError(
            f"the model has dropout ({where}) but the loss takes no `key`, so dropout "
            "would never apply. Give the loss a `key=None` keyword and pass it to the "
            "model (the built-in losses do), or set dropout to 0."
        )


def _deleted(x: Any) -> bool:
    """A JAX array whose buffer is gone (donated to a step); a traced one has none."""
    try:
        return isinstance(x, jax.Array) and x.is_deleted()
    except jax.errors.ConcretizationTypeError:  # inside eqx.filter_eval_shape(step.init)
        return False


def _check_leaves(model: Any) -> None:
    for path, x in jax.tree_util.tree_leaves_with_path(model):
        if _deleted(x):
            raise ValueError(
                f"model leaf {jax.tree_util.keystr(path)} was deleted: a training step "
                "donated its buffer (a model taken from a TrainState that a later step or "
                "fit consumed, such as trainer.state.model). Keep a copy before training "
                "on: model = jax.tree.map(jnp.copy, model) (trainer.model stays usable)."
            )
        if isinstance(x, np.ndarray) and x.dtype.kind in "USOV":
            raise TypeError(
                f"model leaf {jax.tree_util.keystr(path)} is a numpy array of dtype {x.dtype}; "
                "a model's arrays must be numeric. Mark non-numeric data "
                "eqx.field(static=True) or keep it outside the model."
            )


def _check_trainable(model: Any) -> None:
    """A model with no floating-point array would train nothing (the step differentiates
    only those), its loss unchanged however long it runs."""
    arrays = [x for x in jax.tree.leaves(model) if is_dynamic(x)]
    if any(jnp.issubdtype(x.dtype, jnp.inexact) for x in arrays):
        return
    found = ", ".join(f"{jnp.dtype(x.dtype).name}{list(x.shape)}" for x in arrays[:4])
    more = f" and {len(arrays) - 4} more" if len(arrays) > 4 else ""
    raise ValueError(
        f"the model has no floating-point arrays to train (found "
        f"{f'{len(arrays)}: {found}{more}' if arrays else 'no arrays at all'}); the step "
        "differentiates floating-point leaves only, so nothing would change. Make the "
        "weights floating point (e.g. jnp.asarray(w, jnp.float32))."
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


def check_hooked(hooked: Any, state: TrainState) -> None:
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
