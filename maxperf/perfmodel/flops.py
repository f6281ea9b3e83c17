"""Parameter counts and FLOPs per device per step.

Parameters match the Flax model's shapes exactly (maxperf.models.layers): per layer q D x H x Dh, k and v D x K x Dh,
o H x Dh x D, MLP gate/up D x F and down F x D (no gate for GELU), two norms (four with post-norms) of D (LayerNorm
has a scale and a bias, RMSNorm a scale), QK-norm two RMSNorm scales of Dh; a final norm; the embedding V x D; the
unembedding D x V unless tied; learned positions max_position x D. No biases.

Model FLOPs follow MaxText's `calculate_tflops_training_per_device` (maxtext_utils.py): 6 x tokens x matmul weights
(the unembedding included, the embedding lookup not), plus attention 4 x B x L^2 x H x Dh x 3 halved for the causal
mask, remat excluded; Megatron (Narayanan et al. 2021, eq. 3) counts the same terms. Per device means per
`per_device_batch_size` B (MaxText's convention: global batch = B x devices).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from maxperf import attention_rule  # plain Python: the kernel rule the model applies
from maxperf.perfmodel.shapes import ModelShape, TrainShape, check_model, check_train

# Training costs forward + backward = 3 x forward: the backward computes grads w.r.t. inputs and weights, each as
# many FLOPs as the forward (Kaplan et al. 2020, sec. 2.1; Narayanan et al. 2021).
TRAIN_FACTOR = 3
# attention=dot_product materializes the full [L, L] score matrix and masks it (models/layers/attention_kernels.py),
# so the hardware executes all L^2 scores however causal or windowed the mask; the flash kernels of TPU (splash) and
# GPU (Pallas) skip the blocks the mask hides, so they execute the masked share only (to within their diagonal
# blocks); the CPU's blockwise kernel masks every block like the dot product (steptime handles CPUs).
ATTENTION_SKIPS_MASKED = {"dot_product": False, "flash": True}
# Flash attention's backward runs five matmuls per score block (the scores again, dV, dP, dQ, dK: Dao et al. 2022,
# algorithm 2) against the forward's two.
FLASH_BACKWARD_MATMULS = 5

# MaxText's remat policies (layers/decoders.py get_remat_policy): the checkpoint names each keeps on device and
# offloads to host memory; the same table as maxperf.models.config.REMAT_SAVED (perfmodel imports nothing of models).
CHECKPOINT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj", "context", "out_proj",
                    "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
REMAT_SAVED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "minimal": (_MINIMAL, ()),
    "minimal_with_context": ((*_MINIMAL, "context"), ()),
    "save_dot_with_context_except_mlp": ((*_QKV, "context", "out_proj"), ()),
    "save_dot_except_mlpwi": ((*_QKV, "out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": ((*_QKV, "out_proj"), ()),
    "save_qkv_proj": (_QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "qkv_proj_offloaded": ((), ("query_proj", "value_proj", "key_proj")),
    "minimal_offloaded": ((), _MINIMAL),
    "full": ((), ()),
}
# remat_policy=custom: each name's key (remat, device, offload) and MaxText's default for it
CUSTOM_DEFAULT = {name: ("device" if name == "decoder_layer_input" else "remat") for name in CHECKPOINT_NAMES}


def remat_names(train: TrainShape, policy: str | None = None) -> tuple[frozenset[str], frozenset[str]] | None:
    """(names kept on device, names offloaded) under the step's remat policy (or `policy`, with the step's custom
    keys); None for `none` (no remat)."""
    policy = str(train.remat_policy) if policy is None else policy
    if policy == "none":
        return None
    if policy == "custom":
        where = {n: str(getattr(train, n, CUSTOM_DEFAULT[n])) for n in CHECKPOINT_NAMES}
        return (frozenset(n for n, w in where.items() if w == "device"),
                frozenset(n for n, w in where.items() if w == "offload"))
    saved, offloaded = REMAT_SAVED[policy]
    return frozenset(saved), frozenset(offloaded)


def attention_kernel(train: TrainShape) -> str:
    """"flash" or "dot_product": `auto` is flash (splash on TPU, Pallas on GPU, blockwise on CPU), as MaxText picks;
    `resolve_attention` first turns it into the dot product where the platform's flash cannot serve the setting."""
    return "dot_product" if str(getattr(train, "attention", "auto")) == "dot_product" else "flash"


