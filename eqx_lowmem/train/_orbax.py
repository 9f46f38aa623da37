"""Orbax checkpoints of a training state: sharded, multi-host, saved asynchronously.

A run directory holds one orbax step directory per checkpoint, named
`checkpoint_<updates, 9 digits>` (orbax's `step_prefix="checkpoint"`), each with two items:

- `state`: the array leaves of the tree (an Equinox `TrainState`: model, optimizer state,
  step, loss scale; typed PRNG keys as their `jax.random.key_data`), written by orbax's
  `PyTreeCheckpointHandler` (tensorstore, OCDBT). Orbax's own API reads it onto any mesh:
  `ocp.StandardCheckpointer().restore(step_dir / "state", abstract_tree)`;
- `meta`: JSON: the caller's metadata, one record per array leaf (its path, kind, dtype,
  shape) with each leaf's hash, and the SHA-256 of both.

What orbax and tensorstore do not check, this module does. A flipped bit in an array's
bytes reads back silently from OCDBT, so every leaf carries a 64-bit hash: the sum mod
2**64 over its elements of a mix (SplitMix64's) of each element's bits and its position in
the leaf, summed over the parts each process holds. Integer sums do not depend on the order
of addition, so the hash is the same on any mesh or number of processes; the position and
the mix make swapped elements and changes that cancel out change it. A restore recomputes
it and refuses a leaf that differs. The `meta` item carries the SHA-256 of its content, so
an edited stream position, history or update count is refused too. (Checkpoints written
before the hash carry sums of bits, still verified.) Any failure to read is a
`CheckpointError` naming the step directory.

Atomicity is orbax's: a step is written under a temporary name and renamed when every
process has finished; a process killed at any moment leaves the step directories before it,
and the next `OrbaxCheckpoints` on the directory deletes the temporary one.

orbax-checkpoint is an optional dependency (`pip install -e '.[orbax]'`), imported when an
`OrbaxCheckpoints` is made.
"""

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_path
from ._checkpoint import (
    CheckpointError,
    _check_expect,
    _check_leaf,
    _expected,
    _is_key_dtype,
    _key_data_sharding,
    _mismatch,
    _numeric,
)
from ._leaf_hash import (
    checksum,
    fingerprints,
    hashes,
)

STEP_PREFIX = "checkpoint"
STATE_ITEM = "state"
META_ITEM = "meta"
_DIGITS = 9
_INSTALL = "pip install -e '.[orbax]' (or: pip install 'orbax-checkpoint>=0.12.8,<0.13')"


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"orbax checkpoints need the orbax-checkpoint package, which is not installed "
            f"({e}). Install it with: {_INSTALL}."
        ) from e
    return ocp


def step_directory(directory: str | os.PathLike, step: int) -> Path:
    """The step directory of checkpoint `step` in a run directory."""
    return Path(directory) / f"{STEP_PREFIX}_{step:0{_DIGITS}d}"


def _finished_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(s for s in map(_step_of, directory.iterdir()) if s is not None)


