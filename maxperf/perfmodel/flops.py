"""Parameter counts and FLOPs per device per step.

Parameters match the Flax model's shapes exactly (maxperf.models.layers): per layer q D x H x Dh, k and v D x K x Dh,
o H x Dh x D, MLP gate/up D x F and down F x D (no gate for GELU), two norms (four with post-norms) of D (LayerNorm
has a scale and a bias, RMSNorm a scale), QK-norm two RMSNorm scales of Dh; a final norm; the embedding V x D; the
unembedding D x V unless tied; learned positions max_position x D; gpt-oss's biases (q H x Dh, k and v K x Dh,
o D; each expert's wi_0 and wi_1 Fe and wo D) and attention sinks (H). Latent attention (MLA, layers/mla.py):
q through D x R, an RMSNorm of R and R x H x Dq (or D x H x Dq where R = q_lora_rank is 0), the kv latent and the
shared RoPE key D x (C + Dr), an RMSNorm of C, C x H x (Dn + Dv), o H x Dv x D. A MoE layer (perfmodel.moe): the
router D x E (+ E with DeepSeek's selection bias), E experts and S shared experts, each an MLP of width Fe.
Active parameters are those one token passes through: the router, top-k of the E experts, the rest whole.

Model FLOPs follow MaxText's `calculate_tflops_training_per_device` (maxtext_utils.py): 6 x tokens x active matmul
weights (the unembedding and the router included, the embedding lookup not), plus attention 2 x B x L^2 x H x
(Dq + Dv) x 3 halved for the causal mask (4 x ... x Dh where the query and value head dims agree; MLA's
calculate_mla_tflops_per_device), remat excluded; Megatron (Narayanan et al. 2021, eq. 3) counts the same terms. Per
device means per `per_device_batch_size` B per microbatch, A = grad_accum_steps microbatches a step (MaxText's
convention: global batch = B x devices x A).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from maxperf.perfmodel.moe import MoeShape, dispatch, expert_capacity, moe_shape, rows_per_token
from maxperf.spec import attention_rule
from maxperf.spec.memo import model_memo, per_model
from maxperf.spec.model import ModelConfig
from maxperf.spec.remat import remat_names
from maxperf.spec.train import TrainConfig

# Training costs forward + backward = 3 x forward: the backward computes grads w.r.t. inputs and weights, each as
# many FLOPs as the forward (Kaplan et al. 2020, sec. 2.1; Narayanan et al. 2021).
TRAIN_FACTOR = 3
# attention=dot_product materializes the full [L, L] score matrix and masks it (models/layers/attention_kernels.py),
# so the hardware executes all L^2 scores however causal or windowed the mask; the flash kernels of TPU (splash) and
# GPU (Pallas) skip the blocks the mask hides, so they execute the masked share only (to within their diagonal
# blocks); the CPU's blockwise kernel masks every block like the dot product (steptime handles CPUs).
ATTENTION_SKIPS_MASKED = {"dot_product": False, "flash": True}
# Flash attention's backward runs five matmuls per score block (the scores again, dV, dP, dQ, dK: Dao et al. 2022,
# algorithm 2) against the forward's two, where one kernel computes dQ, dK and dV together (FlashAttention-2 and
# cuDNN's on GPU; splash with sa_use_fused_bwd_kernel). Splash's default backward is two kernels, each computing the
# scores and dP again: dK and dV over the key tiles (4 matmuls), dQ over the query tiles (3): seven
# (jax.experimental.pallas.ops.tpu.splash_attention: _splash_attention_bwd_dkv and _bwd_dq).
FLASH_BACKWARD_MATMULS = 5
SPLASH_SPLIT_KERNEL_MATMULS = {"dkv": 4, "dq": 3}
SPLASH_SPLIT_BACKWARD_MATMULS = sum(SPLASH_SPLIT_KERNEL_MATMULS.values())


def flash_backward_matmuls(train: TrainConfig, kind: str) -> int:
    """The matmuls per score block of a flash kernel's backward on a chip kind ("tpu": splash, split unless
    sa_use_fused_bwd_kernel)."""
    split = kind == "tpu" and not train.sa_use_fused_bwd_kernel
    return SPLASH_SPLIT_BACKWARD_MATMULS if split else FLASH_BACKWARD_MATMULS

def attention_kernel(train: TrainConfig) -> str:
    """"flash" or "dot_product": `auto` is flash (splash on TPU, Pallas on GPU, blockwise on CPU), as MaxText picks;
    `resolve_attention` first turns it into the dot product where the platform's flash cannot serve the setting."""
    return "dot_product" if str(train.attention) == "dot_product" else "flash"


