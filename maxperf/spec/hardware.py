"""The accelerators' datasheets, one typed table; every number carries its source. What a chip sustains in a
step (fitted or measured) is perfmodel's (perfmodel/chips.py).

Conventions: FLOP/s are dense (NVIDIA datasheets quote bf16/fp8/int8 "with sparsity"; those are halved here, as
their footnotes say). Link bandwidth is one direction of one link, in bytes/s: a "bidirectional per chip" figure is
divided by 2 and by the link count. Host network bandwidth is per host of `host_chips` chips, in bytes/s.

Sources, cited by short name below:
  [v4]    cloud.google.com/tpu/docs/v4 (system architecture table)
  [v5e]   cloud.google.com/tpu/docs/v5e (key specifications table)
  [v5p]   cloud.google.com/tpu/docs/v5p (key specifications table)
  [v6e]   cloud.google.com/tpu/docs/v6e (key specifications table)
  [7x]    cloud.google.com/tpu/docs/tpu7x (specification table comparing v5p, v6e, TPU7x)
  [gke-7x] cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood ("each Ironwood (TPU7x) VM contains 4 chips
          and 2 NICs")
  [book]  Austin et al., "How to Scale Your Model" (jax-ml.github.io/scaling-book), part 2, TPU spec tables
  [libtpu] the "available HBM" of libtpu 0.0.52's out-of-memory compile errors (CompileTimeHbmOom: "the total memory
          required for HLO temporaries (...) exceeds available HBM (95.73G)"), compiled here on the named slices
  [a100]  NVIDIA A100 Tensor Core GPU datasheet (SXM4); [dgxa100] NVIDIA DGX A100 datasheet
  [h100]  NVIDIA H100 Tensor Core GPU datasheet (SXM5); [dgxh100] NVIDIA DGX H100 datasheet
  [h200]  NVIDIA H200 Tensor Core GPU datasheet (SXM); [dgxh200] NVIDIA DGX H200 datasheet
  [b200]  NVIDIA HGX B200 / DGX B200 datasheets (8-GPU totals divided by 8)
  [nvl72] NVIDIA GB200 NVL72 datasheet (72-GPU rack totals divided by 72)
  [mamf]  S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul
          FLOPS comparison table" (github.com/stas00/ml-engineering): the best bf16 torch.matmul rate found over a
          grid of shapes, mean of 100 iterations after 50 warm-up ones, per GPU
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

G = 1e9
T = 1e12
GiB = 2**30
GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class Chip:
    name: str
    vendor: str  # "google", "nvidia", "cpu"
    kind: str  # "tpu", "gpu", "cpu"
    peak_bf16_flops: float  # dense
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # one direction of one ICI / NVLink link, bytes/s
    link_count: int  # ICI ports or NVLink links per chip
    host_network_bandwidth: float  # per host (DCN for TPU, InfiniBand/RoCE for GPU), bytes/s
    host_chips: int  # chips per host that host_network_bandwidth serves
    torus_dims: int | None = None  # TPU: 2 (v5e, v6e) or 3
    # TPU: the side of its matrix units' systolic arrays, which a matmul's contraction and output dims fill in tiles
    # of this width (a dim of 128 fills half of a 256-wide array)
    mxu_width: int | None = None
    # TPU: the TensorCores one JAX device drives: 2 on v4 and v5p, whose two cores XLA runs as one "megacore" device,
    # splitting each operation between them; 1 on v5e and v6e (one core a chip) and TPU7x (one device per core)
    cores_per_device: int | None = None
    nvlink_domain: int | None = None  # GPU: chips that share one NVLink/NVSwitch domain
    peak_fp32_flops: float | None = None  # None: float32 matmuls run at the bf16 rate (see peak_flops)
    peak_fp8_flops: float | None = None
    peak_int8_ops: float | None = None
    calibrated: bool = False  # True only for the "cpu" chip read from a stored calibration
    # (dtype, HALF): the thin side at which a matmul runs at half its square rate (perfmodel.steptime); measured
    # by `maxperf calibrate` for CPUs, empty (steptime's assumption per kind) elsewhere
    matmul_half: tuple[tuple[str, float], ...] = ()
    # (collective, bus bandwidth relative to an all-gather's): measured for CPUs, empty (all alike) elsewhere
    collective_efficiency: tuple[tuple[str, float], ...] = ()
    # bytes/s of faulting in newly mapped memory, for CPU devices whose step maps its large temporaries afresh
    # (XLA:CPU allocates them per execution); None: no such cost (accelerators keep a pooled allocator)
    page_fault_bandwidth: float | None = None
    # bytes/s read + written by a fused copy that transposes a float32 matrix, for CPU devices, where XLA:CPU moves
    # FSDP weight shards between the layer stack and its layouts by such copies; None: not measured (accelerators)
    transpose_bandwidth: float | None = None
    # bytes/s read + written by a fused elementwise kernel with exponentials (a softmax), for CPU devices, whose
    # elementwise work runs below the streaming bandwidth (hbm_bandwidth); None: elementwise work at hbm_bandwidth
    elementwise_bandwidth: float | None = None
    # (dtype, head_dim, FLOP/s): the rate of a whole causal attention, forward and backward (scores, mask, softmax,
    # context), in model FLOPs, measured for CPUs, whose compiler fuses its pieces into kernels slower than their
    # parts; empty: attention as matmuls and a softmax
    attention_rates: tuple[tuple[str, int, float], ...] = ()
    # seconds each collective adds between dependent work, measured on CPU devices; None: the network's assumption
    # (perfmodel.network.LATENCY_S)
    collective_latency: float | None = None
    note: str = ""
    # TPU: what libtpu lets one program hold, per chip: its HBM less what the runtime keeps ([libtpu]); None: all of
    # hbm_bytes
    usable_hbm_bytes: float | None = None

    def peak_flops(self, dtype: str) -> float:
        """Peak matmul FLOP/s for a compute dtype. On TPU, jax's default precision runs float32 matmuls as one bf16
        pass (jax.lax.Precision.DEFAULT), so the bf16 peak applies; GPUs use TF32 tensor cores for float32."""
        if str(dtype) == "float32" and self.peak_fp32_flops is not None:
            return self.peak_fp32_flops
        return self.peak_bf16_flops

    def measured_matmul_half(self, dtype: str) -> float | None:
        return next((h for d, h in self.matmul_half if d == str(dtype)), None)

    def attention_rate(self, dtype: str, head_dim: int) -> float | None:
        """The measured attention rate in `dtype` at `head_dim`: linear in log(head_dim) between the measured head
        dimensions, the nearest one's beyond them; None where attention was not measured in `dtype`."""
        rates = sorted((dh, rate) for dt, dh, rate in self.attention_rates if dt == str(dtype))
        if not rates:
            return None
        if head_dim <= rates[0][0]:
            return rates[0][1]
        for (d0, r0), (d1, r1) in zip(rates, rates[1:]):
            if head_dim <= d1:
                w = math.log(head_dim / d0) / math.log(d1 / d0)
                return r0 + w * (r1 - r0)
        return rates[-1][1]

    @property
    def ici_bandwidth_per_chip(self) -> float:
        """All links, both directions, bytes/s (the figure the datasheets quote)."""
        return 2 * self.link_bandwidth * self.link_count

    @property
    def host_network_per_chip(self) -> float:
        return self.host_network_bandwidth / self.host_chips

    @property
    def host_link_bandwidth(self) -> float | None:
        """One direction of this chip's own link to its host's memory (PCIe, or NVLink-C2C on GB200), bytes/s:
        what offloaded activations cross. None for CPU devices, whose "device" memory is host memory."""
        return HOST_LINK_BANDWIDTH.get(self.name)


