"""Recomputation (remat) presets: which intermediates a block keeps for the backward pass.

A module takes part by declaring, as class attributes, the checkpoint names its forward pass
tags with `jax.ad_checkpoint.checkpoint_name` and what the selective presets mean for it:

    class MyBlock(eqx.Module):
        checkpoint_names: ClassVar[tuple[str, ...]] = ("hidden", "out")
        remat_presets: ClassVar[dict[str, tuple[str, ...]]] = {
            "dots": ("hidden", "out"),
            "minimal": ("hidden",),
        }

`"none"` and `"full"` need no declaration. `"dots"`, `"minimal"` and `"minimal_offloaded"`
are errors, when the model is built, for a module that does not define them, and so is a
`Save` naming anything outside its `checkpoint_names`.
"""

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

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

# What the selective presets mean for a `TransformerBlock` (and the default of
# `resolve_remat` / `remat_policy`, which `TransformerBlock` calls without naming itself).
TRANSFORMER_PRESETS: Mapping[str, tuple[str, ...]] = {
    "dots": DOTS_NAMES,
    "minimal": MINIMAL_NAMES,
}

# Every preset name, for every module. "minimal_offloaded" keeps the module's "minimal" names
# in pinned host memory instead of device memory (MaxText's preset of the same name).
PRESETS: tuple[str, ...] = ("none", "full", "dots", "minimal", "minimal_offloaded")

# Presets that need the module to say what they mean, and the declaration they read.
_NEEDS = {"dots": "dots", "minimal": "minimal", "minimal_offloaded": "minimal"}


def _names_tuple(names: object, what: str) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(
            f"{what} must be a tuple of str, got the str {names!r}; write ({names!r},)."
        )
    out = tuple(names)  # type: ignore[arg-type]
    for i, name in enumerate(out):
        if not isinstance(name, str):
            raise TypeError(f"{what}: name {i} must be a str, got {type(name).__name__} {name!r}.")
    return out


class Save:
    """A remat spec that keeps exactly the named intermediates and recomputes the rest.

    `Save(*names)` keeps `names` in device memory. `offload=(...)` keeps those names in
    pinned host memory between the forward and the backward pass instead
    (`jax.checkpoint_policies.save_and_offload_only_these_names`): the device holds them
    only while they are computed and again while the backward pass uses them, at the cost of
    a device-to-host and a host-to-device copy each. On XLA:CPU the placement is dropped and
    offloaded names are simply saved (same numbers, same memory); a GPU shows the saving.

    Example:
        >>> import eqx_lowmem as el
        >>> el.nn.Save("qkv", "ffn_hidden")
        Save('qkv', 'ffn_hidden')
        >>> el.nn.Save("attn_out", offload=("qkv",))
        Save('attn_out', offload=('qkv',))

    The names must be checkpoint names of the module it is given to (for a
    `TransformerBlock`: those its docstring lists); an unknown name is an error when the
    module is built.
    """

    __slots__ = ("names", "offload")
    names: tuple[str, ...]
    offload: tuple[str, ...]

    def __init__(self, *names: str, offload: tuple[str, ...] | list[str] = ()):
        names = _names_tuple(names, "Save(*names)")
        offload = _names_tuple(offload, "Save(offload=...)")
        both = sorted(set(names) & set(offload))
        if both:
            raise ValueError(
                f"Save: {both} are both saved on the device and offloaded; name each once, "
                "in *names (device memory) or in offload= (host memory)."
            )
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "offload", offload)

    def __setattr__(self, name, value):
        raise AttributeError("Save is immutable.")

    def __eq__(self, other):
        return (
            isinstance(other, Save) and other.names == self.names and other.offload == self.offload
        )

    def __hash__(self):
        return hash(("Save", self.names, self.offload))

    def __repr__(self):
        parts = [repr(n) for n in self.names]
        if self.offload:
            parts.append(f"offload={self.offload!r}")
        return f"Save({', '.join(parts)})"


# What users may pass; `resolve_remat` checks the string against PRESETS with a clear error.
RematArg: TypeAlias = bool | str | Save
Remat: TypeAlias = Literal["none", "full", "dots", "minimal", "minimal_offloaded"] | Save

