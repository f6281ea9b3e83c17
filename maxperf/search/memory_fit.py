"""`maxperf estimate-memory`: the analytical memory breakdown beside the compiler's figures, and the largest
per-device batch that fits, found by few compiles.

    from maxperf.search import memory_fit
    cmp = memory_fit.compare("v5p-8", "llama2-7b", ["remat_policy=full"])
    cmp.analytical.per_device_total_bytes, cmp.compiler["per_device_total_bytes"], cmp.fits, cmp.difference
    best = memory_fit.max_batch("v5p-8", "llama2-7b", [])
    best.per_device_batch_size, best.compiles

With `cluster` (a connected maxperf.search.cluster.Cluster), each compile runs as a task of that Ray cluster.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxperf.aot.artifacts import OutputRefused
from maxperf.perfmodel import MemoryBreakdown, estimate_memory
from maxperf.perfmodel.estimate import device_for
from maxperf.perfmodel.flops import resolve_attention
from maxperf.spec.errors import DoesNotFit, MaxperfError, Unserializable
from maxperf.spec.mesh import Mesh
from maxperf.spec.request import Request, resolve
from maxperf.spec.train import PipelineSchedule

SCHEMA = "maxperf.estimate-memory/1"
MAX_BATCH_SCHEMA = "maxperf.max-batch/1"
# No per-device batch beyond this is tried: the search stops there and says so (a bound, not a measurement).
MAX_BATCH_LIMIT = 1 << 16

Progress = Callable[[str], None]


@dataclass(frozen=True)
class MemoryComparison:
    """One configuration's memory per device: the analytical breakdown and, unless skipped, XLA's figures."""

    plan: Request
    analytical: MemoryBreakdown
    compiler: dict[str, Any] | None  # memory.json of the compile (None: analytical only)
    compile_seconds: float | None
    out_dir: Path | None  # where the artifact was kept (None: a temporary directory, removed)
    cache_hit: bool = False  # the compiler's figures came from the compile cache (nothing compiled now)

    @property
    def source(self) -> str:
        """Whose verdict counts: the compiler's when there was a compile."""
        return "compiler" if self.compiler is not None else "analytical"

    @property
    def fits(self) -> bool:
        return bool(self.compiler["fits"]) if self.compiler is not None else self.analytical.fits

    @property
    def per_device_total_bytes(self) -> float:
        if self.compiler is not None and self.compiler.get("per_device_total_bytes"):
            return float(self.compiler["per_device_total_bytes"])
        return self.analytical.per_device_total_bytes

    @property
    def hbm_bytes(self) -> float:
        if self.compiler is not None and self.compiler.get("hbm_bytes"):
            return float(self.compiler["hbm_bytes"])
        return self.analytical.hbm_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.hbm_bytes - self.per_device_total_bytes

    @property
    def difference(self) -> float | None:
        """(analytical - compiler) / compiler, signed; None without the compiler's whole figure."""
        compiler = self.compiler or {}
        total = compiler.get("per_device_total_bytes")
        if compiler.get("at_least"):  # an out-of-memory compile's figure is where XLA stopped counting
            return None
        return (self.analytical.per_device_total_bytes - total) / total if total else None

    def as_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "schema": SCHEMA, "model": p.model.name, "topology": p.topology.name,
            "num_slices": p.topology.num_slices, "mesh": {a: n for a, n in p.mesh.axes.items() if n > 1},
            "warnings": list(p.warnings),
            "per_device_batch_size": p.configs.train.per_device_batch_size, "seq_len": p.configs.train.seq_len,
            "remat_policy": str(p.configs.train.remat_policy.value),
            "analytical": self.analytical.as_dict(),
            "compiler": self.compiler,
            "fits": self.fits, "verdict_source": self.source,
            "per_device_total_bytes": self.per_device_total_bytes, "hbm_bytes": self.hbm_bytes,
            "headroom_bytes": self.headroom_bytes, "difference": self.difference,
            "compile_seconds": self.compile_seconds, "cache_hit": self.cache_hit,
            "out_dir": None if self.out_dir is None else str(self.out_dir),
        }