def resolve_attention(model: ModelConfig, train: TrainConfig, platform: str) -> TrainConfig:
    """`train` with `attention` as the model runs it on a platform kind ("tpu", "gpu", "cpu"): the model's own rule
    (maxperf/attention_rule.py, plain Python) picks, so `auto` becomes dot_product where flash cannot serve the
    setting, and an explicit flash it cannot serve is the same one-line error the compile gives."""
    if attention_rule.for_config(model, train, platform) != "dot_product" or attention_kernel(train) == "dot_product":
        return train
    if dataclasses.is_dataclass(train):
        return dataclasses.replace(train, attention="dot_product")
    resolved = copy.copy(train)
    resolved.attention = "dot_product"
    return resolved


def recomputed(model: ModelConfig, train: TrainConfig, moe_layer: bool = False) -> frozenset[str]:
    """The forward pieces the backward pass computes again under the remat policy: the projections "query_proj",
    "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1" (or "mlpwi"), "mlpwo", and the attention's "scores"
    (Q K^T and softmax) and "context" (P V; with flash, the whole forward kernel); in a MoE layer (`moe_layer`) also
    "router" (the gate's logits, which no policy names) and, with the einsum dispatch, "dispatch" (its one-hot
    einsum).

    What the backward reads: the attention backward q, k, v and (flash) the kernel's residuals, named "context", or
    (dot product) the probabilities, which no policy names; the output projection's weight gradient the attention's
    output, "attention_out" (with flash a transpose of the kernel's output, which "context" keeps);
    the MLP block's norm the residual stream after attention, so the output projection; the MLP's backward its
    wi outputs; only a post-norm (Gemma 2) reads the wo output, but in a MoE layer the gradient of the routing
    weights reads the experts' outputs (the combine is a weighted sum), so there the wo output is recomputed unless
    kept. XLA drops recomputation nothing reads (measured here: full remat recomputes no MLP down projection,
    tests/test_perfmodel_xla_flops.py)."""
    names = remat_names(train)
    if names is None:
        return frozenset()
    kept = names[0] | names[1]
    if "qkv_proj" in kept and model.fused_qkv:
        kept |= {"query_proj", "key_proj", "value_proj"}
    if "mlpwi" in kept and model.fused_mlp:  # a gated MLP's gate and up, fused
        kept |= {"mlpwi_0", "mlpwi_1"}
    wi = ("mlpwi_0", "mlpwi_1") if gated(model) else ("mlpwi",)
    out = {n for n in ("query_proj", "key_proj", "value_proj", "out_proj", *wi) if n not in kept}
    if (model.post_norms or moe_layer) and "mlpwo" not in kept:
        out.add("mlpwo")
    if attention_kernel(train) == "dot_product":
        out.add("scores")  # the probabilities, which no name keeps
        if "attention_out" not in kept:
            out.add("context")
    elif "context" not in kept:  # the forward kernel again, for its residuals
        out |= {"scores", "context"}
    if moe_layer:
        out.add("router")
        if dispatch(train) != "sparse":  # the experts' input is the dispatch einsum's output, named by no policy
            out.add("dispatch")
        elif gated(model):  # the routed experts' up projection, which MaxText names moe_mlpwi_1 alone, always again
            out.add("moe_mlpwi_1")
    return frozenset(out)


def is_mla(model: ModelConfig) -> bool:
    return str(model.attention_type) == "mla"


def head_dims(model: ModelConfig) -> tuple[int, int]:
    """(Dq, Dv): the query and key head dim, and the value's; latent attention's differ, elsewhere both Dh."""
    return attention_rule.head_dims(model)


