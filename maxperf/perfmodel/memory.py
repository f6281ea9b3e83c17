"""Memory per device: state (params, AdamW, grads), saved activations per remat policy, logits, temporaries.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4):
count, per layer and token, every tensor the backward pass reads, then divide by the mesh axes that shard it. The
family here differs from their GPT: grouped-query attention (K kv heads), gated MLPs (three F-wide tensors), norms
computed in float32, no dropout (so no masks); under attention=dot_product the scores in the compute dtype unless
MaxText's float32 switches say otherwise, under flash no [L, L] scores at all (models/layers/attention_kernels.py).
Remat policies keep MaxText's checkpoint names (perfmodel.flops.REMAT_SAVED); offloaded ones live in host memory.
Every assumption is a named constant; the figures are to be checked against XLA's memory_analysis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from maxperf.perfmodel.flops import attention_kernel, gated, head_dims, is_mla, moe_layers_of, mtp_depths
from maxperf.perfmodel.moe import MoeShape, dispatch, moe_shape, routed_buffer_rows, rows_per_token
from maxperf.perfmodel.sharding import activation_split, gathered_size, held, held_gathered, layer_weights
from maxperf.spec.logical_axes import local_size, split
from maxperf.spec.memo import model_memo
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.params import ParamArray, param_arrays, state_arrays
from maxperf.spec.params import params_per_device as held_params
from maxperf.spec.remat import remat_names
from maxperf.spec.train import (
    DTYPE_BYTES,
    OPTIMIZER_STATES_PER_PARAM,  # optax.adamw's mu and nu, in the parameters' dtype
    TrainConfig,
    micro_batch,
)

# Gradient accumulation sums microbatch gradients in a float32 buffer (models/train_step.py).
GRAD_ACCUMULATOR_BYTES = 4
# The train step donates the state, so the updated params and optimizer state reuse the input buffers.
STATE_DONATED = True
# Norms upcast to float32; the backward reads the float32 input and the normalized float32 value (8 bytes/elem), at
# the residual stream's width on the device (a.D); the compute-dtype output, gathered over tensor for the next
# matmul, is not kept (the shape of GATED_MLP_SAVED_F's note: four f32[4,8,2048,1024] per layer for two norms, no
# bf16[.., 4096]).
NORM_SAVED_BYTES = 8
# RMSNorm (MaxText's form) rounds the normalized value to the compute dtype before its scale, so the backward keeps the
# float32 input and the normalized value in the compute dtype: 4 + 2 bytes per element in bf16 (a tiny model on v5p-8,
# tensor 2, no remat: the forward scan's saved buffers shrank by 2 bytes per element of each norm's width when the
# norm took that form, tests/test_estimate_memory.py's tiny compile).
RMS_NORM_SAVED_FLOAT32_BYTES = 4
# Gated MLP (SwiGLU/GeGLU) keeps gate, up, the activation's internals (sigmoid s and its derivative s (1 - s)), the
# activation and the product: 6 x F (measured here with libtpu 0.0.52: llama2-7b widths at 4 layers on v5p-32,
# tensor 4, B 2, L 2048, remat_policy=none: the forward scan stacks six bf16[4,8,2048,2752] per layer); the plain
# GELU MLP keeps its input, the tanh internals and the output: 3 x F.
GATED_MLP_SAVED_F = 6
PLAIN_MLP_SAVED_F = 3
# Per attention score under the dot product: two buffers in the logits' dtype (float32 with MaxText's
# float32_qk_product or float32_logits, else the compute dtype): the exponentials and the normalized probabilities,
# and, when that dtype is wider, a compute-dtype copy (for P V); soft-capping adds the tanh output in the product's
# dtype. The mask is one shared [L, L] boolean, negligible. Measured here with libtpu 0.0.52 (the shape of
# GATED_MLP_SAVED_F's note, attention=dot_product): the forward scan stacks two bf16[4,8,8,1,2048,2048] per layer.
SCORE_SAVED = 2
SOFTCAP_SAVED = 1
# Flash kernels keep, per query and head, the float32 log-sum-exp of the softmax beside their output (the shape of
# GATED_MLP_SAVED_F's note, attention=flash: the forward scan stacks f32[4,8,8,2048], [N, B, H, L], beside the
# kernel's bf16[4,8,8,2048,128] output). The TPU's figure, for every platform.
FLASH_LSE_BYTES = 4
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
# Logits: the compute-dtype unembedding output; since the cross-entropy picks the target logit by a one-hot
# reduction (models/train_step.py cross_entropy), XLA fuses the float32 upcast, the log-softmax and its gradient, and
# Gemma 2's final soft-capping, into reductions over it, so no float32 [T, V] buffer is live. Measured here:
# gemma-2b (V = 256000) on v5p-8, B=4, L=2048, full remat compiles to 15.61 GiB per device, its loss phase the peak:
# 2.4 bytes per logit beside the gradients, the carry and the gathered vocabulary table (6 before the one-hot
# cross-entropy, with the float32 softmax live).
LOGITS_FLOAT32_BUFFERS = 0
# XLA:GPU does not fuse the float32 upcast into the loss's reductions: at the loss the float32 [T, V] logits are live
# and the compute-dtype ones are not. Measured on an H100 (bench/gpu_measured.py, 2026-11-23): qwen3-0.6b
# (V = 151936), B=16, L=2048, full remat compiles to 27.44 GiB = the state (8.88) + 18.55 GiB, 4 bytes per logit.
GPU_LOGIT_BYTES = 4
# num_vocab_tiling > 1 (models/train_step.py tiled_nll_sum): inside the loss's scan a chunk's logits keep one float32
# buffer beside the compute-dtype ones (the gradient of the chunk's logits, computed by the scan's backward), and the
# table's gradient, summed over the chunks, is in the param dtype and split like the table. Measured here: gemma-2b
# on v5p-8, B=4, L=2048, full remat compiles to 13.71 GiB per device with 4 tiles (14.29 analytical) and 14.34 with 8
# (12.82 analytical; its peak no longer the loss).
TILED_LOGITS_FLOAT32_BUFFERS = 1
# The optimizer phase: the gradients are divided by the token count and clipped by their global norm, which needs
# every gradient reduced before any update, so XLA materializes one more float32 gradient-sized buffer (the scaled
# gradients) beside the gradients themselves. Measured here: llama2-7b v5p-8, B=1, L=2048, full remat: temp
# 12.77 GiB = 2 x 6.28 GiB of gradients + 0.2 GiB.
OPTIMIZER_GRADIENT_COPIES = 1
# XLA:GPU updates in place without it: scaled-4 (4.15B), B=4, L=2048 on an H100 compiles to 64.01 GiB against a
# state of 61.92 GiB (bench/gpu_measured.py, 2026-11-23), where one more gradient copy would make 77.4.
GPU_OPTIMIZER_GRADIENT_COPIES = 0
# Saved tensors are written per layer into stacked [N, ...] buffers by the forward scan and read by the backward
# scan. Under the former "minimal" (jax's dots_with_no_batch_dims_saveable) XLA also held a second, partial copy of
# them in the loss phase (1.83 x the saved bytes for qwen3-0.6b on v5p-8, B=1, L=2048; bench/memory_accuracy.py).
# Under MaxText's policies, which save by checkpoint name, it holds none: llama2-7b on v5p-128, B=4, L=2048,
# attention=flash remat_policy=minimal compiles with libtpu 0.0.52 to 24.06 GiB per device (25.17 analytical, with no
# copy), its forward scan writing one stacked buffer per saved name (3 x bf16[32,4,2048,32,128], 2 x
# bf16[32,4,2048,11008], the out_proj and the carry bf16[32,4,2048,4096]: the 20.75 GiB counted); libtpu 0.0.50.1
# compiled it to 26.22 GiB (39 GiB analytical with the former 1.8 copies).
MINIMAL_SAVED_COPIES = 1.0
# Offloaded tensors of two layers are in device memory during the backward: the last layer's, which the forward
# leaves on device for the backward that starts with it, and the next layer's, brought back while the current one is
# differentiated. Measured here with libtpu 0.0.52: llama2-7b widths at 4 layers on v5p-32, tensor 4, B 2, L 2048,
# remat_policy=minimal_offloaded, flash: at the backward scan the entry holds the last layer's bf16[8,2048,2752]
# pair beside the prefetched (dynamic-slice) pair of the next, 2.72 GiB per device (1.17 GiB of it in host memory).
OFFLOAD_STAGED_LAYERS = 2
# optimizer_memory_host_offload: the fraction of the offloaded optimizer state in HBM at the step's peak (XLA brings
# it in leaf by leaf for the update). Measured here with libtpu 0.0.50.1 (not yet with 0.0.52): llama2-7b on
# v5p-128, B=4, L=2048, attention=flash, remat full: optimizer_memory_host_offload compiles to 8.26e9 bytes per
# device against 8.74e9 without (0.84e9 of optimizer state in host memory, 0.43 of it back in HBM at the peak); the
# parameters offloaded too, the same 8.26e9
OFFLOADED_OPTIMIZER_STAGED = 0.43
# A MoE layer's experts are all-gathered over FSDP by the model itself (inside the dispatch's shard_map), in compute
# dtype: one layer's worth live, the gradients taking their place for the reduce-scatter; and XLA hoists the
# compute-dtype copies of every layer's local expert shards out of the scans. Measured here with libtpu 0.0.52:
# mixtral-8x7b at 4 layers on v5p-32 (fsdp 16), B 2, L 2048, remat full, flash: the backward scan's body holds three
# all-gathered bf16[1,8,4096,14336] at its peak, the entry three bf16[4,8,256,14336] converts; 10.31 GiB per device.
# XLA:GPU converts inside the scan and hoists no copies: no buffer of every layer's experts in the compute dtype in
# the compiles of bench/memory_accuracy.py's "gpu" group (qwen3-30b-a3b on h100-8, expert 8: only the float32
# gradients f32[48,16,2048,768] span the layers).
GATHERED_LAYERS = 1
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
# A MoE layer keeps (models/layers/moe.py; counted from its tensors, not yet measured): per token the router's
# float32 logits and probabilities over the E experts and the float32 top-k weights; per routed row the experts'
# input (D) and MLP internals (GATED_MLP_SAVED_F x Fe), the rows of the sorted dispatch being the worst-case receive
# buffer under expert parallelism (perfmodel.moe.routed_buffer_rows), those of the einsum dispatch its E x C slots
# per sequence; the combine reads the top-k expert outputs per token (sorted dispatch), or every slot's output and
# the [L, E, C] dispatch and combine masks (einsum dispatch).
ROUTER_FLOAT32_PER_EXPERT = 2
# Multi-token prediction (models/layers/mtp.py), per module and token beside its decoder layer's input and saved
# tensors: the projection's input, the normed embedding and hidden state concatenated (2 x D in the compute dtype), and
# its three norms' saved values (norm_saved_bytes; counted from the module). Each depth's logits are live beside the
# decoder's in the loss phase, and each head's gradient of the vocabulary table is whole, beside the other's, through
# the decoder's backward: deepseek-v3 at 4 layers with mtp_num_layers=1 on v5p-128 (expert 8), B 1, L 1024, remat full,
# flash compiles with libtpu 0.0.52 to 17.98 GiB per device (19.88 analytical), two bf16[1024,129280] logits fusions
# live at the loss and two bf16[7168,129280] table gradients (transpose of BLD,DV->BLV, all-reduced) at the backward
# scan.
MTP_SAVED_D = 2
MTP_SAVED_NORMS = 3
MTP_LOGITS_PER_DEPTH = 1
MTP_TABLE_GRADIENTS_PER_HEAD = 1
# With the vocabulary split over tensor and the batch over data-like axes, libtpu schedules the unembedding's weight
# gradient (the final hidden state's transpose times the logits' gradient, reduce-scattered over the data axes) after
# the backward scan, so its two inputs, the hidden state gathered over tensor ([T, D]) and the logits' gradient
# ([T, V / tensor]), both in the compute dtype, stay live through every layer's backward. Measured here with libtpu
# 0.0.52: llama2-7b widths at 4 layers on v5p-32, tensor 4, B 2, L 2048, minimal, flash: bf16[16384,4096] and
# bf16[16384,8000] (378 MiB) live from the loss to the end of the backward scan; MaxText's train_compile of that step
# takes the gradient earlier (3.52 GiB per device against maxperf's 3.69). Without a data split (tensor 16 on 16
# chips) nothing is reduced and the weight gradient is taken at once.
LATE_TABLE_GRADIENT_INPUTS = 1
# The checkpoint names of the attention block's tensors and of the MLP's (a MoE layer's experts'), for the breakdown
ATTENTION_NAMES = ("query_proj", "key_proj", "value_proj", "qkv_proj", "context", "out_proj")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device."""

    params: float
    optimizer: float
    gradients: float
    grad_accumulator: float  # only with grad_accum_steps > 1
    activations: float  # saved for the backward pass, all layers
    saved_copy: float  # remat by name: the second copy of the saved outputs, live until the backward starts
    logits: float
    temporaries: float  # one layer's gathered weights, unsharded grads and backward working set
    optimizer_temporaries: float  # the scaled gradients of the clipped update
    hbm_bytes: float
    host_offload: float = 0.0  # activations the remat policy offloads to pinned host memory (not in HBM)
    # MaxText's optimizer_memory_host_offload / parameter_memory_host_offload: the state kept in pinned host memory
    # between steps (not in HBM), and the part of an offloaded optimizer state in HBM at the step's peak
    host_state: float = 0.0
    optimizer_staged: float = 0.0
    # what the parameters, gradients and optimizer state of each part take ("experts": the MoE blocks' routers, routed
    # and shared experts; "attention": the attention blocks; "rest": embeddings, dense MLPs, norms), and what the
    # saved activations of each take (the MLP's part under "experts" in MoE layers, under "rest" in dense ones)
    state_blocks: tuple[tuple[str, float], ...] = ()
    activation_blocks: tuple[tuple[str, float], ...] = ()

    def phases(self) -> dict[str, float]:
        """What is live beside the state (params, optimizer, accumulator) in each phase of the step: "loss" (the
        logits and the gathered vocabulary table atop the saved activations, and under minimal remat the second
        copy of the saved dot outputs), "backward" (a layer being differentiated atop the saved activations) and
        "optimizer" (the activations freed, a scaled copy of the gradients). XLA allocates the gradient buffers
        before the loss (they are outputs of the whole backward), so they count in every phase; the phases do not
        overlap, so the peak is the largest."""
        return {
            "loss": self.gradients + self.activations + self.saved_copy + self.logits,
            "backward": self.gradients + self.activations + self.temporaries,
            "optimizer": self.gradients + self.optimizer_temporaries,
        }

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.get)

    @property
    def per_device_total_bytes(self) -> float:
        return (self.params + self.optimizer + self.grad_accumulator + self.optimizer_staged
                + max(self.phases().values()))

    @property
    def host_bytes(self) -> float:
        """Pinned host memory per device: offloaded activations and offloaded state."""
        return self.host_offload + self.host_state

    @property
    def headroom_bytes(self) -> float:
        return self.hbm_bytes - self.per_device_total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def as_dict(self) -> dict:
        return {
            "params": self.params, "optimizer": self.optimizer, "gradients": self.gradients,
            "grad_accumulator": self.grad_accumulator, "activations": self.activations,
            "saved_copy": self.saved_copy, "logits": self.logits,
            "temporaries": self.temporaries, "optimizer_temporaries": self.optimizer_temporaries,
            "peak_phase": self.peak_phase, "phases": self.phases(),
            "per_device_total_bytes": self.per_device_total_bytes,
            "hbm_bytes": self.hbm_bytes, "headroom_bytes": self.headroom_bytes, "fits": self.fits,
            "host_offload": self.host_offload, "host_state": self.host_state,
            "optimizer_staged": self.optimizer_staged, "host_bytes": self.host_bytes,
            "state_blocks": dict(self.state_blocks), "activation_blocks": dict(self.activation_blocks),
        }


