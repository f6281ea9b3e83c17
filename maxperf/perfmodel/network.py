"""Bandwidth models of collectives over ICI tori, NVLink domains and host networks (DCN, InfiniBand).

A ring collective over n members moves (n-1)/n of the full buffer through each member for an all-gather or a
reduce-scatter and 2(n-1)/n for an all-reduce (Patarasuk & Yuan 2009; the NCCL "bus bandwidth" convention).
Over several networks the collective is hierarchical: the part inside the fast network moves the full buffer, the
part across the slow one moves 1/a of it, a being the members inside the fast network (as XLA and NCCL do).

An all-to-all over n members sends each member's buffer out in n equal parts, one to each member: through a switch
(NVLink, a host network) (n-1)/n of the buffer leaves each member at its own bandwidth; on a torus the parts travel
several hops and share the links, so a member's traffic is its buffer times the mean hops, spread over its links
(bisection-bound for a large ring, as Dally & Towles 2004, sec. 3.3, derive for uniform traffic on a torus).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from maxperf.perfmodel.chips import Chip
from maxperf.spec.logical_axes import MESH_AXES
from maxperf.spec.mesh import Mesh
from maxperf.spec.topology import Topology

# Mesh axes are laid out innermost first (the one needing the most bandwidth takes the fastest, nearest chips),
# as jax's mesh_utils.create_device_mesh and MaxText's default ordering do for tensor parallelism; fsdp_transpose
# sits inside fsdp, as in MaxText's mesh_axes.
INNERMOST_FIRST = ("tensor", "sequence", "expert", "fsdp_transpose", "fsdp", "stage", "data")
# A torus ring runs both ways round each dimension it spans: 2 links per dimension, one direction each. A dimension
# without its wraparound link is a line, whose ring collectives reach each member through one port at a time: half
# the bandwidth ("this is an important caveat, since it typically doubles the time of most communication", [book]
# part 2; its worked all-gather over a 4-chip v5e axis without wraparound takes (n - 1) / n of the buffer over one
# link's one-way bandwidth).
LINKS_PER_TORUS_DIM = 2
LINKS_PER_LINE_DIM = 1
# Which dimensions of a TPU slice close into rings. A 2D torus (v5e, v6e) has its wraparound only along a dimension
# of the pod's full 16 chips ([book] part 2: "TPU v5e only has a wraparound connection when one axis has size 16";
# "a TPU v5e 8x16 will have a wraparound on the longer axis"). A 3D torus (v4, v5p, TPU7x: cubes of 4x4x4 joined by
# optical switches) wraps every dimension once the slice is whole cubes, and none below a cube ([v5p] "All 4x4x4 and
# larger slices (one cube) have full 3D torus"; [book]: 2x2x1, 2x2x2 and 2x2x4 have no wraparounds). [book]: Austin
# et al., "How to Scale Your Model", jax-ml.github.io/scaling-book, parts 2 (TPUs) and 3 (sharding); [v5p]:
# cloud.google.com/tpu/docs/v5p.
POD_SIDE_2D = 16
CUBE_SIDE = 4
# Fixed cost per collective (launch and synchronisation) inside a slice or NVLink domain, an assumption: a few hops of
# ICI/NVLink latency. Across slices and hosts the cost is a latency per step of the collective's ring
# (perfmodel.work.Constants.dcn_step_latency; CollectiveTime.dcn_steps counts the steps).
LATENCY_S = {"ici": 5e-6}

FACTOR = {
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-reduce": lambda n: 2 * (n - 1) / n,
}


@dataclass(frozen=True)
class AxisNetwork:
    """How one mesh axis is spread: `inner` members on the chip-to-chip network, `outer` across hosts/slices."""

    axis: str
    inner: int
    outer: int
    inner_bandwidth: float  # bytes/s per chip, one direction, on the chip-to-chip network
    outer_bandwidth: float  # bytes/s per chip on the host network
    torus: bool = False  # on a torus, axes on different dimensions use different links, so bandwidths add
    kind_efficiency: tuple[tuple[str, float], ...] = ()  # (collective, bandwidth relative to inner_bandwidth)
    inner_latency: float = LATENCY_S["ici"]  # fixed seconds per collective on the chip-to-chip network
    torus_dims: int = 1  # on a torus, the dimensions the axis spans (inner_bandwidth counts the links of all of them)
    links: int = 2  # on a torus, the one-way links inner_bandwidth counts: 2 per closed dimension, 1 per line

    def efficiency(self, kind: str) -> float:
        return next((e for k, e in self.kind_efficiency if k == kind), 1.0)


def _torus_dims_spanned(torus: tuple[int, ...], sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The torus dimensions (indices into `torus`) each ICI mesh axis spans, filling dimensions innermost axis
    first; an axis of one member spans none."""
    free = list(torus)
    out = {}
    for axis in INNERMOST_FIRST:
        rest, spanned = sizes[axis], []
        for i, cap in enumerate(free):
            if rest == 1:
                break
            take = math.gcd(rest, cap)
            if take > 1:
                free[i] //= take
                rest //= take
                spanned.append(i)
        out[axis] = tuple(spanned)
    return out


