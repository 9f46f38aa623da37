"""Checkpoints and the atomic writer: integrity, structure, read failures, locking, modes."""

import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem._io import atomic_write, clean_stale_temporaries, write_json
from eqx_lowmem.train import (
    CheckpointError,
    DirectoryLockedError,
    TrainState,
    load_checkpoint,
    load_model,
    read_meta,
    save_checkpoint,
)
from eqx_lowmem.train._checkpoint import CHECKPOINT_NAME
from eqx_lowmem.train._lock import lock_directory

_MAGIC = b"EQXLOWMEM-CKPT 2\n"


def _state(seed=0, opt=None, width=4, dtype=jnp.float32):
    model = eqx.nn.MLP(3, 2, width, 2, key=jr.PRNGKey(seed))
    model = el.precision._policy.cast_floating(model, dtype)
    opt = optax.adam(1e-3) if opt is None else opt
    return TrainState(
        step=jnp.asarray(7, jnp.int32),
        model=model,
        opt_state=opt.init(eqx.filter(model, eqx.is_inexact_array)),
        key=jr.key(seed),
        model_state=None,
        loss_scale=el.precision.dynamic_loss_scale(),
    )


def _header(path):
    raw = Path(path).read_bytes()
    (length, _) = struct.unpack("<QI", raw[len(_MAGIC) : len(_MAGIC) + 12])
    start = len(_MAGIC) + 12
    return json.loads(raw[start : start + length]), start + length


def _rewrite_header(path, edit):
    """Replace the header by `edit(header bytes)`, with a valid checksum."""
    raw = Path(path).read_bytes()
    (length, _) = struct.unpack("<QI", raw[len(_MAGIC) : len(_MAGIC) + 12])
    start = len(_MAGIC) + 12
    header = edit(raw[start : start + length])
    pre = _MAGIC + struct.pack("<QI", len(header), zlib.crc32(header))
    Path(path).write_bytes(pre + header + raw[start + length :])


# ------------------------------------------------------------------------- atomic writer


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_write_honours_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        a = atomic_write(tmp_path / "a.bin", b"x")
        b = write_json(tmp_path / "sub" / "b.json", {"a": 1})
        save_checkpoint(tmp_path / CHECKPOINT_NAME, {"w": jnp.ones(2)}, {})
    finally:
        os.umask(old)
    for p in (a, b, tmp_path / CHECKPOINT_NAME):
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, p


def test_atomic_write_bytes_callable_and_errors(tmp_path):
    p = tmp_path / "x.npy"
    atomic_write(p, lambda f: np.save(f, np.arange(3)))
    assert np.load(p).tolist() == [0, 1, 2]
    atomic_write(p, b"old")

    def fails(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(p, fails)
    assert p.read_bytes() == b"old"  # the old content, and no temporary left
    assert sorted(q.name for q in tmp_path.iterdir()) == ["x.npy"]
    with pytest.raises(TypeError, match="data"):  # ours, or beartype's under pytest
        atomic_write(p, "text")  # type: ignore[arg-type]
    with pytest.raises(IsADirectoryError, match="directory"):
        atomic_write(tmp_path, b"x")
    assert json.loads(write_json(tmp_path / "r.json", [1, 2]).read_text()) == [1, 2]


def test_clean_stale_temporaries_removes_only_writer_temporaries(tmp_path):
    stale = [
        tmp_path / f".{CHECKPOINT_NAME}.0123456789abcdef.tmp",
        tmp_path / ".report.json.fedcba9876543210.tmp",
    ]
    kept = [
        tmp_path / f".{CHECKPOINT_NAME}.k2_9xq0a.tmp",  # tempfile.mkstemp's: another program's
        tmp_path / CHECKPOINT_NAME,
        tmp_path / "notes.tmp",
        tmp_path / ".hidden.tmp",
        tmp_path / ".x.not-a-token.tmp",
    ]
    for p in stale + kept:
        p.write_bytes(b"x" * 100)
    assert clean_stale_temporaries(tmp_path, CHECKPOINT_NAME) == stale[:1]
    assert clean_stale_temporaries(tmp_path, lambda n: n.endswith(".json")) == [stale[1]]
    assert clean_stale_temporaries(tmp_path) == []
    assert sorted(tmp_path.iterdir()) == sorted(kept)
    assert clean_stale_temporaries(tmp_path / "missing") == []


# ------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_identical_for_every_leaf_kind(tmp_path):
    state = _state()
    tree = {
        "state": state,
        "bf16": jnp.asarray([1.0, -2.5, 3e-3], jnp.bfloat16),
        "f16": jnp.asarray([65504.0], jnp.float16),
        "bool": jnp.asarray([True, False]),
        "raw_key": jr.PRNGKey(3),
        "u8": np.arange(5, dtype=np.uint8),
        "scalar": jnp.asarray(2.5),
        "empty": jnp.zeros((0, 3)),
        "python": 3,
    }
    p = tmp_path / CHECKPOINT_NAME
    save_checkpoint(p, tree, {"epoch": 2, "history": [1.5]})
    loaded, meta = load_checkpoint(p, tree)
    assert meta == {"epoch": 2, "history": [1.5]} == read_meta(p)
    assert eqx.tree_equal(loaded, tree, typematch=False)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(tree), strict=True):
        if eqx.is_array(b):
            assert a.dtype == b.dtype and a.shape == b.shape
    assert jax.random.key_impl(loaded["state"].key) == jax.random.key_impl(state.key)
    header, _ = _header(p)
    paths = [r["path"] for r in header["leaves"]]
    assert "['state'].model.layers[0].weight" in paths
    assert "['state'].opt_state[0].mu.layers[1].bias" in paths


