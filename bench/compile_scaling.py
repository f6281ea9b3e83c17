"""Compile-time and host-memory targets of `maxperf compile`, each measured as a whole `maxperf` process.

    .venv/bin/python bench/compile_scaling.py            # all cases (about 10 minutes on 2 cores)
    .venv/bin/python bench/compile_scaling.py chips      # one group: chips, depth, llama2-7b, 405b, cache

Groups and their targets:
  chips     the same per-device work on v5p-8 and v5p-12288: ratio of compile times under 1.5
  depth     scaled-8 with 32 and with 80 layers (scanned): ratio under 1.5
  llama2-7b llama2-7b on v5p-1024 (B=1, L=2048, full remat): whole process under 45 s
  405b      llama3.1-405b on v5p-1024: host peak RSS under 8 GiB
  cache     the same compile twice: the second much faster (persistent compilation cache)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
SMALL = ["per_device_batch_size=1", "seq_len=1024", "remat_policy=full"]


def run(topology: str, model: str, words: list[str], cache: Path) -> dict:
    out = Path(tempfile.mkdtemp()) / "out"
    env = {**os.environ, "MAXPERF_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "compile", "--topology", topology, "--model", model,
                           "--out", str(out), *words], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{topology} {model} failed: {proc.stderr.strip().splitlines()[-1]}")
    manifest = json.loads((out / "manifest.json").read_text())
    memory = json.loads((out / "memory.json").read_text())
    row = {"topology": topology, "model": model, "wall_s": wall, "compile_s": manifest["compile_seconds"],
           "rss_gib": manifest["peak_rss_bytes"] / GIB, "device_gib": (memory["per_device_total_bytes"] or 0) / GIB,
           "fits": memory["fits"]}
    print(f"  {topology:<11} {model:<14} {' '.join(words):<55} wall {wall:6.1f} s  compile {row['compile_s']:6.1f} s"
          f"  host RSS {row['rss_gib']:.2f} GiB  device {row['device_gib']:.2f} GiB"
          f"{'' if row['fits'] else '  DOES NOT FIT'}", flush=True)
    return row


def fresh_cache() -> Path:
    return Path(tempfile.mkdtemp(prefix="maxperf-bench-cache-"))


def chips() -> None:
    print("chips: same per-device work (FSDP over 4 chips, data parallel beyond), 4 against 6144 chips")
    same = [*SMALL, "ici_fsdp=4", "ici_data=-1"]
    a = run("v5p-8", "scaled-8", same, fresh_cache())
    b = run("v5p-12288", "scaled-8", same, fresh_cache())
    print(f"  ratio of compile times {b['compile_s'] / a['compile_s']:.2f} (target < 1.5)")


def depth() -> None:
    print("depth: 32 against 80 layers, scanned")
    a = run("v5p-64", "scaled-8", [*SMALL, "num_layers=32"], fresh_cache())
    b = run("v5p-64", "scaled-8", [*SMALL, "num_layers=80"], fresh_cache())
    print(f"  ratio of compile times {b['compile_s'] / a['compile_s']:.2f} (target < 1.5)")


def llama2_7b() -> None:
    print("llama2-7b on v5p-1024, B=1, L=2048, full remat (target: whole process < 45 s, aim 30 s)")
    run("v5p-1024", "llama2-7b", ["per_device_batch_size=1", "seq_len=2048", "remat_policy=full"], fresh_cache())


def llama_405b() -> None:
    print("llama3.1-405b on v5p-1024 (target: host peak RSS < 8 GiB)")
    run("v5p-1024", "llama3.1-405b", ["per_device_batch_size=1", "seq_len=2048", "remat_policy=full"], fresh_cache())


def cache() -> None:
    print("persistent compilation cache: the same compile twice")
    directory = fresh_cache()
    a = run("v5p-1024", "scaled-1", SMALL, directory)
    b = run("v5p-1024", "scaled-1", SMALL, directory)
    print(f"  second compile {b['compile_s']:.1f} s against {a['compile_s']:.1f} s "
          f"({a['compile_s'] / max(b['compile_s'], 1e-3):.0f}x faster)")


GROUPS = {"chips": chips, "depth": depth, "llama2-7b": llama2_7b, "405b": llama_405b, "cache": cache}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(GROUPS):
        GROUPS[name]()
