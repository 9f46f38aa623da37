"""Recomputation (remat) presets: which intermediates a block keeps for the backward pass."""

from collections.abc import Callable
from typing import Literal, TypeAlias

import jax

# Every intermediate of a `TransformerBlock` that a policy may save, in forward order.
BLOCK_NAMES: tuple[str, ...] = (
    "attn_in",  # LayerNorm 1 output: the input of the q/k/v projection, (seq, d_model)
    "qkv",  # q, k and v projections, (seq, 3 * d_model)
    "attn_context",  # softmax(q k^T) v, heads merged, (seq, d_model)
    "attn_out",  # output projection of the attention, (seq, d_model)
    "ffn_in",  # LayerNorm 2 output: the input of the first feed-forward layer, (seq, d_model)
    "ffn_hidden",  # first feed-forward layer, before the activation, (seq, d_ff)
    "ffn_out",  # second feed-forward layer, (seq, d_model)
)

# "dots": every projection (a matmul without a per-head batch axis). The attention matrix
# (heads, seq, seq) and all element-wise work (norms, activation, softmax) are recomputed.
DOTS_NAMES: tuple[str, ...] = ("qkv", "attn_out", "ffn_hidden", "ffn_out")
# "minimal": the two widest projections. Recomputes the norms, the attention from the saved
# q/k/v, the (d_model x d_model) output projection and the activation: about a tenth of a
# forward pass, for 3 * d_model + d_ff numbers per token.
MINIMAL_NAMES: tuple[str, ...] = ("qkv", "ffn_hidden")

PRESETS: tuple[str, ...] = ("none", "full", "dots", "minimal")


class Save:
    """A remat spec that keeps exactly the named intermediates and recomputes the rest.

    Example:
        >>> import eqx_lowmem as el
        >>> el.nn.Save("qkv", "ffn_hidden")
        Save('qkv', 'ffn_hidden')

    The names must be checkpoint names of the module it is given to (for a
    `TransformerBlock`: `eqx_lowmem.nn.BLOCK_NAMES`); an unknown name is an error when the
    module is built.
    """

    __slots__ = ("names",)
    names: tuple[str, ...]

    def __init__(self, *names: str):
        for i, name in enumerate(names):
            if not isinstance(name, str):
                raise TypeError(
                    f"Save(*names): name {i} must be a str, got {type(name).__name__} {name!r}."
                )
        object.__setattr__(self, "names", tuple(names))

    def __setattr__(self, name, value):
        raise AttributeError("Save is immutable.")

    def __eq__(self, other):
        return isinstance(other, Save) and other.names == self.names

    def __hash__(self):
        return hash(("Save", self.names))

    def __repr__(self):
        return f"Save({', '.join(repr(n) for n in self.names)})"


# What users may pass; `resolve_remat` checks the string against PRESETS with a clear error.
RematArg: TypeAlias = bool | str | Save
Remat: TypeAlias = Literal["none", "full", "dots", "minimal"] | Save


def resolve_remat(remat: object, names: tuple[str, ...] = BLOCK_NAMES) -> Remat:
    """Normalise a user's `remat=` argument, raising on anything unknown.

    Args:
        remat: `False`/`"none"`, `True`/`"full"`, `"dots"`, `"minimal"` or a `Save`.
        names: the checkpoint names the module defines (a `Save` may only use these).

    Returns:
        One of the preset strings, or the `Save`.

    Raises:
        ValueError: for an unknown preset or a `Save` naming an intermediate that does not exist.
    """
    if remat is False:
        return "none"
    if remat is True:
        return "full"
    if isinstance(remat, str):
        if remat not in PRESETS:
            raise ValueError(
                f"remat={remat!r} is not a preset; expected one of {PRESETS}, True, False, "
                "or eqx_lowmem.nn.Save(*names)."
            )
        return remat  # type: ignore[return-value]
    if isinstance(remat, Save):
        unknown = [n for n in remat.names if n not in names]
        if unknown:
            raise ValueError(
                f"remat={remat!r} names {unknown}, which this module does not define; "
                f"its checkpoint names are {names}."
            )
        return remat
    raise TypeError(
        f"remat must be a bool, one of {PRESETS} or eqx_lowmem.nn.Save(*names); "
        f"got {type(remat).__name__} {remat!r}."
    )


def remat_policy(remat: Remat) -> Callable[..., bool] | None:
    """The `jax.checkpoint` policy of a resolved spec; `None` means do not checkpoint."""
    if remat == "none":
        return None
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "dots":
        return jax.checkpoint_policies.save_only_these_names(*DOTS_NAMES)
    if remat == "minimal":
        return jax.checkpoint_policies.save_only_these_names(*MINIMAL_NAMES)
    assert isinstance(remat, Save)
    return jax.checkpoint_policies.save_only_these_names(*remat.names)
