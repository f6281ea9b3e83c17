"""Token embeddings (shared with the unembedding when tied) and learned position tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.layers.params import param


class Embed(nnx.Module):
    def __init__(self, V: int, D: int, dtype, rngs: nnx.Rngs):
        self.table_VxD = param(rngs, (V, D), ("vocab", "embed"), dtype, fan_in=D)

    def __call__(self, tokens_BxL: jax.Array, compute_dtype, iota: bool = False) -> jax.Array:
        """The rows of `tokens_BxL`; `iota`: as a one-hot matmul (MaxText's use_iota_embed), else a gather."""
        # the table is cast before the lookup, as MaxText's Embed does: a float32 gather keeps a float32 [B, L, D]
        # (of the whole global batch, under FSDP's split of D) live, and its backward scatters in float32
        table_VxD = self.table_VxD[...].astype(compute_dtype)
        if iota:
            one_hot_BxLxV = jax.nn.one_hot(tokens_BxL, table_VxD.shape[0], dtype=compute_dtype)
            return jnp.einsum("BLV,VD->BLD", one_hot_BxLxV, table_VxD)
        return jnp.take(table_VxD, tokens_BxL, axis=0)

    def attend(self, x_BxLxD: jax.Array) -> jax.Array:
        """Logits against the embedding table (tied unembedding)."""
        return jnp.einsum("BLD,VD->BLV", x_BxLxD, self.table_VxD[...].astype(x_BxLxD.dtype))


class LearnedPositions(nnx.Module):
    def __init__(self, max_position: int, D: int, dtype, rngs: nnx.Rngs):
        self.table_PxD = param(rngs, (max_position, D), ("position", "embed"), dtype, fan_in=D)

    def __call__(self, positions_BxL: jax.Array, compute_dtype) -> jax.Array:
        return jnp.take(self.table_PxD[...].astype(compute_dtype), positions_BxL, axis=0)


class Unembed(nnx.Module):
    def __init__(self, D: int, V: int, dtype, rngs: nnx.Rngs):
        self.w_DxV = param(rngs, (D, V), ("embed", "vocab"), dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return jnp.einsum("BLD,DV->BLV", x_BxLxD, self.w_DxV[...].astype(x_BxLxD.dtype))
