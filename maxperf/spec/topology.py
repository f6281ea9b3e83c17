"""The machines maxperf compiles for: a catalog of TPU, GPU and CPU topologies, in plain Python (their devices and
jax meshes are maxperf.aot.devices').

Sources, one per family (the table `_TPU_FAMILIES` and `_GPU_SYSTEMS` below carries them too):
- TPU names, slice shapes and hosts follow the Cloud TPU accelerator types (cloud.google.com/tpu/docs/v4, /v5e,
  /v5p, /v6e, /tpu7x). N in `v4-N`, `v5p-N` and `tpu7x-N` counts TensorCores (two per chip), in `v5e-N` and `v6e-N`
  chips. Slices below one 4x4x4 cube are listed shape by shape; whole-cube slices are every cube count up to the
  family's largest slice, each with its most cube-like AxBxC (A<=B<=C multiples of 4, shortest longest side, then
  longest shortest side), dropping shapes with a side over 256 chips: this reproduces the Cloud docs' v5p table
  (4x4x4 ... 16x16x24) and the accelerator-type lists of xpk/MaxText.
- libtpu topology strings ("v5p:8x8x8") are what `jax.experimental.topologies.get_topology_desc(platform="tpu")`
  accepts with libtpu 0.0.50.1, checked here for every catalog entry (v4 needs chip config "megacore" to give one
  device per chip; v5e/v6e single hosts of 8 chips need chips_per_host_bounds (2, 4, 1); tpu7x gives two devices
  per chip, its two chiplets, as on Cloud).
- GPU: HGX systems of 8 GPUs per host joined by NVLink, hosts joined by InfiniBand/RoCE; GB200 NVL72 racks of
  18 compute trays (hosts) of 4 GPUs in one NVLink domain; Google Cloud's A3 High and A3 Mega VMs (8 H100s, hosts
  joined by fewer NICs: cloud.google.com/compute/docs/gpus/gpu-network-bandwidth). Devices come from the CUDA
  plugin's topology "PARTITIONSxHOSTSxGPUS" with an embedded target spec (see `gpu_targets`), one partition per
  NVLink domain.
- CPU: `cpu-N` is N host-platform devices of this very process (XLA_FLAGS=--xla_force_host_platform_device_count).

Meshes: ICI axes span one fast-interconnect domain, DCN axes span domains. The domain is a TPU slice, an HGX host
(NVLink inside, InfiniBand across hosts), or a GB200 NVL72 rack; for CPU the whole process.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

from maxperf.spec import gpu_targets
from maxperf.spec.errors import MaxperfError, unknown
from maxperf.spec.hardware import CHIPS, Chip

_CUBE = 4  # chips per side of a TPU cube (v4, v5p, tpu7x)
_MAX_SIDE = 256
# The most slices one job is known to have joined over DCN: 199, Google Cloud's 50,944-chip TPU v5e job of November
# 2023 (199 slices of v5e-256, run with MaxText; cloud.google.com/blog/products/compute/
# the-worlds-largest-distributed-llm-training-job-on-tpu-v5e, and MaxText's docs/reference/architecture/
# architecture_overview.md). The bound rounds it up to a power of two: room to plan a little past the largest job
# run, while a count no DCN has joined (100,000,000 slices of v5p-64 would be 3.2 billion chips) is refused.
MAX_SLICES = 256


@dataclasses.dataclass(frozen=True)
class Topology:
    """One machine: `num_slices` slices, each `hosts_per_slice` hosts of `chips_per_host` chips."""

    name: str
    platform: str  # "tpu" | "gpu" | "cpu"
    chip: str  # key of maxperf.spec.hardware.CHIPS
    chips_per_slice: int
    hosts_per_slice: int
    chips_per_host: int
    num_slices: int = 1
    torus: tuple[int, ...] = ()  # TPU: ICI dims of a slice; GPU: (hosts, gpus per host); CPU: (devices,)
    libtpu_topology: str | None = None
    gpu_target: str | None = None  # the plugin's device description of the embedded GPU spec
    devices_per_chip: int = 1  # tpu7x: 2 (one JAX device per chiplet)
    chip_config: str | None = None  # libtpu chip_config_name
    chips_per_host_bounds: tuple[int, int, int] | None = None  # passed to libtpu where its default differs
    hosts_per_nvlink_domain: int = 1  # GPU: 1 for HGX, 18 for a whole GB200 NVL72 rack (fewer for part of one)
    # GPU: each host's GPU-to-GPU network, bytes/s, where the system's is not its chip's reference host's
    # (Chip.host_network_bandwidth): Google Cloud's A3 High and A3 Mega VMs
    host_network_bandwidth: float | None = None
    target_config_path: str | None = None  # GPU: a user's GpuTargetConfigProto file instead of the embedded spec

    @property
    def chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def display_name(self) -> str:
        """`v5p-128`, or `2 x v5p-128` over two slices (`name` is one slice's)."""
        return f"{self.num_slices} x {self.name}" if self.num_slices > 1 else self.name

    @property
    def hosts(self) -> int:
        return self.hosts_per_slice * self.num_slices

    @property
    def num_devices(self) -> int:
        """JAX devices over all slices (chips times devices per chip)."""
        return self.chips * self.devices_per_chip

    @property
    def ici_domains(self) -> int:
        """Fast-interconnect domains (TPU slices, HGX hosts, NVL72 racks): the DCN mesh axes span these."""
        if self.platform == "gpu":
            return self.hosts // self.hosts_per_nvlink_domain
        return self.num_slices

    @property
    def devices_per_ici_domain(self) -> int:
        return self.num_devices // self.ici_domains

    @property
    def target_hbm_bytes(self) -> int | None:
        """The memory per chip the compiler lets a program hold. GPU: what the target spec compiled for states
        (`device_memory_size`), None where the CUDA plugin that holds the spec is missing; TPU: libtpu's (the chip
        table's usable_hbm_bytes); None elsewhere. perfmodel reads this, else the chip table's hbm_bytes."""
        if self.platform == "tpu":
            usable = _chip_spec(self.chip).usable_hbm_bytes
            return None if usable is None else int(usable)
        if self.platform != "gpu":
            return None
        return gpu_targets.target_memory_bytes(self.chip, self.target_config_path)

    @property
    def hbm_bytes_per_chip(self) -> int | None:
        target = self.target_hbm_bytes
        return target if target is not None else int(_chip_spec(self.chip).hbm_bytes)

    @property
    def hbm_bytes_per_device(self) -> int | None:
        """The memory one JAX device (what memory_analysis() reports on) owns: half a chip's on tpu7x."""
        per_chip = self.hbm_bytes_per_chip
        return None if per_chip is None else per_chip // self.devices_per_chip

    @property
    def peak_bf16_flops_per_chip(self) -> float | None:
        return float(_chip_spec(self.chip).peak_bf16_flops)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "platform": self.platform,
            "chip": self.chip,
            "chips": self.chips,
            "hosts": self.hosts,
            "num_slices": self.num_slices,
            "chips_per_slice": self.chips_per_slice,
            "hosts_per_slice": self.hosts_per_slice,
            "chips_per_host": self.chips_per_host,
            "devices": self.num_devices,
            "torus": list(self.torus),
            "libtpu_topology": self.libtpu_topology,
            "gpu_target": self.gpu_target,
            "target_config_path": self.target_config_path,
            "hbm_bytes_per_chip": self.hbm_bytes_per_chip,
            "hbm_bytes_per_device": self.hbm_bytes_per_device,
            "peak_bf16_flops_per_chip": self.peak_bf16_flops_per_chip,
        }


