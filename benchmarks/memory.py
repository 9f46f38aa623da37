"""The memory report's predicted peak against the device's measured peak.

For each configuration (the guide's transformer in three settings, a causal language
model and an MLP), a fresh process compiles the training step, predicts its peak
(`eqx_lowmem.memory.memory_report`), and, on a GPU, runs one step and reads
`peak_bytes_in_use` (with `XLA_PYTHON_CLIENT_PREALLOCATE=false`). A second process compiles
the same step for XLA:CPU and records its prediction and its GPU/TPU estimate (for 16-bit
compute: the float32-compute twin's peak with 16-bit saved activations), the figures a user
planning on a laptop would see; `cpu_estimate_error` compares that estimate with the GPU.
The offloaded configuration keeps its saved names in pinned host memory on a GPU: the row
records the report's host bytes (`memory_analysis().host_*`), 0 on XLA:CPU, which drops the
placement. On a machine without a GPU only the CPU figures are written.

Every configuration is also compiled for a GPU it may not have (a compile-only target,
`memory_report(..., target=...)`): an H100 here, the lent GPU's own kind on a GPU, where
`compile_only_error` compares that figure with the measured peak (the compile-only figure
is trusted as far as it agrees). Also times the command line on the guide's configuration:
`eqx-lowmem report` on XLA:CPU (goal: < 30 s) and for an H100 (< 60 s), and
`eqx-lowmem plan --target a100-40gb` with the default candidates and budget (< 5 minutes).

    python benchmarks/memory.py            # writes benchmarks/results/memory.json
    python benchmarks/memory.py --only guide_full_mixed_x4
    python benchmarks/memory.py --lm-loss  # writes benchmarks/results/lm_loss.json

`--lm-loss` compares the language-model loss's two paths side by side in one process:
`next_token_loss(..., chunk=None)` (whole float32 logits and log-softmax) against the
chunked default (`chunked_cross_entropy`), on a 2-layer `CausalLM(remat=True)` at a
vocabulary of 32,000, d_model 512, one micro-batch of 8 x 256 predicted tokens: the
loss-and-gradient's compiled temporaries (the whole model's, and the head's alone), the
largest differences of loss and gradients, and the median ratio of step times
(interleaved rounds). Goals (issue 36): >= 10x fewer temporaries, <= 1.0x the time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo, if not installed
from _common import MARKER, spawn, write_json  # noqa: E402

GUIDE = {"layers": 12, "d_model": 512, "heads": 8, "d_ff": 2048, "seq": 256, "batch": 32}
# name: (model, remat, accumulate, precision)
_TABLE = {
    "guide_none_fp32": ("guide", False, 1, "float32"),
    "guide_dots_fp32_x2": ("guide", "dots", 2, "float32"),
    "guide_full_mixed_x4": ("guide", True, 4, "mixed_bf16"),
    "guide_offloaded_mixed": ("guide", "minimal_offloaded", 1, "mixed_bf16"),
    "lm_minimal_mixed": ("lm", "minimal", 1, "mixed_bf16"),
    "mlp_fp32_x2": ("mlp", False, 2, "float32"),
}
CONFIGS = {
    name: dict(zip(("model", "remat", "accumulate", "precision"), row, strict=True))
    for name, row in _TABLE.items()
}
GOALS = {
    "gpu_prediction_error": 0.05,
    "cli_guide_report_seconds_cpu": 30.0,
    "cli_guide_report_seconds_h100": 60.0,
    "cli_guide_plan_seconds_a100_40gb": 300.0,
}
# The compile-only target of each device kind a GPU may report (`device_kind`).
_KINDS = {"H100 80GB": "h100", "H100 PCIe": "h100-pcie", "H200": "h200", "A100-SXM4-40GB":
          "a100-40gb", "A100-SXM4-80GB": "a100-80gb", "L4": "l4", "A10G": "a10g",
          "RTX 4090": "rtx4090", "V100": "v100"}  # fmt: skip


def compile_only_target(device_kind: str | None) -> str | None:
    """The target that compiles for the GPU this runs on (an H100 on XLA:CPU); None for a
    GPU without one."""
    if device_kind is None:
        return "h100"
    return next((t for kind, t in _KINDS.items() if kind in device_kind), None)


def build(config: dict):
    """(model, loss_fn, optimizer, batch) of a configuration; batch as shapes."""
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import optax

    import eqx_lowmem as el

    key = jr.PRNGKey(0)
    if config["model"] == "guide":
        g = GUIDE
        model = el.nn.transformer_encoder(
            g["layers"], g["d_model"], g["heads"], g["d_ff"], key=key, remat=config["remat"]
        )
        x = jax.ShapeDtypeStruct((g["batch"], g["seq"], g["d_model"]), jnp.float32)
        return model, el.train.mse, optax.adam(1e-3), (x, x)
    if config["model"] == "lm":
        model = el.nn.CausalLM(8192, 256, 6, 512, 8, 2048, key=key, remat=config["remat"])
        tokens = jax.ShapeDtypeStruct((16, 256), jnp.int32)
        return model, el.train.next_token_loss, optax.adamw(1e-3), (tokens,)
    model = el.nn.mlp([1024, 4096, 4096, 1024], key=key)
    x = jax.ShapeDtypeStruct((512, 1024), jnp.float32)
    return model, el.train.mse, optax.sgd(1e-2, momentum=0.9), (x, x)


def child(name: str) -> None:
    """One configuration in this (fresh) process: predict, and measure on an accelerator."""
    import jax

    import eqx_lowmem as el

    config = CONFIGS[name]
    model, loss_fn, optimizer, batch = build(config)
    measure = jax.default_backend() != "cpu"

    def report(**kwargs):
        t0 = time.perf_counter()
        r = el.memory.memory_report(model, loss_fn, optimizer, batch, name=name,
                                    accumulate=config["accumulate"],
                                    precision=config["precision"], **kwargs)  # fmt: skip
        return r.to_dict(), time.perf_counter() - t0

    here, seconds = report(measure=measure)
    out = {"seconds": seconds, "report": here}
    target = compile_only_target(jax.devices()[0].device_kind if measure else None)
    if target is not None:
        out["target"], out["target_seconds"] = report(target=target)
    print(MARKER + json.dumps(out), flush=True)


def run_child(name: str, platform: str | None) -> dict | None:
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if platform:
        env["JAX_PLATFORMS"] = platform
    try:
        return spawn(__file__, {"name": name}, timeout=600, env=env)
    except RuntimeError as e:
        print(f"{name} ({platform or 'default'}) failed: {e}", flush=True)
        return None


_TARGET_COMMANDS = {
    "cli_guide_report_seconds_h100": ["report", "--target", "h100"],
    "cli_guide_plan_seconds_a100_40gb": ["plan", "--target", "a100-40gb"],
}


def _target_row(child: dict) -> dict | None:
    """A configuration's figures for its compile-only target."""
    r = child.get("target")
    if r is None:
        return None
    return {"device": r["device"], "peak_bytes": r["peak_bytes"], "parts": r["parts"],
            "at_peak": r["at_peak"], "compiler_options": r["config"]["compiler_options"],
            "report_seconds": child["target_seconds"]}  # fmt: skip


