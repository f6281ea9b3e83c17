"""Offline summary of an xprof trace (`*.xplane.pb`): top XLA operations by self time, the split between compute,
collectives and the rest, and the step time as the trace sees it.

XLA operation events carry `hlo_op` and `hlo_module` stats (on the host plane for CPU devices, on `/device:*`
planes for TPU and GPU); what a backend does not record is reported as missing, never as zero.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "send", "recv",
                "collective-broadcast", "ragged-all-to-all")
_MEMORY = ("copy", "transpose", "dynamic-update-slice", "dynamic-slice", "slice", "concatenate", "pad", "broadcast",
           "gather", "scatter", "bitcast")
_COMPUTE = ("fusion", "convolution", "dot", "custom-call", "cublas", "gemm", "reduce", "sort", "ynn", "triton")


def category(op: str) -> str:
    name = op.lower()
    if any(c in name for c in _COLLECTIVES):
        return "collective"
    if any(name.startswith(m) for m in _MEMORY):
        return "memory"
    if any(c in name for c in _COMPUTE):
        return "compute"
    return "other"


@dataclass(frozen=True)
class OpTime:
    op: str
    category: str
    count: int
    self_seconds: float


@dataclass(frozen=True)
class TraceSummary:
    files: list[str]
    device_planes: list[str]  # empty where the backend records no device activity (CPU)
    top_ops: list[OpTime]
    seconds_by_category: dict[str, float]  # self time of XLA operations, summed over devices
    step_time_s: float | None  # median span of one execution of the module, as traced
    steps_traced: int
    missing: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def _stats(event) -> dict:
    import warnings

    try:
        with warnings.catch_warnings():  # jaxlib's stats type lacks __module__, which Python warns about
            warnings.simplefilter("ignore", DeprecationWarning)
            return dict(event.stats)
    except Exception:  # a stat value of a type the reader cannot convert
        return {}


def summarize(trace_dir: Path, module: str = "jit_step", top: int = 20) -> TraceSummary:
    from jax.profiler import ProfileData

    files = sorted(str(p) for p in Path(trace_dir).rglob("*.xplane.pb"))
    if not files:
        return TraceSummary([], [], [], {}, None, 0, [f"no *.xplane.pb under {trace_dir}"])
    self_time: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    spans: dict[tuple, list[float]] = defaultdict(lambda: [float("inf"), 0.0])
    device_planes: set[str] = set()
    for path in files:
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith("/device:") and not plane.name.startswith("/device:CUSTOM"):
                device_planes.add(plane.name)  # CUSTOM planes (libtpu's Megascale trace) hold no device ops
            for line in plane.lines:
                _add_line(line, module, self_time, counts, spans, plane.name)
    by_category: dict[str, float] = defaultdict(float)
    for op, seconds in self_time.items():
        by_category[category(op)] += seconds
    ops = sorted(self_time, key=self_time.get, reverse=True)[:top]
    per_run = [end - start for start, end in spans.values() if end > start]
    missing = []
    if not device_planes:
        missing.append("device planes: this backend records no device activity (CPU); times are host-side XLA "
                       "execution")
    if not self_time:
        missing.append(f"no XLA operation events for module {module}")
    return TraceSummary(
        files=files, device_planes=sorted(device_planes),
        top_ops=[OpTime(op, category(op), counts[op], self_time[op]) for op in ops],
        seconds_by_category=dict(by_category),
        step_time_s=statistics.median(per_run) if per_run else None, steps_traced=len(per_run), missing=missing,
    )


def _add_line(line, module: str, self_time, counts, spans, plane: str) -> None:
    """Self time per XLA op on one timeline line: an event's duration less that of the events nested in it."""
    events = []
    for event in line.events:
        stats = _stats(event)
        if "hlo_op" not in stats or not str(stats.get("hlo_module", "")).startswith(module):
            continue
        start, duration = float(event.start_ns), float(event.duration_ns)
        events.append((start, duration, str(stats["hlo_op"])))
        run = stats.get("run_id", stats.get("step_num"))
        span = spans[(plane, run)] if run is not None else None
        if span is not None:
            span[0] = min(span[0], start * 1e-9)
            span[1] = max(span[1], (start + duration) * 1e-9)
    events.sort(key=lambda e: (e[0], -e[1]))
    stack: list[list] = []  # [end, op, child_time]
    for start, duration, op in events:
        while stack and stack[-1][0] <= start:
            _close(stack.pop(), self_time)
        if stack:
            stack[-1][2] += duration
        stack.append([start + duration, op, 0.0, duration])
        counts[op] += 1
    while stack:
        _close(stack.pop(), self_time)


def _close(frame: list, self_time) -> None:
    end, op, children, duration = frame
    self_time[op] += max(duration - children, 0.0) * 1e-9
