"""Rotary position embeddings (Su et al. 2021), with Llama 3.1's frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxperf.models.config import RopeScaling


def inverse_frequencies(Dh: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    inv_freq = 1.0 / theta ** (jnp.arange(0, Dh, 2, dtype=jnp.float32) / Dh)
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between (Meta's reference code).
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelen < high_wavelen, inv_freq, jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, mid))


def apply_rope(x_BxLxNxDh: jax.Array, positions_BxL: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates the two halves of each head's features by position-dependent angles.

    Angles in float32, the rotation in x's dtype, as MaxText's RotaryEmbedding does: a float32 rotation would keep
    float32 copies of q and k (and of their gradients) live in every layer."""
    dtype = x_BxLxNxDh.dtype
    angles_BxLxR = positions_BxL[..., None].astype(jnp.float32) * inv_freq[None, None, :]
    cos = jnp.cos(angles_BxLxR)[:, :, None, :].astype(dtype)
    sin = jnp.sin(angles_BxLxR)[:, :, None, :].astype(dtype)
    x1, x2 = jnp.split(x_BxLxNxDh, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
