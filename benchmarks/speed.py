"""The speed grid: every timed goal, side by side, on a CPU or a GPU (`--device gpu`).

Each configuration builds a training step, checks its first applied update (finite loss and
gradient norm, compared across the configurations that compute the same function), compiles
outside the timer, burns in and times updates synchronised with `jax.block_until_ready`.

- `--device gpu` (a run of at most 8 minutes): the guide's sizes, each configuration in a
  process of its own with `XLA_PYTHON_CLIENT_PREALLOCATE=false`, so that
  `device.memory_stats()["peak_bytes_in_use"]` is its peak; the memory report's prediction
  beside it (goal: within 5%). Writes `results/gpu.json`.
- `--device cpu`: reduced sizes; each group's configurations in one process, timed in
  rounds that alternate their order (ABBA), a ratio the median of per-round ratios: the
  drift of a shared machine cancels. Writes `results/speed.json`.
- `--smoke`: every configuration at tiny sizes in one process (a check of the script).

Groups (`CONFIGS`, each against its `BASELINES` row; goals in `GOALS`): `remat/*` (the guide's
encoder under each preset), `accumulate/*` (against `optax.MultiSteps` too), `precision/*`,
`attention/*` (chunked, XLA's, cuDNN's), `stream/*` (a prefetched `DataStream` over `.npy`
memory maps; the Trainer's data check), `fsdp/*`, `lm_loss/*` (`memory.py`'s LM loss,
whole logits or chunked), `sparse/*` (`memory.py`'s sparse storage on its MLP) and `paper/*`
(WRN-28-2: FP32, FP16 + checkpointing, + micro-batches, + 30% density).

    python benchmarks/speed.py --device gpu          # on a GPU: results/gpu.json
    python benchmarks/speed.py --device gpu --only remat/ accumulate/
    python benchmarks/speed.py                       # CPU: results/speed.json
    python benchmarks/speed.py --smoke --out /tmp/s.json
"""

import os

# Before anything imports jax, here and in the workers: the peak counter then sees the step.
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout, if not installed
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import (  # noqa: E402
    GUIDE,
    MARKER,
    RESULTS,
    compiled_memory,
    encoder,
    interleaved,
    median_ratio,
    spawn_results,
    time_median,
    write_json,
)
from jax.sharding import Mesh  # noqa: E402
from memory import LM_LOSS, LM_LOSS_SMOKE, SPARSE, SPARSE_MLP, lm_mean_loss, sparse_mlp, wrn_loss  # noqa: E402

import eqx_lowmem as el  # noqa: E402

