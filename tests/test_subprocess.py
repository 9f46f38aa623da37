"""Real processes: a run killed by SIGKILL resumes bit-identically; data parallelism on 4
host devices equals one device."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from .helpers import compile_cache_env

TRAIN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax, equinox as eqx
    import eqx_lowmem as el

    directory, out, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
    x = jr.normal(jr.PRNGKey(2), (64, 2))
    y = jnp.sin(x[:, :1]) + x[:, 1:] ** 2
    model = el.nn.mlp([2, 16, 1], key=jr.PRNGKey(0))

    def callback(trainer, metrics):
        print("update", metrics["epoch"], metrics["update"], flush=True)
        time.sleep(pause)

    trainer = el.train.Trainer(
        model, el.train.mse, optax.adam(0.01), accumulate=2, checkpoint_dir=directory,
        checkpoint_every=3, progress=False, callback=callback,
    )
    trainer.fit(x, y, epochs=4, micro_batch=4, key=jr.PRNGKey(1))
    leaves = [np.asarray(a) for a in jax.tree.leaves(eqx.filter(trainer.model, eqx.is_array))]
    np.savez(out, *leaves)
    """
)


def _run(script, *args, env=None):
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )


def _load(path):
    with np.load(path, allow_pickle=False) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.slow  # three training processes
def test_killed_run_resumes_bit_identically(tmp_path):
    # The three runs compile the same programs: the later two load them from a cache.
    env = compile_cache_env(tmp_path / "jax_cache")
    _run(TRAIN_SCRIPT, tmp_path / "full", tmp_path / "full.npz", 0, env=env)

    interrupted = tmp_path / "interrupted"
    with subprocess.Popen(
        [sys.executable, "-c", TRAIN_SCRIPT, str(interrupted), str(tmp_path / "x.npz"), "0.02"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    ) as proc:
        assert proc.stdout is not None
        # Epoch 1 has 8 updates; kill in the middle of epoch 2, after a checkpoint.
        for line in proc.stdout:
            if line.startswith("update 1 5"):
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (interrupted / "checkpoint.ckpt").exists()
    assert not (tmp_path / "x.npz").exists()

    resumed = _run(TRAIN_SCRIPT, interrupted, tmp_path / "resumed.npz", 0, env=env)
    # It resumed from the checkpoint after update 4 of epoch 2 (numbered 1 from 0):
    # checkpoint_every=3 counts the run's updates (8 + 4 = 12).
    assert resumed.stdout.splitlines()[0] == "update 1 5"
    full, again = _load(tmp_path / "full.npz"), _load(tmp_path / "resumed.npz")
    assert len(full) == len(again) > 0
    assert all(np.array_equal(a, b) for a, b in zip(full, again, strict=True))


DATA_PARALLEL_SCRIPT = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax, equinox as eqx
    import eqx_lowmem as el

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("data",))
    model = el.nn.transformer_encoder(2, 16, 2, 32, key=jr.PRNGKey(0), remat=True)
    x = jr.normal(jr.PRNGKey(1), (22, 6, 16))  # 22 samples: padded to 24 = 3 x 4 devices x 2
    y = jr.normal(jr.PRNGKey(2), (22, 6, 16))

    def train(precision, mesh):
        # SGD with momentum: Adam divides by sqrt(v) and so turns rounding differences in
        # near-zero gradient entries (summation order differs across devices) into
        # lr-sized ones; that is Adam's arithmetic, not the step's.
        step = el.train.make_step(
            el.train.mse, optax.sgd(0.1, momentum=0.9), accumulate=3, precision=precision,
            mesh=mesh,
        )
        state = step.init(model, key=jr.PRNGKey(3))
        for _ in range(4):
            state, metrics = step(state, (x, y))
        return state, metrics, step

    for precision, tol in (("float32", 1e-5), ("mixed_bf16", 2e-2)):
        single, m1, _ = train(precision, None)
        multi, m4, step = train(precision, mesh)
        ok = eqx.tree_equal(single.model, multi.model, rtol=tol, atol=tol)
        print(precision, "equal", bool(ok), float(m1["loss"]), float(m4["loss"]))
        assert bool(ok), precision
        assert abs(float(m1["loss"]) - float(m4["loss"])) <= tol * abs(float(m1["loss"]))

    # One gradient reduction per update: no all-reduce inside any loop body.
    state = step.init(model, key=jr.PRNGKey(3))
    spec = jax.ShapeDtypeStruct((24, 6, 16), jnp.float32)
    hlo = step.lower(state, (spec, spec)).compile().as_text()
    bodies = set(re.findall(r"body=%?([\\w.\\-]+)", hlo))
    computations = dict(re.findall(r"\\n%?([\\w.\\-]+) [^\\n]*\\{\\n(.*?)\\n\\}", hlo, re.S))
    def calls(name, seen):
        if name in seen or name not in computations:
            return seen
        seen.add(name)
        callee = r"(?:to_apply|calls|body|condition|branch_computations)=\\{?%?([\\w.\\-]+)"
        for name_ in re.findall(callee, computations[name]):
            calls(name_, seen)
        return seen
    inside = set()
    for body in bodies:
        calls(body, inside)
    assert bodies, "expected the micro-batch scan to compile to a while loop"
    assert not any("all-reduce" in computations[c] for c in inside), "all-reduce inside a loop"
    assert "all-reduce" in hlo
    print("reductions outside loops: ok")

    # The Trainer refuses, before any work, a micro-batch the 4 devices do not divide.
    trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.1), mesh=mesh, progress=False)
    try:
        trainer.fit(x, y, epochs=1, micro_batch=6, key=jr.PRNGKey(0))
    except ValueError as e:
        assert "micro_batch=6 is not divisible by the 4 devices" in str(e), e
        assert trainer.state is None
        print("indivisible micro-batch refused")
    # A micro-batch they divide, with a short last batch (22 = 2 x 8 + 6) they do not.
    trainer.fit(x, y, epochs=1, micro_batch=8, key=jr.PRNGKey(0))
    assert int(trainer.state.step) == 3
    print("trainer on 4 devices: ok")
    """
)


@pytest.mark.slow  # a process of 4 devices
def test_data_parallel_equals_single_device():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    out = _run(DATA_PARALLEL_SCRIPT, env=env)
    assert "float32 equal True" in out.stdout
    assert "reductions outside loops: ok" in out.stdout
    assert "indivisible micro-batch refused" in out.stdout
    assert "trainer on 4 devices: ok" in out.stdout