def analytical(p: Request) -> MemoryBreakdown:
    """perfmodel's breakdown for a plan, against the per-device memory perfmodel's chip table gives."""
    mesh = Mesh.of(p.mesh.axes, p.mesh.dcn).check(p.topology)
    chip = device_for(p.topology)
    train = resolve_attention(p.configs.model, p.configs.train, chip.kind)
    return estimate_memory(p.configs.model, train, mesh, chip.hbm_bytes, chip.kind, chip.name)


def compare(topology: str, model: str, overrides: Sequence[str] = (), *, num_slices: int = 1,
            analytical_only: bool = False, out: str | os.PathLike | None = None,
            progress: Progress | None = None, force: bool = False, cluster=None,
            keep_executables: bool = False) -> MemoryComparison:
    """The analytical breakdown, and (unless `analytical_only`) the compiler's figures for the same step, compiled
    into `out` when given (kept), else into a temporary directory (removed); with `cluster`, compiled on a node of
    that Ray cluster, its JSON (with `keep_executables`, all of it) written into `out`."""
    p = resolve(topology, model, overrides, num_slices=num_slices)
    mine = analytical(p)
    if analytical_only:
        return MemoryComparison(p, mine, None, None, None)
    if str(p.configs.train.pipeline_schedule) == "1f1b" and p.mesh.axes["stage"] > 1:
        # the compiled pipeline runs MaxText's schedule: set the compiler's figure beside that schedule's analytical
        train = dataclasses.replace(p.configs.train, pipeline_schedule=PipelineSchedule.GPIPE)
        mine = analytical(dataclasses.replace(p, configs=dataclasses.replace(p.configs, train=train)))
    if cluster is not None:
        memory, seconds, cache_hit = cluster.compile_memory(p, model, overrides, num_slices,
                                                            out=None if out is None else Path(out), force=force,
                                                            keep_executables=keep_executables, progress=progress)
        return MemoryComparison(p, mine, memory, seconds, None if out is None else Path(out), cache_hit)
    memory, seconds, cache_hit = _compile_memory(p, model, overrides, num_slices, out, progress, force)
    return MemoryComparison(p, mine, memory, seconds, None if out is None else Path(out), cache_hit)


def _compile_memory(p: Request, model: str, overrides: Sequence[str], num_slices: int, out: str | os.PathLike | None,
                    progress: Progress | None, force: bool) -> tuple[dict[str, Any], float, bool]:
    """memory.json of a compile of the plan through `aot.compile` (and its compile cache), whether or not the step
    fits: into `out` when given (kept), else into a temporary directory (removed)."""
    from maxperf import aot

    say = progress
    if out is None and progress is not None:  # nothing is kept: its phases say what they do for the comparison
        def say(phase: str) -> None:
            progress("reading the compiler's figures" if phase == "writing artifacts" else phase)
    with tempfile.TemporaryDirectory(prefix="maxperf-memory-") as tmp:
        target = Path(out) if out is not None else Path(tmp) / "artifact"
        try:
            result = aot.compile(p.topology.name, model, overrides, num_slices=num_slices, out=target,
                                 progress=say, force=force)
            return dict(result.memory), result.compile_seconds, result.cache_hit
        except (DoesNotFit, Unserializable):  # the verdict and XLA's figures were written before the error
            manifest = json.loads((target / "manifest.json").read_text())
            return (json.loads((target / "memory.json").read_text()), float(manifest.get("compile_seconds", 0.0)),
                    bool(manifest.get("compile_cache_hit")))


@dataclass(frozen=True)
class Trial:
    per_device_batch_size: int
    fits: bool
    per_device_total_bytes: float | None  # the compiler's (None where XLA gave no figure)
    compile_seconds: float


@dataclass(frozen=True)
class MaxBatch:
    """The largest per-device batch that fits (0: not even one), how it was found, and its comparison."""

    per_device_batch_size: int
    analytical_guess: int  # the largest B that fits by perfmodel alone: where the search started
    compiles: int
    trials: tuple[Trial, ...]
    best: MemoryComparison | None  # the comparison at the largest fitting batch
    hit_limit: bool  # the search stopped at MAX_BATCH_LIMIT
    smallest: int = 1  # the smallest per_device_batch_size the request takes (batch_unit), its search's step

    @property
    def fits(self) -> bool:
        return self.per_device_batch_size >= 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": MAX_BATCH_SCHEMA, "max_per_device_batch_size": self.per_device_batch_size,
            "analytical_guess": self.analytical_guess, "compiles": self.compiles, "hit_limit": self.hit_limit,
            "smallest_per_device_batch_size": self.smallest,
            "trials": [t.__dict__ for t in self.trials], "fits": self.fits,
            **({"best": self.best.as_dict()} if self.best is not None else {}),
        }


