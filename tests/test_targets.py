"""Compile-only GPU targets: `memory_report`, `plan` and the command line for a GPU that this
machine does not have (`eqx_lowmem.memory.Target`)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest
from jax.experimental import topologies

import eqx_lowmem as el
from eqx_lowmem.memory import Target

from .helpers import compile_as_users

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the CUDA plugin: .[gpu-plan]")

X = jax.ShapeDtypeStruct((8192, 64), jnp.float32)
Y = jax.ShapeDtypeStruct((8192,), jnp.int32)


def _model():
    return el.nn.mlp([64, 256, 256, 10], key=jr.PRNGKey(0), activation=jnp.tanh)


@pytest.fixture(scope="module")
def reports():
    """The same step for XLA:CPU and an H100, in float32 and mixed bf16 (SGD)."""
    out = {}
    for target in (None, "h100"):
        for precision in ("float32", "mixed_bf16"):
            out[target, precision] = el.memory.memory_report(
                _model(), el.train.cross_entropy, optax.sgd(0.1), (X, Y),
                precision=precision, target=target,
            )  # fmt: skip
    return out


def test_an_h100_report_equals_the_step_compiled_by_hand_for_that_gpu(reports):
    # By hand: JAX's compile-only topology from the same target config, the library's
    # step built on a mesh of it, lowered and compiled without the report.
    config = Target("h100").config
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
    mesh = topologies.make_mesh(topology, (1,), ("data",))
    step = el.train.make_step(el.train.cross_entropy, optax.sgd(0.1), mesh=mesh)
    state = jax.eval_shape(lambda: step.init(_model(), key=jr.PRNGKey(0)))
    analysis = compile_as_users(step.lower(state, (X, Y))).memory_analysis()
    report = reports["h100", "float32"]
    for figure in ("argument", "output", "temp", "alias"):
        assert report.compiled[figure] == getattr(analysis, f"{figure}_size_in_bytes"), figure
    assert report.backend == "gpu" and report.device.startswith("NVIDIA H100 80GB HBM3")
    assert report.trusted == {"gpu": "peak_bytes"}
    assert report.config["target"] == "h100"
    assert "compile-only target 'h100'" in str(report)
    # The whole report works for the GPU: what is live at its peak adds up to it.
    assert report.compiled["argument"] <= report.live_peak_bytes <= report.peak_bytes


def test_16_bit_activations_halve_on_the_gpu_where_xla_cpu_keeps_float32(reports):
    def stored(report):
        # Saved activations live at the peak (and XLA:CPU's float32 copies of 16-bit ones),
        # less the 16-bit copies of the batch and the parameters that float32 does not make.
        copies = sum(g.nbytes for g in report.activations if g.label.endswith("compute dtype"))
        return report.at_peak["activations"] + report.at_peak["upcasts"] - copies

    on_gpu = stored(reports["h100", "mixed_bf16"]) / stored(reports["h100", "float32"])
    on_cpu = stored(reports[None, "mixed_bf16"]) / stored(reports[None, "float32"])
    assert on_gpu <= 0.5, on_gpu
    assert on_cpu > 0.9, on_cpu
    assert reports["h100", "mixed_bf16"].at_peak["upcasts"] == 0


def test_plan_for_a_gpu_fits_its_budget_there_and_defaults_to_its_memory():
    def make_model(remat):  # (an MLP has nothing to recompute)
        return _model()

    args = (make_model, el.train.cross_entropy, optax.adam(1e-3), (X, Y))
    options = dict(remats=(False,), accumulates=(1, 8), precisions=("float32", "mixed_bf16"))
    target = Target("a100-40gb", mem_fraction=0.75)
    whole = el.memory.plan(*args, target=target, prune=False, **options)
    assert whole.budget == int(0.75 * 42_298_834_944)
    assert "0.75 x" in whole.budget_from and "A100-SXM4-40GB" in str(whole)
    assert all(c.report.backend == "gpu" for c in whole.candidates)
    # A budget between the candidates' GPU peaks: the choice fits, compiled again for the GPU.
    peaks = sorted(c.peak_bytes for c in whole.candidates)
    budget = (peaks[0] + peaks[1]) // 2
    best = whole.within(budget).best
    again = el.memory.memory_report(
        _model(), el.train.cross_entropy, optax.adam(1e-3), (X, Y),
        accumulate=best.accumulate, precision=best.precision, target="a100-40gb",
    )  # fmt: skip
    assert again.peak_bytes == best.peak_bytes <= budget < peaks[1]


def test_several_gpus_split_fsdp_state_per_device():
    model = el.nn.mlp([64, 512, 512, 10], key=jr.PRNGKey(0))
    args = (model, el.train.cross_entropy, optax.adam(1e-3), (X, Y))
    one = el.memory.memory_report(*args, target="h100")
    four = el.memory.memory_report(*args, target=Target("h100", devices=4), shard="fsdp")
    assert four.config["devices"] == 4
    assert four.sizes["optimizer"] < 0.3 * one.sizes["optimizer"]
    with pytest.raises(ValueError, match="devices=4, but the mesh"):
        el.memory.memory_report(
            *args, target=Target("h100", devices=4), mesh=jax.make_mesh((1,), ("data",))
        )


def test_bad_targets_are_named_before_any_compile(tmp_path):
    with pytest.raises(ValueError, match=r"target='h1000' is not a known target.*'h100'"):
        Target("h1000")
    with pytest.raises(ValueError, match=r"Target\(devices=0\): expected at least 1"):
        Target("h100", devices=0)
    bad = tmp_path / "mygpu.txtpb"
    bad.write_text("gpu_device_info { bogus_field: 1 }")
    with pytest.raises(ValueError, match=r"mygpu.txtpb.*bogus_field"):
        el.memory.memory_report(_model(), el.train.cross_entropy, optax.sgd(0.1), (X, Y),
                                target=str(bad))  # fmt: skip
    with pytest.raises(ValueError, match="measure=True runs the step"):
        el.memory.memory_report(_model(), el.train.cross_entropy, optax.sgd(0.1), (X, Y),
                                target="h100", measure=True)  # fmt: skip


def test_a_config_file_compiles_as_the_named_gpu(tmp_path, reports):
    path = tmp_path / "h100.txtpb"
    path.write_text(Target("h100").config)
    report = el.memory.memory_report(
        _model(), el.train.cross_entropy, optax.sgd(0.1), (X, Y), target=path
    )
    assert report.compiled == reports["h100", "float32"].compiled
    assert Target(str(path)).memory_bytes == Target("h100").memory_bytes


def test_a_plugin_of_another_version_than_jaxlib_is_named(tmp_path):
    # A plugin's metadata found first on the path says another version (a real
    # .dist-info directory, as pip writes one).
    info = tmp_path / "jax_cuda12_plugin-0.0.1.dist-info"
    info.mkdir()
    metadata = "Metadata-Version: 2.1\nName: jax-cuda12-plugin\nVersion: 0.0.1\n"
    (info / "METADATA").write_text(metadata)
    code = textwrap.dedent(
        """
        import eqx_lowmem as el
        try:
            el.memory.Target("h100").description
        except ImportError as e:
            print(e)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "jax-cuda12-plugin 0.0.1 is installed but jaxlib is" in done.stdout, done.stderr
    assert "pip install 'jax-cuda12-plugin==" in done.stdout


