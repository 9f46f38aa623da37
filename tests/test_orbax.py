"""Orbax checkpoints (`OrbaxCheckpoints`, `Trainer(checkpoint_format="orbax")`): round trips,
asynchronous saves of a donated state, corruption and other models refused with a
`CheckpointError`, killed saves' temporaries; TensorBoard scalars read back; models saved
as plain Equinox files."""

import glob
import os
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.train import CheckpointError, OrbaxCheckpoints

pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed (.[orbax])")


def _tree(seed=0):
    model = eqx.nn.MLP(3, 2, 64, 2, key=jr.PRNGKey(seed))
    return {
        "model": model,
        "bf16": jnp.asarray([1.0, -2.5, 3e-3], jnp.bfloat16),
        "bool": jnp.asarray([True, False]),
        "typed_key": jr.key(3),
        "raw_key": jr.PRNGKey(3),
        "u8": np.arange(5, dtype=np.uint8),
        "scalar": jnp.asarray(2.5),
        "python": 3,
    }


def _arrays(tree):
    tree = jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        eqx.filter(tree, eqx.is_array),
    )
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b):
    return _equal_lists(_arrays(a), _arrays(b))


def _equal_lists(xs, ys):
    return len(xs) == len(ys) > 0 and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        for x, y in zip(xs, ys, strict=True)
    )


def test_round_trip_is_bit_identical_and_uncommitted(tmp_path):
    tree = _tree()
    with OrbaxCheckpoints(tmp_path, keep=2) as checkpoints:
        for step in (1, 2, 3):
            checkpoints.save(step, tree, {"step": step})
        checkpoints.wait()
        assert checkpoints.steps() == [2, 3]  # keep=2
        loaded, meta = checkpoints.restore(_tree(seed=1))
        assert meta == {"step": 3} == checkpoints.read_meta()
        assert _same(loaded, tree)
        assert jax.random.key_impl(loaded["typed_key"]) == jax.random.key_impl(tree["typed_key"])
        assert loaded["python"] == 3 and isinstance(loaded["u8"], np.ndarray)
        # jit keys its cache on commitment: a fresh state's leaves are uncommitted, so the
        # loaded ones are too, and a step does not compile again after a resume.
        assert not any(x.committed for x in jax.tree.leaves(loaded) if isinstance(x, jax.Array))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint_000000002", "checkpoint_000000003"], names


def test_an_async_save_keeps_the_values_of_a_state_the_next_step_donates(tmp_path):
    step = el.train.make_step(el.train.mse, optax.adam(1e-2))
    state = step.init(el.nn.mlp([4, 32, 1], key=jr.PRNGKey(0)), key=jr.PRNGKey(1))
    batch = (jr.normal(jr.PRNGKey(2), (8, 4)), jnp.ones((8, 1)))
    saved = {}
    with OrbaxCheckpoints(tmp_path, keep=None) as checkpoints:
        for i in range(1, 4):
            state, _ = step(state, batch)
            checkpoints.save(i, state, {})
            saved[i] = _arrays(state)  # copied before the next step donates the buffers
        checkpoints.wait()
        like = step.init(el.nn.mlp([4, 32, 1], key=jr.PRNGKey(5)), key=jr.PRNGKey(6))
        for i in range(1, 4):
            loaded, _ = checkpoints.restore(like, step=i)
            assert _equal_lists(_arrays(loaded), saved[i])
        assert not _same(checkpoints.restore(like, step=1)[0], checkpoints.restore(like)[0])
        compiled = step._jitted._cache_size()
        after, _ = step(checkpoints.restore(like)[0], batch)
        expected, _ = step(state, batch)
        assert step._jitted._cache_size() == compiled
        assert _same(after, expected)


def _largest_data_file(directory: Path) -> Path:
    files = [Path(p) for p in glob.glob(str(directory / "**" / "*"), recursive=True)]
    return max((p for p in files if p.is_file()), key=lambda p: p.stat().st_size)


