"""How far each array is split across the mesh, from the logical-axis rules, without jax.

The rules are `maxperf.logical_axes`, the same table the models part shards its arrays by.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from maxperf.logical_axes import mesh_axes_for
from maxperf.perfmodel.flops import gated
from maxperf.perfmodel.shapes import Mesh, ModelShape, global_batch

# Mesh axes that split the weights for storage only: they split the batch (fsdp, fsdp_transpose, expert) or the
# sequence too, so each weight is gathered over them before its matmul (FSDP; ZeRO-3). `tensor` splits weights and
# their matmuls alike and is never gathered.
FSDP_AXES = ("fsdp", "fsdp_transpose", "sequence", "expert")


def split(shape: Iterable[int], logical: Iterable[str | None], mesh: Mesh) -> tuple[int, ...]:
    """The number of shards along each dimension of an array with these logical axis names."""
    shape = tuple(shape)
    entries = mesh_axes_for(shape, tuple(logical), mesh.axes)
    return tuple(math.prod(mesh.axes[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in entries)


def local_size(shape: tuple[int, ...], logical: tuple[str | None, ...], mesh: Mesh) -> float:
    size = 1.0
    for s, n in zip(shape, split(shape, logical, mesh)):
        size *= s / n
    return size


def gathered_mesh(mesh: Mesh) -> Mesh:
    """The mesh as a gathered weight sees it: the FSDP axes gathered away."""
    return Mesh(axes={**mesh.axes, **{axis: 1 for axis in FSDP_AXES}}, dcn=mesh.dcn)


def gathered_size(shape: tuple[int, ...], logical: tuple[str | None, ...], mesh: Mesh) -> float:
    """Elements of one copy of a weight after its FSDP gather (still split over tensor)."""
    return local_size(shape, logical, gathered_mesh(mesh))


def gather_axes(arrays: Iterable[ParamArray], mesh: Mesh) -> tuple[str, ...]:
    """The FSDP axes that split at least one of these weights, in mesh order: those their gathers run over."""
    used = set()
    for x in arrays:
        for entry in mesh_axes_for(x.shape, x.logical, mesh.axes):
            used.update((entry,) if isinstance(entry, str) else entry or ())
    return tuple(a for a in FSDP_AXES if a in used)


@dataclass(frozen=True)
class ParamArray:
    name: str
    shape: tuple[int, ...]
    logical: tuple[str | None, ...]
    count: int  # how many such arrays (the layer count for per-layer weights)
    matmul: bool  # enters a matmul (gathered for FSDP in compute dtype)


def param_arrays(model: ModelShape) -> list[ParamArray]:
    """Every parameter array of the Flax model with its logical axes (models/layers/*.py)."""
    V, D, N, H, K, Dh, F = (model.vocab_size, model.d_model, model.num_layers, model.num_heads, model.num_kv_heads,
                            model.head_dim, model.d_ff)
    norm_arrays = 2 if str(model.norm) == "layernorm" else 1  # scale (+ bias)
    layer_norms = (4 if model.post_norms else 2) * norm_arrays
    if getattr(model, "fused_qkv", False):  # each kv head beside its query heads, key and value (layers/attention.py)
        arrays = [ParamArray("qkv", (D, K, H // K + 2, Dh), ("embed", "kv_heads", None, "head_dim"), N, True)]
    else:
        arrays = [ParamArray("q", (D, H, Dh), ("embed", "heads", "head_dim"), N, True),
                  ParamArray("k", (D, K, Dh), ("embed", "kv_heads", "head_dim"), N, True),
                  ParamArray("v", (D, K, Dh), ("embed", "kv_heads", "head_dim"), N, True)]
    fused_mlp = gated(model) and getattr(model, "fused_mlp", False)
    if fused_mlp:
        arrays.append(ParamArray("gate_up", (D, 2, F), ("embed", None, "mlp"), N, True))
    else:
        arrays.append(ParamArray("up", (D, F), ("embed", "mlp"), N, True))
    arrays += [
        ParamArray("o", (H, Dh, D), ("heads", "head_dim", "embed"), N, True),
        ParamArray("down", (F, D), ("mlp", "embed"), N, True),
        ParamArray("layer_norms", (D,), ("norm",), N * layer_norms, False),
        ParamArray("final_norm", (D,), ("norm",), norm_arrays, False),
        ParamArray("embedding", (V, D), ("vocab", "embed"), 1, True),
    ]
    if gated(model) and not fused_mlp:
        arrays.append(ParamArray("gate", (D, F), ("embed", "mlp"), N, True))
    if model.qk_norm:
        arrays.append(ParamArray("qk_norms", (Dh,), ("norm",), 2 * N, False))
    if not model.tie_embeddings:
        arrays.append(ParamArray("unembedding", (D, V), ("embed", "vocab"), 1, True))
    if str(model.positions) == "learned":
        arrays.append(ParamArray("positions", (model.max_position, D), ("position", "embed"), 1, False))
    return arrays


@dataclass(frozen=True)
class ActivationSplit:
    """Local sizes of the activation dimensions on one device."""

    B: float  # examples: global batch (B x devices, MaxText's convention) over the data-like axes that divide it
    L: float  # sequence over `sequence`
    D: float  # model width of the residual stream over tensor (MaxText's activation_embed)
    H: float  # query heads over tensor
    K: float  # kv heads over tensor
    F: float  # MLP width over tensor
    V: float  # vocabulary over tensor

    @property
    def T(self) -> float:
        """Tokens on this device."""
        return self.B * self.L


def activation_split(model: ModelShape, B: float, L: int, mesh: Mesh) -> ActivationSplit:
    """With a fractional B the global batch may not divide every data-like axis: it is split over those that divide
    it and the devices along the others compute the same examples (B here is what one device computes)."""
    rows = global_batch(B, mesh.devices)
    (nb, nl) = split((rows, L), ("activation_batch", "activation_length"), mesh)

    def one(size: int, name: str) -> float:
        return size / split((size,), (name,), mesh)[0]

    return ActivationSplit(
        B=rows / nb, L=L / nl, D=one(model.d_model, "activation_embed"), H=one(model.num_heads, "activation_heads"),
        K=one(model.num_kv_heads, "activation_kv_heads"), F=one(model.d_ff, "activation_mlp"),
        V=one(model.vocab_size, "activation_vocab"),
    )
