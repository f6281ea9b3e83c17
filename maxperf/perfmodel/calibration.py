"""Where `maxperf calibrate` keeps this machine's measured peaks, and reading them back (plain json, no jax).

The file is written by `maxperf.profiler.calibrate`; perfmodel only reads it, to give the "cpu" chip measured peaks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 2
# Operand layouts of the matmuls a train step runs: the forward's x @ W ("nn"), the input gradient dy @ W^T ("nt")
# and the weight gradient x^T @ dy ("tn"). XLA:CPU reaches very different rates on them (`maxperf calibrate` here, 2
# devices of a 2-core Xeon with AMX, bfloat16: nt 1.09x and tn 0.19x the rate of nn), so each is calibrated.
FORMS = ("nn", "nt", "tn")
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
    flops_per_s: float  # all the process's devices together, each running its own matmul at the same time
    form: str = "nn"  # one of FORMS


@dataclass(frozen=True)
class Calibration:
    """Measured on this machine's jax devices, all of them at once (SPMD devices of one process share the cores and
    memory): matmul FLOP/s by dtype, form and size, memory bandwidth, and the bandwidth of a collective between the
    devices. Rates are totals over the `num_devices` devices; perfmodel divides them among a topology's devices."""

    platform: str
    device_kind: str
    num_devices: int
    matmul: tuple[MatmulSample, ...]
    memory_bandwidth: float  # bytes/s, a reduction over a large array on every device
    collective_bandwidth: float | None  # bytes/s of an all-gather among the devices, as link bandwidth; None: 1 device
    jax_version: str
    created: str  # ISO 8601, UTC
    schema: int = SCHEMA_VERSION

    def peak_flops(self, dtype: str) -> float | None:
        """The best plain ("nn") matmul rate measured in `dtype`; None when that dtype was not measured."""
        rates = [s.flops_per_s for s in self.matmul if s.dtype == dtype and s.form == "nn"]
        return max(rates) if rates else None

    def form_efficiency(self, dtype: str) -> dict[str, float]:
        """Each form's rate relative to "nn", at the largest size measured in `dtype` with every form."""
        sizes = {s.size for s in self.matmul if s.dtype == dtype}
        full = [n for n in sizes if {s.form for s in self.matmul if s.dtype == dtype and s.size == n} >= set(FORMS)]
        if not full:
            return {}
        rate = {s.form: s.flops_per_s for s in self.matmul if s.dtype == dtype and s.size == max(full)}
        return {f: rate[f] / rate["nn"] for f in FORMS}

    def as_dict(self) -> dict:
        return {
            "schema": self.schema, "platform": self.platform, "device_kind": self.device_kind,
            "num_devices": self.num_devices, "jax_version": self.jax_version, "created": self.created,
            "memory_bandwidth": self.memory_bandwidth, "collective_bandwidth": self.collective_bandwidth,
            "matmul": [{"dtype": s.dtype, "form": s.form, "size": s.size, "flops_per_s": s.flops_per_s}
                       for s in self.matmul],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls(
            platform=d["platform"], device_kind=d["device_kind"], num_devices=int(d["num_devices"]),
            matmul=tuple(MatmulSample(m["dtype"], int(m["size"]), float(m["flops_per_s"]), m["form"])
                         for m in d["matmul"]),
            memory_bandwidth=float(d["memory_bandwidth"]),
            collective_bandwidth=None if d["collective_bandwidth"] is None else float(d["collective_bandwidth"]),
            jax_version=d["jax_version"], created=d["created"], schema=int(d["schema"]),
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
