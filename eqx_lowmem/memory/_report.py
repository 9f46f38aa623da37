"""Where the memory of a training step goes, from compilation alone."""

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy
from ..train._config import StepConfig, step_config as resolve_step_config
from ._activations import fused_slots, group_residuals, micro_residuals
from ._compile import compile_step, memory_figures
from ._cost import jaxpr_cost
from ._inspect import (
    batch_structs,
    is_arrayish,
    is_float,
    model_attention,
    model_density,
    model_remat,
    precision_name,
    tree_bytes,
)
from ._measure import check_measurable, measure_peak
from ._result import MemoryReport
from ._target import Target, as_target
from ._units import format_bytes


def float32_twin(policy: Policy, target: Target | None = None) -> Policy | None:
    """On XLA:CPU, the policy of the same step computing in float32 (for the GPU estimate).

    None when the step computes in float32 already or is compiled for an accelerator.
    """
    backend = jax.default_backend() if target is None else target.backend
    if backend != "cpu" or policy.compute_dtype.itemsize != 2:
        return None
    return dataclasses.replace(policy, compute_dtype=jnp.float32)


def _devices(mesh: Mesh | None, data_axis: str) -> int:
    if mesh is None:
        return 1
    if data_axis not in mesh.axis_names:
        raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh {mesh.axis_names}.")
    return int(mesh.shape[data_axis])


def step_report(
    step: Any,
    loss_fn: Callable[..., Any],
    model: PyTree,
    batch: Any,
    *,
    has_state: bool = False,
    model_state: PyTree = None,
    key: PRNGKeyArray | None = None,
    measure: bool = False,
    name: str | None = None,
    twin: MemoryReport | None = None,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    shard: str = "data",
    target: Target | None = None,
) -> MemoryReport:
    """The report of a built step (`memory_report` builds it; the planner reuses twins).

    `step` is `make_step(loss_fn, ..., has_state=has_state, mesh=mesh, shard=shard)`.
    `twin`, on XLA:CPU for a 16-bit compute dtype, is the report of the same step built
    with `float32_twin(step.policy)` (and `loss_scale=step.loss_scale`): the GPU/TPU
    estimate is its peak with its saved activations replaced by this step's. For a GPU
    `target` the step is built on `target_mesh(target, mesh, data_axis)`, which is `mesh`.
    """
    key = jr.PRNGKey(0) if key is None else key
    target = Target("cpu") if target is None else target
    devices = _devices(mesh, data_axis)
    what = f"accumulate={step.accumulate}" + (f" x {devices} devices" if devices > 1 else "")
    structs, size = batch_structs(batch, step.granularity, what)
    if measure:
        _check_measurable(model, target)
    if has_state and model_state is None:
        raise ValueError(
            "the step was made with has_state=True: pass model_state= (e.g. from "
            "eqx.nn.make_with_state); shapes (jax.ShapeDtypeStruct) are enough."
        )
    state = eqx.filter_eval_shape(
        lambda m, ms: step.init(m, key=key, model_state=ms), model, model_state
    )
    jaxpr, compiled, at_peak, options = compile_step(step, state, structs, target)
    figures = memory_figures(compiled)

    # The micro-batch's loss is traced on plain shapes: on a mesh with Explicit axes the
    # state's types carry their sharding, which a loss outside the step cannot take.
    plain = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_arrayish(x) else x, state.model
    )
    residuals, dtypes = micro_residuals(
        loss_fn,
        step.policy,
        plain,
        structs,
        granularity=step.granularity,
        model_state=state.model_state,
        key=key,
    )
    groups = group_residuals(residuals, dtypes)
    shardings = step.state_shardings(state) if mesh is not None else None
    sizes, params, fused, fused_bytes = _sizes(
        step, state, shardings, plain, structs, size, groups, devices, key
    )
    replicated = sum(1 for whole, mine in params if whole == mine and whole > 0)
    peak = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
    backend = target.backend
    compute = step.policy.compute_dtype
    # Traced here (on XLA:CPU for a compile-only target): what the trace chose.
    attention = model_attention(model, compute, jax.default_backend())
    remat = model_remat(model)
    notes = _notes(target, twin, sizes, peak, devices, shard, replicated, len(params))
    notes += _step_notes(step, model, figures, attention, remat, len(fused), fused_bytes)
    if twin is not None:
        accelerator = twin.peak_bytes - twin.sizes["activations"] + sizes["activations"]
    else:
        accelerator = peak
    if backend == "cpu":
        trusted = {"cpu": "peak_bytes", "gpu": "accelerator_peak_bytes"}
    else:
        trusted = {backend: "peak_bytes"}

    measured = None
    if measure:
        measured = measure_peak(step, model, structs, model_state, key)
        trusted = {**trusted, backend: "measured_peak_bytes"}

    config = _config(step, model, state, structs, name, remat, attention, devices, shard)
    config.update(target=target.name, compiler_options=options)
    return MemoryReport(
        sizes=sizes,
        compiled=figures,
        activations=groups,
        accelerator_peak_bytes=accelerator,
        trusted=trusted,
        notes=tuple(notes),
        backend=backend,
        device=target.describe(),
        config=config,
        cost=jaxpr_cost(jaxpr),
        measured_peak_bytes=measured,
        at_peak=None if at_peak is None else at_peak.parts(),
    )


