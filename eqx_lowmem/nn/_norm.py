"""LayerNorm that always normalises in float32, with a backward pass that keeps only its input."""

import functools
import math
from typing import TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._jvp import linear_tangent, rule_input


def _stats(x32: Array, eps: float) -> tuple[Array, Array]:
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return mean, jax.lax.rsqrt(var + eps)


def _last_axis(v: Array, ndim: int) -> Array:
    """A vector shaped to broadcast along the last axis of an `ndim`-dimensional array."""
    return v.astype(jnp.float32).reshape((1,) * (ndim - 1) + (-1,))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    mean, rstd = _stats(x32, eps)
    y = (x32 - mean) * rstd * _last_axis(weight, x.ndim) + _last_axis(bias, x.ndim)
    return y.astype(x.dtype)


def _layer_norm_tangent(eps: float, res: tuple[Array, Array], tangents: list) -> Array:
    # Reverse mode keeps x (which the caller keeps anyway) and recomputes the normalised
    # input from it, rather than keeping three activation-sized buffers (_jvp).
    x, weight = res
    dx, dweight, dbias = tangents
    x32 = x.astype(jnp.float32)
    mean, rstd = _stats(x32, eps)
    xhat = (x32 - mean) * rstd
    t = jnp.zeros_like(x32)
    if dx is not None:
        # rstd first: reverse mode transposes the ops in reverse order, so it applies rstd
        # last, as the custom_vjp's backward pass did (XLA then packs the same temporaries).
        e = dx.astype(jnp.float32) * rstd
        dxhat = (
            e
            - jnp.mean(e, axis=-1, keepdims=True)
            - xhat * jnp.mean(e * xhat, axis=-1, keepdims=True)
        )
        t = t + dxhat * _last_axis(weight, x.ndim)
    if dweight is not None:
        t = t + xhat * _last_axis(dweight, x.ndim)
    if dbias is not None:
        t = t + _last_axis(dbias, x.ndim)
    return t.astype(x.dtype)


@functools.partial(_layer_norm.defjvp, symbolic_zeros=True)
def _layer_norm_jvp(eps, primals, tangents):
    x, weight, bias = primals
    y = _layer_norm(x, weight, bias, eps)
    rule = functools.partial(_layer_norm_tangent, eps)
    return y, linear_tangent(rule, (rule_input(x), weight), tangents, y)


class LayerNorm(eqx.Module):
    """Layer normalisation over the last axis, computed in float32 whatever the input dtype.

    The mean and variance of 16-bit activations lose too much precision, so the input is
    upcast, normalised and cast back: the output has the input's dtype. The backward pass
    keeps only the input and recomputes the normalised values, rather than keeping them.
    """

    weight: Array
    bias: Array
    eps: float = eqx.field(static=True)

    def __init__(self, size: int, *, eps: float = 1e-5, dtype=jnp.float32):
        self.weight = jnp.ones((size,), dtype)
        self.bias = jnp.zeros((size,), dtype)
        self.eps = eps

    @jax.named_scope("eqx_lowmem.nn.LayerNorm")
    def __call__(self, x: Float[Array, "*shape size"]) -> Float[Array, "*shape size"]:
        return _layer_norm(x, self.weight, self.bias, self.eps)


BatchStats: TypeAlias = tuple[Array, Array]  # (running mean, running variance), float32 (C,)


def _channels(v: Array, ndim: int) -> Array:
    """A per-channel vector shaped to broadcast along axis 0 of an `ndim`-dimensional array."""
    return v.astype(jnp.float32).reshape((-1,) + (1,) * (ndim - 1))


# BatchNorm's autodiff would keep the centred input, the normalised input, the ReLU mask
# and the output: four activation-sized buffers per layer. The two custom rules (_jvp)
# below keep only the input (which the layer before keeps anyway) and recompute the rest,
# the ReLU's mask included, element-wise. Neither backward pass needs a collective: the
# batch reductions stay in plain, differentiated code.


@jax.custom_jvp
def _moments(x: Array, shift: Array) -> tuple[Array, Array]:
    """Per-channel mean of `x - shift` and of its square over one example's spatial axes."""
    d = x.astype(jnp.float32) - _channels(shift, x.ndim)
    axes = tuple(range(1, x.ndim))
    return jnp.mean(d, axis=axes), jnp.mean(jnp.square(d), axis=axes)


