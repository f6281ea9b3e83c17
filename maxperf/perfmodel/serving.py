"""Serving: the memory, prefill time and decode time of models/serving.py's steps, as arithmetic on the spec.

Per device, B sequences over the batch axes (data x fsdp x expert), heads and the MLP over `tensor`; weights split over
the FSDP axes (fsdp, fsdp_transpose, sequence, and expert for all but the routed experts) are gathered whole before
their matmuls, as in training (perfmodel.sharding), so a device computes and reads each gathered weight for its own
sequences, every step:
- memory: the weights (the compute dtype, or 1 byte a number under quantization=int8 / fp8, the embedding table and
  head in the compute dtype), the cache of S positions (models/serving.cache_layout), and the largest temporaries
  (a layer's activations, the last position's logits).
- decode, one token for each of B sequences at a cache filled to `context` positions: a price per kernel, summed
  (the kernels run one after another): each matmul its FLOPs at the chip's sustained rate and its weights' bytes at
  HBM bandwidth x DECODE_HBM_EFFICIENCY, attention its FLOPs and the filled part of the cache (within a layer's
  window), as the paged and ragged kernels of serving stacks read it (once per query head under
  decode_cache_reads=per_query_head, as TensorRT-LLM's masked multi-head attention kernel does), the two terms of a
  kernel added on a GPU and the larger taken on a TPU (DECODE_KERNEL_LAW); a mixture of experts reads the experts
  its tokens reach; under tensor parallelism two all-reduces of the activations per layer; the FSDP gathers of the
  weights; a fixed cost per layer (DECODE_LAYER_S).
- prefill, B prompts of P tokens: the training forward's matmuls at the chip's sustained rate for their shapes
  (perfmodel.work.matmul_efficiency), causal attention at the flash kernels' efficiency (cuDNN's faster where the
  training step prices it so: perfmodel.work.flash_speedup), the same all-reduces over B x P tokens and the same
  gathers.
int8 and FP8 matmuls run at the chip's int8 / FP8 peak where it has one (MaxText's AQT int8 serving; TensorRT-LLM's
FP8), else at the bf16 rate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from maxperf.perfmodel.chips import Chip
from maxperf.perfmodel.network import CollectiveTime, axis_networks, collective_time
from maxperf.perfmodel.sharding import gather_axes, held_gathered, layer_weights
from maxperf.perfmodel.work import FLASH_EFFICIENCY, SHIPPED, flash_speedup, matmul_efficiency
from maxperf.spec.logical_axes import local_size, split
from maxperf.spec.memo import per_model
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import AttentionType, ModelConfig
from maxperf.spec.params import param_arrays
from maxperf.spec.topology import Topology
from maxperf.spec.train import DTYPE_BYTES, Quantization, TrainConfig

# The share of HBM bandwidth a decode step's weight and cache reads sustain, per chip kind, each fitted on its own
# kind's rows (bench/serving.py, FITTED_ON). GPU: 62 rows of NVIDIA's TensorRT-LLM tables on H100 and H200, their
# kernels' FLOPs and bytes summed (DECODE_KERNEL_LAW; each source's rows held out in turn it moves between 0.79 and
# 0.92; the tables' grouped-query runs whose decode kernel read the cache once per query head are priced so,
# decode_cache_reads=per_query_head; the 0.9.0 table's Mixtral 8x7B rows in 16 bits, as its experts ran). TPU: 8 rows
# of vLLM on Google's tpu-recipes, the Trillium recipe's decode steps of Llama 3.3 70B on v6e-8 (median ITL 23.11 and
# 30.73 ms at 64 and 128 sequences) and the Ironwood recipes' served benchmarks of Qwen3-32B and
# Qwen3-Coder-480B-A35B in FP8 on TPU7x (0.59 without the Trillium rows, 0.64 without the Ironwood ones). MaxText's
# one published decode figure (Llama 2 70B on v5e-16) runs its `autoregressive` mesh axis, which maxperf does not
# build, and JetStream's are ShareGPT runs of unstated lengths.
DECODE_HBM_EFFICIENCY = {"gpu": 0.79, "tpu": 0.62, "cpu": 1.0}
# Seconds per decoder layer per decode step that neither FLOPs nor bytes explain: kernel launches and the
# synchronization between a layer's kernels (assumed: ten kernels a layer at a few microseconds each on GPU, XLA's
# fused TPU programs fewer)
DECODE_LAYER_S = {"gpu": 20e-6, "tpu": 10e-6, "cpu": 0.0}
# How a decode kernel's FLOPs time and bytes time combine, per chip kind: "max", the longer of the two (a roofline:
# the weights' stream hides the math), or "sum", one after the other. GPU: "sum", as the GEMM libraries' kernels of
# the published GPU runs behave at decode shapes. DeepSeek's DeepGEMM table (FP8 on an H800 SXM5, an H100 SXM's SMs,
# clock and HBM3; 64 to 8,192 rows against DeepSeek-V3's weight shapes, dense and grouped: bench/published/gemm.csv)
# states its own kernels' rates and their speedup over a CUTLASS 3.6 implementation. At the GPU's fraction and HBM
# efficiency here, the CUTLASS kernels' times are the sum of the two terms within 11.1% (median of 28 shapes) and
# 1.5x the roofline's (48.7% off); DeepGEMM's own are the roofline's within 14.4% (the sum's 21.7%):
# `.venv/bin/python bench/gpu_gemm.py --published`. TensorRT-LLM's releases of 2023-2024 ran CUTLASS and cuBLASLt
# GEMMs; on their rows the sum's held-out error is 12.8% to the roofline's 14.8% (bench/serving.py, 2026-12-02). A
# stack on DeepGEMM-class kernels runs faster than this prices. TPU: "max" (vLLM's rows: decode steps 4.1% held out,
# 7.4% with the sum).
DECODE_KERNEL_LAW = {"gpu": "sum", "tpu": "max", "cpu": "max"}
FITTED_ON = "bench/serving.py, 2026-12-02"
# How far this model falls from published serving measurements it was not fitted on, per chip kind (an estimate
# quotes its own kind's; "all" where no rows are of its kind): the median and worst |predicted / published - 1| of
# throughput, each source's rows predicted with the constants fitted without them (bench/serving.py, 2026-12-02)
HELD_OUT_ERROR = {"gpu": (0.128, 0.770), "tpu": (0.073, 0.276), "all": (0.121, 0.770)}
HELD_OUT_BASIS = {
    "gpu": "62 published serving runs on GPUs (TensorRT-LLM on H100 and H200)",
    "tpu": "8 published serving runs on TPUs (vLLM on v6e and TPU7x)",
    "all": "70 published serving runs (TensorRT-LLM on H100 and H200, vLLM on v6e and TPU7x)",
}


def uncertainty(kind: str) -> tuple[float, float, str]:
    """(median, worst, basis) of the held-out error an estimate on a chip of `kind` quotes."""
    key = kind if kind in HELD_OUT_ERROR else "all"
    return (*HELD_OUT_ERROR[key], f"the median and worst error on {HELD_OUT_BASIS[key]}, each source held out of the "
                                  "fit (bench/serving.py, 2026-12-02)")


@dataclass(frozen=True)
class ServingConstants:
    """The serving model's constants (bench/serving.py fits `hbm_efficiency`)."""

    hbm_efficiency: tuple[tuple[str, float], ...] = tuple(DECODE_HBM_EFFICIENCY.items())
    layer_s: tuple[tuple[str, float], ...] = tuple(DECODE_LAYER_S.items())

    def efficiency(self, kind: str) -> float:
        return dict(self.hbm_efficiency)[kind]

    def layer(self, kind: str) -> float:
        return dict(self.layer_s)[kind]


