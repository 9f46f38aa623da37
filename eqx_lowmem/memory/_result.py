"""The memory report's result type: its parts, the peak they come from, and the table."""

import dataclasses
import json
import os
import textwrap
from typing import Any, NamedTuple

from .._io import write_json
from ._cost import Cost
from ._peak import PEAK_LABELS
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
    "parameters": "a smaller model, sharded parameters (shard='fsdp' over several devices), "
    "sparse layers, or precision='half_bf16' (16-bit parameters)",
    "gradients": "a smaller model, or shard='fsdp' (the gradient is float32 whatever the "
    "precision)",
    "accumulator": "accumulate=1 if the activations allow it (the accumulator is float32)",
    "optimizer": "an optimizer with less state (SGD instead of Adam), 16-bit state "
    "(precision='half_bf16'), or shard='fsdp'",
    "activations": "remat (True, 'minimal', 'dots') or more micro-batches (accumulate)",
    "batch": "a smaller batch, streamed from host memory",
    "other": "remat=True (chunked attention and feed-forward) or more micro-batches",
}
_W = 62  # width of the label column of the table


class ActivationGroup(NamedTuple):
    """Saved activations of one kind (residuals of the backward pass, grouped).

    Attributes:
        label: what they are: the checkpoint name (`"qkv"`), `"parameters, compute dtype"`
            or `"batch, compute dtype"` (the 16-bit copies a policy casts), or, for a value
            without a checkpoint name, `"unnamed <what computed it>"` (`"unnamed ReLU or
            max"`); the module that made it is in `module`.
        name: the checkpoint name, or None.
        scope: the named scopes that computed it (e.g. `"eqx_lowmem.nn.TransformerEncoder/
            eqx_lowmem.nn.TransformerBlock"`), or `""`.
        loops: lengths of the scans it is stacked over: `(n_layers,)` for a value of each of
            the blocks of a `transformer_encoder`. Each layer's share is `nbytes / n_layers`.
        dtype: its dtype's name.
        arrays: how many arrays the group holds.
        nbytes: their total size for one micro-batch (on one device).
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

    @property
    def module(self) -> str:
        """The innermost module (named scope) that computed it, by class name; `""`."""
        return self.scope.rsplit("/", 1)[-1].rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The memory of one training step: its parts, the predicted peak, and which to trust.

    With several devices (`memory_report(..., mesh=...)`) every figure is per device.

    Attributes:
        sizes: bytes of the parts other than `other`, in the order of `PARTS`:
            `parameters` (every array of the model in the policy's parameter dtype: the
            values and integer indices of sparse layers too), `gradients` (one float32
            buffer of the trainable leaves: the gradient the optimizer receives),
            `accumulator` (another, when `accumulate > 1`), `optimizer` (the optimizer
            state's arrays), `activations` (what the backward pass of one micro-batch keeps:
            `saved_residuals`, less what XLA does not store: broadcast constants and views
            of the inputs), `batch` (the batch and its per-sample weights).
        compiled: the figures of `compiled.memory_analysis()`: `argument`, `output`,
            `temp`, `alias`, XLA's own `peak` (on XLA:CPU it leaves temporaries out), and
            where the backend reports them the host-memory ones (`host_argument`,
            `host_output`, `host_temp`, `host_alias`: offloaded activations).
        activations: the saved activations, grouped (largest first).
        accelerator_peak_bytes: the peak to expect on a GPU or TPU. Equal to `peak_bytes`
            when compiled for one, or when the step computes in float32. On XLA:CPU with a
            16-bit compute dtype (whose temporaries XLA:CPU keeps partly in float32), the
            peak of the same step computing in float32, with its saved activations
            replaced by this step's 16-bit ones: an estimate that errs high.
        trusted: which figure to believe for which backend: `{"cpu": ..., "gpu": ...}` naming
            a field (`"peak_bytes"`, `"accelerator_peak_bytes"`, `"measured_peak_bytes"`).
        notes: the reasons, in words.
        backend: the backend it was compiled for (`"cpu"`, `"gpu"`, `"tpu"`).
        device: the device kind.
        config: what was reported on: `accumulate`, `precision`, `remat` (found in the
            model's modules), `attention` (what each block's setting runs as), `density`
            (of sparse layers), `devices`, `shard`, batch shapes, `parameters`, `name`.
        cost: the arithmetic of the step (every loop counted as often as it runs).
        measured_peak_bytes: with `measure=True`, the device's measured peak of one step
            (`peak_bytes_in_use`, less what was in use before the step's state was made);
            else None.
        at_peak: what is live at the compiled step's peak, by part (`PEAK_PARTS` of
            `eqx_lowmem.memory._peak`: parameters, optimizer state, gradients and
            accumulator, saved activations, recomputed activations, backward-pass
            temporaries, the backend's float32 copies of 16-bit arrays, update temporaries,
            batch, other), read from XLA's buffer assignment; None where it could not be
            read. Unlike `sizes` (every saved activation, every gradient), this is what
            is held at one moment, and it includes the working set of recomputation.
    """

    sizes: dict[str, int]
    compiled: dict[str, int]
    activations: tuple[ActivationGroup, ...]
    accelerator_peak_bytes: int
    trusted: dict[str, str]
    notes: tuple[str, ...]
    backend: str
    device: str
    config: dict[str, Any]
    cost: Cost
    measured_peak_bytes: int | None = None
    at_peak: dict[str, int] | None = None

    @property
    def live_peak_bytes(self) -> int | None:
        """The bytes XLA holds live at once at the compiled step's peak (the sum of
        `at_peak`), or None where its buffer assignment could not be read. The compiled
        peak (`peak_bytes`) adds what XLA's packing of temporaries into one block leaves
        unused (`packing_bytes`)."""
        return None if self.at_peak is None else sum(self.at_peak.values())

    @property
    def packing_bytes(self) -> int | None:
        """`peak_bytes - live_peak_bytes`: room XLA's packing leaves between live buffers."""
        live = self.live_peak_bytes
        return None if live is None else self.peak_bytes - live

    @property
    def peak_bytes(self) -> int:
        """The predicted peak of the compiled step: argument + output + temp - alias bytes
        (with donation, the new state reuses the old one's buffers)."""
        c = self.compiled
        return c["argument"] + c["output"] + c["temp"] - c["alias"]

    @property
    def parts(self) -> dict[str, int]:
        """Bytes per part, in the order of `PARTS`: `sizes` and `other`, the remainder of
        the peak (the live values of the forward and backward computations that are not
        saved activations, workspace, the small state). Never negative: when the sizes add
        up to more than the peak (XLA never holds them all at once), `other` is 0 and
        `overlap_bytes` says by how much; otherwise they add up to `peak_bytes` exactly."""
        return {**self.sizes, "other": max(0, self.peak_bytes - sum(self.sizes.values()))}

    @property
    def overlap_bytes(self) -> int:
        """How much more than the peak the sizes add up to (0 almost always)."""
        return max(0, sum(self.sizes.values()) - self.peak_bytes)

    @property
    def host_bytes(self) -> int:
        """Bytes in host memory (offloaded activations): host argument + output + temp -
        alias, where the backend reports them; 0 on XLA:CPU."""
        c = self.compiled
        keys = ("host_argument", "host_output", "host_temp")
        return sum(c.get(k, 0) for k in keys) - c.get("host_alias", 0)

    @property
    def residuals_by_dtype(self) -> dict[str, int]:
        """Bytes of the saved activations per dtype."""
        out: dict[str, int] = {}
        for g in self.activations:
            out[g.dtype] = out.get(g.dtype, 0) + g.nbytes
        return out

    @property
    def dominant(self) -> tuple[str, int]:
        """The largest part: `(name, bytes)`."""
        parts = self.parts
        part = max(parts, key=lambda k: parts[k])
        return part, parts[part]

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-compatible values (bytes as ints)."""
        return {
            "config": _jsonable(self.config),
            "backend": self.backend,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "parts": self.parts,
            "overlap_bytes": self.overlap_bytes,
            "host_bytes": self.host_bytes,
            "dominant": self.dominant[0],
            "compiled": dict(self.compiled),
            "activations": [
                {**g._asdict(), "module": g.module, "loops": list(g.loops), "shape": list(g.shape)}
                for g in self.activations
            ],
            "residuals_by_dtype": self.residuals_by_dtype,
            "accelerator_peak_bytes": self.accelerator_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "at_peak": None if self.at_peak is None else dict(self.at_peak),
            "live_peak_bytes": self.live_peak_bytes,
            "packing_bytes": self.packing_bytes,
            "trusted": dict(self.trusted),
            "notes": list(self.notes),
            "cost": self.cost._asdict(),
        }

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The report as JSON text; with `path`, also written there atomically."""
        payload = self.to_dict()
        if path is not None:
            write_json(path, payload)
        return json.dumps(payload, indent=2)

    def table(self, *, max_groups: int = 8) -> str:
        """The report as a table of parts, the largest activation groups, and the notes."""
        peak = max(self.peak_bytes, 1)
        c = self.config
        devices = c.get("devices", 1)
        settings = (
            f"  accumulate={c['accumulate']}  precision={c['precision']}  remat={c['remat']}"
            f"  batch={shapes_text(c['batch'])}"
        )
        extra = []
        if c.get("attention"):
            chosen = [f"{k}->{v}" if k != v else k for k, v in c["attention"].items()]
            extra.append("attention=" + ",".join(chosen))
        if c.get("density") is not None:
            extra.append(f"density={c['density']:.3g}")
        if devices > 1:
            extra.append(f"devices={devices}  shard={c.get('shard')}  (figures per device)")
        if c.get("compiler_options"):
            options = ", ".join(f"{k}={v}" for k, v in c["compiler_options"].items())
            extra.append(f"compiler options: {options}")
        lines = [
            f"Memory of one training step ({c.get('name') or 'model'}), compiled for "
            f"{self.backend} ({self.device}); nothing ran"
            + (" until measured" if self.measured_peak_bytes is not None else ""),
            settings,
            *(["  " + "  ".join(extra)] if extra else []),
            "",
            f"  {'part':<{_W}}{'bytes':>12}{'share':>8}",
        ]
        parts = self.parts
        for part in PARTS:
            n = parts[part]
            lines.append(f"  {PART_LABELS[part]:<{_W}}{format_bytes(n):>12}{100 * n / peak:>7.1f}%")
            if part == "activations":
                for g in self.activations[:max_groups]:
                    layers = "x" + "x".join(str(n) for n in g.loops) if g.loops else ""
                    module = g.module or "-"
                    text = f"{g.label[:26]:<26} {module[:18]:<18} {layers:>4} {g.dtype:<8}"
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
        if self.at_peak is not None:
            lines.append(f"  {'live at the compiled peak (XLA buffer assignment)':<{_W}}"
                         f"{format_bytes(self.live_peak_bytes or 0):>12}")  # fmt: skip
            for part, n in self.at_peak.items():
                if n:
                    lines.append(f"    {PEAK_LABELS[part]:<{_W - 2}}{format_bytes(n):>12}")
            lines.append(f"    {'unused room between them (packing)':<{_W - 2}}"
                         f"{format_bytes(self.packing_bytes or 0):>12}")  # fmt: skip
        if self.host_bytes:
            lines.append(
                f"  {'host memory (offloaded, not in the peak)':<{_W}}"
                f"{format_bytes(self.host_bytes):>12}"
            )
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


def shapes_text(batch: Any) -> str:
    """`[((8, 16), "float32"), ...]` as `"(8, 16) float32, ..."`."""
    return ", ".join(f"{tuple(s)} {d}" for s, d in batch)
