"""What `compile` and `estimate-memory` print for a user's step (`--step MODULE:FACTORY`)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from maxperf.cli.common import GIB, print_hlo_line, print_json, print_top
from maxperf.spec.errors import DoesNotFit, MaxperfError
from maxperf.spec.steps import StepName

COMPILE_SCHEMA = "maxperf.compile/1"
MEMORY_SCHEMA = "maxperf.estimate-memory/1"


def compiled(args, step: StepName, say) -> int:
    """`maxperf compile --step MODULE:FACTORY`."""
    from maxperf.aot import user_compile

    result = user_compile.compile_step(args.topology, step, args.overrides, num_slices=args.num_slices,
                                       out=args.out, target_config=args.target_config, progress=say, argv=sys.argv,
                                       force=args.force)
    if args.json:
        print_json(summary(result))
        return 0 if result.fits else 3
    r = result.request
    print(f"compiled {result.step.name} for {r.topology.name}"
          + (f" x {r.topology.num_slices} slices" if r.topology.num_slices > 1 else "") + f" -> {result.out_dir}")
    words = " ".join(f"{k}={v}" for k, v in r.args.items())
    print(f"  mesh             {r.mesh.shown()}" + (f"; factory arguments {words}" if words else ""))
    _memory_line(result.memory)
    print(f"  FLOPs/device     {result.cost['flops_per_device'] / 1e12:.4g} TFLOP per step (counted in the "
          "optimized HLO, loops by their trip counts)")
    e = result.estimate
    print_hlo_line(e["hlo_time"])
    throughput = []
    if e.get("tokens_per_s"):
        throughput.append(f"{e['tokens_per_s']:,.0f} {e['unit']}/s")
    if e.get("tflops_per_chip"):
        throughput.append(f"{e['tflops_per_chip']:.4g} TFLOP/s per chip, MFU {e['mfu']:.1%}")
    if throughput:
        print(f"  predicted        {'; '.join(throughput)}")
    print_top(e["hlo_time"])
    compiled_in = ("from the compile cache, no compile" if result.cache_hit else f"{result.compile_seconds:.1f} s")
    print(f"  compile time     {compiled_in} (lowering {result.lower_seconds:.1f} s, whole "
          f"{result.total_seconds:.1f} s); host peak RSS {result.peak_rss_bytes / GIB:.2f} GiB")
    for note in [*e.get("notes", []), *e["hlo_time"].get("not_modelled", []), *result.limitations]:
        print(f"  note: {note}")
    return 0 if result.fits else 3


def _memory_line(mem: dict) -> None:
    print(f"  memory/device    {mem['per_device_total_bytes'] / GIB:.2f} GiB of {mem['hbm_bytes'] / GIB:.2f} GiB "
          f"({'fits' if mem['fits'] else 'DOES NOT FIT'}, headroom {mem['headroom_bytes'] / GIB:.2f} GiB)")


def summary(result) -> dict:
    """`maxperf compile --step ... --json`."""
    r = result.request
    return {"schema": COMPILE_SCHEMA, "out_dir": str(result.out_dir), "step": str(r.step),
            "model": result.step.name, "topology": r.topology.name, "num_slices": r.topology.num_slices,
            "mesh": {"axes": r.mesh.axes, "ici": r.mesh.ici, "dcn": r.mesh.dcn}, "args": r.args,
            "fits": result.fits, "memory": result.memory, "cost": result.cost, "estimate": result.estimate,
            "cache_hit": result.cache_hit, "compile_seconds": result.compile_seconds,
            "lower_seconds": result.lower_seconds, "total_seconds": result.total_seconds,
            "peak_rss_bytes": result.peak_rss_bytes, "limitations": result.limitations}


def memory(args, step: StepName, say) -> int:
    """`maxperf estimate-memory --step MODULE:FACTORY`: the compiler's memory per device and the verdict (there is
    no analytical model of a user's step)."""
    from maxperf.aot import user_compile
    from maxperf.aot import user_step as user_step_module

    if args.analytical_only or args.max_batch:
        raise MaxperfError(f"--step {step}: {'--analytical-only' if args.analytical_only else '--max-batch'} needs "
                           "maxperf's analytical model of the step, which a user's step does not have; its memory "
                           "comes from the compiler")
    scratch = None if args.out else Path(tempfile.mkdtemp(prefix="maxperf-memory-"))
    out = Path(args.out) if args.out else scratch / "artifact"
    try:
        try:
            result = user_compile.compile_step(args.topology, step, args.overrides, num_slices=args.num_slices,
                                               out=out, progress=say, argv=sys.argv, force=args.force)
            mem, fits = result.memory, result.fits
        except DoesNotFit:
            mem, fits = _read_json(out / "memory.json"), False
            if mem is None:
                raise
        except user_step_module.Unserializable as e:  # the memory is known; only the executable cannot be kept
            mem = _read_json(out / "memory.json")
            if mem is None:
                raise
            fits = bool(mem.get("fits"))
            say(f"note: {str(e).split(': a part of')[0]}: no executable kept; the memory is the compiler's")
        if args.json:
            print_json({"schema": MEMORY_SCHEMA, "step": str(step), "topology": args.topology, "fits": fits,
                        "source": "compiler", "analytical": None, "compiler": mem,
                        "out_dir": str(out) if args.out else None})
            return 0 if fits else 3
        print(f"{step} on {args.topology}: compiler (XLA memory_analysis), per device")
        for name in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes"):
            if mem.get(name) is not None:
                shown = -mem[name] if name == "alias_bytes" else mem[name]
                print(f"  {name.removesuffix('_bytes') + (' (subtracted)' if name == 'alias_bytes' else ''):<22} "
                      f"{shown / GIB:>9.2f} GiB")
        total = mem.get("per_device_total_bytes")
        print(f"  {'per-device total':<22} {total / GIB if total else float('nan'):>9.2f} GiB")
        if mem.get("compiler_message"):
            print(f"  compiler: {mem['compiler_message']}")
        headroom = f", headroom {mem['headroom_bytes'] / GIB:.2f} GiB" if mem.get("headroom_bytes") is not None else ""
        print(f"  verdict (compiler): {'fits' if fits else 'DOES NOT FIT'} in {mem['hbm_bytes'] / GIB:.2f} GiB per "
              f"device{headroom}")
        if args.out:
            print(f"  artifact kept in {out}")
        return 0 if fits else 3
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _read_json(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
