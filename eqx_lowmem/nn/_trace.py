"""A function with its own rule under `jax.vmap` that differentiation never sees.

`jax.custom_batching.custom_vmap` gives a function a batch-level rule, but reverse-mode
autodiff cannot go through it: a layer could only use it where `jax.vmap` is the innermost
transformation (`grad(vmap(f))`), not under `vmap(grad(f))` (per-example gradients), and
telling the two apart at trace time needs JAX's private internals. `vmap_rule` asks no
question: it binds one primitive (JAX's public extension API: `jax.extend.core.Primitive`
with rules in `jax.interpreters`) whose batching rule is the caller's rule and whose
derivative is that of the plain per-example function. Whichever transformation reaches the
call first applies its own rule, so:

- `grad(vmap(f))`, `vmap(f)`: the batch-level rule (then differentiated as it is written,
  e.g. a `custom_vjp` over the whole batch);
- `vmap(grad(f))`, `grad(f)`, `jvp`: the plain function, differentiated by JAX, then
  vmapped by JAX's own rules;
- a `jit`, `checkpoint` or `lax.scan` between the `vmap` and the call: the rule too, when
  the vmap batches their body.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

_call_p = Primitive("eqx_lowmem_vmap_rule")
_call_p.multiple_results = True


class _Fns:
    """The caller's function and rule on flat arguments, a primitive parameter (hashable
    by identity)."""

    def __init__(self, plain: Callable, rule: Callable, in_tree: Any, out_tree: Any):
        self.plain, self.rule, self.in_tree, self.out_tree = plain, rule, in_tree, out_tree

    def call(self, args: Sequence) -> list:
        out = self.plain(*jax.tree.unflatten(self.in_tree, args))
        return jax.tree.leaves(out)

    def batched(self, axis_size: int, in_batched: Sequence[bool], args: Sequence) -> tuple:
        args_tree = jax.tree.unflatten(self.in_tree, args)
        batched_tree = jax.tree.unflatten(self.in_tree, in_batched)
        out, out_batched = self.rule(axis_size, batched_tree, *args_tree)
        flat, tree = jax.tree.flatten(out)
        if tree != self.out_tree:
            raise ValueError(f"vmap_rule: the rule returned {tree}, the function {self.out_tree}")
        if isinstance(out_batched, bool):
            return flat, [out_batched] * len(flat)
        return flat, jax.tree.leaves(out_batched)


def _impl(*args: Any, call: ClosedJaxpr, fns: _Fns) -> list:
    return jaxpr_as_fun(call)(*args)


def _abstract_eval(*avals: Any, call: ClosedJaxpr, fns: _Fns) -> tuple:
    return call.out_avals, call.effects


def _batch(args: Sequence, dims: Sequence, *, call: ClosedJaxpr, fns: _Fns) -> tuple:
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [
        a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)
    ]
    outs, batched = fns.batched(size, [d is not None for d in dims], args)
    return outs, [0 if b else None for b in batched]


def _jvp(primals: Sequence, tangents: Sequence, *, call: ClosedJaxpr, fns: _Fns) -> tuple:
    # The Python function again, not `call`: a custom_vjp in it may close over values of
    # its own trace, which its backward pass reads when the differentiation reaches it.
    # Differentiated in the arguments that have a tangent only (a zero tangent made
    # explicit would cost a product with zeros in the forward pass).
    moving = [type(t) is not ad.Zero for t in tangents]

    def plain(*dyn: Any) -> list:
        it = iter(dyn)
        return fns.call([next(it) if m else p for p, m in zip(primals, moving, strict=True)])

    dyn = [p for p, m in zip(primals, moving, strict=True) if m]
    dots = [t for t, m in zip(tangents, moving, strict=True) if m]
    outs, out_dots = jax.jvp(plain, dyn, dots)
    return list(outs), list(out_dots)


_call_p.def_impl(_impl)
_call_p.def_effectful_abstract_eval(_abstract_eval)
batching.primitive_batchers[_call_p] = _batch
ad.primitive_jvps[_call_p] = _jvp
mlir.register_lowering(_call_p, mlir.lower_fun(_impl, multiple_results=True))


def vmap_rule(plain: Callable, rule: Callable, *args: Any) -> Any:
    """`plain(*args)`, except that a `jax.vmap` acting on it runs
    `rule(axis_size, in_batched, *args)` instead: `in_batched` is `args`' tree of bools
    (which leaves the vmap batches, their batch axis moved to the front), and the rule
    returns `(out, out_batched)` as `jax.custom_batching.custom_vmap`'s does, `out_batched`
    one bool or a tree of them.

    Unlike `custom_vmap`, differentiation sees `plain` itself (JAX differentiates it), so
    `vmap(grad(f))` gives per-example gradients, while `grad(vmap(f))` differentiates what
    the rule returns. `plain` is traced here for its output's shapes, and again where it
    is differentiated; it must close over no array (pass arrays in `args`).
    """
    flat, in_tree = jax.tree.flatten(args)
    out_trees = []

    def flat_plain(*flat_args: Any) -> list:
        out, out_tree = jax.tree.flatten(plain(*jax.tree.unflatten(in_tree, flat_args)))
        out_trees.append(out_tree)
        return out

    call = jax.make_jaxpr(flat_plain)(*flat)
    outs = _call_p.bind(*flat, call=call, fns=_Fns(plain, rule, in_tree, out_trees[0]))
    return jax.tree.unflatten(out_trees[0], outs)
