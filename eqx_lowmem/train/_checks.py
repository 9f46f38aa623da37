"""The Trainer's checks of what it is given, each raised before any work: arguments, data,
the mesh, the checkpoint directory, and a model that must accept the data."""

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
from jax.sharding import Mesh

from .._checks import (
    INT32_RANGE,
    UINT32_MAX,
    check_fits_in_32_bits,
    check_int,
    check_path,
    check_prng_key,
    check_seconds,
    within,
)
from ..data import DataStream
from ._batches import peek
from ._loss import call_loss
from ._losses import check_batch, id_fields
from ._resume import FORMATS
from ._state import TrainState
from ._step import Step

_STREAM_AND_ARRAYS = """\
fit() takes either arrays or a stream, not both:

    trainer.fit(X, y, epochs=3, micro_batch=8, key=key)          # arrays
    trainer.fit(epochs=3, key=key, stream=DataStream(...))       # a stream
"""


def check_trainer_args(
    *,
    checkpoint_dir,
    checkpoint_every,
    checkpoint_seconds,
    keep_checkpoints,
    max_consecutive_skips,
    progress,
    log_seconds,
    interrupt,
    config,
    checkpoint_format,
    log_dir=None,
    callback=None,
) -> dict[str, Any] | None:
    """The checks of `Trainer(...)`'s arguments; returns `config` as JSON would give it back."""
    for name, d in (("checkpoint_dir", checkpoint_dir), ("log_dir", log_dir)):
        if d is not None:
            check_path(name, d, kind="directory")
            if Path(d).exists() and not Path(d).is_dir():
                raise ValueError(
                    f"{name}={str(d)!r} is a file; expected a directory (it is created if "
                    "missing). Pass a directory path."
                )
    if checkpoint_format not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}.")
    check_int("checkpoint_every", checkpoint_every, 1, none=True)
    check_int("keep_checkpoints", keep_checkpoints, 1)
    check_int("max_consecutive_skips", max_consecutive_skips, 1)
    check_seconds("checkpoint_seconds", checkpoint_seconds)
    check_seconds("log_seconds", log_seconds)
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ValueError("checkpoint_every needs a checkpoint_dir to write to.")
    if progress not in (True, False, "bar", "log"):
        raise ValueError(f"progress must be True, False, 'bar' or 'log', got {progress!r}.")
    if interrupt not in ("exit", "raise"):
        raise ValueError(f"interrupt must be 'exit' or 'raise', got {interrupt!r}.")
    if callback is not None and not callable(callback):
        raise TypeError(
            f"callback must be a function callback(trainer, metrics) or None, got "
            f"{type(callback).__name__} {callback!r}."
        )
    if config is not None and not isinstance(config, dict):
        raise TypeError(
            f"config must be a JSON-serialisable dict of your settings (e.g. "
            f"{{'layers': 4}}), got {type(config).__name__} {config!r}."
        )
    if config is not None:
        try:
            config = json.loads(json.dumps(config))
        except (TypeError, ValueError) as e:
            raise ValueError(f"config must be a JSON-serialisable dict: {e}") from e
    return config


def check_fit_args(key: Any, epochs: Any, updates: Any, eval_every: Any, eval_data: Any) -> None:
    """The checks of `fit(...)`'s arguments other than the data."""
    check_prng_key("key", key)
    check_int("epochs", epochs, 0, none=True)
    check_int("updates", updates, 0, none=True)
    check_int("eval_every", eval_every, 1, none=True)
    if epochs is None and updates is None:
        raise ValueError("fit() needs epochs=... or updates=... (or both).")
    if eval_every is not None and eval_data is None:
        raise ValueError("eval_every needs eval_data to evaluate on.")


def check_directory(d: Path | None) -> None:
    if d is not None and d.exists() and not d.is_dir():
        raise ValueError(
            f"checkpoint_dir={str(d)!r} is a file; expected a directory (it is created "
            "if missing). Pass a directory path."
        )


def make_stream(X, y, micro_batch, key, shuffle, stream, accumulate: int) -> DataStream:
    """The stream `fit` trains from: `stream` checked, or one over the arrays `X` (and `y`)."""
    if stream is not None:
        if X is not None or y is not None:
            raise ValueError(_STREAM_AND_ARRAYS)
        _check_stream(stream, micro_batch)
        return stream
    if X is None:
        raise ValueError("fit() needs arrays X (and y) or stream=DataStream(...).")
    check_int(
        "micro_batch", micro_batch, 1,
        alternative=f"samples per micro-batch; an update uses accumulate={accumulate} of them",
    )  # fmt: skip
    arrays = (X,) if y is None else (X, y)
    lengths = [len(a) for a in arrays]
    if len(set(lengths)) != 1:
        raise ValueError(
            f"X and y must have the same number of samples, got len(X)={lengths[0]} and "
            f"len(y)={lengths[1]}."
        )
    return DataStream(
        tuple(np.asarray(a) for a in arrays),
        micro_batch,
        key=key if shuffle else None,
    )