def _check_measurable(model: PyTree, target: Target) -> None:
    if target.compile_only:
        raise ValueError(
            f"measure=True runs the step, but target={target.name!r} is compiled for only; "
            "measure on the GPU itself with target='attached'."
        )
    check_measurable(model)


def _config(step, model, state, structs, name, remat, attention, devices, shard) -> dict:
    """The report's `config`: what was compiled, as the report names it."""
    return {
        "name": name,
        "accumulate": step.accumulate,
        "accumulate_dtype": step.accumulate_dtype.name,
        "fuse_accumulation": bool(step.config.fuse_accumulation and step.accumulate > 1),
        "precision": precision_name(step.policy),
        "compute_dtype": str(jnp.dtype(step.policy.compute_dtype)),
        "remat": remat,
        "attention": attention,
        "density": model_density(model),
        "devices": devices,
        "shard": shard,
        # The rest of the step's options (`StepConfig`'s), as the built step holds them.
        "loss_scale": None if step.loss_scale is None else float(step.loss_scale.scale),
        "has_state": step.has_state,
        "mesh": None if step.mesh is None else dict(step.mesh.shape),
        "data_axis": step.data_axis,
        "after_update": _name(step.config.after_update),
        "skip_nonfinite": step.skip_nonfinite,
        "batch": [(list(x.shape), str(x.dtype)) for x in jax.tree.leaves(structs)],
        "parameters": sum(x.size for x in jax.tree.leaves(state.model) if is_float(x)),
    }


def _name(fn: Any) -> str | None:
    """A function's name (a hook's class name), or None."""
    if fn is None:
        return None
    return getattr(fn, "__qualname__", type(fn).__qualname__)


def _sizes(step, state, shardings, plain, structs, size, groups, devices, key) -> tuple:
    """The bytes of each part on one device, then each parameter's (whole bytes, bytes on
    one device), the gradient arrays whose micro-batch gradient fused accumulation does not
    hold, and their bytes."""

    def local(tree: Any, part: str, dtype: Any = None) -> list[tuple[int, int]]:
        """(whole bytes, bytes on one device) of each array of `state.<part>`."""
        where = None if shardings is None else getattr(shardings, part)
        out = []
        for x, s in _pairs(tree, where):
            shape = tuple(x.shape)
            item = np.dtype(dtype or x.dtype).itemsize
            local_shape = shape if s is None else tuple(s.shard_shape(shape))
            out.append((int(np.prod(shape)) * item, int(np.prod(local_shape)) * item))
        return out

    params = local(state.model, "model")
    # Each micro-batch's gradient and the accumulator, in the step's accumulate_dtype;
    # the stacks that fold their gradient into the accumulator hold no micro-batch gradient.
    grads = local(eqx.filter(state.model, is_float), "model", step.accumulate_dtype)
    fused = fused_slots(step, plain, structs, model_state=state.model_state, key=key)
    opt = local(state.opt_state, "opt_state")
    grad_bytes = sum(b for _, b in grads)
    fused_bytes = sum(b for n, (_, b) in enumerate(grads) if n in fused)
    sizes = {
        "parameters": sum(b for _, b in params),
        "gradients": grad_bytes - fused_bytes,
        "accumulator": grad_bytes if step.accumulate > 1 else 0,
        "optimizer": sum(b for _, b in opt),
        "activations": sum(g.nbytes for g in groups),
        "batch": (tree_bytes(structs) + 4 * size) // devices,
    }
    return sizes, params, fused, fused_bytes


