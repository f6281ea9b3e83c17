"""`maxperf run`: the compiled step on real devices, timed, optionally profiled and checkpointed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from maxperf.aot import artifacts, distributed
from maxperf.aot.targets import ensure_cpu_devices
from maxperf.cli import supervisor
from maxperf.cli.common import GIB, print_json, progress
from maxperf.profiler.checkpoints import CheckpointFailed
from maxperf.spec.errors import MaxperfError


def _prepare(args) -> str | None:
    """The artifact's platform, after checking the job's process count against it; a CPU artifact runs on this
    process's CPU devices: make as many as it was compiled for, before jax starts."""
    path = args.artifact
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    if not (directory / "manifest.json").is_file():
        return None  # load() explains what is missing
    devices = artifacts.read_manifest(directory).get("devices", {})
    _check_processes(devices, args)
    if devices.get("platform") == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        patient_cpu_collectives(args.timeout)
        ensure_cpu_devices(devices["count"] // max(devices.get("processes", 1), 1))
    if devices.get("platform") == "gpu" and not any(v in os.environ for v in _GPU_ALLOCATOR_VARIABLES):
        # jax's GPU allocator takes 75% of the GPU's memory unless told otherwise, so a step that `compile` found
        # to fit the device could run out of memory here: give it what the verdict assumed, less the CUDA context
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = GPU_MEMORY_FRACTION
    return devices.get("platform")


# XLA:CPU ends the process when a collective's devices have not all arrived within its termination timeout (40 s by
# default: "Termination timeout for `all reduce RendezvousKey{...}` of 40 seconds exceeded", SIGABRT). The devices of
# a cpu-N step are threads of this process sharing its cores, so on a loaded host one arrives late by the time its
# work takes, not because a peer died: a run waits this many times --timeout (600 s at the default) before XLA gives
# up, and slows down instead of aborting.
CPU_COLLECTIVE_TIMEOUT_FACTOR = 10
_CPU_COLLECTIVE_FLAGS = ("xla_cpu_collective_call_terminate_timeout_seconds", "xla_cpu_collective_timeout_seconds")


def patient_cpu_collectives(timeout: float) -> None:
    """XLA:CPU's collective timeouts set from `--timeout` (CPU_COLLECTIVE_TIMEOUT_FACTOR), before jax starts, where
    XLA_FLAGS does not set them already."""
    flags = os.environ.get("XLA_FLAGS", "")
    seconds = int(CPU_COLLECTIVE_TIMEOUT_FACTOR * timeout)
    extra = [f"--{name}={seconds}" for name in _CPU_COLLECTIVE_FLAGS if f"--{name}=" not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([*flags.split(), *extra])


GPU_MEMORY_FRACTION = "0.95"
_GPU_ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                            "XLA_PYTHON_CLIENT_ALLOCATOR")


def out_of_memory(e: BaseException) -> OutOfMemory | None:
    """A one-line reason for a step that ran out of device memory (XLA's RESOURCE_EXHAUSTED); None for other errors."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    first = next((line for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line), text)[:300]
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    hint = (f"jax's allocator held XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} of each GPU's memory; "
            if fraction else "")
    return OutOfMemory(f"the step ran out of device memory ({first.strip()}); {hint}compile a smaller step "
                       f"(per_device_batch_size, remat_policy) or give the allocator more")


class OutOfMemory(MaxperfError):
    """The compiled step ran out of device memory on this machine. Exit code 1."""

    exit_code = 1


def _check_processes(devices: dict, args) -> None:
    """The job's process count against the artifact's, before any process waits for peers that will not come."""
    want, given = devices.get("processes", 1), args.num_processes
    if given is None and (want == 1 or devices.get("platform") != "cpu"):
        return  # a TPU or GPU job may take its processes from the cluster's environment
    if (given or 1) != want:
        start = ("run it as one process, without --num-processes" if want == 1 else
                 f"start {want} processes, each with --coordinator HOST:PORT --num-processes {want} --process-id I")
        raise MaxperfError(f"{args.artifact} was compiled for {want} process(es), this job has {given or 1}: {start}")


def cmd_run(args) -> int:
    from maxperf.profiler.run import run  # loads numpy, and jax once the environment is set

    say = progress()
    if distributed.initialize(args, _prepare(args)):
        say(f"{supervisor.JOINED} {args.coordinator} as process {args.process_id} of {args.num_processes}")
    try:
        result = run(args.artifact, steps=args.steps, warmup=args.warmup, profile=args.profile, data=args.data,
                     checkpoint=args.checkpoint, restore=args.restore, out=args.out, progress=say,
                     peer_timeout=args.timeout, force=args.force)
    except CheckpointFailed as e:
        # orbax's writer threads wait 20 minutes for signals that a failed save never sends, and would keep the
        # process from exiting: say it and leave now
        print(f"maxperf: error: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code)
    except Exception as e:
        if (oom := out_of_memory(e)) is None:
            raise
        raise oom from None
    if isinstance(result, dict):  # a serving step's run (profiler/serving_run.py)
        return _print_serving(result, args.json)
    if args.json:
        print_json(result.as_dict())
        return 0
    written = (f"-> {result.out_dir}/run.json" if result.out_dir is not None else
               f"(process {result.process_index} of {result.processes}; process 0 writes run.json)")
    print(f"ran {result.steps} steps on {result.devices} {result.device_kind} device(s) {written}")
    print(f"  step time        median {result.step_time_s:.4f} s (p10 {result.step_time_p10_s:.4f}, p90 "
          f"{result.step_time_p90_s:.4f}, min {result.step_time_min_s:.4f})")
    if result.tokens_per_s is not None:
        print(f"  {result.unit + '/s':<16} {result.tokens_per_s:,.0f}")
    if result.tflops_per_device is not None:
        print(f"  TFLOP/s/device   {result.tflops_per_device:.3g} (MFU {result.mfu:.1%} of "
              f"{result.peak_flops_per_device / 1e12:.3g} TFLOP/s, {result.peak_source})")
    if result.predicted_step_time_s and result.step == "train":
        print(f"  predicted        {result.predicted_step_time_s:.4f} s (analytical); measured/predicted "
              f"{result.measured_over_predicted:.2f}")
    if result.hlo_predicted_step_time_s:
        print(f"  from the HLO     {result.hlo_predicted_step_time_s:.4f} s; measured/predicted "
              f"{result.measured_over_hlo_predicted:.2f}")
    if result.losses:
        print(f"  loss             {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    mem = result.memory
    if mem.get("measured_peak_bytes") is not None:
        print(f"  memory/device    peak {mem['measured_peak_bytes'] / GIB:.2f} GiB; compiler said "
              f"{(mem['compiler_per_device_bytes'] or 0) / GIB:.2f} GiB")
    else:
        print(f"  memory/device    {mem['measured_note']}")
    if result.checkpoint:
        c = result.checkpoint
        print(f"  checkpoint       {c['path']}: {c['bytes'] / GIB:.3f} GiB, blocked {c['blocking_seconds']:.2f} s, "
              f"finished in {c['total_seconds']:.2f} s")
    if result.profile:
        prof = result.profile
        print(f"  profile          {len(prof['top_ops'])} ops summarized; open with: {prof['open_command']}")
        for note in prof["missing"]:
            print(f"  missing          {note}")
    for note in result.notes:  # run.json's: the MFU past the peak, the data read again, the fallbacks
        print(f"  note             {note}")
    return 0


def _print_serving(r: dict, as_json: bool) -> int:
    if as_json:
        print_json(r)
        return 0
    what = "prefill of the batch" if r["step"] == "prefill" else "per output token"
    print(f"ran {r['steps']} {r['step']} steps on {r['devices']} {r['device_kind']} device(s) -> "
          f"{r['out_dir']}/run.json")
    print(f"  step time        median {r['step_time_s'] * 1e3:.4g} ms {what} (min {r['step_time_min_s'] * 1e3:.4g} ms)"
          f", {r['batch']} sequences")
    print(f"  tokens/s         {r['tokens_per_s']:,.0f} ({r['tokens_per_s_per_chip']:,.0f} per device)")
    if r["predicted_step_time_s"]:
        print(f"  predicted        {r['predicted_step_time_s'] * 1e3:.4g} ms ({r['predicted_basis']}); "
              f"measured/predicted {r['measured_over_predicted']:.2f}")
    if r["hlo_predicted_step_time_s"]:
        print(f"  from the HLO     {r['hlo_predicted_step_time_s'] * 1e3:.4g} ms; measured/predicted "
              f"{r['measured_over_hlo_predicted']:.2f}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a compiled step on this machine's devices and measure it")
    p.add_argument("artifact", help="DIR/compiled.pkl or DIR from `maxperf compile`")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10); the median is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps run first (default 2)")
    p.add_argument("--profile", action="store_true", help="capture an xprof trace of a few steps and summarize it")
    p.add_argument("--data", help="a .npy file of token ids: rows of L+1 tokens, or one 1-D stream; each step reads "
                                  "the global batch, per_device_batch_size x devices x grad_accum_steps rows")
    p.add_argument("--checkpoint", help="save the state here (orbax, asynchronous) after the run")
    p.add_argument("--restore", help="start from the state saved here")
    p.add_argument("--out", help="where run.json (and trace/) go (default: DIR/run); an existing one must be an "
                                 "earlier run's output")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier output of this command in --out even if it holds other files")
    p.add_argument("--json", action="store_true", help="print run.json's content on stdout (progress stays on "
                                                       "stderr)")
    distributed.add_arguments(p)
    supervisor.add_arguments(p)
    p.set_defaults(func=cmd_run)