SHIPPED_SERVING = ServingConstants()
# Bytes a stored weight number takes, by quantization (models/serving.STORAGE)
WEIGHT_BYTES = {Quantization.INT8: 1, Quantization.FP8: 1}
UNQUANTIZED = ("embedding", "unembedding", "positions")  # spec.params names: tables and head


@dataclass(frozen=True)
class ServingMemory:
    weights_bytes: float
    cache_bytes: float
    temp_bytes: float
    hbm_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.cache_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes


@dataclass(frozen=True)
class Phase:
    """One step's time, per device: compute, memory and collective parts and what bounds it."""

    seconds: float
    compute_s: float
    memory_s: float
    collective_s: float
    fixed_s: float
    flops: float
    bytes: float

    @property
    def bottleneck(self) -> str:
        parts = {"compute": self.compute_s, "HBM bandwidth": self.memory_s, "collectives": self.collective_s,
                 "per-layer overhead": self.fixed_s}
        return max(parts, key=parts.get)


@dataclass(frozen=True)
class ServingEstimate:
    model: str
    chip: str
    kind: str  # the chip's kind: tpu, gpu or cpu
    devices: int
    chips: int  # the topology's chips (TPU7x: two TensorCores a chip, each a device)
    batch: int  # sequences, all devices
    prompt: int  # P
    cache: int  # S
    context: float  # the cache positions filled when decode is priced
    memory: ServingMemory
    prefill: Phase  # the batch's B prompts at once (the compiled prefill step)
    first_token: Phase  # one prompt alone: a request's time to first token
    decode: Phase
    max_batch_per_device: float  # the largest per_device_batch_size whose memory fits
    max_context: float  # the most cache positions (max_target_length) that fit at this batch

    @property
    def ttft_s(self) -> float:
        return self.first_token.seconds

    @property
    def time_per_output_token_s(self) -> float:
        return self.decode.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.decode.seconds

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.tokens_per_s / self.chips

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second through the batch's prefill."""
        return self.batch * self.prompt / self.prefill.seconds

    def as_dict(self) -> dict:
        phase = lambda p: {**dataclasses.asdict(p), "bottleneck": p.bottleneck}  # noqa: E731
        return {"schema": "maxperf.serving-estimate/1", "model": self.model, "chip": self.chip,
                "devices": self.devices, "chips": self.chips, "batch": self.batch, "prompt_tokens": self.prompt,
                "cache_positions": self.cache, "context": self.context,
                "memory": {**dataclasses.asdict(self.memory), "total_bytes": self.memory.total_bytes,
                           "fits": self.memory.fits},
                "prefill": phase(self.prefill), "first_token": phase(self.first_token), "decode": phase(self.decode),
                "ttft_s": self.ttft_s,
                "time_per_output_token_s": self.time_per_output_token_s, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_chip": self.tokens_per_s_per_chip, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "max_batch_per_device": self.max_batch_per_device, "max_context": self.max_context,
                "constants": {"decode_hbm_efficiency": DECODE_HBM_EFFICIENCY, "decode_layer_s": DECODE_LAYER_S,
                              "fitted_on": FITTED_ON},
                "uncertainty": dict(zip(("relative", "worst", "basis"), uncertainty(self.kind)))}


