"""The memory report: its parts are the compiled step's memory, split where it goes."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el

from .helpers import compile_as_users, users_env

LAYERS, D, HEADS, FF, SEQ, BATCH = 2, 32, 4, 64, 16, 8


def _encoder(remat: object = False):
    return el.nn.transformer_encoder(LAYERS, D, HEADS, FF, key=jr.PRNGKey(0), remat=remat)


def _batch():
    x = jax.ShapeDtypeStruct((BATCH, SEQ, D), jnp.float32)
    return (x, x)


def _nbytes(tree, keep=eqx.is_array):
    return sum(x.nbytes for x in jax.tree.leaves(tree) if keep(x))


# The report's compiled figures (the real step's, remat's and micro-batches' peaks against
# the plain one's) as users get them.
pytestmark = pytest.mark.usefixtures("users_compiler")


@pytest.fixture(scope="module")
def adam_report(users_compiler):
    """Adam, accumulate=2, float32: the model, its step and the step's report."""
    model = _encoder()
    step = el.train.make_step(el.train.mse, optax.adam(1e-3), accumulate=2)
    report = el.memory.memory_report(model, el.train.mse, optax.adam(1e-3), _batch(), accumulate=2)
    return model, step, report


def test_parts_add_up_to_the_compiled_peak_of_the_real_step(adam_report):
    model, step, report = adam_report
    assert tuple(report.parts) == el.memory._result.PARTS
    assert sum(report.parts.values()) == report.peak_bytes
    # The step that runs, compiled with real arrays through Step.lower.
    state = step.init(model, key=jr.PRNGKey(0))
    x = jnp.zeros((BATCH, SEQ, D))
    analysis = compile_as_users(step.lower(state, (x, x))).memory_analysis()
    expected = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    assert report.peak_bytes == expected
    assert report.compiled["temp"] == analysis.temp_size_in_bytes
    assert report.compiled["alias"] == analysis.alias_size_in_bytes


def test_parameter_gradient_optimizer_and_batch_parts_are_the_real_pytrees(adam_report):
    model, step, report = adam_report
    state = step.init(model, key=jr.PRNGKey(0))
    x = jnp.ones((BATCH, SEQ, D))
    grads = eqx.filter_grad(lambda m: jnp.sum(el.train.mse(m, x, x)))(state.model)
    assert report.parts["parameters"] == _nbytes(state.model, eqx.is_inexact_array)
    assert report.parts["gradients"] == _nbytes(grads, eqx.is_inexact_array)
    assert report.parts["accumulator"] == report.parts["gradients"]  # accumulate=2
    assert report.parts["optimizer"] == _nbytes(state.opt_state)
    # Adam: two moments per parameter, and a 4-byte step counter.
    assert report.parts["optimizer"] == 2 * report.parts["parameters"] + 4
    # Both arrays of the batch, and the step's per-sample weights.
    assert report.parts["batch"] == 2 * BATCH * SEQ * D * 4 + BATCH * 4
    assert report.config["parameters"] * 4 == report.parts["parameters"]


def test_abstract_and_concrete_models_give_the_same_report(adam_report):
    _, _, report = adam_report
    again = el.memory.memory_report(
        eqx.filter_eval_shape(_encoder), el.train.mse, optax.adam(1e-3), _batch(), accumulate=2
    )
    assert again.to_dict() == report.to_dict()


@pytest.fixture(scope="module")
def sgd_reports(users_compiler):
    """SGD reports of the same encoder: no remat, remat="minimal", and 4 micro-batches."""
    opt = optax.sgd(0.1)
    return {
        "plain": el.memory.memory_report(_encoder(False), el.train.mse, opt, _batch()),
        "minimal": el.memory.memory_report(_encoder("minimal"), el.train.mse, opt, _batch()),
        "micro": el.memory.memory_report(
            _encoder(False), el.train.mse, opt, _batch(), accumulate=4
        ),
    }


