"""Checkpoints: a pytree of arrays and a JSON header in one file, checksummed, written atomically.

Format 2 (the file `CHECKPOINT_NAME` in a Trainer's `checkpoint_dir`):

- the magic line `EQXLOWMEM-CKPT 2\\n`;
- 8 bytes: the header's length, little-endian; 4 bytes: the header's CRC-32;
- the UTF-8 JSON header: `{"format": 2, "meta": ..., "leaves": [...]}`, one record per
  array leaf, in the order of `jax.tree.leaves`: its path in the tree (`keystr`, e.g.
  `.model.layers[0].weight`), kind (`array` or `key`, with the key's `impl`), dtype, shape,
  offset of its bytes from the start of the data, and the CRC-32 of those bytes;
- the data: each leaf's raw bytes (C order, little-endian), one after another.

Nothing is unpickled, so a checkpoint cannot run code. Every read failure is one error type,
`CheckpointError`, naming the file and what is wrong. The leaves' paths are what a checkpoint
records of the structure it was made with: `load_checkpoint` refuses a `like` whose array
leaves have other paths, shapes or dtypes, and `load_model` finds a model's leaves by path in
a Trainer's checkpoint.
"""

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_path
from .._io import atomic_write, clean_stale_temporaries as clean_stale_temporaries

# The Trainer's checkpoint file in its `checkpoint_dir`. Not `.eqx`: it is not Equinox's
# `tree_serialise_leaves` format, and `eqx.tree_deserialise_leaves` cannot read it.
CHECKPOINT_NAME = "checkpoint.ckpt"

_MAGIC = b"EQXLOWMEM-CKPT 2\n"
_OLD_MAGICS = (b"EQXLOWMEM-CKPT 1\n",)
_PREAMBLE = struct.Struct("<QI")  # header length, header CRC-32
_FORMAT = 2
_RECORD_KEYS = ("path", "kind", "dtype", "shape", "offset", "crc32")


class CheckpointError(ValueError):
    """A checkpoint cannot be read (truncated, corrupt, not a checkpoint) or does not match
    what it is loaded into (another model, optimizer or configuration). The message names
    the file and what is wrong."""


# ------------------------------------------------------------------------------- leaves


