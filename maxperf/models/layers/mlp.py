"""Feed-forward blocks: gated (SwiGLU, GeGLU; Shazeer 2020) or plain GELU.

MaxText's checkpoint names: mlpwi_0 (the gate projection) and mlpwi_1 (the up projection) of a gated MLP, mlpwi of
a plain one, mlpwo (the down projection)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

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
            h_BxLxF = checkpoint_name(h_BxLxF, "mlpwi_1")
            g_BxLxF = jax.numpy.einsum("BLD,DF->BLF", x_BxLxD, self.gate_DxF[...].astype(dtype))
            g_BxLxF = checkpoint_name(g_BxLxF, "mlpwi_0")
            h_BxLxF = _ACT[self.activation](g_BxLxF) * h_BxLxF
        else:
            h_BxLxF = _ACT[self.activation](checkpoint_name(h_BxLxF, "mlpwi"))
        h_BxLxF = constrain(h_BxLxF, ("activation_batch", "activation_length", "activation_mlp"))
        out_BxLxD = jax.numpy.einsum("BLF,FD->BLD", h_BxLxF, self.down_FxD[...].astype(dtype))
        return checkpoint_name(out_BxLxD, "mlpwo")