@per_model
def serving_model(model: ModelConfig) -> ModelConfig:
    """The model a serving step runs: without its multi-token-prediction modules (kept per model, so that what is
    computed of it is too)."""
    return dataclasses.replace(model, mtp_num_layers=0) if model.mtp_num_layers else model


def weight_bytes(train: TrainConfig, name: str) -> float:
    if name in UNQUANTIZED:
        return DTYPE_BYTES[train.compute_dtype]
    return WEIGHT_BYTES.get(train.quantization, DTYPE_BYTES[train.compute_dtype])


def _arrays(model: ModelConfig, sizes: dict[str, int], train: TrainConfig):
    """(array, elements one device holds, bytes of one element) for every weight."""
    for x in param_arrays(serving_model(model)):
        yield x, x.count * local_size(x.shape, x.logical, sizes), weight_bytes(train, x.name)


def _computed(model: ModelConfig, mesh: Mesh, train: TrainConfig):
    """(array, elements one device computes with, bytes of one element) for every weight: after its FSDP gather."""
    for x in param_arrays(serving_model(model)):
        yield x, x.count * held_gathered(x, mesh), weight_bytes(train, x.name)


def _gathers(model: ModelConfig, mesh: Mesh, chip: Chip, topology: Topology, train: TrainConfig) -> float:
    """Seconds of a step's FSDP gathers: every weight split over the FSDP axes gathered once, as its own collective
    (XLA gathers each layer's weights before its matmuls; counted unhidden, as the other serving collectives)."""
    # the weights a gather axis splits (the routed experts under expert parallelism stay where they are)
    arrays = [x for x in param_arrays(serving_model(model)) if x.matmul and gather_axes([x], mesh)]
    axes = gather_axes(arrays, mesh)
    if not axes:
        return 0.0
    nbytes = sum(x.count * held_gathered(x, mesh) * weight_bytes(train, x.name) for x in arrays)
    return _seconds(collective_time("all-gather", nbytes, axes, axis_networks(mesh, chip, topology),
                                    pieces=sum(x.count for x in arrays)), chip)


