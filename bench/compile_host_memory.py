"""Host memory of a compile: the peak RSS of `maxperf compile` processes beside the estimate that sizes a cluster's
compile tasks and the local sweep's workers (maxperf.search.host_memory, whose constants come from this table).

    .venv/bin/python bench/compile_host_memory.py              # every case (about 15 minutes on 2 cores)
    .venv/bin/python bench/compile_host_memory.py --quick      # the small cases only (about 2 minutes)

Each case is one whole `maxperf compile` process with a fresh compile cache; its peak RSS is the manifest's
`peak_rss_bytes` (the compiling process's ru_maxrss: imports, libtpu or the CUDA plugin, tracing, lowering, XLA, the
serialized executable).
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

# (topology, model, overrides): small first; platform, width, depth, scanning, experts and chips vary one at a time
QUICK = [
    ("cpu-1", "tiny", []),
    ("cpu-8", "tiny", []),
    ("v5p-8", "tiny", []),
    ("h100-8", "tiny", []),
    ("v5p-8", "tiny", ["num_layers=16", "scan_layers=false"]),
    ("v5p-8", "scaled-1", SMALL),
]
FULL = QUICK + [
    ("v5p-1024", "scaled-1", SMALL),
    ("cpu-8", "scaled-1", SMALL),
    ("v5p-8", "scaled-1", [*SMALL, "scan_layers=false"]),
    ("v5p-8", "llama2-7b", SMALL),
    ("h100-8", "llama2-7b", SMALL),
    ("v5p-64", "mixtral-8x7b", SMALL),
    ("v5p-1024", "llama3.1-405b", SMALL),
]


def measure(topology: str, model: str, words: list[str]) -> dict:
    from maxperf.search import host_memory
    from maxperf.spec.request import resolve

    need = host_memory.compile_host_bytes(resolve(topology, model, words))
    out = Path(tempfile.mkdtemp(prefix="maxperf-hostmem-")) / "out"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["MAXPERF_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxperf-hostmem-cache-")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "compile", "--topology", topology, "--model", model,
                           "--out", str(out), *words], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        line = (proc.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {topology:<9} {model:<14} {' '.join(words):<50} failed: {line}", flush=True)
        return {}
    manifest = json.loads((out / "manifest.json").read_text())
    rss = manifest["peak_rss_bytes"]
    hlo = (out / "hlo" / "optimized.hlo.txt").stat().st_size if (out / "hlo" / "optimized.hlo.txt").exists() else 0
    print(f"  {topology:<9} {model:<14} {' '.join(words):<50} compile {manifest['compile_seconds']:6.1f} s  "
          f"wall {wall:6.1f} s  HLO {hlo / 2**20:6.1f} MiB  peak RSS {rss / GIB:5.2f} GiB  "
          f"estimate {need / GIB:5.2f} GiB ({need / rss:.2f}x)", flush=True)
    return {"rss": rss, "estimate": need}


if __name__ == "__main__":
    cases = QUICK if "--quick" in sys.argv[1:] else FULL
    print("peak host RSS of whole `maxperf compile` processes, fresh cache; estimate: search.host_memory")
    rows = [r for r in (measure(*case) for case in cases) if r]
    under = [r for r in rows if r["estimate"] < r["rss"]]
    print(f"{len(rows)} compiles: the estimate is under the measured peak in {len(under)}; estimate / measured from "
          f"{min(r['estimate'] / r['rss'] for r in rows):.2f} to {max(r['estimate'] / r['rss'] for r in rows):.2f}")
