"""A step's work recorded as terms, and the fitted constants that price them.

`Work` records what a step does (every matmul's FLOPs, bytes and smallest side; the flash kernels' FLOPs; the
elementwise traffic per pass; every collective's and host copy's seconds and overlap); `price` turns the terms into
seconds at given constants and `settle` into a step time. perfmodel.steptime prices one step so; bench/published.py
prices all its rows at once with the same two functions to fit the constants.

Each matmul is a roofline (Williams et al. 2009): max(FLOPs / (peak x efficiency), bytes / HBM bandwidth).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from maxperf.perfmodel import cpu
from maxperf.perfmodel.chips import (
    CHIPS,
    GEMM_SWEEPS,
    MATMUL_FRACTION,
    MATMUL_FRACTION_ORIGIN,
    SWEEP_DEVICES_PER_CHIP,
    Chip,
    flash_architecture,
    matmul_ceiling,
    matmul_plateau,
)
from maxperf.spec import attention_rule
from maxperf.spec.errors import require
from maxperf.spec.fp8 import Fp8Recipe, Granularity, Scaling
from maxperf.spec.fp8 import recipe as fp8_recipe
from maxperf.spec.train import TrainConfig

# Matmul efficiency = min(fraction x m / (m + HALF), ceiling) x fill, m the smallest of the matmul's dimensions: the
# rate a large matmul sustains on the chip (chips.MATMUL_FRACTION), less for a thinner one, which fills the systolic
# arrays and tensor-core tiles less well and has less work to hide each kernel's start and end behind (a matmul whose
# smallest side is HALF reaches half of it; on a TPU HALF grows with its matrix units' width, on a GPU with its FLOPs
# per HBM byte: half_scale), never above
# the chip's best measured matmul (chips.MEASURED_MATMUL: the law keeps rising with m where Ironwood's measured GEMMs
# level off at 0.83 of its peak), m no wider than where the chip's published GEMM sweep stops gaining
# (chips.matmul_plateau: v6e's at 4096), and less where its contraction and output dims fill a TPU's matrix units in
# part (mxu_fill). Fitted: bench/published.py (FITTED), 86 rows, 51 TPU and 35 GPU; the TPU's HALF (at a 128-wide
# array) read from Ironwood's GEMM sweep (half_from_sweep), the GPU's fitted. The rows'
# matmuls have smallest sides of 1024 to 16384 (half their FLOPs at 6144 or more; every row runs flash attention):
# below 1024, as for the dot product's head-dim-wide einsums, the figure is an extrapolation.
FITTED = "2026-11-27, the constants of bench/published.py's default --free, from its PRIOR"
# The GPU whose HALF Constants.matmul_half["gpu"] is; other GPUs scale it by their FLOPs per HBM byte (half_scale)
GPU_HALF_REFERENCE = "h100-sxm"


def flops_per_hbm_byte(chip: Chip) -> float:
    """The chip's bf16 peak over its HBM bandwidth: how many FLOPs a matmul must do per byte it moves to keep the
    matrix units busy (the roofline's ridge point)."""
    return chip.peak_bf16_flops / chip.hbm_bandwidth


def half_scale(chip: Chip) -> float:
    """How much wider a matmul must be on this chip to reach the share of its peak that a matmul of the reference
    width reaches: a TPU's matrix-unit width over 128 (Constants.matmul_half["tpu"] is HALF for 128-wide arrays); a
    GPU's FLOPs per HBM byte over H100 SXM's (matmul_half["gpu"] is H100 SXM's HALF): a matmul's operand traffic per
    FLOP falls as its sides grow, so a chip with more FLOPs per byte of bandwidth needs wider matmuls to keep its
    tensor cores busy (A100 80GB 153 FLOPs a byte, A100 40GB 201, H200 206, B200 292, H100 SXM 295, GB200 312); 1
    elsewhere (CPU devices measure their own)."""
    if chip.mxu_width:
        return chip.mxu_width / 128
    if chip.kind == "gpu":
        return flops_per_hbm_byte(chip) / flops_per_hbm_byte(CHIPS[GPU_HALF_REFERENCE])
    return 1.0


# A swept GEMM shorter than this is mostly its kernel's start and end (TPU7x's 1024-cubed one: 6 us), which a step's
# long matmuls do not pay: the HALF a sweep gives is read from its longer ones
SWEEP_MIN_SECONDS = 20e-6


def half_from_sweep(name: str) -> float:
    """The TPU HALF (at a 128-wide array) that puts the thin-matmul law nearest, in log, to chip `name`'s published
    GEMM sweep (chips.GEMM_SWEEPS), the law at the chip's fraction (chips.MATMUL_FRACTION) and its HALF scaled to its
    matrix units (half_scale). Read from the sizes below where the sweep stops gaining (chips.matmul_plateau; past it
    the ceiling, not HALF, sets the rate) and at least SWEEP_MIN_SECONDS long. Ironwood's 2048- and 4096-cubed
    GEMMs give 638 (the law then 1.02 and 0.96 of their measured rates). Every whole HALF up to 4096 is tried at
    once, as arrays (every maxperf command imports this)."""
    chip = CHIPS[name]
    per_device = chip.peak_bf16_flops / SWEEP_DEVICES_PER_CHIP[name]
    rates = {m: tflops * 1e12 / per_device for m, tflops in GEMM_SWEEPS[name].items()
             if m < matmul_plateau(chip) and 2 * m**3 / (tflops * 1e12) >= SWEEP_MIN_SECONDS}
    require(len(rates) >= 1, f"{name}'s GEMM sweep has no size between its kernels' start-up and its plateau")
    fraction, scale = MATMUL_FRACTION[name], half_scale(chip)
    halves = np.arange(1, 4097)
    misfit = sum(np.log(fraction * m / (m + halves * scale) / rate) ** 2 for m, rate in rates.items())
    return float(halves[np.argmin(misfit)])


MATMUL_HALF = {
    # measured, not fitted: from Google's Ironwood GEMM sweep (half_from_sweep; chips.GEMM_SWEEPS), so that the
    # training rows fit the chips' rates and not this too. Fitted on the rows it came out at 640 (51 TPU rows,
    # 2026-11-27) and 701 (all 90, 2026-12-01); without MaxText's v5e table's 24 rows, 946
    "tpu": half_from_sweep("tpu7x"),
    # H100 SXM's (other GPUs scale it: half_scale); fitted on 2026-11-25 (32 GPU rows) and held since: refitted it
    # moves to 790-900, trading off against the GPUs' rates, where the single-H100 steps measured on real hardware
    # (bench/gpu_measured.py) put it no higher
    "gpu": 713,
    "cpu": cpu.MATMUL_HALF,
}
# Memory-bound elementwise passes per token per layer over D-wide vectors (reads + writes, forward), in compute-dtype
# passes, on TPUs and GPUs (XLA:CPU's: perfmodel.cpu). Unfused, two norms with float32 internals (6 each) and two
# residual adds (3 each) would make 18; XLA fuses norms and residual adds into the neighbouring matmuls' operand and
# output fusions, so few reach HBM on their own: fitted 2.7 (bench/published.py, 2026-11-23, 81 rows), and held there
# since (it trades off against the matmul rates and flash kernels' in the fit, which leaves it ill-determined).
ELEMENTWISE_D_PASSES = 2.7
# Flash attention kernels (splash on TPU; cuDNN, Pallas or Triton on GPU) run their matmuls and online softmax in
# on-chip memory, at this fraction of the chip's sustained matmul rate (peak x fraction x the share of a TPU's matrix
# units their head dims fill): the softmax's exponentials keep them below a large GEMM's rate. Fitted (FITTED; 51 TPU
# rows, 35 GPU rows, all with flash), the kernels computing their masks' partial blocks whole (flops.executed_pairs)
# and splash's split backward its seven matmuls per block (flops.flash_backward_matmuls).
FLASH_EFFICIENCY = {"tpu": 0.78, "gpu": 0.47}
# The GPU value prices the FlashAttention-2 and Triton class of kernels (MosaicML's runs; maxperf's own GPU kernel,
# Pallas Triton) on Hopper; on the A100s, whose warp-level mma instructions those kernels were written for, they
# sustain 1.72x as much of the chip's best matmul (FlashAttention-2's published rates on both chips:
# chips.flash_architecture; `flash_speedup`). cuDNN's fused attention (MaxText's attention=cudnn_flash_te /
# cudnn_flash_jax, Transformer Engine's in NVIDIA's recipes) runs on Hopper's warpgroup matrix instructions and tensor
# memory accelerator, which those kernels do not use: on an H100 SXM5 in bf16, head dim 128, 1k to 16k tokens, its
# forward ran at 1.58x to 1.70x FlashAttention-2's rate (causal and not) and its backward at 1.57x to 1.63x (Shah et
# al. 2024, FlashAttention-3, arXiv:2407.08608, Figs. 5 and 6). Measured on an H200 (jax 0.11.2, causal, bf16, head
# dim 128, forward + backward, bench/gpu_attention.py, rows in bench/measured/h200_attention.json): cuDNN's fused
# attention (jax.nn.dot_product_attention, implementation "cudnn") ran 1.51x, 1.65x and 1.66x maxperf's Pallas Triton
# kernel at 2,048, 8,192 and 32,768 tokens. Not measured on Blackwell, so the flash rate there; on the A100 both run
# the same mma instructions (FlashAttention-2's rate there). Both kernels' rates rise with the sequence (rate_inf x L /
# (L + half), half 1,160 tokens for cuDNN's and 890 for Pallas Triton's, within 6%: bench/gpu_attention.py --fit); the
# model keeps them flat, their rates fitted on published runs at 2,048 to 8,192 tokens: priced with those laws, the
# published runs held out by source came out further off (bench/published.py, 4.9% / 24.9% to 6.4% / 26.3%).
CUDNN_FLASH_SPEEDUP = 1.6
CUDNN_FLASH_CHIPS = frozenset({"h100-sxm", "h200"})


def flash_speedup(chip: Chip, train) -> float:
    """How much faster than FLASH_EFFICIENCY's kernels on an H100 (of its sustained matmul rate) `train`'s flash
    attention runs on `chip` (of its own): CUDNN_FLASH_SPEEDUP for cuDNN's kernels on the chips that have the
    instructions it uses, else the FlashAttention-2 class's rate on the chip's architecture (chips.flash_architecture:
    1.72 on the A100s, 1 on Hopper and where unmeasured)."""
    cudnn = str(train.attention) in attention_rule.CUDNN
    return CUDNN_FLASH_SPEEDUP if cudnn and chip.name in CUDNN_FLASH_CHIPS else flash_architecture(chip)


def flash_speedup_note(chip: Chip, speedup: float) -> str:
    """What an assumption line adds for `flash_speedup`'s factor on `chip` (nothing at 1)."""
    if speedup == 1:
        return ""
    if chip.name in CUDNN_FLASH_CHIPS:
        return f" x {speedup:g} for cuDNN's kernel on {chip.name} (FlashAttention-3 paper)"
    return (f" x {speedup:.2f} on {chip.name}, where FlashAttention-2-class kernels keep that much more of the best "
            "matmul than on an H100 (FlashAttention-2 paper)")


# quantization=int8 (models/layers/quantization.py, AQT's config_v3): each quantized operand is read twice in the
# compute dtype (its absmax, then scale and round) and written once as int8; a gradient's stochastic rounding adds
# its noise, 4-byte random bits that XLA's RngBitGenerator writes and the quantize fusion reads (counted from the
# operations, each assumed one pass over HBM). The int8 x int8 -> int32 dot reads 1-byte operands and writes its
# dequantized output in the compute dtype (the int32 result scaled in the dot's output fusion, assumed).
INT8_NOISE_BYTES = 8
# FP8 recipes (maxperf.spec.fp8, models/layers/fp8.py): a quantized matmul runs at the chip's FP8 peak times the
# share of it its shape sustains (the bf16 rule: fraction x m / (m + HALF), at most the chip's best measured bf16
# matmul, x fill) times FP8_EFFICIENCY, how much of that an FP8 GEMM keeps relative to a bf16 one (its kernels, the
# scales applied in its epilogue, and what else the FP8 recipes' frameworks run faster than the runs the bf16
# fraction was fitted on), per chip kind and, on GPUs, per implementation (fp8_key):
# - "tpu", "gpu": fitted (FITTED_FP8) on bench/published's FP8 rows: on GPU NVIDIA Megatron-Bridge's Llama 3 8B,
#   70B and 405B on H100s, B200s and GB200s (Transformer Engine's current scaling, e.g. 744, 1,576 and 719 TFLOP/s
#   per GPU for the 8B on 8 H100s and 8 B200s and the 70B on 64 H100s: above the bf16 fraction fitted on MosaicML's
#   and MaxText's H100 runs, so above 1, with their attention at cuDNN's rate, CUDNN_FLASH_SPEEDUP), which prices
#   the te_* recipes; on TPU the tpu-recipes Ironwood Llama 3.1 70B and 405B fp8_full rows.
# - "gpu xla": the recipes whose FP8 matmuls XLA builds on a GPU (fp8, fp8_gpu, aqt_*: MaxText runs them through
#   flax's, Qwix's and AQT's jax ops). Measured (MEASURED_FP8): one step of maxperf's scaled-1 preset (B 8, L 2048,
#   flash, full remat) on an H200, compiled there (autotuned) by jax 0.11.2, took 290.7 ms in bf16 and 230.3 ms with
#   quantization=fp8: 0.79 of the bf16 step, where "gpu"'s value predicts 0.58. The value puts the predicted ratio
#   at the measured one (so it carries none of the bf16 prediction's own error, 0.86 of measured there).
FP8_EFFICIENCY = {"tpu": 1.00, "gpu": 1.19, "gpu xla": 0.73, "cpu": 1.0}
FITTED_FP8 = {"tpu": "bench/published.py, 2026-11-27, 2 TPU7x FP8 rows",
              "gpu": "bench/published.py, 2026-12-02, 6 NVIDIA FP8 rows (Transformer Engine)"}
MEASURED_FP8 = {"gpu xla": "XLA's FP8 step against its bf16 step on an H200, bench/gpu_measured.py, 2026-11-28"}


def fp8_key(kind: str, recipe: Fp8Recipe | None) -> str:
    """The FP8_EFFICIENCY entry that prices `recipe`'s matmuls on a chip of `kind`: on GPUs Transformer Engine's
    (te_*) or XLA's (the others); elsewhere the kind's."""
    if kind == "gpu" and recipe is not None and not recipe.transformer_engine:
        return "gpu xla"
    return kind


# The quantize passes, bytes per element quantized (c: the compute dtype's bytes), counted from the operations, each
# assumed one pass over HBM: current scaling reads the operand for its amax, then again to scale and cast it, and
# writes one byte (2c + 1); delayed scaling casts with the scale it has, so its amax and cast fuse into one read
# (c + 1); MXFP8's amax is per 32-element block, fused with the cast, and writes a scale per block (c + 1 + 1/32).
# The backward quantizes dy so; the forward's FP8 operands it reuses are transposed on GPU, whose FP8 GEMMs take
# their operands in one layout only (cuBLASLt's TN: read and write one byte), where MXFP8 quantizes x and W again
# along the backward's contraction.
FP8_TRANSPOSE_BYTES = {"gpu": 2.0}
# Seconds per step of a collective's ring across slices (TPU: each a transfer through both hosts' network stacks) or
# per collective across hosts (GPU and CPU, NCCL and gloo pipelining their steps). TPU: fitted on the MaxText v4 and
# v5e tables' rows over 1 to 32 slices, whose throughput falls with the slices as this latency grows (v5e 128B from 1
# to 32 slices: 110 to 91 TFLOP/s per chip, where the DCN's bandwidth alone gave 109 to 101), their gradients
# all-reduced one array of the train state at a time (spec.params.reduced_arrays: 12 for their decoders, the last
# scanned block's and those outside the layers, which the compiled steps send after the backward's loop with nothing
# beside them: docs/accuracy.md, "Across slices");
# bench/published.py --free dcn_latency_tpu, 2026-11-27, 88 rows. GPU and CPU: assumed, tens of microseconds.
DCN_STEP_LATENCY = {"tpu": 1.71e-3, "gpu": 30e-6, "cpu": 30e-6}


# How far a step time from these constants falls from published measurements it was not fitted on: the median and
# worst |predicted / published - 1| of throughput per chip, each source's rows predicted by constants fitted on the
# other sources' ("source"), each chip generation's by constants fitted on the others' with its sustained rate from
# the rule for chips without rows ("generation"); bench/published.py --hold-out source,hardware. An estimate quotes
# the first for chips whose rate was fitted, the second for the others.
# "fp8": the rows that train in FP8 alone, each source held out (8 rows: NVIDIA's Transformer Engine runs on H100,
# B200 and GB200 and the TPU7x recipes); an FP8 step quotes it where its chip's figure is the smaller.
HELD_OUT_ERROR = {"source": (0.052, 0.237), "generation": (0.050, 0.237), "fp8": (0.128, 0.194)}
HELD_OUT_BASIS = "bench/published.py, 2026-12-02, 90 rows"
# Chips measured directly on published runs that no constant was fitted on: the median and worst |error| and the
# median signed error of throughput per chip over those runs, and what they are. An estimate on such a chip quotes
# these, the nearer measure of its error than the generation held out.
UNFITTED_RUNS_ERROR = {
    "tpu-v6e": (0.030, 0.169, 0.014, "19 published tpu-recipes Trillium runs, none of them fitted (bench/recipes.py, "
                                     "2026-12-02): GPT-3 175B, Gemma 3 12B and Llama 3.1 405B predicted 10% to 17% "
                                     "faster than they ran"),
}

# Mixtures of experts: no published run of one is among the fitted rows. On TPUs MaxText's MoE recipes measure them
# (Mixtral on v6e, DeepSeek-V3 and Llama 4 on v5p, DeepSeek-V3, gpt-oss and Qwen3 on TPU7x): median and worst |error|,
# median signed error and what they are. An estimate of a mixture of experts on a TPU quotes these.
UNFITTED_MOE_ERROR = {
    "tpu": (0.135, 0.353, -0.014, "12 published tpu-recipes mixture-of-experts runs on TPU v6e, v5p and TPU7x, none "
                                  "of them fitted (bench/recipes.py, 2026-12-01): gpt-oss-120b on TPU7x predicted 35% "
                                  "faster than it ran, DeepSeek-V3 on TPU7x 13% to 20% slower"),
}


@dataclass(frozen=True)
class Uncertainty:
    """The error to expect of a step time: `relative`, the median |error| held out as `basis` says, and `worst`."""

    relative: float
    worst: float
    basis: str


def uncertainty(chip: Chip, constants: Constants, moe: bool = False, fp8: bool = False) -> Uncertainty | None:
    """The held-out error of a step time on `chip` (HELD_OUT_ERROR; a mixture of experts, `moe`, on a chip whose
    MoE runs were measured: UNFITTED_MOE_ERROR; a step with FP8 matmuls, `fp8`, the FP8 rows' where larger); None for
    CPU devices, whose rates are measured by `maxperf calibrate` rather than fitted to published runs."""
    found = _uncertainty(chip, constants, moe)
    if found is None or not fp8 or HELD_OUT_ERROR["fp8"][0] <= found.relative:
        return found
    median, worst = HELD_OUT_ERROR["fp8"]
    return Uncertainty(median, worst, f"the published runs that train in FP8, each source's predicted by constants "
                                      f"fitted without them: median {median:.0%}, worst {worst:.0%} ({HELD_OUT_BASIS})")


def _uncertainty(chip: Chip, constants: Constants, moe: bool) -> Uncertainty | None:
    if chip.kind == "cpu":
        return None
    if moe and chip.kind in UNFITTED_MOE_ERROR:
        return _measured_on_unfitted_runs(*UNFITTED_MOE_ERROR[chip.kind])
    fitted = MATMUL_FRACTION_ORIGIN.get(chip.name) == "fitted" and constants.fraction(chip) == MATMUL_FRACTION.get(
        chip.name)
    if not fitted and chip.name in UNFITTED_RUNS_ERROR:
        return _measured_on_unfitted_runs(*UNFITTED_RUNS_ERROR[chip.name])
    mode = "source" if fitted else "generation"
    median, worst = HELD_OUT_ERROR[mode]
    words = ("each source's published runs predicted by constants fitted without them" if fitted else
             f"each chip generation predicted by constants fitted without it ({chip.name}'s sustained rate is not "
             "fitted)")
    return Uncertainty(median, worst, f"{words}: median {median:.0%}, worst {worst:.0%} ({HELD_OUT_BASIS})")


def _measured_on_unfitted_runs(median: float, worst: float, signed: float, what: str) -> Uncertainty:
    """An uncertainty measured on published runs none of which was fitted (UNFITTED_RUNS_ERROR, UNFITTED_MOE_ERROR)."""
    return Uncertainty(median, worst, f"{what}: median {median:.0%}, worst {worst:.0%}, median signed {signed:+.0%} "
                                      "of throughput")


@dataclass(frozen=True)
class Overlap:
    """Fraction of each family of collectives that runs hidden behind compute (0: fully exposed, 1: fully hidden).
    Hidden time never exceeds the compute it hides behind.

    Defaults, fitted on bench/published.py's rows but for `sequence` and `expert`: FSDP gathers and reduce-scatters are
    prefetched a layer ahead by XLA's latency-hiding scheduler, about half hidden (fitted 0.45, FITTED, 86 rows);
    tensor-parallel collectives are decomposed by XLA into collective matmuls that overlap the matmuls they feed (Wang
    et al., ASPLOS 2023), all but hidden (fitted 0.99 on 2026-11-23, 22 TPU rows with a tensor axis, and held since);
    the data-parallel gradient all-reduce runs once after the scanned backward, with nothing left to hide behind
    (fitted 0.0 on 2026-11-23, 36 rows with a data axis, and held since); sequence-parallel collectives half hidden
    (assumed: no row has a sequence axis); the expert-parallel all-to-alls of a MoE layer exposed (assumed: the
    experts' matmuls wait for the rows the dispatch brings, the layer's next work for what the combine brings back; no
    published row has an expert axis)."""

    fsdp: float = 0.45
    tensor: float = 0.99
    sequence: float = 0.5
    data: float = 0.0
    expert: float = 0.0

    @classmethod
    def uniform(cls, fraction: float) -> Overlap:
        return cls(fraction, fraction, fraction, fraction, fraction)

    def __post_init__(self) -> None:
        for name in ("fsdp", "tensor", "sequence", "data", "expert"):
            value = getattr(self, name)
            require(0.0 <= value <= 1.0, f"overlap {name} must be between 0 and 1, got {value}")


OVERLAP_ORIGIN = {"fsdp": "fitted", "tensor": "fitted", "sequence": "assumed", "data": "fitted", "expert": "assumed"}


@dataclass(frozen=True)
class Constants:
    """The step-time model's fitted constants, passed to `step_time` (and `perfmodel.estimate`) rather than read from
    module globals, so that bench/published.py can fit them and price the same recorded work at any values."""

    matmul_fraction: Mapping[str, float] = field(default_factory=lambda: dict(MATMUL_FRACTION))  # per chip name
    matmul_half: Mapping[str, float] = field(default_factory=lambda: dict(MATMUL_HALF))  # per chip kind
    elementwise_d_passes: float = ELEMENTWISE_D_PASSES
    flash_efficiency: Mapping[str, float] = field(default_factory=lambda: dict(FLASH_EFFICIENCY))  # per chip kind
    # seconds per step of a collective's ring across slices or hosts (network.CollectiveTime.dcn_steps), per kind
    dcn_step_latency: Mapping[str, float] = field(default_factory=lambda: dict(DCN_STEP_LATENCY))
    fp8_efficiency: Mapping[str, float] = field(default_factory=lambda: dict(FP8_EFFICIENCY))  # per chip kind

    def fraction(self, chip: Chip) -> float:
        """The share of its peak a large matmul sustains on `chip`; 1.0 where none is recorded (CPU devices, whose
        calibrated peaks are achieved rates)."""
        return self.matmul_fraction.get(chip.name, 1.0)


SHIPPED = Constants()

# How a term of the step turns into seconds (Terms.law).
FIXED = 0  # seconds known when recorded (collectives, host copies, memory-bound work other than the D passes)
MATMUL = 1  # max(FLOPs / (peak x rate x fraction x m / (m + HALF)), bytes / HBM bandwidth)
FLASH = 2  # FLOPs / (peak x rate x fraction x flash efficiency)
D_PASSES = 3  # seconds known when recorded + seconds per elementwise pass over D x elementwise_d_passes
COMM_KINDS = ("ici", "dcn", "host")


@dataclass(frozen=True)
class Terms:
    """A step's work as recorded, before the fitted constants price it: one entry per piece of work, in arrays of equal
    length. `price` and `settle` turn them into seconds; `estimate` and bench/published.py (which concatenates many
    steps' terms) call the same two functions."""

    name: tuple[str, ...]  # breakdown row
    kind: tuple[str, ...]  # "compute", "hbm", "ici", "dcn", "host"; a matmul's is decided when priced
    law: np.ndarray
    fixed_s: np.ndarray  # FIXED and D_PASSES: the seconds known when recorded
    peak_s: np.ndarray  # MATMUL and FLASH: FLOPs / peak
    hbm_s: np.ndarray  # MATMUL: bytes / HBM bandwidth; D_PASSES: seconds per pass
    side: np.ndarray  # MATMUL: the smallest side m (1 elsewhere)
    rate: np.ndarray  # MATMUL: a kernel's rate relative to a plain matmul of its shape (1 elsewhere)
    half: np.ndarray  # MATMUL: a measured HALF (CPU devices); NaN: the chip kind's constant times half_scale
    half_scale: np.ndarray  # MATMUL: a TPU's matrix-unit width over 128 (a wider array needs a wider matmul), else 1
    ceiling: np.ndarray  # MATMUL: the chip's best measured matmul rate over its peak (chips.MEASURED_MATMUL), else inf
    dcn_steps: np.ndarray  # collectives across slices or hosts: the latencies they pay (priced at dcn_step_latency)
    flops: np.ndarray
    bytes: np.ndarray
    family: tuple[str, ...]  # a collective's Overlap field; "" for work that is not a collective or has its own
    overlap: np.ndarray  # the hidden fraction of host copies (collectives take their family's from Overlap)
    fp8: np.ndarray  # MATMUL: 1 for an FP8 matmul (priced at fp8_efficiency too), else 0

    @property
    def comm(self) -> np.ndarray:
        return np.array([k in COMM_KINDS for k in self.kind], dtype=bool)

    @classmethod
    def concat(cls, many: list[Terms]) -> Terms:
        """Several steps' terms end to end (bench/published.py prices all its rows at once)."""
        out = {}
        for f in fields(cls):
            values = [getattr(t, f.name) for t in many]
            out[f.name] = np.concatenate(values) if isinstance(values[0], np.ndarray) else sum(values, ())
        return cls(**out)

    def merged(self, step: np.ndarray) -> tuple[Terms, np.ndarray]:
        """The same work in fewer terms, for pricing many times over (bench/published.py's fits): the terms of one
        step (`step`: each term's) that `price` and `settle` treat alike are summed into one, and `price` and `settle`
        give the merged terms the same step times, to rounding. Alike: the same law, whether a collective, overlap
        family and own overlap; a matmul also the same smallest side, rate, HALF, matrix width, ceiling, FP8 flag and
        FLOPs-to-bytes ratio (its max of FLOP time and byte time then scales with the sum), a flash kernel the same
        rate. Returns the merged terms (each group named and kinded by its first term) and each one's step."""
        comm = self.comm
        groups: dict[tuple, list[int]] = {}
        for i, law in enumerate(self.law.tolist()):
            key = (int(step[i]), law, bool(comm[i]), self.family[i], float(self.overlap[i]))
            if law == MATMUL:
                ratio = self.peak_s[i] / self.hbm_s[i] if self.hbm_s[i] else math.inf
                half = None if math.isnan(self.half[i]) else float(self.half[i])
                key += (float(self.side[i]), float(self.rate[i]), half, float(self.half_scale[i]),
                        float(self.ceiling[i]), float(self.fp8[i]), float(ratio))
            elif law == FLASH:
                key += (float(self.rate[i]),)
            groups.setdefault(key, []).append(i)
        first = np.array([g[0] for g in groups.values()], dtype=int)
        label = np.zeros(len(self.law), dtype=int)
        for n, g in enumerate(groups.values()):
            label[g] = n
        summed = ("fixed_s", "peak_s", "hbm_s", "dcn_steps", "flops", "bytes")
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in summed:
                out[f.name] = np.bincount(label, value, len(first))
            elif isinstance(value, np.ndarray):
                out[f.name] = value[first]
            else:
                out[f.name] = tuple(value[i] for i in first)
        return type(self)(**out), np.asarray(step)[first]

    def overlaps(self, overlap: Overlap) -> np.ndarray:
        """Each term's hidden fraction under `overlap`."""
        return np.array([getattr(overlap, f) if f else o for f, o in zip(self.family, self.overlap)], dtype=float)


def price(terms: Terms, fraction, half, flash, d_passes, dcn_latency, fp8=1.0) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each term, and whether a matmul is bound by its FLOPs (True) or its bytes. `fraction`, `half`,
    `flash` and `fp8` (FP8 matmuls' efficiency relative to bf16's) are one value for the step or one per term
    (bench/published.py prices many steps at once)."""
    t = terms
    h = np.where(np.isnan(t.half), half * t.half_scale, t.half)
    # an FP8 matmul's share of the FP8 peak, like a bf16 one's of the bf16 peak, never above the best measured
    efficiency = t.rate * np.minimum(np.minimum(fraction * t.side / (t.side + h), t.ceiling) * (1 + t.fp8 * (fp8 - 1)),
                                     t.ceiling)
    at_rate = t.peak_s / efficiency
    matmul = np.maximum(at_rate, t.hbm_s)
    seconds = np.where(t.law == MATMUL, matmul, t.fixed_s)
    seconds = np.where(t.law == FLASH, t.peak_s / (t.rate * fraction * flash), seconds)
    seconds = np.where(t.law == D_PASSES, t.fixed_s + t.hbm_s * d_passes, seconds) + t.dcn_steps * dcn_latency
    return seconds, at_rate >= t.hbm_s


def by_step(values: np.ndarray, step: np.ndarray, steps: int) -> np.ndarray:
    """Sums of `values` (..., terms) over each step's terms (`step`: each term's step, of `steps`): (..., steps)."""
    lead = values.shape[:-1]
    if not lead:
        return np.bincount(step, values, steps)
    k = math.prod(lead)
    flat = (step + steps * np.arange(k)[:, None]).ravel()
    return np.bincount(flat, values.reshape(k, -1).ravel(), k * steps).reshape(*lead, steps)


def settle(seconds: np.ndarray, comm: np.ndarray, overlap: np.ndarray, step: np.ndarray, steps: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step times from priced terms (`step`: each term's step, of `steps`): compute and memory-bound work add up;
    a collective's `overlap` share hides behind it, and what cannot hide (more hidden time than work to hide behind)
    comes back in proportion. Returns the step times, each step's busy seconds and the share of hidden time that
    spilled back. `seconds` and `overlap` may carry leading axes (bench/published.py settles many pricings at once),
    and so do the results."""
    busy = by_step(np.where(comm, 0.0, seconds), step, steps)
    total = by_step(np.where(comm, seconds, 0.0), step, steps)
    hidden = by_step(np.where(comm, seconds * overlap, 0.0), step, steps)
    spill = np.maximum(0.0, hidden - busy) / np.where(hidden > 0, hidden, 1.0)
    return busy + total - hidden * (1 - spill), busy, spill