def test_corrupt_truncated_and_other_checkpoints_are_checkpoint_errors(tmp_path):
    tree = {"w": jnp.arange(20_000, dtype=jnp.float32), "b": jnp.ones(3)}
    checkpoints = OrbaxCheckpoints(tmp_path)
    checkpoints.save(5, tree, {"lr": 0.1})
    checkpoints.wait()
    where = str(tmp_path / "checkpoint_000000005")
    # Another model, another configuration.
    with pytest.raises(CheckpointError, match=r"leaf \['w'\] has shape \(20000,\).*\(10,\)"):
        checkpoints.restore({"w": jnp.zeros(10), "b": jnp.ones(3)})
    with pytest.raises(CheckpointError, match="leaves expected but not in it"):
        checkpoints.restore({"w": tree["w"], "c": jnp.ones(3)})
    with pytest.raises(CheckpointError, match="made with lr=0.1 but this run has lr=0.2"):
        checkpoints.restore(tree, expect={"lr": 0.2})
    # A flipped bit in the arrays' bytes: OCDBT reads it back silently; the fingerprint not.
    data = _largest_data_file(tmp_path / "checkpoint_000000005" / "state")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"leaf \['w'\] fails its hash") as e:
        checkpoints.restore(tree)
    assert where in str(e.value)
    data.write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(CheckpointError, match="cannot be read.*truncated or corrupt"):
        checkpoints.restore(tree)
    (tmp_path / "checkpoint_000000005" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(CheckpointError, match="'meta' item cannot be read"):
        checkpoints.read_meta()
    checkpoints.close()


def test_a_killed_saves_temporary_directory_is_ignored_and_removed(tmp_path):
    with OrbaxCheckpoints(tmp_path) as checkpoints:
        checkpoints.save(2, {"w": jnp.ones(3)}, {})
    # What a save killed before its rename leaves: a step under orbax's temporary name.
    tmp = tmp_path / "checkpoint_000000004.orbax-checkpoint-tmp-1234567"
    (tmp / "state").mkdir(parents=True)
    assert el.train._orbax.newest_step_directory(tmp_path) == tmp_path / "checkpoint_000000002"
    reader = OrbaxCheckpoints(tmp_path, read_only=True)  # another program: leaves it alone
    assert reader.steps() == [2] and tmp.exists()
    with OrbaxCheckpoints(tmp_path) as checkpoints:
        assert checkpoints.latest() == 2
        loaded, _ = checkpoints.restore({"w": jnp.zeros(3)})
        assert loaded["w"].tolist() == [1.0, 1.0, 1.0]
    assert not tmp.exists()


def test_without_orbax_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[orbax\]'"):
        OrbaxCheckpoints(tmp_path)
    trainer = el.train.Trainer(
        el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0)),
        el.train.mse,
        optax.sgd(0.1),
        checkpoint_dir=tmp_path / "run",
        checkpoint_format="orbax",
        progress=False,
    )
    with pytest.raises(ImportError, match="orbax-checkpoint"):
        trainer.fit(jnp.ones((4, 2)), jnp.ones((4, 1)), epochs=1, micro_batch=4, key=jr.key(0))


# --------------------------------------------------------------------------- the Trainer


def _data():
    x = jr.normal(jr.PRNGKey(2), (32, 2))
    return x, jnp.sin(x[:, :1]) + x[:, 1:] ** 2


def _trainer(directory, log_dir=None, optimizer=None, checkpoint_format="orbax"):
    return el.train.Trainer(
        el.nn.mlp([2, 16, 1], key=jr.PRNGKey(0)),
        el.train.mse,
        optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
        if optimizer is None
        else optimizer,
        accumulate=2,
        checkpoint_dir=directory,
        checkpoint_format=checkpoint_format,
        checkpoint_every=2,
        keep_checkpoints=2,
        progress=False,
        log_dir=log_dir,
    )


def _fit(trainer, epochs):
    x, y = _data()
    return trainer.fit(x, y, epochs=epochs, micro_batch=4, key=jr.PRNGKey(1), eval_data=(x, y))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer = _trainer(tmp_path_factory.mktemp("full"))
    return trainer, _fit(trainer, 3)  # 4 updates an epoch, 12 in all


