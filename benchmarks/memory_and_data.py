"""The guide's benchmark reproduced, and what it did not measure: memory, speed and data.

The guide's measurement: a `transformer_encoder` of 12 blocks (d_model 512, 8 heads, d_ff
2048), sequences of 256, batches of 32, float32, MSE against synthetic targets (seed 0),
`optax.sgd(0.01)`, one step per epoch (a synthetic dataset of exactly one batch, kept on the
device, the step repeated). Each configuration runs in a Python process of its own:

- `baseline`: no remat, `accumulate=1`. `remat_full`: `remat="full"`. `accumulate_4`: 4
  micro-batches per batch. And beyond the guide: `remat_full_accumulate_4`;
  `segments_sqrt` (checkpointed segments of round(sqrt(n_layers)) blocks, no remat
  inside); `mixed_bf16` (bfloat16 compute, float32 parameters) without remat, and with remat
  and accumulation; `plain_eqx` and `plain_eqx_checkpoint`, the framework compared against:
  the same blocks (built with `remat=False`, `chunk_size=None`) in a `lax.scan` written here,
  its body wrapped in `eqx.filter_checkpoint` or not, trained by the least plain step
  (`eqx.filter_jit` + `eqx.filter_value_and_grad` + `optax.sgd`, model donated like the
  library's state).
- Peak bytes. GPU: `peak_bytes_in_use` of the process, which built, compiled and ran the
  step (`XLA_PYTHON_CLIENT_PREALLOCATE=false`), with the compiled prediction beside it.
  CPU (`memory_stats()` is None): argument + output + temp - alias from `memory_analysis()`
  of the guide's step, compiled only.
- Steps per second: the median of 3 sessions of 20 steps, each session synchronised at its
  end with `jax.block_until_ready`, after compiling and 2 burn-in steps. GPU: the guide's
  size; time ratios are those of the processes' rates. CPU: a reduced size (`REDUCED`; a
  guide step takes tens of seconds on two cores), and, since times taken in different
  processes minutes apart on a shared CPU are not comparable, each process also builds the
  baseline from the same parameters and times it in alternating sessions (ABBA, as
  `remat.py`): the time ratio is the median of the sessions' ratios, and the baseline
  paired with itself gives the noise floor. `--size` overrides the size of the run (timing,
  and on a GPU the measured peak).
- Correctness first: every process records the loss and gradient norm of its first two
  updates from the same parameters and batch; they must match the baseline's within 1e-5
  relative (float32), 1e-3 where float32 matmuls run in TensorFloat-32 (JAX's default
  on a recent GPU; `--matmul-precision highest` turns it off), or 1e-2 (bfloat16
  compute). The `accumulate_4` process then checks the third claim below on the device it
  runs on: one update from 32 samples as 4 micro-batches of 8 against one from the 32 at
  once. A configuration whose process fails is recorded as failed; the others still count.
- The stream table: `benchmarks/stream.py`'s own measurement on a smaller file
  (`STREAM_SAMPLES` samples of 64 KiB): in-order, bounded-shuffle and global-shuffle
  rates, and the mixing of data stored sorted by label.

The claims (`CLAIMS`) were written before the first run; the script evaluates them.

    python benchmarks/memory_and_data.py     # writes benchmarks/results/memory_and_data.json
"""

import os

# Before anything imports jax, here and in the workers: on a GPU, peak_bytes_in_use only
# measures the step when the allocator does not grab memory up front.
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo, if not installed
from _common import (  # noqa: E402
    MARKER,
    compiled_memory as _memory,
    interleaved,
    median_ratio,
    spawn as _spawn,
    write_json,
)

GUIDE = {"n_layers": 12, "d_model": 512, "n_heads": 8, "d_ff": 2048, "seq": 256, "batch": 32}
# CPU timing: 4 blocks (segments of 2), seq 128 (2 attention chunks of 64 under remat), a
# step in about 0.07 s on two idle cores, so 9 processes fit in a few minutes.
REDUCED = {"n_layers": 4, "d_model": 128, "n_heads": 4, "d_ff": 512, "seq": 128, "batch": 8}
SIZES = {"guide": GUIDE, "reduced": REDUCED}
SEED = 0
LEARNING_RATE = 0.01
SESSIONS = 3
STEPS_PER_SESSION = 20
BURN_IN = 2
CHECK_UPDATES = 2
ACCUMULATE = 4
CLAIM_MICRO_BATCH = 8  # the claim's 4 x 8 = 32
RTOL_FLOAT32 = 1e-5
# bfloat16 keeps 8 significant bits (relative step 2**-8 = 3.9e-3); a 12-block forward and
# backward in it moves whole-model scalars by a few of those steps.
RTOL_BF16 = 1e-2
# JAX's default precision lets a GPU with tensor cores multiply float32 matrices in
# TensorFloat-32 (11 significant bits, relative step 2**-11 = 4.9e-4); differently shaped
# matmuls (remat's attention chunks, micro-batches) then round differently. Used for the
# float32 configurations where that is so (`--matmul-precision highest` keeps 1e-5).
RTOL_TF32 = 1e-3

