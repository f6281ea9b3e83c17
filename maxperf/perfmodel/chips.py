"""What each chip sustains in a training step, beside its datasheet (maxperf.spec.hardware): the share of its peak a
large matmul runs at, fitted on published runs or measured, and the CPU devices' rates measured by `maxperf
calibrate`.

Sources: [mamf] S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul
FLOPS comparison table" (github.com/stas00/ml-engineering); [fit] fitted on bench/published (bench/published.py,
rows of that chip).
"""

from __future__ import annotations

from dataclasses import replace

from maxperf.perfmodel.calibration import Calibration
from maxperf.spec.errors import unknown
from maxperf.spec.hardware import CHIPS, Chip

# The rate a large dense matmul sustains in a training step, as a fraction of the datasheet peak (Chip.matmul_fraction):
# a datasheet peak counts every tensor unit busy at the boost clock, which a chip running dense matmuls through a whole
# step does not hold within its power limit (H100 SXM: 700 W [h100]), and a step's matmuls are of the shapes a model
# has, not a benchmark's best. perfmodel.steptime scales every matmul and the flash kernels by it. No TPU page
# publishes a measured matmul rate: TPUs' are fitted [fit]. The GPUs' measured GEMM rates [mamf] (A100 SXM 0.869,
# H100 SXM 0.803, B200 0.776, GB200 0.729 of peak) are best shapes over 100 iterations, above what training steps
# reach: the GPUs with rows are fitted too, and those without take [mamf] x 0.77, H100's fitted / measured ratio.
# [fit]: bench/published.py (all constants free, 2026-11-23, 81 rows; per chip n rows): leave-one-out median / worst
# |error| over its rows in the comment.
MATMUL_FRACTION = {
    "tpu-v4": 0.81,  # [fit] 6 rows (MaxText v4 table): LOO 3.0% / 5.2%
    "tpu-v5e": 0.94,  # [fit] 24 rows (MaxText v5e table): LOO 1.8% / 13.4%
    "tpu-v5p": 0.86,  # [fit] 16 rows (MaxText v5p table): LOO 6.3% / 11.7%
    "tpu7x": 0.77,  # [fit] 3 rows (tpu-recipes Ironwood): LOO 0.6% / 0.8%
    "tpu-v6e": 0.85,  # assumed: the mean of the fitted TPU generations (no v6e rows)
    "a100-40gb": 0.79,  # [fit] 4 rows (MPT): LOO 1.6% / 1.9%; [mamf] measured 0.869
    "a100-80gb": 0.83,  # [fit] 9 rows (MPT): LOO 2.4% / 10.8%; [mamf] measured 0.869
    "h100-sxm": 0.62,  # [fit] 19 rows (MPT, MaxText A3): LOO 2.3% / 12.1%; [mamf] measured 0.803
    "h200": 0.62,  # assumed as H100 SXM: the same tensor cores at the same 700 W ([h200]; [mamf] "H200 is the same")
    "b200": 0.60,  # assumed: [mamf] 0.776 x 0.77
    "gb200": 0.56,  # assumed: [mamf] 0.729 x 0.77
}
MATMUL_FRACTION_ORIGIN = {name: "fitted" for name in ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu7x", "a100-40gb",
                                                      "a100-80gb", "h100-sxm")}
MATMUL_FRACTION_ORIGIN |= {name: "assumed" for name in ("tpu-v6e", "h200", "b200", "gb200")}


def calibrated_cpu(cal: Calibration | None) -> Chip:
    """The "cpu" chip with measured peaks where a calibration exists, else the labelled defaults."""
    chip = CHIPS["cpu"]
    if cal is None:
        return chip
    fp32 = cal.peak_flops("float32") or chip.peak_fp32_flops
    bf16 = cal.peak_flops("bfloat16") or fp32
    dtypes = sorted({s.dtype for s in cal.matmul})
    halves = tuple((dtype, h) for dtype in dtypes if (h := cal.matmul_half(dtype)) is not None)
    collectives = ()
    if cal.collective_bandwidth and cal.all_reduce_bandwidth:
        collectives = (("all-reduce", cal.all_reduce_bandwidth / cal.collective_bandwidth),)
    return replace(
        chip, peak_bf16_flops=bf16, peak_fp32_flops=fp32, hbm_bandwidth=cal.memory_bandwidth,
        link_bandwidth=cal.collective_bandwidth or cal.memory_bandwidth, matmul_half=halves,
        collective_efficiency=collectives, page_fault_bandwidth=cal.page_fault_bandwidth,
        transpose_bandwidth=cal.transpose_bandwidth, elementwise_bandwidth=cal.elementwise_bandwidth,
        attention_rates=tuple((s.dtype, s.head_dim, s.flops_per_s) for s in cal.attention),
        collective_latency=cal.collective_latency, calibrated=True,
        note=f"calibrated {cal.created} on {cal.device_kind} ({cal.platform}, jax {cal.jax_version})",
    )


def get(name: str, calibration: Calibration | None = None) -> Chip:
    """The chip named `name`; for "cpu", with the measured peaks of `calibration` when one is given (perfmodel
    never reads a calibration from disk: callers load it and pass it in)."""
    if name not in CHIPS:
        raise unknown("chip", name, CHIPS)
    if name == "cpu":
        return calibrated_cpu(calibration)
    return CHIPS[name]
