"""Dtype policies: which dtype parameters are stored, computed and returned in."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def _is_float(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast every floating-point array leaf of `tree` to `dtype`; leave everything else."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of training, as jmp's `Policy`.

    Attributes:
        param_dtype: how parameters are stored. Memory: 4 or 2 bytes per parameter. 16 bits
            (the "half" presets) also stores the optimizer state in 16 bits (see
            `opt_state_dtype`), and rounds each update stochastically (see `make_step`).
        compute_dtype: what the forward and backward passes compute in: parameters and
            floating inputs are cast to it inside the step. Memory: the activations the
            backward pass keeps halve with a 16-bit type (`eqx_lowmem.memory.saved_residuals`
            shows it); a float32 `param_dtype` then adds a 16-bit copy of the parameters
            (2 bytes per parameter) while the step runs. XLA:CPU computes 16-bit types in
            float32 inside, so its compiled temporaries do not shrink; a GPU's do.
        output_dtype: the dtype of losses, of their reduction over the batch and of the
            accumulated gradient. Only float32: 16-bit sums lose the small terms.

    Layer norms and the softmax of `eqx_lowmem.nn` compute in float32 whatever the policy;
    the losses of `eqx_lowmem.train` return float32.

    Example:
        >>> import jax.numpy as jnp
        >>> policy = Policy(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16)
        >>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
        dtype(bfloat16)
        >>> policy == PRESETS["mixed_bf16"]
        True
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            value = getattr(self, field)
            try:
                dtype = jnp.dtype(value)
            except TypeError:
                dtype = None
            if dtype is None or dtype not in [jnp.dtype(d) for d in _DTYPES.values()]:
                raise ValueError(
                    f"Policy({field}={value!r}) is not supported; expected one of "
                    f"{sorted(_DTYPES)}."
                )
            object.__setattr__(self, field, dtype)
        if self.output_dtype != jnp.dtype(jnp.float32):
            raise ValueError(
                f"Policy(output_dtype={self.output_dtype}): losses, their sum over the batch "
                "and the accumulated gradient are always float32 (16-bit sums lose the small "
                "terms); use output_dtype=jnp.float32."
            )

    @property
    def is_half(self) -> bool:
        """Parameters stored in 16 bits (updates then need stochastic rounding)."""
        return self.param_dtype.itemsize == 2

    @property
    def opt_state_dtype(self) -> Any:
        """The dtype of the optimizer state: bfloat16 when parameters are 16-bit, else None
        (the optimizer's own, float32).

        bfloat16 also for float16 parameters: it has float32's exponent range, and Adam's
        second moment (the square of the gradient, ~1e-8 for a gradient of 1e-4) flushes to
        zero in float16, which makes the update `m / (sqrt(v) + eps)` explode.
        """
        return jnp.dtype(jnp.bfloat16) if self.is_half else None

    @property
    def needs_loss_scale(self) -> bool:
        """float16 anywhere: gradients underflow without a loss scale."""
        return jnp.dtype(jnp.float16) in (self.param_dtype, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Floating leaves of `tree` cast to `param_dtype`."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating leaves of `tree` cast to `compute_dtype`."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Floating leaves of `tree` cast to `output_dtype`."""
        return cast_floating(tree, self.output_dtype)


# Presets. Bytes per parameter with Adam, stored (parameter + two moments) and while a
# step runs (+ the float32 accumulated gradient, + a 16-bit compute copy for "mixed"):
#   float32     12 stored, 16 in a step
#   mixed_*     12 stored, 18 in a step (float32 master parameters)
#   half_*       6 stored (2 + 2 + 2; moments in bfloat16), 10 in a step
PRESETS: dict[str, Policy] = {
    "float32": Policy(jnp.float32, jnp.float32, jnp.float32),
    "mixed_bf16": Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "mixed_fp16": Policy(jnp.float32, jnp.float16, jnp.float32),
    "half_bf16": Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32),
    "half_fp16": Policy(jnp.float16, jnp.float16, jnp.float32),
}


def get_policy(policy: str | Policy | None) -> Policy:
    """A `Policy` from a preset name (`"float32"`, `"mixed_bf16"`, `"mixed_fp16"`,
    `"half_bf16"`, `"half_fp16"`), a `Policy`, or None.

    Raises:
        ValueError: for an unknown preset name.
    """
    if policy is None:
        return PRESETS["float32"]
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in PRESETS:
        return PRESETS[policy]
    raise ValueError(
        f"precision={policy!r} is not a preset; expected one of {sorted(PRESETS)} or an "
        "eqx_lowmem.precision.Policy."
    )
