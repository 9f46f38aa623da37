"""Optimizer state in 8 bits: block-wise dynamic quantisation for any optax optimizer."""

import functools
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array

from .._layout import Packed, is_entry, owners
from ._elementwise import elementwise_labels, signature
from ._optim import HalfState

# Leaves of these names hold non-negative statistics (optax's second moments): unsigned code.
_NON_NEGATIVE = ("nu", "nu_max", "sum_of_squares")


def dynamic_code(signed: bool) -> np.ndarray:
    """The 256 values of Dettmers et al.'s dynamic tree code, sorted, in [-1, 1].

    Each value is `10**-e * f`: the exponent `e` in 0..6 (10**-6 is the smallest non-zero
    magnitude relative to the block's absmax) and a linear fraction `f` in (0.1, 1] with
    more steps at larger exponents. The unsigned code spends the sign bit on the fraction.
    """
    data = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1.0, n + 1)
        means = 10.0 ** (i - 6) * (edges[:-1] + edges[1:]) / 2
        data += list(means) + (list(-means) if signed else [])
    return np.sort(np.asarray(data, np.float64)).astype(np.float32)


@functools.lru_cache(maxsize=2)
def _decades(signed: bool) -> tuple:
    """Per decade of the code (magnitudes 10**(i-6) * (0.1, 1]): the threshold above which
    a magnitude is nearest to a value of that decade or a later one (the midpoint between
    the two decades' facing values), and the linear map `floor(m * a + c)` from a
    magnitude to its cell in the decade, the decade's first index and its last cell; then
    the threshold of 1.0. Index `zero` holds 0."""
    table = np.sort(np.asarray(dynamic_code(signed), np.float64))
    zero = int(np.searchsorted(table, 0.0))
    start, top, rows = zero + 1, 0.0, []
    for i in range(7):
        n, s = (2**i if signed else 2 ** (i + 1)), 10.0 ** (i - 6)
        rows.append(((top + table[start]) / 2, n / (0.9 * s), -0.1 * n / 0.9, start, n - 1))
        top, start = table[start + n - 1], start + n
    return zero, rows, (top + 1.0) / 2


def _encode(r: Array, signed: bool) -> Array:
    """The index of the code value nearest to each `r` in [-1, 1], element-wise with
    compares and selects only (no search, logarithm or gather, so it vectorises and fuses
    with the update): count the decade thresholds below `|r|`, then the linear cell in that
    decade; a negative value takes the mirror index."""
    zero, rows, one = _decades(signed)
    m = jnp.abs(r)
    b = sum((m >= np.float32(t)).astype(jnp.int32) for t, *_ in rows)
    at_one = m >= np.float32(one)
    a, c, base, last = (np.float32(rows[0][1]), np.float32(rows[0][2]), rows[0][3], rows[0][4])
    for j, (_, aj, cj, bj, lj) in enumerate(rows[1:], start=2):
        w = b >= j
        a, c = jnp.where(w, np.float32(aj), a), jnp.where(w, np.float32(cj), c)
        base, last = jnp.where(w, np.int32(bj), base), jnp.where(w, np.int32(lj), last)
    cell = jnp.clip(jnp.floor(m * a + c).astype(jnp.int32), 0, last)
    idx = jnp.where(b == 0, zero, jnp.where(at_one, 255, base + cell))
    if signed:  # the negative values mirror the positive ones around zero (no -1.0)
        idx = jnp.where(r < 0, 2 * zero - jnp.where(at_one, idx - 1, idx), idx)
    return idx.astype(jnp.uint8)


def _decode(codes: Array, scale: Array, signed: bool) -> Array:
    """Codes `(blocks * block,)` to float32 blocks `(blocks, block)`: one lookup in the
    256-value table."""
    table = jnp.asarray(dynamic_code(signed))
    return table[codes.astype(jnp.int32)].reshape(scale.shape[0], -1) * scale[:, None]


