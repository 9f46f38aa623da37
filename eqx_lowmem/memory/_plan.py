"""Which combination of remat, micro-batches and precision fits a memory budget, fastest."""

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
from jaxtyping import PRNGKeyArray, PyTree

from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy, get_policy
from ..train._step import make_step
from ._io import write_json
from ._report import (
    PART_ADVICE,
    PART_LABELS,
    MemoryReport,
    _check_batch,
    _precision_name,
    float32_twin,
    random_batch,
    step_report,
)
from ._units import format_bytes, parse_size

REMATS: tuple[Any, ...] = (False, "minimal", "dots", True)
ACCUMULATES: tuple[int, ...] = (1, 2, 4, 8)
PRECISIONS: tuple[str, ...] = ("float32", "mixed_bf16")


def _remat_text(remat: Any) -> str:
    if remat is False:
        return "none"
    if remat is True:
        return "full"
    return str(remat)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One combination the planner compiled.

    Attributes:
        remat: the `remat` given to `make_model` (`False`, `"minimal"`, `"dots"`, `True`, ...).
        accumulate: number of micro-batches per batch.
        precision: the precision preset's name (or the `Policy`'s repr).
        compute_dtype: the dtype the forward and backward passes compute in.
        peak_bytes: the peak the plan compared with the budget (`target`).
        flops: the step's arithmetic (`report.cost.flops`, every loop counted).
        seconds: the measured median seconds per step with `measure=True`, else None.
        fits: `peak_bytes <= budget`.
        report: its full `MemoryReport`.
    """

    remat: Any
    accumulate: int
    precision: str
    compute_dtype: str
    peak_bytes: int
    flops: float
    seconds: float | None
    fits: bool
    report: MemoryReport

    @property
    def label(self) -> str:
        return (
            f"remat={_remat_text(self.remat)}, accumulate={self.accumulate}, "
            f"precision={self.precision}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "remat": _remat_text(self.remat),
            "accumulate": self.accumulate,
            "precision": self.precision,
            "compute_dtype": self.compute_dtype,
            "peak_bytes": self.peak_bytes,
            "flops": self.flops,
            "seconds": self.seconds,
            "fits": self.fits,
            "dominant": self.report.dominant[0],
            "report": self.report.to_dict(),
        }


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen combination and every candidate.

    Attributes:
        best: the fastest candidate that fits.
        candidates: every candidate compiled, in search order.
        budget: the budget in bytes.
        target: which peak was compared with the budget: `"compiled"` (the figure of the
            backend that compiled it) or `"accelerator"` (the GPU/TPU estimate).
        ranked_by: `"flops"` or `"measured"`.
        backend: the backend the candidates were compiled (and measured) on.
        skipped: accumulate values left out, with the reason.
    """

    best: Candidate
    candidates: tuple[Candidate, ...]
    budget: int
    target: str
    ranked_by: str
    backend: str
    skipped: tuple[str, ...] = ()

    def within(self, budget: "int | str") -> "Plan":
        """The same candidates chosen under another budget, without compiling again.

        Raises:
            BudgetError: when none fits `budget`.
            ValueError: for a measured plan, when a candidate that did not fit the first
                budget (and so was not timed) fits the new one.
        """
        budget_bytes = parse_size(budget)
        untimed = [
            c
            for c in self.candidates
            if self.ranked_by == "measured" and c.seconds is None and c.peak_bytes <= budget_bytes
        ]
        if untimed:
            raise ValueError(
                f"{untimed[0].label} fits budget={format_bytes(budget_bytes)} but was not timed "
                f"(it did not fit the first budget, {format_bytes(self.budget)}); call plan(..., "
                "measure=True) again with the larger budget."
            )
        return _choose(
            self.candidates, budget_bytes, self.target, self.ranked_by, self.backend, self.skipped
        )

    def _rank(self, c: Candidate) -> tuple:
        return _rank(c, self.ranked_by, self.target, self.backend)

    def table(self) -> str:
        """All candidates, fastest first among those that fit, then those that do not."""
        timed = self.ranked_by == "measured"
        head = (
            f"  {'remat':<10}{'accum':>6}  {'precision':<12}{'peak':>12}{'FLOPs':>10}"
            + (f"{'s/step':>9}" if timed else "")
            + f"  {'fits':<5}{'largest part':<22}"
        )
        lines = [
            f"Plan for a budget of {format_bytes(self.budget)} ({self.target} peak, ranked by "
            f"{self.ranked_by}): {self.best.label}",
            head,
        ]
        order = sorted(self.candidates, key=lambda c: (not c.fits, *self._rank(c)))
        for c in order:
            part, n = c.report.dominant
            mark = " <- best" if c is self.best else ""
            lines.append(
                f"  {_remat_text(c.remat):<10}{c.accumulate:>6}  {c.precision:<12}"
                f"{format_bytes(c.peak_bytes):>12}{_flops_text(c.flops):>10}"
                + (f"{c.seconds:>9.4f}" if timed and c.seconds is not None else "")
                + (f"{'-':>9}" if timed and c.seconds is None else "")
                + f"  {'yes' if c.fits else 'no':<5}{part + ' ' + format_bytes(n):<22}{mark}"
            )
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "target": self.target,
            "ranked_by": self.ranked_by,
            "backend": self.backend,
            "best": self.candidates.index(self.best),
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": list(self.skipped),
        }

    def to_json(self, path: "str | os.PathLike[str] | None" = None) -> str:
        """The plan as JSON text; with `path`, also written there atomically."""
        payload = self.to_dict()
        if path is not None:
            write_json(path, payload)
        return json.dumps(payload, indent=2)


