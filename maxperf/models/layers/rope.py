"""Rotary position embeddings (Su et al. 2021), with Llama 3.1's frequency scaling and YaRN (Peng et al. 2023) as
DeepSeek-V2/V3 and Kimi K2 use it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxperf.spec.model import RopeScaling, YarnScaling


def inverse_frequencies(Dh: int, theta: float, scaling: RopeScaling | YarnScaling | None) -> jax.Array:
    inv_freq = 1.0 / theta ** (jnp.arange(0, Dh, 2, dtype=jnp.float32) / Dh)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _yarn(inv_freq, Dh, theta, scaling)
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between (Meta's reference code).
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelen < high_wavelen, inv_freq, jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, mid))


def _yarn(inv_freq: jax.Array, Dh: int, theta: float, yarn: YarnScaling) -> jax.Array:
    """YaRN's "NTK-by-parts": features that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those that turn more than beta_fast times are kept, with a linear ramp
    between (DeepSeek-V3's yarn_find_correction_range and yarn_linear_ramp_mask, bounds floored and ceiled)."""

    def dim_of(rotations: float) -> float:
        return Dh * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(yarn.beta_fast)), 0), min(math.ceil(dim_of(yarn.beta_slow)), Dh - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(Dh // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def yarn_softmax_factor(scaling: RopeScaling | YarnScaling | None) -> float:
    """What YaRN multiplies the softmax scale by: (0.1 mscale ln(factor) + 1)^2 (DeepSeek-V3's yarn_get_mscale with
    mscale_all_dim, squared as its attention applies it); 1 without YaRN."""
    if not isinstance(scaling, YarnScaling) or scaling.factor <= 1:
        return 1.0
    return (0.1 * scaling.mscale * math.log(scaling.factor) + 1.0) ** 2


def apply_rope(x_BxLxNxDh: jax.Array, positions_BxL: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates the two halves of each head's features by position-dependent angles.

    Angles in float32, the rotation in x's dtype, as MaxText's RotaryEmbedding does: a float32 rotation would keep
    float32 copies of q and k (and of their gradients) live in every layer. MaxText writes the rotation as
    x cos + rotate_half(x) sin over the whole head width, rotate_half(x1, x2) = (-x2, x1); rotating the halves
    apart gives the same values in the same dtype (each product rounded, then summed) and a smaller program
    (llama2-7b on v5p-1024: 663,423 TPU bundles against 686,645, the same memory)."""
    dtype = x_BxLxNxDh.dtype
    angles_BxLxR = positions_BxL[..., None].astype(jnp.float32) * inv_freq[None, None, :]
    cos_BxLx1xR = jnp.cos(angles_BxLxR)[:, :, None, :].astype(dtype)
    sin_BxLx1xR = jnp.sin(angles_BxLxR)[:, :, None, :].astype(dtype)
    x1, x2 = jnp.split(x_BxLxNxDh, 2, axis=-1)
    return jnp.concatenate([x1 * cos_BxLx1xR - x2 * sin_BxLx1xR, x2 * cos_BxLx1xR + x1 * sin_BxLx1xR], axis=-1)
