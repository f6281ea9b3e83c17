"""What each chip sustains in a training step, beside its datasheet (maxperf.spec.hardware): the share of its peak a
large matmul runs at, fitted on published runs or measured, and the CPU devices' rates measured by `maxperf
calibrate`.

Sources: [mamf] S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul
FLOPS comparison table" (github.com/stas00/ml-engineering); [fit] fitted on bench/published (bench/published.py,
rows of that chip).
"""

from __future__ import annotations

import math
from dataclasses import replace

from maxperf.perfmodel.calibration import Calibration
from maxperf.spec.errors import unknown
from maxperf.spec.hardware import CHIPS, Chip

# The rate a large dense matmul sustains in a training step, as a fraction of the datasheet peak (Constants.fraction):
# a datasheet peak counts every tensor unit busy at the boost clock, which a chip running dense matmuls through a whole
# step does not hold within its power limit (H100 SXM: 700 W [h100]), and a step's matmuls are of the shapes a model
# has, not a benchmark's best. perfmodel.work scales every matmul and the flash kernels by it, and no matmul runs
# faster than the chip's best measured one (MEASURED_MATMUL, where published). TPUs' fractions are fitted [fit]; the
# GPUs with rows are fitted too; their measured GEMM rates [mamf], best shapes over 100 iterations, sit above what
# training steps reach. Chips without rows take `fraction_without_rows` of the fitted ones. [fit]: bench/published.py
# (FITTED_ON), per chip n rows.
MATMUL_FRACTION = {
    "tpu-v4": 0.814,  # [fit] 6 rows (MaxText v4 table)
    "tpu-v5e": 0.995,  # [fit] 24 rows (MaxText v5e table)
    "tpu-v5p": 0.882,  # [fit] 16 rows (MaxText v5p table)
    # [fit] 5 rows (tpu-recipes Ironwood); their large matmuls run at the measured 0.829 (MEASURED_MATMUL), so the fit
    # cannot determine it: held at its fit before that cap, and held in bench/published.py's fits
    "tpu7x": 0.978,
    # [fit] 4 and 9 rows (MPT), refitted on 2026-12-01 (90 rows) when a GPU's HALF came to scale with its FLOPs per
    # HBM byte (perfmodel.work.half_scale): 0.775 and 0.824 with H100's HALF; and on 2026-12-02 when their flash
    # kernels came to run at FlashAttention-2's A100 rate (flash_architecture): 0.756 and 0.779 before, one GA100's
    # compute fitted 3% apart, 0.2% now
    "a100-40gb": 0.728,
    "a100-80gb": 0.727,
    "h100-sxm": 0.616,  # [fit] 21 rows (MPT, MaxText A3, NVIDIA Megatron-Bridge)
}
FITTED_ON = "bench/published.py, 2026-11-27, 86 rows"
# Chips whose tensor cores, clocks and power limit are another's: H200 is H100 SXM's compute at the same 700 W with
# more and faster HBM ([h200]; [mamf] "H200 is the same"); the A100 SXM4's 40 GB and 80 GB parts are one GA100 at the
# same 312 TFLOP/s, clocks and 400 W, with HBM2 or faster HBM2e ([a100])
SAME_COMPUTE = {"h200": "h100-sxm", "a100-80gb": "a100-40gb", "a100-40gb": "a100-80gb"}
# The best bf16 matmul rate measured on each chip, over its datasheet peak: no matmul of a step runs faster
# (perfmodel.work.price caps the law there). GPUs: [mamf] ("H200 is the same" as H100 SXM). TPU7x: Google's Ironwood
# GEMM sweep, bf16, TFLOP/s per device (one of a chip's two TensorCores, 1153.5 of its peak): 892.9 at m = n = k = 4096,
# 950.1 at 16384, 956.4 at 32768 ([iw-gemm] tpu-recipes microbenchmarks/ironwood/README.md, "Results: GEMM"), where
# the law fitted on steps would go on rising (0.91 of peak at 16384). TPU v6e: 827.5 TFLOP/s at 8192 cubed with a
# 64 MiB scoped VMEM limit ([v6e-gemm] tpu-recipes microbenchmarks/README.md; no larger size published), and 840.2 at
# 4096 cubed (the same README at af2a7cd, 2025-04-03): v6e's GEMM gains nothing from 4096 to 8192 (matmul_plateau).
MEASURED_MATMUL = {"a100-40gb": 0.869, "a100-80gb": 0.869, "h100-sxm": 0.803, "h200": 0.803, "b200": 0.776,
                   "gb200": 0.729, "tpu7x": 0.829, "tpu-v6e": 0.901}


# Published bf16 GEMM sweeps, m = n = k -> TFLOP/s per device (a TPU7x device is one of its chip's two TensorCores):
# TPU7x [iw-gemm], v6e [v6e-gemm] (the sources above).
GEMM_SWEEPS = {
    "tpu7x": {1024: 349.7270639, 2048: 679.284728, 4096: 892.9445127, 16384: 950.1286983, 32768: 956.3824592},
    "tpu-v6e": {4096: 840.2, 8192: 827.5},
}
# The JAX devices among which each swept chip's peak is shared (a TPU7x chip's two TensorCores)
SWEEP_DEVICES_PER_CHIP = {"tpu7x": 2, "tpu-v6e": 1}
# A swept size within this share of the sweep's best has stopped gaining with width
PLATEAU_TOLERANCE = 0.01
# Per chip with a sweep, the smallest swept size within PLATEAU_TOLERANCE of the sweep's best (matmul_plateau)
GEMM_PLATEAU = {name: min(m for m, rate in sweep.items() if rate >= (1 - PLATEAU_TOLERANCE) * max(sweep.values()))
                for name, sweep in GEMM_SWEEPS.items()}