def _flops_text(flops: "int | float") -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} "


def _rank(c: Candidate, ranked_by: str, target: str, backend: str) -> tuple:
    """The order of candidates: a fixed total order, so smaller budgets never pick larger peaks.

    By the FLOPs of matrix products (the bulk of a step's time; equal across precisions and
    numbers of micro-batches, larger with recomputation); equal ones go to fewer
    micro-batches (larger matrix products use the hardware better), then to 16-bit compute
    on an accelerator (tensor cores) or to float32 compute on XLA:CPU (which emulates 16-bit
    types in float32), then to fewer FLOPs in all (element-wise recomputation), then to the
    smaller peak. Measured: by seconds, then peak.
    """
    if ranked_by == "measured":
        return (c.seconds if c.seconds is not None else math.inf, c.peak_bytes)
    itemsize = np.dtype(c.compute_dtype).itemsize
    accelerator = target == "accelerator" or backend != "cpu"
    return (
        c.report.cost.matmul_flops,
        c.accumulate,
        itemsize if accelerator else -itemsize,
        c.flops,
        c.peak_bytes,
    )


def _choose(
    candidates: tuple[Candidate, ...],
    budget: int,
    target: str,
    ranked_by: str,
    backend: str,
    skipped: tuple[str, ...],
) -> Plan:
    candidates = tuple(dataclasses.replace(c, fits=c.peak_bytes <= budget) for c in candidates)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.peak_bytes)
        part, n = smallest.report.dominant
        raise BudgetError(
            f"no combination fits budget={format_bytes(budget)} ({budget} bytes): "
            f"the smallest {target} peak found is {format_bytes(smallest.peak_bytes)}, with "
            f"{smallest.label}, and its largest part is {PART_LABELS[part]} "
            f"({format_bytes(n)}, {100 * n / max(smallest.peak_bytes, 1):.0f}%). Raise the "
            f"budget to at least {format_bytes(smallest.peak_bytes)}, or shrink the "
            f"{PART_LABELS[part]}: {PART_ADVICE[part]}.",
            candidates,
            smallest,
        )
    best = min(fitting, key=lambda c: _rank(c, ranked_by, target, backend))
    return Plan(
        best=best,
        candidates=candidates,
        budget=budget,
        target=target,
        ranked_by=ranked_by,
        backend=backend,
        skipped=skipped,
    )