def test_the_first_step_after_a_resume_compiles_nothing(tmp_path):
    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2, axis=-1)

    step = el.train.make_step(loss, optax.adam(1e-3))
    state = step.init(eqx.nn.MLP(3, 2, 8, 1, key=jr.PRNGKey(0)), key=jr.PRNGKey(1))
    batch = (jnp.ones((4, 3)), jnp.ones((4, 2)))
    state, _ = step(state, batch)
    compiled = step._jitted._cache_size()
    save_checkpoint(tmp_path / CHECKPOINT_NAME, state, {})
    resumed, _ = load_checkpoint(tmp_path / CHECKPOINT_NAME, state)
    # jit keys its cache on commitment: the state a step returns is uncommitted, so the
    # loaded one must be too, or the step would compile again
    assert not any(x.committed for x in jax.tree.leaves(resumed) if isinstance(x, jax.Array))
    after, _ = step(resumed, batch)
    expected, _ = step(state, batch)
    assert step._jitted._cache_size() == compiled
    assert eqx.tree_equal(after.model, expected.model)


def test_meta_must_be_json_and_leaves_numeric(tmp_path):
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path / "c", {"w": jnp.ones(1)}, {"f": object()})
    for leaf in (np.array(["a", "b"]), np.array([None], object), np.zeros(1, [("a", "f4")])):
        with pytest.raises(TypeError, match=r"leaf \['names'\] has dtype .* does not store"):
            save_checkpoint(tmp_path / "c", {"names": leaf, "w": jnp.ones(1)}, {})
    assert not list(tmp_path.iterdir())  # refused before anything is written


# ------------------------------------------------------------------------- integrity


def test_a_flipped_bit_in_any_leaf_is_refused_naming_the_leaf(tmp_path):
    state = _state()
    p = tmp_path / CHECKPOINT_NAME
    save_checkpoint(p, state, {"epoch": 1})
    good = p.read_bytes()
    header, data_start = _header(p)
    assert len(header["leaves"]) == len([x for x in jax.tree.leaves(state) if eqx.is_array(x)])
    for record in header["leaves"]:  # step, weights, Adam's count and moments, key, scale
        raw = bytearray(good)
        raw[data_start + record["offset"]] ^= 0x10
        p.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError, match="checksum") as info:
            load_checkpoint(p, state)
        assert str(p) in str(info.value) and record["path"] in str(info.value)
    # A bit of the header: the epoch 1 becomes 3.
    i = good.index(b'"epoch":1')
    raw = bytearray(good)
    raw[i + len('"epoch":')] ^= 0x02
    p.write_bytes(bytes(raw))
    for read in (lambda: read_meta(p), lambda: load_checkpoint(p, state)):
        with pytest.raises(CheckpointError, match="header fails its checksum"):
            read()


