"""A trained model in and out as a plain Equinox file; `load_model` from any checkpoint."""

import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from .._checks import check_path
from .._io import atomic_write
from ._checkpoint import _MAGIC, CheckpointError, load_model as _load_from_checkpoint
from ._orbax import STEP_PREFIX, OrbaxCheckpoints, holds_orbax_steps


def save_model(path: str | os.PathLike, model: Any, *, densify: bool = False) -> Path:
    """Write `model` as `eqx.tree_serialise_leaves` bytes: Equinox alone reads the file back
    (`eqx.tree_deserialise_leaves(path, like)`), and so does `load_model`.

    Written atomically (a temporary file renamed over `path`). The format is Equinox's: each
    array leaf as a `.npy` record, one after another, without checksums.

    Args:
        path: the file (conventionally `*.eqx`).
        model: an Equinox model, e.g. `trainer.model`.
        densify: for a sparse model (`eqx_lowmem.sparse`), write the dense model that
            `eqx_lowmem.sparse.densify` rebuilds (plain `eqx.nn.Linear` layers: load it into
            the dense architecture); False writes the sparse layers as they are (their
            values and positions: load it into a sparse model of the same density).

    Returns:
        `path`, as a `Path`.

    Example:
        >>> import os, tempfile, equinox as eqx, jax.random as jr
        >>> model = eqx.nn.Linear(2, 3, key=jr.key(0))
        >>> p = save_model(os.path.join(tempfile.mkdtemp(), "model.eqx"), model)
        >>> like = eqx.nn.Linear(2, 3, key=jr.key(1))
        >>> bool((eqx.tree_deserialise_leaves(p, like).weight == model.weight).all())
        True
    """
    check_path("path", path)
    if not any(eqx.is_array(x) for x in jax.tree.leaves(model)):
        raise TypeError(
            f"save_model(model=...) got {type(model).__name__}, which holds no arrays: there "
            "would be nothing to save. Pass the model itself, e.g. trainer.model."
        )
    if densify:
        from ..sparse import densify as to_dense

        model = to_dense(model)
    return atomic_write(path, lambda f: eqx.tree_serialise_leaves(f, model))


def load_model(path: str | os.PathLike, like: Any) -> Any:
    """Load a model: from `save_model`'s (or `eqx.tree_serialise_leaves`') file, from a
    Trainer's `checkpoint.ckpt`, or from an orbax checkpoint (a run directory: its newest
    step; or one step directory `checkpoint_<updates>`).

    From a checkpoint only the model's leaves are read, found by their paths, floating
    ones cast to `like`'s dtypes, each verified by its checksum or fingerprint. From an
    Equinox file every leaf must have `like`'s shape and dtype (the file has no checksums).

    Args:
        path: the file or directory.
        like: a model of the same structure and shapes (built as for training, or
            `eqx.filter_eval_shape` of its constructor, which allocates nothing).

    Returns:
        `like` with the saved arrays.

    Raises:
        FileNotFoundError: if `path` does not exist.
        CheckpointError: if it cannot be read or holds no model shaped as `like`.
    """
    check_path("path", path)
    path = Path(path)
    if path.is_dir():
        if holds_orbax_steps(path):
            return OrbaxCheckpoints(path, read_only=True).load_model(like)
        name = path.name
        digits = name[len(STEP_PREFIX) + 1 :]
        if name.startswith(STEP_PREFIX + "_") and digits.isdigit():
            engine = OrbaxCheckpoints(path.parent, read_only=True)
            return engine.load_model(like, step=int(digits))
        raise CheckpointError(
            f"{path} is a directory without orbax checkpoints (no {STEP_PREFIX}_<updates> "
            "step directory): pass a model file, a checkpoint file or an orbax run directory."
        )
    with open(path, "rb") as f:
        head = f.read(len(_MAGIC))
        if head.startswith(_MAGIC[:-2]):
            return _load_from_checkpoint(path, like)
        _check_not_other(path, head)
        f.seek(0)
        try:
            model = eqx.tree_deserialise_leaves(f, like)
        except Exception as e:  # numpy's and Equinox's errors for a short or other file
            hint = (
                " It looks like a NumPy .npy file of one array (np.save): read arrays with "
                "np.load, models from files written by save_model."
                if path.suffix == ".npy"
                else ""
            )
            raise CheckpointError(
                f"{path} is not an Equinox model file shaped as `like` ({type(e).__name__}: "
                f"{e}); build `like` as the model was built when it was saved.{hint}"
            ) from e
        if f.read(1):
            raise CheckpointError(
                f"{path} holds more arrays than `like` has: it was saved from a different "
                "model. Build `like` as the model was built when it was saved."
            )
    return model


def _check_not_other(path: Path, head: bytes) -> None:
    """Refuse, by name, files that are plainly not an Equinox model file: an empty one, a
    NumPy `.npy`/`.npz` (Equinox's files are a sequence of `.npy` records: the first leaf
    alone would read as one)."""
    if not head:
        raise CheckpointError(
            f"{path} is empty (0 bytes): not a model file. A save that was killed leaves the "
            "old file or none (save_model writes atomically); this one was made elsewhere."
        )
    if head.startswith(b"PK\x03\x04"):
        raise CheckpointError(
            f"{path} is a zip archive (NumPy's .npz?), not an Equinox model file; pass a "
            "file written by save_model or eqx.tree_serialise_leaves."
        )