def test_remat_and_accumulation_lower_the_activations(sgd_reports):
    plain, remat, micro = sgd_reports["plain"], sgd_reports["minimal"], sgd_reports["micro"]
    assert remat.parts["activations"] < plain.parts["activations"] / 2
    # A quarter of the batch per micro-batch (the per-layer weight slices the scan saves do
    # not shrink).
    assert micro.parts["activations"] < plain.parts["activations"] / 2
    assert remat.peak_bytes < plain.peak_bytes
    assert micro.peak_bytes < plain.peak_bytes
    assert plain.config["remat"] == "none" and remat.config["remat"] == "minimal"
    # SGD keeps no state; accumulate=1 has no accumulator.
    assert plain.parts["optimizer"] == 0 and plain.parts["accumulator"] == 0
    assert micro.parts["accumulator"] == micro.parts["gradients"]
    # The same matrix products, plus the recomputed ones; every loop counted.
    assert remat.cost.matmul_flops > plain.cost.matmul_flops
    assert micro.cost.matmul_flops == plain.cost.matmul_flops


def test_activation_groups_name_checkpoints_and_layers(sgd_reports):
    report = sgd_reports["minimal"]
    named = {g.label: g for g in report.activations if g.name is not None}
    assert set(named) == set(el.nn._remat.MINIMAL_NAMES)
    qkv = named["qkv"]
    # One per layer, stacked by the scan over layers: (layers, batch, seq, 3 * d_model).
    assert qkv.loops == (LAYERS,)
    assert qkv.shape == (LAYERS, BATCH, SEQ, 3 * D)
    assert qkv.nbytes == LAYERS * BATCH * SEQ * 3 * D * 4
    assert qkv.scope.endswith("TransformerBlock")
    assert sum(g.nbytes for g in report.activations) == report.parts["activations"]
    assert report.residuals_by_dtype == {"float32": report.parts["activations"]}
    text = str(report)
    assert "qkv" in text and "x2" in text and "predicted peak" in text


def test_cpu_report_with_bf16_says_which_figure_to_trust():
    model = el.nn.mlp([32, 256, 256, 32], key=jr.PRNGKey(0))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    report = el.memory.memory_report(
        model, el.train.mse, optax.adam(1e-3), (x, x), precision="half_bf16"
    )
    assert report.backend == "cpu"
    n = report.config["parameters"]
    assert report.parts["parameters"] == 2 * n  # 16-bit parameters
    assert report.parts["gradients"] == 4 * n  # the accumulated gradient stays float32
    # Two 16-bit moments per parameter, and a few scalar counters.
    assert 4 * n <= report.parts["optimizer"] < 4 * n + 64
    assert report.residuals_by_dtype["bfloat16"] >= 2 * 64 * 256 * 2  # two hidden layers
    # The GPU/TPU estimate: the same step computing in float32, compiled here, with its
    # saved activations replaced by the 16-bit ones.
    twin = el.memory.memory_report(
        model,
        el.train.mse,
        optax.adam(1e-3),
        (x, x),
        precision=el.precision.Policy(jnp.bfloat16, jnp.float32, jnp.float32),
    )
    assert twin.accelerator_peak_bytes == twin.peak_bytes  # float32 compute: no estimate
    assert twin.parts["parameters"] == report.parts["parameters"]
    assert twin.parts["optimizer"] == report.parts["optimizer"]
    assert twin.parts["activations"] > report.parts["activations"]
    expected = twin.peak_bytes - twin.parts["activations"] + report.parts["activations"]
    assert report.accelerator_peak_bytes == expected < twin.peak_bytes
    assert report.trusted == {"cpu": "peak_bytes", "gpu": "accelerator_peak_bytes"}
    assert any("float32" in note and "CPU" in note for note in report.notes)
    assert "estimate for a GPU/TPU" in str(report)


def test_json_export_round_trips_and_writes_atomically(adam_report, tmp_path):
    _, _, report = adam_report
    path = tmp_path / "sub" / "report.json"
    text = report.to_json(path)
    assert json.loads(path.read_text()) == json.loads(text) == report.to_dict()
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temp file left
    payload = json.loads(text)
    assert sum(payload["parts"].values()) == payload["peak_bytes"]
    assert payload["dominant"] == report.dominant[0]