def _chip_spec(chip: str) -> Chip:
    return CHIPS[chip]


# ---------------------------------------------------------------------------------------------------------------
# The catalog


@dataclasses.dataclass(frozen=True)
class _TpuFamily:
    prefix: str  # Cloud accelerator-type prefix
    chip: str
    libtpu: str  # libtpu topology prefix
    cores_per_name_unit: int  # TensorCores counted by N per chip (2), or 1 where N counts chips
    devices_per_chip: int
    chip_config: str | None
    small_shapes: tuple[tuple[int, ...], ...]  # slices below a cube, or every slice of a 2D family
    max_cubes: int  # every whole-cube count up to this; 0 for families without cubes
    extra_cubes: tuple[int, ...]  # larger whole-cube slices offered one by one
    single_host_chips: int  # largest slice that is one host
    source: str


_TPU_FAMILIES = (
    _TpuFamily("v4", "tpu-v4", "v4", 2, 1, "megacore", ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)), 32, (), 4,
               "cloud.google.com/tpu/docs/v4: v4-8 (2x2x1) to v4-4096 (8x16x16, 2048 chips), 4 chips per host"),
    _TpuFamily("v5e", "tpu-v5e", "v5e", 1, 1, None, ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)),
               0, (), 8, "cloud.google.com/tpu/docs/v5e: v5litepod-1/4/8 are one host (1, 4, 8 chips); 16-256 chips "
               "have 4 per host"),
    _TpuFamily("v5p", "tpu-v5p", "v5p", 2, 1, "megacore", ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)), 96, (), 4,
               "cloud.google.com/tpu/docs/v5p: v5p-8 (2x2x1) to v5p-12288 (16x16x24, 96 cubes), 4 chips per host"),
    _TpuFamily("v6e", "tpu-v6e", "v6e", 1, 1, None, ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)),
               0, (), 8, "cloud.google.com/tpu/docs/v6e: v6e-1/4/8 are one host (1, 4, 8 chips); 16-256 chips "
               "have 4 per host"),
    _TpuFamily("tpu7x", "tpu7x", "tpu7x", 2, 2, None, ((1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)), 96,
               (108, 128, 140, 144), 4,
               "cloud.google.com/tpu/docs/tpu7x: two TensorCores (two JAX devices) per chip, 4 chips per host, "
               "9216-chip pod; slices past 96 cubes as xpk lists them (12x24x24, 16x16x32, 16x20x28, 16x24x24); "
               "one chip (1x1x1), GKE's single-chip node as tpu-recipes' Ironwood vLLM recipes serve on it"),
)