def test_every_read_failure_is_one_error_naming_the_file(tmp_path):
    state = {"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.asarray(3)}
    p = tmp_path / CHECKPOINT_NAME
    save_checkpoint(p, state, {"epoch": 1})
    good = p.read_bytes()
    _, data_start = _header(p)

    def refused(raw, match):
        p.write_bytes(raw)
        with pytest.raises(CheckpointError, match=match) as info:
            load_checkpoint(p, state)
        assert str(p) in str(info.value)
        assert isinstance(info.value, ValueError)

    # Truncated at every boundary and inside each part.
    for cut in sorted({0, 3, len(_MAGIC), len(_MAGIC) + 5, len(_MAGIC) + 12, data_start - 1}):
        refused(good[:cut], "truncated")
    for cut in (data_start, data_start + 7, len(good) - 1):
        refused(good[:cut], "truncated")
    refused(good + b"\0", "corrupt")  # trailing bytes
    refused(b"PK\x03\x04" + good[4:], "not an eqx_lowmem checkpoint")
    refused(b"EQXLOWMEM-CKPT 1\n" + good[len(_MAGIC) :], "earlier eqx_lowmem")
    # A header length of 2**62 (once an empty MemoryError).
    refused(_MAGIC + struct.pack("<QI", 2**62, 0) + good[len(_MAGIC) + 12 :], "length field")

    def with_header(edit, match):
        p.write_bytes(good)
        _rewrite_header(p, edit)
        with pytest.raises(CheckpointError, match=match) as info:
            load_checkpoint(p, state)
        assert str(p) in str(info.value)

    with_header(lambda h: h[:-1], "not valid JSON")
    with_header(lambda h: b"\xff\xfe" + h, "not UTF-8")
    with_header(lambda h: b"[1, 2]", "not an object")
    with_header(lambda h: json.dumps({"format": 2, "meta": {}}).encode(), r"lacks \['leaves'\]")

    def record(change):
        def edit(h):
            header = json.loads(h)
            change(header["leaves"][0])
            return json.dumps(header, separators=(",", ":")).encode()

        return edit

    with_header(record(lambda r: r.pop("crc32")), "array record 0 lacks")
    with_header(record(lambda r: r.update(dtype="object")), "not a numeric dtype")
    with_header(record(lambda r: r.update(dtype="<U4")), "not a numeric dtype")
    with_header(record(lambda r: r.update(shape=[-2, 3])), "array record 0 .* is corrupt")
    with_header(record(lambda r: r.update(offset=8)), "array record 0 .* is corrupt")
    # A directory and a missing file.
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path, state)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.ckpt", state)


# ------------------------------------------------------------------------- structure


def test_a_different_configuration_is_refused_naming_the_leaf(tmp_path):
    p = tmp_path / CHECKPOINT_NAME
    state = _state()
    save_checkpoint(p, state, {"precision": "float32", "accumulate": 2, "lr": 1e-3})
    with pytest.raises(CheckpointError, match=r"first: .model.layers\[3\]") as info:
        load_checkpoint(p, eqx.tree_at(lambda s: s.model, state, _deeper()))
    assert str(p) in str(info.value)
    with pytest.raises(CheckpointError, match=r"leaf .model.layers\[0\].weight has shape"):
        load_checkpoint(p, _state(width=5))
    with pytest.raises(CheckpointError, match="dtype bfloat16"):
        load_checkpoint(p, _state(dtype=jnp.bfloat16))
    with pytest.raises(CheckpointError, match="different model or optimizer"):
        load_checkpoint(p, _state(opt=optax.sgd(0.1, momentum=0.9)))
    with pytest.raises(CheckpointError, match=r"made with accumulate=2 but this run has"):
        load_checkpoint(p, state, expect={"precision": "float32", "accumulate": 4})
    with pytest.raises(CheckpointError, match=r"lr=0.001 but this run has lr=0.01"):
        load_checkpoint(p, state, expect={"lr": 1e-2})
    load_checkpoint(p, state, expect={"accumulate": 2, "not_recorded": 1})
    # What cannot be seen: adam and adamw keep the same state layout.
    load_checkpoint(p, _state(opt=optax.adamw(1e-3)))


def _deeper():
    return eqx.nn.MLP(3, 2, 4, 3, key=jr.PRNGKey(0))


# ------------------------------------------------------------------------- load_model


def test_load_model_reads_just_the_model_of_a_trainer_checkpoint(tmp_path):
    p = tmp_path / CHECKPOINT_NAME
    state = _state(seed=1)
    save_checkpoint(p, state, {"epoch": 3})
    fresh = _state(seed=2).model
    model = load_model(p, fresh)
    assert eqx.tree_equal(model, state.model)
    # Without allocating a model: the shapes alone.
    shapes = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 4, 2, key=jr.PRNGKey(0))
    assert eqx.tree_equal(load_model(p, shapes), state.model)
    # A model saved alone; and a half_bf16 run's bfloat16 parameters into a float32 model.
    save_checkpoint(p, state.model, {})
    assert eqx.tree_equal(load_model(p, fresh), state.model)
    half = _state(seed=1, dtype=jnp.bfloat16)
    save_checkpoint(p, half, {})
    loaded = load_model(p, fresh)
    assert loaded.layers[0].weight.dtype == jnp.float32
    assert eqx.tree_equal(loaded, el.precision._policy.cast_floating(half.model, jnp.float32))
    with pytest.raises(
        CheckpointError, match=r"no model shaped as `like`: leaf .model.layers\[3\]"
    ):
        load_model(p, _deeper())
    with pytest.raises(CheckpointError, match="has shape"):
        load_model(p, _state(width=5).model)


# ------------------------------------------------------------------------- sharded state

