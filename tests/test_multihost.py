"""Two real processes on localhost (two CPU devices each, gloo collectives) train one model
with sharded parameters, each reading its own part of every batch from a memmapped `.npy`;
the result equals one process training on the whole batches. They train twice, on a mesh
from `jax.make_mesh` (Explicit axes, as the README builds it) and on a `jax.sharding.Mesh`."""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process, port, tokens_path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    if process >= 0:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    import jax.random as jr, numpy as np, optax, equinox as eqx
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    import eqx_lowmem as el

    model = el.nn.CausalLM(vocab_size=32, max_seq=16, n_layers=2, d_model=32, n_heads=4,
                           d_ff=64, key=jr.PRNGKey(0), remat=True)
    optimizer = optax.sgd(0.1, momentum=0.9)
    meshes = {
        "make_mesh": lambda: jax.make_mesh((jax.device_count(),), ("data",)),
        "Mesh": lambda: Mesh(np.array(jax.devices()), ("data",)),
    }
    for kind, make_mesh in meshes.items() if process >= 0 else [("one", None)]:
        if process >= 0:
            stream = el.data.DataStream((tokens_path,), batch_size=16, shuffle_buffer=32,
                                        key=3, process_index=process, process_count=2)
            step = el.train.make_step(el.train.next_token_loss, optimizer, accumulate=2,
                                      mesh=make_mesh(), shard="fsdp")
        else:
            stream = el.data.DataStream((tokens_path,), batch_size=16, shuffle_buffer=32, key=3)
            step = el.train.make_step(el.train.next_token_loss, optimizer, accumulate=2)
        state = step.init(model, key=jr.PRNGKey(1))
        if process < 0:
            initial = eqx.filter(model, eqx.is_inexact_array)
            np.savez(out + "_initial", *[np.asarray(x) for x in jax.tree.leaves(initial)])
        for (tokens,) in stream:
            state, metrics = step(state, (tokens,))
        params = eqx.filter(state.model, eqx.is_inexact_array)
        if process >= 0:
            params = multihost_utils.process_allgather(params, tiled=True)
        if process <= 0:
            np.savez(f"{out}_{kind}", *[np.asarray(x) for x in jax.tree.leaves(params)])
    print("devices", jax.device_count(), "local", jax.local_device_count(), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leaves(path):
    with np.load(path, allow_pickle=False) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.slow  # two processes over gloo, and a third on one device
def test_two_processes_with_fsdp_equal_one_process(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 32, (64, 17), dtype=np.int32))
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(i), str(port), str(tokens), str(tmp_path / "multi")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
        assert "devices 4 local 2" in out
    single = subprocess.run(
        [sys.executable, "-c", SCRIPT, "-1", "0", str(tokens), str(tmp_path / "single")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert single.returncode == 0, single.stderr[-4000:]
    one = _leaves(tmp_path / "single_one.npz")
    initial = _leaves(tmp_path / "single_initial.npz")
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one, initial, strict=True)) > 1e-3
    for kind in ("make_mesh", "Mesh"):
        multi = _leaves(tmp_path / f"multi_{kind}.npz")
        assert len(multi) == len(one)
        for a, b in zip(multi, one, strict=True):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=kind)