def test_a_process_whose_cuda_plugin_failed_to_start_still_compiles_for_a_gpu():
    # Without JAX_PLATFORMS=cpu, JAX starts the plugin, which fails without CUDA (no driver
    # here) and is skipped: the target registers it for compiling only.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, jax.random as jr, optax
        import eqx_lowmem as el
        model = el.nn.mlp([8, 16, 8], key=jr.PRNGKey(0))
        x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
        r = el.memory.memory_report(model, el.train.mse, optax.sgd(0.1), (x, x), target="l4")
        print("device:", r.device, jax.default_backend())
        """
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "device: NVIDIA L4 (compile-only target 'l4') cpu" in done.stdout


def test_a_tpu_target_compiles_with_libtpu_or_names_the_extra():
    import importlib.util

    args = (_model(), el.train.cross_entropy, optax.sgd(0.1), (X, Y))
    if importlib.util.find_spec("libtpu") is None:  # CI: the test command leaves it out
        with pytest.raises(ImportError, match=r"pip install 'eqx-lowmem\[tpu-plan\]'"):
            el.memory.memory_report(*args, target="v5e")
        return
    report = el.memory.memory_report(*args, target=Target("v5e", devices=4), shard="fsdp")
    assert report.backend == "tpu" and report.device.startswith("TPU v5 lite x 4")
    assert Target("v5e").budget_bytes == 16 * 2**30


def test_micro_batches_of_images_hold_one_copy_of_the_batch_on_a_gpu():
    # A GPU's convolutions take channels last: were the micro-batches sliced from the batch
    # in its own shape, XLA would transpose the whole batch before the loop (a second one).
    key1, key2 = jr.split(jr.PRNGKey(0))
    model = eqx.nn.Sequential([
        eqx.nn.Conv2d(3, 8, 3, key=key1), eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Lambda(lambda h: jnp.mean(h, axis=(1, 2))), eqx.nn.Linear(8, 10, key=key2),
    ])  # fmt: skip
    x = jax.ShapeDtypeStruct((64, 3, 32, 32), jnp.float32)
    y = jax.ShapeDtypeStruct((64,), jnp.int32)
    report = el.memory.memory_report(model, el.train.cross_entropy, optax.sgd(0.1), (x, y),
                                     accumulate=4, target="h100")  # fmt: skip
    # The images once, the labels and the step's per-sample weights (float32).
    assert report.at_peak["batch"] == 64 * 3 * 32 * 32 * 4 + 64 * 4 + 64 * 4


def test_a_residual_chunk_loop_holds_one_buffer_for_both_gradients_on_a_gpu():
    # map_chunks of a function that keeps its rows' shape writes each chunk's input
    # gradient over the output gradient's rows it has just read; a second input leaf
    # (here an unused column) takes the general path, whose input gradient is summed
    # into a buffer of its own. XLA:CPU holds both the same; a GPU's scheduler does not.
    from eqx_lowmem.memory._compile import NO_TRITON_GEMM
    from eqx_lowmem.nn._chunk import map_chunks

    target = Target("h100")
    device = jax.sharding.SingleDeviceSharding(target.devices_of_topology()[0])
    n, d = 1024, 256
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=device)
              for s in ((n, d), (d, 4 * d), (4 * d, d))]  # fmt: skip

    def block(rows, w1, w2):
        return rows + jnp.tanh(rows @ w1) @ w2

    def one_leaf(x, w1, w2):
        return jnp.sum(jnp.sin(map_chunks(lambda r, _: block(r, w1, w2), x, 128)))

    def two_leaves(x, w1, w2):
        fn = lambda r, _: block(r[0], w1, w2) + 0 * r[1]  # noqa: E731
        return jnp.sum(jnp.sin(map_chunks(fn, (x, jnp.zeros((n, 1))), 128)))

    options = {**target.options(), **NO_TRITON_GEMM}
    temp = {
        f.__name__: compile_as_users(jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*shapes),
                                     options).memory_analysis().temp_size_in_bytes
        for f in (one_leaf, two_leaves)
    }  # fmt: skip
    assert temp["two_leaves"] - temp["one_leaf"] >= 0.95 * n * d * 4, temp


def test_a_gpus_name_is_what_its_device_reported_where_one_was_measured():
    # `benchmarks/results/gpu.json` was written on an H200: its `device_kind` there.
    from eqx_lowmem.memory._target import GPUS

    record = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu.json"
    device = json.loads(record.read_text())["environment"]["device"]
    assert GPUS["h200"].description == device == "NVIDIA H200"