def _seconds(t: CollectiveTime, chip: Chip) -> float:
    """A collective's seconds: over the chips' links and the hosts' network, and the latencies its steps across
    slices or hosts pay (perfmodel.work.Constants.dcn_step_latency, as the training step prices them)."""
    return t.ici_s + t.dcn_s + t.dcn_steps * SHIPPED.dcn_step_latency[chip.kind]


def _gathered_layer_bytes(model: ModelConfig, mesh: Mesh, train: TrainConfig) -> float:
    """The temporaries of one layer's weights gathered over the FSDP axes (beyond the shards already held)."""
    sizes = dict(mesh.sizes)
    arrays = [x for x in param_arrays(serving_model(model)) if x.matmul]
    return layer_weights(arrays, lambda x: (held_gathered(x, mesh) - local_size(x.shape, x.logical, sizes))
                         * weight_bytes(train, x.name))


def batch_split(sizes: dict[str, int], B: int) -> int:
    return split((B,), ("cache_batch",), sizes)[0]


def cache_bytes_per_token(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], layer_window=None) -> float:
    """Bytes of one sequence's cache per position on one device, all layers (layers whose window is shorter than
    the positions counted by `layer_window(w)`, the share of positions they hold)."""
    c = DTYPE_BYTES[train.compute_dtype]
    q = 1 if train.quantize_kvcache else c
    if model.attention_type is AttentionType.MLA:
        width = (model.kv_lora_rank + model.qk_rope_head_dim) * q + (2 * c if train.quantize_kvcache else 0)
        per_layer = width
    else:
        K, Dh = model.num_kv_heads, model.head_dim
        kv_split = split((K,), ("cache_kv_heads",), sizes)[0]
        scales = 0.0
        if train.quantize_kvcache:
            scales = 2 * c * ((K / kv_split) if train.kv_quant_axis == "dkv" else 1)
        per_layer = 2 * K / kv_split * Dh * q + scales
    if layer_window is None:
        return per_layer * model.num_layers
    from maxperf.spec import attention_rule

    return per_layer * sum(layer_window(w) for w in attention_rule.layer_masks(model))


def estimate_memory(model: ModelConfig, train: TrainConfig, mesh: Mesh, hbm_bytes: float, kind: str = "decode",
                    per_device_batch: float | None = None, platform: str = "tpu") -> ServingMemory:
    """One device's memory for a serving step: the weights, the cache of the batch's sequences, and the step's
    temporaries. `kind` prefill: the compiled prefill of the whole batch's prompts; decode: a decode step, and beside
    it one prompt's prefill (a serving loop prefills new requests while the batch's cache is resident)."""
    sizes = dict(mesh.sizes)
    devices = math.prod(sizes.values())
    B = (per_device_batch if per_device_batch is not None else train.per_device_batch_size) * devices
    b = B / batch_split(sizes, int(max(1, round(B))))
    S, P = train.seq_len, train.max_prefill_predict_length
    weights = sum(n * bytes_ for _, n, bytes_ in _arrays(model, sizes, train))
    cache = b * S * cache_bytes_per_token(model, train, sizes)
    if kind == "prefill":
        temp = _prefill_temp(model, train, sizes, b * P, b, platform)
    else:
        temp = max(_decode_temp(model, train, sizes, b, platform), _prefill_temp(model, train, sizes, P, 1, platform))
        temp += _relaid_int8_cache(model, train, sizes, platform) * b * S
    temp += _gathered_layer_bytes(model, mesh, train)
    return ServingMemory(weights, cache, temp, hbm_bytes)


