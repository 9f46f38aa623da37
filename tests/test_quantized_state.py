"""8-bit optimizer state (`quantized_state`): code resolution, updates against float32
Adam, compiled memory, composition with make_step, half_state and checkpoints, bad input."""

import importlib.util
import json
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.precision import quantized_state
from eqx_lowmem.precision._quantized import QuantizedArray, dynamic_code, quantize

from .helpers import compile_as_users


def _half_gap(signed):
    """Half the widest gap of the code: the worst relative (to absmax) rounding error."""
    return float(np.max(np.diff(dynamic_code(signed).astype(np.float64)))) / 2


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_within_half_a_code_step_per_block(signed, getkey):
    block = 256
    x = jr.normal(getkey(), (7, 100)) * jnp.logspace(-4, 2, 7)[:, None]  # 700: last block padded
    x = x if signed else x**2
    q = quantize(x, block, signed=signed)
    assert q.codes.shape == (3 * block,) and q.scale.shape == (3,) and q.codes.dtype == jnp.uint8
    err = np.abs(np.asarray(q.dense()) - np.asarray(x)).ravel()
    err = np.pad(err, (0, 3 * block - 700)).reshape(3, block)
    absmax = np.abs(np.pad(np.asarray(x).ravel(), (0, 3 * block - 700))).reshape(3, block)
    bound = absmax.max(axis=1) * (_half_gap(signed) + 2 * np.finfo(np.float32).eps)
    assert np.all(err.max(axis=1) <= bound)
    # the dynamic code is relative near zero too: tiny entries keep most of their value
    small = np.abs(np.asarray(x).ravel()) > 1e-5 * absmax.ravel()[:700].max()
    rel = err.ravel()[:700][small] / np.abs(np.asarray(x).ravel()[small])
    assert np.median(rel) < 0.1


def test_first_update_is_adams_and_stored_moments_within_code_resolution(getkey):
    params = {"w": jr.normal(getkey(), (64, 80)), "b": jr.normal(getkey(), (80,))}
    grads = jax.tree.map(lambda p: jr.normal(getkey(), p.shape), params)
    adam = optax.adam(1e-3)
    q = quantized_state(adam, block=512)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
        u32, s32 = jax.jit(adam.update)(grads, adam.init(params), params)
        u8, s8 = jax.jit(q.update)(grads, q.init(params), params)
    # zero state dequantises exactly to zero: the first update is Adam's (to float32
    # rounding: the two programs fuse the same arithmetic differently)
    assert eqx.tree_equal(u32, u8, rtol=1e-6, atol=0.0)
    for name, signed in (("mu", True), ("nu", False)):
        stored = getattr(s8.inner[0], name)
        exact = getattr(s32[0], name)
        assert isinstance(stored["w"], QuantizedArray) and stored["w"].signed == signed
        assert eqx.tree_equal(stored["b"], exact["b"])  # under one block: float32, exact
        blocks = np.asarray(exact["w"]).reshape(-1, 512)
        err = np.abs(np.asarray(stored["w"].dense()).reshape(-1, 512) - blocks)
        # half a code step of the block's absmax, plus float32 rounding of the product
        bound = np.abs(blocks).max(1) * (_half_gap(signed) + 2 * np.finfo(np.float32).eps)
        assert np.all(err.max(1) <= bound), name


def test_adam_state_is_at_most_2_1_bytes_a_parameter():
    params = {f"w{i}": jnp.zeros((512, 256)) for i in range(8)}
    state = quantized_state(optax.adam(1e-3)).init(params)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert nbytes / (8 * 512 * 256) <= 2.1


@pytest.mark.parametrize("shape", [(512, 256), (4096, 8), (64, 2048)])
def test_no_float32_state_copy_in_the_compiled_update(shape):
    # 8 leaves of 128k elements: Adam's float32 moments would be 8 MiB; the update runs a
    # chunk of rows at a time, one leaf after the other (at shape (64, 2048) a chunk is
    # 16 rows: blocks of 2048 are whole rows)
    params = {f"w{i}": jnp.zeros(shape) for i in range(8)}
    opt = quantized_state(optax.adam(1e-3))
    state = opt.init(params)
    with jax.numpy_dtype_promotion("standard"):
        compiled = compile_as_users(jax.jit(opt.update).lower(params, state, params))
    temp = compiled.memory_analysis().temp_size_in_bytes
    float32_state = 8 * 8 * 512 * 256  # mu and nu in float32
    assert temp <= float32_state / 4, (temp, float32_state)