def params_per_device(model: ModelConfig, mesh: Mesh) -> float:
    """Parameters held by one device after sharding (the optimizer and gradients are sharded alike)."""
    return held_params(model, mesh.sizes)


def params_per_block(model: ModelConfig, mesh: Mesh) -> dict[str, float]:
    """params_per_device split into "experts" (MoE blocks), "attention" and "rest" (the MTP modules' layers with
    the decoder's blocks of their kind)."""
    memo = model_memo(model)
    if (out := memo.get(("params_per_block", mesh.sizes))) is None:
        out = memo["params_per_block", mesh.sizes] = {"experts": 0.0, "attention": 0.0, "rest": 0.0}
        for x in state_arrays(model):
            part = "experts" if x.block == "moe" else "attention" if x.block == "attention" else "rest"
            out[part] += x.count * held(x, mesh)
    return dict(out)


def expert_entry_size(x: ParamArray, mesh: Mesh) -> float:
    """Elements on one device of a routed-expert array as the experts' shard_map takes it in, and gives its gradient
    back (models/layers/moe.py sparse_dispatch's in_specs): its experts over `expert`, D as the parameter splits it,
    the expert width over `tensor` alone where the parameter's "mlp" axis spans fsdp_transpose too."""
    tp = mesh.axes.get("tensor", 1)
    size = 1.0
    for n, name, shards in zip(x.shape, x.logical, split(x.shape, x.logical, mesh.axes)):
        size *= n / ((tp if n % tp == 0 else 1) if name == "mlp" else shards)
    return size


