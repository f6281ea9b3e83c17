"""The one table of logical axis names and the mesh axes that shard them, in plain Python.

Layers name logical axes only (`("embed", "mlp")`); these rules say which mesh axes shard each of them. A mesh axis
is used for a dimension only where the sizes so far divide it, and never twice in one array, so every preset
shards validly on every mesh (a dimension that does not divide is replicated along that axis instead). The models
part turns the result into PartitionSpecs; perfmodel uses it to count what each device holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

LogicalAxes = tuple[str | None, ...]

# MaxText's mesh axes (configs/base.yml mesh_axes) that maxperf's layers use, outermost first; MaxText's `context` is
# `sequence` here (its ici_context_parallelism sets it), its `stage` the pipeline's stages. Each may span DCN too
# (MaxText's dcn_*_parallelism), though MaxText advises only data, fsdp and the pipeline's stages.
MESH_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert")
DCN_AXES = MESH_AXES

# logical name -> mesh axes that shard it, outermost first: MaxText's logical_axis_rules (configs/base.yml), with
# its `context` named `sequence`. Order matters as in MaxText (flax's logical_to_mesh_axes): an array's dimensions
# take their axes in the order their names appear here, and an axis an earlier name took is skipped. So a weight
# [D, F] puts fsdp_transpose on F ("mlp" comes first) and D keeps fsdp (MaxText's second "embed" rule), while an
# attention weight [D, H, Dh] puts both fsdp and fsdp_transpose on D.
RULES: dict[str, tuple[str, ...]] = {
    # activations: the batch over the data-like axes, the sequence over `sequence`, and every model-side dimension
    # over `tensor`, the model width D of the residual stream included (MaxText's activation_embed)
    "activation_vocab": ("tensor",),
    "activation_heads": ("tensor",),
    "activation_kv_heads": ("tensor",),
    "activation_mlp": ("tensor",),
    # a mixture of experts' [B, E, C, ...] dispatch: E over `expert`, the batch over the other data-like axes
    # (MaxText's activation_exp and activation_batch_no_exp)
    "activation_exp": ("expert",),
    "activation_batch_no_exp": ("data", "fsdp", "fsdp_transpose"),
    "activation_batch": ("data", "fsdp", "fsdp_transpose", "expert"),
    # the batch of the embeddings, the logits and the step's input: over the pipeline's stages too, which hold no
    # layers there (MaxText's activation_embed_and_logits_batch)
    "activation_embed_and_logits_batch": ("data", "stage", "fsdp", "fsdp_transpose", "expert"),
    # a pipeline's stage dimension of its per-stage activations (MaxText's activation_stage)
    "activation_stage": ("stage",),
    "activation_length": ("sequence",),
    "activation_embed": ("tensor",),
    # parameters: a mixture of experts' weights [E, ...] put E over `expert` first (MaxText's exp rule)
    "exp": ("expert",),
    # tensor parallelism splits the vocabulary, heads and MLP width (fsdp_transpose the MLP width too);
    # FSDP splits the model width D
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("fsdp_transpose", "tensor"),
    "embed": ("fsdp", "fsdp_transpose", "sequence", "expert"),
    # the experts' E under shard_exp_on_fsdp, their D then whole (MaxText's embed_moe rule on E)
    "exp_fsdp": ("fsdp", "fsdp_transpose", "sequence"),
    # latent attention's compressed q and kv widths, input side of the up-projections: sharded as D (MaxText's
    # q_lora and kv_lora rules)
    "q_lora": ("fsdp", "fsdp_transpose", "sequence", "expert"),
    "kv_lora": ("fsdp", "fsdp_transpose", "sequence", "expert"),
    "norm": ("tensor",),
    # MaxText's llama2 configs (configs/models/llama2-*.yml) replace the norm rule by ['norm', 'fsdp']
    "norm_fsdp": ("fsdp",),
    "position": (),
    "layers": (),
    # the layer axis of a pipelined stack, stored stage-major: each stage holds its own layers (MaxText's `layers`
    # rule; maxperf's other stacks keep every layer on every device, as MaxText's outside a pipeline)
    "stage_layers": ("stage",),
    # the serving steps' key/value cache (MaxText's cache_batch, cache_sequence, cache_kv): sequences as the
    # activations' batch, kv heads over tensor
    "cache_batch": ("data", "fsdp", "fsdp_transpose", "expert"),
    "cache_sequence": (),
    "cache_kv_heads": ("tensor",),
}
_ORDER = {name: i for i, name in enumerate(RULES)}


def mesh_axes_for(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> tuple:
    """The PartitionSpec entries for an array of `shape` whose dimensions carry `logical` names."""
    return _assign(shape, logical, mesh_sizes)[0]


def over_data(shape: Sequence[int], entries: Sequence, mesh_sizes: Mapping[str, int]) -> tuple:
    """MaxText's ZeRO-1 placement (shard_optimizer_over_data; its sharding.add_data_to_sharding): the PartitionSpec
    entries of an array of `shape` placed by `entries`, with `data` put before the axes of the first dimension whose
    local size it divides and that `tensor` does not split; `entries` as they are where `data` has one device,
    already splits a dimension, or divides none."""
    data = mesh_sizes.get("data", 1)
    entries = tuple(entries) + (None,) * (len(shape) - len(entries))
    named = [(e,) if isinstance(e, str) else tuple(e or ()) for e in entries]
    if data == 1 or any("data" in axes for axes in named):
        return entries
    for i, (n, axes) in enumerate(zip(shape, named)):
        local = n // math.prod(mesh_sizes.get(a, 1) for a in axes)
        if local % data == 0 and "tensor" not in axes:
            return (*entries[:i], ("data", *axes), *entries[i + 1:])
    return entries


def undivided_axes(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> list[tuple[int, str]]:
    """(dimension, mesh axis) for each mesh axis over 1 that a rule names for a dimension but that is left out
    because it does not divide the dimension (with the axes chosen before it): the dimension is replicated along it."""
    return _assign(shape, logical, mesh_sizes)[1]


def _assign(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> tuple[tuple, list]:
    # cached: perfmodel asks about the same few arrays on the same mesh hundreds of times per estimate, and
    # `maxperf plan` estimates thousands of meshes
    spec, skipped = _assign_cached(tuple(shape), tuple(logical), tuple(mesh_sizes.items()))
    return spec, list(skipped)


@functools.lru_cache(maxsize=1 << 16)
def _assign_cached(shape: tuple[int, ...], logical: LogicalAxes, sizes: tuple[tuple[str, int], ...]
                   ) -> tuple[tuple, tuple]:
    spec, skipped = _assign_uncached(shape, logical, dict(sizes))
    return spec, tuple(skipped)


def _assign_uncached(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> tuple[tuple, list]:
    if len(shape) != len(logical):
        raise ValueError(f"shape {tuple(shape)} has {len(shape)} dims but logical axes {logical} name {len(logical)}")
    for name in logical:
        if name is not None and name not in RULES:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {', '.join(RULES)}")
    used: set[str] = set()
    spec: list = [None] * len(shape)
    skipped = []
    for dim in sorted(range(len(shape)), key=lambda d: _ORDER.get(logical[d], len(_ORDER))):
        size, name = shape[dim], logical[dim]
        chosen = []
        for axis in RULES.get(name, ()) if name else ():
            n = mesh_sizes.get(axis, 1)
            if n == 1 or axis in used:
                continue
            if size % (math.prod(mesh_sizes[a] for a in chosen) * n) == 0:
                chosen.append(axis)
            else:
                skipped.append((dim, axis))
        used.update(chosen)
        spec[dim] = None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen)
    return tuple(spec), sorted(skipped)


def split(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The number of shards along each dimension of an array with these logical axis names."""
    return _split(tuple(shape), tuple(logical), tuple(mesh_sizes.items()))


@functools.lru_cache(maxsize=1 << 16)  # the same few arrays on the same mesh, hundreds of times per estimate
def _split(shape: tuple[int, ...], logical: LogicalAxes, sizes: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    axes = dict(sizes)
    entries = mesh_axes_for(shape, logical, axes)
    return tuple(math.prod(axes[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in entries)


def local_size(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> float:
    """Elements of one device's shard of the array."""
    size = 1.0
    for s, n in zip(shape, split(shape, logical, mesh_sizes)):
        size *= s / n
    return size
