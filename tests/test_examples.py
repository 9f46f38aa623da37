"""The examples run as a user runs them: real processes."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def test_char_lm_trains_and_a_second_run_resumes(tmp_path):
    tiny = [
        "--run-dir", tmp_path, "--max-chars", 12000, "--seq", 32, "--layers", 1,
        "--d-model", 32, "--heads", 2, "--batch", 16, "--accumulate", 2,
        "--checkpoint-every", 5, "--sample-chars", 20, "--no-progress",
    ]  # fmt: skip
    first = _run(EXAMPLES / "train_char_lm.py", *tiny, "--epochs", 1)
    assert "unigram entropy" in first.stdout and "sample:" in first.stdout
    assert (tmp_path / "checkpoint" / "checkpoint.ckpt").exists()
    assert "resuming" not in first.stdout
    second = _run(EXAMPLES / "train_char_lm.py", *tiny, "--epochs", 2)
    assert "resuming from" in second.stdout and "1 epoch(s) done" in second.stdout
    # The second run trained only the second epoch.
    assert "epoch  train loss" in second.stdout
    assert second.stdout.count("\n    2 ") == 1


def test_stream_example_prints_the_guides_output():
    out = _run(EXAMPLES / "stream.py").stdout
    assert out.splitlines()[0] == "[[0, 1, 2, 3], [4, 5]]"


README = Path(__file__).parent.parent / "README.md"


def _readme_block(marker):
    """The code block right after `<!-- marker -->` in the README."""
    text = README.read_text()
    after = text[text.index(f"<!-- {marker} -->") :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```", start)]


def test_the_readmes_short_example_runs_at_its_size_and_resumes(tmp_path):
    # Run as a user would: the README's code, as written, in a fresh directory.
    (tmp_path / "example.py").write_text(_readme_block("short-example"))
    first = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, check=True,
    )  # fmt: skip
    losses = first.stdout.strip().splitlines()[-1]
    assert losses.startswith("train loss per epoch: [") and losses.count(",") == 1
    assert (tmp_path / "runs" / "lm" / "checkpoint.ckpt").exists()
    tokens = tmp_path / "tokens.npy"
    written = tokens.stat().st_mtime_ns
    # Again: the data file is kept (not rewritten) and the finished run is resumed, not redone.
    again = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, check=True,
    )  # fmt: skip
    assert again.stdout.strip().splitlines()[-1] == losses
    assert tokens.stat().st_mtime_ns == written
    # The README's one-call load of the trained model, for inference.
    imports = "import jax, jax.numpy as jnp, jax.random as jr\nimport eqx_lowmem as el\n"
    load = imports + _readme_block("load-example") + "print(logits.shape)\n"
    (tmp_path / "load.py").write_text(load)
    out = subprocess.run(
        [sys.executable, "load.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "(128, 128)"