def test_trainer_resumes_an_orbax_run_exactly_and_logs_to_tensorboard(tmp_path, uninterrupted):
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (.[test])",
    )
    full, full_history = uninterrupted
    first = _trainer(tmp_path / "run", log_dir=tmp_path / "logs")
    _fit(first, 2)
    assert first.checkpoint_path == tmp_path / "run" / "checkpoint_000000008"
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir()) == [
        "checkpoint_000000006",
        "checkpoint_000000008",
    ]
    # A refusal of other settings, as with the single file.
    with pytest.raises(ValueError, match="different optimizer"):
        _fit(_trainer(tmp_path / "run", optimizer=optax.sgd(0.1)), 3)
    with pytest.raises(ValueError, match="holds orbax checkpoints"):
        _fit(_trainer(tmp_path / "run", checkpoint_format="file"), 3)
    second = _trainer(tmp_path / "run", log_dir=tmp_path / "logs")
    history = _fit(second, 3)
    assert history == full_history
    assert _same(second.state, full.state)
    assert (
        el.train.load_model(tmp_path / "run", el.nn.mlp([2, 16, 1], key=jr.PRNGKey(9)))
        .layers[0]
        .weight.tolist()
        == full.model.layers[0].weight.tolist()
    )

    events = accumulator.EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/grad_norm",
        "train/skipped",
        "train/learning_rate",
        "train/updates_per_second",
        "train/epoch_loss",
        "eval/loss",
    } <= tags
    assert "train/memory_bytes_in_use" not in tags  # XLA:CPU reports no memory
    assert "train/loss_scale" not in tags  # float32: no loss scale
    # Both runs' events, each update once: 1-8 from the first, 9-12 from the second.
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))
    assert [e.step for e in events.Scalars("eval/loss")] == [4, 8, 12]
    np.testing.assert_allclose(
        [e.value for e in events.Scalars("eval/loss")], history["eval_loss"], rtol=1e-6
    )
    np.testing.assert_allclose(
        [e.value for e in events.Scalars("train/epoch_loss")], history["train_loss"], rtol=1e-6
    )
    np.testing.assert_allclose([e.value for e in events.Scalars("train/learning_rate")], 0.01)


# The child trains as above and kills itself as soon as its n-th save returns: the save's
# files are being written in the background (argv: directory, n).
CHILD = """
import os, signal, sys
from eqx_lowmem.train import OrbaxCheckpoints
from tests.test_orbax import _fit, _trainer

directory, n = sys.argv[1], int(sys.argv[2])
saves = []
save = OrbaxCheckpoints.save
def save_then_die(self, *args, **kwargs):
    save(self, *args, **kwargs)
    saves.append(1)
    if len(saves) == n:
        os.kill(os.getpid(), signal.SIGKILL)
OrbaxCheckpoints.save = save_then_die
_fit(_trainer(directory), 3)
"""


def test_sigkill_during_an_async_save_resumes_bit_identically(tmp_path, uninterrupted, env):
    full, full_history = uninterrupted
    killed = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), "3"],  # the save of update 6
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    # Killed while the save of update 6 was being written: its temporary directory is left.
    assert any(n.startswith("checkpoint_000000006.orbax-checkpoint-tmp") for n in names), names
    assert "checkpoint_000000004" in names
    trainer = _trainer(tmp_path)
    assert _fit(trainer, 3) == full_history
    assert _same(trainer.state, full.state)
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["checkpoint_000000010", "checkpoint_000000012"], names


# --------------------------------------------------------------------------- save_model


def test_save_model_writes_what_equinox_alone_reads(tmp_path):
    model = el.nn.mlp([3, 8, 2], key=jr.PRNGKey(0))
    path = el.save_model(tmp_path / "model.eqx", model)
    like = el.nn.mlp([3, 8, 2], key=jr.PRNGKey(1))
    assert _same(eqx.tree_deserialise_leaves(path, like), model)
    assert _same(el.load_model(path, like), model)
    with pytest.raises(CheckpointError, match="not an Equinox model file shaped as `like`"):
        el.load_model(path, el.nn.mlp([3, 9, 2], key=jr.PRNGKey(1)))
    with pytest.raises(CheckpointError, match="holds more arrays than `like`"):
        el.load_model(path, el.nn.mlp([3, 8], key=jr.PRNGKey(1)))
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="not an Equinox model file"):
        el.load_model(path, like)


