"""Adam's state in float32, 16 bits (`half_state`) and 8 bits (`quantized_state`), side by side.

On a character language model (`eqx_lowmem.nn.CausalLM`) trained on the standard library's
source (the main example's data, nothing downloaded):

- optimizer bytes per parameter, from the state's arrays;
- the compiled step's peak (`memory_report`, compile only) on the guide's LM (12 layers,
  d_model 512, 8 heads, d_ff 2048, seq 256, batch 32, full recomputation) on XLA:CPU and,
  with `--target h100` (needs the CUDA plugin: /work/gpuvenv), for an H100;
- step time on a small LM (2 layers, d_model 128), interleaved rounds, as the median ratio
  to 16-bit state's;
- the loss over the same updates (same data order per seed), 2 seeds, and the held-out
  loss at the end. Goals (issue 39): <= 2.1 bytes a parameter, held-out loss within the
  float32 seeds' spread, step time <= 1.15x 16-bit state's.

    python benchmarks/optimizer_state.py                 # writes results/optimizer_state.json
    python benchmarks/optimizer_state.py --target h100   # adds the H100 peaks to it
    python benchmarks/optimizer_state.py --device gpu    # `gpu_rows()` on a GPU: prints JSON
"""

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from _common import add_to_record, environment, interleaved, median_ratio, write_json  # noqa: E402

import eqx_lowmem as el  # noqa: E402

VOCAB, LR = 128, 3e-3
SMALL = {"layers": 2, "d_model": 128, "heads": 4, "d_ff": 512, "seq": 64, "batch": 16}
GUIDE = {"layers": 12, "d_model": 512, "heads": 8, "d_ff": 2048, "seq": 256, "batch": 32}
VARIANTS = {
    "float32": lambda: optax.adam(LR),
    "16bit": lambda: el.precision.half_state(optax.adam(LR)),
    "8bit": lambda: el.precision.quantized_state(optax.adam(LR)),
}
GOALS = {"bytes_per_param_8bit": 2.1, "step_time_8bit_vs_16bit": 1.15}


def model(cfg: dict, key, remat="none"):
    return el.nn.CausalLM(VOCAB, cfg["seq"], cfg["layers"], cfg["d_model"], cfg["heads"],
                          cfg["d_ff"], key=key, remat=remat)  # fmt: skip


def loss_fn(m, tokens, *, key=None):
    return el.train.next_token_loss(m, tokens.astype(jnp.int32), key=key)


def held_out_loss(m, tokens):
    losses, weights = loss_fn(m, tokens)
    return jnp.sum(losses * weights) / jnp.sum(weights)


def windows(seq: int, chars: int = 400_000) -> np.ndarray:
    """Windows of `seq + 1` characters of the standard library (the example's corpus)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "train_char_lm.py"
    spec = importlib.util.spec_from_file_location("train_char_lm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokens = np.frombuffer(example.stdlib_text(chars), np.uint8)
    n = len(tokens) // (seq + 1)
    return tokens[: n * (seq + 1)].reshape(n, seq + 1).astype(np.int32)


def state_bytes(opt_state, params) -> float:
    n = sum(x.size for x in jax.tree.leaves(params))
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state)) / n


def peaks(target=None) -> dict:
    """Compiled peak and optimizer-state bytes of the guide's LM step per variant."""
    m = model(GUIDE, jr.PRNGKey(0), remat="full")
    batch = (jax.ShapeDtypeStruct((GUIDE["batch"], GUIDE["seq"] + 1), jnp.int32),)
    out = {}
    for name, make in VARIANTS.items():
        r = el.memory.memory_report(m, loss_fn, make(), batch, target=target).to_dict()
        out[name] = {"peak_bytes": r["peak_bytes"], "optimizer_bytes": r["parts"]["optimizer"],
                     "argument_bytes": r["compiled"]["argument"],
                     "temp_bytes": r["compiled"]["temp"], "device": r["device"]}  # fmt: skip
    return out


def train(data: np.ndarray, held_out: np.ndarray, updates: int, seeds=(0, 1)) -> dict:
    """Loss per update for every variant over the same batches per seed; held-out loss."""
    out = {}
    for seed in seeds:
        order = np.random.default_rng(seed).integers(0, len(data), (updates, SMALL["batch"]))
        for name, make in VARIANTS.items():
            step = el.train.make_step(loss_fn, make())
            state = step.init(model(SMALL, jr.PRNGKey(seed)), key=jr.PRNGKey(seed + 100))
            losses = []
            for rows in order:
                state, info = step(state, (jnp.asarray(data[rows]),))
                losses.append(float(info["loss"]))
            held = eqx.filter_jit(held_out_loss)(state.model, held_out)
            out.setdefault(name, []).append({"seed": seed, "losses": losses,
                                             "held_out": float(held)})  # fmt: skip
    return out