_TPUS = [
    Chip(
        name="tpu-v4", vendor="google", kind="tpu",
        peak_bf16_flops=275 * T,  # [v4] "275 teraflops (bf16 or int8)"
        peak_int8_ops=275 * T,  # [v4] same figure for int8
        hbm_bytes=32 * GiB, hbm_bandwidth=1200 * G,  # [v4] "32 GiB, 1200 GBps"
        usable_hbm_bytes=30.75 * GiB,  # [libtpu] v4-8
        link_bandwidth=45 * G, link_count=6,  # [book] v4p ICI 4.5e10 B/s one way per link; 3D torus: 6 ports
        torus_dims=3,  # [v4] 3D mesh/torus
        mxu_width=128,  # [book] "all previous generations use 128x128"
        cores_per_device=2,  # [v4] "Each TPU v4 chip contains two TensorCores", one megacore device
        # the v4 page gives no DCN figure; assumed equal to v5p's (below), 4 chips per host [v4 VMs]
        host_network_bandwidth=4 * 50 * GBIT, host_chips=4,
    ),
    Chip(
        name="tpu-v5e", vendor="google", kind="tpu",
        peak_bf16_flops=197 * T,  # [v5e] "197 TFLOPs"
        peak_int8_ops=393 * T,  # [v5e] "393 TOPs" (Int8)
        hbm_bytes=16 * GiB, hbm_bandwidth=819 * G,  # [v5e] "16 GB, 819 GBps"
        usable_hbm_bytes=15.75 * GiB,  # [libtpu] v5e-8
        link_bandwidth=400 * G / 2 / 4, link_count=4,  # [v5e] 400 GBps bidirectional per chip, 4 ICI ports
        torus_dims=2,  # [v5e] 2D torus
        mxu_width=128,  # [book] 128x128 MXUs
        cores_per_device=1,  # [v5e] "Each v5e chip contains one TensorCore"
        host_network_bandwidth=2 * 100 * GBIT, host_chips=8,  # [v5e] "2 x 100 Gbps NIC" per host, 8 chips per host
    ),
    Chip(
        name="tpu-v5p", vendor="google", kind="tpu",
        peak_bf16_flops=459 * T,  # [v5p] "459 TFLOPs"
        peak_fp8_flops=459 * T,  # [v5p] FP8 459 TFLOPs (no faster than bf16)
        peak_int8_ops=918 * T,  # Google Cloud blog "Introducing Cloud TPU v5p" (Dec 2023): 918 TOPS int8
        hbm_bytes=95 * GiB, hbm_bandwidth=2765 * G,  # [v5p] 95 GiB, 2765 GBps
        usable_hbm_bytes=95.73 * GiB,  # [libtpu] v5p-8
        link_bandwidth=1200 * G / 2 / 6, link_count=6,  # [v5p] 1200 GBps bidirectional per chip; 3D torus: 6 ports
        torus_dims=3,  # [v5p] 3D torus
        mxu_width=128,  # [book] 128x128 MXUs
        cores_per_device=2,  # [v5p] two TensorCores a chip, one megacore device
        # [v5p] "Data center network (DCN) bandwidth per chip (Gbps) 50", 4-chip VMs: a NIC's line rate, each way, as
        # Google's tables give it for v5e (25 Gbps a chip: "2 x 100 Gbps NIC" per 8-chip host, "6.4 Tbps" per
        # 256-chip pod), v6e and TPU7x (100 Gbps a chip, two NICs per 4-chip VM [gke-7x])
        host_network_bandwidth=4 * 50 * GBIT, host_chips=4,
    ),
    Chip(
        name="tpu-v6e", vendor="google", kind="tpu",
        peak_bf16_flops=918 * T,  # [v6e] "918 TFLOPs"
        peak_fp8_flops=918 * T,  # [7x] FP8 918 TFLOPs for v6e
        peak_int8_ops=1836 * T,  # [v6e] "1836 TOPs"
        hbm_bytes=32 * GiB, hbm_bandwidth=1638 * G,  # [v6e] 32 GB, 1638 GBps ([7x] writes 32 GiB)
        usable_hbm_bytes=31.24 * GiB,  # [libtpu] v6e-16
        link_bandwidth=800 * G / 2 / 4, link_count=4,  # [v6e] 800 GBps bidirectional per chip, "ICI ports per chip 4"
        torus_dims=2,  # [v6e] 2D torus
        mxu_width=256,  # [v6e] "two 256x256 matrix-multiply units (MXU)"
        cores_per_device=1,  # [v6e] "Each v6e chip contains one TensorCore"
        host_network_bandwidth=4 * 100 * GBIT, host_chips=4,  # [7x] DCN 100 Gbps per chip for v6e; 4-chip VMs
    ),
    Chip(
        name="tpu7x", vendor="google", kind="tpu",
        peak_bf16_flops=2307 * T,  # [7x] 2307 TFLOPs BF16
        peak_fp8_flops=4614 * T,  # [7x] 4614 TFLOPs FP8
        hbm_bytes=192 * GiB, hbm_bandwidth=7380 * G,  # [7x] 192 GiB, 7380 GB/s
        usable_hbm_bytes=2 * 94.74 * GiB,  # [libtpu] tpu7x-8, 94.74G a device
        # [7x] 1200 GBps bidirectional per chip; the page gives no port count: 6 assumed, as for v5p's 3D torus
        link_bandwidth=1200 * G / 2 / 6, link_count=6,
        torus_dims=3,  # [7x] "shares many similarities with TPU v5p": 3D torus of 4x4x4 cubes
        # MaxText docs/guides/optimization/custom_model.md: Trillium and Ironwood "optimized for 256x256"
        mxu_width=256,
        cores_per_device=1,  # [7x] two TensorCores a chip, each its own JAX device
        host_network_bandwidth=4 * 100 * GBIT, host_chips=4,  # [7x] DCN 100 Gbps per chip; 4-chip VMs
    ),
]

