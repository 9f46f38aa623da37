"""The library's training step against the step a user writes by hand, side by side.

For each model (an MLP 784-512-512-10 at batch 256, a small `CausalLM`, a small WideResNet
and a 64-block recomputed encoder) both steps get the same model, loss, batch and Adam:
`el.train.make_step(loss, adam)` against `jax.jit` of `jax.value_and_grad` of the mean
loss, `optimizer.update` and `optax.apply_updates`, state donated. It checks the
parameters agree after 3 updates, compiles both outside the timers, then times them in
interleaved rounds (ABBA). Goals (issue 40): time ratio hand/library >= 0.97 (the step's
updates per second against the hand step's) and compiled peak library/hand <= 1.01.

    python benchmarks/step_speed.py                 # CPU, results/step_speed.json
    python benchmarks/step_speed.py --device gpu    # a GPU, results/step_speed_gpu.json
    python benchmarks/step_speed.py --plan          # adds `plan`'s time to step_speed.json

`--plan` times `el.memory.plan` with its default candidates (pruned, and every one
compiled) against one compile of the default step; goal: <= 5x, the same choice.

On a GPU (batches 8x the CPU's) set `XLA_PYTHON_CLIENT_PREALLOCATE=false`.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import (  # noqa: E402
    add_to_record,
    compiled_memory,
    encoder,
    environment,
    interleaved,
    median_ratio,
    write_json,
)
from speed import hand_step  # noqa: E402

import eqx_lowmem as el  # noqa: E402

GOALS = {"time_ratio_min": 0.97, "peak_ratio_max": 1.01}


def lm_loss(model, tokens):
    """`next_token_loss` without a key (no dropout): both steps call the same function."""
    return el.train.next_token_loss(model, tokens)


def cases(scale: int = 1) -> dict:
    """name -> (model, loss, batch); `scale` multiplies the batch (a GPU's rows)."""
    k = jr.PRNGKey(0)
    kx, ky = jr.split(jr.PRNGKey(1))
    # GroupNorm: no batch statistics, so its (empty) state is a constant of the loss.
    wrn, wrn_state = eqx.nn.make_with_state(el.nn.WideResNet)(10, 2, 10, key=k, norm="group")
    return {
        "mlp": (
            el.nn.mlp([784, 512, 512, 10], key=k),
            el.train.cross_entropy,
            (jr.normal(kx, (256 * scale, 784)), jr.randint(ky, (256 * scale,), 0, 10)),
        ),
        "lm": (
            el.nn.CausalLM(512, 64, 4, 128, 4, 512, key=k),
            lm_loss,
            (jr.randint(kx, (8 * scale, 64), 0, 512),),
        ),
        "wrn": (
            wrn,
            lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(
                m.batched(x, wrn_state)[0].astype(jnp.float32), y
            ),
            (jr.normal(kx, (16 * scale, 3, 32, 32)), jr.randint(ky, (16 * scale,), 0, 10)),
        ),
        "encoder64": (
            el.nn.transformer_encoder(64, 64, 4, 256, key=k, remat=True),
            el.train.mse,
            (jr.normal(kx, (4 * scale, 16, 64)), jr.normal(ky, (4 * scale, 16, 64))),
        ),
    }


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def measure(name: str, model, loss, batch, rounds: int) -> dict:
    optimizer = optax.adam(1e-3)
    step = el.train.make_step(loss, optimizer)
    state = step.init(model, key=jr.PRNGKey(2))
    params = _copy(eqx.filter(model, eqx.is_inexact_array))
    opt_state = optimizer.init(params)
    hand = hand_step(model, loss, optimizer)

    # Correctness first: the parameters after each of 3 updates. The first is exact (the
    # same gradient, bit for bit); later ones differ where the two programs' rounding
    # differs and Adam divides a near-zero gradient by its own size.
    diffs = []
    for _ in range(3):
        state, _ = step(state, batch)
        params, opt_state, _ = hand(params, opt_state, batch)
        ours = eqx.filter(state.model, eqx.is_inexact_array)
        pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(params), strict=True)
        diffs.append(max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
                         for a, b in pairs))  # fmt: skip
    diff = diffs[-1]

    memory = {
        "library": compiled_memory(step.lower(state, batch).compile()),
        "hand": compiled_memory(hand.lower(params, opt_state, batch).compile()),
    }
    box = {"state": state, "params": params, "opt": opt_state}

    def run_library():
        box["state"], metrics = step(box["state"], batch)
        jax.block_until_ready(metrics)

    def run_hand():
        box["params"], box["opt"], value = hand(box["params"], box["opt"], batch)
        jax.block_until_ready(value)

    for _ in range(2):  # burn in
        run_library()
        run_hand()
    timed = interleaved({"library": run_library, "hand": run_hand}, rounds)
    n = sum(x.size for x in jax.tree.leaves(ours))
    row = {
        "parameters": int(n),
        "max_relative_param_diff_after_1": diffs[0],
        "max_relative_param_diff_after_3": diff,
        "library_ms": 1e3 * float(np.median(timed.wall["library"])),
        "hand_ms": 1e3 * float(np.median(timed.wall["hand"])),
        # Updates per second of the library's step over the hand step's.
        "time_ratio": median_ratio(timed.wall["hand"], timed.wall["library"]),
        "memory": memory,
        "peak_ratio": None,
    }
    if memory["library"] and memory["hand"]:
        row["peak_ratio"] = memory["library"]["peak"] / memory["hand"]["peak"]
    row["met"] = (row["time_ratio"] >= GOALS["time_ratio_min"]
                  and (row["peak_ratio"] or 0) <= GOALS["peak_ratio_max"])  # fmt: skip
    print(f"{name:10s} library {row['library_ms']:8.2f} ms  hand {row['hand_ms']:8.2f} ms  "
          f"time {row['time_ratio']:.3f}  peak {row['peak_ratio']}  diff {diff:.1e}",
          flush=True)  # fmt: skip
    return row


