"""The memory grid: every compile-only figure, deterministic (nothing runs, nothing is timed).

Each row compiles a training step on abstract shapes and records `memory_analysis()`
(argument + output + temp - alias: what XLA allocates) or the memory report's parts, on
XLA:CPU and, in the `lm_loss/`, `optimizer_state/`, `paper/` and `frontier/` rows, for an
H100 (a compile-only GPU target). `FULL` holds the sizes (`step/*`'s: `step_cases`):

- `guide/*`: the guide's transformer under each remat preset, scanned and as a Python loop,
  segments, accumulation, mixed bf16, and plain Equinox (`lax.scan`, body in
  `eqx.filter_checkpoint`) (`speed.py`'s `guide/*` time the rows of the same names at 4
  blocks of width 128, batch 8); `precision/*`: each precision preset on it.
- `accumulate/*`: the accumulation benchmark's transformer whole and in k micro-batches
  (`speed.py`'s `accumulate/*` time k = 1 and 4).
- `shard/*`: replicated against FSDP over 2, 4 and 8 host devices.
- `sparse/*`: sparse storage (issue 11) against dense and jaxpruner's masked dense weight
  (`speed.py`'s `sparse/*` rows time the same steps).
- `lm_loss/*`: the language-model loss's two paths (issue 36), whole float32 logits and
  chunked. Goal: >= 10x fewer temporaries.
- `optimizer_state/*`: Adam's state in float32, 16 bits and 8 bits on the guide's character
  LM (`speed.py`'s `optimizer_state/*` time them on a small one). Goal: <= 2.1 bytes a
  parameter in 8 bits.
- `step/*`: the library's step against the step a user writes by hand on the same model,
  loss, batch and Adam (`speed.py`'s `step_*` groups time them). Goal: library/hand <= 1.01.
- `paper/*`: Sohoni et al. (2019)'s tables: WRN-28-2 with momentum SGD, and a 12-block
  causal LM with Adam.
- `frontier/*`: each configuration of `quality.py`: its training step.

`tests/test_memory_grid.py` (slow) compiles rows again and fails when the committed
`results/memory_grid.json` no longer matches the code: rerun this script then.

    python benchmarks/memory.py                   # every row: writes results/memory_grid.json
    python benchmarks/memory.py --only guide/ paper/fp16   # rows by prefix, the rest kept
    python benchmarks/memory.py --smoke --out /tmp # tiny sizes, a check of the script
"""

import argparse
import json
import os
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout, if not installed
import quality  # noqa: E402
from _common import (  # noqa: E402
    ACCUMULATE,
    GUIDE,
    RESULTS,
    compiled_memory,
    encoder,
    run_workers,
    worker_main,
    write_json,
)
from _steps import (  # noqa: E402
    CHAR_LM_GUIDE,
    CHAR_LM_SMALL,
    LM_LOSS,
    LM_LOSS_SMOKE,
    OPTIMIZERS,
    SPARSE,
    SPARSE_MLP,
    STEP_CASES,
    char_lm,
    char_loss,
    hand_step,
    lm_mean_loss,
    plain_encoder,
    sparse_mlp,
    step_cases,
    wide_resnet,
    wrn_loss,
)

import eqx_lowmem as el  # noqa: E402