# The routed experts' gradients, and their float32 accumulator under gradient accumulation, keep the split the
# experts' shard_map gives them (models/layers/moe.py sparse_dispatch: the expert width over tensor alone), not the
# parameters' (over fsdp_transpose and tensor). Measured here with libtpu 0.0.52: mixtral-8x7b on v5p-64, fsdp 2 x
# fsdp_transpose 4 x tensor 4, B 2, A 8, L 2048, remat minimal, flash: the parameters f32[32,8,2048,896] beside an
# accumulator f32[32,8,2048,3584] per expert matrix (x3) and the microbatch's gradients of the same shape; 93.69
# GiB per device compiled against 52.52 analytical with the gradients split like the parameters.
def expert_gradient_excess(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> float:
    """Elements per device by which the routed experts' gradients exceed their parameters' shards: the gradients of
    the dropless dispatch come out of its shard_map split as they went in (expert_entry_size), so a width split over
    fsdp_transpose as well as tensor comes back split over tensor only (the note above)."""
    if moe_shape(model) is None or dispatch(train) != "sparse":
        return 0.0
    return sum(x.count * (expert_entry_size(x, mesh) - held(x, mesh)) for x in state_arrays(model)
               if x.expert_parallel)


def routed_rows_held(moe: MoeShape, train: TrainConfig, mesh: Mesh) -> float:
    """Rows of the routed experts' buffers per local token: the sorted dispatch's (top-k, in the worst-case receive
    buffer under expert parallelism), or the einsum dispatch's E x C / L slots."""
    if dispatch(train) == "sparse":
        return routed_buffer_rows(moe, mesh.axes.get("expert", 1))
    return rows_per_token(moe, train)


def named_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, moe_layer: bool = False) -> dict[str, float]:
    """Bytes per local token of each checkpoint name's tensor that the backward reads back, in one layer (the layer
    input is the scan carry, counted apart; qkv_proj only under fused_qkv, mlpwi of a gated MLP only under
    fused_mlp; the MLP's output, mlpwo, only a post-norm reads, or in a MoE layer (`moe_layer`) the routing
    weights' gradient: elsewhere a policy that names it keeps nothing, tests/test_remat.py). A MoE layer's MLP names
    are its experts' tensors over the rows they hold, and its shared experts'."""
    c = DTYPE_BYTES[train.compute_dtype]
    D, Dh = model.d_model, model.head_dim
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    # a flash kernel's residuals carry the context's name too: its output in the kernel's [B, H, L, Dh] layout (beside
    # the context in the model's) and the float32 log-sum-exp (measured here: jax's saved_residuals of a layer)
    flash = attention_kernel(train) == "flash"
    moe = moe_shape(model) if moe_layer else None
    F = a.F if moe is None else (routed_rows_held(moe, train, mesh) + moe.S) * a.Fe
    # MaxText's fused_mlp names the gate and up outputs together mlpwi, its fused_qkv q, k and v together qkv_proj
    if gated(model) and getattr(model, "fused_mlp", False):
        wi = {"mlpwi": 2 * c * F}
    else:
        wi = {"mlpwi_0": c * F, "mlpwi_1": c * F} if gated(model) else {"mlpwi": c * F}
    if moe is not None:  # the experts' output rows are whole D wide, partial sums over a tensor-split width (the
        # forward scan of expert_gradient_excess's compile, at tensor 4, stacks bf16[32,32768,4096] for them)
        wo = c * (D * routed_rows_held(moe, train, mesh) + (a.D if moe.S else 0))
    else:
        wo = c * a.D if model.post_norms else 0.0
    if is_mla(model):
        Dq, Dv = head_dims(model)
        kernel = c * a.H * Dv + FLASH_LSE_BYTES * a.H if flash else 0.0
        return {"query_proj": c * a.H * Dq, "key_proj": c * a.H * Dq, "value_proj": c * a.H * Dv,
                "context": c * a.H * Dv + kernel, "out_proj": c * a.D, **wi, "mlpwo": wo}
    kernel = c * a.H * Dh + FLASH_LSE_BYTES * a.H if flash else 0.0
    if getattr(model, "fused_qkv", False):
        qkv = {"qkv_proj": c * (a.H + 2 * a.K) * Dh}
    else:
        qkv = {"query_proj": c * a.H * Dh, "key_proj": c * a.K * Dh, "value_proj": c * a.K * Dh}
    return {**qkv, "context": c * a.H * Dh + kernel, "out_proj": c * a.D, **wi, "mlpwo": wo}


