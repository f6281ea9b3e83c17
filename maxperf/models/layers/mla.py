"""Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", sections 2.1.2 and 2.1.3): queries and keys/values
through low-rank latents, and a RoPE key shared by all heads beside each head's position-free key.

R q_lora_rank (0: q straight from D), C kv_lora_rank, Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim,
Dq = Dn + Dr the query and key head dim. Every query head has its own key and value (K = H), so the kernels see
G = 1. Tensors carry MaxText's checkpoint names (layers/attention_mla.py): query_proj, key_proj and value_proj on
what the kernel takes, context on what it gives, out_proj on the output; its logical axes: the latent widths as the
model width (q_lora, kv_lora), heads over tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxperf.models.layers import kv_cache, offload, quantization
from maxperf.models.layers.attention_kernels import AttentionOptions, attend
from maxperf.models.layers.norms import RMSNorm
from maxperf.models.layers.params import param
from maxperf.models.layers.rope import apply_rope, inverse_frequencies, yarn_softmax_factor
from maxperf.models.sharding import constrain
from maxperf.spec.model import ModelConfig

HEADS = ("activation_batch", "activation_length", "activation_heads", None)
LATENT = ("activation_batch", "activation_length", None)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(Dq), times YaRN's factor where the model extends its context with YaRN (DeepSeek-V3's
    modeling_deepseek.py: softmax_scale = q_head_dim**-0.5 * mscale**2)."""
    if cfg.query_scale is not None:
        return cfg.query_scale
    return cfg.qk_head_dim**-0.5 * yarn_softmax_factor(cfg.rope_scaling)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: AttentionOptions = AttentionOptions()):
        D, H, R, C = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        Dn, Dr, Dv, Dq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
        self.cfg = cfg
        self.options = options
        if R:
            self.wq_a_DxR = param(rngs, (D, R), ("embed", None), dtype, fan_in=D)
            self.q_norm = RMSNorm(R, cfg.norm_eps, dtype, rngs)
            self.wq_b_RxHxDq = param(rngs, (R, H, Dq), ("q_lora", "heads", "head_dim"), dtype, fan_in=R)
        else:
            self.q_DxHxDq = param(rngs, (D, H, Dq), ("embed", "heads", "head_dim"), dtype, fan_in=D)
        # one matmul gives the kv latent and the shared RoPE key (MaxText's wkv_a, DeepSeek's kv_a_proj_with_mqa)
        self.wkv_a_DxE = param(rngs, (D, C + Dr), ("embed", None), dtype, fan_in=D)
        self.kv_norm = RMSNorm(C, cfg.norm_eps, dtype, rngs)
        self.wkv_b_CxHxE = param(rngs, (C, H, Dn + Dv), ("kv_lora", "heads", "head_dim"), dtype, fan_in=C)
        self.o_HxDvxD = param(rngs, (H, Dv, D), ("heads", "head_dim", "embed"), dtype, fan_in=H * Dv)

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, window: int | jax.Array,
                 rope: bool | jax.Array = True) -> jax.Array:
        """`window` and `rope` are taken for the decoder layer's signature: MLA layers attend to the whole causal
        prefix, always with their decoupled RoPE key (the config refuses RoPE-free layers with MLA)."""
        cfg, dtype = self.cfg, x_BxLxD.dtype
        B, L, _ = x_BxLxD.shape
        H, C, Dn, Dr, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        inv_freq = inverse_frequencies(Dr, cfg.rope_theta, cfg.rope_scaling)

        if cfg.q_lora_rank:
            cq_BxLxR = quantization.einsum("BLD,DR->BLR", x_BxLxD, self.wq_a_DxR[...].astype(dtype))
            cq_BxLxR = self.q_norm(constrain(cq_BxLxR, LATENT))
            q_BxLxHxDq = quantization.einsum("BLR,RHd->BLHd", cq_BxLxR, self.wq_b_RxHxDq[...].astype(dtype))
        else:
            q_BxLxHxDq = quantization.einsum("BLD,DHd->BLHd", x_BxLxD, self.q_DxHxDq[...].astype(dtype))
        q_BxLxHxDq = constrain(q_BxLxHxDq, HEADS)
        q_rope_BxLxHxDr = apply_rope(q_BxLxHxDq[..., Dn:], positions_BxL, inv_freq)
        q_BxLxHxDq = jnp.concatenate([q_BxLxHxDq[..., :Dn], q_rope_BxLxHxDr], axis=-1)
        q_BxLxHxDq = q_BxLxHxDq * jnp.asarray(softmax_scale(cfg), dtype)

        ckv_BxLxE = constrain(quantization.einsum("BLD,DE->BLE", x_BxLxD, self.wkv_a_DxE[...].astype(dtype)), LATENT)
        c_BxLxC = self.kv_norm(ckv_BxLxE[..., :C])
        k_rope_BxLx1xDr = apply_rope(ckv_BxLxE[:, :, None, C:], positions_BxL, inv_freq)
        if kv_cache.current() is not None:  # a serving step: the latents go to the cache
            mode, cache, index = kv_cache.cached_latent(c_BxLxC, k_rope_BxLx1xDr[:, :, 0], positions_BxL)
            if mode == kv_cache.DECODE:
                o_BxLxHxDv = kv_cache.latent_decode(q_BxLxHxDq[..., :Dn], q_BxLxHxDq[..., Dn:],
                                                    self.wkv_b_CxHxE[...].astype(dtype), Dn, cache, positions_BxL,
                                                    index)
                return quantization.einsum("BLHd,HdD->BLD", o_BxLxHxDv, self.o_HxDvxD[...].astype(dtype))
        kv_BxLxHxE = quantization.einsum("BLC,CHe->BLHe", c_BxLxC, self.wkv_b_CxHxE[...].astype(dtype))
        kv_BxLxHxE = constrain(kv_BxLxHxE, HEADS)
        k_BxLxHxDq = jnp.concatenate([kv_BxLxHxE[..., :Dn], jnp.broadcast_to(k_rope_BxLx1xDr, (B, L, H, Dr))],
                                     axis=-1)
        v_BxLxHxDv = kv_BxLxHxE[..., Dn:]

        q_BxLxHxDq = checkpoint_name(constrain(q_BxLxHxDq, HEADS), "query_proj")
        k_BxLxHxDq = checkpoint_name(constrain(k_BxLxHxDq, HEADS), "key_proj")
        v_BxLxHxDv = checkpoint_name(constrain(v_BxLxHxDv, HEADS), "value_proj")
        o_BxLxHx1xDv = attend(q_BxLxHxDq[:, :, :, None, :], k_BxLxHxDq, v_BxLxHxDv, 0, softcap=None,
                              options=self.options)
        o_BxLxHxDv = checkpoint_name(o_BxLxHx1xDv.reshape(B, L, H, Dv), "attention_out")
        out_BxLxD = quantization.einsum("BLHd,HdD->BLD", o_BxLxHxDv, self.o_HxDvxD[...].astype(dtype))
        return offload.residual(out_BxLxD, "out_proj")
