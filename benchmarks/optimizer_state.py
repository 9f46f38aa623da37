"""Adam's state in float32, 16 bits (`half_state`) and 8 bits (`quantized_state`): the loss.

A small character language model (`_steps.char_lm`) trained on the standard library's
source (the main example's data, nothing downloaded) with each state, over the same batches
in the same order per seed, 2 seeds: the loss per update and the held-out loss at the end.
Goal (issue 39): the 8-bit state's held-out loss within the float32 seeds' spread. The
state's bytes and compiled peaks are `memory.py`'s `optimizer_state/*` rows, its step times
`speed.py`'s `optimizer_state/*` group (`optimizer_state.json` of 2026-12-04 holds all
three, measured by this script before they moved).

    python benchmarks/optimizer_state.py      # writes results/optimizer_state_loss.json
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from _common import write_json  # noqa: E402
from _steps import CHAR_LM_SMALL, OPTIMIZERS, char_lm, char_loss  # noqa: E402

import eqx_lowmem as el  # noqa: E402


def windows(seq: int, chars: int = 400_000) -> np.ndarray:
    """Windows of `seq + 1` characters of the standard library (the example's corpus)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "train_char_lm.py"
    spec = importlib.util.spec_from_file_location("train_char_lm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokens = np.frombuffer(example.stdlib_text(chars), np.uint8)
    n = len(tokens) // (seq + 1)
    return tokens[: n * (seq + 1)].reshape(n, seq + 1).astype(np.int32)


def held_out_loss(m, tokens):
    losses, weights = char_loss(m, tokens)
    return jnp.sum(losses * weights) / jnp.sum(weights)


def train(data: np.ndarray, held_out: np.ndarray, updates: int, seeds=(0, 1)) -> dict:
    """Loss per update for every variant over the same batches per seed; held-out loss."""
    cfg, out = CHAR_LM_SMALL, {}
    for seed in seeds:
        order = np.random.default_rng(seed).integers(0, len(data), (updates, cfg["batch"]))
        for name, make in OPTIMIZERS.items():
            step = el.train.make_step(char_loss, make())
            state = step.init(char_lm(cfg, jr.PRNGKey(seed)), key=jr.PRNGKey(seed + 100))
            losses = []
            for rows in order:
                state, info = step(state, (jnp.asarray(data[rows]),))
                losses.append(float(info["loss"]))
            held = eqx.filter_jit(held_out_loss)(state.model, held_out)
            out.setdefault(name, []).append({"seed": seed, "losses": losses,
                                             "held_out": float(held)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=300)
    args = ap.parse_args()
    data = windows(CHAR_LM_SMALL["seq"])
    curves = train(data[:-256], data[-256:], args.updates)
    held = {n: [r["held_out"] for r in rows] for n, rows in curves.items()}
    spread = abs(held["float32"][0] - held["float32"][1])
    gap = abs(np.mean(held["8bit"]) - np.mean(held["float32"]))
    summary = {"held_out_loss": held, "held_out_gap_8bit_vs_float32": gap,
               "float32_seed_spread": spread, "loss_goal_met": bool(gap <= spread)}  # fmt: skip
    print(json.dumps(summary, indent=1), flush=True)
    record = {"summary": summary, "small": CHAR_LM_SMALL, "updates": args.updates,
              "curves": curves}  # fmt: skip
    print(f"wrote {write_json('optimizer_state_loss', record)}")


if __name__ == "__main__":
    main()
