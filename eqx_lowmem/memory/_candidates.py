"""A plan's answer: the candidates it compiled, the order that ranks them, the `Plan`
holding the best that fits, and the `BudgetError` when none does."""

import dataclasses
import json
import math
import os
from typing import Any

from .._io import write_json
from ..train._make_step import SHARDS
from ._cost import THROUGHPUTS, Throughput, relative_time
from ._result import PART_ADVICE, PART_LABELS, MemoryReport
from ._units import format_bytes, format_flops, parse_size, remat_text


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One combination the planner compiled.

    Attributes:
        remat: the `remat` given to `make_model` (a remat preset name, a bool,
            or a `Save`).
        accumulate: number of micro-batches per batch.
        precision: the precision preset's name (or the `Policy`'s repr).
        shard: `"data"` (replicated parameters) or `"fsdp"` (sharded), with a mesh.
        density: the sparse layers' density (`eqx_lowmem.sparse.sparsify`), None for dense.
        report: its full `MemoryReport` (per device with a mesh).
        budget: the budget in bytes it was judged against.
        peak: which peak must fit: `"compiled"` or `"accelerator"`.
        seconds: the measured median seconds per step with `measure=True`, else None.
    """

    remat: Any
    accumulate: int
    precision: str
    shard: str
    density: float | None
    report: MemoryReport
    budget: int
    peak: str
    seconds: float | None = None

    @property
    def peak_bytes(self) -> int:
        """The peak compared with the budget: the compiled one, or the GPU/TPU estimate."""
        r = self.report
        return r.peak_bytes if self.peak == "compiled" else r.accelerator_peak_bytes

    @property
    def fits(self) -> bool:
        """`peak_bytes <= budget`."""
        return self.peak_bytes <= self.budget

    @property
    def flops(self) -> float:
        """The step's arithmetic (`report.cost.flops`, every loop counted)."""
        return self.report.cost.flops

    @property
    def compute_dtype(self) -> str:
        """The dtype the forward and backward passes compute in."""
        return self.report.config["compute_dtype"]

    @property
    def label(self) -> str:
        text = (
            f"remat={remat_text(self.remat)}, accumulate={self.accumulate}, "
            f"precision={self.precision}"
        )
        if self.shard != "data":
            text += f", shard={self.shard}"
        if self.density is not None:
            text += f", density={self.density:g}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "remat": remat_text(self.remat),
            "accumulate": self.accumulate,
            "precision": self.precision,
            "shard": self.shard,
            "density": self.density,
            "peak_bytes": self.peak_bytes,
            "flops": self.flops,
            "seconds": self.seconds,
            "fits": self.fits,
            "dominant": self.report.dominant[0],
            "report": self.report.to_dict(),
        }


def rank_device(peak: str, backend: str, rank_for: str | Throughput | None) -> str:
    """The device kind a plan ranks for: `rank_for`, else the backend compiled on, or
    `"gpu"` when planning on XLA:CPU for an accelerator (`peak="accelerator"`)."""
    if isinstance(rank_for, Throughput):
        return "custom"
    if rank_for is not None:
        return rank_for
    return "gpu" if peak == "accelerator" and backend == "cpu" else backend


