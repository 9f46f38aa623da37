"""Which combination of remat, micro-batches, precision, sharding and density fits a memory
budget, fastest."""

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from ..nn._remat import PRESETS as REMAT_PRESETS
from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy, get_policy
from ..train._config import StepConfig, step_config as resolve_step_config
from ..train._make_step import SHARDS
from ._candidates import BudgetError, Plan, _choose, _throughput
from ._cost import THROUGHPUTS, Throughput
from ._inspect import batch_structs
from ._report import target_mesh
from ._search import Compiler, Search, Spec
from ._target import Target, as_target
from ._units import format_bytes, parse_size

ACCUMULATES: tuple[int, ...] = (1, 2, 4, 8)
PRECISIONS: tuple[str, ...] = ("float32", "mixed_bf16")
PEAKS: tuple[str, ...] = ("compiled", "accelerator")


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


_MAKE_MODEL = """\
plan(make_model=...) takes a function that builds the model for a remat setting, got a
{got}: the planner builds one model per candidate (remat changes the model).

    el.memory.plan(model, loss, optimizer, batch, budget="8GiB")            # wrong
    el.memory.plan(lambda remat: make(remat=remat, key=key), loss, optimizer, batch,
                   budget="8GiB")                                           # right
"""


def plan(
    make_model: Callable[[Any], PyTree],
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch: Any,
    *,
    budget: int | np.integer | str | None = None,
    remats: Sequence[Any] | None = None,
    accumulates: Sequence[int] = ACCUMULATES,
    precisions: Sequence[str | Policy] = PRECISIONS,
    densities: Sequence[float | None] = (None,),
    mesh: Mesh | None = None,
    data_axis: str = "data",
    shards: Sequence[str] | None = None,
    target: Target | str | os.PathLike | None = None,
    peak: str = "compiled",
    measure: bool = False,
    steps: int = 3,
    rank_for: str | Throughput | None = None,
    loss_scale: DynamicLossScale | Literal["auto"] | None = "auto",
    key: PRNGKeyArray | None = None,
    progress: Callable[[str], None] | None = None,
    prune: bool = True,
    step_config: StepConfig | None = None,
) -> Plan:
    """The fastest combination of remat, micro-batches, precision (and, with a mesh,
    sharding; with densities, sparsity) that fits `budget`.

    Compiles the training step of every combination without running it (`memory_report`
    of each), keeps those whose predicted peak is at most `budget`, and returns the fastest.

    How "fastest" is judged: by default by an estimate of the step's time on the device kind
    planned for (`rank_for`; by default the backend compiled on, or a GPU with
    `peak="accelerator"` on XLA:CPU): the arithmetic each step asks for, counted on its
    jaxpr with every loop as many times as it runs , each
    kind at its rate (on a GPU 16-bit matrix products run
    at twice float32's rate, on XLA:CPU at half of it). With a GPU `target` (`"h100"`,
    `"a100-40gb"`, ...) every candidate is compiled for that GPU, on any machine, and ranked
    for a GPU; the budget defaults to what XLA may use of its memory. Recomputation adds
    matrix products (`remat=True` costs the guide's transformer a quarter more);
    micro-batches add almost nothing, and equal estimates go to fewer micro-batches, then to
    replicated parameters, then to the smaller peak. An estimate does not see how well each
    kernel runs, or that very small micro-batches use an accelerator poorly: with
    `measure=True` the fitting candidates are timed on this device instead and ranked by
    median seconds per step.
    Sparsity changes the model, so the densest fitting density always wins.

    Monotone: a smaller budget never returns a candidate with a larger peak (the fitting
    set only shrinks, and the ranking is a fixed total order).

    Memory and time: nothing is allocated (with `measure=False`); a trace of each candidate
    that could be next and one compilation of each that can decide the answer (`prune`;
    on XLA:CPU a 16-bit candidate also needs its float32-compute twin for the GPU/TPU
    estimate): the guide's transformer for an A100 took 48 s on two CPU cores
    (`benchmarks/results/memory.json`), compiling every one of its 32 candidates a few
    minutes; `progress` hears of each compile.
    `measure=True` builds each fitting model and runs `steps + 1` steps of it.

    Args:
        make_model: `make_model(remat)` returns the model built with that recomputation
            setting (e.g. `lambda remat: transformer_encoder(..., remat=remat, key=key)`).
            It is called inside `eqx.filter_eval_shape`, so no weights are allocated.
        loss_fn: the loss, as `make_step`'s.
        optimizer: an optax optimizer.
        batch: the whole batch of one update: a tuple of arrays or `jax.ShapeDtypeStruct`s.
        budget: bytes (per device with a mesh), or a size such as `"2GiB"`, `"1.5GB"`.
            Default: the target's memory times the share XLA may use (JAX's default 0.75,
            or `XLA_PYTHON_CLIENT_MEM_FRACTION`; `Target(..., mem_fraction=)`), as the plan
            says (`Plan.budget_from`); needed for a target of unknown memory (XLA:CPU).
        remats: recomputation settings to try. Default: every remat preset (`"none"`, `"full"`,
            `"dots"`, `"minimal"`, `"minimal_offloaded"`);
            on XLA:CPU without `"minimal_offloaded"` (the CPU drops its host placement, so
            it compiles to `"minimal"` there).
        accumulates: numbers of micro-batches to try (ints >= 1); those that do not divide
            the batch (times the devices) are skipped (listed in `Plan.skipped`).
        precisions: precision preset names or `Policy`s to try.
        densities: sparse densities to try, `None` for the dense model: each other value
            makes the model sparse with `eqx_lowmem.sparse.sparsify(model, density, key=key)`.
        mesh: plan per device of this mesh (`memory_report`'s).
        data_axis: the mesh axis the batch (and with FSDP the parameters) is split over.
        shards: `"data"` and/or `"fsdp"` to try; default both with a mesh, `("data",)`
            without one.
        target: the device planned for (`memory_report`'s): None or `"cpu"` for this
            process's backend, a GPU name (`"h100"`, `"a100-40gb"`, ...; needs
            `eqx-lowmem[gpu-plan]`), a `GpuTargetConfigProto` file, `"attached"`, or a
            `Target` (with `devices=` for several).
        peak: which peak must fit: `"compiled"`, the target's compiled peak (trusted for
            it), or `"accelerator"`, `MemoryReport`'s GPU/TPU estimate from an XLA:CPU
            compile (the rough figure of planning for a GPU without `target`).
        measure: rank the fitting candidates by measured seconds per step on this device.
        steps: timed steps per candidate with `measure=True` (after one untimed step).
        rank_for: the device kind the estimate ranks for, `"cpu"`, `"gpu"`, `"tpu"`, or a
            `Throughput` of one's own.
        loss_scale: as `make_step`'s.
        key: PRNG key for the state, dropout, sparsity and measured batches.
        progress: called with one line per candidate as it is compiled (the CLI prints
            them), e.g. `progress=print`.
        prune: compile only what can decide the answer (the same answer as `prune=False`):
            no candidate whose state and batch alone exceed the budget, and none ranked
            below the first that fits (each that could be next is traced for its
            estimated time first, a fraction of a compile: of the candidates that differ
            only in `accumulate`, one at a time from the fewest micro-batches).
            `Plan.pruned` lists the rest; `Plan.within` then answers only for budgets the
            pruned ones cannot change. `prune=False` compiles every candidate (a table of
            them all; `within` for any budget).
        step_config: the step's other options in one `eqx_lowmem.train.StepConfig` (the
            value a `Trainer` and `memory_report` take), instead of `mesh`, `data_axis`
            and `loss_scale` (then left at their defaults): every candidate is that step
            with the `accumulate`, `precision` and `shard` searched (`accumulates`,
            `precisions`, `shards`), its `accumulate_dtype`, `fuse_accumulation` and
            `after_update` hook (and its state) included. A stateful model
            (`has_state=True`) is not planned.

    Returns:
        A `Plan`: `plan.best` (its `remat`, `accumulate`, `precision`, `report`),
        `plan.candidates`, `print(plan)` for the table.

    Raises:
        BudgetError: when no candidate fits; it names the smallest peak found, its
            combination and its largest part, and holds every candidate.
        ValueError: for an empty search space, an accumulate below 1, a density outside
            (0, 1], an unknown shard, target or peak, an unparseable budget, or no budget
            for a target of unknown memory.
        ImportError: for a GPU target without the CUDA plugin (`eqx-lowmem[gpu-plan]`).

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
    if isinstance(make_model, eqx.Module) or not callable(make_model):
        raise TypeError(_MAKE_MODEL.format(got=type(make_model).__name__))
    config = resolve_step_config(step_config, mesh=mesh, data_axis=data_axis, loss_scale=loss_scale)
    if config.has_state:
        raise ValueError(
            "plan does not plan a stateful model (step_config.has_state=True): report on its "
            "step with el.memory.memory_report(..., model_state=..., step_config=...)."
        )
    mesh, data_axis = config.mesh, config.data_axis
    if target in PEAKS:  # the name of `peak` before targets were devices
        warnings.warn(
            f"plan(target={target!r}) is now plan(peak={target!r}); target= names the device "
            "planned for (e.g. 'h100').",
            DeprecationWarning,
            stacklevel=2,
        )
        target, peak = None, str(target)
    target = as_target(target)
    budget_bytes, budget_from = _budget(budget, target)
    remats, accumulates, precisions, densities, shards = _search_space(
        remats, accumulates, precisions, densities, mesh, shards, peak, rank_for, measure, steps
    )
    if measure and target.compile_only:
        raise ValueError(
            f"measure=True times each candidate, but target={target.name!r} is compiled for "
            "only; plan on the GPU itself with target='attached', or rank by the estimate."
        )
    mesh = target_mesh(target, mesh, data_axis)
    key = jr.PRNGKey(0) if key is None else key
    devices = 1 if mesh is None else int(mesh.shape.get(data_axis, 1))
    structs, size = batch_structs(batch, 1)
    usable, skipped = _dividing(accumulates, size, devices)
    specs = [
        Spec(i, remat, density, get_policy(precision), accumulate, shard)
        for i, remat in enumerate(remats)
        for density in densities
        for precision in precisions
        for accumulate in usable
        for shard in shards
    ]
    compiler = Compiler(loss_fn, optimizer, config.replace(mesh=mesh), structs, key, remats,
                        target)  # fmt: skip
    search = Search(compiler, make_model, budget_bytes, peak, measure, steps, progress, len(specs))
    if prune:
        candidates, pruned = search.pruned(specs, _throughput(peak, target.backend, rank_for))
    else:
        candidates, pruned = [search.judge(spec) for spec in specs], []
    if not candidates:  # every one pruned for its state and batch alone
        raise BudgetError(
            f"no combination fits budget={format_bytes(budget_bytes)} ({budget_bytes} bytes): "
            + "; ".join(pruned)
            + ". Raise the budget, or shrink the model's state (shard='fsdp' over devices, "
            "16-bit state, a smaller model).",
            (),
            None,
        )
    candidates = tuple(candidates)
    return _choose(
        Plan(
            best=candidates[0],
            candidates=candidates,
            budget=budget_bytes,
            peak=peak,
            ranked_by="measured" if measure else "estimate",
            backend=target.backend,
            rank_for=rank_for,
            skipped=skipped,
            device=target.describe(),
            budget_from=budget_from,
            pruned=tuple(pruned),
        )
    )


def _budget(budget: int | np.integer | str | None, target: Target) -> tuple[int, str]:
    """(the budget in bytes, where it came from: "" when given)."""
    if budget is not None:
        return parse_size(budget, "budget"), ""
    usable = target.budget_bytes
    if usable is None:
        raise ValueError(
            f"plan needs budget= for target={target.name!r}, whose memory is unknown; e.g. "
            "budget='16GiB', or a GPU target such as target='h100', whose memory sets it."
        )
    memory = target.memory_bytes
    return usable, (
        f"{format_bytes(usable)} = {target.fraction:g} x {format_bytes(memory)} of "
        f"{target.description}, the share of its memory XLA may use (give budget= to choose)"
    )


def _search_space(remats, accumulates, precisions, densities, mesh, shards, peak, rank_for,
                  measure, steps) -> tuple[tuple, ...]:  # fmt: skip
    """`plan`'s arguments checked, as (remats, accumulates, precisions, densities, shards)
    tuples with the defaults filled in."""
    if peak not in PEAKS:
        raise ValueError(f"peak={peak!r}; expected one of {PEAKS}.")
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
    return remats, accumulates, precisions, densities, shards


def _dividing(accumulates: tuple, size: int, devices: int) -> tuple[list, tuple[str, ...]]:
    """(the accumulates that divide the batch of `size` over `devices`, why each other one
    is skipped); a ValueError when none does."""
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
    return usable, skipped
