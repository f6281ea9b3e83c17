"""`maxperf run`: load a compiled step, check the machine matches it, run and time it, and write run.json."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts, distributed
from maxperf.aot.loading import Artifact, load
from maxperf.spec.errors import MaxperfError

RUN_SCHEMA = "maxperf.run/1"
# How a collective reports a peer that died mid-step (gloo on CPU; seen when process 1 of a cpu-4x2 run is killed).
_PEER_LOST = re.compile(r"Gloo \w+ failed|Connection (reset|closed) by peer")


class PeerLost(MaxperfError):
    """A collective failed because another process of the job is gone. Exit code 1."""

    exit_code = 1
PROFILED_STEPS = 3


@dataclass(frozen=True)
class RunResult:
    out_dir: Path | None  # where run.json went; None on the processes of a job other than process 0, which writes it
    steps: int
    warmup: int
    step_times_s: list[float]
    step_time_s: float  # median
    step_time_p10_s: float
    step_time_p90_s: float
    step_time_min_s: float
    tokens_per_s: float | None  # in `unit` per second; None where a user's step gives no tokens_per_step
    tflops_per_device: float | None  # None where a user's step gives no model_flops
    mfu: float | None
    peak_flops_per_device: float
    peak_source: str
    losses: list[float]
    platform: str
    device_kind: str
    devices: int
    processes: int
    process_index: int
    predicted_step_time_s: float | None
    measured_over_predicted: float | None
    memory: dict[str, Any]
    profile: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    restored_from: str | None = None
    data: str = "synthetic uniform tokens"
    artifact: str = ""
    # the sha256 of the compiled.pkl that ran, as its manifest lists it: a report refuses to set the run beside
    # another compile written into the same directory since
    artifact_sha256: str | None = None
    notes: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None  # CPU: the calibration the peak came from (StoredCalibration.record())
    partial: bool = False  # interrupted: `steps` counts the timed steps measured before it
    # the step time read from the compiled program (estimate.json's hlo_time), beside the measurement
    hlo_predicted_step_time_s: float | None = None
    measured_over_hlo_predicted: float | None = None
    step: str = "train"  # maxperf's train step, or a user's MODULE:FACTORY
    unit: str = "tokens"  # what tokens_per_s counts (a user's step names its own: images, ...)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["out_dir"] = None if self.out_dir is None else str(Path(self.out_dir).absolute())
        return {"schema": RUN_SCHEMA, **out}


def check_devices(artifact: Artifact, devices) -> list:
    """The local devices the executable runs on; a mismatch names what was compiled for and what is here."""
    import jax

    want = artifact.manifest.get("devices", {})
    platform, kind = want.get("platform"), want.get("kind")
    count, processes = want.get("count"), want.get("processes", 1)
    have_platform = devices[0].platform if devices else "none"
    found = (f"found {len(devices)} {have_platform} device(s) ({devices[0].device_kind if devices else '-'}) in "
             f"{jax.process_count()} process(es)")
    expected = f"compiled for {count} {platform} device(s) ({kind}) in {processes} process(es)"
    if have_platform != platform or jax.process_count() != processes or len(devices) < count:
        raise MaxperfError(f"this machine does not match the artifact: {expected}; {found}")
    if platform != "cpu" and devices[0].device_kind != kind:
        raise MaxperfError(f"this machine does not match the artifact: {expected}; {found}")
    return list(devices)[:count] if platform == "cpu" else list(devices)


def batches(spec, tokens, first_step: int, seed: int):
    """Batch i of the run: seeded synthetic tokens (`tokens` None), or consecutive rows of a token file's `tokens`
    as _token_rows read them."""
    import numpy as np

    from maxperf.models import train_step

    Bg, L = spec.batch["inputs"].shape
    if tokens is None:
        def synthetic(i: int):
            return train_step.synthetic_batch(spec, seed + 1 + first_step + i)
        return synthetic

    def from_file(i: int):
        import jax

        index = (np.arange(Bg) + (first_step + i) * Bg) % tokens.shape[0]
        rows = np.asarray(tokens[np.sort(index)], np.int32)
        batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "mask": np.ones((Bg, L), bool)}
        return jax.device_put(batch, spec.batch_shardings)

    from_file.rows, from_file.batch_rows = tokens.shape[0], Bg  # what data_note reads
    return from_file


def data_note(data, batch_for, executed: int, first: int = 0) -> list[str]:
    """The line run.json's notes carry where the steps read more rows than a --data file holds: its rows repeat. A
    run restored at step `first` reads from row first x the batch."""
    rows, per_step = getattr(batch_for, "rows", None), getattr(batch_for, "batch_rows", None)
    end = (first + executed) * (per_step or 0)
    if data is None or rows is None or end <= rows:
        return []
    within = f"; each batch of {per_step} rows holds some more than once" if per_step > rows else ""
    start = f" from step {first}" if first else ""
    return [f"--data {data} holds {rows} rows and the {executed} steps run{start} read up to row {end}: its rows "
            f"were read again from the start ({end / rows:.1f} passes){within}"]


def _token_rows(path: Path, L: int, V: int):
    import numpy as np

    try:
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise MaxperfError(f"--data {path}: not a .npy file (numpy.save of an integer array of token ids, "
                                   "[rows, L+1] or a 1-D stream)")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise MaxperfError(f"--data {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise MaxperfError(f"--data {path}: not a .npy array of token ids (numpy.save of an integer array of "
                           f"[rows, L+1] or a 1-D stream); numpy says: {str(e).splitlines()[0][:200]}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise MaxperfError(f"--data {path}: tokens must be integers, got {tokens.dtype}")
    if tokens.ndim == 1:
        n = tokens.shape[0] // (L + 1)
        if n == 0:
            raise MaxperfError(f"--data {path}: a 1-D stream of {tokens.shape[0]} tokens holds no row of L+1 = "
                               f"{L + 1} tokens; give at least {L + 1}")
        tokens = tokens[: n * (L + 1)].reshape(n, L + 1)
    if tokens.ndim == 2 and tokens.shape[0] == 0:
        raise MaxperfError(f"--data {path}: holds no rows (shape {tokens.shape}); give at least one row of L+1 = "
                           f"{L + 1} tokens")
    if tokens.ndim != 2 or tokens.shape[1] < L + 1:
        raise MaxperfError(f"--data {path}: need rows of at least L+1 = {L + 1} tokens (or a 1-D stream), got "
                           f"shape {tokens.shape}")
    tokens = tokens[:, : L + 1]
    if int(tokens.max()) >= V or int(tokens.min()) < 0:
        raise MaxperfError(f"--data {path}: token ids must lie in [0, {V}), found {int(tokens.min())}.."
                           f"{int(tokens.max())}")
    return tokens


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Watchdog:
    """Ends a multi-process run whose steps stop finishing (a peer died or hangs) with one clear line.

    It allows half the peer timeout, or five times the slowest step so far if that is longer, so it speaks before
    jax's coordination service aborts the process (after the whole timeout) with a stack trace."""

    def __init__(self, peer_timeout: float, platform: str = ""):
        import threading

        self.platform = platform
        self.base = peer_timeout / 2
        self.seconds = self.base
        self.last = time.monotonic()
        self.done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, step_seconds: float) -> None:
        self.seconds = max(self.seconds, self.base, 5 * step_seconds)
        self.last = time.monotonic()

    def stop(self) -> None:
        self.done.set()

    def _watch(self) -> None:
        import os
        import sys

        while not self.done.wait(1.0):
            if time.monotonic() - self.last > self.seconds:
                cpu = ("; on CPU devices XLA:CPU's runtime may run a device's independent collectives in another "
                       "order than its peers' and wait for them forever (likeliest where the devices outnumber the "
                       "machine's cores): run again, or compile for fewer devices" if self.platform == "cpu" else "")
                print(f"maxperf: error: no step finished for {self.seconds:.0f} s; a peer process has stopped or "
                      f"hangs, so this one gives up{cpu}", file=sys.stderr, flush=True)
                os._exit(1)