class QuantizedArray(Packed):
    """One optimizer-state leaf stored as 8-bit codes and one float32 absmax per block.

    `codes` `(blocks * block,)` uint8 index the sorted dynamic code; `scale` `(blocks,)`.
    Flat, so that FSDP, which splits an array along its one axis, keeps whole blocks on
    each device whenever the device count divides the number of blocks.
    """

    codes: Array
    scale: Array
    shape: tuple[int, ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    signed: bool = eqx.field(static=True)

    def dense(self) -> Array:
        """The leaf in float32 (its original dtype's values, dequantised)."""
        n = math.prod(self.shape)
        x = _decode(self.codes, self.scale, self.signed)
        return x.reshape(-1)[:n].reshape(self.shape)

    def like(self, x: Array) -> "QuantizedArray":
        """`x`, shaped like this leaf, quantised with this leaf's code and block."""
        block = self.codes.shape[0] // self.scale.shape[0]
        return quantize(x, block, signed=self.signed, dtype=self.dtype)


def _blocks(x: Array, block: int, signed: bool) -> tuple[Array, Array]:
    """`x` in blocks of `block` elements along its flattened form (the last block padded
    with zeros): codes `(blocks * block,)` uint8 and absmax `(blocks,)` float32."""
    flat = jnp.ravel(x).astype(jnp.float32)
    flat = jnp.pad(flat, (0, -x.size % block)).reshape(-1, block)
    scale = jnp.max(jnp.abs(flat), axis=1)
    inverse = jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1.0), 0.0)
    return _encode(flat * inverse[:, None], signed).reshape(-1), scale


def quantize(x: Array, block: int, *, signed: bool, dtype: Any = None) -> QuantizedArray:
    """`x` in blocks of `block` elements along its flattened form (the last block padded
    with zeros), each scaled by its absmax and rounded to the nearest code value."""
    codes, scale = _blocks(x, block, signed)
    return QuantizedArray(codes, scale, tuple(x.shape), dtype or x.dtype, signed)


def _is_q(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


class QuantizedState(NamedTuple):
    """State of `quantized_state`: the wrapped optimizer's state, its large per-parameter
    floating leaves as `QuantizedArray`s."""

    inner: Any


def _name(path: tuple) -> str:
    for p in reversed(path):
        name = getattr(p, "name", None)
        if isinstance(name, str):
            return name
    return ""


_LAYOUT_FIX = (
    "8-bit state stores leaves laid out like the parameters (one number per element of a "
    "parameter, as optax's mu, nu and trace are); keep this optimizer's state in float32 or "
    "16 bits (eqx_lowmem.precision.half_state), or pass a block larger than this leaf."
)


def _checked(inner: Any, params: Any, block: int) -> tuple[list, Any, list]:
    """`owners` of `inner`, refusing a floating leaf of at least `block` elements that is
    not one number per element of a parameter (it could be neither quantised in blocks
    that follow the parameter nor kept small)."""
    leaves, treedef, who = owners(inner, params)
    for (path, x), w in zip(leaves, who, strict=True):
        if w is None and eqx.is_inexact_array(x) and x.ndim >= 1 and x.size >= block:
            raise ValueError(
                f"quantized_state(optimizer=...): the state leaf at "
                f"opt_state{jax.tree_util.keystr(path)} is {x.dtype}{list(x.shape)}, not "
                f"laid out like the parameters. {_LAYOUT_FIX}"
            )
    return leaves, treedef, who


def _empty(x: Any) -> Array:
    """A stand-in for a parameter left out of a call: no elements, the same rank and dtype."""
    return jnp.zeros((0,) * len(x.shape), x.dtype)


class _Plan(NamedTuple):
    """One update's flat arguments: the gradient's, the parameters' (or None) and the
    state's leaves (dense, or `QuantizedArray`), each state leaf's parameter (or None)."""

    u: list
    p: list | None
    s: list
    who: list
    u_def: Any
    s_def: Any

    def call(self, optimizer: Any, u: list, p: list | None, s: list) -> tuple[list, list]:
        updates = jax.tree.unflatten(self.u_def, u)
        params = None if p is None else jax.tree.unflatten(self.u_def, p)
        new_u, new_s = optimizer.update(updates, jax.tree.unflatten(self.s_def, s), params)
        return jax.tree.leaves(new_u), jax.tree.leaves(new_s, is_leaf=is_entry)

    def only(self, keep: Any, u: list, p: list | None, s: list) -> tuple:
        """The arguments with every parameter not in `keep` (and its state) emptied."""
        u = [x if i in keep else _empty(x) for i, x in enumerate(u)]
        p = None if p is None else [x if i in keep else _empty(x) for i, x in enumerate(p)]
        s = [x if w is None or w in keep else _empty(x) for x, w in zip(s, self.who, strict=True)]
        return u, p, s


def _arrays(fn: Any, u: list, p: list | None, s: list) -> tuple[Any, list]:
    """`fn` of the array leaves only (the rest, MaskedNodes, fixed), and those arrays."""
    flat, treedef = jax.tree.flatten((u, p, s), is_leaf=is_entry)
    at = [i for i, x in enumerate(flat) if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)]

    def of_arrays(*arrays):
        full = list(flat)
        for i, a in zip(at, arrays, strict=True):
            full[i] = a
        return fn(*jax.tree.unflatten(treedef, full))

    return of_arrays, [flat[i] for i in at]