def _is_key_dtype(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _is_leaf_array(x: Any) -> bool:
    """Array leaves a checkpoint stores (and ShapeDtypeStruct stand-ins in a `like`)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _expected(x: Any) -> tuple[str, tuple[int, ...], str]:
    """(kind, shape, dtype) of what leaf `x` stores: a typed key as its key data."""
    if _is_key_dtype(x.dtype):
        data = jax.eval_shape(jax.random.key_data, x)
        return "key", tuple(data.shape), str(data.dtype)
    return "array", tuple(x.shape), str(jnp.dtype(x.dtype))


def _numeric(dtype: np.dtype) -> bool:
    if dtype.fields is not None or dtype.hasobject:
        return False
    return bool(jnp.issubdtype(dtype, jnp.number) or dtype == np.dtype(bool))


def _dtype(name: str, path: Path) -> np.dtype:
    """The numeric dtype a header names; anything else (objects, strings) is corruption."""
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.dtype(bool)):
        raise CheckpointError(f"{path}: the header names dtype {name!r}, not a numeric dtype.")
    return np.dtype(dtype)


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in flat]


def _array_slots(like: Any) -> tuple[list[Any], Any, list[int], list[str]]:
    """`like`'s leaves and treedef, the indices of its array leaves, and their paths."""
    named = _leaves_with_paths(like)
    leaves, treedef = jax.tree.flatten(like)
    slots = [i for i, (_, x) in enumerate(named) if _is_leaf_array(x)]
    return leaves, treedef, slots, [named[i][0] for i in slots]


def _host_value(x: Any) -> np.ndarray:
    """Leaf `x` as one host array: gathered from every device, and from every process."""
    if _is_key_dtype(x.dtype):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _raw(a: np.ndarray) -> np.ndarray:
    """The bytes of `a` in C order, little-endian, as a flat uint8 array (bfloat16 has no
    buffer-protocol name, so its bytes are taken through a view)."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.reshape(-1).view(np.uint8)


# ------------------------------------------------------------------------------- save


def save_checkpoint(path: str | os.PathLike, tree: Any, meta: dict[str, Any]) -> None:
    """Write the array leaves of `tree` and the JSON-serialisable `meta` to `path`.

    Written through `eqx_lowmem._io.atomic_write`: a process killed at any moment leaves
    the old checkpoint or the new one, never a torn file. Each leaf's bytes and the header
    carry a CRC-32, and each leaf its path in `tree`, so a flipped bit or a different
    structure is refused when it is read.

    Record in `meta` what the run was made with and what a resume must share (e.g.
    `{"precision": "mixed_bf16", "accumulate": 4, "learning_rate": 1e-3}`), and pass it as
    `load_checkpoint(..., expect=...)`: the leaves' paths, shapes and dtypes show a
    different model or optimizer state layout, but not a different optimizer of the same
    layout (`optax.adam` and `optax.adamw` keep the same state), learning rate or schedule.

    Sharded arrays: every leaf is gathered into one host array, one leaf at a time (host
    memory: the largest leaf). With several processes, call it on every process (the
    gather is collective); process 0 writes the file and the others wait until it is
    written. `load_checkpoint` places each leaf back with its `like` leaf's sharding.

    Memory: one leaf on the host at a time. Time: one pass over the bytes (copy, CRC-32 at
    about 1 GB/s as measured for dec9c32, write) and an `fsync`.

    Example:
        >>> import os, tempfile, jax.numpy as jnp
        >>> p = os.path.join(tempfile.mkdtemp(), "c.ckpt")
        >>> save_checkpoint(p, {"w": jnp.ones(3)}, {"epoch": 1})
        >>> tree, meta = load_checkpoint(p, {"w": jnp.zeros(3)})
        >>> tree["w"].tolist(), meta
        ([1.0, 1.0, 1.0], {'epoch': 1})
    """
    check_path("path", path)
    path = Path(path)
    try:
        meta_json = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint(meta=...) must be JSON-serialisable: {e}") from e
    leaves = [(p, x) for p, x in _leaves_with_paths(tree) if eqx.is_array(x)]
    records: list[dict[str, Any]] = []
    offset = 0
    for p, x in leaves:
        if not _is_key_dtype(x.dtype) and not _numeric(np.dtype(x.dtype)):
            raise TypeError(
                f"save_checkpoint: leaf {p} has dtype {x.dtype}, which a checkpoint does not "
                "store (numbers, booleans and PRNG keys only); keep strings and objects out "
                "of the arrays of the tree (e.g. as a static field), or in `meta`."
            )
        kind, shape, dtype = _expected(x)
        record: dict[str, Any] = {"path": p, "kind": kind, "dtype": dtype, "shape": list(shape)}
        if kind == "key":
            record["impl"] = str(jax.random.key_impl(x))
        record.update(offset=offset, crc32="00000000")  # fixed width: filled in below
        records.append(record)
        offset += int(np.prod(shape, dtype=np.int64)) * np.dtype(jnp.dtype(dtype)).itemsize
    writer = jax.process_index() == 0

    def header_bytes() -> bytes:
        header = {"format": _FORMAT, "meta": meta_json, "leaves": records}
        return json.dumps(header, separators=(",", ":")).encode("utf-8")

    def write(f: BinaryIO) -> None:
        placeholder = header_bytes()
        data_start = len(_MAGIC) + _PREAMBLE.size + len(placeholder)
        f.seek(data_start)
        for (_, x), record in zip(leaves, records, strict=True):
            a = _raw(_host_value(x))
            record["crc32"] = f"{zlib.crc32(a.data):08x}"
            f.write(a.data)
        header = header_bytes()
        assert len(header) == len(placeholder)
        f.seek(0)
        f.write(_MAGIC)
        f.write(_PREAMBLE.pack(len(header), zlib.crc32(header)))
        f.write(header)

    if writer:
        atomic_write(path, write)
    else:  # take part in the gathers, write nothing
        for _, x in leaves:
            _host_value(x)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"eqx_lowmem.save_checkpoint {path}")


# ------------------------------------------------------------------------------- read


def _directory_message(path: Path) -> str:
    """What to do with a directory given where a checkpoint file was expected."""
    from ._orbax import STEP_PREFIX, holds_orbax_steps

    orbax = holds_orbax_steps(path) or (
        path.name.startswith(STEP_PREFIX + "_") and (path / "meta").is_dir()
    )
    if orbax:
        return (
            f"{path} is an orbax checkpoint directory (checkpoint_format='orbax'), not a "
            "checkpoint file: read it with eqx_lowmem.train.OrbaxCheckpoints(run_directory)"
            ".read_meta() or .restore(like), or load_model(path, like) for the model."
        )
    if (path / CHECKPOINT_NAME).is_file():
        return f"{path} is a directory; its checkpoint is {path / CHECKPOINT_NAME}."
    return f"{path} is a directory, not a checkpoint file."


class _Reader:
    """An open checkpoint: its validated header, and its leaves read on demand."""

    def __init__(self, path: str | os.PathLike):
        check_path("path", path)
        self.path = Path(path)
        try:
            self._f: BinaryIO = open(self.path, "rb")
        except IsADirectoryError:
            raise CheckpointError(_directory_message(self.path)) from None
        except FileNotFoundError:
            raise
        except OSError as e:  # permissions, I/O errors
            raise CheckpointError(f"{self.path} cannot be opened: {e}") from e
        try:
            self._size = os.fstat(self._f.fileno()).st_size
            self._read_header()
        except BaseException:
            self._f.close()
            raise

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def _read_header(self) -> None:
        f = self._f
        magic = f.read(len(_MAGIC))
        if magic in _OLD_MAGICS:
            raise self._fail(
                "written by an earlier eqx_lowmem (checkpoint format 1, without checksums); "
                "this version reads format 2 only. Start a new run directory."
            )
        if magic != _MAGIC:
            if _MAGIC.startswith(magic):
                raise self._fail(f"truncated: the file has {self._size} bytes, not even a header.")
            raise self._fail(
                f"not an eqx_lowmem checkpoint (it starts with {magic[:16]!r}, expected "
                f"{_MAGIC!r})."
            )
        preamble = f.read(_PREAMBLE.size)
        if len(preamble) < _PREAMBLE.size:
            raise self._fail(f"truncated: the file ends inside the header ({self._size} bytes).")
        length, crc = _PREAMBLE.unpack(preamble)
        start = len(_MAGIC) + _PREAMBLE.size
        if length > self._size - start:
            raise self._fail(
                f"the header length field says {length} bytes but only {self._size - start} "
                "follow: the file is truncated or corrupt."
            )
        raw = f.read(length)
        if zlib.crc32(raw) != crc:
            raise self._fail("the header fails its checksum: the file is corrupt.")
        try:
            header = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise self._fail(f"the header is not UTF-8 ({e}): the file is corrupt.") from None
        except json.JSONDecodeError as e:
            raise self._fail(f"the header is not valid JSON ({e}): the file is corrupt.") from None
        if not isinstance(header, dict):
            raise self._fail(f"the header is a JSON {type(header).__name__}, not an object.")
        missing = [k for k in ("format", "meta", "leaves") if k not in header]
        if missing:
            raise self._fail(f"the header lacks {missing}: the file is corrupt.")
        if header["format"] != _FORMAT or not isinstance(header["leaves"], list):
            raise self._fail(f"unknown checkpoint format {header['format']!r}.")
        self.meta: dict[str, Any] = header["meta"]
        self._data_start = start + length
        self.records: list[dict[str, Any]] = []
        end = 0
        for i, record in enumerate(header["leaves"]):
            self.records.append(self._check_record(i, record, end))
            end = record["offset"] + record["nbytes"]
        if self._data_start + end != self._size:
            raise self._fail(
                f"the header describes {end} bytes of arrays but the file holds "
                f"{self._size - self._data_start}: it is "
                f"{'truncated' if self._data_start + end > self._size else 'corrupt'}."
            )
        self.by_path = {r["path"]: r for r in self.records}

    def _check_record(self, i: int, record: Any, end: int) -> dict[str, Any]:
        if not isinstance(record, dict) or any(k not in record for k in _RECORD_KEYS):
            raise self._fail(f"array record {i} lacks some of {list(_RECORD_KEYS)}: corrupt.")
        dtype = _dtype(record["dtype"], self.path)
        shape = record["shape"]
        if (
            not isinstance(shape, list)
            or not all(isinstance(s, int) and s >= 0 for s in shape)
            or record["kind"] not in ("array", "key")
            or record["offset"] != end
        ):
            raise self._fail(f"array record {i} ({record.get('path')}) is corrupt.")
        record["nbytes"] = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return record

    def read(self, record: dict[str, Any]) -> np.ndarray:
        """The leaf of `record` as a host array, checksum verified."""
        self._f.seek(self._data_start + record["offset"])
        raw = self._f.read(record["nbytes"])
        if len(raw) != record["nbytes"]:
            raise self._fail(f"truncated inside leaf {record['path']}.")
        if f"{zlib.crc32(raw):08x}" != record["crc32"]:
            raise self._fail(
                f"leaf {record['path']} fails its checksum: its bytes are corrupt. Use an "
                "older checkpoint or start a new run directory."
            )
        dtype = np.dtype(jnp.dtype(record["dtype"]))
        return np.frombuffer(raw, np.uint8).view(dtype).reshape(record["shape"])


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a checkpoint, without reading its arrays (the header is verified).

    Raises:
        CheckpointError: if the file is not a readable checkpoint.
    """
    with _Reader(path) as reader:
        return reader.meta


def _place(value: np.ndarray, record: dict[str, Any], like: Any) -> Any:
    """A host array as a leaf like `like`: wrapped as a key, on `like`'s sharding.

    A `like` leaf that is not committed to its device (fresh from `init` or a jitted
    step) gets an uncommitted array: jit keys its cache on commitment, so a committed
    copy would make the first step after a resume compile the whole step again."""
    sharding = getattr(like, "sharding", None)
    if isinstance(like, jax.Array) and not like.committed:
        sharding = None
    if record["kind"] == "key":
        data = jnp.asarray(value)
        if sharding is not None:
            data = jax.device_put(data, _key_data_sharding(sharding, like))
        return jax.random.wrap_key_data(data, impl=record["impl"])
    if isinstance(like, np.ndarray):
        return jnp.asarray(value)
    if sharding is None:
        return jnp.asarray(value)
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    # Several processes: each places the parts of the leaf its devices hold.
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _key_data_sharding(sharding: Any, like: Any) -> Any:
    """The sharding of a key's data (one more trailing axis) for a key sharded as `like`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (like.ndim + 1 - len(sharding.spec))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return sharding


def _mismatch(path: Path, saved: list[str], wanted: list[str]) -> CheckpointError:
    extra = [p for p in saved if p not in set(wanted)]
    missing = [p for p in wanted if p not in set(saved)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} leaves expected but not in it (first: {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} leaves in it but not expected (first: {extra[0]})")
    if not parts:
        parts.append("the same leaves in another order")
    return CheckpointError(
        f"{path} was saved from a different model or optimizer: it holds {len(saved)} arrays, "
        f"this run expects {len(wanted)}; {'; '.join(parts)}. Load it with the configuration "
        "that made it, or use a new run directory."
    )


def _check_expect(path: Path, meta: dict[str, Any], expect: dict[str, Any] | None) -> None:
    for name, value in (expect or {}).items():
        if name not in meta:
            continue  # older checkpoints did not record it
        saved = meta[name]
        if json.loads(json.dumps(value)) != saved:
            raise CheckpointError(
                f"{path} was made with {name}={saved!r} but this run has {name}={value!r}; "
                "resume with the same setting, or use a new run directory."
            )


def load_checkpoint(
    path: str | os.PathLike, like: Any, *, expect: dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """Read a checkpoint into the structure of `like` (a pytree of the same kind).

    Every leaf's checksum is verified before it is used, and its path, shape and dtype
    must be `like`'s. Each leaf is placed with the sharding of its `like` leaf (on several
    processes through `jax.make_array_from_callback`; every process reads the file, so it
    must be on a shared filesystem). A different device count is a different sharding of
    the same arrays: the leaves are re-sharded. Host memory: one leaf at a time.

    Args:
        path: the checkpoint file.
        like: a pytree with the structure, shapes and dtypes saved (arrays or
            `jax.ShapeDtypeStruct`s); its non-array leaves are returned as they are.
        expect: meta fields the checkpoint must have been saved with (e.g.
            `{"precision": "half_bf16", "accumulate": 4}`); a field the checkpoint does not
            record is not checked.

    Returns:
        `(tree, meta)`: `like` with its array leaves replaced by the saved ones.

    Raises:
        CheckpointError: (a `ValueError`) if the file is truncated, corrupt or not a
            checkpoint, if a leaf fails its checksum, if its leaves differ from `like`'s in
            path, shape or dtype (another model or optimizer state), or if a field of
            `expect` differs. The message names the file and the leaf.
    """
    path = Path(path)
    with _Reader(path) as reader:
        leaves, treedef, slots, wanted = _array_slots(like)
        saved = [r["path"] for r in reader.records]
        if wanted != saved:
            raise _mismatch(path, saved, wanted)
        _check_expect(path, reader.meta, expect)
        for i, record in zip(slots, reader.records, strict=True):
            _check_leaf(path, record, leaves[i])
        for i, record in zip(slots, reader.records, strict=True):
            leaves[i] = _place(reader.read(record), record, leaves[i])
        return jax.tree.unflatten(treedef, leaves), reader.meta


def _check_leaf(path: Path, record: dict[str, Any], like: Any, cast: bool = False) -> None:
    kind, shape, dtype = _expected(like)
    same_dtype = dtype == record["dtype"] or (
        cast
        and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        and jnp.issubdtype(jnp.dtype(record["dtype"]), jnp.floating)
    )
    if kind != record["kind"] or tuple(record["shape"]) != shape or not same_dtype:
        raise CheckpointError(
            f"{path}: leaf {record['path']} has shape {tuple(record['shape'])} and dtype "
            f"{record['dtype']} ({record['kind']}), expected shape {shape} and dtype {dtype} "
            f"({kind}); it was saved from a different model or optimizer."
        )


def load_model(path: str | os.PathLike, like: Any) -> Any:
    """Load just the model from a checkpoint: for inference or fine-tuning.

    Reads the leaves of `like` and no others, found by their paths: in a Trainer's
    checkpoint (`Trainer(..., checkpoint_dir=d)` writes `d / CHECKPOINT_NAME`, holding the
    whole `TrainState`) the model's leaves are under `.model`; a checkpoint of a model
    alone (`save_checkpoint(p, model, {})`) holds them at the top. Floating-point leaves
    are cast to `like`'s dtype (a `half_bf16` run stores bfloat16 parameters; a float32
    `like` gets them exactly, as float32). Host memory: one leaf at a time.

    Args:
        path: the checkpoint file.
        like: a model of the same structure and shapes (e.g. built as for training, or
            `eqx.filter_eval_shape` of its constructor, which allocates nothing).

    Returns:
        `like` with the saved parameters (and any other array leaves).

    Raises:
        CheckpointError: if the file cannot be read, a leaf fails its checksum, or it holds
            no model of the structure of `like` (naming the first leaf not found).

    Example:
        >>> import os, tempfile, equinox as eqx, jax.random as jr
        >>> model = eqx.nn.Linear(2, 3, key=jr.key(0))
        >>> p = os.path.join(tempfile.mkdtemp(), CHECKPOINT_NAME)
        >>> save_checkpoint(p, {"step": 0, "model": model}, {})  # as a Trainer saves
        >>> fresh = eqx.nn.Linear(2, 3, key=jr.key(1))
        >>> bool((load_model(p, fresh).weight == model.weight).all())
        True
    """
    path = Path(path)
    with _Reader(path) as reader:
        leaves, treedef, slots, wanted = _array_slots(like)
        prefixes = [".model", "['model']", ""]
        prefix = next((q for q in prefixes if all(q + p in reader.by_path for p in wanted)), None)
        if prefix is None:
            best = max(prefixes, key=lambda q: sum(q + p in reader.by_path for p in wanted))
            absent = next(p for p in wanted if best + p not in reader.by_path)
            raise CheckpointError(
                f"{path} holds no model shaped as `like`: leaf {best + absent} is not in it "
                f"({len(reader.records)} leaves, e.g. "
                f"{[r['path'] for r in reader.records[:3]]}). Build `like` as the model "
                "was built for training."
            )
        records = [reader.by_path[prefix + p] for p in wanted]
        for i, record in zip(slots, records, strict=True):
            _check_leaf(path, record, leaves[i], cast=True)
        for i, record in zip(slots, records, strict=True):
            value = _place(reader.read(record), record, leaves[i])
            if record["kind"] == "array" and value.dtype != leaves[i].dtype:
                value = value.astype(leaves[i].dtype)
            leaves[i] = value
        return jax.tree.unflatten(treedef, leaves)
