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


def optimised_env(env=None) -> dict:
    """`env` (default: this process's) for a subprocess that trains for many steps: XLA:CPU's
    optimisation level 1 instead of the suite's 0 (conftest), whose slower programs there
    cost more than its quicker compiles save (the README's example: 38 s of CPU instead of
    71 s). The same programs; only the machine code differs."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_backend_optimization_level=0", "--xla_backend_optimization_level=1"
    )
    return env
