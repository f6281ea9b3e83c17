"""`--cluster`: sweeps, plan verification and max-batch compiles as tasks of a Ray cluster (maxperf.search.cluster).

The slow tests run a real cluster of two nodes on 127.0.0.1 (tests/ray_cluster.py), started for this module and
stopped after it, each node with its own compile cache; the command runs as a user runs it, with its own.
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ray_cluster import LocalCluster, free_ports, marked_processes

from maxperf.aot import cache
from maxperf.cli import main
from maxperf.search import cluster, host_memory
from maxperf.spec.request import resolve

NEEDS_RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="needs the cluster extra: pip install 'maxperf[cluster]'")
SMALL = ["--model", "tiny", "seq_len=128"]  # compiles in seconds; the points of a test differ from another's


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- without a cluster ------------------------------------------------------------------------------------------


def test_a_test_cluster_gives_no_port_twice():
    """Each node's ports are chosen after the head's and the other nodes' were released: none may come back (a worker
    port equal to the client server's stopped a head from starting)."""
    taken: set[int] = set()
    first = free_ports(40, taken)
    again = [free_ports(40, taken) for _ in range(20)]
    every = first + [p for ports in again for p in ports]
    assert len(every) == len(set(every)) == len(taken) == 840


@pytest.mark.parametrize("text,expected", [
    ("ray", ("auto", None)),
    ("ray://head.example:10001", ("ray://head.example:10001", ("head.example", 10001))),
    ("10.0.0.2:6379", ("10.0.0.2:6379", ("10.0.0.2", 6379))),
    ("[::1]:6379", ("[::1]:6379", ("::1", 6379))),
])
def test_an_address_names_the_cluster_and_where_to_reach_it(text, expected):
    assert cluster.parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "ray:", "head", "head:", "head:0", "head:70000", "ray://head", "http://h:1/x"])
def test_a_malformed_address_is_bad_input(text):
    with pytest.raises(cluster.ClusterRefused, match="is not a Ray address") as e:
        cluster.parse_address(text)
    assert e.value.exit_code == 2


def test_a_version_mismatch_names_each_library_on_both_sides():
    mine = {name: "1.0" for name in cluster.MUST_MATCH}
    assert cluster.version_mismatch(mine, dict(mine), "node n") is None
    line = cluster.version_mismatch(mine, {**mine, "libtpu": "0.0.1", "jaxlib": None}, "node n")
    assert line.startswith("node n has other library versions than this machine: ")
    assert "jaxlib missing (here 1.0)" in line and "libtpu 0.0.1 (here 1.0)" in line and "\n" not in line


def test_a_compile_no_node_can_hold_is_refused_with_the_largest_node():
    tiny = resolve("v5p-8", "tiny", [])
    deep = resolve("v5p-1024", "llama3.1-405b", ["scan_layers=false"])
    need = host_memory.compile_host_bytes(deep)
    assert need > 4 * host_memory.compile_host_bytes(tiny)
    small = cluster.Node("a" * 56, "n1", "10.0.0.1", 8, host_memory.compile_host_bytes(tiny))
    big = cluster.Node("b" * 56, "n2", "10.0.0.2", 8, need - 1)
    cluster.check_fits([small, big], 2, [("tiny", tiny)])
    with pytest.raises(cluster.ClusterRefused, match=rf"^405b needs about {need / 2**30:.2f} GiB of host memory to "
                                                     rf"compile .* \(the largest is {(need - 1) / 2**30:.2f} GiB on "
                                                     r"n2 \(10.0.0.2, node bbbbbbbb\)\)"):
        cluster.check_fits([small, big], 2, [("tiny", tiny), ("405b", deep)])
    cluster.check_fits([small, cluster.Node("c" * 56, "n3", "10.0.0.3", 2, need)], 2, [("405b", deep)])
    with pytest.raises(cluster.ClusterRefused, match="no node has 16 CPUs"):
        cluster.check_fits([small, big], 16, [("tiny", tiny)])


