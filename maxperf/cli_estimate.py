"""The analytical commands: `maxperf estimate`, `maxperf estimate-memory`, `maxperf calibrate`."""

from __future__ import annotations

import sys

GIB = 1 << 30


def cmd_estimate(args) -> int:
    from maxperf import perfmodel
    from maxperf.aot.compile import plan
    from maxperf.cli import _print_json

    p = plan(args.topology, args.model, args.overrides, num_slices=args.num_slices)
    est = perfmodel.estimate(p.configs.model, p.configs.train, p.mesh_shape.axes, p.mesh_shape.dcn, p.topology,
                             overlap=args.overlap if args.overlap is not None else perfmodel.Overlap())
    if args.json:
        _print_json(est.as_dict())
        return 0
    print(f"{p.model.name} on {p.topology.name} ({p.topology.chips} {est.chip} chips), mesh "
          + " x ".join(f"{a}={n}" for a, n in p.mesh_shape.axes.items() if n > 1))
    print(f"  step time        {est.step_time_s:.4f} s, bound by {est.bottleneck}")
    print(f"  tokens/s         {est.tokens_per_s:,.0f}")
    print(f"  TFLOP/s per chip {est.tflops_per_chip:.1f}  (MFU {est.mfu:.1%})")
    print(f"  memory/device    {est.memory_per_device_bytes / GIB:.2f} GiB of {est.memory.hbm_bytes / GIB:.2f} GiB "
          f"({'fits' if est.fits else 'DOES NOT FIT'})")
    if est.chip_note:
        print(f"  note: {est.chip_note}")
    print(f"  {'component':<34} {'kind':<10} {'seconds':>10} {'exposed':>10}")
    for row in est.breakdown:
        print(f"  {row.name:<34} {row.kind:<10} {row.seconds:>10.5f} {row.exposed_seconds:>10.5f}")
    return 0 if est.fits else 3


def cmd_calibrate(args) -> int:
    from maxperf.profiler.calibrate import calibrate

    cal = calibrate()
    from maxperf.cli import _print_json

    _print_json(cal)
    return 0


def _estimate_parser(sub) -> None:
    from maxperf.cli import _add_plan_arguments

    p = sub.add_parser("estimate", help="analytical step time, TFLOP/s, MFU and memory, no compile")
    _add_plan_arguments(p, model_default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--overlap", type=float, help="fraction of communication hidden under compute (0..1)")
    p.set_defaults(func=cmd_estimate)


def _calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's devices for CPU predictions")
    p.set_defaults(func=cmd_calibrate)


COMMANDS = [_estimate_parser, _calibrate_parser]
