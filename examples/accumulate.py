"""Gradient accumulation, as in the guide: 4 micro-batches of 8 make the update of a batch of 32.

The guide's MLP (2 inputs, 4 hidden units, 1 output), MSE, SGD with learning rate 0.05, 64
samples, 5 epochs, no shuffling. Training with batches of 32, and with micro-batches of 8
accumulated 4 at a time, applies the same updates: same final loss, same weights. Only the
memory differs: activations of 8 samples at a time instead of 32.

python examples/accumulate.py
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_lowmem as el

model_key, x_key, noise_key, fit_key = jr.split(jr.PRNGKey(0), 4)
X = jr.normal(x_key, (64, 2))
y = X[:, :1] - 2.0 * X[:, 1:] + 0.1 * jr.normal(noise_key, (64, 1))  # (64, 1)
model = el.nn.mlp([2, 4, 1], key=model_key)


def train(micro_batch: int, accumulate: int):
    # Each update uses accumulate x micro_batch samples; activations of micro_batch at a time.
    trainer = el.train.Trainer(
        model, el.train.mse, optax.sgd(0.05), accumulate=accumulate, progress=False
    )
    history = trainer.fit(X, y, epochs=5, micro_batch=micro_batch, key=fit_key, shuffle=False)
    return history["train_loss"][-1], trainer.model


whole_loss, whole = train(micro_batch=32, accumulate=1)
accumulated_loss, accumulated = train(micro_batch=8, accumulate=4)
print(f"batch 32:                      final loss {whole_loss:.6f}")
print(f"batch 8, accumulate 4 (32):    final loss {accumulated_loss:.6f}")
difference = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(accumulated), strict=True)
)
print(f"largest difference between their weights: {difference:.1e}")
