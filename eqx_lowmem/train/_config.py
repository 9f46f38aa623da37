"""`StepConfig`: every option of a training step, built once and given to the Trainer,
`memory_report` and `plan` alike."""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy
from ._make_step import make_step
from ._state import TrainState
from ._step import Step
from ._update import UpdateInfo


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The options of a training step, as `make_step` takes them (each documented there,
    with its memory and time): one value to build the step of a `Trainer`
    (`Trainer(..., step_config=...)`), to report on its memory
    (`el.memory.memory_report(..., step_config=...)`) and to plan it
    (`el.memory.plan(..., step_config=...)`), so the three see the same step.

    Recomputation (remat), the attention and sparsity are the model's: build the model with
    them.

    Attributes:
        accumulate: micro-batches per update. Memory: one micro-batch's activations plus
            one gradient accumulator.
        precision: a preset name (`"mixed_bf16"`, ...) or a `Policy`.
        loss_scale: `"auto"` (a dynamic scale where float16 needs one), None, or a
            `DynamicLossScale`.
        has_state: the model has `eqx.nn.State` (BatchNorm).
        mesh: a `jax.sharding.Mesh` to split the batch (and with FSDP the state) over.
        data_axis: the mesh axis the batch is split over.
        shard: `"data"` (replicated state) or `"fsdp"` (state split over `data_axis`).
        after_update: `after_update(state, info) -> state` inside the step (sparse
            rewiring).
        jit: False runs the step eagerly (debugging; the memory tools compile it anyway).
        accumulate_dtype: the dtype of the micro-batch gradients and their accumulator.
        fuse_accumulation: fold recomputed stacks' gradients into the accumulator in
            their backward loop (one gradient-sized buffer less).
        skip_nonfinite: skip updates with a non-finite loss or gradient (None: only with
            a loss scale). Time: up to 30% of a small step's (48d82b8).

    Example:
        >>> import jax.numpy as jnp, jax.random as jr, optax
        >>> import eqx_lowmem as el
        >>> config = el.train.StepConfig(accumulate=4, accumulate_dtype=jnp.bfloat16)
        >>> step = config.build(el.train.mse, optax.sgd(0.1))
        >>> step.accumulate, step.accumulate_dtype.name
        (4, 'bfloat16')
        >>> config.replace(accumulate=2).accumulate
        2
    """

    accumulate: int = 1
    precision: str | Policy | None = None
    loss_scale: DynamicLossScale | Literal["auto"] | None = "auto"
    has_state: bool = False
    mesh: Mesh | None = None
    data_axis: str = "data"
    shard: str = "data"
    after_update: Callable[[TrainState, UpdateInfo], TrainState] | None = None
    jit: bool = True
    accumulate_dtype: Any = jnp.float32
    fuse_accumulation: bool = True
    skip_nonfinite: bool | None = None

    def options(self) -> dict[str, Any]:
        """The fields as `make_step`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def build(self, loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation) -> Step:
        """`make_step(loss_fn, optimizer, **options)`: the `Step` (its arguments checked)."""
        return make_step(loss_fn, optimizer, **self.options())

    def replace(self, **changes: Any) -> "StepConfig":
        """A copy with `changes` (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)


def step_config(given: StepConfig | None, **options: Any) -> StepConfig:
    """`given`, or a `StepConfig` of `options` (a caller's keyword arguments named as its
    fields). With `given`, every option must be left at its default: one place says what
    the step is.

    Raises:
        TypeError: for a `given` that is not a `StepConfig`.
        ValueError: for an option given both ways, naming it.
    """
    if given is None:
        return StepConfig(**options)
    if not isinstance(given, StepConfig):
        raise TypeError(
            f"step_config must be an eqx_lowmem.train.StepConfig, got {type(given).__name__}; "
            "e.g. step_config=el.train.StepConfig(accumulate=4)."
        )
    defaults = StepConfig()
    both = [name for name, value in options.items() if _differs(value, getattr(defaults, name))]
    if both:
        raise ValueError(
            f"{', '.join(f'{n}=' for n in both)} given beside step_config=; set "
            f"{'it' if len(both) == 1 else 'them'} in the StepConfig instead "
            f"(step_config.replace({both[0]}=...))."
        )
    return given


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # a value whose comparison is not a bool (an array)
        return True