TINY = {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_ff": 32, "seq": 8, "batch": 4}
SIZES = {
    "gpu": {"transformer": GUIDE, "mlp": SPARSE_MLP,
            "wrn": {"depth": 28, "width": 2, "batch": 100, "image": 32}, "stream_samples": 512,
            "lm_loss": LM_LOSS,
            "timing": {"burn_in": 3, "repeats": 10}},
    # A CPU update of the guide's size takes seconds: 4 blocks of width 128 (about 0.07 s).
    "cpu": {"transformer": {"n_layers": 4, "d_model": 128, "n_heads": 4, "d_ff": 512,
                            "seq": 128, "batch": 8},
            "mlp": SPARSE_MLP,
            "wrn": {"depth": 16, "width": 1, "batch": 100, "image": 32}, "stream_samples": 256,
            "lm_loss": LM_LOSS,
            "timing": {"burn_in": 1, "repeats": 9}},
    "smoke": {"transformer": TINY, "mlp": {**SPARSE_MLP, "width": 32, "batch": 8},
              "wrn": {"depth": 10, "width": 1, "batch": 100, "image": 8}, "stream_samples": 16,
              "lm_loss": LM_LOSS_SMOKE,
              "timing": {"burn_in": 1, "repeats": 1}},
}  # fmt: skip
BUDGET_S = 450  # the GPU run; issue 13's bound is 8 minutes
WORKER_TIMEOUT_S = 150
MAX_SKIPPED = 30  # overflowing updates a dynamic loss scale may skip before the first good one
DENSITY = 0.3
SMOKE_REPORTS = ("remat/none",)  # the smoke run's one memory report (each is one more compile)

CONFIGS: dict[str, dict] = {  # name: spec; order is priority (the budget drops the last)
    **{f"remat/{p}": {"kind": "transformer", "remat": p, "report": True}
       for p in ("none", "full", "dots")},
    "remat/minimal": {"kind": "transformer", "remat": "minimal", "report": True, "host": True},
    "remat/minimal_offloaded": {"kind": "transformer", "remat": "minimal_offloaded",
                                "report": True, "host": True},
    "precision/mixed_bf16": {"kind": "transformer", "precision": "mixed_bf16", "report": True},
    "accumulate/k4": {"kind": "transformer", "accumulate": 4, "report": True},
    "accumulate/multisteps_k4": {"kind": "multisteps", "accumulate": 4},
    "stream/resident": {"kind": "stream", "source": "resident"},
    "stream/memmap_prefetch": {"kind": "stream", "source": "memmap"},
    "stream/trainer_unchecked": {"kind": "stream", "source": "memmap", "trainer": False},
    "stream/trainer_checked": {"kind": "stream", "source": "memmap", "trainer": True},
    "attention/chunked": {"kind": "transformer", "precision": "mixed_bf16", "attention": "chunked"},
    "attention/xla": {"kind": "transformer", "precision": "mixed_bf16", "attention": "xla"},
    "attention/full_chunked": {"kind": "transformer", "precision": "mixed_bf16", "remat": "full",
                               "attention": "chunked"},
    "attention/full_cudnn": {"kind": "transformer", "precision": "mixed_bf16", "remat": "full",
                             "attention": "cudnn"},
    "fsdp/replicated": {"kind": "fsdp", "shard": "data"},
    "fsdp/fsdp": {"kind": "fsdp", "shard": "fsdp"},
    "lm_loss/naive": {"kind": "lm_loss", "chunk": None},
    "lm_loss/chunked": {"kind": "lm_loss", "chunk": "auto"},
    **{f"sparse/{v}": {"kind": "sparse", "variant": v, "slow": v == "bcoo"} for v in SPARSE},
    "paper/fp32": {"kind": "wrn", "precision": None, "remat": "none", "accumulate": 1},
    "paper/fp16_remat": {"kind": "wrn", "precision": "half_fp16", "accumulate": 1},
    "paper/fp16_remat_micro10": {"kind": "wrn", "precision": "half_fp16", "accumulate": 10},
    "paper/fp16_remat_micro10_sparse30": {"kind": "wrn", "precision": "half_fp16",
                                          "accumulate": 10, "density": DENSITY},
    # Issue 36: micro-batches of 2 and 1 image, and GroupNorm in BatchNorm's place.
    "paper/fp16_remat_micro2_sparse30": {"kind": "wrn", "precision": "half_fp16",
                                         "accumulate": 50, "density": DENSITY},
    "paper/fp16_remat_micro1_sparse30": {"kind": "wrn", "precision": "half_fp16",
                                         "accumulate": 100, "density": DENSITY},
    "paper/fp16_remat_micro1_sparse30_gn": {"kind": "wrn", "precision": "half_fp16",
                                            "accumulate": 100, "density": DENSITY,
                                            "norm": "group"},
}  # fmt: skip
# Each group's baseline: the rows of a group are compared with it (on a CPU, side by side).
BASELINES = {"remat": "remat/none", "precision": "remat/none", "accumulate": "remat/none",
             "attention": "attention/chunked", "stream": "stream/resident", "fsdp":
             "fsdp/replicated", "lm_loss": "lm_loss/naive", "sparse": "sparse/dense",
             "paper": "paper/fp32"}  # fmt: skip
NONE, UPS = "remat/none", "updates_per_s"
GOALS = {  # name: (numerator, denominator, quantity, sense, bound)
    "full_remat_peak": ("remat/full", NONE, "peak", "<=", 0.20),
    "full_remat_time": ("remat/full", NONE, "step_s", "<=", 1.30),
    "selective_remat_peak": ("remat/{selective}", NONE, "peak", "<=", 0.60),
    "selective_remat_time": ("remat/{selective}", NONE, "step_s", "<=", 1.10),
    "accumulate_vs_whole_batch": ("accumulate/k4", NONE, UPS, ">=", 0.95),
    "accumulate_vs_multisteps": ("accumulate/k4", "accumulate/multisteps_k4", UPS, ">=", 1.20),
    "mixed_bf16_peak": ("precision/mixed_bf16", NONE, "peak", "<=", 0.60),
    "mixed_bf16_speed": ("precision/mixed_bf16", NONE, UPS, ">=", 1.80),
    "stream_vs_resident": ("stream/memmap_prefetch", "stream/resident", UPS, ">=", 0.95),
    "check_data_stall": ("stream/trainer_checked", "stream/trainer_unchecked", UPS, ">=", 0.95),
    "chunked_lm_loss_time": ("lm_loss/chunked", "lm_loss/naive", "step_s", "<=", 1.0),
}
REPORT_TOLERANCE = 0.05
# The first update's loss and gradient norm, relative, between configurations computing the
# same function: float32 (a GPU's matmuls may use TF32) and 16-bit.
CHECK_RTOL = {"float32": 2e-3, "16bit": 5e-2, "lm_loss": 2e-3}
# The compile-only target of each device kind a GPU may report (`device_kind`).
_KINDS = {"H100 80GB": "h100", "H100 PCIe": "h100-pcie", "H200": "h200", "A100-SXM4-40GB":
          "a100-40gb", "A100-SXM4-80GB": "a100-80gb", "L4": "l4", "A10G": "a10g",
          "RTX 4090": "rtx4090", "V100": "v100"}  # fmt: skip


class Unavailable(Exception):
    """A configuration this checkout or backend cannot run (cuDNN on a CPU, say)."""


# ------------------------------------------------------------------------------ runners


def _ready(tree) -> None:
    jax.block_until_ready(eqx.filter(tree, eqx.is_array))


def _batch(cfg: dict, key):
    kx, ky = jr.split(key)
    shape = (cfg["batch"], cfg["seq"], cfg["d_model"])
    return jr.normal(kx, shape), jr.normal(ky, shape)


def _tree_bytes(tree) -> int:
    return sum(int(a.nbytes) for a in jax.tree.leaves(tree) if eqx.is_array(a))


def _step_runner(step, state, batch, host: bool = False):
    """The update of a `make_step`, after its first applied one (a dynamic loss scale may
    skip the first few): `(update, info)` with the first update's loss and gradient norm."""
    info: dict = {}
    if host:  # the program's own host-memory figures (offloaded residuals on a GPU)
        m = step.lower(state, batch).compile()
        info["compiled"] = compiled_memory(m) | {
            f"host_{k}": int(getattr(m.memory_analysis(), f"host_{k}_size_in_bytes", 0))
            for k in ("argument", "output", "temp", "alias")
        }
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    _ready(state)
    info["first_call_s"], skipped = time.perf_counter() - t0, 0
    while not bool(metrics["finite"]) and skipped < MAX_SKIPPED:
        skipped += 1
        state, metrics = step(state, batch)
    check = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
    if not (bool(metrics["finite"]) and all(map(math.isfinite, check.values()))):
        raise FloatingPointError(f"no finite update in {skipped + 1} calls: {check}")
    holder = [state]

    def update():
        holder[0], _ = step(holder[0], batch)
        _ready(holder[0])

    return update, {**info, "skipped_updates": skipped, **check}


def _report(shapes, optimizer, batch, accumulate, precision) -> dict:
    """The memory report's prediction (compile only), to compare with the measured peak;
    on a GPU also the same step compiled for its kind as a compile-only target."""

    structs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch)
    args = (shapes, el.train.mse, optimizer, structs)
    report = el.memory.memory_report(*args, accumulate=accumulate, precision=precision)
    trusted = report.trusted.get(jax.default_backend(), "peak_bytes")
    trusted = "peak_bytes" if trusted == "measured_peak_bytes" else trusted
    parts = {k: int(v) for k, v in report.parts.items()}
    out = {"peak_bytes": int(report.peak_bytes), "trusted": trusted, "parts": parts,
           "predicted": int(getattr(report, trusted)), "compile_only_peak_bytes": None,
           "attention": report.config.get("attention")}  # fmt: skip
    if jax.default_backend() == "gpu":
        kind = jax.devices()[0].device_kind
        target = next((t for k, t in _KINDS.items() if k in kind), None)
        if target is not None:
            gpu = el.memory.memory_report(*args, accumulate=accumulate, precision=precision,
                                          target=target)  # fmt: skip
            out["compile_only_peak_bytes"] = int(gpu.peak_bytes)
    return out


