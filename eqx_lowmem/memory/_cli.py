"""The `eqx-lowmem` command: a memory report or a plan, before any training step runs.

`--model` chooses the model:

- `encoder` (the default): `eqx_lowmem.nn.transformer_encoder` with the shape options,
  trained with `eqx_lowmem.train.mse` on float32 inputs and targets of shape
  (batch, seq, d_model): the guide's configuration by default.
- `lm`: the README's language model, `eqx_lowmem.nn.CausalLM(vocab, seq, layers, d_model,
  heads, d_ff)`, trained with `eqx_lowmem.train.next_token_loss` on int32 token ids of
  shape (batch, seq + 1).
- `module:function`: your own. `function(remat)` (remat is one of `"none"`, `"full"`,
  `"dots"`, `"minimal"`, `"minimal_offloaded"`)
  returns `(model, loss_fn, batch)` or `(model, loss_fn, batch, optimizer)`: the model
  built with that recomputation setting, a loss for `eqx_lowmem.train.make_step`
  (`loss_fn(model, *batch)` returning per-sample values), and one whole batch as a tuple of
  arrays or `jax.ShapeDtypeStruct`s. It is called inside `eqx.filter_eval_shape`, so
  building the model allocates nothing.

`--batch` is the whole batch of one update, split into `--accumulate` micro-batches (and
over `--devices`).
"""

import argparse
import dataclasses
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ._candidates import BudgetError
from ._cli_args import OPTIMIZERS, make_parser, parse
from ._plan import default_remats, plan
from ._report import memory_report
from ._target import Target

BUILTIN_MODELS = ("encoder", "lm")


class UserCodeError(Exception):
    """An exception raised by the user's `--model` factory or its loss."""


def _builtin(args: argparse.Namespace) -> Callable[..., Any]:
    """The built-in model with the shape options: `factory(remat)`."""
    from ..nn import CausalLM, transformer_encoder
    from ..train._losses import mse, next_token_loss

    if args.model == "lm":
        tokens = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)

        def lm(remat: str) -> tuple:
            m = CausalLM(
                args.vocab,
                args.seq,
                args.layers,
                args.d_model,
                args.heads,
                args.d_ff,
                key=jr.PRNGKey(0),
                remat=remat,
            )
            return m, next_token_loss, (tokens,)

        return lm
    x = jax.ShapeDtypeStruct((args.batch, args.seq, args.d_model), jnp.float32)

    def encoder(remat: str) -> tuple:
        m = transformer_encoder(
            args.layers, args.d_model, args.heads, args.d_ff, key=jr.PRNGKey(0), remat=remat
        )
        return m, mse, (x, x)

    return encoder


def _describe(args: argparse.Namespace) -> str:
    shape = (
        f"{args.layers} layers, d_model {args.d_model}, {args.heads} heads, d_ff {args.d_ff}, "
        f"seq {args.seq}, batch {args.batch}, {args.optimizer}"
    )
    if args.model == "lm":
        return f"lm: CausalLM vocab {args.vocab}, {shape}, next_token_loss"
    return f"encoder: transformer_encoder {shape}, mse"


def _user_factory(spec: str) -> Callable[..., Any]:
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(
            f"--model {spec!r}: expected module:function (or encoder, lm), e.g. "
            "mypackage.models:make_model."
        )
    if "" not in sys.path:
        sys.path.insert(0, "")  # as `python -m`: modules in the working directory import
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {module_name}: {e}") from None
    except Exception as e:
        raise UserCodeError(f"importing {module_name} raised {_one_line(e)}") from e
    try:
        factory = getattr(module, function_name)
    except AttributeError:
        raise ValueError(
            f"--model {spec!r}: module {module_name} has no {function_name}."
        ) from None
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {function_name} is not a function.")
    return factory


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _build(factory: Callable[..., Any], remat: str, spec: str, concrete: bool, user: bool):
    """(model, loss_fn, batch, optimizer or None), abstract unless `concrete`."""
    try:
        out = factory(remat) if concrete else eqx.filter_eval_shape(factory, remat)
    except Exception as e:
        if not user:
            raise
        raise UserCodeError(f"{spec}({remat!r}) raised {_one_line(e)}") from e
    if not isinstance(out, tuple) or len(out) not in (3, 4):
        raise ValueError(
            f"--model {spec}: the function must return (model, loss_fn, batch) or "
            f"(model, loss_fn, batch, optimizer); got {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple) else "")
            + "."
        )
    model, loss_fn, batch = out[:3]
    optimizer = out[3] if len(out) == 4 else None
    if not callable(loss_fn):
        raise ValueError(
            f"--model {spec}: the loss it returns (the second item) must be a function "
            f"loss_fn(model, *batch), such as eqx_lowmem.train.mse; got "
            f"{type(loss_fn).__name__} {_short(loss_fn)}."
        )
    if optimizer is not None and not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ValueError(
            f"--model {spec}: the optimizer it returns (the fourth item) must be an optax "
            f"GradientTransformation, such as optax.adam(1e-3); got "
            f"{type(optimizer).__name__} {_short(optimizer)}."
        )
    if not isinstance(batch, (tuple, list)):
        raise ValueError(
            f"--model {spec}: the batch it returns must be a tuple of arrays or "
            f"jax.ShapeDtypeStructs, such as (x, y); got {type(batch).__name__}."
        )
    return model, loss_fn, tuple(batch), optimizer


