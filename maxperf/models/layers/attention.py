"""Causal self-attention with grouped-query heads, rotary positions, sliding windows and chunks, QK-norm,
soft-capping, and the pieces of Llama 4 (RoPE-free global layers, L2 QK-norm, attention temperature tuning), gpt-oss
(projection biases, attention sinks) and Gemma 3 (a RoPE base of the local layers' own).

Tensors carry MaxText's checkpoint names (query_proj, key_proj, value_proj, context, out_proj), which the remat
policies save or offload by name; the scores themselves are computed by the kernel `attention=` picks
(layers/attention_kernels.py). `make_attention` gives a decoder layer its block: this one, or multi-head latent
attention (layers/mla.py) for attention_type=mla."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxperf.models.layers import kv_cache, offload, quantization
from maxperf.models.layers.attention_kernels import AttentionOptions, attend
from maxperf.models.layers.mla import LatentAttention
from maxperf.models.layers.norms import RMSNorm
from maxperf.models.layers.params import param
from maxperf.models.layers.rope import apply_rope, inverse_frequencies
from maxperf.models.sharding import constrain
from maxperf.spec import attention_rule
from maxperf.spec.model import AttentionType, ModelConfig, Positions


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: AttentionOptions = AttentionOptions()):
        D, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.options = options
        self.windows = attention_rule.windows_of(cfg)
        # MaxText's attentions.py (init_query_w) folds 1/sqrt(Dh) into the query weights' initialization, unless QK
        # norms or a query_pre_attn_scalar set the scale; the step itself then scales nothing
        self.scale_at_init = not (cfg.qk_norm or cfg.qk_l2_norm) and cfg.query_scale is None
        gain = Dh**-0.5 if self.scale_at_init else 1.0
        if cfg.fused_qkv:
            # one [D, K, G + 2, Dh] weight: each kv head beside its G query heads, its key and its value, so that
            # splitting the fused output stays within each tensor shard (MaxText splits its [D, H + 2K, Dh] in a
            # shard_map for the same reason)
            self.qkv_DxKxExDh = param(rngs, (D, K, cfg.kv_groups + 2, Dh), ("embed", "kv_heads", None, "head_dim"),
                                      dtype, fan_in=D)
            gains_E = jnp.asarray([gain] * cfg.kv_groups + [1.0, 1.0], jnp.float32)
            self.qkv_DxKxExDh[...] = (self.qkv_DxKxExDh[...] * gains_E[None, None, :, None]).astype(dtype)
        else:
            self.q_DxHxDh = param(rngs, (D, H, Dh), ("embed", "heads", "head_dim"), dtype, fan_in=D, gain=gain)
            self.k_DxKxDh = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), dtype, fan_in=D)
            self.v_DxKxDh = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), dtype, fan_in=D)
        self.o_HxDhxD = param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), dtype, fan_in=H * Dh)
        if cfg.attention_bias:
            self.q_bias_HxDh = param(rngs, (H, Dh), ("heads", "head_dim"), dtype, init="zeros")
            self.k_bias_KxDh = param(rngs, (K, Dh), ("kv_heads", "head_dim"), dtype, init="zeros")
            self.v_bias_KxDh = param(rngs, (K, Dh), ("kv_heads", "head_dim"), dtype, init="zeros")
            self.o_bias_D = param(rngs, (D,), ("embed",), dtype, init="zeros")
        if cfg.attention_sinks:
            self.sinks_H = param(rngs, (H,), ("heads",), dtype, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.norm_eps, dtype, rngs)
            self.k_norm = RMSNorm(Dh, cfg.norm_eps, dtype, rngs)

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, window: int | jax.Array,
                 rope: bool | jax.Array = True) -> jax.Array:
        """`window`: the layer's mask (attention_rule.layer_masks); `rope`: whether the layer applies RoPE (False on
        Llama 4's RoPE-free layers); either a Python value, or traced where layers of a scanned stack differ."""
        cfg, dtype = self.cfg, x_BxLxD.dtype
        B, L, _ = x_BxLxD.shape
        K, G, Dh = cfg.num_kv_heads, cfg.kv_groups, cfg.head_dim
        if cfg.fused_qkv:
            qkv_BxLxKxExDh = quantization.einsum("BLD,DKed->BLKed", x_BxLxD, self.qkv_DxKxExDh[...].astype(dtype))
            qkv_BxLxKxExDh = constrain(qkv_BxLxKxExDh, ("activation_batch", "activation_length",
                                                        "activation_kv_heads", None, None))
            qkv_BxLxKxExDh = checkpoint_name(qkv_BxLxKxExDh, "qkv_proj")
            q_BxLxHxDh = qkv_BxLxKxExDh[:, :, :, :G].reshape(B, L, cfg.num_heads, Dh)
            k_BxLxKxDh, v_BxLxKxDh = qkv_BxLxKxExDh[:, :, :, G], qkv_BxLxKxExDh[:, :, :, G + 1]
        else:
            q_BxLxHxDh = quantization.einsum("BLD,DHd->BLHd", x_BxLxD, self.q_DxHxDh[...].astype(dtype))
            k_BxLxKxDh = quantization.einsum("BLD,DKd->BLKd", x_BxLxD, self.k_DxKxDh[...].astype(dtype))
            v_BxLxKxDh = quantization.einsum("BLD,DKd->BLKd", x_BxLxD, self.v_DxKxDh[...].astype(dtype))
            q_BxLxHxDh = constrain(q_BxLxHxDh, ("activation_batch", "activation_length", "activation_heads", None))
            k_BxLxKxDh = constrain(k_BxLxKxDh, ("activation_batch", "activation_length", "activation_kv_heads", None))
            v_BxLxKxDh = constrain(v_BxLxKxDh, ("activation_batch", "activation_length", "activation_kv_heads", None))
        if cfg.attention_bias:
            q_BxLxHxDh = q_BxLxHxDh + self.q_bias_HxDh[...].astype(dtype)[None, None]
            k_BxLxKxDh = k_BxLxKxDh + self.k_bias_KxDh[...].astype(dtype)[None, None]
            v_BxLxKxDh = v_BxLxKxDh + self.v_bias_KxDh[...].astype(dtype)[None, None]
        if cfg.qk_norm:
            q_BxLxHxDh, k_BxLxKxDh = self.q_norm(q_BxLxHxDh), self.k_norm(k_BxLxKxDh)
        if cfg.positions is Positions.ROPE:
            q_BxLxHxDh, k_BxLxKxDh = self._rope(q_BxLxHxDh, k_BxLxKxDh, positions_BxL, window, rope)
        # named where MaxText names them (layers/attentions.py): the kernel's inputs, after the norms and RoPE, the
        # fused projection too; a policy that saves or offloads them spares the backward the projections and RoPE
        q_BxLxHxDh = checkpoint_name(q_BxLxHxDh, "query_proj")
        k_BxLxKxDh = checkpoint_name(k_BxLxKxDh, "key_proj")
        v_BxLxKxDh = checkpoint_name(v_BxLxKxDh, "value_proj")
        if not self.scale_at_init:
            scale = cfg.query_scale if cfg.query_scale is not None else Dh**-0.5
            q_BxLxHxDh = q_BxLxHxDh * jnp.asarray(scale, dtype)
        if cfg.temperature_tuning and rope is not True:
            q_BxLxHxDh = _tune_temperature(q_BxLxHxDh, positions_BxL, rope)
        q_BxLxKxGxDh = q_BxLxHxDh.reshape(B, L, K, G, Dh)
        sinks_KxG = self.sinks_H[...].astype(jnp.float32).reshape(K, G) if cfg.attention_sinks else None
        def attend_prompt():
            return attend(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, window, softcap=cfg.attn_logit_softcap,
                          options=self.options, windows=self.windows, sinks_KxG=sinks_KxG)

        if kv_cache.current() is None:
            o_BxLxKxGxDh = attend_prompt()
        else:  # a serving step: the keys and values go to the cache
            o_BxLxKxGxDh = kv_cache.cached_gqa(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, positions_BxL, window,
                                               softcap=cfg.attn_logit_softcap, sinks_KxG=sinks_KxG,
                                               attend_prompt=attend_prompt)
        o_BxLxHxDh = o_BxLxKxGxDh.reshape(B, L, cfg.num_heads, Dh)
        # MaxText's names: "attention_out" this output; "context" only a flash kernel's residuals (attention_kernels)
        o_BxLxHxDh = checkpoint_name(o_BxLxHxDh, "attention_out")
        out_BxLxD = quantization.einsum("BLHd,HdD->BLD", o_BxLxHxDh, self.o_HxDhxD[...].astype(dtype))
        if cfg.attention_bias:
            out_BxLxD = out_BxLxD + self.o_bias_D[...].astype(dtype)[None, None]
        return offload.residual(out_BxLxD, "out_proj")

    def _rope(self, q_BxLxHxDh, k_BxLxKxDh, positions_BxL, window, rope):
        """RoPE with the layer's base (Gemma 3's local_rope_theta on sliding-window layers, as MaxText's
        local_rope_max_timescale; the others' positions divided by rope_linear_scaling_factor), then Llama 4's L2
        QK-norm; neither on a RoPE-free layer."""
        cfg, Dh = self.cfg, self.cfg.head_dim
        if rope is False:
            return q_BxLxHxDh, k_BxLxKxDh
        inv_freq = inverse_frequencies(Dh, cfg.rope_theta, cfg.rope_scaling) / cfg.rope_linear_scaling_factor
        if cfg.local_rope_theta is not None and any(w > 0 for w in self.windows):
            local = inverse_frequencies(Dh, cfg.local_rope_theta, None)
            inv_freq = jnp.where(jnp.asarray(window) > 0, local, inv_freq) if not isinstance(window, int) else (
                local if window > 0 else inv_freq)
        q, k = apply_rope(q_BxLxHxDh, positions_BxL, inv_freq), apply_rope(k_BxLxKxDh, positions_BxL, inv_freq)
        if cfg.qk_l2_norm:
            q, k = _l2_norm(q, cfg.norm_eps), _l2_norm(k, cfg.norm_eps)
        if rope is True:
            return q, k
        return jnp.where(rope, q, q_BxLxHxDh), jnp.where(rope, k, k_BxLxKxDh)


