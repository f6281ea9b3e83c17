"""Feed-forward blocks: gated (SwiGLU, GeGLU; Shazeer 2020) or plain GELU.

MaxText's checkpoint names: mlpwi_0 (the gate projection) and mlpwi_1 (the up projection) of a gated MLP, mlpwi of
a plain one, mlpwo (the down projection)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxperf.models.layers import offload, quantization
from maxperf.models.layers.params import param
from maxperf.models.sharding import constrain
from maxperf.spec.model import Activation

_ACT = {Activation.SWIGLU: jax.nn.silu, Activation.GEGLU: jax.nn.gelu, Activation.GELU: jax.nn.gelu}


def gate(activation: Activation, g: jax.Array, h: jax.Array, limit: float = 7.0) -> jax.Array:
    """A gated MLP's hidden units from its gate g and up h projections: act(g) h, or for clamped_swiglu (gpt-oss, as
    MaxText's gpt_oss MoE) g sigmoid(1.702 g) (h + 1) with g clipped above and h both ways at `limit`."""
    if activation is Activation.CLAMPED_SWIGLU:
        g = jax.numpy.minimum(g, limit)
        h = jax.numpy.clip(h, -limit, limit)
        return g * jax.nn.sigmoid(1.702 * g) * (h + 1)
    return _ACT[activation](g) * h


class MLP(nnx.Module):
    def __init__(self, D: int, F: int, activation: Activation, dtype, rngs: nnx.Rngs, fused: bool = False,
                 limit: float = 7.0):
        """`fused` (MaxText's fused_mlp): a gated MLP's gate and up projections as one [D, 2, F] weight and matmul,
        its output named mlpwi; a plain MLP has one input projection either way. `limit`: clamped_swiglu's clip."""
        self.activation = activation
        self.limit = limit
        self.fused = fused and activation.gated
        if self.fused:
            self.wi_Dx2xF = param(rngs, (D, 2, F), ("embed", None, "mlp"), dtype, fan_in=D)
        else:
            if activation.gated:
                self.gate_DxF = param(rngs, (D, F), ("embed", "mlp"), dtype)
            self.up_DxF = param(rngs, (D, F), ("embed", "mlp"), dtype)
        self.down_FxD = param(rngs, (F, D), ("mlp", "embed"), dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        dtype = x_BxLxD.dtype
        if self.fused:
            wi_BxLx2xF = quantization.einsum("BLD,DkF->BLkF", x_BxLxD, self.wi_Dx2xF[...].astype(dtype))
            wi_BxLx2xF = checkpoint_name(wi_BxLx2xF, "mlpwi")
            h_BxLxF = gate(self.activation, wi_BxLx2xF[:, :, 0], wi_BxLx2xF[:, :, 1], self.limit)
        elif self.activation.gated:
            h_BxLxF = quantization.einsum("BLD,DF->BLF", x_BxLxD, self.up_DxF[...].astype(dtype))
            h_BxLxF = checkpoint_name(h_BxLxF, "mlpwi_1")
            g_BxLxF = quantization.einsum("BLD,DF->BLF", x_BxLxD, self.gate_DxF[...].astype(dtype))
            g_BxLxF = checkpoint_name(g_BxLxF, "mlpwi_0")
            h_BxLxF = gate(self.activation, g_BxLxF, h_BxLxF, self.limit)
        else:
            h_BxLxF = quantization.einsum("BLD,DF->BLF", x_BxLxD, self.up_DxF[...].astype(dtype))
            h_BxLxF = _ACT[self.activation](checkpoint_name(h_BxLxF, "mlpwi"))
        h_BxLxF = constrain(h_BxLxF, ("activation_batch", "activation_length", "activation_mlp"))
        out_BxLxD = quantization.einsum("BLF,FD->BLD", h_BxLxF, self.down_FxD[...].astype(dtype))
        return offload.residual(out_BxLxD, "mlpwo")
