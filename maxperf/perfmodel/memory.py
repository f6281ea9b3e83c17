"""Memory per device: the state (parameters, AdamW's moments, gradients), the saved activations (perfmodel.saved), the
logits, the backward's working set (perfmodel.working) and the optimizer's, phase by phase; what lives in pinned host
memory instead. Every assumption is a named constant, checked against XLA's memory_analysis where the note says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxperf.perfmodel import pipeline
from maxperf.perfmodel.flops import moe_layers_of, mtp_depths
from maxperf.perfmodel.moe import dispatch, moe_shape
from maxperf.perfmodel.saved import (
    MTP_LOGITS_PER_DEPTH,
    MTP_SAVED_D,
    MTP_SAVED_NORMS,
    layer_saved_parts,
    layer_saved_per_token,
    norm_saved_bytes,
    offloaded_per_token,
    over_layers,
)
from maxperf.perfmodel.sharding import activation_split, gathered_size, held, zero1_params_per_device
from maxperf.perfmodel.working import working
from maxperf.spec.fp8 import recipe as fp8_recipe
from maxperf.spec.logical_axes import local_size, split
from maxperf.spec.memo import model_memo
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.params import ParamArray, logits_table, state_arrays
from maxperf.spec.params import params_per_device as held_params
from maxperf.spec.remat import remat_names
from maxperf.spec.train import DTYPE_BYTES, TrainConfig, gradient_bytes, optimizer_state_bytes

# Gradient accumulation sums microbatch gradients in a float32 buffer (models/train_step.py).
GRAD_ACCUMULATOR_BYTES = 4
# A pipeline loop's buffers (pipeline_buffers) live as the forward's value and the backward's gradient: 2 copies
# (counted from models/pipeline.py's carry, not yet measured).
PIPELINE_BUFFER_COPIES = 2
# ZeRO-1 under gradient accumulation: the float32 parameters gathered for the loop in bfloat16 (MaxText's
# gradient_accumulation_loss_and_grad), so the microbatches' gradients and their sum are bfloat16 too.
ZERO1_LOOP_BYTES = 2


def zero1_loop_bytes(train: TrainConfig) -> int | None:
    """ZeRO-1's element size for the parameters, gradients and accumulator of an accumulation loop (ZERO1_LOOP_BYTES,
    where the parameters are wider); None without accumulation."""
    p = DTYPE_BYTES[train.param_dtype]
    return ZERO1_LOOP_BYTES if train.grad_accum_steps > 1 and p > ZERO1_LOOP_BYTES else None


def zero1_gathered_bytes(train: TrainConfig, platform: str) -> int:
    """The element size in which ZeRO-1 gathers the parameters back over `data`: the loop's under accumulation;
    with one microbatch XLA:TPU casts the float32 parameters to the compute dtype before their gather (llama2-7b on
    v5p-32, data 4 x fsdp 4, B 2, remat full: bf16[1024,32,11008] gathered from the float32 state, 11.42 GiB per
    device compiled, 11.33 analytical), XLA:GPU gathers them as they are (llama3-8b on b200-8, data 8, B 2:
    f32[4096,32,14336])."""
    c, p = DTYPE_BYTES[train.compute_dtype], DTYPE_BYTES[train.param_dtype]
    return zero1_loop_bytes(train) or (min(c, p) if platform == "tpu" else p)
# The train step donates the state, so the updated params and optimizer state reuse the input buffers.
STATE_DONATED = True
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
# logits_dot_in_fp32=true: the logits' matmul writes float32 logits, a buffer beside the compute-dtype ones that XLA
# keeps live at the loss. Measured here: llama3-8b, 2 layers, B=4, L=2048 on v5p-8 compiles to 3.94 GiB more
# temporaries (7.51 against 3.57 GiB), 4 bytes per logit. On GPUs the float32 logits are already what is live
# (GPU_LOGIT_BYTES), assumed unchanged.
FP32_LOGITS_BUFFERS = 1
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
# optimizer_memory_host_offload: the fraction of the offloaded optimizer state in HBM at the step's peak (XLA brings
# it in leaf by leaf for the update). Measured here with libtpu 0.0.50.1 (not yet with 0.0.52): llama2-7b on
# v5p-128, B=4, L=2048, attention=flash, remat full: optimizer_memory_host_offload compiles to 8.26e9 bytes per
# device against 8.74e9 without (0.84e9 of optimizer state in host memory, 0.43 of it back in HBM at the peak); the
# parameters offloaded too, the same 8.26e9
OFFLOADED_OPTIMIZER_STAGED = 0.43


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
    fp8_state: float = 0.0  # a delayed FP8 recipe's scales and amax histories (fp8_state_bytes), on every device
    # ZeRO-1 (shard_optimizer_over_data): the parameters gathered back over `data` for the forward and backward
    gathered_params: float = 0.0
    # a TPU step whose overlapped schedule does not fit, so that the compiler serializes it (a mixture of experts'
    # dispatch; a dense model's weights gathered whole, a matrix at a time): what the overlapped schedule would need
    # (0: the breakdown is the overlapped schedule's)
    overlapped_bytes: float = 0.0
    # what the peak would grow by where libtpu takes the vocabulary table's gradient after the backward scan, which
    # perfmodel counts before it (working.late_logits_gradient); 0 where the placement is counted or cannot differ
    late_risk_bytes: float = 0.0
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
            "loss": self.gradients + self.gathered_params + self.activations + self.saved_copy + self.logits,
            "backward": self.gradients + self.gathered_params + self.activations + self.temporaries,
            "optimizer": self.gradients + self.optimizer_temporaries,
        }

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.get)

    @property
    def per_device_total_bytes(self) -> float:
        return (self.params + self.optimizer + self.grad_accumulator + self.optimizer_staged + self.fp8_state
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

    @property
    def late_total_bytes(self) -> float:
        """The per-device total where the logits' gradient is held from the loss through the backward
        (late_risk_bytes): the loss and backward phases hold it, the optimizer's does not."""
        phases = self.phases()
        risk = self.late_risk_bytes
        return (self.per_device_total_bytes - max(phases.values())
                + max(phases["loss"] + risk, phases["backward"] + risk, phases["optimizer"]))

    @property
    def may_not_fit(self) -> bool:
        """Fits as counted, but not with the logits' gradient held through the backward (late_risk_bytes)."""
        return self.fits and self.late_risk_bytes > 0 and self.late_total_bytes > self.hbm_bytes

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
            "optimizer_staged": self.optimizer_staged, "host_bytes": self.host_bytes, "fp8_state": self.fp8_state,
            "gathered_params": self.gathered_params, "overlapped_bytes": self.overlapped_bytes,
            "late_risk_bytes": self.late_risk_bytes, "late_total_bytes": self.late_total_bytes,
            "may_not_fit": self.may_not_fit,
            "state_blocks": dict(self.state_blocks), "activation_blocks": dict(self.activation_blocks),
        }

