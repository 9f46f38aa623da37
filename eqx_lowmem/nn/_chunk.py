"""Apply a function to chunks of rows, each chunk recomputed in its own backward pass."""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun
from jaxtyping import Array, PyTree

from ._jvp import is_zero


def map_chunks(fn: Callable[[PyTree, Array], Array], x: PyTree, chunk: int | None) -> Array:
    """`fn(rows, first_row)` over consecutive chunks of `chunk` rows of `x`, concatenated.

    `x` is an array or a pytree of arrays (None leaves allowed) with the same number of
    rows. Each chunk runs under `jax.checkpoint`, so the backward pass keeps only `x` and
    holds one chunk's intermediates at a time, for one more forward pass of `fn`. A chunk
    reads its rows of `x` and writes its rows of the output in place, so neither pass
    holds `x` or the output a second time, split into chunks. A length that `chunk` does
    not divide is padded; the padded rows are dropped. With `chunk=None` (or
    `chunk >= len(x)`) this is `fn(x, 0)`.

    Where `x` is one array and `fn` keeps its rows' shape and dtype (a residual block's
    attention or feed-forward), the backward pass writes each chunk's gradient of `x`
    over the rows of the output's gradient it has just read: one sequence-sized buffer
    for both, where a gradient accumulated from zeros would be a second (a rule of its
    own, `_in_place`; measured for 46287bd on the H100 target, 2-layer
    `CausalLM(remat=True)`, 8 x 256 tokens: the loss-and-gradient's temporaries from 83.1
    to 75.8 MB).

    On XLA:CPU the loop runs inside a `lax.cond` whose predicate XLA cannot know: the
    backward loop's zero-initialised accumulators (the gradients of everything `fn`
    closes over, and of `x`) are then allocated when that loop runs. As plain program
    values XLA:CPU's scheduler allocates them at the start of the enclosing computation,
    a whole block's backward pass early (2-layer `CausalLM`, 8 x 256 tokens: 20 of its
    111 MB of temporaries, measured for 76e6529). Other platforms run the loop as it is.
    """
    leaves, treedef = jax.tree.flatten(x)
    n = leaves[0].shape[0]
    if chunk is None or chunk >= n:
        return fn(x, jnp.zeros((), jnp.int32))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    if pad:
        x = jax.tree.map(lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)), x)
        leaves = jax.tree.leaves(x)
    if len(leaves) == 1:
        rows = jax.ShapeDtypeStruct((chunk, *leaves[0].shape[1:]), leaves[0].dtype)
        traced = jax.make_jaxpr(lambda r, f: fn(jax.tree.unflatten(treedef, [r]), f))(
            rows, jax.ShapeDtypeStruct((), jnp.int32)
        )
        if [(a.shape, a.dtype) for a in traced.out_avals] == [(rows.shape, rows.dtype)]:
            # Everything `fn` closes over is passed explicitly (a rule's function must not
            # close over a value being traced).
            return _in_place(_Jaxpr(traced.jaxpr), chunk, leaves[0], *traced.consts)[:n]

    @jax.checkpoint
    def one(x: PyTree, first: Array) -> Array:
        rows = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, first, chunk), x)
        return fn(rows, first)

    out = jax.eval_shape(one, x, jnp.zeros((), jnp.int32))
    y = jnp.zeros((n_chunks * chunk, *out.shape[1:]), out.dtype)
    return _on_platform(_loop(one, n_chunks, chunk), x, y)[:n]


def _loop(one: Callable[..., Array], n_chunks: int, chunk: int) -> Callable[..., Array]:
    """`run(x, y, *args)`: each chunk's `one(x, first, *args)` written over its rows of
    `y` in place."""
    firsts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk

    def run(x: PyTree, y: Array, *args: Any) -> Array:
        def body(y: Array, first: Array) -> tuple[Array, None]:
            return jax.lax.dynamic_update_slice_in_dim(y, one(x, first, *args), first, 0), None

        return jax.lax.scan(body, y, firsts)[0]

    return run


def _on_platform(run: Callable[..., Array], *args: Any) -> Array:
    """`run(*args)`; on XLA:CPU inside a `lax.cond` it cannot resolve (the docstring above)."""

    def scoped(*args: Any) -> Array:
        return jax.lax.cond(jax.lax.optimization_barrier(jnp.bool_(True)), run, run, *args)

    return jax.lax.platform_dependent(*args, cpu=scoped, default=run)


class _Jaxpr:
    """`fn(rows, first, *consts)` of a traced function whose constants are arguments."""

    def __init__(self, jaxpr: Jaxpr):
        self.jaxpr = jaxpr

    def __call__(self, rows: Array, first: Array, *consts: Any) -> Array:
        return jaxpr_as_fun(ClosedJaxpr(self.jaxpr, list(consts)))(rows, first)[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _in_place(fn: Callable[..., Array], chunk: int, x: Array, *consts: Array) -> Array:
    """`map_chunks` of `fn(rows, first, *consts)` for rows in and rows of the same shape
    out. Its tangent is a loop that replaces each chunk's rows of the input's tangent by
    the output's, in place, so reverse mode (which transposes that loop) writes each
    chunk's input gradient over the output gradient's rows it has just read."""
    n_chunks = x.shape[0] // chunk

    @jax.checkpoint
    def one(x: Array, first: Array, *consts: Array) -> Array:
        return fn(jax.lax.dynamic_slice_in_dim(x, first, chunk), first, *consts)

    # Every row is overwritten: the first buffer's values never count. Made from `x`, not
    # a constant, so that XLA does not merge it with other zeros of its shape into one
    # buffer held across the loops of all of them.
    y = jnp.full_like(x, x.reshape(-1)[0] * 0)
    return _on_platform(_loop(one, n_chunks, chunk), x, y, *consts)


def _in_place_jvp(fn, chunk, primals, tangents):
    x, *consts = primals
    dx, *dconsts = tangents
    y = _in_place(fn, chunk, x, *consts)
    live = [not is_zero(t) for t in dconsts]
    if is_zero(dx) and not any(live):
        return y, jnp.zeros_like(y)
    dx = jnp.zeros_like(x) if is_zero(dx) else dx
    dconsts = [t for t, m in zip(dconsts, live, strict=True) if m]

    def with_live(consts: list, live_consts: list) -> list:
        it = iter(live_consts)
        return [next(it) if m else c for c, m in zip(consts, live, strict=True)]

    @jax.checkpoint  # reverse mode keeps `x` and the constants, and recomputes each chunk
    def tangent(x: Array, first: Array, drows: Array, consts: list, dconsts: list) -> Array:
        rows = jax.lax.dynamic_slice_in_dim(x, first, chunk)
        held = [c for c, m in zip(consts, live, strict=True) if m]
        return jax.jvp(
            lambda r, cs: fn(r, first, *with_live(consts, cs)), (rows, held), (drows, dconsts)
        )[1]

    def run(x: Array, dx: Array, consts: list, dconsts: list) -> Array:
        def body(dx: Array, first: Array) -> tuple[Array, None]:
            drows = jax.lax.dynamic_slice_in_dim(dx, first, chunk)
            dy = tangent(x, first, drows, consts, dconsts)
            return jax.lax.dynamic_update_slice_in_dim(dx, dy, first, 0), None

        firsts = jnp.arange(x.shape[0] // chunk, dtype=jnp.int32) * chunk
        return jax.lax.scan(body, dx, firsts)[0]

    return y, _on_platform(run, x, dx, list(consts), dconsts)


_in_place.defjvp(_in_place_jvp, symbolic_zeros=True)
