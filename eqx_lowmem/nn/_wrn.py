"""Pre-activation wide residual networks (Zagoruyko and Komodakis, 2016), each group's
identical blocks on a `Stack`, with the recomputation of Sohoni et al. (2019)."""

import functools
import math
import re
from collections.abc import Callable
from typing import Any, ClassVar, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from ._conv import conv2d
from ._norm import BatchNorm, BatchStats, GroupNorm, standardise_weight
from ._remat import (
    PRESETS,
    Remat,
    Save,
    module_remat_names,
    remat_policy,
    resolve_remat,
)
from ._stack import Stack, stack

NormState: TypeAlias = BatchStats | tuple[()]  # GroupNorm: empty
BlockState: TypeAlias = dict[str, NormState]
NORMS = ("batch", "group", "group_ws")
Norm: TypeAlias = BatchNorm | GroupNorm


def _make_norm(norm: str, channels: int, groups: int) -> Norm:
    return BatchNorm(channels) if norm == "batch" else GroupNorm(groups, channels)


def _conv_ws(layer: Any, ws: bool, x: Array) -> Array:
    """`conv2d(layer, x)`, with Weight Standardization of the convolution's weights when
    `ws`: a dense `eqx.nn.Conv2d`'s whole weight, a sparse one's stored weights."""
    from ..sparse._layers import SparseConv2d  # the sparse package builds on this one

    if ws and isinstance(layer, eqx.nn.Conv2d):
        layer = eqx.tree_at(lambda c: c.weight, layer, standardise_weight(layer.weight))
    elif ws and isinstance(layer, SparseConv2d):
        layer = layer.standardised()
    return conv2d(layer, x)


def _conv(c_in: int, c_out: int, size: int, stride: int, key: PRNGKeyArray) -> eqx.nn.Conv2d:
    """A bias-free convolution with He-normal weights over fan-out, as the authors' code."""
    # Shapes only: Equinox's own (uniform) initialisation would be drawn, compiled per
    # shape, and thrown away.
    conv = eqx.filter_eval_shape(
        eqx.nn.Conv2d, c_in, c_out, size, stride=stride, padding=size // 2, use_bias=False,
        key=key,
    )  # fmt: skip
    std = math.sqrt(2.0 / (size * size * c_out))
    weight = std * jr.normal(key, conv.weight.shape, jnp.float32)
    return eqx.tree_at(lambda c: c.weight, conv, weight)


def _bn_relu(bn: Norm, x: Array, stats: NormState) -> tuple[Array, NormState]:
    return bn(x, stats, relu=True)


class WideBlock(eqx.Module):
    """The pre-activation basic block: BatchNorm-ReLU-conv3x3 twice, plus the input.

    `y = shortcut(a) + conv2(relu(bn2(conv1(a))))` with `a = relu(bn1(x))`; the shortcut
    is `x` itself when the width and resolution do not change, else a 1x1 convolution of
    `a` (as in the authors' code). `__call__(x, state, *, key=None) -> (y, state)`, the
    state being the two BatchNorms' running statistics (the `Stack` convention).

    Checkpoint names (for `remat=Save(...)`): `act1` (relu(bn1(x))), `conv1` (the first
    convolution's output), `act2` (relu(bn2(conv1))), `conv2`. Presets: `"dots"` keeps the
    convolutions' outputs (`conv1`, `conv2`) and recomputes the BatchNorms and ReLUs;
    `"minimal"` keeps `conv1` only (the block's input is kept anyway): with it the backward
    pass recomputes no convolution, only element-wise work, for two activation-sized
    tensors per block instead of four.

    `norm="group"` puts `GroupNorm(groups, channels)` where the BatchNorms are (their state
    is then empty), `"group_ws"` also standardises the convolutions' weights (Qiao et al.,
    2019).
    """

    checkpoint_names: ClassVar[tuple[str, ...]] = ("act1", "conv1", "act2", "conv2")
    remat_presets: ClassVar[dict[str, tuple[str, ...]]] = {
        "dots": ("conv1", "conv2"),
        "minimal": ("conv1",),
    }

    bn1: Norm
    conv1: Any  # eqx.nn.Conv2d, or a sparse convolution after eqx_lowmem.sparse.sparsify
    bn2: Norm
    conv2: Any
    shortcut: Any  # a 1x1 eqx.nn.Conv2d, or None for the identity
    in_channels: int = eqx.field(static=True)
    out_channels: int = eqx.field(static=True)
    stride: int = eqx.field(static=True)
    ws: bool = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int,
        *,
        key: PRNGKeyArray,
        norm: str = "batch",
        groups: int = 8,
    ):
        k1, k2, k3 = jr.split(key, 3)
        self.bn1 = _make_norm(norm, in_channels, groups)
        self.conv1 = _conv(in_channels, out_channels, 3, stride, k1)
        self.bn2 = _make_norm(norm, out_channels, groups)
        self.conv2 = _conv(out_channels, out_channels, 3, 1, k2)
        if in_channels == out_channels and stride == 1:
            self.shortcut = None
        else:
            self.shortcut = _conv(in_channels, out_channels, 1, stride, k3)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.stride = stride
        self.ws = norm == "group_ws"

    def init_state(self) -> BlockState:
        """Both BatchNorms' running statistics before training (GroupNorm: empty)."""
        return {"bn1": self.bn1.init_stats(), "bn2": self.bn2.init_stats()}

    @jax.named_scope("eqx_lowmem.nn.WideBlock")
    def __call__(
        self,
        x: Float[Array, "in_channels height width"],
        state: BlockState,
        *,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "out_channels h w"], BlockState]:
        del key  # no dropout: the paper's and the DSR authors' WRN-28-2 use none
        a, s1 = _bn_relu(self.bn1, x, state["bn1"])
        a = checkpoint_name(a, "act1")
        h = checkpoint_name(_conv_ws(self.conv1, self.ws, a), "conv1")
        h, s2 = _bn_relu(self.bn2, h, state["bn2"])
        h = checkpoint_name(_conv_ws(self.conv2, self.ws, checkpoint_name(h, "act2")), "conv2")
        skip = x if self.shortcut is None else _conv_ws(self.shortcut, self.ws, a)
        return skip + h, {"bn1": s1, "bn2": s2}


