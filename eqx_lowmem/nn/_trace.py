"""What JAX's public API cannot tell a layer: whether `jax.vmap` is the innermost
transformation acting on its arguments. The one place in eqx_lowmem that reads JAX's
private internals; `tests/test_conv.py` fails when they move."""

from typing import Any

import jax

try:
    from jax._src.core import find_top_trace as _find_top_trace
    from jax._src.interpreters.batching import BatchTrace as _BatchTrace
except ImportError:  # pragma: no cover - a JAX without them: see batched_on_top
    _find_top_trace = _BatchTrace = None


def batched_on_top(tree: Any) -> bool | None:
    """Whether the innermost transformation acting on the arrays of `tree` is a
    `jax.vmap`: then a layer's batch-level rule (`jax.custom_batching.custom_vmap`) runs
    before any differentiation sees it (reverse-mode autodiff cannot go through
    `custom_vmap` itself). False outside any vmap, and under a `jax.grad` applied inside
    the vmap.

    None where this JAX gives no answer (its internals moved): every caller then takes
    its plain per-example path, correct everywhere, without the batch-level rule (a
    slower convolution, no fused accumulation)."""
    if _find_top_trace is None or _BatchTrace is None:
        return None
    try:
        return isinstance(_find_top_trace(jax.tree.leaves(tree)), _BatchTrace)
    except Exception:  # internals changed in another way: no answer
        return None
