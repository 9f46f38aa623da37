"""Dynamic loss scaling with the semantics of PyTorch's `torch.amp.GradScaler`."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree


class DynamicLossScale(eqx.Module):
    """A loss scale that grows while gradients stay finite and shrinks when they overflow.

    The loss is multiplied by `scale` before differentiation, so small float16 gradients do
    not flush to zero, and the gradients are divided by it after. On each update
    (`adjust`): a non-finite gradient multiplies the scale by `backoff_factor` and the
    update is skipped; `growth_interval` finite updates in a row multiply it by
    `growth_factor`. As `GradScaler`: initial scale 2**16, growth 2.0 every 2000 finite
    updates, backoff 0.5, and no lower bound (the scale may fall below 1).

    It is a pytree: it lives in the `TrainState` and is saved with checkpoints.

    References:
        Micikevicius et al., "Mixed Precision Training", ICLR 2018, Section 3.2.
        Sohoni et al., "Low-Memory Neural Network Training", 2019, Section 3.2.
    """

    scale: Float[Array, ""]
    good_steps: Int[Array, ""]
    growth_interval: int = eqx.field(static=True, default=2000)
    growth_factor: float = eqx.field(static=True, default=2.0)
    backoff_factor: float = eqx.field(static=True, default=0.5)

    def scale_loss(self, loss: Array) -> Array:
        return loss * self.scale.astype(loss.dtype)

    def unscale(self, grads: PyTree) -> PyTree:
        inv = 1.0 / self.scale
        return jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)

    def adjust(self, finite: Bool[Array, ""]) -> "DynamicLossScale":
        """The scale after an update whose gradients were (or were not) all finite."""
        grown = self.good_steps + 1 >= self.growth_interval
        scale = jnp.where(
            finite,
            jnp.where(grown, self.scale * self.growth_factor, self.scale),
            self.scale * self.backoff_factor,
        )
        good = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return eqx.tree_at(lambda s: (s.scale, s.good_steps), self, (scale, good))


def dynamic_loss_scale(
    initial: float = 2.0**16,
    *,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
) -> DynamicLossScale:
    """A fresh `DynamicLossScale` (defaults: PyTorch's `GradScaler`).

    Raises:
        ValueError: for a non-positive initial scale or interval, a growth factor <= 1 or a
            backoff factor outside (0, 1).
    """
    if not initial > 0:
        raise ValueError(f"initial loss scale must be > 0, got {initial!r}.")
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be >= 1, got {growth_interval!r}.")
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
