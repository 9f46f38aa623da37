"""The Trainer: `fit` over arrays or a stream, with every memory tool, never losing a run."""

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PRNGKeyArray
from tqdm.auto import tqdm

from ..data import DataStream
from ..precision._loss_scale import DynamicLossScale
from ..precision._policy import Policy
from ._checkpoint import load_checkpoint, save_checkpoint
from ._step import Step, TrainState

CHECKPOINT_NAME = "checkpoint.eqx"

_STREAM_AND_ARRAYS = """\
fit() takes either arrays or a stream, not both:

    trainer.fit(X, y, epochs=3, batch_size=8, key=key)           # arrays
    trainer.fit(epochs=3, key=key, stream=DataStream(...))       # a stream
"""


class Trainer:
    """Train a model with micro-batch accumulation, remat, precision and several devices.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr, optax
        >>> import eqx_lowmem as el
        >>> model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
        >>> trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.05), accumulate=4,
        ...                            progress=False)
        >>> X, y = jnp.ones((64, 2)), jnp.zeros((64, 1))
        >>> history = trainer.fit(X, y, epochs=5, batch_size=8, key=jr.PRNGKey(1))
        >>> len(history["train_loss"])
        5
    """

    def __init__(
        self,
        model: Any,
        loss: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        accumulate: int = 1,
        compile: bool = True,
        precision: "str | Policy | None" = None,
        loss_scale: "DynamicLossScale | Literal['auto'] | None" = "auto",
        model_state: Any = None,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        progress: bool = True,
        callback: Callable[["Trainer", dict[str, Any]], None] | None = None,
    ):
        """Args:
        model: an Equinox model (the loss calls it).
        loss: per-sample loss, `loss(model, *batch)` (or `loss(model, model_state, *batch)`
            with `model_state`); see `make_step`. For example `el.train.mse`.
        optimizer: an optax optimizer.
        accumulate: micro-batches per update: each update uses `accumulate * batch_size`
            samples while only `batch_size` samples of activations are alive. Memory:
            activations of one micro-batch and one float32 gradient accumulator.
        compile: jit the step (False runs it eagerly, for debugging).
        precision, loss_scale: see `make_step` (`"mixed_bf16"`, `"mixed_fp16"`, ...).
        model_state: `eqx.nn.State` for stateful layers (BatchNorm); the loss then takes and
            returns it.
        mesh, data_axis: data parallelism over a `jax.sharding.Mesh` (see `make_step`).
        checkpoint_dir: where `fit` saves `checkpoint.eqx` (model, optimizer state, step,
            PRNG key, loss scale, the stream's position and the history) at the end of every
            epoch and every `checkpoint_every` updates, and from where it resumes.
        checkpoint_every: also checkpoint every this many updates.
        progress: show a progress bar over each epoch's updates (never when stderr is not
            a terminal).
        callback: called after every update with the trainer and a dict of `epoch`,
            `step` and the step's metrics as Python numbers.
        """
        if checkpoint_every is not None and (
            not isinstance(checkpoint_every, int) or checkpoint_every < 1
        ):
            raise ValueError(
                f"checkpoint_every must be None or an int >= 1, got {checkpoint_every!r}."
            )
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to write to.")
        self.step_fn = Step(
            loss,
            optimizer,
            accumulate=accumulate,
            precision=precision,
            loss_scale=loss_scale,
            has_state=model_state is not None,
            mesh=mesh,
            data_axis=data_axis,
            jit=compile,
        )
        self.loss = loss
        self.accumulate = accumulate
        self.mesh = mesh
        self.data_axis = data_axis
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.progress = progress
        self.callback = callback
        self._model = model
        self._model_state = model_state
        self.state: TrainState | None = None
        self.history: dict[str, list[float]] = {"train_loss": []}
        self._eval_fn = eqx.filter_jit(self._eval_batch) if compile else self._eval_batch

    @property
    def model(self) -> Any:
        """The trained model (parameters in the policy's storage dtype)."""
        return self._model if self.state is None else self.state.model

    @property
    def model_state(self) -> Any:
        return self._model_state if self.state is None else self.state.model_state

    @property
    def checkpoint_path(self) -> Path | None:
        return None if self.checkpoint_dir is None else self.checkpoint_dir / CHECKPOINT_NAME

    # ---------------------------------------------------------------------------------- fit

    def fit(
        self,
        X: Any = None,
        y: Any = None,
        *,
        epochs: int,
        batch_size: int | None = None,
        key: PRNGKeyArray,
        shuffle: bool = True,
        stream: DataStream | None = None,
        eval_data: "tuple | DataStream | None" = None,
    ) -> dict[str, list[float]]:
        """Train for `epochs` epochs, or resume an interrupted run from `checkpoint_dir`.

        Args:
            X, y: arrays with the same first dimension (y may be None for a loss of X
                alone). More inputs: pass a `DataStream` over all of them.
            epochs: total epochs (a resumed run continues up to this many).
            batch_size: samples per micro-batch, as in the guide. With a stream: None or
                the stream's batch size.
            key: PRNG key: the data order (with `shuffle`) and dropout derive from it.
            shuffle: shuffle the arrays each epoch (a global permutation).
            stream: a `DataStream` to train from instead of arrays; its batches are the
                micro-batches, `accumulate` of them per update.
            eval_data: `(X, y)` arrays or a `DataStream`; its loss is computed after
                every epoch into `history["eval_loss"]`.

        Returns:
            The history: `train_loss` holds each epoch's mean loss over its samples (mean of
            the loss over every sample, whatever the micro-batching), `eval_loss` each
            epoch's evaluation loss.

        Raises:
            ValueError: before any work, for X and y of different lengths, a stream with X,
                `batch_size < 1`, a batch size that differs from the stream's, epochs < 0,
                or a model that does not accept the data. FloatingPointError: for a
                non-finite loss without a loss scale: the update is not applied and no
                checkpoint is written.
        """
        data_key, state_key = jr.split(key)
        stream = self._make_stream(X, y, epochs, batch_size, data_key, shuffle, stream)
        eval_stream = self._make_eval_stream(eval_data, stream.batch_size)
        self.state = self.step_fn.init(self._model, key=state_key, model_state=self._model_state)
        self._check_model_accepts(stream)
        history: dict[str, list[float]] = {"train_loss": []}
        if eval_stream is not None:
            history["eval_loss"] = []
        partial = {"sum": 0.0, "weight": 0.0, "updates": 0}
        if self.checkpoint_path is not None and self.checkpoint_path.exists():
            self.state, meta = load_checkpoint(self.checkpoint_path, self.state)
            stream.set_state(meta["stream"])
            history, partial = meta["history"], meta["partial"]
        self.history = history

        group = self.accumulate * stream.batch_size
        sharding = None if self.mesh is None else NamedSharding(self.mesh, P(self.data_axis))
        while stream.epoch < epochs:
            epoch = stream.epoch
            total = (
                None
                if stream.num_batches is None
                else math.ceil(stream.num_batches / self.accumulate)
            )
            bar = tqdm(
                total=total,
                initial=partial["updates"],
                desc=f"epoch {epoch + 1}/{epochs}",
                disable=True if not self.progress else None,
                leave=False,
                file=sys.stderr,
            )
            batches = stream.prefetch(sharding=None if self.mesh is None else sharding)
            pending = None  # metrics of the step in flight
            try:
                for micro in _groups(batches, self.accumulate):
                    position = stream.state()  # after this group's batches
                    batch, weights = _pad(micro, group)
                    assert self.state is not None
                    self.state, metrics = self.step_fn(self.state, batch, weights)
                    # Read the previous step's metrics while this one runs.
                    if pending is not None:
                        self._finish(pending, partial, bar, epoch)
                    pending = metrics
                    every = self.checkpoint_every
                    if every is not None and (partial["updates"] + 1) % every == 0:
                        # Wait for this step: the saved state is exactly the one after it.
                        self._finish(pending, partial, bar, epoch)
                        pending = None
                        self._save(position, history, partial)
                if pending is not None:
                    self._finish(pending, partial, bar, epoch)
            finally:
                bar.close()
            history["train_loss"].append(partial["sum"] / max(partial["weight"], 1e-30))
            if eval_stream is not None:
                history["eval_loss"].append(self.evaluate(eval_stream))
            partial = {"sum": 0.0, "weight": 0.0, "updates": 0}
            self._save(stream.state(), history, partial)
        return history

    def _finish(self, metrics, partial, bar, epoch) -> None:
        """Wait for a step's metrics; stop on a non-finite loss; update the running mean."""
        values = {k: v.item() for k, v in jax.device_get(metrics).items()}
        if not values["finite"] and self.step_fn.loss_scale is None:
            raise FloatingPointError(
                f"non-finite loss or gradient at update {partial['updates'] + 1} of epoch "
                f"{epoch + 1}; that update was not applied and no checkpoint was written. "
                "Lower the learning rate, clip gradients, or use a loss scale with 16-bit "
                "compute."
            )
        partial["sum"] += values["loss"] * values["weight"]
        partial["weight"] += values["weight"]
        partial["updates"] += 1
        bar.update(1)
        bar.set_postfix(loss=f"{values['loss']:.4f}", refresh=False)
        if self.callback is not None:
            self.callback(self, {"epoch": epoch, "update": partial["updates"], **values})

    def _save(self, position, history, partial) -> None:
        if self.checkpoint_path is None:
            return
        meta = {"stream": position, "history": history, "partial": dict(partial)}
        save_checkpoint(self.checkpoint_path, self.state, meta)

    # ---------------------------------------------------------------------------- evaluate

    def _eval_batch(self, model, model_state, batch, weights):
        if model_state is not None:
            out, _ = self.loss(model, model_state, *batch)
        else:
            out = self.loss(model, *batch)
        values, w = out if isinstance(out, tuple) else (out, None)
        values = values.astype(jnp.float32)
        w = jnp.ones_like(values) if w is None else w.astype(jnp.float32)
        w = w * weights.reshape(weights.shape + (1,) * (values.ndim - 1))
        return jnp.sum(values * w), jnp.sum(w)

    def evaluate(self, data: "tuple | DataStream", batch_size: int | None = None) -> float:
        """Mean loss over every sample of `data` (arrays or a `DataStream`), no update."""
        stream = (
            data
            if isinstance(data, DataStream)
            else self._make_eval_stream(data, batch_size or 256)
        )
        assert stream is not None
        policy = self.step_fn.policy
        model = policy.cast_to_compute(self.model)
        total = weight = 0.0
        for batch in stream:
            batch = policy.cast_to_compute(tuple(jnp.asarray(x) for x in batch))
            batch, weights = _pad([batch], stream.batch_size)
            s, w = self._eval_fn(model, self.model_state, batch, weights)
            total += float(s)
            weight += float(w)
        return total / max(weight, 1e-30)

    # ---------------------------------------------------------------------------- checks

    def _make_stream(self, X, y, epochs, batch_size, key, shuffle, stream) -> DataStream:
        if not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be an int >= 0, got {epochs!r}.")
        if stream is not None:
            if X is not None or y is not None:
                raise ValueError(_STREAM_AND_ARRAYS)
            if not isinstance(stream, DataStream):
                raise TypeError(
                    f"stream must be an eqx_lowmem.data.DataStream, got {type(stream).__name__}."
                )
            if batch_size is not None and batch_size != stream.batch_size:
                raise ValueError(
                    f"batch_size={batch_size} but the stream serves batches of "
                    f"{stream.batch_size}; pass batch_size=None (or the stream's)."
                )
            return stream
        if X is None:
            raise ValueError("fit() needs arrays X (and y) or stream=DataStream(...).")
        if batch_size is None or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size must be an int >= 1 (samples per micro-batch), got {batch_size!r}."
            )
        arrays = (X,) if y is None else (X, y)
        lengths = [len(a) for a in arrays]
        if len(set(lengths)) != 1:
            raise ValueError(
                f"X and y must have the same number of samples, got len(X)={lengths[0]} and "
                f"len(y)={lengths[1]}."
            )
        return DataStream(
            tuple(np.asarray(a) for a in arrays),
            batch_size,
            key=key if shuffle else None,
        )

    def _make_eval_stream(self, eval_data, batch_size) -> DataStream | None:
        if eval_data is None or isinstance(eval_data, DataStream):
            return eval_data
        arrays = tuple(np.asarray(a) for a in eval_data if a is not None)
        lengths = {len(a) for a in arrays}
        if len(lengths) != 1:
            raise ValueError(
                f"eval_data arrays must have the same number of samples, got {sorted(lengths)}."
            )
        return DataStream(arrays, batch_size)

    def _check_model_accepts(self, stream: DataStream) -> None:
        """Trace one micro-batch through the loss before any work, for a clear error."""
        first = next(iter(_peek(stream)), None)
        if first is None:
            return
        state = self.state
        assert state is not None
        policy = self.step_fn.policy
        model_state = state.model_state

        def trace(model, batch):
            model = policy.cast_to_compute(model)
            batch = policy.cast_to_compute(batch)
            if model_state is not None:
                return self.loss(model, model_state, *batch)
            return self.loss(model, *batch)

        specs = tuple(jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in first)
        try:
            eqx.filter_eval_shape(trace, state.model, specs)
        except Exception as e:
            shapes = ", ".join(f"{tuple(s.shape)} {s.dtype}" for s in specs)
            raise ValueError(
                f"the loss cannot be applied to the model and a batch of ({shapes}): "
                f"{type(e).__name__}: {e}"
            ) from e


def _peek(stream: DataStream):
    """The first batch of the stream's current epoch, leaving its position unchanged."""
    position = stream.state()
    try:
        for batch in stream:
            yield batch
            break
    finally:
        stream.set_state(position)


def _groups(batches, k: int):
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def _pad(micro: list[tuple], size: int) -> tuple[tuple, jax.Array]:
    """Concatenate micro-batches and pad to `size` samples at weight 0 (one compilation)."""
    fields = [[m[i] for m in micro] for i in range(len(micro[0]))]  # one list per array
    batch = tuple(jnp.concatenate(f) if len(f) > 1 else f[0] for f in fields)
    n = batch[0].shape[0]
    weights = jnp.ones((size,), jnp.float32)
    if n < size:
        index = jnp.arange(size) % n
        batch = tuple(jnp.asarray(x)[index] for x in batch)
        weights = (jnp.arange(size) < n).astype(jnp.float32)
    return batch, weights
