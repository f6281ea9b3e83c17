"""XLA:CPU in the step-time model: what CPU devices pay, or do differently, that TPUs and GPUs do not.

CPU devices are maxperf's test bed (every test runs on a CPU-only machine), measured by `maxperf calibrate`
(perfmodel.calibration): their peaks, matmul HALF, collective rates and latency are Chip fields that a calibration
fills; this module holds the behaviour of XLA:CPU itself, each item measured here and said how. perfmodel.steptime
and estimate call it for chips of kind "cpu" only.
"""

from __future__ import annotations

from collections.abc import Callable

from maxperf.perfmodel.chips import Chip

# XLA:CPU allocates a step's temporaries afresh on every execution; glibc maps an allocation above its mmap
# threshold anew each time (the threshold adapts up to 32 MiB on 64-bit systems, mallopt(3) M_MMAP_THRESHOLD), so
# every page of such temporaries faults in once per step. Measured: a cpu-2 step of scaled-1 (800 MB of temporaries
# per device, maxperf's memory.json) takes 1.60 GB of minor faults per step (getrusage), two devices' worth.
FRESH_MAPPING_THRESHOLD = 32 * 2**20
# XLA:CPU's dot kernels (YNNPACK) block the contraction in steps of 256; with a longer one, a dot whose output is
# narrower than float32 accumulates in a float32 M x N scratch of its own, outside XLA's buffers, which from the mmap
# threshold up is mapped afresh and faults in on every call. Measured (one device, getrusage): bf16 7168x512x2048
# faults 58.9 MB per call and runs at a third of the rate of 7168x256x2048, which faults none; bf16 2048x512x2048 (a
# 16.8 MB scratch) faults none; float32 4096x1024x4096 faults its 67 MB output only (it accumulates in place).
CPU_DOT_K_BLOCK = 256
# The matmul HALF of an uncalibrated CPU (work.MATMUL_HALF["cpu"]): assumed; `maxperf calibrate` measures it.
MATMUL_HALF = 32
# Elementwise passes per token per layer over D-wide vectors (work.ELEMENTWISE_D_PASSES on accelerators): XLA:CPU
# runs its dots as library calls that no elementwise work fuses into, so the norms (float32 internals: 6
# compute-dtype passes each) and the residual adds (3 each) make their own passes: 2 x 6 + 2 x 3.
ELEMENTWISE_D_PASSES = 18
# XLA:CPU's blockwise attention kernel computes every block, masked or not (the TPU and GPU flash kernels skip the
# fully masked ones: flops.ATTENTION_SKIPS_MASKED).
SKIPS_MASKED_BLOCKS = False
# Collectives run hidden behind nothing: they are memory copies on the cores that compute. Measured (a traced cpu-2
# step of scaled-1, `maxperf run --profile`): the operations' self times, collectives included, add up to the step
# (3.0 s of operations per device in a 2.8 s step).
OVERLAP = 0.0

Add = Callable[..., None]  # steptime's _Table.add(name, kind, seconds, flops, nbytes)


def dot_accumulator_faults(add: Add, chip: Chip, M: float, K: float, N: float, count: float, c: int) -> None:
    """The page faults of a dot's own float32 accumulator (CPU_DOT_K_BLOCK), where the chip has one."""
    scratch = 4 * M * N
    if chip.page_fault_bandwidth and c < 4 and K > CPU_DOT_K_BLOCK and scratch >= FRESH_MAPPING_THRESHOLD:
        faulted = scratch * count
        add("page faults (dot accumulators, XLA:CPU)", "hbm", faulted / chip.page_fault_bandwidth, 0.0, faulted)


def temporaries_faults(add: Add, chip: Chip, temporaries: float) -> None:
    """The page faults of a step's temporaries, mapped afresh on every step above the mmap threshold."""
    if chip.page_fault_bandwidth and temporaries >= FRESH_MAPPING_THRESHOLD:
        add("page faults (new temporaries)", "hbm", temporaries / chip.page_fault_bandwidth, 0.0, temporaries)


def measured_attention(add: Add, rate: float, flops: float) -> None:
    """Attention at the calibrated whole-kernel rate (Chip.attention_rates): XLA:CPU fuses scores, mask, softmax
    and context into kernels slower than their parts, so calibrate times the whole, forward and backward."""
    add("attention (measured kernels)", "compute", flops / rate, flops)


def fsdp_collectives(param_bytes: int) -> tuple[int, str]:
    """Bytes per gathered element and the gradients' collective: XLA:CPU gathers the parameters in their own dtype and
    converts after, and has no reduce-scatter of its own: it all-reduces the gradients and keeps its shard (the
    optimized HLO of a cpu-2 step of scaled-1: one float32 all-gather per array, each feeding a bf16 convert, and one
    tuple all-reduce per layer over the float32 gradients)."""
    return param_bytes, "all-reduce"


def weight_layout_copies(add: Add, chip: Chip, last: float, first: float, param_bytes: int, times: float) -> None:
    """XLA:CPU keeps each stacked weight in one layout and moves a layer's float32 shard between it and the layout its
    use wants with a fused copy that transposes: `last` (elements of local shards whose model width is their last
    axis) when sliced from the stack for a gather (twice a step: the forward and the backward's gather), `first` (model
    width first) when its gradient is written into the stacked gradients, `times` = layers x microbatches (the
    optimized HLO of a cpu-2 step of scaled-1 and of qwen3-0.6b; traced, these copies run at the calibrated transpose
    rate, Chip.transpose_bandwidth)."""
    if chip.transpose_bandwidth:
        moved = 2 * param_bytes * (2 * last + first) * times  # read and written
        add("weight layout copies (XLA:CPU)", "hbm", moved / chip.transpose_bandwidth, 0.0, moved)