# Declarations for modules whose class does not carry them (registered by their builders).
_REGISTRY: dict[type, tuple[tuple[str, ...], Mapping[str, tuple[str, ...]]]] = {}


def register_remat_names(
    cls: type, names: tuple[str, ...], presets: Mapping[str, tuple[str, ...]]
) -> None:
    """Declare `cls`'s checkpoint names and presets without class attributes."""
    _REGISTRY[cls] = (tuple(names), dict(presets))


def module_remat_names(
    module: Any,
) -> tuple[tuple[str, ...], Mapping[str, tuple[str, ...]]]:
    """The checkpoint names and selective presets a module (or module class) declares.

    Reads the class attributes `checkpoint_names` and `remat_presets` (see the module
    docstring); a module that declares neither has no names and only `"none"`/`"full"`.
    """
    cls = module if isinstance(module, type) else type(module)
    names = getattr(cls, "checkpoint_names", None)
    presets = getattr(cls, "remat_presets", None)
    if names is None and presets is None:
        for klass in cls.__mro__:
            if klass in _REGISTRY:
                return _REGISTRY[klass]
        return (), {}
    names = _names_tuple(() if names is None else names, f"{cls.__name__}.checkpoint_names")
    presets = dict(presets or {})
    for preset, used in presets.items():
        unknown = [n for n in used if n not in names]
        if unknown:
            raise ValueError(
                f"{cls.__name__}.remat_presets[{preset!r}] names {unknown}, which are not in "
                f"{cls.__name__}.checkpoint_names {names}."
            )
    return names, presets


def resolve_remat(
    remat: object,
    names: tuple[str, ...] = BLOCK_NAMES,
    presets: Mapping[str, tuple[str, ...]] = TRANSFORMER_PRESETS,
    *,
    module: str = "this module",
) -> Remat:
    """Normalise a user's `remat=` argument, raising on anything unknown.

    Args:
        remat: `False`/`"none"`, `True`/`"full"`, `"dots"`, `"minimal"`,
            `"minimal_offloaded"` or a `Save`.
        names: the checkpoint names the module defines (a `Save` may only use these).
        presets: what `"dots"` and `"minimal"` keep for this module; a preset missing here
            is an error.
        module: the module's name, for error messages.

    Returns:
        One of the preset strings, or the `Save`.

    Raises:
        ValueError: for an unknown preset, a preset the module does not define, or a `Save`
            naming an intermediate that does not exist.
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
        need = _NEEDS.get(remat)
        if need is not None and need not in presets:
            raise ValueError(
                f"remat={remat!r}: {module} does not define what {need!r} keeps (it defines "
                f"{sorted(presets) or 'no selective presets'}; checkpoint names {names}). "
                "Use 'full', 'none', eqx_lowmem.nn.Save(*names), or declare `remat_presets` "
                "on the module."
            )
        return remat  # type: ignore[return-value]
    if isinstance(remat, Save):
        unknown = [n for n in remat.names + remat.offload if n not in names]
        if unknown:
            raise ValueError(
                f"remat={remat!r} names {unknown}, which {module} does not define; "
                f"its checkpoint names are {names}."
            )
        return remat
    raise TypeError(
        f"remat must be a bool, one of {PRESETS} or eqx_lowmem.nn.Save(*names); "
        f"got {type(remat).__name__} {remat!r}."
    )


def _offloading(saved: tuple[str, ...], offloaded: tuple[str, ...]) -> Callable[..., bool]:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src="device",
        offload_dst="pinned_host",
    )


def remat_policy(
    remat: Remat, presets: Mapping[str, tuple[str, ...]] = TRANSFORMER_PRESETS
) -> Callable[..., bool] | None:
    """The `jax.checkpoint` policy of a resolved spec; `None` means do not checkpoint."""
    if remat == "none":
        return None
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "minimal_offloaded":
        return _offloading((), presets["minimal"])
    if isinstance(remat, str):
        return jax.checkpoint_policies.save_only_these_names(*presets[remat])
    assert isinstance(remat, Save)
    if remat.offload:
        return _offloading(remat.names, remat.offload)
    return jax.checkpoint_policies.save_only_these_names(*remat.names)
