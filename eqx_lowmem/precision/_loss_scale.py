"""Dynamic loss scaling with the semantics of PyTorch's `torch.amp.GradScaler`."""

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

    def adjust(self, finite: Bool[ArrayLike, ""]) -> "DynamicLossScale":
        """The scale after an update whose gradients were (`True`) or were not all finite.

        `GradScaler`'s rule: not finite -> scale * backoff, good steps 0. Finite -> good
        steps + 1; when that reaches `growth_interval`, scale * growth (kept if still finite
        in float32) and good steps 0.
        """
        finite = jnp.asarray(finite, jnp.bool_)
        good = self.good_steps + 1
        grow = finite & (good >= self.growth_interval)
        grown = self.scale * self.growth_factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.scale)
        scale = jnp.where(
            finite, jnp.where(grow, grown, self.scale), self.scale * self.backoff_factor
        )
        good_steps = jnp.where(finite & ~grow, good, jnp.zeros_like(good))
        return eqx.tree_at(lambda s: (s.scale, s.good_steps), self, (scale, good_steps))


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
        ValueError: for a non-positive or non-finite initial scale, an interval < 1, a
            growth factor <= 1 or a backoff factor outside (0, 1).
    """
    if not (0 < initial <= _FLOAT32_MAX):
        raise ValueError(
            f"initial loss scale must be a finite float32 > 0, got {initial!r}; "
            "GradScaler's default is 2.0**16."
        )
    if not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}.")
    if not growth_factor > 1:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}.")
    if not 0 < backoff_factor < 1:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}.")
    return DynamicLossScale(
        scale=jnp.asarray(initial, jnp.float32),
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