def timing(data: np.ndarray, rounds: int = 15) -> dict:
    """Seconds per step, the variants interleaved (ABBA rounds), and ratios to 16-bit's."""
    batch = (jnp.asarray(data[: SMALL["batch"]]),)
    calls, states = {}, {}
    for name, make in VARIANTS.items():
        step = el.train.make_step(loss_fn, make())
        states[name] = step.init(model(SMALL, jr.PRNGKey(0)), key=jr.PRNGKey(1))

        def call(step=step, name=name):
            states[name], info = step(states[name], batch)
            jax.block_until_ready(info["loss"])

        for _ in range(3):  # compile and burn in
            call()
        calls[name] = call
    r = interleaved(calls, rounds)
    out = {n: {"wall_s": statistics.median(r.wall[n]), "cpu_s": statistics.median(r.cpu[n])}
           for n in calls}  # fmt: skip
    for n in calls:
        out[n]["wall_vs_16bit"] = median_ratio(r.wall[n], r.wall["16bit"])
        out[n]["cpu_vs_16bit"] = median_ratio(r.cpu[n], r.cpu["16bit"])
    return out


def gpu_rows() -> list[dict]:
    """On a GPU: the guide LM's measured step time per variant (interleaved) and compiled
    peaks, as rows for the lead's GPU script."""
    SMALL.update(GUIDE)  # this process times the guide's LM only
    t = timing(np.random.default_rng(0).integers(0, VOCAB, (64, GUIDE["seq"] + 1)), 10)
    p = peaks()
    return [{"variant": n, **t[n], **p[n], "device": jax.devices()[0].device_kind} for n in t]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="add compile-only peaks for this GPU")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--updates", type=int, default=300)
    args = ap.parse_args()
    if args.device == "gpu":
        print(json.dumps(gpu_rows(), indent=1))
        return
    if args.target:  # only the compile-only peaks, added to the CPU run's record
        found = {f"peaks_{args.target}": peaks(el.memory.Target(args.target)),
                 f"environment_{args.target}": environment()}  # fmt: skip
        add_to_record("optimizer_state", found)
        print(json.dumps(found, indent=1))
        return
    data = windows(SMALL["seq"])
    held_out, data = data[-256:], data[:-256]
    params = eqx.filter(model(SMALL, jr.PRNGKey(0)), eqx.is_inexact_array)
    guide = eqx.filter(model(GUIDE, jr.PRNGKey(0)), eqx.is_inexact_array)
    per_param = {n: {"small": state_bytes(make().init(params), params),
                     "guide": state_bytes(jax.eval_shape(make().init, guide), guide)}
                 for n, make in VARIANTS.items()}  # fmt: skip
    time_rows = timing(data)
    print(json.dumps(time_rows, indent=1), flush=True)
    curves = train(data, held_out, args.updates)
    held = {n: [r["held_out"] for r in rows] for n, rows in curves.items()}
    spread = abs(held["float32"][0] - held["float32"][1])
    gap = abs(np.mean(held["8bit"]) - np.mean(held["float32"]))
    summary = {
        "bytes_per_param": {n: v["guide"] for n, v in per_param.items()},
        "held_out_loss": held,
        "held_out_gap_8bit_vs_float32": gap, "float32_seed_spread": spread,
        "loss_goal_met": bool(gap <= spread),
        "step_time_8bit_vs_16bit": time_rows["8bit"]["wall_vs_16bit"],
        "step_time_goal_met": time_rows["8bit"]["wall_vs_16bit"]
        <= GOALS["step_time_8bit_vs_16bit"],
        "bytes_goal_met": per_param["8bit"]["guide"] <= GOALS["bytes_per_param_8bit"],
    }  # fmt: skip
    print(json.dumps(summary, indent=1), flush=True)
    record = {"goals": GOALS, "summary": summary, "small": SMALL, "guide": GUIDE,
              "updates": args.updates, "bytes_per_param": per_param, "timing": time_rows,
              "peaks_cpu": peaks(), "curves": curves}  # fmt: skip
    print(json.dumps(record["peaks_cpu"], indent=1))
    write_json("optimizer_state", record)


if __name__ == "__main__":
    main()
