"""The `eqx-lowmem` command's arguments: the model and output options both subcommands
take, then each subcommand's own (`report`, `plan`), and the parse that names a mistyped
option before a missing one."""

import argparse
import difflib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import optax

from ..nn._remat import PRESETS as REMAT_PRESETS
from ..precision._policy import PRESETS as PRECISION_PRESETS
from ..train._make_step import SHARDS
from ._plan import ACCUMULATES, PEAKS, PRECISIONS
from ._target import known_targets
from ._units import parse_size

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-2),
    "momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
}
_PRECISION_HELP = (
    "float32: everything in float32; mixed_bf16 / mixed_fp16: float32 parameters, 16-bit "
    "compute (fp16 with loss scaling); half_bf16: 16-bit parameters and optimizer state too"
)
_EPILOG = """\
examples:
  eqx-lowmem report --layers 12 --d-model 512 --seq 256 --batch 32 --remat full \\
      --accumulate 4 --precision mixed_bf16 --plot memory.png
  eqx-lowmem report --model lm --vocab 128 --batch 64 --accumulate 4 --remat full
  eqx-lowmem report --model mypackage.models:make --remat dots --json report.json
  eqx-lowmem report --devices 4 --shard fsdp --batch 64
  eqx-lowmem plan --budget 2GiB --optimizer adam --plot plan.png
  eqx-lowmem report --target h100 --precision mixed_bf16 --remat full
  eqx-lowmem plan --target a100-40gb              # budget: what XLA may use of its memory
  eqx-lowmem plan --target h100 --devices 8 --budget 20GiB

--batch is the whole batch of one update (split into --accumulate micro-batches).
Nothing is trained: the step is compiled for shapes alone.
"""


def _version() -> str:
    try:
        from .. import __version__

        return str(__version__)
    except Exception:  # an uninstalled checkout without version metadata
        return "unknown"


def _positive(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects an int >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} expects an int >= 1, got {value}")
        return value

    return parse


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