# Written before the first run, and not changed after it.
CLAIMS = [
    {
        "id": "remat_peak",
        "claim": "remat='full' peak bytes at most 0.7x the baseline's (guide size)",
        "threshold": 0.7,
    },
    {
        "id": "remat_time",
        "claim": "remat='full' step time at most 1.5x the baseline's",
        "threshold": 1.5,
    },
    {
        "id": "accumulate_equal",
        "claim": (
            "accumulate=4 over 32 samples (4 micro-batches of 8) gives the parameters of "
            "accumulate=1 over the same 32 within 1e-5 relative (float32), on the device used"
        ),
        "threshold": 1e-5,
    },
]
REFERENCE = {
    "source": "FINDINGS.md (the guide's T4 figures are not available otherwise)",
    "device": "Tesla T4",
    "implementation": "per-block jax.checkpoint",
    "peak_ratio": 0.224,
    "time_ratio": 1.41,
}

# framework: "eqx_lowmem" (make_step over transformer_encoder) or "equinox" (plain).
CONFIGS = {
    "baseline": {"framework": "eqx_lowmem", "remat": "none", "accumulate": 1},
    "remat_full": {"framework": "eqx_lowmem", "remat": "full", "accumulate": 1},
    "accumulate_4": {"framework": "eqx_lowmem", "remat": "none", "accumulate": ACCUMULATE},
    "remat_full_accumulate_4": {
        "framework": "eqx_lowmem",
        "remat": "full",
        "accumulate": ACCUMULATE,
    },
    "segments_sqrt": {
        "framework": "eqx_lowmem",
        "remat": "none",
        "accumulate": 1,
        "segment": "sqrt",
    },
    "mixed_bf16": {
        "framework": "eqx_lowmem",
        "remat": "none",
        "accumulate": 1,
        "precision": "mixed_bf16",
    },
    "mixed_bf16_remat_full_accumulate_4": {
        "framework": "eqx_lowmem",
        "remat": "full",
        "accumulate": ACCUMULATE,
        "precision": "mixed_bf16",
    },
    "plain_eqx": {"framework": "equinox", "checkpoint": False},
    "plain_eqx_checkpoint": {"framework": "equinox", "checkpoint": True},
}
STREAM_SAMPLES = 3200  # of 64 KiB: a 200 MiB file (stream.py's own uses 6400)
STREAM_REPEATS = 5
STREAM_EPOCHS = 3
GPU_BUDGET_S = 300  # the issue: the guide's size on the H200 within 5 minutes
MIB = 2**20


# ------------------------------------------------------------------------------- workers


def make_data(cfg: dict):
    """The synthetic dataset: one batch `(x, y)`, each `(batch, seq, d_model)`."""
    import jax.random as jr

    _, x_key, y_key = jr.split(jr.PRNGKey(SEED), 3)
    shape = (cfg["batch"], cfg["seq"], cfg["d_model"])
    return jr.normal(x_key, shape), jr.normal(y_key, shape)


def make_encoder(cfg: dict, spec: dict):
    """The library's encoder; for plain Equinox its blocks, without remat or chunking."""
    import jax.random as jr

    import eqx_lowmem as el

    model_key = jr.split(jr.PRNGKey(SEED), 3)[0]
    plain = spec["framework"] == "equinox"
    return el.nn.transformer_encoder(
        cfg["n_layers"],
        cfg["d_model"],
        cfg["n_heads"],
        cfg["d_ff"],
        key=model_key,
        remat="none" if plain else spec["remat"],
        segment=None if plain else spec.get("segment"),
        chunk_size=None if plain else "auto",
    )


