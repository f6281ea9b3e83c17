"""What is live beside the state and the saved activations while one layer is differentiated: the weights gathered
for it (or the shards a windowed einsum holds), what the rematerialized layer recomputes, the backward's own working
buffers, a mixture of experts' routed rows (and on GPU its grouped matmuls' dense expansion), the offloaded
tensors staged back, and the vocabulary table's gradients. Each figure is read from the compiler's buffers where its
note says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxperf.perfmodel import pipeline
from maxperf.perfmodel.flops import attention_kernel, head_dims, is_mla, mtp_depths
from maxperf.perfmodel.moe import dispatch, moe_shape
from maxperf.perfmodel.saved import (
    MTP_TABLE_GRADIENTS_PER_HEAD,
    layer_kinds,
    layer_offloaded_per_token,
    routed_rows_held,
    score_bytes,
)
from maxperf.perfmodel.sharding import activation_split, gathered_size, held, held_gathered, layer_weights
from maxperf.spec.logical_axes import split
from maxperf.spec.memo import model_memo
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.params import logits_table, param_arrays, state_arrays
from maxperf.spec.remat import remat_names
from maxperf.spec.train import DTYPE_BYTES, TrainConfig, micro_batch

# Splash attention's forward, recomputed inside the backward of a rematerialized layer, writes its log-sum-exp
# broadcast over the 128 lanes of a TPU vector register (the same case with remat_policy=minimal: the backward
# scan's body holds the kernel's (bf16[8,8,2048,128], f32[8,8,2048,128]) outputs).
RECOMPUTED_LSE_LANES = 128
# Recomputed inside the backward, the dot product's softmax writes its probabilities only (the exponentials fuse into
# them), beside the one score gradient (BACKWARD_SCORE_GRADIENTS). Measured here: llama2-7b widths at 4 layers on
# v5p-32, tensor 1, B 1, L 8192, remat_policy=full, attention=dot_product: the backward scan's body holds two
# bf16[1,32,1,8192,8192], 10.81 GiB per device compiled.
RECOMPUTED_SCORE_BUFFERS = 1
# ... and where the policy keeps neither of the MLP's input projections, their recomputed outputs with the
# activation's, three F-wide buffers (the same case: a rematted_computation fusion writing three bf16[1,8192,11008]).
RECOMPUTED_MLP_F = 3
# Where the weights are gathered whole (FSDP shards thinner than WINDOWED_MIN_ROWS, below) the recomputed up
# projection and the activation fuse into the output fusion that writes the gate's and up's gradients: only the
# recomputed gate is written, one F-wide buffer beside the three of the backward. Measured here with libtpu 0.0.52:
# llama3-70b widths at 4 layers on v6e-256 (fsdp 256), L 8192, flash, remat full and custom with q, k, v and the
# layer input offloaded, B 5: the backward scan's body holds the recomputed gate bf16[5,8192,28672], dy W_o^T and a
# (bf16[5,8192,28672] x 2) fusion that reads the gathered up-projection weight, four F-wide buffers; llama2-7b at
# 4 layers on v5p-128 (fsdp 64), B 4, L 2048, full remat, flash: the same four bf16[4,2048,11008].
RECOMPUTED_MLP_F_GATHERED = 1
# Offloaded tensors of two layers are in device memory during the backward: the last layer's, which the forward
# leaves on device for the backward that starts with it, and the next layer's, brought back while the current one is
# differentiated. Measured here with libtpu 0.0.52: llama2-7b widths at 4 layers on v5p-32, tensor 4, B 2, L 2048,
# remat_policy=minimal_offloaded, flash: at the backward scan the entry holds the last layer's bf16[8,2048,2752]
# pair beside the prefetched (dynamic-slice) pair of the next, 2.72 GiB per device (1.17 GiB of it in host memory).
OFFLOAD_STAGED_LAYERS = 2
# A MoE layer's experts are all-gathered over FSDP by the model itself (inside the dispatch's shard_map), in compute
# dtype: one layer's worth live, the gradients taking their place for the reduce-scatter; and XLA hoists the
# compute-dtype copies of every layer's local expert shards out of the scans. Measured here with libtpu 0.0.52:
# mixtral-8x7b at 4 layers on v5p-32 (fsdp 16), B 2, L 2048, remat full, flash: the backward scan's body holds three
# all-gathered bf16[1,8,4096,14336] at its peak, the entry three bf16[4,8,256,14336] converts; 10.31 GiB per device.
# XLA:GPU converts inside the scan and hoists no copies: no buffer of every layer's experts in the compute dtype in
# the compiles of bench/memory_accuracy.py's "gpu" group (qwen3-30b-a3b on h100-8, expert 8: only the float32
# gradients f32[48,16,2048,768] span the layers).
GATHERED_LAYERS = 1
# Where that layer's worth would not fit, the scheduler (memory-pressure aware) gathers one weight matrix at a time,
# each just before the matmul that reads it. Measured here with libtpu 0.0.52: gpt3-175b on v6e-256 (fsdp 256, 48
# rows of D a shard), B 3, L 2048, remat full, flash (tpu-recipes' Trillium GPT-3 175B): at the compiler's peak one
# gathered bf16[1,49152,12288] (1.13 GiB) is live beside the stacked layer inputs, not the layer's 3.4 GiB; 30.10 GiB
# per device compiled, 31.63 analytical with the layer's worth.
HOISTED_EXPERT_COPIES = 1
# Beside the gathered experts, the experts' backward writes their weight gradients whole before reduce-scattering
# them, where the shards are thick enough for windowed gathers (THIN_EXPERT_GATHER_IN_FLIGHT for the others): two
# of the layer's expert matrices live at its peak where the experts are many and narrow (qwen3-30b-a3b at
# 4 layers on v5p-32, B 2, L 2048, remat full, flash: the backward scan's body holds the three all-gathered
# bf16[1,128,2048,768] beside a tgmm output bf16[128,2048,768] and the all-reduce of another; 5.56 GiB per device).
EXPERT_GRAD_MATRICES = 2
# Where the experts' FSDP shards are thin (fewer than WINDOWED_MIN_ROWS rows of D), XLA gathers each expert matrix
# as an all-reduce of a zero-padded whole matrix (a broadcast, the shard written in, all-reduced), gathering the
# layer's matrices one after another and differentiating the weights after they are freed: at the peak the gathered
# layer and the zero-padded input of the gather in flight, not the gradients beside them. Measured here with libtpu
# 0.0.52, remat full, flash, B 2, L 2048 at 4 layers: mixtral-8x22b on v5p-128 (fsdp 64: 96 rows) holds three
# gathered bf16[1,8,6144,16384] and the padded fourth at the backward scan's peak, 11.61 GiB per device;
# llama4-maverick-17b-128e on v5p-512 (fsdp 256) two gathered bf16[1,128,5120,8192] (one in flight) and its padded
# input, its weight gradients (tgmm, copy, all-reduce, 10 GiB each) later and alone, 36.97 GiB (52.80 analytical with
# the gradients beside the gathered layer). Those buffers were read from the MoE layer before its dispatch took
# MaxText's sort and float32 sum and its experts were cast before their gather; the current layer compiles the same
# two steps to 10.29 and 48.21 GiB (10.86 and 43.85 analytical: +5.5%, -9.1%).
THIN_EXPERT_GATHER_IN_FLIGHT = 1
# The experts' backward over its routed rows (the dropless receive buffer, perfmodel.moe.routed_buffer_rows) holds
# six D-wide row buffers (the dispatched input and its gather, the grouped matmul's output, the combine's scatter-add
# and its gradient) and three Fe-wide ones (the recomputed gate and up and their product). Measured here with libtpu
# 0.0.52: qwen3-235b-a22b at 4 layers on v5p-256, expert 16, B 2, L 2048, remat full, flash: six bf16[524288,4096]
# and a (bf16[524288,1536] x 3) fusion at the backward scan's peak (524288 = 16 x 4096 tokens x 8); 33.21 GiB per
# device compiled, 11.30 analytical without them.
MOE_ROW_D_BUFFERS = 6
MOE_ROW_F_BUFFERS = 3
# XLA:TPU's latency-hiding scheduler keeps its schedule under a memory limit near the device's HBM (libtpu's log:
# "LatencyHidingScheduler current memory usage ... Current limit: 96.2e9" on v5p). Where the overlapped exchange
# above would take the step past the device's memory, it runs the exchange, the sort and the experts' matmuls one
# after another, and three D-wide row buffers are live at a time: the received rows, their sort into expert order
# and the forward's sorted input kept for the weight gradients, beside the three Fe-wide ones. Measured here with
# libtpu 0.0.52: kimi-k2 at 4 layers (a scan of 3 MoE layers) on v5p-1024, expert 32, B 2, L 2048, remat full,
# flash: the backward scan's body holds all_to_all, gather and the sorted input, bf16[1048576,7168] each, beside
# the gate, up and product bf16[1048576,2048] at its peak, the all-to-alls of the recomputed forward and of the
# backward not overlapped; HLO temp 66.23 GiB (59.19 GiB unpadded, 10.5% fragmentation), 99.88 GiB analytical with
# the overlapped buffers. TPU only: the other compilers' schedules were not measured so.
MOE_ROW_D_BUFFERS_SERIAL = 3
# XLA:GPU has no grouped matmul for jax.lax.ragged_dot: it expands each one into a dense product over all of the
# device's E / expert local experts, every routed row multiplied by every local expert's weights under a mask. The
# expanded operands are local experts x rows wide: [G, M, D] for the input of the gate and up projections (and of
# their weight gradients), [G, M, Fe] for the down projection's and for the gradients of gate and up. At the backward
# scan's peak two D-wide and three Fe-wide such buffers are live (read from the compiler's buffer layout, jax 0.12's
# CUDA 12 plugin compiling without a GPU, B 1-2, L 2048, remat full, the slots below the stacked expert gradients):
# deepseek-v2-lite at 3 layers on h100-1 (G 64, M = 6 x 4096 rows) two bf16[64,24576,2048] and three
# bf16[64,24576,1408]; qwen3-30b-a3b at 2 layers (G 128, M 8 x 2048) two bf16[128,16384,2048] and three
# bf16[128,16384,768]. Under expert parallelism M is the worst-case receive buffer (routed_buffer_rows): qwen3-30b-a3b
# on h100-8 with expert 8 holds bf16[16,262144,2048] buffers (57.03 GiB per device compiled; 11.24 analytical without
# them). On TPU the groups run as grouped matmuls (megablox's kernel, or XLA:TPU's ragged_dot) and none of these exist.
RAGGED_EXPANDED_D_BUFFERS = 2
RAGGED_EXPANDED_F_BUFFERS = 3
# Where FSDP shards the experts, XLA:GPU holds the scanned layers' float32 expert gradients in two layouts in the
# backward: the one the layer scan stacks (the FSDP shard's dimension first) and the parameters'. deepseek-v2-lite on
# h100-8 (fsdp 8), B 1, L 2048, remat full: f32[256,26,64,1408] and f32[26,64,256,1408] (x3 matrices, 2.23 GiB each)
# below the expansions above; 56.68 GiB per device compiled (43.24 analytical without these and one copy). Over the
# expert axis alone (h100-8, expert 8; h100-1) the compiler holds one; XLA:TPU holds one (EXPERT_GRAD_MATRICES).
GPU_EXPERT_GRADIENT_COPIES = 1
# Elsewhere XLA:TPU turns each weight's FSDP all-gather (and its gradient's reduce-scatter) into a windowed einsum, a
# loop that multiplies one shard at a time while the next arrives: a few local shards live, never the gathered
# weight. Measured here with libtpu 0.0.52, llama2-7b widths at 4 layers on v5p-32, remat none, flash: tensor 4,
# B 2 (fsdp 4) and tensor 1, B 1 (fsdp 16) both run every layer matmul in windowed_dot_general loops holding
# bf16[2,1024,2752] and bf16[2,256,11008] (two shards) beside the shard in flight, for weight and gradient alike.
# Not where the shards are thin: at fsdp 64 (v5p-128, B 4, remat full) the scans all-gather each weight whole
# (all-reduces of bf16[1,4096,11008]) and hold one layer's worth, its unsharded gradients taking the weights' place
# (2.35 GiB per device compiled, 2.02 analytical with windowed weights). Between the measured 256 (windowed) and 64
# (gathered) rows of D per shard, the boundary is taken at the 128 rows of the TPU's matrix unit.
WINDOWED_SHARDS = 4
WINDOWED_MIN_ROWS = 128
# Backward of one layer under the dot product: one score-sized gradient in the logits' dtype (the softmax's dS, with
# dP = dO V^T fused into it) beside the recomputed exponentials (counted with the recomputed layer, SCORE_SAVED); no
# float32 B x L x D buffer (the norms' float32 values stay inside fusions). Measured here with libtpu 0.0.52:
# llama2-7b on v5p-128, B=4, L=2048, attention=dot_product remat_policy=full compiles to 6.98 GiB per device, the
# backward scan's body holding two bf16[4,32,2048,2048] buffers (exponentials, dS) and no f32[4,2048,4096];
# attention=flash to 5.87 GiB, its body no f32[4,2048,4096] either. (libtpu 0.0.50.1 compiled the dot product to
# 10.67 GiB, two score gradients and two float32 B x L x D buffers live.)
BACKWARD_SCORE_GRADIENTS = 1
BACKWARD_D_FLOAT32 = 0
# Beside them the layer being differentiated holds, per token, compute-dtype buffers of the full width D (the norms'
# outputs gathered over tensor for the weight gradients, the partial input gradients of q, k and v before their sum
# and reduce-scatter) and three of the MLP's local width (the product's, the activation's and the gate's gradients).
# Which of the full-width ones exist depends on where XLA turns the gather or the reduce-scatter into a windowed
# einsum; measured here (llama2-7b widths at 4 layers on v5p-32, libtpu 0.0.52), the backward scan's body holds five
# (tensor 4, B 2, L 2048: two gathered, three partial), three (tensor 8, B 16, L 4096: the partial ones, the gathers
# windowed) and two (tensor 16, B 2, L 8192: the gathered ones, the reduce-scatters windowed); three is the middle
# (errors of -7%, -14% and 0% on those steps, where five gave -3%, +8% and +37%).
BACKWARD_D_BUFFERS = 3
BACKWARD_F_BUFFERS = 3
BACKWARD_MLP_D_BUFFERS = 2
# With the vocabulary split over tensor and the batch over data-like axes, libtpu schedules the unembedding's weight
# gradient (the final hidden state's transpose times the logits' gradient, reduce-scattered over the data axes) after
# the backward scan, so its two inputs, the hidden state gathered over tensor ([T, D]) and the logits' gradient
# ([T, V / tensor]), both in the compute dtype, stay live through every layer's backward. Measured here with libtpu
# 0.0.52: llama2-7b widths at 4 layers on v5p-32, tensor 4, B 2, L 2048, minimal, flash: bf16[16384,4096] and
# bf16[16384,8000] (378 MiB) live from the loss to the end of the backward scan; MaxText's train_compile of that step
# takes the gradient earlier (3.52 GiB per device against maxperf's 3.69). Without a data split (tensor 16 on 16
# chips) nothing is reduced and the weight gradient is taken at once.
LATE_TABLE_GRADIENT_INPUTS = 1
# libtpu's TPU7x target takes the table's weight gradient after the backward scan whatever the mesh, holding the logits'
# gradient ([T, V] in the compute dtype) and the final hidden state ([T, D]) through every layer's backward, and
# reduces the gradient after it (so it is not held through the scan as GATHERED_TABLE_GRADIENTS has it elsewhere).
# Measured here with libtpu 0.0.52, 4 layers, remat full, flash: llama2-7b widths on tpu7x-128, B 2, L 2048, at fsdp
# 128 (1.66 GiB per device compiled, 1.46 analytical without this, 1.74 with it) and at data 2 x fsdp 64 (1.96; 1.58,
# 1.86), where v5p-256 at data 2 x fsdp 64 takes the gradient before the backward scan; gpt-oss-120b on tpu7x-128
# (data 2 x fsdp 64, B 10, L 8192: bf16[10,8192,201088] live from the loss to the gradient after the backward scan)
# at remat full (64.14; 36.83, 62.2) and with the decoder input and wo offloaded (65.10; 37.72, 66.3).
LATE_TABLE_GRADIENT_CHIPS = ("tpu7x",)
# Where the weights are gathered whole, the vocabulary table's weight gradient is all-reduced whole in the compute
# dtype ([D, V / tensor]) instead of reduce-scattered a window at a time, and it stays live through the backward
# scan. Measured here with libtpu 0.0.52: llama3-70b widths at 4 layers on v6e-256 (fsdp 256), L 8192, flash, B 2 and
# 5, remat full and custom: an all-reduce bf16[8192,128256] (1.96 GiB) live across the backward scan; llama2-7b at
# 4 layers on v5p-128 (fsdp 64): bf16[4096,32000]. XLA:TPU only (the GPU's compiles were not read for it).
GATHERED_TABLE_GRADIENTS = 1


def recomputed_attention_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, remat: str) -> float:
    """Bytes per local token the backward of a rematerialized layer holds of its recomputed attention: the flash
    kernel's forward residuals (its output and the log-sum-exp over RECOMPUTED_LSE_LANES), or the dot product's
    probabilities (RECOMPUTED_SCORE_BUFFERS in the logits' dtype); nothing for flash where the policy keeps the
    context."""
    c = DTYPE_BYTES[train.compute_dtype]
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    Dv = head_dims(model)[1] if is_mla(model) else model.head_dim
    if attention_kernel(train) == "flash":
        names = remat_names(train, remat)
        kept = names is not None and "context" in (names[0] | names[1])
        return 0.0 if kept else a.H * (c * Dv + 4 * RECOMPUTED_LSE_LANES)
    return a.H * train.seq_len * RECOMPUTED_SCORE_BUFFERS * score_bytes(train)[1]


@dataclass(frozen=True)
class Working:
    """Bytes per device live beside the saved activations at the backward's peak: as the compiler overlaps a mixture
    of experts' exchange with its experts' work or gathers a layer's weights ahead, and as XLA:TPU serializes them
    where that would not fit (MOE_ROW_D_BUFFERS_SERIAL, GATHERED_LAYERS' note; the same figure where neither
    applies)."""

    overlapped: float
    serial: float
    # what libtpu's schedule could hold on top where perfmodel counts the table's gradient taken before the backward
    # scan (late_logits_gradient): 0 where it is counted late, or cannot be
    late_risk: float = 0.0


@dataclass(frozen=True)
class _MeshParts:
    """What `working` reads of the weights' split over a mesh alone, in elements (kept per model and mesh: a search
    asks for every batch, policy and kernel of a mesh)."""

    windowed: bool  # the weights stream through windowed einsums (their FSDP shards thick enough)
    layer_full: float  # a layer's weights gathered whole (a MoE layer's experts; every weight where not windowed)
    shard: float  # the largest windowed weight's shard
    experts_held: float  # the routed experts' shards
    table_gathered: float  # the vocabulary table, gathered
    expert_matrix: float  # the largest routed expert weight, gathered
    expert_rows: float  # the routed experts' D rows per FSDP shard
    experts_sharded_held: float  # the routed experts' shards where FSDP splits them
    layer_gathered: float  # a layer's weights, every one gathered
    matrix_full: float  # the largest weight matrix gathered whole where the weights are not windowed (0 where they are)


def _mesh_parts(model: ModelConfig, mesh: Mesh) -> _MeshParts:
    memo = model_memo(model)
    if (parts := memo.get(("working mesh parts", mesh.sizes))) is not None:
        return parts
    D = model.d_model
    arrays = param_arrays(model)
    windowed = D / split((D,), ("embed",), mesh.axes)[0] >= WINDOWED_MIN_ROWS
    layer_full = layer_weights(arrays, lambda x: held_gathered(x, mesh) if x.expert_parallel or not windowed
                               else 0.0)
    shard = max((held(x, mesh) for x in arrays if x.matmul and x.block and not x.expert_parallel),
                default=0.0) if windowed else 0.0
    table = logits_table(model)
    experts = [x for x in arrays if x.expert_parallel]
    parts = memo["working mesh parts", mesh.sizes] = _MeshParts(
        windowed=windowed, layer_full=layer_full, shard=shard,
        experts_held=sum(x.count * held(x, mesh) for x in state_arrays(model) if x.expert_parallel),
        table_gathered=gathered_size(table.shape, table.logical, mesh),
        expert_matrix=max((held_gathered(x, mesh) for x in experts), default=0.0),
        expert_rows=min((n / k for x in experts
                         for n, name, k in zip(x.shape, x.logical, split(x.shape, x.logical, mesh.axes))
                         if name == "embed"), default=float(D)),
        experts_sharded_held=sum(x.count * held(x, mesh) for x in state_arrays(model)
                                 if x.expert_parallel and held_gathered(x, mesh) > held(x, mesh)),
        layer_gathered=layer_weights(arrays, lambda x: held_gathered(x, mesh)),
        matrix_full=0.0 if windowed else max((held_gathered(x, mesh) for x in arrays
                                              if x.matmul and x.block and not x.expert_parallel), default=0.0))
    return parts


def working(model: ModelConfig, train: TrainConfig, mesh: Mesh, platform: str, chip: str = "",
            view: pipeline.View | None = None) -> Working:
    """The backward's working set on a platform kind ("tpu", "gpu", "cpu"; CPU follows the TPU's buffers); `chip`: the
    chip's name where its compiler's schedule differs (LATE_TABLE_GRADIENT_CHIPS); `view`: the step's pipeline view
    where the caller has it (pipeline.view)."""
    c = DTYPE_BYTES[train.compute_dtype]
    p = DTYPE_BYTES[train.param_dtype]
    remat = str(train.remat_policy)
    D = model.d_model
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    # tokens of one layer call on this device (a pipeline microbatch's in a pipeline), and of the logits' call
    view = view or pipeline.view(model, train, mesh)
    T, T_logits = a.T * view.token_scale, a.T * view.logits_scale
    # weights the model gathers itself (a MoE layer's experts) are whole; the rest stream through windowed einsums
    # where their shards are thick enough, else are gathered whole too
    parts = _mesh_parts(model, mesh)
    windowed, layer_full, shard = parts.windowed, parts.layer_full, parts.shard
    hoisted = HOISTED_EXPERT_COPIES * c * parts.experts_held
    gathered = (GATHERED_LAYERS * layer_full * c + WINDOWED_SHARDS * shard * c
                + (hoisted if c < p and platform != "gpu" else 0.0))
    grads_unsharded = WINDOWED_SHARDS * shard * c
    # the gradient of the scores, in the logits' dtype: the dot product's only (flash keeps its tiles on chip)
    score_grads = 0.0 if attention_kernel(train) == "flash" else score_bytes(train)[1] * a.H * train.seq_len
    moe = moe_shape(model)
    F_local = max(a.F, a.Fe * (routed_rows_held(moe, train, mesh) + moe.S) if moe else 0.0)
    # the backward of a layer runs its MLP's part, then its attention's; what a rematerialized layer recomputes of
    # its attention (q, k, v and the kernel's residuals, or the scores) is live through both, the MLP's recomputed
    # gate and up through the MLP's part only; the larger part counts
    names = remat_names(train, remat)
    tpu_gathered = not windowed and platform != "gpu"  # XLA:TPU with the weights gathered whole
    recomputed_mlp = ((RECOMPUTED_MLP_F_GATHERED if tpu_gathered else RECOMPUTED_MLP_F) * F_local
                      if names is not None and not ({"mlpwi", "mlpwi_0", "mlpwi_1"} & (names[0] | names[1])) else 0.0)
    Dq, Dv = head_dims(model) if is_mla(model) else (model.head_dim, model.head_dim)
    qkv = c * ((a.H + a.K) * Dq + a.K * Dv)  # q, k and v, or their gradients
    recomputed = (recomputed_attention_per_token(model, train, mesh, remat) + qkv) if names is not None else 0.0
    mlp_phase = c * (BACKWARD_F_BUFFERS * F_local + recomputed_mlp + BACKWARD_MLP_D_BUFFERS * D) + recomputed
    serial_phase = mlp_phase
    # a MoE layer's part: its routed rows, each D wide and Fe wide, as the exchange overlaps the experts' work, and
    # as XLA serializes it where that would not fit (MOE_ROW_D_BUFFERS_SERIAL); on GPU, the dense expansions of its
    # grouped matmuls over the local experts (RAGGED_EXPANDED_*)
    gpu_ragged = platform == "gpu" and dispatch(train) == "sparse"  # ragged_dot as XLA:GPU expands it
    if moe is not None:
        rows = routed_rows_held(moe, train, mesh)
        shared = moe.S * a.Fe * (BACKWARD_F_BUFFERS + (RECOMPUTED_MLP_F if recomputed_mlp else 0))
        expanded = (rows * moe.E / mesh.axes.get("expert", 1)
                    * (RAGGED_EXPANDED_D_BUFFERS * D + RAGGED_EXPANDED_F_BUFFERS * a.Fe) if gpu_ragged else 0.0)
        phases = {n: max(mlp_phase, c * (rows * (n * D + MOE_ROW_F_BUFFERS * a.Fe) + expanded + shared
                                         + BACKWARD_MLP_D_BUFFERS * D) + recomputed)
                  for n in (MOE_ROW_D_BUFFERS, MOE_ROW_D_BUFFERS_SERIAL)}
        mlp_phase, serial_phase = phases[MOE_ROW_D_BUFFERS], phases[MOE_ROW_D_BUFFERS_SERIAL]
    # context parallelism (the sequence axis, MaxText's all-gather strategy): each device's attention reads the keys
    # and values gathered along the whole sequence, and its backward makes their gradients at that size before
    # reduce-scattering them (models/context.py): per local token, the other shards' k and v twice. On cpu-4 (tiny,
    # 8 KV heads of 256, flash, full remat, 4,096 tokens a device) the compiler's total rose from 0.60 to 1.00 GiB
    # between the sequence whole and split over 4
    cp = mesh.axes.get("sequence", 1)
    gathered_kv = 2 * c * a.K * (Dq + Dv) * (cp - 1) if cp > 1 else 0.0
    attention_phase = (BACKWARD_SCORE_GRADIENTS * score_grads + c * BACKWARD_D_BUFFERS * D + qkv + recomputed
                       + BACKWARD_D_FLOAT32 * 4 * D + gathered_kv)
    matrix = c * parts.expert_matrix
    # the routed experts' D rows per FSDP shard (THIN_EXPERT_GATHER_IN_FLIGHT)
    thin = parts.expert_rows < WINDOWED_MIN_ROWS
    expert_grads = 0.0 if thin else EXPERT_GRAD_MATRICES * matrix
    in_flight = THIN_EXPERT_GATHER_IN_FLIGHT * matrix if thin else 0.0
    staged = OFFLOAD_STAGED_LAYERS * T * max(layer_offloaded_per_token(model, train, mesh, m)
                                             for m in layer_kinds(model))
    batch_split = split((micro_batch(train.per_device_batch_size, mesh.devices),), ("activation_batch",),
                        mesh.axes)[0]
    late_chip = chip in LATE_TABLE_GRADIENT_CHIPS
    late_table_gradient = (LATE_TABLE_GRADIENT_INPUTS * T_logits * (D + a.V) * c if platform != "gpu"
                           and train.num_vocab_tiling == 1 and (late_chip or a.V < model.vocab_size and batch_split > 1)
                           else 0.0)
    # XLA:GPU's second layout of the scanned experts' gradients while they are FSDP-sharded (GPU_EXPERT_GRADIENT_COPIES)
    expert_grad_copy = GPU_EXPERT_GRADIENT_COPIES * p * parts.experts_sharded_held if gpu_ragged else 0.0
    # with MTP heads, the vocabulary table's gradient of each head (the decoder's and every depth's), whole; else,
    # with the weights gathered whole, the decoder's (GATHERED_TABLE_GRADIENTS)
    depths = mtp_depths(model)
    table_size = parts.table_gathered * c
    table_grads = (MTP_TABLE_GRADIENTS_PER_HEAD * (1 + depths) * table_size if depths
                   else GATHERED_TABLE_GRADIENTS * table_size if tpu_gathered and not late_chip else 0.0)

    # pipeline_fsdp_ag_once: the stage's layers gathered once for the step, with their gradients beside them in the
    # compute dtype (MaxText's note on the key), instead of a layer's at a time; and a stage of U layers a repeat
    # (num_layers_per_pipeline_stage) gathers all U for each iteration, with their gradients (measured: llama2-7b at 8
    # layers on v5p-16, 2 stages of 4 layers, B 4, full remat: 8.96 GiB compiled against 6.67 counting one layer's)
    stage_gathered = 0.0
    if view.pipelined:
        s = view.schedule
        layers = model.num_layers / s.stages if s.fsdp_gather_once else s.units_per_stage - 1
        stage_gathered = 2 * c * layers * parts.layer_gathered

    def peak(mlp: float, weights: float = gathered) -> float:
        busiest = max(T * mlp, T * attention_phase, expert_grads)
        return (weights + in_flight + grads_unsharded + busiest + staged + table_grads + late_table_gradient
                + expert_grad_copy + stage_gathered)

    # a dense model's weights gathered whole: under memory pressure XLA:TPU gathers them a matrix at a time
    # (GATHERED_LAYERS' note) instead of a layer's worth ahead
    one_matrix = (gathered - GATHERED_LAYERS * layer_full * c + c * parts.matrix_full
                  if tpu_gathered and moe is None and parts.matrix_full else gathered)
    late_risk = (late_logits_gradient(T_logits, a.V, c) if platform == "tpu" and not late_table_gradient
                 and train.num_vocab_tiling == 1 and batch_split > 1 and not depths else 0.0)
    return Working(overlapped=peak(mlp_phase), serial=peak(serial_phase, one_matrix), late_risk=late_risk)


# Where the batch is split and the vocabulary is not (FSDP, data), XLA:TPU takes the vocabulary table's weight gradient
# before the backward layer scan in some schedules and after it in others, holding the logits' gradient ([T, V] in the
# compute dtype) from the loss through every layer's backward; nothing in the mesh, chip or remat policy has been found
# to tell which (docs/maxtext.md, "Not yet counted"). perfmodel counts the early placement, and reports the late one's
# extra as a risk to the verdict. Measured with libtpu 0.0.52, llama3-8b at 4 layers, fsdp only: late on v6e-8 at B 8,
# L 2048 under remat minimal (17.50 GiB compiled, 13.73 analytical), full (12.75 / 8.98) and at B 32 with
# minimal_offloaded (41.47 / 23.69: the analytical figure fits 31.25 GiB, the compiler's does not), each short by one
# [T, V] gradient; early for llama2-7b on v5p-8 and v5p-16 (6.15 / 6.29, 5.53 / 5.35).
def late_logits_gradient(tokens: float, vocab: float, c: int) -> float:
    """Bytes of the logits' gradient a late table gradient holds through the backward: [tokens, vocab] in the
    compute dtype (`c` bytes)."""
    return tokens * vocab * c