def test_errors_name_the_argument():
    model, opt = _encoder(), optax.sgd(0.1)
    with pytest.raises(ValueError, match="not divisible by accumulate=3"):
        el.memory.memory_report(model, el.train.mse, opt, _batch(), accumulate=3)
    with pytest.raises(ValueError, match="first .batch. dimension"):
        x = jax.ShapeDtypeStruct((BATCH, SEQ, D), jnp.float32)
        y = jax.ShapeDtypeStruct((BATCH + 1, SEQ, D), jnp.float32)
        el.memory.memory_report(model, el.train.mse, opt, (x, y))
    with pytest.raises(TypeError, match="tuple of arrays"):
        el.memory.memory_report(model, el.train.mse, opt, jnp.zeros((BATCH, SEQ, D)))
    with pytest.raises(ValueError, match="model_state"):
        el.memory.memory_report(model, el.train.mse, opt, _batch(), has_state=True)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU has no memory statistics")
def test_measure_on_cpu_explains_what_it_needs():
    with pytest.raises(ValueError, match="GPU or TPU"):
        el.memory.memory_report(
            el.nn.mlp([4, 8, 1], key=jr.PRNGKey(0)),
            el.train.mse,
            optax.sgd(0.1),
            (jnp.zeros((4, 4)), jnp.zeros((4, 1))),
            measure=True,
        )


# ------------------------------------------------------------------------ building blocks


def test_jaxpr_cost_counts_every_scan_iteration_and_matches_xla_without_loops():
    w = jnp.ones((3, 16, 16))

    def scanned(x):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    cost = el.memory._cost.jaxpr_cost(jax.make_jaxpr(scanned)(jnp.ones((4, 16))))
    assert cost.matmul_flops == 3 * 2 * 4 * 16 * 16
    # A model without loops: XLA's own count agrees.
    model = el.nn.mlp([16, 64, 4], key=jr.PRNGKey(0))

    def loss(m, x):
        return jnp.sum(jax.vmap(m)(x) ** 2)

    x = jnp.ones((32, 16))
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    xla = grad.lower(model, x).compile().compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    mine = el.memory._cost.jaxpr_cost(eqx.filter_make_jaxpr(eqx.filter_grad(loss))(model, x)[0])
    assert mine.flops == pytest.approx(xla["flops"], rel=0.05)


def test_jaxpr_cost_leaves_out_work_no_output_needs():
    # XLA drops it too: a dead product in a scan body, a carry that only feeds itself, a
    # jit's unused output, and the primal a custom backward pass recomputes and discards.
    w = jnp.ones((3, 16, 16))
    x = jnp.ones((4, 16))
    one = 2 * 4 * 16 * 16  # the flops of one (4, 16) @ (16, 16) product

    def body(c, wi):
        h, junk = c
        dead = h @ wi @ wi  # noqa: F841
        return (h @ wi, junk @ wi), None

    def scanned(x):
        (h, _), _ = jax.lax.scan(body, (x, x), w)
        return jax.jit(lambda h: (h @ w[0], h @ w[1] @ w[2]))(h)[0]

    @jax.custom_vjp
    def f(x):
        return x @ w[0]

    def bwd(x, g):
        _, vjp = jax.vjp(lambda x: x @ w[0], x)  # its primal output is discarded
        return vjp(g)

    f.defvjp(lambda x: (f(x), x), bwd)
    cost = el.memory._cost.jaxpr_cost
    assert cost(jax.make_jaxpr(scanned)(x)).matmul_flops == 4 * one
    step = jax.value_and_grad(lambda x: f(x).sum())
    assert cost(jax.make_jaxpr(step)(x)).matmul_flops == 2 * one


