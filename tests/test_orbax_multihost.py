"""A 2-process FSDP run (two CPU devices each, gloo) saves an orbax checkpoint; orbax's own
API, with no eqx_lowmem code, restores it onto 1 and onto 4 devices, equal to what the run
held; eqx_lowmem restores it onto a 4-device FSDP step that trains on from it."""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed (.[orbax])")

# Names as orbax gives them (`ArrayMetadata.name`): the path's keys joined by dots.
NAME = """
def name(path):
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
"""

TRAIN = NAME + textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process, port, tokens_path, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    import equinox as eqx, jax.numpy as jnp, jax.random as jr, numpy as np, optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    import eqx_lowmem as el

    model = el.nn.CausalLM(vocab_size=32, max_seq=16, n_layers=2, d_model=32, n_heads=4,
                           d_ff=64, key=jr.PRNGKey(0), remat=True)
    stream = el.data.DataStream((tokens_path,), batch_size=16, key=3, process_index=process,
                                process_count=2)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    step = el.train.make_step(el.train.next_token_loss, optax.adam(1e-2), accumulate=2,
                              mesh=mesh, shard="fsdp")
    state = step.init(model, key=jr.PRNGKey(1))
    for (tokens,) in stream:
        state, metrics = step(state, (tokens,))
    with el.train.OrbaxCheckpoints(directory) as checkpoints:
        checkpoints.save(int(state.step), state, {"updates": int(state.step)})
    stored = jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        eqx.filter(state, eqx.is_array),
    )
    sharded = sum(not x.is_fully_replicated for x in jax.tree.leaves(stored))
    flat = jax.tree_util.tree_flatten_with_path(stored)[0]
    values = {name(p): multihost_utils.process_allgather(x, tiled=True) for p, x in flat}
    if process == 0:
        np.savez(directory + "/expected.npz", **{k: np.asarray(v) for k, v in values.items()})
    print("saved", int(state.step), "sharded leaves", sharded, flush=True)
    """
)

# Orbax alone: the tree's shapes from orbax's metadata, each leaf placed on this process's
# devices (split over them along its first axis where it divides), restored and compared.
RESTORE = NAME + textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import jax, numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    steps = Path(sys.argv[1]).glob("checkpoint_*")
    step_dir = max(p for p in steps if "tmp" not in p.name)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = len(jax.devices())
    checkpointer = ocp.StandardCheckpointer()
    tree = checkpointer.metadata(step_dir / "state").item_metadata.tree

    def target(m):
        spec = P("x") if len(m.shape) and m.shape[0] % n == 0 else P()
        return jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, spec))

    abstract = jax.tree.map(target, tree)
    restored = checkpointer.restore(step_dir / "state", abstract)
    expected = np.load(Path(sys.argv[1]) / "expected.npz")
    flat = jax.tree_util.tree_flatten_with_path(restored)[0]
    assert sorted(name(p) for p, _ in flat) == sorted(expected.files), (
        sorted(name(p) for p, _ in flat), sorted(expected.files))
    worst, split = 0.0, 0
    for p, x in flat:
        want = expected[name(p)]
        assert x.shape == want.shape and x.dtype == want.dtype, name(p)
        worst = max(worst, float(np.max(np.abs(np.asarray(x, np.float64) - want), initial=0.0)))
        split += len(x.sharding.device_set) == n and not x.is_fully_replicated
    assert not any(m.startswith("eqx_lowmem") for m in sys.modules)
    print("devices", n, "leaves", len(flat), "split", split, "max_abs_diff", worst, flush=True)
    """
)

# eqx_lowmem onto another mesh: a 4-device FSDP step restores the state and trains on.
RESUME = textwrap.dedent(
    """
    import sys
    import jax, jax.random as jr, numpy as np, optax, equinox as eqx
    from jax.sharding import Mesh
    import eqx_lowmem as el

    model = el.nn.CausalLM(vocab_size=32, max_seq=16, n_layers=2, d_model=32, n_heads=4,
                           d_ff=64, key=jr.PRNGKey(5), remat=True)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    step = el.train.make_step(el.train.next_token_loss, optax.adam(1e-2), accumulate=2,
                              mesh=mesh, shard="fsdp")
    like = step.init(model, key=jr.PRNGKey(6))
    with el.train.OrbaxCheckpoints(sys.argv[1]) as checkpoints:
        state, meta = checkpoints.restore(like)
    tokens = np.random.default_rng(1).integers(0, 32, (16, 17), dtype=np.int32)
    state, metrics = step(state, (tokens,))
    print("resumed", meta["updates"], "step", int(state.step), "loss", float(metrics["loss"]),
          flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    return env


@pytest.mark.slow
def test_a_two_process_fsdp_checkpoint_restores_with_orbax_onto_1_and_4_devices(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 32, (64, 17), dtype=np.int32))
    directory = tmp_path / "run"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRAIN, str(i), str(port), str(tokens), str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(2),
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    saved = next(ln for ln in outputs[0][0].splitlines() if ln.startswith("saved")).split()
    assert saved[:2] == ["saved", "4"], outputs[0][0]  # 64 samples, 4 batches of 16
    assert int(saved[-1]) > 0  # the parameters and optimizer state were sharded
    for devices in (1, 4):
        run = subprocess.run(
            [sys.executable, "-c", RESTORE, str(directory)],
            capture_output=True,
            text=True,
            timeout=300,
            env=_env(devices),
        )
        assert run.returncode == 0, run.stderr[-4000:]
        words = next(ln for ln in run.stdout.splitlines() if ln.startswith("devices")).split()
        assert words[:2] == ["devices", str(devices)], run.stdout
        assert float(words[-1]) <= 1e-6, run.stdout
        if devices == 4:
            assert int(words[words.index("split") + 1]) > 0, run.stdout  # resharded over 4
    resumed = subprocess.run(
        [sys.executable, "-c", RESUME, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(4),
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    line = next(ln for ln in resumed.stdout.splitlines() if ln.startswith("resumed"))
    assert line.split()[:4] == ["resumed", "4", "step", "5"], resumed.stdout
