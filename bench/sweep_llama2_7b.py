"""`maxperf sweep` over 8 v5p sizes for llama2-7b, compiled, then the scaling report.

    .venv/bin/python bench/sweep_llama2_7b.py [OUT_DIR]      # about 40 s per point on this 2-core machine

Re-running with the same OUT_DIR resumes a killed sweep; the wall time of each stage is printed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from maxperf.reports import render
from maxperf.search.sweep import sweep

SIZES = ["v5p-8", "v5p-16", "v5p-32", "v5p-64", "v5p-128", "v5p-256", "v5p-512", "v5p-1024"]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out/sweep-llama2-7b")
    start = time.perf_counter()
    result = sweep("llama2-7b", SIZES, axes={"per_device_batch_size": ["1"], "remat_policy": ["full"]}, out=out,
                   progress=lambda line: print(line, flush=True))
    print(f"sweep: {len(result.rows)} points ({result.computed} compiled now) in {time.perf_counter() - start:.0f} s")
    for r in result.rows:
        print(f"  {r['topology']:<9} {r['status']:<13} compile {r.get('compile_seconds') or 0:5.1f} s  "
              f"compiler {((r.get('compiler_memory_bytes') or 0) / 2**30):6.2f} GiB  analytical "
              f"{((r.get('analytical_memory_bytes') or 0) / 2**30):6.2f} GiB  "
              f"predicted MFU {r.get('predicted_mfu') or 0:.1%}")
    t = time.perf_counter()
    report = render([out], out / "scaling.html", command=["bench/sweep_llama2_7b.py", str(out)])
    print(f"report: {report.html_path} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
