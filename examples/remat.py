"""Recomputation (remat), as in the guide: the memory of one training step with and without it.

It trains nothing. It compiles, without running, one training step of the guide's
transformer (12 blocks, d_model 512, 8 heads, d_ff 2048, seq 256, batch 32, MSE, SGD) with
each remat preset and prints the memory XLA plans for it; then it checks on a small
transformer that the gradients with and without remat agree.

python examples/remat.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_lowmem as el

REMATS = ("none", "full", "dots", "minimal", "minimal_offloaded")  # every preset of `remat=`

MIB = 2**20


def step_memory(remat: str) -> tuple[int, int]:
    """Peak and temporary bytes of one compiled training step; nothing is allocated."""
    # Shapes only: jax.ShapeDtypeStruct stand-ins for the parameters, state and batch.
    model = eqx.filter_eval_shape(
        lambda key: el.nn.transformer_encoder(12, 512, 8, 2048, key=key, remat=remat),
        jr.PRNGKey(0),
    )
    step = el.train.make_step(el.train.mse, optax.sgd(0.01))
    state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(1))
    x = jax.ShapeDtypeStruct((32, 256, 512), jnp.float32)  # (batch, seq, d_model)
    m = step.lower(state, (x, x)).compile().memory_analysis()
    # What is alive at once: inputs, outputs and temporaries, less the donated inputs that
    # the outputs reuse.
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return peak, m.temp_size_in_bytes


print("One training step of the guide's transformer, compiled but not run:")
print(f"  {'remat':8s} {'peak MiB':>9s} {'temporaries MiB':>16s} {'vs none':>8s}")
base = None
for remat in REMATS:
    peak, temp = step_memory(remat)
    base = base or peak
    print(f"  {remat:8s} {peak / MIB:9,.0f} {temp / MIB:16,.0f} {peak / base:8.2f}")


# The same gradients, with and without remat, on a small transformer (2 blocks, d_model 64).
# seq 96 is longer than full remat's chunks of 64 queries and tokens: the chunking is tested.
@eqx.filter_jit
def gradients(model, x, y):
    grads = eqx.filter_grad(lambda m: jnp.mean(el.train.mse(m, x, y)))(model)
    # Models with different remat settings differ in static fields: compare the arrays.
    return jax.tree.leaves(grads)


x_key, y_key = jr.split(jr.PRNGKey(2))
x = jr.normal(x_key, (4, 96, 64))  # (batch, seq, d_model)
y = jr.normal(y_key, (4, 96, 64))


def small(remat):
    return el.nn.transformer_encoder(2, 64, 4, 128, key=jr.PRNGKey(0), remat=remat)


expected = gradients(small("none"), x, y)
print("Gradients with and without remat (2 blocks, d_model 64, seq 96, batch 4):")
for remat in REMATS[1:]:
    got = gradients(small(remat), x, y)
    # Largest difference relative to each gradient's largest entry, over all parameters.
    diff = max(
        float(jnp.max(jnp.abs(g - e)) / jnp.max(jnp.abs(e)))
        for g, e in zip(got, expected, strict=True)
    )
    print(f"  {remat:8s} agree: {diff <= 1e-5} (largest relative difference {diff:.1e})")
