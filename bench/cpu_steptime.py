"""Measured step time on this machine's CPU devices against perfmodel's prediction, after `maxperf calibrate`.

    .venv/bin/python bench/cpu_steptime.py [--devices N] [--steps S] [--no-calibrate]

Calibrates first (maxperf.profiler.calibrate: matmul FLOP/s, memory, transposing-copy, softmax, page-fault and
collective bandwidth, whole-attention FLOP/s and collective latency of this machine's jax devices, stored where
perfmodel reads them), then for each configuration compiles the train step for cpu-N through maxperf.aot.compile,
runs it as `maxperf run` does (maxperf.profiler.run: a real state, warm-up steps, then S timed steps, each waited
for), and prints the median measured step time beside perfmodel.estimate(...) for the same configuration on the cpu
topology, the signed error of the prediction, and the median absolute error (target: under 25%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path


def _devices_flag(n: int) -> None:
    flag = f"--xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


# (preset, overrides): tiny at a few batch sizes and sequence lengths, and scaled-1 / qwen3-0.6b shrunk in depth,
# sequence and vocabulary so that one step takes well under a second on two cores
CONFIGS = (
    ("tiny", ("per_device_batch_size=4", "seq_len=128")),
    ("tiny", ("per_device_batch_size=8", "seq_len=256")),
    ("tiny", ("per_device_batch_size=2", "seq_len=512")),
    ("tiny", ("per_device_batch_size=8", "seq_len=256", "remat_policy=none")),
    ("scaled-1", ("num_layers=2", "per_device_batch_size=1", "seq_len=128", "vocab_size=8192")),
    ("scaled-1", ("num_layers=2", "per_device_batch_size=2", "seq_len=256", "vocab_size=8192")),
    ("qwen3-0.6b", ("num_layers=2", "per_device_batch_size=1", "seq_len=256", "vocab_size=8192")),
    ("qwen3-0.6b", ("num_layers=2", "per_device_batch_size=2", "seq_len=512", "vocab_size=8192",
                    "remat_policy=minimal")),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2, help="CPU devices (the cpu-N topology)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-calibrate", action="store_true", help="use the stored calibration")
    args = ap.parse_args()
    _devices_flag(args.devices)

    from maxperf import aot, perfmodel
    from maxperf.profiler.calibrate import calibrate
    from maxperf.profiler.run import run
    from maxperf.user_cache import load_calibration

    if not args.no_calibrate:
        cal = calibrate()
        bf16_attention = [s for s in cal.attention if s.dtype == "bfloat16"]
        print(f"calibrated: bf16 {cal.peak_flops('bfloat16') / 1e9:.1f} GFLOP/s (half rate at a thin side of "
              f"{cal.matmul_half('bfloat16'):.0f}), f32 {cal.peak_flops('float32') / 1e9:.1f} GFLOP/s, memory "
              f"{cal.memory_bandwidth / 1e9:.1f} GB/s, transposing copies {cal.transpose_bandwidth / 1e9:.1f} GB/s, "
              f"softmax {cal.elementwise_bandwidth / 1e9:.1f} GB/s, bf16 attention "
              f"{'/'.join(f'{s.flops_per_s / 1e9:.0f}' for s in bf16_attention)} GFLOP/s (head_dim "
              f"{'/'.join(str(s.head_dim) for s in bf16_attention)}), "
              f"page faults {(cal.page_fault_bandwidth or 0) / 1e9:.1f} GB/s, all-gather "
              f"{(cal.collective_bandwidth or 0) / 1e9:.1f} GB/s, all-reduce "
              f"{(cal.all_reduce_bandwidth or 0) / 1e9:.1f} GB/s, {(cal.collective_latency or 0) * 1e6:.0f} us per "
              f"collective ({cal.num_devices} devices)")
    topology = f"cpu-{args.devices}"
    calibration = load_calibration()  # the one the compiles' estimate.json and these predictions both use
    print(f"{'model':<11} {'config':<58} {'measured':>9} {'predicted':>9} {'error':>7}")
    errors = []
    with tempfile.TemporaryDirectory(prefix="maxperf-steptime-") as tmp:
        for i, (model, overrides) in enumerate(CONFIGS):
            result = aot.compile(topology, model, overrides, out=Path(tmp) / f"c{i}", calibration=calibration)
            measured = run(result.out_dir, steps=args.steps, warmup=args.warmup).step_time_s
            p = result.plan
            est = perfmodel.estimate(p, calibration=calibration)
            error = (est.step_time_s - measured) / measured
            errors.append(abs(error))
            print(f"{model:<11} {' '.join(overrides):<58} {measured * 1e3:>7.1f}ms {est.step_time_s * 1e3:>7.1f}ms "
                  f"{error:>+7.1%}", flush=True)
    print(f"\n{len(errors)} configurations: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}; "
          "target: median < 25%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
