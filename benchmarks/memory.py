"""The memory grid: every compile-only figure, deterministic (nothing runs, nothing is timed).

Each row compiles a training step on abstract shapes and records `memory_analysis()`
(argument + output + temp - alias: what XLA allocates) or the memory report's parts:

- `guide/*`: the guide's transformer (12 blocks, d_model 512, 8 heads, d_ff 2048, seq 256,
  batch 32, MSE, SGD) under each remat preset, scanned and as a Python loop, segments,
  accumulation, mixed bf16, and plain Equinox (`lax.scan`, body in `eqx.filter_checkpoint`)
  (`speed.py`'s `guide/*` time the rows of the same names at 4 blocks of width 128, batch 8).
- `precision/*`: each precision preset on the guide's transformer: what the backward pass
  keeps (traced) and the bytes of parameters plus Adam's state (abstract shapes).
- `accumulate/*`: the accumulation benchmark's transformer (2 blocks, d_model 256, batch 32)
  whole and in k micro-batches (`speed.py`'s `accumulate/*` time k = 1 and 4).
- `shard/*`: a 4-block encoder with Adam, replicated against FSDP over 2, 4 and 8 host
  devices (in a worker process started with 8 of them).
- `sparse/*`: sparse storage (issue 11) on an MLP of three 1024x1024 layers and a 10-way
  head, batch 128, Adam, 30% density: ours (indices or a bit set, with DSR or not) against
  dense, jaxpruner's masked dense weight and `jax.experimental.sparse`'s BCOO; parameters
  plus Adam's state and the step's peak (`speed.py`'s `sparse/*` rows time the same steps).
- `frontier/*`: each configuration of `quality.py --frontier`: its training step at batch
  100 on XLA:CPU and for an H100.
- `lm_loss/*`: the language-model loss's two paths (issue 36) on a 2-layer `CausalLM(remat=True)`
  at a vocabulary of 32,000, d_model 512, 8 x 256 predicted tokens: the loss-and-gradient
  with whole float32 logits (`naive`, `chunk=None`) and chunked (`chunked`, the default),
  the body alone (`body`: vocabulary 128, which the chunked loss cannot go below), the
  chunked loss with the blocks' rows in chunks of 32 (`chunked_rows32`; 64 by default) and
  the head alone (`head`: hidden states in, loss out; its temporaries naive and chunked),
  on XLA:CPU and for an H100 (`speed.py`'s `lm_loss/*` time the same). Goal: >= 10x fewer
  temporaries.
- `optimizer_state/*`: Adam's state in float32, 16 bits (`half_state`) and 8 bits
  (`quantized_state`): its bytes a parameter and the compiled step's peak (`memory_report`)
  on the guide's character LM (12 layers, d_model 512, seq 256, batch 32, full
  recomputation), on XLA:CPU and for an H100 (`speed.py`'s `optimizer_state/*` time them on
  a small one). Goal: <= 2.1 bytes a parameter in 8 bits.
- `step/*`: the library's step (`make_step`) against the step a user writes by hand
  (`hand_step`) on the same model, loss, batch and Adam, for an MLP 784-512-512-10 at batch
  256, a small `CausalLM`, a small WideResNet and a 64-block recomputed encoder
  (`step_cases`; `speed.py`'s `step_*` groups time them). Goal: library/hand <= 1.01.
- `paper/*`: Sohoni et al. (2019)'s tables, each row a `memory_report` of the real step on
  XLA:CPU and for an H100 (a compile-only GPU target): WRN-28-2 at batch 100 with momentum
  SGD, and a 12-block causal LM with Adam (16 sequences of 250 tokens).

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

SHARD = {"n_layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 1024, "seq": 64, "batch": 32}
WRN = {"depth": 28, "width": 2, "batch": 100, "image": (3, 32, 32)}
LM = {"vocab": 10_000, "seq": 250, "batch": 16, "n_layers": 12, "d_model": 512, "n_heads": 4,
      "d_ff": 1024}  # fmt: skip
SMOKE = {
    "guide": {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_ff": 32, "seq": 8, "batch": 8},
    "wrn": {"depth": 10, "width": 1, "batch": 10, "image": (3, 8, 8)},
    "lm": {"vocab": 64, "seq": 16, "batch": 4, "n_layers": 2, "d_model": 32, "n_heads": 2,
           "d_ff": 64},
}  # fmt: skip
# name: (vocabulary, None for LM_LOSS's; the loss's chunk; the blocks' chunk_size), or the head
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
_FP16_CHECKPOINT = {**_FP32, "precision": "half_fp16", "remat": "checkpoint-residual-1"}
_COMBINED = quality._COMBINED
# What keeps the frontier's accuracy at one image (issue 36): GroupNorm + WS, dense.
_GNWS = {**_COMBINED, "accumulate": 100, "density": None, "norm": "group_ws"}
PAPER_WRN = {
    "baseline_fp32": _FP32,
    "fp16": {**_FP32, "precision": "half_fp16"},
    "checkpoint": {**_FP32, "remat": "checkpoint-residual-1"},
    "micro10": {**_FP32, "accumulate": 10},
    "sparse30": {**_FP32, "density": 0.3},
    "fp16_checkpoint": _FP16_CHECKPOINT,
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


def _report_row(report_for, gpu: bool) -> dict:
    """A paper row: the report's parts on XLA:CPU and its compiled figures for an H100."""
    r = report_for(None)
    s, at_peak = r.sizes, r.at_peak or {}
    row = {"model": s["parameters"], "gradients": s["gradients"] + s["accumulator"]}
    row |= {k: s[k] for k in ("optimizer", "activations", "batch")}
    row.update(total=int(r.peak_bytes), sum_of_parts=int(sum(row.values())), at_peak=at_peak,
               live_at_peak=r.live_peak_bytes, packing=r.packing_bytes,
               backend_upcast_bytes=at_peak.get("upcasts", 0))  # fmt: skip
    if gpu:
        g = report_for(GPU_TARGET)
        row[GPU_TARGET] = {"total": int(g.peak_bytes), "at_peak": g.at_peak,
                           "live_at_peak": g.live_peak_bytes, "device": g.device}  # fmt: skip
    return row


