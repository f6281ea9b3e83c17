"""`maxperf estimate`: perfmodel's step time, TFLOP/s per chip, MFU and memory for a request, no compile."""

from __future__ import annotations

from maxperf.cli.common import (
    GIB,
    JSON_HELP,
    add_request_arguments,
    batch_words,
    print_json,
    print_step_settings,
    print_warnings,
    step_settings,
)
from maxperf.spec.request import resolve


def cmd_estimate(args) -> int:
    from maxperf import perfmodel  # both load numpy, which the other commands start without
    from maxperf.user_cache import calibration_for

    p = resolve(args.topology, args.model, args.overrides, num_slices=args.num_slices)
    est = perfmodel.estimate(p, overlap=args.overlap, calibration=calibration_for(p.topology))
    print_warnings(p)
    if args.json:
        print_json(estimate_summary(p, est))
        return 0 if est.fits else 3
    print(f"{p.model.name} on {p.topology.display_name} ({p.topology.chips} {est.chip} chips), mesh "
          + (" x ".join(f"{a}={n}" for a, n in p.mesh.axes.items() if n > 1) or "1 (one device)"))
    print(f"  global batch     {batch_words(p.configs.train, p.configs.train.global_batch(p.mesh.devices))}")
    print_step_settings(p)
    spread = f" +-{est.uncertainty.relative:.0%}" if est.uncertainty else ""
    print(f"  step time        {est.step_time_s:.4f} s{spread}, bound by {est.bottleneck}")
    print(f"  tokens/s         {est.tokens_per_s:,.0f}")
    print(f"  TFLOP/s per chip {est.tflops_per_chip:.1f}  (MFU {est.mfu:.1%})")
    if est.flops.mtp_flops:  # counted in the model FLOPs as MaxText does, its parameters beside the model's
        print(f"  MTP modules      {p.model.mtp_num_layers}: {est.params.mtp / 1e9:.2f}B parameters beside "
              f"{est.params.total / 1e9:.2f}B, {est.flops.mtp_flops / est.flops.model_flops:.1%} of the model FLOPs")
    print(f"  memory/device    {est.memory_per_device_bytes / GIB:.2f} GiB of {est.memory.hbm_bytes / GIB:.2f} GiB "
          f"({'fits' if est.fits else 'DOES NOT FIT'})")
    if est.uncertainty:
        print(f"  uncertainty      +-{est.uncertainty.relative:.0%}: {est.uncertainty.basis}")
    if est.chip_note:
        print(f"  note: {est.chip_note}")
    if est.assumptions:
        print("  assumptions:     " + "\n                   ".join(est.assumptions))
    width = max([len("component"), *(len(row.name) for row in est.breakdown)])
    print(f"  {'component':<{width}} {'kind':<10} {'seconds':>10} {'exposed':>10}")
    for row in est.breakdown:
        print(f"  {row.name:<{width}} {row.kind:<10} {row.seconds:>10.5f} {row.exposed_seconds:>10.5f}")
    return 0 if est.fits else 3


def estimate_summary(p, est) -> dict:
    """`maxperf estimate --json`: perfmodel's estimate with what it was for (topology, mesh, batch)."""
    t = p.configs.train
    return {**est.as_dict(), "topology": p.topology.name, "num_slices": p.topology.num_slices,
            "mesh": {"axes": p.mesh.axes, "ici": p.mesh.ici, "dcn": p.mesh.dcn},
            "warnings": list(p.warnings),
            "per_device_batch_size": t.per_device_batch_size, "grad_accum_steps": t.grad_accum_steps,
            "global_batch": t.global_batch(p.mesh.devices), "seq_len": t.seq_len, **step_settings(p)}


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="analytical step time, TFLOP/s, MFU and memory, no compile")
    add_request_arguments(p, model_default=None)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--overlap", type=float, help="fraction of communication hidden under compute (0..1); "
                   "default: per collective family on TPU and GPU, none on CPU")
    p.set_defaults(func=cmd_estimate)
