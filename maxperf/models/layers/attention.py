"""Causal self-attention with grouped-query heads, rotary positions, sliding windows, QK-norm and soft-capping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.config import ModelConfig, Positions
from maxperf.models.layers.norms import RMSNorm
from maxperf.models.layers.params import param
from maxperf.models.layers.rope import apply_rope, inverse_frequencies
from maxperf.models.sharding import constrain

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def causal_mask(L: int, window: int | jax.Array) -> jax.Array:
    """[L, L] boolean: query i sees key j when j <= i and, for a window W > 0, i - j < W (W = 0: no window).

    A Python int window gives XLA a static mask; a traced one (interleaved local and global layers) is computed."""
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    if isinstance(window, int):
        return (j <= i) & (i - j < window) if window > 0 else j <= i
    return (j <= i) & ((window <= 0) | (i - j < window))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        D, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
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
        scale = cfg.query_scale if cfg.query_scale is not None else Dh**-0.5
        q_BxLxKxGxDh = (q_BxLxHxDh * jnp.asarray(scale, dtype)).reshape(B, L, K, G, Dh)
        s_BxKxGxLxS = jnp.einsum(
            "BLKGd,BSKd->BKGLS", q_BxLxKxGxDh, k_BxLxKxDh, preferred_element_type=jnp.float32
        )
        if cfg.attn_logit_softcap is not None:
            s_BxKxGxLxS = cfg.attn_logit_softcap * jnp.tanh(s_BxKxGxLxS / cfg.attn_logit_softcap)
        s_BxKxGxLxS = jnp.where(causal_mask(L, window)[None, None, None], s_BxKxGxLxS, _MASKED)
        p_BxKxGxLxS = jax.nn.softmax(s_BxKxGxLxS, axis=-1).astype(dtype)
        o_BxLxKxGxDh = jnp.einsum("BKGLS,BSKd->BLKGd", p_BxKxGxLxS, v_BxLxKxDh)
        o_BxLxHxDh = o_BxLxKxGxDh.reshape(B, L, cfg.num_heads, Dh)
        return jnp.einsum("BLHd,HdD->BLD", o_BxLxHxDh, self.o_HxDhxD[...].astype(dtype))
