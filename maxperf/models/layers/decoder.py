"""Decoder layers, by kind. Mixture-of-experts and latent-attention layers register here beside the dense one."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxperf.models.config import LayerKind, ModelConfig
from maxperf.models.layers.attention import make_attention
from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.mlp import MLP
from maxperf.models.layers.norms import make_norm
from maxperf.models.sharding import constrain

RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


class DenseDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals; Gemma 2 also normalizes each block's output."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: AttentionOptions = AttentionOptions()):
        D, eps = cfg.d_model, cfg.norm_eps
        self.attn_norm = make_norm(cfg.norm, D, eps, dtype, rngs)
        self.attention = make_attention(cfg, dtype, rngs, options)
        self.mlp_norm = make_norm(cfg.norm, D, eps, dtype, rngs)
        self.mlp = MLP(D, cfg.d_ff, cfg.activation, dtype, rngs, fused=cfg.fused_mlp)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.attn_post_norm = make_norm(cfg.norm, D, eps, dtype, rngs)
            self.mlp_post_norm = make_norm(cfg.norm, D, eps, dtype, rngs)

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, window: jax.Array) -> jax.Array:
        x_BxLxD = checkpoint_name(x_BxLxD, "decoder_layer_input")
        h_BxLxD = self.attention(self.attn_norm(x_BxLxD), positions_BxL, window)
        if self.post_norms:
            h_BxLxD = self.attn_post_norm(h_BxLxD)
        x_BxLxD = constrain(x_BxLxD + h_BxLxD, RESIDUAL)
        h_BxLxD = self.mlp(self.mlp_norm(x_BxLxD))
        if self.post_norms:
            h_BxLxD = self.mlp_post_norm(h_BxLxD)
        return constrain(x_BxLxD + h_BxLxD, RESIDUAL)


LAYERS: dict[LayerKind, type[nnx.Module]] = {LayerKind.DENSE: DenseDecoderLayer}
