"""Gradient accumulation as a wrapper over a gradient function (Levanter's shape).

A *gradient function* maps `(params, model_state, batch, weights, key)` to `Sums`: the
gradient of the weighted loss *sum* and the sums it came from. Sums over disjoint parts of
a batch add up to the sums of the whole batch, so `accumulate(fn, k)` (a `lax.scan` over `k`
micro-batches, each taking its own `grad`) has the signature and the result of `fn` on the
whole batch, with one micro-batch of activations alive. The mean (sum / total weight) is
taken once, after every micro-batch and every device: never a mean of means.

With a 16-bit accumulator (`dtype=jnp.float16` or `jnp.bfloat16` for both `loss_grad` and
`accumulate`), each micro-batch's gradient is kept in 16 bits at a mean's magnitude (the
gradient of `scale * sum / count`, what the loss scale keeps in range) and added into a
16-bit average of them; the float32 gradient of the sum is formed once, after the last
micro-batch.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..nn._fuse import Fusion, fusing
from ..precision._policy import Policy
from ._loss import call_loss


class Sums(NamedTuple):
    """What a gradient function returns for (part of) a batch.

    Attributes:
        grads: float32 gradient of `scale * sum(values * weights)` w.r.t. the parameters;
            with `unit`, a 16-bit accumulator whose float32 value times `unit` is that.
        total: `sum(values * weights)`, float32.
        weight: `sum(weights)`, float32.
        model_state: the model state after this part (threaded in order), or None.
        unit: None, or the float32 scalar the 16-bit `grads` are in units of (a 16-bit
            accumulator holds the gradient of the mean: `unit` is the count). Kept apart
            so that no float32 copy of the whole gradient is ever formed: its consumers
            convert and scale each element as they read it (`exact()` forms it).
    """

    grads: Any
    total: Float[Array, ""]
    weight: Float[Array, ""]
    model_state: Any
    unit: Float[Array, ""] | None = None

    def exact(self) -> "Sums":
        """The same sums with `grads` the float32 gradient of the sum (`unit` None)."""
        if self.unit is None:
            return self
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) * self.unit, self.grads)
        return Sums(grads, self.total, self.weight, self.model_state)


class MeanSums(NamedTuple):
    """What a 16-bit gradient function returns: `Sums`, but `grads` (in the 16-bit dtype)
    is the gradient of `scale * sum(values * weights) / count`, a mean's magnitude, which
    16 bits hold where a sum over many samples would overflow float16.

    Attributes:
        grads: 16-bit gradient of `scale * sum / count`.
        total, weight, model_state: as in `Sums`.
        count: the number of loss values the sum is over (float32; exact below 2**24).
    """

    grads: Any
    total: Float[Array, ""]
    weight: Float[Array, ""]
    model_state: Any
    count: Float[Array, ""]


GradFn = Callable[[Any, Any, tuple, Array, PRNGKeyArray, Array], Sums]

ACCUMULATE_DTYPES = ("float32", "bfloat16", "float16")


def check_accumulate_dtype(dtype: Any) -> Any:
    """`dtype` as a numpy dtype, if it is one of `ACCUMULATE_DTYPES`; else a clear error."""
    try:
        got = jnp.dtype(dtype)
    except TypeError:
        got = None
    if got is None or got.name not in ACCUMULATE_DTYPES:
        raise ValueError(
            f"accumulate_dtype={dtype!r}; expected one of {ACCUMULATE_DTYPES} (e.g. "
            "jnp.float16 with a loss scale to keep the micro-batch gradients in 16 bits)."
        )
    return got


def _is_16(dtype: Any) -> bool:
    return jnp.dtype(dtype).itemsize == 2


def loss_grad(
    loss_fn: Callable[..., Any],
    static: Any,
    policy: Policy,
    *,
    prepare: Callable[[Any], Any] | None = None,
    dtype: Any = jnp.float32,
) -> GradFn:
    """The gradient function of `loss_fn` for a model split as `eqx.combine(params, static)`.

    `prepare(model)`, when given, runs inside the differentiated function before the loss
    (FSDP all-gathers shards there, so their gradients come back reduce-scattered).

    `dtype` 16-bit (`jnp.float16`, `jnp.bfloat16`): the function returns a `MeanSums`, its
    gradient in `dtype` and not multiplied by `count` (for `accumulate(..., dtype=dtype)`).

    The returned `fn(params, model_state, batch, weights, key, scale)` differentiates
    `scale * sum / count` (`count` = the number of loss values, known from shapes): a
    mean-like magnitude, which is what a 16-bit backward pass and its loss scale are tuned
    for; it multiplies by `count` afterwards (in float32) to return the gradient of the sum.
    """

    def fn(
        params, model_state, batch, weights, key, scale, fuse=None, in_units=False
    ) -> Sums | MeanSums:
        seen: dict[str, Any] = {}

        def fold(a, g):
            # One layer's gradient into its accumulator slice: what `accumulate` would add.
            if _is_16(dtype):
                return (a.astype(jnp.float32) + g.astype(dtype).astype(jnp.float32)
                        * fuse.share).astype(dtype)  # fmt: skip
            return a + g.astype(jnp.float32) * jnp.float32(seen["count"])

        def objective(params, acc):
            model = eqx.combine(params, static)
            if prepare is not None:
                model = prepare(model)
            fusion = None if acc is None else Fusion(params, acc, fold)
            seen["fusion"] = fusion
            with fusing(fusion):
                out = call_loss(
                    loss_fn, model, batch, weights, model_state=model_state, key=key,
                    policy=policy,
                )  # fmt: skip
            if fusion is not None:
                fusion.check_reached(eqx.combine(params, static))
            total = jnp.sum(out.values * out.weights)
            count = seen["count"] = out.values.size
            return total * (scale / count), (total, jnp.sum(out.weights), out.model_state, count)

        if fuse is None:
            grads, aux = jax.grad(objective, has_aux=True)(params, None)
            fused, acc_ct = frozenset(), None
        else:
            (grads, acc_ct), aux = jax.grad(objective, argnums=(0, 1), has_aux=True)(
                params, fuse.acc
            )
            fused = frozenset(seen["fusion"].fused)
            fuse.fused = fused
        total, weight, new_state, count = aux
        if in_units and fuse is None and not _is_16(dtype):
            # The gradient as the backward pass leaves it, in units of the count: a product
            # with the count here would be stored whole wherever a loop reads it (the
            # chunked norm), a float32 copy of the gradient.
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            return Sums(grads, total, weight, new_state, jnp.float32(count))
        leaves, treedef = jax.tree.flatten(grads)
        accs = [None] * len(leaves) if acc_ct is None else jax.tree.leaves(acc_ct)
        out = []
        for n, (g, a) in enumerate(zip(leaves, accs, strict=True)):
            if n in fused:
                # The new accumulator, from the stack that took it; a use of the same
                # parameters outside that stack (tied weights) is folded in here.
                out.append(fold(a, g))
            elif _is_16(dtype):
                out.append(g.astype(dtype))
            else:
                out.append(g.astype(jnp.float32) * jnp.float32(count))
        grads = jax.tree.unflatten(treedef, out)
        if _is_16(dtype):
            return MeanSums(grads, total, weight, new_state, jnp.float32(count))
        return Sums(grads, total, weight, new_state)

    fn.fusable = True  # type: ignore[attr-defined]
    return fn


class FuseRequest:
    """What `accumulate` offers one micro-batch's gradient function: its accumulator
    (`acc`, the parameters' structure) and the micro-batch's share of the samples. The
    function sets `fused`: the positions (in the parameters' leaves) where its returned
    gradient already is the new accumulator (`eqx_lowmem.nn._fuse`)."""

    def __init__(self, acc: Any, share: float):
        self.acc = acc
        self.share = share
        self.fused: frozenset[int] = frozenset()


def _to_sums(m: MeanSums) -> Sums:
    """The sums of a 16-bit gradient of `sum / count`: in units of the count."""
    return Sums(m.grads, m.total, m.weight, m.model_state, m.count)


def _fold_leaves(rule: Callable, acc: Any, part: Any, fused: frozenset[int]) -> Any:
    """`rule(acc_leaf, part_leaf)` per leaf, except where `part` already holds the new
    accumulator (positions in `fused`, from a stack that folded its gradient in)."""
    a_leaves, treedef = jax.tree.flatten(acc)
    p_leaves = jax.tree.leaves(part)
    out = [
        g if n in fused else rule(a, g)
        for n, (a, g) in enumerate(zip(a_leaves, p_leaves, strict=True))
    ]
    return jax.tree.unflatten(treedef, out)


def _add(a: Sums, b: Sums, fused: frozenset[int] = frozenset()) -> Sums:
    return Sums(
        _fold_leaves(jnp.add, a.grads, b.grads, fused), a.total + b.total, a.weight + b.weight,
        b.model_state,
    )  # fmt: skip


def accumulate(grad_fn: GradFn, k: int, *, dtype: Any = jnp.float32, fuse: bool = True) -> GradFn:
    """`grad_fn` over `k` micro-batches in a `lax.scan`: the same sums, 1/k of the activations.

    Micro-batch `i` is samples `[i * m, (i + 1) * m)` with `m = ceil(n / k)`; a remainder
    (when `k` does not divide `n`) runs as one more, smaller micro-batch after the scan, so
    stateful layers (BatchNorm) see exactly the real micro-batches. Each micro-batch gets the
    key `jr.fold_in(key, i)`. Memory: one micro-batch of activations and one float32
    accumulator. `k = 1` is `grad_fn` itself.

    `dtype` 16-bit: `grad_fn` is `loss_grad(..., dtype=dtype)` (a `MeanSums` per
    micro-batch); the accumulator holds, in `dtype`, the average of the micro-batches'
    gradients weighted by their share of the samples (`m / n`: each micro-batch has the same
    loss values per sample, so the share of the loss values), never larger than the largest
    of them, so a float16 accumulator overflows only where a micro-batch's gradient would.
    Each addition is computed in float32 and rounded once to `dtype`. Memory: the
    micro-batch gradient and the accumulator in 2 bytes per parameter each (instead of 4);
    returns `Sums` in units of the count (`Sums.unit`): no float32 copy of the gradient is
    formed (`Sums.exact()` forms one).

    `fuse` (for a `loss_grad` function): the accumulator is offered to the model's scanned
    stacks whose blocks are all recomputed (`remat=True`), which fold each layer's gradient
    into it inside their backward loop (`eqx_lowmem.nn._fuse`): the same numbers, without a
    micro-batch gradient of those stacks' parameters beside the accumulator.
    """
    fuse = bool(fuse) and getattr(grad_fn, "fusable", False)
    if _is_16(dtype):
        return _accumulate_16(grad_fn, k, jnp.dtype(dtype), fuse)
    if k == 1:
        return grad_fn

    def init(params, model_state) -> Sums:
        # The gradient has the parameters' structure in float32: no trace needed for it.
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return Sums(zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), model_state)

    def add(acc, part, share, fused):
        return _add(acc, part, fused)

    return _over_micro_batches(grad_fn, k, init, add, fuse)


def _over_micro_batches(
    part_fn: Callable[..., Any],
    k: int,
    init: Callable[[Any, Any], Any],
    add: Callable[[Any, Any, float, frozenset[int]], Any],
    fuse: bool = False,
) -> Callable[..., Any]:
    """`part_fn` over `k` micro-batches in a `lax.scan` (and a smaller last one outside it),
    folded by `add(acc, part, share, fused)`, `share` being the micro-batch's fraction of
    samples; with `fuse`, `part_fn` gets a `FuseRequest` and `fused` is what it set."""

    def part(acc, *args, share):
        if not fuse:
            return add(acc, part_fn(*args), share, frozenset())
        request = FuseRequest(acc.grads, share)
        out = part_fn(*args, fuse=request)
        return add(acc, out, share, request.fused)

    def fn(params, model_state, batch, weights, key, scale):
        n = weights.shape[0]
        m = -(-n // k)
        full, rest = divmod(n, m)

        # (full, m, features): micro-batch i is samples [i * m, (i + 1) * m), each sample
        # flat. A sample of several axes is given its shape back inside the loop: a layout
        # the model wants (a GPU's convolutions take channels last) is then made per
        # micro-batch, not by XLA on the whole batch before the loop (a second batch).
        split = jax.tree.map(
            lambda x: x[: full * m].reshape(full, m, math.prod(x.shape[1:])), batch
        )
        w_split = weights[: full * m].reshape(full, m)

        def body(carry, xs):
            mb, mw, i = xs
            mb = jax.tree.map(lambda s, x: s.reshape(m, *x.shape[1:]), mb, batch)
            args = (params, carry.model_state, mb, mw, jr.fold_in(key, i), scale)
            return part(carry, *args, share=m / n), None

        acc, _ = jax.lax.scan(body, init(params, model_state), (split, w_split, jnp.arange(full)))
        if rest:
            batch_rest, w_rest = jax.tree.map(lambda x: x[full * m :], (batch, weights))
            args = (params, acc.model_state, batch_rest, w_rest, jr.fold_in(key, full), scale)
            acc = part(acc, *args, share=rest / n)
        return acc

    return fn


def _accumulate_16(grad_fn: GradFn, k: int, dtype: Any, fuse: bool = False) -> GradFn:
    """`accumulate` with a 16-bit accumulator (see there)."""

    def micro(params, model_state, batch, weights, key, scale, **fusing) -> MeanSums:
        out = grad_fn(params, model_state, batch, weights, key, scale, **fusing)
        if not isinstance(out, MeanSums):
            raise TypeError(
                f"accumulate(..., dtype={dtype.name}) needs the gradient function "
                f"loss_grad(..., dtype={dtype.name}), which returns MeanSums; got "
                f"{type(out).__name__}."
            )
        return out

    if k == 1:
        return lambda *args: _to_sums(micro(*args))

    def add(acc: MeanSums, part: MeanSums, share: float, fused: frozenset[int]) -> MeanSums:
        def rule(a, g):
            return (a.astype(jnp.float32) + g.astype(jnp.float32) * share).astype(dtype)

        grads = _fold_leaves(rule, acc.grads, part.grads, fused)
        return MeanSums(
            grads, acc.total + part.total, acc.weight + part.weight, part.model_state,
            acc.count + part.count,
        )  # fmt: skip

    def init(params, model_state) -> MeanSums:
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
        zero = jnp.zeros((), jnp.float32)
        return MeanSums(zeros, zero, zero, model_state, zero)

    fn = _over_micro_batches(micro, k, init, add, fuse)
    return lambda *args: _to_sums(fn(*args))