def _abstract(x: Any) -> Any:
    if _is_q(x):
        return jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x


def _piecewise(optimizer: Any, plan: _Plan, large: set) -> bool:
    """Whether `optimizer`'s update may run one parameter (and chunk of it) at a time:
    every output element depends on its own element only (`elementwise_labels`), and the
    update runs the same primitives with other parameters emptied (no choice made on
    their shapes, such as a weight-decay mask by rank)."""
    u = [_abstract(x) for x in plan.u]
    p = None if plan.p is None else [_abstract(x) for x in plan.p]
    s = [_abstract(x) for x in plan.s]
    fn, args = _arrays(lambda *a: plan.call(optimizer, *a), u, p, s)
    own = [i for i in range(len(u))] + ([] if p is None else list(range(len(p))))
    own += [w for w, x in zip(plan.who, s, strict=True) if isinstance(x, jax.ShapeDtypeStruct)]
    found = elementwise_labels(fn, args, own)
    if found is None:
        return False
    labels, full = found
    expect = list(range(len(u))) + [
        w for w, x in zip(plan.who, s, strict=True) if isinstance(x, jax.ShapeDtypeStruct)
    ]
    for got, want in zip(labels, expect, strict=False):
        if isinstance(got, int) and got != want:
            return False
    for keep in [set(range(len(u))) - large, *({i} for i in large)]:
        fn, args = _arrays(lambda *a: plan.call(optimizer, *a), *plan.only(keep, u, p, s))
        if signature(fn, args) != full:
            return False
    return True