def projection_flops_per_token(model: ModelConfig, moe_rows: float | None = None,
                               sparse: bool = False) -> dict[str, float]:
    """Forward FLOPs per token of each named projection of one layer. `moe_rows`: for a MoE layer, the routed rows a
    token costs (perfmodel.moe.rows_per_token); its MLP names then cover the routed and shared experts, and "router"
    the gate; but with the dropless dispatch (`sparse`) a gated MLP's "mlpwi_1" the shared experts' alone and
    "moe_mlpwi_1" the routed ones' (moe_wi: MaxText names the routed up projection moe_mlpwi_1 alone there)."""
    D, H, K, Dh, F = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim, model.d_ff
    if is_mla(model):
        R, C, Dn, Dr, Dv = (model.q_lora_rank, model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim,
                            model.v_head_dim)
        Dq = Dn + Dr
        # the kv latent (and the shared RoPE key) feeds keys and values alike: counted with the keys
        attention = {"query_proj": 2 * (D * R + R * H * Dq) if R else 2 * D * H * Dq,
                     "key_proj": 2 * (D * (C + Dr) + C * H * Dn), "value_proj": 2 * C * H * Dv,
                     "out_proj": 2 * H * Dv * D}
    else:
        attention = {"query_proj": 2 * D * H * Dh, "key_proj": 2 * D * K * Dh, "value_proj": 2 * D * K * Dh,
                     "out_proj": 2 * H * Dh * D}
    moe = moe_shape(model) if moe_rows is not None else None
    if moe is None:
        return {**attention, "mlpwi_0": 2 * D * F, "mlpwi_1": 2 * D * F, "mlpwi": 2 * D * F, "mlpwo": 2 * F * D}
    width = (moe_rows + moe.S) * moe.Fe
    names = {**attention, "mlpwi_0": 2 * D * width, "mlpwi_1": 2 * D * width, "mlpwi": 2 * D * width,
             "mlpwo": 2 * width * D, "router": 2 * D * moe.E}
    if sparse and gated(model):
        names |= {"mlpwi_1": 2 * D * moe.S * moe.Fe, "moe_mlpwi_1": 2 * D * moe_rows * moe.Fe}
    return names


def moe_wi(model: ModelConfig, train: TrainConfig) -> tuple[str, ...]:
    """The names of a MoE layer's experts' up (and gate) projections: with the dropless dispatch a gated MLP's up
    projection is two, the routed experts' moe_mlpwi_1 and the shared experts' mlpwi_1
    (projection_flops_per_token)."""
    if not gated(model):
        return ("mlpwi",)
    return ("mlpwi_0", "mlpwi_1", "moe_mlpwi_1") if dispatch(train) == "sparse" else ("mlpwi_0", "mlpwi_1")


# AdamW elementwise work per parameter (optax.adamw): m update 3, v update 4, bias corrections 2, sqrt+eps+divide 3,
# weight decay 2, learning-rate scale and apply 2; the global-norm clip adds 3 (square, sum, scale).
OPTIMIZER_FLOPS_PER_PARAM = 19


def norm_params(model: ModelConfig) -> int:
    """One norm of width D: LayerNorm has scale and bias, RMSNorm a scale only."""
    return (2 if str(model.norm) == "layernorm" else 1) * model.d_model


def gated(model: ModelConfig) -> bool:
    return str(model.activation) != "gelu"


def mlp_params(model: ModelConfig, width: int) -> int:
    """An MLP of hidden width `width`: gate (gated activations only), up and down."""
    return (3 if gated(model) else 2) * model.d_model * width


def attention_params(model: ModelConfig) -> tuple[int, int]:
    """(matmul weights, other parameters) of one layer's attention block: q, k, v, o (MLA: its latent projections);
    QK-norm's two RMSNorm scales of Dh, MLA's RMSNorm scales of R and C, gpt-oss's per-head sink logits and q, k, v,
    o biases."""
    D, H, K, Dh = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim
    sinks = H if model.attention_sinks else 0
    sinks += (H * Dh + 2 * K * Dh + D) if model.attention_bias else 0
    if is_mla(model):
        R, C, Dn, Dr, Dv = (model.q_lora_rank, model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim,
                            model.v_head_dim)
        q = D * R + R * H * (Dn + Dr) if R else D * H * (Dn + Dr)
        return q + D * (C + Dr) + C * H * (Dn + Dv) + H * Dv * D, R + C + sinks
    return D * H * Dh + 2 * D * K * Dh + H * Dh * D, (2 * Dh if model.qk_norm else 0) + sinks


def expert_bias_params(model: ModelConfig, moe: MoeShape) -> int:
    """One routed expert's biases (gpt-oss's mlp_bias): wi_0 (gated only) and wi_1 of Fe, wo of D."""
    if not model.mlp_bias:
        return 0
    return (2 if gated(model) else 1) * moe.Fe + model.d_model


