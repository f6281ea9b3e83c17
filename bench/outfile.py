"""The JSON file a bench writes with --json: where it goes is checked before any row runs (a one-line usage error, exit
2, nothing written), and the file is written whole, to a temporary name in its directory renamed into place, so that a
reader never sees half of it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def checked(ap: argparse.ArgumentParser, path: str | os.PathLike | None, option: str = "--json") -> Path | None:
    """`path` as a Path, or the parser's usage error where it cannot be written (a directory, or one whose directory
    does not exist); None where no file was asked for."""
    if not path:
        return None
    path = Path(path)
    if path.is_dir():
        ap.error(f"{option} {path}: a directory; give a file name in it")
    if not path.parent.is_dir():
        ap.error(f"{option} {path}: no directory {path.parent} to write it in")
    return path


def write(path: Path, doc: Any, indent: int = 1) -> None:
    """`doc` as JSON at `path`, whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=indent) + "\n")
    os.replace(tmp, path)