def test_save_model_of_a_sparse_model_dense_or_sparse(tmp_path):
    dense = el.nn.mlp([16, 32, 4], key=jr.PRNGKey(0))
    sparse = el.sparse.sparsify(dense, 0.3, key=jr.PRNGKey(1))
    el.save_model(tmp_path / "sparse.eqx", sparse)
    el.save_model(tmp_path / "dense.eqx", sparse, densify=True)
    like_sparse = el.sparse.sparsify(
        el.nn.mlp([16, 32, 4], key=jr.PRNGKey(5)), 0.3, key=jr.PRNGKey(6)
    )
    loaded = eqx.tree_deserialise_leaves(tmp_path / "sparse.eqx", like_sparse)
    assert _same(loaded, sparse)
    loaded_dense = eqx.tree_deserialise_leaves(tmp_path / "dense.eqx", dense)
    x = jr.normal(jr.PRNGKey(2), (16,))
    np.testing.assert_allclose(loaded_dense(x), sparse(x), rtol=1e-5, atol=1e-6)
    assert os.path.getsize(tmp_path / "dense.eqx") > os.path.getsize(tmp_path / "sparse.eqx")


def test_swapped_elements_and_an_edited_meta_item_are_refused(tmp_path):
    w = jnp.arange(6.0).reshape(2, 3)
    swapped = w.at[0, 0].set(w[1, 2]).at[1, 2].set(w[0, 0])  # same sum of bits, same values
    checkpoints = OrbaxCheckpoints(tmp_path, keep=None, asynchronous=False)
    checkpoints.save(5, {"w": w}, {"stream": {"position": 12}})
    checkpoints.save(6, {"w": swapped}, {"stream": {"position": 12}})
    # Step 5's records with step 6's arrays: its bytes hold two elements swapped.
    step5, step6 = tmp_path / "checkpoint_000000005", tmp_path / "checkpoint_000000006"
    os.rename(step5 / "state", tmp_path / "original_state")
    os.rename(step6 / "state", step5 / "state")
    with pytest.raises(CheckpointError, match=r"leaf \['w'\] fails its (hash|fingerprint)"):
        checkpoints.restore({"w": w}, step=5)
    os.rename(step5 / "state", step6 / "state")
    os.rename(tmp_path / "original_state", step5 / "state")
    tree, meta = checkpoints.restore({"w": w}, step=5)
    assert np.array_equal(tree["w"], w) and meta == {"stream": {"position": 12}}
    # The stream position edited from 12 to 14 in the meta item's JSON.
    item = step5 / "meta" / "metadata"
    item.write_text(item.read_text().replace('"position": 12', '"position": 14'))
    assert '"position": 14' in item.read_text()
    with pytest.raises(CheckpointError, match="'meta' item fails its SHA-256 checksum") as e:
        checkpoints.read_meta(5)
    assert str(step5) in str(e.value)
    with pytest.raises(CheckpointError, match="was edited or is corrupt"):
        checkpoints.restore({"w": w}, step=5)
    checkpoints.close()


_FULL_DISK = """
import resource, signal, sys
import jax, jax.numpy as jnp
from eqx_lowmem.train import OrbaxCheckpoints
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
checkpoints = OrbaxCheckpoints(sys.argv[1], keep=None)
checkpoints.save(1, {"w": jnp.zeros(50_000)}, {"n": 1})
checkpoints.wait()
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # as a full disk
checkpoints.save(2, {"w": jax.random.normal(jax.random.PRNGKey(0), (50_000,))}, {"n": 2})
try:
    checkpoints.wait()
except OSError as e:
    print("error:", e, flush=True)
"""


def test_a_save_that_cannot_write_names_the_directory_and_the_intact_checkpoint(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("error:"))
    assert f"saving checkpoint 2 in {tmp_path} failed: File too large" in line, line
    assert f"{tmp_path / 'checkpoint_000000001'}, is intact" in line
    with OrbaxCheckpoints(tmp_path, read_only=True) as checkpoints:
        assert checkpoints.steps() == [1]
        tree, meta = checkpoints.restore({"w": jnp.ones(50_000)})
    assert meta == {"n": 1} and not np.asarray(tree["w"]).any()
