"""Forward-mode rules that keep reverse mode's memory: the custom rules of eqx_lowmem's
layers are `jax.custom_jvp`s whose tangent is a function linear in the tangents, run under
`jax.checkpoint` with the arrays it needs (the layer's input, not its intermediates).

`jax.jvp` and `jax.jacfwd` use the rule as written. Reverse mode (`jax.grad`) linearises
it and transposes the tangent function: the `jax.checkpoint` around it makes the backward
pass keep only those arrays and recompute the rest element-wise, as a hand-written
`jax.custom_vjp` would, and tangents that are symbolically zero (an input nobody
differentiates) are left out, so their gradients are never computed. A rule is written so
that its transpose runs the ops of the hand-written backward pass it replaces in the same
order (JAX transposes in reverse order): the compiled step's temporaries then match."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array

# The named scope of every rule's tangent: reverse mode recomputes what the rule needs
# inside it (under `jax.checkpoint`'s "rematted_computation"), and `eqx_lowmem.memory`
# counts that working set as the backward pass's, as it did the hand-written ones'.
RULE_SCOPE = "eqx_lowmem.nn.rule"


def is_zero(t: Any) -> bool:
    """Whether a tangent given to a `symbolic_zeros=True` rule is a symbolic zero."""
    return isinstance(t, SymbolicZero)


def rule_input(x: Array) -> Array:
    """`x` as a value of its own (`jnp.copy`, which lowers to no HLO operation at all), to be
    the input that every custom rule of one layer reads.

    Under an outer `jax.checkpoint` whose policy saves `x` (a selective preset that saves a
    named value the layer reads: WideResNet's `conv1` into its second BatchNorm under
    `"minimal"`, a transformer's `ffn_hidden` into its GELU), each rule's own
    `jax.checkpoint` would forward the saved `x` as a residual of its own, which a scan
    then stacks once more per rule. The copy is not saved by such a policy (it has no
    name): the outer checkpoint recomputes it from the saved `x`, so the rules read it
    without a residual of their own. Without an outer checkpoint the copy is the residual,
    the same buffer as `x`. A layer calls this once and passes the result to all its rules
    (two copies would be two residuals of a scan); a rule whose residual is the layer's
    output (the softmax's) does not, since a later layer keeps that output anyway.
    """
    return jnp.copy(x)


def linear_tangent(
    rule: Callable[[Any, list[Any]], Any], residuals: Any, tangents: Sequence[Any], out: Any
) -> Any:
    """`rule(residuals, tangents)` under `jax.checkpoint`, symbolic zeros passed as None.

    Args:
        rule: the tangent of the layer's output, linear in the tangents that are not None.
        residuals: the arrays the rule reads besides the tangents; reverse mode keeps these
            and recomputes everything else the rule computes from them.
        tangents: the rule's tangents, `SymbolicZero` where no tangent flows.
        out: the layer's output, for a zero tangent when no tangent flows at all.

    Returns:
        The output tangent.
    """
    mask = tuple(not is_zero(t) for t in tangents)
    if not any(mask):
        return jax.tree.map(jnp.zeros_like, out)
    live = [t for t, m in zip(tangents, mask, strict=True) if m]

    def run(residuals, live):
        it = iter(live)
        with jax.named_scope(RULE_SCOPE):
            return rule(residuals, [next(it) if m else None for m in mask])

    return jax.checkpoint(run, prevent_cse=False)(residuals, live)
