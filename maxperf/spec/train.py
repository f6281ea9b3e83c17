"""The training step's config: batch, sequence, precision, optimizer, remat, attention kernel and MoE dispatch, as
MaxText's keys name them (B per-device batch, L sequence, A gradient accumulation steps)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from maxperf.spec.attention_rule import SPLASH_BLOCKS
from maxperf.spec.errors import MaxperfError, require
from maxperf.spec.grouped_matmul import GMM_TILE_KEYS
from maxperf.spec.remat import RematLocation, RematPolicy

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# AdamW keeps two states per parameter, its first and second moments (optax.adamw's mu and nu)
OPTIMIZER_STATES_PER_PARAM = 2
OPTIMIZERS = ("adamw", "adam_pax")  # MaxText's opt_type values compiled (as AdamW: the same state and update cost)
SPLASH_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")  # splash's QKVLayout names
DECODE_CACHE_READS = ("per_kv_head", "per_query_head")  # TrainConfig.decode_cache_reads


class AttentionKernel(enum.StrEnum):
    """How attention is computed (MaxText's `attention`; its `autoselected` is accepted for `auto`)."""

    AUTO = "auto"  # flash on TPU and GPU, as MaxText picks; the blockwise flash on CPU
    DOT_PRODUCT = "dot_product"  # the materialized [L, L] scores and softmax
    FLASH = "flash"  # TPU: Pallas splash attention; GPU: Pallas (Triton) flash attention; CPU: blockwise
    # MaxText's GPU kernels of cuDNN's fused flash attention, through Transformer Engine (cudnn_flash_te, its GPU
    # configs' choice) or jax's binding (cudnn_flash_jax): maxperf compiles them as its GPU flash kernel (Pallas
    # Triton; cuDNN's graphs are built by a cuDNN library and GPU the compiling machine lacks) and perfmodel prices
    # them as flash; refused on TPU as MaxText's are
    CUDNN_FLASH_TE = "cudnn_flash_te"
    CUDNN_FLASH_JAX = "cudnn_flash_jax"


class Quantization(enum.StrEnum):
    """MaxText's `quantization` of the decoder layers' matmuls (its "" is `none`; `bf16` is accepted for it). The FP8
    values are maxperf.spec.fp8's recipes; MaxText's others (nanoo_fp8, intmp, te_nvfp4, int8w, int4w, ...) are not
    implemented and refused. `auto`: `maxperf plan` chooses between bf16 and the chip's FP8 recipe; elsewhere bf16."""

    NONE = "none"
    INT8 = "int8"  # AQT config_v3: int8 forward and input gradient, the weight gradient per local_shard_count
    FP8 = "fp8"
    AQT_FP8 = "aqt_fp8"
    AQT_FP8_FULL = "aqt_fp8_full"
    FP8_FULL = "fp8_full"  # with use_qwix_quantization=true, as MaxText takes it
    FP8_GPU = "fp8_gpu"  # with use_qwix_quantization=true: Qwix's NVIDIA provider of flax's FP8 ops (`fp8`'s)
    TE_FP8_DELAYEDSCALING = "te_fp8_delayedscaling"
    TE_FP8_CURRENTSCALING = "te_fp8_currentscaling"
    TE_MXFP8 = "te_mxfp8"
    AUTO = "auto"


class PipelineSchedule(enum.StrEnum):
    """The order a pipeline runs its microbatches in (pipeline_schedule): MaxText's, the only one compiled, and
    Megatron-LM's, which NVIDIA's published pipelined runs use and which perfmodel prices."""

    GPIPE = "gpipe"  # MaxText's: every microbatch's forward through the loop, then the loop's backward
    ONE_F_ONE_B = "1f1b"  # Megatron-LM's one forward, one backward (interleaved with num_pipeline_repeats > 1)


@dataclass(frozen=True)
class TrainConfig:
    # B: one microbatch per device, as in MaxText: a microbatch of B x devices examples, a step of
    # gradient_accumulation_steps (A) of them; fractional as in MaxText (0.5: a microbatch of half the devices)
    per_device_batch_size: float = 1
    seq_len: int = 2048  # L
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    # AdamW's first moment's dtype (MaxText's mu_dtype); empty: the parameters' (param_dtype), as MaxText's default
    mu_dtype: str = ""
    # MaxText's key and default: float32 gradients are cast to this dtype before the update (bfloat16 halves them)
    grad_dtype: str = "float32"
    # MaxText's optimizer: adamw, or adam_pax (Pax's Adam: the same two states per parameter and the same update's
    # cost, compiled as AdamW); MaxText's sgd and muon are not compiled
    opt_type: str = "adamw"
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    decay_steps: int = 10_000  # cosine decay to min_lr_ratio * learning_rate after warm-up
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip_norm: float | None = 1.0
    grad_accum_steps: int = 1  # A: microbatches of B per device in each step (MaxText's gradient_accumulation_steps)
    remat_policy: RematPolicy = RematPolicy.FULL
    # remat_policy=custom: where each named tensor is kept (MaxText's keys and defaults)
    decoder_layer_input: RematLocation = RematLocation.DEVICE
    context: RematLocation = RematLocation.REMAT
    attention_out: RematLocation = RematLocation.REMAT
    mlpwi: RematLocation = RematLocation.REMAT
    mlpwi_0: RematLocation = RematLocation.REMAT
    mlpwi_1: RematLocation = RematLocation.REMAT
    mlpwo: RematLocation = RematLocation.REMAT
    query_proj: RematLocation = RematLocation.REMAT
    key_proj: RematLocation = RematLocation.REMAT
    value_proj: RematLocation = RematLocation.REMAT
    qkv_proj: RematLocation = RematLocation.REMAT
    out_proj: RematLocation = RematLocation.REMAT
    attention: AttentionKernel = AttentionKernel.AUTO
    # dot_product only (MaxText's switches, default off): the q k^T product, and the softmax, in float32
    float32_qk_product: bool = False
    float32_logits: bool = False
    # MaxText's logits_dot_in_fp32: the logits' matmul (the unembedding, or the tied embedding's) in float32, its
    # hidden states and table cast up; XLA's default precision then decides the passes (one bf16 pass on TPU, TF32
    # on NVIDIA GPUs)
    logits_dot_in_fp32: bool = False
    # splash attention's tiles (MaxText's keys and defaults)
    sa_block_q: int = 512
    sa_block_kv: int = 512
    sa_block_kv_compute: int = 512
    sa_block_q_dkv: int = 512
    sa_block_kv_dkv: int = 512
    sa_block_kv_dkv_compute: int = 512
    sa_block_q_dq: int = 512
    sa_block_kv_dq: int = 512
    # MaxText's key and default: splash's backward as two kernels (dq; dk and dv), each computing the scores and
    # their gradient again, or (true) as one
    sa_use_fused_bwd_kernel: bool = False
    # MaxText's keys: splash's q, k and v layouts in the kernel (HEAD_DIM_MINOR or SEQ_MINOR)
    sa_q_layout: str = "HEAD_DIM_MINOR"
    sa_k_layout: str = "HEAD_DIM_MINOR"
    sa_v_layout: str = "HEAD_DIM_MINOR"
    # MaxText's key: its vendored tokamax splash kernel, whose backward is always one kernel; maxperf compiles jax's
    # splash with the same tiles and layouts and the fused backward (sa_use_fused_bwd_kernel follows it)
    use_tokamax_splash: bool = False
    # MaxText's num_vocab_tiling: the loss over this many chunks of the tokens, each chunk's [B, L/n, V] logits
    # computed in the forward and again in the backward, so the whole [B, L, V] logits never exist
    num_vocab_tiling: int = 1
    # MaxText's keys: the optimizer state, and the parameters, live in pinned host memory between steps; the step
    # moves them to the device for the update (the parameters for the forward too) and back
    optimizer_memory_host_offload: bool = False
    parameter_memory_host_offload: bool = False
    # MaxText's key (ZeRO-1; Megatron's distributed optimizer): the optimizer state and the float32 parameters split
    # over the `data` axis as well (its first dimension that `data` divides and `tensor` does not split); the step
    # gathers the parameters back over `data` for the forward (in bfloat16, once before the loop, under gradient
    # accumulation, whose gradients are then bfloat16 too) and reduce-scatters the gradients to the update's split.
    # No effect where `data` has one device.
    shard_optimizer_over_data: bool = False
    scan_layers: bool = True
    # MaxText's key and default: the layer axis of scanned weights sits second ([D, N, ...]), not first
    param_scan_axis: int = 1
    seed: int = 0
    # mixture-of-experts dispatch (MaxText's keys): capacity_factor=-1 is dropless (MaxText's default); a positive
    # one gives each expert capacity_factor x its even share of each sequence's tokens, dropping those past it, in
    # the dense dispatch (sparse_matmul=false). sparse_matmul: dropless, tokens sorted by expert and multiplied group
    # by group; false: dense one-hot einsums. megablox (MaxText's default): on TPU the groups run in jax's Pallas
    # megablox grouped-matmul kernel with MaxText's tiles; false, and on GPU and CPU: jax.lax.ragged_dot.
    capacity_factor: float = -1.0
    sparse_matmul: bool = True
    megablox: bool = True
    # MaxText's keys and defaults: the grouped matmul's tiles, per weight and product (spec.grouped_matmul)
    wi_tile_fwd_batch_seq: int = 512
    wi_tile_fwd_embed_dim: int = 1024
    wi_tile_fwd_mlp_dim: int = 1024
    wi_tile_dlhs_batch_seq: int = 512
    wi_tile_dlhs_embed_dim: int = 1024
    wi_tile_dlhs_mlp_dim: int = 1024
    wi_tile_drhs_batch_seq: int = 512
    wi_tile_drhs_embed_dim: int = 1024
    wi_tile_drhs_mlp_dim: int = 1024
    wo_tile_fwd_batch_seq: int = 512
    wo_tile_fwd_embed_dim: int = 1024
    wo_tile_fwd_mlp_dim: int = 1024
    wo_tile_dlhs_batch_seq: int = 512
    wo_tile_dlhs_embed_dim: int = 1024
    wo_tile_dlhs_mlp_dim: int = 1024
    wo_tile_drhs_batch_seq: int = 512
    wo_tile_drhs_embed_dim: int = 1024
    wo_tile_drhs_mlp_dim: int = 1024
    load_balance_loss_weight: float = 0.01  # the router's auxiliary loss (Switch Transformer's form)
    # DeepSeek-V3's auxiliary-loss-free balancing (MaxText's key; 0: off): with routed_bias, after each step every MoE
    # layer's selection bias moves by this rate times sign(mean load - expert's load) over the step's tokens
    routed_bias_update_rate: float = 0.0
    # the multi-token-prediction loss (mtp_num_layers > 0), averaged over its depths, enters the loss times this
    mtp_loss_scaling_factor: float = 0.1
    # perfmodel only: the busiest expert-parallel device's routed rows over the mean (None: perfmodel's assumption)
    moe_load_imbalance: float | None = None
    # MaxText's keys: int8 matmuls (models/layers/quantization.py); the weight gradient's token axis in this many
    # separately scaled shards, 0 for that gradient in the compute dtype, -1 MaxText's default: the chips of one host
    quantization: Quantization = Quantization.NONE
    quantization_local_shard_count: int = -1
    # MaxText's key: its quantization through Qwix (fp8_full, the TPU7x FP8 recipes' value) rather than AQT / flax
    use_qwix_quantization: bool = False
    # pipeline parallelism over the `stage` mesh axis (ici_pipeline_parallelism, dcn_pipeline_parallelism), MaxText's
    # keys and defaults (maxperf.spec.pipeline resolves them): -1 microbatches is the stages (2 x the stages with the
    # forwarding delay), -1 repeats what the layers need; each stage runs num_layers_per_pipeline_stage layers per
    # repeat; pipeline_parallel_layers -1 pipelines every layer
    num_pipeline_microbatches: int = -1
    num_pipeline_repeats: int = -1
    num_layers_per_pipeline_stage: int = 1
    pipeline_parallel_layers: int = -1
    pipeline_delay_activation_forwarding: bool = False
    pipeline_fsdp_ag_once: bool = False
    # MaxText's key and default: a pipelined decoder's remat policy applies to each iteration of the pipeline's loop as
    # a whole (its layers are not rematerialized one by one), and none and full alike then keep only the iteration's
    # input and each layer's input; false: no remat in the pipeline at all (maxperf.spec.remat.pipelined)
    set_remat_policy_on_pipeline_iterations: bool = True
    # Megatron-LM's keys (MaxText has no uneven stages): the embedding, the loss, takes a layer's place in the first,
    # the last, stage, so the layers and these places divide over stages x repeats x num_layers_per_pipeline_stage
    # where the layers alone do not (Llama 3.1 405B's 126 over 8 x 8 x 2). In one SPMD program a place is a unit slot
    # that passes its input on: its weights are stored, as every stage holds the same shapes, and not used; the
    # embedding and the loss run outside the loop as for any pipelined decoder (maxperf.spec.pipeline)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # maxperf's key (MaxText has one schedule): gpipe, MaxText's, whose backward starts after every microbatch's
    # forward, so each stage holds the activations of all its loop iterations; 1f1b, Megatron-LM's, which starts a
    # microbatch's backward as soon as it leaves the last stage, so the first stage holds those of only the
    # microbatches in flight (maxperf.spec.pipeline.Schedule.held_iterations). The compiled step runs MaxText's;
    # perfmodel prices either
    pipeline_schedule: PipelineSchedule = PipelineSchedule.GPIPE
    # MaxText's key and default: under context parallelism (ici_context_parallelism, maxperf's sequence axis) each
    # sequence is reordered so that every shard holds as much of a causal mask's work (models/context.py)
    context_parallel_load_balance: bool = True
    # the serving steps (compile --step prefill|decode; models/serving.py), MaxText's keys and defaults: prompts of
    # max_prefill_predict_length tokens into a cache of seq_len (max_target_length) positions; the cache in int8
    # with quantize_kvcache, its scales over the heads and head dim (heads_and_dkv) or the head dim (dkv)
    max_prefill_predict_length: int = 64
    quantize_kvcache: bool = False
    kv_quant_dtype: str = "int8"
    kv_quant_axis: str = "heads_and_dkv"
    # how the serving engine's decode attention reads a grouped-query cache, as perfmodel prices it: once per KV head
    # for all the query heads that share it (per_kv_head: XLA's grouped dot, TensorRT-LLM's XQA kernel,
    # FlashDecoding), or once per query head (per_query_head: TensorRT-LLM's masked multi-head attention kernel, one
    # thread block per query head, which it runs wherever its XQA kernel has none for the group). maxperf's compiled
    # decode step is XLA's grouped dot either way
    decode_cache_reads: str = "per_kv_head"

    def __post_init__(self) -> None:
        B = self.per_device_batch_size
        require(isinstance(B, (int, float)) and not isinstance(B, bool) and B > 0,
                 f"per_device_batch_size must be > 0 (a fraction such as 0.5 is allowed), got "
                 f"{int(B) if isinstance(B, float) and B.is_integer() else B!r}")
        if float(B).is_integer():  # a whole B stays an int: 4, not 4.0, in every figure and artifact
            object.__setattr__(self, "per_device_batch_size", int(B))
        require(self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}")
        for field in ("compute_dtype", "param_dtype"):
            value = getattr(self, field)
            require(value in DTYPES, f"{field} must be one of {', '.join(DTYPES)}, got {value!r}")
        require(self.mu_dtype in ("", *DTYPES),
                f"mu_dtype must be one of {', '.join(DTYPES)} (or empty: param_dtype's), got {self.mu_dtype!r}")
        require(self.grad_dtype in DTYPES, f"grad_dtype must be one of {', '.join(DTYPES)}, got {self.grad_dtype!r}")
        require(self.opt_type in OPTIMIZERS, f"opt_type={self.opt_type}: maxperf compiles AdamW, as MaxText's "
                f"{' and '.join(OPTIMIZERS)} (MaxText's sgd and muon are not compiled)")
        for name in ("sa_q_layout", "sa_k_layout", "sa_v_layout"):
            require(getattr(self, name) in SPLASH_LAYOUTS,
                    f"{name} must be one of {', '.join(SPLASH_LAYOUTS)}, got {getattr(self, name)!r}")
        if self.use_tokamax_splash:  # tokamax's splash has only the fused backward (MaxText sets it so)
            object.__setattr__(self, "sa_use_fused_bwd_kernel", True)
        require(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}")
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        require(self.decay_steps >= 1, f"decay_steps must be >= 1, got {self.decay_steps}")
        require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        require(
            self.grad_clip_norm is None or self.grad_clip_norm > 0,
            f"grad_clip_norm must be > 0 or none, got {self.grad_clip_norm}",
        )
        for name in (*SPLASH_BLOCKS, *GMM_TILE_KEYS):
            value = getattr(self, name)
            require(value >= 128 and value % 128 == 0, f"{name} must be a positive multiple of 128, got {value}")
        require(self.grad_accum_steps >= 1, f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}")
        require(self.param_scan_axis in (0, 1), f"param_scan_axis must be 0 or 1, got {self.param_scan_axis}")
        require(self.capacity_factor == -1 or self.capacity_factor > 0,
                 f"capacity_factor must be -1 (dropless, MaxText's default) or > 0 (each expert takes that many "
                 f"times its even share of the tokens), got {self.capacity_factor:g}")
        require(self.load_balance_loss_weight >= 0,
                 f"load_balance_loss_weight must be >= 0, got {self.load_balance_loss_weight:g}")
        require(self.routed_bias_update_rate >= 0,
                 f"routed_bias_update_rate must be >= 0 (0: the selection bias stays as it is), got "
                 f"{self.routed_bias_update_rate:g}")
        require(self.mtp_loss_scaling_factor >= 0,
                 f"mtp_loss_scaling_factor must be >= 0, got {self.mtp_loss_scaling_factor:g}")
        require(self.moe_load_imbalance is None or self.moe_load_imbalance >= 1,
                 f"moe_load_imbalance (the busiest expert shard's rows over the mean) must be >= 1, got "
                 f"{self.moe_load_imbalance}")
        require(self.quantization_local_shard_count >= -1,
                 f"quantization_local_shard_count must be -1 (the chips of one host, MaxText's default), 0 (the weight "
                 f"gradient unquantized) or a positive shard count, got {self.quantization_local_shard_count}")
        qwix = self.quantization in (Quantization.FP8_FULL, Quantization.FP8_GPU, Quantization.AUTO,
                                     Quantization.NONE)
        require(qwix or not self.use_qwix_quantization,
                f"use_qwix_quantization=true with quantization={self.quantization}: maxperf builds Qwix's fp8_full "
                "and fp8_gpu only; set one of them, or use_qwix_quantization=false for MaxText's AQT and flax values")
        require(self.quantization not in (Quantization.FP8_FULL, Quantization.FP8_GPU) or self.use_qwix_quantization,
                f"quantization={self.quantization} is MaxText's Qwix recipe: set use_qwix_quantization=true with it, "
                "as MaxText requires")
        require(self.max_prefill_predict_length >= 1,
                f"max_prefill_predict_length (the prompt's tokens) must be >= 1, got {self.max_prefill_predict_length}")
        require(self.kv_quant_dtype == "int8", f"kv_quant_dtype={self.kv_quant_dtype}: maxperf stores the cache in "
                "int8 (MaxText's int4 is not built)")
        require(self.kv_quant_axis in ("heads_and_dkv", "dkv"),
                f"kv_quant_axis must be heads_and_dkv or dkv, got {self.kv_quant_axis!r}")
        require(self.decode_cache_reads in DECODE_CACHE_READS,
                 f"decode_cache_reads must be one of {', '.join(DECODE_CACHE_READS)}, got {self.decode_cache_reads!r}")
        require(self.num_vocab_tiling >= 1 and self.seq_len % self.num_vocab_tiling == 0,
                 f"num_vocab_tiling must be >= 1 and divide seq_len ({self.seq_len}), got {self.num_vocab_tiling}")

    def micro_batch(self, devices: int) -> int:
        """B x devices examples per microbatch (MaxText's micro_batch_size_to_train_on): a whole number; a
        MaxperfError otherwise."""
        return micro_batch(self.per_device_batch_size, devices)

    def global_batch(self, devices: int) -> int:
        """B x devices x A examples per step (MaxText's global_batch_size_to_train_on): A microbatches."""
        return self.micro_batch(devices) * self.grad_accum_steps


def micro_batch(B: float, devices: int) -> int:
    """B x devices examples per microbatch (MaxText's micro_batch_size_to_train_on), which must be whole."""
    rows = B * devices
    if not (float(rows).is_integer() and rows >= 1):  # the message formatted only when it is said
        raise MaxperfError(f"per_device_batch_size={B} over {devices} devices gives a microbatch of {rows:g} examples, "
                           f"which must be a whole number; choose B so that B x {devices} is whole")
    return int(rows)


def optimizer_state_bytes(train: TrainConfig) -> int:
    """Bytes of AdamW's state per parameter: its first moment in mu_dtype (param_dtype's where unset), its second in
    param_dtype."""
    p = DTYPE_BYTES[train.param_dtype]
    return (DTYPE_BYTES[train.mu_dtype] if train.mu_dtype else p) + p * (OPTIMIZER_STATES_PER_PARAM - 1)


def gradient_bytes(train: TrainConfig) -> int:
    """Bytes of one parameter's gradient as the update reads it: float32 gradients cast to grad_dtype (MaxText's
    train step), others in the parameters' dtype."""
    p = DTYPE_BYTES[train.param_dtype]
    return DTYPE_BYTES[train.grad_dtype] if train.param_dtype == "float32" else p
