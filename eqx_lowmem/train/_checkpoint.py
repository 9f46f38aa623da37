"""Checkpoints: a pytree of arrays and a JSON header in one file, written atomically.

Format: the magic line `EQXLOWMEM-CKPT 1\n`, 8 bytes of little-endian header length, a UTF-8
JSON header (the user's metadata and one record per array leaf), then one `.npy` record per
leaf. Arrays are read with `np.load(..., allow_pickle=False)`: a checkpoint cannot run code.
"""

import io
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

_MAGIC = b"EQXLOWMEM-CKPT 1\n"
# 16-bit floats that .npy has no name for travel as their bits.
_BITS = {"bfloat16": np.uint16}


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_numpy(x: Any) -> tuple[np.ndarray, dict[str, Any]]:
    record: dict[str, Any] = {"kind": "array"}
    if _is_key(x):
        record = {"kind": "key", "impl": str(jax.random.key_impl(x))}
        x = jax.random.key_data(x)
    a = np.asarray(x)
    record.update(dtype=str(a.dtype), shape=list(a.shape))
    if record["dtype"] in _BITS:
        a = a.view(_BITS[record["dtype"]])
    return a, record


def save_checkpoint(path: str | os.PathLike, tree: Any, meta: dict[str, Any]) -> None:
    """Write the array leaves of `tree` and the JSON-serialisable `meta` to `path`.

    The file is written next to its destination and renamed over it, so a process killed
    at any moment leaves either the old checkpoint or the new one, never a torn file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves = [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]
    arrays, records = zip(*(_to_numpy(x) for x in leaves), strict=True) if leaves else ((), ())
    header = json.dumps({"meta": meta, "leaves": list(records)}).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for a in arrays:
                np.save(f, a, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a checkpoint, without reading its arrays."""
    with open(path, "rb") as f:
        return _read_header(f, path)["meta"]


def _read_header(f: io.BufferedReader, path) -> dict[str, Any]:
    if f.read(len(_MAGIC)) != _MAGIC:
        raise ValueError(f"{path} is not an eqx_lowmem checkpoint (bad magic line).")
    (length,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(length).decode())


def load_checkpoint(path: str | os.PathLike, like: Any) -> tuple[Any, dict[str, Any]]:
    """Read a checkpoint into the structure of `like` (a pytree of the same kind).

    Returns:
        `(tree, meta)`: `like` with its array leaves replaced by the saved ones.

    Raises:
        ValueError: if the file is not a checkpoint, or its arrays do not match `like`
            in number, shape or dtype (a different model or optimizer).
    """
    with open(path, "rb") as f:
        header = _read_header(f, path)
        records = header["leaves"]
        leaves, treedef = jax.tree.flatten(like)
        slots = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
        if len(slots) != len(records):
            raise ValueError(
                f"{path} holds {len(records)} arrays but the model, optimizer and state "
                f"expect {len(slots)}; it was saved from a different configuration."
            )
        for i, record in zip(slots, records, strict=True):
            a = np.load(f, allow_pickle=False)
            if record["dtype"] in _BITS:
                a = a.view(jnp.dtype(record["dtype"]))
            x = leaves[i]
            expected = (
                (tuple(jax.random.key_data(x).shape), str(jax.random.key_data(x).dtype))
                if _is_key(x)
                else (tuple(x.shape), str(x.dtype))
            )
            if (tuple(a.shape), str(a.dtype)) != expected:
                raise ValueError(
                    f"{path}: array {i} has shape {a.shape} and dtype {a.dtype}, expected "
                    f"shape {expected[0]} and dtype {expected[1]}; it was saved from a "
                    "different model or optimizer."
                )
            value = jnp.asarray(a)
            if record["kind"] == "key":
                value = jax.random.wrap_key_data(value, impl=record["impl"])
            sharding = getattr(x, "sharding", None)
            leaves[i] = value if sharding is None else jax.device_put(value, sharding)
    return jax.tree.unflatten(treedef, leaves), header["meta"]
