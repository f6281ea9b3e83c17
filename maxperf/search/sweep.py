"""`maxperf sweep`: estimate (and compile) a model over a grid of topologies, slice counts and overrides.

Each point runs in a worker process, which writes `DIR/points/NAME/point.json` (atomically) beside its artifact as
soon as the point is done. A re-run skips a point whose point.json was made by the same request (model, analytical
or compiled, topology, slices, overrides, CPU calibration: its `key`) and did not end in an error, so a killed or
interrupted sweep resumes where it stopped, and a different request in the same directory recomputes. The table of
all points is written as `results.csv` and `results.parquet`. With `cluster`, the points are compiled as tasks of a
Ray cluster instead (maxperf.search.cluster), and written here as each one finishes.

Workers die with the sweep: SIGINT and SIGTERM end the running points at once (finished points stay), and a worker
whose parent is gone (even by SIGKILL) is killed by the kernel (Linux's PR_SET_PDEATHSIG) or ends itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts
from maxperf.perfmodel.calibration import StoredCalibration
from maxperf.spec.errors import MaxperfError
from maxperf.user_cache import load_calibration

# The longest name a point's directory takes: the file systems' limit is 255 bytes, and temporary names add to it
MAX_NAME = 200

POINT_SCHEMA = "maxperf.sweep-point/3"  # 2: `key`, what the resume compares; 3: B is one microbatch
SWEEP_SCHEMA = "maxperf.sweep/1"
RESULT_SCHEMA = "maxperf.sweep-result/1"  # `maxperf sweep --json`
HOST_BYTES_PER_COMPILE = 3 << 30  # peak host RSS seen per compile here (llama2-7b 1.5 GiB, 405B 1.8 GiB), with margin


@dataclass(frozen=True)
class Point:
    topology: str
    num_slices: int
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        """The point's directory name: its topology, slices and words; where that would pass the file systems' 255
        bytes, cut short and ended by a digest of the whole, so that distinct points keep distinct names."""
        words = "_".join(re.sub(r"[^A-Za-z0-9._=-]", "-", w) for w in self.overrides)
        name = "_".join(x for x in (self.topology, f"x{self.num_slices}" if self.num_slices > 1 else "", words) if x)
        if len(name) <= MAX_NAME:
            return name
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        return f"{name[:MAX_NAME - len(digest) - 1]}_{digest}"


class SweepInterrupted(MaxperfError):
    """SIGINT or SIGTERM ended the sweep; the points finished so far are kept. Exit code 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


@dataclass(frozen=True)
class SweepResult:
    out_dir: Path
    rows: list[dict[str, Any]]
    computed: int  # points run now (the rest were finished before)
    seconds: float
    cluster: dict[str, Any] | None = None  # the Ray cluster the points ran on (None: this machine's workers)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "error"]

    def as_dict(self) -> dict[str, Any]:
        return {"schema": RESULT_SCHEMA, "out_dir": str(self.out_dir), "points": len(self.rows),
                "computed": self.computed, "errors": len(self.errors), "seconds": self.seconds,
                "cluster": self.cluster, "rows": self.rows}


def point_key(model: str, point: Point, analytical_only: bool,
              calibration: StoredCalibration | None = None) -> dict[str, Any]:
    """Everything that decides a point's result: a point.json with another key is computed again (a user's step by
    the file that defines its factory too: the same words over changed code are another step)."""
    key = {"model": model, "analytical_only": analytical_only, "topology": point.topology,
           "num_slices": point.num_slices, "overrides": list(point.overrides),
           "calibration_sha256": calibration.sha256 if calibration is not None else None}
    if is_user_step(model):
        from maxperf.aot.user_step import source_digest
        from maxperf.spec.steps import parse_step

        key["step_source_sha256"] = source_digest(parse_step(model))
    return key


def is_user_step(model: str) -> bool:
    """A sweep of a user's step names its factory, MODULE:FACTORY, where a sweep of maxperf's names a preset."""
    return ":" in model


