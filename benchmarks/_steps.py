"""The models, losses and training steps the two grids measure: `memory.py` compiles them,
`speed.py` times them (each of its kinds a builder here, `(name, spec, sizes) -> (update,
info)`: the update to time, and what the build found: the first update's loss and gradient
norm, figures compiled on the way).
"""

import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from _common import compiled_memory, encoder

import eqx_lowmem as el
from eqx_lowmem.memory._inspect import tree_bytes
from eqx_lowmem.memory._target import GPUS

LM_LOSS = {"vocab": 32_000, "d_model": 512, "layers": 2, "heads": 8, "d_ff": 2048, "remat": True,
           "batch": 8, "seq": 256}  # fmt: skip
LM_LOSS_SMOKE = {**LM_LOSS, "vocab": 4096, "d_model": 32, "d_ff": 64, "seq": 16}
STEP_CASES = ("mlp", "lm", "wrn", "encoder64")  # `step_cases`
# Adam's state in float32, 16 bits and 8 bits (`optimizer_state/*`), on a character LM:
# the guide's (12 layers, full recomputation: compiled) and a small one (timed).
OPTIMIZERS = {
    "float32": lambda: optax.adam(3e-3),
    "16bit": lambda: el.precision.half_state(optax.adam(3e-3)),
    "8bit": lambda: el.precision.quantized_state(optax.adam(3e-3)),
}
CHAR_VOCAB = 128
CHAR_LM_SMALL = {"layers": 2, "d_model": 128, "heads": 4, "d_ff": 512, "seq": 64, "batch": 16}
CHAR_LM_GUIDE = {"layers": 12, "d_model": 512, "heads": 8, "d_ff": 2048, "seq": 256, "batch": 32}
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
# Sparse storage: name -> (label, storage, DSR's period). "rewired": ours after 30 DSR
# rewirings on other batches (training's steady state: a timed run never reaches step 100,
# and a rewired layout is not the one `sparsify` makes); "masked": jaxpruner's way (dense
# weight and Adam state, a uint8 mask). `jax.experimental.sparse`'s BCOO weights took 40x
# dense's compiled peak and 109x its time: the "bcoo" rows until commit 80a7b30.
SPARSE = {
    "dense": ("dense", None, None),
    "masked": ("masked dense (jaxpruner)", "masked", None),
    "ours": ("ours", "indices", None),
    "ours_dsr1": ("ours + DSR every step", "indices", 1),
    "ours_dsr100": ("ours + DSR every 100 steps", "indices", 100),
    "bits": ("ours, positions as a bit set", "bits", None),
    "bits_dsr100": ("ours, positions as a bit set + DSR every 100 steps", "bits", 100),
    "rewired_dsr100": ("ours + DSR every 100 steps, after 30 rewirings", "rewired", 100),
}  # fmt: skip
SPARSE_MLP = {"width": 1024, "layers": 3, "batch": 128, "density": 0.3, "slack": 0.1}
MAX_SKIPPED = 30  # overflowing updates a dynamic loss scale may skip before the first good one
SMOKE_REPORTS = ("guide/none",)  # the smoke run's one memory report (each is one more compile)


class MaskedLinear(eqx.Module):
    """jaxpruner's way: a dense weight and a uint8 mask; the forward uses weight * mask."""

    weight: jax.Array
    bias: jax.Array
    mask: jax.Array

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x, *, key=None):
        return (self.weight * self.mask.astype(self.weight.dtype)) @ x + self.bias