def _relaid_int8_cache(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], platform: str) -> float:
    """Bytes per sequence and position of the int8 keys and values a TPU decode step copies whole, in and out of its
    layer loop: an int8 cache of more than one key/value head on a device is laid out for the step's arguments in
    libtpu's int8 tiles over [heads, head dim] otherwise than the loop's in-place update wants, and XLA relays it out
    into a temporary before the loop and back after (llama3-8b on v5e-4 over tensor=4, 2 heads a device, 16 sequences
    of 2048 positions: temporaries 4.67 GiB compiled, 0.67 with a bf16 cache, the int8 cache 2.02 GiB; over tensor=8
    on v5e-8, one head a device, llama3-70b's are not copied). 0 elsewhere."""
    if platform != "tpu" or not train.quantize_kvcache or model.attention_type is AttentionType.MLA:
        return 0.0
    K = model.num_kv_heads
    local = K / split((K,), ("cache_kv_heads",), sizes)[0]
    return 2 * 2 * local * model.head_dim * model.num_layers if local > 1 else 0.0  # k and v, in and out


def _widths(model: ModelConfig, sizes: dict[str, int]) -> tuple[float, float, float]:
    """(D, an MLP's hidden width on one device, the query heads' width on one device)."""
    t = sizes.get("tensor", 1)
    F = model.moe_mlp_dim * model.num_experts_per_tok if model.is_moe else model.d_ff
    return model.d_model, max(model.d_ff, F) / t, model.num_heads * model.head_dim / t


def _prefill_temp(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], tokens: float, rows: float,
                  platform: str = "tpu") -> float:
    """A prefill's largest temporaries: one layer's activations (the residual stream, the MLP's gate and up outputs,
    q, k and v; flash attention keeps no scores), a mixture of experts' dense expansion on GPU (_ragged_expansion)
    and the last positions' float32 logits."""
    c = DTYPE_BYTES[train.compute_dtype]
    D, F, Q = _widths(model, sizes)
    return (tokens * c * (3 * D + 3 * F + 2 * Q) + _ragged_expansion(model, train, sizes, tokens, platform)
            + rows * model.vocab_size / sizes.get("tensor", 1) * 4 * 2)


def _ragged_expansion(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], tokens: float,
                      platform: str) -> float:
    """XLA:GPU expands a mixture of experts' grouped matmul (jax.lax.ragged_dot) into a dense product over the
    device's local experts (perfmodel.working's RAGGED_EXPANDED_*): in the forward one D-wide such buffer, every routed
    row times every local expert, is live at the peak (deepseek-v2-lite's prefill on h100-1: bf16[64, 24576, 2048],
    bench/serving_memory.py). TPUs run grouped matmuls."""
    if platform != "gpu" or not model.is_moe or not train.sparse_matmul:
        return 0.0
    local = model.num_experts / split((model.num_experts,), ("exp",), sizes)[0]
    rows = tokens * model.num_experts_per_tok
    return rows * local * model.d_model * DTYPE_BYTES[train.compute_dtype]


def _decode_temp(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], b: float, platform: str = "tpu"
                 ) -> float:
    """A decode step's: one layer's activations for b tokens, its scores over the cache in float32, a quantized
    cache's layer widened to the compute dtype, and the logits."""
    c = DTYPE_BYTES[train.compute_dtype]
    D, F, Q = _widths(model, sizes)
    S = train.seq_len
    heads = _local_heads(model, sizes)
    widened = b * S * cache_bytes_per_token(model, train, sizes) / max(1, model.num_layers) * (
        c if train.quantize_kvcache else 0)
    return (b * c * (3 * D + 3 * F + Q) + b * heads * S * 4 * 2 + widened + _ragged_expansion(
        model, train, sizes, b, platform) + b * model.vocab_size / sizes.get("tensor", 1) * 4 * 2)


def _peak(chip: Chip, train: TrainConfig) -> float:
    if train.quantization is Quantization.INT8 and chip.peak_int8_ops:
        return chip.peak_int8_ops
    if train.quantization is Quantization.FP8 and chip.peak_fp8_flops:
        return chip.peak_fp8_flops
    return chip.peak_flops(train.compute_dtype)


def _local_heads(model: ModelConfig, sizes: dict[str, int]) -> float:
    """The query heads on one device."""
    return model.num_heads / split((model.num_heads,), ("heads",), sizes)[0]


