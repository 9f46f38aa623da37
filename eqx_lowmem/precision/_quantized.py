"""Optimizer state in 8 bits: block-wise dynamic quantisation for any optax optimizer."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array

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


class QuantizedArray(eqx.Module):
    """One optimizer-state leaf stored as 8-bit codes and one float32 absmax per block.

    `codes` `(blocks, block)` uint8 index the sorted dynamic code; `scale` `(blocks,)`.
    """

    codes: Array
    scale: Array
    shape: tuple[int, ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    signed: bool = eqx.field(static=True)

    def dense(self) -> Array:
        """The leaf in float32 (its original dtype's values, dequantised)."""
        table = jnp.asarray(dynamic_code(self.signed))
        n = int(np.prod(self.shape, dtype=np.int64))
        x = table[self.codes.astype(jnp.int32)] * self.scale[:, None]
        return x.reshape(-1)[:n].reshape(self.shape)

    def like(self, x: Array) -> "QuantizedArray":
        """`x`, shaped like this leaf, quantised with this leaf's code and block."""
        return quantize(x, self.codes.shape[1], signed=self.signed, dtype=self.dtype)


def _nearest_code(r: Array, signed: bool) -> Array:
    """The index of the code value nearest to each `r` in [-1, 1], element-wise (so XLA
    fuses it with the update): the closed-form index inside `r`'s decade, then the best of
    it and its two neighbours (the nearest value may lie in the next decade)."""
    table = jnp.asarray(dynamic_code(signed))
    m = jnp.abs(r)
    i = jnp.clip(jnp.floor(jnp.log10(jnp.maximum(m, 1e-30))) + 7, 0, 6).astype(jnp.int32)
    n = jnp.left_shift(1, i + (0 if signed else 1))  # values in decade i
    f = m / jnp.power(10.0, (i - 6).astype(jnp.float32))
    k = jnp.clip(jnp.floor((f - 0.1) / 0.9 * n.astype(jnp.float32)).astype(jnp.int32), 0, n - 1)
    if signed:  # zero at 127, positives from 128 on, negatives mirrored below zero
        p = 128 + (n - 1) + k
        idx = jnp.where(r < 0, 254 - p, p)
    else:
        idx = (2 * n - 1) - n + k  # decade i starts at 2**(i+1) - 1
    best, err = idx, jnp.abs(table[idx] - r)
    for step in (-1, 1):
        c = jnp.clip(idx + step, 0, 255)
        e = jnp.abs(table[c] - r)
        best, err = jnp.where(e < err, c, best), jnp.minimum(e, err)
    return best


def quantize(x: Array, block: int, *, signed: bool, dtype: Any = None) -> QuantizedArray:
    """`x` in blocks of `block` elements along its flattened form (the last block padded
    with zeros), each scaled by its absmax and rounded to the nearest code value."""
    n = x.size
    flat = jnp.ravel(x).astype(jnp.float32)
    flat = jnp.pad(flat, (0, -n % block)).reshape(-1, block)
    scale = jnp.max(jnp.abs(flat), axis=1)
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = _nearest_code(flat / safe[:, None], signed)
    return QuantizedArray(codes.astype(jnp.uint8), scale, tuple(x.shape), dtype or x.dtype, signed)


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


def quantized_state(
    optimizer: optax.GradientTransformation, bits: int = 8, block: int = 2048
) -> optax.GradientTransformation:
    """Wrap an optax optimizer so its large floating-point state is stored in 8 bits.

    Every floating leaf of the state with at least `block` elements is stored as one uint8
    code per element and one float32 absmax per block of `block` elements (blocks along the
    flattened leaf, the last one padded): Dettmers et al.'s block-wise dynamic
    quantisation, with the signed dynamic tree code for signed statistics (`mu`, `trace`)
    and the unsigned one (its sign bit spent on the fraction) for leaves named `nu`,
    `nu_max` or `sum_of_squares` (optax's second moments). Smaller leaves (biases, norms)
    and scalars (counts, hyperparameters) stay as they are. Each update dequantises, runs
    `optimizer` in float32 and requantises (round to nearest), element-wise, so XLA fuses
    it per leaf.

    Memory: Adam's state goes from 8 to 2 + 8/`block` bytes per parameter of its large
    leaves. Time: per state element one table lookup and a binary search over 255 code
    midpoints per update.

    Compose with 16-bit state as `half_state(quantized_state(opt))` (what `make_step`
    builds for the half_* precision policies): small leaves in 16 bits, codes and scales
    untouched. `quantized_state(half_state(opt))` is refused.

    Args:
        optimizer: any optax optimizer.
        bits: 8 (the only width built).
        block: elements per block, a positive int; 2048 as in the paper.

    Returns:
        An optax `GradientTransformation` whose state is a `QuantizedState`.

    Raises:
        ValueError: for `bits` other than 8, a `block` that is not a positive int, or an
            inner state that is `half_state`'s.

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
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"quantized_state(block={block!r}); expected a positive int such as 2048.")

    def store(plain: Any, like: Any) -> Any:
        """`plain` with the leaves that are QuantizedArrays in `like` quantised again."""
        forms = jax.tree.leaves(like, is_leaf=_is_q)
        leaves, treedef = jax.tree.flatten(plain)
        out = [f.like(x) if _is_q(f) else x for f, x in zip(forms, leaves, strict=True)]
        return jax.tree.unflatten(treedef, out)

    def quantize_leaf(path: tuple, x: Any) -> Any:
        if not (eqx.is_inexact_array(x) and x.ndim >= 1 and x.size >= block):
            return x
        return quantize(x, block, signed=_name(path) not in _NON_NEGATIVE)

    def init(params):
        inner = optimizer.init(params)
        if isinstance(inner, HalfState):
            raise ValueError(
                "quantized_state(half_state(opt)) stores the 8-bit state of a 16-bit state; "
                "write half_state(quantized_state(opt)) instead (small leaves in 16 bits)."
            )
        return QuantizedState(jax.tree_util.tree_map_with_path(quantize_leaf, inner))

    def update(updates, state, params=None):
        plain = jax.tree.map(lambda x: x.dense() if _is_q(x) else x, state.inner, is_leaf=_is_q)
        updates, plain = optimizer.update(updates, plain, params)
        return updates, QuantizedState(store(plain, state.inner))

    return optax.GradientTransformation(init, update)