def sparse_mlp(name: str, cfg: dict) -> tuple:
    """`SPARSE[name]`'s model of the MLP at `cfg`'s size, a batch `(x, y)` and its step
    (cross-entropy, Adam; DSR after each update where the row says)."""

    _, storage, period = SPARSE[name]
    dense = el.nn.mlp([cfg["width"]] * (cfg["layers"] + 1) + [10], key=jr.PRNGKey(0))
    x = jr.normal(jr.PRNGKey(2), (cfg["batch"], cfg["width"]))
    y = jr.randint(jr.PRNGKey(3), (cfg["batch"],), 0, 10)

    def step(period):
        hook = None if period is None else el.sparse.dsr(period=period)
        return el.train.make_step(el.train.cross_entropy, optax.adam(1e-3), after_update=hook)

    if storage is None:
        return dense, (x, y), step(None)
    model = el.sparse.sparsify(dense, cfg["density"], key=jr.PRNGKey(1), slack=cfg["slack"],
                               storage="bits" if storage == "bits" else "indices")  # fmt: skip
    if storage == "masked":  # the same positions, stored jaxpruner's way
        keep = [el.sparse.densify(s).weight != 0 for s in model.layers]
        layers = [MaskedLinear(d.weight, d.bias, k.astype(jnp.uint8))
                  for d, k in zip(dense.layers, keep, strict=True)]  # fmt: skip
        model = el.nn.MLP(layers=tuple(layers), activation=dense.activation)
    if storage == "rewired":  # on other batches: a model that learnt the timed one is not
        rewire = step(1)  # training's steady state (and its zero gradients are denormal)
        state = rewire.init(model, key=jr.PRNGKey(5))
        for i in range(30):
            kx, ky = jr.split(jr.PRNGKey(6 + i))
            other = jr.normal(kx, x.shape), jr.randint(ky, y.shape, 0, 10)
            state, _ = rewire(state, other)
        model = state.model
    return model, (x, y), step(period)


def wide_resnet(opts: dict, depth: int, width: int, key, in_channels: int = 3) -> tuple:
    """Every grid's WideResNet (10 classes) and its normalisation state: `opts` sets `remat`
    (default checkpoint-residual-1) and `norm` (default BatchNorm), and with a `density`
    makes the 3x3 convolutions sparse (`distribution`, `slack`, `storage` as `sparsify`'s)."""
    model, state = eqx.nn.make_with_state(el.nn.WideResNet)(
        depth, width, 10, key=key, in_channels=in_channels,
        remat=opts.get("remat", "checkpoint-residual-1"), norm=opts.get("norm", "batch"),
    )  # fmt: skip
    if opts.get("density") is not None:
        sparse = {k: opts[k] for k in ("distribution", "slack", "storage") if k in opts}
        model = el.sparse.sparsify(model, opts["density"], key=jr.fold_in(key, 1),
                                   exclude=el.nn.WideResNet.keep_dense, **sparse)  # fmt: skip
    return model, state


def wrn_loss(model, state, x, y):
    """Per-image cross-entropy of a WideResNet, threading its normalisation state: uint8
    images (the grids' synthetic ones) normalised as CIFAR-10's, others (quality.py's
    Fashion-MNIST, normalised when loaded) as they are, in the stem's dtype."""
    if x.dtype == jnp.uint8:
        mean = jnp.asarray(CIFAR_MEAN, jnp.float32)[:, None, None]
        std = jnp.asarray(CIFAR_STD, jnp.float32)[:, None, None]
        x = (x.astype(jnp.float32) / 255.0 - mean) / std
    logits, state = model.batched(x.astype(model.stem.weight.dtype), state)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y), state


def lm_mean_loss(model, tokens, chunk):
    """`next_token_loss`'s weighted mean, whole logits (`chunk=None`) or chunked."""
    values, weights = el.train.next_token_loss(model, tokens, chunk=chunk)
    return jnp.sum(values * weights) / jnp.sum(weights)


class PlainEncoder(eqx.Module):
    """Plain Equinox, the framework compared against: the encoder's stacked blocks in a
    `lax.scan` written here, its body in `eqx.filter_checkpoint` or not (`plain_encoder`)."""

    blocks: eqx.Module
    checkpoint: bool = eqx.field(static=True)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, p):
            return eqx.combine(p, static)(h), None

        body = eqx.filter_checkpoint(body) if self.checkpoint else body
        return jax.lax.scan(body, x, params)[0]


def plain_encoder(cfg: dict, checkpoint: bool) -> PlainEncoder:
    """The encoder at `cfg`'s size as plain Equinox runs it (no remat, no chunking): what
    `hand_step` trains in the guide's plain rows."""
    return PlainEncoder(encoder(cfg, jr.split(jr.PRNGKey(0), 3)[0], chunk_size=None).blocks,
                        checkpoint)  # fmt: skip