def time_command(args: list[str]) -> dict:
    """Wall seconds of `eqx-lowmem ARGS` on the guide's configuration (the default model)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "eqx_lowmem.memory._cli", *args],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "ok": done.returncode == 0, "stdout": done.stdout[-4000:]}


def time_cli() -> dict:
    """Wall seconds of `eqx-lowmem report` on the guide's configuration, with --plot, on CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "guide.png"
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "eqx_lowmem.memory._cli", "report", "--plot", str(png)],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.perf_counter() - t0
        ok = done.returncode == 0 and png.stat().st_size > 10_000
        return {"seconds": seconds, "ok": ok, "stdout": done.stdout[-4000:]}


LM_LOSS = {"vocab": 32_000, "d_model": 512, "layers": 2, "heads": 8, "d_ff": 2048}
LM_LOSS.update(remat=True, batch=8, seq=256, rounds=7)


def _head_temps(c: dict, chunk: int) -> dict[str, int]:
    """The head alone (hidden states and head in, loss out): its loss-and-gradient
    temporaries, naive (whole logits and log-softmax) and chunked."""
    import jax
    import jax.numpy as jnp

    import eqx_lowmem as el

    n, d, v = c["batch"] * c["seq"], c["d_model"], c["vocab"]
    args = (jnp.zeros((n, d)), jnp.zeros((v, d)), jnp.zeros((v,)), jnp.zeros((n,), jnp.int32))

    def naive(h, w, b, t):
        logp = jax.nn.log_softmax(h @ w.T + b[None, :], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, t[:, None], axis=1))

    def chunked(h, w, b, t):
        return jnp.mean(el.train.chunked_cross_entropy(h, w, t, head_bias=b, chunk=chunk))

    def temp(f):
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    return {"naive": temp(naive), "chunked": temp(chunked)}


