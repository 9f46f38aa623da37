"""The examples run as a user runs them: real processes. The processes of this file share
one persistent compilation cache (the `env` fixture), so a rerun (a resume) loads its
programs instead of compiling them again."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


def _run(*args, env, timeout=300, cwd=None):
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        env=env,
        cwd=cwd,
    )


@pytest.mark.slow  # the whole example, twice
def test_char_lm_trains_and_a_second_run_resumes(tmp_path, env):
    tiny = [
        "--run-dir", tmp_path, "--max-chars", 12000, "--seq", 32, "--layers", 1,
        "--d-model", 32, "--heads", 2, "--batch", 16, "--accumulate", 2,
        "--checkpoint-every", 5, "--sample-chars", 20, "--no-progress",
    ]  # fmt: skip
    first = _run(EXAMPLES / "train_char_lm.py", *tiny, "--epochs", 1, env=env)
    assert "unigram entropy" in first.stdout and "sample:" in first.stdout
    assert (tmp_path / "checkpoint" / "checkpoint.ckpt").exists()
    assert "resuming" not in first.stdout
    second = _run(EXAMPLES / "train_char_lm.py", *tiny, "--epochs", 2, env=env)
    assert "resuming from" in second.stdout and "1 epoch(s) done" in second.stdout
    # The second run trained only the second epoch.
    assert "epoch  train loss" in second.stdout
    assert second.stdout.count("\n    2 ") == 1


def test_stream_example_prints_the_guides_output(env):
    out = _run(EXAMPLES / "stream.py", env=env).stdout
    assert out.splitlines()[0] == "[[0, 1, 2, 3], [4, 5]]"
