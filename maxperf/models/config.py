"""Typed, frozen configs: the model, the training step, and the parallelism over a mesh.

One letter per dimension: V vocabulary, D model width, N layers, H query heads, K kv heads, Dh head dim,
F feed-forward width, B per-device batch, L sequence, W attention window.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from maxperf import attention_rule, logical_axes
from maxperf.errors import MaxperfError


class Activation(enum.StrEnum):
    SWIGLU = "swiglu"
    GEGLU = "geglu"
    GELU = "gelu"
    # gpt-oss (MaxText's gpt_oss MoE activation): gate g clipped above and up u clipped both ways at
    # mlp_activations_limit, then g sigmoid(1.702 g) (u + 1)
    CLAMPED_SWIGLU = "clamped_swiglu"

    @property
    def gated(self) -> bool:
        return self is not Activation.GELU


class Norm(enum.StrEnum):
    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"


class Positions(enum.StrEnum):
    ROPE = "rope"
    LEARNED = "learned"


class AttentionType(enum.StrEnum):
    """The mask pattern, or the attention block (MaxText's `attention_type`)."""

    GLOBAL = "global"  # every layer full causal
    LOCAL_SLIDING = "local_sliding"  # every layer sees the last W tokens
    LOCAL_GLOBAL = "local_global"  # Gemma 2: `local_per_global` sliding-window layers, then one global, repeated
    CHUNK = "chunk"  # Llama 4: local layers attend causally within chunks of `chunk_attn_window_size` tokens; the
    #                  global layers are the RoPE-free ones (nope_layer_interval), else every local_per_global + 1-th
    MLA = "mla"  # DeepSeek's multi-head latent attention: low-rank q and kv, decoupled RoPE keys; causal


class RoutedScoreFunc(enum.StrEnum):
    """How a mixture-of-experts router scores experts (MaxText's `routed_score_func`; its "" is softmax)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class AttentionKernel(enum.StrEnum):
    """How attention is computed (MaxText's `attention`; its `autoselected` is accepted for `auto`)."""

    AUTO = "auto"  # flash on TPU and GPU, as MaxText picks; the blockwise flash on CPU
    DOT_PRODUCT = "dot_product"  # the materialized [L, L] scores and softmax
    FLASH = "flash"  # TPU: Pallas splash attention; GPU: Pallas (Triton) flash attention; CPU: blockwise


class RematPolicy(enum.StrEnum):
    """MaxText's remat policies (layers/decoders.py get_remat_policy): what each decoder layer keeps for the
    backward, by checkpoint name; the rest is recomputed. `*_offloaded` keep theirs in pinned host memory."""

    NONE = "none"  # keep every activation the backward pass needs
    MINIMAL = "minimal"  # q, k, v, out projections and the MLP's wi/wo outputs
    MINIMAL_WITH_CONTEXT = "minimal_with_context"  # minimal and the attention context
    SAVE_DOT_WITH_CONTEXT_EXCEPT_MLP = "save_dot_with_context_except_mlp"  # q, k, v, context, out
    SAVE_DOT_EXCEPT_MLPWI = "save_dot_except_mlpwi"  # q, k, v, out, mlpwo
    SAVE_DOT_EXCEPT_MLP = "save_dot_except_mlp"  # q, k, v, out
    SAVE_QKV_PROJ = "save_qkv_proj"  # q, k, v
    SAVE_OUT_PROJ = "save_out_proj"  # out
    QKV_PROJ_OFFLOADED = "qkv_proj_offloaded"  # q, k, v in host memory
    MINIMAL_OFFLOADED = "minimal_offloaded"  # minimal's set in host memory
    CUSTOM = "custom"  # each named tensor as its own key says (RematLocation)
    FULL = "full"  # keep only each layer's input, recompute the whole layer


class Quantization(enum.StrEnum):
    """MaxText's `quantization` of the decoder layers' matmuls (its "" is `none`). MaxText's other values (fp8,
    nanoo_fp8, fp8_full, aqt_fp8, intmp, te_*, int8w, int4w, ...) are not implemented and refused."""

    NONE = "none"
    INT8 = "int8"  # AQT config_v3: int8 forward and input gradient, the weight gradient per local_shard_count


class RematLocation(enum.StrEnum):
    """Where `remat_policy=custom` keeps one named tensor (MaxText's per-tensor keys)."""

    REMAT = "remat"  # recomputed in the backward
    DEVICE = "device"  # saved in device memory
    OFFLOAD = "offload"  # saved in pinned host memory


# The checkpoint names the decoder layer gives its tensors (MaxText's), and what each remat policy saves on device
# and offloads to the host (layers/decoders.py get_remat_policy).
CHECKPOINT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj", "context", "out_proj",
                    "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
REMAT_SAVED: dict[RematPolicy, tuple[tuple[str, ...], tuple[str, ...]]] = {
    RematPolicy.MINIMAL: (_MINIMAL, ()),
    RematPolicy.MINIMAL_WITH_CONTEXT: ((*_MINIMAL, "context"), ()),
    RematPolicy.SAVE_DOT_WITH_CONTEXT_EXCEPT_MLP: ((*_QKV, "context", "out_proj"), ()),
    RematPolicy.SAVE_DOT_EXCEPT_MLPWI: ((*_QKV, "out_proj", "mlpwo"), ()),
    RematPolicy.SAVE_DOT_EXCEPT_MLP: ((*_QKV, "out_proj"), ()),
    RematPolicy.SAVE_QKV_PROJ: (_QKV, ()),
    RematPolicy.SAVE_OUT_PROJ: (("out_proj",), ()),
    RematPolicy.QKV_PROJ_OFFLOADED: ((), ("query_proj", "value_proj", "key_proj")),
    RematPolicy.MINIMAL_OFFLOADED: ((), _MINIMAL),
    RematPolicy.FULL: ((), ()),
}


class LayerKind(enum.StrEnum):
    """The decoder layer family: each layer's attention (per `attention_type`) and its feed-forward block, a dense
    MLP or a mixture of experts (`ModelConfig.moe_layers`)."""

    DENSE = "dense"
    MOE = "moe"  # some or all layers' MLP is a mixture of experts (num_experts > 1)


MESH_AXES, DCN_AXES = logical_axes.MESH_AXES, logical_axes.DCN_AXES  # MaxText's mesh axes, outermost first

_DTYPES = ("float32", "bfloat16", "float16")
SPLASH_BLOCKS = attention_rule.SPLASH_BLOCKS  # MaxText's sa_block_* keys, in the kernel rule's order


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise MaxperfError(message)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (Meta's reference implementation)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023), as DeepSeek-V2/V3 and Kimi K2 extend RoPE past their pretraining length (the
    `rope_scaling` of their Hugging Face config.json; MaxText's rope_type=yarn with rope_factor, beta_fast, beta_slow,
    original_max_position_embeddings, mscale)."""

    factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position: int = 4096
    mscale: float = 1.0  # HF's mscale_all_dim: the softmax scale grows by (0.1 mscale ln(factor) + 1)^2


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int  # V
    d_model: int  # D
    num_layers: int  # N
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # Dh
    d_ff: int  # F
    activation: Activation = Activation.SWIGLU
    norm: Norm = Norm.RMSNORM
    norm_eps: float = 1e-5
    positions: Positions = Positions.ROPE
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    max_position: int = 8192  # size of the learned position table
    tie_embeddings: bool = False
    scale_embeddings: bool = False  # multiply embeddings by sqrt(D), as Gemma does
    # MaxText's use_iota_embed: the lookup as a one-hot [B, L, V] matmul against the table (its backward a matmul,
    # not a scatter), as MaxText's TPU configs run it; the same values
    use_iota_embed: bool = False
    attention_type: AttentionType = AttentionType.GLOBAL
    window: int | None = None  # W, for local_sliding and for the local layers of local_global
    local_per_global: int = 1
    qk_norm: bool = False
    query_scale: float | None = None  # None: 1/sqrt(Dh)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    post_norms: bool = False  # norms after attention and MLP too, as in Gemma 2
    # the D-wide norm scales sharded over fsdp (logical axis norm_fsdp), as MaxText's llama2 configs' logical rule
    # ['norm', 'fsdp'] does; else over tensor (its base rule)
    norm_fsdp: bool = False
    # MaxText's fused_qkv and fused_mlp: one projection matmul for q, k and v (checkpoint name qkv_proj), and one for
    # the gated MLP's gate and up (checkpoint name mlpwi); the same FLOPs and parameters, one weight each
    fused_qkv: bool = False
    fused_mlp: bool = False
    layer_kind: LayerKind = LayerKind.DENSE
    # --- mixture of experts (MaxText's keys): layer i's MLP is a mixture of `num_experts` experts of width
    # `base_moe_mlp_dim` when num_experts > 1, i >= first_num_dense_layers, and (i - first_num_dense_layers + 1) is a
    # multiple of interleave_moe_layer_step; every other layer keeps the dense MLP of width d_ff
    num_experts: int = 1
    num_experts_per_tok: int = 1  # top-k
    base_moe_mlp_dim: int | None = None  # each routed expert's hidden width; None: d_ff
    shared_experts: int = 0  # experts every token goes through, each of width base_moe_mlp_dim
    first_num_dense_layers: int = 0  # DeepSeek: the first layers are dense
    interleave_moe_layer_step: int = 1  # Llama 4 Maverick: 2 (every other layer is MoE)
    routed_score_func: RoutedScoreFunc = RoutedScoreFunc.SOFTMAX
    routed_scaling_factor: float = 1.0  # DeepSeek-V3: 2.5, multiplies the routed experts' combined output
    routed_bias: bool = False  # DeepSeek-V3: a per-expert bias added to scores for selection only (aux-loss-free)
    n_routing_groups: int = -1  # group-limited routing: experts in this many groups (-1: no groups)
    topk_routing_group: int = -1  # ... of which the best this many groups are eligible
    norm_topk_prob: bool = False  # renormalize the top-k weights to sum to 1 (Qwen3-MoE, DeepSeek-V3)
    # --- multi-head latent attention (attention_type=mla; MaxText's keys)
    q_lora_rank: int = 0  # 0: q projected directly from D (DeepSeek-V2-Lite); else through this rank
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # --- Llama 4 (MaxText's keys and its llama4 decoder)
    chunk_attn_window_size: int = 8192  # attention_type=chunk: the local layers' chunk
    nope_layer_interval: int = -1  # every this-many-th layer uses no RoPE (-1: all use RoPE)
    # a parameter-free L2 norm of q and k after RoPE, on RoPE layers only (MaxText's use_qk_norm in its llama4
    # decoder); qk_norm is the RMSNorm with a scale before RoPE (Qwen3, Gemma 3)
    qk_l2_norm: bool = False
    # the RoPE-free layers scale the query by 1 + 0.1 ln(floor((position + 1) / 8192) + 1) (Llama 4's attention
    # temperature tuning, which MaxText applies in training too)
    temperature_tuning: bool = False
    # the router's sigmoid weight multiplies each token before its expert, whose output then joins with weight 1
    # (MaxText's llama4 MoE)
    routed_input_scaling: bool = False
    # --- gpt-oss (MaxText's keys)
    attention_sinks: bool = False  # a learned per-head logit joining each softmax's denominator (attention_sink)
    attention_bias: bool = False  # biases on the q, k, v and output projections
    mlp_bias: bool = False  # biases on each expert's wi_0, wi_1 and wo
    mlp_activations_limit: float = 7.0  # activation=clamped_swiglu's clip
    # --- Gemma 3
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base (None: rope_theta)
    # positions divided by this on the other layers (MaxText's rope_linear_scaling_factor; Gemma 3's global layers)
    rope_linear_scaling_factor: float = 1.0
    # DeepSeek-V3's multi-token prediction (MaxText's key): this many sequential modules, module k predicting the
    # token k + 1 ahead, each one decoder layer of the last layer's kind; trained beside the model, counted apart
    mtp_num_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def moe_mlp_dim(self) -> int:
        return self.base_moe_mlp_dim if self.base_moe_mlp_dim is not None else self.d_ff

    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each decoder layer's feed-forward block is a mixture of experts."""
        if not self.is_moe:
            return (False,) * self.num_layers
        k, step = self.first_num_dense_layers, self.interleave_moe_layer_step
        return tuple(i >= k and (i - k + 1) % step == 0 for i in range(self.num_layers))

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff"):
            value = getattr(self, field)
            _require(isinstance(value, int) and value >= 1, f"{field} must be a positive integer, got {value!r}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        if self.attention_type is AttentionType.CHUNK:
            _require(self.chunk_attn_window_size >= 1,
                     f"attention_type=chunk needs chunk_attn_window_size >= 1, got {self.chunk_attn_window_size}")
        elif self.attention_type not in (AttentionType.GLOBAL, AttentionType.MLA):
            _require(
                self.window is not None and self.window >= 1,
                f"attention_type={self.attention_type} needs window=W with W >= 1, got window={self.window}",
            )
        _require(self.local_per_global >= 1, f"local_per_global must be >= 1, got {self.local_per_global}")
        _require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        _require(self.num_experts >= 1, f"num_experts must be >= 1, got {self.num_experts}")
        _require(self.mtp_num_layers >= 0, f"mtp_num_layers must be >= 0 (0: no multi-token prediction), got "
                 f"{self.mtp_num_layers}")
        _require(1 <= self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok (top-k) must be between 1 and num_experts ({self.num_experts}), got "
                 f"{self.num_experts_per_tok}")
        _require(self.first_num_dense_layers >= 0 and self.interleave_moe_layer_step >= 1,
                 f"first_num_dense_layers must be >= 0 and interleave_moe_layer_step >= 1, got "
                 f"{self.first_num_dense_layers} and {self.interleave_moe_layer_step}")
        if self.n_routing_groups != -1 or self.topk_routing_group != -1:
            _require(self.n_routing_groups >= 1 and self.num_experts % self.n_routing_groups == 0
                     and 1 <= self.topk_routing_group <= self.n_routing_groups,
                     f"group-limited routing needs n_routing_groups dividing num_experts ({self.num_experts}) and "
                     f"1 <= topk_routing_group <= n_routing_groups, got {self.n_routing_groups} and "
                     f"{self.topk_routing_group}")

        if self.attention_type is AttentionType.MLA:
            _require(self.num_kv_heads == self.num_heads,
                     f"attention_type=mla gives every query head its own key and value: num_kv_heads must equal "
                     f"num_heads ({self.num_heads}), got {self.num_kv_heads}")
            _require(self.q_lora_rank >= 0, f"q_lora_rank must be >= 0 (0: q projected directly), got "
                     f"{self.q_lora_rank}")
            for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                value = getattr(self, field)
                _require(value >= 1, f"attention_type=mla needs {field} >= 1, got {value}")
            _require(self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
                     f"attention_type=mla needs an even qk_rope_head_dim >= 2, got {self.qk_rope_head_dim}")
            _require(not self.fused_qkv, "attention_type=mla has no fused q, k and v projection; set fused_qkv=false")
            _require(self.nope_layer_interval <= 0 and not self.attention_bias and not self.qk_l2_norm,
                     "attention_type=mla always applies its decoupled RoPE and has no projection biases or L2 "
                     "QK-norm; set nope_layer_interval=-1, attention_bias=false, qk_l2_norm=false")
        _require(self.rope_linear_scaling_factor > 0,
                 f"rope_linear_scaling_factor must be > 0, got {self.rope_linear_scaling_factor}")
        _require(self.mlp_activations_limit > 0,
                 f"mlp_activations_limit must be > 0, got {self.mlp_activations_limit}")
        _require(not (self.fused_qkv and self.attention_bias),
                 "attention_bias has no fused q, k and v form; set fused_qkv=false")

    @property
    def qk_head_dim(self) -> int:
        """The query and key head dim: MLA's qk_nope_head_dim + qk_rope_head_dim, else head_dim."""
        if self.attention_type is AttentionType.MLA:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def value_head_dim(self) -> int:
        """The value (and context) head dim: MLA's v_head_dim, else head_dim."""
        return self.v_head_dim if self.attention_type is AttentionType.MLA else self.head_dim

    @property
    def kv_groups(self) -> int:
        """Query heads per kv head (H / K)."""
        return self.num_heads // self.num_kv_heads

    def nope_layers(self) -> tuple[bool, ...]:
        """Whether each layer goes without RoPE (MaxText's determine_is_nope_layer)."""
        n = self.nope_layer_interval
        return tuple(n > 0 and (i + 1) % n == 0 for i in range(self.num_layers))

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention span of each layer: its sliding window, or for attention_type=chunk's local layers their
        chunk; None where the layer attends to the whole causal prefix."""
        if self.attention_type in (AttentionType.GLOBAL, AttentionType.MLA):
            return (None,) * self.num_layers
        if self.attention_type is AttentionType.LOCAL_SLIDING:
            return (self.window,) * self.num_layers
        if self.attention_type is AttentionType.CHUNK and self.nope_layer_interval > 0:
            # MaxText's llama4 decoder: a RoPE-free layer is global, every other one chunked
            return tuple(None if nope else self.chunk_attn_window_size for nope in self.nope_layers())
        span = self.chunk_attn_window_size if self.attention_type is AttentionType.CHUNK else self.window
        period = self.local_per_global + 1
        return tuple(None if (i + 1) % period == 0 else span for i in range(self.num_layers))


@dataclass(frozen=True)
class TrainConfig:
    # B: one microbatch per device, as in MaxText: a microbatch of B x devices examples, a step of
    # gradient_accumulation_steps (A) of them; fractional as in MaxText (0.5: a microbatch of half the devices)
    per_device_batch_size: float = 1
    seq_len: int = 2048  # L
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
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
    # splash attention's tiles (MaxText's keys and defaults)
    sa_block_q: int = 512
    sa_block_kv: int = 512
    sa_block_kv_compute: int = 512
    sa_block_q_dkv: int = 512
    sa_block_kv_dkv: int = 512
    sa_block_kv_dkv_compute: int = 512
    sa_block_q_dq: int = 512
    sa_block_kv_dq: int = 512
    # MaxText's num_vocab_tiling: the loss over this many chunks of the tokens, each chunk's [B, L/n, V] logits
    # computed in the forward and again in the backward, so the whole [B, L, V] logits never exist
    num_vocab_tiling: int = 1
    # MaxText's keys: the optimizer state, and the parameters, live in pinned host memory between steps; the step
    # moves them to the device for the update (the parameters for the forward too) and back
    optimizer_memory_host_offload: bool = False
    parameter_memory_host_offload: bool = False
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

    def remat_names(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """(names saved on device, names offloaded to pinned host memory) under the remat policy; None for `none`
        (no rematerialization at all)."""
        policy = RematPolicy(self.remat_policy)
        if policy is RematPolicy.NONE:
            return None
        if policy is RematPolicy.CUSTOM:
            where = {name: RematLocation(getattr(self, name)) for name in CHECKPOINT_NAMES}
            return (tuple(n for n, w in where.items() if w is RematLocation.DEVICE),
                    tuple(n for n, w in where.items() if w is RematLocation.OFFLOAD))
        return REMAT_SAVED[policy]

    def __post_init__(self) -> None:
        B = self.per_device_batch_size
        _require(isinstance(B, (int, float)) and not isinstance(B, bool) and B > 0,
                 f"per_device_batch_size must be > 0 (a fraction such as 0.5 is allowed), got "
                 f"{int(B) if isinstance(B, float) and B.is_integer() else B!r}")
        if float(B).is_integer():  # a whole B stays an int: 4, not 4.0, in every figure and artifact
            object.__setattr__(self, "per_device_batch_size", int(B))
        _require(self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}")
        for field in ("compute_dtype", "param_dtype"):
            value = getattr(self, field)
            _require(value in _DTYPES, f"{field} must be one of {', '.join(_DTYPES)}, got {value!r}")
        _require(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}")
        _require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.decay_steps >= 1, f"decay_steps must be >= 1, got {self.decay_steps}")
        _require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _require(
            self.grad_clip_norm is None or self.grad_clip_norm > 0,
            f"grad_clip_norm must be > 0 or none, got {self.grad_clip_norm}",
        )
        for name in SPLASH_BLOCKS:
            value = getattr(self, name)
            _require(value >= 128 and value % 128 == 0, f"{name} must be a positive multiple of 128, got {value}")
        _require(self.grad_accum_steps >= 1, f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}")
        _require(self.param_scan_axis in (0, 1), f"param_scan_axis must be 0 or 1, got {self.param_scan_axis}")
        _require(self.capacity_factor == -1 or self.capacity_factor > 0,
                 f"capacity_factor must be -1 (dropless, MaxText's default) or > 0 (each expert takes that many "
                 f"times its even share of the tokens), got {self.capacity_factor:g}")
        _require(self.capacity_factor == -1 or not self.sparse_matmul,
                 f"capacity_factor={self.capacity_factor:g} drops tokens in the dense dispatch: set "
                 "sparse_matmul=false with it, or capacity_factor=-1 for the dropless sparse one")
        _require(self.load_balance_loss_weight >= 0,
                 f"load_balance_loss_weight must be >= 0, got {self.load_balance_loss_weight:g}")
        _require(self.routed_bias_update_rate >= 0,
                 f"routed_bias_update_rate must be >= 0 (0: the selection bias stays as it is), got "
                 f"{self.routed_bias_update_rate:g}")
        _require(self.mtp_loss_scaling_factor >= 0,
                 f"mtp_loss_scaling_factor must be >= 0, got {self.mtp_loss_scaling_factor:g}")
        _require(self.moe_load_imbalance is None or self.moe_load_imbalance >= 1,
                 f"moe_load_imbalance (the busiest expert shard's rows over the mean) must be >= 1, got "
                 f"{self.moe_load_imbalance}")
        _require(self.quantization_local_shard_count >= -1,
                 f"quantization_local_shard_count must be -1 (the chips of one host, MaxText's default), 0 (the weight "
                 f"gradient unquantized) or a positive shard count, got {self.quantization_local_shard_count}")
        _require(self.num_vocab_tiling >= 1 and self.seq_len % self.num_vocab_tiling == 0,
                 f"num_vocab_tiling must be >= 1 and divide seq_len ({self.seq_len}), got {self.num_vocab_tiling}")

    def micro_batch(self, devices: int) -> int:
        """B x devices examples per microbatch (MaxText's micro_batch_size_to_train_on): a whole number; a
        MaxperfError otherwise."""
        rows = self.per_device_batch_size * devices
        _require(float(rows).is_integer() and rows >= 1,
                 f"per_device_batch_size={self.per_device_batch_size} over {devices} devices gives a microbatch of "
                 f"{rows:g} examples, which must be a whole number; choose B so that B x {devices} is whole")
        return int(rows)

    def global_batch(self, devices: int) -> int:
        """B x devices x A examples per step (MaxText's global_batch_size_to_train_on): A microbatches."""
        return self.micro_batch(devices) * self.grad_accum_steps




@dataclass(frozen=True)
class ParallelismConfig:
    """Mesh axis sizes; -1 on one axis fills what the others leave (`maxperf.plan.resolve_mesh` resolves them)."""

    ici_data: int = 1
    ici_fsdp: int = -1
    ici_fsdp_transpose: int = 1
    ici_sequence: int = 1
    ici_tensor: int = 1
    ici_expert: int = 1
    dcn_data: int = -1
    dcn_fsdp: int = 1
    dcn_fsdp_transpose: int = 1
    dcn_sequence: int = 1
    dcn_tensor: int = 1
    dcn_expert: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _require(value == -1 or value >= 1, f"{f.name} must be a positive integer or -1, got {value}")


def from_dict(cls, data: dict):
    """Rebuilds a config dataclass from its JSON form (enums from their values, nested configs recursively)."""
    import types
    import typing

    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        kind, value = hints[f.name], data[f.name]
        options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
        dataclass_options = [o for o in options if dataclasses.is_dataclass(o)]
        if isinstance(value, dict) and len(dataclass_options) > 1:
            # a union of configs (rope_scaling): the one whose fields are the stored keys
            options = [o for o in dataclass_options if {f.name for f in dataclasses.fields(o)} == set(value)]
        if value is not None:
            for option in options:
                if isinstance(option, type) and issubclass(option, enum.Enum):
                    value = option(value)
                elif dataclasses.is_dataclass(option):
                    value = from_dict(option, value)
        values[f.name] = value
    return cls(**values)
