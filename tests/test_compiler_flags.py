"""The memory figures the suite asserts are those of the compiler users run.

The suite compiles with flags that make XLA:CPU compile faster (`helpers.SUITE_XLA_FLAGS`).
One of them changes buffer assignment, so every compile whose `memory_analysis()` a test
asserts sets it back (`helpers.compile_as_users`, `helpers.users_env`, and conftest's for
`memory_report`). Here: those figures equal a process's under XLA's default flags, as does
`memory_report`'s own compile at optimisation level 0 (`eqx_lowmem/memory/_compile.py`
claims it leaves the buffers as they are); and no test reads `memory_analysis()` of a
program compiled any other way."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqx_lowmem as el

from .helpers import SUITE_XLA_FLAGS, compile_as_users

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("argument", "output", "temp", "alias")
# `eqx_lowmem.memory._compile`'s option on XLA:CPU, which it says changes no buffer.
REPORT_OPTIONS = {"xla_backend_optimization_level": 0}


def _sparse_mlp() -> tuple:
    """A 2-layer MLP at 30% density (shapes only) and its batch's shapes: the suite's flags
    move its step's temporaries by 13% (56,288 bytes against 49,184 with DSR and
    `accumulate=4`) and memory_report's by 1%."""
    model = el.nn.mlp([64, 64, 10], key=jr.PRNGKey(0))
    sparse = eqx.filter_eval_shape(
        lambda m: el.sparse.sparsify(m, 0.3, key=jr.PRNGKey(1), slack=0.1), model
    )
    batch = (jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.int32))
    return sparse, batch


def programs() -> dict:
    """Small training steps of the kinds whose memory the suite asserts, as
    `(step, state shapes, batch shapes)`; on both, the suite's flags move the temporaries:
    sparse layers with DSR and micro-batches, and a fused, tied causal LM in mixed precision
    (its stack recomputed)."""
    sparse, (x, y) = _sparse_mlp()
    dsr = el.train.make_step(
        el.train.cross_entropy, optax.adam(1e-3), accumulate=4, after_update=el.sparse.dsr()
    )
    lm = el.nn.CausalLM(64, 16, 2, 32, 2, 64, key=jr.PRNGKey(0), remat=True, tie_embeddings=True)
    tokens = jax.ShapeDtypeStruct((8, 17), jnp.int32)
    fused = el.train.make_step(
        el.train.next_token_loss, optax.adam(1e-3), accumulate=4, precision="mixed_bf16"
    )
    out = {}
    for name, step, model, batch in (
        ("sparse_dsr_accumulate", dsr, sparse, (x, y)),
        ("causal_lm_fused_bf16", fused, lm, (tokens,)),
    ):
        state = eqx.filter_eval_shape(step.init, model, key=jr.PRNGKey(2))
        out[name] = (step, model, state, batch)
    return out


def figures(compiled) -> dict:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in FIGURES}


def report_figures() -> dict:
    """The compiled figures of `memory_report` for the sparse MLP with micro-batches."""
    sparse, batch = _sparse_mlp()
    report = el.memory.memory_report(
        sparse, el.train.cross_entropy, optax.adam(1e-3), batch, accumulate=4
    )
    return {k: int(report.compiled[k]) for k in FIGURES}


# Run in a process with XLA's default flags: what a user's process compiles.
USERS_PROCESS = """
import json, sys
from tests.test_compiler_flags import REPORT_OPTIONS, figures, programs, report_figures
out = {}
for name in sys.argv[1:]:
    step, model, state, batch = programs()[name]
    lowered = step.lower(state, batch)
    out[name] = {"default": figures(lowered.compile()),
                 "report_options": figures(lowered.compile(compiler_options=REPORT_OPTIONS))}
out["report"] = report_figures()
print(json.dumps(out))
"""


def _users_process(*names: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in SUITE_XLA_FLAGS]
    env["XLA_FLAGS"] = " ".join(flags)
    done = subprocess.run(
        [sys.executable, "-c", USERS_PROCESS, *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def users():
    """The sparse program's and the report's figures in a process with default flags (the
    causal LM's too under `-m slow`)."""
    return _users_process("sparse_dsr_accumulate")


def _check_program(name: str, users: dict) -> None:
    step, _, state, batch = programs()[name]
    suite = figures(compile_as_users(step.lower(state, batch)))
    assert suite == users[name]["default"], (name, suite, users[name]["default"])
    # memory/_compile.py compiles at level 0 to save time and says the figures stay those
    # of the default compile: checked in the process with default flags.
    assert users[name]["report_options"] == users[name]["default"], (name, users[name])


def test_the_suites_memory_figures_are_xlas_defaults_and_level_0_moves_no_buffer(users):
    _check_program("sparse_dsr_accumulate", users)


@pytest.mark.slow  # one more program compiled at XLA's default level, in its own process
def test_the_same_for_a_fused_causal_lm_in_mixed_precision():
    _check_program("causal_lm_fused_bf16", _users_process("causal_lm_fused_bf16"))


def test_memory_report_in_the_suite_gives_the_users_figures(users, users_compiler):
    assert report_figures() == users["report"]


def _unchecked_memory_analyses(source: str) -> list[int]:
    """Lines of `source` that call `.memory_analysis()` on anything but `compile_as_users(...)`
    or a name bound to one in the same function. (Code in strings, run by subprocesses, is
    not Python here: those processes get `users_env`.)"""
    tree = ast.parse(source)

    def as_users(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "compile_as_users"
        )

    bad = []
    for scope in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]]:
        bound = {
            target.id
            for node in ast.walk(scope)
            if isinstance(node, ast.Assign) and as_users(node.value)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(scope):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "memory_analysis"
            ):
                receiver = node.func.value
                ok = as_users(receiver) or (isinstance(receiver, ast.Name) and receiver.id in bound)
                if not ok:
                    bad.append(node.lineno)
    return sorted(set(bad))


def test_no_test_reads_the_memory_of_a_program_the_suites_flags_compiled():
    found = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        lines = _unchecked_memory_analyses(path.read_text())
        if lines:
            found[path.name] = lines
    assert not found, (
        f"memory_analysis() of programs compiled under the suite's flags, which change "
        f"buffer assignment: {found}; compile them with helpers.compile_as_users."
    )
    # The check itself finds such a call.
    assert _unchecked_memory_analyses("m = f.lower(x).compile().memory_analysis()\n") == [1]
