"""Plots of memory reports and plans (they need matplotlib: `pip install matplotlib`).

Figures are built with `matplotlib.figure.Figure` and the Agg canvas, never `pyplot`, so
they need no display and leave global state alone; written PNGs appear atomically.
"""

import os
import textwrap
from collections.abc import Sequence
from typing import Any

from .._io import atomic_write
from ._candidates import Plan
from ._result import PART_LABELS, PARTS, MemoryReport
from ._units import remat_text

# One colour per part, in PARTS order: the paper's Figure 1 groups (model, optimizer,
# activations) in related hues, the batch and the remainder in greys.
_COLOURS = {
    "parameters": "#1f4e79",
    "gradients": "#4a86c5",
    "accumulator": "#9dc3e6",
    "optimizer": "#c55a11",
    "activations": "#70ad47",
    "batch": "#7f7f7f",
    "other": "#d0cece",
}
_REMAT_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
_MARKERS = ["o", "s", "^", "D", "v", "P"]


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plots need matplotlib: pip install matplotlib (from a checkout: pip install -e "
            "'.[plot]')."
        ) from e
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _unit(max_bytes: int | float) -> tuple[str, float]:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= scale:
            return unit, float(scale)
    return "B", 1.0


def _save(fig: Any, path: str | os.PathLike[str] | None, dpi: int) -> None:
    if path is not None:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def plot_report(
    reports: MemoryReport | Sequence[MemoryReport],
    path: str | os.PathLike[str] | None = None,
    *,
    kind: str = "bar",
    labels: Sequence[str] | None = None,
    budget: int | None = None,
    title: str | None = None,
    dpi: int = 150,
) -> Any:
    """The breakdown of one or more reports: stacked bars (the paper's Figure 1) or pies.

    Each bar stacks the parts of `MemoryReport.parts` to the predicted peak; a black tick
    marks the measured peak where one was measured, a dashed outline the GPU/TPU estimate
    where it differs. A negative remainder ("other", when XLA keeps less than the traced
    activations) is drawn as zero, and the bar's total label still gives the peak.

    Args:
        reports: one report or several (side by side, e.g. remat off and on).
        path: where to write a PNG (atomically); None to only return the figure.
        kind: `"bar"` (stacked) or `"pie"` (one pie per report).
        labels: a label per report (default: its remat, accumulate and precision).
        budget: draw a horizontal line at this many bytes (bars only).
        title: the figure title.
        dpi: resolution of the PNG.

    Returns:
        The `matplotlib.figure.Figure`.

    Raises:
        ValueError: for no reports, a wrong number of labels, or an unknown `kind`.
    """
    if isinstance(reports, MemoryReport):
        reports = [reports]
    reports = list(reports)
    if not reports:
        raise ValueError("plot_report needs at least one MemoryReport.")
    if labels is None:
        labels = [_default_label(r) for r in reports]
    if len(labels) != len(reports):
        raise ValueError(f"got {len(labels)} labels for {len(reports)} reports; give one each.")
    if kind == "bar":
        fig = _bars(reports, list(labels), budget)
    elif kind == "pie":
        fig = _pies(reports, list(labels))
    else:
        raise ValueError(f"kind={kind!r}; expected 'bar' or 'pie'.")
    if title is None:
        title = "Memory of one training step"
        name = reports[0].config.get("name")
        if len(reports) == 1 and name:
            title += "\n" + textwrap.fill(str(name), 70)
    fig.suptitle(title, fontsize=11)
    _save(fig, path, dpi)
    return fig


def _default_label(r: MemoryReport) -> str:
    c = r.config
    return f"remat={c['remat']}\naccumulate={c['accumulate']}\n{c['precision']}"


def _bars(reports: list[MemoryReport], labels: list[str], budget: int | None) -> Any:
    fig = _figure(max(6.5, 1.8 * len(reports) + 4.0), 5.2)
    ax = fig.add_subplot()
    top = max([max(r.peak_bytes, r.measured_peak_bytes or 0) for r in reports] + [budget or 0])
    unit, scale = _unit(top)
    xs = range(len(reports))
    bottoms = _stacked_parts(ax, reports, scale, top)
    _peak_lines(ax, reports, bottoms, unit, scale)
    if budget is not None:
        ax.axhline(budget / scale, color="#c00000", linestyle=":", linewidth=1.5, label="budget")
    ax.set_xticks(list(xs), labels, fontsize=9)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_ylim(0, top / scale * 1.12)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    _parts_legend(ax)
    backends = sorted({r.backend for r in reports})
    ax.set_title(
        f"predicted peak (compiled for {', '.join(backends)}), by part, in {unit}", fontsize=10
    )
    return fig


