"""The checks of what users pass, in one place: ints, seeds and PRNG keys, and whether a
value is concrete (on the host) or traced. Each raises an error that names the argument,
what was expected, what arrived and the fix."""

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_int(
    name: str, value: Any, minimum: int, *, none: bool = False, alternative: str = ""
) -> None:
    """`value` is an int >= `minimum` (`True` is not an int here), or None with `none`.

    Raises:
        TypeError: for a value that is not an int. ValueError: for one below `minimum`.
            Both name `name`, what was expected (and `alternative`) and what arrived.
    """
    if value is None and none:
        return
    also = "None or " if none else ""
    expected = f"{name} must be {also}an int >= {minimum}" + (
        f" ({alternative})" if alternative else ""
    )
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{expected}, got {value!r}.")


def check_seconds(name: str, value: Any) -> None:
    """`value` is None or a number of seconds > 0.

    Raises:
        TypeError: for a value that is not a number. ValueError: for one <= 0.
    """
    if value is None:
        return
    expected = f"{name} must be None or a number of seconds > 0"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}.")
    if not value > 0:
        raise ValueError(f"{expected}, got {value!r}.")


def _described(value: Any) -> str:
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"an array of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def check_prng_key(name: str, key: Any) -> None:
    """`key` is one JAX PRNG key: a typed key (`jr.key(0)`, shape `()`) or a raw one
    (`jr.PRNGKey(0)`: uint32 of shape `(2,)`, or `(4,)` for the `rbg` implementations).
    What the Trainer's `fit`, `make_step(...).init` and everything drawing JAX random
    numbers from a user's key accept.

    Raises:
        TypeError: otherwise, naming `name`; for an int, the key it meant.
    """
    if isinstance(key, jax.Array):  # also a traced key (`eqx.filter_eval_shape(step.init)`)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return
        if key.dtype == jnp.uint32 and key.shape in ((2,), (4,)):
            return
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        raise TypeError(
            f"{name}={key!r} is an int; {name} must be a JAX PRNG key: pass "
            f"{name}=jr.PRNGKey({key}) or jr.key({key})."
        )
    if isinstance(key, np.ndarray) and key.dtype == np.uint32 and key.shape in ((2,), (4,)):
        raise TypeError(
            f"{name} is a numpy array; {name} must be a JAX PRNG key: pass "
            f"{name}=jnp.asarray({name}) or jr.PRNGKey(seed)."
        )
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"{name} must be one JAX PRNG key (shape ()), got keys of shape {key.shape}; "
            f"pass one of them (e.g. {name}[0])."
        )
    raise TypeError(
        f"{name} must be a JAX PRNG key such as jr.PRNGKey(0) or jr.key(0), got {_described(key)}."
    )


def seed_entropy(name: str, key: Any) -> list[int] | None:
    """An int seed or a JAX key (`jr.PRNGKey(0)`, `jr.key(0)`) as a list of non-negative
    ints (what seeds numpy's generators, and what a data stream's state stores); None
    for None.

    Raises:
        TypeError: for a bool. ValueError: for a negative seed or an array that is not a
            key, naming `name`.
    """
    if key is None:
        return None
    if isinstance(key, (bool, np.bool_)):
        raise TypeError(
            f"{name}={key!r}; expected an int seed, jr.PRNGKey(seed) or jr.key(seed) "
            "(True is not a seed)."
        )
    if isinstance(key, (int, np.integer)):
        key = int(key)
        if key < 0:
            raise ValueError(
                f"{name}={key} is negative; pass a non-negative int seed or a jax key."
            )
        return [key]
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    data = np.asarray(key)
    if data.dtype.kind not in "ui" or data.size == 0 or (data < 0).any():
        raise ValueError(
            f"{name} has dtype {data.dtype} and shape {data.shape}; expected an int seed, "
            "jr.PRNGKey(seed) or jr.key(seed)."
        )
    return [int(v) for v in data.ravel()]


