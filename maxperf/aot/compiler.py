"""`maxperf compile`: lower and compile the train step for a (possibly virtual) topology, and write the artifact."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import pickle
import platform
import re
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxperf import __version__
from maxperf.aot import artifacts, cache, hlo_time, peak, targets
from maxperf.perfmodel.calibration import StoredCalibration
from maxperf.spec import presets
from maxperf.spec.errors import DoesNotFit, MaxperfError, Unserializable
from maxperf.spec.model import ModelConfig
from maxperf.spec.request import Request, resolve, serving_warnings
from maxperf.spec.topology import Topology

Progress = Callable[[str], None]

_VERSIONED = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
              "jax-cuda13-pjrt", "flax", "optax")


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "maxperf": __version__}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# Environment variables whose flags change what XLA compiles (MaxText's recipes set both): a compiled step is cached
# under them, so that a compile with other flags (a raised VMEM limit, say) is not served an executable built without
# them. XLA_FLAGS' host device count is the topology's business, not the program's, and is left out.
COMPILER_ENVIRONMENT = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")
_HOST_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def compiler_environment() -> dict[str, str]:
    """The compiler flags this process's environment gives XLA (COMPILER_ENVIRONMENT), as the compile cache keys
    them."""
    out = {}
    for name in COMPILER_ENVIRONMENT:
        flags = os.environ.get(name, "")
        if name == "XLA_FLAGS":
            flags = _HOST_DEVICE_COUNT.sub("", flags)
        out[name] = " ".join(flags.split())
    return out


def cache_versions() -> dict[str, str | None]:
    """What a cached executable depends on beside its program, target and options: the library versions and the
    compiler flags of the environment."""
    return {**library_versions(), **compiler_environment()}


def versions_that_must_match(platform_name: str) -> tuple[str, ...]:
    """Library versions an executable is bound to: jax's runtime, and the compiler plugin of its platform."""
    plugin = {"tpu": ("libtpu",), "gpu": ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                                          "jax-cuda13-pjrt")}.get(platform_name, ())
    return ("jax", "jaxlib", *plugin)


@dataclass(frozen=True)
class CompileResult:
    out_dir: Path
    plan: Request
    param_count: int
    global_batch: int  # examples per step: grad_accum_steps microbatches of per_device_batch_size x devices
    fits: bool
    memory: dict[str, Any]
    cost: dict[str, Any]
    estimate: dict[str, Any] | None
    compile_seconds: float
    lower_seconds: float
    total_seconds: float
    peak_rss_bytes: int
    limitations: list[str]
    cache_hit: bool = False  # the executable came from the compile cache: nothing was compiled now


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(text: str) -> int:
    m = re.fullmatch(r"([\d.]+)\s*([KMGT]?)i?B?", text.strip())
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


# The status code an XLA error starts with (absl's canonical codes).
_STATUS = re.compile(r"\b(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
                     r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|UNIMPLEMENTED|"
                     r"INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED):")


def out_of_memory_figures(message: str) -> dict[str, int] | None:
    """What XLA's out-of-memory compile error says, in bytes; None when the error is not about memory.

    Two forms seen from libtpu: 'Used 103.53G of 95.74G hbm' (the total) and 'the total memory required for HLO
    temporaries (122.60G) exceeds available HBM (15.75G)' (temporaries only)."""
    status = _STATUS.search(message)
    if status is not None and status.group(1) != "RESOURCE_EXHAUSTED":
        return None  # another failure whose details mention memory (the GPU autotuner's NOT_FOUND, say)
    if scoped_vmem_exhausted(message):
        return None  # a kernel's on-chip working set, not the device's memory
    if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
        return None
    size = r"([\d.]+\s*[KMGT]?i?B?)"
    if m := re.search(rf"Used\s+{size}\s+of\s+{size}\s+\w+", message):
        return {"per_device_total_bytes": _bytes(m.group(1)), "compiler_available_bytes": _bytes(m.group(2))}
    if m := re.search(rf"temporaries \({size}\) exceeds available \w+ \({size}\)", message):
        return {"temp_bytes": _bytes(m.group(1)), "compiler_available_bytes": _bytes(m.group(2))}
    return {}