def _stacked_parts(ax: Any, reports: list[MemoryReport], scale: float, top: int | float) -> list:
    """One stacked bar per report, a segment per part, each tall one labelled with its
    size; returns the bars' tops."""
    xs = range(len(reports))
    bottoms = [0.0] * len(reports)
    for part in PARTS:
        heights = [r.parts[part] / scale for r in reports]
        if not any(heights):
            continue
        ax.bar(
            xs,
            heights,
            0.55 if len(reports) > 1 else 0.45,
            bottom=bottoms,
            color=_COLOURS[part],
            edgecolor="white",
            linewidth=0.5,
            label=PART_LABELS[part],
        )
        for x, b, h in zip(xs, bottoms, heights, strict=True):
            if h >= 0.045 * top / scale:  # label segments tall enough to hold the text
                ax.text(
                    x,
                    b + h / 2,
                    f"{h:.3g}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if part in ("accumulator", "other") else "white",
                )
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    return bottoms


def _peak_lines(ax: Any, reports: list[MemoryReport], bottoms: list, unit: str, scale: float):
    """Each bar's peak written above it, and lines at the measured peak and the GPU/TPU
    estimate where they differ."""
    xs = range(len(reports))
    for x, r, b in zip(xs, reports, bottoms, strict=True):
        text = f"{r.peak_bytes / scale:.3g} {unit}"
        if r.overlap_bytes:  # parts that XLA overlaps: the bar overshoots the peak
            text += f"\n(parts overlap by {r.overlap_bytes / scale:.3g})"
        ax.annotate(
            text,
            (x, b),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
        )
        if r.measured_peak_bytes is not None:
            ax.plot(
                [x - 0.36, x + 0.36],
                [r.measured_peak_bytes / scale] * 2,
                color="black",
                linewidth=2.5,
                label="measured peak" if x == 0 else None,
            )
        if r.accelerator_peak_bytes != r.peak_bytes:
            ax.plot(
                [x - 0.33, x + 0.33],
                [r.accelerator_peak_bytes / scale] * 2,
                color="black",
                linestyle="--",
                linewidth=1.2,
                label="GPU/TPU estimate" if x == 0 else None,
            )


def _parts_legend(ax: Any) -> None:
    """The legend beside the axes: parts listed top-down as they are stacked, then the
    lines."""
    handles, names = ax.get_legend_handles_labels()
    parts = [(h, n) for h, n in zip(handles, names, strict=True) if n in PART_LABELS.values()]
    lines = [(h, n) for h, n in zip(handles, names, strict=True) if n not in PART_LABELS.values()]
    ordered = parts[::-1] + lines
    ax.legend(
        [h for h, _ in ordered],
        [n for _, n in ordered],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=9,
        frameon=False,
    )


def _pies(reports: list[MemoryReport], labels: list[str]) -> Any:
    fig = _figure(4.2 * len(reports) + 2.2, 4.6)
    axes = fig.subplots(1, len(reports), squeeze=False)[0]
    for ax, r, label in zip(axes, reports, labels, strict=True):
        parts = [p for p in PARTS if r.parts[p] > 0]
        unit, scale = _unit(r.peak_bytes)
        _, _, texts = ax.pie(
            [r.parts[p] for p in parts],
            colors=[_COLOURS[p] for p in parts],
            autopct=lambda pct: f"{pct:.0f}%" if pct >= 4 else "",
            pctdistance=0.75,
            startangle=90,
            counterclock=False,
            wedgeprops={"edgecolor": "white", "linewidth": 0.8},
            textprops={"fontsize": 9, "color": "white", "fontweight": "bold"},
        )
        for text, part in zip(texts, parts, strict=True):
            if part in ("accumulator", "other"):  # light wedges: dark text
                text.set_color("black")
        ax.set_title(f"{label}\npeak {r.peak_bytes / scale:.3g} {unit}", fontsize=10)
    handles = [
        _patch(_COLOURS[p], PART_LABELS[p]) for p in PARTS if any(r.parts[p] > 0 for r in reports)
    ]
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=False)
    return fig


def _patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, label=label)


