"""`maxperf sweep`: estimate (and compile) a model over a grid of topologies, slice counts and overrides.

Each point runs in a worker process and leaves `DIR/points/NAME/point.json` (written atomically) beside its
artifact; a re-run skips points whose point.json exists, so a killed sweep resumes where it stopped. The table of
all points is written as `results.csv` and `results.parquet`.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts
from maxperf.errors import MaxperfError
from maxperf.perfmodel.calibration import StoredCalibration
from maxperf.user_cache import load_calibration

POINT_SCHEMA = "maxperf.sweep-point/1"
SWEEP_SCHEMA = "maxperf.sweep/1"
HOST_BYTES_PER_COMPILE = 3 << 30  # peak host RSS seen per compile here (llama2-7b 1.5 GiB, 405B 1.8 GiB), with margin


@dataclass(frozen=True)
class Point:
    topology: str
    num_slices: int
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        words = "_".join(re.sub(r"[^A-Za-z0-9._=-]", "-", w) for w in self.overrides)
        return "_".join(x for x in (self.topology, f"x{self.num_slices}" if self.num_slices > 1 else "", words) if x)


@dataclass(frozen=True)
class SweepResult:
    out_dir: Path
    rows: list[dict[str, Any]]
    computed: int  # points run now (the rest were finished before)
    seconds: float


def grid(topologies: Sequence[str], num_slices: Sequence[int], axes: dict[str, Sequence[str]]) -> list[Point]:
    keys = list(axes)
    combos = list(itertools.product(*(axes[k] for k in keys))) or [()]
    return [Point(t, s, tuple(f"{k}={v}" for k, v in zip(keys, combo)))
            for t in topologies for s in num_slices for combo in combos]


def default_workers(points: int) -> int:
    """Bounded by the cores (XLA uses more than one thread per compile) and by host memory per compile."""
    cores = os.cpu_count() or 1
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(points, max(1, cores // 2), max(1, available // HOST_BYTES_PER_COMPILE)))


def run_point(model: str, point: Point, directory: str, analytical_only: bool,
              calibration: StoredCalibration | None = None) -> dict[str, Any]:
    """One grid point, in a worker: the estimate, then the compile; failures are recorded, not raised.
    `calibration`: what the sweep loaded once for its CPU points, so every point uses the same one."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from maxperf import aot, perfmodel, plan as planning
    from maxperf.errors import DoesNotFit

    row: dict[str, Any] = {"schema": POINT_SCHEMA, "point": point.name, "model": model, "topology": point.topology,
                           "num_slices": point.num_slices, "overrides": " ".join(point.overrides), "status": "ok",
                           "reason": None, "warnings": ""}
    start = time.perf_counter()
    try:
        p = planning.plan(point.topology, model, point.overrides, num_slices=point.num_slices)
        row["warnings"] = "; ".join(p.warnings)  # mesh axes that do not divide a dimension (plan.py)
        est = perfmodel.estimate(p.configs.model, p.configs.train, p.mesh_shape.axes, p.mesh_shape.dcn, p.topology,
                                 calibration=calibration)
        row.update(chips=p.topology.chips, devices=p.topology.num_devices, platform=p.topology.platform,
                   chip=p.topology.chip, global_batch=p.configs.train.per_device_batch_size * p.topology.num_devices,
                   seq_len=p.configs.train.seq_len, hbm_bytes=est.memory.hbm_bytes,
                   predicted_step_time_s=est.step_time_s, predicted_tokens_per_s=est.tokens_per_s,
                   predicted_tflops_per_chip=est.tflops_per_chip, predicted_mfu=est.mfu,
                   analytical_memory_bytes=est.memory_per_device_bytes, analytical_fits=est.fits,
                   bottleneck=est.bottleneck)
        if not analytical_only:
            try:
                result = aot.compile(p.topology, model, point.overrides, out=Path(directory) / "artifact",
                                     calibration=calibration)
                row.update(compiler_memory_bytes=result.memory["per_device_total_bytes"], fits=result.fits,
                           compile_seconds=result.compile_seconds, compiler_flops_per_device=result.cost[
                               "flops_per_device"], artifact=str(Path(directory) / "artifact"))
                if not result.fits:
                    row.update(status="does not fit", reason="compiler memory exceeds HBM")
            except DoesNotFit as e:
                row.update(status="does not fit", reason=str(e), fits=False, artifact=str(Path(directory) / "artifact"))
        else:
            row["fits"] = est.fits
            if not est.fits:
                row.update(status="does not fit", reason="analytical memory exceeds HBM")
    except MaxperfError as e:
        row.update(status="error", reason=str(e))
    except Exception as e:  # one broken point must not end the sweep
        row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    row["seconds"] = time.perf_counter() - start
    return row


