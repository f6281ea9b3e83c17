"""Multi-token prediction (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 2.2), as MaxText trains it
(layers/multi_token_prediction.py): `mtp_num_layers` modules in sequence after the decoder. Module k takes the
previous hidden state h (the decoder's last layer output, before its final norm, for k = 1) and the embeddings of the
tokens k ahead, normalizes each, concatenates [embedding; hidden] and projects 2D -> D, runs one decoder layer of the
decoder's last layer's kind (MoE in DeepSeek-V3), and predicts the token k + 1 ahead through its own final norm and
the model's shared output head. Training only: the module's loss joins the model's, the logits are the decoder's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.decoder import RESIDUAL, make_layer
from maxperf.models.layers.moe import MoEOptions
from maxperf.models.layers.norms import RMSNorm
from maxperf.models.layers.params import param
from maxperf.models.sharding import constrain
from maxperf.spec.model import ModelConfig


class MTPModule(nnx.Module):
    """One prediction depth: RMSNorms of the embedding and of the hidden state, their 2D x D projection, one decoder
    layer, and the RMSNorm before the shared head (MaxText's mtp_k_embedding_norm, _hidden_state_norm, _projection,
    _transformer_layer, _final_norm)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, attention: AttentionOptions, moe: MoEOptions):
        D, eps = cfg.d_model, cfg.norm_eps
        self.embedding_norm = RMSNorm(D, eps, dtype, rngs)
        self.hidden_norm = RMSNorm(D, eps, dtype, rngs)
        self.projection_2DxD = param(rngs, (2 * D, D), ("embed", None), dtype, fan_in=2 * D)
        self.layer = make_layer(cfg.moe_layers()[-1], cfg, dtype, rngs, attention, moe)
        self.final_norm = RMSNorm(D, eps, dtype, rngs)

    def project(self, h_BxLxD: jax.Array, e_BxLxD: jax.Array) -> jax.Array:
        """The decoder layer's input: W [RMSNorm(e); RMSNorm(h)] (MaxText's order: the embedding first)."""
        both_BxLx2D = jnp.concatenate([self.embedding_norm(e_BxLxD), self.hidden_norm(h_BxLxD)], axis=-1)
        x_BxLxD = jnp.einsum("BLC,CD->BLD", both_BxLx2D, self.projection_2DxD[...].astype(both_BxLx2D.dtype))
        return constrain(x_BxLxD, RESIDUAL)


def shift_left(x_BxL: jax.Array) -> jax.Array:
    """Each row one position to the left, the last position 0 (MaxText's roll_and_mask)."""
    rolled_BxL = jnp.roll(x_BxL, -1, axis=1)
    last_1xL = (jnp.arange(x_BxL.shape[1]) == x_BxL.shape[1] - 1)[None, :]
    return jnp.where(last_1xL, jnp.zeros((), x_BxL.dtype), rolled_BxL)
