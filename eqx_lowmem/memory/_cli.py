"""The `eqx-lowmem` command: a memory report or a plan, before any training step runs.

    eqx-lowmem report --layers 12 --d-model 512 --heads 8 --d-ff 2048 --seq 256 --batch 32 \\
        --optimizer adam --remat full --accumulate 4 --precision mixed_bf16 \\
        --json report.json --plot report.png
    eqx-lowmem plan --budget 2GiB --optimizer adam --plot plan.png
    eqx-lowmem report --model mypackage.models:make --remat dots

`--model module:function` names a function of one argument, `remat` (one of "none",
"full", "dots", "minimal"), that returns `(model, loss_fn, batch)` or
`(model, loss_fn, batch, optimizer)`: the model built with that recomputation setting, a
loss for `eqx_lowmem.train.make_step` (`loss_fn(model, *batch)` returning per-sample
values), and one batch as a tuple of arrays or `jax.ShapeDtypeStruct`s. It is called inside
`eqx.filter_eval_shape`, so building the model allocates nothing. Without `--model`, the
model is `eqx_lowmem.nn.transformer_encoder` with the shape options, trained with
`eqx_lowmem.train.mse` on float32 inputs and targets of shape (batch, seq, d_model): the
guide's configuration by default.
"""

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from ..nn._encoder import transformer_encoder
from ..precision._policy import PRESETS
from ..train._losses import mse
from ._plan import BudgetError, plan
from ._report import memory_report
from ._units import parse_size

REMAT_CHOICES = ("none", "full", "dots", "minimal")
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-2),
    "momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
}


