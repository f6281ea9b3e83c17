"""The step time read from the compiled program (maxperf.aot.hlo_time): how long reading and costing a real step's
HLO takes, and MaxText's own step through maxperf against MaxText's train_compile and its published TFLOP/s.

    .venv/bin/python bench/hlo_time.py costing            # llama2-7b on v5p-1024 (compiled, or from the cache)
    .venv/bin/python bench/hlo_time.py maxtext [CASE ...]  # MaxText's step: v5e-16b, v5p-32b (tens of minutes)

`costing` compiles (or takes from the compile cache) llama2-7b for a v5p-1024 pod, B 1, L 2048, flash attention,
full remat, then reads and costs its optimized HLO REPEAT times in this process, from the text file to the result,
and prints the median and the slowest wall time against the 2 s target, the CPU time beside it (on a shared machine
the wall time is mostly other processes'), and the prediction beside the analytical one.

`maxtext` runs, for each case, MaxText's `train_compile` in its own venv (PEER_VENV, default /tmp/peer, made by
../shared/peer/maxtext_aot.sh; bench/maxtext_compare.py's runner) and `maxperf compile --step
maxperf.integrations.maxtext_step:make_step` under the same venv's python (this checkout on PYTHONPATH), with the
same MaxText keys: MaxText's configs for a row of bench/published (its 16b.sh and 32b.sh). It prints both memories
per device (MaxText's sum: argument + output - alias + temp), the HLO-derived step time, and the TFLOP/s per chip
that step time gives in MaxText's own FLOP count (calculate_tflops_training_per_device) against the TFLOP/s MaxText
published for that configuration.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
GIB = 1 << 30
TARGET_S = 2.0
REPEAT = 5
COSTING = ("v5p-1024", "llama2-7b", ["per_device_batch_size=1", "seq_len=2048", "attention=flash",
                                     "remat_policy=full"])
FACTORY = "maxperf.integrations.maxtext_step:make_step"


@dataclass(frozen=True)
class MaxTextCase:
    name: str
    row: str  # bench/published/training.csv id whose TFLOP/s MaxText published
    topology: str
    batch: int
    seq: int
    settings: tuple[str, ...]  # MaxText keys, as its configs/tpu/*/*.sh pass them


CASES = (
    MaxTextCase("v5e-16b", "maxtext-v5e-16b-x1", "v5e-256", 6, 2048,
                ("global_parameter_scale=16", "remat_policy=full", "attention=flash", "use_iota_embed=true")),
    MaxTextCase("v5p-32b", "maxtext-v5p-32b-v5p-128-x1", "v5p-128", 6, 2048,
                ("global_parameter_scale=32", "remat_policy=minimal", "attention=flash", "use_iota_embed=true",
                 "ici_fsdp_parallelism=-1", "ici_tensor_parallelism=4")),
)


def costing(repeat: int) -> None:
    from maxperf import aot
    from maxperf.aot import hlo_time

    topology, model, words = COSTING
    out = Path(tempfile.mkdtemp(prefix="maxperf-costing-")) / "artifact"
    start = time.perf_counter()
    result = aot.compile(topology, model, words, out=out)
    print(f"{model} on {topology} {' '.join(words)}: compiled in {time.perf_counter() - start:.1f} s"
          f"{' (from the compile cache)' if result.cache_hit else ''}")
    path = out / "hlo" / "optimized.hlo.txt"
    artifact = aot.load(out)
    times, cpu, predicted = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        predicted = hlo_time.predict(path.read_text(), artifact.topology, artifact.mesh)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    size = path.stat().st_size
    print(f"  optimized HLO {size / 1e6:.2f} MB, {predicted.kernels:,} instructions executed per step")
    print(f"  reading and costing it: median {statistics.median(times):.3f} s, slowest {max(times):.3f} s over "
          f"{repeat} runs (target < {TARGET_S:g} s); CPU time median {statistics.median(cpu):.3f} s, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"  step time from the HLO {predicted.step_time_s:.4f} s (bound by {predicted.bottleneck}; exposed "
          f"collectives {predicted.exposed_s:.4f} s), analytical {result.estimate['step_time_s']:.4f} s")


def published_tflops(row: str) -> float:
    with open(ROOT / "bench" / "published" / "training.csv", newline="") as f:
        return float(next(r for r in csv.DictReader(f) if r["id"] == row)["published_tflops_per_chip"])


def maxtext(names: list[str]) -> None:
    import maxtext_compare

    python = maxtext_compare.PEER_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no MaxText venv at {maxtext_compare.PEER_VENV}: run ../shared/peer/maxtext_aot.sh")
    work = Path(tempfile.mkdtemp(prefix="maxperf-maxtext-step-"))
    rows = []
    for case in [c for c in CASES if not names or c.name in names]:
        print(f"{case.name}: MaxText default model, {case.topology} B {case.batch} L {case.seq} "
              f"{' '.join(case.settings)}", flush=True)
        theirs = maxtext_compare.maxtext(maxtext_compare.Case(case.name, "default", case.topology, case.batch,
                                                              case.seq, case.settings), work)
        print(f"  MaxText train_compile: {theirs.wall_s:.0f} s, {theirs.memory_gib} GiB {theirs.note}", flush=True)
        out = work / f"maxperf_{case.name}"
        argv = [str(python), "-m", "maxperf.cli", "compile", "--step", FACTORY, "--topology", case.topology,
                "model_name=default", f"per_device_batch_size={case.batch}", f"max_target_length={case.seq}",
                *case.settings, "--out", str(out), "--force", "--json"]
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
        wall = time.perf_counter() - start
        if proc.returncode not in (0, 3):
            print(f"  maxperf: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        memory = json.loads((out / "memory.json").read_text())
        estimate = json.loads((out / "estimate.json").read_text())
        ours = (memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
                + memory["temp_bytes"]) / GIB
        published = published_tflops(case.row)
        tflops = estimate["tflops_per_chip"]
        print(f"  maxperf --step (MaxText's step): {wall:.0f} s, {ours:.2f} GiB; from the HLO "
              f"{estimate['step_time_s']:.4f} s/step, {tflops:.1f} TFLOP/s per chip (MaxText published {published:g}, "
              f"{tflops / published - 1:+.1%})", flush=True)
        rows.append((case, theirs.memory_gib, ours, estimate["step_time_s"], tflops, published))
    print()
    print("| case | topology | MaxText GiB | maxperf --step GiB | ratio | HLO step s | HLO TFLOP/s/chip | published "
          "| error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case, theirs, ours, step, tflops, published in rows:
        ratio = f"{ours / theirs:.3f}x" if theirs else "-"
        print(f"| {case.name} | {case.topology} | {theirs if theirs is None else f'{theirs:.2f}'} | {ours:.2f} "
              f"| {ratio} | {step:.4f} | {tflops:.1f} | {published:g} | {tflops / published - 1:+.1%} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("costing", "maxtext"))
    ap.add_argument("cases", nargs="*", help=f"maxtext: cases to run (default all): {', '.join(c.name for c in CASES)}")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="costing: how many times the HLO is read and costed")
    args = ap.parse_args()
    unknown = sorted(set(args.cases) - {c.name for c in CASES})
    if unknown:
        ap.error(f"unknown cases {', '.join(unknown)}; cases: {', '.join(c.name for c in CASES)}")
    if args.what == "costing":
        costing(max(args.repeat, 1))
    else:
        maxtext(args.cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
