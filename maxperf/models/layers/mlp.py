"""Feed-forward blocks: gated (SwiGLU, GeGLU; Shazeer 2020) or plain GELU."""

from __future__ import annotations

import jax
from flax import nnx

from maxperf.models.config import Activation
from maxperf.models.layers.params import param
from maxperf.models.sharding import constrain

_ACT = {Activation.SWIGLU: jax.nn.silu, Activation.GEGLU: jax.nn.gelu, Activation.GELU: jax.nn.gelu}


class MLP(nnx.Module):
    def __init__(self, D: int, F: int, activation: Activation, dtype, rngs: nnx.Rngs):
        self.activation = activation
        if activation.gated:
            self.gate_DxF = param(rngs, (D, F), ("embed", "mlp"), dtype)
        self.up_DxF = param(rngs, (D, F), ("embed", "mlp"), dtype)
        self.down_FxD = param(rngs, (F, D), ("mlp", "embed"), dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        dtype = x_BxLxD.dtype
        h_BxLxF = jax.numpy.einsum("BLD,DF->BLF", x_BxLxD, self.up_DxF[...].astype(dtype))
        if self.activation.gated:
            g_BxLxF = jax.numpy.einsum("BLD,DF->BLF", x_BxLxD, self.gate_DxF[...].astype(dtype))
            h_BxLxF = _ACT[self.activation](g_BxLxF) * h_BxLxF
        else:
            h_BxLxF = _ACT[self.activation](h_BxLxF)
        h_BxLxF = constrain(h_BxLxF, ("activation_batch", "activation_length", "activation_mlp"))
        return jax.numpy.einsum("BLF,FD->BLD", h_BxLxF, self.down_FxD[...].astype(dtype))