# GPU systems: (name prefix, chip key, GPUs per host, hosts per NVLink domain, unit counts offered, each host's
# GPU-to-GPU network in bytes/s where it is not the chip's reference host's (None), source)

_GBIT = 1e9 / 8
_UNITS = (1, 2, 4, 8, 16, 32, 64, 128)
_GPU_SYSTEMS = (
    ("a100", "a100-80gb", 8, 1, _UNITS, None, "HGX A100 80GB (SXM4), 8 GPUs per host"),
    ("a100-40gb", "a100-40gb", 8, 1, _UNITS, None, "HGX A100 40GB (SXM4), 8 GPUs per host"),
    ("h100", "h100-sxm", 8, 1, _UNITS, None, "HGX H100 80GB (SXM5), 8 GPUs per host"),
    ("h200", "h200", 8, 1, _UNITS, None, "HGX H200 141GB, 8 GPUs per host"),
    ("b200", "b200", 8, 1, _UNITS, None, "HGX B200, 8 GPUs per host"),
    ("gb200", "gb200", 4, 18, (1, 2, 4, 8, 16), None, "GB200 NVL72: 18 trays of 4 GPUs in one NVLink domain per rack"),
    # Google Cloud's H100 VMs, whose GPUs share fewer NICs than an HGX host's one 400 Gb/s NIC per GPU
    # (cloud.google.com/compute/docs/gpus/gpu-network-bandwidth): A3 High (a3-highgpu-8g, xpk's h100-80gb-8) 4 NICs
    # of 200 Gbps for GPU-to-GPU traffic (GPUDirect-TCPX), 800 Gbps of its 1,000; A3 Mega (a3-megagpu-8g, xpk's
    # h100-mega-80gb-8) 8 of 200 Gbps (GPUDirect-TCPXO), 1,600 of its 1,800. A3 Ultra (H200) and A4 (B200) give each
    # GPU its own 400 Gbps ConnectX-7, as `h200-8xM` and `b200-8xM` do.
    ("a3-high", "h100-sxm", 8, 1, _UNITS, 4 * 200 * _GBIT,
     "Google Cloud A3 High (a3-highgpu-8g): 8 H100 80GB, GPU-to-GPU over 4 x 200 Gbps NICs"),
    ("a3-mega", "h100-sxm", 8, 1, _UNITS, 8 * 200 * _GBIT,
     "Google Cloud A3 Mega (a3-megagpu-8g): 8 H100 80GB, GPU-to-GPU over 8 x 200 Gbps NICs"),
)


_GPU_PARTIAL_HOST = (1, 2, 4)  # GPUs of one HGX host a job may be given
# Part of an NVL72 rack a job may be given, in trays of 4 GPUs (`gb200-8`: 2 trays of one rack, in its NVLink domain),
# and racks of which a job takes 16 trays each (`gb200-64x4`: 256 GPUs, 64 of each of 4 racks' 72, one NVLink domain
# per rack), as NVIDIA's Megatron-Bridge performance summary runs GB200 on 8, 64 and 256 GPUs
_GB200_PARTIAL_TRAYS = (1, 2, 4, 8, 16)
_GB200_PARTIAL_RACKS = (2, 4, 8, 16)
_CPU_SIZES = (1, 2, 4, 8)
_ALIASES = {"v5litepod": "v5e"}


def _cube_shape(cubes: int) -> tuple[int, int, int] | None:
    """The most cube-like AxBxC (sides multiples of 4, A<=B<=C) holding `cubes` 4x4x4 cubes."""
    best = None
    for a in range(1, cubes + 1):
        for b in range(a, cubes + 1):
            c, rest = divmod(cubes, a * b)
            if rest or c < b:
                continue
            key = (c, -a)
            if best is None or key < best[0]:
                best = (key, (a, b, c))
    if best is None or best[1][2] * _CUBE > _MAX_SIDE:
        return None
    return tuple(side * _CUBE for side in best[1])


