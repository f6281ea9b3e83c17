"""How far each array is split across the mesh, from the logical-axis rules (maxperf.spec.logical_axes, the table the
models part shards its arrays by) and the model's parameter arrays (maxperf.spec.params)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from maxperf.perfmodel.moe import moe_shape
from maxperf.spec.logical_axes import local_size, mesh_axes_for, over_data, split
from maxperf.spec.memo import model_memo
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.params import (  # noqa: F401 (perfmodel's users read ParamArray and param_arrays here too)
    ParamArray,
    mtp_arrays,
    param_arrays,
    stage_share,
)
from maxperf.spec.train import micro_batch

# Mesh axes that split the weights for storage only: they split the batch (fsdp, fsdp_transpose, expert) or the
# sequence too, so each weight is gathered over them before its matmul (FSDP; ZeRO-3). `tensor` splits weights and
# their matmuls alike and is never gathered.
FSDP_AXES = ("fsdp", "fsdp_transpose", "sequence", "expert")


def gathered_axes(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes as a gathered weight sees them: the FSDP axes gathered away."""
    return {**mesh.axes, **{axis: 1 for axis in FSDP_AXES}}


def gathered_size(shape: tuple[int, ...], logical: tuple[str | None, ...], mesh: Mesh) -> float:
    """Elements of one copy of a weight after its FSDP gather (still split over tensor)."""
    return local_size(shape, logical, gathered_axes(mesh))


def gather_axes(arrays: Iterable[ParamArray], mesh: Mesh) -> tuple[str, ...]:
    """The FSDP axes that split at least one of these weights, in mesh order: those their gathers run over (never
    `expert` for the routed experts, which each device keeps its own of)."""
    used = set()
    for x in arrays:
        mine = set()
        for entry in mesh_axes_for(x.shape, x.logical, mesh.axes):
            mine.update((entry,) if isinstance(entry, str) else entry or ())
        if x.expert_parallel:  # not gathered over `expert`; the other arrays may well be
            mine.discard("expert")
        used |= mine
    return tuple(a for a in FSDP_AXES if a in used)


def held(x: ParamArray, mesh: Mesh) -> float:
    """Elements of one such array on one device."""
    return local_size(x.shape, x.logical, mesh.axes)


def over_data_share(x: ParamArray, mesh: Mesh) -> float:
    """The share of its shard one device keeps of an array under ZeRO-1 (shard_optimizer_over_data;
    spec.logical_axes.over_data): 1 / data where `data` divides the local size of one of its dimensions that `tensor`
    does not split (a stacked array's layer axis among them), else 1."""
    data = mesh.axes.get("data", 1)
    if data == 1:
        return 1.0
    entries = tuple(mesh_axes_for(x.shape, x.logical, mesh.axes))
    if over_data(x.shape, entries, mesh.axes) != entries:
        return 1 / data
    return 1 / data if x.count > 1 and x.count % data == 0 else 1.0


def zero1_params_per_device(model: ModelConfig, mesh: Mesh) -> float:
    """Parameters one device keeps in the train state under ZeRO-1 (and optimizer moments alike): each array's
    shard (a pipeline stage's share of the layers) over `data` too where it divides (over_data_share)."""
    return (sum(x.count * held(x, mesh) * stage_share(x, mesh.axes) * over_data_share(x, mesh)
                for x in param_arrays(model))
            + sum(x.count * held(x, mesh) * over_data_share(x, mesh) for x in mtp_arrays(model)))


def held_gathered(x: ParamArray, mesh: Mesh) -> float:
    """Elements of one such array on one device after its FSDP gather (an expert array keeps its local experts)."""
    if not x.expert_parallel:
        return gathered_size(x.shape, x.logical, mesh)
    kept = {**gathered_axes(mesh), "expert": mesh.axes.get("expert", 1)}
    return local_size(x.shape, x.logical, kept)


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


def activation_split(model: ModelConfig, B: float, L: int, mesh: Mesh) -> ActivationSplit:
    """One microbatch's activations (B per device: MaxText's per_device_batch_size). With a fractional B the
    microbatch may not divide every data-like axis: it is split over those that divide it and the devices along the
    others compute the same examples (B here is what one device computes)."""
    memo = model_memo(model)
    key = ("activation_split", B, L, mesh.sizes)
    if (hit := memo.get(key)) is not None:
        return hit
    memo[key] = _activation_split(model, B, L, mesh)
    return memo[key]


def _activation_split(model: ModelConfig, B: float, L: int, mesh: Mesh) -> ActivationSplit:
    rows = micro_batch(B, mesh.devices)
    (nb, nl) = split((rows, L), ("activation_batch", "activation_length"), mesh.axes)

    def one(size: int, name: str) -> float:
        return size / split((size,), (name,), mesh.axes)[0]

    return ActivationSplit(
        B=rows / nb, L=L / nl, D=one(model.d_model, "activation_embed"), H=one(model.num_heads, "activation_heads"),
        K=one(model.num_kv_heads, "activation_kv_heads"), F=one(model.d_ff, "activation_mlp"),
        V=one(model.vocab_size, "activation_vocab"),
        Fe=one(moe.Fe, "activation_mlp") if (moe := moe_shape(model)) else 0.0,
    )