def moe_block_params(model: ModelConfig, moe: MoeShape) -> tuple[int, int, int, int]:
    """(matmul weights, active matmul weights, other parameters, active other parameters) of one MoE block: the
    router D x E, E routed and S shared experts (top-k and S active); the router's bias of E (DeepSeek's selection
    bias, gpt-oss's logit bias), the routed experts' biases (top-k active)."""
    expert = mlp_params(model, moe.Fe)
    router = model.d_model * moe.E
    bias = moe.E if moe.router_bias else 0
    return (router + (moe.E + moe.S) * expert, router + (moe.k + moe.S) * expert,
            bias + moe.E * expert_bias_params(model, moe), bias + moe.k * expert_bias_params(model, moe))


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # token table (+ learned position table)
    unembedding: int  # D x V when untied, else 0 (the embedding table serves)
    per_layer: int  # matmul weights and norms of one decoder layer (a MoE layer's, all experts, where there are any)
    layer_matmul: int  # matmul weights of that layer
    final_norm: int
    active: int = 0  # what one token passes through: the router, top-k experts and shared experts, the rest whole
    attention: int = 0  # the attention blocks of all layers (their projections, and QK-norm, latent norms, sinks)
    experts: int = 0  # the MoE blocks of all layers: routers, routed and shared experts
    active_layer_matmul: int = 0  # matmul weights a token passes through in all decoder layers (router included)
    # DeepSeek-V3's multi-token-prediction modules (mtp_num_layers), outside total and active: each an RMSNorm of the
    # hidden state and of the next token's embedding, their 2D x D projection, one decoder layer of the last layer's
    # kind and the head's RMSNorm, the embedding and output head shared (DeepSeek-AI 2024, sec. 2.2; the
    # enorm/hnorm/eh_proj/shared_head.norm of its Hugging Face checkpoint)
    mtp: int = 0

    @property
    def non_embedding(self) -> int:
        """Parameters outside the embedding, position and unembedding tables (Kaplan et al. 2020's N)."""
        return self.total - self.embedding - self.unembedding


@per_model
def count_params(model: ModelConfig) -> ParamCounts:
    V, D, N = model.vocab_size, model.d_model, model.num_layers
    per_norm = norm_params(model)
    attn_matmul, attn_other = attention_params(model)
    layer_norms = (4 if model.post_norms else 2) * per_norm
    dense_mlp = mlp_params(model, model.d_ff)
    moe = moe_shape(model)
    n_moe = moe.moe_layers if moe else 0
    block, block_active, block_other, block_other_active = moe_block_params(model, moe) if moe else (0, 0, 0, 0)
    fixed = attn_matmul + attn_other + layer_norms  # in every layer
    layers = N * fixed + (N - n_moe) * dense_mlp + n_moe * (block + block_other)
    layers_active = N * fixed + (N - n_moe) * dense_mlp + n_moe * (block_active + block_other_active)
    embedding = V * D + (model.max_position * D if str(model.positions) == "learned" else 0)
    unembedding = 0 if model.tie_embeddings else D * V
    total = embedding + unembedding + layers + per_norm
    layer_matmul = attn_matmul + (block if n_moe else dense_mlp)
    last_moe = bool(moe) and moe_layers_of(model)[-1]
    last_layer = fixed + (block + block_other if last_moe else dense_mlp)
    mtp = mtp_depths(model) * (3 * per_norm + 2 * D * D + last_layer)
    return ParamCounts(
        total=total, embedding=embedding, unembedding=unembedding,
        per_layer=layer_matmul + attn_other + layer_norms + (block_other if n_moe else 0), layer_matmul=layer_matmul,
        final_norm=per_norm, active=embedding + unembedding + layers_active + per_norm,
        attention=N * (attn_matmul + attn_other), experts=n_moe * (block + block_other),
        active_layer_matmul=N * attn_matmul + (N - n_moe) * dense_mlp + n_moe * block_active, mtp=mtp,
    )


def mtp_depths(model: ModelConfig) -> int:
    """DeepSeek-V3's multi-token-prediction modules (mtp_num_layers; 0: none)."""
    return model.mtp_num_layers


def moe_layers_of(model: ModelConfig) -> tuple[bool, ...]:
    """Whether each decoder layer is a MoE layer (all False for a dense model)."""
    return tuple(model.moe_layers()) if moe_shape(model) else (False,) * model.num_layers