def paper_row(name: str, smoke: bool) -> dict:

    if name in PAPER_WRN:
        cfg = SMOKE["wrn"] if smoke else WRN
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
        cfg = SMOKE["lm"] if smoke else LM
        precision, remat, accumulate, acc_dtype = PAPER_LM[name]
        accumulate = cfg["batch"] if accumulate == "per_sequence" else accumulate
        model = el.nn.CausalLM(*(cfg[k] for k in ("vocab", "seq", "n_layers", "d_model",
                                                  "n_heads", "d_ff")),
                               key=jr.PRNGKey(0), remat=remat, tie_embeddings=True)  # fmt: skip
        batch = (jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32),)
        args, extra = (model, el.train.next_token_loss, optax.adam(1e-3), batch), {}

    def report(target):
        return el.memory.memory_report(*args, accumulate=accumulate, precision=precision,
                                       accumulate_dtype=jnp.dtype(acc_dtype), name=name,
                                       target=target, **extra)  # fmt: skip

    return _report_row(report, gpu=not smoke)


def _placed(shape: tuple, dtype, target):
    """Zeros of `shape`, or for a compile-only `target` the shape on its device."""
    if target is None:
        return jnp.zeros(shape, dtype)
    sharding = jax.sharding.SingleDeviceSharding(target.devices_of_topology()[0])
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _compiled(fn, args, target) -> dict:
    """`compiled_memory` of `jax.jit(fn)` at `args`, for `target` when given (cuBLAS for
    the products whose Triton tiles need the device)."""
    from eqx_lowmem.memory._compile import NO_TRITON_GEMM

    lowered = jax.jit(fn).lower(*args)
    options = None if target is None else {**target.options(), **NO_TRITON_GEMM}
    return compiled_memory(lowered.compile(compiler_options=options))


def lm_loss_memory(c: dict, name: str, target=None) -> dict:
    """`LM_LOSS_ROWS[name]`'s loss-and-gradient memory at `c`'s size (see the docstring)."""
    from eqx_lowmem.train._chunked import DEFAULT_CHUNK

    n, d, v = c["batch"] * c["seq"], c["d_model"], c["vocab"]
    if name == "head":
        shapes = ((n, d, jnp.float32), (v, d, jnp.float32), (v, jnp.float32), (n, jnp.int32))
        args = tuple(_placed(s[:-1], s[-1], target) for s in shapes)

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
    arrays = jax.tree.map(lambda a: _placed(a.shape, a.dtype, target), arrays)
    tokens = _placed((c["batch"], c["seq"] + 1), jnp.int32, target)

    def grad(arrays, tokens):
        return jax.value_and_grad(lambda a: lm_mean_loss(eqx.combine(a, static), tokens, chunk))(
            arrays
        )

    return _compiled(grad, (arrays, tokens), target)


def lm_loss_row(name: str, smoke: bool) -> dict:
    """An `lm_loss/*` row: on XLA:CPU and (not `smoke`) for an H100."""
    c = LM_LOSS_SMOKE if smoke else LM_LOSS
    row = lm_loss_memory(c, name)
    if not smoke:
        row[GPU_TARGET] = lm_loss_memory(c, name, el.memory.Target(GPU_TARGET))
    return row


