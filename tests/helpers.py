"""Shared test helpers."""

import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import equinox as eqx


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    """True when two pytrees have the same structure, dtypes and allclose leaves."""
    return bool(eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol))


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, imported as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"eqx_lowmem_benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


# The suite compiles faster than XLA's defaults (conftest sets these flags): on XLA:CPU,
# LLVM's optimisation of the generated machine code, the MLIR fusion emitters and splitting
# the module for parallel code generation (two cores: more overhead than gain) are most of
# the compile time, and the tests compile hundreds of small programs. Without them (level
# 0, the elemental IR emitters, one LLVM module) a compile takes well under half as long.
# None changes floating-point semantics (no fast-math). The first and the last leave buffer
# assignment as it is; the fusion emitters' flag does not (`SUITE_ONLY_FLAG`).
SUITE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
# The one flag of the suite's that changes buffer assignment, and so the figures of
# `memory_analysis()`: without the fusion emitters a sparse MLP step with DSR and
# `accumulate=4` compiles to 3.4% more temporaries. Set back to XLA's default (on) for every
# compile whose memory a test asserts (`compile_as_users`, `users_env`, and conftest's
# `users_compiler` for `memory_report`); `tests/test_compiler_flags.py` checks that this
# gives the figures of XLA's defaults, and that no test reads `memory_analysis()` of a
# program compiled otherwise.
SUITE_ONLY_FLAG = "--xla_cpu_use_fusion_emitters=false"
USERS_COMPILER = {"xla_cpu_use_fusion_emitters": True}


def compile_as_users(lowered: Any, options: dict | None = None) -> Any:
    """`lowered.compile()` as a user's process compiles it (XLA's default flags), however
    the suite's flags speed up its other compiles: for `memory_analysis()`. `options`:
    more compiler options (a compile-only target's)."""
    return lowered.compile(compiler_options={**USERS_COMPILER, **(options or {})})


def users_env(env=None) -> dict:
    """`env` (default: this process's) for a subprocess whose memory figures a test asserts:
    XLA_FLAGS without the suite's flag that changes buffer assignment."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != SUITE_ONLY_FLAG)
    return env


_NATIVE_LOG = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\)|[IWEF]\d{4} )"
)


def own_lines(stderr: str) -> list[str]:
    """The lines of a child's stderr less native libraries' own log lines (absl's: JAX's
    CUDA plugin, installed by the gpu-plan extra, logs at start that this machine has no
    CUDA driver, even with JAX_PLATFORMS=cpu)."""
    return [line for line in stderr.strip().splitlines() if not _NATIVE_LOG.match(line)]
