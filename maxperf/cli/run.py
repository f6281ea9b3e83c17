"""`maxperf run`: the compiled step on real devices, timed, optionally profiled and checkpointed."""

from __future__ import annotations

import os
import sys

GIB = 1 << 30


def _prepare_cpu(path: str) -> str | None:
    """A CPU artifact runs on this process's CPU devices: make as many as it was compiled for, before jax starts."""
    from pathlib import Path

    from maxperf.aot import artifacts
    from maxperf.aot.topologies import ensure_cpu_devices

    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    if not (directory / "manifest.json").is_file():
        return None  # load() explains what is missing
    devices = artifacts.read_manifest(directory).get("devices", {})
    if devices.get("platform") == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        ensure_cpu_devices(devices["count"] // max(devices.get("processes", 1), 1))
    return devices.get("platform")


def cmd_run(args) -> int:
    from maxperf.cli import _print_json, _progress
    from maxperf.profiler.run import run

    from maxperf.aot import distributed

    distributed.initialize(args, _prepare_cpu(args.artifact))
    say = _progress()
    result = run(args.artifact, steps=args.steps, warmup=args.warmup, profile=args.profile, data=args.data,
                 checkpoint=args.checkpoint, restore=args.restore, out=args.out, progress=say,
                 peer_timeout=args.timeout, force=args.force)
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
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10); the median is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps run first (default 2)")
    p.add_argument("--profile", action="store_true", help="capture an xprof trace of a few steps and summarize it")
    p.add_argument("--data", help="a .npy file of token ids: rows of L+1 tokens, or one 1-D stream")
    p.add_argument("--checkpoint", help="save the state here (orbax, asynchronous) after the run")
    p.add_argument("--restore", help="start from the state saved here")
    p.add_argument("--out", help="where run.json (and trace/) go (default: DIR/run); an existing one must be an "
                                 "earlier run's output")
    p.add_argument("--force", action="store_true", help="replace whatever --out holds")
    p.add_argument("--json", action="store_true", help="print run.json's content on stdout (progress stays on "
                                                       "stderr)")
    from maxperf.aot import distributed

    distributed.add_arguments(p)
    p.set_defaults(func=cmd_run)


COMMANDS = [_run_parser]