def resolve_attention(model: ModelShape, train: TrainShape, platform: str) -> TrainShape:
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


def recomputed(model: ModelShape, train: TrainShape) -> frozenset[str]:
    """The forward pieces the backward pass computes again under the remat policy: the projections "query_proj",
    "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1" (or "mlpwi"), "mlpwo", and the attention's "scores"
    (Q K^T and softmax) and "context" (P V; with flash, the whole forward kernel).

    What the backward reads: the attention backward q, k, v and (flash) the kernel's residuals, named "context", or
    (dot product) the probabilities, which no policy names; the output projection's weight gradient the context;
    the MLP block's norm the residual stream after attention, so the output projection; the MLP's backward its
    wi outputs; only a post-norm (Gemma 2) reads the wo output. XLA drops recomputation nothing reads (measured
    here: full remat recomputes no MLP down projection, tests/test_perfmodel_xla_flops.py)."""
    names = remat_names(train)
    if names is None:
        return frozenset()
    kept = names[0] | names[1]
    if "qkv_proj" in kept and getattr(model, "fused_qkv", False):
        kept |= {"query_proj", "key_proj", "value_proj"}
    if "mlpwi" in kept and getattr(model, "fused_mlp", False):  # a gated MLP's gate and up, fused
        kept |= {"mlpwi_0", "mlpwi_1"}
    wi = ("mlpwi_0", "mlpwi_1") if gated(model) else ("mlpwi",)
    out = {n for n in ("query_proj", "key_proj", "value_proj", "out_proj", *wi) if n not in kept}
    if model.post_norms and "mlpwo" not in kept:
        out.add("mlpwo")
    if "context" not in kept:
        out.add("context")
    if attention_kernel(train) == "dot_product" or "context" not in kept:
        out.add("scores")
    return frozenset(out)


def projection_flops_per_token(model: ModelShape) -> dict[str, float]:
    """Forward FLOPs per token of each named projection of one layer."""
    D, H, K, Dh, F = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim, model.d_ff
    return {"query_proj": 2 * D * H * Dh, "key_proj": 2 * D * K * Dh, "value_proj": 2 * D * K * Dh,
            "out_proj": 2 * H * Dh * D, "mlpwi_0": 2 * D * F, "mlpwi_1": 2 * D * F, "mlpwi": 2 * D * F,
            "mlpwo": 2 * F * D}
# AdamW elementwise work per parameter (optax.adamw): m update 3, v update 4, bias corrections 2, sqrt+eps+divide 3,
# weight decay 2, learning-rate scale and apply 2; the global-norm clip adds 3 (square, sum, scale).
OPTIMIZER_FLOPS_PER_PARAM = 19


def norm_params(model: ModelShape) -> int:
    """One norm of width D: LayerNorm has scale and bias, RMSNorm a scale only."""
    return (2 if str(model.norm) == "layernorm" else 1) * model.d_model


def gated(model: ModelShape) -> bool:
    return str(model.activation) != "gelu"


def layer_matmul_params(model: ModelShape) -> int:
    """The weights of one layer that enter matmuls: q, k, v, o and the MLP."""
    D, H, K, Dh, F = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim, model.d_ff
    return D * H * Dh + 2 * D * K * Dh + H * Dh * D + (3 if gated(model) else 2) * D * F


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # token table (+ learned position table)
    unembedding: int  # D x V when untied, else 0 (the embedding table serves)
    per_layer: int  # matmul weights and norms of one decoder layer
    layer_matmul: int  # matmul weights of one decoder layer
    final_norm: int

    @property
    def non_embedding(self) -> int:
        """Parameters outside the embedding, position and unembedding tables (Kaplan et al. 2020's N)."""
        return self.total - self.embedding - self.unembedding


def count_params(model: ModelShape) -> ParamCounts:
    check_model(model)
    V, D, N, Dh = model.vocab_size, model.d_model, model.num_layers, model.head_dim
    per_norm = norm_params(model)
    layer_norms = (4 if model.post_norms else 2) * per_norm + (2 * Dh if model.qk_norm else 0)  # QK-norm: RMSNorm
    matmul = layer_matmul_params(model)
    per_layer = matmul + layer_norms
    embedding = V * D + (model.max_position * D if str(model.positions) == "learned" else 0)
    unembedding = 0 if model.tie_embeddings else D * V
    total = embedding + unembedding + N * per_layer + per_norm
    return ParamCounts(total=total, embedding=embedding, unembedding=unembedding, per_layer=per_layer,
                       layer_matmul=matmul, final_norm=per_norm)