def device_memory(devices) -> dict[str, Any]:
    """In-use and peak bytes per local device where the backend reports them (TPU and GPU do; CPU does not)."""
    import jax

    stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
    if not stats or any(s is None for s in stats):
        return {"measured_in_use_bytes": None, "measured_peak_bytes": None,
                "measured_note": f"missing: the {devices[0].platform} backend reports no device memory statistics"}
    return {"measured_in_use_bytes": max(s.get("bytes_in_use", 0) for s in stats),
            "measured_peak_bytes": max(s.get("peak_bytes_in_use", 0) for s in stats),
            "measured_note": "largest over the local devices"}


def refuse_inside_artifact(out_dir: Path, directory: Path) -> None:
    """A run writes beside its compile artifact or in its `run` directory (the default), nowhere else inside it: a
    compile's directory holds only what maxperf writes there, and a later compile to it would be refused."""
    resolved, home = out_dir.resolve(), directory.resolve()
    if home in resolved.parents and resolved != home / "run" or resolved == home:
        raise MaxperfError(f"--out {out_dir} lies inside the compile artifact {directory}, which holds only what "
                           f"maxperf writes there; give a directory beside it (e.g. --out {directory.name}-run), or "
                           f"leave --out out for {directory / 'run'}")


def run(path: str | Path, *, steps: int = 10, warmup: int = 2, profile: bool = False, data: str | Path | None = None,
        checkpoint: str | Path | None = None, restore: str | Path | None = None, out: str | Path | None = None,
        progress: Callable[[str], None] | None = None, peer_timeout: float = 60.0, force: bool = False) -> RunResult:
    """Runs the compiled step `steps` times after `warmup` steps and measures it. `out` (default DIR/run) must be
    new, empty or an earlier run's output, unless `force`; it and `checkpoint` are checked before the first step."""
    if steps < 1 or warmup < 0:
        raise MaxperfError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps}, warmup={warmup}")
    say = progress or (lambda _: None)
    import jax

    from maxperf import perfmodel
    from maxperf.models import train_step
    from maxperf.perfmodel.estimate import device_for, fallback_notes
    from maxperf.profiler import checkpoints
    from maxperf.user_cache import calibration_for

    artifact = load(path)
    if artifact.user is not None:
        from maxperf.profiler import user_run

        return user_run.run(artifact, steps=steps, warmup=warmup, profile=profile, data=data, checkpoint=checkpoint,
                            restore=restore, out=out, progress=progress, peer_timeout=peer_timeout, force=force)
    devices = check_devices(artifact, jax.devices())
    if artifact.manifest.get("step") in ("prefill", "decode"):
        return _serving(artifact, devices, steps=steps, warmup=warmup, profile=profile, data=data,
                        checkpoint=checkpoint, restore=restore, out=out, force=force, say=say)
    out_dir = Path(out) if out is not None else artifact.directory / "run"
    refuse_inside_artifact(out_dir, artifact.directory)
    if checkpoint is not None:
        checkpoints.check_destination(Path(checkpoint))  # a save that cannot happen fails before the first step
        if Path(checkpoint).resolve() in out_dir.resolve().parents:
            raise MaxperfError(f"--out {out_dir} lies inside --checkpoint {checkpoint}, which the save needs for "
                               "itself; give two directories apart")
        ckpt, home = Path(checkpoint).resolve(), artifact.directory.resolve()
        if ckpt.is_relative_to(home):  # a later compile would refuse it, --force remove it
            raise MaxperfError(f"--checkpoint {checkpoint} lies inside the compile artifact {artifact.directory}, "
                               "which holds only what maxperf compile writes there; give a directory beside it")
        if restore is not None and ckpt.is_relative_to(Path(restore).resolve()):
            raise MaxperfError(f"--checkpoint {checkpoint} lies inside --restore {restore}, the checkpoint this run "
                               "reads; give a directory beside it")
    # what the run reads is there before the executable loads (the restore's contents are checked against the state
    # once it has the state's shapes)
    if restore is not None and not checkpoints.is_checkpoint(Path(restore)):
        raise MaxperfError(f"--restore {restore} is not a checkpoint directory (a `maxperf run --checkpoint` output)")
    if data is not None and not Path(data).is_file():
        raise MaxperfError(f"--data {data} is not a file; give a .npy file of token ids")
    p = artifact.plan
    tokens = None if data is None else _token_rows(Path(data), p.configs.train.seq_len, p.configs.model.vocab_size)
    used = [path for path in (artifact.directory, data, restore, checkpoint) if path is not None]
    # a bad --out fails before any work, and --out is locked from here: a second run to it is refused at once
    writer = artifacts.ArtifactWriter(out_dir, "run", force=force, inputs=used)
    try:
        say(f"loading the executable onto {len(devices)} {devices[0].platform} device(s)")
        spec, step = artifact.step(devices)
        if restore is not None:
            say(f"restoring the state from {restore}")
            if train_step.reorders_layers(spec) and not checkpoints.layers_in_model_order(Path(restore)):
                raise MaxperfError(f"--restore {restore} was saved before maxperf kept a pipelined decoder's layers "
                                   "in the model's order: its layers may be in a pipeline's stored order, which this "
                                   "step would take for the model's; restore it with the maxperf that saved it")
            state = train_step.stored_layers(spec, checkpoints.restore(Path(restore), spec))
        else:
            state = train_step.init_state(spec, seed=p.configs.train.seed)
        first = int(jax.device_get(state["step"]))
        batch_for = batches(spec, tokens, first, p.configs.train.seed)
    except BaseException:
        writer.abandon()
        raise
    watchdog = Watchdog(peer_timeout, devices[0].platform) if jax.process_count() > 1 else None
    losses: list[float] = []
    times: list[float] = []
    interrupted: KeyboardInterrupt | None = None  # Ctrl-C, or SIGTERM as the command raises it
    try:
        profile_summary = None
        try:
            def execute(batch):
                nonlocal state
                state, metrics = step(state, batch)
                jax.block_until_ready((state, metrics))
                return float(metrics["loss"])

            timed_steps(batch_for, execute, warmup, steps, times, losses, watchdog, say)
            if profile:
                def traced(i):
                    nonlocal state
                    state, metrics = step(state, batch_for(i))
                    jax.block_until_ready((state, metrics))

                profile_summary = profile_steps(traced, warmup + steps, writer, out_dir, watchdog, say)
        except KeyboardInterrupt as e:
            if not times:
                raise
            interrupted, profile_summary = e, None  # after timed steps: what was measured is kept
            shutil.rmtree(writer.tmp / "trace", ignore_errors=True)
        if watchdog:
            watchdog.stop()  # orbax bounds its own waits for peers
        # a checkpoint keeps a pipelined stack in the model's layer order: it restores into any layout of the model
        saved = (checkpoints.save(Path(checkpoint), train_step.model_order_layers(spec, state))
                 if checkpoint is not None and interrupted is None else None)
        calibration = calibration_for(p.topology)
        chip = device_for(p.topology, calibration)
        peak = chip.peak_flops(p.configs.train.compute_dtype)
        flops = perfmodel.count_flops(p.configs.model, p.configs.train).model_flops
        median = statistics.median(times)
        estimate = artifact.json("estimate.json")
        record = calibration.record() if calibration is not None else None
        executed = warmup + len(times) + (PROFILED_STEPS if profile_summary is not None else 0)
        notes = [*fallback_notes(p.topology, chip, calibration), *calibration_mismatch(estimate, record),
                 *untuned_gpu_step(artifact.manifest), *data_note(data, batch_for, executed, first)]
        if interrupted is not None:
            notes.insert(0, f"interrupted after {len(times)} of {steps} timed steps: the figures are of those"
                         + (f"; no checkpoint was written to {checkpoint} (the state of an interrupted run is not "
                            "saved: run again to save one)" if checkpoint is not None else ""))
        predicted = estimate.get("step_time_s") if estimate else None
        hlo = (estimate or {}).get("hlo_time") or {}
        memory = {"compiler_per_device_bytes": (artifact.json("memory.json") or {}).get("per_device_total_bytes"),
                  **device_memory(devices)}
        result = RunResult(
            out_dir=out_dir, steps=len(times), warmup=warmup, step_times_s=times, step_time_s=median,
            step_time_p10_s=percentile(times, 0.1), step_time_p90_s=percentile(times, 0.9),
            step_time_min_s=min(times), tokens_per_s=spec.global_batch * p.configs.train.seq_len / median,
            tflops_per_device=flops / median / 1e12, mfu=flops / (median * peak), peak_flops_per_device=peak,
            peak_source=("calibrated by `maxperf calibrate`" if chip.calibrated else chip.note or "published"),
            losses=losses, platform=devices[0].platform, device_kind=devices[0].device_kind, devices=len(devices),
            processes=jax.process_count(), process_index=jax.process_index(), predicted_step_time_s=predicted,
            measured_over_predicted=median / predicted if predicted else None, memory=memory,
            profile=profile_summary, checkpoint=saved, restored_from=str(Path(restore).absolute()) if restore else None,
            data=str(data) if data else "synthetic uniform tokens", artifact=str(artifact.directory.resolve()),
            artifact_sha256=artifact.manifest.get("files", {}).get("compiled.pkl"),
            notes=notes, calibration=record, partial=interrupted is not None,
            hlo_predicted_step_time_s=hlo.get("step_time_s"),
            measured_over_hlo_predicted=median / hlo["step_time_s"] if hlo.get("step_time_s") else None,
        )
        result.notes.extend(impossible_mfu(result.mfu, result.peak_source))
        if jax.process_index() == 0:
            writer.write_json("run.json", result.as_dict())
            writer.commit()
        else:
            writer.abandon()
            result = dataclasses.replace(result, out_dir=None)
    except BaseException as e:
        writer.abandon()
        if jax.process_count() > 1 and _PEER_LOST.search(str(e)):
            raise PeerLost(distributed.lost_job(jax.process_index(), jax.process_count(),
                                                f" ({str(e).splitlines()[0][:200]})")) from None
        raise
    finally:
        if watchdog:
            watchdog.stop()
    if interrupted is not None:
        if result.out_dir is not None:
            say(f"interrupted after {len(times)} of {steps} timed steps: {out_dir}/run.json keeps them, marked "
                "partial" + (f"; no checkpoint was written to {checkpoint}" if checkpoint is not None else ""))
        raise interrupted
    return result