def transformer(name: str, spec: dict, sizes: dict):
    """The guide's encoder trained by `make_step`: remat, precision, accumulation, attention."""

    cfg = sizes["transformer"]
    remat, attention = spec.get("remat", "none"), spec.get("attention", "auto")
    precision, accumulate = spec.get("precision"), spec.get("accumulate", 1)
    if remat not in el.nn.PRESETS:
        raise Unavailable(f"remat={remat!r} is not in eqx_lowmem.nn.PRESETS")
    compute = el.precision.get_policy(precision).compute_dtype
    head_dim = cfg["d_model"] // cfg["n_heads"]
    used = el.nn.resolve_attention(attention if attention != "cudnn" else "auto", compute,
                                   head_dim=head_dim)  # fmt: skip
    if attention == "cudnn" and used != "cudnn":
        raise Unavailable(f"cuDNN attention cannot run here (backend {jax.default_backend()}, "
                          f"{jnp.dtype(compute).name}, head_dim {head_dim})")  # fmt: skip
    optimizer = optax.sgd(0.01)
    step = el.train.make_step(el.train.mse, optimizer, accumulate=accumulate, precision=precision)
    model_key, data_key = jr.split(jr.PRNGKey(0))
    state = step.init(encoder(cfg, model_key, remat, attention=attention), key=jr.PRNGKey(1))
    batch = _batch(cfg, data_key)
    update, info = _step_runner(step, state, batch, spec.get("host", False))
    info |= {"attention": used, "compute_dtype": jnp.dtype(compute).name}
    if spec.get("report") and (sizes["name"] != "smoke" or name in SMOKE_REPORTS):
        shapes = eqx.filter_eval_shape(encoder, cfg, model_key, remat, attention=attention)
        info["report"] = _report(shapes, optimizer, batch, accumulate, precision)
    return update, info


