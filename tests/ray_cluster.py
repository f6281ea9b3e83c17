"""A Ray cluster on this machine's loopback only, for the tests and the benchmark of `--cluster`: a head and worker
nodes, each a `ray start --block` in a process group of its own, with its own temporary directory, ports, memory and
maxperf cache directory; stopped by killing those groups (and any process that carries the node's mark in its
environment, MARK), so that nothing is left running.

Ray replaces 127.0.0.1 with the machine's outward address (`services.resolve_ip_for_localhost`), which would put the
cluster on the network. Two settings keep everything on 127.0.0.1: `ray start` runs with that replacement off
(START), and the nodes' processes and the driver run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, under which Ray takes
127.0.0.1 as this node's address (DRIVER_ENV: give it to every `maxperf --cluster` run against this cluster). Usage
statistics and the dashboard are off.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

START = """
import sys
from ray._private import ray_constants, services
ray_constants.ENABLE_RAY_CLUSTER = True  # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 would refuse a second node here
services.resolve_ip_for_localhost = lambda host: host  # keep 127.0.0.1
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
"""
DRIVER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
STARTED = "Ray runtime started"
MARK = "MAXPERF_TEST_RAY_NODE"  # in every process of a node's environment: its temporary directory
# A lost node is known in about 10 s rather than Ray's default minute (its head checks every node's raylet this often,
# and gives up after this many missed answers): a killed node's tasks are retried sooner.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "5000",
                 "RAY_health_check_failure_threshold": "5"}
START_TIMEOUT_S = 120


def free_ports(n: int, taken: set[int] | None = None) -> list[int]:
    """`n` ports free on 127.0.0.1 now (held together while chosen, so they differ), none of them in `taken` (ports
    chosen earlier for the same cluster: released since, the system may hand them out again), which they join."""
    taken = set() if taken is None else taken
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in taken:
                ports.append(port)
        taken.update(ports)
        return ports


@dataclass
class RayNode:
    name: str
    process: subprocess.Popen
    temp_dir: Path
    cache_dir: Path
    log: Path

    @property
    def node_id(self) -> str:
        """Ray's id of this node, from its raylet's log."""
        for log in sorted(self.temp_dir.glob("session_*/logs/raylet.out")):
            if m := re.search(r"node(?:_id| id|ID)[=: ]+([0-9a-f]{56})", log.read_text(errors="replace")):
                return m.group(1)
        raise LookupError(f"no node id in {self.temp_dir}")


class LocalCluster:
    """`with LocalCluster(workers=1) as c:` a head and `workers` worker nodes; `c.address` (GCS) and
    `c.client_address` (ray://) to join it; `c.add_node(...)`, `c.kill(node)`; everything stopped on leaving."""

    def __init__(self, workers: int = 1, *, cpus: int = 2, memory_bytes: int = 6 << 30):
        # short: Ray's unix socket paths live under the temporary directory, and such a path has at most 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="mpray-", dir="/tmp"))
        self.cpus, self.memory_bytes, self.workers = cpus, memory_bytes, workers
        self.taken: set[int] = set()  # every port given to this cluster's nodes: no two components share one
        self.port, self.client_port = free_ports(2, self.taken)
        self.nodes: list[RayNode] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def client_address(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a driver (`maxperf --cluster`) on this machine: no forced XLA device count."""
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        return {**env, **DRIVER_ENV, **extra}

    def __enter__(self) -> LocalCluster:
        try:
            self.add_node("head", head=True)
            for i in range(self.workers):
                self.add_node(f"worker{i + 1}")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_node(self, name: str, *, head: bool = False, env: dict[str, str] | None = None,
                 cpus: int | None = None, memory_bytes: int | None = None) -> RayNode:
        temp_dir, cache_dir = self.root / name, self.root / f"{name}-cache"
        temp_dir.mkdir()
        ports = free_ports(47, self.taken)
        args = ["start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus or self.cpus}",
                f"--memory={memory_bytes or self.memory_bytes}", "--object-store-memory=100000000",
                f"--temp-dir={temp_dir}", "--disable-usage-stats", f"--node-manager-port={ports[0]}",
                f"--object-manager-port={ports[1]}", f"--dashboard-agent-listen-port={ports[2]}",
                f"--dashboard-agent-grpc-port={ports[3]}", f"--runtime-env-agent-port={ports[4]}",
                f"--metrics-export-port={ports[5]}", f"--worker-port-list={','.join(map(str, ports[7:]))}"]
        if head:
            args += ["--head", f"--port={self.port}", "--include-dashboard=false",
                     f"--ray-client-server-port={self.client_port}"]
        else:
            args += [f"--address={self.address}"]
        node_env = {**self.env(), "MAXPERF_CACHE_DIR": str(cache_dir), MARK: str(temp_dir), **HEALTH_CHECKS,
                    # the Ray Client server forks a driver per client; gRPC's fork handlers crash it here
                    "GRPC_ENABLE_FORK_SUPPORT": "0", **(env or {})}
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-c", START, *args], stdout=out, stderr=subprocess.STDOUT,
                                       env=node_env, start_new_session=True, cwd=self.root)
        node = RayNode(name, process, temp_dir, cache_dir, log)
        self.nodes.append(node)
        deadline = time.monotonic() + START_TIMEOUT_S
        while STARTED not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"ray node {name} did not start: " + " | ".join(tail))
            time.sleep(0.2)
        return node

    def kill(self, node: RayNode) -> None:
        """The node dies at once, as a machine that is lost: every process of its group, SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        node.process.wait(timeout=30)
        self._kill_strays(node.temp_dir)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            self.kill(node)
        self.nodes.clear()
        self._kill_strays(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _kill_strays(directory: Path) -> None:
        """Processes of this cluster's nodes under `directory` that left their process groups, known by MARK."""
        for pid in marked_processes(directory):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def marked_processes(directory: Path) -> list[int]:
    """Live processes whose environment marks them as a node's under `directory`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().split(") ", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        values = [e.split(b"=", 1)[1].decode(errors="replace") for e in environ if e.startswith(MARK.encode() + b"=")]
        if state != "Z" and values and Path(values[0]).is_relative_to(directory):
            found.append(int(proc.name))
    return found


def ray_processes() -> list[str]:
    """Every process of this machine whose command line names Ray (to see that nothing was left running)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            state = (proc / "stat").read_text().split(") ", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and re.search(r"\bray\b|raylet|gcs_server|ray::", cmdline):
            found.append(f"{proc.name} {cmdline[:120]}")
    return found