def _serving(artifact: Artifact, devices, *, steps: int, warmup: int, profile: bool, data, checkpoint, restore,
             out, force: bool, say) -> dict:
    """A serving artifact's run (profiler/serving_run.py): its run.json as a dict."""
    from maxperf.profiler import serving_run

    given = [name for name, value in (("--profile", profile), ("--data", data), ("--checkpoint", checkpoint),
                                      ("--restore", restore)) if value]
    if given:
        raise MaxperfError(f"{', '.join(given)}: a serving step runs synthetic tokens and keeps no state; drop "
                           f"{' and '.join(given)}")
    out_dir = Path(out) if out is not None else artifact.directory / "run"
    refuse_inside_artifact(out_dir, artifact.directory)
    artifacts.claim_output(out_dir, "run", force=force, inputs=[artifact.directory])
    say(f"loading the {artifact.manifest['step']} step onto {len(devices)} {devices[0].platform} device(s)")
    result = serving_run.run(artifact, devices, steps=steps, warmup=warmup, out_dir=out_dir, force=force,
                             used=[artifact.directory], say=say)
    return {**result, "out_dir": str(out_dir)}


def timed_steps(prepare: Callable[[int], Any], execute: Callable[[Any], float | Callable[[], float] | None],
                warmup: int, steps: int, times: list[float], losses: list[float], watchdog: Watchdog | None,
                say: Callable[[str], None]) -> None:
    """Runs `warmup` then `steps` steps, appending each timed step's seconds and loss to `times` and `losses` as it
    finishes (so an interrupted run keeps them): `prepare(i)` makes step i's input, untimed and ready on the
    devices; `execute(input)` runs the step to completion and returns its loss, or a function that reads it, called
    after the step is timed (None: none recorded)."""
    import jax

    for i in range(warmup + steps):
        given = prepare(i)
        jax.block_until_ready(given)
        t = time.perf_counter()
        loss = execute(given)
        elapsed = time.perf_counter() - t
        if callable(loss):  # a loss read only once the step's time is taken
            loss = loss()
        if watchdog:
            watchdog.beat(elapsed)
        if i >= warmup:
            times.append(elapsed)
            if loss is not None:
                losses.append(loss)
        say(f"{'warm-up' if i < warmup else 'step'} {i + 1 - (0 if i < warmup else warmup)}: {elapsed:.4f} s"
            + (f", loss {loss:.4f}" if loss is not None else ""))


