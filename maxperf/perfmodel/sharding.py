"""How far each array is split across the mesh, from the logical-axis rules, without jax.

The rules are `maxperf.logical_axes`, the same table the models part shards its arrays by.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from maxperf.logical_axes import mesh_axes_for
from maxperf.perfmodel.flops import gated, is_mla
from maxperf.perfmodel.moe import moe_shape
from maxperf.perfmodel.shapes import Mesh, ModelShape, micro_batch, model_memo, per_model

# Mesh axes that split the weights for storage only: they split the batch (fsdp, fsdp_transpose, expert) or the
# sequence too, so each weight is gathered over them before its matmul (FSDP; ZeRO-3). `tensor` splits weights and
# their matmuls alike and is never gathered.
FSDP_AXES = ("fsdp", "fsdp_transpose", "sequence", "expert")


def split(shape: Iterable[int], logical: Iterable[str | None], mesh: Mesh) -> tuple[int, ...]:
    """The number of shards along each dimension of an array with these logical axis names."""
    return _split(tuple(shape), tuple(logical), mesh.sizes)


@functools.lru_cache(maxsize=1 << 16)  # the same few arrays on the same mesh, hundreds of times per estimate
def _split(shape: tuple[int, ...], logical: tuple[str | None, ...], sizes: tuple[tuple[str, int], ...]
           ) -> tuple[int, ...]:
    axes = dict(sizes)
    entries = mesh_axes_for(shape, logical, axes)
    return tuple(math.prod(axes[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in entries)


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
    """The FSDP axes that split at least one of these weights, in mesh order: those their gathers run over (never
    `expert` for the routed experts, which each device keeps its own of)."""
    used = set()
    for x in arrays:
        for entry in mesh_axes_for(x.shape, x.logical, mesh.axes):
            used.update((entry,) if isinstance(entry, str) else entry or ())
        if x.expert_parallel:
            used.discard("expert")
    return tuple(a for a in FSDP_AXES if a in used)


@dataclass(frozen=True)
class ParamArray:
    name: str
    shape: tuple[int, ...]
    logical: tuple[str | None, ...]
    count: int  # how many such arrays (the layer count for per-layer weights, the MoE layers' for expert weights)
    matmul: bool  # enters a matmul (gathered for FSDP in compute dtype)
    # the decoder-layer block it belongs to: "attention", "mlp" (a dense layer's), "moe" (router, routed and shared
    # experts), "norm" (the layer's D-wide norms); "" outside the layers (tables, final norm)
    block: str = ""
    # stacked routed experts [E, ...] (logical "exp", over the `expert` axis): each device multiplies its own
    # experts, so their FSDP gather leaves the expert axis split
    expert_parallel: bool = False


def held(x: ParamArray, mesh: Mesh) -> float:
    """Elements of one such array on one device."""
    return local_size(x.shape, x.logical, mesh)


def held_gathered(x: ParamArray, mesh: Mesh) -> float:
    """Elements of one such array on one device after its FSDP gather (an expert array keeps its local experts)."""
    if not x.expert_parallel:
        return gathered_size(x.shape, x.logical, mesh)
    kept = Mesh(axes={**gathered_mesh(mesh).axes, "expert": mesh.axes.get("expert", 1)}, dcn=mesh.dcn)
    return local_size(x.shape, x.logical, kept)


def param_arrays(model: ModelShape) -> list[ParamArray]:
    """Every parameter array of the Flax model with its logical axes (models/layers/*.py)."""
    return list(_param_arrays(model))


@per_model
def _param_arrays(model: ModelShape) -> tuple[ParamArray, ...]:
    V, D, N, H, K, Dh, F = (model.vocab_size, model.d_model, model.num_layers, model.num_heads, model.num_kv_heads,
                            model.head_dim, model.d_ff)
    norm_arrays = 2 if str(model.norm) == "layernorm" else 1  # scale (+ bias)
    layer_norms = (4 if model.post_norms else 2) * norm_arrays
    moe = moe_shape(model)
    n_moe = moe.moe_layers if moe else 0
    n_dense = N - n_moe
    if is_mla(model):
        arrays = mla_arrays(model)
    elif getattr(model, "fused_qkv", False):  # each kv head beside its query heads, key and value (layers/attention.py)
        arrays = [ParamArray("qkv", (D, K, H // K + 2, Dh), ("embed", "kv_heads", None, "head_dim"), N, True,
                             "attention")]
    else:
        arrays = [ParamArray("q", (D, H, Dh), ("embed", "heads", "head_dim"), N, True, "attention"),
                  ParamArray("k", (D, K, Dh), ("embed", "kv_heads", "head_dim"), N, True, "attention"),
                  ParamArray("v", (D, K, Dh), ("embed", "kv_heads", "head_dim"), N, True, "attention")]
    fused_mlp = gated(model) and getattr(model, "fused_mlp", False)
    if n_dense:
        if fused_mlp:
            arrays.append(ParamArray("gate_up", (D, 2, F), ("embed", None, "mlp"), n_dense, True, "mlp"))
        else:
            arrays.append(ParamArray("up", (D, F), ("embed", "mlp"), n_dense, True, "mlp"))
    if not is_mla(model):
        arrays.append(ParamArray("o", (H, Dh, D), ("heads", "head_dim", "embed"), N, True, "attention"))
    if n_dense:
        arrays.append(ParamArray("down", (F, D), ("mlp", "embed"), n_dense, True, "mlp"))
    arrays += [
        ParamArray("layer_norms", (D,), ("norm",), N * layer_norms, False, "norm"),
        ParamArray("final_norm", (D,), ("norm",), norm_arrays, False),
        ParamArray("embedding", (V, D), ("vocab", "embed"), 1, True),
    ]
    if n_dense and gated(model) and not fused_mlp:
        arrays.append(ParamArray("gate", (D, F), ("embed", "mlp"), n_dense, True, "mlp"))
    if model.qk_norm:
        arrays.append(ParamArray("qk_norms", (Dh,), ("norm",), 2 * N, False, "attention"))
    if getattr(model, "attention_sinks", False):
        arrays.append(ParamArray("sinks", (H,), ("heads",), N, False, "attention"))
    if getattr(model, "attention_bias", False):  # gpt-oss (models/layers/attention.py)
        arrays += [ParamArray("q_bias", (H, Dh), ("heads", "head_dim"), N, False, "attention"),
                   ParamArray("kv_bias", (K, Dh), ("kv_heads", "head_dim"), 2 * N, False, "attention"),
                   ParamArray("o_bias", (D,), ("embed",), N, False, "attention")]
    if not model.tie_embeddings:
        arrays.append(ParamArray("unembedding", (D, V), ("embed", "vocab"), 1, True))
    if str(model.positions) == "learned":
        arrays.append(ParamArray("positions", (model.max_position, D), ("position", "embed"), 1, False))
    if moe:
        arrays += moe_arrays(model, moe)
    return tuple(arrays)


def mla_arrays(model: ModelShape) -> list[ParamArray]:
    """Latent attention's arrays (models/layers/mla.py)."""
    D, N, H = model.d_model, model.num_layers, model.num_heads
    R, C, Dn, Dr, Dv = (model.q_lora_rank, model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim,
                        model.v_head_dim)
    if R:
        q = [ParamArray("wq_a", (D, R), ("embed", None), N, True, "attention"),
             ParamArray("q_norm", (R,), ("norm",), N, False, "attention"),
             ParamArray("wq_b", (R, H, Dn + Dr), ("q_lora", "heads", "head_dim"), N, True, "attention")]
    else:
        q = [ParamArray("q", (D, H, Dn + Dr), ("embed", "heads", "head_dim"), N, True, "attention")]
    return q + [ParamArray("wkv_a", (D, C + Dr), ("embed", None), N, True, "attention"),
                ParamArray("kv_norm", (C,), ("norm",), N, False, "attention"),
                ParamArray("wkv_b", (C, H, Dn + Dv), ("kv_lora", "heads", "head_dim"), N, True, "attention"),
                ParamArray("o", (H, Dv, D), ("heads", "head_dim", "embed"), N, True, "attention")]


def moe_arrays(model: ModelShape, moe) -> list[ParamArray]:
    """A MoE block's arrays (models/layers/moe.py, as MaxText's RoutedMoE): the router [D, E], the experts' wi_0,
    wi_1 [E, D, Fe] and wo [E, Fe, D], the shared experts as one MLP of width S x Fe."""
    D, n, E, Fe = model.d_model, moe.moe_layers, moe.E, moe.Fe
    arrays = [ParamArray("router", (D, E), ("embed", None), n, True, "moe"),
              ParamArray("experts_up", (E, D, Fe), ("exp", "embed", "mlp"), n, True, "moe", True),
              ParamArray("experts_down", (E, Fe, D), ("exp", "mlp", "embed"), n, True, "moe", True)]
    if gated(model):
        arrays.append(ParamArray("experts_gate", (E, D, Fe), ("exp", "embed", "mlp"), n, True, "moe", True))
    if moe.router_bias:
        arrays.append(ParamArray("router_bias", (E,), (None,), n, False, "moe"))
    if getattr(model, "mlp_bias", False):  # gpt-oss's expert biases
        arrays += [ParamArray("experts_wi_bias", (E, Fe), ("exp", "mlp"), n * (2 if gated(model) else 1), False, "moe"),
                   ParamArray("experts_wo_bias", (E, D), ("exp", "embed"), n, False, "moe")]
    if moe.S:
        width = moe.S * Fe
        arrays += [ParamArray("shared_up", (D, width), ("embed", "mlp"), n, True, "moe"),
                   ParamArray("shared_down", (width, D), ("mlp", "embed"), n, True, "moe")]
        if gated(model):
            arrays.append(ParamArray("shared_gate", (D, width), ("embed", "mlp"), n, True, "moe"))
    return arrays


def layer_weights(arrays: Iterable[ParamArray], size) -> float:
    """One decoder layer's matmul weights by `size` (a function of an array), the largest layer's where layers
    differ: the attention block beside a dense MLP or a MoE block, whichever is bigger."""
    blocks = {"attention": 0.0, "mlp": 0.0, "moe": 0.0}
    for x in arrays:
        if x.matmul and x.block in blocks:
            blocks[x.block] += size(x)
    return blocks["attention"] + max(blocks["mlp"], blocks["moe"])


@dataclass(frozen=True)
class ActivationSplit:
    """Local sizes of the activation dimensions on one device."""

    B: float  # examples: one microbatch (B x devices, MaxText's convention) over the data-like axes that divide it
    L: float  # sequence over `sequence`
    D: float  # model width of the residual stream over tensor (MaxText's activation_embed)
    H: float  # query heads over tensor
    K: float  # kv heads over tensor
    F: float  # MLP width over tensor
    V: float  # vocabulary over tensor
    Fe: float = 0.0  # a MoE expert's width over tensor (0 for a dense model)

    @property
    def T(self) -> float:
        """Tokens of one microbatch on this device."""
        return self.B * self.L


def activation_split(model: ModelShape, B: float, L: int, mesh: Mesh) -> ActivationSplit:
    """One microbatch's activations (B per device: MaxText's per_device_batch_size). With a fractional B the
    microbatch may not divide every data-like axis: it is split over those that divide it and the devices along the
    others compute the same examples (B here is what one device computes)."""
    memo = model_memo(model)
    key = ("activation_split", B, L, mesh.sizes)
    if (hit := memo.get(key)) is not None:
        return hit
    memo[key] = _activation_split(model, B, L, mesh)
    return memo[key]


def _activation_split(model: ModelShape, B: float, L: int, mesh: Mesh) -> ActivationSplit:
    rows = micro_batch(B, mesh.devices)
    (nb, nl) = split((rows, L), ("activation_batch", "activation_length"), mesh)

    def one(size: int, name: str) -> float:
        return size / split((size,), (name,), mesh)[0]

    return ActivationSplit(
        B=rows / nb, L=L / nl, D=one(model.d_model, "activation_embed"), H=one(model.num_heads, "activation_heads"),
        K=one(model.num_kv_heads, "activation_kv_heads"), F=one(model.d_ff, "activation_mlp"),
        V=one(model.vocab_size, "activation_vocab"),
        Fe=one(moe.Fe, "activation_mlp") if (moe := moe_shape(model)) else 0.0,
    )
