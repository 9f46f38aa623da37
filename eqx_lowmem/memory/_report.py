"""Where the memory of a training step goes, from compilation alone."""

import dataclasses
import json
import os
import textwrap
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import PRNGKeyArray, PyTree

from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import PRESETS, Policy, get_policy
from ..train._step import Step, _accepts_key, make_step
from ._cost import Cost, jaxpr_cost
from ._io import write_json
from ._residuals import Residual, saved_residuals
from ._units import format_bytes

# The parts of the predicted peak, in the order they are printed and stacked in plots.
PARTS: tuple[str, ...] = (
    "parameters",
    "gradients",
    "accumulator",
    "optimizer",
    "activations",
    "batch",
    "other",
)
PART_LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients (float32)",
    "accumulator": "gradient accumulator",
    "optimizer": "optimizer state",
    "activations": "saved activations",
    "batch": "batch",
    "other": "other temporaries",
}
# What shrinks each part, for the planner's error and the report's advice.
PART_ADVICE: dict[str, str] = {
    "parameters": "a smaller model, or precision='half_bf16' (16-bit parameters)",
    "gradients": "a smaller model (the gradient is float32 whatever the precision)",
    "accumulator": "accumulate=1 if the activations allow it (the accumulator is float32)",
    "optimizer": "an optimizer with less state (SGD instead of Adam), or 16-bit state "
    "(precision='half_bf16')",
    "activations": "remat (True, 'minimal', 'dots') or more micro-batches (accumulate)",
    "batch": "a smaller batch, streamed from host memory",
    "other": "remat=True (chunked attention and feed-forward) or more micro-batches",
}
_W = 62  # width of the label column of the table


