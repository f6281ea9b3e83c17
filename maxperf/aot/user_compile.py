"""`maxperf compile --step MODULE:FACTORY`: a user's step lowered and compiled for a (possibly virtual) topology,
written as the same artifact maxperf's own steps make (compiled.pkl, manifest.json, hlo/, memory.json, cost.json,
estimate.json), its step time read from the compiled program (maxperf.aot.hlo_time).

Everything that can be wrong with the input is found before anything is written: the --out directory, the
factory (imported, called and its Step checked: maxperf.aot.user_step) and the step function (traced and lowered).
"""

from __future__ import annotations

import math
import os
import pickle
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts, cache, compiler, hlo_time, peak, targets, user_step
from maxperf.aot.user_step import Step, UserStepError
from maxperf.perfmodel.calibration import StoredCalibration
from maxperf.spec.errors import DoesNotFit
from maxperf.spec.steps import StepName, UserRequest, resolve_user
from maxperf.spec.topology import Topology

ESTIMATE_SCHEMA = "maxperf.hlo-estimate/1"  # estimate.json of a user's step: the prediction read from the HLO


@dataclass(frozen=True)
class UserCompileResult:
    out_dir: Path
    request: UserRequest
    step: Step
    fits: bool
    memory: dict[str, Any]
    cost: dict[str, Any]
    estimate: dict[str, Any] | None  # None when the step did not compile (it does not fit)
    compile_seconds: float
    lower_seconds: float
    total_seconds: float
    peak_rss_bytes: int
    limitations: list[str]
    cache_hit: bool = False


def compile_step(topology: str | Topology, step: str | StepName, words: Sequence[str] = (), *, num_slices: int = 1,
                 out: str | os.PathLike | None = None, target_config: str | os.PathLike | None = None,
                 progress=None, argv: Sequence[str] | None = None, force: bool = False,
                 calibration: StoredCalibration | None = None) -> UserCompileResult:
    """Compiles the step `step`'s factory makes over `topology`'s mesh (the `ici_*` / `dcn_*` words size it; the
    other words go to the factory) and writes the artifact directory.

    Raises UserStepError (a MaxperfError, exit 2, nothing written) when the factory cannot be imported, raises,
    returns something other than a checked Step, or its function fails to trace or lower; MaxperfError for other
    bad input; DoesNotFit (after writing the verdict) when the step needs more memory than a device has."""
    say = progress or (lambda _: None)
    start = time.perf_counter()
    request = resolve_user(topology, step, words, num_slices=num_slices, target_config=target_config)
    topo = request.topology
    out_dir = Path(out) if out is not None else request.default_dir()
    inputs = [target_config] if target_config else []
    artifacts.claim_output(out_dir, "compile", force=force, inputs=inputs)  # a bad --out: before any work
    say(f"devices: {topo.name} ({topo.num_devices} devices, mesh {request.mesh.shown()})")
    if topo.platform == "tpu":
        targets.quiet_libtpu()
    import jax

    mesh = targets.jax_mesh(topo, request.mesh)
    say(f"calling the step's factory {request.step}")
    user = user_step.make_step(request.step, mesh, request.args)
    say("lowering")
    t = time.perf_counter()
    lowered = lower(user, mesh)
    lower_seconds = time.perf_counter() - t
    writer = artifacts.ArtifactWriter(out_dir, "compile", force=force, inputs=inputs)
    try:
        return _compile_into(writer, request, user, mesh, lowered, say, start, lower_seconds, argv, calibration, jax)
    except BaseException:
        writer.abandon()
        raise


def lower(user: Step, mesh):
    """The step jitted with its donation and result shardings, lowered inside its context; a failure in the user's
    function is a UserStepError."""
    import jax

    options: dict[str, Any] = {"donate_argnums": user.donate}
    if user.out_shardings is not None:
        options["out_shardings"] = user.out_shardings
    try:
        with user_step.context(user, mesh):
            return jax.jit(user.fn, **options).lower(*user.args)
    except Exception as e:
        raise UserStepError(f"tracing or lowering the step of --step {user.name} failed: {user_step.first_line(e)} "
                            "(--verbose shows the traceback)", user_step.traceback_text(e)) from None