def concrete(x: Any) -> np.ndarray | None:
    """`x` as a host array when its values are known here (a numpy array, a JAX array
    outside any transformation); None inside `jit`, `vmap`, `grad` or `eval_shape`,
    where a check on values would need a device round trip (and cost in a jitted step)."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def within(a: np.ndarray, limit: float = float("inf")) -> bool:
    """True when every value of the float32 or float64 array `a` is finite and at most
    `limit` in magnitude, known from one pass: the sum of the squares of `a` is finite and
    at most `limit**2` only then. False means only "not known here" (a NaN, an inf, a value
    beyond `limit`, or squares whose sum overflows or passes `limit**2`): scan the values
    then. No boolean copy, and NumPy's own loop (`einsum`) rather than a BLAS dot: on 32 MiB
    the two take 1.28 and 1.23 ms (`np.isfinite(a).all()` 1.94), but BLAS threads that
    outlive the call took CPU from a running XLA:CPU step: `Trainer.fit` of an epoch of 40
    updates of an MLP, whose arrays it checks whole, ran 0.963-0.969x a hand loop with the
    dot and 0.971-0.978x with `einsum` (0.981-0.983x unchecked; all measured for c1a8880)."""
    if a.dtype not in (np.float32, np.float64) or not a.size:
        return False
    flat = a.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):  # an inf or NaN sum: scan
        squares = float(np.einsum("i,i->", flat, flat))
    return math.isfinite(squares) and squares <= limit * limit


def ids_outside(ids: Any, size: int | None) -> tuple[str, str] | None:
    """Where `ids` are known here (`concrete`) and some lie outside `[0, size)` (below 0
    for `size` None): `("from <min> to <max>", "<n> are outside (first at index <i>:
    <id>)")`. None when they all lie inside, are not integers, or are traced."""
    a = concrete(ids)
    if a is None or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        return None
    lo, hi = int(a.min()), int(a.max())
    if lo >= 0 and (size is None or hi < size):
        return None
    outside = (a < 0) if size is None else (a < 0) | (a >= size)
    bad = np.flatnonzero(outside)
    first = np.unravel_index(bad[0], a.shape)
    at = tuple(int(i) for i in first)
    return f"from {lo} to {hi}", f"{bad.size} are outside (first at index {at}: {int(a[first])})"


def check_path(name: str, value: Any, *, kind: str = "file") -> None:
    """`value` is a path (`str` or `os.PathLike`) that is not empty ('' would mean the
    working directory: the files would land among others').

    Raises:
        TypeError: for a value that is not a path. ValueError: for an empty one.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a {kind} path (a str or pathlib.Path), got {_described(value)}."
        )
    if os.fspath(value) == "":
        example = "'runs/run1'" if kind == "directory" else "'runs/model.eqx'"
        raise ValueError(
            f"{name}='' is empty; expected a {kind} path, e.g. {name}={example}. (An empty "
            "path would be the working directory.)"
        )


INT32_RANGE = (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))
UINT32_MAX = int(np.iinfo(np.uint32).max)


def check_fits_in_32_bits(name: str, a: np.ndarray) -> None:
    """A 64-bit integer array whose values JAX can hold: without x64
    (`jax_enable_x64`, off by default) JAX stores int64 as int32 and uint64 as uint32,
    wrapping larger values silently (token ids beyond 2**31 become other ids).

    Raises:
        ValueError: naming `name`, the largest value and the fix.
    """
    if a.dtype.kind not in "iu" or a.dtype.itemsize < 8 or not a.size or jax.config.jax_enable_x64:
        return
    lo, hi = int(a.min()), int(a.max())
    limit = (0, UINT32_MAX) if a.dtype.kind == "u" else INT32_RANGE
    if lo < limit[0] or hi > limit[1]:
        raise ValueError(
            f"{name} holds {a.dtype} values from {lo} to {hi}, beyond the 32-bit range "
            f"[{limit[0]}, {limit[1]}] JAX stores them in without x64: they would wrap "
            "silently. Renumber the ids into that range, or enable 64-bit values with "
            "jax.config.update('jax_enable_x64', True) before building anything."
        )
