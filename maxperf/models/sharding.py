"""Logical axes meet the mesh: PartitionSpecs for parameters and activations, and meshes in automatic mode.

The rules themselves live in `maxperf.logical_axes`, shared with perfmodel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from maxperf.logical_axes import RULES, LogicalAxes, mesh_axes_for

__all__ = ["RULES", "LogicalAxes", "constrain", "make_mesh", "mesh_axes_for", "partition_spec"]


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