_GPUS = [
    Chip(
        name="a100-40gb", vendor="nvidia", kind="gpu",
        peak_bf16_flops=312 * T, peak_fp32_flops=156 * T,  # [a100] BF16 312 TFLOPS, TF32 156 TFLOPS (dense)
        peak_int8_ops=624 * T,  # [a100] INT8 624 TOPS dense
        hbm_bytes=40 * G, hbm_bandwidth=1555 * G,  # [a100] 40 GB HBM2, 1,555 GB/s
        link_bandwidth=600 * G / 2 / 12, link_count=12,  # [a100] NVLink 600 GB/s; 12 third-generation links
        nvlink_domain=8,  # [dgxa100] 8 GPUs on NVSwitch
        host_network_bandwidth=8 * 200 * GBIT, host_chips=8,  # [dgxa100] 8x 200 Gb/s HDR InfiniBand
    ),
    Chip(
        name="a100-80gb", vendor="nvidia", kind="gpu",
        peak_bf16_flops=312 * T, peak_fp32_flops=156 * T,  # [a100] as the 40 GB part
        peak_int8_ops=624 * T,  # [a100]
        hbm_bytes=80 * G, hbm_bandwidth=2039 * G,  # [a100] 80 GB HBM2e, 2,039 GB/s (SXM)
        link_bandwidth=600 * G / 2 / 12, link_count=12,  # [a100]
        nvlink_domain=8,  # [dgxa100]
        host_network_bandwidth=8 * 200 * GBIT, host_chips=8,  # [dgxa100]
    ),
    Chip(
        name="h100-sxm", vendor="nvidia", kind="gpu",
        peak_bf16_flops=989 * T, peak_fp32_flops=494.5 * T,  # [h100] BF16 1,979 / TF32 989 TFLOPS with sparsity
        peak_fp8_flops=1979 * T, peak_int8_ops=1979 * T,  # [h100] 3,958 TFLOPS / TOPS with sparsity
        hbm_bytes=80 * G, hbm_bandwidth=3.35 * T,  # [h100] 80 GB, 3.35 TB/s
        link_bandwidth=900 * G / 2 / 18, link_count=18,  # [h100] NVLink 900 GB/s; 18 fourth-generation links
        nvlink_domain=8,  # [dgxh100] 8 GPUs on 4 NVSwitches
        host_network_bandwidth=8 * 400 * GBIT, host_chips=8,  # [dgxh100] 8x 400 Gb/s ConnectX-7
    ),
    Chip(
        name="h200", vendor="nvidia", kind="gpu",
        peak_bf16_flops=989 * T, peak_fp32_flops=494.5 * T,  # [h200] same tensor cores as H100 SXM
        peak_fp8_flops=1979 * T, peak_int8_ops=1979 * T,  # [h200] 3,958 with sparsity
        hbm_bytes=141 * G, hbm_bandwidth=4.8 * T,  # [h200] 141 GB HBM3e, 4.8 TB/s
        link_bandwidth=900 * G / 2 / 18, link_count=18,  # [h200] NVLink 900 GB/s
        nvlink_domain=8,  # [dgxh200]
        host_network_bandwidth=8 * 400 * GBIT, host_chips=8,  # [dgxh200] 8x 400 Gb/s ConnectX-7
    ),
    Chip(
        name="b200", vendor="nvidia", kind="gpu",
        peak_bf16_flops=2.25e15, peak_fp32_flops=1.125e15,  # [b200] 36 PF BF16 / 18 PF TF32 sparse per 8 GPUs
        peak_fp8_flops=4.5e15, peak_int8_ops=4.5e15,  # [b200] 72 PF FP8 / 72 POPS INT8 sparse per 8 GPUs
        hbm_bytes=180 * G, hbm_bandwidth=7.7 * T,  # [b200] 1,440 GB and 62 TB/s per 8 GPUs (HGX B200)
        link_bandwidth=1800 * G / 2 / 18, link_count=18,  # [b200] fifth-generation NVLink 1.8 TB/s, 18 links
        nvlink_domain=8,  # [b200] 8 GPUs, 2 NVSwitch chips
        host_network_bandwidth=8 * 400 * GBIT, host_chips=8,  # [b200] DGX B200: 8x 400 Gb/s ConnectX-7
    ),
    Chip(
        name="gb200", vendor="nvidia", kind="gpu",
        peak_bf16_flops=2.5e15, peak_fp32_flops=1.25e15,  # [nvl72] 360 PF FP16/BF16, 180 PF TF32 sparse per 72
        peak_fp8_flops=5e15, peak_int8_ops=5e15,  # [nvl72] 720 PF FP8, 720 POPS INT8 sparse per 72
        hbm_bytes=186 * G, hbm_bandwidth=8 * T,  # [nvl72] up to 13.4 TB HBM3e and 576 TB/s per 72 GPUs
        link_bandwidth=1800 * G / 2 / 18, link_count=18,  # [nvl72] 130 TB/s NVLink per 72 = 1.8 TB/s per GPU
        nvlink_domain=72,  # [nvl72] one NVLink domain of 72 GPUs
        # [nvl72] reference: compute trays of 2 superchips (4 GPUs), one 400 Gb/s ConnectX-7 per GPU
        host_network_bandwidth=4 * 400 * GBIT, host_chips=4,
    ),
]