def optimizer_state_row(variant: str, smoke: bool) -> dict:
    """An `optimizer_state/*` row: the state's bytes a parameter and the step's report."""
    model = char_lm(CHAR_LM_SMALL if smoke else CHAR_LM_GUIDE, jr.PRNGKey(0), remat="full")
    cfg, params = CHAR_LM_SMALL if smoke else CHAR_LM_GUIDE, eqx.filter(model, eqx.is_inexact_array)
    state = jax.eval_shape(OPTIMIZERS[variant]().init, params)
    stored = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    batch = (jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32),)

    def report(target):
        r = el.memory.memory_report(model, char_loss, OPTIMIZERS[variant](), batch,
                                    target=target).to_dict()  # fmt: skip
        return {"peak_bytes": r["peak_bytes"], "optimizer_bytes": r["parts"]["optimizer"],
                "argument_bytes": r["compiled"]["argument"], "temp_bytes": r["compiled"]["temp"],
                "device": r["device"]}  # fmt: skip

    row = {"bytes_per_param": stored / sum(x.size for x in jax.tree.leaves(params)), **report(None)}
    return row if smoke else row | {GPU_TARGET: report(GPU_TARGET)}


def step_row(case: str) -> dict:
    """A `step/*` row: the compiled memory of the library's step and of the hand step."""
    model, loss, batch = step_cases()[case]
    step, optimizer = el.train.make_step(loss, optax.adam(1e-3)), optax.adam(1e-3)
    state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(2))
    params = eqx.filter(model, eqx.is_inexact_array)
    hand = hand_step(model, loss, optimizer).lower(params, optimizer.init(params), batch)
    return {"library": compiled_memory(step.lower(state, batch).compile()),
            "hand": compiled_memory(hand.compile())}  # fmt: skip


def frontier_row(name: str, smoke: bool) -> dict:
    """A frontier configuration's training step (`quality.py --frontier`) at its batch,
    compiled for XLA:CPU and for an H100 (there without DSR's rewiring hook, whose host
    callback compiles only for a backend this process runs)."""
    cfg = {**(quality.FRONTIER_QUICK if smoke else quality.FRONTIER)}
    batch = (jax.ShapeDtypeStruct((cfg["batch"], 1, 28, 28), jnp.float32),
             jax.ShapeDtypeStruct((cfg["batch"],), jnp.int32))  # fmt: skip

    def peak(opts, mesh=None):
        step = quality.make_config_step(cfg, opts, mesh)
        state = eqx.filter_eval_shape(lambda: quality.init_state(0, cfg, step, opts))
        return compiled_memory(step.lower(state, batch).compile())["peak"]

    opts = quality.ALL_CONFIGS[name]
    row = {"peak": peak(opts)}
    if not smoke:
        gpu = el.memory.Target(GPU_TARGET)
        row[GPU_TARGET] = peak({**opts, "rewire": False}, gpu.mesh((1,), ("data",)))
    return row


def rows(smoke: bool) -> dict:
    """Every row's name and the call that computes it (shard's: all its rows at once)."""
    guide = SMOKE["guide"] if smoke else GUIDE
    acc = SMOKE["guide"] if smoke else ACCUMULATE
    out = {n: (guide_row, guide, o) for n, o in GUIDE_ROWS.items()}
    out |= {f"precision/{p}": (precision_row, guide, p) for p in PRECISIONS}
    out |= {f"accumulate/k{k}": (guide_row, acc, {"accumulate": k}) for k in (1, 2, 4, 8)}
    # The shard rows' batch: accumulate=2 on each of up to 8 devices.
    out["shard/"] = (shard_rows, {**SMOKE["guide"], "batch": 16} if smoke else SHARD)
    mlp = {**SPARSE_MLP, "width": 32, "batch": 8} if smoke else SPARSE_MLP
    out |= {f"sparse/{n}": (sparse_row, mlp, n) for n in SPARSE}
    out |= {f"lm_loss/{n}": (lm_loss_row, n, smoke) for n in LM_LOSS_ROWS}
    out |= {f"optimizer_state/{n}": (optimizer_state_row, n, smoke) for n in OPTIMIZERS}
    out |= {f"step/{n}": (step_row, n) for n in STEP_CASES}
    out |= {f"paper/{n}": (paper_row, n, smoke) for n in (*PAPER_WRN, *PAPER_LM)}
    return out | {f"frontier/{n}": (frontier_row, n, smoke) for n in quality.ALL_CONFIGS}


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