@dataclass(frozen=True)
class Int8Matmuls:
    """quantization=int8: the layers' matmuls in int8; `weight_gradient`: the weight gradient too
    (quantization_local_shard_count other than 0)."""

    weight_gradient: bool


def int8_matmuls(train: TrainConfig) -> Int8Matmuls | None:
    """The train config's quantization as steptime models it (optional keys, read where present)."""
    if str(train.quantization) != "int8":
        return None
    return Int8Matmuls(weight_gradient=train.quantization_local_shard_count != 0)


def fp8_matmuls(train: TrainConfig) -> Fp8Recipe | None:
    """The train config's FP8 recipe (maxperf.spec.fp8); None for bf16 and int8."""
    return fp8_recipe(str(train.quantization))


def quantize_bytes(recipe: Fp8Recipe, c: int) -> float:
    """HBM bytes per element an FP8 recipe's quantize pass moves (the note at FP8_EFFICIENCY)."""
    if recipe.scaling is Scaling.BLOCK:
        return c + 1 + 1 / recipe.block
    return c + 1 if recipe.scaling is Scaling.DELAYED else 2 * c + 1


def matmul_efficiency(chip: Chip, m: float, half: float | None = None, constants: Constants = SHIPPED) -> float:
    """The fraction of peak a matmul whose smallest side is m sustains: fraction x m / (m + HALF), HALF the kind's
    scaled to this chip (half_scale), m no wider than the chip's GEMM plateau (chips.matmul_plateau), at most the
    chip's best measured matmul rate (chips.MEASURED_MATMUL); `half` (a calibrated HALF) replaces it."""
    m = min(m, matmul_plateau(chip))
    if half is None:
        half = constants.matmul_half[chip.kind] * half_scale(chip)
    return min(constants.fraction(chip) * m / (m + half), matmul_ceiling(chip))