def hand_step(model, loss, optimizer):
    """The step a user writes by hand: the mean loss (weighted, where the loss returns
    weights), its gradient, the optimizer's update; params and optimizer state donated.
    Returns the jitted `step(params, opt_state, batch) -> (params, opt_state, loss)`."""
    static = eqx.partition(model, eqx.is_inexact_array)[1]

    def step(params, opt_state, batch):
        def mean_loss(p):
            out = loss(eqx.combine(p, static), *batch)
            values, w = out if isinstance(out, tuple) else (out, jnp.ones_like(out))
            return jnp.sum(values * w) / jnp.sum(w)

        value, grads = jax.value_and_grad(mean_loss)(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def hand_loop(model, loss, optimizer):
    """`hand_step` run as a user's loop runs it, on a copy of `model`'s parameters:
    `run(batches)` makes an update per batch and waits for the last loss; `box` holds the
    parameters and the optimizer state."""
    call = hand_step(model, loss, optimizer)
    box = [jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))]
    box.append(optimizer.init(box[0]))

    def run(batches):
        for batch in batches:
            box[0], box[1], value = call(box[0], box[1], batch)
        return jax.block_until_ready(value)

    return run, box


def step_cases(scale: int = 1) -> dict:
    """The `step/*` cases: name -> (model, loss, batch); `scale` multiplies the batch."""
    k = jr.PRNGKey(0)
    kx, ky = jr.split(jr.PRNGKey(1))
    # GroupNorm: no batch statistics, so its (empty) state is a constant of the loss.
    wrn, wrn_state = eqx.nn.make_with_state(el.nn.WideResNet)(10, 2, 10, key=k, norm="group")

    def wrn_loss(m, x, y):
        logits = m.batched(x, wrn_state)[0].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    def lm_loss(model, tokens):  # no key, no dropout: both steps call the same function
        return el.train.next_token_loss(model, tokens)

    images, labels = jr.normal(kx, (16 * scale, 3, 32, 32)), jr.randint(ky, (16 * scale,), 0, 10)
    return {
        "mlp": (el.nn.mlp([784, 512, 512, 10], key=k), el.train.cross_entropy,
                (jr.normal(kx, (256 * scale, 784)), jr.randint(ky, (256 * scale,), 0, 10))),
        "lm": (el.nn.CausalLM(512, 64, 4, 128, 4, 512, key=k), lm_loss,
               (jr.randint(kx, (8 * scale, 64), 0, 512),)),
        "wrn": (wrn, wrn_loss, (images, labels)),
        "encoder64": (el.nn.transformer_encoder(64, 64, 4, 256, key=k, remat=True), el.train.mse,
                      (jr.normal(kx, (4 * scale, 16, 64)), jr.normal(ky, (4 * scale, 16, 64)))),
    }  # fmt: skip


# ------------------------------------------------------------------------------ runners


def _batch(cfg: dict, key):
    kx, ky = jr.split(key)
    shape = (cfg["batch"], cfg["seq"], cfg["d_model"])
    return jr.normal(kx, shape), jr.normal(ky, shape)


def _step_runner(step, state, batch, host: bool = False):
    """The update of a `make_step`, after its first applied one (a dynamic loss scale may
    skip the first few): `(update, info)` with the first update's loss and gradient norm."""
    info: dict = {}
    if host:  # the program's own host-memory figures (offloaded residuals on a GPU)
        m = step.lower(state, batch).compile()
        info["compiled"] = compiled_memory(m) | {
            f"host_{k}": int(getattr(m.memory_analysis(), f"host_{k}_size_in_bytes", 0))
            for k in ("argument", "output", "temp", "alias")
        }
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(state)
    info["first_call_s"], skipped = time.perf_counter() - t0, 0
    while not bool(metrics["finite"]) and skipped < MAX_SKIPPED:
        skipped += 1
        state, metrics = step(state, batch)
    check = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
    if not (bool(metrics["finite"]) and all(map(math.isfinite, check.values()))):
        raise FloatingPointError(f"no finite update in {skipped + 1} calls: {check}")
    holder = [state]

    def update():  # waits as the hand step does, on one output (one program: all are ready)
        holder[0], metrics = step(holder[0], batch)
        jax.block_until_ready(metrics["loss"])

    return update, {**info, "skipped_updates": skipped, **check}