def oom_total(temporaries: int, arguments: int) -> dict[str, int]:
    """The per-device total of a compile that ran out of memory where XLA named only its "HLO temporaries", and the
    arguments the step's shardings give. libtpu's figure holds the arguments where it is at least as large as they
    are: a decode step of llama3-70b on v5e-8 in int8 fits at 22 sequences a device (15.63 GiB compiled, 0.17 of them
    temporaries) and at 23 was refused with temporaries of 15.94 GiB beside 15.77 of arguments (one more sequence
    cannot add 15.8 GiB of temporaries). A smaller figure cannot hold them, and they are added. `temp_bytes` is
    what lies beside the arguments, as memory_analysis counts temporaries, so that the parts sum to the total."""
    total = temporaries if temporaries >= arguments else temporaries + arguments
    return {"argument_bytes": arguments, "temp_bytes": total - arguments, "per_device_total_bytes": total}


CONTINUATION_FUSION_FLAG = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather"


def refused_flag_error(message: str) -> str | None:
    """The one-line error for a compile libtpu refused for a flag in LIBTPU_INIT_ARGS: continuation fusion of
    all-gathers into the matmuls they feed (MaxText's CF_FOR_ALL_GATHER, which its v5e, v5p and Trillium scripts
    set), which this libtpu compiles on TPU v5e alone ("Continuation fusion for AllGather is enabled on platform
    ... not supported/recommended on platforms other than TPU v5e"); None for any other failure."""
    if "continuation fusion for allgather" not in message.lower():
        return None
    return (f"libtpu compiles continuation fusion of all-gathers ({CONTINUATION_FUSION_FLAG}=true in "
            "LIBTPU_INIT_ARGS) on TPU v5e alone, and refused it for this topology's chip: drop the flag or set it "
            f"false ({CONTINUATION_FUSION_FLAG}=false after it, as MaxText's v5p 32b.sh does, which hands the "
            "all-gathers to the SparseCore with --xla_tpu_enable_sparse_core_collective_offload_all_gather=true)")


def known_failure_line(message: str) -> str | None:
    """The one-line error, with what to change, for a compile failure maxperf recognizes that is not the device's
    memory running out: a kernel out of scoped VMEM (vmem_error), a flag libtpu refuses for the chip
    (refused_flag_error); None for any other."""
    return vmem_error(message) if scoped_vmem_exhausted(message) else refused_flag_error(message)


def scoped_vmem_exhausted(message: str) -> bool:
    """XLA's TPU compile error for a kernel whose blocks need more of a TensorCore's vector memory (VMEM, on chip)
    than the compiler allows it: libtpu's 'CompileTimeScopedVmemOom', or 'Ran out of memory in memory space vmem.
    Used 286.25M of 127.94M vmem'. It says nothing about HBM."""
    lowered = message.lower()
    return ("scopedvmemoom" in lowered or "memory space vmem" in lowered
            or bool(re.search(r"\bof\s+[\d.]+\s*[kmgt]?i?b?\s+vmem\b", lowered)))


def vmem_error(message: str) -> str:
    """The one-line error for a compile that ran out of scoped VMEM, with what to change."""
    detail = " ".join(line.strip() for line in message.splitlines()[:2] if line.strip())[:300]
    return ("a kernel of the step needs more of the TPU's vector memory (VMEM, on chip; not HBM) than XLA "
            "allows it: use smaller splash attention blocks (sa_block_q, sa_block_kv, sa_block_kv_compute and their "
            "_dkv / _dq forms), or raise the limit as MaxText's recipes do with "
            f"LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=N in the environment (XLA: {detail})")


def argument_bytes(spec) -> int:
    """Bytes of the state and batch (a serving step's arguments) one device holds in its own memory (not pinned host
    memory), from their shardings."""
    import jax
    import numpy as np

    total = 0
    pairs = (zip(spec.args, spec.arg_shardings) if hasattr(spec, "args") else
             ((spec.state, spec.state_shardings), (spec.batch, spec.batch_shardings)))
    for tree, shardings in pairs:
        for x, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
            if getattr(sharding, "memory_kind", None) == "pinned_host":
                continue
            total += math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory_bytes(topology: Topology) -> int:
    """What one device may hold: its HBM, or for CPU devices this host's RAM shared among them."""
    per_device = topology.hbm_bytes_per_device if topology.platform != "cpu" else None
    return int(per_device) if per_device else host_memory_bytes() // topology.num_devices