def test_the_shared_cache_is_asked_after_a_miss_and_given_every_new_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path / "here"))

    class Store:
        def __init__(self):
            self.entries, self.asked = {}, []

        def get(self, k):
            self.asked.append(k)
            return self.entries.get(k)

        def put(self, k, entry):
            self.entries[k] = entry

    store = Store()
    entry = cache.Entry(b"exe", "in", "out", {"temp_bytes": 1}, None, "HloModule m", 1.5)
    store.entries["theirs"] = entry
    cache.share(store)
    try:
        assert cache.get("theirs") == entry and (tmp_path / "here" / "compiled" / "theirs").is_dir()  # kept here
        store.asked.clear()
        assert cache.get("theirs") == entry and store.asked == []  # now a local hit
        cache.put("mine", entry)
        assert store.entries["mine"] == entry and cache.get("mine") == entry
        assert cache.get("nobody") is None and store.asked == ["nobody"]
    finally:
        cache.share(None)


@pytest.mark.parametrize("argv,message", [
    (["sweep", *SMALL, "--topologies", "cpu-1", "--keep-executables"], "--keep-executables is for --cluster"),
    (["sweep", *SMALL, "--topologies", "cpu-1", "--analytical-only", "--cluster", "ray"], "compiles nothing"),
    (["sweep", *SMALL, "--topologies", "cpu-1", "--workers", "2", "--cluster", "ray"], "drop --workers"),
    (["sweep", *SMALL, "--topologies", "cpu-1", "--cluster", "head"], "is not a Ray address"),
    (["plan", "--model", "tiny", "--topology", "cpu-2", "--verify", "0", "--cluster", "ray"], "compiles nothing"),
    (["estimate-memory", "--topology", "cpu-2", *SMALL, "--analytical-only", "--cluster", "ray"], "compiles nothing"),
    (["estimate-memory", "--topology", "cpu-2", *SMALL, "--keep-executables"], "--keep-executables is for"),
    # the steps that compile here alone: a cluster given is refused, not ignored
    (["estimate-memory", "--topology", "cpu-1", "--step", "examples/vision_step.py:make_step", "--cluster", "ray"],
     "drop --cluster"),
    (["plan", "--step", "decode", "--model", "tiny", "--topology", "v5e-4", "--verify", "1", "--cluster", "ray"],
     "drop --cluster"),
])
def test_cluster_options_that_cannot_apply_are_bad_input_and_write_nothing(capsys, tmp_path, argv, message):
    code, out, err = run_main(capsys, *argv, "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and message in err and err.startswith("maxperf: error: ")
    assert not (tmp_path / "o").exists()


def test_an_unreachable_address_is_refused_before_any_work(capsys, tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = run_main(capsys, "sweep", *SMALL, "--topologies", "cpu-1", "--out", str(tmp_path / "o"),
                              "--cluster", f"127.0.0.1:{port}", "--json")
    line = f"cannot reach the Ray cluster at 127.0.0.1:{port} (Connection refused)"
    assert code == 2 and err.strip().splitlines()[-1] == f"maxperf: error: {line}"
    assert json.loads(out) == {"schema": "maxperf.error/1", "error": line, "exit": 2}
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_without_cluster_ray_is_never_imported(tmp_path):
    code = ("import sys; from maxperf.cli import main; "
            f"main(['sweep', '--model', 'tiny', '--topologies', 'cpu-1,v5p-8', '--analytical-only', '--out', "
            f"{str(tmp_path / 'o')!r}]); main(['plan', '--model', 'tiny', '--topology', 'cpu-2', '--verify', '0', "
            f"'--out', {str(tmp_path / 'p')!r}]); print('ray' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


# -- on a cluster of two nodes on 127.0.0.1 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes():
    if importlib.util.find_spec("ray") is None:
        pytest.skip(NEEDS_RAY.kwargs["reason"])
    with LocalCluster(workers=1, cpus=2, memory_bytes=6 << 30) as c:
        yield c
    assert ray_processes_of(c) == [] and not c.root.exists()  # stopped: nothing of it left running or on disk


def ray_processes_of(c: LocalCluster) -> list[int]:
    return marked_processes(c.root)


def sweep(c: LocalCluster, out: Path, topologies: str, *words: str, cache_dir: Path, address: str | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "maxperf.cli", "sweep", *SMALL, "--topologies", topologies, "--out", str(out),
            "--cluster", address or c.address, "--json", *words]
    return subprocess.run(args, capture_output=True, text=True, env=c.env(MAXPERF_CACHE_DIR=str(cache_dir)),
                          timeout=timeout)


class Running:
    """A `maxperf --cluster` command in its own process group, its stderr read line by line as it comes."""

    def __init__(self, c: LocalCluster, argv: list[str], cache_dir: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "maxperf.cli", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     env=c.env(MAXPERF_CACHE_DIR=str(cache_dir)))
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")),
                                       daemon=True)
        self.reader.start()

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.proc.kill()
        pytest.fail(f"no line matched {pattern!r}: {''.join(self.lines)[-3000:]}")

    def finish(self, timeout: float = 600) -> tuple[int, str, str]:
        try:
            out = self.proc.stdout.read() if self.proc.wait(timeout=timeout) is not None else ""
        finally:
            self.proc.kill()
        self.reader.join(timeout=10)
        return self.proc.returncode, out, "".join(self.lines)


@pytest.mark.slow
def test_a_sweep_runs_on_both_nodes_resumes_and_a_second_run_is_all_cache_hits(two_nodes, tmp_path):
    c = two_nodes
    home = tmp_path / "home-cache"
    r = sweep(c, tmp_path / "a", "cpu-1,cpu-2", cache_dir=home)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    rows = result["rows"]
    assert result["computed"] == 2 and [row["status"] for row in rows] == ["ok"] * 2
    assert result["cluster"]["address"] == c.address and len(result["cluster"]["nodes"]) == 2
    assert len({row["node_id"] for row in rows}) == 2  # both nodes compiled
    assert all(row["attempts"] == 1 and row["compile_cache_hit"] is False and row["host"] for row in rows)
    for row in rows:  # each point's JSON came home, into --out on this machine, without the executable
        artifact = tmp_path / "a" / "points" / row["point"] / "artifact"
        assert row["artifact"] == str(artifact) and row["artifact_files"] == "json"
        assert sorted(p.name for p in artifact.iterdir()) == ["cost.json", "estimate.json", "manifest.json",
                                                               "memory.json"]
        assert json.loads((artifact / "memory.json").read_text())["per_device_total_bytes"] == \
            row["compiler_memory_bytes"]
        assert row["seconds"] > 0 and row["cpu_seconds"] > 0
    assert not list((tmp_path / "a").rglob("*.partial"))
    assert len(list((home / "compiled").iterdir())) == 2  # what the nodes compiled is in this machine's cache

    again = sweep(c, tmp_path / "a", "cpu-1,cpu-2", cache_dir=home)
    assert again.returncode == 0 and json.loads(again.stdout)["computed"] == 0
    assert "2 points, 2 already done, 0 to run" in again.stderr

    for node in c.nodes:  # the nodes forget what they compiled: the shared cache answers alone
        assert list((node.cache_dir / "compiled").iterdir())
        shutil.rmtree(node.cache_dir)
    second = sweep(c, tmp_path / "b", "cpu-1,cpu-2", "--keep-executables", cache_dir=home)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = json.loads(second.stdout)["rows"]
    assert [row["compile_cache_hit"] for row in rows] == [True] * 2
    from maxperf.aot import artifacts

    for row in rows:  # --keep-executables: the whole artifact came home, as its manifest lists it
        artifact = Path(row["artifact"])
        assert row["artifact_files"] == "all" and (artifact / "compiled.pkl").is_file()
        artifacts.verify_hashes(artifact, artifacts.read_manifest(artifact))
    # a point computed again whose artifact holds what `maxperf run` wrote there: refused as a local sweep refuses it
    # (the artifact came home over it, and the run's files were gone)
    point = Path(rows[0]["artifact"]).parent
    (point / "artifact" / "run").mkdir()
    (point / "artifact" / "run" / "run.json").write_text("{}")
    done = json.loads((point / "point.json").read_text())
    (point / "point.json").write_text(json.dumps({**done, "key": "an earlier sweep's"}))  # to be computed again
    third = sweep(c, tmp_path / "b", "cpu-1,cpu-2", cache_dir=home)
    row = next(r for r in json.loads(third.stdout)["rows"] if r["point"] == point.name)
    assert row["status"] == "error" and "does not replace it" in row["reason"]
    assert (point / "artifact" / "run" / "run.json").read_text() == "{}"


@pytest.mark.slow
def test_ctrl_c_cancels_the_tasks_and_keeps_what_finished(two_nodes, tmp_path):
    c = two_nodes
    out = tmp_path / "s"
    run = Running(c, ["sweep", *SMALL, "--topologies", "cpu-4,cpu-8", "--out", str(out), "--cluster", c.address,
                      "per_device_batch_size=3,5"], tmp_path / "home-cache")
    run.wait_for(r": started on ")
    os.killpg(run.proc.pid, signal.SIGINT)
    code, _, err = run.finish(timeout=120)
    finished = sorted(p.parent.name for p in out.glob("points/*/point.json"))
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"maxperf: error: interrupted by SIGINT: {len(finished)} of 4 points finished now and kept in {out}; run "
        "the same command again to resume")
    assert not list(out.rglob("*.partial"))
    deadline = time.monotonic() + 60  # the tasks' workers are killed: no compile goes on on the cluster
    while time.monotonic() < deadline and _busy(c):
        time.sleep(0.5)
    assert _busy(c) == []


def _busy(c: LocalCluster) -> list[str]:
    """The cluster's processes running a maxperf task (Ray titles a busy worker ray::FUNCTION)."""
    titles = []
    for pid in ray_processes_of(c):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "_task" in title and title.startswith("ray::"):
            titles.append(title.strip())
    return titles


@pytest.mark.slow
def test_a_killed_node_loses_no_finished_point_and_its_point_finishes_elsewhere(two_nodes, tmp_path):
    c = two_nodes
    victim = c.add_node("victim")
    out = tmp_path / "s"
    try:
        run = Running(c, ["sweep", *SMALL, "--topologies", "cpu-1,cpu-2", "--out", str(out), "--cluster",
                          c.address, "--json", "per_device_batch_size=6,7"], tmp_path / "home-cache")
        m = run.wait_for(rf"\] (\S+): started on \S+ \(node {victim.node_id[:8]}\)")
        kept = {p.parent.name: p.read_bytes() for p in out.glob("points/*/point.json")}
        c.kill(victim)
        code, stdout, err = run.finish()
    finally:
        if victim in c.nodes:
            c.kill(victim)
            c.nodes.remove(victim)
    assert code == 0 and stdout.startswith("{"), f"exit {code}, stdout {stdout[:1500]!r}: {err[-3000:]}"
    rows = {row["point"]: row for row in json.loads(stdout)["rows"]}
    assert len(rows) == 4 and all(row["status"] == "ok" for row in rows.values())
    for name, data in kept.items():  # finished before the kill: kept as it was
        assert (out / "points" / name / "point.json").read_bytes() == data
    moved = rows[m.group(1)]  # the point the lost node was compiling finished on another node
    assert moved["attempts"] >= 2 and moved["node_id"][:8] != victim.node_id[:8]
    assert re.search(rf"{re.escape(m.group(1))}: started on \S+ \(node \w+\) \(attempt 2 of at most 4: ", err)
    assert "(raylet)" not in err  # Ray's own messages of the lost node do not reach the terminal


@pytest.mark.slow
def test_a_node_with_other_library_versions_is_refused_before_any_work(two_nodes, tmp_path):
    c = two_nodes
    fake = tmp_path / "fake" / "libtpu-0.0.1.dist-info"  # the node's importlib.metadata finds this libtpu first
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: libtpu\nVersion: 0.0.1\n")
    odd = c.add_node("odd", env={"PYTHONPATH": str(fake.parent)}, cpus=1)
    try:
        r = sweep(c, tmp_path / "o", "cpu-1", cache_dir=tmp_path / "home-cache", timeout=300)
    finally:
        c.kill(odd)
        c.nodes.remove(odd)
    line = err_line(r)
    assert r.returncode == 2 and line.startswith("maxperf: error: node ")
    here = cluster.node_versions()["libtpu"]
    assert f"has other library versions than this machine: libtpu 0.0.1 (here {here})" in line
    assert not (tmp_path / "o").exists() and not (tmp_path / "home-cache").exists()


def err_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_cluster_without_memory_for_a_compile_is_refused_before_any_work(two_nodes, tmp_path):
    r = subprocess.run([sys.executable, "-m", "maxperf.cli", "sweep", "--model", "llama3.1-405b", "--topologies",
                        "v5p-8,v5p-1024", "--out", str(tmp_path / "o"), "--cluster", two_nodes.address,
                        "scan_layers=false"], capture_output=True, text=True, timeout=300, env=two_nodes.env())
    line = err_line(r)
    assert r.returncode == 2 and re.fullmatch(
        r"maxperf: error: v5p-8_scan_layers=false needs about [\d.]+ GiB of host memory to compile \(.*\), more "
        r"than any node of the cluster offers \(the largest is 6.00 GiB on .*\); give the nodes more memory "
        r"\(ray start --memory\) or leave the point out", line), line
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_plan_verifies_on_the_cluster_through_ray_client(two_nodes, tmp_path):
    out = tmp_path / "p"
    r = subprocess.run([sys.executable, "-m", "maxperf.cli", "plan", "--model", "tiny", "--topology", "cpu-2",
                        "--per-device-batch", "2", "--verify", "1", "--out", str(out), "--cluster",
                        two_nodes.client_address, "--json", "seq_len=128"], capture_output=True, text=True,
                       timeout=600, env=two_nodes.env(MAXPERF_CACHE_DIR=str(tmp_path / "home-cache")))
    assert r.returncode == 0, r.stderr[-3000:]
    winner = json.loads(r.stdout)["winner"]
    assert winner["verified"] is True and winner["compiler_memory_bytes"] > 0
    point = json.loads((Path(winner["artifact"]).parent / "point.json").read_text())
    assert point["status"] == "ok" and point["attempts"] == 1 and point["node_id"]
    assert Path(winner["artifact"]).is_relative_to(out) and (Path(winner["artifact"]) / "memory.json").is_file()


@pytest.mark.slow
def test_max_batch_compiles_each_trial_on_the_cluster(two_nodes, tmp_path):
    # the configuration of test_estimate_memory's boundary test: its memory grows fast with B on v5e's 16 GiB
    r = subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate-memory", "--topology", "v5e-4", "--model",
                        "tiny", "seq_len=4096", "remat_policy=none", "--max-batch", "--json", "--out",
                        str(tmp_path / "m"), "--cluster", two_nodes.address], capture_output=True, text=True,
                       timeout=900, env=two_nodes.env(MAXPERF_CACHE_DIR=os.environ["MAXPERF_CACHE_DIR"]))
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout)
    b = found["max_per_device_batch_size"]
    fits = {t["per_device_batch_size"]: t["fits"] for t in found["trials"]}
    assert found["compiles"] == len(found["trials"]) >= 2 and fits[b] is True and fits.get(b + 1) is False
    assert len(re.findall(r"compiled on \S+ \(node \w+\)", r.stderr)) == found["compiles"]
    for trial in found["trials"]:  # each trial's JSON came home into --out
        memory = json.loads((tmp_path / "m" / f"batch-{trial['per_device_batch_size']}" / "memory.json").read_text())
        assert memory["fits"] == trial["fits"]


@pytest.mark.slow
@NEEDS_RAY
def test_the_cluster_bench_prints_its_figures():
    """bench/cluster_sweep.py, cut to 4 points: the local pool, one node and two nodes each compile every point
    afresh, and the per-task overhead it prints is a measured figure."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "cluster_sweep.py"
    run = subprocess.run([sys.executable, str(bench), "--points", "4"], capture_output=True, text=True, timeout=900,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^(local pool|Ray, 1 node|Ray, 2 nodes)\s+(\d+)\s+(\S+)\s+([\d.]+)", run.stdout, re.M)}
    assert sorted(rows) == ["Ray, 1 node", "Ray, 2 nodes", "local pool"], run.stdout
    assert [r[0] for r in rows.values()] == ["4"] * 3 and rows["Ray, 2 nodes"][1] == "2", run.stdout
    assert re.search(r"^Ray's overhead per task against the local pool: [+-]\d+\.\d\d s$", run.stdout, re.M)
