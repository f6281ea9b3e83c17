"""The serving steps' memory: perfmodel.serving's analytical figure against the compiler's, over a grid of
models, steps and targets compiled from this machine.

    .venv/bin/python bench/serving_memory.py [--only SUBSTRING] [--json FILE]

Each case is compiled (maxperf.aot.compile with --step prefill or decode, XLA's memory_analysis of the executable
for a TPU or GPU target without one) and estimated (perfmodel.serving.estimate_memory of the same step); the error
is analytical / compiled - 1 of the per-device total. The grid covers dense grouped-query, sliding-window and
soft-capped models, mixtures of experts under tensor and expert parallelism, latent attention, int8 and fp8
weights and an int8 cache, on H100s and TPU v5e, v5p, v6e and TPU7x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
import outfile  # noqa: E402

GRID = [  # (step, model, topology, words)
    ("decode", "llama3-8b", "h100-1", "per_device_batch_size=64 max_target_length=8192 "
                                      "max_prefill_predict_length=2048"),
    ("prefill", "llama3-8b", "h100-1", "per_device_batch_size=8 max_target_length=8192 "
                                       "max_prefill_predict_length=2048"),
    ("decode", "llama3-70b", "h100-8", "ici_tensor_parallelism=8 per_device_batch_size=32 max_target_length=4096 "
                                       "max_prefill_predict_length=1024"),
    ("prefill", "llama3-70b", "h100-8", "ici_tensor_parallelism=8 per_device_batch_size=4 max_target_length=4096 "
                                        "max_prefill_predict_length=1024"),
    ("decode", "llama3-70b", "h100-8", "ici_tensor_parallelism=8 per_device_batch_size=32 max_target_length=4096 "
                                       "max_prefill_predict_length=1024 quantization=fp8 quantize_kvcache=true"),
    ("decode", "llama3-70b", "v5e-8", "ici_tensor_parallelism=8 per_device_batch_size=8 max_target_length=2048 "
                                      "max_prefill_predict_length=1024 quantization=int8 quantize_kvcache=true"),
    ("prefill", "llama3-70b", "v5e-8", "ici_tensor_parallelism=8 per_device_batch_size=1 max_target_length=2048 "
                                       "max_prefill_predict_length=1024 quantization=int8 quantize_kvcache=true"),
    ("decode", "llama2-7b", "v5e-8", "ici_tensor_parallelism=8 per_device_batch_size=12 max_target_length=2048 "
                                     "max_prefill_predict_length=1024"),
    ("decode", "gemma3-12b", "v5e-8", "ici_tensor_parallelism=8 per_device_batch_size=8 max_target_length=8192 "
                                      "max_prefill_predict_length=1024 quantize_kvcache=true kv_quant_axis=dkv"),
    ("decode", "llama3-8b", "v6e-8", "ici_tensor_parallelism=8 per_device_batch_size=32 max_target_length=4096 "
                                     "max_prefill_predict_length=1024"),
    ("prefill", "gemma3-12b", "v6e-8", "ici_tensor_parallelism=8 per_device_batch_size=1 max_target_length=8192 "
                                       "max_prefill_predict_length=4096"),
    ("decode", "llama3.1-70b", "tpu7x-8", "ici_tensor_parallelism=8 per_device_batch_size=16 max_target_length=8192 "
                                          "max_prefill_predict_length=1024 quantization=fp8"),
    ("decode", "mixtral-8x7b", "h100-8", "ici_tensor_parallelism=8 per_device_batch_size=32 max_target_length=4096 "
                                         "max_prefill_predict_length=1024"),
    ("decode", "qwen3-30b-a3b", "v5p-8", "ici_expert_parallelism=4 per_device_batch_size=32 max_target_length=4096 "
                                         "max_prefill_predict_length=1024"),
    ("decode", "deepseek-v2-lite", "h100-1", "per_device_batch_size=64 max_target_length=4096 "
                                             "max_prefill_predict_length=1024"),
    ("prefill", "deepseek-v2-lite", "h100-1", "per_device_batch_size=4 max_target_length=4096 "
                                              "max_prefill_predict_length=1024"),
    ("decode", "gpt-oss-20b", "h100-1", "per_device_batch_size=32 max_target_length=8192 "
                                        "max_prefill_predict_length=1024 quantization=fp8"),
]


def run_case(step: str, model: str, topology: str, words: str, work: Path) -> dict:
    from maxperf import aot
    from maxperf.perfmodel import serving
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.errors import DoesNotFit
    from maxperf.spec.request import resolve

    t = time.perf_counter()
    out = work / f"{step}_{model}_{topology}"
    try:
        memory = aot.compile(topology, model, words.split(), out=out, step=step, force=True).memory
    except DoesNotFit:  # the compiler's out-of-memory figures, as compile wrote them
        memory = json.loads((out / "memory.json").read_text())
    p = resolve(topology, model, words.split())
    chip = device_for(p.topology)
    analytical = serving.estimate_memory(p.model, p.train, p.mesh, chip.hbm_bytes, step, platform=chip.kind)
    compiled = memory["per_device_total_bytes"]
    return {"step": step, "model": model, "topology": topology, "words": words, "compiled_bytes": compiled,
            "analytical_bytes": analytical.total_bytes, "weights_bytes": analytical.weights_bytes,
            "cache_bytes": analytical.cache_bytes, "temp_bytes": analytical.temp_bytes,
            "compiler_temp_bytes": memory.get("temp_bytes", 0), "error": analytical.total_bytes / compiled - 1,
            "seconds": time.perf_counter() - t}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose line holds this")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.json = outfile.checked(ap, args.json)
    from maxperf.cli.common import compile_only_environment

    compile_only_environment("v5e-8")
    cases = [c for c in GRID if args.only is None or args.only in " ".join(c)]
    rows = []
    gib = 1 << 30
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'step':<8} {'model':<17} {'target':<7} {'compiled':>9} {'analyt.':>8} {'error':>7} {'temp c/a':>12}")
        for case in cases:
            r = run_case(*case, Path(tmp))
            rows.append(r)
            print(f"{r['step']:<8} {r['model']:<17} {r['topology']:<7} {r['compiled_bytes'] / gib:>8.2f}G "
                  f"{r['analytical_bytes'] / gib:>7.2f}G {100 * r['error']:>+6.1f}% "
                  f"{r['compiler_temp_bytes'] / gib:>5.2f}/{r['temp_bytes'] / gib:<5.2f}G", flush=True)
    errors = [abs(r["error"]) for r in rows]
    out = {"cases": rows, "median": statistics.median(errors), "worst": max(errors),
           "within_10pct": sum(e <= 0.10 for e in errors)}
    print(f"{len(rows)} cases: median |error| {100 * out['median']:.1f}%, worst {100 * out['worst']:.1f}%, "
          f"{out['within_10pct']} within 10%")
    if args.json:
        outfile.write(args.json, out, indent=2)
    return out


if __name__ == "__main__":
    main()