# Labelled defaults for an uncalibrated CPU: deliberately low (a few cores of a laptop-class CPU under XLA:CPU,
# which reaches well below the vector units' peak); `maxperf calibrate` replaces them with measurements.
CPU_DEFAULT_FP32_FLOPS = 50 * G
CPU_DEFAULT_BF16_FLOPS = 50 * G  # bf16 dots range from slower (converted) to faster (native bf16) than float32
CPU_DEFAULT_MEMORY_BANDWIDTH = 10 * G
CPU_DEFAULT_NETWORK = 10 * GBIT  # 10 Gb/s Ethernet between hosts (an assumption, not a measurement)


def _physical_memory() -> float:
    """This machine's RAM (os.sysconf), the "HBM" of CPU devices; 16 GiB where the OS does not say."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * GiB


def _cpu_chip() -> Chip:
    # devices of one process exchange data through memory: links at memory bandwidth, one "link" each
    return Chip(
        name="cpu", vendor="cpu", kind="cpu",
        peak_bf16_flops=CPU_DEFAULT_BF16_FLOPS, peak_fp32_flops=CPU_DEFAULT_FP32_FLOPS,
        hbm_bytes=_physical_memory(), hbm_bandwidth=CPU_DEFAULT_MEMORY_BANDWIDTH,
        link_bandwidth=CPU_DEFAULT_MEMORY_BANDWIDTH, link_count=1,
        host_network_bandwidth=CPU_DEFAULT_NETWORK, host_chips=1,
        note="uncalibrated defaults (run `maxperf calibrate`)",
    )


CHIPS: dict[str, Chip] = {c.name: c for c in [*_TPUS, *_GPUS, _cpu_chip()]}

# Host memory per chip, bytes: what pinned host memory (offloaded activations and state) shares with the host's own
# use. [v5e] "DRAM per host 512 GiB", 8 chips per host; [v5p] "RAM (GB) (4-chip VM) 448"; [v6e] "DRAM per host
# 1536 GiB", 8 chips per host; [dgxh100] DGX H100: 2 TB of system memory for its 8 GPUs. Others unpublished here.
HOST_MEMORY_PER_CHIP = {"tpu-v5e": 512 * GiB / 8, "tpu-v5p": 448e9 / 4, "tpu-v6e": 1536 * GiB / 8,
                        "h100-sxm": 2e12 / 8, "h200": 2e12 / 8}

# One direction of each chip's link to host memory, bytes/s (Chip.host_link_bandwidth).
HOST_LINK_BANDWIDTH = {
    # [book] part 2: "PCIe bandwidth is typically around 1.6e10 bytes / second per TPU (3.2e10 for TPU v6e)", whose
    # host link is PCIe Gen5 ([v6e] "connects to the host through a PCIe Gen5 interface"); TPU7x's is not published:
    # assumed v6e's for each of its two devices (halved, a chip's link shared by its devices, the fit over
    # bench/published.py's TPU rows moves: leave-one-source-out 5.6% to 8.0%, its Ironwood 405B rows offloading)
    "tpu-v4": 1.6e10, "tpu-v5e": 1.6e10, "tpu-v5p": 1.6e10, "tpu-v6e": 3.2e10, "tpu7x": 3.2e10,
    # [a100] PCIe Gen4: 64 GB/s (both directions)
    "a100-40gb": 32 * G, "a100-80gb": 32 * G,
    # [h100], [h200] PCIe Gen5: 128 GB/s (both directions)
    "h100-sxm": 64 * G, "h200": 64 * G,
    # [b200] PCIe Gen5 x16 per GPU: 128 GB/s (both directions)
    "b200": 64 * G,
    # [nvl72] NVLink-C2C between each Blackwell GPU and its Grace CPU: 900 GB/s (both directions)
    "gb200": 450 * G,
}
