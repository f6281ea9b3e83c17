"""The resolved mesh, one type for every part: the parallelism config's sizes (-1 to fill) resolved over a topology
into each axis's size inside one fast-interconnect domain (ICI: a TPU slice, an HGX host, a GB200 NVL72 rack) and
across domains (DCN). perfmodel counts with it; maxperf.aot.devices builds the jax Mesh from it."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from maxperf.spec.errors import MaxperfError, require
from maxperf.spec.logical_axes import DCN_AXES, MESH_AXES
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.topology import Topology


@dataclass(frozen=True, eq=False)
class Mesh:
    """Each mesh axis's size within a domain (`ici`) and across domains (`dcn`); the axis is their product."""

    ici: Mapping[str, int]
    dcn: Mapping[str, int]

    @functools.cached_property
    def axes(self) -> dict[str, int]:
        # an artifact written before an axis existed lacks it: size 1
        return {a: self.ici.get(a, 1) * self.dcn.get(a, 1) for a in MESH_AXES}

    @functools.cached_property
    def sizes(self) -> tuple[tuple[str, int], ...]:
        """The axes as a hashable key (computed once per mesh: caches key on it)."""
        return tuple(self.axes.items())

    @property
    def devices(self) -> int:
        return math.prod(self.axes.values())

    def size(self, *names: str) -> int:
        return math.prod(self.axes[a] for a in names)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self.sizes == other.sizes and _ones(self.dcn) == _ones(other.dcn)

    def __hash__(self) -> int:
        return hash((self.sizes, tuple(sorted(_ones(self.dcn).items()))))

    def shown(self) -> str:
        """'data=2 x fsdp=8', the axes over 1 (or '1')."""
        return " x ".join(f"{a}={n}" for a, n in self.axes.items() if n > 1) or "1"

    def as_dict(self) -> dict:
        return {"axes": self.axes, "ici": dict(self.ici), "dcn": dict(self.dcn)}

    @classmethod
    def of(cls, axes: Mapping[str, int], dcn: Mapping[str, int] | None = None) -> Mesh:
        """A mesh from whole-axis sizes and the DCN part of each (which must divide it)."""
        unknown = sorted(set(axes) - set(MESH_AXES)) + sorted(set(dcn or {}) - set(DCN_AXES))
        require(not unknown, f"unknown mesh axes {', '.join(unknown)}; valid: {', '.join(MESH_AXES)}")
        whole = {a: int(axes.get(a, 1)) for a in MESH_AXES}
        parts = {a: int((dcn or {}).get(a, 1)) for a in DCN_AXES}
        bad = [f"{a}={n}" for a, n in whole.items() if n < 1]
        require(not bad, f"mesh axis sizes must be >= 1, got {', '.join(bad)}")
        for a, n in parts.items():
            require(n >= 1 and whole[a] % n == 0, f"dcn {a}={n} must be >= 1 and divide mesh {a}={whole[a]}")
        return cls(ici={a: whole[a] // parts[a] for a in MESH_AXES}, dcn=parts)

    def check(self, topology: Topology) -> Mesh:
        """This mesh, after checking it spans the topology: the axes multiply to its devices, the DCN parts to its
        fast-interconnect domains."""
        expected = topology.num_devices
        require(self.devices == expected,
                f"mesh axes {_shown(self.axes)} multiply to {self.devices} but the topology has {expected} devices")
        domains = topology.ici_domains
        require(math.prod(self.dcn.values()) == domains,
                f"dcn axes {_shown(self.dcn)} multiply to {math.prod(self.dcn.values())} but the topology has "
                f"{domains} DCN domain(s) (slices, or GPU NVLink domains); make their product {domains}")
        return self


def _ones(sizes: Mapping[str, int]) -> dict[str, int]:
    return {a: n for a, n in sizes.items() if n != 1}


def _shown(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{a}={n}" for a, n in sizes.items() if n != 1) or "all 1"


def resolve(parallelism: ParallelismConfig, topology: Topology) -> Mesh:
    """ICI sizes over the devices of one domain and DCN sizes over the domains, each -1 filling what is left."""
    one, many = domain_words(topology)
    ici = _fill({a: getattr(parallelism, f"ici_{a}") for a in MESH_AXES}, topology.devices_per_ici_domain, "ici",
                f"devices in each {one} of {topology.name}")
    dcn = _fill({a: getattr(parallelism, f"dcn_{a}") for a in DCN_AXES}, topology.ici_domains, "dcn",
                f"{many} in {topology.name}")
    return Mesh(ici=ici, dcn=dcn)


def domain_words(topology: Topology) -> tuple[str, str]:
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