def test_update_equals_the_dense_path_chunk_by_chunk(getkey):
    """Chunked (element-wise optimizer) and whole (its fallback) give the same state."""
    params = {"w": jr.normal(getkey(), (40, 96)), "v": jr.normal(getkey(), (3000,))}
    grads = [jax.tree.map(lambda p: jr.normal(getkey(), p.shape), params) for _ in range(3)]
    mask = {"w": True, "v": False}
    outs = []
    for chunk in (256, 1 << 16):
        opt = quantized_state(optax.adamw(1e-2, mask=mask), block=128, chunk=chunk)
        state, p = opt.init(params), params
        with jax.numpy_dtype_promotion("standard"):
            for g in grads:
                u, state = jax.jit(opt.update)(g, state, p)
                p = optax.apply_updates(p, u)
        outs.append((p, state))
    assert eqx.tree_equal(outs[0][1], outs[1][1], rtol=1e-6, atol=1e-9)
    assert eqx.tree_equal(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-9)


def test_not_elementwise_optimizers_run_whole_and_match(getkey):
    """Global-norm clipping inside reads every leaf: the update runs whole, as it must."""
    from eqx_lowmem.precision._elementwise import elementwise_labels

    params = {"w": jr.normal(getkey(), (40, 96))}
    g = jax.tree.map(lambda p: 10 * jr.normal(getkey(), p.shape), params)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    leaves = jax.tree.leaves(g)
    assert elementwise_labels(lambda x: x / jnp.sum(x), leaves, [0]) is None
    assert elementwise_labels(lambda x: x * 2.0, leaves, [0]) is not None
    with jax.numpy_dtype_promotion("standard"):
        u32, _ = clipped.update(g, clipped.init(params), params)
        q = quantized_state(clipped, block=128, chunk=256)
        u8, _ = jax.jit(q.update)(g, q.init(params), params)
    assert eqx.tree_equal(u32, u8, rtol=1e-5, atol=0.0)


def test_trains_under_make_step_with_accumulation_loss_scaling_and_resumes_from_both_formats(
    tmp_path, getkey
):
    model = el.nn.mlp([16, 160, 4], key=getkey())
    x, y = jr.normal(getkey(), (32, 16)), jr.normal(getkey(), (32, 4))
    opt = quantized_state(optax.adam(1e-2), block=256)
    step = el.train.make_step(el.train.mse, opt, accumulate=2, precision="mixed_fp16")
    key = getkey()
    straight = step.init(model, key=key)
    losses = []
    for _ in range(6):
        straight, info = step(straight, (x, y))
        losses.append(float(info["loss"]))
    assert losses[-1] < 0.8 * losses[0]
    half = step.init(model, key=key)
    for _ in range(3):
        half, _ = step(half, (x, y))
    el.train.save_checkpoint(tmp_path / "ckpt", half, {"step": 3})
    resumed, _ = el.train.load_checkpoint(tmp_path / "ckpt", step.init(model, key=key))
    for _ in range(3):
        resumed, _ = step(resumed, (x, y))
    assert eqx.tree_equal(resumed, straight)
    if importlib.util.find_spec("orbax") is None:  # the .[orbax] extra
        return
    with el.train.OrbaxCheckpoints(tmp_path / "orbax") as checkpoints:
        checkpoints.save(3, half, {"step": 3})
        checkpoints.wait()
        resumed, _ = checkpoints.restore(step.init(model, key=key))
    for _ in range(3):
        resumed, _ = step(resumed, (x, y))
    assert eqx.tree_equal(resumed, straight)