def attention_pairs(L: int, W: int | None) -> float:
    """(query, key) pairs a causal layer attends to, MaxText's way: L^2 / 2 for a full causal mask (not L(L+1)/2),
    and L*W - W^2/2 for a window W < L (the same area: a band of width W below the diagonal)."""
    w = L if W is None else min(W, L)
    return L * w - w * w / 2


@dataclass(frozen=True)
class FlopCounts:
    """FLOPs per device per step (forward + backward over all microbatches)."""

    tokens: int  # B x L
    weight_flops: float  # 6 x tokens x matmul weights (unembedding included)
    attention_flops: float  # causal / windowed score and context einsums, x 3
    model_flops: float  # weight_flops + attention_flops: what MFU divides
    attention_executed_flops: float  # the attention einsums as executed (see ATTENTION_SKIPS_MASKED), fwd + bwd
    recompute_flops: float  # the forward work the remat policy does again in the backward pass
    optimizer_flops: float  # AdamW on this device's parameter shard
    hardware_flops: float  # weight + executed attention + recompute + optimizer


def attention_fwd_flops(model: ModelShape, B: int, L: int, executed: bool, kernel: str = "dot_product") -> float:
    """Forward score (Q K^T) and context (P V) einsums over all layers: 2 x 2 x B x pairs x H x Dh per layer."""
    H, Dh = model.num_heads, model.head_dim
    if executed and not ATTENTION_SKIPS_MASKED[kernel]:
        return model.num_layers * 4 * B * L * L * H * Dh
    return sum(4 * B * attention_pairs(L, W) * H * Dh for W in model.layer_windows())


def count_flops(model: ModelShape, train: TrainShape, params_per_device: float | None = None) -> FlopCounts:
    """`params_per_device`: the parameters this device's optimizer updates (its shard); all of them if None."""
    check_model(model)
    check_train(train)
    B, L, N = train.per_device_batch_size, train.seq_len, model.num_layers
    params = count_params(model)
    tokens = B * L
    # every forward matmul does 2 FLOPs per weight per token; the unembedding uses a D x V table, tied or not
    layer_weight_fwd = 2 * tokens * params.layer_matmul
    weight_fwd = N * layer_weight_fwd + 2 * tokens * model.d_model * model.vocab_size
    attn_model_fwd = attention_fwd_flops(model, B, L, executed=False)
    kernel = attention_kernel(train)
    attn_exec_fwd = attention_fwd_flops(model, B, L, executed=True, kernel=kernel)
    # the backward: twice the forward for the dot product's einsums; flash recomputes the scores in its own
    # backward kernel (FLASH_BACKWARD_MATMULS against the forward's two)
    attn_exec_bwd = attn_exec_fwd * (FLASH_BACKWARD_MATMULS / 2 if kernel == "flash" else 2)
    # remat: the named projections and attention pieces the backward computes again (see `recomputed`); measured
    # here for full: tiny shape on v5p-8, scan_layers=false: XLA's extra FLOPs of full over none = 0.813e9 = this
    # count (tests/test_perfmodel_xla_flops.py)
    again = recomputed(model, train)
    per_token = projection_flops_per_token(model)
    recompute = N * tokens * sum(per_token[n] for n in again if n in per_token)
    recompute += attn_exec_fwd * (("scores" in again) + ("context" in again)) / 2
    if getattr(train, "num_vocab_tiling", 1) > 1:  # each chunk's logits computed again in the backward
        recompute += 2 * tokens * model.d_model * model.vocab_size
    shard = params.total if params_per_device is None else params_per_device
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * shard
    weight = TRAIN_FACTOR * weight_fwd
    return FlopCounts(
        tokens=tokens, weight_flops=weight, attention_flops=TRAIN_FACTOR * attn_model_fwd,
        model_flops=weight + TRAIN_FACTOR * attn_model_fwd,
        attention_executed_flops=attn_exec_fwd + attn_exec_bwd, recompute_flops=recompute, optimizer_flops=optimizer,
        hardware_flops=weight + attn_exec_fwd + attn_exec_bwd + recompute + optimizer,
    )
