"""The model config: shapes, the layer pattern and the blocks' variants, as MaxText's keys name them.

One letter per dimension: V vocabulary, D model width, N layers, H query heads, K kv heads, Dh head dim,
F feed-forward width, E experts, W attention window.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from maxperf.spec.errors import require


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


class LayerKind(enum.StrEnum):
    """The decoder layer family: each layer's attention (per `attention_type`) and its feed-forward block, a dense
    MLP or a mixture of experts (`ModelConfig.moe_layers`)."""

    DENSE = "dense"
    MOE = "moe"  # some or all layers' MLP is a mixture of experts (num_experts > 1)



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
    # MaxText's shard_exp_on_fsdp (formerly fsdp_shard_on_exp): the routed experts' weights [E, D, Fe] and [E, Fe, D]
    # stored with E over the FSDP axes (logical axis exp_fsdp, MaxText's embed_moe) and D whole, instead of E over
    # `expert` and D over FSDP; gathered whole before the grouped matmuls either way. MaxText requires fsdp to divide
    # E and no tensor or expert parallelism (spec.request checks both)
    shard_exp_on_fsdp: bool = False
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

    def layer_cycle(self) -> int:
        """How many consecutive layers the decoder scans as one block, each of them with weights of its own: the
        period after which the layers' kinds repeat, as MaxText's decoders set it. Gemma 2's local and global pair and
        Gemma 3's five local layers and a global one (local_per_global + 1: its GEMMA3_ATTENTION_PATTERN), gpt-oss's
        sliding and full pair, Llama 4's RoPE-free layer every nope_layer_interval with its dense and MoE layers
        interleaved within (MaxText's inhomogeneous_layer_cycle_interval), a mixture of experts' dense layers before
        each MoE one (interleave_moe_layer_step); 1 where every layer is alike."""
        nope = self.nope_layer_interval > 0
        windows = self.attention_type is AttentionType.LOCAL_GLOBAL or (
            self.attention_type is AttentionType.CHUNK and not nope)  # layer_windows' period
        return math.lcm(self.local_per_global + 1 if windows else 1, self.nope_layer_interval if nope else 1,
                        self.interleave_moe_layer_step if self.is_moe else 1)

    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each decoder layer's feed-forward block is a mixture of experts."""
        if not self.is_moe:
            return (False,) * self.num_layers
        k, step = self.first_num_dense_layers, self.interleave_moe_layer_step
        return tuple(i >= k and (i - k + 1) % step == 0 for i in range(self.num_layers))

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff"):
            value = getattr(self, field)
            require(isinstance(value, int) and value >= 1, f"{field} must be a positive integer, got {value!r}")
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        if self.attention_type is AttentionType.CHUNK:
            require(self.chunk_attn_window_size >= 1,
                     f"attention_type=chunk needs chunk_attn_window_size >= 1, got {self.chunk_attn_window_size}")
        elif self.attention_type not in (AttentionType.GLOBAL, AttentionType.MLA):
            require(
                self.window is not None and self.window >= 1,
                f"attention_type={self.attention_type} needs window=W with W >= 1, got window={self.window}",
            )
        require(self.local_per_global >= 1, f"local_per_global must be >= 1, got {self.local_per_global}")
        require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        require(self.num_experts >= 1, f"num_experts must be >= 1, got {self.num_experts}")
        require(self.mtp_num_layers >= 0, f"mtp_num_layers must be >= 0 (0: no multi-token prediction), got "
                 f"{self.mtp_num_layers}")
        require(1 <= self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok (top-k) must be between 1 and num_experts ({self.num_experts}), got "
                 f"{self.num_experts_per_tok}")
        require(self.first_num_dense_layers >= 0 and self.interleave_moe_layer_step >= 1,
                 f"first_num_dense_layers must be >= 0 and interleave_moe_layer_step >= 1, got "
                 f"{self.first_num_dense_layers} and {self.interleave_moe_layer_step}")
        if self.num_experts > 1:  # MaxText's num_moe_layers would be 0 or less: a mixture of experts without experts
            first = self.first_num_dense_layers + self.interleave_moe_layer_step - 1
            require(self.num_layers > first,
                    f"num_layers={self.num_layers} leaves {self.name} no layer of experts (its first is layer "
                    f"{first + 1}: first_num_dense_layers={self.first_num_dense_layers}, interleave_moe_layer_step="
                    f"{self.interleave_moe_layer_step}); give num_layers={first + 1} or more, or fewer dense layers "
                    "first (first_num_dense_layers)")
        if self.n_routing_groups != -1 or self.topk_routing_group != -1:
            require(self.n_routing_groups >= 1 and self.num_experts % self.n_routing_groups == 0
                     and 1 <= self.topk_routing_group <= self.n_routing_groups,
                     f"group-limited routing needs n_routing_groups dividing num_experts ({self.num_experts}) and "
                     f"1 <= topk_routing_group <= n_routing_groups, got {self.n_routing_groups} and "
                     f"{self.topk_routing_group}")

        if self.attention_type is AttentionType.MLA:
            require(self.num_kv_heads == self.num_heads,
                     f"attention_type=mla gives every query head its own key and value: num_kv_heads must equal "
                     f"num_heads ({self.num_heads}), got {self.num_kv_heads}")
            require(self.q_lora_rank >= 0, f"q_lora_rank must be >= 0 (0: q projected directly), got "
                     f"{self.q_lora_rank}")
            for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                value = getattr(self, field)
                require(value >= 1, f"attention_type=mla needs {field} >= 1, got {value}")
            require(self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
                     f"attention_type=mla needs an even qk_rope_head_dim >= 2, got {self.qk_rope_head_dim}")
            require(not self.fused_qkv, "attention_type=mla has no fused q, k and v projection; set fused_qkv=false")
            require(self.nope_layer_interval <= 0 and not self.attention_bias and not self.qk_l2_norm,
                     "attention_type=mla always applies its decoupled RoPE and has no projection biases or L2 "
                     "QK-norm; set nope_layer_interval=-1, attention_bias=false, qk_l2_norm=false")
        require(self.rope_linear_scaling_factor > 0,
                 f"rope_linear_scaling_factor must be > 0, got {self.rope_linear_scaling_factor}")
        require(self.mlp_activations_limit > 0,
                 f"mlp_activations_limit must be > 0, got {self.mlp_activations_limit}")
        require(not (self.fused_qkv and self.attention_bias),
                 "attention_bias has no fused q, k and v form; set fused_qkv=false")

    @property
    def qk_head_dim(self) -> int:
        """The query and key head dim: MLA's qk_nope_head_dim + qk_rope_head_dim, else head_dim."""
        if self.attention_type is AttentionType.MLA:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

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
