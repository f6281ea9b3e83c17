"""matplotlib figures rendered as inline SVG (vector output, non-interactive backend)."""

from __future__ import annotations

import html
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # non-interactive: never opens a window or needs a display
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "figure.dpi": 96})
    return plt


def _colors() -> list[str]:
    return _pyplot().rcParams["axes.prop_cycle"].by_key()["color"]


def to_svg(fig, alt: str) -> str:
    """The figure as an <svg> element carrying a text alternative (role=img, aria-label, <title>)."""
    plt = _pyplot()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<!--.*?-->|<metadata>.*?</metadata>", "", svg, flags=re.S)
    # inline SVG in HTML needs no namespace declarations; dropping them leaves no URL at all in the page
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    label = html.escape(alt, quote=True)
    return re.sub(r"<svg ", f'<svg role="img" aria-label="{label}" ', svg, count=1).replace(
        ">", f"><title>{label}</title>", 1)


def stacked_bars(labels: Sequence[str], parts: dict[str, Sequence[float]], *, unit: str, alt: str,
                 lines: Sequence[tuple[float, str]] = ()) -> str:
    """One horizontal bar per label, stacked by part, its total written at its end; vertical limit lines (HBM)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 0.9 + 0.45 * len(labels)))
    left = [0.0] * len(labels)
    colors = _colors()
    for i, (name, values) in enumerate(parts.items()):
        values = [v or 0.0 for v in values]
        ax.barh(labels, values, left=left, label=name, color=colors[i % len(colors)],
                hatch="//" if i >= len(colors) else None, edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, values)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.3g}", va="center", fontsize=8)
    for value, name in lines:
        ax.axvline(value, color="black", linestyle="--", linewidth=1)
        ax.text(value, -0.6, f" {name}", va="bottom", fontsize=8)
    ax.set_xlim(0, max([*left, *(v for v, _ in lines), 1e-12]) * 1.15)
    ax.set_xlabel(unit)
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / (1 + len(labels))), ncol=3,
              frameon=False)
    return to_svg(fig, alt)


def grouped_bars(labels: Sequence[str], series: dict[str, Sequence[float | None]], *, unit: str, alt: str) -> str:
    """Horizontal bars, one group per label and one bar per series in it (a missing value draws no bar)."""
    plt = _pyplot()
    n = len(series)
    height = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(7.2, 0.9 + 0.3 * len(labels) * max(n, 1)))
    for i, (name, values) in enumerate(series.items()):
        ys = [j - 0.4 + height * (i + 0.5) for j in range(len(labels))]
        ax.barh(ys, [v or 0.0 for v in values], height=height, label=name)
        for y, v in zip(ys, values):
            if v is not None:
                ax.text(v, y, f" {v:.3g}", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlim(0, max([v for vs in series.values() for v in vs if v is not None] + [1e-12]) * 1.2)
    ax.set_xlabel(unit)
    ax.invert_yaxis()
    if n > 1:
        ax.legend(fontsize=7, loc="lower right")
    return to_svg(fig, alt)


def series(xs: Sequence[float], lines: dict[str, Sequence[float | None]], *, xlabel: str, ylabel: str, alt: str,
           hlines: Sequence[tuple[float, str]] = ()) -> str:
    """Lines over one x axis (e.g. a value per step), with labelled horizontal reference lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 2.8))
    for name, values in lines.items():
        pts = [(a, b) for a, b in zip(xs, values) if b is not None]
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", markersize=3, label=name)
    styles = ["--", ":", "-."]
    for i, (value, name) in enumerate(hlines):
        ax.axhline(value, color="black", linestyle=styles[i % len(styles)], linewidth=1, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return to_svg(fig, alt)


@dataclass
class Panel:
    """One chip type's axes: lines of (label, xs, ys), ideal lines beside them (dashed, the same colour), and an
    optional horizontal limit (value, label), e.g. the chip's HBM."""

    title: str
    lines: list[tuple[str, list[float], list[float | None]]] = field(default_factory=list)
    ideal: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)  # label -> (xs, ys)
    limit: tuple[float, str] | None = None
    over: list[tuple[float, float]] = field(default_factory=list)  # points marked as not fitting


# A panel's limit line is drawn only within this many times its highest point; beyond, its title names it
LIMIT_IN_VIEW = 4.0


def panels(panels_: Sequence[Panel], *, xlabel: str, ylabel: str, alt: str, logx: bool = True,
           from_zero: bool = False) -> str:
    """Side by side axes, one per panel; a label keeps its colour across panels; one legend below them all."""
    plt = _pyplot()
    n = max(len(panels_), 1)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols + 0.6, 2.7 * rows + 0.4), squeeze=False)
    colors = _colors()
    labels = list(dict.fromkeys(label for p in panels_ for label, _, _ in p.lines))
    color = {label: colors[i % len(colors)] for i, label in enumerate(labels)}
    handles: dict[str, object] = {}
    for ax, panel in zip(axes.flat, panels_):
        for label, xs, ys in panel.lines:
            pts = [(a, b) for a, b in zip(xs, ys) if b is not None]
            if pts:
                (h,) = ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", markersize=4, color=color[label])
                handles.setdefault(label, h)
            if label in panel.ideal:
                ixs, iys = panel.ideal[label]
                (h,) = ax.plot(ixs, iys, linestyle="--", linewidth=1, color=color[label], alpha=0.7)
                handles.setdefault("ideal (dashed): linear from the fewest chips", h)
        for x, y in panel.over:
            (h,) = ax.plot([x], [y], marker="x", markersize=9, color="#c62828", linestyle="none")
            handles.setdefault("does not fit", h)
        highest = max([y for _, _, ys in panel.lines for y in ys if y is not None] + [y for _, y in panel.over],
                      default=0.0)
        title = panel.title
        if panel.limit is not None:
            value, name = panel.limit
            if highest and value > LIMIT_IN_VIEW * highest:  # drawn, it would flatten the lines against the axis
                title += f"\n({name}: above the chart)"
            else:
                ax.axhline(value, color="black", linestyle=":", linewidth=1.2)
                ax.annotate(name, (0.02, value), xycoords=("axes fraction", "data"), va="bottom", fontsize=7)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.15)
        if from_zero:
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)
    for ax in list(axes.flat)[len(panels_):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=2, frameon=False)
    return to_svg(fig, alt)
