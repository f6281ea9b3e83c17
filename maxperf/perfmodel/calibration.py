"""What `maxperf calibrate` measured on a machine, as plain data (no jax, no disk).

`maxperf.profiler.calibrate` measures it and `maxperf.user_cache` stores and loads it; callers pass what they
loaded to perfmodel (a StoredCalibration), which never reads it from disk itself, so an estimate.json and a run.json
each say which calibration they used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 5
# Sides of a thin matmul: the small one of M (rows of x), K (the contraction) or N (columns of W).
THIN_SIDES = ("m", "k", "n")


@dataclass(frozen=True)
class MatmulSample:
    dtype: str
    size: int  # a square matmul of size x size by size x size; a thin one's two long sides
    flops_per_s: float  # all the process's devices together, each running its own matmul at the same time
    thin: int | None = None  # a thin matmul: one side (`side`) is `thin` long, the other two `size`; None: square
    side: str | None = None  # one of THIN_SIDES


@dataclass(frozen=True)
class AttentionSample:
    dtype: str
    head_dim: int
    seq_len: int
    heads: int  # per device: examples x query heads
    flops_per_s: float  # model FLOPs (12 x seq_len^2 x head_dim per head, forward and backward) over all devices


@dataclass(frozen=True)
class Calibration:
    """Measured on this machine's jax devices, all of them at once (SPMD devices of one process share the cores and
    memory): matmul FLOP/s by dtype, size and thinness, memory bandwidth, the rates of transposing copies, of fused
    elementwise work and of a whole attention, the cost of faulting in new memory, and the bandwidth and fixed cost
    of collectives between the devices. Rates are totals over the `num_devices` devices; perfmodel divides them
    among a topology's devices."""

    platform: str
    device_kind: str
    num_devices: int
    matmul: tuple[MatmulSample, ...]
    memory_bandwidth: float  # bytes/s, a reduction over a large array on every device
    collective_bandwidth: float | None  # bytes/s of an all-gather among the devices, as link bandwidth; None: 1 device
    all_reduce_bandwidth: float | None  # the same for an all-reduce (the bus bandwidth convention of perfmodel.network)
    page_fault_bandwidth: float | None  # bytes/s of newly mapped memory written for the first time, beyond the write
    transpose_bandwidth: float  # bytes/s read + written by a float32 copy that transposes a matrix
    elementwise_bandwidth: float  # bytes/s read + written by a softmax over float32 rows, written in bfloat16
    attention: tuple[AttentionSample, ...]  # a causal attention's forward and backward, per dtype and head dimension
    collective_latency: float | None  # seconds a small all-reduce between dependent computations adds; None: 1 device
    jax_version: str
    created: str  # ISO 8601, UTC
    schema: int = SCHEMA_VERSION

    def peak_flops(self, dtype: str) -> float | None:
        """The best square matmul rate measured in `dtype`; None when that dtype was not measured."""
        rates = [s.flops_per_s for s in self.matmul if s.dtype == dtype and s.thin is None]
        return max(rates) if rates else None

    def matmul_half(self, dtype: str) -> float | None:
        """The thin side at which a matmul runs at half the rate of a square one of its long sides: the median,
        over the thin samples, of HALF in rate(thin) = rate(square) x thin / (thin + HALF), the form
        perfmodel.steptime gives matmul efficiency. None when `dtype` has no thin samples."""
        square = {s.size: s.flops_per_s for s in self.matmul if s.dtype == dtype and s.thin is None}
        halves = sorted(s.thin * (square[s.size] / s.flops_per_s - 1) for s in self.matmul
                        if s.dtype == dtype and s.thin is not None and s.size in square)
        if not halves:
            return None
        mid = len(halves) // 2
        return max(0.0, halves[mid] if len(halves) % 2 else (halves[mid - 1] + halves[mid]) / 2)

    def as_dict(self) -> dict:
        return {
            "schema": self.schema, "platform": self.platform, "device_kind": self.device_kind,
            "num_devices": self.num_devices, "jax_version": self.jax_version, "created": self.created,
            "memory_bandwidth": self.memory_bandwidth, "collective_bandwidth": self.collective_bandwidth,
            "all_reduce_bandwidth": self.all_reduce_bandwidth, "page_fault_bandwidth": self.page_fault_bandwidth,
            "transpose_bandwidth": self.transpose_bandwidth, "elementwise_bandwidth": self.elementwise_bandwidth,
            "collective_latency": self.collective_latency,
            "matmul": [{"dtype": s.dtype, "size": s.size, "flops_per_s": s.flops_per_s,
                        "thin": s.thin, "side": s.side} for s in self.matmul],
            "attention": [{"dtype": s.dtype, "head_dim": s.head_dim, "seq_len": s.seq_len, "heads": s.heads,
                           "flops_per_s": s.flops_per_s} for s in self.attention],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls(
            platform=d["platform"], device_kind=d["device_kind"], num_devices=int(d["num_devices"]),
            matmul=tuple(MatmulSample(m["dtype"], int(m["size"]), float(m["flops_per_s"]),
                                      None if m.get("thin") is None else int(m["thin"]), m.get("side"))
                         for m in d["matmul"]),
            memory_bandwidth=float(d["memory_bandwidth"]),
            collective_bandwidth=_optional(d["collective_bandwidth"]),
            all_reduce_bandwidth=_optional(d["all_reduce_bandwidth"]),
            page_fault_bandwidth=_optional(d["page_fault_bandwidth"]),
            transpose_bandwidth=float(d["transpose_bandwidth"]),
            elementwise_bandwidth=float(d["elementwise_bandwidth"]),
            attention=tuple(AttentionSample(a["dtype"], int(a["head_dim"]), int(a["seq_len"]), int(a["heads"]),
                                            float(a["flops_per_s"])) for a in d["attention"]),
            collective_latency=_optional(d["collective_latency"]),
            jax_version=d["jax_version"], created=d["created"], schema=int(d["schema"]),
        )


def _optional(value) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class StoredCalibration:
    """A calibration as a caller found it, to pass to perfmodel: the measurements and the file they came from, or
    why there are none (the file is missing, unreadable or of another schema; CPU estimates then use the labelled
    defaults and say why)."""

    path: str | None  # None: passed in by a program, not read from a file
    calibration: Calibration | None
    sha256: str | None = None  # of the file's bytes: two estimates used the same calibration when these match
    problem: str | None = None  # why `calibration` is None
    schema: int | None = None  # the file's schema where it was read but could not be used (another version's)

    def record(self) -> dict[str, Any]:
        """Which calibration was used, as estimate.json and run.json record it."""
        cal = self.calibration
        return {"path": self.path, "sha256": self.sha256, "used": cal is not None, "problem": self.problem,
                "created": cal.created if cal else None, "schema": cal.schema if cal else self.schema,
                "device_kind": cal.device_kind if cal else None, "num_devices": cal.num_devices if cal else None,
                "jax_version": cal.jax_version if cal else None}
