"""What a model, a batch and a policy hold: array sizes, settings found in modules."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ..precision._policy import PRESETS, Policy


def is_arrayish(x: Any) -> bool:
    """An array or a `jax.ShapeDtypeStruct`."""
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def is_float(x: Any) -> bool:
    """A floating-point array or `jax.ShapeDtypeStruct`: a trainable leaf."""
    return is_arrayish(x) and bool(jnp.issubdtype(x.dtype, jnp.inexact))


def nbytes(x: Any) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def tree_bytes(tree: Any, keep: Callable[[Any], bool] = is_arrayish) -> int:
    """Bytes of the leaves of `tree` that `keep` selects."""
    return sum(nbytes(x) for x in jax.tree.leaves(tree) if keep(x))


def as_struct(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(int(d) for d in x.shape), x.dtype)
    return x


def batch_structs(batch: Any, granularity: int, what: str | None = None) -> tuple[tuple, int]:
    """The batch as a tuple of `jax.ShapeDtypeStruct`s, and its size, checked.

    Raises:
        TypeError: for a batch that is not a non-empty tuple of arrays or structs.
        ValueError: for arrays of different lengths, or a size `granularity` does not divide.
    """
    if not isinstance(batch, (tuple, list)) or not batch:
        raise TypeError(
            "batch must be a non-empty tuple of arrays or jax.ShapeDtypeStructs with a common "
            f"leading batch dimension, such as (x, y); got {type(batch).__name__}."
        )
    structs = tuple(jax.tree.map(as_struct, tuple(batch)))
    leaves = jax.tree.leaves(structs)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, jax.ShapeDtypeStruct)]
    if bad:
        raise TypeError(f"batch leaves must be arrays or jax.ShapeDtypeStructs; got {bad}.")
    sizes = {x.shape[0] if x.shape else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "batch arrays must share their first (batch) dimension; got shapes "
            f"{[x.shape for x in leaves]}."
        )
    size = sizes.pop()
    assert size is not None
    if size % granularity:
        raise ValueError(
            f"a batch of {size} samples is not divisible by {what or granularity}; use a "
            f"batch size that is a multiple of {granularity} (the report compiles equal "
            "micro-batches; the batch is the whole batch of one update)."
        )
    return structs, size


def precision_name(policy: Policy) -> str:
    """The preset name of `policy` (`"mixed_bf16"`), or its repr."""
    for name, preset in PRESETS.items():
        if preset == policy:
            return name
    return repr(policy)


def _modules(model: Any, has: str) -> list[Any]:
    """The `eqx.Module`s in `model` (and in their fields) with an attribute `has`,
    outermost first."""
    found: list[Any] = []
    stack = [model]
    seen: set[int] = set()
    while stack:
        x = stack.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, eqx.Module):
            if hasattr(x, has):
                found.append(x)
            stack.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return found


def model_remat(model: PyTree) -> str | None:
    """The `remat` setting(s) of the modules of `model` that have one, as text; None if none.

    Any module with a `remat` field counts (`TransformerBlock`, a stack of blocks, a
    WideResNet); several different settings are joined by commas, outermost first.
    """
    from ._units import remat_text

    found: list[str] = []
    for m in _modules(model, "remat"):
        text = remat_text(m.remat)
        if text not in found:
            found.append(text)
    return ",".join(found) if found else None


def model_attention(model: PyTree, dtype: Any, backend: str) -> dict[str, str] | None:
    """What each attention setting of `model`'s blocks runs as: `{"auto": "chunked"}`.

    Blocks are the modules with an `attention` field; `resolved_attention(dtype, backend)`
    (or `eqx_lowmem.nn._attention.resolve_attention`) says what `"auto"` chose. None without any.
    """
    from ..nn._attention import resolve_attention

    out: dict[str, str] = {}
    for m in _modules(model, "attention"):
        if not isinstance(m.attention, str):
            continue
        if hasattr(m, "resolved_attention"):
            resolved = m.resolved_attention(dtype, backend)
        else:
            resolved = resolve_attention(m.attention, dtype, backend)
        out.setdefault(m.attention, resolved)
    return out or None


def model_density(model: PyTree) -> float | None:
    """The fraction of the dense weights that `model`'s sparse layers (`eqx_lowmem.sparse`)
    allocate slots for (capacity over dense size: what memory follows; shapes suffice);
    None without sparse layers."""
    try:
        from ..sparse._convert import sparse_layers
    except ImportError:
        return None
    layers = [layer for _, layer in sparse_layers(model)]
    if not layers:
        return None
    slots = sum(int(np.prod(m.values.shape)) for m in layers)
    dense = sum(m.size * int(np.prod(m.stack_shape)) for m in layers)
    return slots / dense