def _check_stream(stream: Any, micro_batch: Any) -> None:
    if not isinstance(stream, DataStream):
        raise TypeError(
            f"stream must be an eqx_lowmem.data.DataStream, got {type(stream).__name__}."
        )
    if micro_batch is not None and micro_batch != stream.batch_size:
        raise ValueError(
            f"micro_batch={micro_batch!r} but the stream serves batches of "
            f"{stream.batch_size} (the micro-batches); pass micro_batch=None (or the "
            "stream's)."
        )
    if stream.process_count != jax.process_count():
        raise ValueError(
            f"the stream is one of process_count={stream.process_count} parts, but "
            f"JAX runs {jax.process_count()} process(es): call "
            "jax.distributed.initialize(...) in every process before building the "
            "model and the stream, or build the stream with process_count=1."
        )


def make_eval_stream(eval_data, micro_batch) -> DataStream | None:
    if eval_data is None or isinstance(eval_data, DataStream):
        return eval_data
    if not isinstance(eval_data, (tuple, list)):
        raise TypeError(
            f"eval_data must be a tuple of arrays such as (X, y) or a DataStream, got "
            f"{type(eval_data).__name__}."
        )
    arrays = tuple(np.asarray(a) for a in eval_data if a is not None)
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise ValueError(
            f"eval_data arrays must have the same number of samples, got {sorted(lengths)}."
        )
    return DataStream(arrays, micro_batch)


def check_mesh(mesh: Mesh | None, data_axis: str, micro_batch: int) -> None:
    if mesh is None:
        return
    n = int(mesh.shape[data_axis])
    if micro_batch % n:
        raise ValueError(
            f"micro_batch={micro_batch} is not divisible by the {n} devices of the mesh's "
            f"{data_axis!r} axis; every micro-batch is split over them: use a "
            f"multiple of {n}. Batch sizes are global (over all devices)."
        )


def check_data(loss, model: Any, batch: tuple, compute_dtype: Any = None) -> None:
    """`check_batch` (NaN, labels out of range), and what JAX or the precision would
    change silently: complex arrays (a real loss of them trains on their real part),
    64-bit integers beyond 32 bits (wrapped without x64), and finite values beyond
    float16's range under a float16 `compute_dtype` (cast to inf). Time: one pass over
    the batch on the host (two under float16)."""
    arrays = tuple(np.asarray(x) for x in batch)
    for i, a in enumerate(arrays):
        if np.iscomplexobj(a):
            raise ValueError(
                f"batch[{i}] is complex ({a.dtype}); the step trains on real data (a cast "
                "to the compute dtype keeps only the real part). Pass the real and "
                "imaginary parts as separate real features (np.stack([z.real, z.imag], -1))."
            )
        check_fits_in_32_bits(f"batch[{i}]", a)
        _check_fits_float16(f"batch[{i}]", a, compute_dtype)
    check_batch(loss, model, arrays)


_FLOAT16_MAX = float(np.finfo(np.float16).max)


class BatchCheck:
    """`check_data(loss, model, batch, compute_dtype)` for the many batches of one run,
    at less host time a batch: what depends only on the batch's dtypes and sample shapes
    (which arrays can hold NaN, which hold labels or token ids, the model's number of
    classes, the 32-bit and float16 limits) is worked out once per such signature; a
    batch then costs one pass per array that can be wrong: a float32 or float64 array's
    `within` (finite, and within float16's range under float16 compute), an integer
    array's min and max where they are bounded (ids, 64-bit values). Arrays of other
    dtypes (complex, 16-bit floats) go through `check_data` as they are. A batch that
    fails the fast pass goes through `check_data`, which raises its error."""

    def __init__(self, loss: Any, model: Any, compute_dtype: Any = None):
        self.loss, self.model, self.compute_dtype = loss, model, compute_dtype
        self._plans: dict[tuple, tuple[bool, list]] = {}

    def __call__(self, batch: tuple) -> None:
        arrays = [x if type(x) is np.ndarray else np.asarray(x) for x in batch]
        key = tuple([(a.dtype, a.shape[1:] if a.ndim else None) for a in arrays])
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(arrays)
        whole, passes = plan
        if not whole and all(check(arrays[i]) for i, check in passes):
            return
        check_data(self.loss, self.model, tuple(batch), self.compute_dtype)

    def _plan(self, arrays: list[np.ndarray]) -> tuple[bool, list]:
        """(whether `check_data` must see every batch, [(array index, fast check)])."""
        float16 = self.compute_dtype is not None and np.dtype(self.compute_dtype) == np.float16
        limit = _FLOAT16_MAX if float16 else float("inf")
        ids = id_fields(self.loss, self.model, arrays)  # {index: classes or None}
        x64 = jax.config.jax_enable_x64
        passes: list = []
        for i, a in enumerate(arrays):
            kind = a.dtype.kind
            if kind in "cV" or (kind == "f" and a.dtype not in (np.float32, np.float64)):
                return True, []  # complex: refused; 16-bit floats (bfloat16's kind is V)
            if kind == "f":
                passes.append((i, lambda a, limit=limit: within(a, limit)))
            elif kind in "iu":
                lo, hi = None, None
                if a.dtype.itemsize >= 8 and not x64:
                    lo, hi = (0, UINT32_MAX) if kind == "u" else INT32_RANGE
                if i in ids:
                    lo = 0 if lo is None else max(lo, 0)
                    classes = ids[i]
                    if classes is not None:
                        hi = classes - 1 if hi is None else min(hi, classes - 1)
                if lo is not None:
                    passes.append((i, lambda a, lo=lo, hi=hi: _between(a, lo, hi)))
        return False, passes