def _builtin(args: argparse.Namespace) -> Callable[..., Any]:
    """The guide's transformer with the shape options: `factory(remat)`."""
    for name in ("layers", "d_model", "heads", "d_ff", "seq", "batch"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be a positive int, got {getattr(args, name)}.")
    x = jax.ShapeDtypeStruct((args.batch, args.seq, args.d_model), jnp.float32)

    def factory(remat: str) -> tuple:
        model = transformer_encoder(
            args.layers, args.d_model, args.heads, args.d_ff, key=jr.PRNGKey(0), remat=remat
        )
        return model, mse, (x, x)

    return factory


def _user_factory(spec: str) -> Callable[..., Any]:
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(
            f"--model {spec!r}: expected module:function, e.g. mypackage.models:make_model."
        )
    if "" not in sys.path:
        sys.path.insert(0, "")  # as `python -m`: modules in the working directory import
    module = importlib.import_module(module_name)
    try:
        factory = getattr(module, function_name)
    except AttributeError:
        raise ValueError(
            f"--model {spec!r}: module {module_name} has no {function_name}."
        ) from None
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {function_name} is not a function.")
    return factory


def _build(factory: Callable[..., Any], remat: str, spec: str, concrete: bool) -> tuple:
    """(model, loss_fn, batch, optimizer or None), abstract unless `concrete`."""
    out = factory(remat) if concrete else eqx.filter_eval_shape(factory, remat)
    if not isinstance(out, tuple) or len(out) not in (3, 4):
        raise ValueError(
            f"--model {spec}: the function must return (model, loss_fn, batch) or "
            f"(model, loss_fn, batch, optimizer); got {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple) else "")
            + "."
        )
    model, loss_fn, batch = out[:3]
    optimizer = out[3] if len(out) == 4 else None
    return model, loss_fn, tuple(batch), optimizer


def _csv(kind: Callable[[str], Any], choices: Sequence[str] | None = None):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        if choices is not None:
            bad = [t for t in items if t not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not in {list(choices)}")
        return [kind(t) for t in items]

    return parse


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    model = argparse.ArgumentParser(add_help=False)
    g = model.add_argument_group("model (the built-in transformer, or --model)")
    g.add_argument("--layers", type=int, default=12, help="transformer blocks (12)")
    g.add_argument("--d-model", type=int, default=512, help="residual width (512)")
    g.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    g.add_argument("--d-ff", type=int, default=2048, help="feed-forward width (2048)")
    g.add_argument("--seq", type=int, default=256, help="sequence length (256)")
    g.add_argument("--batch", type=int, default=32, help="samples per batch (32)")
    g.add_argument(
        "--optimizer", choices=sorted(OPTIMIZERS), default="adam", help="optimizer (adam)"
    )
    g.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="your model: FUNCTION(remat) returns (model, loss_fn, batch[, optimizer])",
    )
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    out.add_argument("--plot", metavar="PATH", help="also write a PNG plot")

    parser = argparse.ArgumentParser(
        prog="eqx-lowmem",
        description="Where the memory of a training step goes, and which combination of "
        "remat, micro-batches and precision fits a budget. Compiles; runs nothing.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report", parents=[model, out], help="the memory of one training step, by part"
    )
    report.add_argument("--remat", choices=REMAT_CHOICES, default="none", help="(none)")
    report.add_argument("--accumulate", type=int, default=1, help="micro-batches per batch (1)")
    report.add_argument("--precision", choices=sorted(PRESETS), default="float32")
    report.add_argument("--plot-kind", choices=("bar", "pie"), default="bar")
    report.add_argument(
        "--measure", action="store_true", help="also run one step and measure (GPU/TPU)"
    )
    p = sub.add_parser(
        "plan", parents=[model, out], help="the fastest combination that fits --budget"
    )
    p.add_argument("--budget", type=_size, required=True, help="e.g. 2GiB, 512MiB, 1.5GB")
    p.add_argument(
        "--remats",
        type=_csv(str, REMAT_CHOICES),
        default=["none", "minimal", "dots", "full"],
        help="comma-separated (none,minimal,dots,full)",
    )
    p.add_argument(
        "--accumulates", type=_csv(int), default=[1, 2, 4, 8], help="comma-separated (1,2,4,8)"
    )
    p.add_argument(
        "--precisions",
        type=_csv(str, sorted(PRESETS)),
        default=["float32", "mixed_bf16"],
        help="comma-separated (float32,mixed_bf16)",
    )
    p.add_argument(
        "--target",
        choices=("compiled", "accelerator"),
        default="compiled",
        help="fit the peak compiled here, or the GPU/TPU estimate (compiled)",
    )
    p.add_argument("--measure", action="store_true", help="rank by timed steps on this device")
    p.add_argument("--steps", type=int, default=3, help="timed steps with --measure (3)")
    return parser


def _report(args: argparse.Namespace, factory, spec: str) -> None:
    model, loss_fn, batch, optimizer = _build(factory, args.remat, spec, args.measure)
    optimizer = optimizer or OPTIMIZERS[args.optimizer]()
    report = memory_report(
        model,
        loss_fn,
        optimizer,
        batch,
        accumulate=args.accumulate,
        precision=args.precision,
        measure=args.measure,
        name=spec,
    )
    print(report)
    if args.json:
        report.to_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from ._plot import plot_report

        plot_report(report, args.plot, kind=args.plot_kind)
        print(f"wrote {args.plot}")


def _plan(args: argparse.Namespace, factory, spec: str) -> None:
    _, loss_fn, batch, optimizer = _build(factory, args.remats[0], spec, False)
    optimizer = optimizer or OPTIMIZERS[args.optimizer]()

    def make_model(remat):
        return _build(factory, remat, spec, args.measure)[0]

    result = plan(
        make_model,
        loss_fn,
        optimizer,
        batch,
        budget=args.budget,
        remats=args.remats,
        accumulates=args.accumulates,
        precisions=args.precisions,
        target=args.target,
        measure=args.measure,
        steps=args.steps,
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 success, 1 error, 2 bad usage)."""
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        if args.model:
            spec, factory = args.model, _user_factory(args.model)
        else:
            spec = (
                f"transformer {args.layers}x{args.d_model} heads={args.heads} d_ff={args.d_ff} "
                f"seq={args.seq} batch={args.batch} {args.optimizer}"
            )
            factory = _builtin(args)
        if args.command == "report":
            _report(args, factory, spec)
        else:
            _plan(args, factory, spec)
    except BudgetError as e:
        print(f"eqx-lowmem plan: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, ImportError) as e:
        print(f"eqx-lowmem {args.command}: error: {e}", file=sys.stderr)
        return 1
    print(f"({args.command} took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
