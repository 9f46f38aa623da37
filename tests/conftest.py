import os

# Compile faster: on XLA:CPU, LLVM's optimisation of the generated machine code is most of
# the compile time, and the tests compile hundreds of small programs. It changes neither
# buffer assignment (the memory figures tests assert) nor floating-point semantics (no
# fast-math). Must be set before JAX starts its backend; subprocesses inherit it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402

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


# Scheduling over the workers (pyproject: `--dist loadgroup --no-loadscope-reorder`): a
# test file is one unit, run by one worker (its module fixtures compile once), except the
# files in SPLIT, whose tests are independent and each heavy: there each test is a unit.
# Units start slowest first (measured on 2 cores) and the short ones fill in at the end;
# by default xdist would start the files with the most tests first, leaving a heavy file
# of few tests for last while the other worker idles.
SLOWEST_FIRST = (
    "test_examples.py::test_the_readmes_short_example_runs_at_its_size_and_resumes",
    "test_wrn.py",
    "test_fsdp.py",
    "test_gpu_script.py",
    "test_sparse_rewire.py",
    "test_examples.py::test_char_lm_trains_and_a_second_run_resumes",
    "test_multihost.py",
    "test_subprocess.py",
    "test_interrupt.py",
    "test_attention.py",
    "test_precision.py",
    "test_doctests.py",
    "test_memory_plan.py",
)
SPLIT = ("test_examples.py",)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def order(item):
        name = item.path.name
        return rank.get(f"{name}::{item.originalname}", rank.get(name, len(rank)))

    items.sort(key=order)  # stable: the rest keep their order
    if getattr(config.option, "dist", "no") == "loadgroup":
        for item in items:
            if item.path.name not in SPLIT:
                item.add_marker(pytest.mark.xdist_group(item.path.name))
