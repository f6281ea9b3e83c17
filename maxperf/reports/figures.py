"""matplotlib figures rendered as inline SVG (Agg-free vector output, non-interactive backend)."""

from __future__ import annotations

import html
import io
import re
from collections.abc import Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # non-interactive: never opens a window or needs a display
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "figure.dpi": 96})
    return plt


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
                 line: float | None = None, line_label: str = "") -> str:
    """One horizontal bar per label, stacked by part; an optional vertical limit line (e.g. HBM)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.55 * len(labels)))
    left = [0.0] * len(labels)
    for name, values in parts.items():
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values)]
    if line is not None:
        ax.axvline(line, color="black", linestyle="--", linewidth=1)
        ax.text(line, len(labels) - 0.5, f" {line_label}", va="top", fontsize=8)
    ax.set_xlabel(unit)
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.05 * len(labels)), ncol=4,
              frameon=False)
    return to_svg(fig, alt)


def lines_against_groups(xs: Sequence[Sequence[float]], series: dict[str, Sequence[float | None]], *, xlabel: str,
                         ylabel: str, alt: str, logx: bool = True, hline: float | None = None,
                         hline_label: str = "") -> str:
    """One line per series, each over its own x values (series i over xs[i])."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for x, (name, values) in zip(xs, series.items()):
        pts = [(a, b) for a, b in zip(x, values) if b is not None]
        if pts:
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=name)
    if hline is not None:
        ax.axhline(hline, color="black", linestyle="--", linewidth=1, label=hline_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return to_svg(fig, alt)