def mxu_fill(chip: Chip, *dims: float) -> float:
    """The share of a TPU's matrix units that a matmul's contraction and output dims fill: the array holds each in
    tiles of its width, so a dim of 128 fills half of a 256-wide array ("two 128x128 operations on Trillium and
    Ironwood will halve the efficiency compared to a single, fully-utilized 256x256 operation": MaxText's
    docs/guides/optimization/custom_model.md); 1 on chips without matrix units of a stated width."""
    width = chip.mxu_width
    fill = 1.0
    if width:
        for d in dims:
            fill *= d / (width * math.ceil(d / width))
    return fill


# The narrowest matrix unit a TPU has (128 wide): a matmul dim below it is thin, and the thin-matmul term (HALF) prices
# it; mxu_fill prices the part-filled tiles of the dims at or above it
MIN_MXU_WIDTH = 128


# A term's fields in the order Work records them: its words, then its numbers (Terms' arrays)
COLUMNS = ("name", "kind", "family", "law", "fixed_s", "peak_s", "hbm_s", "side", "rate", "half", "half_scale",
           "ceiling", "dcn_steps", "flops", "bytes", "overlap", "fp8")


# A value for each of a training matmul's three products (the forward x @ W, the input gradient dy @ W^T, the weight
# gradient x^T @ dy), or one for all three
PerPass = float | tuple[float, float, float]