# A delayed FP8 recipe's state (models/layers/fp8.py): per quantized matmul, x's, W's and dy's scale and amax history,
# float32, replicated (train_step.fp8_state).
FP8_STATE_BYTES = 4


def fp8_state_bytes(model: ModelConfig, train: TrainConfig) -> float:
    """Bytes of a delayed FP8 recipe's scales and amax histories on each device: one row of 1 + history floats for
    each of x, W and dy of every quantized matmul, the layers' projections (and their MTP modules') and a capacity
    dispatch's two einsums per MoE layer; 0 for the recipes that keep none."""
    recipe = fp8_recipe(str(train.quantization))
    if recipe is None or not recipe.state_scales:
        return 0.0
    sites = sum(x.count for x in state_arrays(model) if x.matmul and x.block in ("attention", "mlp", "moe"))
    sites += 2 * (sum(model.moe_layers()) + model.mtp_num_layers * model.moe_layers()[-1])
    return sites * recipe.state_scales * (1 + recipe.history) * FP8_STATE_BYTES


def params_per_device(model: ModelConfig, mesh: Mesh, train: TrainConfig | None = None) -> float:
    """Parameters held by one device after sharding (the optimizer and gradients are sharded alike); with `train`,
    a pipelined stack's empty places besides (pipeline.empty_place_params)."""
    held = held_params(model, mesh.sizes)
    return held if train is None else held + pipeline.empty_place_params(model, train, mesh)

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