def _density(text: str) -> float | None:
    if text in ("dense", "none", "1"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"density {text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"density {value} is not in (0, 1]")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_options() -> argparse.ArgumentParser:
    """The options that choose the model, its shapes, the optimizer and the devices."""
    model = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = model.add_argument_group("model (built in, or your own with --model module:function)")
    g.add_argument(
        "--model",
        default="encoder",
        metavar="{encoder,lm,MODULE:FUNCTION}",
        help="encoder: transformer encoder with MSE (the guide's; default); lm: the README's "
        "causal language model with next-token loss; MODULE:FUNCTION: FUNCTION(remat) returns "
        "(model, loss_fn, batch[, optimizer])",
    )
    g.add_argument("--layers", type=_positive("--layers"), default=12, help="blocks (12)")
    g.add_argument("--d-model", type=_positive("--d-model"), default=512, help="width (512)")
    g.add_argument("--heads", type=_positive("--heads"), default=8, help="attention heads (8)")
    g.add_argument("--d-ff", type=_positive("--d-ff"), default=2048, help="feed-forward (2048)")
    g.add_argument("--seq", type=_positive("--seq"), default=256, help="sequence length (256)")
    g.add_argument("--vocab", type=_positive("--vocab"), default=128, help="lm vocabulary (128)")
    g.add_argument(
        "--batch",
        type=_positive("--batch"),
        default=32,
        help="the whole batch of one update, split into --accumulate micro-batches (32)",
    )
    g.add_argument(
        "--optimizer", choices=sorted(OPTIMIZERS), default="adam", help="optimizer (adam)"
    )
    g.add_argument(
        "--devices",
        type=_positive("--devices"),
        default=1,
        help="report per device of a mesh of N devices (on CPU, N host devices; with a GPU "
        "--target, N such GPUs) (1)",
    )
    g.add_argument(
        "--target",
        metavar="NAME|FILE",
        default=None,
        help="the device to compile for: cpu (here, the default), attached (this process's "
        f"device), a GPU ({', '.join(n for n in known_targets() if n not in ('cpu', 'attached'))}"
        ") compiled for on any machine (needs eqx-lowmem[gpu-plan]), or a GpuTargetConfigProto "
        "text file",
    )
    return model


def _output_options() -> argparse.ArgumentParser:
    """Where the result also goes (JSON, a plot), and how errors show."""
    out = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    out.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    out.add_argument("--plot", metavar="PATH", help="also write a PNG plot (needs matplotlib)")
    out.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    return out


def _report_arguments(report: argparse.ArgumentParser) -> None:
    """`report`'s own options: one setting of each technique."""
    report.add_argument(
        "--remat", choices=REMAT_PRESETS, default="none", help="recomputation preset (none)"
    )
    report.add_argument(
        "--accumulate", type=_positive("--accumulate"), default=1, help="micro-batches (1)"
    )
    report.add_argument(
        "--precision",
        choices=sorted(PRECISION_PRESETS),
        default="float32",
        help=f"dtype policy (float32). {_PRECISION_HELP}",
    )
    report.add_argument(
        "--shard",
        choices=SHARDS,
        default="data",
        help="with --devices: replicate (data) or "
        "shard (fsdp) parameters and optimizer state (data)",
    )
    report.add_argument(
        "--plot-kind",
        choices=("bar", "pie"),
        default="bar",
        help="--plot as a stacked bar of the parts (bar, the default) or a pie",
    )
    report.add_argument(
        "--measure", action="store_true", help="also run one step and measure (GPU/TPU)"
    )


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    """`plan`'s own options: the budget, the candidates tried and how they are ranked."""
    # Required, checked after unknown options (a typo such as --budgte is named as such).
    p.add_argument(
        "--budget",
        type=_size,
        help="e.g. 2GiB, 512MiB, 1.5GB (with a GPU --target: what XLA may use of its memory)",
    )
    p.add_argument(
        "--remats",
        type=_csv(str, REMAT_PRESETS),
        default=None,
        help=f"comma-separated, of {','.join(REMAT_PRESETS)} (all; on CPU without the "
        "offloaded one, which compiles as minimal there)",
    )
    p.add_argument(
        "--accumulates",
        type=_csv(_positive("--accumulates")),
        default=list(ACCUMULATES),
        help=f"comma-separated ints >= 1 ({','.join(map(str, ACCUMULATES))})",
    )
    p.add_argument(
        "--precisions",
        type=_csv(str, sorted(PRECISION_PRESETS)),
        default=list(PRECISIONS),
        help=f"comma-separated ({','.join(PRECISIONS)}). {_PRECISION_HELP}",
    )
    p.add_argument(
        "--shards",
        type=_csv(str, SHARDS),
        default=None,
        help="comma-separated, with --devices (data,fsdp)",
    )
    p.add_argument(
        "--densities",
        type=_csv(_density),
        default=[None],
        help="comma-separated sparse densities in (0, 1], 'dense' for none (dense)",
    )
    p.add_argument(
        "--peak",
        choices=PEAKS,
        default="compiled",
        help="fit the compiled peak, or the GPU/TPU estimate from an XLA:CPU compile (compiled)",
    )
    p.add_argument(
        "--rank-for",
        choices=("cpu", "gpu", "tpu"),
        default=None,
        help="the device kind whose speeds rank the candidates (the target's, or gpu "
        "with --peak accelerator)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="compile every candidate (a table of them all), not only those that can decide "
        "the answer",
    )
    p.add_argument("--measure", action="store_true", help="rank by timed steps on this device")
    p.add_argument("--steps", type=_positive("--steps"), default=3, help="timed steps (3)")


def make_parser() -> argparse.ArgumentParser:
    """The `eqx-lowmem` parser, its subcommands' parsers in `parser.subcommands`."""
    model, out = _model_options(), _output_options()
    common: dict[str, Any] = dict(
        allow_abbrev=False, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser = argparse.ArgumentParser(
        prog="eqx-lowmem",
        description="Where the memory of a training step goes, and which combination of "
        "remat, micro-batches, precision and sharding fits a budget. Compiles; runs nothing.",
        **common,
    )
    parser.add_argument("--version", action="version", version=f"eqx-lowmem {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report",
        parents=[model, out],
        help="the memory of one training step, by part",
        description="The memory of one training step, by part, from compilation alone.",
        **common,
    )
    _report_arguments(report)
    p = sub.add_parser(
        "plan",
        parents=[model, out],
        help="the fastest combination that fits --budget",
        description="The fastest combination of remat, micro-batches, precision (and "
        "sharding) whose compiled peak fits --budget.",
        **common,
    )
    _plan_arguments(p)
    parser.subcommands = {"report": report, "plan": p}  # type: ignore[attr-defined]
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, naming unknown options (with the closest known one) before missing ones."""
    args, extra = parser.parse_known_args(argv)
    sub = parser.subcommands[args.command]  # type: ignore[attr-defined]
    if extra:
        known = sorted(set(re.findall(r"--[a-z][a-z-]*", sub.format_help())))
        close = difflib.get_close_matches(extra[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close and extra[0].startswith("-") else ""
        sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if args.target in PEAKS:  # --target's meaning before targets were devices
        if args.command != "plan":
            sub.error(f"--target {args.target}: a device name, such as h100 or cpu")
        print(
            f"eqx-lowmem: --target {args.target} is now --peak {args.target}; --target names "
            "the device planned for (e.g. h100).",
            file=sys.stderr,
        )
        args.peak, args.target = args.target, None
    if args.command == "plan" and args.budget is None and args.target in (None, "cpu"):
        sub.error(
            "the following arguments are required: --budget (or a GPU --target, whose memory "
            "sets it)"
        )
    return args