def _step_notes(step, model, figures, attention, remat, fused: int, fused_bytes: int) -> list:
    """The notes on what the step's techniques do to its figures: fused accumulation,
    16-bit gradients, attention on XLA:CPU against a GPU, offloading."""
    notes = []
    backend = jax.default_backend()  # where the step was traced
    if fused_bytes:
        notes.append(
            f"Fused accumulation: {fused} arrays of scanned, recomputed stacks "
            f"({fused_bytes / 2**20:.1f} MiB of gradient) fold each layer's gradient into the "
            "accumulator in their backward loop, so no micro-batch gradient of them is held "
            "(make_step(fuse_accumulation=True)); the gradients part counts the rest."
        )
    if step.accumulate_dtype.itemsize == 2:
        notes.append(
            f"Gradients in {step.accumulate_dtype.name} (accumulate_dtype): each micro-batch's "
            "gradient and the accumulator take 2 bytes per parameter; the update reads the "
            "accumulator as it is, converting each value to float32 where it is used (no "
            "float32 copy of the gradient is stored)."
        )
    if backend == "cpu":
        on_gpu = model_attention(model, step.policy.compute_dtype, "gpu")
        if attention and on_gpu and on_gpu != attention:
            here, there = _choices(attention), _choices(on_gpu)
            notes.append(
                f"Attention: traced on XLA:CPU, {here}; on a CUDA GPU {there}, with other "
                "temporaries. The figures are for the former (cuDNN's kernels compile only "
                "on the device: report there with target='attached' for theirs)."
            )
    if backend == "cpu" and remat is not None and "offload" in remat:
        notes.append(
            "Offloading: XLA:CPU drops the host placement of offloaded names (the same "
            "numbers, no host memory), so here they count as saved activations on the "
            "device; on a GPU the report shows them as host memory and the device peak falls."
        )
    if figures.get("host_temp", 0) or figures.get("host_argument", 0):
        notes.append(
            "Host memory: offloaded activations live in pinned host memory between the forward "
            "and the backward pass; they are not in the device peak."
        )
    return notes


def _choices(attention: dict[str, str]) -> str:
    return ", ".join(f"attention={k!r} runs {v!r}" for k, v in attention.items())


def _pairs(tree: Any, shardings: Any) -> list[tuple[Any, Any]]:
    """(array leaf, its sharding or None) for every array of `tree`."""
    if shardings is None:
        return [(x, None) for x in jax.tree.leaves(tree) if is_arrayish(x)]
    out: list[tuple[Any, Any]] = []
    jax.tree.map(
        lambda x, s: out.append((x, s)) if is_arrayish(x) else None,
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )
    return out


def _notes(target, twin, sizes, peak, devices, shard, replicated, arrays) -> list[str]:
    notes = []
    backend = target.backend
    if target.compile_only:
        notes.append(
            f"Compiled for {target.describe()} by XLA's {backend.upper()} compiler without "
            "the device: its buffer assignment for that device (its convolutions, native "
            "16-bit arithmetic, its fusions), the peak XLA plans there; nothing ran. "
            "Attention and other choices made while tracing are this machine's (see the "
            "attention note)."
        )
    elif backend == "cpu" and twin is not None:
        notes.append(
            "XLA:CPU computes 16-bit types partly in float32 (it converts the operands of "
            "matrix products, and elementwise work, to float32), so its temporaries do not "
            "shrink as a GPU's do: the predicted peak is trusted for CPU only. The GPU/TPU "
            f"estimate is the peak of the same step computing in float32 "
            f"({format_bytes(twin.peak_bytes)}, compiled here) with its saved activations "
            f"({format_bytes(twin.sizes['activations'])}) replaced by this step's "
            f"({format_bytes(sizes['activations'])}): conservative, as a GPU keeps its "
            "other temporaries in 16 bits too. Compile on the target for its own figure."
        )
    elif backend == "cpu":
        notes.append(
            "Compiled by XLA:CPU: trusted for CPU. A GPU/TPU compiles the same buffers with "
            "its own fusion and scheduling: expect about the same peak; run the report on "
            "the target (measure=True there) for its exact figure."
        )
    else:
        notes.append(
            f"Compiled by XLA:{backend.upper()}: its buffer assignment for this device; "
            "trusted for it (measure=True compares with the measured peak)."
        )
    if devices > 1:
        text = (
            f"Per device, over {devices} devices: each holds 1/{devices} of the batch and of "
            "each micro-batch's activations"
        )
        if shard == "fsdp":
            text += (
                f", and 1/{devices} of the parameters, gradients and optimizer state (FSDP; "
                f"{replicated} of {arrays} model arrays have no dimension {devices} divides "
                "and stay replicated; each block's weights are gathered while it runs)"
            )
        else:
            text += "; parameters, gradients and optimizer state are replicated (shard='data')"
        notes.append(text + ".")
    total = sum(sizes.values())
    if total > peak:
        notes.append(
            f"The parts above add up to {format_bytes(total - peak)} more than the peak: XLA "
            "never holds them all at once (it may fuse the update into the gradient, or free "
            "saved activations as the backward pass consumes them), so no room is left for "
            "other temporaries."
        )
    return notes


