"""The one place where logical axis names meet mesh axes.

Layers name logical axes only (`("embed", "mlp")`); these rules say which mesh axes shard each of them. A mesh axis
is used for a dimension only where the sizes so far divide it, and never twice in one array, so every preset
shards validly on every mesh (a dimension that does not divide is replicated along that axis instead).
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
    if len(shape) != len(logical):
        raise ValueError(f"shape {tuple(shape)} has {len(shape)} dims but logical axes {logical} name {len(logical)}")
    used: set[str] = set()
    spec = []
    for size, name in zip(shape, logical):
        if name is not None and name not in RULES:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {', '.join(RULES)}")
        chosen = []
        for axis in RULES.get(name, ()) if name else ():
            n = mesh_sizes.get(axis, 1)
            if n == 1 or axis in used:
                continue
            if size % (math.prod(mesh_sizes[a] for a in chosen) * n) == 0:
                chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return tuple(spec)


def partition_spec(shape: Sequence[int], logical: LogicalAxes, mesh_sizes: Mapping[str, int]):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*mesh_axes_for(shape, logical, mesh_sizes))


def constrain(x, logical: LogicalAxes):
    """Pins an activation's sharding by logical names, under the mesh set by `jax.set_mesh`; a no-op without one."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(x.shape, logical, dict(mesh.shape)))


def make_mesh(devices, axis_sizes: Mapping[str, int]):
    """A mesh in automatic (GSPMD) sharding mode over `devices`, axes in the order of `axis_sizes`."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    grid = np.asarray(devices, dtype=object).reshape(tuple(axis_sizes.values()))
    return Mesh(grid, tuple(axis_sizes), axis_types=(AxisType.Auto,) * len(axis_sizes))