_RESIDUAL = re.compile(r"checkpoint-residual-([1-9][0-9]*)\Z")


def _parse_remat(remat: object) -> tuple[Remat, int | None]:
    """(the blocks' own remat, the segment length of "checkpoint-residual-k" or None)."""
    if isinstance(remat, str):
        match = _RESIDUAL.match(remat)
        if match:
            k = int(match.group(1))
            return ("full", None) if k == 1 else ("none", k)
        if remat not in PRESETS:
            raise ValueError(
                f"remat={remat!r} is not a WideResNet option; expected one of {PRESETS}, "
                "'checkpoint-residual-k' (k >= 1), True, False or eqx_lowmem.nn.Save(*names)."
            )
    names, presets = module_remat_names(WideBlock)
    return resolve_remat(remat, names, presets, module="WideBlock"), None


class WideResNet(eqx.Module):
    """A pre-activation wide residual network, WRN-depth-width (Zagoruyko and Komodakis, 2016).

    As in the DSR authors' CIFAR code: a 3x3 convolution to 16 channels; three groups of
    `(depth - 4) / 6` `WideBlock`s at `16 * width`, `32 * width` and `64 * width` channels,
    the first block of groups 2 and 3 at stride 2; BatchNorm-ReLU, global average pooling
    and a linear head. WRN-28-2 has 1,467,610 parameters. Within a group, the blocks after
    the first are identical and run as one `Stack` (`lax.scan`), which is what makes
    recomputation free memory on XLA.

    BatchNorm state: build with `model, state = eqx.nn.make_with_state(WideResNet)(...)`
    and call `model(x, state) -> (logits, state)` on one `(in_channels, height, width)`
    image under `jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))`
    (see `batched`): the batch statistics are those of the vmapped batch, so under
    `make_step(..., accumulate=k)` those of each micro-batch, and the running statistics
    update once per micro-batch. Evaluation: `eqx.nn.inference_mode(model)` switches every
    BatchNorm to its running statistics (the state is then returned unchanged).
    `eqx_lowmem.nn.apply_with_batch_statistics(model, state, x, micro_batch=m)` evaluates
    instead as training normalised (each micro-batch of `m` by its own statistics), the
    choice for models trained on micro-batches of one or two images. `norm="group"`
    (GroupNorm, optionally with Weight Standardization) has no batch statistics at all.

    Recomputation, `remat=`:

    - `False`/`"none"`: keeps every block's activations (fastest).
    - `"checkpoint-residual-k"` (Sohoni et al., 2019, Section 3.4): keeps the output of
      every `k`-th residual block of a group and recomputes the rest in the backward pass,
      one segment of `k` blocks at a time (one more forward pass). A group's first
      (strided) block is checkpointed on its own. `"checkpoint-residual-1"` is `True`.
      The paper also lists a "2*" variant; its text was not at hand offline, and we read
      it as checkpoint-residual-2 with segments that never cross a group boundary (where
      width and resolution change), which is what `"checkpoint-residual-2"` does here.
    - `True`/`"full"`: every block keeps only its input.
    - `"dots"`, `"minimal"`, `"minimal_offloaded"`, `Save(...)`: per block, as
      `WideBlock` defines them (`"minimal"` recomputes only element-wise work).

    Example:
        >>> import equinox as eqx, jax.numpy as jnp, jax.random as jr
        >>> import eqx_lowmem as el
        >>> model, state = eqx.nn.make_with_state(el.nn.WideResNet)(
        ...     10, 1, 10, key=jr.PRNGKey(0), in_channels=1)
        >>> logits, state = model.batched(jnp.zeros((2, 1, 28, 28)), state)
        >>> logits.shape
        (2, 10)
    """

    stem: eqx.nn.Conv2d
    firsts: tuple[WideBlock, ...]
    rests: tuple[Stack | None, ...]
    bn: Norm
    head: eqx.nn.Linear
    first_index: tuple[eqx.nn.StateIndex, ...]
    rest_index: tuple[eqx.nn.StateIndex | None, ...]
    bn_index: eqx.nn.StateIndex
    depth: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    n_classes: int = eqx.field(static=True)
    in_channels: int = eqx.field(static=True)
    remat: Remat | str = eqx.field(static=True)
    segment: int | None = eqx.field(static=True)
    norm: str = eqx.field(static=True)

    def __init__(
        self,
        depth: int,
        width: int,
        n_classes: int,
        *,
        key: PRNGKeyArray,
        in_channels: int = 3,
        remat: bool | str | Save = False,
        scan: bool = True,
        norm: str = "batch",
        groups: int = 8,
    ):
        """Args:
        depth: 6n + 4 for n >= 1 blocks per group (10, 16, 22, 28, ...).
        width: the widening factor k (channels 16k, 32k, 64k).
        n_classes: outputs of the linear head.
        key: PRNG key for the initial weights.
        in_channels: channels of the input images (3 for CIFAR, 1 for Fashion-MNIST).
        remat: recomputation (above).
        scan: run each group's identical blocks with `lax.scan` (`False`: a Python loop,
            the same numbers; recomputation then may not save memory).
        norm: `"batch"` (BatchNorm, the paper's), `"group"` (`GroupNorm(groups, c)` in
            every BatchNorm's place: no state, nothing shared across the batch, so the same
            numbers at any micro-batch size; two reductions per normalisation, as
            BatchNorm's) or `"group_ws"` (GroupNorm and Weight Standardization of every
            convolution, a sparse one's over its stored weights, Qiao et al. 2019: one
            pass over each weight per step).
        groups: GroupNorm's groups; must divide every width (16, 16k, 32k and 64k).

        Raises:
            ValueError: for a bad depth, width, class count, channel count, remat, norm,
                or groups that do not divide a width.
        """
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}.")
        for name, value in (("width", width), ("n_classes", n_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
            raise ValueError(
                f"depth must be 6n + 4 with n >= 1 blocks per group (10, 16, 22, 28, ...), "
                f"got {depth!r}."
            )
        if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1:
            raise ValueError(f"in_channels must be a positive int, got {in_channels!r}.")
        block_remat, segment = _parse_remat(remat)
        n = (depth - 4) // 6
        stem_key, head_key, *group_keys = jr.split(key, 5)
        self.stem = _conv(in_channels, 16, 3, 1, stem_key)
        firsts, rests, first_index, rest_index = [], [], [], []
        c_in = 16
        for g, (c_out, stride) in enumerate(((16 * width, 1), (32 * width, 2), (64 * width, 2))):
            first_key, rest_key = jr.split(group_keys[g])
            first = WideBlock(c_in, c_out, stride, key=first_key, norm=norm, groups=groups)
            firsts.append(first)
            first_index.append(eqx.nn.StateIndex(first.init_state()))
            if n > 1:
                rest, states = stack(
                    lambda k, c=c_out: _with_state(
                        WideBlock(c, c, 1, key=k, norm=norm, groups=groups)
                    ),
                    n - 1,
                    key=rest_key,
                    remat=block_remat,
                    segment=segment,
                    scan=scan,
                    stateful=True,
                )
                rests.append(rest)
                rest_index.append(eqx.nn.StateIndex(states))
            else:
                rests.append(None)
                rest_index.append(None)
            c_in = c_out
        self.firsts = tuple(firsts)
        self.rests = tuple(rests)
        self.first_index = tuple(first_index)
        self.rest_index = tuple(rest_index)
        self.bn = _make_norm(norm, c_in, groups)
        self.bn_index = eqx.nn.StateIndex(self.bn.init_stats())
        head = eqx.nn.Linear(c_in, n_classes, key=head_key)
        self.head = eqx.tree_at(lambda h: h.bias, head, jnp.zeros((n_classes,), jnp.float32))
        self.depth = depth
        self.width = width
        self.n_classes = n_classes
        self.in_channels = in_channels
        self.remat = remat if segment is not None else block_remat
        self.segment = segment
        self.norm = norm

    def _first(
        self, block: WideBlock, x: Array, state: BlockState, each: Callable
    ) -> tuple[Array, BlockState]:
        """A group's first block, recomputed on its own when any recomputation is on."""
        remat = "full" if self.segment is not None else self.remat
        assert not isinstance(remat, str) or remat in PRESETS
        policy = remat_policy(remat, WideBlock.remat_presets)  # type: ignore[arg-type]
        run = lambda b, x, s: each(b)(x, s)  # noqa: E731
        if policy is None:
            return run(block, x, state)
        return eqx.filter_checkpoint(run, policy=policy)(block, x, state)

    @jax.named_scope("eqx_lowmem.nn.WideResNet")
    def __call__(
        self,
        x: Float[Array, "channels height width"],
        state: eqx.nn.State,
        *,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, " n_classes"], eqx.nn.State]:
        """Logits of one image, and the new state (under `jax.vmap`, see the class).

        Args:
            x: one image, `(in_channels, height, width)`.
            state: the `eqx.nn.State` from `eqx.nn.make_with_state`.
            key: unused (no dropout); accepted for the `Stack` and loss conventions.
        """
        if x.ndim != 3 or x.shape[0] != self.in_channels:
            raise ValueError(
                f"WideResNet expects one image of shape ({self.in_channels}, height, width), "
                f"got {x.shape}; jax.vmap over the batch (see WideResNet.batched)."
            )
        del key
        return self._forward(x, state, None)

    def _forward(self, x: Array, state: eqx.nn.State, axis_name: str | None):
        """One image (`axis_name=None`), or a batch whose vmap sits innermost: around each
        piece, inside the groups' loops and the recomputed regions (see `batched`)."""
        if axis_name is None:
            each = _identity
        else:
            each = functools.partial(
                jax.vmap, axis_name=axis_name, in_axes=(0, None), out_axes=(0, None)
            )
        ws = self.norm == "group_ws"
        h, _ = each(lambda x, s: (_conv_ws(self.stem, ws, x), s))(x, None)
        for first, rest, fi, ri in zip(
            self.firsts, self.rests, self.first_index, self.rest_index, strict=True
        ):
            h, s = self._first(first, h, state.get(fi), each)
            state = state.set(fi, s)
            if rest is not None:
                assert ri is not None
                if axis_name is None:
                    h, s = rest(h, state.get(ri))
                else:
                    h, s = rest.batched(h, state.get(ri), axis_name=axis_name)
                state = state.set(ri, s)
        h, s = each(functools.partial(_bn_relu, self.bn))(h, state.get(self.bn_index))
        state = state.set(self.bn_index, s)

        def head(h, s):
            pooled = jnp.mean(h.astype(jnp.float32), axis=(1, 2)).astype(h.dtype)
            return self.head(pooled), s

        logits, _ = each(head)(h, None)
        return logits, state

    @staticmethod
    def keep_dense(path: str, layer: Any) -> bool:
        """For `eqx_lowmem.sparse.sparsify(model, density, key=key, exclude=...)`: true for
        every layer but the blocks' 3x3 convolutions (98.9% of WRN-28-2's parameters), so
        the stem, the 1x1 shortcuts and the head stay dense, as in the paper."""
        del layer
        return not (path.endswith(".conv1") or path.endswith(".conv2"))

    def batched(
        self, x: Float[Array, "batch channels height width"], state: eqx.nn.State
    ) -> tuple[Float[Array, "batch n_classes"], eqx.nn.State]:
        """`self` over a batch, batch statistics over the whole of `x`: a loss calls this.

        The same numbers as `jax.vmap(model, axis_name="batch", in_axes=(0, None),
        out_axes=(0, None))(x, state)`, with the vmap inside the groups' loops and the
        recomputed regions, so that each convolution runs once over the batch with a
        backward pass that XLA:CPU runs fast inside loops (`eqx_lowmem.nn._conv`)."""
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                "WideResNet.batched expects images of shape (batch, in_channels="
                f"{self.in_channels}, height, width), got {x.shape}."
            )
        # A copy, as vmap makes one: the caller's state stays usable (eqx.nn.State marks
        # the object it sets on as used).
        leaves, treedef = jax.tree.flatten(state)
        with jax.named_scope("eqx_lowmem.nn.WideResNet"):
            return self._forward(x, jax.tree.unflatten(treedef, leaves), "batch")


def _identity(fn: Callable) -> Callable:
    return fn


def _with_state(block: WideBlock) -> tuple[WideBlock, BlockState]:
    return block, block.init_state()
