"""The machines maxperf compiles for: a catalog of TPU, GPU and CPU topologies, their (virtual) devices and meshes.

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
  18 compute trays (hosts) of 4 GPUs in one NVLink domain. Devices come from the CUDA plugin's topology
  "PARTITIONSxHOSTSxGPUS" with an embedded target spec (see `gpu_targets`), one partition per NVLink domain.
- CPU: `cpu-N` is N host-platform devices of this very process (XLA_FLAGS=--xla_force_host_platform_device_count).

Meshes: ICI axes span one fast-interconnect domain, DCN axes span domains. The domain is a TPU slice, an HGX host
(NVLink inside, InfiniBand across hosts), or a GB200 NVL72 rack; for CPU the whole process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from maxperf.aot import gpu_targets
from maxperf.errors import MaxperfError, unknown

if TYPE_CHECKING:
    import jax

TPU_INSTALL_HINT = "install libtpu to compile for TPUs: pip install 'maxperf[tpu]'"
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
    chip: str  # key of maxperf.perfmodel.chips
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
    hosts_per_nvlink_domain: int = 1  # GPU: 1 for HGX, 18 for GB200 NVL72
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
        """GPU: the memory the target spec compiled for states (`device_memory_size`); None elsewhere, or where the
        CUDA plugin that holds the spec is missing (perfmodel reads this, else the chip table's figure)."""
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

def _chip_spec(chip: str):
    """The perfmodel's table entry for `chip` (imported here: perfmodel's package imports nothing of aot)."""
    from maxperf.perfmodel import chips

    return chips.get(chip)

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
               0, (), 8, "cloud.google.com/tpu/docs/v5e: v5litepod-1/4/8 are one host (1, 4, 8 chips); 16-256 chips have 4 per host"),
    _TpuFamily("v5p", "tpu-v5p", "v5p", 2, 1, "megacore", ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)), 96, (), 4,
               "cloud.google.com/tpu/docs/v5p: v5p-8 (2x2x1) to v5p-12288 (16x16x24, 96 cubes), 4 chips per host"),
    _TpuFamily("v6e", "tpu-v6e", "v6e", 1, 1, None, ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)),
               0, (), 8, "cloud.google.com/tpu/docs/v6e: v6e-1/4/8 are one host (1, 4, 8 chips); 16-256 chips have 4 per host"),
    _TpuFamily("tpu7x", "tpu7x", "tpu7x", 2, 2, None, ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)), 96, (108, 128, 140, 144), 4,
               "cloud.google.com/tpu/docs/tpu7x: two TensorCores (two JAX devices) per chip, 4 chips per host, "
               "9216-chip pod; slices past 96 cubes as xpk lists them (12x24x24, 16x16x32, 16x20x28, 16x24x24)"),
)

# GPU systems: (name prefix, chip key, GPUs per host, hosts per NVLink domain, unit counts offered, source)
_GPU_SYSTEMS = (
    ("a100", "a100-80gb", 8, 1, (1, 2, 4, 8, 16, 32, 64, 128), "HGX A100 80GB (SXM4), 8 GPUs per host"),
    ("a100-40gb", "a100-40gb", 8, 1, (1, 2, 4, 8, 16, 32, 64, 128), "HGX A100 40GB (SXM4), 8 GPUs per host"),
    ("h100", "h100-sxm", 8, 1, (1, 2, 4, 8, 16, 32, 64, 128), "HGX H100 80GB (SXM5), 8 GPUs per host"),
    ("h200", "h200", 8, 1, (1, 2, 4, 8, 16, 32, 64, 128), "HGX H200 141GB, 8 GPUs per host"),
    ("b200", "b200", 8, 1, (1, 2, 4, 8, 16, 32, 64, 128), "HGX B200, 8 GPUs per host"),
    ("gb200", "gb200", 4, 18, (1, 2, 4, 8, 16), "GB200 NVL72: 18 trays of 4 GPUs in one NVLink domain per rack"),
)

