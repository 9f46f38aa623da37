"""Dynamic loss scaling with the semantics of PyTorch's `torch.amp.GradScaler`."""

import math
import numbers

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree

_FLOAT32_MAX = float(np.finfo(np.float32).max)


class DynamicLossScale(eqx.Module):
    """A loss scale that grows while gradients stay finite and shrinks when they overflow.

    The loss is multiplied by `scale` before differentiation, so small float16 gradients do
    not flush to zero, and the gradients are divided by it after. On each update
    (`adjust`): a non-finite gradient multiplies the scale by `backoff_factor`, resets the
    count of good steps, and the update is skipped; `growth_interval` finite updates in a
    row multiply it by `growth_factor` (unless that would overflow float32) and reset the
    count. As `GradScaler`: initial scale 2**16, growth 2.0 every 2000 finite updates,
    backoff 0.5, and no lower bound (the scale may fall below 1).

    It is a pytree of two scalars (`scale`, `good_steps`): it lives in the `TrainState` and
    is saved with checkpoints. Memory and time: negligible.

    Build it with `dynamic_loss_scale`.

    Example:
        >>> import jax.numpy as jnp
        >>> ls = dynamic_loss_scale(growth_interval=2)
        >>> ls = ls.adjust(jnp.asarray(True)).adjust(jnp.asarray(True))
        >>> float(ls.scale)
        131072.0
        >>> float(ls.adjust(jnp.asarray(False)).scale)
        65536.0

    References:
        Micikevicius et al., "Mixed Precision Training", ICLR 2018, Section 3.2.
        Sohoni et al., "Low-Memory Neural Network Training", 2019, Section 3.2.
        PyTorch, `torch.amp.GradScaler` and `_amp_update_scale_`.
    """

    scale: Float[Array, ""]
    good_steps: Int[Array, ""]
    growth_interval: int = eqx.field(static=True, default=2000)
    growth_factor: float = eqx.field(static=True, default=2.0)
    backoff_factor: float = eqx.field(static=True, default=0.5)

    def scale_loss(self, loss: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
        """`loss * scale`, in float32 (a scale of 2**16 is already infinite in float16)."""
        return jnp.asarray(loss).astype(jnp.float32) * self.scale

    def unscale(self, grads: PyTree) -> PyTree:
        """Every floating leaf divided by `scale`, computed in float32, cast back to its dtype."""
        inv = 1.0 / self.scale

        def one(g):
            if not eqx.is_inexact_array(g):
                return g
            return (g.astype(jnp.float32) * inv).astype(g.dtype)

        return jax.tree.map(one, grads)

    def adjust(self, finite: Bool[ArrayLike, ""]):
        """The scale after an update whose gradients were (`True`) or were not all finite.

        `GradScaler`'s rule: not finite -> scale * backoff, good steps 0. Finite -> good
        steps + 1; when that reaches `growth_interval`, scale * growth (kept if still finite
        in float32) and good steps 0.

        Rounding, as `GradScaler` (`_amp_update_scale_`): the float32 scale times the
        factor as a Python float (a double), computed in double and stored as a float32.
        A factor float32 cannot represent (0.3) is not rounded to float32 first: the
        product is computed exactly in integers and rounded as the double product and its
        conversion round it, so the scales are `GradScaler`'s bit for bit. One exception:
        a result below float32's normal range (< 1.2e-38) may differ in its last bit.
        """
        finite = jnp.asarray(finite, jnp.bool_)
        good = self.good_steps + 1
        grow = finite & (good >= self.growth_interval)
        grown = _times(self.scale, self.growth_factor)
        grown = jnp.where(jnp.isfinite(grown), grown, self.scale)
        shrunk = _times(self.scale, self.backoff_factor)
        scale = jnp.where(finite, jnp.where(grow, grown, self.scale), shrunk)
        good_steps = jnp.where(finite & ~grow, good, jnp.zeros_like(good))
        return eqx.tree_at(lambda s: (s.scale, s.good_steps), self, (scale, good_steps))


# Exact `float32(float64(scale) * factor)` without float64 (JAX computes in float32 unless
# x64 is on): the significands multiplied as integers in 16-bit digits, rounded to
# float64's 53 bits and then to float32's 24, each to nearest even, as the C++ of
# GradScaler's `_amp_update_scale_` does when it multiplies a float by a double and stores
# the result in a float.
_DIGIT = 16
_MASK = (1 << _DIGIT) - 1


def _bit(digits: list[Array], i: int) -> Array:
    return (digits[i // _DIGIT] >> (i % _DIGIT)) & 1


def _any_below(digits: list[Array], i: int) -> Array:
    """Whether any bit below position `i` is set."""
    low = digits[i // _DIGIT] & ((1 << (i % _DIGIT)) - 1)
    for d in digits[: i // _DIGIT]:
        low = low | d
    return low != 0


def _round_at(digits: list[Array], pos: int) -> list[Array]:
    """The number rounded to a multiple of `2**pos`, ties to even."""
    up = (_bit(digits, pos - 1) == 1) & (_any_below(digits, pos - 1) | (_bit(digits, pos) == 1))
    out = []
    carry = jnp.where(up, jnp.uint32(1 << (pos % _DIGIT)), jnp.uint32(0))
    for k, d in enumerate(digits):
        if k < pos // _DIGIT:
            out.append(jnp.zeros_like(d))
            continue
        if k == pos // _DIGIT:
            d = d & jnp.uint32(_MASK ^ ((1 << (pos % _DIGIT)) - 1))
        total = d + carry
        out.append(total & _MASK)
        carry = total >> _DIGIT
    return out


def _times(scale: Array, factor: float) -> Array:
    """`float32(float64(scale) * factor)`, bit for bit, for a positive normal float32
    `scale` and a Python float `factor` (a subnormal result may differ by its rounding)."""
    mantissa, exponent = math.frexp(factor)
    f = int(mantissa * 2**53)  # factor = f * 2**(exponent - 53), f < 2**53
    if f & (f - 1) == 0:  # a power of two: exact in float32
        return scale * jnp.float32(factor)
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    biased = (bits >> 23) & 0xFF
    m = (bits & 0x7FFFFF) | 0x800000  # scale = m * 2**(biased - 150)
    m_digits = [m & _MASK, m >> _DIGIT]
    f_digits = [(f >> (_DIGIT * k)) & _MASK for k in range(4)]
    # Schoolbook multiplication: each 16 x 16-bit partial product split in two digits.
    columns = [jnp.zeros_like(m) for _ in range(7)]
    for i, a in enumerate(m_digits):
        for j, b in enumerate(f_digits):
            p = a * jnp.uint32(b)
            columns[i + j] = columns[i + j] + (p & _MASK)
            columns[i + j + 1] = columns[i + j + 1] + (p >> _DIGIT)
    digits, carry = [], jnp.zeros_like(m)
    for c in columns:
        total = c + carry
        digits.append(total & _MASK)
        carry = total >> _DIGIT
    # The product has 76 or 77 bits: its top bit is 76 or 75.
    top = jnp.where(_bit(digits, 76) == 1, 76, 75)

    def rounded(top_bit: int) -> tuple[Array, Array]:
        r = _round_at(_round_at(digits, top_bit - 52), top_bit - 23)  # to 53, then 24 bits
        shift = top_bit - 23
        value = jnp.zeros_like(m)
        for k, d in enumerate(r):  # the kept 24 or 25 bits, shifted down to bit 0
            offset = _DIGIT * k - shift
            if offset > -_DIGIT and offset < 32:
                value = value | (d << offset if offset >= 0 else d >> -offset)
        return value, jnp.asarray(shift, jnp.int32)

    v76, s76 = rounded(76)
    v75, s75 = rounded(75)
    value = jnp.where(top == 76, v76, v75)  # 24 bits, or 25 when rounding carried
    shift = jnp.where(top == 76, s76, s75)
    exp2 = shift + biased.astype(jnp.int32) - 150 + (exponent - 53)
    result = jnp.ldexp(value.astype(jnp.float32), exp2)  # exact, or inf on overflow
    # Zero and subnormal scales (no implicit leading bit) in float32, as documented.
    return jnp.where(biased > 0, result, scale * jnp.float32(factor))


def dynamic_loss_scale(
    initial: float = 2.0**16,
    *,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
) -> DynamicLossScale:
    """A fresh `DynamicLossScale` (defaults: PyTorch's `GradScaler`).

    Args:
        initial: the first scale (`GradScaler`'s `init_scale`).
        growth_interval: finite updates in a row after which the scale grows.
        growth_factor: what the scale is multiplied by when it grows; > 1.
        backoff_factor: what it is multiplied by after a non-finite gradient; in (0, 1).

    Returns:
        A `DynamicLossScale` with `good_steps` 0; pass it to `make_step(loss_scale=...)`.

    Raises:
        TypeError: for a scale or factor that is not a number (e.g. `"big"`).
        ValueError: for a non-positive or non-finite initial scale, an interval that is
            not an int >= 1, a growth factor <= 1 or a backoff factor outside (0, 1).
    """
    for name, value in (
        ("initial", initial),
        ("growth_factor", growth_factor),
        ("backoff_factor", backoff_factor),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"dynamic_loss_scale({name}={value!r}): expected a number, got a "
                f"{type(value).__name__}."
            )
    if not (0 < initial <= _FLOAT32_MAX):
        raise ValueError(
            f"initial loss scale must be a finite float32 > 0, got {initial!r}; "
            "GradScaler's default is 2.0**16."
        )
    if (
        isinstance(growth_interval, bool)
        or not isinstance(growth_interval, int)
        or growth_interval < 1
    ):
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}.")
    if not growth_factor > 1:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}.")
    if not 0 < backoff_factor < 1:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}.")
    return DynamicLossScale(
        scale=jnp.asarray(float(initial), jnp.float32),
        good_steps=jnp.asarray(0, jnp.int32),
        growth_interval=growth_interval,
        growth_factor=float(growth_factor),
        backoff_factor=float(backoff_factor),
    )


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """True when every floating-point leaf of `tree` is finite (one fused reduction)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack(leaves).all()