class ActivationGroup(NamedTuple):
    """Saved activations of one kind (residuals of the backward pass, grouped).

    Attributes:
        label: what they are: the checkpoint name (`"qkv"`), `"parameters, compute dtype"`
            (the cast copy of the parameters a 16-bit policy keeps), or `"(<primitive>)"`
            naming the operation that computed a value without a checkpoint name.
        name: the checkpoint name, or None.
        scope: the named scopes that computed it (e.g. `"eqx_lowmem.nn.TransformerEncoder/
            eqx_lowmem.nn.TransformerBlock"`), or `""`.
        loops: lengths of the scans it is stacked over: `(n_layers,)` for a value of each of
            the blocks of a `transformer_encoder`. Each layer's share is `nbytes / n_layers`.
        dtype: its dtype's name.
        arrays: how many arrays the group holds.
        nbytes: their total size for one micro-batch.
        shape: the shape of the first of them.
    """

    label: str
    name: str | None
    scope: str
    loops: tuple[int, ...]
    dtype: str
    arrays: int
    nbytes: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The memory of one training step: its parts, the predicted peak, and which to trust.

    Attributes:
        parts: bytes per part, in the order of `PARTS`: `parameters` (the floating arrays of
            the model, in the policy's parameter dtype), `gradients` (one float32
            parameter-sized buffer: the gradient the optimizer receives), `accumulator`
            (another, when `accumulate > 1`: a micro-batch's gradient before it is added),
            `optimizer` (the optimizer state's arrays), `activations` (what the backward
            pass of one micro-batch keeps: `saved_residuals`), `batch` (the batch and its
            per-sample weights), `other` (the remainder: the live values of the forward and
            backward computations that are not saved activations, workspace, and the small
            state: step counter, PRNG key, loss scale). They add up to `peak_bytes` exactly.
            The parts other than `other` are sizes, not a liveness analysis: where XLA never
            holds them all at once (it may add each layer's micro-batch gradient straight
            into the accumulator), `other` is negative and a note says so.
        peak_bytes: the predicted peak of the compiled step: argument + output + temp -
            alias bytes of `compiled.memory_analysis()` (with donation, the new state
            reuses the old one's buffers).
        compiled: the raw figures of `memory_analysis()`: `argument`, `output`, `temp`,
            `alias`, and XLA's own `peak` (on XLA:CPU it leaves temporaries out).
        activations: the saved activations, grouped (largest first).
        residuals_by_dtype: bytes of the saved activations per dtype.
        accelerator_peak_bytes: the peak to expect on a GPU or TPU. Equal to `peak_bytes`
            when compiled for one, or when the step computes in float32. On XLA:CPU with a
            16-bit compute dtype (whose temporaries XLA:CPU keeps partly in float32), the
            peak of the same step computing in float32, with its saved activations
            replaced by this step's 16-bit ones: an estimate that errs high, since a GPU
            also keeps the step's other temporaries in 16 bits.
        trusted: which figure to believe for which backend: `{"cpu": ..., "gpu": ...}` naming
            a field (`"peak_bytes"`, `"accelerator_peak_bytes"`, `"measured_peak_bytes"`).
        notes: the reasons, in words.
        backend: the backend it was compiled for (`"cpu"`, `"gpu"`, `"tpu"`).
        device: the device kind.
        config: what was reported on: `accumulate`, `precision`, `remat` (found in the
            model's `TransformerBlock`s), batch shapes, `name`.
        cost: the arithmetic of the step (every loop counted as often as it runs).
        measured_peak_bytes: with `measure=True`, the device's measured peak of one step
            (`peak_bytes_in_use`, less what was in use before the step's state was made);
            else None.
    """

    parts: dict[str, int]
    peak_bytes: int
    compiled: dict[str, int]
    activations: tuple[ActivationGroup, ...]
    residuals_by_dtype: dict[str, int]
    accelerator_peak_bytes: int
    trusted: dict[str, str]
    notes: tuple[str, ...]
    backend: str
    device: str
    config: dict[str, Any]
    cost: Cost
    measured_peak_bytes: int | None = None

    @property
    def dominant(self) -> tuple[str, int]:
        """The largest part: `(name, bytes)`."""
        part = max(self.parts, key=lambda k: self.parts[k])
        return part, self.parts[part]

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-compatible values (bytes as ints)."""
        return {
            "config": _jsonable(self.config),
            "backend": self.backend,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "parts": dict(self.parts),
            "dominant": self.dominant[0],
            "compiled": dict(self.compiled),
            "activations": [
                {**g._asdict(), "loops": list(g.loops), "shape": list(g.shape)}
                for g in self.activations
            ],
            "residuals_by_dtype": dict(self.residuals_by_dtype),
            "accelerator_peak_bytes": self.accelerator_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "trusted": dict(self.trusted),
            "notes": list(self.notes),
            "cost": self.cost._asdict(),
        }

    def to_json(self, path: "str | os.PathLike[str] | None" = None) -> str:
        """The report as JSON text; with `path`, also written there atomically."""
        payload = self.to_dict()
        if path is not None:
            write_json(path, payload)
        return json.dumps(payload, indent=2)

    def table(self, *, max_groups: int = 8) -> str:
        """The report as a table of parts, the largest activation groups, and the notes."""
        peak = max(self.peak_bytes, 1)
        c = self.config
        lines = [
            f"Memory of one training step ({c.get('name') or 'model'}), compiled for "
            f"{self.backend} ({self.device}); nothing ran"
            + (" until measured" if self.measured_peak_bytes is not None else ""),
            f"  accumulate={c['accumulate']}  precision={c['precision']}  remat={c['remat']}"
            f"  batch={_shapes_text(c['batch'])}",
            "",
            f"  {'part':<{_W}}{'bytes':>12}{'share':>8}",
        ]
        for part in PARTS:
            n = self.parts[part]
            lines.append(f"  {PART_LABELS[part]:<{_W}}{format_bytes(n):>12}{100 * n / peak:>7.1f}%")
            if part == "activations":
                for g in self.activations[:max_groups]:
                    scope = g.scope.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
                    layers = "x" + "x".join(str(n) for n in g.loops) if g.loops else ""
                    text = f"{g.label[:26]:<26} {scope[:18]:<18} {layers:>4} {g.dtype:<8}"
                    lines.append(f"    {text:<{_W - 2}}{format_bytes(g.nbytes):>12}")
                rest = self.activations[max_groups:]
                if rest:
                    more = sum(g.nbytes for g in rest)
                    text = f"... {len(rest)} more groups"
                    lines.append(f"    {text:<{_W - 2}}{format_bytes(more):>12}")
        cm = self.compiled
        lines += [
            "  " + "-" * (_W + 20),
            f"  {'predicted peak':<{_W}}{format_bytes(self.peak_bytes):>12}",
            f"    = argument {format_bytes(cm['argument'])} + output {format_bytes(cm['output'])}"
            f" + temp {format_bytes(cm['temp'])} - alias {format_bytes(cm['alias'])}",
        ]
        if self.accelerator_peak_bytes != self.peak_bytes:
            lines.append(
                f"  {'estimate for a GPU/TPU':<{_W}}{format_bytes(self.accelerator_peak_bytes):>12}"
            )
        if self.measured_peak_bytes is not None:
            error = self.peak_bytes / max(self.measured_peak_bytes, 1) - 1
            lines.append(
                f"  {'measured peak (peak_bytes_in_use)':<{_W}}"
                f"{format_bytes(self.measured_peak_bytes):>12}  (prediction {100 * error:+.1f}%)"
            )
        by_dtype = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.residuals_by_dtype.items())
        lines.append(f"  saved activations by dtype: {by_dtype or 'none'}")
        lines.append("  trusted: " + ", ".join(f"{k}: {v}" for k, v in self.trusted.items()))
        for note in self.notes:
            lines += textwrap.wrap(note, 92, initial_indent="  note: ", subsequent_indent="    ")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _shapes_text(batch: Any) -> str:
    return ", ".join(f"{tuple(s)} {d}" for s, d in batch)


# ------------------------------------------------------------------------------- helpers


def _is_arrayish(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _is_float(x: Any) -> bool:
    return _is_arrayish(x) and bool(jnp.issubdtype(x.dtype, jnp.inexact))


def _nbytes(x: Any) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _tree_bytes(tree: Any, keep: Callable[[Any], bool] = _is_arrayish) -> int:
    return sum(_nbytes(x) for x in jax.tree.leaves(tree) if keep(x))


def _as_struct(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(int(d) for d in x.shape), x.dtype)
    return x


def _check_batch(batch: Any, granularity: int) -> tuple[tuple, int]:
    """The batch as a tuple of ShapeDtypeStructs, and its size."""
    if not isinstance(batch, (tuple, list)) or not batch:
        raise TypeError(
            "batch must be a non-empty tuple of arrays or jax.ShapeDtypeStructs with a common "
            f"leading batch dimension, such as (x, y); got {type(batch).__name__}."
        )
    structs = tuple(jax.tree.map(_as_struct, tuple(batch)))
    leaves = jax.tree.leaves(structs)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, jax.ShapeDtypeStruct)]
    if bad:
        raise TypeError(f"batch leaves must be arrays or jax.ShapeDtypeStructs; got {bad}.")
    sizes = {x.shape[0] if x.shape else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "batch arrays must share their first (batch) dimension; got shapes "
            f"{[x.shape for x in leaves]}."
        )
    size = sizes.pop()
    assert size is not None
    if size % granularity:
        raise ValueError(
            f"a batch of {size} samples is not divisible by accumulate={granularity}; "
            f"use a divisor of {size} for accumulate (the report compiles equal micro-batches)."
        )
    return structs, size


def _precision_name(policy: Policy) -> str:
    for name, preset in PRESETS.items():
        if preset == policy:
            return name
    return repr(policy)


def model_remat(model: PyTree) -> str | None:
    """The `remat` setting(s) of the `TransformerBlock`s in `model`, as text; None if none."""
    from ..nn._block import TransformerBlock

    found = []
    for leaf in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, TransformerBlock)):
        if isinstance(leaf, TransformerBlock) and str(leaf.remat) not in found:
            found.append(str(leaf.remat))
    return ",".join(found) if found else None


