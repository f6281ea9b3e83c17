"""Mesh axis sizes as the user sets them (MaxText's ici_* and dcn_* keys); `maxperf.spec.mesh` resolves them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from maxperf.spec.errors import require
from maxperf.spec.logical_axes import DCN_AXES, MESH_AXES  # noqa: F401 (the axes' one table)


@dataclass(frozen=True)
class ParallelismConfig:
    """Mesh axis sizes; -1 on one axis fills what the others leave (`maxperf.spec.mesh.resolve` resolves them)."""

    ici_data: int = 1
    ici_stage: int = 1  # pipeline stages (MaxText's ici_pipeline_parallelism)
    ici_fsdp: int = -1
    ici_fsdp_transpose: int = 1
    ici_sequence: int = 1
    ici_tensor: int = 1
    ici_expert: int = 1
    dcn_data: int = -1
    dcn_stage: int = 1  # MaxText's dcn_pipeline_parallelism
    dcn_fsdp: int = 1
    dcn_fsdp_transpose: int = 1
    dcn_sequence: int = 1
    dcn_tensor: int = 1
    dcn_expert: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            require(value == -1 or value >= 1, f"{f.name} must be a positive integer or -1, got {value}")