def profile_steps(run_step: Callable[[int], None], first: int, writer: artifacts.ArtifactWriter, out_dir: Path,
                  watchdog: Watchdog | None, say: Callable[[str], None]) -> dict[str, Any]:
    """Traces PROFILED_STEPS more steps into the run's trace/ and summarizes them; the summary names the files where
    they will be once the run's output is in place, not in its temporary directory."""
    import jax

    from maxperf.profiler.trace_summary import summarize
    from maxperf.profiler.viewer import open_command

    say(f"profiling {PROFILED_STEPS} steps")
    with jax.profiler.trace(str(writer.tmp / "trace")):
        for i in range(PROFILED_STEPS):
            run_step(first + i)
            if watchdog:
                watchdog.beat(0.0)
    summary = summarize(writer.tmp / "trace").as_dict()
    summary["files"] = [str(out_dir / Path(f).relative_to(writer.tmp)) for f in summary["files"]]
    summary["missing"] = [m.replace(str(writer.tmp), str(out_dir)) for m in summary["missing"]]
    summary["open_command"] = open_command(out_dir / "trace")  # xprof on 127.0.0.1
    return summary


# Measured on an H100 (jax 0.11.2, bench/gpu_measured.py and `maxperf compile --target-config`, 2026-11-23): the same
# step compiled without the GPU against compiled on it: qwen3-0.6b B 16 L 2048 7.85 s against 0.578 s per step,
# scaled-1 B 8 6.97 s against 0.296 s.
UNTUNED_GPU_SLOWDOWN = "13-24x"