@dataclass(frozen=True)
class _State:
    """The state's bytes on a device (estimate_memory's parts of that name), and what each parameter costs."""

    params: float
    optimizer: float
    gradients: float
    accumulator: float
    gathered: float  # ZeRO-1's parameters gathered back over `data`
    update_gradients: float  # the gradients the optimizer's update reads
    state_per_param: float
    host_state: float
    optimizer_staged: float


def _state(model: ModelConfig, train: TrainConfig, mesh: Mesh, platform: str) -> _State:
    p = DTYPE_BYTES[train.param_dtype]
    micro = train.grad_accum_steps
    local_params = params_per_device(model, mesh, train)
    params = local_params * p
    optimizer = optimizer_state_bytes(train) * local_params
    local_grads = local_params + expert_gradient_excess(model, train, mesh)
    gradients = local_grads * gradient_bytes(train)
    # models/train_step.py accumulates microbatch gradients in float32 whatever the param dtype
    accumulator = local_grads * GRAD_ACCUMULATOR_BYTES if micro > 1 else 0.0
    state_per_param = (p + gradient_bytes(train) + optimizer_state_bytes(train)
                       + (GRAD_ACCUMULATOR_BYTES if micro > 1 else 0))
    gathered = 0.0
    update_gradients = gradients  # the gradients the optimizer's update reads
    if train.shard_optimizer_over_data and mesh.axes.get("data", 1) > 1:
        # ZeRO-1: the state's parameters and moments split over `data` too; the step gathers the parameters back
        # (bfloat16 under accumulation, whose gradients and accumulator are then bfloat16 too: models/train_step.py)
        kept = local_params * zero1_params_per_device(model, mesh) / held_params(model, mesh.sizes)
        loop_bytes = zero1_loop_bytes(train)
        params, optimizer = kept * p, optimizer_state_bytes(train) * kept
        gathered = local_params * zero1_gathered_bytes(train, platform)
        # with one microbatch the gradients are reduce-scattered layer by layer as the backward makes them (the step
        # constrains them to the state's split), so only the split ones live; with accumulation the microbatch's
        # and the accumulator's keep the model's split (MaxText's carry), bfloat16
        gradients = local_grads * loop_bytes if loop_bytes else kept * gradient_bytes(train)
        accumulator = local_grads * loop_bytes if loop_bytes else accumulator
        update_gradients = kept * (loop_bytes or gradient_bytes(train))  # reduce-scattered to the state's split
        state_per_param = (params + optimizer + gradients + accumulator + gathered) / local_params
    if not STATE_DONATED:
        params, optimizer = 2 * params, 2 * optimizer
    # state in pinned host memory between steps: the parameters come to HBM for the whole step (the forward and
    # backward read them), the optimizer state streams in for the update, only part of it in HBM at a time
    host_state = 0.0
    optimizer_staged = 0.0
    if train.parameter_memory_host_offload:
        host_state += params
    if train.optimizer_memory_host_offload:
        host_state += optimizer
        optimizer_staged = OFFLOADED_OPTIMIZER_STAGED * optimizer
        optimizer = 0.0
    return _State(params, optimizer, gradients, accumulator, gathered, update_gradients, state_per_param,
                  host_state, optimizer_staged)


