"""`maxperf run` of a user's step: the factory called again over this machine's devices, its executable loaded,
its arguments made by `Step.init`, each step's results carried into the next step's arguments (`Step.carry`), and
the measured step set against the step time read from the compiled program (estimate.json)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts
from maxperf.aot.loading import Artifact
from maxperf.aot.user_step import Step, UserStepError, context, first_line, traceback_text
from maxperf.profiler.run import (
    RunResult,
    Watchdog,
    calibration_mismatch,
    check_devices,
    device_memory,
    impossible_mfu,
    percentile,
    profile_steps,
    refuse_inside_artifact,
    timed_steps,
    untuned_gpu_step,
)
from maxperf.spec.errors import MaxperfError


def check_arguments(made: tuple, wanted: tuple, who: str) -> None:
    """A UserStepError naming the first argument whose shape or dtype is not the one the step was compiled for
    (the executable would refuse it with a message that names neither the argument nor where it came from)."""
    import jax

    for i, (x, want) in enumerate(zip(made, wanted)):
        got, expect = jax.tree.leaves(x), jax.tree.leaves(want)
        if len(got) != len(expect):
            raise UserStepError(f"{who} made argument {i} of {len(got)} arrays; the step was compiled for "
                                f"{len(expect)}")
        for a, b in zip(got, expect):
            shape, dtype = tuple(getattr(a, "shape", ())), getattr(a, "dtype", type(a).__name__)
            if shape != tuple(b.shape) or str(dtype) != str(b.dtype):
                raise UserStepError(f"{who} made argument {i} as {dtype}{list(shape)}; the step was compiled for "
                                    f"{b.dtype}{list(b.shape)}")


def _same(a: float | None, b: float | None) -> bool:
    """Whether two optional figures agree (to rounding)."""
    if not a or not b:
        return not a and not b
    return abs(a / b - 1) < 1e-9


def default_carry(step: Step, name: str) -> Callable[[tuple, Any], tuple]:
    """A step `(state, ...) -> (state, ...)`: its first result becomes its next first argument where it has that
    argument's arrays (structure, shapes and dtypes); a step that donates nothing may take the same arguments again;
    any other needs `Step.carry`."""
    import jax

    def alike(new: Any, old: Any) -> bool:
        if jax.tree.structure(new) != jax.tree.structure(old):
            return False
        return all(tuple(getattr(a, "shape", ())) == tuple(getattr(b, "shape", ()))
                   and str(getattr(a, "dtype", "")) == str(getattr(b, "dtype", ""))
                   for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)))

    others = [i for i in step.donate if i != 0]
    if others:  # refused before the first step: a donated argument is gone once the step has run
        raise UserStepError(f"--step {name} donates argument(s) {others}, which the default carry would pass to the "
                            "next step after the step consumed them; give Step.carry(args, outputs) -> the next "
                            "step's arguments, or donate only the first (the state)")

    def carry(args: tuple, outputs: Any) -> tuple:
        if isinstance(outputs, (tuple, list)) and outputs and alike(outputs[0], args[0]):
            return (outputs[0], *args[1:])
        if not step.donate:
            return args
        raise UserStepError(f"--step {name}: its results do not begin with a new value of its first (donated) "
                            "argument, of the same shapes and dtypes; give Step.carry(args, outputs) -> the next "
                            "step's arguments")

    return carry


def run(artifact: Artifact, *, steps: int, warmup: int, profile: bool = False, data=None, checkpoint=None,
        restore=None, out=None, progress: Callable[[str], None] | None = None, peer_timeout: float = 60.0,
        force: bool = False) -> RunResult:
    """Runs a user's compiled step `steps` times after `warmup` steps and measures it (see the module docstring)."""
    say = progress or (lambda _: None)
    import jax

    from maxperf.perfmodel.estimate import device_for, fallback_notes
    from maxperf.user_cache import calibration_for

    name = str(artifact.user.step)
    for option, given in (("--data", data), ("--checkpoint", checkpoint), ("--restore", restore)):
        if given is not None:
            raise MaxperfError(f"{option} is for maxperf's train step; --step {name} makes its own arguments "
                               "(Step.init)")
    devices = check_devices(artifact, jax.devices())
    out_dir = Path(out) if out is not None else artifact.directory / "run"
    refuse_inside_artifact(out_dir, artifact.directory)
    # --out locked from here: a second run to it is refused at once
    writer = artifacts.ArtifactWriter(out_dir, "run", force=force, inputs=[artifact.directory])
    try:
        say(f"calling the step's factory {name} and loading the executable onto {len(devices)} "
            f"{devices[0].platform} device(s)")
        step, compiled, mesh = artifact.user_step(devices)
        if step.init is None:
            raise UserStepError(f"--step {name} gives no Step.init: `maxperf run` needs it to make the step's "
                                "arguments")
        try:
            with context(step, mesh):
                args = tuple(step.init(0))
        except Exception as e:
            raise UserStepError(f"Step.init of --step {name} raised {first_line(e)} (--verbose shows its "
                                "traceback)", traceback_text(e)) from None
        if len(args) != len(step.args):
            raise UserStepError(f"Step.init of --step {name} made {len(args)} arguments; the step takes "
                                f"{len(step.args)}")
        check_arguments(args, step.args, f"Step.init of --step {name}")
        carry = step.carry or default_carry(step, name)
        current: dict[str, Any] = {"args": args, "outputs": None}
    except BaseException:
        writer.abandon()
        raise

    def prepare(i: int) -> tuple:
        if current["outputs"] is not None:
            try:
                current["args"] = tuple(carry(current["args"], current["outputs"]))
            except Exception as e:
                raise UserStepError(f"Step.carry of --step {name} raised {first_line(e)} (--verbose shows its "
                                    "traceback)", traceback_text(e)) from None
            if step.carry is not None:
                check_arguments(current["args"], step.args, f"Step.carry of --step {name}")
            current["outputs"] = None
        return current["args"]

    def execute(given: tuple) -> Callable[[], float] | None:
        try:
            outputs = compiled(*given)
        except TypeError as e:  # jax's check of the arguments against the executable's
            if "Argument types differ" not in str(e):
                raise
            differ = [line.strip() for line in str(e).splitlines()[1:] if line.strip()][:2]
            raise UserStepError(f"the arguments --step {name} makes no longer match the compiled executable (its "
                                "factory or the words given to it changed since the compile)"
                                + (f": {'; '.join(differ)}" if differ else "") + "; compile it again") from None
        except ValueError as e:  # jax's check of the arguments' shardings against the executable's
            if "shardings" not in str(e):
                raise
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            detail = "; ".join(lines[1:3])[:400]
            raise UserStepError(f"--step {name}'s arguments are not placed as the compiled step takes them (Step.init "
                                "or Step.carry made arrays with other shardings than Step.args, or its out_shardings "
                                "differ from them and the results were carried)"
                                + (f": {detail}" if detail else "") + "; place them with jax.device_put(x, "
                                "sharding) as Step.args are") from None
        jax.block_until_ready(outputs)
        current["outputs"] = outputs
        if step.loss is None:
            return None

        def loss() -> float:  # read after the step's time is taken: Step.loss is the user's host code, not the step
            try:
                return float(step.loss(outputs))
            except Exception as e:
                raise UserStepError(f"Step.loss of --step {name} raised {first_line(e)} (--verbose shows its "
                                    "traceback)", traceback_text(e)) from None

        return loss

    watchdog = Watchdog(peer_timeout, devices[0].platform) if jax.process_count() > 1 else None
    times: list[float] = []
    losses: list[float] = []
    interrupted: KeyboardInterrupt | None = None
    try:
        profile_summary = None
        try:
            timed_steps(prepare, execute, warmup, steps, times, losses, watchdog, say)
            if profile:
                profile_summary = profile_steps(lambda i: execute(prepare(i)), warmup + steps, writer, out_dir,
                                                watchdog, say)
        except KeyboardInterrupt as e:
            if not times:
                raise
            interrupted, profile_summary = e, None
        if watchdog:
            watchdog.stop()
        topology = artifact.topology
        calibration = calibration_for(topology)
        chip = device_for(topology, calibration)
        peak = chip.peak_flops("bfloat16")
        median = statistics.median(times)
        estimate = artifact.json("estimate.json") or {}
        predicted = estimate.get("step_time_s")
        record = calibration.record() if calibration is not None else None
        notes = [*fallback_notes(topology, chip, calibration), *calibration_mismatch(estimate, record),
                 *untuned_gpu_step(artifact.manifest)]
        if interrupted is not None:
            notes.insert(0, f"interrupted after {len(times)} of {steps} timed steps: the figures are of those")
        # the compiled step's figures, as the compile recorded them: the factory called again here may give others
        per_device = estimate.get("model_flops_per_device")
        tokens = artifact.manifest.get("tokens_per_step")
        now = step.model_flops / topology.num_devices if step.model_flops else None
        if not _same(now, per_device) or not _same(step.tokens_per_step, tokens):
            notes.append(f"--step {name} now gives model_flops {step.model_flops or 0:.4g} and tokens_per_step "
                         f"{step.tokens_per_step or 0:.4g}, not those of the compile ("
                         f"{(per_device or 0) * topology.num_devices:.4g} and {tokens or 0:.4g}): the figures here "
                         "are the compiled step's; compile again if its work changed")
        result = RunResult(
            out_dir=out_dir, steps=len(times), warmup=warmup, step_times_s=times, step_time_s=median,
            step_time_p10_s=percentile(times, 0.1), step_time_p90_s=percentile(times, 0.9),
            step_time_min_s=min(times),
            tokens_per_s=tokens / median if tokens else None,
            tflops_per_device=per_device / median / 1e12 if per_device else None,
            mfu=per_device / (median * peak) if per_device else None, peak_flops_per_device=peak,
            peak_source=("calibrated by `maxperf calibrate`" if chip.calibrated else chip.note or "published"),
            losses=losses, platform=devices[0].platform, device_kind=devices[0].device_kind, devices=len(devices),
            processes=jax.process_count(), process_index=jax.process_index(), predicted_step_time_s=predicted,
            measured_over_predicted=median / predicted if predicted else None,
            memory={"compiler_per_device_bytes": (artifact.json("memory.json") or {}).get("per_device_total_bytes"),
                    **device_memory(devices)},
            profile=profile_summary, data="Step.init's arguments, carried from step to step",
            artifact=str(artifact.directory.resolve()), notes=notes, calibration=record,
            artifact_sha256=artifact.manifest.get("files", {}).get("compiled.pkl"),
            partial=interrupted is not None, hlo_predicted_step_time_s=predicted,
            measured_over_hlo_predicted=median / predicted if predicted else None, step=name, unit=step.unit,
        )
        result.notes.extend(impossible_mfu(result.mfu, result.peak_source))
        if jax.process_index() == 0:
            writer.write_json("run.json", result.as_dict())
            writer.commit()
        else:
            writer.abandon()
            result = dataclasses.replace(result, out_dir=None)
    except BaseException:
        writer.abandon()
        raise
    finally:
        if watchdog:
            watchdog.stop()
    if interrupted is not None:
        raise interrupted
    return result