def _attention(model: ModelConfig, sizes: dict[str, int], absorbed: bool = True) -> tuple[float, float]:
    """(heads on one device, FLOPs per query per visible key per head: scores and context). MLA's decode attends in
    the absorbed form (scores over the latent C and the rope part Dr, the context over C); its prefill, as the
    training step, over the keys and values expanded from the latent (scores over the nope and rope dims, the
    context over the value dim)."""
    H = _local_heads(model, sizes)
    if model.attention_type is AttentionType.MLA:
        if absorbed:
            return H, 2 * (model.kv_lora_rank + model.qk_rope_head_dim) + 2 * model.kv_lora_rank
        return H, 2 * (model.qk_nope_head_dim + model.qk_rope_head_dim) + 2 * model.v_head_dim
    return H, 4 * model.head_dim


def query_heads_per_kv_head(model: ModelConfig, sizes: dict[str, int]) -> float:
    """The query heads on one device that share each of its KV heads (at least 1: tensor parallelism past the KV
    heads replicates them)."""
    K = model.num_kv_heads / split((model.num_kv_heads,), ("cache_kv_heads",), sizes)[0]
    return max(1.0, _local_heads(model, sizes) / K)


def cache_passes(model: ModelConfig, train: TrainConfig, sizes: dict[str, int]) -> float:
    """How many times a decode step's attention reads each cached position: once (decode_cache_reads=per_kv_head),
    or once for each query head on the device that shares a KV head (per_query_head)."""
    if train.decode_cache_reads != "per_query_head" or model.attention_type is AttentionType.MLA:
        return 1.0
    return query_heads_per_kv_head(model, sizes)


def _prefill_pairs(P: int, w: int) -> float:
    """Query-key pairs of a causal prefill of P tokens in a layer of window w (0: all; < 0: chunks of -w): half the
    square within a window or chunk as long as the prompt; a shorter window, each query its w keys; shorter chunks,
    each chunk's half square."""
    if w < 0:
        return P * min(P, -w) / 2
    visible = _visible(P)(w)
    return P * visible / (2 if visible == P else 1)


def _visible(context: float):
    """Keys a query at `context` positions sees in a layer of window w (0: all; < 0: its chunk, half on average)."""
    return lambda w: min(context, w) if w > 0 else (min(context, -w / 2) if w < 0 else context)


def _collectives(model: ModelConfig, mesh: Mesh, chip: Chip, topology: Topology, tokens: float, c: int) -> float:
    """Two all-reduces of the activations per layer over `tensor` (attention's output projection, the MLP's), an
    expert-parallel layer's dispatch and return as all-to-alls."""
    sizes = dict(mesh.sizes)
    nets = axis_networks(mesh, chip, topology)
    seconds = 0.0
    if sizes.get("tensor", 1) > 1:
        t = collective_time("all-reduce", tokens * model.d_model * c, ("tensor",), nets)
        seconds += 2 * model.num_layers * _seconds(t, chip)
    if sizes.get("expert", 1) > 1 and model.is_moe:
        from maxperf.perfmodel.network import all_to_all_time

        k = model.num_experts_per_tok
        t = all_to_all_time(tokens * k * model.d_model * c, ("expert",), nets)
        seconds += 2 * sum(model.moe_layers()) * _seconds(t, chip)
    return seconds


def _experts_reached(model: ModelConfig, tokens: float) -> float:
    """The expected share of experts that `tokens` routed tokens reach (k of E each, uniformly)."""
    E, k = model.num_experts, model.num_experts_per_tok
    return 1 - (1 - k / E) ** tokens


class _Kernels:
    """Kernels that run one after another, each taking the longer of its FLOPs at its rate and its bytes at HBM
    bandwidth (a roofline per kernel: a decode step's matmuls stream their weights, its attention the cache, and
    neither hides under the other), or with `summed` the two added (the stream, then the math: DECODE_KERNEL_LAW);
    their seconds summed by what bounds each."""

    def __init__(self, bandwidth: float, summed: bool = False):
        self.bandwidth = bandwidth
        self.summed = summed
        self.compute_s = self.memory_s = self.flops = self.bytes = 0.0

    def add(self, flops: float, rate: float, nbytes: float) -> None:
        tc, tm = flops / rate if flops else 0.0, nbytes / self.bandwidth
        if self.summed:
            self.compute_s += tc
            self.memory_s += tm
        elif tc >= tm:
            self.compute_s += tc
        else:
            self.memory_s += tm
        self.flops += flops
        self.bytes += nbytes

    def phase(self, collective_s: float, fixed_s: float) -> Phase:
        return Phase(self.compute_s + self.memory_s + collective_s + fixed_s, self.compute_s, self.memory_s,
                     collective_s, fixed_s, self.flops, self.bytes)


