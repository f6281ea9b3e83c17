"""Compiles on a Ray cluster (`--cluster`), for sweeps, `maxperf plan --verify` and `estimate-memory`, when one
machine is not enough. Ray schedules; maxperf only says what each compile needs.

    with cluster.connect("ray://head:10001", [request, ...]) as c:   # checks every node first
        c.run_points(model, points, out_dir, ...)                      # a sweep's points, as sweep.run_points

- Each compile is a Ray task that declares the CPUs and host memory it needs (`host_memory.compile_host_bytes`), so
  Ray never runs more compiles on a node than fit; one that no node could hold is refused before any work.
- Every node's library versions must equal this machine's (jax, jaxlib, libtpu, the CUDA plugins, flax, optax,
  maxperf): they are checked on every node before any task runs, and again by each task where it lands (a node that
  joined later).
- Results come home: each point's JSON files (with `keep_executables`, its whole artifact, compiled.pkl included) are
  written into `out` on this machine, atomically, as each task finishes, so a re-run resumes as a local sweep does.
- Ray resubmits a task whose worker or node died (MAX_RETRIES); a point started MAX_ATTEMPTS times, or that Ray gave
  up on, is recorded as an error with its reason.
- The compile cache is shared: an actor on this machine's node (`Home`) serves this machine's cache directory to
  every task, which asks it for its key after its own node's cache misses and stores there what it compiles.
- Ctrl-C or SIGTERM cancels the tasks (their workers are killed) and keeps the finished points.

Nothing here imports ray until `connect` is called.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts
from maxperf.search import host_memory
from maxperf.spec.errors import DoesNotFit, MaxperfError, Terminated, was_terminated

MAX_RETRIES = 3  # Ray resubmits a task this many times when its worker process or its node dies
MAX_ATTEMPTS = MAX_RETRIES + 1  # a point started this often is recorded as failed (out-of-memory kills retry forever)
CONNECT_TIMEOUT_S = 10.0  # to open a TCP connection to the address, before Ray is asked to join
PROBE_TIMEOUT_S = 120.0  # for every node to answer the version check
CACHE_TIMEOUT_S = 600.0  # for the shared cache to hand over or store one entry
POLL_S = 2.0  # how often progress asks which points have started
# The libraries a compiled step depends on: the same versions everywhere, or a node's compiles differ from this
# machine's (and its executables do not load where this machine's do). Ray itself checks Python's and its own.
MUST_MATCH = ("maxperf", "jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
              "jax-cuda13-pjrt", "flax", "optax")
# This machine's settings that change what is compiled (or whether the cache is used), given to every task.
FORWARDED_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "MAXPERF_NO_CACHE")
INSTALL_HINT = "pip install 'maxperf[cluster]'"

Progress = Callable[[str], None]


class ClusterRefused(MaxperfError):
    """The cluster cannot take the work: unreachable, too small for a compile, or a node with other library versions.
    Exit code 2 (bad input); said before any task runs."""


class ClusterFailed(MaxperfError):
    """The cluster failed under a running sweep (its connection lost). Exit code 1."""

    exit_code = 1


def parse_address(text: str) -> tuple[str, tuple[str, int] | None]:
    """(what ray.init is given, (host, port) to reach first or None): `ray` is the cluster this machine belongs to
    (RAY_ADDRESS, else the local node's), `ray://HOST:PORT` a head's Ray Client server, `HOST:PORT` a head's GCS
    address, joined from a machine that is a node of the cluster."""
    text = text.strip()
    if text == "ray":
        return "auto", None
    rest = text.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
        raise ClusterRefused(f"--cluster {text!r} is not a Ray address; give ray (the cluster this machine is a node "
                             "of), ray://HOST:PORT (a head's Ray Client server, port 10001 by default) or HOST:PORT "
                             "(a head's GCS address, from a node of the cluster)")
    return text, (host, int(port))


def node_versions() -> dict[str, str | None]:
    """This machine's versions of the libraries in MUST_MATCH (None: not installed)."""
    versions: dict[str, str | None] = {}
    for name in MUST_MATCH:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def version_mismatch(mine: dict[str, str | None], theirs: dict[str, str | None], where: str) -> str | None:
    """One line naming the libraries whose versions differ on `where`, or None when they all match."""
    differ = [f"{name} {theirs.get(name) or 'missing'} (here {mine.get(name) or 'missing'})" for name in MUST_MATCH
              if theirs.get(name) != mine.get(name)]
    if not differ:
        return None
    return (f"{where} has other library versions than this machine: {', '.join(differ)}; every node needs this "
            "machine's jax, jaxlib, libtpu, CUDA plugin, flax, optax and maxperf")


@dataclass(frozen=True)
class Node:
    node_id: str
    host: str  # the node's hostname, as its worker reports it
    address: str  # the node's IP address, as Ray knows it
    cpus: float
    memory_bytes: float  # Ray's `memory` resource: what tasks may declare on this node

    @property
    def shown(self) -> str:
        return f"{self.host} ({self.address}, node {self.node_id[:8]})"


@dataclass(frozen=True)
class Need:
    """What one compile task declares to Ray."""

    cpus: int
    memory_bytes: int


@dataclass
class Cluster:
    """A connected cluster whose nodes were checked; `close()` (or leaving the `with`) disconnects, which ends every
    task this connection started."""

    address: str
    nodes: list[Node]
    versions: dict[str, str | None]
    cpus_per_compile: int
    connect_seconds: float
    home: Any = None  # the Home actor
    _ray: Any = None
    _forwarded: dict[str, str] = field(default_factory=dict)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._ray is not None and self._ray.is_initialized():
            self._ray.shutdown()

    def as_dict(self) -> dict[str, Any]:
        return {"address": self.address, "nodes": [n.shown for n in self.nodes],
                "cpus_per_compile": self.cpus_per_compile, "connect_seconds": round(self.connect_seconds, 3)}

    def need(self, request) -> Need:
        """A compile of `request` (a spec Request, or None for a step maxperf cannot size: a user's step)."""
        return Need(self.cpus_per_compile, host_memory.compile_host_bytes(request))

    def check_fits(self, named: Sequence[tuple[str, Any]]) -> None:
        """Refuses (exit 2) when some compile of `named` ((name, request)) needs more host memory than any node
        offers."""
        check_fits(self.nodes, self.cpus_per_compile, named)

    # -- a sweep's points -----------------------------------------------------------------------------------------

    def run_points(self, model: str, todo: list, out_dir: Path, *, analytical_only: bool = False,
                   calibration=None, keep_executables: bool = False, progress: Progress | None = None,
                   start: float | None = None) -> None:
        """Runs `todo` (sweep.Points) as Ray tasks and writes each one's point.json and artifact under
        out_dir/points/NAME as it finishes; on SIGINT or SIGTERM cancels them and raises SweepInterrupted."""
        from maxperf.search import sweep

        ray = self._ray
        say = progress or (lambda _: None)
        start = time.perf_counter() if start is None else start
        named = point_requests(model, todo)
        self.check_fits(named)
        cpu_devices = 0 if analytical_only else sweep.cpu_devices_needed(todo)
        remote = ray.remote(_run_point_task)
        pending: dict[Any, Any] = {}
        by_name = {pt.name: pt for pt in todo}
        done = failed = 0
        seen: dict[str, int] = {}
        previous = _raise_on_sigterm()
        try:
            for pt, (_, request) in zip(todo, named):
                need = self.need(request)
                ref = remote.options(num_cpus=need.cpus, memory=need.memory_bytes, max_retries=MAX_RETRIES,
                                     retry_exceptions=False, name=f"maxperf point {pt.name}").remote(
                    model, pt, analytical_only, calibration, keep_executables, cpu_devices, self.versions, self.home)
                pending[ref] = pt
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                starts = self._starts()
                for name, attempts in starts.items():
                    if attempts and seen.get(name, 0) < len(attempts) and name in by_name:
                        node_id, host = attempts[-1]
                        again = (f" (attempt {len(attempts)} of at most {MAX_ATTEMPTS}: the worker or node of the "
                                 "attempt before was lost)" if len(attempts) > 1 else "")
                        say(f"{name}: started on {host} (node {node_id[:8]}){again}")
                        seen[name] = len(attempts)
                for ref in ready:
                    pt = pending.pop(ref)
                    outcome = self._outcome(ref, pt, starts.get(pt.name, []))
                    row = outcome.get("row") or sweep.new_row(model, pt, analytical_only, calibration)
                    if outcome.get("refused"):
                        raise ClusterRefused(outcome["refused"])
                    if outcome.get("lost"):
                        row.update(status="error", reason=outcome["lost"])
                    row = self._bring_home(out_dir / "points" / pt.name, row, outcome, keep_executables)
                    _save_row(out_dir / "points" / pt.name, row)
                    done += 1
                    failed += row["status"] == "error"
                    running = sum(1 for p in pending.values() if starts.get(p.name))
                    left = (time.perf_counter() - start) / done * (len(todo) - done)
                    say(f"[{done}/{len(todo)}] {row['point']}: {row['status']}"
                        f"{' (' + row['reason'] + ')' if row['reason'] else ''} on {row.get('host', '?')}; "
                        f"{running} running, {failed} failed; about {left:.0f} s left")
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM as Terminated
            self._cancel(pending)
            sweep.remove_partials(out_dir, todo)
            signum = signal.SIGTERM if was_terminated(e) else signal.SIGINT
            finished = done
            raise sweep.SweepInterrupted(f"interrupted by {signal.Signals(signum).name}: {finished} of {len(todo)} "
                                         f"points finished now and kept in {out_dir}; run the same command again to "
                                         "resume", signum) from None
        except BaseException:
            self._cancel(pending)
            raise
        finally:
            _restore_sigterm(previous)

    # -- one compile (estimate-memory) ----------------------------------------------------------------------------

    def compile_memory(self, request, model: str, overrides: Sequence[str], num_slices: int, *,
                       out: Path | None = None, force: bool = False, keep_executables: bool = False,
                       progress: Progress | None = None) -> tuple[dict[str, Any], float, bool]:
        """memory.json, compile seconds and cache hit of one compile on the cluster (`aot.compile`'s, whether or not
        the step fits); its artifact written to `out` when given (its JSON, or with `keep_executables` all of it)."""
        ray = self._ray
        say = progress or (lambda _: None)
        self.check_fits([(f"{request.topology.name} {' '.join(overrides)}".strip(), request)])
        if out is not None:
            artifacts.claim_output(Path(out), "compile", force=force)  # refused before the compile, as locally
        need = self.need(request)
        remote = ray.remote(_compile_task)
        previous = _raise_on_sigterm()
        ref = remote.options(num_cpus=need.cpus, memory=need.memory_bytes, max_retries=MAX_RETRIES,
                             retry_exceptions=False).remote(request.topology.name, model, list(overrides), num_slices,
                                                            keep_executables, self.versions, self.home)
        try:
            outcome = self._outcome(ref, None, [])
        except BaseException:
            self._cancel({ref: None})
            raise
        finally:
            _restore_sigterm(previous)
        if outcome.get("refused"):
            raise ClusterRefused(outcome["refused"])
        if outcome.get("lost"):
            raise ClusterFailed(outcome["lost"])
        if outcome.get("error"):
            error = MaxperfError(outcome["error"])
            error.exit_code = outcome.get("exit_code", 1)
            raise error
        say(f"compiled on {outcome['host']} (node {outcome['node_id'][:8]})")
        if out is not None:
            _write_artifact(Path(out), outcome["files"], force=force)
        return outcome["memory"], outcome["compile_seconds"], outcome["cache_hit"]

    # -- helpers --------------------------------------------------------------------------------------------------

    def _starts(self) -> dict[str, list[tuple[str, str]]]:
        try:
            return self._ray.get(self.home.starts.remote(), timeout=CACHE_TIMEOUT_S)
        except self._ray.exceptions.RayError:
            return {}

    def _outcome(self, ref, point, attempts) -> dict[str, Any]:
        """What a finished task returned, or `lost` (why Ray gave up on it) when it raised."""
        ray = self._ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # raised inside the task: maxperf's code could not run there
            cause = e.cause if getattr(e, "cause", None) is not None else e
            return {"lost": f"failed on the cluster: {type(cause).__name__}: {_first_line(cause)}"}
        except ray.exceptions.RayError as e:  # worker or node lost beyond the retries, or cancelled
            tried = f" after {len(attempts)} attempts" if attempts else ""
            return {"lost": f"lost on the cluster{tried}: {type(e).__name__}: {_first_line(e)}"}

    def _bring_home(self, directory: Path, row: dict[str, Any], outcome: dict[str, Any], keep: bool) -> dict:
        row = dict(row)
        for name in ("host", "node_id", "attempts"):
            if name in outcome:
                row[name] = outcome[name]
        files = outcome.get("files")
        if files:
            try:  # as a local sweep: an earlier artifact holding what `maxperf run` wrote there is not replaced
                _write_artifact(directory / "artifact", files, force=False)
            except artifacts.OutputRefused as e:
                from maxperf.search import sweep

                row.update(status="error", artifact=str(directory / "artifact"),
                           reason=sweep.kept_artifact_reason(e))
                return row
            row.update(artifact=str(directory / "artifact"), artifact_files="all" if keep else "json")
        elif row.get("artifact"):  # the task's path on its node means nothing here
            row["artifact"] = None
        return row

    def _cancel(self, pending: dict) -> None:
        """Cancels the tasks not finished: Ray kills the workers running them."""
        ray = self._ray
        for ref in list(pending):
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already finished, or the connection is gone
                pass


def check_fits(nodes: Sequence[Node], cpus: int, named: Sequence[tuple[str, Any]]) -> None:
    able = [n for n in nodes if n.cpus >= cpus]
    largest = max(able, key=lambda n: n.memory_bytes, default=None)
    for name, request in named:
        need = host_memory.compile_host_bytes(request)
        if largest is None or need > largest.memory_bytes:
            biggest = (f"the largest is {largest.memory_bytes / 2**30:.2f} GiB on {largest.shown}" if largest
                       else f"no node has {cpus} CPUs")
            raise ClusterRefused(f"{name} needs about {need / 2**30:.2f} GiB of host memory to compile "
                                 f"({host_memory.SOURCE}), more than any node of the cluster offers ({biggest}); "
                                 "give the nodes more memory (ray start --memory) or leave the point out")


def connect(address: str, requests: Sequence[tuple[str, Any]] = (), *, progress: Progress | None = None) -> Cluster:
    """Joins the cluster at `address` (see parse_address) and checks it before any work: every node's library
    versions, and room on some node for the compile of each (name, request) in `requests`. Refusals raise
    ClusterRefused (exit 2)."""
    say = progress or (lambda _: None)
    start = time.perf_counter()
    target, reach = parse_address(address)
    try:
        import ray
    except ImportError:
        raise ClusterRefused(f"--cluster needs Ray on this machine and on every node: {INSTALL_HINT}") from None
    if reach is not None:
        _answers(*reach, client=target.startswith("ray://"))
    forwarded = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    say(f"joining the Ray cluster at {address}")
    previous = signal.getsignal(signal.SIGTERM) if _main_thread() else None
    try:
        with warnings.catch_warnings():  # Ray Client warns before it raises; the refusal says it in one line
            warnings.simplefilter("ignore")
            ray.init(address=target, logging_level=logging.ERROR, log_to_driver=False,
                     runtime_env={"env_vars": forwarded} if forwarded else None)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        where = "here: start one (ray start --head) or give its address" if target == "auto" else f"at {address}"
        raise ClusterRefused(f"cannot join the Ray cluster {where} ({_first_line(e)})") from None
    finally:
        if previous is not None:  # ray.init makes SIGTERM exit at once; a sweep cancels its tasks first
            signal.signal(signal.SIGTERM, previous)
    _quiet_driver()
    try:
        cluster = _check(ray, address, forwarded, say)
        cluster.check_fits(requests)
        cluster.connect_seconds = time.perf_counter() - start
        return cluster
    except BaseException:
        ray.shutdown()
        raise


def _quiet_driver() -> None:
    """Ray's driver prints the cluster's messages to it (a task to be retried, a node marked dead) on stdout, where
    the command's output goes (one JSON document with --json): they are dropped, and progress says the same in one
    line (a point started again, its attempt). MAXPERF_DEBUG=1 sends them to stderr instead."""
    try:
        from ray._private import worker
    except ImportError:
        return
    original = getattr(worker, "print_to_stdstream", None)
    if original is None or getattr(original, "maxperf", False):
        return

    def to_stderr_or_nowhere(data, ignore_prefix):
        if os.environ.get("MAXPERF_DEBUG"):
            original({**data, "is_err": True}, ignore_prefix)

    to_stderr_or_nowhere.maxperf = True
    worker.print_to_stdstream = to_stderr_or_nowhere


def _answers(host: str, port: int, *, client: bool) -> None:
    """Refuses an address where no Ray server answers, within CONNECT_TIMEOUT_S: ray.init would wait for ever on a
    GCS address that does not answer (it retries), and 30 s on a Ray Client address."""
    import grpc

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterRefused(f"cannot reach the Ray cluster at {where} ({e.strerror or type(e).__name__})") from None
    with grpc.insecure_channel(where) as channel:
        try:
            if client:  # a Ray Client server: a gRPC server at least
                grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
            else:  # a head's GCS: it tells its cluster id
                from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError:
            raise ClusterRefused(f"no Ray Client server answers at {where} within {CONNECT_TIMEOUT_S:.0f} s "
                                 "(a head's Ray Client server listens on port 10001 unless told otherwise)") from None
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:  # a GCS that wants a token is a GCS: ray.init says more
                raise ClusterRefused(f"no Ray cluster answers at {where} ({e.code().name}); give its head's GCS "
                                     "address (port 6379 unless told otherwise) or ray://HOST:PORT") from None


def _check(ray, address: str, forwarded: dict[str, str], say: Progress) -> Cluster:
    """Every alive node answers with its versions (a task pinned to it that asks for no CPU); one that differs from
    this machine, cannot run maxperf or does not answer is refused."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    mine = node_versions()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    probe = ray.remote(_probe)
    refs = {probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(): n for n in alive}
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    for ref in late:
        n = refs[ref]
        if _alive_node(ray, n["NodeID"]):
            raise ClusterRefused(f"node {n.get('NodeManagerAddress')} ({n['NodeID'][:8]}) did not answer the "
                                 f"version check within {PROBE_TIMEOUT_S:.0f} s")
    nodes = []
    for ref in ready:
        n = refs[ref]
        try:
            answer = ray.get(ref)
        except ray.exceptions.RayError as e:
            if not _alive_node(ray, n["NodeID"]):  # it left the cluster meanwhile: no task goes there
                say(f"node {n.get('NodeManagerAddress')} ({n['NodeID'][:8]}) left the cluster")
                continue
            cause = getattr(e, "cause", None) or e
            raise ClusterRefused(f"node {n.get('NodeManagerAddress')} ({n['NodeID'][:8]}) cannot run maxperf "
                                 f"({type(cause).__name__}: {_first_line(cause)}); install this machine's maxperf "
                                 "and libraries there") from None
        node = Node(n["NodeID"], answer["host"], n.get("NodeManagerAddress", "?"), float(n["Resources"].get("CPU", 0)),
                    float(n["Resources"].get("memory", 0)))
        if (line := version_mismatch(mine, answer["versions"], f"node {node.shown}")) is not None:
            raise ClusterRefused(line)
        nodes.append(node)
    if not any(n.cpus >= 1 for n in nodes):
        raise ClusterRefused(f"the Ray cluster at {address} has no node with a CPU to compile on")
    cpus = min(host_memory.CPUS_PER_COMPILE, int(max(n.cpus for n in nodes)))
    here = ray.get_runtime_context().get_node_id()
    client = ray.util.client.ray.is_connected()
    # the shared cache: this machine's cache directory when this machine is a node, else (Ray Client) the head's
    from maxperf.aot import cache
    from maxperf.user_cache import cache_dir

    home_dir = None if client else str(cache_dir())
    home = ray.remote(Home).options(num_cpus=0, max_concurrency=8, scheduling_strategy=NodeAffinitySchedulingStrategy(
        here, soft=False)).remote(home_dir if cache.enabled() else None)
    say(f"{len(nodes)} nodes with the same library versions: " + ", ".join(
        f"{n.shown} {n.cpus:g} CPUs {n.memory_bytes / 2**30:.1f} GiB" for n in nodes))
    return Cluster(address, nodes, mine, cpus, 0.0, home, ray, forwarded)


def _alive_node(ray, node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())


def point_requests(model: str, points: Sequence) -> list[tuple[str, Any]]:
    """(name, request) of each sweep point; the request None where maxperf cannot resolve it (a user's step, sized
    by host_memory's default)."""
    from maxperf.spec.request import resolve

    named = []
    for pt in points:
        try:
            named.append((pt.name, resolve(pt.topology, model, pt.overrides, num_slices=pt.num_slices)))
        except MaxperfError:
            named.append((pt.name, None))
    return named


def _save_row(directory: Path, row: dict[str, Any]) -> None:
    """point.json, written atomically (a temporary file renamed), as a local sweep's worker writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".point.json.partial"
    tmp.write_text(json.dumps(row, indent=2) + "\n")
    os.replace(tmp, directory / "point.json")


def _write_artifact(out: Path, files: dict[str, bytes], *, force: bool) -> None:
    """An artifact's files, as they came from the node, into `out` in one rename (`aot.artifacts.ArtifactWriter`)."""
    writer = artifacts.ArtifactWriter(out, "compile", force=force)
    try:
        for name, data in files.items():
            writer.write_bytes(name, data)
        writer.commit()
    except BaseException:
        writer.abandon()
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_on_sigterm():
    """SIGTERM raises Terminated while tasks run, so they are cancelled as on Ctrl-C."""
    if not _main_thread():
        return None

    def terminate(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminate)


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


# -- what runs on the cluster -----------------------------------------------------------------------------------


class Home:
    """An actor on the node of the machine that asked (the head's with Ray Client): the compile cache of that machine
    shared with every task, and which point started where (progress, attempts)."""

    def __init__(self, cache_dir: str | None):
        if cache_dir is not None:
            os.environ["MAXPERF_CACHE_DIR"] = cache_dir
        self._starts: dict[str, list[tuple[str, str]]] = {}
        self._lock = threading.Lock()

    def started(self, name: str, node_id: str, host: str) -> int:
        """Records an attempt of `name` on a node; the attempt's number."""
        with self._lock:
            self._starts.setdefault(name, []).append((node_id, host))
            return len(self._starts[name])

    def starts(self) -> dict[str, list[tuple[str, str]]]:
        with self._lock:
            return {k: list(v) for k, v in self._starts.items()}

    def cache_get(self, key: str):
        from maxperf.aot import cache

        return cache.get(key)

    def cache_put(self, key: str, entry) -> None:
        from maxperf.aot import cache

        cache.put(key, entry)


class HomeCache:
    """The shared compile cache as a task sees it (aot.cache.share): the Home actor, asked synchronously; a Home that
    cannot be reached is a miss, never an error."""

    def __init__(self, home):
        self.home = home

    def get(self, key: str):
        import ray

        try:
            return ray.get(self.home.cache_get.remote(key), timeout=CACHE_TIMEOUT_S)
        except Exception:
            return None

    def put(self, key: str, entry) -> None:
        import ray

        try:
            ray.get(self.home.cache_put.remote(key, entry), timeout=CACHE_TIMEOUT_S)
        except Exception:
            pass


def _probe() -> dict[str, Any]:
    """A node's answer to the version check."""
    return {"versions": node_versions(), "host": socket.gethostname()}


_WORKDIR_PREFIX = "maxperf-task-"


def _task_start(name: str, versions: dict[str, str | None], home) -> dict[str, Any]:
    """What every task does first: the version check on its node, the attempt recorded, the shared cache installed,
    and what killed tasks left in this node's temporary directory removed. `refused` when this node differs."""
    import ray

    from maxperf.aot import cache

    node_id = ray.get_runtime_context().get_node_id()
    host = socket.gethostname()
    where = {"node_id": node_id, "host": host}
    if (line := version_mismatch(versions, node_versions(), f"node {host} ({node_id[:8]})")) is not None:
        return {**where, "refused": line}
    try:
        attempt = ray.get(home.started.remote(name, node_id, host), timeout=CACHE_TIMEOUT_S)
    except Exception:
        attempt = 0
    artifacts.remove_orphaned_temp_dirs(_WORKDIR_PREFIX)  # of tasks whose process is gone (a killed compile)
    cache.share(HomeCache(home) if cache.enabled() else None)
    return {**where, "attempts": attempt}


def _collect(directory: Path, keep: bool) -> dict[str, bytes]:
    """An artifact's files by relative path: all of them with `keep`, else its JSON files."""
    if not directory.is_dir():
        return {}
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and (keep or (p.suffix == ".json" and p.parent == directory))}


def _run_point_task(model: str, point, analytical_only: bool, calibration, keep: bool, cpu_devices: int,
                    versions: dict[str, str | None], home) -> dict[str, Any]:
    """One sweep point on a node: sweep.run_point in a temporary directory, its row and files sent home."""
    from maxperf.search import sweep

    outcome = _task_start(point.name, versions, home)
    if outcome.get("refused"):
        return outcome
    if outcome["attempts"] > MAX_ATTEMPTS:  # every earlier attempt lost its worker: out of memory, killed
        row = sweep.new_row(model, point, analytical_only, calibration)
        row.update(status="error", reason=f"started {outcome['attempts'] - 1} times on the cluster and lost each "
                                          "time (its worker killed, out of memory, or its node lost)")
        return {**outcome, "row": row}
    if cpu_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from maxperf.aot import targets

        try:
            targets.ensure_cpu_devices(cpu_devices)
        except MaxperfError:  # this worker started jax with fewer devices: the point says so
            pass
    with tempfile.TemporaryDirectory(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-") as tmp:
        row = sweep.run_point(model, point, tmp, analytical_only, calibration)
        return {**outcome, "row": row, "files": _collect(Path(tmp) / "artifact", keep)}


def _compile_task(topology: str, model: str, overrides: list[str], num_slices: int, keep: bool,
                  versions: dict[str, str | None], home) -> dict[str, Any]:
    """One compile on a node (estimate-memory): aot.compile in a temporary directory; its memory.json and files."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from maxperf import aot

    outcome = _task_start(f"{topology} {' '.join(overrides)}", versions, home)
    if outcome.get("refused"):
        return outcome
    with tempfile.TemporaryDirectory(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-") as tmp:
        target = Path(tmp) / "artifact"
        try:
            result = aot.compile(topology, model, overrides, num_slices=num_slices, out=target)
            memory, seconds, hit = dict(result.memory), result.compile_seconds, result.cache_hit
        except DoesNotFit:  # the verdict and XLA's figures were written before the error
            manifest = json.loads((target / "manifest.json").read_text())
            memory = json.loads((target / "memory.json").read_text())
            seconds, hit = float(manifest.get("compile_seconds", 0.0)), bool(manifest.get("compile_cache_hit"))
        except MaxperfError as e:
            return {**outcome, "error": str(e), "exit_code": e.exit_code}
        except Exception as e:
            return {**outcome, "error": f"{type(e).__name__}: {_first_line(e)}", "exit_code": 1}
        return {**outcome, "memory": memory, "compile_seconds": seconds, "cache_hit": hit,
                "files": _collect(target, keep)}