# Each group's sizes: the grid's, and the smoke run's (tiny; no H100 target). The shard
# rows' batch: accumulate=2 on each of up to 8 devices.
FULL = {
    "guide": GUIDE, "accumulate": ACCUMULATE, "sparse": SPARSE_MLP, "lm_loss": LM_LOSS,
    "optimizer_state": CHAR_LM_GUIDE, "frontier": quality.FRONTIER,
    "shard": {"n_layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 1024, "seq": 64, "batch": 32},
    "wrn": {"depth": 28, "width": 2, "batch": 100, "image": (3, 32, 32)},
    "lm": {"vocab": 10_000, "seq": 250, "batch": 16, "n_layers": 12, "d_model": 512,
           "n_heads": 4, "d_ff": 1024},
}  # fmt: skip
_TINY = {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_ff": 32, "seq": 8, "batch": 8}
SMOKE = {
    "guide": _TINY, "accumulate": _TINY, "sparse": {**SPARSE_MLP, "width": 32, "batch": 8},
    "lm_loss": LM_LOSS_SMOKE, "optimizer_state": CHAR_LM_SMALL,
    "frontier": quality.FRONTIER_QUICK, "shard": {**_TINY, "batch": 16},
    "wrn": {"depth": 10, "width": 1, "batch": 10, "image": (3, 8, 8)},
    "lm": {"vocab": 64, "seq": 16, "batch": 4, "n_layers": 2, "d_model": 32, "n_heads": 2,
           "d_ff": 64},
}  # fmt: skip
# name: (vocabulary, None for LM_LOSS's; the loss's chunk, None for whole float32 logits;
# the blocks' chunk_size, 64 by "auto"), or the head alone (hidden states in, loss out: its
# temporaries naive and chunked). The body's 128 is the least the chunked loss allows.
LM_LOSS_ROWS = {"naive": (None, None, "auto"), "chunked": (None, "auto", "auto"),
                "chunked_rows32": (None, "auto", 32), "body": (128, None, "auto"),
                "head": ()}  # fmt: skip
GPU_TARGET = "h100"

# name: options of the guide's step (remat, segment, scan, accumulate, precision, plain).
GUIDE_ROWS = {
    **{f"guide/{p}": {"remat": p} for p in ("none", "full", "dots", "minimal")},
    "guide/segments": {"segment": "sqrt"},
    **{f"guide/{p}_loop": {"remat": p, "scan": False} for p in ("none", "full", "dots", "minimal")},
    "guide/segments_loop": {"segment": "sqrt", "scan": False},
    "guide/accumulate_4": {"accumulate": 4},
    "guide/full_accumulate_4": {"remat": "full", "accumulate": 4},
    "guide/mixed_bf16": {"precision": "mixed_bf16"},
    "guide/mixed_bf16_full_accumulate_4": {"precision": "mixed_bf16", "remat": "full",
                                           "accumulate": 4},
    "guide/plain_eqx": {"plain": False},
    "guide/plain_eqx_checkpoint": {"plain": True},
}  # fmt: skip
PRECISIONS = ("float32", "mixed_bf16", "mixed_fp16", "half_bf16", "half_fp16")
# The paper's WRN rows at batch 100: name -> the step's options; a row may set `norm`
# ("group", "group_ws": WideResNet's; BatchNorm by default).
# FP32 and the paper's combination: the frontier's own options (`quality.py`).
_FP32 = {**quality._FP32, "accumulate_dtype": "float32"}
_COMBINED = quality._COMBINED
# What keeps the frontier's accuracy at one image (issue 36): GroupNorm + WS, dense.
_GNWS = {**_COMBINED, "accumulate": 100, "density": None, "norm": "group_ws"}
PAPER_WRN = {
    "baseline_fp32": _FP32,
    "fp16": {**_FP32, "precision": "half_fp16"},
    "checkpoint": {**_FP32, "remat": "checkpoint-residual-1"},
    "micro10": {**_FP32, "accumulate": 10},
    "sparse30": {**_FP32, "density": 0.3},
    "fp16_checkpoint": {**_FP32, "precision": "half_fp16", "remat": "checkpoint-residual-1"},
    "fp16_checkpoint_micro10": {**_COMBINED, "density": None},
    "fp16_checkpoint_micro10_sparse30": _COMBINED,
    "fp16_checkpoint3_micro10_sparse30": {**_COMBINED, "remat": "checkpoint-residual-3"},
    "fp16_checkpoint_micro50_sparse30": {**_COMBINED, "accumulate": 50},
    "fp16_checkpoint_micro100_sparse30": {**_COMBINED, "accumulate": 100},
    "gnws_fp16_checkpoint_micro100": _GNWS,
    "gnws_fp16_checkpoint_micro100_q8": {**_GNWS, "quantized": True},  # 8-bit momentum
    "gnws_fp16_checkpoint_micro100_sparse30": {**_GNWS, "density": 0.3},
}
# (precision, remat, accumulate: "per_sequence" is one sequence per micro-batch, dtype)
PAPER_LM = {
    "transformer_baseline_fp32": ("float32", False, 1, "float32"),
    "transformer_fp16": ("half_fp16", False, 1, "float32"),
    "transformer_checkpoint": ("float32", True, 1, "float32"),
    "transformer_micro250": ("float32", False, "per_sequence", "float32"),
    "transformer_fp16_checkpoint_micro250": ("half_fp16", True, "per_sequence", "float16"),
}


def _shapes(cfg: dict) -> tuple:
    x = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"], cfg["d_model"]), jnp.float32)
    return x, x


def _with_gpu(figures, gpu: bool) -> dict:
    """The row `figures(None)` (XLA:CPU's) and, where `gpu`, `figures(target)` for an H100."""
    row = figures(None)
    if gpu:
        row[GPU_TARGET] = figures(el.memory.Target(GPU_TARGET))
    return row


def guide_row(cfg: dict, opts: dict) -> dict:
    """The compiled memory of the guide's step (`make_step`, or plain Equinox's)."""

    if "plain" in opts:  # the hand step (SGD) on plain Equinox's encoder
        model, optimizer = plain_encoder(cfg, opts["plain"]), optax.sgd(0.01)
        params = eqx.filter(model, eqx.is_inexact_array)
        hand = hand_step(model, el.train.mse, optimizer)
        return compiled_memory(hand.lower(params, optimizer.init(params), _shapes(cfg)).compile())
    structure = {"segment": opts.get("segment"), "scan": opts.get("scan", True)}
    model = eqx.filter_eval_shape(encoder, cfg, jr.PRNGKey(0), opts.get("remat", "none"),
                                  **structure)  # fmt: skip
    step = el.train.make_step(el.train.mse, optax.sgd(0.01), precision=opts.get("precision"),
                              accumulate=opts.get("accumulate", 1))  # fmt: skip
    state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(1))
    return compiled_memory(step.lower(state, _shapes(cfg)).compile())


def precision_row(cfg: dict, preset: str) -> dict:
    """What the backward pass keeps in `preset` (traced), and parameters + Adam's state."""

    policy, found = el.precision.get_policy(preset), []

    def loss(params, x, y):
        model = policy.cast_to_compute(params)
        return jnp.sum(el.train.mse(model, *policy.cast_to_compute((x, y))))

    def trace(x):
        model = policy.cast_to_param(encoder(cfg, jr.PRNGKey(0)))  # as step.init stores it
        found.extend(el.memory.saved_residuals(loss, model, x, x))
        return jnp.zeros(())

    jax.eval_shape(trace, _shapes(cfg)[0])
    kept = [r for r in found if r.source.startswith("intermediate")
            or r.source.endswith("(transformed)") or r.source == "constant"]  # fmt: skip
    step = el.train.make_step(el.train.mse, optax.adam(1e-3), precision=preset)
    state = eqx.filter_eval_shape(step.init, eqx.filter_eval_shape(encoder, cfg, jr.PRNGKey(0)),
                                  key=jr.PRNGKey(1))  # fmt: skip
    leaves = jax.tree.leaves((state.model, state.opt_state))
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves if hasattr(x, "dtype"))
    return {"saved_bytes": sum(r.nbytes for r in kept), "param_opt_bytes": int(nbytes)}


