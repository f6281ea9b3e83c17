"""Step time per device: matmuls at the chip's sustained rate x a shape-dependent efficiency, memory-bound work at
HBM bandwidth, and the collectives the sharding implies, with a stated overlap of communication and compute. Every
constant says where it comes from: a datasheet or paper, a fit to published training measurements
(bench/published.py), or an assumption. What XLA:CPU does differently lives in perfmodel.cpu.

Each matmul is a roofline (Williams et al. 2009): max(FLOPs / (peak x efficiency), bytes / HBM bandwidth). Work is
summed per step over all layers and microbatches, by kind, into a breakdown table.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from maxperf.perfmodel import cpu
from maxperf.perfmodel.chips import MATMUL_FRACTION, MATMUL_FRACTION_ORIGIN, Chip
from maxperf.perfmodel.cpu import FRESH_MAPPING_THRESHOLD  # noqa: F401 (profiler.calibrate sizes buffers by it)
from maxperf.perfmodel.flops import (
    ATTENTION_SKIPS_MASKED,
    COMBINE_BACKWARD_EINSUMS,
    DISPATCH_BACKWARD_EINSUMS,
    FLASH_BACKWARD_MATMULS,
    attention_kernel,
    gated,
    head_dims,
    is_mla,
    layer_pairs,
    recomputed,
)
from maxperf.perfmodel.memory import params_per_device
from maxperf.perfmodel.moe import (
    LOAD_IMBALANCE,
    PERMUTE_PASSES,
    dispatch,
    expert_capacity,
    load_imbalance,
    moe_shape,
    routed_buffer_rows,
    rows_per_token,
)
from maxperf.perfmodel.network import LATENCY_S, CollectiveTime, all_to_all_time, axis_networks, collective_time
from maxperf.perfmodel.saved import layer_offloaded_per_token, over_layers
from maxperf.perfmodel.sharding import activation_split, gather_axes, held, held_gathered, param_arrays
from maxperf.spec.errors import require
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.topology import Topology
from maxperf.spec.train import DTYPE_BYTES, OPTIMIZER_STATES_PER_PARAM, TrainConfig

# Matmul efficiency = chip.matmul_fraction x m / (m + HALF), m the smallest of the matmul's dimensions: the rate a
# large matmul sustains on the chip (chips.MATMUL_FRACTION), less for a thinner one, which fills the 128/256-wide
# systolic arrays and tensor-core tiles less well and has less work to hide each kernel's start and end behind; a
# matmul whose smallest side is HALF reaches half of it. "fitted": bench/published.py, all constants free, 2026-11-23,
# 81 rows (49 TPU, 32 GPU), leave-one-out median / worst 2.4% / 13.4% overall. The rows' matmuls have smallest sides
# of 1024 to 16384 (half their FLOPs at 6144 or more; every row runs flash attention): below 1024, as for the dot
# product's head-dim-wide einsums, the figure is an extrapolation. HALF and the flash rate trade off in the fit (HALF
# 128 on TPU held: flash on TPU 0.22 of the matmul rate, LOO 3.4% / 15.6%); this pair keeps flash near what the
# model assumed before the fit (0.6 of peak), the other would put splash at a fifth of a large matmul's rate.
MATMUL_HALF = {
    "tpu": 610,  # fitted (49 TPU rows)
    "gpu": 760,  # fitted (32 GPU rows)
    "cpu": cpu.MATMUL_HALF,
}
# XLA:GPU's jax.lax.ragged_dot (the dropless grouped matmul, sparse_matmul=true) runs as if each local expert's matmul
# took every row, not its own: at GPU_RAGGED_DOT_RATE / (local experts) of the modelled per-expert rate. Fitted on
# two steps compiled and run on an H100 (jax 0.11.2, bench/gpu_measured.py, 2026-11-23), B 4, L 2048, full remat:
# mixtral-8x7b cut to 2 layers (8 experts) took 591 ms where the model at the plain rate gave its experts 103 ms of a
# 166 ms step (0.195 of the rate, 1.56 / 8); deepseek-v2-lite cut to 4 layers (64 experts) 1279 ms, its experts 33 ms
# of 117 (0.028, 1.77 / 64). With sparse_matmul=false capacity_factor=1.25 the same steps took 169 and 133 ms
# (predicted 193 and 140), and qwen3-30b-a3b (128 experts) with ragged_dot failed XLA:GPU's autotuner.
GPU_RAGGED_DOT_RATE = 1.6
# Memory-bound elementwise passes per token per layer over D-wide vectors (reads + writes, forward), in compute-dtype
# passes, on TPUs and GPUs (XLA:CPU's: perfmodel.cpu). Unfused, two norms with float32 internals (6 each) and two
# residual adds (3 each) would make 18; XLA fuses norms and residual adds into the neighbouring matmuls' operand and
# output fusions, so few reach HBM on their own: fitted 2.7 (bench/published.py, 2026-11-23, 81 rows). Over F-wide
# vectors: the activation and gating product (read gate and up, write product), assumed.
ELEMENTWISE_D_PASSES = 2.7
# quantization=int8 (models/layers/quantization.py, AQT's config_v3): each quantized operand is read twice in the
# compute dtype (its absmax, then scale and round) and written once as int8; a gradient's stochastic rounding adds
# its noise, 4-byte random bits that XLA's RngBitGenerator writes and the quantize fusion reads (counted from the
# operations, each assumed one pass over HBM). The int8 x int8 -> int32 dot reads 1-byte operands and writes its
# dequantized output in the compute dtype (the int32 result scaled in the dot's output fusion, assumed).
INT8_NOISE_BYTES = 8
ELEMENTWISE_F_PASSES = 3
# Backward elementwise work reads saved values and gradients and writes gradients: about twice the forward (assumed).
ELEMENTWISE_BACKWARD_FACTOR = 2
# Softmax per score (the dot product's; flash keeps it on chip): forward reads the float32 scores and writes float32
# and compute-dtype probabilities; backward reads probabilities and their gradient and writes the score gradient, all
# float32 (counted from the operations, each assumed to be one pass over HBM).
SOFTMAX_FWD_FLOAT32 = 2
SOFTMAX_BWD_FLOAT32 = 3
# Flash attention kernels (splash on TPU; cuDNN, Pallas or Triton on GPU) run their matmuls and online softmax in
# on-chip memory, at this fraction of the chip's sustained matmul rate (peak x chip.matmul_fraction): the softmax's
# exponentials and the head-dim-wide (128) matmuls keep them below a large GEMM's rate. Fitted: bench/published.py,
# 2026-11-23 (49 TPU rows, 32 GPU rows, all with flash).
FLASH_EFFICIENCY = {"tpu": 0.81, "gpu": 0.47}
# Offloaded activations cross the host link in the forward (to the host) and the backward (back): XLA issues the
# copies asynchronously beside compute, so most of their time hides (assumed: no published row offloads).
HOST_OFFLOAD_OVERLAP = 0.8
# Offloaded state (optimizer_memory_host_offload, parameter_memory_host_offload) comes in before the work that reads
# it (the parameters before the forward, the optimizer state before the update, which waits for every gradient) and
# goes back after it: little compute is left to hide it behind, so it is counted exposed (an assumption).
STATE_OFFLOAD_OVERLAP = 0.0
# AdamW update per parameter: reads param, grad, mu, nu and writes param, mu, nu (optax.adamw).
OPTIMIZER_PASSES = 7
# Loss over the vocabulary: read logits, log-softmax, gradient, in float32 (counted, one pass each assumed).
LOSS_FLOAT32_PASSES = 4


@dataclass(frozen=True)
class Overlap:
    """Fraction of each family of collectives that runs hidden behind compute (0: fully exposed, 1: fully hidden).
    Hidden time never exceeds the compute it hides behind.

    Defaults, fitted on bench/published.py's rows (2026-11-23) but for `sequence`: FSDP gathers and reduce-scatters are
    prefetched a layer ahead by XLA's latency-hiding scheduler, about half hidden (fitted 0.51, 81 rows); tensor-
    parallel collectives are decomposed by XLA into collective matmuls that overlap the matmuls they feed (Wang et
    al., ASPLOS 2023), all but hidden (fitted 0.99, 22 TPU rows with a tensor axis); the data-parallel gradient
    all-reduce runs once after the scanned backward, with nothing left to hide behind (fitted 0.0, 36 rows with a
    data axis); sequence-parallel collectives half hidden (assumed: no row has a sequence axis); the expert-parallel
    all-to-alls of a MoE layer exposed (assumed: the experts' matmuls wait for the rows the dispatch brings, the
    layer's next work for what the combine brings back; no published row has an expert axis)."""

    fsdp: float = 0.51
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

    def fraction(self, chip: Chip) -> float:
        """The share of its peak a large matmul sustains on `chip`; 1.0 where none is recorded (CPU devices, whose
        calibrated peaks are achieved rates)."""
        return self.matmul_fraction.get(chip.name, 1.0)


SHIPPED = Constants()

# How a term of the step turns into seconds (Terms.law).
FIXED = 0  # seconds known when recorded (collectives, host copies, memory-bound work other than the D passes)
MATMUL = 1  # max(FLOPs / (peak x rate x fraction x m / (m + HALF)), bytes / HBM bandwidth)
FLASH = 2  # FLOPs / (peak x fraction x flash efficiency)
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
    half: np.ndarray  # MATMUL: a measured HALF (CPU devices); NaN: the chip kind's constant
    flops: np.ndarray
    bytes: np.ndarray
    family: tuple[str, ...]  # a collective's Overlap field; "" for work that is not a collective or has its own
    overlap: np.ndarray  # the hidden fraction of host copies (collectives take their family's from Overlap)

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

    def overlaps(self, overlap: Overlap) -> np.ndarray:
        """Each term's hidden fraction under `overlap`."""
        return np.array([getattr(overlap, f) if f else o for f, o in zip(self.family, self.overlap)], dtype=float)


def price(terms: Terms, fraction, half, flash, d_passes) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each term, and whether a matmul is bound by its FLOPs (True) or its bytes. `fraction`, `half` and
    `flash` are one value for the step or one per term (bench/published.py prices many steps at once)."""
    t = terms
    h = np.where(np.isnan(t.half), half, t.half)
    efficiency = t.rate * fraction * t.side / (t.side + h)
    at_rate = t.peak_s / efficiency
    matmul = np.maximum(at_rate, t.hbm_s)
    seconds = np.where(t.law == MATMUL, matmul, t.fixed_s)
    seconds = np.where(t.law == FLASH, t.peak_s / (fraction * flash), seconds)
    seconds = np.where(t.law == D_PASSES, t.fixed_s + t.hbm_s * d_passes, seconds)
    return seconds, at_rate >= t.hbm_s


def settle(seconds: np.ndarray, comm: np.ndarray, overlap: np.ndarray, step: np.ndarray, steps: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step times from priced terms (`step`: each term's step, of `steps`): compute and memory-bound work add up;
    a collective's `overlap` share hides behind it, and what cannot hide (more hidden time than work to hide behind)
    comes back in proportion. Returns the step times, each step's busy seconds and the share of hidden time that
    spilled back."""
    busy = np.bincount(step, np.where(comm, 0.0, seconds), steps)
    total = np.bincount(step, np.where(comm, seconds, 0.0), steps)
    hidden = np.bincount(step, np.where(comm, seconds * overlap, 0.0), steps)
    spill = np.maximum(0.0, hidden - busy) / np.where(hidden > 0, hidden, 1.0)
    return busy + total - hidden * (1 - spill), busy, spill


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "compute", "hbm", "ici", "dcn", "host"
    seconds: float
    exposed_seconds: float
    flops: float
    bytes: float


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    compute_s: float
    hbm_s: float
    ici_s: float  # total, before overlap
    dcn_s: float
    exposed_ici_s: float
    exposed_dcn_s: float
    bottleneck: str  # "compute", "hbm", "ici", "dcn", "host"
    rows: tuple[Row, ...]
    host_s: float = 0.0  # offloaded activations over the host link, total before overlap
    exposed_host_s: float = 0.0
    # the fitted and assumed constants this step's time rests on, one line each with its origin (see `assume`)
    assumptions: tuple[str, ...] = ()
    terms: Terms | None = field(default=None, repr=False, compare=False)  # the work as recorded, before pricing


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


def matmul_efficiency(chip: Chip, m: float, half: float | None = None, constants: Constants = SHIPPED) -> float:
    """The fraction of peak a matmul whose smallest side is m sustains: fraction x m / (m + HALF); `half` (a
    calibrated HALF) replaces the kind's."""
    return constants.fraction(chip) * m / (m + (constants.matmul_half[chip.kind] if half is None else half))


class _Table:
    """Records a step's work as Terms: matmuls with their FLOPs, bytes and shape; memory-bound work; collectives."""

    def __init__(self, chip: Chip, dtype: str, constants: Constants, int8: Int8Matmuls | None = None):
        self.chip, self.peak, self.constants = chip, chip.peak_flops(dtype), constants
        self.int8 = int8
        self.half = chip.measured_matmul_half(dtype)
        self.columns: dict[str, list] = {k: [] for k in (
            "name", "kind", "law", "fixed_s", "peak_s", "hbm_s", "side", "rate", "half", "flops", "bytes", "family",
            "overlap")}
        self.assumed: dict[str, str] = {}

    def assume(self, key: str, line: str) -> None:
        """Records that a constant that is fitted or assumed, not measured on this chip, drove this step."""
        self.assumed.setdefault(key, line)

    def _term(self, name: str, kind: str, law: int, *, fixed_s: float = 0.0, peak_s: float = 0.0, hbm_s: float = 0.0,
              side: float = 1.0, rate: float = 1.0, half: float = math.nan, flops: float = 0.0, nbytes: float = 0.0,
              family: str = "", overlap: float = 0.0) -> None:
        for key, value in (("name", name), ("kind", kind), ("law", law), ("fixed_s", fixed_s), ("peak_s", peak_s),
                           ("hbm_s", hbm_s), ("side", side), ("rate", rate), ("half", half), ("flops", flops),
                           ("bytes", nbytes), ("family", family), ("overlap", overlap)):
            self.columns[key].append(value)

    def add(self, name: str, kind: str, seconds: float, flops: float = 0.0, nbytes: float = 0.0,
            overlap: float = 0.0, family: str = "") -> None:
        """Work whose seconds are known now; a collective names its Overlap `family`, other links their `overlap`."""
        self._term(name, kind, FIXED, fixed_s=seconds, flops=flops, nbytes=nbytes, family=family, overlap=overlap)

    def matmul(self, name: str, M: float, K: float, N: float, count: float, c: int,
               side: float | None = None, rate: float = 1.0, operand_bytes: float | None = None) -> None:
        """`count` matmuls of M x K by K x N in compute dtype (c bytes): a roofline of FLOPs and HBM traffic (and on
        CPU devices what XLA:CPU's dot kernels add, perfmodel.cpu). `side` replaces the smallest side in the
        efficiency (`matmul_efficiency`); `rate` scales it (a kernel slower than a plain matmul of the shape);
        `operand_bytes`: the two operands' element size where it is not c (1 for int8)."""
        flops = 2 * M * K * N * count
        nbytes = ((c if operand_bytes is None else operand_bytes) * (M * K + K * N) + c * M * N) * count
        if "matmul" in self.assumed:  # said once per step: spare the line's formatting on every matmul
            pass
        elif self.chip.kind != "cpu":
            origin = MATMUL_FRACTION_ORIGIN[self.chip.name] if self.constants.matmul_fraction.get(
                self.chip.name) == MATMUL_FRACTION.get(self.chip.name) else "as given"
            self.assume("matmul", f"matmuls at {self.constants.fraction(self.chip):.2f} of peak ({origin}) x m / (m + "
                                  f"{self.constants.matmul_half[self.chip.kind]:g}), m a matmul's smallest side "
                                  "(HALF fitted)")
        elif self.half is None:
            self.assume("matmul", f"matmul HALF {self.constants.matmul_half['cpu']:g} (assumed: maxperf calibrate "
                                  "measures it)")
        self._term(name, "compute", MATMUL, peak_s=flops / self.peak, hbm_s=nbytes / self.chip.hbm_bandwidth,
                   side=min(M, K, N) if side is None else side, rate=rate,
                   half=math.nan if self.half is None else self.half, flops=flops, nbytes=nbytes)
        if self.chip.kind == "cpu":
            cpu.dot_accumulator_faults(self.add, self.chip, M, K, N, count, c)

    def flash(self, name: str, flops: float) -> None:
        """A flash attention kernel's FLOPs, at its fraction of the sustained matmul rate (Constants.flash_efficiency)."""
        self._term(name, "compute", FLASH, peak_s=flops / self.peak, flops=flops)

    def d_passes(self, name: str, fixed_bytes: float, bytes_per_pass: float) -> None:
        """Memory-bound elementwise work: `fixed_bytes` and `bytes_per_pass` x Constants.elementwise_d_passes."""
        bandwidth = self.chip.elementwise_bandwidth or self.chip.hbm_bandwidth
        self._term(name, "hbm", D_PASSES, fixed_s=fixed_bytes / bandwidth, hbm_s=bytes_per_pass / bandwidth,
                   nbytes=fixed_bytes + bytes_per_pass * self.constants.elementwise_d_passes)

    def train_matmul(self, name: str, M: float, K: float, N: float, forward: float, backward: float, c: int,
                     side: float | None = None, rate: float = 1.0, quantized: bool = True) -> None:
        """A matmul run `forward` times as x @ W (the forward and its recomputation) and `backward` times as each of
        the backward's two: the input gradient dy @ W^T (M x N by N x K) and the weight gradient x^T @ dy (K x M by
        M x N). All run at the plain rate: compilers give the transposed operand the layout the matmul wants
        (XLA:CPU copies x to x^T, a T x D transpose, and runs the weight gradient as a plain matmul, as a cpu-2
        step's optimized HLO shows), so a library's slower rate for a transposed operand does not apply.
        Under quantization=int8 (`self.int8`) a `quantized` one runs as `int8_train_matmul`."""
        if quantized and self.int8 is not None:
            self.int8_train_matmul(name, M, K, N, forward, backward, c, side, rate)
            return
        self.matmul(name, M, K, N, forward, c, side, rate)
        self.matmul(name, M, N, K, backward, c, side, rate)
        self.matmul(name, K, M, N, backward, c, side, rate)

    def int8_train_matmul(self, name: str, M: float, K: float, N: float, forward: float, backward: float, c: int,
                          side: float | None, rate: float) -> None:
        """train_matmul under quantization=int8: the forward and the input gradient as int8 dots at the chip's int8
        peak (its bf16 one where it has none), the weight gradient too unless local_shard_count is 0; and the
        quantize passes over every quantized operand (INT8_NOISE_BYTES)."""
        speedup = (self.chip.peak_int8_ops or self.peak) / self.peak
        self.assume("int8", f"int8 matmuls at {speedup:g}x the {self.chip.name} bf16 rate (datasheet peaks); "
                            f"each quantized operand read twice and written once as int8, gradients' noise "
                            f"{INT8_NOISE_BYTES} bytes per element (assumed)")
        int8_rate = rate * speedup
        self.matmul(name, M, K, N, forward, c, side, int8_rate, operand_bytes=1)
        self.matmul(name, M, N, K, backward, c, side, int8_rate, operand_bytes=1)
        quantize = c + c + 1  # absmax read, scale-and-round read, int8 write
        # forward: x [M, K] and W [K, N]; input gradient: dy [M, N] with noise, W again
        elements = forward * quantize * (M * K + K * N) + backward * ((quantize + INT8_NOISE_BYTES) * M * N
                                                                      + quantize * K * N)
        if self.int8.weight_gradient:
            self.matmul(name, K, M, N, backward, c, side, int8_rate, operand_bytes=1)
            elements += backward * ((quantize + INT8_NOISE_BYTES) * M * N + quantize * M * K)
        else:
            self.matmul(name, K, M, N, backward, c, side, rate)
        self.memory("int8 quantize", elements)

    def memory(self, name: str, nbytes: float) -> None:
        """Memory-bound elementwise work: at HBM bandwidth, or where one was measured (CPU devices) at the rate of a
        fused elementwise kernel (Chip.elementwise_bandwidth)."""
        self.add(name, "hbm", nbytes / (self.chip.elementwise_bandwidth or self.chip.hbm_bandwidth), 0.0, nbytes)

    def terms(self) -> Terms:
        col = self.columns
        arrays = {k: np.array(col[k], dtype=float) for k in ("law", "fixed_s", "peak_s", "hbm_s", "side", "rate",
                                                             "half", "flops", "bytes", "overlap")}
        arrays["law"] = arrays["law"].astype(int)
        return Terms(name=tuple(col["name"]), kind=tuple(col["kind"]), family=tuple(col["family"]), **arrays)


def step_time(model: ModelConfig, train: TrainConfig, mesh: Mesh, chip: Chip, topology: Topology,
              overlap: Overlap, temporaries: float = 0.0, imbalance: float | None = None,
              constants: Constants = SHIPPED) -> StepTime:
    """`constants`: the fitted constants (SHIPPED: as fitted on bench/published.py); `temporaries`: bytes per device live beside the state at the step's peak (the memory model's), which CPU
    devices fault in afresh every step (perfmodel.cpu); `imbalance`: the MoE load imbalance (perfmodel.moe
    load_imbalance; None: the train config's moe_load_imbalance where it has one, else LOAD_IMBALANCE)."""
    c = DTYPE_BYTES[train.compute_dtype]
    p = DTYPE_BYTES[train.param_dtype]
    D, N, Dh, L = model.d_model, model.num_layers, model.head_dim, train.seq_len
    micro = train.grad_accum_steps
    a = activation_split(model, train.per_device_batch_size, L, mesh)
    T, Bm = a.T, a.B  # tokens and examples of one microbatch on this device: B (per_device_batch_size) of them
    table = _Table(chip, train.compute_dtype, constants, int8_matmuls(train))

    # matmuls: forward, backward (2 x forward), and the forward again where remat recomputes it
    again = recomputed(model, train)
    bwd = N * micro
    moe = moe_shape(model)
    n_dense = N - (moe.moe_layers if moe else 0)

    def fwd(*names: str, layers: int = N, recomputing: frozenset[str] = again) -> float:
        return sum(layers * micro * (1 + (name in recomputing)) for name in names)

    Dq, Dv = head_dims(model)
    if is_mla(model):
        _mla_matmuls(table, model, T, a.H, fwd, bwd, c)
    else:
        table.train_matmul("q projection", T, D, a.H * Dh, fwd("query_proj"), bwd, c)
        table.train_matmul("k, v projections", T, D, a.K * Dh, fwd("key_proj", "value_proj"), 2 * bwd, c)
        table.train_matmul("attention output projection", T, a.H * Dh, D, fwd("out_proj"), bwd, c)
    wi = ("mlpwi_0", "mlpwi_1") if gated(model) else ("mlpwi",)
    if n_dense:
        dense = n_dense * micro
        table.train_matmul("mlp up" + (" and gate" if gated(model) else ""), T, D, a.F, fwd(*wi, layers=n_dense),
                           len(wi) * dense, c)
        table.train_matmul("mlp down", T, a.F, D, fwd("mlpwo", layers=n_dense), dense, c)
    f = 1.0
    if moe:
        f = load_imbalance(train, mesh.axes["expert"], imbalance)
        _moe_matmuls(table, model, train, mesh, moe, T, Bm, a, f, fwd, c)
    # num_vocab_tiling: each chunk's logits are computed again in the backward
    # MaxText does not quantize the logits (its logits_dense and the embedding's attend take no quantization)
    table.train_matmul("unembedding", T, D, a.V, micro * (1 + (train.num_vocab_tiling > 1)), micro, c,
                       quantized=False)
    # attention per (example, head): scores L x Dh by Dh x L, context L x L by L x Dh. The dot product computes all
    # L x L scores; the TPU and GPU flash kernels skip masked blocks (ATTENTION_SKIPS_MASKED) and run at a kernel
    # rate with no softmax passes over HBM
    kernel = attention_kernel(train)
    flash_rate = constants.flash_efficiency.get(chip.kind) if kernel == "flash" else None
    skips = ATTENTION_SKIPS_MASKED[kernel] and (chip.kind != "cpu" or cpu.SKIPS_MASKED_BLOCKS)
    attention_rate = chip.attention_rate(train.compute_dtype, Dq)
    for pairs, run in itertools.groupby(layer_pairs(model, L)):
        share = pairs / (L * L) if skips else 1.0
        count = Bm * a.H * micro * share * sum(1 for _ in run)  # a run of alike layers at once
        scores_fwd, context_fwd = 1 + ("scores" in again), 1 + ("context" in again)
        if flash_rate:
            # the forward kernel (2 matmuls), again where remat recomputes it, and the backward kernel's
            flops = 2 * a.L * L * (Dq + Dv) / 2 * (2 * context_fwd + FLASH_BACKWARD_MATMULS) * count
            if "flash" not in table.assumed:  # once, not per layer
                table.assume("flash", f"flash attention at {flash_rate:.2f} of the matmul rate (fitted)")
            table.flash("attention (flash kernel)", flops)
        elif attention_rate:  # measured whole (CPU devices): scores, softmax and context, forward and backward
            cpu.measured_attention(table.add, attention_rate,
                                   2 * a.L * L * (Dq + Dv) / 2 * (scores_fwd + context_fwd + 4) * count)
        else:
            # one batched einsum over B x H: its head-dim-wide side is a contraction or an output width that tensor
            # cores and MXUs tile whole, so the thin-matmul term takes its sequence-wide sides (on an H100, scaled-1
            # at B 8, L 2048 with full remat: the dot product measured 89 ms slower than flash, where the
            # head-dim side made it 247; bench/gpu_measured.py)
            side = None if chip.kind == "cpu" else min(a.L, L)
            table.train_matmul("attention scores", a.L, Dq, L, scores_fwd * count, count, c, side, quantized=False)
            table.train_matmul("attention context", a.L, L, Dv, context_fwd * count, count, c, side, quantized=False)

    # memory-bound work
    elementwise_layers = N * micro * (1 + ELEMENTWISE_BACKWARD_FACTOR + (1 if again else 0))
    if chip.kind != "cpu":
        table.assume("elementwise", f"{constants.elementwise_d_passes:g} elementwise HBM passes over D per token and "
                                    f"layer (fitted), {ELEMENTWISE_F_PASSES} over F (assumed)")
    if moe is None:
        per_token = c * ELEMENTWISE_F_PASSES * a.F
    else:  # the activation's passes over each layer's MLP width: a dense layer's F, a MoE layer's routed and shared
        F_moe = (rows_per_token(moe, train) + moe.S) * a.Fe
        per_token = c * ELEMENTWISE_F_PASSES * over_layers(model, lambda m: F_moe if m else a.F) / N
    if is_mla(model):  # the RoPE parts: each head's query part and the shared key
        per_token += 2 * c * (a.H + 1) * model.qk_rope_head_dim
    elif str(model.positions) == "rope":
        per_token += 2 * c * (a.H + a.K) * Dh  # rotate q and k: read and write
    per_pass = elementwise_layers * T * c * D
    if chip.kind == "cpu":  # XLA:CPU's passes are counted, not fitted
        table.d_passes("norms, residuals, activations", elementwise_layers * T * per_token
                       + cpu.ELEMENTWISE_D_PASSES * per_pass, 0.0)
    else:
        table.d_passes("norms, residuals, activations", elementwise_layers * T * per_token, per_pass)
    if moe is not None and dispatch(train) == "sparse":
        permutes = moe.moe_layers * micro * (1 + ELEMENTWISE_BACKWARD_FACTOR + (1 if again else 0))
        table.assume("moe permute", f"{PERMUTE_PASSES} HBM passes over the routed rows (top-k x D per token) to sort "
                                    "and unsort them, forward (assumed)")
        table.memory("moe dispatch permutes", permutes * T * moe.k * f * D * c * PERMUTE_PASSES)
    scores = Bm * a.H * a.L * L * N * micro
    softmax_fwd = (4 * SOFTMAX_FWD_FLOAT32 + c) * (1 + ("scores" in again))
    if not attention_rate and not flash_rate:
        table.memory("softmax", scores * (softmax_fwd + 4 * SOFTMAX_BWD_FLOAT32))
    offloaded = N * micro * T * layer_offloaded_per_token(model, train, mesh)
    if offloaded and chip.host_link_bandwidth:
        table.assume("offload", f"offload copies {HOST_OFFLOAD_OVERLAP:.0%} hidden (assumed)")
        table.add("remat offload (host link)", "host", 2 * offloaded / chip.host_link_bandwidth, 0.0, 2 * offloaded,
                  HOST_OFFLOAD_OVERLAP)
    table.memory("loss", micro * T * a.V * 4 * LOSS_FLOAT32_PASSES)
    local_params = params_per_device(model, mesh)
    # MaxText's *_memory_host_offload: the state in pinned host memory crosses the host link to the device and back
    # each step, once per step whatever the microbatches
    offloaded_states = (OPTIMIZER_STATES_PER_PARAM * train.optimizer_memory_host_offload
                        + train.parameter_memory_host_offload)
    state = offloaded_states * local_params * p
    if state and chip.host_link_bandwidth:
        table.add("state offload (host link)", "host", 2 * state / chip.host_link_bandwidth, 0.0, 2 * state,
                  STATE_OFFLOAD_OVERLAP)
    table.memory("optimizer update", OPTIMIZER_PASSES * p * local_params)
    if chip.kind == "cpu":
        cpu.temporaries_faults(table.add, chip, temporaries)

    # collectives
    nets = axis_networks(mesh, chip, topology)
    arrays = param_arrays(model)
    layer_arrays = [x for x in arrays if x.block and x.matmul and not x.expert_parallel]
    table_array = next(x for x in arrays if x.name == ("embedding" if model.tie_embeddings else "unembedding"))
    fsdp_axes = gather_axes([*layer_arrays, table_array], mesh)
    if fsdp_axes:
        # per layer: the mean over the layers where dense and MoE layers differ
        gathered = sum(held_gathered(x, mesh) * (x.count / N) for x in layer_arrays)
        vocab = held_gathered(table_array, mesh)
        # forward gather, backward gather again, gradient reduce-scatter: per layer and microbatch, each weight
        # gathered by a collective of its own and a layer's gradients reduced by one combined collective
        g_bytes, rs = cpu.fsdp_collectives(p) if chip.kind == "cpu" else (c, "reduce-scatter")
        per_layer = sum(x.count / N for x in layer_arrays)
        for kind, nbytes, count, pieces in (("all-gather", gathered * g_bytes, 2 * N * micro, per_layer),
                                            ("all-gather", vocab * g_bytes, 2 * micro, 1),
                                            (rs, gathered * p, N * micro, 1),
                                            (rs, vocab * p, micro, 1)):
            _collective(table, "fsdp " + kind, kind, nbytes, fsdp_axes, nets, count, overlap.fsdp, pieces)
        if chip.kind == "cpu":
            last = sum(held(x, mesh) * (x.count / N) for x in layer_arrays if x.logical[-1] == "embed")
            first = sum(held(x, mesh) * (x.count / N) for x in layer_arrays if x.logical[0] == "embed")
            cpu.weight_layout_copies(table.add, chip, last, first, p, N * micro)
    if moe is not None:
        experts = [x for x in arrays if x.expert_parallel]
        _moe_collectives(table, model, train, mesh, moe, T, experts, nets, overlap, c, p)
    if mesh.axes["tensor"] > 1:
        # Megatron-style: 2 all-reduces of T x D in the forward, 2 in the backward (Shoeybi et al. 2019, sec. 3)
        count = N * micro * (2 + 2 + ("out_proj" in again) + ("mlpwo" in again))
        _collective(table, "tensor all-reduce", "all-reduce", T * D * c, ("tensor",), nets, count, overlap.tensor)
    if mesh.axes["sequence"] > 1:
        # keys and values gathered along the sequence in the forward, their gradients reduce-scattered back
        kv = T * mesh.axes["sequence"] * 2 * a.K * Dh * c
        count = N * micro * (1 + ("key_proj" in again or "value_proj" in again))
        _collective(table, "sequence all-gather", "all-gather", kv, ("sequence",), nets, count, overlap.sequence)
        _collective(table, "sequence reduce-scatter", "reduce-scatter", kv, ("sequence",), nets, N * micro,
                    overlap.sequence)
    if mesh.axes["data"] > 1:
        # gradients are replicated across `data`: one all-reduce of this device's gradient shard per step
        _collective(table, "data all-reduce", "all-reduce", local_params * p, ("data",), nets, 1, overlap.data)
    return _settle(table, overlap)


def _mla_matmuls(table: _Table, model: ModelConfig, T: float, H: float, fwd, bwd: float, c: int) -> None:
    """Latent attention's projections (models/layers/mla.py), H the local heads: q through its latent (or straight
    from D), the kv latent with the shared RoPE key, its up-projection to keys and values, the output."""
    D, R, C = model.d_model, model.q_lora_rank, model.kv_lora_rank
    Dn, Dr, Dv = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    if R:
        table.train_matmul("q projection", T, D, R, fwd("query_proj"), bwd, c)
        table.train_matmul("q projection", T, R, H * (Dn + Dr), fwd("query_proj"), bwd, c)
    else:
        table.train_matmul("q projection", T, D, H * (Dn + Dr), fwd("query_proj"), bwd, c)
    kv = max(fwd("key_proj"), fwd("value_proj"))  # one latent and one up-projection serve keys and values
    table.train_matmul("k, v projections", T, D, C + Dr, kv, bwd, c)
    table.train_matmul("k, v projections", T, C, H * (Dn + Dv), kv, bwd, c)
    table.train_matmul("attention output projection", T, H * Dv, D, fwd("out_proj"), bwd, c)


def _moe_matmuls(table: _Table, model: ModelConfig, train: TrainConfig, mesh: Mesh, moe, T: float, Bm: float, a,
                 f: float, fwd, c: int) -> None:
    """A MoE layer's matmuls on one device: the router, the routed experts' grouped matmul as one matmul per local
    expert over its rows (the device's tokens x rows per token among its E / ep experts, f times the mean on the
    busiest device), each reading its own weights, the shared experts, and with the einsum dispatch its one-hot
    dispatch and combine einsums (models/layers/moe.py)."""
    D, micro, layers = model.d_model, train.grad_accum_steps, moe.moe_layers
    again = recomputed(model, train, moe_layer=True)
    bwd = layers * micro
    kind = dispatch(train)
    rows = rows_per_token(moe, train)
    ep = mesh.axes["expert"] if moe.E % mesh.axes["expert"] == 0 else 1
    local = moe.E / ep
    # the rows one expert's matmul takes: the device's rows (from all ep devices' tokens) among its local experts
    group = T * rows * f / local
    table.assume("grouped matmul", f"routed experts' grouped matmuls as one matmul per expert of its rows "
                                   f"({group:.0f} here), at that matmul's efficiency (the term above)")
    if f > 1:
        origin = "assumed" if f == LOAD_IMBALANCE else "as given"
        table.assume("moe imbalance", f"the busiest of the expert-parallel devices computes {f:g}x the mean of the "
                                      f"routed rows ({origin}; the key moe_load_imbalance sets it)")

    def moe_fwd(*names: str) -> float:
        return fwd(*names, layers=layers, recomputing=again)

    rate = 1.0
    if kind == "sparse" and table.chip.kind == "gpu":
        rate = min(1.0, GPU_RAGGED_DOT_RATE / local)
        table.assume("ragged dot", f"XLA:GPU's ragged_dot at {GPU_RAGGED_DOT_RATE:g} / {local:g} local experts of the "
                                   f"per-expert matmul rate (fitted on two H100 steps; sparse_matmul=false "
                                   f"capacity_factor=1.25 ran 3.5-9.6x faster there)")
    wi = ("mlpwi_0", "mlpwi_1") if gated(model) else ("mlpwi",)
    table.train_matmul("experts up and gate" if gated(model) else "experts up", group, D, a.Fe, local * moe_fwd(*wi),
                       local * len(wi) * bwd, c, rate=rate)
    table.train_matmul("experts down", group, a.Fe, D, local * moe_fwd("mlpwo"), local * bwd, c, rate=rate)
    table.train_matmul("router", T, D, moe.E, moe_fwd("router"), bwd, c)
    if moe.S:
        table.train_matmul("shared experts up" + (" and gate" if gated(model) else ""), T, D, moe.S * a.Fe,
                           moe_fwd(*wi), len(wi) * bwd, c)
        table.train_matmul("shared experts down", T, moe.S * a.Fe, D, moe_fwd("mlpwo"), bwd, c)
    if kind != "sparse":  # per sequence: [E C, L] x [L, D] to dispatch, [L, E C] x [E C, D] to combine
        slots = moe.E * expert_capacity(moe, train)
        count = Bm * layers * micro
        table.matmul("expert dispatch and combine einsums", slots, a.L, D,
                     count * (1 + ("dispatch" in again) + DISPATCH_BACKWARD_EINSUMS), c)
        table.matmul("expert dispatch and combine einsums", a.L, slots, D, count * (1 + COMBINE_BACKWARD_EINSUMS), c)


def _moe_collectives(table: _Table, model: ModelConfig, train: TrainConfig, mesh: Mesh, moe, T: float, expert_arrays,
                     nets, overlap: Overlap, c: int, p: int) -> None:
    """The routed experts' FSDP gathers (over the FSDP axes other than `expert`, each device gathering its own
    experts) and the expert-parallel all-to-alls: per MoE layer the dispatch and the combine in the forward, their
    gradients in the backward, and the dispatch again where remat recomputes the layer (models/layers/moe.py)."""
    micro, layers = train.grad_accum_steps, moe.moe_layers
    axes = gather_axes(expert_arrays, mesh)
    if axes:
        gathered = sum(held_gathered(x, mesh) for x in expert_arrays)  # one MoE layer's
        g_bytes, rs = cpu.fsdp_collectives(p) if table.chip.kind == "cpu" else (c, "reduce-scatter")
        _collective(table, "fsdp all-gather", "all-gather", gathered * g_bytes, axes, nets, 2 * layers * micro,
                    overlap.fsdp, len(expert_arrays))
        _collective(table, "fsdp " + rs, rs, gathered * p, axes, nets, layers * micro, overlap.fsdp)
    kind = dispatch(train)
    if mesh.axes["expert"] > 1:
        # what one device sends: the sorted dispatch's exchange buffers, whole (sized for the worst case, so however
        # routing falls), or the einsum dispatch's [B, E, C, D] slots, from batch-split to expert-split
        rows = routed_buffer_rows(moe, mesh.axes["expert"]) if kind == "sparse" else rows_per_token(moe, train)
        sent = T * rows * model.d_model * c
        count = layers * micro * (4 + (recomputed(model, train) != frozenset()))
        _collective(table, "expert all-to-all", "all-to-all", sent, ("expert",), nets, count, overlap.expert,
                    time=all_to_all_time(sent, ("expert",), nets))


def _collective(table: _Table, name: str, kind: str, nbytes: float, axes: tuple[str, ...], nets, count: float,
                overlap: float, pieces: int = 1, time: CollectiveTime | None = None) -> None:
    """`time`: one collective's time where `collective_time` does not model its kind (the all-to-all)."""
    t = collective_time(kind, nbytes, axes, nets, pieces) if time is None else time
    if table.chip.kind != "cpu" and (t.ici_s or t.dcn_s):  # CPU collectives: measured rates, latency and overlap
        family = name.split()[0]
        origin = OVERLAP_ORIGIN[family] if overlap == getattr(Overlap(), family) else "as given"
        table.assume("overlap " + family, f"{family} collectives {overlap:.0%} hidden ({origin})")
        table.assume("latency", f"{LATENCY_S['ici'] * 1e6:g} us per collective inside a slice or NVLink domain, "
                                f"{LATENCY_S['dcn'] * 1e6:g} us across (assumed)")
    family = name.split()[0]
    if t.ici_s:
        table.add(name + " (ici)", "ici", count * t.ici_s, 0.0, count * nbytes, family=family)
    if t.dcn_s:
        table.add(name + " (dcn)", "dcn", count * t.dcn_s, 0.0, count * nbytes, family=family)


def _settle(table: _Table, overlap: Overlap) -> StepTime:
    terms, chip, c = table.terms(), table.chip, table.constants
    seconds, flops_bound = price(terms, c.fraction(chip), c.matmul_half[chip.kind],
                                 c.flash_efficiency.get(chip.kind, 1.0), c.elementwise_d_passes)
    comm, hidden_share = terms.comm, terms.overlaps(overlap)
    steps, busy, spill = settle(seconds, comm, hidden_share, np.zeros(len(seconds), dtype=int), 1)
    exposed_s = np.where(comm, seconds - seconds * hidden_share * (1 - spill[0]), seconds)
    kinds = ("compute", "hbm", "ici", "dcn", "host")
    rows: dict[str, dict[str, float]] = {}
    totals = dict.fromkeys(kinds, 0.0)
    exposed = {"ici": 0.0, "dcn": 0.0, "host": 0.0}
    for i, name in enumerate(terms.name):
        kind = terms.kind[i] if terms.law[i] != MATMUL else "compute" if flops_bound[i] else "hbm"
        row = rows.get(name)
        if row is None:
            row = rows[name] = {**dict.fromkeys(kinds, 0.0), "exposed": 0.0, "flops": 0.0, "bytes": 0.0}
        s, x = float(seconds[i]), float(exposed_s[i])
        row[kind] += s
        row["exposed"] += x
        row["flops"] += float(terms.flops[i])
        row["bytes"] += float(terms.bytes[i])
        totals[kind] += s
        if kind in exposed:
            exposed[kind] += x
    out = [Row(n, max(kinds, key=lambda k: r[k]), sum(r[k] for k in kinds), r["exposed"], r["flops"], r["bytes"])
           for n, r in rows.items()]
    step, work = float(steps[0]), float(busy[0])
    # a network whose traffic alone outlasts all the compute bounds the step however well it overlaps
    networks = {k: totals[k] for k in ("ici", "dcn", "host")}
    slow = max(networks, key=networks.get)
    if networks[slow] > work:
        bottleneck = slow
    else:
        shares = {"compute": totals["compute"], "hbm": totals["hbm"], **exposed}
        bottleneck = max(shares, key=shares.get)
    return StepTime(step_time_s=step, compute_s=totals["compute"], hbm_s=totals["hbm"], ici_s=totals["ici"],
                    dcn_s=totals["dcn"], exposed_ici_s=exposed["ici"], exposed_dcn_s=exposed["dcn"],
                    bottleneck=bottleneck, rows=tuple(sorted(out, key=lambda r: -r.seconds)), host_s=totals["host"],
                    exposed_host_s=exposed["host"], assumptions=tuple(table.assumed.values()), terms=terms)