def _tpu_topology(family: _TpuFamily, shape: tuple[int, ...]) -> Topology:
    chips = math.prod(shape)
    single_host = chips <= family.single_host_chips
    per_host = chips if single_host else 4
    bounds = None
    if len(shape) == 2 and single_host and chips == 8:
        bounds = (shape[0], shape[1], 1)  # libtpu's default splits 2x4 into two hosts; Cloud's v5e-8/v6e-8 is one
    return Topology(
        name=f"{family.prefix}-{chips * family.cores_per_name_unit}",
        platform="tpu",
        chip=family.chip,
        chips_per_slice=chips,
        hosts_per_slice=chips // per_host,
        chips_per_host=per_host,
        torus=tuple(shape),
        libtpu_topology=f"{family.libtpu}:{'x'.join(map(str, shape))}",
        devices_per_chip=family.devices_per_chip,
        chip_config=family.chip_config,
        chips_per_host_bounds=bounds,
    )


def _gpu_topology(prefix: str, chip: str, per_host: int, nvlink_hosts: int, units: int,
                  network: float | None = None) -> Topology:
    domain = per_host * nvlink_hosts  # GPUs in one NVLink domain
    hosts = units * nvlink_hosts
    return Topology(
        name=f"{prefix}-{domain}" if units == 1 else f"{prefix}-{domain}x{units}",
        platform="gpu",
        chip=chip,
        chips_per_slice=hosts * per_host,
        hosts_per_slice=hosts,
        chips_per_host=per_host,
        torus=(hosts, per_host),
        gpu_target=gpu_targets.CHIP_TO_DEVICE[chip],
        hosts_per_nvlink_domain=nvlink_hosts,
        host_network_bandwidth=network,
    )


def _cpu_topology(n: int, processes: int = 1) -> Topology:
    """`cpu-N`: N devices of this process; `cpu-NxP`: P processes (jax.distributed, gloo) of N devices each."""
    name = f"cpu-{n}" if processes == 1 else f"cpu-{n}x{processes}"
    return Topology(name=name, platform="cpu", chip="cpu", chips_per_slice=n * processes, hosts_per_slice=processes,
                    chips_per_host=n, torus=(n * processes,))

@functools.cache
def _catalog() -> dict[str, Topology]:
    entries: list[Topology] = []
    for family in _TPU_FAMILIES:
        shapes = list(family.small_shapes)
        cube_counts = [*range(1, family.max_cubes + 1), *family.extra_cubes]
        shapes += [s for k in cube_counts if (s := _cube_shape(k)) is not None]
        entries += [_tpu_topology(family, shape) for shape in shapes]
    for prefix, chip, per_host, nvlink_hosts, units, network, _source in _GPU_SYSTEMS:
        if nvlink_hosts == 1 and network is None:  # part of one host: `h100-1`, `h100-2`, `h100-4` (a VM is whole)
            entries += [_gpu_topology(prefix, chip, k, 1, 1) for k in _GPU_PARTIAL_HOST if k < per_host]
        if prefix == "gb200":
            entries += [_gpu_topology(prefix, chip, per_host, trays, 1) for trays in _GB200_PARTIAL_TRAYS]
            entries += [_gpu_topology(prefix, chip, per_host, _GB200_PARTIAL_TRAYS[-1], racks)
                        for racks in _GB200_PARTIAL_RACKS]
        entries += [_gpu_topology(prefix, chip, per_host, nvlink_hosts, m, network) for m in units]
    entries += [_cpu_topology(n) for n in _CPU_SIZES]
    return {t.name: t for t in entries}


def catalog() -> list[Topology]:
    """Every named topology, TPU families first (in chip order), then GPU systems, then CPU."""
    return list(_catalog().values())


MAX_GPU_UNITS = 4096  # HGX hosts (or NVL72 racks) a GPU topology `<gpu>-8xM` may name: past any cluster built


def _any_host_count(key: str) -> Topology | None:
    """`h100-8x24`, `b200-8x3`, `gb200-72x6`: a GPU system of any number of its hosts (or racks), not only the
    catalog's powers of two; None where `key` names no such system."""
    m = re.fullmatch(r"([a-z0-9-]+?)-(\d+)x(\d+)", key)
    if m is None or not 1 <= int(m.group(3)) <= MAX_GPU_UNITS:
        return None
    for prefix, chip, per_host, nvlink_hosts, _, network, _ in _GPU_SYSTEMS:
        if prefix == m.group(1) and int(m.group(2)) == per_host * nvlink_hosts:
            return _gpu_topology(prefix, chip, per_host, nvlink_hosts, int(m.group(3)), network)
    return None


