"""A plain multi-layer perceptron: the guide's `mlp([2, 4, 1], key)`."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray


class MLP(eqx.Module):
    """Dense layers with an activation between them (none after the last)."""

    layers: tuple[eqx.nn.Linear, ...]
    activation: Callable[[Array], Array] = eqx.field(static=True)

    @jax.named_scope("eqx_lowmem.nn.MLP")
    def __call__(
        self, x: Float[Array, " in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out_features"]:
        expected = self.layers[0].in_features
        if x.shape != (expected,):
            raise ValueError(
                f"MLP expects one example of shape ({expected},), got {x.shape}; "
                "call it on a single example and jax.vmap over the batch."
            )
        del key
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)


def mlp(
    sizes: Sequence[int],
    *,
    key: PRNGKeyArray,
    activation: Callable[[Array], Array] = jax.nn.relu,
) -> MLP:
    """Build an MLP with layer widths `sizes`, e.g. `mlp([2, 4, 1], key=key)`.

    Args:
        sizes: input width, hidden widths, output width; at least two positive ints.
        key: PRNG key for the initial weights.
        activation: applied after every layer but the last.

    Returns:
        An `MLP` whose `__call__` maps one example of shape `(sizes[0],)` to `(sizes[-1],)`.

    Raises:
        ValueError: if `sizes` has fewer than two entries or a width below 1.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr
        >>> net = mlp([2, 4, 1], key=jr.PRNGKey(0))
        >>> net(jnp.ones(2)).shape
        (1,)
    """
    sizes = list(sizes)
    if len(sizes) < 2 or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(
            f"sizes must be at least two positive ints (input, ..., output), got {sizes!r}; "
            "for example mlp([2, 4, 1], key=key)."
        )
    keys = jr.split(key, len(sizes) - 1)
    layers = tuple(
        eqx.nn.Linear(n_in, n_out, key=k)
        for n_in, n_out, k in zip(sizes[:-1], sizes[1:], keys, strict=True)
    )
    return MLP(layers=layers, activation=activation)