# XLA:CPU: LLVM's optimisation of the generated code is most of the compile time and does
# not change buffer assignment, so every memory figure equals the default compilation's
# (tests/test_memory_report.py checks it against the step's own) in about 60% of the time.
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0}


def _compile(lowered: Any) -> Any:
    if jax.default_backend() != "cpu":
        return lowered.compile()
    try:
        return lowered.compile(compiler_options=_FAST_CPU_COMPILE)
    except Exception as e:  # an XLA without the option: compile as usual
        if "compile option" not in str(e):
            raise
        return lowered.compile()


def lower_step(step: Step, state: Any, batch: tuple) -> tuple[Any, Any]:
    """Compile `step` for a state and batch of shapes without running it, and trace its jaxpr.

    The compiled step is `step.lower(state, batch).compile()`: the very program a call of
    the step runs, with the state donated (on XLA:CPU without LLVM's optimisation of the
    machine code, which leaves the buffers as they are). Nothing is allocated on the device.

    Returns:
        `(jaxpr, compiled)`: the step's `ClosedJaxpr` (for `jaxpr_cost`) and the compiled
        step (`memory_analysis()`, `cost_analysis()`).
    """
    traced = step.trace(state, batch)
    compiled = _compile(traced.lower())
    jaxpr = traced.jaxpr
    return jaxpr, compiled