def shard_rows(cfg: dict) -> dict:
    """Replicated against FSDP over 2, 4 and 8 devices: per-device compiled bytes, in a
    process of its own where this one has fewer devices (8 host devices are set before JAX
    starts: `--worker`)."""
    if jax.device_count() < 8:
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
        return run_workers(__file__, [cfg], timeout=1800, env={"XLA_FLAGS": flags})[0]

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2, axis=(1, 2))

    model = encoder(cfg, jr.PRNGKey(0), "full")  # real: init places the state on the mesh
    batch = (jr.normal(jr.PRNGKey(1), _shapes(cfg)[0].shape),)
    out = {}
    for n in (2, 4, 8):
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
        row = {}
        for shard in ("data", "fsdp"):
            step = el.train.make_step(loss, optax.adam(1e-3), accumulate=2, mesh=mesh, shard=shard)
            state = step.init(model, key=jr.PRNGKey(2))
            row[shard] = compiled_memory(step.lower(state, batch).compile())
        out[f"shard/{n}"] = row
    return out


def sparse_row(cfg: dict, name: str) -> dict:
    """A sparse-storage step's compiled memory and its parameters plus Adam's state."""
    model, batch, step = sparse_mlp(name, cfg)
    state = step.init(model, key=jr.PRNGKey(4))
    stored = jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))
    memory = compiled_memory(step.lower(state, batch).compile())
    return {**memory, "params_opt_bytes": sum(int(a.nbytes) for a in stored)}


