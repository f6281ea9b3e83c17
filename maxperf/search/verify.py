"""`maxperf plan --verify K`: the best candidates of a search compiled, until K fit by the compiler.

The compiles run as a sweep's points (its worker pool, or a Ray cluster's tasks; point.json and resume). A compile
that needs more memory than perfmodel said raises the margin to the error it measured, and the search runs again
under it before the next compile, so a model perfmodel underestimates does not cost a compile per near-identical
candidate.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from maxperf.search import sweep
from maxperf.search.candidates import Candidate
from maxperf.search.margin import Margin
from maxperf.search.plan import GIB, SearchResult, rank, search
from maxperf.spec.logical_axes import MESH_AXES
from maxperf.user_cache import load_calibration

MAX_COMPILES_PER_FIT = 4  # verification gives up after K x this many compiles
FSDP_FAMILY = ("fsdp", "fsdp_transpose")  # mesh axes of one role: layout_family


def verify(result: SearchResult, k: int, out: str | os.PathLike, workers: int | None = None,
           progress: Callable[[str], None] | None = None, cluster=None,
           keep_executables: bool = False) -> SearchResult:
    """Compiles the best candidates in worker processes (with `cluster`, a connected search.cluster.Cluster: as its
    tasks), K at a time, dropping those the compiler says do not fit and compiling the next, until K fit; the
    compiler's memory replaces perfmodel's and the candidates are ranked again."""
    say = progress or (lambda _: None)
    start = time.perf_counter()
    out_dir = Path(out)
    compiled: dict[tuple[str, ...], Candidate] = {}  # by overrides: what the compiler said, kept across re-searches
    budget = k * MAX_COMPILES_PER_FIT
    calibration = load_calibration() if result.platform == "cpu" else None
    while True:
        verified = [c for c in result.candidates if c.verified]
        want = k - len(verified)
        todo = distinct_layouts([c for c in result.fitting if c.overrides() not in compiled], compiled.values(),
                                want)
        if want <= 0 or not todo or result.compiles >= budget:
            break
        todo = todo[:budget - result.compiles]
        points = {_point(result, c): c for c in todo}
        say(f"compiling {len(points)} candidate(s): " + "; ".join(c.mesh_shown() for c in todo))
        if cluster is not None:
            cluster.run_points(result.request.model, list(points), out_dir, calibration=calibration,
                               keep_executables=keep_executables, progress=say)
        else:
            sweep.run_points(result.request.model, list(points), out_dir, calibration=calibration,
                             workers=workers or sweep.default_workers(len(points)), progress=say)
        for point, c in points.items():
            compiled[c.overrides()] = c
            row = json.loads((out_dir / "points" / point.name / "point.json").read_text())
            result.compiles += 1
            if row["status"] == "error":  # recorded, and the next candidate compiled in its place
                c.verified, c.compile_error = False, f"compile failed: {row['reason']}"
                continue
            c.verified = bool(row.get("fits"))
            c.compiler_memory_bytes = row.get("compiler_memory_bytes")
            if c.compiler_memory_bytes is None and not c.verified:
                c.compiler_memory_bytes = memory_from_artifact(row.get("artifact"))
            c.compile_seconds, c.artifact = row.get("compile_seconds"), row.get("artifact")
        if raise_margin(result, [c for c in points.values() if c.compiler_memory_bytes and c.memory_bytes]):
            # the orderings that spared estimates held under the old margin: search again under the new one
            say(f"margin raised to {result.margin.value:.1%}; searching again")
            search_again(result, compiled, progress)
        rank(result)
    if result.compiles >= budget and len([c for c in result.candidates if c.verified]) < k:
        result.notes.append(f"verification stopped after {result.compiles} compiles ({MAX_COMPILES_PER_FIT} per "
                            f"requested fit)")
    if not any(c.verified for c in result.candidates) and result.compiles:
        result.notes.append("no compiled candidate fits")
        for c in result.candidates:
            if c.status == "chosen":
                c.status, c.reason = "slower", "not verified: every compiled candidate failed to fit"
    result.verify_seconds += time.perf_counter() - start
    return result


def layout_family(c: Candidate) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A candidate's mesh with the axes that play one role taken together: fsdp and fsdp_transpose both shard the
    weights and the batch over their product (they differ only in which weight dim each splits, and perfmodel and
    the compiler move the same bytes for either), so fsdp=2 x fsdp_transpose=16, fsdp=8 x fsdp_transpose=4 and
    fsdp=32 are one family; its ICI and DCN sizes per role."""
    def roles(sizes: dict[str, int]) -> tuple[int, ...]:
        return (*(sizes.get(a, 1) for a in MESH_AXES if a not in FSDP_FAMILY),
                math.prod(sizes.get(a, 1) for a in FSDP_FAMILY))

    return roles(c.ici), roles(c.dcn)


