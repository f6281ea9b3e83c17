"""Step time per device: what one training step does, recorded as perfmodel.work's terms (matmuls at the chip's
sustained rate x a shape-dependent efficiency, memory-bound work at HBM bandwidth, the collectives the sharding
implies with a stated overlap of communication and compute) and priced at the fitted constants. Every constant says
where it comes from: a datasheet or paper, a fit to published training measurements (bench/published.py), or an
assumption. What XLA:CPU does differently lives in perfmodel.cpu.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from maxperf.perfmodel import cpu, pipeline
from maxperf.perfmodel.chips import Chip
from maxperf.perfmodel.flops import (
    ATTENTION_SKIPS_MASKED,
    COMBINE_BACKWARD_EINSUMS,
    DISPATCH_BACKWARD_EINSUMS,
    attention_kernel,
    backward_block_matmuls,
    busiest_context_shard,
    executed_pairs,
    flash_backward_matmuls,
    gated,
    head_dims,
    is_mla,
    layer_pairs,
    mtp_depths,
    mtp_fwd_flops,
    recomputed,
)
from maxperf.perfmodel.memory import params_per_device, zero1_gathered_bytes, zero1_loop_bytes
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
from maxperf.perfmodel.saved import offloaded_per_token, over_layers
from maxperf.perfmodel.sharding import (
    FSDP_AXES,
    activation_split,
    gather_axes,
    held,
    held_gathered,
    param_arrays,
    zero1_params_per_device,
)
from maxperf.perfmodel.work import (
    COMM_KINDS,
    MATMUL,
    OVERLAP_ORIGIN,
    SHIPPED,
    Constants,
    Overlap,
    Terms,
    Work,
    flash_speedup,
    flash_speedup_note,
    fp8_key,
    fp8_matmuls,
    int8_matmuls,
    price,
    settle,
)
from maxperf.spec.grouped_matmul import GMM_PASSES, megablox_tiling, pass_tiles
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.params import logits_table, reduced_arrays
from maxperf.spec.params import params_per_device as held_params
from maxperf.spec.topology import Topology
from maxperf.spec.train import DTYPE_BYTES, TrainConfig, optimizer_state_bytes

# XLA:GPU's jax.lax.ragged_dot (the dropless grouped matmul, sparse_matmul=true) runs as if each local expert's matmul
# took every row, not its own: at GPU_RAGGED_DOT_RATE / (local experts) of the modelled per-expert rate. Fitted on
# two steps compiled and run on an H100 (jax 0.11.2, bench/gpu_measured.py, 2026-11-23), B 4, L 2048, full remat:
# mixtral-8x7b cut to 2 layers (8 experts) took 591 ms where the model at the plain rate gave its experts 103 ms of a
# 166 ms step (0.195 of the rate, 1.56 / 8); deepseek-v2-lite cut to 4 layers (64 experts) 1279 ms, its experts 33 ms
# of 117 (0.028, 1.77 / 64). With sparse_matmul=false capacity_factor=1.25 the same steps took 169 and 133 ms
# (predicted 193 and 140), and qwen3-30b-a3b (128 experts) with ragged_dot failed XLA:GPU's autotuner.
GPU_RAGGED_DOT_RATE = 1.6
# Over F-wide vectors, the activation and gating product's elementwise passes per token per layer (read gate and
# up, write product), assumed.
ELEMENTWISE_F_PASSES = 3
# Backward elementwise work reads saved values and gradients and writes gradients: about twice the forward (assumed).
ELEMENTWISE_BACKWARD_FACTOR = 2
# Softmax per score (the dot product's; flash keeps it on chip): forward reads the float32 scores and writes float32
# and compute-dtype probabilities; backward reads probabilities and their gradient and writes the score gradient, all
# float32 (counted from the operations, each assumed to be one pass over HBM).
SOFTMAX_FWD_FLOAT32 = 2
SOFTMAX_BWD_FLOAT32 = 3
# Offloaded activations cross the host link in the forward (to the host) and the backward (back): XLA issues the
# copies asynchronously beside compute, so most of their time hides. Assumed, not fitted; checked on the published runs
# that offload (2026-12-02): over the 26 tpu-recipes runs of bench/recipes.py that offload (none fitted) the median
# |error| is 13.1% hiding none of it, 11.5% at half, 4.1% at 0.8 (median signed -0.9%), 4.2% at 0.9 and 7.5% hiding
# all; over the 8 rows of bench/published.py that do, 7.0%, 2.7%, 1.6%, 1.4% and 1.6%.
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


def step_time(model: ModelConfig, train: TrainConfig, mesh: Mesh, chip: Chip, topology: Topology,
              overlap: Overlap, temporaries: float = 0.0, imbalance: float | None = None,
              constants: Constants = SHIPPED) -> StepTime:
    """`constants`: the fitted constants (SHIPPED: as fitted on bench/published.py); `temporaries`: bytes per device
    live beside the state at the step's peak (the memory model's), which CPU devices fault in afresh every step
    (perfmodel.cpu); `imbalance`: the MoE load imbalance (perfmodel.moe load_imbalance; None: the train config's
    moe_load_imbalance where it has one, else LOAD_IMBALANCE)."""
    c = DTYPE_BYTES[train.compute_dtype]
    p = DTYPE_BYTES[train.param_dtype]
    D, N, Dh, L = model.d_model, model.num_layers, model.head_dim, train.seq_len
    a = activation_split(model, train.per_device_batch_size, L, mesh)
    # A pipeline (perfmodel.pipeline) runs each device's stage once per loop iteration on one pipeline microbatch:
    # a layer's work counts `micro` times per layer of the model (the loop's iterations x the stage's layers over the
    # model's, bubble included, per gradient-accumulation microbatch) on T tokens (the pipeline microbatch's); the
    # logits and the loss run once per microbatch on Tu tokens (split over the stages too). Without a pipeline,
    # micro is the accumulation's microbatches and T = Tu the device's tokens of one.
    view = pipeline.view(model, train, mesh)
    micro = train.grad_accum_steps * view.layer_scale
    T, Bm = a.T * view.token_scale, a.B * view.token_scale  # tokens and examples of one layer call on this device
    Tu = a.T * view.logits_scale
    steps = train.grad_accum_steps  # what runs once per microbatch outside the layers
    # the forward passes one layer's weights serve on this device in a step: every microbatch of the accumulation,
    # and of the pipeline, whose stage holds 1 / stages of the layers (`micro` counts the layer calls per model layer)
    weight_uses = micro * (view.schedule.stages if view.pipelined else 1)
    table = Work(chip, train.compute_dtype, constants, int8_matmuls(train), fp8_matmuls(train), weight_uses)
    table.overlap_given = overlap != DEFAULT_OVERLAP

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
        _moe_matmuls(table, model, train, mesh, moe, T, Bm, a, f, fwd, c, micro)
    # num_vocab_tiling: each chunk's logits are computed again in the backward
    # MaxText does not quantize the logits (its logits_dense and the embedding's attend take no quantization, int8
    # or FP8)
    # logits_dot_in_fp32: float32 operands, at the chip's float32 peak (TF32 on GPUs; one bf16 pass on TPUs)
    fp32 = train.logits_dot_in_fp32
    table.train_matmul("unembedding", Tu, D, a.V, steps * (1 + (train.num_vocab_tiling > 1)), steps,
                       4 if fp32 else c, quantized=False,
                       rate=chip.peak_flops("float32") / table.peak if fp32 else 1.0)
    if mtp_depths(model):
        _mtp_terms(table, model, train, mesh, chip, Tu, a, steps, c)
    if model.use_iota_embed:
        # MaxText's use_iota_embed: the lookup as a one-hot matmul [T, V] by [V, D], its backward the table's gradient
        # [V, T] by [T, D] alone (the tokens have none)
        table.matmul("embedding (one-hot matmul)", Tu, a.V, D, steps, c)
        table.matmul("embedding (one-hot matmul)", a.V, Tu, D, steps, c)
    # attention per (example, head): scores L x Dh by Dh x L, context L x L by L x Dh. The dot product computes all
    # L x L scores; the TPU and GPU flash kernels skip the blocks their mask hides (ATTENTION_SKIPS_MASKED), computing
    # the others whole (executed_pairs), at a kernel rate with no softmax passes over HBM
    kernel = attention_kernel(train)
    flash_rate = constants.flash_efficiency.get(chip.kind) if kernel == "flash" else None
    skips = ATTENTION_SKIPS_MASKED[kernel] and (chip.kind != "cpu" or cpu.SKIPS_MASKED_BLOCKS)
    attention_rate = chip.attention_rate(train.compute_dtype, Dq)
    per_layer = executed_pairs(model, train, L, chip.kind) if skips else layer_pairs(model, L)
    # the flash backward's matmuls times the pairs each computes, per layer: over its own kernels' tiles
    backward = (backward_block_matmuls(model, train, L, chip.kind) if skips
                else (flash_backward_matmuls(train, chip.kind) * L * L,) * len(per_layer))
    if skips and mesh.axes["sequence"] > 1 and not train.context_parallel_load_balance:
        # kernels that skip masked blocks leave the busiest context shard the most to do (busiest_context_shard)
        busiest = busiest_context_shard(model, L, mesh.axes["sequence"])
        per_layer = tuple(p * f for p, f in zip(per_layer, busiest))
        backward = tuple(p * f for p, f in zip(backward, busiest))
    for (pairs, backward_pairs), run in itertools.groupby(zip(per_layer, backward)):
        share = pairs / (L * L) if skips else 1.0
        layers = sum(1 for _ in run)  # a run of alike layers at once
        count = Bm * a.H * micro * share * layers
        scores_fwd, context_fwd = 1 + ("scores" in again), 1 + ("context" in again)
        if flash_rate:
            # the forward kernel (2 matmuls), again where remat recomputes it, and the backward kernels' over their
            # own tiles
            forward_pairs = pairs if skips else L * L
            flops = a.L / L * (Dq + Dv) * (2 * context_fwd * forward_pairs + backward_pairs) * Bm * a.H * micro * layers
            speedup = flash_speedup(chip, train)
            if "flash" not in table.assumed:  # once, not per layer
                table.assume("flash", f"flash attention at {flash_rate:.2f} of the matmul rate (fitted)"
                             + flash_speedup_note(chip, speedup))
            table.flash("attention (flash kernel)", flops, Dq, Dv, speedup)
        elif attention_rate:  # measured whole (CPU devices): scores, softmax and context, forward and backward
            cpu.measured_attention(table.add, attention_rate,
                                   2 * a.L * L * (Dq + Dv) / 2 * (scores_fwd + context_fwd + 4) * count)
        else:
            # one batched einsum over B x H: its head-dim-wide side is a contraction or an output width that tensor
            # cores and MXUs tile whole (a TPU's wider arrays filled in part: mxu_fill), so the thin-matmul term takes
            # its sequence-wide sides (on an H100, scaled-1 at B 8, L 2048 with full remat: the dot product measured
            # 89 ms slower than flash, where the head-dim side made it 247; bench/gpu_measured.py)
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
    offloaded = micro * T * offloaded_per_token(model, train, mesh)
    if offloaded and chip.host_link_bandwidth:
        table.assume("offload", f"offload copies {HOST_OFFLOAD_OVERLAP:.0%} hidden (assumed)")
        table.add("remat offload (host link)", "host", 2 * offloaded / chip.host_link_bandwidth, 0.0, 2 * offloaded,
                  HOST_OFFLOAD_OVERLAP)
    table.memory("loss", steps * Tu * a.V * 4 * LOSS_FLOAT32_PASSES)
    local_params = params_per_device(model, mesh, train)
    # the parameters the optimizer updates and its moments on this device: under ZeRO-1 (shard_optimizer_over_data)
    # their split over `data` too, as the memory model keeps them (perfmodel.memory)
    updated = local_params
    if train.shard_optimizer_over_data and mesh.axes.get("data", 1) > 1:
        updated = local_params * zero1_params_per_device(model, mesh) / held_params(model, mesh.sizes)
    # MaxText's *_memory_host_offload: the state in pinned host memory crosses the host link to the device and back
    # each step, once per step whatever the microbatches
    state = (optimizer_state_bytes(train) * train.optimizer_memory_host_offload
             + p * train.parameter_memory_host_offload) * updated
    if state and chip.host_link_bandwidth:
        table.add("state offload (host link)", "host", 2 * state / chip.host_link_bandwidth, 0.0, 2 * state,
                  STATE_OFFLOAD_OVERLAP)
    table.memory("optimizer update", OPTIMIZER_PASSES * p * updated)
    if chip.kind == "cpu":
        cpu.temporaries_faults(table.add, chip, temporaries)

    # collectives
    nets = axis_networks(mesh, chip, topology)
    arrays = param_arrays(model)
    layer_arrays = [x for x in arrays if x.block and x.matmul and not x.expert_parallel]
    table_array = logits_table(model)
    fsdp_axes = gather_axes([*layer_arrays, table_array], mesh)
    if fsdp_axes:
        # per layer: the mean over the layers where dense and MoE layers differ
        gathered = sum(held_gathered(x, mesh) * (x.count / N) for x in layer_arrays)
        vocab = held_gathered(table_array, mesh)
        # forward gather, backward gather again, gradient reduce-scatter: per layer and microbatch, each weight
        # gathered by a collective of its own and a layer's gradients reduced by one combined collective; a pipeline
        # gathers its stage's layers each iteration, or with pipeline_fsdp_ag_once all of them once a step, its
        # gradients reduced once after the loop
        g_bytes, rs = cpu.fsdp_collectives(p) if chip.kind == "cpu" else (c, "reduce-scatter")
        per_layer = sum(x.count / N for x in layer_arrays)
        once = view.pipelined and view.schedule.fsdp_gather_once
        gathers, scatters = (N / view.schedule.stages * steps,) * 2 if once else (2 * N * micro, N * micro)
        # num_vocab_tiling on a TPU: XLA gathers the table inside the chunks' loop, for each chunk's logits and again
        # for their recomputation, and all-reduces each chunk's gradient of the whole table in the compute dtype. Read
        # from the optimized HLO of MaxText's own gemma3-12b step on v6e-256 (its Trillium recipe, L 32768, 16
        # chunks; MaxText 0.2.5's train_compile, 2026-12-02) and of maxperf's of the same words, alike: 16 gathers of
        # the table's shard in the forward's loop, 16 gathers and 16 all-reduces of bf16[3840, 262144] in the
        # backward's.
        tiles = train.num_vocab_tiling if chip.kind == "tpu" else 1
        table_grad = (rs, vocab * p) if tiles == 1 else ("all-reduce", vocab * c)
        for kind, nbytes, count, pieces in (("all-gather", gathered * g_bytes, gathers, per_layer),
                                            ("all-gather", vocab * g_bytes, 2 * steps * tiles, 1),
                                            (rs, gathered * p, scatters, 1),
                                            (*table_grad, steps * tiles, 1)):
            _collective(table, "fsdp " + kind, kind, nbytes, fsdp_axes, nets, count, overlap.fsdp, pieces)
        if chip.kind == "cpu":
            last = sum(held(x, mesh) * (x.count / N) for x in layer_arrays if x.logical[-1] == "embed")
            first = sum(held(x, mesh) * (x.count / N) for x in layer_arrays if x.logical[0] == "embed")
            cpu.weight_layout_copies(table.add, chip, last, first, p, N * micro)
    if moe is not None:
        experts = [x for x in arrays if x.expert_parallel]
        _moe_collectives(table, model, train, mesh, moe, T, experts, nets, overlap, c, p, micro)
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
    # the gradients' reductions over `data`: after a scanned backward, once, with nothing left to hide behind
    # (Overlap.data); unscanned, each layer's as its backward ends, while the layers below it compute theirs, scheduled
    # as FSDP's per-layer collectives are and hidden as they are (Overlap.fsdp)
    reduce_family, reduce_overlap = (None, overlap.data) if train.scan_layers else ("fsdp", overlap.fsdp)
    if not train.scan_layers and mesh.axes["data"] > 1:
        table.assume("overlap unscanned data", "data-parallel gradient reductions of unscanned layers, layer by layer "
                                               f"in the backward, {overlap.fsdp:.0%} hidden as fsdp collectives are")
    if mesh.axes["data"] > 1 and train.shard_optimizer_over_data:
        # ZeRO-1: the gradients reduce-scattered over `data` to the state's split, the updated parameters gathered
        # back for the next step's forward (in bfloat16 under accumulation, whose gradients are bfloat16 too, and on
        # TPUs, whose compiler casts before the gather: perfmodel.memory), once a step each, as the all-reduce
        pieces = reduced_arrays(model, train.scan_layers)
        reduced = zero1_loop_bytes(train) or p
        for kind, nbytes in (("reduce-scatter", reduced), ("all-gather", zero1_gathered_bytes(train, table.chip.kind))):
            _collective(table, "data " + kind, kind, local_params * nbytes, ("data",), nets, 1, reduce_overlap, pieces,
                        family=reduce_family)
    elif mesh.axes["data"] > 1:
        # gradients are replicated across `data`: one all-reduce of this device's gradient shard per step
        # XLA reduces each gradient array by a collective of its own, as the train state holds them
        _collective(table, "data all-reduce", "all-reduce", local_params * p, ("data",), nets, 1, reduce_overlap,
                    reduced_arrays(model, train.scan_layers), family=reduce_family)
    # an FSDP axis that splits none of the dense weights (it divides none of their dimensions: spec.request warns)
    # leaves them replicated along it, as `data` does: their gradients all-reduced over it once a step
    unsplit = tuple(a for a in FSDP_AXES if mesh.axes[a] > 1
                    and a not in gather_axes([x for x in arrays if not x.expert_parallel], mesh))
    if unsplit:
        replicated = sum(held(x, mesh) * x.count for x in arrays if not x.expert_parallel)
        _collective(table, f"data all-reduce (weights replicated over {' x '.join(unsplit)})", "all-reduce",
                    replicated * p, unsplit, nets, 1, reduce_overlap, reduced_arrays(model, train.scan_layers),
                    family=reduce_family)
    if view.pipelined:
        _stage_transfers(table, view.schedule, T * a.D * c, nets["stage"], steps)
    return _settle(table, overlap)


def _stage_transfers(table: Work, s, nbytes: float, net, steps: int) -> None:
    """A pipeline's collective permutes over `stage`: each iteration's forward moves its stages' outputs on
    (pipeline.transfers_per_iteration, `nbytes` each: a microbatch's activations on this device), the backward their
    gradients back, hidden as the schedule lets them (pipeline.STAGE_OVERLAP: with the forwarding delay, each
    iteration's transfers are independent of its compute)."""
    t = pipeline.permute_time(nbytes, net)
    count = 2 * s.iterations * pipeline.transfers_per_iteration(s) * steps
    hidden = pipeline.STAGE_OVERLAP[s.delay]
    empty = f", {s.places - s.units} of {s.places} places empty (computed, passed on)" if s.places != s.units else ""
    table.assume("pipeline", f"pipeline: {s.stages} stages x {s.repeats} repeats, {s.microbatches} microbatches, "
                             f"{s.iterations} iterations ({s.bubble_fraction:.1%} bubble, counted){empty}; stage "
                             f"transfers {hidden:.0%} hidden (assumed)")
    if t.ici_s:
        table.add("pipeline stage transfers (ici)", "ici", count * t.ici_s, 0.0, count * nbytes, overlap=hidden)
    if t.dcn_s:
        table.add("pipeline stage transfers (dcn)", "dcn", count * t.dcn_s, 0.0, count * nbytes, overlap=hidden,
                  dcn_steps=count * t.dcn_steps)


DEFAULT_OVERLAP = Overlap()


def _mla_matmuls(table: Work, model: ModelConfig, T: float, H: float, fwd, bwd: float, c: int) -> None:
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


def _moe_matmuls(table: Work, model: ModelConfig, train: TrainConfig, mesh: Mesh, moe, T: float, Bm: float, a,
                 f: float, fwd, c: int, micro: float) -> None:
    """A MoE layer's matmuls on one device: the router, the routed experts' grouped matmul as one matmul per local
    expert over its rows (the device's tokens x rows per token among its E / ep experts, f times the mean on the
    busiest device), each reading its own weights, the shared experts, and with the einsum dispatch its one-hot
    dispatch and combine einsums (models/layers/moe.py)."""
    D, layers = model.d_model, moe.moe_layers
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
    # the dropless routed experts' up projection is moe_mlpwi_1 alone (flops.moe_wi), the shared experts' mlpwi_1
    routed_wi = ("mlpwi_0", "moe_mlpwi_1") if kind == "sparse" and gated(model) else wi
    up, down = "experts up and gate" if gated(model) else "experts up", "experts down"
    megablox = kind == "sparse" and table.chip.kind == "tpu" and train.megablox
    for name, weight, K, N, forward, backward in ((up, "wi", D, a.Fe, moe_fwd(*routed_wi), len(routed_wi) * bwd),
                                                  (down, "wo", a.Fe, D, moe_fwd("mlpwo"), bwd)):
        total = group * local  # the device's routed rows, sorted by expert
        tilings = [megablox_tiling(int(total), int(K), int(N), pass_tiles(train, weight, pass_))
                   for pass_ in GMM_PASSES] if megablox else [None]
        if tilings[0] is None:  # the forward's shapes tile (the kernel runs) or not (ragged_dot)
            table.train_matmul(name, group, K, N, local * forward, local * backward, c, rate=rate)
            continue
        # one Pallas kernel over all the sorted rows in tiles of tm x tk x tn, each of its three products (forward,
        # input gradient, weight gradient) in its own (MaxText's wi_tile_* / wo_tile_* keys): a row tile that
        # straddles two experts' rows is computed for each (jax's megablox make_group_metadata: tiles <= m / tm +
        # groups - 1, so every boundary costs a tile where routing leaves it unaligned), and K and N are computed in
        # whole tiles
        useful = []
        # a product whose own tiles do not fit the shapes runs in the forward's
        for tm, tk, tn in (tiling or tilings[0] for tiling in tilings):
            straddled = total / (total + (local - 1) * tm)
            fill = K / (tk * math.ceil(K / tk)) * N / (tn * math.ceil(N / tn))
            useful.append((straddled, fill, f"{tm} x {tk} x {tn}"))
        shapes = list(dict.fromkeys(shape for _, _, shape in useful))
        table.assume(f"megablox {weight}", f"routed experts' {'up' if weight == 'wi' else 'down'} projections in "
                                           f"megablox's {' / '.join(shapes)} tiles (forward, input and weight "
                                           f"gradients{'' if len(shapes) > 1 else ' alike'}): a row tile for each "
                                           f"expert boundary and whole tiles of K and N ("
                                           f"{' / '.join(f'{s * f:.2f}' for s, f, _ in useful)} of the work useful "
                                           f"here)")
        table.train_matmul(name, group, K, N, local * forward, local * backward, c, side=min(total, K, N),
                           rate=tuple(rate * s for s, _, _ in useful), fill=tuple(f for _, f, _ in useful))
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


def _mtp_terms(table: Work, model: ModelConfig, train: TrainConfig, mesh: Mesh, chip: Chip, Tu: float,
               a, steps: int, c: int) -> None:
    """DeepSeek-V3's multi-token-prediction modules (mtp_num_layers), each on the device's tokens of a microbatch
    (models/layers/mtp.py, as MaxText runs them after the decoder): its projection of the normalized hidden state and
    the next token's embedding (2D to D), one decoder layer of the last layer's kind (its matmuls priced as one
    matmul of the layer's weights per token, at D by their width over the tensor split; its attention as the
    decoder's last layer's, at the same kernel), and the shared head's logits and loss."""
    n = mtp_depths(model)
    D, L = model.d_model, train.seq_len
    runs = n * steps
    flops = mtp_fwd_flops(model, train, Tu / L)  # per microbatch: the device's Tu tokens
    tensor = mesh.axes.get("tensor", 1)
    width = flops.weights / n / (2 * Tu * D) / tensor  # the layer's weights per token, over D, on this device
    again = flops.recompute / flops.weights if flops.weights else 0.0  # the policy's recomputed share
    table.train_matmul("multi-token prediction layers", Tu, D, width, runs * (1 + again), runs, c)
    table.train_matmul("multi-token prediction projection", Tu, 2 * D, D / tensor, runs, runs, c)
    table.train_matmul("multi-token prediction logits", Tu, D, a.V, runs, runs, c, quantized=False)
    table.memory("multi-token prediction loss", runs * Tu * a.V * 4 * LOSS_FLOAT32_PASSES)
    Dq, Dv = head_dims(model)
    heads = a.H / model.num_heads  # the query heads' share on this device
    executed = flops.attention_executed / n * heads  # one module's forward einsums on this device
    if attention_kernel(train) == "flash" and chip.kind != "cpu":
        table.flash("multi-token prediction attention",
                    runs * executed * (2 + flash_backward_matmuls(train, chip.kind)) / 2, Dq, Dv,
                    flash_speedup(chip, train))
    else:  # scores and context, each forward and twice in the backward, at their matmul rate
        examples = Tu / L * a.H * runs
        table.train_matmul("multi-token prediction attention", L, Dq, L, examples, examples, c, quantized=False)
        table.train_matmul("multi-token prediction attention", L, L, Dv, examples, examples, c, quantized=False)


def _moe_collectives(table: Work, model: ModelConfig, train: TrainConfig, mesh: Mesh, moe, T: float, expert_arrays,
                     nets, overlap: Overlap, c: int, p: int, micro: float) -> None:
    """The routed experts' FSDP gathers (over the FSDP axes other than `expert`, each device gathering its own
    experts) and the expert-parallel all-to-alls: per MoE layer the dispatch and the combine in the forward, their
    gradients in the backward, and the dispatch again where remat recomputes the layer (models/layers/moe.py)."""
    layers = moe.moe_layers
    axes = gather_axes(expert_arrays, mesh)
    if axes:
        gathered = sum(held_gathered(x, mesh) for x in expert_arrays)  # one MoE layer's
        g_bytes, rs = cpu.fsdp_collectives(p) if table.chip.kind == "cpu" else (c, "reduce-scatter")
        _collective(table, "fsdp all-gather", "all-gather", gathered * g_bytes, axes, nets, 2 * layers * micro,
                    overlap.fsdp, len(expert_arrays))
        _collective(table, "fsdp " + rs, rs, gathered * p, axes, nets, layers * micro, overlap.fsdp)
    kind = dispatch(train)
    if mesh.axes["expert"] > 1:
        # what one device sends: the sorted dispatch's routed rows, k a token, as MaxText's ragged_all_to_all sends
        # them on TPUs and GPUs (maxperf's compiled step sends its exchange buffers whole, sized for the worst case,
        # ep x min(k, E / ep) rows a token: XLA:CPU has no ragged all-to-all, and the step read from the HLO prices
        # what it compiled), or the einsum dispatch's [B, E, C, D] slots, from batch-split to expert-split
        if kind != "sparse":
            rows = rows_per_token(moe, train)
        elif table.chip.kind == "cpu":
            rows = routed_buffer_rows(moe, mesh.axes["expert"])
        else:
            rows = float(moe.k)
            table.assume("ragged all-to-all", f"expert all-to-all: the {moe.k} routed rows a token, as MaxText's "
                                              "ragged_all_to_all sends them (maxperf's compiled step sends its "
                                              f"worst-case buffer, {routed_buffer_rows(moe, mesh.axes['expert']):g} "
                                              "rows a token)")
        sent = T * rows * model.d_model * c
        count = layers * micro * (4 + (recomputed(model, train) != frozenset()))
        _collective(table, "expert all-to-all", "all-to-all", sent, ("expert",), nets, count, overlap.expert,
                    time=all_to_all_time(sent, ("expert",), nets))


def _collective(table: Work, name: str, kind: str, nbytes: float, axes: tuple[str, ...], nets, count: float,
                overlap: float, pieces: int = 1, time: CollectiveTime | None = None, family: str | None = None
                ) -> None:
    """`time`: one collective's time where `collective_time` does not model its kind (the all-to-all); `family`: the
    overlap family it hides as, where not its name's first word."""
    t = collective_time(kind, nbytes, axes, nets, pieces) if time is None else time
    family = family or name.split()[0]
    # CPU collectives: measured rates, latency and overlap; the first line of each key stands (Work.assume)
    if table.chip.kind != "cpu" and (t.ici_s or t.dcn_s) and "overlap " + family not in table.assumed:
        origin = OVERLAP_ORIGIN[family] if not table.overlap_given else "as given"
        table.assume("overlap " + family, f"{family} collectives {overlap:.0%} hidden ({origin})")
        table.assume("latency", f"{LATENCY_S['ici'] * 1e6:g} us per collective inside a slice or NVLink domain "
                                "(assumed), "
                                f"{table.constants.dcn_step_latency[table.chip.kind] * 1e6:g} us per step of its ring "
                                f"across ({'fitted' if table.chip.kind == 'tpu' else 'assumed'})")
    if t.ici_s:
        table.add(name + " (ici)", "ici", count * t.ici_s, 0.0, count * nbytes, family=family)
    if t.dcn_s:
        table.add(name + " (dcn)", "dcn", count * t.dcn_s, 0.0, count * nbytes, family=family,
                  dcn_steps=count * t.dcn_steps)


def _applied_overlap(table: Work, terms, comm, seconds, exposed_s, overlap: Overlap) -> None:
    """Where less of a family's collectives is hidden than its overlap allows (the compute to hide them behind runs
    out), its assumption line says the share applied."""
    for family in dict.fromkeys(f for f, is_comm in zip(terms.family, comm.tolist()) if f and is_comm):
        key = "overlap " + family
        if key not in table.assumed:
            continue
        rows = np.array([f == family for f in terms.family]) & comm
        total = float(seconds[rows].sum())
        applied = 1 - float(exposed_s[rows].sum()) / total if total else 0.0
        if applied < getattr(overlap, family) - 0.005:
            table.assumed[key] += f", {applied:.0%} here: the compute beside them runs out"


KINDS = ("compute", "hbm", *COMM_KINDS)  # what bounds a row of the breakdown, in its order
_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}


def _settle(table: Work, overlap: Overlap) -> StepTime:
    terms, chip, c = table.terms(), table.chip, table.constants
    seconds, flops_bound = price(terms, c.fraction(chip), c.matmul_half[chip.kind],
                                 c.flash_efficiency.get(chip.kind, 1.0), c.elementwise_d_passes,
                                 c.dcn_step_latency[chip.kind],
                                 c.fp8_efficiency.get(fp8_key(chip.kind, table.fp8), 1.0))
    comm, hidden_share = terms.comm, terms.overlaps(overlap)
    steps, busy, spill = settle(seconds, comm, hidden_share, np.zeros(len(seconds), dtype=int), 1)
    exposed_s = np.where(comm, seconds - seconds * hidden_share * (1 - spill[0]), seconds)
    _applied_overlap(table, terms, comm, seconds, exposed_s, overlap)
    n = len(KINDS)
    # per row name: seconds of each kind (KINDS' order), then exposed seconds, FLOPs and bytes; summed over Python
    # floats (a numpy scalar per element costs more than the sums)
    rows: dict[str, list[float]] = {}
    totals = [0.0] * n
    exposed = dict.fromkeys(COMM_KINDS, 0.0)
    laws, bound, flops, nbytes = terms.law.tolist(), flops_bound.tolist(), terms.flops.tolist(), terms.bytes.tolist()
    for name, term_kind, law, by_flops, s, x, f, b in zip(terms.name, terms.kind, laws, bound, seconds.tolist(),
                                                          exposed_s.tolist(), flops, nbytes):
        kind = term_kind if law != MATMUL else "compute" if by_flops else "hbm"
        k = _KIND_INDEX[kind]
        row = rows.get(name)
        if row is None:
            row = rows[name] = [0.0] * (n + 3)
        row[k] += s
        row[n] += x
        row[n + 1] += f
        row[n + 2] += b
        totals[k] += s
        if kind in exposed:
            exposed[kind] += x
    out = [Row(name, KINDS[max(range(n), key=r.__getitem__)], sum(r[:n]), r[n], r[n + 1], r[n + 2])
           for name, r in rows.items()]
    totals = dict(zip(KINDS, totals))
    step, work = float(steps[0]), float(busy[0])
    # a network whose traffic alone outlasts all the compute bounds the step however well it overlaps
    networks = {k: totals[k] for k in COMM_KINDS}
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