def paper_row(cfg: dict, name: str, gpu: bool) -> dict:
    """A paper row: the memory report's parts on XLA:CPU and (`gpu`) its compiled figures
    for an H100."""
    if name in PAPER_WRN:
        o = PAPER_WRN[name]
        precision, accumulate, acc_dtype = o["precision"], o["accumulate"], o["accumulate_dtype"]
        accumulate = min(accumulate, cfg["batch"])  # the smoke batch: micro-batches of one
        opts = {**o, "storage": "bits"}
        model, state = wide_resnet(opts, cfg["depth"], cfg["width"], jr.PRNGKey(0))
        batch = (jax.ShapeDtypeStruct((cfg["batch"], *cfg["image"]), jnp.uint8),
                 jax.ShapeDtypeStruct((cfg["batch"],), jnp.int32))  # fmt: skip
        optimizer = optax.sgd(0.1, momentum=0.9)
        if o.get("quantized"):
            optimizer = el.precision.quantized_state(optimizer)
        args = (model, wrn_loss, optimizer, batch)
        extra = {"has_state": True, "model_state": state}
    else:
        precision, remat, accumulate, acc_dtype = PAPER_LM[name]
        accumulate = cfg["batch"] if accumulate == "per_sequence" else accumulate
        model = el.nn.CausalLM(*(cfg[k] for k in ("vocab", "seq", "n_layers", "d_model",
                                                  "n_heads", "d_ff")),
                               key=jr.PRNGKey(0), remat=remat, tie_embeddings=True)  # fmt: skip
        batch = (jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32),)
        args, extra = (model, el.train.next_token_loss, optax.adam(1e-3), batch), {}

    def figures(target) -> dict:
        r = el.memory.memory_report(*args, accumulate=accumulate, precision=precision,
                                    accumulate_dtype=jnp.dtype(acc_dtype), name=name,
                                    target=target, **extra)  # fmt: skip
        if target is not None:
            return {"total": int(r.peak_bytes), "at_peak": r.at_peak,
                    "live_at_peak": r.live_peak_bytes, "device": r.device}  # fmt: skip
        s, at_peak = r.sizes, r.at_peak or {}
        row = {"model": s["parameters"], "gradients": s["gradients"] + s["accumulator"]}
        row |= {k: s[k] for k in ("optimizer", "activations", "batch")}
        row.update(total=int(r.peak_bytes), sum_of_parts=int(sum(row.values())), at_peak=at_peak,
                   live_at_peak=r.live_peak_bytes, packing=r.packing_bytes,
                   backend_upcast_bytes=at_peak.get("upcasts", 0))  # fmt: skip
        return row

    return _with_gpu(figures, gpu)


def _compiled(fn, args, target) -> dict:
    """`compiled_memory` of `jax.jit(fn)` at `args`, for `target` when given (`args` on its
    device; cuBLAS for the products whose Triton tiles need the device)."""
    from eqx_lowmem.memory._compile import NO_TRITON_GEMM

    options = None
    if target is not None:
        device = jax.sharding.SingleDeviceSharding(target.devices_of_topology()[0])
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            args)  # fmt: skip
        options = {**target.options(), **NO_TRITON_GEMM}
    return compiled_memory(jax.jit(fn).lower(*args).compile(compiler_options=options))


def lm_loss_memory(c: dict, name: str, target=None) -> dict:
    """`LM_LOSS_ROWS[name]`'s loss-and-gradient memory at `c`'s size, for `target` if given."""
    from eqx_lowmem.train._chunked import DEFAULT_CHUNK

    n, d, v = c["batch"] * c["seq"], c["d_model"], c["vocab"]
    if name == "head":
        shapes = ((n, d, jnp.float32), (v, d, jnp.float32), (v, jnp.float32), (n, jnp.int32))
        args = tuple(jax.ShapeDtypeStruct(s[:-1], s[-1]) for s in shapes)

        def naive(h, w, b, t):
            logp = jax.nn.log_softmax(h @ w.T + b[None, :], axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, t[:, None], axis=1))

        def chunked(h, w, b, t):
            loss = el.train.chunked_cross_entropy(h, w, t, head_bias=b, chunk=DEFAULT_CHUNK)
            return jnp.mean(loss)

        grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2))  # noqa: E731
        return {p: _compiled(grad(f), args, target)["temp"] for p, f in
                (("naive", naive), ("chunked", chunked))}  # fmt: skip
    vocab, chunk, rows = LM_LOSS_ROWS[name]
    model = el.nn.CausalLM(vocab or v, c["seq"], c["layers"], d, c["heads"], c["d_ff"],
                           key=jr.key(0), remat=c["remat"], chunk_size=rows)  # fmt: skip
    arrays, static = eqx.partition(model, eqx.is_array)
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"] + 1), jnp.int32)

    def loss(arrays, tokens):
        return lm_mean_loss(eqx.combine(arrays, static), tokens, chunk)

    return _compiled(jax.value_and_grad(loss), (arrays, tokens), target)


def lm_loss_row(c: dict, name: str, gpu: bool) -> dict:
    """An `lm_loss/*` row: on XLA:CPU and (`gpu`) for an H100."""
    return _with_gpu(lambda target: lm_loss_memory(c, name, target), gpu)