def hand_step(model, loss, optimizer):
    """The step a user writes by hand: the mean loss (weighted, where the loss returns
    weights), its gradient, the optimizer's update; params and optimizer state donated.
    Returns the jitted `step(params, opt_state, batch) -> (params, opt_state, loss)`."""
    static = eqx.partition(model, eqx.is_inexact_array)[1]

    def step(params, opt_state, batch):
        def mean_loss(p):
            out = loss(eqx.combine(p, static), *batch)
            values, w = out if isinstance(out, tuple) else (out, jnp.ones_like(out))
            return jnp.sum(values * w) / jnp.sum(w)

        value, grads = jax.value_and_grad(mean_loss)(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def multisteps(name: str, spec: dict, sizes: dict):
    """`optax.MultiSteps`: a hand-written step per micro-batch."""
    cfg, k = sizes["transformer"], spec["accumulate"]
    model_key, data_key = jr.split(jr.PRNGKey(0))
    model, opt = encoder(cfg, model_key), optax.MultiSteps(optax.sgd(0.01), every_k_schedule=k)
    call, (x, y) = hand_step(model, el.train.mse, opt), _batch(cfg, data_key)
    params = eqx.filter(model, eqx.is_inexact_array)
    holder = [params, opt.init(params)]

    def update():
        for i in range(k):
            holder[0], holder[1], value = call(holder[0], holder[1], (x[i::k], y[i::k]))
        _ready(holder[:2])
        return value

    loss = float(update())
    if loss != loss:
        raise FloatingPointError("MultiSteps' first update is not finite")
    return update, {"loss": loss, "opt_state_bytes": _tree_bytes(holder[1])}


def stream(name: str, spec: dict, sizes: dict):
    """One epoch of the whole-batch float32 step: batches on the device, or a shuffled
    `DataStream` over `.npy` memory maps with `prefetch` (or the Trainer over it)."""

    cfg, n = sizes["transformer"], sizes["stream_samples"]
    b, shape = cfg["batch"], (cfg["seq"], cfg["d_model"])
    rng, tmp = np.random.default_rng(0), tempfile.mkdtemp(prefix="speed_stream_")
    paths = []
    for part in ("x", "y"):
        paths.append(str(Path(tmp) / f"{part}.npy"))
        np.save(paths[-1], rng.standard_normal((n, *shape), np.float32))
    step = el.train.make_step(el.train.mse, optax.sgd(0.01))
    holder = [step.init(encoder(cfg, jr.PRNGKey(0)), key=jr.PRNGKey(1))]
    data = el.data.DataStream(tuple(paths), batch_size=b, key=0, drop_last=True)
    if spec["source"] == "resident":
        x, y = (np.load(p) for p in paths)
        resident = [jax.device_put((x[i : i + b], y[i : i + b])) for i in range(0, n - b + 1, b)]
    if "trainer" in spec:
        trainer = el.train.Trainer(encoder(cfg, jr.PRNGKey(0)), el.train.mse, optax.sgd(0.01),
                                   check_data=spec["trainer"], progress=False)  # fmt: skip

    def update():  # one epoch; the figures are per batch (`per_call`)
        if "trainer" in spec:
            trainer.fit(epochs=1, key=jr.PRNGKey(1), stream=data)
            return _ready(trainer.state)
        for batch in resident if spec["source"] == "resident" else data.prefetch(depth=2):
            holder[0], _ = step(holder[0], batch)
        _ready(holder[0])

    update()  # compiles
    return update, {"per_call": n // b, "samples": n, "order": spec.get("trainer", spec["source"])}


def fsdp(name: str, spec: dict, sizes: dict):
    """The guide's encoder, Adam, full remat: replicated or FSDP over every local device."""

    cfg, mesh = sizes["transformer"], Mesh(np.array(jax.devices()), ("data",))
    step = el.train.make_step(el.train.mse, optax.adam(1e-3), mesh=mesh, shard=spec["shard"])
    model_key, data_key = jr.split(jr.PRNGKey(0))
    state = step.init(encoder(cfg, model_key, "full"), key=jr.PRNGKey(1))
    update, info = _step_runner(step, state, _batch(cfg, data_key), host=True)
    return update, {**info, "devices": jax.device_count()}


def sparse(name: str, spec: dict, sizes: dict):
    """A sparse-storage variant of `memory.py`'s MLP (`memory.SPARSE`): its step's time."""
    model, batch, step = sparse_mlp(spec["variant"], sizes["mlp"])
    return _step_runner(step, step.init(model, key=jr.PRNGKey(4)), batch)


def lm_loss(name: str, spec: dict, sizes: dict):
    """`memory.py`'s LM loss-and-gradient (`lm_loss/*`): whole logits, or chunked (then
    compared once with the whole logits' in this process)."""
    c = sizes["lm_loss"]
    model = el.nn.CausalLM(c["vocab"], c["seq"], c["layers"], c["d_model"], c["heads"],
                           c["d_ff"], key=jr.key(0), remat=c["remat"])  # fmt: skip
    tokens = jr.randint(jr.key(1), (c["batch"], c["seq"] + 1), 0, c["vocab"])
    grad = eqx.filter_jit(eqx.filter_value_and_grad(lm_mean_loss))
    run = lambda chunk: jax.block_until_ready(grad(model, tokens, chunk))  # noqa: E731
    loss, grads = run(spec["chunk"])
    info = {"loss": float(loss), "grad_norm": float(optax.tree.norm(grads))}
    if spec["chunk"] is not None:
        whole_loss, whole = run(None)
        diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, whole)
        info |= {"loss_abs_diff": float(jnp.abs(loss - whole_loss)),
                 "grad_max_abs_diff": max(jax.tree.leaves(diffs))}  # fmt: skip
    return lambda: run(spec["chunk"]), info


def wrn(name: str, spec: dict, sizes: dict):
    """A WideResNet (momentum SGD, BatchNorm per micro-batch): the paper's rows."""

    w = sizes["wrn"]
    model_key, data_key, sparse_key = jr.split(jr.PRNGKey(0), 3)
    model, bn = eqx.nn.make_with_state(el.nn.WideResNet)(
        w["depth"], w["width"], 10, key=model_key,
        remat=spec.get("remat", "checkpoint-residual-1"), norm=spec.get("norm", "batch"),
    )  # fmt: skip
    if spec.get("density") is not None:
        model = el.sparse.sparsify(model, spec["density"], key=sparse_key,
                                   exclude=el.nn.WideResNet.keep_dense)  # fmt: skip
    options = {"accumulate": spec["accumulate"], "precision": spec["precision"]}
    step = el.train.make_step(wrn_loss, optax.sgd(0.1, momentum=0.9), has_state=True, **options)
    state = step.init(model, key=jr.PRNGKey(1), model_state=bn)
    kx, ky = jr.split(data_key)
    images = jr.randint(kx, (w["batch"], 3, w["image"], w["image"]), 0, 256).astype("uint8")
    update, info = _step_runner(step, state, (images, jr.randint(ky, (w["batch"],), 0, 10)))
    return update, {**info, "parameter_bytes": _tree_bytes(state.model)}


# ------------------------------------------------------------------------------- worker


def _peak() -> int | None:
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def worker(payload: dict) -> None:
    """Build each named configuration, then time them: one by one (each process's own peak,
    `paired` False), or in alternating rounds (`paired`); one result line per name."""
    sizes = {"name": payload["size"], **SIZES[payload["size"]]}
    timing, built, results = sizes["timing"], {}, {}
    for name in payload["names"]:
        spec, t0 = CONFIGS[name], time.perf_counter()
        try:
            update, info = globals()[spec["kind"]](name, spec, sizes)
            built[name] = update
            if not payload["paired"]:
                info["step_s"] = time_median(update, **timing) / info.get("per_call", 1)
                info["peak"] = _peak()
        except Unavailable as e:
            info = {"unavailable": str(e)}
        except Exception as e:  # recorded: one broken piece must not hide the rest
            info = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        results[name] = {**info, "wall_s": time.perf_counter() - t0, "pid": os.getpid()}
    if payload["paired"] and built:
        for update in built.values():
            for _ in range(timing["burn_in"]):
                update()

        def record(wall: dict, names: list[str]) -> None:
            for name in names:
                per_call = results[name].get("per_call", 1)
                results[name]["rounds"] = "main" if name in fast else "own"
                results[name]["step_s_all"] = [t / per_call for t in wall[name]]
                results[name]["step_s"] = sorted(wall[name])[len(wall[name]) // 2] / per_call
                base = BASELINES.get(name.split("/")[0])
                if base in wall:  # the median of per-round ratios: drift cancels
                    results[name]["time_vs_base"] = median_ratio(
                        [t / per_call for t in wall[name]],
                        [t / results[base].get("per_call", 1) for t in wall[base]],
                    )

        # A slow configuration (seconds a call) in 2 rounds of its own with its baseline:
        # in the others' rounds its calls would swamp their drift-cancelling pairing.
        fast = [n for n in built if not CONFIGS[n].get("slow")]
        record(interleaved({n: built[n] for n in fast}, max(timing["repeats"], 2)).wall, fast)
        for name in (n for n in built if n not in fast):
            pair = dict.fromkeys((BASELINES.get(name.split("/")[0]), name))
            record(interleaved({n: built[n] for n in pair if n in built}, 2).wall, [name])
    for name, r in results.items():
        if "step_s" in r:
            r["updates_per_s"] = 1.0 / r["step_s"]
        r.setdefault("peak", None)
        print(MARKER + json.dumps({"name": name, "result": r}), flush=True)


# ------------------------------------------------------------------------------- parent


def _ratio(results: dict, num: str, den: str, quantity: str) -> float | None:
    """`num`'s figure over `den`'s; for times taken side by side in one process, the median
    of the rounds' ratios."""
    a, b = results.get(num, {}), results.get(den, {})
    if a.get(quantity) is None or not b.get(quantity):
        return None
    paired = "step_s_all" in a and a.get("rounds") == b.get("rounds")  # timed in one process,
    if quantity != "peak" and a.get("pid") == b.get("pid") and paired:  # the same rounds
        ratio = median_ratio(a["step_s_all"], b["step_s_all"])
        return ratio if quantity == "step_s" else 1 / ratio
    return a[quantity] / b[quantity]


def evaluate_goals(results: dict) -> dict:
    """Each goal's ratio and whether it is met (None where a figure is missing: peaks on a
    CPU, a configuration that did not run); and the memory report against the peaks."""
    time_of = {n: _ratio(results, f"remat/{n}", NONE, "step_s") for n in ("dots", "minimal")}
    timed = [n for n, t in time_of.items() if t is not None]
    fast = [n for n in timed if time_of[n] <= 1.10 and _ratio(results, f"remat/{n}", NONE, "peak")]
    selective = (min(fast, key=lambda n: _ratio(results, f"remat/{n}", NONE, "peak")) if fast
                 else min(timed, key=time_of.get, default=None))  # fmt: skip
    goals = {}
    for name, (num, den, quantity, sense, bound) in GOALS.items():
        num = num.format(selective=selective)
        r = _ratio(results, num, den, quantity)
        met = None if r is None else (r <= bound if sense == "<=" else r >= bound)
        goals[name] = {"ratio": r, "goal": f"{sense} {bound}", "met": met,
                       "of": f"{num} / {den} ({quantity})"}  # fmt: skip
    errors = {n: r["report"]["predicted"] / r["peak"] - 1 for n, r in results.items()
              if r.get("peak") and "predicted" in r.get("report", {})}  # fmt: skip
    compile_only = {n: r["report"]["compile_only_peak_bytes"] / r["peak"] - 1
                    for n, r in results.items()
                    if n in errors and r["report"].get("compile_only_peak_bytes")}  # fmt: skip
    worst = max(errors.values(), key=abs) if errors else None
    goals["report_within_5_percent"] = {
        "ratio": worst, "goal": f"|predicted / measured - 1| <= {REPORT_TOLERANCE}",
        "met": None if worst is None else abs(worst) <= REPORT_TOLERANCE, "of": errors,
        "compile_only_of": compile_only,  # what figures planned without the GPU are worth
    }  # fmt: skip
    return goals


def check_consistency(results: dict) -> dict:
    """The first update's loss and gradient norm agree between configurations computing the
    same function from the same parameters and batch (remat, accumulation and attention
    change the schedule, not the arithmetic)."""
    groups = {
        "float32": ["remat/none", "remat/full", "remat/dots", "remat/minimal",
                    "remat/minimal_offloaded", "accumulate/k4"],
        "16bit": ["precision/mixed_bf16", *(n for n in CONFIGS if n.startswith("attention/"))],
        "lm_loss": ["lm_loss/naive", "lm_loss/chunked"],
    }  # fmt: skip
    out = {}
    for group, names in groups.items():
        names = [n for n in names if "loss" in results.get(n, {})]
        if len(names) > 1:
            ref = results[names[0]]
            worst = max(abs(results[n][q] / ref[q] - 1) for n in names[1:]
                        for q in ("loss", "grad_norm"))  # fmt: skip
            out[group] = {"names": names, "max_rel_diff": worst, "rtol": CHECK_RTOL[group],
                          "ok": worst <= CHECK_RTOL[group]}  # fmt: skip
    return out


def _run(names: list[str], size: str, paired: bool, timeout: float) -> dict:
    """One worker process for `names`; a configuration it did not report is an error."""
    payload = {"size": size, "names": names, "paired": paired}
    lines, proc = spawn_results(__file__, payload, timeout=timeout)
    results = {line["name"]: line["result"] for line in lines}
    why = "timed out" if proc is None else f"exit code {proc.returncode}"
    tail = "" if proc is None else proc.stderr[-3000:]
    return {n: results.get(n, {"error": f"worker process {why}", "stderr": tail}) for n in names}


def run_all(names: list[str], device: str, smoke: bool, budget: float) -> dict:
    """GPU: each configuration in a process of its own (its peak), within `budget`. CPU: the
    configurations sharing a baseline in one process, timed side by side. Smoke: one."""
    if smoke:
        return _run(names, "smoke", True, 900)
    if device == "cpu":
        groups: dict[str, list[str]] = {}
        for n in names:
            base = BASELINES.get(n.split("/")[0]) or n.split("_")[0]
            groups.setdefault(base, [base] if base in CONFIGS else []).append(n)
        results = {}
        for group in groups.values():
            results |= _run(list(dict.fromkeys(group)), "cpu", True, 3600)
        return {n: results[n] for n in names}
    results, start = {}, time.perf_counter()
    for n in names:
        left = budget - (time.perf_counter() - start)
        skipped = {n: {"skipped": f"the time budget of {budget:.0f} s was spent"}}
        results |= _run([n], "gpu", False, min(left, WORKER_TIMEOUT_S)) if left > 10 else skipped
        print(f"  {n:<36} {json.dumps(results[n])[:150]}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any backend, quick")
    parser.add_argument("--only", nargs="+", default=None, help="configuration name prefixes")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="GPU: seconds for all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    names = [n for n in CONFIGS if not args.only or any(n.startswith(p) for p in args.only)]

    if args.device == "gpu" and jax.default_backend() != "gpu" and not args.smoke:
        parser.error(f"--device gpu: the default backend is {jax.default_backend()!r}, not a "
                     "GPU: run with --smoke (tiny sizes) or --device cpu.")  # fmt: skip
    # One compilation cache for the run's workers: a memory report compiles the program its
    # configuration ran, then served from the cache (compile time only).
    cache = tempfile.TemporaryDirectory(prefix="eqx_lowmem_speed_cache_")
    os.environ |= {"JAX_COMPILATION_CACHE_DIR": cache.name,
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}  # fmt: skip
    t0 = time.perf_counter()
    results = run_all(names, args.device, args.smoke, args.budget)
    cache.cleanup()
    default = RESULTS / ("gpu.json" if args.device == "gpu" else "speed.json")
    out = args.out or (Path(tempfile.gettempdir()) / "speed_smoke.json" if args.smoke else default)
    mode = "smoke" if args.smoke else args.device
    record = {"mode": mode, "sizes": SIZES["smoke" if args.smoke else args.device],
              "environment_variables": {k: os.environ.get(k) for k in
                                        ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")},
              "configs": results, "goals": evaluate_goals(results),
              "checks": check_consistency(results), "wall_s": time.perf_counter() - t0}  # fmt: skip
    path = write_json(out.stem, record, directory=out.parent)
    for name, g in record["goals"].items():
        shown = "n/a" if g["ratio"] is None else f"{g['ratio']:.3f}"
        print(f"  goal {name:<28} {shown:>8}  {g['goal']:<10} met={g['met']}")
    for name, c in record["checks"].items():
        print(f"  check {name}: max rel diff {c['max_rel_diff']:.2e} ok={c['ok']}")
    print(f"wrote {path} in {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