def grid(topologies: Sequence[str], num_slices: Sequence[int], axes: dict[str, Sequence[str]]) -> list[Point]:
    """Every point once: a topology, slice count or value given twice names one point (two of the same name would
    race on one directory)."""
    keys = list(axes)
    combos = list(itertools.product(*(dict.fromkeys(axes[k]) for k in keys))) or [()]
    return [Point(t, s, tuple(f"{k}={v}" for k, v in zip(keys, combo)))
            for t in dict.fromkeys(topologies) for s in dict.fromkeys(num_slices) for combo in combos]


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
    from maxperf import aot, perfmodel
    from maxperf.spec import request as planning
    from maxperf.spec.errors import DoesNotFit, Unserializable

    row = new_row(model, point, analytical_only, calibration)
    cpu_start = time.process_time()  # this process's CPU time, the compiler's threads included
    start = time.perf_counter()
    if is_user_step(model):  # a user's step (spec.steps): compiled, its step time read from its HLO
        from maxperf.search import user_points

        row.update(user_points.point(model, point, Path(directory) / "artifact"))
        row["seconds"] = time.perf_counter() - start
        _save_point(Path(directory), row)
        return row
    try:
        p = planning.resolve(point.topology, model, point.overrides, num_slices=point.num_slices)
        row["warnings"] = "; ".join(p.warnings)  # mesh axes that do not divide a dimension (spec.request)
        est = perfmodel.estimate(p,
                                 calibration=calibration)
        row.update(chips=p.topology.chips, devices=p.topology.num_devices, platform=p.topology.platform,
                   chip=p.topology.chip, global_batch=p.configs.train.global_batch(p.mesh.devices),
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
                               "flops_per_device"], artifact=str(Path(directory) / "artifact"),
                           hlo_step_time_s=((result.estimate or {}).get("hlo_time") or {}).get("step_time_s"))
                row["compile_cache_hit"] = result.cache_hit
                if not result.fits:
                    row.update(status="does not fit", reason="compiler memory exceeds HBM")
            except DoesNotFit as e:
                row.update(status="does not fit", reason=str(e), fits=False, artifact=str(Path(directory) / "artifact"))
            except Unserializable as e:  # compiled, its memory written: the verdict stands, only the executable is not
                memory = json.loads((Path(directory) / "artifact" / "memory.json").read_text())
                fits = memory["per_device_total_bytes"] <= memory["hbm_bytes"]
                row.update(compiler_memory_bytes=memory["per_device_total_bytes"], fits=fits,
                           artifact=str(Path(directory) / "artifact"), executable=False,
                           reason=str(e).split("; the compiler's memory")[0])
                if not fits:
                    row.update(status="does not fit")
            except artifacts.OutputRefused as e:  # the point's earlier artifact holds what a run wrote there
                row.update(status="error", reason=kept_artifact_reason(e))
        else:
            row["fits"] = est.fits
            if not est.fits:
                row.update(status="does not fit", reason="analytical memory exceeds HBM")
            # an earlier compile of this point (and what `maxperf run` wrote into it) stays: the row names it
            if (Path(directory) / "artifact" / "manifest.json").is_file():
                row["earlier_artifact"] = str(Path(directory) / "artifact")
    except MaxperfError as e:
        row.update(status="error", reason=str(e))
    except Exception as e:  # one broken point must not end the sweep
        row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    row.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start,
               host=socket.gethostname())
    _save_point(Path(directory), row)  # here, not in the parent: a finished point outlives a killed sweep
    return row


def kept_artifact_reason(e: artifacts.OutputRefused) -> str:
    """A point's row reason where its earlier artifact holds what `maxperf run` wrote there: the sweep keeps it."""
    return (f"{e}".split("; move them")[0] + "; the sweep does not replace it: move those files out of the point's "
            "artifact, or sweep into another --out")


def new_row(model: str, point: Point, analytical_only: bool,
            calibration: StoredCalibration | None = None) -> dict[str, Any]:
    """A point's row before it runs: what names it, and `key`, what a re-run compares."""
    return {"schema": POINT_SCHEMA, "point": point.name, "model": model, "topology": point.topology,
            "num_slices": point.num_slices, "overrides": " ".join(point.overrides), "status": "ok", "reason": None,
            "warnings": "", "key": json.dumps(point_key(model, point, analytical_only, calibration))}


def cpu_devices_needed(points: Sequence[Point]) -> int:
    """The most CPU devices a point of `points` compiles for (0: none is a CPU topology): a worker starts jax with
    as many, so that one worker can compile every point (jax's CPU device count is fixed once it starts)."""
    from maxperf.spec import topology

    counts = [0]
    for pt in points:
        try:
            topo = topology.get(pt.topology, pt.num_slices)
        except MaxperfError:  # not a catalog name (a user's step names its own): its point says why
            continue
        if topo.platform == "cpu":
            counts.append(topo.num_devices)
    return max(counts)


