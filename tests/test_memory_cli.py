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
    args += ["--plot", "p.png", "--all"]
    done = _run(args, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "<- best" in done.stdout and "predicted peak" in done.stdout
    assert "[4/4] remat=" in done.stderr  # progress, one line per compiled candidate
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
    assert "remat=full, accumulate=2, precision=float32: its state and batch alone" in done.stderr


def test_plan_for_a_gpu_target_needs_no_budget_and_compiles_only_what_decides(tmp_path):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the CUDA plugin: .[gpu-plan]")
    args = ["plan", *SMALL, "--target", "l4", "--remats", "none,full", "--accumulates", "1,2"]
    done = _run([*args, "--precisions", "float32", "--json", "p.json"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "of NVIDIA L4 (compile-only target 'l4')" in done.stdout
    assert "Budget: 16.9 GiB = 0.75 x 22.5 GiB of NVIDIA L4" in done.stdout
    plan = json.loads((tmp_path / "p.json").read_text())
    assert len(plan["candidates"]) == 1 and len(plan["pruned"]) == 3
    assert "not compiled: remat=none, accumulate=2" in done.stdout
    report = _run(["report", *SMALL, "--target", "l4"], tmp_path)
    assert "compile-only target 'l4'" in report.stdout, report.stderr


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


# ------------------------------------------------------------------ in-process: argparse


def _main(args, capsys):
    from eqx_lowmem.memory._cli import main

    try:
        code = main(args)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_abbreviations_and_typos_are_rejected(capsys):
    code, _, err = _main(["plan", "--budget", "1GiB", "--remat", "full"], capsys)
    assert code == 2 and "unrecognized arguments: --remat" in err
    code, _, err = _main(["plan", "--budgte", "1GiB"], capsys)
    assert code == 2 and "unrecognized arguments: --budgte 1GiB (did you mean --budget?)" in err
    code, _, err = _main(["plan"], capsys)
    assert code == 2 and "required: --budget" in err
    code, _, err = _main(["plan", "--budget", "1GiB", "--accumulates", "0"], capsys)
    assert code == 2 and "--accumulates expects an int >= 1, got 0" in err
    code, _, err = _main(["report", "--batch", "0"], capsys)
    assert code == 2 and "--batch expects an int >= 1" in err


def test_version_and_help_with_examples(capsys):
    code, out, _ = _main(["--version"], capsys)
    assert code == 0 and out.startswith("eqx-lowmem ")
    code, out, _ = _main(["report", "--help"], capsys)
    assert code == 0
    out = " ".join(out.split())  # help text wraps
    assert "examples:" in out and "eqx-lowmem report --model lm" in out
    assert "mixed_bf16 / mixed_fp16: float32 parameters, 16-bit" in out  # --precision
    assert "stacked bar of the parts" in out  # --plot-kind
    assert "the whole batch of one update" in out  # --batch
    code, out, _ = _main(["plan", "--help"], capsys)
    assert code == 0 and "--rank-for" in out and "examples:" in out and "--densities" in out


def test_a_broken_user_model_or_loss_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "broken_models_cli.py").write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp, jax.random as jr
            import eqx_lowmem as el

            def factory(remat):
                raise RuntimeError("no such layer: conv9")

            def bad_loss(model, x, y):
                raise KeyError("labels")

            def loss_fails(remat):
                model = el.nn.mlp([4, 8, 1], key=jr.PRNGKey(0))
                x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
                return model, bad_loss, (x, x)

            def loss_is_text(remat):
                model = el.nn.mlp([4, 8, 1], key=jr.PRNGKey(0))
                x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
                return model, "mse", (x, x)

            def optimizer_is_a_rate(remat):
                model = el.nn.mlp([4, 8, 1], key=jr.PRNGKey(0))
                x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
                return model, el.train.mse, (x, x), 1e-3
            """
        )
    )
    code, _, err = _main(["report", "--model", "broken_models_cli:factory"], capsys)
    assert code == 1
    assert err.strip().count("\n") == 1  # the model line, then the one error line
    last = err.strip().splitlines()[-1]
    assert "error in --model broken_models_cli:factory" in last
    assert "RuntimeError: no such layer: conv9" in last and "Traceback" not in err
    code, _, err = _main(["report", "--model", "broken_models_cli:loss_fails"], capsys)
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert "error in --model broken_models_cli:loss_fails" in last and "KeyError" in last
    assert "Traceback" not in err
    # What the factory returns in the wrong place: the item, what was expected, what came.
    code, _, err = _main(["report", "--model", "broken_models_cli:loss_is_text"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "the loss it returns (the second item) must be a function" in last
    assert "got str 'mse'" in last and "not callable" not in err
    code, _, err = _main(["report", "--model", "broken_models_cli:optimizer_is_a_rate"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "the optimizer it returns (the fourth item)" in last
    assert "optax GradientTransformation" in last and "got float 0.001" in last


def test_an_unwritable_plot_fails_before_the_report_is_computed(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, out, err = _main(["report", "--plot", str(blocker / "sub" / "r.png")], capsys)
    assert code == 1 and "--plot" in err and "cannot create" in err
    assert "model:" not in err and out == ""  # nothing was built or compiled
    code, _, err = _main(["report", "--json", str(tmp_path)], capsys)
    assert code == 1 and "--json" in err and "is a directory" in err


def test_the_readme_language_model_from_the_command_line(tmp_path, capsys):
    args = ["report", "--model", "lm", "--vocab", "16", "--layers", "1", "--d-model", "16"]
    args += ["--heads", "2", "--d-ff", "32", "--seq", "8", "--batch", "4", "--accumulate", "2"]
    code, out, err = _main([*args, "--json", str(tmp_path / "lm.json")], capsys)
    assert code == 0, err
    assert "model: lm: CausalLM vocab 16" in err and "next_token_loss" in err
    report = json.loads((tmp_path / "lm.json").read_text())
    assert report["config"]["batch"] == [[[4, 9], "int32"]]  # (batch, seq + 1) token ids
    assert report["config"]["accumulate"] == 2


def test_devices_and_fsdp_report_per_device(tmp_path):
    args = ["report", *SMALL, "--devices", "4", "--shard", "fsdp", "--accumulate", "2"]
    done = _run([*args, "--json", "r.json"], tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["devices"] == 4 and report["config"]["shard"] == "fsdp"
    # Every array of the encoder has a dimension 4 divides: a quarter of 4 bytes each.
    assert report["parts"]["parameters"] == report["config"]["parameters"]
    assert "(figures per device)" in done.stdout
    done = _run(["report", *SMALL, "--shard", "fsdp"], tmp_path)
    assert done.returncode == 1 and "add --devices N" in done.stderr