def wraparounds(chip: Chip, torus: tuple[int, ...]) -> tuple[bool, ...]:
    """Which dimensions of a slice of `torus` close into rings (the notes at POD_SIDE_2D); a layout of another
    rank than the chip's torus (a test's bare chip count) is taken as a closed ring."""
    if chip.torus_dims is None or len(torus) != chip.torus_dims:
        return (True,) * len(torus)
    if chip.torus_dims == 2:
        return tuple(side == POD_SIDE_2D for side in torus)
    whole_cubes = all(side % CUBE_SIDE == 0 for side in torus)
    return (whole_cubes,) * len(torus)


def axis_networks(mesh: Mesh, chip: Chip, topology: Topology) -> dict[str, AxisNetwork]:
    """Each mesh axis's network on this chip and topology (callers must not change the dict)."""
    key = (tuple(mesh.ici.items()), tuple(mesh.dcn.items()), chip, topology)
    if (nets := _NETWORKS.get(key)) is None:  # a search asks at every candidate of a mesh
        if len(_NETWORKS) >= 1024:
            _NETWORKS.clear()
        nets = _NETWORKS[key] = _axis_networks(mesh, chip, topology)
    return nets


_NETWORKS: dict[tuple, dict[str, AxisNetwork]] = {}


def _axis_networks(mesh: Mesh, chip: Chip, topology: Topology) -> dict[str, AxisNetwork]:
    host_bw = chip.host_network_per_chip
    if chip.kind == "tpu":
        ici = {a: mesh.ici.get(a, 1) for a in MESH_AXES}
        torus = tuple(topology.torus or ()) or (max(1, topology.chips // max(topology.num_slices, 1)),)
        spanned, closed = _torus_dims_spanned(torus, ici), wraparounds(chip, torus)

        def links(dims: tuple[int, ...]) -> int:  # one direction of each link the axis's rings run over
            return sum(LINKS_PER_TORUS_DIM if closed[i] else LINKS_PER_LINE_DIM for i in dims) or LINKS_PER_TORUS_DIM

        return {
            a: AxisNetwork(a, ici[a], mesh.dcn.get(a, 1), links(spanned[a]) * chip.link_bandwidth, host_bw,
                           torus=True, torus_dims=max(len(spanned[a]), 1), links=links(spanned[a]))
            for a in MESH_AXES
        }
    if chip.kind == "gpu":
        # NVSwitch: every GPU reaches any peer in its domain with all its links; beyond the domain, its own NIC. The
        # domain is the topology's (a job given part of an NVL72 rack has only its own GPUs in it). A mesh's ici axes
        # lie inside the topology's fast-interconnect domains and its dcn axes across them (aot.targets builds the
        # device mesh so); of the ici axes, those past the NVLink domain, innermost first, reach over the NIC too
        domain = min(chip.nvlink_domain or 1, topology.devices_per_ici_domain)
        nvlink = chip.link_bandwidth * chip.link_count
        out, inner_product = {}, 1
        for a in INNERMOST_FIRST:
            n = mesh.ici.get(a, 1)
            inside = max(1, min(n, domain // inner_product)) if inner_product <= domain else 1
            inside = math.gcd(n, inside)
            out[a] = AxisNetwork(a, inside, n // inside * mesh.dcn.get(a, 1), nvlink, host_bw)
            inner_product *= n
        return out
    return _cpu_networks(mesh, chip, topology)


def _cpu_networks(mesh: Mesh, chip: Chip, topology: Topology) -> dict[str, AxisNetwork]:
    """CPU devices of one host share memory (links at the calibrated collective rate and latency); hosts talk over
    the network."""
    per_host = max(1, topology.chips_per_host)
    out, inner_product = {}, 1
    for a in INNERMOST_FIRST:
        n = mesh.axes[a]
        inside = math.gcd(n, max(1, per_host // inner_product)) if inner_product <= per_host else 1
        out[a] = AxisNetwork(a, inside, n // inside, chip.link_bandwidth, chip.host_network_per_chip,
                             kind_efficiency=chip.collective_efficiency,
                             inner_latency=chip.collective_latency if chip.collective_latency is not None
                             else LATENCY_S["ici"])
        inner_product *= n
    return out


@dataclass(frozen=True)
class CollectiveTime:
    ici_s: float
    dcn_s: float  # bandwidth time across slices or hosts, without latency
    # the latencies the part across slices or hosts pays: on TPUs a ring over n slices runs n - 1 steps of
    # exchanges one after another (2(n - 1) for an all-reduce's reduce-scatter then all-gather: Thakur et al. 2005,
    # "Optimization of collective communication operations in MPICH"), each a transfer through the hosts' network
    # stack; on GPUs and CPUs one per collective (NCCL and gloo pipeline their steps)
    dcn_steps: float = 0.0


RING_STEPS = {"all-gather": lambda n: n - 1, "reduce-scatter": lambda n: n - 1, "all-reduce": lambda n: 2 * (n - 1),
              "all-to-all": lambda n: n - 1}


def _dcn_steps(kind: str, outer: int, nets: list[AxisNetwork], pieces: int) -> float:
    """Latencies paid across slices or hosts by `pieces` collectives over `outer` members (CollectiveTime.dcn_steps)."""
    return pieces * (RING_STEPS[kind](outer) if all(x.torus for x in nets) else 1)


def collective_time(kind: str, nbytes: float, axes: tuple[str, ...], nets: dict[str, AxisNetwork],
                    pieces: int = 1) -> CollectiveTime:
    """One collective of a `nbytes` buffer (the full, unsharded size) over the product of `axes`, issued as `pieces`
    separate collectives (one per array), each paying the network's fixed cost."""
    inner = math.prod(nets[a].inner for a in axes)
    outer = math.prod(nets[a].outer for a in axes)
    f = FACTOR[kind]
    ici = dcn = 0.0
    if inner > 1:
        # on a torus each axis has its own dimensions' links and a multi-axis collective uses them all; through a
        # switch (NVLink, memory) the axes share one set of links
        bws = [nets[a].inner_bandwidth * nets[a].efficiency(kind) for a in axes if nets[a].inner > 1]
        bw = sum(bws) if all(nets[a].torus for a in axes) else min(bws)
        latency = max(nets[a].inner_latency for a in axes if nets[a].inner > 1)
        ici = f(inner) * nbytes / bw + pieces * latency
    if outer > 1:
        spanning = [nets[a] for a in axes if nets[a].outer > 1]
        dcn = f(outer) * nbytes / inner / min(x.outer_bandwidth for x in spanning)
        return CollectiveTime(ici, dcn, _dcn_steps(kind, outer, spanning, pieces))
    return CollectiveTime(ici, dcn)


def torus_mean_hops(members: int, dims: int) -> float:
    """Mean hops from a member of a `dims`-dimensional torus of `members` to all members (itself included), a ring
    of k = members^(1/dims) per dimension: k/4 per dimension, both directions round each ring."""
    k = members ** (1 / dims)
    return dims * k / 4


def all_to_all_time(nbytes: float, axes: tuple[str, ...], nets: dict[str, AxisNetwork]) -> CollectiveTime:
    """One all-to-all in which each member sends `nbytes` (its whole buffer, its own share included) over the
    product of `axes`: the parts for members inside the fast network over it (a torus: times the mean hops, over
    all its links), the parts for the other slices or hosts over the host network."""
    inner = math.prod(nets[a].inner for a in axes)
    outer = math.prod(nets[a].outer for a in axes)
    n = inner * outer
    ici = dcn = 0.0
    if inner > 1:
        local = nbytes * inner / n
        fast = [nets[a] for a in axes if nets[a].inner > 1]
        if all(x.torus for x in fast):
            bw = sum(x.inner_bandwidth for x in fast)
            traffic = local * torus_mean_hops(inner, sum(x.torus_dims for x in fast))
        else:
            bw = min(x.inner_bandwidth for x in fast)
            traffic = local * (inner - 1) / inner
        ici = traffic / bw + max(x.inner_latency for x in fast)
    if outer > 1:
        spanning = [nets[a] for a in axes if nets[a].outer > 1]
        dcn = nbytes * (outer - 1) / outer / min(x.outer_bandwidth for x in spanning)
        return CollectiveTime(ici, dcn, _dcn_steps("all-to-all", outer, spanning, 1))
    return CollectiveTime(ici, dcn)
