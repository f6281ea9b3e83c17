"""What a report page is made of (sections of facts, figures and tables) and the small helpers every section uses:
reading an artifact's JSON, formatting a cell, naming a topology."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxperf.spec.errors import MaxperfError

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    csv_name: str
    best: dict[int, int] = field(default_factory=dict)  # row index -> column index of a best value
    emphasis: set[int] = field(default_factory=set)  # rows drawn as totals and verdicts


@dataclass
class Section:
    title: str
    kind: str
    headline: str = ""  # the answer in one line: fits or not, step time, MFU, bottleneck
    verdict: str = ""  # "fits", "does not fit" or "" (colours the headline)
    facts: list[tuple[str, str]] = field(default_factory=list)
    figures: list[tuple[str, Table]] = field(default_factory=list)  # (svg, its numbers)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Page:
    """The sections of one report, in order, and the versions that produced their artifacts."""

    def __init__(self):
        self.sections: list[Section] = []
        self.versions: dict[str, Any] = {}
        self._tables = 0

    def table(self, title: str, columns: list[str], rows: list[list[Any]], **kw) -> Table:
        self._tables += 1
        slug = "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")
        while "--" in slug:
            slug = slug.replace("--", "-")
        return Table(title, columns, rows, f"{self._tables:02d}-{slug}.csv", **kw)


def read_json(path: Path) -> dict | None:
    """A JSON object the directory holds, None when absent; a damaged one is an error naming the file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MaxperfError(f"{path} is not readable JSON ({type(e).__name__}: {e}); the directory is damaged: "
                           "produce it again") from None
    if not isinstance(data, dict):
        raise MaxperfError(f"{path} holds a JSON {type(data).__name__}, not an object; the directory is damaged: "
                           "produce it again")
    return data


def fmt(value: Any) -> str:
    """A table cell: blank for what does not apply or was not recorded, 4 significant digits for floats."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"  # 128,103 tokens/s, not 1.281e+05
    return str(value)


def gib(value: float | None) -> float | None:
    return None if value is None else value / GIB


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return "?"
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / MIB:,.1f} MiB"


def topology_label(name: str, num_slices: int | None) -> str:
    """`v5p-128`, or `2 x v5p-128` over two slices (the catalog name is one slice's)."""
    return f"{num_slices} x {name}" if num_slices and num_slices > 1 else name


def percent(value: float | None) -> str:
    return "?" if value is None else f"{value:.1%}"


def seconds(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.4g} s" if value >= 0.1 else f"{value * 1e3:.3g} ms" if value >= 1e-4 else f"{value * 1e6:.3g} µs"