_GPU_PARTIAL_HOST = (1, 2, 4)  # GPUs of one HGX host a job may be given
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

def _gpu_topology(prefix: str, chip: str, per_host: int, nvlink_hosts: int, units: int) -> Topology:
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
    for prefix, chip, per_host, nvlink_hosts, units, _source in _GPU_SYSTEMS:
        if nvlink_hosts == 1:  # part of one host: `h100-1`, `h100-2`, `h100-4`
            entries += [_gpu_topology(prefix, chip, k, 1, 1) for k in _GPU_PARTIAL_HOST if k < per_host]
        entries += [_gpu_topology(prefix, chip, per_host, nvlink_hosts, m) for m in units]
    entries += [_cpu_topology(n) for n in _CPU_SIZES]
    return {t.name: t for t in entries}

def catalog() -> list[Topology]:
    """Every named topology, TPU families first (in chip order), then GPU systems, then CPU."""
    return list(_catalog().values())

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
    elif (m := re.fullmatch(r"cpu-(\d+)(?:x(\d+))?", key)) and int(m.group(1)) >= 1 and int(m.group(2) or 1) >= 1:
        topology = _cpu_topology(int(m.group(1)), int(m.group(2) or 1))
    else:
        raise unknown("topology", name, list(table))
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

# ---------------------------------------------------------------------------------------------------------------
# Devices

def quiet_libtpu(accelerator_type: str = "v5p-8") -> None:
    """Silences libtpu's start-up warnings about TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES on a machine with no TPU.

    libtpu reads these variables when it loads, to find the TPU VM it runs on; compile-only topologies do not use
    them (checked: devices, hosts and coordinates are the same with and without). It also lets several processes
    load libtpu at once (without ALLOW_MULTIPLE_LIBTPU_LOAD the second fails on /tmp/libtpu_lockfile), which
    compile-only use needs: a sweep, or a test that compiles in a subprocess. On a TPU VM nothing is set.
    Call it before libtpu loads (`devices()` does).
    """
    try:
        from jax._src import hardware_utils

        attached, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # a jax without this helper: assume a TPU only where its device files exist
        attached = int(os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"))
    if attached:
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_WORKER_ID", "0")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

def ensure_cpu_devices(n: int) -> None:
    """Makes this process have at least `n` CPU devices, or says why it cannot (jax started with fewer)."""
    flag = "--xla_force_host_platform_device_count"
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have < n:
            raise MaxperfError(
                f"this process already started jax with {have} CPU devices, {n} needed; set "
                f"XLA_FLAGS={flag}={n} (or call ensure_cpu_devices({n})) before jax runs anything"
            )
        return
    flags = re.sub(rf"{flag}=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    current = re.search(rf"{flag}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    count = max(n, int(current.group(1))) if current else n
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{flag}={count}"])
    jax.config.update("jax_num_cpu_devices", count)

def devices(topology: Topology) -> list[jax.Device]:
    """The topology's devices over all slices: compile-only ones for TPU and GPU, this process's own for CPU."""
    if topology.platform == "cpu":
        return _cpu_devices(topology.chips_per_host, topology.hosts)
    if topology.platform == "tpu":
        found = _tpu_devices(topology.libtpu_topology, topology.chip_config, topology.chips_per_host_bounds,
                             topology.num_slices, topology.name, torus_wrap(topology.torus))
    elif (local := compiles_on_attached_gpus(topology)) is not None:
        found = local
    else:
        found = _gpu_devices(_gpu_topology_string(topology), topology.chip, topology.target_config_path)
    if len(found) != topology.num_devices:
        raise MaxperfError(f"{topology.name}: the compiler made {len(found)} devices, {topology.num_devices} expected")
    return list(found)

def _cpu_devices(n: int, processes: int = 1) -> list:
    ensure_cpu_devices(n)
    import jax

    if processes > 1:
        if jax.process_count() != processes:
            raise MaxperfError(f"cpu-{n}x{processes} needs {processes} processes joined by jax.distributed "
                               f"(--coordinator, --num-processes {processes}, --process-id); this run has "
                               f"{jax.process_count()}")
        return sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))

    return jax.devices("cpu")[:n]

