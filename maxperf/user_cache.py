"""The user's maxperf cache directory and the calibration `maxperf calibrate` stores in it (plain json, no jax).

Callers load the calibration here once and pass it to perfmodel, which never reads it from disk itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from maxperf.perfmodel.calibration import SCHEMA_VERSION, Calibration, StoredCalibration
from maxperf.spec.notes import note

CALIBRATION_FILE = "calibration.json"
RECALIBRATE = "run `maxperf calibrate` again; CPU estimates use the uncalibrated defaults until then"


def cache_dir() -> Path:
    """MAXPERF_CACHE_DIR if set, else $XDG_CACHE_HOME/maxperf, else ~/.cache/maxperf (XDG base directory spec)."""
    if os.environ.get("MAXPERF_CACHE_DIR"):
        return Path(os.environ["MAXPERF_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "maxperf"


def calibration_path() -> Path:
    return cache_dir() / CALIBRATION_FILE


def save_calibration(cal: Calibration, path: Path | None = None) -> Path:
    """Writes atomically (temp file then rename), so a reader never sees half a file."""
    path = path or calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cal.as_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load_calibration(path: Path | None = None) -> StoredCalibration:
    """The stored calibration with its path and hash, or why there is none. A file that exists but cannot be used
    (unreadable, or written by another version's schema) is said on stderr: estimates fall back to defaults."""
    path = path or calibration_path()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return StoredCalibration(str(path), None, problem=f"no calibration at {path}: run `maxperf calibrate`")
    except OSError as e:
        return _unusable(path, None, f"cannot read the calibration {path} ({e.strerror})")
    sha256 = hashlib.sha256(data).hexdigest()
    try:
        d = json.loads(data)
        schema = d.get("schema") if isinstance(d, dict) else None
        if schema != SCHEMA_VERSION:
            return _unusable(path, sha256, f"the calibration {path} has schema {schema}, this maxperf reads schema "
                                           f"{SCHEMA_VERSION}", schema if isinstance(schema, int) else None)
        return StoredCalibration(str(path), Calibration.from_dict(d), sha256=sha256)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return _unusable(path, sha256, f"the calibration {path} is unreadable ({type(e).__name__}: {e})")


def _unusable(path: Path, sha256: str | None, why: str, schema: int | None = None) -> StoredCalibration:
    problem = f"{why}; {RECALIBRATE}"
    note(problem)
    return StoredCalibration(str(path), None, sha256=sha256, problem=problem, schema=schema)


def calibration_for(topology) -> StoredCalibration | None:
    """What to pass to perfmodel for `topology`: the stored calibration for CPU topologies (the only chip it
    measures); None, without reading anything, for TPUs and GPUs."""
    return load_calibration() if topology.chip == "cpu" else None
