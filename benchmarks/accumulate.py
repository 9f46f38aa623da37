"""Gradient accumulation side by side: the whole batch, our scan over micro-batches, MultiSteps.

A small transformer (2 blocks, d_model 256, 4 heads, d_ff 1024, seq 128, float32), MSE
against random targets, SGD, batches of 32:

- `whole_batch`: `make_step(..., accumulate=1)`, one jitted call per update.
- `scan_k2`, `scan_k4`, `scan_k8`: `make_step(..., accumulate=k)`: one jitted call per update
  that scans over k micro-batches of 32 / k, taking `grad` of each.
- `multisteps_k4`: the standard optax way, `optax.MultiSteps(optax.sgd(lr), every_k_schedule=4)`
  in a jitted call per micro-batch of 8, parameters and optimizer state donated as our step
  donates its state: 4 calls per update, and a parameter-sized gradient buffer in the
  optimizer state. `multisteps_k4_no_donation`: the same without donation (what
  `eqx.filter_jit` does by default), for reference; the goal compares with the stronger one.
- `plain_scan_k4`, for reference: the least code that accumulates, a jitted `lax.scan` of
  `grad` over 4 micro-batches and an SGD update, with none of the step's features
  (weights, loss scale, finiteness check, metrics): the floor our step's overhead is
  measured against.

First every variant's parameters after a few updates are checked against the whole batch's.
Then compile (outside any timer, `lower().compile()`), burn in, and time rounds in which
every variant runs in turn (forward, then reverse order), each timing synchronised with
`jax.block_until_ready`. A variant's rate is its median over rounds; a ratio between two
variants is the median of their per-round ratios, which cancels drift in a shared machine.
Peak bytes are argument + output + temp - alias from `memory_analysis()` of the compiled call.

    python benchmarks/accumulate.py          # writes benchmarks/results/accumulate.json
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo, if not installed
from _common import (  # noqa: E402
    compiled_memory as memory,
    interleaved,
    median_ratio,
    write_json,
)

import eqx_lowmem as el  # noqa: E402

MODEL = {"n_layers": 2, "d_model": 256, "n_heads": 4, "d_ff": 1024}
SEQ = 128
BATCH = 32
KS = (2, 4, 8)
MULTISTEPS_K = 4
LR = 0.05
CHECK_UPDATES = 3
RTOL = 1e-5  # relative to the parameters' norm, per leaf
GOALS = {"scan_k4_vs_whole_batch": 0.95, "scan_k4_vs_multisteps_k4": 1.2}
MEASURED_BEFORE = "FINDINGS.md, CPU: MultiSteps 0.91 updates/s, a plain scan 1.11, whole batch 1.04"
MIB = 2**20


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))


class Ours:
    """`make_step` with `accumulate=k`: one call per update."""

    def __init__(self, model, k: int):
        self.step = el.train.make_step(el.train.mse, optax.sgd(LR), accumulate=k)
        self.state = self.step.init(model, key=jr.PRNGKey(1))
        self.grad_norms: list[float] = []

    def compile(self, batch) -> dict:
        out = {"memory": memory(self.step.lower(self.state, batch).compile())}
        out["opt_state_bytes"] = tree_bytes(self.state.opt_state)
        return out

    def update(self, batch, record: bool = False):
        self.state, metrics = self.step(self.state, batch)
        if record:
            self.grad_norms.append(float(metrics["grad_norm"]))
        return self.state

    def params(self):
        return eqx.filter(self.state.model, eqx.is_inexact_array)


class MultiSteps:
    """`optax.MultiSteps`: one jitted call per micro-batch, k calls per update."""

    def __init__(self, model, k: int, donate: bool = True):
        self.k = k
        self.opt = optax.MultiSteps(optax.sgd(LR), every_k_schedule=k)
        params, self.static = eqx.partition(model, eqx.is_inexact_array)
        self.p = jax.tree.map(lambda a: jnp.array(a, copy=True), params)
        self.opt_state = self.opt.init(self.p)
        self.grad_norms: list[float] = []

        def micro(params, opt_state, x, y):
            def loss(p):
                return jnp.mean(el.train.mse(eqx.combine(p, self.static), x, y))

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = self.opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self.micro = jax.jit(micro, donate_argnums=(0, 1) if donate else ())

    def split(self, batch):
        # Micro-batch i is samples [i * micro, (i + 1) * micro), as in our step.
        micro = len(batch[0]) // self.k
        return [tuple(x[i * micro : (i + 1) * micro] for x in batch) for i in range(self.k)]

    def compile(self, micro_batches) -> dict:
        x, y = micro_batches[0]
        out = {"memory": memory(self.micro.lower(self.p, self.opt_state, x, y).compile())}
        out["opt_state_bytes"] = tree_bytes(self.opt_state)
        out["note"] = "memory of one micro-batch call; the optimizer state holds acc_grads"
        return out

    def update(self, micro_batches, record: bool = False):
        for x, y in micro_batches:
            self.p, self.opt_state, _ = self.micro(self.p, self.opt_state, x, y)
        return self.p, self.opt_state

    def params(self):
        return self.p


class PlainScan:
    """The least accumulation code: `lax.scan` over `grad` per micro-batch, then SGD."""

    def __init__(self, model, k: int):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        self.p = jax.tree.map(lambda a: jnp.array(a, copy=True), params)
        self.grad_norms: list[float] = []

        def update(params, x, y):
            # (k, micro, ...): micro-batch i is samples [i * micro, (i + 1) * micro).
            xs = x.reshape(k, -1, *x.shape[1:])
            ys = y.reshape(k, -1, *y.shape[1:])

            def body(acc, xy):
                grads = jax.grad(lambda p: jnp.sum(el.train.mse(eqx.combine(p, static), *xy)))(
                    params
                )
                return jax.tree.map(jnp.add, acc, grads), None

            acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (xs, ys))
            return jax.tree.map(lambda p, g: p - LR * g / x.shape[0], params, acc)

        self.jitted = jax.jit(update, donate_argnums=0)

    def compile(self, batch) -> dict:
        out = {"memory": memory(self.jitted.lower(self.p, *batch).compile())}
        out["opt_state_bytes"] = 0
        return out

    def update(self, batch, record: bool = False):
        self.p = self.jitted(self.p, *batch)
        return self.p

    def params(self):
        return self.p


def relative_difference(a, b) -> float:
    """Largest over leaves of |a - b| / |b| (Frobenius norms)."""
    diffs = [
        float(jnp.linalg.norm((x - y).ravel()) / jnp.maximum(jnp.linalg.norm(y.ravel()), 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    return max(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="timing rounds over all variants")
    parser.add_argument("--seconds", type=float, default=0.5, help="target seconds per timing")
    args = parser.parse_args()
    start = time.perf_counter()

    model = el.nn.transformer_encoder(**MODEL, key=jr.PRNGKey(0))
    initial = jax.tree.map(lambda a: jnp.array(a, copy=True), eqx.filter(model, eqx.is_array))
    keys = jr.split(jr.PRNGKey(2), 2 * (CHECK_UPDATES + 1))
    shape = (BATCH, SEQ, MODEL["d_model"])  # (batch, seq, d_model)
    batches = [
        (jr.normal(keys[2 * i], shape), jr.normal(keys[2 * i + 1], shape))
        for i in range(CHECK_UPDATES + 1)
    ]
    ms = f"multisteps_k{MULTISTEPS_K}"
    variants: dict = {"whole_batch": Ours(model, 1)}
    for k in KS:
        variants[f"scan_k{k}"] = Ours(model, k)
    variants[ms] = MultiSteps(model, MULTISTEPS_K)
    variants[f"{ms}_no_donation"] = MultiSteps(model, MULTISTEPS_K, donate=False)
    variants["plain_scan_k4"] = PlainScan(model, 4)

    def prepared(v, batch):
        return v.split(batch) if isinstance(v, MultiSteps) else batch

    results: dict = {
        "model": MODEL,
        "seq": SEQ,
        "batch": BATCH,
        "optimizer": f"optax.sgd({LR})",
        "loss": "eqx_lowmem.train.mse",
        "goals": GOALS,
        "measured_before": MEASURED_BEFORE,
        "variants": {},
    }
    rows = results["variants"]

    # Compile outside any timer; the compiled calls are reused by the updates below.
    for name, v in variants.items():
        t0 = time.perf_counter()
        rows[name] = v.compile(prepared(v, batches[0]))
        rows[name]["compile_s"] = time.perf_counter() - t0

    # Correctness: the same updates from the same parameters as the whole batch.
    for v in variants.values():
        for batch in batches[:CHECK_UPDATES]:
            v.update(prepared(v, batch), record=True)
    reference = variants["whole_batch"]
    moved = jax.tree.map(jnp.subtract, reference.params(), initial)
    for name, v in variants.items():
        row = rows[name]
        row["params_relative_difference"] = relative_difference(v.params(), reference.params())
        # The stricter view: the sum of the updates (float32 rounding of p - p0 included).
        row["update_relative_difference"] = relative_difference(
            jax.tree.map(jnp.subtract, v.params(), initial), moved
        )
        if v.grad_norms:
            row["grad_norm_relative_difference"] = max(
                abs(a - b) / b for a, b in zip(v.grad_norms, reference.grad_norms, strict=True)
            )
    correct = all(
        row["params_relative_difference"] <= RTOL
        and row.get("grad_norm_relative_difference", 0.0) <= RTOL
        for row in rows.values()
    )

    # Burn in, and size each timing to about args.seconds.
    timed = {name: prepared(v, batches[-1]) for name, v in variants.items()}
    per_update = {}
    for name, v in variants.items():
        jax.block_until_ready(v.update(timed[name]))
        t0 = time.perf_counter()
        jax.block_until_ready(v.update(timed[name]))
        per_update[name] = time.perf_counter() - t0
    updates = {name: max(1, round(args.seconds / t)) for name, t in per_update.items()}

    def timing(name: str):
        def run():
            out = None
            for _ in range(updates[name]):
                out = variants[name].update(timed[name])
            jax.block_until_ready(out)

        return run

    names = list(variants)
    seconds = interleaved({name: timing(name) for name in names}, args.rounds).wall
    samples = {name: [updates[name] / t for t in seconds[name]] for name in names}

    def ratio(a: str, b: str) -> float:
        """Median over rounds of a's updates/s over b's, measured side by side."""
        return median_ratio(samples[a], samples[b])

    whole = rows["whole_batch"]
    for name in names:
        row = rows[name]
        row["updates_per_s"] = statistics.median(samples[name])
        row["updates_per_s_rounds"] = samples[name]
        row["updates_per_timing"] = updates[name]
        row["speed_vs_whole_batch"] = ratio(name, "whole_batch")
        row["peak_vs_whole_batch"] = row["memory"]["peak"] / whole["memory"]["peak"]

    achieved = {
        "scan_k4_vs_whole_batch": ratio("scan_k4", "whole_batch"),
        "scan_k4_vs_multisteps_k4": ratio("scan_k4", ms),
    }
    results["scan_k4_vs_multisteps_k4_no_donation"] = ratio("scan_k4", f"{ms}_no_donation")
    results["scan_k4_vs_plain_scan_k4"] = ratio("scan_k4", "plain_scan_k4")
    results["correctness"] = {"rtol": RTOL, "updates": CHECK_UPDATES, "passed": correct}
    results["achieved"] = achieved
    results["goals_met"] = {n: bool(correct and achieved[n] >= g) for n, g in GOALS.items()}
    results["wall_s"] = time.perf_counter() - start

    print(f"\naccumulation on {jax.default_backend()}: batch {BATCH}, model {MODEL}, seq {SEQ}")
    print(
        f"  {'variant':26s} {'updates/s':>9s} {'vs whole':>8s} {'peak MiB':>9s} {'temp MiB':>9s}"
        f" {'opt state MiB':>13s} {'params diff':>11s} {'update diff':>11s}"
    )
    for name, row in rows.items():
        m = row["memory"]
        print(
            f"  {name:26s} {row['updates_per_s']:9.3f} {row['speed_vs_whole_batch']:8.2f}"
            f" {m['peak'] / MIB:9.1f} {m['temp'] / MIB:9.1f}"
            f" {row['opt_state_bytes'] / MIB:13.1f} {row['params_relative_difference']:11.1e}"
            f" {row['update_relative_difference']:11.1e}"
        )
    print(
        "  (MultiSteps: memory of one micro-batch call, its optimizer state included; "
        f"correctness within {RTOL:g}: {correct})"
    )
    for name, goal in GOALS.items():
        print(
            f"  goal {name:28s} >= {goal:.2f}: achieved {achieved[name]:.3f}"
            f"  met {results['goals_met'][name]}"
        )
    print(
        "  not goals: scan_k4 vs multisteps_k4 without donation "
        f"{results['scan_k4_vs_multisteps_k4_no_donation']:.3f}, vs plain_scan_k4 "
        f"{results['scan_k4_vs_plain_scan_k4']:.3f}"
    )
    print(f"wrote {write_json('accumulate', results)} ({results['wall_s']:.0f} s)")
    if not correct:
        sys.exit("correctness check failed: accumulation does not match the whole batch")


if __name__ == "__main__":
    main()