def torus_wrap(torus: tuple[int, ...]) -> tuple[bool, bool, bool]:
    """Which ICI dimensions of a TPU slice close into rings: every side of a slice of whole 4x4x4 cubes, the 16-chip
    sides of a v5e/v6e slice (MaxText's accelerator_to_spec_map, whose `wrap` its train_compile passes to libtpu:
    v5p-128 (True, True, True), v5p-64 none, v6e-128 (False, True, False)). Without it the compiler plans collectives
    for open lines of chips: llama2-7b on v5p-1024 (B 1, flash, full remat) gathered each layer's weights by
    all-reduces of the whole weight, in 1.80 GiB per device and 881,530 TPU bundles, against 1.60 GiB and 646,535."""
    if len(torus) == 3:
        closed = all(side % 4 == 0 for side in torus)
        return (closed,) * 3
    return (*(side == 16 for side in torus), False)


@functools.cache
def _tpu_devices(libtpu_topology: str, chip_config: str | None, bounds: tuple | None, num_slices: int,
                 accelerator_type: str, wrap: tuple[bool, bool, bool] = (False, False, False)) -> tuple:
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        raise MaxperfError(f"libtpu is not installed; {TPU_INSTALL_HINT}")
    quiet_libtpu(accelerator_type)
    from jax.experimental.topologies import get_topology_desc

    options: dict[str, Any] = {}
    if chip_config:
        options["chip_config_name"] = chip_config
    if bounds:
        options["chips_per_host_bounds"] = bounds
    if num_slices > 1:
        options["num_slices"] = num_slices
    if any(wrap):
        options["wrap"] = wrap
    try:
        return tuple(get_topology_desc(topology_name=libtpu_topology, platform="tpu", **options).devices)
    except Exception as e:
        raise MaxperfError(f"libtpu cannot make topology {libtpu_topology}: {str(e).splitlines()[0]}") from e

def compiles_on_attached_gpus(topology: Topology) -> tuple | None:
    """This machine's GPUs when a one-host GPU topology is compiled where its GPUs are attached (no --target-config):
    the compiler then autotunes on them and gives a cost analysis. Else None (a compile without the GPU)."""
    if topology.platform != "gpu" or topology.target_config_path is not None or topology.hosts != 1:
        return None
    return gpu_targets.attached_gpus(topology.chip, topology.num_devices)

def _gpu_topology_string(topology: Topology) -> str:
    """The CUDA plugin's 'PARTITIONSxHOSTSxGPUS': one partition per NVLink domain, over all slices."""
    return f"{topology.ici_domains}x{topology.hosts_per_nvlink_domain}x{topology.chips_per_host}"

def gpu_target_config_text(topology: Topology) -> str:
    """The GpuTargetConfigProto text the topology compiles for: the user's file, or the plugin's embedded spec."""
    if topology.target_config_path is not None:
        return gpu_targets.read_target_config(topology.target_config_path)
    return gpu_targets.gpu_target_config(topology.chip)

@functools.cache
def _gpu_devices(topology_string: str, chip: str, target_config_path: str | None) -> tuple:
    if gpu_targets.plugin_library() is None:
        raise MaxperfError(f"the CUDA plugin is not installed; {gpu_targets.INSTALL_HINT}")
    if target_config_path is not None:
        text = gpu_targets.read_target_config(target_config_path)
    else:
        text = gpu_targets.gpu_target_config(chip)
    from jax.experimental.topologies import get_topology_desc

    try:
        return tuple(get_topology_desc(platform="cuda", topology=topology_string, target_config=text).devices)
    except Exception as e:
        raise MaxperfError(f"the CUDA plugin cannot make topology {topology_string}: {str(e).splitlines()[0]}") from e