def layer_saved_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, *, remat: str,
                          moe_layer: bool = False) -> float:
    """Bytes one layer keeps in device memory per local token for its backward, beyond the layer input, under a
    remat policy (`custom` reads the train config's per-tensor keys); `moe_layer`: a MoE layer's."""
    return sum(layer_saved_parts(model, train, mesh, remat=remat, moe_layer=moe_layer).values())


def layer_saved_parts(model: ModelConfig, train: TrainConfig, mesh: Mesh, *, remat: str,
                      moe_layer: bool = False) -> dict[str, float]:
    """layer_saved_per_token split into the attention block's ("attention"), the MLP's or experts' ("mlp") and the
    norms' and residual's ("rest")."""
    if remat != "none":
        names = remat_names(train, remat)
        sizes = named_per_token(model, train, mesh, moe_layer)
        attention = sum(sizes.get(n, 0.0) for n in names[0] if n in ATTENTION_NAMES)
        return {"attention": attention, "mlp": sum(sizes.get(n, 0.0) for n in names[0] if n not in ATTENTION_NAMES),
                "rest": 0.0}
    c = DTYPE_BYTES[train.compute_dtype]
    Dh = model.head_dim
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    moe = moe_shape(model) if moe_layer else None
    if moe is None:
        mlp = c * (GATED_MLP_SAVED_F if gated(model) else PLAIN_MLP_SAVED_F) * a.F
    else:
        mlp = moe_saved_per_token(model, moe, train, mesh)
    # the residual stream and its float32 norm values are split over tensor (MaxText's activation_embed rule)
    norms = (4 if model.post_norms else 2) * norm_saved_bytes(model, c) * a.D
    residual = c * a.D  # the sum after attention, input of the MLP block
    if is_mla(model):
        Dq, Dv = head_dims(model)
        projections = mla_saved_per_token(model, c, a.H)
    else:
        Dq = Dv = Dh
        qkv = c * (a.H + 2 * a.K) * Dh
        qk_norm = (NORM_SAVED_BYTES + c) * (a.H + a.K) * Dh if model.qk_norm else 0.0
        # q, k and v as the kernel takes them (RoPE is linear: its backward needs no input) and the context
        projections = qkv + qk_norm + c * a.H * Dh
    if attention_kernel(train) == "flash":  # the kernel's residuals: its output in its own layout, the log-sum-exp
        scores = c * a.H * Dv + FLASH_LSE_BYTES * a.H
    else:  # each local query attends over all L keys (the full matrix, masked), and the scaled q
        product, logits = score_bytes(train)
        saved = SCORE_SAVED * logits + (c if logits > c else 0)
        scores = a.H * train.seq_len * (saved + (SOFTCAP_SAVED * product if _softcapped(model) else 0))
        scores += 0.0 if is_mla(model) else c * a.H * Dq  # (latent attention's is among its projections)
    return {"attention": projections + scores, "mlp": mlp, "rest": norms + residual}


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