def argument_bytes(user: Step) -> int:
    """Bytes of the step's arguments one device holds, from their shardings (pinned host memory left out)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(user.args):
        if getattr(x.sharding, "memory_kind", None) == "pinned_host":
            continue
        total += math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def _compile_into(writer, request: UserRequest, user: Step, mesh, lowered, say, start: float, lower_seconds: float,
                  argv, calibration, jax) -> UserCompileResult:
    from jax.experimental import serialize_executable

    topo = request.topology
    capacity = compiler.device_memory_bytes(topo)
    text = lowered.as_text()
    writer.write_text("hlo/lowered.stablehlo.mlir", text)
    options = {**targets.compiler_options(topo), **dict(user.compiler_options)}
    # the argument and result trees are keyed too: the lowered text does not name a dict's keys, and the executable
    # is loaded with the trees its entry recorded
    key = cache.key(f"{text}\n{lowered.in_tree}\n{lowered.out_tree}", compiler.target_identity(topo), options,
                    compiler.cache_versions())
    entry = cache.get(key)
    cache_hit = entry is not None
    t = time.perf_counter()
    if cache_hit:
        say("compiling: found in the compilation cache")
    else:
        say("compiling")
        try:
            compiled, found = peak.compile_with_peak(lowered, options)
        except Exception as e:
            if known := compiler.known_failure_line(str(e)):
                raise UserStepError(known, user_step.traceback_text(e)) from None
            figures = compiler.out_of_memory_figures(str(e))
            if figures is None:
                raise UserStepError(f"XLA could not compile the step of --step {user.name}: "
                                    f"{str(e).splitlines()[0][:300]}", user_step.traceback_text(e)) from None
            memory = {"schema": "maxperf.memory/1", "source": "xla compile error (out of memory)", **figures,
                      "hbm_bytes": figures.get("compiler_available_bytes") or capacity, "fits": False,
                      # where XLA stopped: what it had counted when the memory ran out, not the whole step's
                      "at_least": True, "compiler_message": str(e).splitlines()[0][:500]}
            if "temp_bytes" in figures:
                memory["argument_bytes"] = argument_bytes(user)
                memory["per_device_total_bytes"] = memory["argument_bytes"] + figures["temp_bytes"]
                memory["source"] += "; arguments from their shardings"
            if memory.get("per_device_total_bytes"):
                memory["headroom_bytes"] = memory["hbm_bytes"] - memory["per_device_total_bytes"]
            writer.write_json("memory.json", memory)
            write_manifest(writer, request, user, mesh, argv, time.perf_counter() - t, lower_seconds, start,
                           compiled=False, cache_hit=False)
            compiler.finish(writer)
            raise DoesNotFit(compiler.verdict_line(memory)) from None
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except Exception as e:  # jax pickles the executable's lowering: a host callback's function does not pickle
            writer.write_text("hlo/optimized.hlo.txt", compiled.as_text())
            memory = compiler.memory_report(compiler.memory_fields(compiled.memory_analysis()), capacity,
                                            found.as_dict() if found else None)
            writer.write_json("memory.json", memory)
            write_manifest(writer, request, user, mesh, argv, time.perf_counter() - t, lower_seconds, start,
                           compiled=False, cache_hit=False)
            compiler.finish(writer)
            raise user_step.Unserializable(
                f"jax cannot serialize the compiled step of --step {user.name} ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:120]}): a part of its lowering does not pickle (a host callback, as "
                "jax.debug.print or jax.pure_callback makes, holds a Python function); the compiler's memory and "
                f"optimized HLO are in {writer.out}, but no compiled.pkl, so `maxperf run` cannot load it",
                user_step.traceback_text(e)) from None
        entry = cache.Entry(payload=payload, in_tree=str(in_tree), out_tree=str(out_tree),
                            memory=compiler.memory_fields(compiled.memory_analysis()),
                            xla_cost=compiler.xla_cost(compiled), optimized_hlo=compiled.as_text(),
                            compile_seconds=time.perf_counter() - t, label=f"--step {user.name} on {topo.name}",
                            peak=found.as_dict() if found else None)
        cache.put(key, entry)
    compile_seconds = time.perf_counter() - t
    say("reading the step time from the optimized HLO")
    writer.write_text("hlo/optimized.hlo.txt", entry.optimized_hlo)
    memory = compiler.memory_report(entry.memory, capacity, getattr(entry, "peak", None))
    writer.write_json("memory.json", memory)
    cost = compiler.cost_report(entry.xla_cost, entry.optimized_hlo, topo)
    writer.write_json("cost.json", cost)
    predicted = hlo_time.predict(entry.optimized_hlo, topo, request.mesh, calibration)
    estimate = user_estimate(predicted, user, topo, memory, calibration)
    writer.write_json("estimate.json", estimate)
    artifacts.check_executable_pickle(entry.payload)
    blob = {"schema": artifacts.COMPILED_SCHEMA, "platform": topo.platform, "executable": entry.payload,
            "in_tree": entry.in_tree, "out_tree": entry.out_tree}
    writer.write_bytes("compiled.pkl", pickle.dumps(blob, protocol=pickle.HIGHEST_PROTOCOL))
    write_manifest(writer, request, user, mesh, argv, compile_seconds, lower_seconds, start, compiled=True,
                   cache_hit=cache_hit)
    compiler.finish(writer)
    return UserCompileResult(
        out_dir=writer.out, request=request, step=user, fits=memory["fits"], memory=memory, cost=cost,
        estimate=estimate, compile_seconds=compile_seconds, lower_seconds=lower_seconds,
        total_seconds=time.perf_counter() - start, peak_rss_bytes=compiler.peak_rss_bytes(),
        limitations=targets.limitations(topo), cache_hit=cache_hit)


# A step's model FLOPs are about what its program computes at most: recomputation only adds to the latter, and the
# usual count (3 x the forward) takes in a little the program skips, the first layer's input gradient (the example's
# vision step: 1.12 x its compiled FLOPs). Past this margin the Step's figure is said to be suspect (a device's FLOPs
# given for the whole step's are off by the device count, 2 or more)
MODEL_FLOPS_MARGIN = 1.5


def model_flops_check(per_device: float, compiled: float) -> list[str]:
    """A note where a Step's model FLOPs per device are more than the compiled program computes: MFU and TFLOP/s are
    counted from them, so they would overstate both (Step.model_flops is the whole step's, over every device)."""
    if per_device <= MODEL_FLOPS_MARGIN * compiled:
        return []
    ratio = f"{per_device / compiled:.3g} times" if compiled else "more than"
    return [f"Step.model_flops is {per_device:.4g} FLOPs a device a step, {ratio} the {compiled:.4g} the compiled "
            "program's matmuls and convolutions compute: TFLOP/s and MFU are counted from it; give the whole "
            "step's model FLOPs over every device, which recomputation does not count"]


def user_estimate(predicted: hlo_time.HloTime, user: Step, topo: Topology, memory: dict[str, Any],
                  calibration: StoredCalibration | None = None) -> dict[str, Any]:
    """estimate.json of a user's step: the step time read from its HLO, and the throughput, TFLOP/s and MFU its
    Step's figures give (null where it gives none)."""
    from maxperf.perfmodel.estimate import device_for, fallback_notes
    from maxperf.user_cache import calibration_for

    if calibration is None and topo.platform == "cpu":
        calibration = calibration_for(topo)
    chip = device_for(topo, calibration)
    step = predicted.step_time_s
    peak_flops = chip.peak_flops("bfloat16")
    per_device = user.model_flops / topo.num_devices if user.model_flops else None
    notes = list(fallback_notes(topo, chip, calibration))
    if not user.model_flops:
        notes.append("the step gives no model_flops: no TFLOP/s or MFU")
    if per_device:
        notes.append(f"MFU against the {chip.name} bfloat16 peak ({peak_flops / 1e12:.4g} TFLOP/s per device)")
        notes += model_flops_check(per_device, predicted.flops)
    return {
        "schema": ESTIMATE_SCHEMA, "source": predicted.source, "model": user.name, "chip": chip.name,
        "chips": topo.chips, "step_time_s": step, "unit": user.unit,
        "tokens_per_s": user.tokens_per_step / step if user.tokens_per_step and step else None,
        "tflops_per_chip": per_device * topo.devices_per_chip / step / 1e12 if per_device and step else None,
        "mfu": per_device / (step * peak_flops) if per_device and step else None,
        "model_flops_per_device": per_device, "hardware_flops_per_device": predicted.flops,
        "memory_per_device_bytes": None, "fits": memory.get("fits"), "bottleneck": predicted.bottleneck,
        "peak_flops": peak_flops, "calibration": calibration.record() if calibration is not None else None,
        "notes": notes, "hlo_time": predicted.as_dict(),
    }


def write_manifest(writer, request: UserRequest, user: Step, mesh, argv, compile_seconds: float,
                   lower_seconds: float, start: float, *, compiled: bool, cache_hit: bool) -> None:
    topo = request.topology
    manifest = {
        "schema": artifacts.MANIFEST_SCHEMA,
        "created_unix": time.time(),
        "command": list(argv) if argv is not None else sys.argv,
        "compiled": compiled,
        "step": user_step.describe(request, user),
        "model": {"name": user.name},
        "train": {},
        "parallelism": request.parallelism,
        "mesh": {"axes": request.mesh.axes, "ici": request.mesh.ici, "dcn": request.mesh.dcn},
        "warnings": [],
        "topology": topo.as_dict(),
        "devices": compiler.device_summary(mesh),
        "gpu_autotuned": (targets.compiles_on_attached_gpus(topo) is not None if topo.platform == "gpu" else None),
        "param_count": None,
        "global_batch": None,
        "micro_batch": None,
        "tokens_per_step": user.tokens_per_step,
        "versions": compiler.library_versions(),
        "compiler_environment": compiler.compiler_environment(),
        "compile_seconds": round(compile_seconds, 3),
        "compile_cache_hit": cache_hit,
        "lower_seconds": round(lower_seconds, 3),
        "wall_seconds": round(time.perf_counter() - start, 3),
        "peak_rss_bytes": compiler.peak_rss_bytes(),
        "limitations": targets.limitations(topo),
        "files": writer.hashes(),
    }
    writer.write_json("manifest.json", manifest)