def _save_point(directory: Path, row: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".point.json.partial"
    tmp.write_text(json.dumps(row, indent=2) + "\n")
    os.replace(tmp, directory / "point.json")


def _finished(directory: Path, key: dict[str, Any]) -> bool:
    """Whether directory/point.json holds this request's result (not another model's, mode's or setting's); a point
    that ended in an error is tried again."""
    try:
        row = json.loads((directory / "point.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(row, dict) and row.get("schema") == POINT_SCHEMA and row.get("key") == json.dumps(key)
            and row.get("status") != "error")


def remove_partials(out_dir: Path, points: Sequence[Point]) -> None:
    """What compiles killed with their sweep had begun to write beside the points' artifacts (temporary directories,
    lock files), and the folders of points without a point.json: a point stopped after its artifact was in place but
    before its point.json was is not finished (a re-run computes it again), and its folder would disagree with the
    tables, which list the points with a point.json. A folder that holds anything else (what `maxperf run` wrote
    into the artifact, a user's files) stays, and its point says why when it is computed again."""
    for pt in points:
        directory = out_dir / "points" / pt.name
        for partial in directory.glob(".artifact.*.partial"):
            shutil.rmtree(partial, ignore_errors=True)
        artifacts.remove_stale_lock(directory / "artifact")
        if directory.is_dir() and not (directory / "point.json").exists() and _compiled_only(directory):
            shutil.rmtree(directory, ignore_errors=True)
    _remove_if_empty(out_dir / "points")


def _compiled_only(directory: Path) -> bool:
    """Whether a point's folder holds its compile's artifact and nothing else: the files its manifest lists."""
    if any(p.name != "artifact" for p in directory.iterdir()):
        return False
    artifact = directory / "artifact"
    if not artifact.exists():
        return True
    try:
        artifacts.claim_output(artifact, "compile")
    except artifacts.OutputRefused:
        return False
    return True


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty, or not there
        pass


# Workers: they ignore SIGINT (the sweep decides when they stop) and die with the sweep.
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _worker_init(parent_pid: int, cpu_devices: int = 0) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cpu_devices:
        from maxperf.aot import targets

        targets.ensure_cpu_devices(cpu_devices)
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):  # not Linux: watch the parent instead
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


class _Terminated(Exception):
    """SIGTERM, raised in the main thread like KeyboardInterrupt is for SIGINT."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _stop(pool: cf.ProcessPoolExecutor, futures) -> None:
    """Cancels what has not started and kills the running workers now, rather than letting them finish."""
    for future in futures:
        future.cancel()
    # ProcessPoolExecutor gains kill_workers() in Python 3.14; before, its processes are only in _processes.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.join(timeout=10)


def sweep(model: str, topologies: Sequence[str], *, num_slices: Sequence[int] = (1,),
          axes: dict[str, Sequence[str]] | None = None, analytical_only: bool = False, out: str | os.PathLike,
          workers: int | None = None, progress: Callable[[str], None] | None = None, cluster: str | None = None,
          keep_executables: bool = False) -> SweepResult:
    """Runs every point of the grid not already finished under `out`, and writes the results table. `cluster`: a
    Ray address (search.cluster.parse_address) whose nodes compile the points; `keep_executables`: their
    compiled.pkl comes home too, not only their JSON."""
    from maxperf.spec import presets
    from maxperf.spec import request as planning

    say = progress or (lambda _: None)
    if not topologies:
        raise MaxperfError("--topologies is empty; give a comma-separated list such as v5p-8,v5p-16,v5p-32")
    if cluster is not None and analytical_only:
        raise MaxperfError("--cluster sends compiles to Ray, and an --analytical-only sweep compiles nothing; drop "
                           "--cluster")
    points = grid(topologies, num_slices, axes or {})
    if is_user_step(model):
        from maxperf.search import user_points

        chips = user_points.check(model, points, analytical_only)
    else:
        presets.get(model)
        resolved = [planning.resolve(point.topology, model, point.overrides, num_slices=point.num_slices).topology
                    for point in points]  # every mistake in the grid is found before any work starts
        chips = {topo.chip for topo in resolved}
        # a compile of CPU devices in several processes needs those processes joined: a sweep's worker is one
        many = next((topo for topo in resolved if topo.platform == "cpu" and topo.hosts > 1), None)
        if many is not None and not analytical_only:
            raise MaxperfError(f"{many.name} compiles in {many.hosts} processes joined by jax.distributed (maxperf "
                               "compile --coordinator ...), not in a sweep's worker: sweep it with --analytical-only, "
                               "or compile it with maxperf compile")
    calibration = load_calibration() if "cpu" in chips else None  # loaded once: every point uses the same
    out_dir = Path(out)
    # before any work: a directory that is not an earlier sweep's is refused, and one sweep writes there at a time
    with _joined(cluster, model, points, out_dir, say) as session, artifacts.hold_output(out_dir, "sweep"):
        _check_same_model(out_dir, model)
        start = time.perf_counter()
        todo = [pt for pt in points
                if not _finished(out_dir / "points" / pt.name, point_key(model, pt, analytical_only, calibration))]
        say(f"{len(points)} points, {len(points) - len(todo)} already done, {len(todo)} to run")
        out_dir.mkdir(exist_ok=True)
        try:
            if todo:
                remove_partials(out_dir, todo)
                if session is not None:
                    session.run_points(model, todo, out_dir, analytical_only=analytical_only,
                                       calibration=calibration, keep_executables=keep_executables, progress=say,
                                       start=start)
                else:
                    run_points(model, todo, out_dir, analytical_only=analytical_only, calibration=calibration,
                               workers=workers or default_workers(len(todo)), progress=say, start=start)
        finally:  # interrupted or not, the tables say what points/ holds: this request's points, then earlier ones
            with _signals_held():  # a second Ctrl-C must not cut the tables short
                rows = _rows(out_dir, points, model, analytical_only, calibration)
                earlier = _earlier_rows(out_dir, points)
                _write_tables(out_dir, rows + earlier, model, analytical_only, partial=len(rows) < len(points))
    return SweepResult(out_dir, rows, len(todo), time.perf_counter() - start,
                       None if session is None else session.as_dict())


def _check_same_model(out_dir: Path, model: str) -> None:
    """An earlier sweep's directory takes more points of its own model (it resumes and grows; MaxText's name of a
    preset is the preset); another model's sweep there would replace its tables and the points of the same names:
    refused before any work."""
    from maxperf.spec import presets

    try:
        earlier = json.loads((out_dir / "sweep.json").read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        earlier = None
    if earlier is None:  # a sweep killed before its tables were written: its finished points say whose it is
        for path in sorted((out_dir / "points").glob("*/point.json")) if (out_dir / "points").is_dir() else ():
            try:
                earlier = json.loads(path.read_text()).get("model")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(earlier, str):
                break
            earlier = None
    if isinstance(earlier, str) and presets.canonical(earlier) != presets.canonical(model):
        raise MaxperfError(f"--out {out_dir} holds a sweep of {earlier}; give a new directory for {model} (a sweep "
                           "directory resumes and grows the sweep of its own model only)")


def _joined(address: str | None, model: str, points: Sequence[Point], out_dir: Path, say):
    """The Ray cluster at `address`, joined and checked (reachable, the same library versions on every node, room
    for each point's compile) before anything is written; None without an address."""
    if address is None:
        return contextlib.nullcontext()
    from maxperf.search import cluster

    artifacts.claim_output(out_dir, "sweep")  # a --out that would be refused is said before joining
    return cluster.connect(address, cluster.point_requests(model, points), progress=say)


def _rows(out_dir: Path, points: Sequence[Point], model: str, analytical_only: bool,
          calibration: StoredCalibration | None) -> list[dict[str, Any]]:
    """The finished points of this request (those that ended in an error included), in grid order."""
    rows = []
    for pt in points:
        row = _read_row(out_dir / "points" / pt.name / "point.json")
        if row is not None and row.get("key") == json.dumps(point_key(model, pt, analytical_only, calibration)):
            rows.append(row)
    return rows


def _read_row(path: Path) -> dict[str, Any] | None:
    """A point.json's row, or None where it is missing, unreadable or not a sweep point's."""
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return row if isinstance(row, dict) and row.get("schema") == POINT_SCHEMA else None


def _earlier_rows(out_dir: Path, points: Sequence[Point]) -> list[dict[str, Any]]:
    """The finished points of earlier requests into the same directory (other values, topologies or modes) that this
    request did not ask for, by name: the directory's tables list every point it holds."""
    asked = {pt.name for pt in points}
    directory = out_dir / "points"
    paths = sorted(directory.glob("*/point.json")) if directory.is_dir() else []
    rows = [_read_row(path) for path in paths if path.parent.name not in asked]
    return [row for row in rows if row is not None]


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM ignored while a sweep writes what it keeps (the main thread only can change them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_points(model: str, todo: list[Point], out_dir: Path, *, analytical_only: bool = False,
               calibration: StoredCalibration | None = None, workers: int = 1,
               progress: Callable[[str], None] | None = None, start: float | None = None) -> None:
    """Runs `todo` in `workers` processes, each point writing out_dir/points/NAME/point.json (a sweep's points, and
    `maxperf plan --verify`'s compiles); `start` is when the work began, for the time left said to `progress`. On
    SIGINT or SIGTERM kills them at once and raises SweepInterrupted."""
    say = progress or (lambda _: None)
    start = time.perf_counter() if start is None else start
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    futures: dict[cf.Future, Point] = {}
    done = 0
    try:
        pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_worker_init,
                                      initargs=(os.getpid(), 0 if analytical_only else cpu_devices_needed(todo)))
        # Workers start while the points are submitted: they begin with SIGINT ignored, so a Ctrl-C during their
        # start-up prints no traceback of theirs.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
        try:
            for pt in todo:
                futures[pool.submit(run_point, model, pt, str(out_dir / "points" / pt.name), analytical_only,
                                    calibration)] = pt
        finally:
            if in_main_thread:
                signal.signal(signal.SIGINT, previous_int)
        for done, future in enumerate(cf.as_completed(futures), 1):
            row = future.result()
            left = (time.perf_counter() - start) / done * (len(todo) - done)
            say(f"[{done}/{len(todo)}] {row['point']}: {row['status']}"
                f"{' (' + row['reason'] + ')' if row['reason'] else ''}; about {left:.0f} s left")
        pool.shutdown()
    except (KeyboardInterrupt, _Terminated) as e:
        with _signals_held():  # one interrupt can arrive twice (a terminal's Ctrl-C, `timeout -s INT`)
            _stop(pool, futures)
            remove_partials(out_dir, todo)
        signum = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
        finished = sum(_finished(out_dir / "points" / pt.name, point_key(model, pt, analytical_only, calibration))
                       for pt in todo)
        raise SweepInterrupted(f"interrupted by {signal.Signals(signum).name}: {finished} of {len(todo)} points "
                               f"finished now and kept in {out_dir}; run the same command again to resume",
                               signum) from None
    except BrokenProcessPool:
        _stop(pool, futures)
        raise MaxperfError(f"a sweep worker died (out of host memory? try --workers 1); the {done} points finished "
                           f"are kept in {out_dir}: run the same command again to resume") from None
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_term)


# The columns of a table with no finished point yet.
_FIRST_COLUMNS = ["point", "key", "model", "topology", "num_slices", "overrides", "status", "reason"]


def _write_tables(out_dir: Path, rows: list[dict[str, Any]], model: str, analytical_only: bool,
                  partial: bool = False) -> None:
    import pandas as pd

    if rows:
        frame = pd.DataFrame(rows).sort_values(["num_slices", "chips"] if "chips" in rows[0] else ["point"])
    else:
        frame = pd.DataFrame({name: pd.Series(dtype=object) for name in _FIRST_COLUMNS})
    for name, write in (("results.csv", lambda p: frame.to_csv(p, index=False)),
                        ("results.parquet", lambda p: frame.to_parquet(p, index=False))):
        tmp = out_dir / f".{name}.partial"
        write(tmp)
        os.replace(tmp, out_dir / name)
    summary = {"schema": SWEEP_SCHEMA, "model": model, "analytical_only": analytical_only, "points": len(rows),
               "partial": partial}
    tmp = out_dir / ".sweep.json.partial"
    tmp.write_text(json.dumps(artifacts.to_json(summary), indent=2) + "\n")
    os.replace(tmp, out_dir / "sweep.json")
