"""One resolution of a request (topology, model, overrides, slices) into configs and a mesh.

Every command plans through `plan()`: compile, estimate, estimate-memory, sweep and run read the same mesh. This is
the one place that turns the parallelism config (sizes, -1 to fill) into mesh sizes over a topology: ICI axes span
one fast-interconnect domain (a TPU slice, an HGX host, a GB200 NVL72 rack), DCN axes span the domains.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from maxperf.aot import topologies
from maxperf.aot.topologies import Topology
from maxperf.errors import MaxperfError
from maxperf.logical_axes import mesh_axes_for, undivided_axes
from maxperf.models import overrides as overrides_mod
from maxperf.models import presets
from maxperf.models.config import DCN_AXES, MESH_AXES, ModelConfig, ParallelismConfig
from maxperf.models.overrides import Configs

GIB = 1 << 30


@dataclass(frozen=True)
class MeshShape:
    """Resolved mesh sizes: within a domain (ICI) and across domains (DCN); each mesh axis is their product."""

    ici: dict[str, int]
    dcn: dict[str, int]

    @property
    def axes(self) -> dict[str, int]:
        # an artifact written before an axis existed lacks it: size 1
        return {a: self.ici.get(a, 1) * self.dcn.get(a, 1) for a in MESH_AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.axes.values())

    def shown(self) -> str:
        """'data=2 x fsdp=8', the axes over 1 (or '1')."""
        return " x ".join(f"{a}={n}" for a, n in self.axes.items() if n > 1) or "1"


@dataclass(frozen=True)
class Plan:
    """What to compile: the configs, the topology, the resolved mesh, and what the user should know about it."""

    topology: Topology
    configs: Configs
    mesh_shape: MeshShape
    warnings: tuple[str, ...] = ()  # one line each: dimensions the mesh does not divide, with their cost

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
    mesh_shape = resolve_mesh(configs.parallelism, topo)
    configs.train.micro_batch(mesh_shape.devices)  # B x devices examples per microbatch: a whole number
    _check_experts(configs.model, mesh_shape)
    notes: tuple[str, ...] = ()
    if configs.parallelism == ParallelismConfig() and (keep := _fsdp_dividing_width(configs, mesh_shape)):
        # the default mesh would replicate every weight along fsdp: fsdp takes what divides D, data the rest
        notes = (f"the default fsdp={mesh_shape.ici['fsdp']} does not divide D={configs.model.d_model}: planned "
                 f"ici_fsdp={keep} ici_data={mesh_shape.ici['fsdp'] // keep} instead, which does (set ici_fsdp to "
                 "choose)",)
        configs = dataclasses.replace(configs, parallelism=ParallelismConfig(ici_data=-1, ici_fsdp=keep))
        mesh_shape = resolve_mesh(configs.parallelism, topo)
    return Plan(topo, configs, mesh_shape, notes + replication_warnings(configs, mesh_shape)
                + gpu_grouped_matmul_warnings(configs, mesh_shape, topo))


def gpu_grouped_matmul_warnings(configs: Configs, mesh: MeshShape, topo: Topology) -> tuple[str, ...]:
    """On GPU a dropless MoE step's jax.lax.ragged_dot has no grouped GEMM: XLA multiplies every routed row by each
    local expert (perfmodel.memory.RAGGED_EXPANDED_D_BUFFERS), which MaxText's GPU MoE configs avoid with the dense
    dispatch."""
    if topo.platform != "gpu" or not configs.model.is_moe or not configs.train.sparse_matmul:
        return ()
    local = configs.model.num_experts // mesh.axes["expert"]
    if local <= 1:
        return ()
    return (f"on GPU XLA runs the dropless experts (sparse_matmul=true) as dense products of every routed row with "
            f"each of the device's {local} local experts: its buffers and FLOPs are {local}x a grouped matmul's. "
            f"MaxText's GPU MoE configs set sparse_matmul=false with a capacity_factor (e.g. 1.25); more expert "
            f"parallelism leaves fewer local experts",)


def _check_experts(model: ModelConfig, mesh: MeshShape) -> None:
    """A mixture of experts puts E / (ici_expert x dcn_expert) whole experts on each device: the axis must divide E."""
    ep = mesh.axes["expert"]
    if model.is_moe and model.num_experts % ep:
        fits = [n for n in range(1, ep + 1) if model.num_experts % n == 0 and mesh.devices % n == 0]
        raise MaxperfError(f"the expert axis ({mesh.ici['expert']} ICI x {mesh.dcn['expert']} DCN = {ep}) does not "
                           f"divide num_experts={model.num_experts}; choose an ici_expert x dcn_expert product that "
                           f"does, e.g. {fits[-1]}")


def _fsdp_dividing_width(configs: Configs, mesh: MeshShape) -> int | None:
    """The largest ICI fsdp size that divides the model width D, where the mesh's own does not; else None."""
    keep = math.gcd(mesh.ici["fsdp"], configs.model.d_model)
    return keep if keep < mesh.ici["fsdp"] else None


def resolve_mesh(parallelism: ParallelismConfig, topology: Topology) -> MeshShape:
    """ICI sizes over the devices of one domain and DCN sizes over the domains, each -1 filling what is left."""
    one, many = _domain_words(topology)
    ici = _fill({a: getattr(parallelism, f"ici_{a}") for a in MESH_AXES}, topology.devices_per_ici_domain, "ici",
                f"devices in each {one} of {topology.name}")
    dcn = _fill({a: getattr(parallelism, f"dcn_{a}") for a in DCN_AXES}, topology.ici_domains, "dcn",
                f"{many} in {topology.name}")
    return MeshShape(ici=ici, dcn=dcn)