def impossible_mfu(mfu: float | None, peak_source: str) -> list[str]:
    """A note where the measured MFU is above 100%: no device computes faster than its peak, so the peak taken is too
    low (a CPU's uncalibrated default) or the model FLOPs counted are more than the step computes."""
    if mfu is None or mfu <= 1:
        return []
    return [f"MFU {mfu:.1%} is above 100%, which no device reaches: the peak taken ({peak_source}) is below the rate "
            "this device ran at, or the model FLOPs counted are more than the step computes"
            + ("" if "calibrate" in peak_source else "; on a CPU, `maxperf calibrate` measures the peak")]


def untuned_gpu_step(manifest: dict[str, Any]) -> list[str]:
    """A note, said on stderr too, when a GPU step compiled without a GPU runs: its kernels are XLA's untuned
    defaults, far slower than the step a compile on the GPU makes, so its timings are not production's."""
    from maxperf.spec.notes import note

    if manifest.get("gpu_autotuned") is not False:
        return []
    line = (f"this step was compiled without a GPU, so with XLA's untuned kernel configurations: on an H100 such "
            f"steps ran {UNTUNED_GPU_SLOWDOWN} slower than the same step compiled on the GPU; for production timings "
            f"run `maxperf compile` for this topology on a machine with its GPUs attached")
    note(line)
    return [line]


def calibration_mismatch(estimate: dict[str, Any] | None, record: dict[str, Any] | None) -> list[str]:
    """A note when the prediction in estimate.json used another calibration than this run's peak (the machine was
    calibrated again between the compile and the run); said on stderr too."""
    if not estimate or "calibration" not in estimate:
        return []
    before = (estimate["calibration"] or {}).get("sha256")
    now = (record or {}).get("sha256")
    if before == now:
        return []
    from maxperf.spec.notes import note

    def name(r):
        if not r or not r.get("sha256"):
            return "none"
        return f"{r['path']}{' of ' + r['created'] if r.get('created') else ''} (sha256 {r['sha256'][:12]})"

    message = (f"estimate.json predicted with calibration {name(estimate['calibration'])}; this run's peak uses "
               f"{name(record)}")
    note(message)
    return [message]


def read(path: str | Path) -> dict[str, Any]:
    """A run.json, by its file or directory."""
    path = Path(path)
    path = path / "run.json" if path.is_dir() else path
    data = json.loads(path.read_text())
    if data.get("schema") != RUN_SCHEMA:
        raise MaxperfError(f"{path} is not a {RUN_SCHEMA} file")
    return data