def norm_saved_bytes(model: ModelConfig, c: int) -> int:
    """What the backward reads of one element of a residual-width norm: RMSNorm's float32 input and its normalized
    value in the compute dtype (MaxText's form), LayerNorm's two float32 values."""
    return RMS_NORM_SAVED_FLOAT32_BYTES + c if str(model.norm) == "rmsnorm" else NORM_SAVED_BYTES


def mla_saved_per_token(model: ModelConfig, c: int, H: float) -> float:
    """Latent attention's tensors per token (models/layers/mla.py), H the local heads: the q latent and its float32
    norm, the kv latent with the shared RoPE key and the latent's norm, then per head q, its rotated RoPE part, the
    up-projected keys' and values' product, the assembled keys, the scaled q and the context."""
    R, C, Dn, Dr, Dv = (model.q_lora_rank, model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim,
                        model.v_head_dim)
    Dq = Dn + Dr
    latents = c * R + (NORM_SAVED_BYTES + c) * R + c * (C + Dr) + (NORM_SAVED_BYTES + c) * C + c * Dr
    heads = c * H * (Dq + Dr + (Dn + Dv) + Dq + Dq + Dv)
    return latents + heads


def moe_saved_per_token(model: ModelConfig, moe: MoeShape, train: TrainConfig, mesh: Mesh) -> float:
    """A MoE block's tensors per local token without remat (see ROUTER_FLOAT32_PER_EXPERT's note)."""
    c = DTYPE_BYTES[train.compute_dtype]
    D = model.d_model
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    rows = routed_rows_held(moe, train, mesh)
    mlp_f = GATED_MLP_SAVED_F if gated(model) else PLAIN_MLP_SAVED_F
    router = 4 * ROUTER_FLOAT32_PER_EXPERT * moe.E + 4 * moe.k
    experts = c * D * rows + c * mlp_f * rows * a.Fe  # the experts' input rows and MLP internals
    if dispatch(train) == "sparse":  # the combine reads each token's top-k expert outputs
        outputs = c * D * moe.k
    else:  # the combine reads the experts' output slots, and the dispatch and combine masks [L, E, C] per sequence
        outputs = c * D * rows + 2 * c * rows
    shared = c * mlp_f * moe.S * a.Fe
    return router + experts + outputs + shared


