import os

import jax
import jax.random as jr
import pytest

from .helpers import SUITE_XLA_FLAGS, USERS_COMPILER, compile_cache_env

# Compile faster (see `helpers.SUITE_XLA_FLAGS`). Must be set before JAX starts its backend
# (importing jax does not start it); subprocesses inherit it.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *SUITE_XLA_FLAGS]).strip()

# With the CUDA plugin installed (the gpu-plan extra) and no GPU here, JAX would try CUDA
# first in every process and log why it cannot; compile-only GPU targets need no CUDA
# backend (tests/test_targets.py also runs a process without this).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Strict promotion catches silent float64/int upcasts and accidental broadcasting.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="module")
def users_compiler():
    """For a test module that asserts `memory_report`'s compiled figures: `memory_report` and
    `plan` compile with the options a user's process gets (their own optimisation level 0,
    the fusion emitters of XLA's defaults), not the suite's flag that changes buffer
    assignment (`helpers.SUITE_ONLY_FLAG`), so their figures are the ones users see.
    Modules that test the report's or the planner's logic (figures against one another,
    all from one compiler) run at the suite's speed without it."""
    from eqx_lowmem.memory import _compile

    options = _compile._FAST_CPU_COMPILE
    saved = dict(options)
    options.update(USERS_COMPILER)
    yield
    options.clear()
    options.update(saved)


@pytest.fixture
def getkey():
    """A function that returns a fresh PRNG key each call, deterministic per test."""
    key = jr.PRNGKey(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment for a test module's subprocesses: they share one persistent
    compilation cache, so a later process loads what an earlier one compiled."""
    return compile_cache_env(tmp_path_factory.mktemp("jax_cache"))


# Scheduling over the workers (pyproject: `--dist loadfile --no-loadscope-reorder`): each test
# file is run by one worker (its module fixtures compile once). Files start slowest first
# (measured on 2 cores) and the short ones fill in at the end; by default xdist starts the
# files with the most tests first, leaving the heavy files of few tests for last while the
# other worker idles. (`--dist loadgroup` would let a file's tests go apart, but with
# pytest 9 it ignores its groups: xdist 3.8 renames `item._nodeid`, which pytest 9 no
# longer reads.)
SLOWEST_FIRST = (  # the default suite, by file times measured serially under load (2026-12-03)
    "test_sparse_rewire.py",
    "test_attention.py",
    "test_compiler_flags.py",
    "test_wrn.py",
    "test_memory_plan.py",
    "test_remat.py",
    "test_doctests.py",
    "test_precision.py",
    "test_fuse.py",
    "test_interrupt.py",
    "test_orbax.py",
    "test_memory_report.py",
    "test_trainer.py",
    "test_fsdp.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
