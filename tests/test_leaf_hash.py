"""Orbax checkpoints' leaf hashes (`train/_leaf_hash.py`). On an accelerator each part of a
JAX array is hashed on its device (`_device_part_hash`), elsewhere by NumPy on the host
(`_part_hash`): the two agree for every dtype, part and layout (so checkpoints written
either way verify either way), and on a GPU the device's hash reads the leaf in place."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqx_lowmem.train import _leaf_hash

from .helpers import compile_as_users

rng = np.random.default_rng(0)
ARRAYS = {
    "float32 matrix": rng.standard_normal((300, 70)).astype(np.float32),
    "float16": rng.standard_normal(5).astype(np.float16),
    "bfloat16": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
    "float8": rng.standard_normal(9).astype(ml_dtypes.float8_e4m3fn),
    "int8, 3-d": rng.integers(-100, 100, (7, 9, 11)).astype(np.int8),
    "uint32": rng.integers(0, 2**32, 1000, dtype=np.uint32),
    "complex64": (rng.standard_normal(50) + 1j * rng.standard_normal(50)).astype(np.complex64),
    "bool": np.arange(10) % 3 == 0,
    "scalar": np.array(3.5, np.float32),
    "empty rows": np.zeros((4, 0), np.float32),
}
WIDE = {  # 64-bit element types, as a JAX array holds them with 64-bit types on
    "complex128": (rng.standard_normal(50) + 1j * rng.standard_normal(50)).astype(np.complex128),
    "uint64": rng.integers(0, 2**63, 1000, dtype=np.uint64),
    "float64": rng.standard_normal((33, 3)),
}
HAS_GPU_TARGET = importlib.util.find_spec("jax_cuda12_plugin") is not None


def _whole(a: np.ndarray) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in a.shape)


def device_hash(part, index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """`_device_part_hash` run here (XLA:CPU), as a GPU runs it."""
    with jax.enable_x64(True):
        starts = jnp.asarray(_leaf_hash._starts(index, shape), jnp.uint64)
        return int(_leaf_hash._device_part_hash(jnp.asarray(part), starts, shape))


@pytest.mark.parametrize("name", [*ARRAYS, *WIDE])
def test_the_devices_hash_is_the_hosts(name):
    host = ARRAYS.get(name, WIDE.get(name))
    with jax.enable_x64(name in WIDE):
        assert jnp.asarray(host).dtype == host.dtype
        assert device_hash(host, _whole(host), host.shape) == _leaf_hash._part_hash(
            host, _whole(host), host.shape
        )


def test_the_devices_hash_of_a_part_counts_its_place_in_the_whole():
    whole = ARRAYS["float32 matrix"]
    for index in [(slice(0, 150), slice(None)), (slice(150, 300), slice(35, 70)),
                  (slice(5, 9), slice(3, 40))]:  # fmt: skip
        part = whole[index]
        assert device_hash(part, index, whole.shape) == _leaf_hash._part_hash(
            part, index, whole.shape
        ), index


def test_the_hash_sees_a_changed_or_moved_element():
    a = ARRAYS["float32 matrix"]
    b, c = a.copy(), a.copy()
    b[3, 4] = np.nextafter(b[3, 4], np.float32(np.inf))  # one bit
    c[[0, 1]] = c[[1, 0]]  # two rows swapped: the same values, moved
    assert len({device_hash(x, _whole(x), x.shape) for x in (a, b, c)}) == 3


@pytest.mark.skipif(not HAS_GPU_TARGET, reason="compiling for an H100 needs jax-cuda12-plugin")
def test_on_a_gpu_the_hash_reads_the_leaf_in_place():
    # Compiled for an H100 (compile only): one fused reduction, no copy of the leaf's
    # words (as uint64 they would be four times a 16-bit leaf).
    import eqx_lowmem as el

    target = el.memory.Target("h100")
    device = jax.sharding.SingleDeviceSharding(target.devices_of_topology()[0])
    leaf = jax.ShapeDtypeStruct((32000, 4096), jnp.bfloat16, sharding=device)  # 262 MB
    with jax.enable_x64(True):
        starts = jax.ShapeDtypeStruct((2,), jnp.uint64, sharding=device)
        lowered = _leaf_hash._device_part_hash.lower(leaf, starts, leaf.shape)
    temp = compile_as_users(lowered, target.options()).memory_analysis().temp_size_in_bytes
    assert temp <= 2**20, temp


LAYOUTS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from eqx_lowmem.train import _leaf_hash
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    a = np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32)
    whole = _leaf_hash._local_hash(a)
    for spec in (P(), P("a"), P(None, "b"), P("a", "b"), P("b", "a"), P(("a", "b"))):
        x = jax.device_put(a, NamedSharding(mesh, spec))
        assert _leaf_hash._local_hash(x) == whole, spec  # the host's, part by part
        assert _leaf_hash._device_hash(x) == whole, spec  # the devices', as on GPUs
    print("ok", jax.device_count())
    """
)


def test_every_layout_over_four_devices_gives_the_whole_arrays_hash():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    run = subprocess.run(
        [sys.executable, "-c", LAYOUTS], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split()[-2:] == ["ok", "4"]