def _report(shapes, optimizer, batch, accumulate) -> dict:
    """The memory report's prediction (compile only), to compare with the measured peak;
    on a GPU also the same step compiled for its kind as a compile-only target."""

    structs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch)
    args = (shapes, el.train.mse, optimizer, structs)
    report = el.memory.memory_report(*args, accumulate=accumulate)
    trusted = report.trusted.get(jax.default_backend(), "peak_bytes")
    trusted = "peak_bytes" if trusted == "measured_peak_bytes" else trusted
    parts = {k: int(v) for k, v in report.parts.items()}
    out = {"peak_bytes": int(report.peak_bytes), "trusted": trusted, "parts": parts,
           "predicted": int(getattr(report, trusted)), "compile_only_peak_bytes": None,
           "attention": report.config.get("attention")}  # fmt: skip
    if jax.default_backend() == "gpu":
        kind = jax.devices()[0].device_kind  # the compile-only target named as this device
        target = next((t for t, g in GPUS.items() if g.description == kind), None)
        if target is not None:
            gpu = el.memory.memory_report(*args, accumulate=accumulate, target=target)
            out["compile_only_peak_bytes"] = int(gpu.peak_bytes)
    return out


def transformer(name: str, spec: dict, sizes: dict):
    """The guide's encoder trained by `make_step` (SGD): a remat preset or segments,
    micro-batches, a precision; at `sizes[spec["size"]]` (the guide's timing size by default)."""

    cfg, remat = sizes[spec.get("size", "transformer")], spec.get("remat", "none")
    accumulate, segment = spec.get("accumulate", 1), spec.get("segment")
    optimizer = optax.sgd(0.01)
    step = el.train.make_step(el.train.mse, optimizer, accumulate=accumulate,
                              precision=spec.get("precision"))  # fmt: skip
    model_key, data_key = jr.split(jr.PRNGKey(0))
    state = step.init(encoder(cfg, model_key, remat, segment=segment), key=jr.PRNGKey(1))
    batch = _batch(cfg, data_key)
    update, info = _step_runner(step, state, batch, spec.get("host", False))
    if spec.get("report") and (sizes["name"] != "smoke" or name in SMOKE_REPORTS):
        shapes = eqx.filter_eval_shape(encoder, cfg, model_key, remat)
        info["report"] = _report(shapes, optimizer, batch, accumulate)
    return update, info


def plain(name: str, spec: dict, sizes: dict):
    """Plain Equinox's encoder, its scanned body checkpointed (`plain_encoder`), trained by
    the hand step (SGD) on the guide's batch."""
    cfg = sizes["transformer"]
    run = hand_loop(plain_encoder(cfg, True), el.train.mse, optax.sgd(0.01))[0]
    batch = _batch(cfg, jr.split(jr.PRNGKey(0))[1])
    update = lambda: run([batch])  # noqa: E731
    return update, {"loss": float(update())}


def multisteps(name: str, spec: dict, sizes: dict):
    """`optax.MultiSteps`: a hand-written step per micro-batch."""
    cfg, k = sizes["accumulate"], spec["accumulate"]
    model_key, data_key = jr.split(jr.PRNGKey(0))
    opt = optax.MultiSteps(optax.sgd(0.01), every_k_schedule=k)
    run, box = hand_loop(encoder(cfg, model_key), el.train.mse, opt)
    x, y = _batch(cfg, data_key)
    update = lambda: run((x[i::k], y[i::k]) for i in range(k))  # noqa: E731
    loss = float(update())
    if loss != loss:
        raise FloatingPointError("MultiSteps' first update is not finite")
    return update, {"loss": loss, "opt_state_bytes": tree_bytes(box[1])}


def sparse(name: str, spec: dict, sizes: dict):
    """A sparse-storage variant of the MLP (`SPARSE`, `sparse_mlp`): its step's time."""
    model, batch, step = sparse_mlp(spec["variant"], sizes["mlp"])
    return _step_runner(step, step.init(model, key=jr.PRNGKey(4)), batch)


def char_lm(cfg: dict, key, remat="none"):
    """The `optimizer_state/*` rows' character LM (vocabulary 128) at `cfg`'s size."""
    return el.nn.CausalLM(CHAR_VOCAB, cfg["seq"], cfg["layers"], cfg["d_model"], cfg["heads"],
                          cfg["d_ff"], key=key, remat=remat)  # fmt: skip