def test_saved_residuals_take_shapes_including_integer_inputs():
    lm = eqx.filter_eval_shape(lambda: el.nn.CausalLM(50, 12, 2, 16, 2, 32, key=jr.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((3, 12), jnp.int32)
    res = el.memory.saved_residuals(
        lambda m, t: jnp.sum(el.train.next_token_loss(m, t)[0]), lm, tokens
    )
    scanned = [r for r in res if r.loops]
    assert scanned and all(r.loops == (2,) and r.shape[0] == 2 for r in scanned)
    assert all(r.nbytes == np.prod(r.shape) * r.dtype.itemsize for r in res)


class _TwoConvs(eqx.Module):
    """One activation read by two convolutions (as a WideBlock's `act1`: conv1 and the 1x1
    shortcut): both save it, and it is one buffer."""

    a: eqx.nn.Conv2d
    b: eqx.nn.Conv2d

    def __init__(self, key):
        ka, kb = jr.split(key)
        self.a = eqx.nn.Conv2d(4, 8, 3, padding=1, use_bias=False, key=ka)
        self.b = eqx.nn.Conv2d(4, 8, 1, use_bias=False, key=kb)

    def __call__(self, x):
        act = jax.ad_checkpoint.checkpoint_name(jax.nn.relu(x), "act")
        return self.a(act) * self.b(act)


def test_a_residual_saved_by_two_convolutions_counts_once():
    model = _TwoConvs(jr.PRNGKey(0))
    x = jnp.ones((4, 6, 6))
    res = el.memory.saved_residuals(lambda m, x: jnp.sum(m(x)), model, x)
    shared = [r for r in res if r.name == "act"]
    assert len(shared) == 1  # each convolution saves its own broadcast_in_dim of it
    assert shared[0].nbytes == x.size * 4
    # The other saved arrays: the two weights (arguments), the ReLU's mask and its zeros,
    # and the two convolutions' outputs (for the product): seven in all, not eight.
    assert len(res) == 7


def test_a_transposed_copy_of_a_saved_value_is_a_buffer_of_its_own():
    def f(params, x):
        y = jnp.sin(x)  # (4, 4): its transpose has the same shape, and other bytes
        return jnp.sum((y @ params["v"]) ** 2) + jnp.sum((y.T @ params["w"]) ** 2)

    params = {"v": jnp.ones((4, 3)), "w": jnp.ones((4, 3))}
    res = el.memory.saved_residuals(f, params, jnp.ones((4, 4)))
    saved_y = [r for r in res if r.source == "intermediate sin"]
    assert len(saved_y) == 2  # y and y.T


def test_wrn_first_blocks_count_their_shared_activation_once():
    model, state = eqx.nn.make_with_state(el.nn.WideResNet)(10, 1, 10, key=jr.PRNGKey(0))
    batch = (
        jax.ShapeDtypeStruct((4, 3, 8, 8), jnp.float32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )

    def loss(model, state, x, y):
        logits, state = model.batched(x, state)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), state

    report = el.memory.memory_report(
        model, loss, optax.sgd(0.1), batch, has_state=True, model_state=state
    )
    act1 = [
        g for g in report.activations
        if g.name == "act1" and g.scope.endswith("WideResNet/eqx_lowmem.nn.WideBlock")
    ]  # fmt: skip
    # The three first blocks (each with a 1x1 shortcut on act1): one act1 each, the size of
    # their inputs (16 channels at 8x8, 16 at 8x8, 32 at 4x4), not twice that.
    assert sum(g.arrays for g in act1) == 3
    assert sum(g.nbytes for g in act1) == 4 * 4 * (16 * 64 + 16 * 64 + 32 * 16)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1.5 gib", 3 * 2**29),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert el.memory._units.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["2 GiBs", "GiB", "-1GiB", "1e9", ""])
def test_parse_size_rejects_what_is_not_a_size(bad):
    with pytest.raises(ValueError, match="not a byte size"):
        el.memory._units.parse_size(bad)


def test_format_bytes():
    assert el.memory._units.format_bytes(3 * 2**29) == "1.50 GiB"
    assert el.memory._units.format_bytes(512 * 2**20) == "512.0 MiB"
    assert el.memory._units.format_bytes(-2048) == "-2.00 KiB"
    assert el.memory._units.format_bytes(12) == "12 B"


# ------------------------------------------------------------- issues 10 to 15: new behaviour


def test_an_equinox_mlp_shows_modules_not_primitives_and_no_negative_part():
    model = eqx.nn.MLP(16, 4, 64, 2, key=jr.PRNGKey(0))

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2, axis=-1)

    x = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    y = jax.ShapeDtypeStruct((32, 4), jnp.float32)
    report = el.memory.memory_report(model, loss, optax.sgd(0.1), (x, y))
    assert min(report.parts.values()) >= 0
    # Parameters and their SGD gradients: the model's float32 arrays, once each.
    n_bytes = sum(a.nbytes for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert report.parts["parameters"] == report.parts["gradients"] == n_bytes
    # Two hidden layers' ReLU outputs (32 x 64 float32 each), made by eqx.nn.MLP; the
    # batch itself (float32, not a copy) and broadcast zeros are not counted again.
    relu = [g for g in report.activations if g.label == "unnamed ReLU or max"]
    assert [(g.module, g.arrays, g.nbytes) for g in relu] == [("MLP", 2, 2 * 32 * 64 * 4)]
    assert not [g for g in report.activations if g.label.startswith("batch")]
    text = str(report)
    assert "(select_n)" not in text and "(max)" not in text and "(exp)" not in text
    part_lines = [line for line in text.splitlines() if "%" in line]
    assert len(part_lines) == len(el.memory._result.PARTS)
    assert not [line for line in part_lines if "-" in line.split()[-2]]


def test_a_users_module_groups_by_its_own_checkpoint_names():
    class Block(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):
            with jax.named_scope("mylib.Block"):
                h = jax.ad_checkpoint.checkpoint_name(self.linear(x), "block_hidden")
                return jnp.tanh(h)

    def loss(block, x, y):
        policy = jax.checkpoint_policies.save_only_these_names("block_hidden")
        out = jax.vmap(jax.checkpoint(lambda b, v: b(v), policy=policy), (None, 0))(block, x)
        return jnp.sum((out - y) ** 2, axis=-1)

    block = Block(eqx.nn.Linear(8, 24, key=jr.PRNGKey(0)))
    x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    y = jax.ShapeDtypeStruct((16, 24), jnp.float32)
    report = el.memory.memory_report(block, loss, optax.sgd(0.1), (x, y))
    (hidden,) = [g for g in report.activations if g.name == "block_hidden"]
    assert (hidden.label, hidden.module, hidden.nbytes) == ("block_hidden", "Block", 16 * 24 * 4)
    assert "block_hidden" in str(report)


def test_report_says_which_attention_auto_chose_and_host_bytes(adam_report):
    _, _, report = adam_report
    assert report.config["attention"] == {"auto": "chunked"}  # XLA:CPU: the chunked path
    assert "attention=auto->chunked" in str(report)
    assert report.host_bytes == 0 and report.compiled.get("host_temp", 0) == 0
    assert report.config["devices"] == 1 and report.config["shard"] == "data"
    assert "host memory" not in str(report)


def test_sparse_layers_count_as_parameters_and_optimizer_with_their_density():
    sparse = pytest.importorskip("eqx_lowmem.sparse")
    dense = el.nn.mlp([64, 256, 8], key=jr.PRNGKey(0))
    model = eqx.filter_eval_shape(lambda: sparse.sparsify(dense, 0.5, key=jr.PRNGKey(1)))
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    report = el.memory.memory_report(model, el.train.mse, optax.adam(1e-3), (x, y))
    arrays = [a for a in jax.tree.leaves(model) if isinstance(a, jax.ShapeDtypeStruct)]
    floats = [a for a in arrays if jnp.issubdtype(a.dtype, jnp.inexact)]
    assert any(jnp.issubdtype(a.dtype, jnp.integer) for a in arrays)  # the indices
    # Values, indices (and biases) are the parameters; Adam keeps two moments per value.
    assert report.parts["parameters"] == sum(a.size * a.dtype.itemsize for a in arrays)
    assert report.parts["gradients"] == sum(a.size * 4 for a in floats)
    assert (
        2 * report.parts["gradients"]
        <= report.parts["optimizer"]
        < 2 * report.parts["gradients"] + 64
    )
    assert report.config["density"] == pytest.approx(0.5, abs=0.01)
    assert "density=0.5" in str(report)
    assert not [g for g in report.activations if jnp.issubdtype(g.dtype, jnp.integer)]


def test_shard_needs_a_mesh_and_a_known_name():
    model, opt = _encoder(), optax.sgd(0.1)
    with pytest.raises(ValueError, match="pass mesh="):
        el.memory.memory_report(model, el.train.mse, opt, _batch(), shard="fsdp")
    with pytest.raises(ValueError, match="shard='zero'"):
        el.memory.memory_report(model, el.train.mse, opt, _batch(), shard="zero")


_FSDP_SCRIPT = """
import json
import numpy as np, jax, jax.numpy as jnp, jax.random as jr, optax
import eqx_lowmem as el

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
x = jax.ShapeDtypeStruct((16, 8, 32), jnp.float32)
p = el.memory.plan(lambda remat: el.nn.transformer_encoder(2, 32, 4, 64, key=jr.PRNGKey(0),
                   remat=remat), el.train.mse, optax.adam(1e-3), (x, x), budget="1GiB",
                   remats=("full",), accumulates=(2,), precisions=("float32",), mesh=mesh,
                   prune=False)
out = {c.shard: {**c.report.to_dict(), "text": str(c.report)} for c in p.candidates}
out["plan"] = {"shards": [c.shard for c in p.candidates],
               "peaks": [c.peak_bytes for c in p.candidates], "best": p.best.shard,
               "tight": p.within(min(c.peak_bytes for c in p.candidates)).best.shard}
print(json.dumps(out))
"""


def test_per_device_report_and_plan_over_a_mesh_of_four():
    import subprocess
    import sys

    env = {**users_env(), "JAX_PLATFORMS": "cpu"}  # plan's figures as users get them
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    done = subprocess.run(
        [sys.executable, "-c", _FSDP_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    data, fsdp = out["data"], out["fsdp"]
    n_params = data["config"]["parameters"]
    assert fsdp["config"]["devices"] == 4 and fsdp["config"]["shard"] == "fsdp"
    # Replicated: every device holds all parameters and state (Adam: two moments and a
    # count), and a quarter of the batch (two arrays and the sample weights).
    assert data["parts"]["parameters"] == 4 * n_params
    assert data["parts"]["optimizer"] == 2 * 4 * n_params + 4
    assert data["parts"]["batch"] == (2 * 16 * 8 * 32 * 4 + 16 * 4) // 4
    # FSDP: every array of this model has a dimension 4 divides: a quarter each.
    assert fsdp["parts"]["parameters"] == n_params  # 4 bytes x n / 4 devices
    # Every array is in the recomputed stack, which folds its gradient into the
    # accumulator (fused accumulation): no micro-batch gradient beside it.
    assert fsdp["parts"]["accumulator"] == n_params and fsdp["parts"]["gradients"] == 0
    assert fsdp["parts"]["optimizer"] == 2 * n_params + 4
    assert fsdp["parts"]["batch"] == data["parts"]["batch"]
    assert fsdp["parts"]["activations"] == data["parts"]["activations"]
    assert fsdp["compiled"]["argument"] <= 1.05 * data["compiled"]["argument"] / 4 + 4096
    assert fsdp["peak_bytes"] < data["peak_bytes"]
    for r in (data, fsdp):  # disjoint pieces of the compiled step: within its peak
        assert r["overlap_bytes"] == 0
    assert "devices=4  shard=fsdp  (figures per device)" in fsdp["text"]
    assert any("0 of 12 model arrays" in note for note in fsdp["notes"])
    # The planner tries both layouts with a mesh, and shards when replicated does not fit.
    plan = out["plan"]
    assert plan["shards"] == ["data", "fsdp"] and plan["best"] == "data"
    assert plan["tight"] == "fsdp" and plan["peaks"][1] < plan["peaks"][0]


@pytest.mark.parametrize("bad", [2.5, True, None, [1]])
def test_parse_size_refuses_what_is_not_an_int_or_text(bad):
    with pytest.raises(TypeError, match="size must be an int"):
        el.memory._units.parse_size(bad)


def test_offloaded_names_on_cpu_count_on_the_device_and_say_so(sgd_reports):
    report = el.memory.memory_report(
        _encoder("minimal_offloaded"), el.train.mse, optax.sgd(0.1), _batch()
    )
    minimal = sgd_reports["minimal"]
    # XLA:CPU drops the host placement: the same saved activations as "minimal", no host
    # bytes; the note says what a GPU shows instead.
    assert report.config["remat"] == "minimal_offloaded"
    assert report.parts["activations"] == minimal.parts["activations"]
    assert report.host_bytes == 0
    assert any(note.startswith("Offloading: XLA:CPU drops") for note in report.notes)
