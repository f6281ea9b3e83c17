"""Fallbacks that change a prediction (a stale calibration, a GPU's memory from its datasheet) are said on stderr,
once per process; the JSON that the prediction goes into records them too."""

from __future__ import annotations

import sys

_said: set[str] = set()


def note(message: str) -> None:
    """Prints `maxperf: note: MESSAGE` on stderr, the first time this process says it."""
    if message not in _said:
        _said.add(message)
        print(f"maxperf: note: {message}", file=sys.stderr)