def test_half_state_outside_keeps_codes_and_scales(getkey):
    params = {"w": jnp.ones((40, 80)), "b": jnp.ones((8,))}
    opt = el.precision.half_state(quantized_state(optax.adam(1e-3), block=1024))
    state = opt.init(params)
    with jax.numpy_dtype_promotion("standard"):
        _, state = jax.jit(opt.update)(params, state, params)
    mu = state.inner.inner[0].mu
    assert mu["b"].dtype == jnp.bfloat16
    assert mu["w"].codes.dtype == jnp.uint8 and mu["w"].scale.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"half_state\(quantized_state\(opt\)\)"):
        quantized_state(el.precision.half_state(optax.adam(1e-3))).init(params)


@pytest.mark.slow  # a half_bf16 step compiled (about 20 s on two shared cores)
def test_make_step_half_policy_wraps_it_in_half_state(getkey):
    # 16-bit parameters and small state leaves, 8-bit codes for the large ones
    model = el.nn.mlp([16, 160, 4], key=getkey())
    x, y = jr.normal(getkey(), (8, 16)), jr.normal(getkey(), (8, 4))
    step = el.train.make_step(
        el.train.mse, quantized_state(optax.adam(1e-2), block=256), precision="half_bf16"
    )
    state = step.init(model, key=getkey())
    losses = []
    for _ in range(4):
        state, info = step(state, (x, y))
        losses.append(float(info["loss"]))
    assert losses[-1] < losses[0]
    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    leaves = jax.tree.leaves(state.opt_state.inner.inner[0].mu, is_leaf=is_q)
    assert {x.dtype for x in leaves if not is_q(x)} == {jnp.dtype(jnp.bfloat16)}
    assert sum(map(is_q, leaves)) == 2  # the two weights (2560 and 640); biases are small


def test_bad_arguments():
    for bits in (4, 16, True):
        with pytest.raises(ValueError, match=rf"bits={bits!r}\); expected 8"):
            quantized_state(optax.adam(1e-3), bits=bits)
    for block in (0, -4, True):
        with pytest.raises(ValueError, match=rf"block={block!r}\); expected a positive int"):
            quantized_state(optax.adam(1e-3), block=block)


def test_state_not_laid_out_like_the_parameters_is_refused_naming_the_leaf():
    # Adafactor's factored second moment: a row and a column statistic per matrix
    params = {"w": jnp.zeros((4096, 8))}
    with pytest.raises(
        ValueError, match=r"optimizer=.*opt_state\[0\].v_col\[.w.\] is float32\[4096\]"
    ):
        quantized_state(optax.adafactor(1e-3, min_dim_size_to_factor=8), block=1024).init(params)
    # a leaf of one parameter's size that follows no parameter
    odd = optax.GradientTransformation(
        lambda p: {"x": jnp.zeros(5000)}, lambda u, s, p=None: (u, s)
    )
    with pytest.raises(ValueError, match=r"opt_state\['x'\] is float32\[5000\], not laid out"):
        quantized_state(odd, block=2048).init(params)
    for chunk in (0, -8):
        with pytest.raises(ValueError, match=rf"chunk={chunk!r}\); expected a positive int"):
            quantized_state(optax.adam(1e-3), chunk=chunk)