def memory_report(
    model: PyTree,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch: Any,
    *,
    accumulate: int = 1,
    precision: str | Policy | None = None,
    loss_scale: DynamicLossScale | Literal["auto"] | None = "auto",
    accumulate_dtype: Any = jnp.float32,
    fuse_accumulation: bool = True,
    has_state: bool = False,
    model_state: PyTree = None,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    shard: str = "data",
    target: Target | str | os.PathLike | None = None,
    key: PRNGKeyArray | None = None,
    measure: bool = False,
    name: str | None = None,
    step_config: StepConfig | None = None,
) -> MemoryReport:
    """Where the memory of one training step goes, before a single step runs.

    Builds the step `eqx_lowmem.train.make_step(loss_fn, optimizer, accumulate=...,
    precision=..., mesh=..., shard=..., ...)`, takes the shapes of its state with
    `eqx.filter_eval_shape`, compiles it without running it, and splits the compiled peak
    into parameters, gradients (and the accumulator), optimizer state, saved activations
    (grouped by the module and checkpoint name that made them), the batch and the other
    temporaries. With a `mesh`, every figure is per device.

    Memory and time: nothing is allocated on the device (unless `measure=True`); one
    compilation of the step (seconds on two CPU cores for the guide's 12-layer transformer)
    and one trace of a micro-batch's loss. On XLA:CPU a 16-bit compute dtype
    compiles the step twice: once more computing in float32, for the GPU/TPU estimate.

    Recomputation (`remat`), the attention implementation and sparsity are properties of
    the model: build it with the settings to report on, e.g.
    `transformer_encoder(..., remat=True)`; the report says what it found.

    Args:
        model: the model, with arrays or `jax.ShapeDtypeStruct`s
            (`eqx.filter_eval_shape(make_model)` reports on a model too large to build).
        loss_fn: the loss, as `make_step`'s, called the way the step calls it.
        optimizer: an optax optimizer.
        batch: the whole batch of one update, as the step receives it: a tuple of arrays or
            `jax.ShapeDtypeStruct`s with a common leading dimension divisible by
            `accumulate` times the mesh's `data_axis` size.
        accumulate: micro-batches per batch (`make_step`'s).
        precision: a precision preset name or `Policy` (`make_step`'s).
        loss_scale: `make_step`'s.
        accumulate_dtype: the dtype of the micro-batch gradients and of their accumulator
            (`make_step`'s): the gradients part (and the accumulator) in its bytes.
        fuse_accumulation: `make_step`'s: the gradients part leaves out the parameters of
            the stacks that fold their gradient into the accumulator.
        has_state: the loss takes and returns an `eqx.nn.State` (`make_step`'s).
        model_state: the model's `eqx.nn.State` (or its shapes), with `has_state=True`.
        mesh: report per device of this mesh (on CPU, devices from
            `XLA_FLAGS=--xla_force_host_platform_device_count=N`).
        data_axis: the mesh axis the batch (and with FSDP the parameters) is split over.
        shard: `"data"` (parameters replicated) or `"fsdp"` (parameters and optimizer state
            sharded over `data_axis`), as `make_step`'s.
        target: the device the figures are for (`Target`, or its name): None or `"cpu"`
            for this process's backend; a GPU name such as `"h100"` or `"a100-40gb"`, or a
            `GpuTargetConfigProto` file, to compile for that GPU on any machine (needs
            `eqx-lowmem[gpu-plan]`; seconds, as a CPU compile); `"attached"` for the device
            this process runs on. With several devices (`Target("h100", devices=8)`) the
            step is compiled for a mesh of them: `mesh`'s axes if given (its size must be
            the target's `devices`), else one axis named `data_axis`.
        key: PRNG key for the state and dropout (default `jr.PRNGKey(0)`).
        measure: also run one step on the device and report its measured peak
            (`peak_bytes_in_use`). Needs a GPU or TPU and a model with arrays; allocates the
            state and a random batch. The device counter is the process's peak since start:
            the memory in use before the step's state was made is subtracted, but an
            earlier, higher peak hides the step's; run in a fresh process for an exact figure
            (and set `XLA_PYTHON_CLIENT_PREALLOCATE=false`).
        name: a label for tables and plots.
        step_config: every option of the step in one `eqx_lowmem.train.StepConfig` (the
            value a `Trainer` takes: the same step), instead of the step's keyword
            arguments above, which must then be left at their defaults. Its
            `after_update` hook and the state it keeps are part of the step reported on.

    Returns:
        A `MemoryReport`: `print(report)` shows the table, `report.to_dict()` /
        `report.to_json(path)` export it.

    Raises:
        ValueError: for a batch that `accumulate` (times the devices) does not divide,
            arrays of different lengths, `measure=True` on a device without memory
            statistics, an unknown `shard`, an unknown target, a `mesh` whose size is not
            the target's `devices`, `measure=True` for a compile-only target, or the errors
            of `make_step`.
        ImportError: for a GPU target without the CUDA plugin (`eqx-lowmem[gpu-plan]`).

    Example:
        >>> import jax, jax.numpy as jnp, jax.random as jr, optax
        >>> import eqx_lowmem as el
        >>> model = el.nn.mlp([8, 32, 1], key=jr.PRNGKey(0))
        >>> x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
        >>> y = jax.ShapeDtypeStruct((16, 1), jnp.float32)
        >>> report = el.memory.memory_report(model, el.train.mse, optax.adam(1e-3), (x, y))
        >>> # Adam: two moments per parameter and a 4-byte step counter.
        >>> report.parts["optimizer"] == 2 * report.parts["parameters"] + 4
        True
        >>> report.parts["parameters"] == 4 * (8 * 32 + 32 + 32 * 1 + 1)  # float32 weights
        True
    """
    config = resolve_step_config(
        step_config,
        accumulate=accumulate,
        precision=precision,
        loss_scale=loss_scale,
        accumulate_dtype=accumulate_dtype,
        fuse_accumulation=fuse_accumulation,
        has_state=has_state,
        mesh=mesh,
        data_axis=data_axis,
        shard=shard,
    )
    target = as_target(target)
    config = config.replace(mesh=target_mesh(target, config.mesh, config.data_axis))
    step = config.build(loss_fn, optimizer)
    common: dict[str, Any] = dict(
        has_state=config.has_state,
        model_state=model_state,
        key=key,
        mesh=config.mesh,
        data_axis=config.data_axis,
        shard=config.shard,
        target=target,
    )
    twin = None
    twin_policy = float32_twin(step.policy, target)
    if twin_policy is not None:
        # The same step computing in float32, for the GPU/TPU estimate (one more compile).
        twin_step = config.replace(precision=twin_policy, loss_scale=step.loss_scale).build(
            loss_fn, optimizer
        )
        twin = step_report(twin_step, loss_fn, model, batch, **common)
    return step_report(step, loss_fn, model, batch, measure=measure, name=name, twin=twin, **common)


def target_mesh(target: Target, mesh: Mesh | None, data_axis: str) -> Mesh | None:
    """The mesh a step is built on for `target`: `mesh` for this process's devices; for a
    compile-only GPU target, a mesh of its devices with `mesh`'s axes (or one axis named
    `data_axis`), the step's state and batch placed there to compile for the GPU."""
    if not target.compile_only:
        return mesh
    if mesh is None:
        return target.mesh((target.devices,), (data_axis,))
    if mesh.size != target.devices and target.devices != 1:
        raise ValueError(
            f"target={target.describe()!r} has devices={target.devices}, but the mesh "
            f"{dict(mesh.shape)} has {mesh.size}: give a mesh of {target.devices} devices, or "
            f"Target({target.name!r}, devices={mesh.size})."
        )
    full = target if mesh.size == target.devices else dataclasses.replace(target, devices=mesh.size)
    made = full.mesh(tuple(mesh.devices.shape), tuple(mesh.axis_names))
    types = getattr(mesh, "axis_types", None)
    return made if types is None else Mesh(made.devices, made.axis_names, axis_types=types)
