"""Which combination of remat, micro-batches, precision, sharding and density fits a memory
budget, fastest."""

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.random as jr
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from .._io import write_json
from ..nn import PRESETS as REMAT_PRESETS
from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy, get_policy
from ..train._make_step import SHARDS, make_step
from ._cost import THROUGHPUTS, Throughput, relative_time
from ._inspect import batch_structs, precision_name
from ._measure import time_step
from ._report import float32_twin, step_report
from ._result import PART_ADVICE, PART_LABELS, MemoryReport
from ._units import format_bytes, format_flops, parse_size, remat_text

ACCUMULATES: tuple[int, ...] = (1, 2, 4, 8)
PRECISIONS: tuple[str, ...] = ("float32", "mixed_bf16")
TARGETS: tuple[str, ...] = ("compiled", "accelerator")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One combination the planner compiled.

    Attributes:
        remat: the `remat` given to `make_model` (an `eqx_lowmem.nn.PRESETS` name, a bool,
            or a `Save`).
        accumulate: number of micro-batches per batch.
        precision: the precision preset's name (or the `Policy`'s repr).
        shard: `"data"` (replicated parameters) or `"fsdp"` (sharded), with a mesh.
        density: the sparse layers' density (`eqx_lowmem.sparse.sparsify`), None for dense.
        report: its full `MemoryReport` (per device with a mesh).
        budget: the budget in bytes it was judged against.
        target: which peak must fit: `"compiled"` or `"accelerator"`.
        seconds: the measured median seconds per step with `measure=True`, else None.
    """

    remat: Any
    accumulate: int
    precision: str
    shard: str
    density: float | None
    report: MemoryReport
    budget: int
    target: str
    seconds: float | None = None

    @property
    def peak_bytes(self) -> int:
        """The peak compared with the budget: the compiled one, or the GPU/TPU estimate."""
        r = self.report
        return r.peak_bytes if self.target == "compiled" else r.accelerator_peak_bytes

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


def rank_device(target: str, backend: str, rank_for: str | Throughput | None) -> str:
    """The device kind a plan ranks for: `rank_for`, else the backend compiled on, or
    `"gpu"` when planning on XLA:CPU for an accelerator (`target="accelerator"`)."""
    if isinstance(rank_for, Throughput):
        return "custom"
    if rank_for is not None:
        return rank_for
    return "gpu" if target == "accelerator" and backend == "cpu" else backend


def _throughput(target: str, backend: str, rank_for: str | Throughput | None) -> Throughput:
    if isinstance(rank_for, Throughput):
        return rank_for
    return THROUGHPUTS.get(rank_device(target, backend, rank_for), THROUGHPUTS["gpu"])


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen combination and every candidate.

    Attributes:
        best: the fastest candidate that fits (the densest, with sparse densities).
        candidates: every candidate compiled, in search order, judged against `budget`.
        budget: the budget in bytes.
        target: which peak was compared with the budget: `"compiled"` (the figure of the
            backend that compiled it) or `"accelerator"` (the GPU/TPU estimate).
        ranked_by: `"estimate"` (the estimated time on `rank_for`'s device kind) or
            `"measured"` (seconds per step, timed here).
        backend: the backend the candidates were compiled (and measured) on.
        rank_for: the device kind (`"cpu"`, `"gpu"`, `"tpu"`) or `Throughput` the
            estimate ranks for; None: the backend, or `"gpu"` for `target="accelerator"`
            on XLA:CPU.
        skipped: accumulate values left out, with the reason.
    """

    best: Candidate
    candidates: tuple[Candidate, ...]
    budget: int
    target: str
    ranked_by: str
    backend: str
    rank_for: str | Throughput | None = None
    skipped: tuple[str, ...] = ()

    def within(self, budget: int | str):
        """The same candidates chosen under another budget, without compiling again.

        Raises:
            BudgetError: when none fits `budget`.
            ValueError: for a measured plan, when a candidate that did not fit the first
                budget (and so was not timed) fits the new one.
        """
        budget_bytes = parse_size(budget)
        candidates = tuple(
            dataclasses.replace(c, budget=budget_bytes, target=self.target) for c in self.candidates
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

    def estimated(self, c: Candidate) -> float:
        """`c`'s estimated step time relative to the best's (1.0 for the best)."""
        rate = _throughput(self.target, self.backend, self.rank_for)
        best = relative_time(self.best.report.cost, rate)
        return relative_time(c.report.cost, rate) / max(best, 1e-30)

    def ranking(self) -> str:
        """What the ranking is based on, in words."""
        if self.ranked_by == "measured":
            return f"measured seconds per step on {self.backend}"
        device = rank_device(self.target, self.backend, self.rank_for)
        t = _throughput(self.target, self.backend, self.rank_for)
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
            f"Plan for a budget of {format_bytes(self.budget)} ({self.target} peak"
            + (", per device" if self.candidates[0].report.config.get("devices", 1) > 1 else "")
            + f"): {self.best.label}",
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
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "target": self.target,
            "ranked_by": self.ranked_by,
            "ranking": self.ranking(),
            "backend": self.backend,
            "best": self.candidates.index(self.best),
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": list(self.skipped),
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
    density = 1.0 if c.density is None else c.density
    if plan.ranked_by == "measured":
        speed = c.seconds if c.seconds is not None else math.inf
    else:
        speed = relative_time(c.report.cost, _throughput(plan.target, plan.backend, plan.rank_for))
    return (-density, speed, c.accumulate, SHARDS.index(c.shard), c.flops, c.peak_bytes)


def _choose(plan: Plan) -> Plan:
    """`plan` with its best fitting candidate, or a `BudgetError`."""
    candidates = plan.candidates
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.peak_bytes)
        part, n = smallest.report.dominant
        raise BudgetError(
            f"no combination fits budget={format_bytes(plan.budget)} ({plan.budget} bytes): "
            f"the smallest {plan.target} peak found is {format_bytes(smallest.peak_bytes)}, "
            f"with {smallest.label}, and its largest part is {PART_LABELS[part]} "
            f"({format_bytes(n)}, {100 * n / max(smallest.peak_bytes, 1):.0f}%). Raise the "
            f"budget to at least {format_bytes(smallest.peak_bytes)}, or shrink the "
            f"{PART_LABELS[part]}: {PART_ADVICE[part]}.",
            candidates,
            smallest,
        )
    return dataclasses.replace(plan, best=min(fitting, key=lambda c: _rank(c, plan)))