def memory_fields(analysis) -> dict[str, int]:
    return {
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "generated_code_bytes": int(analysis.generated_code_size_in_bytes),
        # pinned host memory: state offloaded between steps (*_memory_host_offload), activations a remat policy
        # offloads; not part of the device total
        **{f"host_{name}_bytes": int(getattr(analysis, f"host_{name}_size_in_bytes", 0) or 0)
           for name in ("argument", "output", "alias", "temp")},
    }


def xla_cost(compiled) -> dict[str, float] | None:
    raw = compiled.cost_analysis()
    if isinstance(raw, (list, tuple)):
        raw = raw[0] if raw else None
    return {k: float(v) for k, v in raw.items()} if raw else None


def unserializable_why(p: Request) -> str:
    """Why a step's executable may not pickle, in words: block-scaled FP8 products partition by a custom rule."""
    from maxperf.spec import fp8

    recipe = fp8.recipe(str(p.configs.train.quantization))
    if recipe is not None and recipe.block:
        return (f"quantization={recipe.name}'s block-scaled products are partitioned by jax's custom partitioning, "
                "whose rule does not pickle")
    return "a part of its lowering does not pickle"


def memory_report(fields: dict[str, int], capacity: int, live_peak: dict | None = None) -> dict[str, Any]:
    """Per-device figures from XLA's memory analysis; the total is what the device must hold at once. `live_peak`:
    what is live at the step's peak (aot.peak), kept as "peak" where XLA reported it."""
    # donated state is both argument and output: count it once (as MaxText's memory report does)
    total = (fields["argument_bytes"] + fields["output_bytes"] - fields["alias_bytes"] + fields["temp_bytes"]
             + fields["generated_code_bytes"])
    return {"schema": "maxperf.memory/1", "source": "xla memory_analysis", **fields,
            "per_device_total_bytes": int(total), "hbm_bytes": int(capacity),
            "headroom_bytes": int(capacity - total), "fits": bool(total <= capacity),
            **({"peak": live_peak} if live_peak else {})}


def cost_report(raw: dict[str, float] | None, hlo_text: str, topology: Topology) -> dict[str, Any]:
    """The compiler's FLOPs and bytes per device, each with where it came from."""
    from maxperf.aot import hlo_cost

    counted = hlo_cost.hlo_flops(hlo_text)
    report: dict[str, Any] = {"schema": "maxperf.cost/1"}
    report["flops_per_device"] = counted.flops
    report["flops_source"] = ("optimized HLO: dot, convolution and GEMM custom-call FLOPs counted by maxperf, "
                              "while-loop bodies multiplied by their trip counts")
    if counted.attention_kernel_flops:
        report["flops_source"] += ("; Pallas attention kernels, which carry no cost estimate, counted by maxperf "
                                   "from their operand shapes and block sizes under a causal mask "
                                   f"({counted.attention_kernel_flops:.4g} of the FLOPs)")
    report["xla_style_flops_per_device"] = counted.xla_style_flops  # the same count XLA makes, loops corrected
    report["hlo"] = dataclasses.asdict(counted) if dataclasses.is_dataclass(counted) else dict(counted)
    if raw:
        report["xla_flops_per_device"] = float(raw.get("flops", 0.0))
        report["bytes_accessed_per_device"] = float(raw.get("bytes accessed", 0.0))
        report["bytes_accessed_source"] = "xla cost_analysis (a while loop's body counted once)"
        report["xla_source"] = "xla cost_analysis: counts each while loop's body once, so scanned layers count once"
    else:
        report["xla_flops_per_device"] = None
        report["bytes_accessed_per_device"] = None
        report["bytes_accessed_source"] = (f"unavailable: the {topology.platform.upper()} compiler gave no cost "
                                           "analysis for this target")
    return report


def estimate_for(p: Request, calibration: StoredCalibration | None = None, step: str = "train"
                 ) -> dict[str, Any] | None:
    """The analytical prediction for the same configuration (perfmodel; perfmodel.serving for a serving step), as
    JSON; `calibration` (for CPU topologies) is loaded from the user's cache when not given, and recorded in the
    JSON."""
    from maxperf import perfmodel
    from maxperf.user_cache import calibration_for

    if calibration is None:
        calibration = calibration_for(p.topology)
    if step != "train":
        from maxperf.perfmodel import serving
        from maxperf.perfmodel.estimate import device_for

        chip = device_for(p.topology, calibration)
        return {**serving.estimate(p.model, p.train, p.mesh, chip, p.topology, kind=step).as_dict(), "step": step}
    result = perfmodel.estimate(p,
                                calibration=calibration)
    return result.as_dict()