def state_floor_bytes(model: ModelConfig, train: TrainConfig, mesh: Mesh, platform: str = "tpu") -> float:
    """What estimate_memory counts in every phase whatever the batch, accumulation, remat policy and attention
    kernel: the parameters and the optimizer state on the device (its staged part where offloaded). A layout where
    they alone exceed HBM fits at no batch."""
    s = _state(model, train, mesh, platform)
    return s.params + s.optimizer + s.optimizer_staged


def estimate_memory(model: ModelConfig, train: TrainConfig, mesh: Mesh, hbm_bytes: float,
                    platform: str = "tpu", chip: str = "") -> MemoryBreakdown:
    """`platform` ("tpu", "gpu", "cpu"): whose compiler's buffer choices to follow where they differ (GPU: the loss's
    float32 logits, the optimizer's gradient copy, the grouped matmuls' expansion); CPU follows the TPU's. `chip`: the
    chip's name, where one generation's compiler schedules apart (working.LATE_TABLE_GRADIENT_CHIPS)."""
    c = DTYPE_BYTES[train.compute_dtype]
    remat = str(train.remat_policy)
    N = model.num_layers
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    T = a.T  # tokens of one microbatch on this device: B (MaxText's per_device_batch_size) x L
    state = _state(model, train, mesh, platform)

    # scanned or not, the backward reads every layer's input: N x T x D (Korthikanti's 2sbh per layer for "full"),
    # in device memory unless the policy offloads it (MaxText's decoder_layer_input=offload; then it is among the
    # offloaded tensors, layer_offloaded_per_token). A pipeline's device keeps them for each layer call of its loop
    # (perfmodel.pipeline: iterations x the stage's layers, each on a pipeline microbatch's tokens), and its loop's
    # buffers besides (pipeline_buffers)
    view = pipeline.view(model, train, mesh)
    # (of those iterations, the ones whose activations are held at once: all under MaxText's schedule, the microbatches
    # in flight under 1F1B, View.held_scale)
    Tl = T * view.layer_scale * view.token_scale * view.held_scale  # tokens x layers the saved tensors count, over N
    names = remat_names(train)
    carry = 0.0 if names is not None and "decoder_layer_input" in names[1] else N * Tl * a.D * c
    carry += pipeline_buffers(view, T, a.D, c)
    per_kind: dict[bool, dict[str, float]] = {}  # a dense and a MoE layer's parts, each worked out once

    def kept(moe_layer: bool) -> dict[str, float]:
        if moe_layer not in per_kind:
            per_kind[moe_layer] = layer_saved_parts(model, train, mesh, remat=remat, moe_layer=moe_layer)
        return per_kind[moe_layer]

    parts = {k: Tl * over_layers(model, lambda m: kept(m)[k]) for k in ("attention", "mlp", "rest")}
    saved = Tl * over_layers(model, lambda m: sum(kept(m).values()))  # layer_saved_per_token
    # multi-token prediction: each module's decoder layer keeps what a decoder layer of its kind keeps (its input and
    # the policy's tensors), and its projection what its backward reads (MTP_SAVED_D, MTP_SAVED_NORMS)
    depths = mtp_depths(model)
    mtp_saved = depths * T * ((1 + MTP_SAVED_D) * c * a.D + MTP_SAVED_NORMS * norm_saved_bytes(model, c) * a.D
                              + layer_saved_per_token(model, train, mesh, remat=remat,
                                                      moe_layer=moe_layers_of(model)[-1])) if depths else 0.0
    activations = carry + saved + mtp_saved
    saved_copy = (MINIMAL_SAVED_COPIES - 1) * saved if remat != "none" else 0.0
    host_offload = Tl * offloaded_per_token(model, train, mesh)
    logits = _logits(model, train, mesh, platform, depths, view.logits_scale)
    work = working(model, train, mesh, platform, chip, view)
    moe = moe_shape(model)

    def breakdown(temporaries: float, overlapped_bytes: float = 0.0) -> MemoryBreakdown:
        return MemoryBreakdown(
            params=state.params, optimizer=state.optimizer, gradients=state.gradients,
            grad_accumulator=state.accumulator,
            activations=activations, saved_copy=saved_copy, logits=logits, temporaries=temporaries,
            optimizer_temporaries=(GPU_OPTIMIZER_GRADIENT_COPIES if platform == "gpu" else OPTIMIZER_GRADIENT_COPIES)
            * state.update_gradients, hbm_bytes=hbm_bytes, host_offload=host_offload,
            host_state=state.host_state, optimizer_staged=state.optimizer_staged,
            fp8_state=fp8_state_bytes(model, train), gathered_params=state.gathered,
            state_blocks=tuple((k, n * state.state_per_param) for k, n in params_per_block(model, mesh).items()),
            activation_blocks=(("experts", parts["mlp"] if moe else 0.0),
                               ("attention", parts["attention"]),
                               ("rest", carry + parts["rest"] + (0.0 if moe else parts["mlp"]) + mtp_saved)),
            overlapped_bytes=overlapped_bytes, late_risk_bytes=work.late_risk,
        )

    overlapped = breakdown(work.overlapped)
    if (platform != "tpu" or overlapped.fits or work.serial >= work.overlapped
            or moe is not None and dispatch(train) != "sparse"):
        return overlapped
    return breakdown(work.serial, overlapped.per_device_total_bytes)