# FlashAttention-2's forward + backward rate, TFLOP/s, at 2,048, 4,096 and 8,192 tokens (16k tokens a batch, hidden
# 2048, head dim 128, causal, bf16), as [fa2] prints it over its bars: Fig. 4(d) on an A100 80GB SXM4, Fig. 7(d) on an
# H100 80GB SXM5 (the figures in the paper's repository, Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark
# .png and flash2_h100_fwd_bwd_benchmark.png). Over each chip's best measured matmul (MEASURED_MATMUL) that is 0.57 to
# 0.67 on the A100 and 0.33 to 0.39 on the H100: the kernel issues the warp-level mma instructions native to Ampere,
# while Hopper's GEMMs reach its peak through warpgroup instructions that FlashAttention-2 does not use ([fa3]
# abstract: "FlashAttention-2 achieving only 35% utilization on the H100 GPU"). The ratio is 1.71x to 1.73x at each
# length, and 1.71x to 1.78x over the figures' other panels (head dim 64, no causal mask).
# [fa2]: T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", arXiv:2307.08691;
# [fa3]: J. Shah et al., "FlashAttention-3", arXiv:2407.08608.
FA2_MEASURED_TFLOPS = {"a100-80gb": (155.0, 173.0, 182.0), "h100-sxm": (265.0, 294.0, 308.0)}
FA2_REFERENCE = "h100-sxm"  # the chip perfmodel.work.FLASH_EFFICIENCY's GPU value is of


def flash_architecture(chip: Chip) -> float:
    """How much more of its best matmul a FlashAttention-2-class kernel (FlashAttention-2, Triton's and Pallas
    Triton's flash kernels, and cuDNN's on chips without Hopper's instructions) sustains on `chip` than on an H100:
    the mean over FA2_MEASURED_TFLOPS's lengths of each chip's rate over its best matmul, `chip`'s over the H100's.
    A chip of another's compute (SAME_COMPUTE) takes that one's; 1 where no figure is published (H200 is H100's
    compute; Blackwell and the TPUs are not measured so)."""
    name = chip.name if chip.name in FA2_MEASURED_TFLOPS else SAME_COMPUTE.get(chip.name, chip.name)
    if name not in FA2_MEASURED_TFLOPS or name == FA2_REFERENCE:
        return 1.0
    ref = CHIPS[FA2_REFERENCE]
    own = CHIPS[name]

    def share(rate: float, c: Chip) -> float:
        return rate * 1e12 / (MEASURED_MATMUL[c.name] * c.peak_bf16_flops)

    ratios = [share(a, own) / share(h, ref)
              for a, h in zip(FA2_MEASURED_TFLOPS[name], FA2_MEASURED_TFLOPS[FA2_REFERENCE])]
    return sum(ratios) / len(ratios)


def matmul_plateau(chip: Chip) -> float:
    """The width past which a matmul on `chip` runs no faster for being wider (GEMM_PLATEAU); unbounded (inf) where no
    sweep is published. The thin-matmul law (perfmodel.work.matmul_efficiency) keeps rising with its smallest side m;
    on v6e, whose GEMM gains nothing from 4096 to 8192, it stops at 4096, where the law at a 256-wide array would give
    8192- and 16384-wide matmuls 13% and 22% more (TPU7x's sweep gains up to 16384, past where its ceiling already
    stops the law)."""
    return GEMM_PLATEAU.get(chip.name, math.inf)


def matmul_ceiling(chip: Chip) -> float:
    """The most of its peak any matmul sustains on `chip`: its best measured one (MEASURED_MATMUL), unbounded (inf)
    where none is published."""
    return MEASURED_MATMUL.get(chip.name, math.inf)


def fraction_without_rows(name: str, fitted: dict[str, float]) -> float:
    """The sustained-rate fraction of a chip that `fitted` (chip name -> fitted fraction) has no rows for. A TPU takes
    the mean of the fitted TPUs whose JAX devices drive as many TensorCores (Chip.cores_per_device: a megacore device
    splits each operation between its two cores, and the fitted megacore chips sustain less: v4 and v5p below v5e and
    TPU7x), or of all fitted TPUs where none does; a GPU its measured GEMM rate [mamf] times the fitted GPUs' mean of
    fitted over measured; a chip of another's compute (SAME_COMPUTE) that one's. Held out a generation at a time on
    bench/published.py's rows, this rule is what `--hold-out hardware` checks."""
    chip = CHIPS[name]
    if SAME_COMPUTE.get(name) in fitted:
        return fitted[SAME_COMPUTE[name]]
    same_kind = {n: f for n, f in fitted.items() if CHIPS[n].kind == chip.kind and n != name}
    if chip.kind == "tpu":
        alike = [f for n, f in same_kind.items() if CHIPS[n].cores_per_device == chip.cores_per_device]
        pool = alike or list(same_kind.values())
        return sum(pool) / len(pool)
    ratios = [f / MEASURED_MATMUL[n] for n, f in same_kind.items() if n in MEASURED_MATMUL]
    return MEASURED_MATMUL[name] * (sum(ratios) / len(ratios) if ratios else 1.0)


MATMUL_FRACTION_ORIGIN = {name: "fitted" for name in MATMUL_FRACTION}
for _name in ("tpu-v6e", "h200", "b200", "gb200"):
    MATMUL_FRACTION_ORIGIN[_name] = "assumed"
    MATMUL_FRACTION[_name] = round(fraction_without_rows(_name, {n: MATMUL_FRACTION[n] for n in list(MATMUL_FRACTION)
                                                                 if MATMUL_FRACTION_ORIGIN.get(n) == "fitted"}), 3)


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