def layer_offloaded_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, moe_layer: bool = False) -> float:
    """Bytes one layer offloads to pinned host memory per local token under the step's remat policy."""
    names = remat_names(train)
    if names is None:
        return 0.0
    sizes = named_per_token(model, train, mesh, moe_layer)
    return sum(sizes.get(n, 0.0) for n in names[1])


def over_layers(model: ModelConfig, per_layer) -> float:
    """The sum of `per_layer(moe_layer)` over the decoder layers: dense layers' and MoE layers'."""
    moe = moe_shape(model)
    n_moe = moe.moe_layers if moe else 0
    dense = model.num_layers - n_moe
    return (dense * per_layer(False) if dense else 0.0) + (n_moe * per_layer(True) if n_moe else 0.0)


def score_bytes(train: TrainConfig) -> tuple[int, int]:
    """Bytes per score of the dot product's q k^T (float32 with float32_qk_product) and of the softmax's logits
    (float32 with either switch), else the compute dtype: MaxText's apply_attention_dot."""
    c = DTYPE_BYTES[train.compute_dtype]
    product = 4 if getattr(train, "float32_qk_product", False) else c
    return product, 4 if getattr(train, "float32_logits", False) else product


def _softcapped(model: ModelConfig) -> bool:
    return getattr(model, "attn_logit_softcap", None) is not None


