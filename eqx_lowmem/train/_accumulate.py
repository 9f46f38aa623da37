"""Gradient accumulation as a wrapper over a gradient function (Levanter's shape).

A *gradient function* maps `(params, model_state, batch, weights, key)` to `Sums`: the
gradient of the weighted loss *sum* and the sums it came from. Sums over disjoint parts of
a batch add up to the sums of the whole batch, so `accumulate(fn, k)` (a `lax.scan` over `k`
micro-batches, each taking its own `grad`) has the signature and the result of `fn` on the
whole batch, with one micro-batch of activations alive. The mean (sum / total weight) is
taken once, after every micro-batch and every device: never a mean of means.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..precision._policy import Policy, cast_floating
from ._loss import call_loss


class Sums(NamedTuple):
    """What a gradient function returns for (part of) a batch.

    Attributes:
        grads: float32 gradient of `scale * sum(values * weights)` w.r.t. the parameters.
        total: `sum(values * weights)`, float32.
        weight: `sum(weights)`, float32.
        model_state: the model state after this part (threaded in order), or None.
    """

    grads: Any
    total: Float[Array, ""]
    weight: Float[Array, ""]
    model_state: Any


GradFn = Callable[[Any, Any, tuple, Array, PRNGKeyArray, Array], Sums]


def loss_grad(
    loss_fn: Callable[..., Any],
    static: Any,
    policy: Policy,
    *,
    prepare: Callable[[Any], Any] | None = None,
) -> GradFn:
    """The gradient function of `loss_fn` for a model split as `eqx.combine(params, static)`.

    `prepare(model)`, when given, runs inside the differentiated function before the loss
    (FSDP all-gathers shards there, so their gradients come back reduce-scattered).

    The returned `fn(params, model_state, batch, weights, key, scale)` differentiates
    `scale * sum / count` (`count` = the number of loss values, known from shapes): a
    mean-like magnitude, which is what a 16-bit backward pass and its loss scale are tuned
    for; it multiplies by `count` afterwards (in float32) to return the gradient of the sum.
    """

    def fn(params, model_state, batch, weights, key, scale) -> Sums:
        def objective(params):
            model = eqx.combine(params, static)
            if prepare is not None:
                model = prepare(model)
            out = call_loss(
                loss_fn, model, batch, weights, model_state=model_state, key=key, policy=policy
            )
            total = jnp.sum(out.values * out.weights)
            count = out.values.size
            return total * (scale / count), (total, jnp.sum(out.weights), out.model_state, count)

        grads, (total, weight, new_state, count) = jax.grad(objective, has_aux=True)(params)
        grads = jax.tree.map(lambda g: g * jnp.float32(count), cast_floating(grads, jnp.float32))
        return Sums(grads, total, weight, new_state)

    return fn


def _add(a: Sums, b: Sums) -> Sums:
    return Sums(
        jax.tree.map(jnp.add, a.grads, b.grads), a.total + b.total, a.weight + b.weight,
        b.model_state,
    )  # fmt: skip


def accumulate(grad_fn: GradFn, k: int) -> GradFn:
    """`grad_fn` over `k` micro-batches in a `lax.scan`: the same sums, 1/k of the activations.

    Micro-batch `i` is samples `[i * m, (i + 1) * m)` with `m = ceil(n / k)`; a remainder
    (when `k` does not divide `n`) runs as one more, smaller micro-batch after the scan, so
    stateful layers (BatchNorm) see exactly the real micro-batches. Each micro-batch gets the
    key `jr.fold_in(key, i)`. Memory: one micro-batch of activations and one float32
    accumulator. `k = 1` is `grad_fn` itself.
    """
    if k == 1:
        return grad_fn

    def fn(params, model_state, batch, weights, key, scale) -> Sums:
        n = weights.shape[0]
        m = -(-n // k)
        full, rest = divmod(n, m)

        # (full, m, ...): micro-batch i is samples [i * m, (i + 1) * m).
        split = jax.tree.map(lambda x: x[: full * m].reshape(full, m, *x.shape[1:]), batch)
        w_split = weights[: full * m].reshape(full, m)

        def body(carry: Sums, xs):
            mb, mw, i = xs
            sums = grad_fn(params, carry.model_state, mb, mw, jr.fold_in(key, i), scale)
            return _add(carry, sums), None

        # The gradient has the parameters' structure in float32: no trace needed for it.
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        init = Sums(zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), model_state)
        sums, _ = jax.lax.scan(body, init, (split, w_split, jnp.arange(full)))
        if rest:
            batch_rest, w_rest = jax.tree.map(lambda x: x[full * m :], (batch, weights))
            last = grad_fn(params, sums.model_state, batch_rest, w_rest, jr.fold_in(key, full),
                           scale)  # fmt: skip
            sums = _add(sums, last)
        return sums

    return fn