def decode_phase(model: ModelConfig, train: TrainConfig, mesh: Mesh, chip: Chip, topology: Topology, b: float,
                 context: float, k: ServingConstants = SHIPPED_SERVING) -> Phase:
    """One decode step of b sequences per device at `context` filled positions: each weight's matmul (the experts
    its tokens reach), then attention over the filled cache."""
    from maxperf.spec import attention_rule

    sizes = dict(mesh.sizes)
    c = DTYPE_BYTES[train.compute_dtype]
    peak = _peak(chip, train) * SHIPPED.fraction(chip)
    kernels = _Kernels(chip.hbm_bandwidth * k.efficiency(chip.kind), DECODE_KERNEL_LAW.get(chip.kind) == "sum")
    routed_tokens = b * sizes.get("expert", 1)
    for x, n, nb in _computed(model, mesh, train):
        if x.name in ("embedding", "positions"):  # a lookup of b rows
            continue
        if not x.matmul:  # norm scales and biases, read by the kernels around the matmuls
            kernels.add(0.0, peak, n * nb)
            continue
        if x.expert_parallel:  # each routed token meets k of the E experts
            rows = b * model.num_experts_per_tok / model.num_experts * sizes.get("expert", 1)
            kernels.add(2 * n * rows, peak, n * nb * _experts_reached(model, routed_tokens))
        else:
            kernels.add(2 * n * b, peak, n * nb)
    H, per_key = _attention(model, sizes)
    keys = sum(_visible(context)(w) for w in attention_rule.layer_masks(model))
    kernels.add(b * H * per_key * keys, peak,
                b * cache_bytes_per_token(model, train, sizes, _visible(context)) * cache_passes(model, train, sizes))
    return kernels.phase(_collectives(model, mesh, chip, topology, b, c) + _gathers(model, mesh, chip, topology, train),
                         k.layer(chip.kind) * model.num_layers)


def prefill_phase(model: ModelConfig, train: TrainConfig, mesh: Mesh, chip: Chip, topology: Topology, b: float,
                  P: int, k: ServingConstants = SHIPPED_SERVING) -> Phase:
    """The prefill of b prompts of P tokens per device: each weight's matmul at the sustained rate for its shape,
    causal attention at the flash kernels' efficiency, and the cache written."""
    from maxperf.spec import attention_rule

    sizes = dict(mesh.sizes)
    c = DTYPE_BYTES[train.compute_dtype]
    tokens = b * P
    peak = _peak(chip, train)
    kernels = _Kernels(chip.hbm_bandwidth * k.efficiency(chip.kind))
    for x, n, nb in _computed(model, mesh, train):
        if x.name in ("embedding", "positions"):
            continue
        if not x.matmul:
            kernels.add(0.0, peak, n * nb)
            continue
        rows = tokens * (model.num_experts_per_tok / model.num_experts * sizes.get("expert", 1)
                         if x.expert_parallel else 1)
        if x.name == "unembedding":  # the output head reads the last position of each prompt only
            rows = b
        # the thin side: the rows, or the model width every projection reads or writes
        kernels.add(2 * n * rows, peak * matmul_efficiency(chip, min(rows, model.d_model)), n * nb)
    H, per_key = _attention(model, sizes, absorbed=False)
    pairs = sum(_prefill_pairs(P, w) for w in attention_rule.layer_masks(model))
    flash = (chip.peak_flops(train.compute_dtype) * SHIPPED.fraction(chip) * FLASH_EFFICIENCY.get(chip.kind, 1.0)
             * flash_speedup(chip, train))
    kernels.add(b * H * per_key * pairs, flash, b * P * cache_bytes_per_token(model, train, sizes))  # cache written
    return kernels.phase(_collectives(model, mesh, chip, topology, tokens, c)
                         + _gathers(model, mesh, chip, topology, train), k.layer(chip.kind) * model.num_layers)


