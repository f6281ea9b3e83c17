"""Where `maxperf calibrate` keeps this machine's measured peaks, and reading them back (plain json, no jax).

The file is written by `maxperf.profiler.calibrate`; perfmodel only reads it, to give the "cpu" chip measured peaks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1
FILE_NAME = "calibration.json"


def cache_dir() -> Path:
    """MAXPERF_CACHE_DIR if set, else $XDG_CACHE_HOME/maxperf, else ~/.cache/maxperf (XDG base directory spec)."""
    if os.environ.get("MAXPERF_CACHE_DIR"):
        return Path(os.environ["MAXPERF_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "maxperf"


def calibration_path() -> Path:
    return cache_dir() / FILE_NAME


@dataclass(frozen=True)
class MatmulSample:
    dtype: str
    size: int  # square matmul of size x size by size x size
    flops_per_s: float


@dataclass(frozen=True)
class Calibration:
    """Measured on this machine's jax devices: matmul FLOP/s by dtype and size, and memory bandwidth."""

    platform: str
    device_kind: str
    num_devices: int
    matmul: tuple[MatmulSample, ...]
    memory_bandwidth: float  # bytes/s, a large array add (read two, write one)
    jax_version: str
    created: str  # ISO 8601, UTC
    schema: int = SCHEMA_VERSION

    def peak_flops(self, dtype: str) -> float | None:
        """The best matmul rate measured in `dtype`; None when that dtype was not measured."""
        rates = [s.flops_per_s for s in self.matmul if s.dtype == dtype]
        return max(rates) if rates else None

    def as_dict(self) -> dict:
        return {
            "schema": self.schema, "platform": self.platform, "device_kind": self.device_kind,
            "num_devices": self.num_devices, "jax_version": self.jax_version, "created": self.created,
            "memory_bandwidth": self.memory_bandwidth,
            "matmul": [{"dtype": s.dtype, "size": s.size, "flops_per_s": s.flops_per_s} for s in self.matmul],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls(
            platform=d["platform"], device_kind=d["device_kind"], num_devices=int(d["num_devices"]),
            matmul=tuple(MatmulSample(m["dtype"], int(m["size"]), float(m["flops_per_s"])) for m in d["matmul"]),
            memory_bandwidth=float(d["memory_bandwidth"]), jax_version=d["jax_version"], created=d["created"],
            schema=int(d["schema"]),
        )


def save(cal: Calibration, path: Path | None = None) -> Path:
    """Writes atomically (temp file then rename), so a reader never sees half a file."""
    path = path or calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cal.as_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load(path: Path | None = None) -> Calibration | None:
    """The stored calibration, or None when there is none or it is unreadable or of another schema."""
    path = path or calibration_path()
    try:
        d = json.loads(path.read_text())
        if d.get("schema") != SCHEMA_VERSION:
            return None
        return Calibration.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError):
        return None