def _rows(shape: tuple, block: int, chunk: int) -> int:
    """Rows (along the first axis) per chunk of a leaf: a whole number of blocks, about
    `chunk` elements (at least one row's worth of blocks), at most half the leaf."""
    row = math.prod(shape[1:])
    r0 = block // math.gcd(block, row)
    # At least two trips where the leaf has room: XLA inlines a loop of one trip, and then
    # interleaves the leaves' updates, holding all their float32 state at once.
    return r0 * max(1, min(chunk // (r0 * row), shape[0] // r0 // 2))


def _with(q: QuantizedArray, codes: Array, scale: Array) -> QuantizedArray:
    return QuantizedArray(codes, scale, q.shape, q.dtype, q.signed)


def _update_leaf(optimizer: Any, plan: _Plan, i: int, block: int, chunk: int) -> tuple:
    """Parameter `i`'s update and new state entries, a chunk of rows at a time (a loop over
    whole chunks, then the rest): the float32 state of one chunk exists at a time."""
    g = plan.u[i]
    d0, row = g.shape[0], math.prod(g.shape[1:])
    entries = [j for j, w in enumerate(plan.who) if w == i]
    qs = {j: plan.s[j] for j in entries if _is_q(plan.s[j])}

    def piece(start: Any, n: int, out: Any) -> Any:
        """Rows `start` to `start + n` (a whole number of blocks from `start`): read from
        and written to `out` (the update, and per entry its codes and scales or array)."""
        upd, states = out
        b0, nb = start * row // block, -(-n * row // block)
        u, s = list(plan.u), list(plan.s)
        # the gradient's rows from the buffer the update overwrites (same dtype), else `g`
        u[i] = jax.lax.dynamic_slice_in_dim(upd if in_place else g, start, n)
        p = None if plan.p is None else list(plan.p)
        if p is not None:
            p[i] = jax.lax.dynamic_slice_in_dim(p[i], start, n)
        for j in entries:
            if j in qs:
                codes, scale = states[j]
                x = _decode(
                    jax.lax.dynamic_slice_in_dim(codes, b0 * block, nb * block),
                    jax.lax.dynamic_slice_in_dim(scale, b0, nb),
                    qs[j].signed,
                )
                s[j] = x.reshape(-1)[: n * row].reshape((n, *g.shape[1:]))
            else:
                s[j] = jax.lax.dynamic_slice_in_dim(states[j], start, n)
        new_u, new_s = plan.call(optimizer, *plan.only({i}, u, p, s))
        upd = jax.lax.dynamic_update_slice_in_dim(upd, new_u[i].astype(upd.dtype), start, 0)
        states = dict(states)
        for j in entries:
            if j in qs:
                codes, scale = _blocks(new_s[j], block, qs[j].signed)
                states[j] = (
                    jax.lax.dynamic_update_slice_in_dim(states[j][0], codes, b0 * block, 0),
                    jax.lax.dynamic_update_slice_in_dim(states[j][1], scale, b0, 0),
                )
            else:
                states[j] = jax.lax.dynamic_update_slice_in_dim(states[j], new_s[j], start, 0)
        return upd, states

    abstract = [_abstract(x) for x in plan.s]
    fn, args = _arrays(
        lambda *a: plan.call(optimizer, *a)[0][i], *plan.only({i}, plan.u, plan.p, abstract)
    )
    out_dtype = jax.eval_shape(fn, *args).dtype
    states = {j: (qs[j].codes, qs[j].scale) if j in qs else plan.s[j] for j in entries}
    # The update takes the gradient's place, chunk by chunk: no second float32 array of
    # the parameter's size (XLA copies the gradient first only if something reads it after).
    in_place = out_dtype == g.dtype
    out = (g if in_place else jnp.zeros(g.shape, out_dtype), states)
    r = _rows(g.shape, block, chunk)
    m = d0 // r if r < d0 else 0
    if m:
        out = jax.lax.fori_loop(0, m, lambda k, o: piece(k * r, r, o), out)
    if m * r < d0:
        out = piece(m * r, d0 - m * r, out)
    upd, states = out
    new = {j: _with(qs[j], *states[j]) if j in qs else states[j] for j in entries}
    return upd, new


def quantized_state(
    optimizer: optax.GradientTransformation,
    bits: int = 8,
    block: int = 2048,
    *,
    chunk: int = 1 << 16,
) -> optax.GradientTransformation:
    """Wrap an optax optimizer so its large floating-point state is stored in 8 bits.

    Every floating leaf of the state laid out like the parameters (one number per element
    of a parameter: Adam's `mu` and `nu`, momentum's `trace`) with at least `block`
    elements is stored as one uint8 code per element and one float32 absmax per block of
    `block` elements (blocks along the flattened leaf, the last one padded): Dettmers et
    al.'s block-wise dynamic quantisation, with the signed dynamic tree code for signed
    statistics (`mu`, `trace`) and the unsigned one (its sign bit spent on the fraction)
    for leaves named `nu`, `nu_max` or `sum_of_squares` (optax's second moments). Smaller
    leaves (biases, norms) and scalars (counts, hyperparameters) stay as they are. Each
    update dequantises, runs `optimizer` in float32 and requantises (round to nearest).

    When `optimizer`'s update is element-wise per parameter (Adam, AdamW, SGD with
    momentum, Lion, RMSProp: read from its traced program), the update runs one large
    parameter at a time, `chunk` elements (whole blocks of rows) at a time, so the float32
    state of one chunk exists at once, never the whole state's. Otherwise (global-norm
    clipping, LAMB's trust ratios) it runs on the whole dequantised state, which holds a
    float32 copy of it at the update's peak: put clipping outside,
    `optax.chain(optax.clip_by_global_norm(1.0), quantized_state(optax.adam(lr)))`.

    Memory: Adam's state goes from 8 to 2 + 8/`block` bytes per parameter of its large
    leaves; the update's temporaries are a few float32 arrays of `chunk` elements. Time:
    per state element one table lookup and about 40 compares and selects per update, and
    a loop trip per chunk.

    Compose with 16-bit state as `half_state(quantized_state(opt))` (what `make_step`
    builds for the half_* precision policies): small leaves in 16 bits, codes and scales
    untouched. `quantized_state(half_state(opt))` is refused.

    Args:
        optimizer: any optax optimizer whose large state leaves are laid out like the
            parameters.
        bits: 8 (the only width built).
        block: elements per block, a positive int; 2048 as in the paper.
        chunk: elements updated at a time, a positive int (rounded to whole blocks of
            rows): smaller holds less float32 state at once, at more loop trips.

    Returns:
        An optax `GradientTransformation` whose state is a `QuantizedState`.

    Raises:
        ValueError: for `bits` other than 8, a `block` or `chunk` that is not a positive
            int, an inner state that is `half_state`'s, or (at `init`) a floating state
            leaf of at least `block` elements that is not laid out like the parameters
            (named by its path).

    Example:
        >>> import optax, jax.numpy as jnp
        >>> opt = quantized_state(optax.adam(1e-3), block=4)
        >>> state = opt.init({"w": jnp.zeros(8)})
        >>> state.inner[0].mu["w"].codes.dtype
        dtype('uint8')

    References:
        Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022
        (arXiv:2110.02861), Sections 2.1-2.2.
    """
    if isinstance(bits, bool) or bits != 8:
        raise ValueError(f"quantized_state(bits={bits!r}); expected 8.")
    for name, value in (("block", block), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"quantized_state({name}={value!r}); expected a positive int such as "
                f"{2048 if name == 'block' else 1 << 16}."
            )

    def init(params):
        inner = optimizer.init(params)
        if isinstance(inner, HalfState):
            raise ValueError(
                "quantized_state(half_state(opt)) stores the 8-bit state of a 16-bit state; "
                "write half_state(quantized_state(opt)) instead (small leaves in 16 bits)."
            )
        leaves, treedef, who = _checked(inner, params, block)
        out = []
        for (path, x), w in zip(leaves, who, strict=True):
            big = w is not None and eqx.is_inexact_array(x) and x.ndim >= 1 and x.size >= block
            out.append(quantize(x, block, signed=_name(path) not in _NON_NEGATIVE) if big else x)
        return QuantizedState(jax.tree.unflatten(treedef, out))

    def update(updates, state, params=None):
        u, u_def = jax.tree.flatten(updates)
        p = None if params is None else u_def.flatten_up_to(params)
        leaves, s_def, who = owners(state.inner, updates)
        plan = _Plan(u, p, [x for _, x in leaves], who, u_def, s_def)
        large = {w for w, x in zip(who, plan.s, strict=True) if _is_q(x)}
        if not large or not _piecewise(optimizer, plan, large):
            dense = [x.dense() if _is_q(x) else x for x in plan.s]
            new_u, new_s = plan.call(optimizer, u, p, dense)
            new_s = [x.like(y) if _is_q(x) else y for x, y in zip(plan.s, new_s, strict=True)]
            return jax.tree.unflatten(u_def, new_u), QuantizedState(s_def.unflatten(new_s))
        small = set(range(len(u))) - large
        new_u, new_s = plan.call(optimizer, *plan.only(small, u, p, plan.s))
        for i in sorted(large):
            new_u[i], entries = _update_leaf(optimizer, plan, i, block, chunk)
            for j, x in entries.items():
                new_s[j] = x
        return jax.tree.unflatten(u_def, new_u), QuantizedState(s_def.unflatten(new_s))

    return optax.GradientTransformation(init, update)