class BudgetError(ValueError):
    """No candidate fits the budget. `candidates` holds them all, `smallest` the lowest peak."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...], smallest: Candidate):
        super().__init__(message)
        self.candidates = candidates
        self.smallest = smallest


def _check_accumulates(accumulates: Sequence[Any]) -> None:
    bad = [a for a in accumulates if isinstance(a, bool) or not isinstance(a, int) or a < 1]
    if bad:
        raise ValueError(
            f"accumulates={tuple(accumulates)}: {bad[0]!r} is not a number of micro-batches; "
            "expected ints >= 1 (1 = the whole batch at once)."
        )


def _check_densities(densities: Sequence[Any]) -> None:
    for d in densities:
        if d is None:
            continue
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(
                f"densities={tuple(densities)}: {d!r} is not a density; expected None (dense) "
                "or a fraction of weights kept in (0, 1], e.g. (None, 0.3)."
            )


def default_remats() -> tuple[str, ...]:
    """The remat presets a plan tries by default: all of them, less the offloaded one on
    XLA:CPU (which compiles it as its device-only twin)."""
    if jax.default_backend() == "cpu":
        return tuple(r for r in REMAT_PRESETS if "offload" not in r)
    return tuple(REMAT_PRESETS)


def _sparsify(model: Any, density: float | None, key: Any) -> Any:
    if density is None:
        return model
    try:
        from ..sparse import sparsify
    except ImportError as e:
        raise ValueError(
            f"densities with {density!r} need eqx_lowmem.sparse, which this installation "
            "lacks; use densities=(None,)."
        ) from e
    return sparsify(model, density, key=key)


def plan(
    make_model: Callable[[Any], PyTree],
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch: Any,
    *,
    budget: int | str,
    remats: Sequence[Any] | None = None,
    accumulates: Sequence[int] = ACCUMULATES,
    precisions: Sequence[str | Policy] = PRECISIONS,
    densities: Sequence[float | None] = (None,),
    mesh: Mesh | None = None,
    data_axis: str = "data",
    shards: Sequence[str] | None = None,
    target: str = "compiled",
    measure: bool = False,
    steps: int = 3,
    rank_for: str | Throughput | None = None,
    loss_scale: DynamicLossScale | Literal["auto"] | None = "auto",
    key: PRNGKeyArray | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The fastest combination of remat, micro-batches, precision (and, with a mesh,
    sharding; with densities, sparsity) that fits `budget`.

    Compiles the training step of every combination without running it (`memory_report`
    of each), keeps those whose predicted peak is at most `budget`, and returns the fastest.

    How "fastest" is judged: by default by an estimate of the step's time on the device
    kind planned for (`rank_for`; by default the backend compiled on, or a GPU with
    `target="accelerator"` on XLA:CPU): the arithmetic each step asks for, counted on its
    jaxpr with every loop as many times as it runs (`eqx_lowmem.memory.jaxpr_cost`), each
    kind at its rate (`eqx_lowmem.memory.THROUGHPUTS`: on a GPU 16-bit matrix products run
    at twice float32's rate, on XLA:CPU at half of it). Recomputation adds matrix products
    (`remat=True` costs the guide's transformer a quarter more); micro-batches add almost
    nothing, and equal estimates go to fewer micro-batches, then to replicated parameters,
    then to the smaller peak. An estimate does not see how well each kernel runs, or that
    very small micro-batches use an accelerator poorly: with `measure=True` the fitting
    candidates are timed on this device instead and ranked by median seconds per step.
    Sparsity changes the model, so the densest fitting density always wins.

    Monotone: a smaller budget never returns a candidate with a larger peak (the fitting
    set only shrinks, and the ranking is a fixed total order).

    Memory and time: nothing is allocated (with `measure=False`); one compilation per
    candidate (on XLA:CPU a 16-bit candidate also needs its float32-compute twin for the
    GPU/TPU estimate, which is usually a candidate already): 32 candidates of the guide's
    transformer take a few minutes on two CPU cores; `progress` hears of each.
    `measure=True` builds each fitting model and runs `steps + 1` steps of it.

    Args:
        make_model: `make_model(remat)` returns the model built with that recomputation
            setting (e.g. `lambda remat: transformer_encoder(..., remat=remat, key=key)`).
            It is called inside `eqx.filter_eval_shape`, so no weights are allocated.
        loss_fn: the loss, as `make_step`'s.
        optimizer: an optax optimizer.
        batch: the whole batch of one update: a tuple of arrays or `jax.ShapeDtypeStruct`s.
        budget: bytes (per device with a mesh), or a size such as `"2GiB"`, `"1.5GB"`.
        remats: recomputation settings to try. Default: every `eqx_lowmem.nn.PRESETS` name;
            on XLA:CPU without `"minimal_offloaded"` (the CPU drops its host placement, so
            it compiles to `"minimal"` there).
        accumulates: numbers of micro-batches to try (ints >= 1); those that do not divide
            the batch (times the devices) are skipped (listed in `Plan.skipped`).
        precisions: `eqx_lowmem.precision.PRESETS` names or `Policy`s to try.
        densities: sparse densities to try, `None` for the dense model: each other value
            makes the model sparse with `eqx_lowmem.sparse.sparsify(model, density, key=key)`.
        mesh: plan per device of this mesh (`memory_report`'s).
        data_axis: the mesh axis the batch (and with FSDP the parameters) is split over.
        shards: `"data"` and/or `"fsdp"` to try; default both with a mesh, `("data",)`
            without one.
        target: which peak must fit: `"compiled"`, the backend this runs on (trusted for
            it), or `"accelerator"`, the GPU/TPU estimate of `MemoryReport` (planning on a
            laptop for a GPU with 16-bit compute).
        measure: rank the fitting candidates by measured seconds per step on this device.
        steps: timed steps per candidate with `measure=True` (after one untimed step).
        rank_for: the device kind the estimate ranks for, `"cpu"`, `"gpu"`, `"tpu"`, or a
            `Throughput` of one's own.
        loss_scale: as `make_step`'s.
        key: PRNG key for the state, dropout, sparsity and measured batches.
        progress: called with one line per candidate as it is compiled (the CLI prints
            them), e.g. `progress=print`.

    Returns:
        A `Plan`: `plan.best` (its `remat`, `accumulate`, `precision`, `report`),
        `plan.candidates`, `print(plan)` for the table.

    Raises:
        BudgetError: when no candidate fits; it names the smallest peak found, its
            combination and its largest part, and holds every candidate.
        ValueError: for an empty search space, an accumulate below 1, a density outside
            (0, 1], an unknown shard or target, or an unparseable budget.

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
    if target not in TARGETS:
        raise ValueError(f"target={target!r}; expected one of {TARGETS}.")
    if isinstance(rank_for, str) and rank_for not in THROUGHPUTS:
        raise ValueError(
            f"rank_for={rank_for!r}; expected one of {tuple(THROUGHPUTS)}, None or a Throughput."
        )
    if shards is None:
        shards = SHARDS if mesh is not None else ("data",)
    if remats is None:
        remats = default_remats()
    remats, accumulates, precisions = tuple(remats), tuple(accumulates), tuple(precisions)
    densities, shards = tuple(densities), tuple(shards)
    if not (remats and accumulates and precisions and densities and shards):
        raise ValueError(
            f"nothing to search: remats={remats}, accumulates={accumulates}, "
            f"precisions={precisions}, densities={densities}, shards={shards}; give at least "
            "one of each."
        )
    _check_accumulates(accumulates)
    _check_densities(densities)
    bad = [s for s in shards if s not in SHARDS]
    if bad:
        raise ValueError(f"shards={shards}: {bad[0]!r} is not one of {SHARDS}.")
    if measure and steps < 1:
        raise ValueError(f"steps={steps}; measure=True needs at least one timed step.")
    key = jr.PRNGKey(0) if key is None else key
    devices = 1 if mesh is None else int(mesh.shape.get(data_axis, 1))
    structs, size = batch_structs(batch, 1)
    skipped = tuple(
        f"accumulate={a}: does not divide the batch of {size}"
        + (f" over {devices} devices" if devices > 1 else "")
        for a in accumulates
        if size % (a * devices)
    )
    usable = [a for a in accumulates if size % (a * devices) == 0]
    if not usable:
        raise ValueError(
            f"no accumulate in {accumulates} divides the batch of {size}"
            + (f" over {devices} devices" if devices > 1 else "")
            + "; use divisors."
        )
    total = len(remats) * len(densities) * len(precisions) * len(usable) * len(shards)

    # Reports by (remat index, density, accumulate, policy, shard): on XLA:CPU a 16-bit
    # candidate's GPU/TPU estimate needs its float32-compute twin, often a candidate itself.
    reports: dict[tuple, MemoryReport] = {}

    def step_of(accumulate: int, policy: Policy, shard: str) -> Any:
        return make_step(
            loss_fn,
            optimizer,
            accumulate=accumulate,
            precision=policy,
            loss_scale=loss_scale,
            mesh=mesh,
            data_axis=data_axis,
            shard=shard,
        )

    def report_of(where: tuple, model: Any, accumulate: int, policy: Policy, shard: str):
        index = (*where, accumulate, policy, shard)
        if index not in reports:
            step = step_of(accumulate, policy, shard)
            twin_policy = float32_twin(step.policy)
            # (The twin's loss scale may differ from the step's: a few bytes of state.)
            twin = (
                None
                if twin_policy is None
                else report_of(where, model, accumulate, twin_policy, shard)
            )
            i, density = where
            name = f"remat={remat_text(remats[i])} x{accumulate} {precision_name(policy)}"
            name += f" {shard}" if shard != "data" else ""
            name += f" density={density:g}" if density is not None else ""
            reports[index] = step_report(
                step,
                loss_fn,
                model,
                structs,
                key=key,
                name=name,
                twin=twin,
                mesh=mesh,
                data_axis=data_axis,
                shard=shard,
            )
        return reports[index]

    candidates = []
    for i, remat in enumerate(remats):
        for density in densities:
            model = eqx.filter_eval_shape(
                lambda r, d: _sparsify(make_model(r), d, key), remat, density
            )
            for precision in precisions:
                policy = get_policy(precision)
                for accumulate in usable:
                    for shard in shards:
                        t0 = time.perf_counter()
                        report = report_of((i, density), model, accumulate, policy, shard)
                        c = Candidate(
                            remat=remat,
                            accumulate=accumulate,
                            precision=precision_name(policy),
                            shard=shard,
                            density=density,
                            report=report,
                            budget=budget_bytes,
                            target=target,
                        )
                        if measure and c.fits:
                            step = step_of(accumulate, policy, shard)
                            concrete = _sparsify(make_model(remat), density, key)
                            seconds = time_step(step, concrete, structs, key, steps)
                            c = dataclasses.replace(c, seconds=seconds)
                        candidates.append(c)
                        if progress is not None:
                            progress(
                                f"[{len(candidates)}/{total}] {c.label}: peak "
                                f"{format_bytes(c.peak_bytes)}"
                                + (" (fits)" if c.fits else "")
                                + (f", {c.seconds:.4f} s/step" if c.seconds is not None else "")
                                + f" ({time.perf_counter() - t0:.1f} s)"
                            )
    candidates = tuple(candidates)
    return _choose(
        Plan(
            best=candidates[0],
            candidates=candidates,
            budget=budget_bytes,
            target=target,
            ranked_by="measured" if measure else "estimate",
            backend=jax.default_backend(),
            rank_for=rank_for,
            skipped=skipped,
        )
    )
