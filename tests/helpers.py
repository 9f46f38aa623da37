"""Shared test helpers."""

import os

import equinox as eqx


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    """True when two pytrees have the same structure, dtypes and allclose leaves."""
    return bool(eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol))


def compile_cache_env(directory, env=None) -> dict:
    """`env` (default: this process's) for subprocesses that share JAX's persistent
    compilation cache in `directory`, every program cached however fast it compiled: a
    later process loads what an earlier one compiled instead of compiling it again. The
    executable is the same; only its source-line metadata may differ. For processes that
    run one after another (two at once could read an entry the other is still writing)."""
    env = dict(os.environ if env is None else env)
    env["JAX_COMPILATION_CACHE_DIR"] = str(directory)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env
