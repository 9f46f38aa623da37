"""Per-layer preparation inside scanned stacks: the seam where a training step acts on one
block's parameters just before the block uses them.

A stack of identical blocks (`eqx_lowmem.nn.Stack`) calls `prepare_layer(stack, params)` on
each layer's slice of its stacked arrays, inside the block's recomputation region. Outside a
training step that installs a hook it is the identity. The step installs one to:

- all-gather a layer's shards just in time under FSDP (`make_step(..., shard="fsdp")`), so a
  gathered weight lives for one block only and is re-gathered, not saved, for the backward;
- cast a layer's parameters to the 16-bit compute dtype just in time under mixed precision,
  so only one block's 16-bit copy is alive at a time.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from jaxtyping import PyTree

LayerHook = Callable[[Any, PyTree], PyTree]

_HOOK: contextvars.ContextVar[LayerHook | None] = contextvars.ContextVar(
    "eqx_lowmem_layer_hook", default=None
)


def is_stack(x: Any) -> bool:
    """Whether `x` is a stack module that calls `prepare_layer` (it has a `layer_spec` field)."""
    return dataclasses.is_dataclass(x) and any(
        f.name == "layer_spec" for f in dataclasses.fields(x)
    )


def prepare_layer(stack: Any, params: PyTree) -> PyTree:
    """Apply the active layer hook to one layer's arrays (identity when none is active).

    Args:
        stack: the stack module whose layer this is (hooks read its `layer_spec`).
        params: the layer's arrays, as `eqx.partition(block, eqx.is_array)[0]`.
    """
    hook = _HOOK.get()
    return params if hook is None else hook(stack, params)


@contextlib.contextmanager
def layer_hook(hook: LayerHook | None) -> Iterator[None]:
    """Install `hook` for `prepare_layer` while tracing the body of the `with`.

    Hooks nest: inside another hook's `with`, the outer hook runs first, then this one (the
    step all-gathers a layer's shards, then the loss call casts them to the compute dtype).
    """
    outer = _HOOK.get()
    if hook is not None and outer is not None:
        inner = hook

        def hook(stack: Any, params: PyTree) -> PyTree:
            return inner(stack, outer(stack, params))

    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def active_hook() -> LayerHook | None:
    """The hook `prepare_layer` applies now (the composition of every active `layer_hook`)."""
    return _HOOK.get()


@contextlib.contextmanager
def exact_hook(hook: LayerHook | None) -> Iterator[None]:
    """Install `hook` as it is, replacing any active one (no nesting): a stack's fused
    backward loop, traced after the loss returned, re-installs the hook its forward ran with."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)