def lm_loss() -> dict:
    """The naive and the chunked LM loss side by side (see the module's docstring)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    from _common import compiled_memory, interleaved, median_ratio

    import eqx_lowmem as el
    from eqx_lowmem.train._chunked import DEFAULT_CHUNK

    c = LM_LOSS
    model = el.nn.CausalLM(
        c["vocab"], c["seq"], c["layers"], c["d_model"], c["heads"], c["d_ff"],
        key=jr.key(0), remat=c["remat"],
    )  # fmt: skip
    tokens = jr.randint(jr.key(1), (c["batch"], c["seq"] + 1), 0, c["vocab"])

    def loss(model, chunk):
        values, weights = el.train.next_token_loss(model, tokens, chunk=chunk)
        return jnp.sum(values * weights) / jnp.sum(weights)

    paths = {"naive": None, "chunked": "auto"}
    fns = {n: eqx.filter_jit(eqx.filter_value_and_grad(loss)) for n in paths}
    memory = {
        n: compiled_memory(fns[n].lower(model, ch).compile().compiled) for n, ch in paths.items()
    }
    out = {n: jax.block_until_ready(fns[n](model, ch)) for n, ch in paths.items()}
    (l0, g0), (l1, g1) = out["naive"], out["chunked"]
    grad_diff = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), g0, g1))
    rounds = interleaved(
        {n: lambda n=n: jax.block_until_ready(fns[n](model, paths[n])) for n in paths},
        c["rounds"],
    )
    assert memory["naive"] is not None and memory["chunked"] is not None
    head = _head_temps(c, DEFAULT_CHUNK)
    return {
        "config": {**c, "chunk": DEFAULT_CHUNK},
        "memory": memory,
        "temp_ratio": memory["naive"]["temp"] / memory["chunked"]["temp"],
        "head_temp": head,
        "head_temp_ratio": head["naive"] / head["chunked"],
        "loss_abs_diff": float(jnp.abs(l0 - l1)),
        "grad_max_abs_diff": float(max(grad_diff)),
        "seconds": rounds.wall,
        "time_ratio": median_ratio(rounds.wall["chunked"], rounds.wall["naive"]),
        "goals": {"temp_ratio_at_least": 10.0, "time_ratio_at_most": 1.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--only", action="append", choices=sorted(CONFIGS))
    parser.add_argument("--no-cli", action="store_true", help="skip timing the CLI")
    parser.add_argument("--lm-loss", action="store_true", help="the LM loss's two paths")
    args = parser.parse_args()
    if args.lm_loss:
        result = lm_loss()
        print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
        print(f"wrote {write_json('lm_loss', result)}")
        return
    if args.worker:
        child(json.loads(args.worker)["name"])
        return

    import jax

    backend = jax.default_backend()
    results = {}
    for name in args.only or CONFIGS:
        row: dict = {"config": CONFIGS[name]}
        cpu = run_child(name, "cpu")
        if cpu is not None:
            r = cpu["report"]
            row["cpu"] = {
                "predicted_peak_bytes": r["peak_bytes"],
                "accelerator_peak_bytes": r["accelerator_peak_bytes"],
                "parts": r["parts"],
                "overlap_bytes": r["overlap_bytes"],
                "report_seconds": cpu["seconds"],
                "h100_compile_only": _target_row(cpu),
            }
        if backend != "cpu":
            acc = run_child(name, None)
            if acc is not None:
                r = acc["report"]
                measured, predicted = r["measured_peak_bytes"], r["peak_bytes"]
                row[backend] = {
                    "device": r["device"],
                    "predicted_peak_bytes": predicted,
                    "measured_peak_bytes": measured,
                    "prediction_error": predicted / measured - 1,
                    "parts": r["parts"],
                    "overlap_bytes": r["overlap_bytes"],
                    "host_bytes": r["host_bytes"],
                    "attention": r["config"]["attention"],
                    "compiled": r["compiled"],
                    "report_seconds": acc["seconds"],
                    "compile_only": _target_row(acc),
                }
                if acc.get("target") is not None:
                    row[backend]["compile_only_error"] = acc["target"]["peak_bytes"] / measured - 1
                if cpu is not None:
                    row[backend]["cpu_estimate_error"] = (
                        row["cpu"]["accelerator_peak_bytes"] / measured - 1
                    )
        results[name] = row
        print(json.dumps({name: row}, indent=1), flush=True)

    summary: dict = {}
    if backend != "cpu":
        errors = {n: r[backend]["prediction_error"] for n, r in results.items() if backend in r}
        summary["gpu_prediction_error"] = errors
        summary["gpu_within_goal"] = {
            n: abs(e) <= GOALS["gpu_prediction_error"] for n, e in errors.items()
        }
        summary["compile_only_error"] = {
            n: r[backend].get("compile_only_error") for n, r in results.items() if backend in r
        }
    if not args.no_cli:
        cli = time_cli()
        summary["cli_guide_report_seconds_cpu"] = cli["seconds"]
        summary["cli_ok"] = cli["ok"]
        print(cli["stdout"], flush=True)
        for key, args in _TARGET_COMMANDS.items():
            timed = time_command(args)
            summary[key], summary[key.replace("seconds", "ok")] = timed["seconds"], timed["ok"]
            summary[key.replace("seconds", "output")] = timed["stdout"]
            print(timed["stdout"], flush=True)
    print(json.dumps(summary, indent=1), flush=True)
    path = write_json("memory", {"goals": GOALS, "summary": summary, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