FSDP = r"""
import json, sys
import jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax, equinox as eqx
import eqx_lowmem as el

jax.config.update("jax_numpy_dtype_promotion", "standard")  # optax's bias correction
mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
opt = el.precision.quantized_state(optax.adam(1e-2), block=64)
def lm():
    return el.nn.CausalLM(vocab_size=32, max_seq=16, n_layers=2, d_model=32, n_heads=4,
                          d_ff=64, key=jr.PRNGKey(0), remat=True)
def train(step):
    state = step.init(lm(), key=jr.PRNGKey(2))
    for i in range(4):
        state, info = step(state, (jr.randint(jr.PRNGKey(i), (16, 17), 0, 32),))
    return state, float(info["loss"])
one, loss_one = train(el.train.make_step(el.train.next_token_loss, opt))
four, loss_four = train(el.train.make_step(el.train.next_token_loss, opt, mesh=mesh, shard="fsdp"))
leaves = lambda s: [np.asarray(x, np.float32) for x in jax.tree.leaves(eqx.filter(s, eqx.is_array))]
adam = optax.adam(1e-2)
one32, _ = train(el.train.make_step(el.train.next_token_loss, adam))
four32, _ = train(el.train.make_step(el.train.next_token_loss, adam, mesh=mesh, shard="fsdp"))
codes = [x for x in jax.tree.leaves(four.opt_state) if x.dtype == jnp.uint8]
is_q = lambda x: isinstance(x, el.precision._quantized.QuantizedArray)
print(json.dumps({
    "diff": max(float(np.max(np.abs(a - b)))
                for a, b in zip(leaves(one.model), leaves(four.model))),
    "diff32": max(float(np.max(np.abs(a - b)))
                  for a, b in zip(leaves(one32.model), leaves(four32.model))),
    "codes_differ": sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in zip(
        [x for x in jax.tree.leaves(one.opt_state) if x.dtype == jnp.uint8], codes)),
    "codes": sum(x.size for x in codes),
    # FSDP splits the flat codes along their axis: whole blocks (64) on each device where
    # 4 divides the blocks (leaves of 1 to 3 blocks are split inside a block)
    "whole_blocks": [not q.codes.sharding.is_fully_replicated
                     and q.codes.addressable_shards[0].data.shape[0] % 64 == 0
                     for q in jax.tree.leaves(four.opt_state, is_leaf=is_q)
                     if is_q(q) and q.scale.shape[0] % 4 == 0],
    "loss": [loss_one, loss_four]}))
"""


@pytest.mark.slow  # four small LM steps compiled in a subprocess on 4 host devices
def test_fsdp_on_four_devices_equals_one_device_with_8bit_state():
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    out = subprocess.run(
        [sys.executable, "-c", FSDP], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # Adam turns the devices' other summation order of tiny gradients into steps of lr
    # (float32 Adam's own parameters differ as much): no further than float32 Adam's
    assert r["diff"] <= r["diff32"], r
    assert abs(r["loss"][0] - r["loss"][1]) < 1e-4 * abs(r["loss"][0]), r
    # a code may round the other way where a moment sits on a rounding boundary
    assert r["codes_differ"] <= 1e-3 * r["codes"], r
    assert r["whole_blocks"] and all(r["whole_blocks"]), r  # split, blocks within a shard


_NDIM_MASK = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731


@pytest.mark.parametrize(
    ("name", "make", "chunked"),
    [
        ("adam", lambda: optax.adam(1e-3), True),
        ("adamw, mask by rank", lambda: optax.adamw(1e-3, mask=_NDIM_MASK), True),
        ("lion", lambda: optax.lion(1e-3), True),
        ("sgd momentum", lambda: optax.sgd(1e-2, momentum=0.9), True),
        (
            "clip inside",
            lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            False,
        ),
        ("lamb", lambda: optax.lamb(1e-3), False),
    ],
)
def test_which_optimizers_update_chunk_by_chunk_and_their_updates(name, make, chunked, getkey):
    """Element-wise optimizers run chunk by chunk, the others whole; both give the
    optimizer's own updates (zero state decodes exactly)."""
    from eqx_lowmem._layout import owners
    from eqx_lowmem.precision._quantized import _is_q, _piecewise, _Plan

    params = {"w": jr.normal(getkey(), (64, 128)), "b": jr.normal(getkey(), (128,))}
    grads = jax.tree.map(lambda p: jr.normal(getkey(), p.shape), params)
    opt, q = make(), quantized_state(make(), block=256, chunk=1024)
    state = q.init(params)
    leaves, s_def, who = owners(state.inner, params)
    u, u_def = jax.tree.flatten(grads)
    plan = _Plan(u, jax.tree.leaves(params), [x for _, x in leaves], who, u_def, s_def)
    large = {w for w, x in zip(who, plan.s, strict=True) if _is_q(x)}
    with jax.numpy_dtype_promotion("standard"):
        assert large and _piecewise(opt, plan, large) == chunked, name
        u32, _ = jax.jit(opt.update)(grads, opt.init(params), params)
        u8, _ = jax.jit(q.update)(grads, state, params)
    assert eqx.tree_equal(u32, u8, rtol=1e-6, atol=1e-12), name