def batch_unit(p: Request, overrides: Sequence[str], num_slices: int, limit: int = MAX_BATCH_LIMIT) -> int:
    """The smallest per_device_batch_size the request takes (a pipeline's microbatches, or gradient accumulation's,
    may need several rows a device to split into): every multiple of it splits too, so a search for the largest
    batch steps by it. The request's own error where none up to `limit` does."""
    refused = None
    for b in range(1, limit + 1):
        try:
            _with_batch(p, overrides, num_slices, b)
            return b
        except MaxperfError as e:
            refused = refused or e
    raise refused


def analytical_max_batch(p: Request, overrides: Sequence[str], num_slices: int, limit: int = MAX_BATCH_LIMIT,
                         unit: int | None = None) -> int:
    """The largest B that fits by perfmodel (0 when the smallest the request takes does not): bisection on the
    analytical total, which grows with B, over the multiples of `batch_unit` (`unit`, where the caller has it)."""
    unit = unit or batch_unit(p, overrides, num_slices, limit)

    def fits(k: int) -> bool:
        return analytical(_with_batch(p, overrides, num_slices, k * unit)).fits

    top = limit // unit
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= top and fits(hi):
        lo, hi = hi, hi * 2
    if hi > top:  # past the last multiple within the limit: that one, or the boundary below it
        if fits(top):
            return top * unit
        hi = top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def fractional_batch(p: Request, overrides: Sequence[str], num_slices: int) -> tuple[float, MemoryBreakdown] | None:
    """Where one sequence per device does not fit: the largest per_device_batch_size below 1 (1/2, 1/4, ..., down to
    one sequence for the whole mesh; MaxText takes fractions whose global batch is whole and splits over the batch
    axes) that fits by perfmodel, and its breakdown; None where none does or none is valid."""
    b = 0.5
    while b * p.mesh.devices >= 1:
        try:
            request = resolve(p.topology.name, p.model, [*overrides, f"per_device_batch_size={b:g}"],
                              num_slices=num_slices)
        except MaxperfError:
            request = None
        if request is not None and (found := analytical(request)).fits:
            return b, found
        b /= 2
    return None


def _with_batch(p: Request, overrides: Sequence[str], num_slices: int, b: int) -> Request:
    return resolve(p.topology.name, p.model, [*overrides, f"per_device_batch_size={b}"], num_slices=num_slices)