def _save_point(directory: Path, row: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".point.json.partial"
    tmp.write_text(json.dumps(row, indent=2) + "\n")
    os.replace(tmp, directory / "point.json")


def sweep(model: str, topologies: Sequence[str], *, num_slices: Sequence[int] = (1,),
          axes: dict[str, Sequence[str]] | None = None, analytical_only: bool = False, out: str | os.PathLike,
          workers: int | None = None, progress: Callable[[str], None] | None = None) -> SweepResult:
    """Runs every point of the grid not already finished under `out`, and writes the results table."""
    from maxperf import plan as planning
    from maxperf.models import presets

    say = progress or (lambda _: None)
    if not topologies:
        raise MaxperfError("--topologies is empty; give a comma-separated list such as v5p-8,v5p-16,v5p-32")
    presets.get(model)
    points = grid(topologies, num_slices, axes or {})
    chips = {planning.plan(point.topology, model, point.overrides, num_slices=point.num_slices).topology.chip
             for point in points}  # every mistake in the grid is found before any work starts
    calibration = load_calibration() if "cpu" in chips else None  # loaded once: every point uses the same
    out_dir = Path(out)
    start = time.perf_counter()
    todo = [pt for pt in points if not (out_dir / "points" / pt.name / "point.json").is_file()]
    say(f"{len(points)} points, {len(points) - len(todo)} already done, {len(todo)} to run")
    if todo:
        n = workers or default_workers(len(todo))
        context = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=n, mp_context=context) as pool:
            futures = {pool.submit(run_point, model, pt, str(out_dir / "points" / pt.name), analytical_only,
                                   calibration): pt for pt in todo}
            for done, future in enumerate(cf.as_completed(futures), 1):
                row = future.result()
                _save_point(out_dir / "points" / futures[future].name, row)
                elapsed = time.perf_counter() - start
                left = elapsed / done * (len(todo) - done)
                say(f"[{done}/{len(todo)}] {row['point']}: {row['status']}"
                    f"{' (' + row['reason'] + ')' if row['reason'] else ''}; about {left:.0f} s left")
    rows = [json.loads((out_dir / "points" / pt.name / "point.json").read_text()) for pt in points]
    _write_tables(out_dir, rows, model, analytical_only)
    return SweepResult(out_dir, rows, len(todo), time.perf_counter() - start)


def _write_tables(out_dir: Path, rows: list[dict[str, Any]], model: str, analytical_only: bool) -> None:
    import pandas as pd

    frame = pd.DataFrame(rows).sort_values(["num_slices", "chips"] if "chips" in rows[0] else ["point"])
    for name, write in (("results.csv", lambda p: frame.to_csv(p, index=False)),
                        ("results.parquet", lambda p: frame.to_parquet(p, index=False))):
        tmp = out_dir / f".{name}.partial"
        write(tmp)
        os.replace(tmp, out_dir / name)
    summary = {"schema": SWEEP_SCHEMA, "model": model, "analytical_only": analytical_only, "points": len(rows)}
    tmp = out_dir / ".sweep.json.partial"
    tmp.write_text(json.dumps(artifacts.to_json(summary), indent=2) + "\n")
    os.replace(tmp, out_dir / "sweep.json")