def _unknown_topology(name: str, key: str, table) -> MaxperfError:
    """An unknown topology's error: where it names a family and a size (v5p-65), that family's sizes nearest to it
    (v5p-64, v5p-128); else the names nearest in spelling."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", key)
    sizes = sorted((int(k.rsplit("-", 1)[1]), k) for k in table if m and re.fullmatch(rf"{m.group(1)}-\d+", k))
    if not sizes:
        return unknown("topology", name, list(table))
    want = int(m.group(2))
    nearest = [k for _, k in sorted(sizes, key=lambda s: (abs(math.log(s[0] / want)) if want else s[0], s[0]))[:3]]
    return MaxperfError(f"unknown topology {name!r}; did you mean {', '.join(nearest)}? (`maxperf topologies` lists "
                        "them)")


def _by_chip_grid(name: str, key: str, table: dict[str, Topology]) -> Topology | None:
    """A TPU slice named by its family and chip grid, as xpk's --device-type and GKE's topology spell it
    (`tpu7x-4x4x4`, `v5p-2x2x1`, `v6e-16x16`): the catalog's slice of that shape (its sides in any order); None where
    `key` is not of that form; a MaxperfError naming the family's shapes nearest in chip count where no slice has it."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+(?:x\d+){1,2})", key)
    family = next((f for f in _TPU_FAMILIES if m and f.prefix == m.group(1)), None)
    if family is None:
        return None
    shape = tuple(int(side) for side in m.group(2).split("x"))
    mine = [t for t in table.values() if t.chip == family.chip]
    for topology in mine:
        if sorted(topology.torus) == sorted(shape):
            return topology
    chips = math.prod(shape)
    nearest = sorted(mine, key=lambda t: (abs(math.log(t.chips_per_slice / chips)) if chips else 0, t.chips_per_slice))
    shown = ", ".join(f"{'x'.join(map(str, t.torus))} ({t.name})" for t in nearest[:3])
    raise MaxperfError(f"no {family.prefix} slice has the chip grid {m.group(2)} ({chips} chips); the nearest are "
                       f"{shown} (`maxperf topologies` lists them)")


def get(name: str, num_slices: int = 1, target_config_path: str | None = None) -> Topology:
    """The topology called `name` (a Cloud TPU accelerator type, `h100-8x16`, `cpu-8`), over `num_slices` slices.

    `target_config_path` (GPU only) compiles for the exact device described by that GpuTargetConfigProto text file.
    """
    if not isinstance(num_slices, int) or num_slices < 1:
        raise MaxperfError(f"num_slices must be a whole number >= 1, got {num_slices!r}")
    if num_slices > MAX_SLICES:
        raise MaxperfError(f"num_slices {num_slices} is beyond any machine: maxperf plans for at most {MAX_SLICES} "
                           "slices (the largest multislice job published joined 199, 50,944 TPU v5e chips); give "
                           f"{MAX_SLICES} or fewer, with larger slices for more chips")
    key = name.strip().lower()
    prefix, sep, rest = key.partition("-")
    key = f"{_ALIASES.get(prefix, prefix)}{sep}{rest}"
    table = _catalog()
    if key in table:
        topology = table[key]
    elif (grid := _by_chip_grid(name, key, table)) is not None:
        topology = grid
    elif (m := re.fullmatch(r"cpu-(\d+)(?:x(\d+))?", key)) and int(m.group(1)) >= 1 and int(m.group(2) or 1) >= 1:
        topology = _cpu_topology(int(m.group(1)), int(m.group(2) or 1))
    elif (hosts := _any_host_count(key)) is not None:
        topology = hosts
    else:
        raise _unknown_topology(name, key, table)
    if num_slices > 1:
        if topology.platform == "cpu":
            raise MaxperfError(f"{topology.name} is one process; for more CPU devices use cpu-N, not num_slices")
        topology = dataclasses.replace(topology, num_slices=num_slices)
    if target_config_path is not None:
        if topology.platform != "gpu":
            raise MaxperfError(f"a GPU target config applies to GPU topologies only, not {topology.name}")
        text = gpu_targets.read_target_config(target_config_path)
        description = re.search(r'device_description_str:\s*"([^"]*)"', text)
        topology = dataclasses.replace(
            topology,
            target_config_path=str(target_config_path),
            gpu_target=description.group(1) if description else f"custom ({target_config_path})",
        )
    return topology
