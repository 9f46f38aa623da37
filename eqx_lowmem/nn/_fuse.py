"""Gradient accumulation fused into the backward pass of scanned stacks.

Under gradient accumulation a training step keeps an accumulator (one gradient's worth of
memory) and, for each micro-batch, computes that micro-batch's gradient (another) before
adding it in. A stack of identical blocks run by `lax.scan` gets its parameters' gradient
from the transposed scan as one stacked array, written layer by layer and added to the
accumulator after the loop, so both are alive at once. When a step offers its accumulator
(`fusing`), a stack whose every block is recomputed (`remat="full"`), or every segment of
blocks (`segment=k`), instead runs its own backward loop, which recomputes one block (or
segment) at a time and adds its gradient into its slice of the accumulator in place:
the micro-batch's gradient of the stack never exists as a whole. The same numbers: bit
for bit where the stack runs once per micro-batch; equal to 1e-6 (`tests/test_fuse.py`;
measured 1.5e-8 for 4df5b8e) where it runs per example or its weights are also used
outside it, whose gradients are then summed in another order. One gradient-sized buffer less
(`tests/test_fuse.py` measures it on the compiled step).

The accumulator comes back as the gradient with respect to the accumulator itself (the
step differentiates the loss with respect to it): a stack that took it returns, as the
accumulator's cotangent, `fold(accumulator, gradient)` per layer, where `fold` is the
step's own addition rule.

Trace-time only: which leaves a stack may take is decided by the identity of the
differentiated parameter arrays that the stack holds, so a stack whose parameters were
transformed before the loss (FSDP's whole-model gather, a user's own cast) runs as usual.
"""

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

Fold = Callable[[Array, Array], Array]


class FusionWarning(UserWarning):
    """A scanned stack set up for fused accumulation (every block or segment recomputed)
    that a step's accumulator could not reach, and why: its micro-batch gradient is then
    held beside the accumulator, one more gradient of its parameters. Silence it with
    `make_step(..., fuse_accumulation=False)` or a warnings filter on this category."""


