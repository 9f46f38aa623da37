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
        param_dtype: how parameters (and, with `half_state`, the optimizer state) are
            stored. Memory: bytes per parameter.
        compute_dtype: what the forward and backward passes compute in: parameters and
            floating inputs are cast to it inside the step. Memory: the saved activations
            shrink with it on an accelerator (XLA:CPU computes 16-bit types in float32
            inside, so its temporaries do not).
        output_dtype: the dtype losses are reduced in, and gradients accumulated in.

    Layer norms and the softmax of `eqx_lowmem.nn` compute in float32 whatever the policy;
    the accumulated gradient is float32.
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            dtype = jnp.dtype(getattr(self, field))
            if dtype not in (jnp.dtype(d) for d in _DTYPES.values()):
                raise ValueError(
                    f"Policy({field}={dtype}) is not supported; expected one of {sorted(_DTYPES)}."
                )
            object.__setattr__(self, field, dtype)

    @property
    def is_half(self) -> bool:
        """Parameters stored in 16 bits (updates then need stochastic rounding)."""
        return self.param_dtype.itemsize == 2

    @property
    def needs_loss_scale(self) -> bool:
        """float16 anywhere: gradients underflow without a loss scale."""
        return jnp.dtype(jnp.float16) in (self.param_dtype, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return cast_floating(tree, self.output_dtype)


# Presets. Bytes per parameter (parameter + gradient + Adam's two moments): float32 16,
# mixed 16 (float32 master copy), half 8.
PRESETS: dict[str, Policy] = {
    "float32": Policy(jnp.float32, jnp.float32, jnp.float32),
    "mixed_bf16": Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "mixed_fp16": Policy(jnp.float32, jnp.float16, jnp.float32),
    "half_bf16": Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32),
    "half_fp16": Policy(jnp.float16, jnp.float16, jnp.float32),
}


def get_policy(policy: "str | Policy | None") -> Policy:
    """A `Policy` from a preset name (`eqx_lowmem.precision.PRESETS`), a `Policy`, or None.

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