_SHARDED = """
import jax, jax.numpy as jnp, numpy as np, sys
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from eqx_lowmem.train import save_checkpoint, load_checkpoint
path, mode = sys.argv[1], sys.argv[2]
mesh = Mesh(np.array(jax.devices()), ("data",))
rows = NamedSharding(mesh, P("data"))
rep = NamedSharding(mesh, P())
def tree(scale):
    return {
        "w": jax.device_put(scale * jnp.arange(32.0).reshape(8, 4), rows),
        "b": jax.device_put(scale * jnp.arange(4.0), rep),
        "key": jax.device_put(jax.random.key(3), rep),
    }
if mode == "save":
    save_checkpoint(path, tree(1.0), {})
else:
    like = tree(0.0)
    loaded, _ = load_checkpoint(path, like)
    assert loaded["w"].sharding == rows, loaded["w"].sharding
    assert loaded["b"].sharding == rep
    assert (np.asarray(loaded["w"]) == np.arange(32.0).reshape(8, 4)).all()
    assert (jax.random.key_data(loaded["key"]) == jax.random.key_data(jax.random.key(3))).all()
    print("ok", len(jax.devices()), len(loaded["w"].addressable_shards))
"""


def test_a_sharded_state_saves_and_reloads_onto_its_sharding_and_another_count(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(textwrap.dedent(_SHARDED))
    path = tmp_path / CHECKPOINT_NAME

    def run(devices, mode):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        )
        env["JAX_PLATFORMS"] = "cpu"
        out = subprocess.run(
            [sys.executable, str(script), str(path), mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()

    run(4, "save")
    assert run(4, "load") == ["ok", "4", "4"]
    assert run(2, "load") == ["ok", "2", "2"]  # re-sharded onto another device count


# ------------------------------------------------------------------------- run directory

_HOLD = """
import sys, time
from eqx_lowmem.train import DirectoryLockedError
from eqx_lowmem.train._lock import lock_directory
try:
    with lock_directory(sys.argv[1]):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
except DirectoryLockedError as e:
    print("refused:", e, flush=True)
"""


def test_a_second_process_on_a_locked_directory_gets_a_clear_error(tmp_path):
    run_dir = tmp_path / "run"
    with lock_directory(run_dir) as d:
        assert d == run_dir and run_dir.is_dir()
        out = subprocess.run(
            [sys.executable, "-c", _HOLD, str(run_dir), "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "refused:" in out.stdout and f"pid {os.getpid()}" in out.stdout
        assert "its own checkpoint_dir" in out.stdout
        with pytest.raises(DirectoryLockedError, match=f"pid {os.getpid()}"):
            with lock_directory(run_dir):
                pass
    # Released: the next holder gets it; and a holder killed by SIGKILL releases it too.
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir), "60"], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            with pytest.raises(DirectoryLockedError, match=f"pid {holder.pid}"):
                with lock_directory(run_dir):
                    pass
        finally:
            holder.kill()
    with lock_directory(run_dir):
        pass
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        with lock_directory(tmp_path / "file"):
            pass


_TWO_HOSTS = """
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
process, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
import jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from eqx_lowmem.train import save_checkpoint, load_checkpoint
mesh = Mesh(np.array(jax.devices()), ("data",))
rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
full = np.arange(32.0, dtype=np.float32).reshape(8, 4)
def tree(scale):
    w = jax.make_array_from_callback((8, 4), rows, lambda i: scale * full[i])
    b = jax.make_array_from_callback((4,), rep, lambda i: scale * full[0][i])
    return {"w": w, "b": b}
saved = tree(1.0)
assert not saved["w"].is_fully_addressable
save_checkpoint(path, saved, {"hosts": 2})
loaded, meta = load_checkpoint(path, tree(0.0))
assert loaded["w"].sharding == rows and meta == {"hosts": 2}
w = multihost_utils.process_allgather(loaded["w"], tiled=True)
assert (np.asarray(w) == full).all()
assert (np.asarray(loaded["b"].addressable_data(0)) == full[0]).all()
print("ok", process, jax.device_count(), flush=True)
"""


def test_two_processes_save_and_load_a_sharded_state(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    path = tmp_path / CHECKPOINT_NAME
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_HOSTS, str(i), str(port), str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        outs += [line.split() for line in out.splitlines() if line.startswith("ok")]
    assert outs == [["ok", "0", "4"], ["ok", "1", "4"]]  # (gloo logs to stdout too)
    # One file, written by process 0, readable on one host.
    assert [q.name for q in tmp_path.iterdir()] == [CHECKPOINT_NAME]
    tree, _ = load_checkpoint(path, {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)})
    assert tree["w"].tolist() == np.arange(32.0).reshape(8, 4).tolist()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_checkpoint_is_a_checkpoint_error(tmp_path):
    p = tmp_path / CHECKPOINT_NAME
    save_checkpoint(p, {"w": jnp.ones(2)}, {})
    p.chmod(0)
    with pytest.raises(CheckpointError, match="cannot be opened"):
        read_meta(p)