def holds_orbax_steps(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a finished orbax step directory of this module's naming
    (a killed save's temporary directory does not count)."""
    return bool(_finished_steps(Path(directory)))


def newest_step_directory(directory: str | os.PathLike) -> Path | None:
    """The newest finished step directory in `directory`, or None (no orbax needed)."""
    steps = _finished_steps(Path(directory))
    return step_directory(directory, steps[-1]) if steps else None


def _step_of(p: Path) -> int | None:
    prefix = STEP_PREFIX + "_"
    name = p.name
    if name.startswith(prefix) and name[len(prefix) :].isdigit() and p.is_dir():
        return int(name[len(prefix) :])
    return None


def _save_failure(directory: Path, step: int | None, error: Exception, whole: list[int]) -> str:
    text = str(error)
    code = re.search(r"os_error_code='?(\d+)", text)
    if code is not None:
        cause = os.strerror(int(code.group(1)))
    elif isinstance(error, OSError) and error.strerror:
        cause = error.strerror
    else:
        cause = f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"
    which = "a checkpoint" if step is None else f"checkpoint {step}"
    if whole:
        kept = (
            f"the newest whole checkpoint, {step_directory(directory, whole[-1])}, is intact "
            "(a rerun resumes from it)"
        )
    else:
        kept = "no earlier checkpoint is in it"
    return (
        f"saving {which} in {directory} failed: {cause}. {kept[0].upper() + kept[1:]}; the "
        "failed save left only a temporary directory, removed by the next run. Free space "
        "or fix the directory's permissions, then run again."
    )


# ------------------------------------------------------------------------------- leaves


def _records(tree: Any) -> tuple[Any, list[dict[str, Any]]]:
    """The tree orbax stores (array leaves only, keys as key data; every other leaf None)
    and one record per array leaf: path, kind, dtype, shape (and a key's impl)."""
    arrays = eqx.filter(tree, eqx.is_array)
    named = jax.tree_util.tree_flatten_with_path(arrays)[0]
    records = []
    for p, x in named:
        path = jax.tree_util.keystr(p)
        if not _is_key_dtype(x.dtype) and not _numeric(np.dtype(x.dtype)):
            raise TypeError(
                f"an orbax checkpoint stores numbers, booleans and PRNG keys; leaf {path} has "
                f"dtype {x.dtype}. Keep other values out of the arrays of the tree."
            )
        kind, shape, dtype = _expected(x)
        record: dict[str, Any] = {"path": path, "kind": kind, "dtype": dtype, "shape": list(shape)}
        if kind == "key":
            record["impl"] = str(jax.random.key_impl(x))
        records.append(record)
    stored = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key_dtype(x.dtype) else x, arrays)
    return stored, records


# ------------------------------------------------------------------------------- the run directory


class OrbaxCheckpoints:
    """A run directory of orbax checkpoints, saved asynchronously.

    With several processes, make it and call `save` and `restore` on every process (the
    directory on a filesystem every host reads); the arrays are written by the processes
    that hold them, and orbax's metadata by process 0.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> checkpoints = OrbaxCheckpoints(tempfile.mkdtemp(), keep=2)
        >>> checkpoints.save(1, {"w": jnp.ones(3)}, {"epoch": 0})
        >>> checkpoints.wait()  # saves return at once; this waits for the disk
        >>> tree, meta = checkpoints.restore({"w": jnp.zeros(3)})
        >>> tree["w"].tolist(), meta, checkpoints.steps()
        ([1.0, 1.0, 1.0], {'epoch': 0}, [1])
        >>> checkpoints.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = 3,
        asynchronous: bool = True,
        read_only: bool = False,
    ):
        """Args:
        directory: the run directory (created).
        keep: how many of the newest checkpoints to keep (None: all). Older ones are
            deleted once a newer one is whole on disk.
        asynchronous: `save` returns once the arrays are copied to host memory and
            writes them in background threads (False: it returns when they are on disk).
        read_only: only read (e.g. while another process trains in the directory): no
            directory is created, no save allowed, and a save in flight is left alone
            (otherwise its temporary directory is taken for a killed save's and removed).
        """
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"keep must be None or an int >= 1, got {keep!r}.")
        check_path("directory", directory, kind="directory")
        ocp = _ocp()
        self._ocp = ocp
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(
                f"{str(self.directory)!r} is a file; orbax checkpoints need a directory."
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=asynchronous,
            step_prefix=STEP_PREFIX,
            step_format_fixed_length=_DIGITS,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE_ITEM: ocp.PyTreeCheckpointHandler(),
                META_ITEM: ocp.JsonCheckpointHandler(),
            },
        )

    # -- what is there -----------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of the whole checkpoints in the directory, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest(self) -> int | None:
        """The newest whole checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int | None = None) -> Path:
        """The step directory of `step` (default: the newest)."""
        step = self._step(step)
        return step_directory(self.directory, step)

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"{self.directory} holds no orbax checkpoint.")
        return step

    # -- save --------------------------------------------------------------------------

    def save(self, step: int, tree: Any, meta: dict[str, Any]) -> None:
        """Save the array leaves of `tree` and the JSON-serialisable `meta` as `step`.

        Returns once the arrays are copied to host memory (with `asynchronous`); the
        files are written in the background, and the next `save` first waits for them.
        The tree's arrays may be donated or deleted as soon as it returns. A step saved
        before is replaced (deleted first).

        Memory: the state's arrays once more in host memory until written. Time on the
        caller: the leaves' hashes (one pass over the arrays: on a GPU where they live, on
        a CPU by NumPy, most of a CPU's stall), the copy to host, and orbax's directory
        set-up.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}.")
        try:
            meta_json = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"OrbaxCheckpoints.save(meta=...) must be JSON-serialisable: {e}"
            ) from e
        stored, records = _records(tree)
        for record, digest in zip(records, hashes(stored), strict=True):
            record["hash"] = digest
        header = {"meta": meta_json, "leaves": records, "sha256": checksum(meta_json, records)}
        ocp = self._ocp
        with self._save_errors():  # the save in flight (orbax's save would wait for it too)
            self._manager.wait_until_finished()
            if step in self._manager.all_steps():
                self._manager.delete(step)
        with self._save_errors(step):
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.PyTreeSave(stored),
                        META_ITEM: ocp.args.JsonSave(header),
                    }
                ),
                force=True,
            )
        self._in_flight = step

    def wait(self) -> None:
        """Block until every save is on disk (and older checkpoints beyond `keep` deleted).

        Raises:
            OSError: if a save failed (a full disk, a read-only filesystem), naming the
                directory, the cause and the newest whole checkpoint, which is intact.
        """
        with self._save_errors():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the saves in flight, then release orbax's threads."""
        with self._save_errors():
            self._manager.close()

    _in_flight: int | None = None  # the step of the last asynchronous save started

    @contextlib.contextmanager
    def _save_errors(self, step: int | None = None):
        """Orbax's and tensorstore's errors of a save (at the save, or at the next wait:
        saves are asynchronous) as one OSError naming the directory, the cause and the
        checkpoint that is intact."""
        try:
            yield
        except Exception as e:
            failed = self._in_flight if step is None else step
            self._in_flight = None
            raise OSError(_save_failure(self.directory, failed, e, self._whole_steps())) from e

    def _whole_steps(self) -> list[int]:
        return _finished_steps(self.directory)

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- read --------------------------------------------------------------------------

    def _read_header(self, step: int) -> dict[str, Any]:
        where = step_directory(self.directory, step)
        ocp = self._ocp
        try:
            header = self._manager.restore(
                step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
            )[META_ITEM]
        except FileNotFoundError as e:
            raise CheckpointError(f"{where}: its {META_ITEM!r} item is missing ({e}).") from e
        except Exception as e:  # orbax and tensorstore raise many types
            raise CheckpointError(f"{where}: its {META_ITEM!r} item cannot be read: {e}") from e
        if (
            not isinstance(header, dict)
            or not isinstance(header.get("leaves"), list)
            or "meta" not in header
        ):
            raise CheckpointError(f"{where}: its {META_ITEM!r} item is corrupt.")
        hashed = any(isinstance(r, dict) and "hash" in r for r in header["leaves"])
        if (hashed or "sha256" in header) and header.get("sha256") != checksum(
            header["meta"], header["leaves"]
        ):
            raise CheckpointError(
                f"{where}: its {META_ITEM!r} item fails its SHA-256 checksum: the metadata "
                "(stream position, history, update count or leaf records) was edited or is "
                "corrupt. Use an older checkpoint (another checkpoint_<updates> directory) "
                "or start a new run directory."
            )
        return header

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with `step` (default: the newest), without its arrays."""
        return self._read_header(self._step(step))["meta"]

    def restore(
        self, like: Any, *, step: int | None = None, expect: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Read checkpoint `step` (default: the newest) into the structure of `like`.

        Each leaf is placed with the sharding of its `like` leaf (another mesh or device
        count than the one saved is a resharding, done by orbax); a `like` leaf that is not
        committed to a device (fresh from a step's `init`) gets an uncommitted array, so a
        jitted step does not compile again. Every leaf's fingerprint is verified.

        Args:
            like: a pytree with the structure, shapes and dtypes saved (arrays or
                `jax.ShapeDtypeStruct`s with a `sharding`); its other leaves are returned
                as they are.
            step: the checkpoint to read.
            expect: meta fields the checkpoint must have been saved with.

        Returns:
            `(tree, meta)`.

        Raises:
            FileNotFoundError: if the directory holds no checkpoint.
            CheckpointError: if the checkpoint cannot be read, its metadata fails its
                checksum, a leaf fails its hash, its leaves differ from `like`'s (another
                model or optimizer), or a field of `expect` differs.
        """
        step = self._step(step)
        where = step_directory(self.directory, step)
        header = self._read_header(step)
        records = header["leaves"]
        _check_expect(where, header["meta"], expect)
        like_stored, like_records = _records_like(like)
        if [r["path"] for r in like_records] != [r.get("path") for r in records]:
            raise _mismatch(
                where, [r.get("path") for r in records], [r["path"] for r in like_records]
            )
        arrays = eqx.filter(like, _is_array_or_struct)
        flat_like = jax.tree.leaves(arrays)
        for record, x in zip(records, flat_like, strict=True):
            _check_leaf(where, record, x)
        restore_args = jax.tree.map(self._restore_arg, like_stored)
        restored = self._restore_state(step, like_stored, restore_args)
        self._verify(where, records, restored)
        leaves = []
        for record, x, value in zip(records, flat_like, jax.tree.leaves(restored), strict=True):
            if isinstance(value, np.ndarray) and not isinstance(x, np.ndarray):
                value = jnp.asarray(value)
            if record["kind"] == "key":
                value = jax.random.wrap_key_data(value, impl=record["impl"])
            leaves.append(value)
        treedef = jax.tree.structure(arrays)
        return eqx.combine(jax.tree.unflatten(treedef, leaves), like), header["meta"]

    def _restore_arg(self, x: Any) -> Any:
        ocp = self._ocp
        sharding = getattr(x, "sharding", None)
        if sharding is None:  # uncommitted, a numpy array, or a struct without sharding
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
        return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=x.shape, dtype=x.dtype)

    def _restore_state(self, step: int, item: Any, restore_args: Any, partial: bool = False):
        ocp = self._ocp
        where = step_directory(self.directory, step)
        try:
            return self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.PyTreeRestore(
                            item=item, restore_args=restore_args, partial_restore=partial
                        )
                    }
                ),
            )[STATE_ITEM]
        except Exception as e:  # orbax and tensorstore raise many types
            raise CheckpointError(
                f"{where}: its arrays cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else ''}); the checkpoint is "
                "truncated or corrupt. Use an older one or start a new run directory."
            ) from e

    @staticmethod
    def _verify(where: Path, records: list[dict[str, Any]], restored: Any) -> None:
        kind = "hash" if all("hash" in r for r in records) else "fingerprint"
        prints = (hashes if kind == "hash" else fingerprints)(restored)
        for record, fingerprint in zip(records, prints, strict=True):
            if record.get(kind) != fingerprint:
                raise CheckpointError(
                    f"{where}: leaf {record['path']} fails its {kind}: its bytes are corrupt. "
                    "Use an older checkpoint or start a new run directory."
                )

    def load_model(self, like: Any, *, step: int | None = None) -> Any:
        """Only the model of a Trainer's checkpoint (its leaves under `.model`), or a
        checkpoint of a model alone, into `like`; floating leaves cast to `like`'s dtypes."""
        step = self._step(step)
        where = step_directory(self.directory, step)
        header = self._read_header(step)
        by_path = {r.get("path"): r for r in header["leaves"]}
        like_stored, like_records = _records_like(like)
        wanted = [r["path"] for r in like_records]
        prefix = next((q for q in (".model", "") if all(q + p in by_path for p in wanted)), None)
        if prefix is None:
            absent = next(p for p in wanted if ".model" + p not in by_path)
            raise CheckpointError(
                f"{where} holds no model shaped as `like`: leaf .model{absent} is not in it. "
                "Build `like` as the model was built for training."
            )
        arrays = eqx.filter(like, _is_array_or_struct)
        flat_like = jax.tree.leaves(arrays)
        records = [by_path[prefix + p] for p in wanted]
        for record, x in zip(records, flat_like, strict=True):
            _check_leaf(where, record, x, cast=True)
        saved_like = jax.tree.map(
            lambda x, r: jax.ShapeDtypeStruct(tuple(r["shape"]), jnp.dtype(r["dtype"])),
            like_stored,
            jax.tree.unflatten(jax.tree.structure(like_stored), records),
        )
        item = {"model": saved_like} if prefix else saved_like
        restore_args = jax.tree.map(self._restore_arg, item)
        restored = self._restore_state(step, item, restore_args, partial=bool(prefix))
        restored = restored["model"] if prefix else restored
        self._verify(where, records, restored)
        leaves = []
        for record, x, value in zip(records, flat_like, jax.tree.leaves(restored), strict=True):
            value = jnp.asarray(value)
            if record["kind"] == "key":
                value = jax.random.wrap_key_data(value, impl=record["impl"])
            elif value.dtype != x.dtype:
                value = value.astype(x.dtype)
            leaves.append(value)
        return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), leaves), like)


def _is_array_or_struct(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _records_like(like: Any) -> tuple[Any, list[dict[str, Any]]]:
    """As `_records`, for a `like` that may hold `jax.ShapeDtypeStruct`s: the stored
    stand-ins (keys as their key data's shape and dtype, with its sharding) and records."""
    arrays = eqx.filter(like, _is_array_or_struct)
    named = jax.tree_util.tree_flatten_with_path(arrays)[0]
    records, stored = [], []
    for p, x in named:
        kind, shape, dtype = _expected(x)
        records.append(
            {"path": jax.tree_util.keystr(p), "kind": kind, "dtype": dtype, "shape": list(shape)}
        )
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and not x.committed:
            sharding = None
        if sharding is not None and kind == "key":
            sharding = _key_data_sharding(sharding, x)
        stored.append(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding))
    return jax.tree.unflatten(jax.tree.structure(arrays), stored), records