PLAN = {"n_layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 1024, "seq": 128, "batch": 32}
PLAN_BUDGET = 200_000_000  # bytes: between the largest and the smallest candidate's peak


def plan_row() -> dict:
    """`plan`'s default candidates against one compile of the default step (no remat, one
    micro-batch, float32), side by side: seconds, their ratio, and the choice with and
    without pruning (goal: <= 5x one compile, the same choice)."""
    import time

    c = PLAN
    x = jax.ShapeDtypeStruct((c["batch"], c["seq"], c["d_model"]), jnp.float32)

    def make_model(remat):
        return encoder(c, jr.PRNGKey(0), remat)

    start = time.perf_counter()
    step = el.train.make_step(el.train.mse, optax.adam(1e-3))
    state = eqx.filter_eval_shape(lambda: step.init(make_model(False), key=jr.PRNGKey(0)))
    step.lower(state, (x, x)).compile()
    one = time.perf_counter() - start
    row = {"config": {**c, "budget": PLAN_BUDGET}, "one_compile_s": one}
    for prune in (True, False):
        start = time.perf_counter()
        p = el.memory.plan(make_model, el.train.mse, optax.adam(1e-3), (x, x),
                           budget=PLAN_BUDGET, prune=prune)  # fmt: skip
        seconds = time.perf_counter() - start
        row["pruned" if prune else "every"] = {
            "seconds": seconds, "ratio_to_one_compile": seconds / one, "compiled":
            len(p.candidates), "best": [str(p.best.remat), p.best.accumulate,
                                        str(p.best.precision)],
        }  # fmt: skip
    row["same_choice"] = row["pruned"]["best"] == row["every"]["best"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", nargs="*", default=None, help="a subset of the cases")
    parser.add_argument("--plan", action="store_true", help="plan's time against a compile")
    args = parser.parse_args()
    if args.plan:  # added to the committed record
        import json

        found = {"plan": {**plan_row(), "environment": environment()}}
        print(json.dumps(found, indent=1))
        print(f"wrote {add_to_record('step_speed', found)}")
        return
    if args.device == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"--device gpu: the default backend is {jax.default_backend()!r}.")
    scale = 8 if args.device == "gpu" else 1  # a GPU's batches: 8x the CPU's
    chosen = {k: v for k, v in cases(scale).items() if args.only is None or k in args.only}
    results = {name: measure(name, *spec, args.rounds) for name, spec in chosen.items()}
    met = all(r["met"] for r in results.values())
    name = "step_speed" if args.device == "cpu" else "step_speed_gpu"
    path = write_json(name, {"goals": GOALS, "rows": results, "all_met": met})
    print(f"wrote {path}; all goals met: {met}")


if __name__ == "__main__":
    main()