def estimate_memory(model: ModelConfig, train: TrainConfig, mesh: Mesh, hbm_bytes: float,
                    platform: str = "tpu") -> MemoryBreakdown:
    """`platform` ("tpu", "gpu", "cpu"): whose compiler's buffer choices to follow where they differ (GPU: the loss's
    float32 logits, the optimizer's gradient copy); CPU follows the TPU's."""
    c = DTYPE_BYTES[train.compute_dtype]
    p = DTYPE_BYTES[train.param_dtype]
    remat = str(train.remat_policy)
    D, N = model.d_model, model.num_layers
    micro = train.grad_accum_steps
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    T = a.T  # tokens of one microbatch on this device: B (MaxText's per_device_batch_size) x L

    local_params = params_per_device(model, mesh)
    params = local_params * p
    optimizer = OPTIMIZER_STATES_PER_PARAM * local_params * p
    local_grads = local_params + expert_gradient_excess(model, train, mesh)
    gradients = local_grads * p
    # models/train_step.py accumulates microbatch gradients in float32 whatever the param dtype
    accumulator = local_grads * GRAD_ACCUMULATOR_BYTES if micro > 1 else 0.0
    state_per_param = p * (2 + OPTIMIZER_STATES_PER_PARAM) + (GRAD_ACCUMULATOR_BYTES if micro > 1 else 0)
    if not STATE_DONATED:
        params, optimizer = 2 * params, 2 * optimizer
    # state in pinned host memory between steps: the parameters come to HBM for the whole step (the forward and
    # backward read them), the optimizer state streams in for the update, only part of it in HBM at a time
    host_state = 0.0
    optimizer_staged = 0.0
    if getattr(train, "parameter_memory_host_offload", False):
        host_state += params
    if getattr(train, "optimizer_memory_host_offload", False):
        host_state += optimizer
        optimizer_staged = OFFLOADED_OPTIMIZER_STAGED * optimizer
        optimizer = 0.0

    # scanned or not, the backward reads every layer's input: N x T x D (Korthikanti's 2sbh per layer for "full")
    carry = N * T * a.D * c
    parts = {k: T * over_layers(model, lambda m: layer_saved_parts(model, train, mesh, remat=remat, moe_layer=m)[k])
             for k in ("attention", "mlp", "rest")}
    saved = T * over_layers(model, lambda m: layer_saved_per_token(model, train, mesh, remat=remat, moe_layer=m))
    # multi-token prediction: each module's decoder layer keeps what a decoder layer of its kind keeps (its input and
    # the policy's tensors), and its projection what its backward reads (MTP_SAVED_D, MTP_SAVED_NORMS)
    depths = mtp_depths(model)
    mtp_saved = depths * T * ((1 + MTP_SAVED_D) * c * a.D + MTP_SAVED_NORMS * norm_saved_bytes(model, c) * a.D
                              + layer_saved_per_token(model, train, mesh, remat=remat,
                                                      moe_layer=moe_layers_of(model)[-1])) if depths else 0.0
    activations = carry + saved + mtp_saved
    saved_copy = (MINIMAL_SAVED_COPIES - 1) * saved if remat != "none" else 0.0
    offloaded = over_layers(model, lambda m: layer_offloaded_per_token(model, train, mesh, m))
    host_offload = T * offloaded
    tiles = vocab_tiles(train)
    heads = 1 + MTP_LOGITS_PER_DEPTH * depths  # the decoder's logits, and those of each MTP depth
    if tiles == 1:
        logits = heads * T * a.V * (GPU_LOGIT_BYTES if platform == "gpu" else c + 4 * LOGITS_FLOAT32_BUFFERS)
    else:  # one chunk's logits at a time, and the vocabulary table's gradient summed over the chunks
        name = "embedding" if model.tie_embeddings else "unembedding"
        table = next(x for x in param_arrays(model) if x.name == name)
        logits = (heads * T / tiles * a.V * (c + 4 * TILED_LOGITS_FLOAT32_BUFFERS)
                  + p * local_size(table.shape, table.logical, mesh.axes))

    arrays = param_arrays(model)
    # weights the model gathers itself (a MoE layer's experts) are whole; the rest stream through windowed einsums
    # where their shards are thick enough, else are gathered whole too
    windowed = D / split((D,), ("embed",), mesh.axes)[0] >= WINDOWED_MIN_ROWS
    layer_full = layer_weights(arrays, lambda x: held_gathered(x, mesh) if x.expert_parallel or not windowed
                               else 0.0)
    shard = max((held(x, mesh) for x in arrays if x.matmul and x.block and not x.expert_parallel),
                default=0.0) if windowed else 0.0
    hoisted = HOISTED_EXPERT_COPIES * c * sum(x.count * held(x, mesh) for x in state_arrays(model)
                                              if x.expert_parallel)
    gathered = (GATHERED_LAYERS * layer_full * c + WINDOWED_SHARDS * shard * c
                + (hoisted if c < p and platform != "gpu" else 0.0))
    grads_unsharded = WINDOWED_SHARDS * shard * c
    table = next(x for x in arrays if x.name == ("embedding" if model.tie_embeddings else "unembedding"))
    vocab_table = gathered_size(table.shape, table.logical, mesh) * c  # gathered for the logits
    # the gradient of the scores, in the logits' dtype: the dot product's only (flash keeps its tiles on chip)
    score_grads = 0.0 if attention_kernel(train) == "flash" else score_bytes(train)[1] * a.H * train.seq_len
    F_local = max(a.F, a.Fe * (routed_rows_held(moe_shape(model), train, mesh) + moe_shape(model).S)
                  if moe_shape(model) else 0.0)
    # the backward of a layer runs its MLP's part, then its attention's; what a rematerialized layer recomputes of
    # its attention (q, k, v and the kernel's residuals, or the scores) is live through both, the MLP's recomputed
    # gate and up through the MLP's part only; the larger part counts
    names = remat_names(train, remat)
    recomputed_mlp = (RECOMPUTED_MLP_F * F_local if names is not None
                      and not ({"mlpwi", "mlpwi_0", "mlpwi_1"} & (names[0] | names[1])) else 0.0)
    Dq, Dv = head_dims(model) if is_mla(model) else (model.head_dim, model.head_dim)
    qkv = c * ((a.H + a.K) * Dq + a.K * Dv)  # q, k and v, or their gradients
    recomputed = (recomputed_attention_per_token(model, train, mesh, remat) + qkv) if names is not None else 0.0
    mlp_phase = c * (BACKWARD_F_BUFFERS * F_local + recomputed_mlp + BACKWARD_MLP_D_BUFFERS * D) + recomputed
    # a MoE layer's part: its routed rows, each D wide and Fe wide, as the exchange overlaps the experts' work, and
    # as XLA serializes it where that would not fit (MOE_ROW_D_BUFFERS_SERIAL); on GPU, the dense expansions of its
    # grouped matmuls over the local experts (RAGGED_EXPANDED_*)
    moe_phases = {}
    gpu_ragged = platform == "gpu" and dispatch(train) == "sparse"  # ragged_dot as XLA:GPU expands it
    if (moe := moe_shape(model)) is not None:
        rows = routed_rows_held(moe, train, mesh)
        shared = moe.S * a.Fe * (BACKWARD_F_BUFFERS + (RECOMPUTED_MLP_F if recomputed_mlp else 0))
        expanded = (rows * moe.E / mesh.axes.get("expert", 1)
                    * (RAGGED_EXPANDED_D_BUFFERS * D + RAGGED_EXPANDED_F_BUFFERS * a.Fe) if gpu_ragged else 0.0)
        moe_phases = {n: max(mlp_phase, c * (rows * (n * D + MOE_ROW_F_BUFFERS * a.Fe) + expanded + shared
                                             + BACKWARD_MLP_D_BUFFERS * D) + recomputed)
                      for n in (MOE_ROW_D_BUFFERS, MOE_ROW_D_BUFFERS_SERIAL)}
        mlp_phase = moe_phases[MOE_ROW_D_BUFFERS]
    attention_phase = (BACKWARD_SCORE_GRADIENTS * score_grads + c * BACKWARD_D_BUFFERS * D + qkv + recomputed
                       + BACKWARD_D_FLOAT32 * 4 * D)
    experts = [x for x in arrays if x.expert_parallel]
    matrix = c * max((held_gathered(x, mesh) for x in experts), default=0.0)
    # the routed experts' D rows per FSDP shard (THIN_EXPERT_GATHER_IN_FLIGHT)
    expert_rows = min((n / k for x in experts for n, name, k in zip(x.shape, x.logical, split(x.shape, x.logical, mesh.axes))
                       if name == "embed"), default=float(D))
    thin = expert_rows < WINDOWED_MIN_ROWS
    expert_grads = 0.0 if thin else EXPERT_GRAD_MATRICES * matrix
    in_flight = THIN_EXPERT_GATHER_IN_FLIGHT * matrix if thin else 0.0
    staged = OFFLOAD_STAGED_LAYERS * T * max(layer_offloaded_per_token(model, train, mesh, m)
                                             for m in layer_kinds(model))
    batch_split = split((micro_batch(train.per_device_batch_size, mesh.devices),), ("activation_batch",), mesh.axes)[0]
    late_table_gradient = (LATE_TABLE_GRADIENT_INPUTS * T * (D + a.V) * c
                           if platform != "gpu" and tiles == 1 and a.V < model.vocab_size and batch_split > 1 else 0.0)
    # XLA:GPU's second layout of the scanned experts' gradients while they are FSDP-sharded (GPU_EXPERT_GRADIENT_COPIES)
    expert_grad_copy = (GPU_EXPERT_GRADIENT_COPIES * p * sum(
        x.count * held(x, mesh) for x in state_arrays(model)
        if x.expert_parallel and held_gathered(x, mesh) > held(x, mesh)) if gpu_ragged else 0.0)
    # with MTP heads, the vocabulary table's gradient of each head (the decoder's and every depth's), whole
    table_grads = (MTP_TABLE_GRADIENTS_PER_HEAD * (1 + depths) * gathered_size(table.shape, table.logical, mesh) * c
                   if depths else 0.0)

    def breakdown(mlp_phase: float) -> MemoryBreakdown:
        working = max(T * mlp_phase, T * attention_phase, expert_grads)
        return MemoryBreakdown(
            params=params, optimizer=optimizer, gradients=gradients, grad_accumulator=accumulator,
            activations=activations, saved_copy=saved_copy, logits=logits + vocab_table,
            temporaries=(gathered + in_flight + grads_unsharded + working + staged + table_grads + late_table_gradient
                         + expert_grad_copy),
            optimizer_temporaries=(GPU_OPTIMIZER_GRADIENT_COPIES if platform == "gpu" else OPTIMIZER_GRADIENT_COPIES)
            * gradients, hbm_bytes=hbm_bytes, host_offload=host_offload,
            host_state=host_state, optimizer_staged=optimizer_staged,
            state_blocks=tuple((k, n * state_per_param) for k, n in params_per_block(model, mesh).items()),
            activation_blocks=(("experts", parts["mlp"] if moe_shape(model) else 0.0),
                               ("attention", parts["attention"]),
                               ("rest", carry + parts["rest"] + (0.0 if moe_shape(model) else parts["mlp"])
                                + mtp_saved)),
        )

    overlapped = breakdown(mlp_phase)
    if platform != "tpu" or not moe_phases or overlapped.fits or dispatch(train) != "sparse":
        return overlapped
    return breakdown(moe_phases[MOE_ROW_D_BUFFERS_SERIAL])