def max_batch(topology: str, model: str, overrides: Sequence[str] = (), *, num_slices: int = 1,
              analytical_only: bool = False, out: str | os.PathLike | None = None,
              progress: Progress | None = None, limit: int = MAX_BATCH_LIMIT, force: bool = False, cluster=None,
              keep_executables: bool = False) -> MaxBatch:
    """The largest per_device_batch_size whose step fits, by compiles: start at perfmodel's answer, then aim each
    next compile where a line through the compiler's figures (or perfmodel's slope, with one figure) crosses the
    device memory, always strictly inside the bracket (largest fitting, smallest failing), so it ends; with
    `out`, every trial's artifact is kept under out/batch-B. `cluster`: each compile a task of that Ray cluster."""
    p = resolve(topology, model, overrides, num_slices=num_slices)
    if out is not None and os.path.lexists(out) and not Path(out).is_dir():
        raise OutputRefused(f"--out {out} is a file; with --max-batch it is a directory of one artifact per trial")
    # in units of the smallest batch the request takes (batch_unit): k units are per_device_batch_size k x unit
    unit = batch_unit(p, overrides, num_slices, limit)
    guess = analytical_max_batch(p, overrides, num_slices, limit, unit)
    if analytical_only:
        best = compare(topology, model, [*overrides, f"per_device_batch_size={guess}"], num_slices=num_slices,
                       analytical_only=True) if guess else None
        return MaxBatch(guess, guess, 0, (), best, guess >= limit // unit * unit, unit)
    say = progress or (lambda _: None)
    top = limit // unit
    slope = (analytical(_with_batch(p, overrides, num_slices, 2 * unit)).per_device_total_bytes
             - analytical(_with_batch(p, overrides, num_slices, unit)).per_device_total_bytes)
    lo, hi = 0, top + 1  # lo fits (0: none known), hi does not (top + 1: none known)
    trials: list[Trial] = []  # in units while searching
    results: dict[int, MemoryComparison] = {}
    k = max(1, guess // unit)
    while True:
        b = k * unit
        say(f"compile {len(trials) + 1}: per_device_batch_size={b}")
        cmp = compare(topology, model, [*overrides, f"per_device_batch_size={b}"], num_slices=num_slices,
                      out=None if out is None else Path(out) / f"batch-{b}", progress=progress, force=force,
                      cluster=cluster, keep_executables=keep_executables)
        total = (cmp.compiler or {}).get("per_device_total_bytes")
        trials.append(Trial(k, cmp.fits, float(total) if total else None, cmp.compile_seconds or 0.0))
        results[k] = cmp
        if cmp.fits:
            lo = k
        else:
            hi = k
        if hi - lo <= 1:
            break
        k = _next_batch(trials, lo, hi, slope, cmp.hbm_bytes, top)
    found = tuple(Trial(t.per_device_batch_size * unit, t.fits, t.per_device_total_bytes, t.compile_seconds)
                  for t in trials)
    return MaxBatch(lo * unit, guess, len(trials), found, results.get(lo), lo >= top, unit)


def _next_batch(trials: Sequence[Trial], lo: int, hi: int, slope: float, hbm: float,
                top: int = MAX_BATCH_LIMIT) -> int:
    """Where the compiler's memory, as a line in B, crosses `hbm`, kept strictly inside (lo, hi): the line through
    the bracket's two figures when both are known, else through the last two, else perfmodel's slope through one."""
    points = {t.per_device_batch_size: t.per_device_total_bytes for t in trials if t.per_device_total_bytes}
    pair = [b for b in (lo, hi) if b in points]
    if len(pair) < 2:
        pair = [t.per_device_batch_size for t in trials if t.per_device_batch_size in points][-2:]
    if len(pair) == 2 and pair[0] != pair[1]:
        secant = (points[pair[1]] - points[pair[0]]) / (pair[1] - pair[0])
        slope = secant if secant > 0 else slope
    anchor = lo if lo in points else trials[-1].per_device_batch_size
    if anchor not in points or slope <= 0:  # no figure to aim with: bisect, or double while unbounded
        return (lo + hi) // 2 if hi <= top else max(2 * lo, lo + 1)
    b = math.floor(anchor + (hbm - points[anchor]) / slope)
    return min(max(b, lo + 1), hi - 1)


def scan_saved_bytes(optimized_hlo: str, num_layers: int, local_batch: int) -> int:
    """Bytes of the tensors a scanned step's forward keeps for its backward, read from the optimized HLO: the
    elements of the entry's first while loop (the forward scan over the layers) stacked per layer and example,
    [num_layers, local_batch, ...]; the scan's weights ([num_layers, D, ...]) and carries are not among them. The
    compiler's side of perfmodel's `activations`."""
    entry = optimized_hlo[optimized_hlo.index("\nENTRY "):]
    loop = next(line for line in entry.splitlines() if " while(" in line)
    shape = loop.split(" = ", 1)[1].split(" while(", 1)[0]
    total = 0
    for dtype, dims in re.findall(r"\b(bf16|f32|f16|s32|pred)\[([0-9,]+)\]", shape):
        sizes = [int(d) for d in dims.split(",")]
        if len(sizes) > 2 and sizes[0] == num_layers and sizes[1] == local_batch:
            total += math.prod(sizes) * _DTYPE_BYTES[dtype]
    return total


_DTYPE_BYTES = {"bf16": 2, "f32": 4, "f16": 2, "s32": 4, "pred": 1}