class Library:
    """`eqx_lowmem.train.make_step` over the library's encoder: one jitted, donated call."""

    def __init__(self, cfg: dict, spec: dict, step=None):
        import jax.random as jr
        import optax

        import eqx_lowmem as el

        self.step = step or el.train.make_step(
            el.train.mse,
            optax.sgd(LEARNING_RATE),
            accumulate=spec["accumulate"],
            precision=spec.get("precision"),
        )
        # init copies the model (the step donates its state): drop the original.
        self.state = self.step.init(make_encoder(cfg, spec), key=jr.PRNGKey(1))

    def compile(self, batch):
        return self.step.lower(self.state, batch).compile()

    def update(self, batch) -> dict:
        self.state, metrics = self.step(self.state, batch)
        return metrics

    def params(self):
        import equinox as eqx

        return eqx.filter(self.state.model, eqx.is_inexact_array)

    def ready(self):
        return self.state


class Plain:
    """Plain Equinox: the same blocks in a `lax.scan` written here, the body optionally in
    `eqx.filter_checkpoint`, and the least jitted SGD step."""

    def __init__(self, cfg: dict, spec: dict):
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax

        checkpoint = spec["checkpoint"]

        class Encoder(eqx.Module):
            blocks: eqx.Module  # stacked TransformerBlocks, remat off, no chunking

            def __call__(self, x):
                params, static = eqx.partition(self.blocks, eqx.is_array)

                def body(h, p):
                    return eqx.combine(p, static)(h), None

                if checkpoint:
                    body = eqx.filter_checkpoint(body)
                h, _ = jax.lax.scan(body, x, params)
                return h

        optimizer = optax.sgd(LEARNING_RATE)

        def step(batch, model, opt_state):
            x, y = batch

            def loss_fn(model):
                return jnp.mean(jnp.square(jax.vmap(model)(x) - y))

            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            updates, opt_state = optimizer.update(grads, opt_state)
            model = eqx.apply_updates(model, updates)
            return model, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

        self.model = Encoder(make_encoder(cfg, spec).blocks)
        self.opt_state = optimizer.init(eqx.filter(self.model, eqx.is_inexact_array))
        # Model and optimizer state donated, as make_step donates its state; not the batch.
        self.jitted = eqx.filter_jit(step, donate="all-except-first")

    def compile(self, batch):
        # equinox's Compiled wraps jax's, which has memory_analysis().
        compiled = self.jitted.lower(batch, self.model, self.opt_state).compile()
        return getattr(compiled, "compiled", compiled)

    def update(self, batch) -> dict:
        self.model, self.opt_state, metrics = self.jitted(batch, self.model, self.opt_state)
        return metrics

    def params(self):
        import equinox as eqx

        return eqx.filter(self.model, eqx.is_inexact_array)

    def ready(self):
        return self.model


def build(cfg: dict, spec: dict):
    return Plain(cfg, spec) if spec["framework"] == "equinox" else Library(cfg, spec)


def compiled_memory(compiled) -> dict | None:
    """argument + output + temp - alias, plus XLA's own peak where given."""
    out = _memory(compiled)
    if out is not None:
        peak = getattr(compiled.memory_analysis(), "peak_memory_in_bytes", None)
        out["xla_peak_memory_in_bytes"] = peak
    return out


def compile_only(cfg: dict, spec: dict) -> dict:
    """Memory of one configuration's step at `cfg`'s size: compiled, never run."""
    runner = build(cfg, spec)
    batch = make_data(cfg)
    t0 = time.perf_counter()
    compiled = runner.compile(batch)
    return {
        "config": cfg,
        "compile_s": time.perf_counter() - t0,
        "memory": compiled_memory(compiled),
    }