def _throughput(peak: str, backend: str, rank_for: str | Throughput | None) -> Throughput:
    if isinstance(rank_for, Throughput):
        return rank_for
    return THROUGHPUTS.get(rank_device(peak, backend, rank_for), THROUGHPUTS["gpu"])


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen combination and every candidate.

    Attributes:
        best: the fastest candidate that fits (the densest, with sparse densities).
        candidates: every candidate compiled, in search order, judged against `budget`.
        budget: the budget in bytes.
        peak: which peak was compared with the budget: `"compiled"` (the figure of the
            backend that compiled it) or `"accelerator"` (the GPU/TPU estimate).
        ranked_by: `"estimate"` (the estimated time on `rank_for`'s device kind) or
            `"measured"` (seconds per step, timed here).
        backend: the backend the candidates were compiled (and measured) on.
        rank_for: the device kind (`"cpu"`, `"gpu"`, `"tpu"`) or `Throughput` the
            estimate ranks for; None: the backend, or `"gpu"` for `peak="accelerator"`
            on XLA:CPU.
        skipped: accumulate values left out, with the reason.
        device: the device planned for (`Target.describe()`), e.g. `"NVIDIA A100-SXM4-40GB
            (compile-only target 'a100-40gb')"`.
        budget_from: where the budget came from when not given: the target's memory times
            the share XLA may use; `""` when given.
        pruned: the candidates not compiled (`plan(prune=True)`), each with why: its state
            and batch alone exceed the budget, or it ranks below the choice.
    """

    best: Candidate
    candidates: tuple[Candidate, ...]
    budget: int
    peak: str
    ranked_by: str
    backend: str
    rank_for: str | Throughput | None = None
    skipped: tuple[str, ...] = ()
    device: str = ""
    budget_from: str = ""
    pruned: tuple[str, ...] = ()

    def within(self, budget: int | str):
        """The same candidates chosen under another budget, without compiling again.

        Raises:
            BudgetError: when none fits `budget`.
            ValueError: for a measured plan, when a candidate that did not fit the first
                budget (and so was not timed) fits the new one.
        """
        budget_bytes = parse_size(budget)
        self._check_pruned(budget_bytes)
        candidates = tuple(
            dataclasses.replace(c, budget=budget_bytes, peak=self.peak) for c in self.candidates
        )
        untimed = [
            c for c in candidates if self.ranked_by == "measured" and c.seconds is None and c.fits
        ]
        if untimed:
            raise ValueError(
                f"{untimed[0].label} fits budget={format_bytes(budget_bytes)} but was not timed "
                f"(it did not fit the first budget, {format_bytes(self.budget)}); call plan(..., "
                "measure=True) again with the larger budget."
            )
        return _choose(dataclasses.replace(self, candidates=candidates, budget=budget_bytes))

    def _check_pruned(self, budget: int) -> None:
        """A ValueError where candidates this plan did not compile could change the answer
        under `budget`: a smaller budget (the choice may no longer fit), or one that admits
        a candidate pruned for its state and batch alone."""
        admitted = [p for p in self.pruned if "state and batch" in p]
        slower = len(admitted) < len(self.pruned)
        if (slower and budget < self.budget) or (admitted and budget > self.budget):
            raise ValueError(
                f"this plan compiled only what decides budget={format_bytes(self.budget)} "
                f"({len(self.pruned)} candidates pruned); for budget={format_bytes(budget)} "
                "call plan again, or plan(..., prune=False) to compile every candidate."
            )

    def estimated(self, c: Candidate) -> float:
        """`c`'s estimated step time relative to the best's (1.0 for the best)."""
        rate = _throughput(self.peak, self.backend, self.rank_for)
        best = relative_time(self.best.report.cost, rate)
        return relative_time(c.report.cost, rate) / max(best, 1e-30)

    def ranking(self) -> str:
        """What the ranking is based on, in words."""
        if self.ranked_by == "measured":
            return f"measured seconds per step on {self.backend}"
        device = rank_device(self.peak, self.backend, self.rank_for)
        t = _throughput(self.peak, self.backend, self.rank_for)
        return (
            f"estimated step time on a {device.upper()} from the step's FLOPs (16-bit matrix "
            f"products at {t.matmul16 / t.matmul32:.2g}x float32's rate, other work at "
            f"{t.other32 / t.matmul32:.2g}x; measure=True times them instead)"
        )

    def table(self) -> str:
        """All candidates, fastest first among those that fit, then those that do not."""
        timed = self.ranked_by == "measured"
        sharded = any(c.shard != "data" for c in self.candidates)
        sparse = any(c.density is not None for c in self.candidates)
        head = (
            f"  {'remat':<10}{'accum':>6}  {'precision':<12}"
            + (f"{'shard':<6}" if sharded else "")
            + (f"{'density':>8}" if sparse else "")
            + f"{'peak':>12}{'FLOPs':>10}"
            + (f"{'s/step':>9}" if timed else f"{'est.':>8}")
            + f"  {'fits':<5}{'largest part':<22}"
        )
        lines = [
            f"Plan for a budget of {format_bytes(self.budget)} ({self.peak} peak"
            + (", per device" if self.candidates[0].report.config.get("devices", 1) > 1 else "")
            + (f" of {self.device}" if self.device else "")
            + f"): {self.best.label}",
            *([f"Budget: {self.budget_from}."] if self.budget_from else []),
            f"Ranked by {self.ranking()}.",
            head,
        ]
        order = sorted(self.candidates, key=lambda c: (not c.fits, *_rank(c, self)))
        for c in order:
            part, n = c.report.dominant
            mark = " <- best" if c is self.best else ""
            if timed:
                speed = f"{c.seconds:>9.4f}" if c.seconds is not None else f"{'-':>9}"
            else:
                speed = f"{self.estimated(c):>7.2f}x"
            lines.append(
                f"  {remat_text(c.remat):<10}{c.accumulate:>6}  {c.precision:<12}"
                + (f"{c.shard:<6}" if sharded else "")
                + (f"{'-' if c.density is None else f'{c.density:g}':>8}" if sparse else "")
                + f"{format_bytes(c.peak_bytes):>12}{format_flops(c.flops):>10}"
                + speed
                + f"  {'yes' if c.fits else 'no':<5}{part + ' ' + format_bytes(n):<22}{mark}"
            )
        if not timed:
            lines.append("  (est.: estimated time relative to the best)")
        lines += [f"  skipped: {s}" for s in self.skipped]
        lines += [f"  not compiled: {p}" for p in self.pruned]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "peak": self.peak,
            "ranked_by": self.ranked_by,
            "ranking": self.ranking(),
            "backend": self.backend,
            "device": self.device,
            "budget_from": self.budget_from,
            "best": self.candidates.index(self.best),
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": list(self.skipped),
            "pruned": list(self.pruned),
        }

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The plan as JSON text; with `path`, also written there atomically."""
        payload = self.to_dict()
        if path is not None:
            write_json(path, payload)
        return json.dumps(payload, indent=2)


def _rank(c: Candidate, plan: Plan) -> tuple:
    """A fixed total order of candidates, so that smaller budgets never pick larger peaks.

    Densest first (sparsity changes the model: a sparser one only when no denser fits);
    then by measured seconds (`measure=True`) or by the estimated time of the step on the
    device kind ranked for (`relative_time` of its FLOPs, matrix products and other work,
    each at its dtype's rate); equal ones go to fewer micro-batches, replicated parameters
    (no gathers), fewer FLOPs, and the smaller peak.
    """
    if plan.ranked_by == "measured":
        speed = c.seconds if c.seconds is not None else math.inf
    else:
        speed = relative_time(c.report.cost, _throughput(plan.peak, plan.backend, plan.rank_for))
    return (*rank_key(c.density, speed, c.accumulate, c.shard, c.flops), c.peak_bytes)


def rank_key(density: float | None, speed: float, accumulate: int, shard: str,
             flops: float) -> tuple:  # fmt: skip
    """`_rank` without the peak: what a candidate's rank is before it is compiled."""
    return (-(1.0 if density is None else density), speed, accumulate, SHARDS.index(shard), flops)


def _choose(plan: Plan) -> Plan:
    """`plan` with its best fitting candidate, or a `BudgetError`."""
    candidates = plan.candidates
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.peak_bytes)
        part, n = smallest.report.dominant
        raise BudgetError(
            f"no combination fits budget={format_bytes(plan.budget)} ({plan.budget} bytes): "
            f"the smallest {plan.peak} peak found is {format_bytes(smallest.peak_bytes)}, "
            f"with {smallest.label}, and its largest part is {PART_LABELS[part]} "
            f"({format_bytes(n)}, {100 * n / max(smallest.peak_bytes, 1):.0f}%). Raise the "
            f"budget to at least {format_bytes(smallest.peak_bytes)}, or shrink the "
            f"{PART_LABELS[part]}: {PART_ADVICE[part]}.",
            candidates,
            smallest,
        )
    return dataclasses.replace(plan, best=min(fitting, key=lambda c: _rank(c, plan)))


class BudgetError(ValueError):
    """No candidate fits the budget. `candidates` holds those compiled, `smallest` the lowest
    peak (None when none was compiled: each one's state and batch alone exceed the budget)."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...], smallest: Candidate | None):
        super().__init__(message)
        self.candidates = candidates
        self.smallest = smallest