def compile(topology: str | Topology, model: str | ModelConfig = presets.DEFAULT_MODEL,
            overrides: Sequence[str] = (), *, num_slices: int = 1, out: str | os.PathLike | None = None,
            target_config: str | os.PathLike | None = None, progress: Progress | None = None,
            argv: Sequence[str] | None = None, force: bool = False,
            calibration: StoredCalibration | None = None, step: str = "train") -> CompileResult:
    """Lowers and compiles the train step (or the serving step `step`: prefill or decode, models/serving.py) for
    `topology` and writes the artifact directory. estimate.json uses
    `calibration` (CPU topologies), else the one stored in the user's cache, and records which.

    Raises MaxperfError for bad input (an `out` that holds anything but an earlier compile's artifact is one, unless
    `force`) and DoesNotFit (after writing the verdict) when the step needs more memory than a device has.
    """
    say = progress or (lambda _: None)
    start = time.perf_counter()
    p = resolve(topology, model, overrides, num_slices=num_slices, target_config=target_config)
    if step != "train":  # a serving step's own words (no optimizer state), kept in the manifest too
        p = dataclasses.replace(p, warnings=serving_warnings(p))
    else:  # a quantized dropless mixture of experts: the train step refuses it, before any work (no pricing note)
        from maxperf.models.layers import quantization as quant

        # the step's own reading of the key; a shard count given, so that reading it starts no jax backend
        quant.check_moe(quant.from_train(dataclasses.replace(p.train, quantization_local_shard_count=1)),
                        p.model.is_moe, p.train.sparse_matmul)
    for line in p.warnings:
        say(f"warning: {line}")
    if step != "train":
        from maxperf.models.serving import check

        check(p.model, p.train, p.topology.num_devices, dict(p.mesh.sizes), step)  # bad input before any writing
    out_dir = Path(out) if out is not None else p.default_dir(step)
    writer = artifacts.ArtifactWriter(out_dir, "compile", force=force,
                                      inputs=[target_config] if target_config else [])
    try:
        return _compile_into(writer, p, say, start, argv, calibration, step)
    except BaseException:
        writer.abandon()
        raise


