"""Causal self-attention with grouped-query heads, rotary positions, sliding windows, QK-norm and soft-capping.

Tensors carry MaxText's checkpoint names (query_proj, key_proj, value_proj, context, out_proj), which the remat
policies save or offload by name; the scores themselves are computed by the kernel `attention=` picks
(layers/attention_kernels.py). `make_attention` gives a decoder layer its block: this one, or multi-head latent
attention (layers/mla.py) for attention_type=mla."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxperf.models.config import AttentionType, ModelConfig, Positions
from maxperf.models.layers.attention_kernels import AttentionOptions, attend
from maxperf.models.layers.mla import LatentAttention
from maxperf.models.layers.norms import RMSNorm
from maxperf.models.layers.params import param
from maxperf.models.layers.rope import apply_rope, inverse_frequencies
from maxperf.models.sharding import constrain

class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: AttentionOptions = AttentionOptions()):
        D, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.options = options
        self.windows = tuple(sorted({w or 0 for w in cfg.layer_windows()}))
        if cfg.fused_qkv:
            # one [D, K, G + 2, Dh] weight: each kv head beside its G query heads, its key and its value, so that
            # splitting the fused output stays within each tensor shard (MaxText splits its [D, H + 2K, Dh] in a
            # shard_map for the same reason)
            self.qkv_DxKxExDh = param(rngs, (D, K, cfg.kv_groups + 2, Dh), ("embed", "kv_heads", None, "head_dim"),
                                      dtype, fan_in=D)
        else:
            self.q_DxHxDh = param(rngs, (D, H, Dh), ("embed", "heads", "head_dim"), dtype, fan_in=D)
            self.k_DxKxDh = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), dtype, fan_in=D)
            self.v_DxKxDh = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), dtype, fan_in=D)
        self.o_HxDhxD = param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), dtype, fan_in=H * Dh)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.norm_eps, dtype, rngs)
            self.k_norm = RMSNorm(Dh, cfg.norm_eps, dtype, rngs)

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, window: int | jax.Array) -> jax.Array:
        cfg, dtype = self.cfg, x_BxLxD.dtype
        B, L, _ = x_BxLxD.shape
        K, G, Dh = cfg.num_kv_heads, cfg.kv_groups, cfg.head_dim
        if cfg.fused_qkv:
            qkv_BxLxKxExDh = jnp.einsum("BLD,DKed->BLKed", x_BxLxD, self.qkv_DxKxExDh[...].astype(dtype))
            qkv_BxLxKxExDh = constrain(qkv_BxLxKxExDh, ("activation_batch", "activation_length",
                                                        "activation_kv_heads", None, None))
            qkv_BxLxKxExDh = checkpoint_name(qkv_BxLxKxExDh, "qkv_proj")
            q_BxLxHxDh = qkv_BxLxKxExDh[:, :, :, :G].reshape(B, L, cfg.num_heads, Dh)
            k_BxLxKxDh, v_BxLxKxDh = qkv_BxLxKxExDh[:, :, :, G], qkv_BxLxKxExDh[:, :, :, G + 1]
        else:
            q_BxLxHxDh = jnp.einsum("BLD,DHd->BLHd", x_BxLxD, self.q_DxHxDh[...].astype(dtype))
            k_BxLxKxDh = jnp.einsum("BLD,DKd->BLKd", x_BxLxD, self.k_DxKxDh[...].astype(dtype))
            v_BxLxKxDh = jnp.einsum("BLD,DKd->BLKd", x_BxLxD, self.v_DxKxDh[...].astype(dtype))
            q_BxLxHxDh = constrain(q_BxLxHxDh, ("activation_batch", "activation_length", "activation_heads", None))
            k_BxLxKxDh = constrain(k_BxLxKxDh, ("activation_batch", "activation_length", "activation_kv_heads", None))
            v_BxLxKxDh = constrain(v_BxLxKxDh, ("activation_batch", "activation_length", "activation_kv_heads", None))
        if cfg.qk_norm:
            q_BxLxHxDh, k_BxLxKxDh = self.q_norm(q_BxLxHxDh), self.k_norm(k_BxLxKxDh)
        if cfg.positions is Positions.ROPE:
            inv_freq = inverse_frequencies(Dh, cfg.rope_theta, cfg.rope_scaling)
            q_BxLxHxDh = apply_rope(q_BxLxHxDh, positions_BxL, inv_freq)
            k_BxLxKxDh = apply_rope(k_BxLxKxDh, positions_BxL, inv_freq)
        # named where MaxText names them (layers/attentions.py): the kernel's inputs, after the norms and RoPE, the
        # fused projection too; a policy that saves or offloads them spares the backward the projections and RoPE
        q_BxLxHxDh = checkpoint_name(q_BxLxHxDh, "query_proj")
        k_BxLxKxDh = checkpoint_name(k_BxLxKxDh, "key_proj")
        v_BxLxKxDh = checkpoint_name(v_BxLxKxDh, "value_proj")
        scale = cfg.query_scale if cfg.query_scale is not None else Dh**-0.5
        q_BxLxKxGxDh = (q_BxLxHxDh * jnp.asarray(scale, dtype)).reshape(B, L, K, G, Dh)
        o_BxLxKxGxDh = attend(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, window, softcap=cfg.attn_logit_softcap,
                              options=self.options, windows=self.windows)
        o_BxLxHxDh = o_BxLxKxGxDh.reshape(B, L, cfg.num_heads, Dh)
        o_BxLxHxDh = checkpoint_name(o_BxLxHxDh, "context")
        out_BxLxD = jnp.einsum("BLHd,HdD->BLD", o_BxLxHxDh, self.o_HxDhxD[...].astype(dtype))
        return checkpoint_name(out_BxLxD, "out_proj")


def make_attention(cfg: ModelConfig, dtype, rngs: nnx.Rngs,
                   options: AttentionOptions = AttentionOptions()) -> Attention | LatentAttention:
    """A decoder layer's attention block: latent attention for attention_type=mla, else grouped-query attention."""
    if cfg.attention_type is AttentionType.MLA:
        return LatentAttention(cfg, dtype, rngs, options)
    return Attention(cfg, dtype, rngs, options)
