"""The analytical estimate of one training step on one topology: FLOPs, memory, step time, MFU, and why."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields, replace

from maxperf.perfmodel import chips, cpu
from maxperf.perfmodel.calibration import Calibration, StoredCalibration
from maxperf.perfmodel.flops import FlopCounts, ParamCounts, count_flops, count_params, resolve_attention
from maxperf.perfmodel.memory import MemoryBreakdown, estimate_memory, params_per_device
from maxperf.perfmodel.steptime import Row, StepTime, step_time
from maxperf.perfmodel.work import SHIPPED, Constants, Overlap, Uncertainty, uncertainty
from maxperf.spec.fp8 import recipe as fp8_recipe
from maxperf.spec.request import Request
from maxperf.spec.topology import Topology

SCHEMA = "maxperf.estimate/1"  # estimate.json and `maxperf estimate --json`


@dataclass(frozen=True)
class Estimate:
    model: str
    chip: str
    chips: int
    step_time_s: float
    tokens_per_s: float  # all devices together
    tflops_per_chip: float  # model FLOP/s of a chip / 1e12 (MaxText's TFLOP/s per device, x devices per chip)
    mfu: float  # model FLOPs / (step time x peak)
    model_flops_per_device: float  # per JAX device (a tpu7x chip has two)
    hardware_flops_per_device: float
    memory: MemoryBreakdown
    fits: bool
    bottleneck: str  # "compute", "hbm", "ici", "dcn"
    breakdown: tuple[Row, ...]
    params: ParamCounts
    flops: FlopCounts
    time: StepTime
    peak_flops: float  # per JAX device, in the compute dtype
    peaks_calibrated: bool  # for "cpu": measured by `maxperf calibrate`; False: published figures or defaults
    chip_note: str
    overlap: Overlap
    calibration: dict | None = None  # for "cpu": which calibration was used (StoredCalibration.record()); else None
    notes: tuple[str, ...] = ()  # fallbacks that change the prediction: no usable calibration, datasheet memory
    # the fitted and assumed constants the step time rests on, one line each (StepTime.assumptions)
    assumptions: tuple[str, ...] = ()
    uncertainty: Uncertainty | None = None  # the step time's error on published runs held out from the fit

    @property
    def memory_per_device_bytes(self) -> float:
        return self.memory.per_device_total_bytes

    def as_dict(self) -> dict:
        """A JSON-ready dict (schema-versioned)."""
        return {
            "schema": SCHEMA, "model": self.model, "chip": self.chip, "chips": self.chips,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tflops_per_chip": self.tflops_per_chip, "mfu": self.mfu,
            "model_flops_per_device": self.model_flops_per_device,
            "hardware_flops_per_device": self.hardware_flops_per_device,
            "memory_per_device_bytes": self.memory_per_device_bytes, "fits": self.fits,
            "bottleneck": self.bottleneck, "peak_flops": self.peak_flops, "peaks_calibrated": self.peaks_calibrated,
            "chip_note": self.chip_note, "calibration": self.calibration, "notes": list(self.notes),
            "assumptions": list(self.assumptions),
            "uncertainty": None if self.uncertainty is None else asdict(self.uncertainty),
            "memory": self.memory.as_dict(),
            "params": {**asdict(self.params), "non_embedding": self.params.non_embedding},
            "flops": asdict(self.flops),
            "time": {f.name: getattr(self.time, f.name) for f in fields(self.time) if f.name not in ("rows", "terms")},
            "breakdown": [asdict(r) for r in self.breakdown],
            "overlap": asdict(self.overlap),
        }


# The Chip fields that devices sharing a chip or a machine divide among themselves (rates and capacities); None
# (not published, not measured) stays None.
SHARED_FIELDS = ("peak_bf16_flops", "peak_fp32_flops", "peak_fp8_flops", "peak_int8_ops", "hbm_bandwidth", "hbm_bytes",
                 "link_bandwidth", "host_network_bandwidth", "page_fault_bandwidth", "transpose_bandwidth",
                 "elementwise_bandwidth")


def target_hbm_bytes(topology: Topology) -> float | None:
    """A chip's memory as the target compiled for states it (a GPU's GpuTargetConfigProto `device_memory_size`);
    None where it states none."""
    value = topology.target_hbm_bytes
    return None if value is None else float(value)


def stored(calibration: StoredCalibration | Calibration | None) -> StoredCalibration | None:
    """A bare Calibration (passed in by a program) as a StoredCalibration without a file."""
    return StoredCalibration(None, calibration) if isinstance(calibration, Calibration) else calibration


def device_for(topology: Topology, calibration: StoredCalibration | Calibration | None = None) -> chips.Chip:
    """What one JAX device has: the chip (with `calibration`'s measurements for "cpu", the target's memory where
    the topology states it), or its share where devices share a chip (tpu7x's two chiplets) or a machine (CPU
    devices of one host share its cores, memory and bandwidth)."""
    hbm = target_hbm_bytes(topology)
    if calibration is None:
        return _device_without_calibration(topology, hbm)
    return _device(topology, stored(calibration), hbm)


@functools.lru_cache(maxsize=64)  # a search asks for the same topology's device at every candidate
def _device_without_calibration(topology: Topology, hbm: float | None) -> chips.Chip:
    return _device(topology, None, hbm)


def _device(topology: Topology, cal: StoredCalibration | None, hbm: float | None) -> chips.Chip:
    chip = chips.get(topology.chip, cal.calibration if cal else None)
    if hbm is not None:
        chip = replace(chip, hbm_bytes=hbm)
    if topology.host_network_bandwidth is not None:  # a system whose hosts' network is not the chip's reference's
        chip = replace(chip, host_network_bandwidth=topology.host_network_bandwidth, host_chips=topology.chips_per_host)
    n = topology.devices_per_chip * (topology.chips_per_host if chip.kind == "cpu" else 1)
    if n <= 1:
        return chip
    shares = {name: value / n for name in SHARED_FIELDS if (value := getattr(chip, name)) is not None}
    return replace(chip, **shares, attention_rates=tuple((dt, dh, rate / n) for dt, dh, rate in chip.attention_rates))


def default_overlap(chip: chips.Chip) -> Overlap:
    """Overlap's defaults on accelerators; on CPU devices XLA:CPU's (perfmodel.cpu.OVERLAP)."""
    return _CPU_OVERLAP if chip.kind == "cpu" else _OVERLAP


_OVERLAP, _CPU_OVERLAP = Overlap(), Overlap.uniform(cpu.OVERLAP)  # frozen: one each serves every estimate


def host_memory_notes(topology: Topology, host_bytes_per_device: float) -> tuple[str, ...]:
    """A line where the pinned host memory a chip's devices use passes the host memory a chip has
    (hardware.HOST_MEMORY_PER_CHIP, where published): the offload would not fit on the hosts."""
    from maxperf.spec.hardware import HOST_MEMORY_PER_CHIP

    per_chip = HOST_MEMORY_PER_CHIP.get(topology.chip)
    used = host_bytes_per_device * topology.num_devices / topology.chips
    if per_chip is None or used <= per_chip:
        return ()
    return (f"pinned host memory {used / 2**30:.1f} GiB a chip passes the {per_chip / 2**30:.0f} GiB of host memory "
            f"a {topology.chip} chip has ({used * topology.chips_per_host / 2**30:.0f} GiB needed on each host): the "
            "offloaded tensors would not fit on the hosts, whatever the verdict on device memory says; offload less "
            "(remat_policy) or use more chips",)


def fallback_notes(topology: Topology, chip: chips.Chip, calibration: StoredCalibration | None) -> tuple[str, ...]:
    """What the prediction stands on that is not the real thing: CPU peaks without a usable calibration, a GPU's
    memory from its datasheet where the target spec it compiles for would say."""
    notes = []
    if chip.kind == "cpu" and (calibration is None or calibration.calibration is None):
        notes.append(calibration.problem if calibration is not None and calibration.problem else
                     "no calibration was passed in: CPU peaks are uncalibrated defaults")
    if chip.kind == "gpu" and target_hbm_bytes(topology) is None:
        notes.append(f"{chip.name} memory is the datasheet's {chips.CHIPS[chip.name].hbm_bytes / 1e9:.0f} GB, not "
                     "read from the GPU target spec that compiles (it needs the CUDA plugin: "
                     "pip install 'maxperf[gpu]')")
    return tuple(notes)


def estimate(request: Request, *, overlap: Overlap | float | None = None,
             calibration: StoredCalibration | Calibration | None = None,
             load_imbalance: float | None = None, memory: MemoryBreakdown | None = None,
             constants: Constants = SHIPPED) -> Estimate:
    """Predicts one step of the request's train config for its model over its mesh and topology.

    overlap: an Overlap, or one fraction for all; None takes the chip's default (default_overlap); calibration: this
    machine's measurements for "cpu" topologies (maxperf.user_cache.calibration_for loads them), recorded in the
    result; without one, labelled defaults; load_imbalance: for MoE models under expert parallelism, the busiest
    device's routed rows over the mean (None: the train config's moe_load_imbalance where it has one, else
    perfmodel.moe.LOAD_IMBALANCE); memory: what estimate_memory gave for this very model, train config (its attention
    resolved), mesh and device, where the caller has it already (a search estimates memory first), so that it is not
    estimated twice; constants: the step-time model's fitted constants (SHIPPED: as fitted on
    bench/published.py)."""
    model, train, mesh, topology = request.model, request.train, request.mesh.check(request.topology), request.topology
    cal = stored(calibration)
    chip = device_for(topology, cal)
    train = resolve_attention(model, train, chip.kind)
    if overlap is None:
        overlap = default_overlap(chip)
    elif not isinstance(overlap, Overlap):
        overlap = Overlap.uniform(float(overlap))
    per_chip = topology.devices_per_chip
    params = count_params(model)
    flops = count_flops(model, train, params_per_device(model, mesh, train), chip.kind)
    if memory is None:
        memory = estimate_memory(model, train, mesh, chip.hbm_bytes, chip.kind, chip.name)
    time = step_time(model, train, mesh, chip, topology, overlap, max(memory.phases().values()), load_imbalance,
                     constants)
    peak = chip.peak_flops(train.compute_dtype)
    step = time.step_time_s
    return Estimate(
        model=str(model.name), chip=chip.name, chips=topology.chips, step_time_s=step,
        tokens_per_s=flops.tokens * mesh.devices / step,
        tflops_per_chip=per_chip * flops.model_flops / step / 1e12,
        mfu=flops.model_flops / (step * peak), model_flops_per_device=flops.model_flops,
        hardware_flops_per_device=flops.hardware_flops, memory=memory, fits=memory.fits,
        bottleneck=time.bottleneck, breakdown=time.rows, params=params, flops=flops, time=time, peak_flops=peak,
        peaks_calibrated=chip.calibrated, chip_note=chip.note, overlap=overlap,
        calibration=cal.record() if cal is not None and chip.kind == "cpu" else None,
        notes=fallback_notes(topology, chip, cal) + host_memory_notes(topology, memory.host_bytes),
        assumptions=time.assumptions,
        uncertainty=uncertainty(chip, constants, model.is_moe, fp8_recipe(str(train.quantization)) is not None),
    )