def char_loss(model, tokens, *, key=None):
    return el.train.next_token_loss(model, tokens.astype(jnp.int32), key=key)


def optimizer_state(name: str, spec: dict, sizes: dict):
    """The small character LM's step with Adam's state in `spec["variant"]`'s precision."""
    cfg = sizes["char_lm"]
    step = el.train.make_step(char_loss, OPTIMIZERS[spec["variant"]]())
    tokens = jr.randint(jr.PRNGKey(2), (cfg["batch"], cfg["seq"] + 1), 0, CHAR_VOCAB)
    return _step_runner(step, step.init(char_lm(cfg, jr.PRNGKey(0)), key=jr.PRNGKey(1)), (tokens,))


def step(name: str, spec: dict, sizes: dict):
    """A `step_cases` case (Adam): the hand step, or the library's, which must first leave
    the parameters where the hand step's first update does (within 1e-4 of the largest,
    the float32 bound for a model; the same gradient, so exact on a CPU). Later updates
    differ where rounding does, which Adam's division of a near-zero gradient by its own
    size turns into steps, so only the first is compared."""
    model, loss, batch = step_cases(sizes["step_scale"])[spec["case"]]
    optimizer = optax.adam(1e-3)
    run, box = hand_loop(model, loss, optimizer)
    hand_update = lambda: run([batch])  # noqa: E731
    if spec["hand"]:
        return _repeated(hand_update, {"loss": float(hand_update())})
    library = el.train.make_step(loss, optimizer)
    state, _ = library(library.init(model, key=jr.PRNGKey(2)), batch)
    hand_update()
    pairs = zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array)),
                jax.tree.leaves(box[0]), strict=True)  # fmt: skip
    diff = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)
    if not diff <= 1e-4:
        raise AssertionError(f"{name}: parameters after one update differ from the hand "
                             f"step's by {diff:.2e} of the largest (bound 1e-4)")  # fmt: skip
    update, info = _step_runner(library, state, batch)
    return _repeated(update, {**info, "max_relative_param_diff_after_1": diff})


def _repeated(update, info: dict, seconds: float = 0.1):
    """`update` repeated to take about `seconds` a call, and `info` with that count as
    `per_call`: one update of a small step takes milliseconds, and a timing that short
    is mostly the jitter of a shared machine."""
    start = time.perf_counter()
    update()
    n = max(1, round(seconds / (time.perf_counter() - start)))

    def call():
        for _ in range(n):
            update()

    return call, {**info, "per_call": n}


def fit(name: str, spec: dict, sizes: dict):
    """The MLP of `step_cases` (Adam) for one epoch of in-memory arrays, `fit_updates`
    shuffled batches: `Trainer.fit` (its defaults: the arrays' data check) against the loop a
    user writes (a permutation, a NumPy gather per batch, the hand step), or the hand step
    fed by `DataStream.prefetch()` (`spec["prefetch"]`: reading overlaps the step); the
    Trainer with `spec["check_data"]` as given. One call is one epoch (`per_call` updates),
    so `fit`'s per-call costs count."""
    model, loss, (x, _) = step_cases(sizes["step_scale"])["mlp"]
    b, updates, rng = x.shape[0], sizes.get("fit_updates", 40), np.random.default_rng(0)
    xs = rng.standard_normal((b * updates, x.shape[1]), dtype=np.float32)
    ys = rng.integers(0, 10, b * updates).astype(np.int32)
    optimizer = optax.adam(1e-3)
    if spec["hand"]:
        run = hand_loop(model, loss, optimizer)[0]
        stream = el.data.DataStream((xs, ys), batch_size=b, key=jr.PRNGKey(1))

        def epoch():  # a NumPy gather per batch, or the library's prefetching stream
            if spec.get("prefetch"):
                return run(stream.prefetch())
            return run((xs[rows], ys[rows]) for rows in np.split(rng.permutation(len(xs)), updates))

    else:
        trainer = el.train.Trainer(model, loss, optimizer, progress=False,
                                   check_data=spec.get("check_data", True))  # fmt: skip

        def epoch():
            trainer.fit(xs, ys, epochs=1, micro_batch=b, key=jr.PRNGKey(1))
            jax.block_until_ready(trainer.state)

    epoch()  # compiles
    return epoch, {"per_call": updates}
