"""`maxperf sweep --cluster`: a sweep's wall time on this machine's worker pool, on a Ray cluster of one node and on
one of two nodes (tests/ray_cluster.py: every node on 127.0.0.1, stopped after), and what Ray adds per compile task.

    .venv/bin/python bench/cluster_sweep.py                 # 16 points: tiny on cpu-1..cpu-8 x 4 batch sizes
    .venv/bin/python bench/cluster_sweep.py --points 4      # the first 4 (what tests/test_cluster.py runs)

Every sweep compiles each point afresh (a new compile cache per run). Each node declares 2 CPUs and each compile task
asks for search.host_memory.CPUS_PER_COMPILE of them, so a node runs one compile at a time, as the local pool does on
2 cores (sweep.default_workers: a worker per 2 cores). On one machine the two nodes share its cores, so the two-node
wall time shows Ray's scheduling across nodes rather than a speed-up: CPU seconds per point, summed over the points'
own processes, are printed beside it. Ray's overhead per task is (one-node wall - local wall) / points: both run the
points one at a time, so the difference is what the cluster path adds to each (task submission, a worker process
importing maxperf, the version check, the shared cache's round trips, the JSON brought home).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ray_cluster import LocalCluster  # noqa: E402

TOPOLOGIES = ["cpu-1", "cpu-2", "cpu-4", "cpu-8"]
BATCHES = [1, 2, 3, 4]
WORDS = ["--model", "tiny", "seq_len=128"]


def sweep(out: Path, points: int, env: dict[str, str], cluster: LocalCluster | None) -> dict:
    """One sweep of the first `points` points, compiled (on `cluster`'s nodes, their caches emptied first); its
    JSON document and its wall time."""
    topologies = TOPOLOGIES[:max(1, -(-points // len(BATCHES)))]
    batches = BATCHES[:min(len(BATCHES), points)]
    args = [sys.executable, "-m", "maxperf.cli", "sweep", *WORDS, "--topologies", ",".join(topologies),
            "--out", str(out), "--json", f"per_device_batch_size={','.join(map(str, batches))}"]
    if cluster is not None:
        args += ["--cluster", cluster.address]
        for node in cluster.nodes:
            shutil.rmtree(node.cache_dir, ignore_errors=True)
    cache = tempfile.mkdtemp(prefix="cache-", dir=out.parent)
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env={**env, "MAXPERF_CACHE_DIR": cache},
                          timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"sweep failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    result = json.loads(proc.stdout)
    rows = result["rows"]
    if any(r["status"] != "ok" or r.get("compile_cache_hit") for r in rows):
        raise SystemExit("a point failed or was not compiled afresh: "
                         f"{[(r['point'], r['status'], r.get('compile_cache_hit')) for r in rows]}")
    return {"wall": wall, "points": len(rows), "cpu": sum(r["cpu_seconds"] for r in rows),
            "point_seconds": statistics.median(r["seconds"] for r in rows),
            "nodes": len({r.get("node_id") for r in rows if r.get("node_id")})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=len(TOPOLOGIES) * len(BATCHES),
                        help="how many of the 16 points to sweep (4 batch sizes per topology)")
    args = parser.parse_args()
    points = max(1, min(args.points, len(TOPOLOGIES) * len(BATCHES)))
    results = {}
    with tempfile.TemporaryDirectory(prefix="mp-bench-") as tmp, LocalCluster(workers=0, cpus=2) as one:
        root = Path(tmp)
        results["local pool"] = sweep(root / "local", points, one.env(), None)
        results["Ray, 1 node"] = sweep(root / "one", points, one.env(), one)
        one.add_node("worker1")
        results["Ray, 2 nodes"] = sweep(root / "two", points, one.env(), one)
    print(f"{points}-point compile sweep (tiny, seq_len=128), each run with a fresh compile cache")
    print(f"{'run':<14} {'points':>6} {'nodes':>5} {'wall s':>8} {'CPU s/point':>11} {'median point s':>14}")
    for name, r in results.items():
        print(f"{name:<14} {r['points']:>6} {r['nodes'] or '-':>5} {r['wall']:8.1f} {r['cpu'] / r['points']:11.2f} "
              f"{r['point_seconds']:14.2f}")
    local, one_node, two = results["local pool"], results["Ray, 1 node"], results["Ray, 2 nodes"]
    print(f"two nodes / one node wall: {two['wall'] / one_node['wall']:.2f}x (the nodes share this machine's cores)")
    print(f"Ray's overhead per task against the local pool: {(one_node['wall'] - local['wall']) / points:+.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