def max_batch_per_device(model: ModelConfig, train: TrainConfig, mesh: Mesh, hbm_bytes: float,
                         kind: str = "decode", platform: str = "tpu") -> float:
    """The largest per_device_batch_size whose `kind` step fits (its memory grows linearly with the batch, past the
    one prompt's prefill a decode holds beside it)."""
    need = lambda B: estimate_memory(model, train, mesh, hbm_bytes, kind, B, platform).total_bytes  # noqa: E731
    lo, hi = 0.0, 1.0
    while need(hi) <= hbm_bytes and hi < 1 << 20:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if need(mid) <= hbm_bytes else (lo, mid)
    devices = math.prod(dict(mesh.sizes).values())
    return math.floor(lo * devices + 1e-9) / devices  # a whole number of sequences over the devices, as B must be


MAX_CONTEXT_SEARCHED = 1 << 26  # cache positions: max_context searches no further


def context_words(positions: float) -> str:
    """A max_context in words: "at least N" where the search stopped at its bound."""
    return f"at least {positions:,}" if positions >= MAX_CONTEXT_SEARCHED else f"{positions:,}"


def max_context(model: ModelConfig, train: TrainConfig, mesh: Mesh, hbm_bytes: float, kind: str = "decode",
                platform: str = "tpu") -> int:
    """The most cache positions (max_target_length, at least the prompt's) whose `kind` step fits at this batch; 0
    where not even the prompt's do."""
    def fits(S: int) -> bool:
        t = dataclasses.replace(train, seq_len=S)
        return estimate_memory(model, t, mesh, hbm_bytes, kind, platform=platform).total_bytes <= hbm_bytes

    lo = train.max_prefill_predict_length
    if not fits(lo):
        return 0
    hi = lo * 2
    while fits(hi):
        if hi >= MAX_CONTEXT_SEARCHED:  # the search stops here: at least this many fit (context_words says so)
            return MAX_CONTEXT_SEARCHED
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def estimate(model: ModelConfig, train: TrainConfig, mesh: Mesh, chip: Chip, topology: Topology,
             context: float | None = None, kind: str = "decode", largest_batch: bool = True) -> ServingEstimate:
    """The serving figures of `per_device_batch_size` sequences per device; decode priced at `context` filled
    positions (default: the middle of generation, halfway from the prompt to the cache's end). `largest_batch`:
    whether to find the largest batch that fits (a search that has it per mesh leaves it out: NaN)."""
    sizes = dict(mesh.sizes)
    devices = math.prod(sizes.values())
    B = train.micro_batch(devices)
    b = B / batch_split(sizes, B)
    P, S = train.max_prefill_predict_length, train.seq_len
    ctx = context if context is not None else (P + S) / 2
    memory = estimate_memory(model, train, mesh, chip.hbm_bytes, kind, platform=chip.kind)
    return ServingEstimate(
        model=model.name, chip=chip.name, kind=chip.kind, devices=devices,
        chips=topology.chips, batch=B, prompt=P, cache=S, context=ctx, memory=memory,
        prefill=prefill_phase(model, train, mesh, chip, topology, b, P),
        first_token=prefill_phase(model, train, mesh, chip, topology, 1, P),
        decode=decode_phase(model, train, mesh, chip, topology, b, ctx),
        max_batch_per_device=(max_batch_per_device(model, train, mesh, chip.hbm_bytes, kind, chip.kind)
                              if largest_batch else math.nan),
        max_context=max_context(model, train, mesh, chip.hbm_bytes, kind, chip.kind) if largest_batch else math.nan)


def static_batch_seconds(model: ModelConfig, train: TrainConfig, mesh: Mesh, chip: Chip, topology: Topology,
                         input_len: int, output_len: int, k: ServingConstants = SHIPPED_SERVING) -> float:
    """A static batch end to end: the prefill of `input_len` tokens, then `output_len` - 1 decode steps over a cache
    growing from input_len (priced at its mean fill: decode time is linear in it)."""
    sizes = dict(mesh.sizes)
    devices = math.prod(sizes.values())
    B = train.micro_batch(devices)
    b = B / batch_split(sizes, B)
    prefill = prefill_phase(model, train, mesh, chip, topology, b, input_len, k).seconds
    steps = max(0, output_len - 1)
    decode = decode_phase(model, train, mesh, chip, topology, b, input_len + output_len / 2, k).seconds
    return prefill + steps * decode
