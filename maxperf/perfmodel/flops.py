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

from dataclasses import dataclass

from maxperf.perfmodel.shapes import ModelShape, TrainShape, check_model, check_train

# Training costs forward + backward = 3 x forward: the backward computes grads w.r.t. inputs and weights, each as
# many FLOPs as the forward (Kaplan et al. 2020, sec. 2.1; Narayanan et al. 2021).
TRAIN_FACTOR = 3
# The model's attention materializes the full [L, L] score matrix and masks it (models/layers/attention.py), so
# the hardware executes all L^2 scores however causal or windowed the mask; a flash/splash kernel that skips
# masked blocks would set this to True.
ATTENTION_SKIPS_MASKED = False
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
    attention_executed_flops: float  # the attention einsums as executed (see ATTENTION_SKIPS_MASKED), x 3
    recompute_flops: float  # the forward work the remat policy does again in the backward pass
    optimizer_flops: float  # AdamW on this device's parameter shard
    hardware_flops: float  # weight + executed attention + recompute + optimizer


def attention_fwd_flops(model: ModelShape, B: int, L: int, executed: bool) -> float:
    """Forward score (Q K^T) and context (P V) einsums over all layers: 2 x 2 x B x pairs x H x Dh per layer."""
    H, Dh = model.num_heads, model.head_dim
    if executed and not ATTENTION_SKIPS_MASKED:
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
    attn_exec_fwd = attention_fwd_flops(model, B, L, executed=True)
    remat = str(train.remat_policy)
    if remat == "full":  # nothing saved: the layer's forward again, but for its last matmul (the MLP down
        # projection), whose output the backward never reads: XLA removes it as dead code. Measured here: tiny
        # shape on v5p-8, scan_layers=false: XLA's extra FLOPs of full over none = 0.813e9 = this count
        # (tests/test_perfmodel_xla_flops.py)
        recompute = N * (layer_weight_fwd - 2 * tokens * model.d_model * model.d_ff) + attn_exec_fwd
    elif remat == "minimal":  # weight-matmul outputs saved (dots without batch dims); attention einsums redone
        recompute = attn_exec_fwd
    else:
        recompute = 0.0
    shard = params.total if params_per_device is None else params_per_device
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * shard
    weight = TRAIN_FACTOR * weight_fwd
    return FlopCounts(
        tokens=tokens, weight_flops=weight, attention_flops=TRAIN_FACTOR * attn_model_fwd,
        model_flops=weight + TRAIN_FACTOR * attn_model_fwd,
        attention_executed_flops=TRAIN_FACTOR * attn_exec_fwd, recompute_flops=recompute, optimizer_flops=optimizer,
        hardware_flops=weight + TRAIN_FACTOR * attn_exec_fwd + recompute + optimizer,
    )