def _compile_into(writer: artifacts.ArtifactWriter, p: Request, say: Progress, start: float, argv,
                  calibration: StoredCalibration | None = None, step: str = "train") -> CompileResult:
    topo, out_dir = p.topology, writer.out
    say(f"devices: {topo.name} ({topo.num_devices} devices, mesh "
        + (" x ".join(f"{a}={n}" for a, n in p.mesh.axes.items() if n > 1) or "1") + ")")
    if topo.platform == "tpu":
        targets.quiet_libtpu()
    import jax
    from jax.experimental import serialize_executable

    from maxperf.models import train_step

    mesh = targets.jax_mesh(p.topology, p.mesh)
    say("abstract state and shardings")
    if step == "train":
        spec = train_step.abstract_step(p.configs.model, p.configs.train, mesh)
        jitted, args = train_step.jit_step(spec), (spec.state, spec.batch)
    else:
        from maxperf.models import serving

        spec = serving.abstract_serve(p.configs.model, p.configs.train, mesh, step)
        jitted, args = spec.jitted(), spec.args
    say("lowering")
    t = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = jitted.lower(*args)
    lower_seconds = time.perf_counter() - t
    capacity = device_memory_bytes(topo)
    writer.write_text("hlo/lowered.stablehlo.mlir", lowered.as_text())
    options = targets.compiler_options(topo, random_bits=str(p.configs.train.quantization) == "int8")
    key = cache.key(lowered.as_text(), target_identity(topo), options, cache_versions())
    entry = cache.get(key)
    cache_hit = entry is not None
    t = time.perf_counter()
    if cache_hit:
        say("compiling: found in the compilation cache")
    else:
        say("compiling")
        try:
            compiled, found = peak.compile_with_peak(lowered, options)
        except Exception as e:  # XLA reports out-of-memory as a compile error on TPU
            if known := known_failure_line(str(e)):
                raise MaxperfError(known) from None
            figures = out_of_memory_figures(str(e))
            if figures is None:
                raise MaxperfError(f"XLA could not compile the step: {str(e).splitlines()[0][:300]}") from e
            memory = {"schema": "maxperf.memory/1", "source": "xla compile error (out of memory)", **figures,
                      "hbm_bytes": figures.get("compiler_available_bytes") or capacity, "fits": False,
                      # where XLA stopped: what it had counted when the memory ran out, not the whole step's
                      "at_least": True, "compiler_message": str(e).splitlines()[0][:500]}
            if "temp_bytes" in figures:  # the compiler named its "temporaries": with or without the arguments
                memory.update(oom_total(figures["temp_bytes"], argument_bytes(spec)))
                memory["source"] += "; arguments from the state's shardings"
            if memory.get("per_device_total_bytes"):
                memory["headroom_bytes"] = memory["hbm_bytes"] - memory["per_device_total_bytes"]
            writer.write_json("memory.json", memory)
            _write_manifest(writer, p, spec, argv, time.perf_counter() - t, lower_seconds, start,
                            compiled=False, cache_hit=False, step=step)
            finish(writer)
            raise DoesNotFit(verdict_line(memory)) from None
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except Exception as e:  # jax pickles the executable's lowering: some partitioning rules do not pickle
            # the compiler's figures are written as a compile that does not fit writes them, without compiled.pkl
            writer.write_text("hlo/optimized.hlo.txt", compiled.as_text())
            writer.write_json("memory.json", memory_report(memory_fields(compiled.memory_analysis()), capacity,
                                                           found.as_dict() if found else None))
            _write_manifest(writer, p, spec, argv, time.perf_counter() - t, lower_seconds, start,
                            compiled=False, cache_hit=False, step=step)
            finish(writer)
            raise Unserializable(
                f"jax cannot serialize this compiled step ({type(e).__name__}: {str(e).splitlines()[0][:120]}): "
                f"{unserializable_why(p)}; the compiler's memory and optimized HLO are in {writer.out}, but no "
                "compiled.pkl, so `maxperf run` cannot load it") from None
        entry = cache.Entry(payload=payload, in_tree=str(in_tree), out_tree=str(out_tree),
                            memory=memory_fields(compiled.memory_analysis()), xla_cost=xla_cost(compiled),
                            optimized_hlo=compiled.as_text(), compile_seconds=time.perf_counter() - t,
                            label=f"{p.model.name} {step} on {topo.name}" + (
                                f" x{topo.num_slices}" if topo.num_slices > 1 else ""),
                            peak=found.as_dict() if found else None)
        cache.put(key, entry)
    compile_seconds = time.perf_counter() - t
    say("writing artifacts")
    writer.write_text("hlo/optimized.hlo.txt", entry.optimized_hlo)
    memory = memory_report(entry.memory, capacity, getattr(entry, "peak", None))
    writer.write_json("memory.json", memory)
    cost = cost_report(entry.xla_cost, entry.optimized_hlo, topo)
    writer.write_json("cost.json", cost)
    estimate = estimate_for(p, calibration, step)
    if estimate is not None:
        say("reading the step time from the optimized HLO")
        estimate["hlo_time"] = hlo_time.predict(entry.optimized_hlo, topo, p.mesh, calibration).as_dict()
        writer.write_json("estimate.json", estimate)
    artifacts.check_executable_pickle(entry.payload)
    blob = {"schema": artifacts.COMPILED_SCHEMA, "platform": topo.platform, "executable": entry.payload,
            "in_tree": entry.in_tree, "out_tree": entry.out_tree}
    writer.write_bytes("compiled.pkl", pickle.dumps(blob, protocol=pickle.HIGHEST_PROTOCOL))
    _write_manifest(writer, p, spec, argv, compile_seconds, lower_seconds, start, compiled=True,
                    cache_hit=cache_hit, step=step)
    finish(writer)
    return CompileResult(
        out_dir=out_dir, plan=p, param_count=spec.param_count, global_batch=spec.global_batch, fits=memory["fits"],
        memory=memory, cost=cost, estimate=estimate, compile_seconds=compile_seconds, lower_seconds=lower_seconds,
        total_seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss_bytes(),
        limitations=targets.limitations(topo, p.model.is_moe) + step_limitations(p, step), cache_hit=cache_hit,
    )


