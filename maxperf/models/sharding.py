"""Logical axes meet the mesh: PartitionSpecs for parameters and activations.

The rules themselves live in `maxperf.spec.logical_axes`, shared with perfmodel; meshes are built in
`maxperf.aot.targets.jax_mesh`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from maxperf.spec.logical_axes import RULES, LogicalAxes, mesh_axes_for

__all__ = ["RULES", "LogicalAxes", "constrain", "mesh_axes_for", "partition_spec"]


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
