"""The README's short example, run as a user runs it: its code as written, in a fresh
directory, in real processes (a file of its own so that it and the other examples run on
different workers). Its processes share a compilation cache: the rerun loads its programs."""

from pathlib import Path

import pytest

from .helpers import optimised_env
from .test_examples import _run

README = Path(__file__).parent.parent / "README.md"


def _readme_block(marker):
    """The code block right after `<!-- marker -->` in the README."""
    text = README.read_text()
    after = text[text.index(f"<!-- {marker} -->") :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```", start)]


@pytest.mark.slow  # the whole example, twice
def test_the_readmes_short_example_runs_at_its_size_and_resumes(tmp_path, env):
    # Run as a user would: the README's code, as written, in a fresh directory. Its 32
    # updates run longer than they compile: optimised machine code.
    env = optimised_env(env)
    (tmp_path / "example.py").write_text(_readme_block("short-example"))
    first = _run("example.py", cwd=tmp_path, env=env, timeout=600)
    losses = first.stdout.strip().splitlines()[-1]
    assert losses.startswith("train loss per epoch: [") and losses.count(",") == 1
    assert (tmp_path / "runs" / "lm" / "checkpoint.ckpt").exists()
    tokens = tmp_path / "tokens.npy"
    written = tokens.stat().st_mtime_ns
    # Again: the data file is kept (not rewritten) and the finished run is resumed, not redone.
    again = _run("example.py", cwd=tmp_path, env=env, timeout=600)
    assert again.stdout.strip().splitlines()[-1] == losses
    assert tokens.stat().st_mtime_ns == written
    # The README's one-call load of the trained model, for inference.
    imports = "import jax, jax.numpy as jnp, jax.random as jr\nimport eqx_lowmem as el\n"
    load = imports + _readme_block("load-example") + "print(logits.shape)\n"
    (tmp_path / "load.py").write_text(load)
    out = _run("load.py", cwd=tmp_path, env=env)
    assert out.stdout.strip().splitlines()[-1] == "(128, 128)"


@pytest.mark.slow  # the whole example, in a process of its own
def test_the_readmes_sparse_example_runs_and_keeps_its_density(tmp_path, env):
    # The README's sparse-training code, as written: three DSR steps at 30% density, then
    # densified back to plain Linear layers.
    (tmp_path / "sparse.py").write_text(_readme_block("sparse-example"))
    out = _run("sparse.py", cwd=tmp_path, env=env).stdout.strip().splitlines()
    density, loss = out[-2].split(", ")
    assert density == "density 0.300"
    assert 0.0 < float(loss.removeprefix("loss ")) < 10.0
    assert out[-1] == "Linear (300, 784)"