class BudgetError(ValueError):
    """No candidate fits the budget. `candidates` holds them all, `smallest` the lowest peak."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...], smallest: Candidate):
        super().__init__(message)
        self.candidates = candidates
        self.smallest = smallest


def _time_step(step, model, structs, key, steps: int) -> float:
    """Median seconds of `steps` steps after one untimed step (which compiles)."""
    state = step.init(model, key=key)
    batch = random_batch(structs, jr.fold_in(key, 1))
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plan(
    make_model: Callable[[Any], PyTree],
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch: Any,
    *,
    budget: "int | str",
    remats: Sequence[Any] = REMATS,
    accumulates: Sequence[int] = ACCUMULATES,
    precisions: "Sequence[str | Policy]" = PRECISIONS,
    target: str = "compiled",
    measure: bool = False,
    steps: int = 3,
    loss_scale: "DynamicLossScale | Literal['auto'] | None" = "auto",
    key: PRNGKeyArray | None = None,
) -> Plan:
    """The fastest combination of remat, micro-batches and precision that fits `budget`.

    Compiles the training step of every combination of `remats` x `accumulates` x
    `precisions` without running it (`memory_report` of each), keeps those whose predicted
    peak is at most `budget`, and returns the fastest.

    How "fastest" is judged: by default, by the arithmetic each step asks for, counted on
    its jaxpr with every loop as many times as it runs (`eqx_lowmem.memory.jaxpr_cost`;
    XLA's `cost_analysis()` counts the body of a loop once, and a step is mostly loops over
    layers and micro-batches). First the FLOPs of matrix products: recomputation adds to
    them (`remat=True` costs the guide's transformer a quarter more), precisions and
    micro-batches do not. Equal ones go to fewer micro-batches (larger matrix products use
    the hardware better), then to 16-bit compute when planning for an accelerator
    (`target="accelerator"` or compiled on a GPU/TPU, where tensor cores run it faster) or
    to float32 compute on XLA:CPU (which emulates 16-bit types), then to fewer FLOPs in all
    (element-wise recomputation), then to the smaller peak. FLOPs do not see how fast each
    kernel runs, or that very small micro-batches use an accelerator poorly: with
    `measure=True` the fitting candidates are timed on this device instead, and ranked by
    median seconds per step.

    Monotone: a smaller budget never returns a candidate with a larger peak (the fitting
    set only shrinks, and the ranking is a fixed total order).

    Memory and time: nothing is allocated (with `measure=False`); one compilation per
    candidate (on XLA:CPU a 16-bit candidate also needs its float32-compute twin for the
    GPU/TPU estimate, which is usually a candidate already): 32 candidates of the guide's
    transformer take a few minutes on two CPU cores. `measure=True` builds each fitting
    model and runs `steps + 1` steps of it.

    Args:
        make_model: `make_model(remat)` returns the model built with that recomputation
            setting (e.g. `lambda remat: transformer_encoder(..., remat=remat, key=key)`).
            It is called inside `eqx.filter_eval_shape`, so no weights are allocated.
        loss_fn, optimizer, loss_scale: as `eqx_lowmem.train.make_step`.
        batch: one batch: a tuple of arrays or `jax.ShapeDtypeStruct`s.
        budget: bytes, or a size such as `"2GiB"`, `"512MiB"`, `"1.5GB"`.
        remats: recomputation settings to try (`eqx_lowmem.nn` presets).
        accumulates: numbers of micro-batches to try; those that do not divide the batch
            are skipped (listed in `Plan.skipped`).
        precisions: `eqx_lowmem.precision.PRESETS` names or `Policy`s to try.
        target: which peak must fit: `"compiled"`, the backend this runs on (trusted for
            it), or `"accelerator"`, the GPU/TPU estimate of `MemoryReport` (planning on a
            laptop for a GPU with 16-bit compute).
        measure: rank the fitting candidates by measured seconds per step on this device.
        steps: timed steps per candidate with `measure=True` (after one untimed step).
        key: PRNG key for the state, dropout and measured batches.

    Returns:
        A `Plan`: `plan.best` (its `remat`, `accumulate`, `precision`, `report`),
        `plan.candidates`, `print(plan)` for the table.

    Raises:
        BudgetError: when no candidate fits; it names the smallest peak found, its
            combination and its largest part, and holds every candidate.
        ValueError: for an empty search space or an unparseable budget.

    Example:
        >>> import jax, jax.numpy as jnp, jax.random as jr, optax
        >>> import eqx_lowmem as el
        >>> def make_model(remat):
        ...     return el.nn.transformer_encoder(2, 32, 4, 64, key=jr.PRNGKey(0), remat=remat)
        >>> x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)
        >>> p = el.memory.plan(make_model, el.train.mse, optax.sgd(0.1), (x, x),
        ...                    budget="4MiB", remats=(False, True), accumulates=(1, 2),
        ...                    precisions=("float32",))
        >>> p.best.peak_bytes <= 4 * 2**20
        True
    """
    budget_bytes = parse_size(budget)
    if target not in ("compiled", "accelerator"):
        raise ValueError(f"target={target!r}; expected 'compiled' or 'accelerator'.")
    if not (remats and accumulates and precisions):
        raise ValueError(
            f"nothing to search: remats={tuple(remats)}, accumulates={tuple(accumulates)}, "
            f"precisions={tuple(precisions)}; give at least one of each."
        )
    if measure and steps < 1:
        raise ValueError(f"steps={steps}; measure=True needs at least one timed step.")
    key = jr.PRNGKey(0) if key is None else key
    structs, size = _check_batch(batch, 1)
    skipped = tuple(
        f"accumulate={a}: does not divide the batch of {size}" for a in accumulates if size % a
    )
    usable = [a for a in accumulates if size % a == 0]
    if not usable:
        raise ValueError(
            f"no accumulate in {tuple(accumulates)} divides the batch of {size}; use divisors."
        )

    # Reports by (remat index, accumulate, policy): on XLA:CPU a 16-bit candidate's GPU/TPU
    # estimate needs its float32-compute twin, which is often a candidate itself.
    reports: dict[tuple, MemoryReport] = {}

    def step_of(accumulate: int, policy: Policy):
        return make_step(
            loss_fn, optimizer, accumulate=accumulate, precision=policy, loss_scale=loss_scale
        )

    def report_of(i: int, model: Any, accumulate: int, policy: Policy) -> MemoryReport:
        if (i, accumulate, policy) not in reports:
            step = step_of(accumulate, policy)
            twin_policy = float32_twin(step.policy)
            # (The twin's loss scale may differ from the step's: a few bytes of state.)
            twin = None if twin_policy is None else report_of(i, model, accumulate, twin_policy)
            name = f"remat={_remat_text(remats[i])} x{accumulate} {_precision_name(policy)}"
            reports[i, accumulate, policy] = step_report(
                step, model, structs, key=key, name=name, twin=twin
            )
        return reports[i, accumulate, policy]

    candidates = []
    for i, remat in enumerate(remats):
        model = eqx.filter_eval_shape(make_model, remat)
        for precision in precisions:
            policy = get_policy(precision)
            for accumulate in usable:
                report = report_of(i, model, accumulate, policy)
                peak = report.peak_bytes if target == "compiled" else report.accelerator_peak_bytes
                seconds = None
                if measure and peak <= budget_bytes:
                    step = step_of(accumulate, policy)
                    seconds = _time_step(step, make_model(remat), structs, key, steps)
                candidates.append(
                    Candidate(
                        remat=remat,
                        accumulate=accumulate,
                        precision=_precision_name(policy),
                        compute_dtype=str(policy.compute_dtype),
                        peak_bytes=peak,
                        flops=report.cost.flops,
                        seconds=seconds,
                        fits=peak <= budget_bytes,
                        report=report,
                    )
                )
    ranked_by = "measured" if measure else "flops"
    return _choose(
        tuple(candidates), budget_bytes, target, ranked_by, jax.default_backend(), skipped
    )
