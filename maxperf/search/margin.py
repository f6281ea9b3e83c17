"""The memory a plan's candidate must leave free: perfmodel's measured error against the compiler.

memory_error.json beside this module holds, per platform, how far perfmodel's per-device memory fell from XLA's over
a benchmark grid (bench/memory_accuracy.py --error-json writes it); a candidate fits when its analytical memory x
(1 + margin) is within the device's memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEMORY_ERROR_PATH = Path(__file__).resolve().with_name("memory_error.json")
# Where memory_error.json has no figure at all: the worst of three cases of `bench/memory_accuracy.py --only v5p-8`
# measured here (qwen3-0.6b remat full: analytical 3.20 GiB, compiler 3.55 GiB, -9.9%; minimal -7.2%; gemma-2b full
# +1.5%; B=1, L=2048, libtpu compile-only).
FALLBACK_MARGIN = 0.109  # 3.55 / 3.20 - 1
FALLBACK_SOURCE = "the largest underestimate of bench/memory_accuracy.py --only v5p-8 measured here (3 cases)"


@dataclass(frozen=True)
class Margin:
    """Memory a candidate must leave free: it fits when analytical x (1 + value) <= HBM."""

    value: float
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}


def _entries(path: Path) -> dict[str, dict]:
    """memory_error.json's entries that give an underestimate ({name: {"worst_underestimate": x, "median": y,
    "cases": n, ...}}); raises OSError or ValueError where the file cannot be read."""
    data = json.loads(path.read_text())
    return {name: row for name, row in data.items() if isinstance(row, dict)
            and isinstance(row.get("worst_underestimate"), (int, float))} if isinstance(data, dict) else {}


def _need(row: dict) -> float:
    """An entry's largest underestimate (compiler / analytical - 1); an over-estimate needs no margin."""
    return max(float(row["worst_underestimate"]), 0.0)


def _own(rows: dict[str, dict], platform: str, chip: str | None, moe: bool = False) -> str | None:
    """The entry measured for `chip` (a generation whose compiler schedules apart: "tpu7x"), else for `platform`;
    for a mixture of experts the one measured on such steps apart ("gpu moe": the GPU grid is of MoE steps) first."""
    names = (f"{chip} moe", f"{platform} moe") if moe else ()
    return next((name for name in (*names, chip, platform) if name in rows), None)


def load_margin(platform: str, path: Path = MEMORY_ERROR_PATH, chip: str | None = None, moe: bool = False) -> Margin:
    """The largest measured underestimate of memory (compiler / analytical - 1) for `chip` where memory_error.json
    measures that chip apart, else for `platform` (_own); a platform it does not name takes the largest of those it
    does; no file, the fallback figure. Each Margin says where its figure came from."""
    try:
        rows = _entries(path)
    except FileNotFoundError:
        return Margin(FALLBACK_MARGIN, f"{FALLBACK_SOURCE} ({path.name} not found)")
    except (OSError, ValueError) as e:
        return Margin(FALLBACK_MARGIN, f"{FALLBACK_SOURCE} ({path.name} unreadable: {type(e).__name__})")
    if (name := _own(rows, platform, chip, moe)) is not None:
        row = rows[name]
        return Margin(_need(row), f"the largest measured {name} underestimate of memory (compiler over "
                      f"analytical) in {path.name} ({row.get('cases', '?')} cases, median |error| "
                      f"{abs(float(row.get('median', 0))):.1%})")
    rows = {n: row for n, row in rows.items() if not n.endswith(" moe")}  # measured on MoE steps alone
    if rows:
        name = max(rows, key=lambda n: _need(rows[n]))
        return Margin(_need(rows[name]), f"the largest measured underestimate of memory in {path.name}, on {name} "
                      f"({path.name} has no {platform} figure)")
    return Margin(FALLBACK_MARGIN, f"{FALLBACK_SOURCE} ({path.name} names no platform's underestimate)")


@dataclass(frozen=True)
class MeasuredError:
    """How far perfmodel's per-device memory fell from the compiler's on one platform's benchmark grid: the compiler
    counted up to `under` more (compiler / analytical - 1, its largest) and up to `over` less (the largest |error| of
    an over-estimate's kind, analytical / compiler - 1), over `cases` compiles of `name`'s entry."""

    name: str
    under: float
    over: float
    cases: int
    date: str

    def close_call(self, analytical: float, capacity: float) -> bool:
        """Whether the compiler's count could fall on the other side of `capacity` than `analytical` does."""
        if analytical <= capacity:
            return analytical * (1 + self.under) > capacity
        return analytical / (1 + self.over) <= capacity

    def as_dict(self) -> dict[str, Any]:
        return {"entry": self.name, "compiler_above_up_to": self.under, "compiler_below_up_to": self.over,
                "cases": self.cases, "date": self.date, "source": f"{MEMORY_ERROR_PATH.name}, bench/memory_accuracy.py"}


def measured_error(platform: str, chip: str | None = None, path: Path = MEMORY_ERROR_PATH,
                   moe: bool = False) -> MeasuredError | None:
    """memory_error.json's entry for `chip` where it measures that chip apart, else for `platform` (_own); None where
    it has none (its figures are not carried over to a platform they were not measured on, as load_margin's are)."""
    try:
        rows = _entries(path)
    except (OSError, ValueError):
        return None
    if (name := _own(rows, platform, chip, moe)) is None:
        return None
    row = rows[name]
    # the largest over-estimate where the entry gives it; else the largest error of either sign, which bounds it
    over = row.get("worst_overestimate", row.get("worst", 0.0))
    return MeasuredError(name, _need(row), max(float(over), 0.0), int(row.get("cases", 0)),
                         str(row.get("date", "")))
