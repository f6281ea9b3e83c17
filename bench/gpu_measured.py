"""Predicted against measured on this machine's GPU: each case is compiled by `maxperf compile` on the attached GPU
(autotuned), run by `maxperf run`, and printed with the prediction beside the measurement.

    .venv/bin/python bench/gpu_measured.py [--topology h100-1 | h200-1] [--steps 10] [--only NAME,...] [--json FILE]

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
    # the kernel's output and log-sum-exp kept by name: the backward runs the backward kernel alone
    "scaled-1 flash minimal_with_context": ["--model", "scaled-1", "per_device_batch_size=8", "attention=flash",
                                            "remat_policy=minimal_with_context"],
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
    # the same step in the precisions NVIDIA's recipes train in: delayed scaling (flax's FP8 ops) and current scaling
    "scaled-1 flash full fp8": ["--model", "scaled-1", "per_device_batch_size=8", "attention=flash",
                                "remat_policy=full", "quantization=fp8"],
    "scaled-1 flash full fp8 current": ["--model", "scaled-1", "per_device_batch_size=8", "attention=flash",
                                        "remat_policy=full", "quantization=te_fp8_currentscaling"],
    # serving: one prefill of the batch's prompts, then decode steps over the cache
    "llama3-8b prefill B8 P1024": ["--step", "prefill", "--model", "llama3-8b", "per_device_batch_size=8",
                                   "max_prefill_predict_length=1024", "max_target_length=4096"],
    "llama3-8b decode B64 S4096": ["--step", "decode", "--model", "llama3-8b", "per_device_batch_size=64",
                                   "max_prefill_predict_length=1024", "max_target_length=4096"],
    "llama3-8b decode B8 S4096": ["--step", "decode", "--model", "llama3-8b", "per_device_batch_size=8",
                                  "max_prefill_predict_length=1024", "max_target_length=4096"],
    # unscanned layers, as MaxText's served checkpoints are: each layer's weights and cache read in place
    "llama3-8b decode B8 S4096 unscanned": ["--step", "decode", "--model", "llama3-8b", "per_device_batch_size=8",
                                            "max_prefill_predict_length=1024", "max_target_length=4096",
                                            "scan_layers=false"],
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
    serving = "--step" in args
    start = time.perf_counter()
    rc, compiled, why = maxperf("compile", "--topology", topology, *args, *([] if serving else ["seq_len=2048"]),
                                "--out", str(out / "c"))
    row: dict = {"case": name, "compile_rc": rc, "compile_wall_s": time.perf_counter() - start, "serving": serving}
    if compiled is None or rc not in (0, 3):
        return {**row, "error": why or f"compile exit {rc}"}
    memory = compiled.get("memory") or {}
    estimate = compiled.get("estimate") or {}
    hlo = estimate.get("hlo_time") or {}
    row.update(compile_s=compiled.get("compile_seconds"), fits=compiled.get("fits"),
               compiler_gib=(memory.get("per_device_total_bytes") or 0) / GIB,
               hlo_predicted_step_s=hlo.get("step_time_s"), limitations=compiled.get("limitations"))
    if serving:
        predicted = ((estimate.get("prefill") or {}).get("seconds") if compiled.get("step") == "prefill"
                     else estimate.get("time_per_output_token_s"))
        row.update(predicted_step_s=predicted,
                   predicted_memory_gib=((estimate.get("memory") or {}).get("total_bytes") or 0) / GIB)
    else:
        row.update(predicted_step_s=estimate.get("step_time_s"), predicted_mfu=estimate.get("mfu"),
                   predicted_memory_gib=(estimate.get("memory_per_device_bytes") or 0) / GIB,
                   predicted_breakdown=estimate.get("breakdown"))
    if rc == 3:
        return {**row, "error": "does not fit"}
    rc, run, why = maxperf("run", str(out / "c"), "--steps", str(steps), "--warmup", "3", "--out", str(out / "r"))
    if run is None or rc != 0:
        return {**row, "error": why or f"run exit {rc}"}
    row.update(measured_step_s=run["step_time_s"], measured_over_predicted=run["measured_over_predicted"],
               measured_over_hlo_predicted=run.get("measured_over_hlo_predicted"), device_kind=run["device_kind"])
    if serving:
        row.update(measured_min_s=run["step_time_min_s"], tokens_per_s=run["tokens_per_s"])
    else:
        row.update(measured_p10_s=run["step_time_p10_s"], measured_p90_s=run["step_time_p90_s"],
                   measured_mfu=run["mfu"], measured_peak_gib=(run["memory"].get("measured_peak_bytes") or 0) / GIB,
                   loss_first=run["losses"][0], loss_last=run["losses"][-1])
    return row


def ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:8.2f}" if seconds else "     n/a"


def line(row: dict) -> str:
    if "error" in row and "measured_step_s" not in row:
        return f"{row['case']:<32} {row['error']}"
    hlo = row.get("measured_over_hlo_predicted")
    common = (f"{row['case']:<32} compile {row['compile_s']:6.1f} s  memory XLA {row['compiler_gib']:6.2f} GiB, "
              f"analytical {row['predicted_memory_gib']:6.2f}  step measured {ms(row['measured_step_s'])} ms, "
              f"predicted {ms(row['predicted_step_s'])} (x{row['measured_over_predicted'] or 0:.3f}), "
              f"from HLO {ms(row['hlo_predicted_step_s'])} (x{hlo or 0:.3f})")
    if row["serving"]:
        return f"{common}  {row['tokens_per_s']:.0f} tokens/s"
    return (f"{common}  p10 {ms(row['measured_p10_s'])} p90 {ms(row['measured_p90_s'])}  MFU predicted "
            f"{row['predicted_mfu']:.3f}, measured {row['measured_mfu']:.3f}  peak {row['measured_peak_gib']:.2f} GiB"
            f"  loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}")


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