def _l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the head dim, no scale (MaxText's L2Norm, in float32)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# Llama 4's attention temperature tuning (MaxText's llama4 decoder: temperature_tuning_scale 0.1, floor 8192)
TEMPERATURE_SCALE, TEMPERATURE_FLOOR = 0.1, 8192.0


def _tune_temperature(q_BxLxHxDh, positions_BxL, rope):
    """The query of a RoPE-free layer times 1 + 0.1 ln(floor((position + 1) / 8192) + 1); 1 on RoPE layers."""
    p = positions_BxL.astype(jnp.float32)
    scale_BxL = jnp.log(jnp.floor((p + 1.0) / TEMPERATURE_FLOOR) + 1.0) * TEMPERATURE_SCALE + 1.0
    if rope is not False:
        scale_BxL = jnp.where(rope, 1.0, scale_BxL)
    return q_BxLxHxDh * scale_BxL[:, :, None, None].astype(q_BxLxHxDh.dtype)


def make_attention(cfg: ModelConfig, dtype, rngs: nnx.Rngs,
                   options: AttentionOptions = AttentionOptions()) -> Attention | LatentAttention:
    """A decoder layer's attention block: latent attention for attention_type=mla, else grouped-query attention."""
    if cfg.attention_type is AttentionType.MLA:
        return LatentAttention(cfg, dtype, rngs, options)
    return Attention(cfg, dtype, rngs, options)
