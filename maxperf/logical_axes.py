"""The one table of logical axis names and the mesh axes that shard them, in plain Python.

Layers name logical axes only (`("embed", "mlp")`); these rules say which mesh axes shard each of them. A mesh axis
is used for a dimension only where the sizes so far divide it, and never twice in one array, so every preset
shards validly on every mesh (a dimension that does not divide is replicated along that axis instead). The models
part turns the result into PartitionSpecs; perfmodel uses it to count what each device holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

LogicalAxes = tuple[str | None, ...]

# logical name -> mesh axes that shard it, outermost first (cf. MaxText's logical_axis_rules)
RULES: dict[str, tuple[str, ...]] = {
    # parameters: FSDP shards the model width, tensor parallelism the heads, MLP width and vocabulary
    "embed": ("fsdp", "sequence", "expert"),
    "vocab": ("tensor",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "norm": (),
    "position": (),
    "layers": (),
    # activations: the batch over data-like axes, the sequence over `sequence`, heads and MLP over `tensor`
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": ("sequence",),
    "activation_embed": (),
    "activation_heads": ("tensor",),
    "activation_kv_heads": ("tensor",),
    "activation_mlp": ("tensor",),
    "activation_vocab": ("tensor",),
}


def mesh_axes_for(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> tuple:
    """The PartitionSpec entries for an array of `shape` whose dimensions carry `logical` names."""
    return _assign(shape, logical, mesh_sizes)[0]


def undivided_axes(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> list[tuple[int, str]]:
    """(dimension, mesh axis) for each mesh axis over 1 that a rule names for a dimension but that is left out
    because it does not divide the dimension (with the axes chosen before it): the dimension is replicated along it."""
    return _assign(shape, logical, mesh_sizes)[1]


def _assign(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]) -> tuple[tuple, list]:
    if len(shape) != len(logical):
        raise ValueError(f"shape {tuple(shape)} has {len(shape)} dims but logical axes {logical} name {len(logical)}")
    used: set[str] = set()
    spec, skipped = [], []
    for dim, (size, name) in enumerate(zip(shape, logical)):
        if name is not None and name not in RULES:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {', '.join(RULES)}")
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
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return tuple(spec), skipped
