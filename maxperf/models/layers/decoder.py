"""Decoder layers: attention and a feed-forward block, a dense MLP or a mixture of experts (`ModelConfig.moe_layers`
says which layers have which). Latent attention comes in through `make_attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.layers import offload
from maxperf.models.layers.attention import make_attention
from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.mlp import MLP
from maxperf.models.layers.moe import MoE, MoEOptions
from maxperf.models.layers.norms import make_norm
from maxperf.models.sharding import constrain
from maxperf.spec.model import ModelConfig

RESIDUAL = ("activation_batch", "activation_length", "activation_embed")
# the residual stream outside the decoder's layers (the embeddings, the final norm, the logits' input): its batch
# over the pipeline's stages too, which hold no layers there (MaxText's activation_embed_and_logits_batch); the
# same as RESIDUAL without a pipeline
OUTER_RESIDUAL = ("activation_embed_and_logits_batch", "activation_length", "activation_embed")


def norm_axis(cfg: ModelConfig) -> str:
    """The logical axis of the model's D-wide norm scales."""
    return "norm_fsdp" if cfg.norm_fsdp else "norm"


class DenseDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals; Gemma 2 also normalizes each block's output."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: AttentionOptions = AttentionOptions()):
        D, eps, axis = cfg.d_model, cfg.norm_eps, norm_axis(cfg)
        self.attn_norm = make_norm(cfg.norm, D, eps, dtype, rngs, axis)
        self.attention = make_attention(cfg, dtype, rngs, options)
        self.mlp_norm = make_norm(cfg.norm, D, eps, dtype, rngs, axis)
        self.mlp = self._feed_forward(cfg, dtype, rngs)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.attn_post_norm = make_norm(cfg.norm, D, eps, dtype, rngs, axis)
            self.mlp_post_norm = make_norm(cfg.norm, D, eps, dtype, rngs, axis)

    def _feed_forward(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return MLP(cfg.d_model, cfg.d_ff, cfg.activation, dtype, rngs, fused=cfg.fused_mlp,
                   limit=cfg.mlp_activations_limit)

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, window: jax.Array, rope=True) -> jax.Array:
        return self.with_aux(x_BxLxD, positions_BxL, window, rope)[0]

    def with_aux(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, window, rope=True) -> tuple[jax.Array, jax.Array]:
        """The layer's output and its auxiliary loss (the router's load-balancing loss; 0 for a dense MLP).
        `window` is the layer's mask (attention_rule.layer_masks), `rope` whether it applies RoPE."""
        x_BxLxD = offload.residual(x_BxLxD, "decoder_layer_input")
        h_BxLxD = self.attention(self.attn_norm(x_BxLxD), positions_BxL, window, rope)
        if self.post_norms:
            h_BxLxD = self.attn_post_norm(h_BxLxD)
        x_BxLxD = constrain(x_BxLxD + h_BxLxD, RESIDUAL)
        h_BxLxD = self.mlp(self.mlp_norm(x_BxLxD))
        h_BxLxD, aux = h_BxLxD if isinstance(h_BxLxD, tuple) else (h_BxLxD, jnp.zeros((), jnp.float32))
        if self.post_norms:
            h_BxLxD = self.mlp_post_norm(h_BxLxD)
        return constrain(x_BxLxD + h_BxLxD, RESIDUAL), aux


class MoEDecoderLayer(DenseDecoderLayer):
    """The dense layer with a mixture of experts in place of its MLP."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: AttentionOptions = AttentionOptions(),
                 moe: MoEOptions = MoEOptions()):
        self.moe_options = moe
        super().__init__(cfg, dtype, rngs, options)

    def _feed_forward(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return MoE(cfg, dtype, rngs, self.moe_options)


class DecoderBlock(nnx.Module):
    """Consecutive layers scanned as one step where dense and MoE layers interleave (Llama 4 Maverick: a dense
    layer, then an MoE one)."""

    def __init__(self, pattern: tuple[bool, ...], cfg: ModelConfig, dtype, rngs: nnx.Rngs,
                 options: AttentionOptions = AttentionOptions(), moe: MoEOptions = MoEOptions()):
        self.layers = nnx.List([make_layer(is_moe, cfg, dtype, rngs, options, moe) for is_moe in pattern])

    def with_aux(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, windows, ropes) -> tuple[jax.Array, jax.Array]:
        aux = jnp.zeros((), jnp.float32)
        for i, layer in enumerate(self.layers):
            x_BxLxD, a = layer.with_aux(x_BxLxD, positions_BxL, windows[i], ropes[i])
            aux = aux + a
        return x_BxLxD, aux


def make_layer(is_moe: bool, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: AttentionOptions = AttentionOptions(),
               moe: MoEOptions = MoEOptions()) -> DenseDecoderLayer:
    if is_moe:
        return MoEDecoderLayer(cfg, dtype, rngs, options, moe)
    return DenseDecoderLayer(cfg, dtype, rngs, options)