def _domain_words(topology: Topology) -> tuple[str, str]:
    """What one fast-interconnect domain of the topology is called, singular and plural."""
    if topology.platform == "gpu":
        unit = "host" if topology.hosts_per_nvlink_domain == 1 else "rack"
        return f"NVLink domain ({unit})", f"NVLink domains ({unit}s)"
    return "slice", "slices"


def _fill(sizes: dict[str, int], total: int, prefix: str, what: str) -> dict[str, int]:
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise MaxperfError(f"at most one {prefix}_* axis may be -1, got {', '.join(f'{prefix}_{a}' for a in free)}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    shown = " x ".join(f"{prefix}_{a}={s}" for a, s in sizes.items() if s != 1)
    if free:
        if total % fixed:
            raise MaxperfError(f"{shown} cannot fill {total} {what}: the fixed axes multiply to {fixed}, which does "
                               f"not divide {total}")
        return {**sizes, free[0]: total // fixed}
    if fixed != total:
        raise MaxperfError(f"{shown or prefix + ' axes all 1'} multiply to {fixed} but there are {total} {what}; "
                           f"make the product {total} or set one {prefix}_* axis to -1")
    return sizes


# The letter of each logical axis, for messages (one letter per dimension).
_LETTERS = {"embed": "D", "vocab": "V", "mlp": "F", "heads": "H", "kv_heads": "K", "activation_batch": "B",
            "activation_length": "L", "activation_heads": "H", "activation_kv_heads": "K", "activation_mlp": "F",
            "activation_vocab": "V", "activation_embed": "D"}


def replication_warnings(configs: Configs, mesh: MeshShape) -> tuple[str, ...]:
    """A line for each mesh axis that does not divide a dimension it would shard.

    The sharding rules (`maxperf.logical_axes`) replicate a dimension along such an axis, and so does the compiled
    step: every device then holds the whole dimension. Weights say what their state costs per device."""
    from maxperf.perfmodel import memory as perf_memory
    from maxperf.perfmodel.shapes import DTYPE_BYTES, Mesh
    from maxperf.perfmodel.sharding import param_arrays

    model, train, axes = configs.model, configs.train, mesh.axes
    found: dict[tuple[str, str], tuple[int, int, bool]] = {}  # (letter, axis) -> (size, axis size, a weight?)
    arrays = [(x.shape, x.logical, True) for x in param_arrays(model)]
    arrays += [((train.micro_batch(mesh.devices), train.seq_len), ("activation_batch", "activation_length"), False)]
    arrays += [((size,), (name,), False) for size, name in (
        (model.num_heads, "activation_heads"), (model.num_kv_heads, "activation_kv_heads"),
        (model.d_ff, "activation_mlp"), (model.vocab_size, "activation_vocab"))]
    held_of: dict[tuple[str, str], int] = {}  # what one device holds of an activation dimension
    for shape, logical, weight in arrays:
        spec = mesh_axes_for(shape, logical, axes)
        for dim, axis in undivided_axes(shape, logical, axes):
            key = (_LETTERS.get(logical[dim], logical[dim]), axis)
            _, _, was_weight = found.get(key, (0, 0, False))
            found[key] = (shape[dim], axes[axis], weight or was_weight)
            split = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],) if spec[dim] else ()
            held_of[key] = shape[dim] // math.prod(axes[a] for a in split)
    if not found:
        return ()
    perf_mesh = Mesh(axes=axes, dcn=mesh.dcn)
    state_per_param = DTYPE_BYTES[str(train.param_dtype)] * (1 + perf_memory.OPTIMIZER_STATES_PER_PARAM)
    held = perf_memory.params_per_device(model, perf_mesh) * state_per_param
    even = sum(x.count * math.prod(x.shape) for x in param_arrays(model)) * state_per_param / mesh.devices
    lines = []
    for (letter, axis), (size, n, weight) in found.items():
        line = f"{axis}={n} does not divide {letter}={size}: {letter} is replicated along {axis}, not split"
        if weight:
            line += (f"; parameters and optimizer state take {held / GIB:.2f} GiB per device ({even / GIB:.2f} GiB "
                     f"if split over all {mesh.devices} devices)")
        elif held_of[(letter, axis)] == size:
            line += f"; each device holds all {size} of it"
        else:
            line += (f"; each device holds {held_of[(letter, axis)]} of the {size}, and the {n} devices along {axis} "
                     "compute the same ones")
        lines.append(line + f"; {_suggestion(mesh, axis, size)}")
    return tuple(lines)


def _suggestion(mesh: MeshShape, axis: str, size: int) -> str:
    """A mesh that divides: the ICI part of `axis` cut to what divides `size`, the rest moved to data."""
    ici = mesh.ici[axis]
    keep = math.gcd(ici, size // math.gcd(size, mesh.dcn.get(axis, 1)))
    if axis == "data" or keep == ici:
        return f"choose axis sizes whose product on {axis} divides {size}"
    return f"e.g. ici_{axis}={keep} ici_data={mesh.ici['data'] * ici // keep}"