# ---------------------------------------------------------------------------------------------------------------
# Meshes

def device_mesh(
    topology: Topology,
    ici: dict[str, int],
    dcn: dict[str, int] | None = None,
    axis_names: Sequence[str] | None = None,
    device_list: Sequence[Any] | None = None,
) -> jax.sharding.Mesh:
    """A mesh in automatic sharding mode over the topology's devices: axis a has size dcn[a] * ici[a], DCN-major
    within each axis.

    The sizes are resolved ones (`maxperf.plan.resolve_mesh` resolves a parallelism config into them): `ici` sizes
    must multiply to the devices of one fast-interconnect domain (`topology.devices_per_ici_domain`), `dcn` sizes to
    the number of domains (`topology.ici_domains`); axes left out have size 1. Axis order is `axis_names`, else the
    dcn axes then the ici axes. `device_list` defaults to `devices(topology)`.
    """
    import numpy as np

    from maxperf.models import sharding

    dcn = dict(dcn or {})
    names = tuple(axis_names) if axis_names is not None else tuple(dict.fromkeys([*dcn, *ici]))
    for label, sizes in (("ici", ici), ("dcn", dcn)):
        extra = [a for a in sizes if a not in names]
        if extra:
            raise MaxperfError(f"{label} axes {extra} are not mesh axes; axes are {list(names)}")
        bad = {a: s for a, s in sizes.items() if not isinstance(s, int) or s < 1}
        if bad:
            raise MaxperfError(f"{label} axis sizes must be whole numbers >= 1, got {bad}")
    ici_shape = [ici.get(a, 1) for a in names]
    dcn_shape = [dcn.get(a, 1) for a in names]
    if math.prod(ici_shape) != topology.devices_per_ici_domain or math.prod(dcn_shape) != topology.ici_domains:
        raise MaxperfError(
            f"{topology.name} has {topology.ici_domains} domain(s) of {topology.devices_per_ici_domain} devices; "
            f"ici axes {dict(zip(names, ici_shape))} multiply to {math.prod(ici_shape)} and dcn axes "
            f"{dict(zip(names, dcn_shape))} to {math.prod(dcn_shape)}"
        )
    all_devices = list(device_list) if device_list is not None else devices(topology)
    groups = _ici_domains(topology, all_devices)
    blocks = np.stack([_domain_mesh(ici_shape, group) for group in groups])  # (domains, *ici_shape)
    blocks = blocks.reshape(dcn_shape + ici_shape)
    rank = len(names)
    interleaved = blocks.transpose([i // 2 + (rank if i % 2 else 0) for i in range(2 * rank)])
    sizes = [d * i for d, i in zip(dcn_shape, ici_shape)]
    return sharding.make_mesh(interleaved.reshape(sizes), dict(zip(names, sizes)))

def _ici_domains(topology: Topology, all_devices: list) -> list[list]:
    """Devices grouped by fast-interconnect domain, in domain order."""
    if topology.ici_domains == 1:
        return [all_devices]
    if topology.platform == "tpu":
        key = lambda d: getattr(d, "slice_index", 0)  # noqa: E731
    else:
        key = lambda d: d.process_index // topology.hosts_per_nvlink_domain  # noqa: E731
    groups: dict[int, list] = {}
    for d in sorted(all_devices, key=lambda d: (key(d), d.id)):
        groups.setdefault(key(d), []).append(d)
    if len(groups) != topology.ici_domains:
        raise MaxperfError(f"{topology.name}: devices fall into {len(groups)} domains, {topology.ici_domains} expected")
    return list(groups.values())

def _domain_mesh(shape: list[int], group: list):
    """One domain's devices in `shape`, laid out along the physical links where jax knows how (TPU), else by id."""
    import numpy as np
    from jax.experimental import mesh_utils

    try:
        return mesh_utils.create_device_mesh(shape, group, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        return np.array(sorted(group, key=lambda d: d.id), dtype=object).reshape(shape)

# ---------------------------------------------------------------------------------------------------------------
# What compiling for a topology needs and cannot give

def compiler_options(topology: Topology, random_bits: bool = False) -> dict[str, Any]:
    """XLA options to pass as `.compile(compiler_options=...)` for this topology.

    GPU across hosts: the one-shot all-reduce kernel works only among GPUs that share NVLink, and compiling it for
    hundreds of GPUs hit an LLVM error (DESIGN.md); it is turned off there. Checked: the compile-only CUDA plugin
    accepts it as a compile option.
    GPU without the GPU attached: XLA rewrites large sorts into CUB's radix sort and asks the CUDA runtime for its
    scratch size while compiling, which fails with no GPU ("cudaErrorInvalidDevice: invalid device ordinal"; a MoE
    step under expert parallelism sorts the rows it receives: tiny-moe with 64 experts over ici_expert=8 on h100-8
    failed so). Those compiles keep XLA's own sort; `limitations` says so.
    TPU, for a step that draws random bits (`random_bits`: int8's stochastic rounding): MaxText's train and
    train_compile set --xla_tpu_spmd_rng_bit_generator_unsafe=true, which lets each device generate its own shard of
    a sharded RngBitGenerator; without it every device generated the whole array (gpt3-175b on v5p-1024, int8:
    800.70 GiB per device). Checked: libtpu takes it as a compile option.
    """
    if topology.platform == "gpu":
        options: dict[str, Any] = {}
        if topology.ici_domains > 1:
            options["xla_gpu_unsupported_use_all_reduce_one_shot_kernel"] = False
        if compiles_on_attached_gpus(topology) is None:
            options["xla_gpu_enable_cub_radix_sort"] = False
        return options
    if topology.platform == "tpu" and random_bits:
        return {"xla_tpu_spmd_rng_bit_generator_unsafe": True}
    return {}

def limitations(topology: Topology) -> list[str]:
    """What compiling for this topology on this machine cannot give, in words the CLI prints."""
    notes: list[str] = []
    if topology.platform == "gpu":
        notes.append("`maxperf run` gives jax's GPU allocator 95% of each GPU's memory "
                     "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; jax's default 0.75 would hold less than the verdict assumes)")
    if compiles_on_attached_gpus(topology) is not None:
        notes.append(f"compiled on this machine's {topology.gpu_target} GPUs (autotuned, with XLA's cost analysis)")
    elif topology.platform == "gpu":
        notes += [
            "the GPU compiler gives no cost analysis without a GPU: FLOPs and bytes come from another source, "
            "labelled as such",
            "no autotuning without a GPU: GEMM and fusion configurations are XLA's defaults, so this executable is not "
            "the production step: on an H100 such steps ran 13-24x slower than compiled on the GPU, and memory can "
            "differ (qwen3-0.6b B 16: 18.2 GiB without the GPU, 27.4 GiB compiled on it); compile on the GPU host "
            "for a run's timings",
            f"compiled for {topology.gpu_target} "
            + (f"from {topology.target_config_path}" if topology.target_config_path else "(the CUDA plugin's spec)"),
        ]
        if topology.ici_domains > 1:
            notes.append("the one-shot all-reduce kernel is disabled (multi-host compile); a GPU run matches that")
        notes.append("sorts (a mixture of experts' token sort under expert parallelism) use XLA's own sort kernel: "
                     "CUB's radix sort, which a GPU compile picks for large sorts, needs the GPU to size its scratch "
                     "memory")
    if topology.platform == "tpu" and topology.devices_per_chip > 1:
        notes.append(f"each {topology.chip} chip is {topology.devices_per_chip} JAX devices; memory is per device, "
                     f"{topology.devices_per_chip} per chip")
    if topology.platform == "cpu":
        notes.append("cpu topologies run on this machine's CPU: memory is host RAM and there is no HBM limit")
    return notes