def run_steps(cfg: dict, spec: dict, paired: bool):
    """Build, compile, check and time one configuration at `cfg`'s size; the figures and
    the runner.

    `paired`: also build the baseline from the same parameters and time the two in
    alternating sessions (ABBA), so their ratio holds on a machine shared with other work
    (the baseline's own process gives the A/A ratio: the noise floor). Only where memory is
    not measured by the process's peak (CPU).
    """
    import jax

    device = jax.devices()[0]
    runner = build(cfg, spec)
    reference = build(cfg, CONFIGS["baseline"]) if paired else None
    batch = make_data(cfg)
    jax.block_until_ready((runner.ready(), batch))

    t0 = time.perf_counter()
    compiled = runner.compile(batch)  # the runner's own calls reuse it
    compile_s = time.perf_counter() - t0
    after_compile = (device.memory_stats() or {}).get("peak_bytes_in_use")
    if reference is not None:
        reference.compile(batch)

    def first_updates(r) -> list[dict]:
        # Correctness first: the first updates from the same parameters; the second's
        # loss depends on the first's gradient.
        check = []
        for _ in range(CHECK_UPDATES):
            metrics = r.update(batch)
            check.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
        for _ in range(BURN_IN):
            r.update(batch)
        jax.block_until_ready(r.ready())
        return check

    def session(r):
        def run():
            for _ in range(STEPS_PER_SESSION):
                r.update(batch)
            jax.block_until_ready(r.ready())

        return run

    check = first_updates(runner)
    ref_check = None if reference is None else first_updates(reference)
    calls = {"run": session(runner)}
    if reference is not None:
        calls["reference"] = session(reference)
    timed = interleaved(calls, SESSIONS).wall
    sessions, ref_sessions = timed["run"], timed.get("reference", [])
    stats = device.memory_stats() or {}
    figures = {
        "config": cfg,
        "compile_s": compile_s,
        "memory_analysis": compiled_memory(compiled),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "peak_bytes_in_use_after_compile": after_compile,
        "check": check,
        "reference_check": ref_check,
        "session_s": sessions,
        "steps_per_s": STEPS_PER_SESSION / statistics.median(sessions),
        "reference_session_s": ref_sessions or None,
        "time_vs_paired_baseline": median_ratio(sessions, ref_sessions) if ref_sessions else None,
    }
    return figures, runner


