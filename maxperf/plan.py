"""One resolution of a request (topology, model, overrides, slices) into configs and a mesh.

Every command plans through `plan()`: compile, estimate, estimate-memory, sweep and run read the same mesh.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from maxperf.aot import topologies
from maxperf.aot.topologies import Topology
from maxperf.models import overrides as overrides_mod
from maxperf.models import presets
from maxperf.models.config import MeshShape, ModelConfig
from maxperf.models.overrides import Configs


@dataclass(frozen=True)
class Plan:
    """What to compile: the configs, the topology and the resolved mesh."""

    topology: Topology
    configs: Configs
    mesh_shape: MeshShape

    @property
    def model(self) -> ModelConfig:
        return self.configs.model

    def default_dir(self) -> Path:
        slices = f"_x{self.topology.num_slices}" if self.topology.num_slices > 1 else ""
        return Path("artifacts") / f"{self.model.name}_{self.topology.name}{slices}"


def plan(topology: str | Topology, model: str | ModelConfig = presets.DEFAULT_MODEL, overrides: Sequence[str] = (),
         *, num_slices: int = 1, target_config: str | os.PathLike | None = None) -> Plan:
    """Resolves names and overrides into configs and a mesh; every mistake is a MaxperfError naming what is valid."""
    topo = topology if isinstance(topology, Topology) else topologies.get(
        topology, num_slices=num_slices, target_config_path=None if target_config is None else str(target_config))
    model_cfg = model if isinstance(model, ModelConfig) else presets.get(model)
    configs = overrides_mod.apply(model_cfg, list(overrides))
    mesh_shape = configs.parallelism.resolve(topo.devices_per_ici_domain, topo.ici_domains)
    return Plan(topo, configs, mesh_shape)