def layer_kinds(model: ModelConfig) -> tuple[bool, ...]:
    """The kinds of decoder layer the model has, as `moe_layer` flags: (False,), (True,) or both."""
    moe = moe_shape(model)
    if moe is None:
        return (False,)
    return tuple(kind for kind, n in ((False, moe.dense_layers), (True, moe.moe_layers)) if n)


def vocab_tiles(train: TrainConfig) -> int:
    """MaxText's num_vocab_tiling: the chunks the loss's tokens are cut into (1: the whole [B, L, V] logits)."""
    return int(getattr(train, "num_vocab_tiling", 1) or 1)


# The analytical total's measured error against XLA's memory_analysis, per platform kind (bench/memory_accuracy.py
# --error-json writes it; the file ships inside the package).
MEASURED_ERROR_FILE = "memory_error.json"


@dataclass(frozen=True)
class MeasuredError:
    """How far estimate_memory's per-device total fell from the compiler's over a benchmark grid: absolute relative
    errors (median, worst) and the 90th percentile of the signed underestimate ((compiler - analytical) / compiler:
    negative where nine in ten cases over-estimate), over `cases` compiles made by `command` on `date`. A safety
    margin: worst_underestimate is the largest compiler / analytical - 1 of them, the margin under which every
    measured case's compiler figure stays within analytical x (1 + margin)."""

    platform: str
    median: float
    worst: float
    p90_underestimate: float
    worst_underestimate: float
    cases: int
    command: str
    date: str


def measured_error(platform: str) -> MeasuredError | None:
    """The measured error of the analytical memory on a platform kind ("tpu", "gpu", "cpu"); None where it has not
    been measured."""
    text = resources.files("maxperf.perfmodel").joinpath(MEASURED_ERROR_FILE).read_text()
    entry = json.loads(text).get(platform)
    if entry is None:
        return None
    return MeasuredError(platform=platform, median=float(entry["median"]), worst=float(entry["worst"]),
                         p90_underestimate=float(entry["p90_underestimate"]),
                         worst_underestimate=float(entry["worst_underestimate"]), cases=int(entry["cases"]),
                         command=str(entry["command"]), date=str(entry["date"]))