def optimizer_state_row(cfg: dict, variant: str, gpu: bool) -> dict:
    """An `optimizer_state/*` row: the state's bytes a parameter and the step's report."""
    model = char_lm(cfg, jr.PRNGKey(0), remat="full")
    params = eqx.filter(model, eqx.is_inexact_array)
    state = jax.eval_shape(OPTIMIZERS[variant]().init, params)
    stored = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    batch = (jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32),)

    def report(target) -> dict:
        r = el.memory.memory_report(model, char_loss, OPTIMIZERS[variant](), batch,
                                    target=target).to_dict()  # fmt: skip
        return {"peak_bytes": r["peak_bytes"], "optimizer_bytes": r["parts"]["optimizer"],
                "argument_bytes": r["compiled"]["argument"], "temp_bytes": r["compiled"]["temp"],
                "device": r["device"]}  # fmt: skip

    per_param = stored / sum(x.size for x in jax.tree.leaves(params))
    return {"bytes_per_param": per_param, **_with_gpu(report, gpu)}


def step_row(case: str) -> dict:
    """A `step/*` row: the compiled memory of the library's step and of the hand step."""
    model, loss, batch = step_cases()[case]
    step, optimizer = el.train.make_step(loss, optax.adam(1e-3)), optax.adam(1e-3)
    state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(2))
    params = eqx.filter(model, eqx.is_inexact_array)
    hand = hand_step(model, loss, optimizer).lower(params, optimizer.init(params), batch)
    return {"library": compiled_memory(step.lower(state, batch).compile()),
            "hand": compiled_memory(hand.compile())}  # fmt: skip


def frontier_row(cfg: dict, name: str, gpu: bool) -> dict:
    """A frontier configuration's training step (`quality.py`) at its batch,
    compiled for XLA:CPU and for an H100 (there without DSR's rewiring hook, whose host
    callback compiles only for a backend this process runs)."""
    batch = (jax.ShapeDtypeStruct((cfg["batch"], 1, 28, 28), jnp.float32),
             jax.ShapeDtypeStruct((cfg["batch"],), jnp.int32))  # fmt: skip

    def peak(opts, mesh=None):
        step = quality.make_config_step(cfg, opts, mesh)
        state = eqx.filter_eval_shape(lambda: quality.init_state(0, cfg, step, opts))
        return compiled_memory(step.lower(state, batch).compile())["peak"]

    opts = quality.ALL_CONFIGS[name]
    opts = {**opts, "accumulate": min(opts["accumulate"], cfg["batch"])}  # the smoke batch
    row = {"peak": peak(opts)}
    if gpu:
        gpu_mesh = el.memory.Target(GPU_TARGET).mesh((1,), ("data",))
        row[GPU_TARGET] = peak({**opts, "rewire": False}, gpu_mesh)
    return row


def rows(smoke: bool) -> dict:
    """Every row's name and the call that computes it (shard's: all its rows at once)."""
    size, gpu = (SMOKE, False) if smoke else (FULL, True)
    out = {n: (guide_row, size["guide"], o) for n, o in GUIDE_ROWS.items()}
    out |= {f"precision/{p}": (precision_row, size["guide"], p) for p in PRECISIONS}
    out |= {f"accumulate/k{k}": (guide_row, size["accumulate"], {"accumulate": k})
            for k in (1, 2, 4, 8)}  # fmt: skip
    out["shard/"] = (shard_rows, size["shard"])
    out |= {f"sparse/{n}": (sparse_row, size["sparse"], n) for n in SPARSE}
    out |= {f"lm_loss/{n}": (lm_loss_row, size["lm_loss"], n, gpu) for n in LM_LOSS_ROWS}
    out |= {f"optimizer_state/{n}": (optimizer_state_row, size["optimizer_state"], n, gpu)
            for n in OPTIMIZERS}  # fmt: skip
    out |= {f"step/{n}": (step_row, n) for n in STEP_CASES}
    out |= {f"paper/{n}": (paper_row, size["wrn"], n, gpu) for n in PAPER_WRN}
    out |= {f"paper/{n}": (paper_row, size["lm"], n, gpu) for n in PAPER_LM}
    return out | {f"frontier/{n}": (frontier_row, size["frontier"], n, gpu)
                  for n in quality.ALL_CONFIGS}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=[""], help="rows whose name starts so")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no GPU target")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, shard_rows)
    path = args.out / "memory_grid.json"
    kept = json.loads(path.read_text())["rows"] if path.exists() else {}
    found = {}
    for name, (fn, *fargs) in rows(args.smoke).items():
        if not any(name.startswith(p) for p in args.only):
            continue
        found |= fn(*fargs) if name == "shard/" else {name: fn(*fargs)}  # shard/: 3 rows
        # Written after every row: a long run keeps what it compiled.
        path = write_json("memory_grid", {"rows": {**kept, **found}}, directory=args.out)
        print(f"{name}: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