def _between(a: np.ndarray, lo: int, hi: int | None) -> bool:
    """Every value of the integer array `a` lies in `[lo, hi]` (`hi` None: no bound)."""
    if not a.size:
        return True
    return int(a.min()) >= lo and (hi is None or int(a.max()) <= hi)


def _check_fits_float16(name: str, a: np.ndarray, compute_dtype: Any) -> None:
    if compute_dtype is None or np.dtype(compute_dtype) != np.float16 or not a.size:
        return
    if not np.issubdtype(a.dtype, np.floating) or a.dtype == np.float16:
        return
    if within(a, _FLOAT16_MAX):
        return
    big = np.abs(a) > _FLOAT16_MAX  # NaN compares False: check_batch names those
    if big.any():
        first = np.unravel_index(np.flatnonzero(big)[0], a.shape)
        raise ValueError(
            f"{name} holds {int(big.sum())} values beyond float16's range (+-{_FLOAT16_MAX:g}; "
            f"first at index {tuple(int(j) for j in first)}: {a[first]}), which overflow to "
            "inf when the float16 compute dtype casts them. Scale the data (e.g. normalise "
            "it), or use precision='mixed_bf16' (bfloat16 has float32's range)."
        )


def check_model_accepts(
    step_fn: Step,
    loss,
    state: TrainState,
    stream: DataStream,
    what: str = "a micro-batch",
    traced: set | None = None,
    check_values: bool = True,
) -> None:
    """Trace one micro-batch (of `what`) through the loss before any work, for a clear
    error, after `check_data` on it (`check_values`; False where a check of all the data
    before its use covers it). `traced`: the (model, batch) shapes traced already (a later
    `fit` of the same Trainer is not traced again: 15 ms on a small MLP, measured for
    dd3bfd0), added to."""
    first = next(iter(peek(stream)), None)
    if first is None:
        raise ValueError(
            f"the {'stream' if what == 'a micro-batch' else what} has no batches in epoch "
            f"{stream.epoch + 1} (an empty source, or drop_last with fewer samples than a "
            "batch); nothing to train on."
        )
    assert state is not None
    try:
        if check_values:
            check_data(loss, state.model, tuple(first), step_fn.policy.compute_dtype)
    except ValueError as e:
        if what == "a micro-batch":
            raise
        raise ValueError(f"{what} (its first batch, checked before training): {e}") from e
    policy = step_fn.policy

    def trace(model, model_state, batch, key):
        return call_loss(loss, model, batch, model_state=model_state, key=key, policy=policy)

    specs = tuple(jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in first)
    # Whole arrays, as the loss sees them inside the step (FSDP gathers them there; on a
    # mesh with Explicit axes the state's arrays are typed as sharded).
    model, model_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
        (state.model, state.model_state),
    )
    seen = None if traced is None else _shapes_key(model, model_state, specs)
    if traced is not None and seen in traced:
        return
    try:
        eqx.filter_eval_shape(trace, model, model_state, specs, jr.PRNGKey(0))
    except Exception as e:
        shapes = ", ".join(f"{tuple(s.shape)} {s.dtype}" for s in specs)
        raise ValueError(
            f"the loss cannot be applied to the model and {what} of ({shapes}) "
            f"(called as the step calls it, with a key if the loss takes one): "
            f"{type(e).__name__}: {e}"
        ) from e
    if traced is not None and seen is not None:
        traced.add(seen)


def _shapes_key(*trees: Any) -> tuple | None:
    """What a trace of the loss depends on: the trees' structure (with their non-array
    leaves) and each array's shape and dtype; None where it cannot be a set's key."""
    leaves, treedef = jax.tree.flatten(trees)
    key = (
        treedef,
        tuple(
            (x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else ("leaf", id(x))
            for x in leaves
        ),
    )
    try:
        hash(key)
    except TypeError:  # a static field that is not hashable
        return None
    return key