def accumulate_equality(cfg: dict, spec: dict, step=None) -> dict:
    """One update of `accumulate=4` over 4 x 8 samples against `accumulate=1` over the 32.

    `step`: an already compiled `accumulate=4` step of the same shapes, reused.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from accumulate import relative_difference

    cfg = {**cfg, "batch": ACCUMULATE * CLAIM_MICRO_BATCH}
    batch = make_data(cfg)
    whole = Library(cfg, {**spec, "accumulate": 1})
    micro = Library(cfg, spec, step=step)
    initial = jax.tree.map(lambda a: jnp.array(a, copy=True), whole.params())
    m_whole, m_micro = whole.update(batch), micro.update(batch)
    p_whole, p_micro = whole.params(), micro.params()
    moved = jax.tree.map(jnp.subtract, p_whole, initial)

    def rel(a, b):
        return abs(float(a) - float(b)) / abs(float(b))

    return {
        "config": cfg,
        "micro_batches": f"{ACCUMULATE} x {CLAIM_MICRO_BATCH}",
        "params_relative_difference": relative_difference(p_micro, p_whole),
        # Stricter: the update itself (p1 - p0), float32 rounding of the subtraction included.
        "update_relative_difference": relative_difference(
            jax.tree.map(jnp.subtract, p_micro, initial), moved
        ),
        "loss_relative_difference": rel(m_micro["loss"], m_whole["loss"]),
        "grad_norm_relative_difference": rel(m_micro["grad_norm"], m_whole["grad_norm"]),
        "params_leaves": len(jax.tree.leaves(eqx.filter(p_whole, eqx.is_array))),
    }


def config_worker(name: str, size: str, matmul_precision: str) -> dict:
    import jax

    if matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", matmul_precision)

    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    size = resolve_size(size, on_gpu)
    cfg = SIZES[size]
    spec = CONFIGS[name]
    out: dict = {"backend": backend, "size": size, "load_before": os.getloadavg()}
    if not on_gpu and size != "guide":
        # The memory figure: the guide's step, compiled only (nothing of that size runs).
        out["guide_compile"] = compile_only(GUIDE, spec)
    out["steps"], runner = run_steps(cfg, spec, paired=not on_gpu)
    out["load_after"] = os.getloadavg()
    if name == "accumulate_4":
        # After the peak is read: this builds two more states. The timed step is reused when
        # the claim's batch of 32 is the timed batch (the guide's size).
        reuse = cfg["batch"] == ACCUMULATE * CLAIM_MICRO_BATCH
        out["accumulate_equality"] = accumulate_equality(
            cfg, spec, step=runner.step if reuse else None
        )
    return out


def stream_worker() -> dict:
    """stream.py's rates (64 KiB samples, a smaller file) and its mixing of sorted data."""
    import stream

    # stream.py's functions read its module constant N (samples per file) when called.
    stream.N = STREAM_SAMPLES
    shape = stream.SHAPES["64KiB"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x_64KiB.npy"
        stream.write_samples(path, shape)
        rates = stream.measure_rates(path, STREAM_REPEATS, STREAM_EPOCHS)
    in_order = rates["in_order"]["samples_per_s"]
    for row in rates.values():
        row["vs_in_order"] = row["samples_per_s"] / in_order
    mixing = stream.mixing()
    return {
        "samples": STREAM_SAMPLES,
        "sample_shape": list(shape),
        "file_mib": STREAM_SAMPLES * int(stream.np.prod(shape)) * 4 / MIB,
        "batch": stream.BATCH,
        "shuffle_buffer": stream.BUFFER,
        "repeats": STREAM_REPEATS,
        "epochs_per_timing": STREAM_EPOCHS,
        "rates": rates,
        "mixing": mixing,
        "wall_s": time.perf_counter() - t0,
    }


def resolve_size(size: str, on_gpu: bool) -> str:
    return ("guide" if on_gpu else "reduced") if size == "auto" else size


def worker(spec: dict) -> dict:
    if spec["kind"] == "stream":
        return stream_worker()
    return config_worker(spec["name"], spec["size"], spec["matmul_precision"])


# -------------------------------------------------------------------------------- parent


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def tolerance(name: str, tf32: bool) -> float:
    if CONFIGS[name].get("precision") == "mixed_bf16":
        return RTOL_BF16
    return RTOL_TF32 if tf32 else RTOL_FLOAT32


def run_workers(names: list[str], args, start: float):
    """Every configuration's process, then the stream table's."""
    runs: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for name in names:
        spec = {
            "kind": "config",
            "name": name,
            "size": args.size,
            "matmul_precision": args.matmul_precision,
        }
        try:
            runs[name] = out = _spawn(__file__, spec)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            if name == "baseline":
                raise
            # One run on a lent GPU: keep the other configurations' figures.
            failed[name] = str(e)[-4000:]
            print(f"  {name:36s} FAILED: {str(e).splitlines()[0]}", flush=True)
            continue
        print(
            f"  {name:36s} {out['steps']['steps_per_s']:7.2f} steps/s"
            f"  ({time.perf_counter() - start:.0f} s elapsed)",
            flush=True,
        )
    t0 = time.perf_counter()
    stream_out = _spawn(__file__, {"kind": "stream"})
    print(f"  stream table ({time.perf_counter() - t0:.0f} s)", flush=True)
    return runs, failed, stream_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=("auto", "guide", "reduced"),
        default="auto",
        help="size of the timed run (auto: guide on a GPU, reduced elsewhere)",
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated subset (baseline first)"
    )
    parser.add_argument(
        "--matmul-precision",
        choices=("default", "highest"),
        default="default",
        help="jax_default_matmul_precision of the steps (default: JAX's, TF32 on a recent GPU)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(MARKER + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    start = time.perf_counter()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or names[:1] != ["baseline"]:
        sys.exit(
            f"--configs: {unknown or names} ; expected names of {list(CONFIGS)}, baseline first"
        )
    # A program compiled by several workers (the baseline paired in every CPU process; the
    # claim's accumulate=1 step on a GPU) is compiled once: the workers share a compilation
    # cache. Each configuration's own step is a program of its own, compiled afresh.
    with tempfile.TemporaryDirectory(prefix="memory_and_data_jax_cache_") as cache_dir:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        runs, failed, stream_out = run_workers(names, args, start)
    backend = runs["baseline"]["backend"]
    on_gpu = backend == "gpu"
    size = runs["baseline"]["size"]
    tf32 = on_gpu and args.matmul_precision == "default"

    # Correctness: the first updates of every process (and of the baseline paired with it)
    # against the baseline's own process.
    ref = runs["baseline"]["steps"]["check"]
    correctness = {}
    for name, out in runs.items():
        checks = [out["steps"]["check"], out["steps"]["reference_check"] or ref]
        diffs = [
            relative(c[k], r[k])
            for check in checks
            for c, r in zip(check, ref, strict=True)
            for k in ("loss", "grad_norm")
        ]
        rtol = tolerance(name, tf32)
        correctness[name] = {
            "max_relative_difference": max(diffs),
            "rtol": rtol,
            "passed": max(diffs) <= rtol,
        }
    correct = all(c["passed"] for c in correctness.values()) and not failed

    # Memory: measured at the run's size on a GPU; the guide's, compiled only, elsewhere.
    table = {}
    for name, out in runs.items():
        steps = out["steps"]
        if on_gpu:
            predicted = steps["memory_analysis"]["peak"]
            # The measured peak; the compiled prediction should a backend not report one.
            peak = steps["peak_bytes_in_use"] or predicted
            memory_cfg = steps["config"]
        elif "guide_compile" in out:
            peak = predicted = out["guide_compile"]["memory"]["peak"]
            memory_cfg = GUIDE
        else:
            peak = predicted = steps["memory_analysis"]["peak"]
            memory_cfg = steps["config"]
        table[name] = {
            "spec": CONFIGS[name],
            "peak_bytes": peak,
            "compiled_peak_bytes": predicted,
            "memory_size": memory_cfg,
            "steps_per_s": steps["steps_per_s"],
            "session_s": steps["session_s"],
            "timing_size": steps["config"],
            "compile_s": steps["compile_s"],
            "check": steps["check"],
            "correctness": correctness[name],
            "raw": out,
        }
    base = table["baseline"]
    for row in table.values():
        row["peak_vs_baseline"] = row["peak_bytes"] / base["peak_bytes"]
        row["compiled_peak_vs_baseline"] = row["compiled_peak_bytes"] / base["compiled_peak_bytes"]
        across = base["steps_per_s"] / row["steps_per_s"]
        row["time_vs_baseline_across_processes"] = across
        # CPU: against the baseline timed in alternation in the same process; GPU: across
        # processes (a second step in the process would add to its measured peak).
        paired = row["raw"]["steps"]["time_vs_paired_baseline"]
        row["time_vs_baseline"] = across if paired is None else paired
    noise = None
    if not on_gpu:
        noise = {
            "a_a_paired_ratio": base["time_vs_baseline"],
            "note": (
                "baseline paired with a second copy of itself in its process; time ratios "
                "across processes on this shared CPU are in time_vs_baseline_across_processes"
            ),
        }

    measured_as = (
        "peak_bytes_in_use, measured" if on_gpu else "memory_analysis, compiled only (guide size)"
    )
    claims = []
    for claim in CLAIMS:
        row = {**claim, "measured": None, "met": None}
        if claim["id"] == "remat_peak" and "remat_full" in table:
            row["measured"] = table["remat_full"]["peak_vs_baseline"]
            row["measured_as"] = measured_as
            row["size"] = table["remat_full"]["memory_size"]
        elif claim["id"] == "remat_time" and "remat_full" in table:
            row["measured"] = table["remat_full"]["time_vs_baseline"]
            row["measured_as"] = f"median of {SESSIONS} sessions of {STEPS_PER_SESSION} steps" + (
                ", across processes" if on_gpu else ", paired with the baseline in one process"
            )
            row["size"] = table["remat_full"]["timing_size"]
        elif claim["id"] == "accumulate_equal" and "accumulate_4" in runs:
            eq = runs["accumulate_4"]["accumulate_equality"]
            row["measured"] = eq["params_relative_difference"]
            row["measured_as"] = "max over leaves of |p4 - p1| / |p1| after one update"
            row["size"] = eq["config"]
            row["detail"] = eq
        if row["measured"] is not None:
            # Met only if the configurations also computed the same numbers.
            row["met"] = bool(row["measured"] <= claim["threshold"] and correct)
        row["device"] = backend
        claims.append(row)

    comparisons = {}
    for ours, theirs in (("remat_full", "plain_eqx_checkpoint"), ("baseline", "plain_eqx")):
        if ours in table and theirs in table:
            comparisons[f"{ours}_vs_{theirs}"] = {
                "peak_ratio": table[ours]["peak_bytes"] / table[theirs]["peak_bytes"],
                "time_ratio": table[ours]["time_vs_baseline"] / table[theirs]["time_vs_baseline"],
            }

    results = {
        "benchmark": (
            "the guide's: transformer_encoder, MSE on synthetic data (seed 0), optax.sgd(0.01), "
            "one step per epoch (one batch, kept on the device), each configuration in its own "
            "process"
        ),
        "claims_written_before_the_run": CLAIMS,
        "reference_t4": REFERENCE,
        "sizes": SIZES,
        "size": size,
        "memory_measured_as": measured_as,
        "memory_size": GUIDE if not on_gpu else SIZES[size],
        "timing_size": SIZES[size],
        "protocol": {
            "sessions": SESSIONS,
            "steps_per_session": STEPS_PER_SESSION,
            "burn_in": BURN_IN,
            "check_updates": CHECK_UPDATES,
            "steps_per_s": "steps_per_session / median session seconds",
        },
        "matmul_precision": args.matmul_precision,
        "float32_matmuls_may_use_tf32": tf32,
        "correctness": {
            "passed": correct,
            "rtol_float32": RTOL_TF32 if tf32 else RTOL_FLOAT32,
            "rtol_bf16": RTOL_BF16,
        },
        "failed": failed,
        "configs": table,
        "claims": claims,
        "comparisons": comparisons,
        "noise": noise,
        "stream": stream_out,
    }
    results["wall_s"] = time.perf_counter() - start

    tsize = SIZES[size]
    print(
        f"\nmemory_and_data on {backend}. Peak: {measured_as}, "
        f"{results['memory_size']['n_layers']} blocks, batch {results['memory_size']['batch']}. "
        f"steps/s: {tsize['n_layers']} blocks, d_model {tsize['d_model']}, seq {tsize['seq']}, "
        f"batch {tsize['batch']}"
    )
    print(
        f"  {'config':36s} {'peak MiB':>9s} {'x base':>7s} {'steps/s':>8s} {'time x':>7s}"
        f" {'check':>6s}"
    )
    for name, row in table.items():
        print(
            f"  {name:36s} {row['peak_bytes'] / MIB:9,.0f} {row['peak_vs_baseline']:7.3f}"
            f" {row['steps_per_s']:8.2f} {row['time_vs_baseline']:7.2f}"
            f" {'ok' if row['correctness']['passed'] else 'FAIL':>6s}"
        )
    if on_gpu:
        print("  compiled prediction (argument + output + temp - alias), MiB:")
        for name, row in table.items():
            print(f"    {name:34s} {row['compiled_peak_bytes'] / MIB:9,.0f}")
    worst = max(c["max_relative_difference"] for c in correctness.values())
    print(f"correctness: largest relative difference of the checked loss/grad norm {worst:.1e}")
    if noise is not None:
        print(
            f"timing noise: the baseline paired with itself ran at {noise['a_a_paired_ratio']:.3f}x"
            " (CPU time ratios: each configuration against the baseline in its own process)"
        )
    for name, c in comparisons.items():
        print(f"{name}: peak {c['peak_ratio']:.3f}x, time {c['time_ratio']:.2f}x")
    print(
        f"reference (T4, per-block jax.checkpoint): peak {REFERENCE['peak_ratio']}x, "
        f"time {REFERENCE['time_ratio']}x"
    )
    print("claims (written before the run):")
    for c in claims:
        shown = "not measured" if c["measured"] is None else f"{c['measured']:.3g}"
        met = {True: "met", False: "NOT met", None: "-"}[c["met"]]
        print(f"  {c['claim']}: threshold {c['threshold']:g}, measured {shown}: {met}")

    s = stream_out
    print(
        f"stream ({s['samples']} samples of 64 KiB, {s['file_mib']:.0f} MiB .npy, batch "
        f"{s['batch']}, warm page cache):"
    )
    for method in (
        "in_order",
        "bounded_shuffle_512",
        "global_shuffle",
        "guide_per_sample_buffer_512",
    ):
        r = s["rates"][method]
        print(f"  {method:32s} {r['samples_per_s']:10,.0f} samples/s {r['vs_in_order']:6.2f}x")
    mixed = s["mixing"]["distinct_classes_per_batch"]
    print(
        "  distinct classes per batch of 32 (60,000 sorted samples, 10 classes): "
        + ", ".join(f"{k} {v:.2f}" for k, v in mixed.items())
    )
    for name, error in failed.items():
        print(f"FAILED {name}: {error.splitlines()[0]}")
    results["wall_s"] = time.perf_counter() - start
    print(f"wrote {write_json('memory_and_data', results)} ({results['wall_s']:.0f} s)")
    if on_gpu and size == "guide" and results["wall_s"] > GPU_BUDGET_S:
        print(f"over the {GPU_BUDGET_S} s the issue allows a GPU run at the guide's size")
    if not correct:
        sys.exit("correctness check failed: the configurations' losses or gradients differ")


if __name__ == "__main__":
    main()