def per_pass(value):
    """`value` as a (forward, input gradient, weight gradient) triple: a triple as it is, one value three times."""
    return tuple(value) if isinstance(value, tuple) else (value,) * 3


class Work:
    """Records a step's work as Terms: matmuls with their FLOPs, bytes and shape; memory-bound work; collectives."""

    def __init__(self, chip: Chip, dtype: str, constants: Constants, int8: Int8Matmuls | None = None,
                 fp8: Fp8Recipe | None = None, weight_uses: float = 1.0):
        """`weight_uses`: the forward passes a layer's weights serve in one step on this device (the microbatches,
        of gradient accumulation and of a pipeline), which a recipe that caches its FP8 weights casts them once for
        (Fp8Recipe.caches_weights)."""
        self.chip, self.peak, self.constants = chip, chip.peak_flops(dtype), constants
        self.int8, self.fp8 = int8, fp8
        self.weight_uses = max(weight_uses, 1.0)
        self.half = chip.measured_matmul_half(dtype)
        self.rows: list[tuple] = []  # one per term, in COLUMNS' order
        self.assumed: dict[str, str] = {}
        self.overlap_given = False  # the Overlap is the caller's, not the default (assumption lines say "as given")

    def assume(self, key: str, line: str) -> None:
        """Records that a constant that is fitted or assumed, not measured on this chip, drove this step."""
        self.assumed.setdefault(key, line)

    def _term(self, name: str, kind: str, law: int, *, fixed_s: float = 0.0, peak_s: float = 0.0, hbm_s: float = 0.0,
              side: float = 1.0, rate: float = 1.0, half: float = math.nan, half_scale: float = 1.0,
              ceiling: float = math.inf, dcn_steps: float = 0.0, flops: float = 0.0, nbytes: float = 0.0,
              family: str = "", overlap: float = 0.0, fp8: bool = False) -> None:
        self.rows.append((name, kind, family, law, fixed_s, peak_s, hbm_s, side, rate, half, half_scale, ceiling,
                          dcn_steps, flops, nbytes, overlap, float(fp8)))

    def add(self, name: str, kind: str, seconds: float, flops: float = 0.0, nbytes: float = 0.0,
            overlap: float = 0.0, family: str = "", dcn_steps: float = 0.0) -> None:
        """Work whose seconds are known now; a collective names its Overlap `family`, other links their `overlap`;
        one across slices or hosts the latencies it pays besides (`dcn_steps`)."""
        self._term(name, kind, FIXED, fixed_s=seconds, flops=flops, nbytes=nbytes, family=family, overlap=overlap,
                   dcn_steps=dcn_steps)

    def matmul(self, name: str, M: float, K: float, N: float, count: float, c: int,
               side: float | None = None, rate: float = 1.0, operand_bytes: float | None = None,
               fill: float | None = None, fp8: bool = False) -> None:
        """`count` matmuls of M x K by K x N in compute dtype (c bytes): a roofline of FLOPs and HBM traffic (and on
        CPU devices what XLA:CPU's dot kernels add, perfmodel.cpu). `side` replaces the smallest side in the
        efficiency (`matmul_efficiency`); `rate` scales it (a kernel slower than a plain matmul of the shape), and so
        does the share of a TPU's matrix units its contraction K and output N fill (`mxu_fill`; `fill` replaces it
        where a kernel's own tiles decide); `operand_bytes`: the two operands' element size where it is not c (1 for
        int8 and FP8); `fp8`: an FP8 matmul, priced at Constants.fp8_efficiency too."""
        flops = 2 * M * K * N * count
        nbytes = ((c if operand_bytes is None else operand_bytes) * (M * K + K * N) + c * M * N) * count
        ceiling = matmul_ceiling(self.chip)
        if "matmul" in self.assumed:  # said once per step: spare the line's formatting on every matmul
            pass
        elif self.chip.kind != "cpu":
            origin = MATMUL_FRACTION_ORIGIN[self.chip.name] if self.constants.matmul_fraction.get(
                self.chip.name) == MATMUL_FRACTION.get(self.chip.name) else "as given"
            scale = half_scale(self.chip)
            half = self.constants.matmul_half[self.chip.kind] * scale
            if self.chip.kind == "gpu":
                fitted = (f"HALF fitted on H100 SXM, x {scale:.2f} for this chip's FLOPs per HBM byte"
                          if scale != 1 else "HALF fitted")
            else:
                fitted = "HALF read from Ironwood's GEMM sweep" + (
                    f", x {scale:g} for {self.chip.mxu_width}-wide matrix units" if scale != 1 else "")
            self.assume("matmul", f"matmuls at {self.constants.fraction(self.chip):.2f} of peak ({origin}) x m / (m + "
                                  f"{half:.0f}), m a matmul's smallest side ({fitted})"
                        + (f", at most {ceiling:.2f} (the best measured)" if math.isfinite(ceiling) else "")
                        + (f", x the share of its {self.chip.mxu_width}-wide matrix units a matmul fills"
                           if self.chip.mxu_width else ""))
        elif self.half is None:
            self.assume("matmul", f"matmul HALF {self.constants.matmul_half['cpu']:g} (assumed: maxperf calibrate "
                                  "measures it)")
        self._term(name, "compute", MATMUL, peak_s=flops / self.peak, hbm_s=nbytes / self.chip.hbm_bandwidth,
                   side=min(min(M, K, N) if side is None else side, matmul_plateau(self.chip)),
                   rate=rate * (mxu_fill(self.chip, *(d for d in (K, N) if d >= MIN_MXU_WIDTH)) if fill is None
                                else fill),
                   half=math.nan if self.half is None else self.half, half_scale=half_scale(self.chip),
                   ceiling=ceiling, flops=flops,
                   nbytes=nbytes, fp8=fp8)
        if self.chip.kind == "cpu":
            cpu.dot_accumulator_faults(self.add, self.chip, M, K, N, count, c)

    def flash(self, name: str, flops: float, Dq: float, Dv: float, speedup: float = 1.0) -> None:
        """A flash attention kernel's FLOPs, at its fraction of the sustained matmul rate (Constants.flash_efficiency)
        times the share of the matrix units its head dims fill: half its matmuls contract over or produce the query
        and key head dim Dq, half the value's Dv (`mxu_fill`); times `speedup`, the kernel's over the fitted ones'
        (`flash_speedup`)."""
        rate = speedup / (0.5 / mxu_fill(self.chip, Dq) + 0.5 / mxu_fill(self.chip, Dv))
        self._term(name, "compute", FLASH, peak_s=flops / self.peak, rate=rate, flops=flops)

    def d_passes(self, name: str, fixed_bytes: float, bytes_per_pass: float) -> None:
        """Memory-bound elementwise work: `fixed_bytes` and `bytes_per_pass` x Constants.elementwise_d_passes."""
        bandwidth = self.chip.elementwise_bandwidth or self.chip.hbm_bandwidth
        self._term(name, "hbm", D_PASSES, fixed_s=fixed_bytes / bandwidth, hbm_s=bytes_per_pass / bandwidth,
                   nbytes=fixed_bytes + bytes_per_pass * self.constants.elementwise_d_passes)

    def train_matmul(self, name: str, M: float, K: float, N: float, forward: float, backward: float, c: int,
                     side: float | None = None, rate: PerPass = 1.0, quantized: bool = True,
                     fill: PerPass | None = None) -> None:
        """A matmul run `forward` times as x @ W (the forward and its recomputation) and `backward` times as each of
        the backward's two: the input gradient dy @ W^T (M x N by N x K) and the weight gradient x^T @ dy (K x M by
        M x N). All run at the plain rate: compilers give the transposed operand the layout the matmul wants
        (XLA:CPU copies x to x^T, a T x D transpose, and runs the weight gradient as a plain matmul, as a cpu-2
        step's optimized HLO shows), so a library's slower rate for a transposed operand does not apply.
        `rate` and `fill` are one value for the three products or a value each (`per_pass`: forward, input gradient,
        weight gradient), as a kernel that tiles each its own way has them.
        Under quantization=int8 (`self.int8`) a `quantized` one runs as `int8_train_matmul`, under an FP8 recipe
        (`self.fp8`) as `fp8_train_matmul`."""
        if quantized and self.int8 is not None:
            self.int8_train_matmul(name, M, K, N, forward, backward, c, side, rate)
            return
        if quantized and self.fp8 is not None:
            self.fp8_train_matmul(name, M, K, N, forward, backward, c, side, rate, fill)
            return
        (r_fwd, r_dx, r_dw), (f_fwd, f_dx, f_dw) = per_pass(rate), per_pass(fill)
        self.matmul(name, M, K, N, forward, c, side, r_fwd, fill=f_fwd)
        self.matmul(name, M, N, K, backward, c, side, r_dx, fill=f_dx)
        self.matmul(name, K, M, N, backward, c, side, r_dw, fill=f_dw)

    def int8_train_matmul(self, name: str, M: float, K: float, N: float, forward: float, backward: float, c: int,
                          side: float | None, rate: PerPass) -> None:
        """train_matmul under quantization=int8: the forward and the input gradient as int8 dots at the chip's int8
        peak (its bf16 one where it has none), the weight gradient too unless local_shard_count is 0; and the
        quantize passes over every quantized operand (INT8_NOISE_BYTES)."""
        speedup = (self.chip.peak_int8_ops or self.peak) / self.peak
        self.assume("int8", f"int8 matmuls at {speedup:g}x the {self.chip.name} bf16 rate (datasheet peaks); "
                            f"each quantized operand read twice and written once as int8, gradients' noise "
                            f"{INT8_NOISE_BYTES} bytes per element (assumed)")
        r_fwd, r_dx, r_dw = per_pass(rate)
        self.matmul(name, M, K, N, forward, c, side, r_fwd * speedup, operand_bytes=1)
        self.matmul(name, M, N, K, backward, c, side, r_dx * speedup, operand_bytes=1)
        quantize = c + c + 1  # absmax read, scale-and-round read, int8 write
        # forward: x [M, K] and W [K, N]; input gradient: dy [M, N] with noise, W again
        elements = forward * quantize * (M * K + K * N) + backward * ((quantize + INT8_NOISE_BYTES) * M * N
                                                                      + quantize * K * N)
        if self.int8.weight_gradient:
            self.matmul(name, K, M, N, backward, c, side, r_dw * speedup, operand_bytes=1)
            elements += backward * ((quantize + INT8_NOISE_BYTES) * M * N + quantize * M * K)
        else:
            self.matmul(name, K, M, N, backward, c, side, r_dw)
        self.memory("int8 quantize", elements)

    def fp8_train_matmul(self, name: str, M: float, K: float, N: float, forward: float, backward: float, c: int,
                         side: float | None, rate: PerPass, fill: PerPass | None) -> None:
        """train_matmul under an FP8 recipe (maxperf.spec.fp8): the forward, and the backward's two products where the
        recipe quantizes the gradient, at the chip's FP8 peak (datasheet) with one-byte operands, priced at
        Constants.fp8_efficiency too; the quantize passes over x, W and dy (`quantize_bytes`), and the backward's
        transposes of the forward's FP8 operands or their requantization (FP8_TRANSPOSE_BYTES)."""
        recipe, chip = self.fp8, self.chip
        speedup = (chip.peak_fp8_flops or self.peak) / self.peak if chip.kind != "cpu" else 1.0
        q = quantize_bytes(recipe, c)
        if "fp8" not in self.assumed:
            key = fp8_key(chip.kind, recipe)
            efficiency = self.constants.fp8_efficiency.get(key, 1.0)
            origin = ("as given" if efficiency != FP8_EFFICIENCY.get(key) else "fitted on Transformer Engine's rows"
                      if key == "gpu" else "fitted" if key in FITTED_FP8 else
                      "measured: XLA's FP8 GEMMs" if key in MEASURED_FP8 else "assumed")
            self.assume("fp8", f"{recipe.name}: FP8 matmuls at {speedup:g}x the {chip.name} bf16 peak (datasheet) x "
                               f"{efficiency:.2f} ({origin}); quantize passes of {q:g} bytes per element "
                               "(counted); attention, logits and norms in the compute dtype")
        (r_fwd, r_dx, r_dw), (f_fwd, f_dx, f_dw) = per_pass(rate), per_pass(fill)
        self.matmul(name, M, K, N, forward, c, side, r_fwd * speedup, operand_bytes=1, fill=f_fwd, fp8=True)
        # W's casts (forward and recomputation) and transposes or requantizations (backward): as often as x's, or
        # once a step for the weights a recipe caches (a weight's backward runs once per forward pass it serves)
        w_forward, w_backward = ((backward / self.weight_uses,) * 2 if recipe.caches_weights and backward
                                 else (forward, backward))
        elements = q * (forward * M * K + w_forward * K * N)  # x and W
        if recipe.quantizes_backward:
            self.matmul(name, M, N, K, backward, c, side, r_dx * speedup, operand_bytes=1, fill=f_dx, fp8=True)
            self.matmul(name, K, M, N, backward, c, side, r_dw * speedup, operand_bytes=1, fill=f_dw, fp8=True)
            # dy, once for both products (per channel twice: each product shifts another operand's scales onto it)
            dy = 2 if recipe.granularity is Granularity.CHANNEL else 1
            again = FP8_TRANSPOSE_BYTES.get(chip.kind, 0.0) if recipe.reuses_forward else q
            elements += backward * (dy * q * M * N + again * M * K) + w_backward * again * K * N
        else:
            self.matmul(name, M, N, K, backward, c, side, r_dx, fill=f_dx)
            self.matmul(name, K, M, N, backward, c, side, r_dw, fill=f_dw)
        self.memory("fp8 quantize", elements)

    def memory(self, name: str, nbytes: float) -> None:
        """Memory-bound elementwise work: at HBM bandwidth, or where one was measured (CPU devices) at the rate of a
        fused elementwise kernel (Chip.elementwise_bandwidth)."""
        self.add(name, "hbm", nbytes / (self.chip.elementwise_bandwidth or self.chip.hbm_bandwidth), 0.0, nbytes)

    def terms(self) -> Terms:
        names, kinds, families, *numbers = zip(*self.rows) if self.rows else ((),) * len(COLUMNS)
        arrays = dict(zip(COLUMNS[3:], np.array(numbers, dtype=float).reshape(len(COLUMNS) - 3, -1)))
        arrays["law"] = arrays["law"].astype(int)
        return Terms(name=names, kind=kinds, family=families, **arrays)