class Fusion:
    """The accumulator a training step offers to the stacks of one micro-batch's loss.

    Args:
        params: the differentiated parameters, as the loss sees them (tracers).
        acc: the accumulator, a pytree of arrays with the structure of `params`.
        fold: `fold(acc_slice, grad_slice) -> new acc_slice`: the step's addition of one
            layer's gradient (of the parameters' dtype) into its accumulator slice.

    Attributes:
        fused: the positions (in `jax.tree.leaves(params)`) whose accumulator a stack has
            taken: their cotangent with respect to `acc` is the new accumulator.
    """

    def __init__(self, params: PyTree, acc: PyTree, fold: Fold):
        p_leaves = jax.tree.leaves(params)
        a_leaves = jax.tree.leaves(acc)
        if len(p_leaves) != len(a_leaves):
            raise ValueError(
                f"Fusion: the accumulator has {len(a_leaves)} arrays for {len(p_leaves)} "
                "parameters; it must have the parameters' structure."
            )
        self._slot = {id(p): n for n, p in enumerate(p_leaves)}
        paths = jax.tree_util.tree_leaves_with_path(params)
        self._paths = [jax.tree_util.keystr(p) for p, _ in paths]
        self._shapes = [tuple(p.shape) for p in p_leaves]
        self._acc = a_leaves
        self.fold = fold
        self.fused: set[int] = set()
        self.declined: set[int] = set()
        self.reached = 0  # the stacks' calls that asked for the accumulator

    def claim(self, leaves: Sequence[Array]) -> list[int] | None:
        """The accumulator positions of `leaves` (a stack's floating arrays), or None when
        any of them is not a differentiated parameter (said with a `FusionWarning`), or was
        taken already (a stack called twice: its first call is fused)."""
        self.reached += 1
        slots = [self._slot.get(id(x)) for x in leaves]
        if not slots or any(n is not None and n in self.fused for n in slots):
            return None
        pairs = zip(slots, leaves, strict=True)
        if any(n is None or self._shapes[n] != tuple(x.shape) for n, x in pairs):
            self.decline(
                leaves,
                "its arrays are not the parameter arrays the step differentiates: the loss "
                "made new ones from them (a cast, a copy, a gather of the whole model) "
                "before calling the stack; call it on the model's own arrays",
            )
            return None
        if len(set(slots)) != len(slots):
            return None
        return slots  # type: ignore[return-value]

    def decline(self, leaves: Sequence[Array], reason: str) -> None:
        """Say, with a `FusionWarning`, that the stack holding `leaves` (its floating
        arrays) is set up for fusion but not fused, and `reason`."""
        slots = [n for n in (self._slot.get(id(x)) for x in leaves) if n is not None]
        self.declined.update(slots)
        names = [self._paths[n] for n in slots]
        if names:
            where = f"the stack holding {names[0]}"
            where += f" and {len(names) - 1} more arrays" if len(names) > 1 else ""
        else:
            first = leaves[0]
            where = f"a stack of {len(leaves)} arrays (the first {first.dtype}{list(first.shape)})"
        warnings.warn(
            f"fused accumulation does not reach {where}, whose blocks are all recomputed: "
            f"{reason}. Its micro-batch gradient is held beside the accumulator "
            "(make_step(..., fuse_accumulation=False) silences this).",
            FusionWarning,
            stacklevel=2,
        )

    def check_reached(self, model: PyTree) -> None:
        """After the loss is traced: a `FusionWarning` for each stack of `model` set up for
        fusion, holding differentiated parameters, that neither took the accumulator nor
        said why. Its call was not traced under this step: a function compiled
        (`jax.jit`, `eqx.filter_jit`) before the step and called with the same shapes
        reuses its earlier trace, which JAX's cache does not tie to the accumulator."""
        stacks = [
            x
            for x in jax.tree.leaves(
                model, is_leaf=lambda x: isinstance(x, eqx.Module) and fusion_candidate(x)
            )
            if isinstance(x, eqx.Module) and fusion_candidate(x)
        ]
        if self.reached >= len(stacks):
            return  # every stack was called under the step (and said so if not fused)
        for stack in stacks:
            leaves = jax.tree.leaves(eqx.filter(stack, eqx.is_inexact_array))
            slots = [self._slot.get(id(x)) for x in leaves]
            if not slots or any(n is None or n in self.fused | self.declined for n in slots):
                continue
            self.decline(
                leaves,
                "its call was not traced under the step (a function compiled with jax.jit "
                "or eqx.filter_jit before the step reuses its earlier trace), or the loss "
                "does not call it; call such a function's body directly in the loss",
            )

    def accumulators(self, slots: Sequence[int]) -> list[Array]:
        return [self._acc[n] for n in slots]

    def commit(self, slots: Sequence[int]) -> None:
        self.fused.update(slots)


_FUSION: contextvars.ContextVar[Fusion | None] = contextvars.ContextVar(
    "eqx_lowmem_fusion", default=None
)


def active_fusion() -> Fusion | None:
    """The accumulator offered to stacks while tracing this loss, or None."""
    return _FUSION.get()


@contextlib.contextmanager
def fusing(fusion: Fusion | None) -> Iterator[None]:
    """Offer `fusion`'s accumulator to the stacks run while tracing the body of the `with`."""
    token = _FUSION.set(fusion)
    try:
        yield
    finally:
        _FUSION.reset(token)


def fusion_candidate(stack: Any) -> bool:
    """Whether a stack's configuration allows the fused backward loop: run by `lax.scan`,
    and either every block recomputed or segments (each recomputed as a unit). A stack
    that keeps its blocks' activations does not: its fused loop would recompute them."""
    if not getattr(stack, "scan", False):
        return False
    return getattr(stack, "segment", None) is not None or getattr(stack, "remat", None) == "full"
