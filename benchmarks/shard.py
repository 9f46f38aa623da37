"""Replicated (`shard="data"`) vs sharded (`shard="fsdp"`) parameters and optimizer state.

A 4-block transformer encoder (d_model 256, 4 heads, d_ff 1024, seq 64, float32, full remat),
Adam, a batch of 32, `accumulate=2`. For each device count n (2, 4, 8 host devices on CPU,
forced with `--xla_force_host_platform_device_count=8`; on a GPU session, the real devices),
one process builds both steps over the first n devices and reports per device:

- bytes from `memory_analysis()` of the compiled step (argument = parameters, optimizer
  state and the batch; temp), and their ratio to the replicated step;
- the step time, median of rounds in which both run in turn after a burn-in (a ratio is the
  median of per-round ratios, which cancels drift on a shared machine);
- the parameters after 3 updates of both, which must agree (checked first).

    python benchmarks/shard.py          # writes benchmarks/results/shard.json
    python benchmarks/shard.py --quick  # smaller model, fewer rounds
"""

import argparse
import functools
import os
import statistics
import sys
from pathlib import Path

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import compiled_memory, interleaved, median_ratio, write_json  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import eqx_lowmem as el  # noqa: E402


def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2, axis=(1, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    d_model, d_ff = (64, 256) if args.quick else (256, 1024)
    rounds = args.rounds or (3 if args.quick else 7)
    batch, seq = 32, 64
    counts = [n for n in (2, 4, 8) if n <= jax.device_count()]
    model = el.nn.transformer_encoder(4, d_model, 4, d_ff, key=jr.PRNGKey(0), remat=True)
    x = jr.normal(jr.PRNGKey(1), (batch, seq, d_model))
    rows = []
    for n in counts:
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
        steps = {
            shard: el.train.make_step(loss, optax.adam(1e-3), accumulate=2, mesh=mesh, shard=shard)
            for shard in ("data", "fsdp")
        }
        states = {k: s.init(model, key=jr.PRNGKey(2)) for k, s in steps.items()}
        memory = {k: compiled_memory(s.lower(states[k], (x,)).compile()) for k, s in steps.items()}
        # Correctness first: both reach the same parameters.
        for _ in range(3):
            for k, s in steps.items():
                states[k], _ = s(states[k], (x,))
        a, b = (
            [
                np.asarray(p)
                for p in jax.tree.leaves(eqx.filter(states[k].model, eqx.is_inexact_array))
            ]
            for k in ("data", "fsdp")
        )
        diff = max(float(np.max(np.abs(p - q))) for p, q in zip(a, b, strict=True))
        assert diff < 1e-4, f"n={n}: FSDP and replicated parameters differ by {diff}"

        def run(k, steps=steps, states=states):
            states[k], m = steps[k](states[k], (x,))
            jax.block_until_ready(m["loss"])

        calls = {k: functools.partial(run, k) for k in steps}
        for call in calls.values():  # burn-in
            call()
        times = interleaved(calls, rounds).wall
        ratio = median_ratio(times["fsdp"], times["data"])
        row = {
            "devices": n,
            "max_parameter_difference": diff,
            "replicated": {"memory": memory["data"], "step_s": statistics.median(times["data"])},
            "fsdp": {"memory": memory["fsdp"], "step_s": statistics.median(times["fsdp"])},
            "argument_ratio": memory["fsdp"]["argument"] / memory["data"]["argument"],
            "temp_ratio": memory["fsdp"]["temp"] / memory["data"]["temp"],
            "time_ratio": ratio,
        }
        rows.append(row)
        print(
            f"n={n}: arguments {row['argument_ratio']:.3f}x (1/n = {1 / n:.3f}), temp "
            f"{row['temp_ratio']:.3f}x, time {ratio:.2f}x, params agree to {diff:.1e}",
            flush=True,
        )
    config = {"n_layers": 4, "d_model": d_model, "d_ff": d_ff, "n_heads": 4, "seq": seq,
              "batch": batch, "accumulate": 2, "optimizer": "adam", "remat": "full",
              "rounds": rounds}  # fmt: skip
    path = write_json("shard", {"config": config, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
