"""The `eqx-lowmem` command line, run as a real process on small shapes."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SMALL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--d-ff", "64", "--seq", "16"]
SMALL += ["--batch", "8"]
PNG = b"\x89PNG\r\n\x1a\n"


def _run(args, cwd, script=None):
    command = [script] if script else [sys.executable, "-m", "eqx_lowmem.memory._cli"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        command + list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_report_command_prints_the_table_and_writes_json_and_png(tmp_path):
    # The console script that pyproject.toml declares.
    script = shutil.which("eqx-lowmem", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the package is not installed with its console script")
    args = ["report", *SMALL, "--optimizer", "adam", "--remat", "full", "--accumulate", "2"]
    args += ["--precision", "mixed_bf16", "--json", "out/r.json", "--plot", "out/r.png"]
    done = _run(args, tmp_path, script)
    assert done.returncode == 0, done.stderr
    for text in ("predicted peak", "optimizer state", "saved activations", "trusted"):
        assert text in done.stdout
    report = json.loads((tmp_path / "out" / "r.json").read_text())
    assert sum(report["parts"].values()) == report["peak_bytes"]
    assert report["config"]["accumulate"] == 2
    assert report["config"]["precision"] == "mixed_bf16"
    assert report["config"]["remat"] == "full"
    assert report["parts"]["optimizer"] == 2 * report["parts"]["parameters"] + 4  # Adam
    assert (tmp_path / "out" / "r.png").read_bytes()[:8] == PNG
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["r.json", "r.png"]


def test_plan_command_picks_a_fitting_combination(tmp_path):
    args = ["plan", *SMALL, "--budget", "1GiB", "--remats", "none,full", "--accumulates", "1,2"]
    args += ["--precisions", "float32", "--optimizer", "sgd", "--json", "p.json"]
    args += ["--plot", "p.png"]
    done = _run(args, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "<- best" in done.stdout and "predicted peak" in done.stdout
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["budget"] == 2**30 and len(plan["candidates"]) == 4
    best = plan["candidates"][plan["best"]]
    assert best["fits"] and best["peak_bytes"] <= 2**30
    assert (best["remat"], best["accumulate"]) == ("none", 1)
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG


def test_plan_command_explains_an_impossible_budget(tmp_path):
    args = ["plan", *SMALL, "--budget", "1KiB", "--remats", "full", "--accumulates", "2"]
    done = _run([*args, "--precisions", "float32"], tmp_path)
    assert done.returncode == 1
    assert "no combination fits budget=1.00 KiB" in done.stderr
    assert "the smallest compiled peak found is" in done.stderr
    assert "its largest part is" in done.stderr


def test_report_on_a_users_model_factory(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp, jax.random as jr
            import eqx_lowmem as el

            def make(remat):
                model = el.nn.transformer_encoder(2, 16, 2, 32, key=jr.PRNGKey(0), remat=remat)
                x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
                return model, el.train.mse, (x, x)
            """
        )
    )
    done = _run(["report", "--model", "mymodels:make", "--remat", "dots"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "remat=dots" in done.stdout and "mymodels:make" in done.stdout
    for name in ("qkv", "ffn_hidden", "attn_out"):  # what "dots" keeps, by name
        assert name in done.stdout


def test_bad_arguments_say_what_was_expected(tmp_path):
    done = _run(["plan", "--budget", "lots"], tmp_path)
    assert done.returncode == 2 and "not a byte size" in done.stderr
    done = _run(["report", "--model", "no_colon"], tmp_path)
    assert done.returncode == 1 and "expected module:function" in done.stderr
