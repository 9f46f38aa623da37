"""The language-model loss's two paths side by side in one process (issue 36).

`next_token_loss(..., chunk=None)` (whole float32 logits and log-softmax) against the
chunked default (`chunked_cross_entropy`), on a 2-layer `CausalLM(remat=True)` at a
vocabulary of 32,000, d_model 512, one micro-batch of 8 x 256 predicted tokens: the
loss-and-gradient's compiled temporaries (the whole model's, and the head's alone), the
largest differences of loss and gradients, and the median ratio of step times
(interleaved rounds). Goals: >= 10x fewer temporaries, <= 1.0x the time. Any backend: on
a GPU it writes `lm_loss_h200.json`-style records under `--name`.

    python benchmarks/lm_loss.py                 # writes benchmarks/results/lm_loss.json
    python benchmarks/lm_loss.py --name lm_loss_h200
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout, if not installed
from _common import write_json  # noqa: E402

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
    parser.add_argument("--name", default="lm_loss", help="the JSON's name in results/")
    args = parser.parse_args()
    result = lm_loss()
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
    print(f"wrote {write_json(args.name, result)}")


if __name__ == "__main__":
    main()