def _moments_tangent(res: tuple[Array, Array], tangents: list) -> tuple[Array, Array]:
    # Transposed by reverse mode into (d1 + 2 (x - shift) d2) / n, the former backward pass.
    x, shift = res
    dx, dshift = tangents
    axes = tuple(range(1, x.ndim))
    d = x.astype(jnp.float32) - _channels(shift, x.ndim)
    dd = jnp.zeros_like(d) if dx is None else dx.astype(jnp.float32)
    if dshift is not None:
        dd = dd - _channels(dshift, x.ndim)
    u = dd / math.prod(x.shape[1:])
    return jnp.sum(u, axis=axes), jnp.sum(2.0 * d * u, axis=axes)


@functools.partial(_moments.defjvp, symbolic_zeros=True)
def _moments_jvp(primals, tangents):
    out = _moments(*primals)
    return out, linear_tangent(_moments_tangent, primals, tangents, out)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _normalise(x: Array, mean: Array, rstd: Array, weight: Array, bias: Array, relu: bool):
    """`act((x - mean) * rstd * weight + bias)` in float32, in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    k = x.ndim
    y = (x32 - _channels(mean, k)) * _channels(rstd * weight, k) + _channels(bias, k)
    return (jax.nn.relu(y) if relu else y).astype(x.dtype)


def _normalise_tangent(relu: bool, res: tuple, tangents: list) -> Array:
    # Written in the reverse order of the former backward pass, which reverse mode's
    # transpose then runs op for op: the ReLU's mask, the weight's and the bias's
    # gradients, then the input's, the mean's and the scale's.
    x, mean, rstd, weight, bias = res
    dx, dmean, drstd, dweight, dbias = tangents
    k = x.ndim
    xhat = (x.astype(jnp.float32) - _channels(mean, k)) * _channels(rstd, k)
    t = jnp.zeros_like(xhat)
    if dx is not None:
        t = t + dx.astype(jnp.float32)
    if dmean is not None:
        t = t - _channels(dmean, k)
    t = t * _channels(rstd, k)
    if drstd is not None:
        t = t + xhat * _channels(drstd / rstd, k)
    t = t * _channels(weight, k)
    if dbias is not None:
        t = t + _channels(dbias, k)
    if dweight is not None:
        t = t + xhat * _channels(dweight, k)
    if relu:  # the ReLU's mask, recomputed from the input rather than kept
        t = jnp.where(xhat * _channels(weight, k) + _channels(bias, k) > 0, t, 0.0)
    return t.astype(x.dtype)


@functools.partial(_normalise.defjvp, symbolic_zeros=True)
def _normalise_jvp(relu, primals, tangents):
    y = _normalise(*primals, relu)
    rule = functools.partial(_normalise_tangent, relu)
    return y, linear_tangent(rule, primals, tangents, y)


def _batch_size(axis_name: str) -> Array:
    try:
        return jax.lax.psum(jnp.ones((), jnp.float32), axis_name)
    except NameError as e:
        raise ValueError(
            f"BatchNorm computes batch statistics over the vmapped axis {axis_name!r}, which "
            "is not bound here. Call the model under "
            f"jax.vmap(model, axis_name={axis_name!r}, in_axes=(0, None), out_axes=(0, None))"
            "(x, state), or switch to the running statistics with "
            "eqx.nn.inference_mode(model)."
        ) from e


class BatchNorm(eqx.Module):
    """Batch normalisation of one example's channels (axis 0), in float32 whatever the dtype.

    Training mode normalises with the statistics of the batch being vmapped over
    (`jax.vmap(..., axis_name=axis_name)`), over the batch and every spatial position, and
    returns running statistics updated the way PyTorch's `BatchNorm2d` updates them
    (`running = (1 - momentum) * running + momentum * batch`, the unbiased variance).
    Inference mode (`inference=True`, set on a whole model with
    `eqx.nn.inference_mode(model)`) normalises with the running statistics and leaves
    them as they are. Statistics, the normalisation and the state are float32 even when
    the input and the parameters are 16-bit (the paper keeps BatchNorm in FP32); the output
    has the input's dtype.

    Memory: the backward pass keeps only the input and recomputes the normalised values
    (and with `relu=True` the ReLU's mask) element-wise, where plain autodiff would keep
    four activation-sized buffers.

    Unlike `eqx.nn.BatchNorm`, the statistics are passed and returned explicitly
    (`(mean, var)`, float32 `(channels,)`), so a stack of blocks can carry them as arrays.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> bn = BatchNorm(3)
        >>> x = jnp.arange(24.0).reshape(4, 3, 2)  # (batch, channels, width)
        >>> y, stats = jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        ...     x, bn.init_stats())
        >>> y.shape, stats[0].dtype
        ((4, 3, 2), dtype('float32'))
    """

    weight: Array
    bias: Array
    channels: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    momentum: float = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    inference: bool = False

    def __init__(
        self,
        channels: int,
        *,
        eps: float = 1e-5,
        momentum: float = 0.1,
        axis_name: str = "batch",
        inference: bool = False,
    ):
        """Args:
        channels: size of axis 0 of an example.
        eps: added to the variance.
        momentum: weight of the new batch statistics in the running ones (PyTorch's 0.1).
        axis_name: the `jax.vmap` axis name of the batch.
        inference: use the running statistics (see `eqx.nn.inference_mode`).
        """
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            raise ValueError(f"channels must be a positive int, got {channels!r}.")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}.")
        self.weight = jnp.ones((channels,), jnp.float32)
        self.bias = jnp.zeros((channels,), jnp.float32)
        self.channels = channels
        self.eps = eps
        self.momentum = momentum
        self.axis_name = axis_name
        self.inference = inference

    def init_stats(self) -> BatchStats:
        """Running statistics before training: mean 0, variance 1."""
        return jnp.zeros((self.channels,), jnp.float32), jnp.ones((self.channels,), jnp.float32)

    @jax.named_scope("eqx_lowmem.nn.BatchNorm")
    def __call__(
        self, x: Float[Array, "channels ..."], stats: BatchStats, *, relu: bool = False
    ) -> tuple[Float[Array, "channels ..."], BatchStats]:
        """Normalise one example (then apply a ReLU if `relu`).

        Returns:
            The output (the input's dtype) and the new running statistics.
        """
        if x.ndim < 1 or x.shape[0] != self.channels:
            raise ValueError(
                f"BatchNorm({self.channels}) expects one example with {self.channels} "
                f"channels on axis 0, got shape {x.shape}; jax.vmap over the batch."
            )
        running_mean, running_var = stats
        x = rule_input(x)  # one residual for _moments and _normalise (_jvp.rule_input)
        if self.inference:
            mean, var, new_stats = running_mean, running_var, stats
        else:
            n = _batch_size(self.axis_name) * math.prod(x.shape[1:])
            axes = tuple(range(1, x.ndim))
            # Shifted moments: E[(x - s)] and E[(x - s)^2] with s the batch mean (no
            # gradient), as accurate as a two-pass variance.
            shift = jax.lax.stop_gradient(
                jax.lax.pmean(jnp.mean(x.astype(jnp.float32), axis=axes), self.axis_name)
            )
            m1, m2 = jax.lax.pmean(_moments(x, shift), self.axis_name)
            mean = shift + m1
            var = jnp.maximum(m2 - jnp.square(m1), 0.0)
            m = self.momentum
            batch_mean, batch_var = jax.lax.stop_gradient((mean, var))
            unbiased = batch_var * (n / jnp.maximum(n - 1.0, 1.0))
            new_stats = (
                ((1.0 - m) * running_mean + m * batch_mean).astype(jnp.float32),
                ((1.0 - m) * running_var + m * unbiased).astype(jnp.float32),
            )
        rstd = jax.lax.rsqrt(var + self.eps)
        y = _normalise(
            x,
            mean,
            rstd,
            self.weight.astype(jnp.float32),
            self.bias.astype(jnp.float32),
            relu,
        )
        return y, new_stats


def _per_group(v: Array, groups: int) -> Array:
    """The mean of a per-channel vector over each group's channels, back per channel."""
    g = jnp.mean(v.reshape(groups, -1), axis=1, keepdims=True)
    return jnp.broadcast_to(g, (groups, v.shape[0] // groups)).reshape(-1)


class GroupNorm(eqx.Module):
    """Group normalisation (Wu and He, 2018) of one example's channels (axis 0), in float32
    whatever the dtype: the channels split into `groups` groups, each normalised by its own
    mean and variance over its channels and every spatial position, then a per-channel
    scale and shift.

    Unlike `BatchNorm`, nothing depends on the other examples: the same output for a
    micro-batch of one image as for a batch of 256, so accumulation over any number of
    micro-batches is exact, training and evaluation normalise alike, and there is no state.
    `__call__(x, stats, relu=...)` accepts and returns a state anyway (unchanged), so it
    stands in for `BatchNorm` in a stateful block (`WideResNet(norm="group")`); called
    without one it returns the output alone, for any `eqx_lowmem.nn.stack` block.

    Memory: as `BatchNorm`, the backward pass keeps only the input and recomputes the
    normalised values (and the ReLU's mask). Time: two reductions over the example.

    Example:
        >>> import jax.numpy as jnp
        >>> gn = GroupNorm(2, 4)
        >>> y = gn(jnp.arange(32.0).reshape(4, 8))  # (channels, width)
        >>> bool(jnp.allclose(y.reshape(2, -1).mean(axis=1), 0.0, atol=1e-5))  # per group
        True
    """

    weight: Array
    bias: Array
    groups: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, groups: int, channels: int, *, eps: float = 1e-5):
        """Args:
        groups: number of groups; must divide `channels` (Wu and He's default is 32;
            `groups=channels` is instance normalisation, `groups=1` layer normalisation
            over channels and positions).
        channels: size of axis 0 of an example.
        eps: added to the variance.

        Raises:
            ValueError: for `groups` or `channels` not a positive int, or `groups` that
                does not divide `channels`.
        """
        for name, value in (("groups", groups), ("channels", channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupNorm: {name} must be a positive int, got {value!r}.")
        if channels % groups:
            divisors = [d for d in range(1, channels + 1) if channels % d == 0]
            raise ValueError(
                f"GroupNorm: groups must divide channels={channels}, got groups={groups}; "
                f"use one of {divisors}."
            )
        self.weight = jnp.ones((channels,), jnp.float32)
        self.bias = jnp.zeros((channels,), jnp.float32)
        self.groups = groups
        self.channels = channels
        self.eps = eps

    def init_stats(self) -> tuple[()]:
        """No state: an empty tuple, to stand in for `BatchNorm.init_stats`."""
        return ()

    @jax.named_scope("eqx_lowmem.nn.GroupNorm")
    def __call__(self, x: Float[Array, "channels ..."], stats=None, *, relu: bool = False):
        """Normalise one example (then apply a ReLU if `relu`).

        Returns:
            The output (the input's dtype); with `stats` given, `(output, stats)`.
        """
        if x.ndim < 1 or x.shape[0] != self.channels:
            raise ValueError(
                f"GroupNorm({self.groups}, {self.channels}) expects one example with "
                f"{self.channels} channels on axis 0, got shape {x.shape}; jax.vmap over the "
                "batch."
            )
        x = rule_input(x)  # one residual for _moments and _normalise (_jvp.rule_input)
        axes = tuple(range(1, x.ndim))
        # Shifted per-channel moments averaged over each group (equal-sized channels): the
        # group's mean and variance, as accurate as a two-pass variance.
        shift = jax.lax.stop_gradient(
            _per_group(jnp.mean(x.astype(jnp.float32), axis=axes), self.groups)
        )
        m1, m2 = _moments(x, shift)
        m1, m2 = _per_group(m1, self.groups), _per_group(m2, self.groups)
        rstd = jax.lax.rsqrt(jnp.maximum(m2 - jnp.square(m1), 0.0) + self.eps)
        weight, bias = self.weight.astype(jnp.float32), self.bias.astype(jnp.float32)
        y = _normalise(x, shift + m1, rstd, weight, bias, relu)
        return y if stats is None else (y, stats)


def standardise_weight(w: Array, eps: float = 1e-5) -> Array:
    """Weight Standardization (Qiao et al., 2019): each output channel's weights (axis 0)
    less their mean, over their standard deviation, computed in float32 in `w`'s dtype."""
    w32 = w.astype(jnp.float32)
    axes = tuple(range(1, w.ndim))
    mean = jnp.mean(w32, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(w32 - mean), axis=axes, keepdims=True)
    return ((w32 - mean) * jax.lax.rsqrt(var + eps)).astype(w.dtype)
