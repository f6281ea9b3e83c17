"""perfmodel's memory per device against XLA's, over presets x TPU topologies x remat policies.

    .venv/bin/python bench/memory_accuracy.py [--cache FILE] [--only SUBSTRING]

For each case it compiles the train step for the TPU topology (compile-only devices, through maxperf.aot, into a
temporary directory; one compile at a time) and prints the analytical per-device total (perfmodel.estimate_memory)
beside the compiler's (argument + output - alias + temp + code, from memory_analysis), the signed error of the
analytical figure, and the median and worst absolute error. `--cache FILE` keeps the compiler's figures in a JSON
file keyed by the case, so that a second run after a change to perfmodel's formulas recompiles nothing (the
compiler's figures depend on the step, not on perfmodel); delete the file to measure again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices; nothing runs here

from maxperf.studies import memory_fit  # noqa: E402

GIB = 1 << 30
# B=1 and L=2048 keep each TPU compile to seconds on a 2-core machine while the step is the realistic shape;
# full-depth presets (scan_layers keeps compile time nearly independent of N).
PRESETS = ("qwen3-0.6b", "gemma-2b", "scaled-1", "gemma2-2b", "llama2-7b", "mistral-7b")
TOPOLOGIES = ("v5p-8", "v5p-64", "v5e-16")
REMAT = ("full", "minimal")
COMMON = ("per_device_batch_size=1", "seq_len=2048")


def cases() -> list[tuple[str, str, tuple[str, ...]]]:
    # topology-major, so that a partial run (interrupted) still covers every preset
    return [(m, t, (*COMMON, f"remat_policy={r}")) for t in TOPOLOGIES for m in PRESETS for r in REMAT]


def key(model: str, topology: str, overrides: tuple[str, ...]) -> str:
    return " ".join((model, topology, *overrides))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, help="JSON file of compiler figures to reuse and extend")
    ap.add_argument("--only", default="", help="run only cases whose key contains this text")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    rows = []
    print(f"{'model':<11} {'topology':<7} {'remat':<8} {'analytical':>10} {'compiler':>9} {'error':>7}  "
          f"{'xla temp':>8} {'args':>6}  compile")
    for model, topology, overrides in cases():
        k = key(model, topology, overrides)
        if args.only and args.only not in k:
            continue
        if k in cache:
            compiler, seconds = cache[k]["compiler"], None
            cmp = memory_fit.compare(topology, model, overrides, analytical_only=True)
        else:
            t0 = time.perf_counter()
            cmp = memory_fit.compare(topology, model, overrides,
                                     progress=lambda s: print(f"  [{k}] {s}", file=sys.stderr, flush=True))
            compiler, seconds = cmp.compiler, time.perf_counter() - t0
            cache[k] = {"compiler": compiler}
            if args.cache:
                args.cache.write_text(json.dumps(cache, indent=1) + "\n")
        analytical = cmp.analytical.per_device_total_bytes
        total = compiler["per_device_total_bytes"]
        error = (analytical - total) / total
        remat = overrides[-1].split("=")[1]
        rows.append({"model": model, "topology": topology, "remat": remat, "analytical_bytes": analytical,
                     "compiler_bytes": total, "error": error, "compiler": compiler,
                     "analytical": cmp.analytical.as_dict()})
        print(f"{model:<11} {topology:<7} {remat:<8} {analytical / GIB:>10.2f} {total / GIB:>9.2f} {error:>+7.1%}  "
              f"{compiler.get('temp_bytes', 0) / GIB:>8.2f} {compiler.get('argument_bytes', 0) / GIB:>6.2f}  "
              + ("cached" if seconds is None else f"{seconds:.0f} s"), flush=True)
    if not rows:
        print("no case matched")
        return 1
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\n{len(rows)} cases: median |error| {statistics.median(errors):.1%}, worst {abs(worst['error']):.1%} "
          f"({worst['model']} {worst['topology']} {worst['remat']}); target: median < 10%, worst < 25%")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