def finish(writer: artifacts.ArtifactWriter) -> None:
    """Process 0 writes the artifact; the other processes of a multi-process compile discard their copy."""
    import jax

    if jax.process_index() == 0:
        writer.commit()
    else:
        writer.abandon()


def verdict_line(memory: dict[str, Any]) -> str:
    gib = 1 << 30
    used, hbm = memory.get("per_device_total_bytes"), memory["hbm_bytes"]
    if used:
        return (f"does not fit: needs {used / gib:.2f} GiB per device, {hbm / gib:.2f} GiB available "
                f"(over by {(used - hbm) / gib:.2f} GiB)")
    return f"does not fit in {hbm / gib:.2f} GiB per device ({memory.get('compiler_message', '')})"


def device_summary(mesh) -> dict[str, Any]:
    """What a machine must have to run the executable: the device kind, and how many devices and processes."""
    devices = list(mesh.devices.flat)
    return {"platform": devices[0].platform, "kind": devices[0].device_kind, "count": len(devices),
            "processes": len({d.process_index for d in devices})}


def target_identity(topology: Topology) -> dict[str, Any]:
    """What the compiled code depends on besides the module: the target, and a user's GPU spec by content."""
    target = topology.as_dict()
    if topology.target_config_path:
        target["target_config_text"] = Path(topology.target_config_path).read_text()
    return target


def step_limitations(p: Request, step: str) -> list[str]:
    """What the compiled step is, beside the production step the analytical estimate prices, in words the CLI prints."""
    if step == "decode" and p.topology.platform == "gpu" and p.configs.train.scan_layers:
        return ["a decode step with scanned layers copies each layer's weights and cache out of the stacked arrays "
                "before its matmuls on GPU (on an H200, llama3-8b at B 8: 24.4 ms a step, 3.9x the analytical figure, "
                "a serving stack's one read of each; docs/serving.md); scan_layers=false, as MaxText's served "
                "checkpoints are, compiles without the copies"]
    if step == "train" and str(p.configs.train.pipeline_schedule) == "1f1b" and p.mesh.axes["stage"] > 1:
        return ["pipeline_schedule=1f1b is Megatron-LM's order, which perfmodel prices; the compiled pipeline runs "
                "MaxText's (every microbatch's forward, then the backward), so its memory holds every loop "
                "iteration's activations, more than 1F1B's microbatches in flight"]
    return []


def _write_manifest(writer: artifacts.ArtifactWriter, p: Request, spec, argv, compile_seconds: float,
                    lower_seconds: float, start: float, *, compiled: bool, cache_hit: bool,
                    step: str = "train") -> None:
    manifest = {
        "schema": artifacts.MANIFEST_SCHEMA,
        "step": step,  # maxperf's own step by name (train, prefill, decode); a user's step records a dict
        "created_unix": time.time(),
        "command": list(argv) if argv is not None else sys.argv,
        "compiled": compiled,
        "model": p.configs.model,
        "train": p.configs.train,
        "parallelism": p.configs.parallelism,
        "mesh": {"axes": p.mesh.axes, "ici": p.mesh.ici, "dcn": p.mesh.dcn},
        "warnings": list(p.warnings),
        "topology": p.topology.as_dict(),
        "devices": device_summary(spec.mesh),
        # GPU: compiled on the attached GPUs (autotuned), or without a GPU (XLA's untuned defaults)
        "gpu_autotuned": (targets.compiles_on_attached_gpus(p.topology) is not None
                          if p.topology.platform == "gpu" else None),
        "param_count": spec.param_count,
        "global_batch": spec.global_batch,  # examples per step (MaxText's global_batch_size_to_train_on)
        "micro_batch": spec.micro_batch,  # examples per microbatch: per_device_batch_size x devices
        "tokens_per_step": (spec.global_batch * p.configs.train.seq_len if step == "train" else
                            spec.tokens_per_step),
        "versions": library_versions(),
        "compiler_environment": compiler_environment(),  # the XLA and libtpu flags it was compiled under
        "compile_seconds": round(compile_seconds, 3),
        "compile_cache_hit": cache_hit,
        "lower_seconds": round(lower_seconds, 3),
        "wall_seconds": round(time.perf_counter() - start, 3),
        "peak_rss_bytes": peak_rss_bytes(),
        "limitations": targets.limitations(p.topology, p.model.is_moe) + step_limitations(p, step),
        "files": writer.hashes(),
    }
    writer.write_json("manifest.json", manifest)