def _micro_residuals(
    step: Step, state: Any, batch: tuple, model_state: Any, key: Any
) -> list[Residual]:
    """What the backward pass of one micro-batch's loss keeps, as the step computes it."""
    k = step.accumulate * step.n_shards
    micro = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((s.shape[0] // k, *s.shape[1:]), s.dtype), batch
    )
    params, static = eqx.partition(state.model, _is_float)
    policy, loss_fn, has_state = step.policy, step.loss_fn, step.has_state
    kwargs = {"key": key} if _accepts_key(loss_fn) else {}

    def loss(params, batch, model_state):
        model = eqx.combine(policy.cast_to_compute(params), static)
        # The step differentiates with respect to the parameters only.
        inputs = jax.lax.stop_gradient(policy.cast_to_compute(batch))
        model_state = jax.lax.stop_gradient(model_state)
        if has_state:
            out, _ = loss_fn(model, model_state, *inputs, **kwargs)
        else:
            out = loss_fn(model, *inputs, **kwargs)
        values, weights = out if isinstance(out, tuple) else (out, None)
        values = values.astype(jnp.float32)
        if weights is not None:
            values = values * weights.astype(jnp.float32)
        return jnp.sum(values)

    return saved_residuals(loss, params, micro, model_state)


def _group(residuals: list[Residual]) -> tuple[ActivationGroup, ...]:
    groups: dict[tuple, list[Residual]] = {}
    for r in residuals:
        if r.source.startswith("argument") and not r.source.endswith("(transformed)"):
            continue  # a parameter or input itself: counted in its own part
        if r.name is not None:
            label = r.name
        elif r.source.startswith("argument args[0]"):
            label = "parameters, compute dtype"
        elif r.source.startswith("argument"):
            label = "batch, compute dtype"
        else:
            label = f"({r.source.split(' ', 1)[1]})"
        key = (label, r.name, r.scope, r.loops, str(r.dtype))
        groups.setdefault(key, []).append(r)
    out = [
        ActivationGroup(
            label, name, scope, loops, dtype, len(rs), sum(r.nbytes for r in rs), rs[0].shape
        )
        for (label, name, scope, loops, dtype), rs in groups.items()
    ]
    return tuple(sorted(out, key=lambda g: -g.nbytes))


# --------------------------------------------------------------------------------- report


def float32_twin(policy: Policy) -> Policy | None:
    """On XLA:CPU, the policy of the same step computing in float32 (for the GPU estimate).

    None when the step computes in float32 already or runs on an accelerator.
    """
    if jax.default_backend() != "cpu" or policy.compute_dtype.itemsize != 2:
        return None
    return Policy(policy.param_dtype, jnp.float32, policy.output_dtype)


def step_report(
    step: Step,
    model: PyTree,
    batch: Any,
    *,
    model_state: PyTree = None,
    key: PRNGKeyArray | None = None,
    measure: bool = False,
    name: str | None = None,
    twin: "MemoryReport | None" = None,
) -> MemoryReport:
    """The report of a built `Step` (`memory_report` builds it; the planner reuses twins).

    `twin`, on XLA:CPU for a 16-bit compute dtype, is the report of the same step built
    with `float32_twin(step.policy)` (and `loss_scale=step.loss_scale`): the GPU/TPU
    estimate is its peak with its saved activations replaced by this step's.
    """
    key = jr.PRNGKey(0) if key is None else key
    structs, size = _check_batch(batch, step.accumulate * step.n_shards)
    if measure:
        _check_measurable(model)
    if step.has_state and model_state is None:
        raise ValueError(
            "the step was made with has_state=True: pass model_state= (e.g. from "
            "eqx.nn.make_with_state); shapes (jax.ShapeDtypeStruct) are enough."
        )
    state = eqx.filter_eval_shape(
        lambda m, ms: step.init(m, key=key, model_state=ms), model, model_state
    )
    jaxpr, compiled = lower_step(step, state, structs)
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError(
            f"the {jax.default_backend()} backend gives no memory_analysis() for the compiled "
            "step; the report needs it."
        )
    figures = {
        "argument": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
        "temp": int(analysis.temp_size_in_bytes),
        "alias": int(analysis.alias_size_in_bytes),
        "peak": int(getattr(analysis, "peak_memory_in_bytes", 0)),
    }
    peak = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.model) if _is_float(x))
    residuals = _micro_residuals(step, state, structs, state.model_state, key)
    groups = _group(residuals)
    parts = {
        "parameters": _tree_bytes(state.model, _is_float),
        "gradients": 4 * n_params,
        "accumulator": 4 * n_params if step.accumulate > 1 else 0,
        "optimizer": _tree_bytes(state.opt_state),
        "activations": sum(g.nbytes for g in groups),
        "batch": _tree_bytes(structs) + 4 * size,
    }
    parts["other"] = peak - sum(parts.values())

    by_dtype: dict[str, int] = {}
    for g in groups:
        by_dtype[g.dtype] = by_dtype.get(g.dtype, 0) + g.nbytes
    backend = jax.default_backend()
    notes = []
    if backend == "cpu":
        if twin is not None:
            accelerator = twin.peak_bytes - twin.parts["activations"] + parts["activations"]
            notes.append(
                "XLA:CPU computes 16-bit types partly in float32 (it converts the operands of "
                "matrix products, and elementwise work, to float32), so its temporaries do not "
                "shrink as a GPU's do: the predicted peak is trusted for CPU only. The GPU/TPU "
                f"estimate is the peak of the same step computing in float32 "
                f"({format_bytes(twin.peak_bytes)}, compiled here) with its saved activations "
                f"({format_bytes(twin.parts['activations'])}) replaced by this step's "
                f"({format_bytes(parts['activations'])}): conservative, as a GPU keeps its "
                "other temporaries in 16 bits too. Compile on the target for its own figure."
            )
        else:
            accelerator = peak
            notes.append(
                "Compiled by XLA:CPU: trusted for CPU. A GPU/TPU compiles the same buffers with "
                "its own fusion and scheduling: expect about the same peak; run the report on "
                "the target (measure=True there) for its exact figure."
            )
        trusted = {"cpu": "peak_bytes", "gpu": "accelerator_peak_bytes"}
    else:
        accelerator = peak
        trusted = {backend: "peak_bytes"}
        notes.append(
            f"Compiled by XLA:{backend.upper()}: its buffer assignment for this device; "
            "trusted for it (measure=True compares with the measured peak)."
        )
    if parts["other"] < 0:
        notes.append(
            f"The parts overlap by {format_bytes(-parts['other'])}: XLA does not hold them all "
            "at once (it may add each layer's micro-batch gradient straight into the "
            "accumulator, or free saved activations as the backward pass consumes them), so "
            "'other' is negative and the parts still add up to the peak."
        )

    measured = None
    if measure:
        measured = _measure(step, model, structs, model_state, key)
        trusted = {**trusted, backend: "measured_peak_bytes"}

    config = {
        "name": name,
        "accumulate": step.accumulate,
        "precision": _precision_name(step.policy),
        "remat": model_remat(model),
        "batch": [(list(x.shape), str(x.dtype)) for x in jax.tree.leaves(structs)],
        "parameters": n_params,
    }
    return MemoryReport(
        parts=parts,
        peak_bytes=peak,
        compiled=figures,
        activations=groups,
        residuals_by_dtype=by_dtype,
        accelerator_peak_bytes=accelerator,
        trusted=trusted,
        notes=tuple(notes),
        backend=backend,
        device=str(getattr(jax.devices()[0], "device_kind", jax.devices()[0])),
        config=config,
        cost=jaxpr_cost(jaxpr),
        measured_peak_bytes=measured,
    )