def distinct_layouts(ranked: list[Candidate], done, want: int) -> list[Candidate]:
    """The first `want` of `ranked` that prove different layouts, not near-twins of one: first one candidate per
    layout family (layout_family) not yet compiled (`done`), then one per mesh not yet compiled within a family
    already taken, then the rest, each tier in ranked order."""
    families = {layout_family(c) for c in done}
    meshes = {c.mesh_shown() for c in done}
    first, second, again = [], [], []
    for c in ranked:
        family, mesh = layout_family(c), c.mesh_shown()
        (first if family not in families else second if mesh not in meshes else again).append(c)
        families.add(family)
        meshes.add(mesh)
    return (first + second + again)[:want]


def search_again(result: SearchResult, compiled: dict[tuple[str, ...], Candidate], progress) -> None:
    """The search under the result's (raised) margin, with what the compiler said of each candidate kept."""
    again = search(result.request, progress, margin=result.margin)
    for i, c in enumerate(again.candidates):
        if (done := compiled.get(c.overrides())) is not None:
            again.candidates[i] = done
    result.candidates, result.closest_miss = again.candidates, again.closest_miss
    result.search_seconds += again.search_seconds


def raise_margin(result: SearchResult, compiled: list[Candidate]) -> bool:
    """A compile measures perfmodel's memory error on this very model and topology: where it exceeds the margin,
    the margin becomes it, so that the candidates ranked next are those that fit by the error just seen. Whether
    it rose."""
    worst = max(compiled, key=lambda c: c.compiler_memory_bytes / c.memory_bytes, default=None)
    if worst is None:
        return False
    error = worst.compiler_memory_bytes / worst.memory_bytes - 1
    if error <= result.margin.value:
        return False
    result.notes.append(f"margin raised from {result.margin.value:.1%} to {error:.1%}: the compiler gave "
                        f"{worst.compiler_memory_bytes / GIB:.2f} GiB for {worst.mesh_shown()} {worst.remat_policy} "
                        f"A={worst.grad_accum_steps}, perfmodel {worst.memory_bytes / GIB:.2f} GiB")
    result.margin = Margin(error, f"measured by this plan's compile of {worst.mesh_shown()} (was "
                                  f"{result.margin.value:.1%}: {result.margin.source})")
    return True


def memory_from_artifact(artifact: str | None) -> float | None:
    """A compile that does not fit records its figures in memory.json before raising."""
    if not artifact:
        return None
    try:
        return float(json.loads((Path(artifact) / "memory.json").read_text())["per_device_total_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prune_points(result: SearchResult, out: str | os.PathLike) -> list[str]:
    """Removes from `out`/points what an earlier plan into the same directory compiled and this one did not (a
    re-plan may resume its compiles there, so they are kept until this plan is written), and returns their names:
    plan.json and points/ then describe the same compiles."""
    directory = Path(out) / "points"
    if not directory.is_dir():
        return []
    kept = {_point(result, c).name for c in result.candidates if c.verified is not None or c.compile_error}
    stale = sorted(p.name for p in directory.iterdir() if p.is_dir() and p.name not in kept)
    for name in stale:
        shutil.rmtree(directory / name, ignore_errors=True)
    sweep._remove_if_empty(directory)
    return stale


def _point(result: SearchResult, c: Candidate) -> sweep.Point:
    """The sweep point a candidate compiles as (its directory under out/points)."""
    return sweep.Point(result.topology_name, result.request.num_slices, (*result.fixed, *c.overrides()))