def pipeline_buffers(view: pipeline.View, T: float, D: float, c: int) -> float:
    """A pipeline loop's own buffers on a device (models/pipeline.py), each with its gradient in the backward:
    state_io (the stage's share of the microbatches, T / S tokens), the stage-to-stage shift (one pipeline
    microbatch), and with circular storage the parked outputs (every microbatch: T tokens); with the forwarding
    delay, each iteration's held-back output."""
    if not view.pipelined:
        return 0.0
    s = view.schedule
    tokens = T / s.stages + T / s.microbatches + (T if s.circular_storage else 0.0)
    # with the forwarding delay each iteration keeps the output it holds back besides its input (measured: llama2-7b
    # at 8 layers on v5p-16, 2 stages, 4 microbatches, B 4: 6.23 GiB compiled against 5.66 without it)
    delayed = s.iterations * T / s.microbatches if s.delay == 2 else 0.0
    return (PIPELINE_BUFFER_COPIES * tokens + delayed) * D * c


def _logits(model: ModelConfig, train: TrainConfig, mesh: Mesh, platform: str, depths: int,
            share: float = 1.0) -> float:
    """The loss's logits (the decoder's and each MTP depth's) and the vocabulary table gathered for them; with
    vocabulary tiling one chunk's logits and the table's gradient summed over the chunks. `share`: the part of the
    device's tokens whose logits it computes (1 / stages in a pipeline, whose logits split the batch over stages)."""
    c = DTYPE_BYTES[train.compute_dtype]
    p = DTYPE_BYTES[train.param_dtype]
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    T = a.B * share * a.L  # the tokens whose logits this device computes
    tiles = train.num_vocab_tiling
    heads = 1 + MTP_LOGITS_PER_DEPTH * depths  # the decoder's logits, and those of each MTP depth
    table = logits_table(model)
    fp32 = FP32_LOGITS_BUFFERS if train.logits_dot_in_fp32 else 0
    if tiles == 1:
        logits = heads * T * a.V * (GPU_LOGIT_BYTES if platform == "gpu" else c + 4 * (LOGITS_FLOAT32_BUFFERS + fp32))
    else:  # one chunk's logits at a time, and the vocabulary table's gradient summed over the chunks
        logits = (heads * T / tiles * a.V * (c + 4 * (TILED_LOGITS_FLOAT32_BUFFERS + fp32))
                  + p * local_size(table.shape, table.logical, mesh.axes))
    return logits + gathered_size(table.shape, table.logical, mesh) * c  # the table gathered for the logits
