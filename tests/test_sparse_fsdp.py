"""Sparse layers with DSR rewiring under FSDP: values, integer indices (or bit sets) and
optimizer state sharded over 4 host devices train exactly as on one device. A real
subprocess with host devices, as `tests/test_fsdp.py`."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

BODY = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax, equinox as eqx
    from jax.sharding import Mesh
    from jaxtyping import install_import_hook
    with install_import_hook("eqx_lowmem", "beartype.beartype"):  # as the suite checks
        import eqx_lowmem as el
        from eqx_lowmem import sparse as sp

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    dense = el.nn.mlp([16, 40, 40, 4], key=jr.PRNGKey(0), activation=jnp.tanh)
    model = sp.sparsify(dense, 0.3, key=jr.PRNGKey(1), slack=0.25, storage=STORAGE)
    x = jr.normal(jr.PRNGKey(2), (32, 16))
    y = jr.normal(jr.PRNGKey(3), (32, 4))

    def train(**kw):
        hook = sp.dsr(period=2, fraction=0.05, threshold=0.05)
        step = el.train.make_step(el.train.mse, optax.adam(1e-2), after_update=hook, **kw)
        state = step.init(model, key=jr.PRNGKey(4))
        specs = [str(getattr(l.indices.sharding, "spec", ""))
                 for _, l in sp._convert.sparse_layers(state.model)]
        for _ in range(7):
            state, metrics = step(state, (x, y))
        leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))
        return [np.asarray(a) for a in leaves], specs, float(metrics["loss"])

    one, _, loss_one = train()
    # Both kinds of mesh: jax.make_mesh's Explicit axes for one storage, a Mesh for the other.
    if STORAGE == "indices":
        mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    else:
        mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    four, specs, loss_four = train(mesh=mesh, shard="fsdp")
    layers = [l for _, l in sp._convert.sparse_layers(model)]
    out = {
        "devices": jax.device_count(),
        "specs": specs,
        "capacities": [l.indices.shape[-1] for l in layers],
        "dtypes": [[str(a.dtype), str(b.dtype)] for a, b in zip(one, four)],
        "int_equal": [bool(np.array_equal(a, b)) for a, b in zip(one, four)
                      if a.dtype.kind in "iu"],
        "float_diff": max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(one, four)
                          if a.dtype.kind == "f"),
        "scale": max(float(np.max(np.abs(a), initial=0.0)) for a in one if a.dtype.kind == "f"),
        "moved": [bool(not np.array_equal(np.asarray(l.indices), a)) for l, a in
                  zip(layers, [a for a in one if a.dtype.kind in "iu" and a.ndim == 1])],
        "loss": [loss_one, loss_four],
    }
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # two DSR steps on 4 devices
@pytest.mark.parametrize("storage", ["indices", "bits"])
def test_sparse_dsr_with_fsdp_on_four_devices_equals_one_device(storage):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    body = f"STORAGE = {storage!r}\n" + BODY
    run = subprocess.run(
        [sys.executable, "-c", body], capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    # the indices (or bits) really are split over the devices (lengths divisible by 4)
    assert all(c % 4 == 0 for c in result["capacities"]), result["capacities"]
    assert all("data" in s for s in result["specs"]), result["specs"]
    assert all(a == b for a, b in result["dtypes"]), result["dtypes"]
    # rewiring moved every layer's indices, identically on 4 devices and on one
    assert all(result["moved"]), result["moved"]
    assert result["int_equal"] and all(result["int_equal"]), result["int_equal"]
    assert result["float_diff"] <= 1e-5 * max(1.0, result["scale"]), result