def plot_plan(
    plan: Plan,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
    dpi: int = 150,
) -> Any:
    """Memory against step cost for every candidate of a plan.

    One point per candidate: its peak (the plan's `target`) against its estimated step time
    relative to the chosen one (`Plan.estimated`), or its measured seconds per step for a
    measured plan. Colour: remat; marker: precision; the
    number beside a point: micro-batches. Candidates over the budget are faded, the budget
    is a dotted line, and the chosen one is circled.

    Args:
        plan: from `eqx_lowmem.memory.plan`.
        path: where to write a PNG (atomically); None to only return the figure.
        title: the figure title.
        dpi: resolution of the PNG.

    Returns:
        The `matplotlib.figure.Figure`.
    """
    fig = _figure(8.0, 5.2)
    ax = fig.add_subplot()
    measured = plan.ranked_by == "measured"
    points = [c for c in plan.candidates if not measured or c.seconds is not None]
    top = max([c.peak_bytes for c in plan.candidates] + [plan.budget])
    unit, scale = _unit(top)
    remats = list(dict.fromkeys(remat_text(c.remat) for c in plan.candidates))
    precisions = list(dict.fromkeys(c.precision for c in plan.candidates))

    def cost(c) -> float:
        return float(c.seconds) if measured else plan.estimated(c)

    _candidate_points(ax, points, remats, precisions, cost, scale)
    _chosen_and_budget(ax, plan, cost(plan.best), unit, scale)
    handles = [
        _marker(_REMAT_COLOURS[i % len(_REMAT_COLOURS)], "o", f"remat={r}")
        for i, r in enumerate(remats)
    ] + [_marker("#555555", _MARKERS[i % len(_MARKERS)], p) for i, p in enumerate(precisions)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.set_xlabel(
        "measured seconds per step"
        if measured
        else f"estimated step time relative to the chosen one ({plan.ranking().split(' (')[0]})"
    )
    ax.set_ylabel(f"{plan.peak} peak ({unit})")
    ax.set_ylim(0, top / scale * 1.18)  # room for the "chosen" label
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    fig.suptitle(
        title or "Memory against step cost for each candidate (xN: micro-batches)", fontsize=11
    )
    _save(fig, path, dpi)
    return fig


def _candidate_points(ax, points: list, remats: list, precisions: list, cost, scale) -> None:
    """One point per candidate: colour by remat, marker by precision, its micro-batches
    beside it; those over the budget faded."""
    for c in points:
        colour = _REMAT_COLOURS[remats.index(remat_text(c.remat)) % len(_REMAT_COLOURS)]
        marker = _MARKERS[precisions.index(c.precision) % len(_MARKERS)]
        x, y = cost(c), c.peak_bytes / scale
        ax.scatter(
            [x],
            [y],
            s=60,
            color=colour,
            marker=marker,
            alpha=1.0 if c.fits else 0.3,
            edgecolors="black" if c.fits else "none",
            linewidths=0.5,
            zorder=3,
        )
        # Micro-batch counts beside the points: right of the first precision's marker,
        # left of the second's, so overlapping precisions stay legible.
        left = precisions.index(c.precision) % 2 == 1
        ax.annotate(
            f"x{c.accumulate}",
            (x, y),
            xytext=(-6 if left else 6, 0),
            textcoords="offset points",
            ha="right" if left else "left",
            va="center",
            fontsize=7,
            alpha=1.0 if c.fits else 0.5,
        )


def _chosen_and_budget(ax: Any, plan: Plan, x: float, unit: str, scale: float) -> None:
    """The chosen candidate (at step cost `x`) circled and named, and the budget's line."""
    best = plan.best
    ax.scatter(
        [x],
        [best.peak_bytes / scale],
        s=320,
        facecolors="none",
        edgecolors="#c00000",
        linewidths=2.0,
        zorder=4,
    )
    box = {"boxstyle": "round,pad=0.25", "facecolor": "white", "edgecolor": "#c00000"}
    ax.annotate(
        f"chosen: {best.label}",
        (x, best.peak_bytes / scale),
        xytext=(0.5, 0.93),
        textcoords="axes fraction",
        ha="center",
        fontsize=8,
        color="#c00000",
        bbox=box,
        arrowprops={"arrowstyle": "->", "color": "#c00000", "linewidth": 1.0},
        zorder=5,
    )
    ax.axhline(plan.budget / scale, color="#c00000", linestyle=":", linewidth=1.5)
    ax.annotate(
        f"budget {plan.budget / scale:.3g} {unit}",
        (0.0, plan.budget / scale),
        xycoords=("axes fraction", "data"),
        xytext=(4, 4),
        textcoords="offset points",
        ha="left",
        fontsize=8,
        color="#c00000",
        bbox={**box, "edgecolor": "none", "alpha": 0.8},
    )


def _marker(colour: str, marker: str, label: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D([], [], color=colour, marker=marker, linestyle="none", markersize=7, label=label)
