"""Predicted against measured on this machine's GPU: each case is compiled by `maxperf compile` on the attached GPU
(autotuned), run by `maxperf run`, and printed with the prediction beside the measurement.

    .venv/bin/python bench/gpu_measured.py [--topology h100-1] [--steps 10] [--only NAME,...] [--json FILE]

Needs a GPU of the topology's kind attached (`nvidia-smi`); prints one row per case as it finishes:
compile seconds, XLA's memory per device and the measured peak, the predicted and measured step time and MFU, and
the first and last loss. A case that fails prints its one-line reason and the bench goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
import outfile  # noqa: E402

# name -> key=value overrides (sequence 2048 unless a case says otherwise)
CASES = {
    "scaled-1 flash full": ["--model", "scaled-1", "per_device_batch_size=8", "attention=flash", "remat_policy=full"],
    "scaled-1 dot full": ["--model", "scaled-1", "per_device_batch_size=8", "attention=dot_product",
                          "remat_policy=full"],
    "scaled-1 flash minimal": ["--model", "scaled-1", "per_device_batch_size=8", "attention=flash",
                               "remat_policy=minimal"],
    "scaled-1 flash none": ["--model", "scaled-1", "per_device_batch_size=4", "attention=flash", "remat_policy=none"],
    "qwen3-0.6b flash full": ["--model", "qwen3-0.6b", "per_device_batch_size=16", "attention=flash",
                              "remat_policy=full"],
    "gemma2-2b auto full": ["--model", "gemma2-2b", "per_device_batch_size=4", "remat_policy=full"],
    "qwen3-0.6b dot full": ["--model", "qwen3-0.6b", "per_device_batch_size=16", "attention=dot_product",
                            "remat_policy=full"],
    "scaled-2 dot minimal": ["--model", "scaled-2", "per_device_batch_size=4", "attention=dot_product",
                             "remat_policy=minimal"],
    # mixtures of experts and latent attention, cut to a few layers so that one GPU holds them
    "qwen3-30b-a3b 4 layers": ["--model", "qwen3-30b-a3b", "num_layers=4", "per_device_batch_size=4",
                               "remat_policy=full"],
    "mixtral-8x7b 2 layers": ["--model", "mixtral-8x7b", "num_layers=2", "per_device_batch_size=4",
                              "remat_policy=full"],
    "deepseek-v2-lite 4 layers": ["--model", "deepseek-v2-lite", "num_layers=4", "per_device_batch_size=4",
                                  "remat_policy=full"],
    "scaled-4 flash full": ["--model", "scaled-4", "per_device_batch_size=4", "attention=flash", "remat_policy=full"],
}

GIB = 2**30


def maxperf(*args: str, timeout: float = 900) -> tuple[int, dict | None, str]:
    """Runs `python -m maxperf.cli ARGS --json`: exit code, the JSON document (None if none), stderr's last line."""
    proc = subprocess.run([sys.executable, "-m", "maxperf.cli", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout)
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        doc = None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return proc.returncode, doc, lines[-1] if lines else ""


def measure(name: str, args: list[str], topology: str, steps: int, work: Path) -> dict:
    out = work / name.replace(" ", "_")
    start = time.perf_counter()
    rc, compiled, why = maxperf("compile", "--topology", topology, *args, "seq_len=2048", "--out", str(out / "c"))
    row: dict = {"case": name, "compile_rc": rc, "compile_wall_s": time.perf_counter() - start}
    if compiled is None or rc not in (0, 3):
        return {**row, "error": why or f"compile exit {rc}"}
    memory = compiled.get("memory") or {}
    estimate = compiled.get("estimate") or {}
    row.update(compile_s=compiled.get("compile_seconds"), fits=compiled.get("fits"),
               compiler_gib=(memory.get("per_device_total_bytes") or 0) / GIB,
               predicted_step_s=estimate.get("step_time_s"), predicted_mfu=estimate.get("mfu"),
               predicted_memory_gib=(estimate.get("memory_per_device_bytes") or 0) / GIB,
               predicted_breakdown=estimate.get("breakdown"), limitations=compiled.get("limitations"))
    if rc == 3:
        return {**row, "error": "does not fit"}
    rc, run, why = maxperf("run", str(out / "c"), "--steps", str(steps), "--warmup", "3", "--out", str(out / "r"))
    if run is None or rc != 0:
        return {**row, "error": why or f"run exit {rc}"}
    row.update(measured_step_s=run["step_time_s"], measured_p10_s=run["step_time_p10_s"],
               measured_p90_s=run["step_time_p90_s"], measured_mfu=run["mfu"],
               measured_over_predicted=run["measured_over_predicted"],
               measured_peak_gib=(run["memory"].get("measured_peak_bytes") or 0) / GIB,
               loss_first=run["losses"][0], loss_last=run["losses"][-1], device_kind=run["device_kind"])
    return row


def line(row: dict) -> str:
    if "error" in row and "measured_step_s" not in row:
        return f"{row['case']:<24} {row['error']}"
    return (f"{row['case']:<24} compile {row['compile_s']:6.1f} s  memory XLA {row['compiler_gib']:6.2f} GiB, "
            f"analytical {row['predicted_memory_gib']:6.2f}, measured peak {row['measured_peak_gib']:6.2f}  "
            f"step predicted {row['predicted_step_s'] * 1e3:7.1f} ms, measured {row['measured_step_s'] * 1e3:7.1f} "
            f"(p10 {row['measured_p10_s'] * 1e3:.1f}, p90 {row['measured_p90_s'] * 1e3:.1f}; "
            f"measured/predicted {row['measured_over_predicted']:.3f})  MFU predicted {row['predicted_mfu']:.3f}, "
            f"measured {row['measured_mfu']:.3f}  loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="h100-1")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args()
    args.json = outfile.checked(parser, args.json)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    rows = []
    with tempfile.TemporaryDirectory(prefix="maxperf-gpu-bench-") as work:
        for name in names:
            row = measure(name, CASES[name], args.topology, args.steps, Path(work))
            rows.append(row)
            print(line(row), flush=True)
            if args.json:
                outfile.write(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