def random_batch(structs: tuple, key: PRNGKeyArray) -> tuple:
    """Device arrays of the batch's shapes: normal floats, zero integers (valid token ids)."""
    leaves, treedef = jax.tree.flatten(structs)
    keys = jr.split(key, max(len(leaves), 1))
    arrays = [
        jr.normal(k, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else jnp.zeros(x.shape, x.dtype)
        for x, k in zip(leaves, keys[: len(leaves)], strict=True)
    ]
    return jax.tree.unflatten(treedef, arrays)


def _check_measurable(model: Any) -> None:
    device = jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        raise ValueError(
            f"measure=True needs a device that reports memory statistics (a GPU or TPU); "
            f"{device} gives memory_stats()={stats}. Use measure=False on CPU."
        )
    abstract = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise ValueError(
            "measure=True runs a step, so the model needs its arrays; got a model with "
            f"{len(abstract)} jax.ShapeDtypeStruct leaves. Pass the built model."
        )


def _measure(step: Step, model, structs, model_state, key) -> int:
    """Run one step and return its measured peak: peak_bytes_in_use less what was in use."""
    device = jax.devices()[0]
    before = device.memory_stats()["bytes_in_use"]
    state = step.init(model, key=key, model_state=model_state)
    batch = random_batch(structs, jr.fold_in(key, 1))
    jax.block_until_ready((state, batch))
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    peak = device.memory_stats()["peak_bytes_in_use"]
    del state, metrics, batch
    return int(peak - before)


def memory_report(
    model: PyTree,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch: Any,
    *,
    accumulate: int = 1,
    precision: "str | Policy | None" = None,
    loss_scale: "DynamicLossScale | Literal['auto'] | None" = "auto",
    has_state: bool = False,
    model_state: PyTree = None,
    key: PRNGKeyArray | None = None,
    measure: bool = False,
    name: str | None = None,
) -> MemoryReport:
    """Where the memory of one training step goes, before a single step runs.

    Builds the step `eqx_lowmem.train.make_step(loss_fn, optimizer, accumulate=...,
    precision=..., ...)`, takes the shapes of its state with `eqx.filter_eval_shape`,
    compiles it without running it, and splits the compiled peak into parameters,
    gradients (and the accumulator), optimizer state, saved activations (grouped by
    checkpoint name and layer), the batch and the other temporaries.

    Memory and time: nothing is allocated on the device (unless `measure=True`); one
    compilation of the step (seconds: the guide's 12-layer transformer compiles in 2-5 s on
    two CPU cores) and one trace of a micro-batch's loss. On XLA:CPU a 16-bit compute dtype
    compiles the step twice: once more computing in float32, for the GPU/TPU estimate.

    Recomputation (`remat`) is a property of the model: build it with the setting to report
    on, e.g. `transformer_encoder(..., remat=True)`.

    Args:
        model: the model, with arrays or `jax.ShapeDtypeStruct`s
            (`eqx.filter_eval_shape(make_model)` reports on a model too large to build).
        loss_fn, optimizer, accumulate, precision, loss_scale, has_state: as `make_step`.
        batch: one batch as the step receives it: a tuple of arrays or
            `jax.ShapeDtypeStruct`s with a common leading dimension divisible by `accumulate`.
        model_state: the model's `eqx.nn.State` (or its shapes), with `has_state=True`.
        key: PRNG key for the state and dropout (default `jr.PRNGKey(0)`).
        measure: also run one step on the device and report its measured peak
            (`peak_bytes_in_use`). Needs a GPU or TPU and a model with arrays; allocates the
            state and a random batch. The device counter is the process's peak since start:
            the memory in use before the step's state was made is subtracted, but an
            earlier, higher peak hides the step's; run in a fresh process for an exact figure
            (and set `XLA_PYTHON_CLIENT_PREALLOCATE=false`).
        name: a label for tables and plots.

    Returns:
        A `MemoryReport`: `print(report)` shows the table, `report.to_dict()` /
        `report.to_json(path)` export it.

    Raises:
        ValueError: for a batch that `accumulate` does not divide, arrays of different
            lengths, `measure=True` on a device without memory statistics, or the errors of
            `make_step`.

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
        >>> sum(report.parts.values()) == report.peak_bytes
        True
    """
    policy = get_policy(precision)
    step = make_step(
        loss_fn,
        optimizer,
        precision=policy,
        accumulate=accumulate,
        loss_scale=loss_scale,
        has_state=has_state,
    )
    twin = None
    twin_policy = float32_twin(step.policy)
    if twin_policy is not None:
        # The same step computing in float32, for the GPU/TPU estimate (one more compile).
        twin_step = make_step(
            loss_fn,
            optimizer,
            precision=twin_policy,
            accumulate=accumulate,
            loss_scale=step.loss_scale,
            has_state=has_state,
        )
        twin = step_report(twin_step, model, batch, model_state=model_state, key=key)
    return step_report(
        step,
        model,
        batch,
        model_state=model_state,
        key=key,
        measure=measure,
        name=name,
        twin=twin,
    )
