import os

# Compile faster: on XLA:CPU, LLVM's optimisation of the generated machine code, the MLIR
# fusion emitters and splitting the module for parallel code generation (two cores: more
# overhead than gain) are most of the compile time, and the tests compile hundreds of
# small programs. Without them (level 0, the elemental IR emitters, one LLVM module) a
# compile takes well under half as long as with XLA's defaults. They change neither buffer
# assignment (the memory figures tests assert; the same for every step configuration
# checked) nor floating-point semantics (no fast-math). Must be set before JAX starts its
# backend; subprocesses inherit it.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",
    ]
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402

from .helpers import compile_cache_env  # noqa: E402

# Strict promotion catches silent float64/int upcasts and accidental broadcasting.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


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
SLOWEST_FIRST = (
    "test_readme.py",
    "test_wrn.py",
    "test_fsdp.py",
    "test_fuse.py",
    "test_gpu_script.py",
    "test_sparse_rewire.py",
    "test_examples.py",
    "test_multihost.py",
    "test_orbax_multihost.py",
    "test_subprocess.py",
    "test_interrupt.py",
    "test_orbax.py",
    "test_attention.py",
    "test_precision.py",
    "test_doctests.py",
    "test_memory_plan.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
