"""Which of a plan's candidates to compile, and compiling them."""

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import numpy as np
import optax

from ..precision._policy import Policy
from ..train._config import StepConfig
from ._candidates import Candidate, rank_key
from ._cost import Cost, Throughput, jaxpr_cost, relative_time
from ._inspect import precision_name, tree_bytes
from ._measure import time_step
from ._report import _pairs, float32_twin, step_report
from ._result import MemoryReport
from ._target import Target
from ._units import format_bytes, remat_text


def sparsify(model: Any, density: float | None, key: Any) -> Any:
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


@dataclasses.dataclass(frozen=True)
class Spec:
    """One combination to try, before it is compiled."""

    index: int  # of the remat in the plan's remats
    remat: Any
    density: float | None
    policy: Policy
    accumulate: int
    shard: str

    @property
    def label(self) -> str:
        text = f"remat={remat_text(self.remat)}, accumulate={self.accumulate}, "
        text += f"precision={precision_name(self.policy)}"
        text += f", shard={self.shard}" if self.shard != "data" else ""
        return text + (f", density={self.density:g}" if self.density is not None else "")


@dataclasses.dataclass
class Compiler:
    """The steps and reports of a plan's candidates, each compiled once.

    Reports are kept by (remat index, density, accumulate, policy, shard): on XLA:CPU a
    16-bit candidate's GPU/TPU estimate needs its float32-compute twin, often a candidate
    itself."""

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    config: StepConfig  # the step's options; its accumulate, precision and shard searched
    structs: Any
    key: Any
    remats: tuple
    target: Target
    reports: dict[tuple, MemoryReport] = dataclasses.field(default_factory=dict)

    def step(self, accumulate: int, policy: Policy, shard: str) -> Any:
        config = self.config.replace(accumulate=accumulate, precision=policy, shard=shard)
        return config.build(self.loss_fn, self.optimizer)

    def _state(self, model: Any, step: Any) -> Any:
        return eqx.filter_eval_shape(lambda m: step.init(m, key=self.key), model)

    def floor(self, model: Any, spec: Spec) -> int:
        """A lower bound of the candidate's compiled peak, from shapes alone: its state and
        batch on one device, its arguments, held for the whole step."""
        step = self.step(spec.accumulate, spec.policy, spec.shard)
        state = self._state(model, step)
        shardings = None if self.config.mesh is None else step.state_shardings(state)
        local = sum(
            int(np.prod(x.shape if s is None else s.shard_shape(x.shape))) * x.dtype.itemsize
            for x, s in _pairs(state, shardings)
        )
        mesh = self.config.mesh
        devices = 1 if mesh is None else int(mesh.shape.get(self.config.data_axis, 1))
        return int(local + tree_bytes(self.structs) // devices)

    def cost(self, model: Any, spec: Spec) -> Cost:
        """The candidate's arithmetic: `jaxpr_cost` of its traced step (no compile)."""
        step = self.step(spec.accumulate, spec.policy, spec.shard)
        return jaxpr_cost(step.trace(self._state(model, step), self.structs).jaxpr)

    def report(self, where: tuple, model: Any, accumulate: int, policy: Policy, shard: str):
        index = (*where, accumulate, policy, shard)
        if index not in self.reports:
            step = self.step(accumulate, policy, shard)
            twin_policy = float32_twin(step.policy, self.target)
            # (The twin's loss scale may differ from the step's: a few bytes of state.)
            twin = (
                None
                if twin_policy is None
                else self.report(where, model, accumulate, twin_policy, shard)
            )
            i, density = where
            name = f"remat={remat_text(self.remats[i])} x{accumulate} {precision_name(policy)}"
            name += f" {shard}" if shard != "data" else ""
            name += f" density={density:g}" if density is not None else ""
            self.reports[index] = step_report(
                step,
                self.loss_fn,
                model,
                self.structs,
                key=self.key,
                name=name,
                twin=twin,
                mesh=self.config.mesh,
                data_axis=self.config.data_axis,
                shard=shard,
                target=self.target,
            )
        return self.reports[index]


@dataclasses.dataclass
class Search:
    """Compiles a plan's candidates: every one, or only those that can decide the answer."""

    compiler: Compiler
    make_model: Callable[[Any], Any]
    budget: int
    peak: str
    measure: bool
    steps: int
    progress: Callable[[str], None] | None
    total: int
    done: int = 0
    models: dict[tuple, Any] = dataclasses.field(default_factory=dict)

    def model_of(self, spec: Spec) -> Any:
        """The candidate's model, as shapes (one per remat and density)."""
        where = (spec.index, spec.density)
        if where not in self.models:
            key = self.compiler.key
            self.models[where] = eqx.filter_eval_shape(
                lambda r, d: sparsify(self.make_model(r), d, key), spec.remat, spec.density
            )
        return self.models[where]

    def judge(self, spec: Spec) -> Candidate:
        """The candidate compiled (and with `measure`, timed if it fits)."""
        t0 = time.perf_counter()
        c = self.compiler
        where = (spec.index, spec.density)
        report = c.report(where, self.model_of(spec), spec.accumulate, spec.policy, spec.shard)
        candidate = Candidate(
            remat=spec.remat,
            accumulate=spec.accumulate,
            precision=precision_name(spec.policy),
            shard=spec.shard,
            density=spec.density,
            report=report,
            budget=self.budget,
            peak=self.peak,
        )
        if self.measure and candidate.fits:
            step = c.step(spec.accumulate, spec.policy, spec.shard)
            concrete = sparsify(self.make_model(spec.remat), spec.density, c.key)
            seconds = time_step(step, concrete, c.structs, c.key, self.steps)
            candidate = dataclasses.replace(candidate, seconds=seconds)
        self.done += 1
        if self.progress is not None:
            self.progress(_progress_line(candidate, self.done, self.total, t0))
        return candidate

    def pruned(self, specs: list[Spec], rate: Throughput) -> tuple[list[Candidate], list[str]]:
        """(the candidates compiled, why each other one was not).

        Each candidate's arguments (state and batch, per device) are held for the whole
        step: one whose arguments alone exceed the budget cannot fit (a compiled peak is
        never below them). The others are compiled in the order of their estimated time
        (their traced arithmetic: a fraction of a compile) until one fits: the rest rank
        below it (with `measure`, every one left is compiled and timed).

        Only what can be next is traced. More micro-batches do the same arithmetic plus
        the accumulation's work per micro-batch, so a candidate is never estimated faster
        than the same one with fewer (and ranks after it on a tie): each group of
        candidates that differ only in `accumulate` is traced one at a time, from the
        fewest micro-batches, its next traced once the one before has been compiled.
        """
        pruned: list[str] = []
        groups: dict[tuple, list[Spec]] = {}
        for spec in specs:
            # (The bound holds for the compiled peak, not for the GPU/TPU estimate.)
            if self.peak == "compiled":
                floor = self.compiler.floor(self.model_of(spec), spec)
                if floor > self.budget:
                    pruned.append(f"{spec.label}: its state and batch alone take "
                                  f"{format_bytes(floor)}, over the budget")  # fmt: skip
                    continue
            key = (spec.index, spec.density, spec.policy, spec.shard)
            groups.setdefault(key, []).append(spec)
        queue: list[tuple[tuple, int, list[Spec]]] = []  # (rank, arrival, the group's rest)
        arrival = itertools.count()  # equal ranks: the order the specs came in

        def push(rest: list[Spec]) -> None:
            spec = rest[0]
            cost = self.compiler.cost(self.model_of(spec), spec)
            order = rank_key(spec.density, relative_time(cost, rate), spec.accumulate,
                             spec.shard, cost.flops)  # fmt: skip
            heapq.heappush(queue, (order, next(arrival), rest))

        for group in groups.values():
            push(sorted(group, key=lambda spec: spec.accumulate))
        self.total = sum(len(group) for group in groups.values())
        candidates, found = [], None  # found: the rank of the first that fits
        while queue:
            order, _, (spec, *rest) = heapq.heappop(queue)
            if found is not None and not self.measure and order != found:
                pruned.extend(f"{s.label}: estimated slower than the plan's choice"
                              for s in (spec, *rest))  # fmt: skip
                continue
            candidates.append(self.judge(spec))
            if candidates[-1].fits and found is None:
                found = order
            if rest:
                push(rest)
        return candidates, pruned


def _progress_line(c: Candidate, n: int, total: int, t0: float) -> str:
    """The line `progress` hears of the `n`-th candidate, compiled since `t0`."""
    return (
        f"[{n}/{total}] {c.label}: peak "
        f"{format_bytes(c.peak_bytes)}"
        + (" (fits)" if c.fits else "")
        + (f", {c.seconds:.4f} s/step" if c.seconds is not None else "")
        + f" ({time.perf_counter() - t0:.1f} s)"
    )
