"""`maxperf run`: the compiled step on real devices, timed, optionally profiled and checkpointed."""

from __future__ import annotations

import os
import sys

GIB = 1 << 30


def _initialize_distributed(args) -> None:
    """Joins a multi-process run: flags first, else the environment cluster schedulers set (jax detects it)."""
    import jax

    if args.num_processes and args.num_processes > 1:
        if not args.coordinator:
            from maxperf.errors import MaxperfError

            raise MaxperfError("--num-processes > 1 needs --coordinator HOST:PORT (and --process-id)")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=args.timeout,
                                   heartbeat_timeout_seconds=args.timeout)
    elif os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("SLURM_JOB_ID"):
        jax.distributed.initialize()


def _prepare_cpu(path: str) -> None:
    """A CPU artifact runs on this process's CPU devices: make as many as it was compiled for, before jax starts."""
    from pathlib import Path

    from maxperf.aot import artifacts
    from maxperf.aot.topologies import ensure_cpu_devices

    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    if not (directory / "manifest.json").is_file():
        return  # load() explains what is missing
    devices = artifacts.read_manifest(directory).get("devices", {})
    if devices.get("platform") == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        ensure_cpu_devices(devices["count"] // max(devices.get("processes", 1), 1))


def cmd_run(args) -> int:
    from maxperf.cli import _print_json, _progress
    from maxperf.profiler.run import run

    _prepare_cpu(args.artifact)
    _initialize_distributed(args)
    say = _progress()
    result = run(args.artifact, steps=args.steps, warmup=args.warmup, profile=args.profile, data=args.data,
                 checkpoint=args.checkpoint, restore=args.restore, out=args.out, progress=say)
    if args.json:
        _print_json(result.as_dict())
        return 0
    print(f"ran {result.steps} steps on {result.devices} {result.device_kind} device(s) -> {result.out_dir}/run.json")
    print(f"  step time        median {result.step_time_s:.4f} s (p10 {result.step_time_p10_s:.4f}, p90 "
          f"{result.step_time_p90_s:.4f}, min {result.step_time_min_s:.4f})")
    print(f"  tokens/s         {result.tokens_per_s:,.0f}")
    print(f"  TFLOP/s/device   {result.tflops_per_device:.3f} (MFU {result.mfu:.1%} of {result.peak_flops_per_device / 1e12:.2f}"
          f" TFLOP/s, {result.peak_source})")
    if result.predicted_step_time_s:
        print(f"  predicted        {result.predicted_step_time_s:.4f} s; measured/predicted "
              f"{result.measured_over_predicted:.2f}")
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
    return 0


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="run a compiled step on this machine's devices and measure it")
    p.add_argument("artifact", help="DIR/compiled.pkl or DIR from `maxperf compile`")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="capture an xprof trace of a few steps and summarize it")
    p.add_argument("--data", help="a .npy file of token ids: rows of L+1 tokens, or one 1-D stream")
    p.add_argument("--checkpoint", help="save the state here (orbax, asynchronous) after the run")
    p.add_argument("--restore", help="start from the state saved here")
    p.add_argument("--out", help="where run.json (and trace/) go (default: DIR/run)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--coordinator", help="HOST:PORT of process 0, for a multi-process run")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--timeout", type=int, default=60, help="seconds to wait for peers before giving up")
    p.set_defaults(func=cmd_run)


COMMANDS = [_run_parser]
