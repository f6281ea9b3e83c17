"""RMSNorm (Zhang & Sennrich 2019) and LayerNorm (Ba et al. 2016), computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.layers.params import param
from maxperf.spec.model import Norm


def _last_axis(v: jax.Array, ndim: int, dtype=jnp.float32) -> jax.Array:
    """A [D] vector in `dtype`, shaped to broadcast against an ndim-rank array along its last axis."""
    return v.astype(dtype).reshape((1,) * (ndim - 1) + (-1,))


class RMSNorm(nnx.Module):
    def __init__(self, width: int, eps: float, dtype, rngs: nnx.Rngs, axis: str = "norm"):
        self.eps = eps
        self.scale = param(rngs, (width,), (axis,), dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalized in float32 and cast to x's dtype, then scaled in that dtype (MaxText's RMSNorm)."""
        x32 = x.astype(jnp.float32)
        y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        return y * _last_axis(self.scale[...], x.ndim, x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, width: int, eps: float, dtype, rngs: nnx.Rngs, axis: str = "norm"):
        self.eps = eps
        self.scale = param(rngs, (width,), (axis,), dtype, init="ones")
        self.bias = param(rngs, (width,), (axis,), dtype, init="zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * _last_axis(self.scale[...], x.ndim) + _last_axis(self.bias[...], x.ndim)).astype(x.dtype)


def make_norm(kind: Norm, width: int, eps: float, dtype, rngs: nnx.Rngs, axis: str = "norm") -> nnx.Module:
    """`axis`: the scale's logical axis (norm_fsdp where ModelConfig.norm_fsdp says so)."""
    return {Norm.RMSNORM: RMSNorm, Norm.LAYERNORM: LayerNorm}[kind](width, eps, dtype, rngs, axis)