def attention_pairs(L: int, W: int | None) -> float:
    """(query, key) pairs a causal layer attends to, MaxText's way: L^2 / 2 for a full causal mask (not L(L+1)/2),
    and L*W - W^2/2 for a window W < L (the same area: a band of width W below the diagonal)."""
    w = L if W is None else min(W, L)
    return L * w - w * w / 2


def chunk_pairs(L: int, C: int) -> float:
    """Pairs of a causal layer that attends within chunks of C tokens (Llama 4's local layers): half the sum of the
    chunks' squares, MaxText's _calculate_chunked_attention_flops_per_layer halved for the causal mask."""
    return ((L // C) * C * C + (L % C) ** 2) / 2


def layer_pairs(model: ModelConfig, L: int) -> tuple[float, ...]:
    """The pairs each layer attends to: attention_type=chunk's local layers within chunks of
    chunk_attn_window_size, every other layer within its window (or the whole causal prefix)."""
    memo = model_memo(model)
    if (hit := memo.get(("layer_pairs", L))) is not None:
        return hit
    chunked = str(model.attention_type) == "chunk"
    C = model.chunk_attn_window_size
    memo["layer_pairs", L] = tuple(chunk_pairs(L, C) if chunked and W is not None else attention_pairs(L, W)
                 for W in model.layer_windows())
    return memo["layer_pairs", L]


def _visible_prefix(mask: int, x: int) -> float:
    """Keys the first x queries of a layer see together: causal (mask 0), within a window of W (mask W > 0) or
    within chunks of C (mask -C)."""
    if mask > 0:
        return x * (x + 1) / 2 if x <= mask else mask * (mask + 1) / 2 + (x - mask) * mask
    if mask < 0:
        q, r = divmod(x, -mask)
        return q * -mask * (-mask + 1) / 2 + r * (r + 1) / 2
    return x * (x + 1) / 2


def busiest_context_shard(model: ModelConfig, L: int, cp: int) -> tuple[float, ...]:
    """Per layer, the busiest of cp contiguous shards' pairs over the mean shard's: a sequence split over the context
    axis without context_parallel_load_balance leaves its causal work to the later shards (the last of cp holds
    (2 cp - 1) / cp times the mean of a causal layer's pairs), and the step waits for the busiest; a window or chunk
    narrower than a shard leaves them near even."""
    memo = model_memo(model)
    if (hit := memo.get(("busiest_context_shard", L, cp))) is not None:
        return hit
    n = L // cp
    out = []
    for mask in attention_rule.layer_masks(model):
        shares = [_visible_prefix(mask, (k + 1) * n) - _visible_prefix(mask, k * n) for k in range(cp)]
        out.append(max(shares) / (sum(shares) / cp) if sum(shares) else 1.0)
    memo["busiest_context_shard", L, cp] = hit = tuple(out)
    return hit


# The tiles a flash kernel computes whole: splash attention's on TPU, each of its kernels its own (MaxText's keys: the
# forward sa_block_q x sa_block_kv, the dK/dV kernel sa_block_q_dkv x sa_block_kv_dkv, which the fused backward
# runs alone, the dQ kernel sa_block_q_dq x sa_block_kv_dq); the Pallas GPU kernel's 128 x 128 in all three (maxperf's
# models/layers/attention_kernels.py).
GPU_FLASH_BLOCK = 128
SPLASH_KERNEL_BLOCKS = {"forward": ("sa_block_q", "sa_block_kv"), "dkv": ("sa_block_q_dkv", "sa_block_kv_dkv"),
                        "dq": ("sa_block_q_dq", "sa_block_kv_dq")}


def flash_blocks(train: TrainConfig, platform: str, L: int, kernel: str = "forward") -> tuple[int, int]:
    """The (query, key) block a flash kernel ("forward", "dkv" or "dq": SPLASH_KERNEL_BLOCKS) computes whole on a
    platform kind."""
    if platform == "tpu":
        q, kv = SPLASH_KERNEL_BLOCKS[kernel]
        return min(getattr(train, q), L), min(getattr(train, kv), L)
    return min(GPU_FLASH_BLOCK, L), min(GPU_FLASH_BLOCK, L)


def block_pairs(L: int, mask: int, bq: int, bkv: int) -> float:
    """(query, key) pairs a flash kernel computes for one layer of L tokens: every block of bq queries by bkv keys
    that holds an unmasked pair, whole (it skips only the blocks its mask hides entirely). `mask` as
    attention_rule.layer_masks: 0 causal, W > 0 a window of W tokens, -C causal within chunks of C. A window narrower
    than a block computes whole blocks (gpt-oss's 128-token windows in 1024-wide blocks: 2 blocks of keys per block
    of queries, 16x the window's pairs)."""
    memo_key = (L, mask, bq, bkv)
    if (hit := _BLOCK_PAIRS.get(memo_key)) is not None:
        return hit
    total = 0
    for first in range(0, L, bq):
        last = min(L, first + bq) - 1
        if mask > 0:
            lo = max(0, first - mask + 1)
        elif mask < 0:
            lo = (first // -mask) * -mask
        else:
            lo = 0
        total += (last // bkv - lo // bkv + 1) * (last - first + 1) * bkv
    _BLOCK_PAIRS[memo_key] = float(total)
    return float(total)


_BLOCK_PAIRS: dict[tuple[int, int, int, int], float] = {}


def executed_pairs(model: ModelConfig, train: TrainConfig, L: int, platform: str, kernel: str = "forward"
                   ) -> tuple[float, ...]:
    """The pairs a flash kernel (flash_blocks) computes for each layer on a platform kind (block_pairs)."""
    bq, bkv = flash_blocks(train, platform, L, kernel)
    memo = model_memo(model)
    if (hit := memo.get(("executed_pairs", L, bq, bkv))) is None:
        hit = memo["executed_pairs", L, bq, bkv] = tuple(block_pairs(L, mask, bq, bkv)
                                                         for mask in attention_rule.layer_masks(model))
    return hit


def backward_block_matmuls(model: ModelConfig, train: TrainConfig, L: int, platform: str) -> tuple[float, ...]:
    """Per layer, the flash backward's matmuls times the pairs each computes (matmul-pairs): on TPU splash's dK/dV
    kernel over its own tiles, and unless sa_use_fused_bwd_kernel its dQ kernel over its own (a window narrower than
    a tile computes whole tiles, so gpt-oss's 128-token windows in the 2,048-wide backward tiles of its tpu-recipes
    run twice the forward's 1,024-wide pairs per query); on GPU one kernel over the forward's tiles."""
    if platform != "tpu" or train.sa_use_fused_bwd_kernel:
        dkv = executed_pairs(model, train, L, platform, "dkv")
        return tuple(FLASH_BACKWARD_MATMULS * p for p in dkv)
    dkv, dq = (executed_pairs(model, train, L, platform, k) for k in ("dkv", "dq"))
    m = SPLASH_SPLIT_KERNEL_MATMULS
    return tuple(m["dkv"] * a + m["dq"] * b for a, b in zip(dkv, dq))


@dataclass(frozen=True)
class FlopCounts:
    """FLOPs per device per step (forward + backward over all microbatches)."""

    tokens: int  # B x A x L: the step's A microbatches of B examples per device
    weight_flops: float  # 6 x tokens x active matmul weights (unembedding and router included)
    attention_flops: float  # causal / windowed score and context einsums, x 3
    model_flops: float  # weight_flops + attention_flops: what MFU divides
    attention_executed_flops: float  # the attention einsums as executed (see ATTENTION_SKIPS_MASKED), fwd + bwd
    recompute_flops: float  # the forward work the remat policy does again in the backward pass
    optimizer_flops: float  # AdamW on this device's parameter shard
    hardware_flops: float  # weight + executed attention + recompute + optimizer + expert padding + dispatch + embedding
    # the multi-token-prediction modules' share of model_flops (inside weight_flops and attention_flops), as MaxText
    # counts them: each module as one more decoder layer of the last layer's kind, its weights and attention
    mtp_flops: float = 0.0
    expert_padding_flops: float = 0.0  # routed-expert rows computed beyond top-k: the einsum dispatch's empty slots
    #                                    (negative where its capacity drops more than it pads)
    dispatch_flops: float = 0.0  # the einsum dispatch's one-hot dispatch and combine einsums, fwd + bwd
    embedding_flops: float = 0.0  # use_iota_embed's one-hot lookup matmul and the table's gradient


def attention_fwd_flops(model: ModelConfig, B: int, L: int, executed: bool, kernel: str = "dot_product") -> float:
    """Forward score (Q K^T) and context (P V) einsums over all layers: 2 x B x pairs x H x (Dq + Dv) per layer."""
    memo = model_memo(model)  # a search asks for the same batches at every mesh
    key = ("attention_fwd_flops", B, type(B), L, executed, kernel)  # an int B counts in ints
    if (flops := memo.get(key)) is not None:
        return flops
    H = model.num_heads
    Dq, Dv = head_dims(model)
    if executed and not ATTENTION_SKIPS_MASKED[kernel]:
        flops = model.num_layers * 2 * B * L * L * H * (Dq + Dv)
    else:
        flops = sum(2 * B * pairs * H * (Dq + Dv) for pairs in layer_pairs(model, L))
    memo[key] = flops
    return flops


def dispatch_einsum_fwd_flops(model: ModelConfig, moe: MoeShape, train: TrainConfig) -> float:
    """The einsum dispatch, per sequence and MoE layer: the dispatch einsum BLEC,BLD->BECD and the combine einsum
    BECD,BLEC->BLD each 2 x L x D x E x C (models/layers/moe.py dense_dispatch; MaxText's dense_matmul)."""
    return 2 * (2 * train.seq_len * model.d_model * moe.E * expert_capacity(moe, train))


# The dispatch einsums' backward: the dispatch mask is one-hot (no gradient), so the dispatch einsum's backward is
# one einsum (the inputs' gradient); the combine weights carry the router's gradient, so the combine's is two.
DISPATCH_BACKWARD_EINSUMS = 1
COMBINE_BACKWARD_EINSUMS = 2


def count_flops(model: ModelConfig, train: TrainConfig, params_per_device: float | None = None,
                kind: str = "gpu") -> FlopCounts:
    """`params_per_device`: the parameters this device's optimizer updates (its shard); all of them if None;
    `kind`: the chip kind, whose flash kernel's backward the executed FLOPs count (flash_backward_matmuls)."""
    # a step is A microbatches of B examples per device (MaxText's per_device_batch_size is one microbatch)
    B, L, N = train.per_device_batch_size * train.grad_accum_steps, train.seq_len, model.num_layers
    params = count_params(model)
    moe = moe_shape(model)
    n_moe = moe.moe_layers if moe else 0
    tokens = B * L
    # every forward matmul does 2 FLOPs per weight per token; the unembedding uses a D x V table, tied or not
    weight_fwd = 2 * tokens * params.active_layer_matmul + 2 * tokens * model.d_model * model.vocab_size
    attn_model_fwd = attention_fwd_flops(model, B, L, executed=False)
    kernel = attention_kernel(train)
    attn_exec_fwd = attention_fwd_flops(model, B, L, executed=True, kernel=kernel)
    # the backward: twice the forward for the dot product's einsums; flash recomputes the scores in its own
    # backward kernel (flash_backward_matmuls against the forward's two)
    flash_bwd = flash_backward_matmuls(train, kind) / 2
    attn_exec_bwd = attn_exec_fwd * (flash_bwd if kernel == "flash" else 2)
    # remat: the named projections and attention pieces the backward computes again (see `recomputed`); measured
    # here for full: tiny shape on v5p-8, scan_layers=false: XLA's extra FLOPs of full over none = 0.813e9 = this
    # count (tests/test_perfmodel_xla_flops.py)
    again = recomputed(model, train)
    per_token = projection_flops_per_token(model)
    recompute = (N - n_moe) * tokens * sum(per_token[n] for n in again if n in per_token)
    recompute += attn_exec_fwd * (("scores" in again) + ("context" in again)) / 2
    if train.num_vocab_tiling > 1:  # each chunk's logits computed again in the backward
        recompute += 2 * tokens * model.d_model * model.vocab_size
    padding = dispatched = 0.0
    if moe:
        rows = rows_per_token(moe, train)
        again_moe = recomputed(model, train, moe_layer=True)
        moe_token = projection_flops_per_token(model, rows, dispatch(train) == "sparse")
        recompute += n_moe * tokens * sum(moe_token[n] for n in again_moe if n in moe_token)
        padding = TRAIN_FACTOR * n_moe * 2 * tokens * (rows - moe.k) * mlp_params(model, moe.Fe)
        if dispatch(train) != "sparse":
            einsums = n_moe * B * dispatch_einsum_fwd_flops(model, moe, train)  # forward: dispatch + combine
            dispatched = einsums + einsums / 2 * (DISPATCH_BACKWARD_EINSUMS + COMBINE_BACKWARD_EINSUMS)
            recompute += einsums / 2 * ("dispatch" in again_moe)
    mtp = mtp_fwd_flops(model, train, B)
    weight_fwd += mtp.weights
    attn_model_fwd += mtp.attention
    attn_exec_fwd += mtp.attention_executed
    attn_exec_bwd += mtp.attention_executed * (flash_bwd if kernel == "flash" else 2)
    recompute += mtp.recompute
    shard = params.total if params_per_device is None else params_per_device
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * shard
    weight = TRAIN_FACTOR * weight_fwd
    # use_iota_embed: the lookup as a one-hot [tokens, V] by [V, D] matmul, and in the backward the table's gradient
    # (the tokens have none); executed, not model FLOPs (MaxText's count leaves the lookup out)
    embedding = 2 * 2 * tokens * model.vocab_size * model.d_model if model.use_iota_embed else 0.0
    return FlopCounts(
        tokens=tokens, weight_flops=weight, attention_flops=TRAIN_FACTOR * attn_model_fwd,
        model_flops=weight + TRAIN_FACTOR * attn_model_fwd,
        attention_executed_flops=attn_exec_fwd + attn_exec_bwd, recompute_flops=recompute, optimizer_flops=optimizer,
        hardware_flops=(weight + attn_exec_fwd + attn_exec_bwd + recompute + optimizer + padding + dispatched
                        + TRAIN_FACTOR * mtp.uncounted + embedding),
        mtp_flops=TRAIN_FACTOR * (mtp.weights + mtp.attention), expert_padding_flops=padding,
        dispatch_flops=dispatched, embedding_flops=embedding,
    )


@dataclass(frozen=True)
class MtpFlops:
    """Forward FLOPs per device of the multi-token-prediction modules (all mtp_num_layers of them)."""

    weights: float  # the decoder layer's matmuls (MaxText's mtp_weight_flops)
    attention: float  # its attention's score and context einsums, the causal share (MaxText's mtp_attn_flops)
    attention_executed: float  # those einsums as the kernel executes them
    recompute: float  # what the remat policy computes again of the layer in the backward
    uncounted: float  # the 2D x D projection and the shared head's D x V matmul, which MaxText leaves out


def mtp_fwd_flops(model: ModelConfig, train: TrainConfig, B: float) -> MtpFlops:
    """Each module costs one more decoder layer of the last layer's kind (a MoE layer at top-k, dropless) and its
    attention, as MaxText's calculate_tflops_training_per_device adds them (maxtext_utils.py, "MTP FLOPs"), over
    B x L tokens (B: the step's examples per device); the causal share by the last layer's mask (MaxText takes the
    full causal one, the same for DeepSeek's global layers). The projection and the head's logits are executed but
    not model FLOPs."""
    n = mtp_depths(model)
    if not n:
        return MtpFlops(0.0, 0.0, 0.0, 0.0, 0.0)
    L, D, H = train.seq_len, model.d_model, model.num_heads
    tokens = B * L
    moe = moe_shape(model)
    last_moe = bool(moe) and moe_layers_of(model)[-1]
    per_token = projection_flops_per_token(model, moe.k if last_moe else None, dispatch(train) == "sparse")
    wi = moe_wi(model, train) if last_moe else ("mlpwi_0", "mlpwi_1") if gated(model) else ("mlpwi",)
    names = ("query_proj", "key_proj", "value_proj", "out_proj", *wi, "mlpwo", *(("router",) if last_moe else ()))
    Dq, Dv = head_dims(model)
    kernel = attention_kernel(train)
    attention = 2 * B * layer_pairs(model, L)[-1] * H * (Dq + Dv)
    executed = attention if ATTENTION_SKIPS_MASKED[kernel] else 2 * B * L * L * H * (Dq + Dv)
    again = recomputed(model, train, moe_layer=last_moe)
    recompute = tokens * sum(per_token[name] for name in again if name in per_token)
    recompute += executed * (("scores" in again) + ("context" in again)) / 2
    return MtpFlops(weights=n * tokens * sum(per_token[name] for name in names), attention=n * attention,
                    attention_executed=n * executed, recompute=n * recompute,
                    uncounted=n * 2 * tokens * (2 * D * D + D * model.vocab_size))