def _check_output(flag: str, path: str | None) -> None:
    """Fail now, before compiling anything, when `path` cannot be written."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name.")
    if target.exists() and not target.is_file() and os.access(target, os.W_OK):
        return  # /dev/stdout, a pipe: written into as it is
    directory = target.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create {directory}: {e.strerror}.") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {directory} is not writable.")
    if flag == "--plot":
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError(
                "--plot needs matplotlib: pip install matplotlib (from a checkout: "
                "pip install -e '.[plot]')."
            )


def _mesh(devices: int) -> Any:
    if devices == 1:
        return None
    have = jax.device_count()
    if have < devices:
        raise ValueError(
            f"--devices {devices}: only {have} {jax.default_backend()} device(s) here. On CPU "
            "the command makes N host devices itself unless the backend started already."
        )
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))


_PACKAGE = str(Path(__file__).resolve().parents[1])


def _from_user_code(e: BaseException, files: str) -> bool:
    """Whether a frame of `e`'s traceback is in the user's files (outside this package)."""
    tb = e.__traceback__
    while tb is not None:
        name = str(Path(tb.tb_frame.f_code.co_filename).resolve())
        if name.startswith(files) and not name.startswith(_PACKAGE):
            return True
        tb = tb.tb_next
    return False


def _guarded(user: bool, factory: Any, fn: Callable[[], Any]) -> Any:
    """Run `fn`; with a user's model, an exception from the model or its loss (traced inside
    the report) becomes a `UserCodeError` naming it; this package's own clear errors
    (ValueError, TypeError) pass as they are."""
    if not user:
        return fn()
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    files = str(Path(getattr(module, "__file__", None) or ".").resolve().parent)
    try:
        return fn()
    except (BudgetError, UserCodeError):
        raise
    except Exception as e:
        if _from_user_code(e, files) or not isinstance(e, (ValueError, TypeError)):
            raise UserCodeError(f"its model or loss raised {_one_line(e)}") from e
        raise


def _report(args, factory, spec: str, user: bool, mesh) -> None:
    model, loss_fn, batch, optimizer = _build(factory, args.remat, spec, args.measure, user)
    optimizer = optimizer or OPTIMIZERS[args.optimizer]()
    report = _guarded(
        user,
        factory,
        lambda: memory_report(
            model,
            loss_fn,
            optimizer,
            batch,
            accumulate=args.accumulate,
            precision=args.precision,
            mesh=mesh,
            shard=args.shard,
            target=_target(args),
            measure=args.measure,
            name=spec,
        ),
    )
    print(report)
    if args.json:
        report.to_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from ._plot import plot_report

        plot_report(report, args.plot, kind=args.plot_kind)
        print(f"wrote {args.plot}")


def _plan(args, factory, spec: str, user: bool, mesh) -> None:
    remats = args.remats or list(default_remats())
    _, loss_fn, batch, optimizer = _build(factory, remats[0], spec, False, user)
    optimizer = optimizer or OPTIMIZERS[args.optimizer]()

    def make_model(remat):
        return _build(factory, remat, spec, args.measure, user)[0]

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    print("compiling each candidate (nothing runs):", file=sys.stderr, flush=True)
    result = _guarded(
        user,
        factory,
        lambda: plan(
            make_model,
            loss_fn,
            optimizer,
            batch,
            budget=args.budget,
            remats=remats,
            accumulates=args.accumulates,
            precisions=args.precisions,
            densities=args.densities,
            mesh=mesh,
            shards=args.shards,
            target=_target(args),
            peak=args.peak,
            rank_for=args.rank_for,
            measure=args.measure,
            steps=args.steps,
            progress=progress,
            prune=not args.all,
        ),
    )
    print(result)
    print()
    print(result.best.report)
    if args.json:
        result.to_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from ._plot import plot_plan

        plot_plan(result, args.plot)
        print(f"wrote {args.plot}")


def _target(args) -> Target:
    """`--target` and `--devices` as a `Target` (a GPU target has the devices itself)."""
    target = Target(args.target or "cpu")
    return dataclasses.replace(target, devices=args.devices) if target.compile_only else target


def _host_devices(devices: int) -> None:
    """On CPU, ask XLA for `devices` host devices (before the backend starts)."""
    if devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 success, 1 error, 2 bad usage)."""
    args = parse(make_parser(), argv)
    start = time.perf_counter()
    user = args.model not in BUILTIN_MODELS
    spec = args.model if user else _describe(args)
    try:
        _check_output("--json", args.json)
        _check_output("--plot", args.plot)
        if args.command == "report" and args.shard != "data" and args.devices == 1:
            raise ValueError(f"--shard {args.shard} shards over devices: add --devices N.")
        compile_only = _target(args).compile_only  # an unknown name fails here, first
        _host_devices(1 if compile_only else args.devices)
        mesh = None if compile_only else _mesh(args.devices)
        factory = _user_factory(args.model) if user else _builtin(args)
        print(f"model: {spec}", file=sys.stderr, flush=True)
        if args.command == "report":
            _report(args, factory, spec, user, mesh)
        else:
            _plan(args, factory, spec, user, mesh)
    except BudgetError as e:
        print(f"eqx-lowmem plan: {e}", file=sys.stderr)
        return 1
    except UserCodeError as e:
        if args.traceback:
            raise
        print(
            f"eqx-lowmem {args.command}: error in --model {args.model}: {e} "
            "(--traceback shows where)",
            file=sys.stderr,
        )
        return 1
    except (ValueError, TypeError, ImportError, OSError) as e:
        if args.traceback:
            raise
        print(f"eqx-lowmem {args.command}: error: {e}", file=sys.stderr)
        return 1
    print(f"({args.command} took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
