"""`maxperf estimate-memory`: perfmodel's memory per device beside the compiler's, the fit, the largest batch."""

from __future__ import annotations

import json
import math
import time

from maxperf.cli.common import (
    GIB,
    JSON_HELP,
    add_cluster_arguments,
    add_request_arguments,
    add_step_argument,
    compile_only_environment,
    host_total,
    join_cluster,
    print_json,
    print_warnings,
    progress,
)
from maxperf.reports import memory as memory_parts
from maxperf.spec import presets
from maxperf.spec.errors import MaxperfError
from maxperf.spec.request import resolve
from maxperf.spec.steps import parse_step


def cmd_estimate_memory(args) -> int:
    compile_only_environment(args.topology)
    step = parse_step(args.step)
    if step.is_user:
        if args.model is not None:
            raise MaxperfError(f"--model names one of maxperf's models; --step {step} builds its own step: drop "
                               "--model")
        if args.cluster is not None:  # a user's step is built from their module, on this machine
            raise MaxperfError(f"--step {step} compiles here, in one process: drop --cluster")
        from maxperf.cli import user_step

        return user_step.memory(args, step, progress())
    if args.model is None:
        raise MaxperfError("give --model (a preset, see `maxperf models`), or --step MODULE:FACTORY for your own "
                           "step")
    if args.analytical_only and (args.out or args.keep_executables):
        raise MaxperfError(f"{'--out' if args.out else '--keep-executables'} keeps what a compile writes, and "
                           "--analytical-only compiles nothing: drop one of them")
    if step.builtin != "train":
        return _serving(args, step.builtin)
    from maxperf.search import memory_fit  # loads numpy, and the compiler when it compiles

    request = resolve(args.topology, args.model, args.overrides, num_slices=args.num_slices)
    if args.analytical_only:  # a compile says them itself, as it starts
        print_warnings(request)
    say = progress()
    with join_cluster(args, [(request.topology.name, request)], say, compiles=not args.analytical_only) as cluster:
        return _estimate(args, memory_fit, say, cluster)


def _estimate(args, memory_fit, say, cluster) -> int:
    """The comparison, or with --max-batch the search; compiled here, or with `cluster` on its nodes."""
    if args.max_batch:
        found = memory_fit.max_batch(args.topology, args.model, args.overrides, num_slices=args.num_slices,
                                     analytical_only=args.analytical_only, out=args.out, progress=say,
                                     force=args.force, cluster=cluster, keep_executables=args.keep_executables)
        # nothing fits: the figures at the smallest batch the request takes (1, or what its microbatches need) say by
        # how much (the compile cache answers a compile already made)
        smallest = None if found.fits else memory_fit.compare(
            args.topology, args.model, [*args.overrides, f"per_device_batch_size={found.smallest}"],
            num_slices=args.num_slices, analytical_only=args.analytical_only, cluster=cluster)
        # below one sequence per device (MaxText's fractional per_device_batch_size): the largest fraction that
        # fits by perfmodel, said beside the verdict
        fraction = None if found.fits else memory_fit.fractional_batch(
            resolve(args.topology, args.model, args.overrides, num_slices=args.num_slices), args.overrides,
            args.num_slices)
        if args.json:
            print_json({**found.as_dict(), **({"at_batch_1": smallest.as_dict()} if smallest else {}),
                        **({"fractional": {"per_device_batch_size": fraction[0], "analytical_fits": True,
                                           "per_device_total_bytes": fraction[1].per_device_total_bytes}}
                           if fraction else {})})
        else:
            _print_max_batch(found, args.analytical_only, smallest)
            if fraction:
                b, breakdown = fraction
                print(f"  below one sequence per device: per_device_batch_size={b:g} fits by perfmodel "
                      f"({breakdown.per_device_total_bytes / GIB:.2f} GiB per device); `maxperf estimate-memory "
                      f"per_device_batch_size={b:g}` compiles it")
        return 0 if found.fits else 3
    cmp = memory_fit.compare(args.topology, args.model, args.overrides, num_slices=args.num_slices,
                             analytical_only=args.analytical_only, out=args.out, progress=say, force=args.force,
                             cluster=cluster, keep_executables=args.keep_executables)
    if args.json:
        print_json(cmp.as_dict())
    else:
        _print_comparison(cmp)
    return 0 if cmp.fits else 3


def _serving(args, kind: str) -> int:
    """A serving step's memory (perfmodel.serving) beside the compiler's (compiled into a scratch directory unless
    --analytical-only); --max-batch: the largest batch and cache by the analytical model."""
    import tempfile
    from pathlib import Path

    from maxperf.models.serving import check
    from maxperf.perfmodel import serving
    from maxperf.perfmodel.estimate import device_for
    from maxperf.perfmodel.serving import context_words

    if args.cluster is not None:
        raise MaxperfError(f"--step {kind} compiles here, in one process: drop --cluster")
    request = resolve(args.topology, args.model, args.overrides, num_slices=args.num_slices)
    check(request.model, request.train, request.mesh.devices, dict(request.mesh.sizes), kind)
    chip = device_for(request.topology)
    e = serving.estimate(request.model, request.train, request.mesh, chip, request.topology, kind=kind)
    m = e.memory
    compiler = None
    if not args.analytical_only:
        from maxperf import aot
        from maxperf.spec.errors import DoesNotFit

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(args.out) if args.out else Path(tmp) / "step"
            try:
                compiler = aot.compile(args.topology, args.model, args.overrides, num_slices=args.num_slices,
                                       out=out, step=kind, force=args.force or not args.out,
                                       progress=progress()).memory
            except DoesNotFit:
                compiler = json.loads((out / "memory.json").read_text())
    fits = compiler["fits"] if compiler is not None else m.fits
    largest = None
    if args.max_batch and not args.analytical_only:
        largest = _serving_max_batch(args, kind, request, e.max_batch_per_device, m)
    result = {"schema": "maxperf.serving-memory/1", "step": kind, "model": request.model.name,
              "topology": request.topology.name, "analytical": {**{k: getattr(m, k) for k in (
                  "weights_bytes", "cache_bytes", "temp_bytes", "hbm_bytes")}, "total_bytes": m.total_bytes,
                  "fits": m.fits}, "compiler": compiler, "fits": bool(fits),
              "max_batch_per_device": e.max_batch_per_device, "max_context": e.max_context,
              **({"max_batch": largest} if largest is not None else {})}
    if args.json:
        print_json(result)
        return 0 if fits else 3
    devices = request.mesh.devices
    if largest is not None:  # the answer first: the compiler's largest batch
        found = largest["per_device_batch_size"]
        print(f"largest per_device_batch_size that fits: {found:g} ({kind}, by {len(largest['trials'])} compiles: "
              f"{found * devices:g} sequences over {devices} devices; analytical {e.max_batch_per_device:g})"
              if found else f"no batch fits ({kind}, by {len(largest['trials'])} compiles: not even one sequence "
              f"over {devices} devices)")
    elif args.max_batch:  # --analytical-only: the analytical model's
        print(f"largest per_device_batch_size that fits: {e.max_batch_per_device:g} ({kind}, analytical; "
              f"{e.max_batch_per_device * devices:g} sequences over {devices} devices)")
    print(f"{presets.label(request.model)} {kind} on {request.topology.name}: {e.batch} sequences, prompt "
          f"{e.prompt}, cache {e.cache} positions")
    print(f"  {'':<22} {'analytical':>11} {'compiler':>11}")
    rows = (("weights", m.weights_bytes, None), ("cache", m.cache_bytes, None), ("temporaries", m.temp_bytes,
            compiler and compiler.get("temp_bytes")), ("total", m.total_bytes, compiler and compiler.get(
                "per_device_total_bytes")))
    for name, analytical, compiled in rows:
        shown = f"{compiled / GIB:>10.2f}G" if compiled else f"{'-':>11}"
        print(f"  {name:<22} {analytical / GIB:>10.2f}G {shown}")
    print(f"  verdict ({'compiler' if compiler else 'analytical'}): {'fits' if fits else 'DOES NOT FIT'} in "
          f"{m.hbm_bytes / GIB:.2f} GiB per device; up to {e.max_batch_per_device:.4g} sequences per device, or "
          f"{context_words(e.max_context)} cache positions at {e.batch} sequences (analytical)")
    return 0 if fits else 3


def _serving_max_batch(args, kind: str, request, analytical: float, memory) -> dict:
    """The largest batch of a serving step the compiler fits, in whole sequences over the devices: compiles started
    at the analytical largest and aimed where a line through the compiler's totals crosses the device memory, kept
    strictly inside the bracket (memory_fit's search, in sequences rather than a per-device batch)."""
    import tempfile
    from pathlib import Path

    from maxperf import aot
    from maxperf.search.memory_fit import MAX_BATCH_LIMIT, Trial, _next_batch
    from maxperf.spec.errors import DoesNotFit

    devices = request.mesh.devices
    words = [w for w in args.overrides if w.partition("=")[0] != "per_device_batch_size"]
    say = progress()
    slope = memory.cache_bytes / max(request.train.per_device_batch_size * devices, 1)  # bytes a device a sequence
    limit = MAX_BATCH_LIMIT * devices
    lo, hi = 0, limit + 1  # sequences: lo fits (0: none known), hi does not (limit + 1: none known)
    trials: list[Trial] = []
    n = min(max(1, math.floor(analytical * devices + 1e-9)), limit)
    with tempfile.TemporaryDirectory() as tmp:
        while True:
            batch = n / devices
            say(f"compile {len(trials) + 1}: per_device_batch_size={batch:g} ({n} sequences)")
            out = Path(args.out) / f"batch-{batch:g}" if args.out else Path(tmp) / f"batch-{n}"
            start = time.perf_counter()
            try:
                figures = aot.compile(args.topology, args.model, [*words, f"per_device_batch_size={batch:g}"],
                                      num_slices=args.num_slices, out=out, step=kind,
                                      force=args.force or not args.out, progress=say).memory
            except DoesNotFit:
                figures = json.loads((out / "memory.json").read_text())
            total = figures.get("per_device_total_bytes")
            trials.append(Trial(n, bool(figures["fits"]), float(total) if total else None,
                                time.perf_counter() - start))
            lo, hi = (n, hi) if figures["fits"] else (lo, n)
            if hi - lo <= 1 or lo >= limit:
                break
            n = _next_batch(trials, lo, hi, slope, memory.hbm_bytes)
    return {"per_device_batch_size": lo / devices, "sequences": lo, "analytical_per_device_batch_size": analytical,
            "trials": [{"per_device_batch_size": t.per_device_batch_size / devices,
                        "sequences": t.per_device_batch_size, "fits": t.fits,
                        "per_device_total_bytes": t.per_device_total_bytes,
                        "compile_seconds": round(t.compile_seconds, 3)} for t in trials]}


_ANALYTICAL_ROWS = ("params", "optimizer", "gradients", "grad_accumulator", "activations", "saved_copy", "logits",
                    "temporaries")
_COMPILER_ROWS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes")


def _print_comparison(cmp) -> None:
    p, a, c = cmp.plan, cmp.analytical, cmp.compiler
    t = p.configs.train
    print(f"{presets.label(p.model)} on {p.topology.name}"
          + (f" x {p.topology.num_slices} slices" if p.topology.num_slices > 1 else "")
          + ", mesh " + (" x ".join(f"{k}={n}" for k, n in p.mesh.axes.items() if n > 1) or "1")
          + f"; B={t.per_device_batch_size}" + (f" x A={t.grad_accum_steps} microbatches" if t.grad_accum_steps > 1
                                                  else "") + f", L={t.seq_len}, remat {t.remat_policy.value}")
    print(f"  {'analytical (perfmodel)':<28} {'GiB':>9}    {'compiler (XLA memory_analysis)':<30} {'GiB':>9}")
    # the total is the state and the peak phase's parts: those are listed first and sum to it; the parts live only
    # in the other phases of the step follow, in parentheses
    peak, inside, outside = memory_parts.peak_parts(a.as_dict())
    left = ([(name, getattr(a, name)) for name in inside if getattr(a, name) or name in _ANALYTICAL_ROWS]
            + [("(only in other phases:)", None)]
            + [(f"({name})", getattr(a, name)) for name in outside if getattr(a, name) or name in _ANALYTICAL_ROWS])
    # aliased outputs are the donated arguments, counted once: subtracted, so that the column sums to its total
    right = [("alias (subtracted)", -c[name]) if name == "alias_bytes" and c.get(name) is not None
             else (name.removesuffix("_bytes"), c.get(name)) for name in _COMPILER_ROWS] if c else []
    for i in range(max(len(left), len(right))):
        ln, lv = left[i] if i < len(left) else ("", None)
        rn, rv = right[i] if i < len(right) else ("", None)
        print(f"  {ln:<28} {_gib(lv):>9}    {rn:<30} {_gib(rv):>9}")
    total_c = c.get("per_device_total_bytes") if c else None
    shown = ("not compiled" if not c else f"at least {_gib(total_c)}" if c.get("at_least") and total_c
             else _gib(total_c))
    print(f"  {f'total ({peak} phase)':<28} {_gib(a.per_device_total_bytes):>9}    {'per-device total':<30} "
          f"{shown:>9}")
    host_c = host_total(c)
    if a.host_bytes or host_c:
        print(f"  {'pinned host memory':<28} {_gib(a.host_bytes):>9}    {'pinned host memory':<30} "
              f"{_gib(host_c) if c else 'not compiled':>9}")
        from maxperf.perfmodel.estimate import host_memory_notes

        for note in host_memory_notes(p.topology, max(a.host_bytes, host_c or 0)):
            print(f"  note: {note}")
    state, saved = dict(a.state_blocks), dict(a.activation_blocks)
    if state.get("experts") or saved.get("experts"):  # a mixture of experts: where the state and activations sit
        print("  by block (analytical)        state    saved activations")
        for block in ("experts", "attention", "rest"):
            print(f"    {block:<24} {_gib(state.get(block)):>9} {_gib(saved.get(block)):>9}")
    if a.overlapped_bytes:  # why a larger batch can need less: the compiler's schedule under memory pressure
        what = ("the experts' dispatch serialized: overlapped with the other layers' work" if state.get("experts")
                else "the weights gathered a matrix at a time: a layer's worth ahead")
        print(f"  schedule (analytical)      {what} it would need {_gib(a.overlapped_bytes)} GiB, past HBM (so a "
              "smaller batch that overlaps can show more)")
    if cmp.difference is not None:
        print(f"  analytical vs compiler     {cmp.difference:+.1%}")
    if c and c.get("peak"):
        _print_peak(c)
    if c and c.get("compiler_message"):
        print(f"  compiler: {c['compiler_message']}")
    verdict = "fits" if cmp.fits else "DOES NOT FIT"
    compiled = ("" if cmp.compile_seconds is None else "; from the compile cache" if cmp.cache_hit
                else f"; compiled in {cmp.compile_seconds:.1f} s")
    short = c is not None and c.get("at_least")
    print(f"  verdict ({cmp.source}): {verdict} in {cmp.hbm_bytes / GIB:.2f} GiB per device, "
          + (f"over by at least {-cmp.headroom_bytes / GIB:.2f} GiB" if short else
             f"headroom {cmp.headroom_bytes / GIB:.2f} GiB") + compiled)
    if c is None:  # analytical only: where the compiler's figure could fall on the other side of HBM
        from types import SimpleNamespace

        from maxperf.cli.estimate import memory_check_lines, memory_error

        est = SimpleNamespace(memory_per_device_bytes=a.per_device_total_bytes, memory=a)
        for line in memory_check_lines(est, memory_error(p, est)[0],
                                       check="compiled (without --analytical-only), the compiler gives its figure"):
            print(f"  memory check: {line}")
    if cmp.out_dir is not None:
        print(f"  artifact kept in {cmp.out_dir}")


def _print_peak(compiler: dict) -> None:
    """What the compiler holds at its step's peak (memory.json's "peak", aot.peak): the arguments, then the largest
    buffers the step makes, each with the jax operation it came from."""
    peak = compiler["peak"]
    live, args = peak["live_bytes"], peak["argument_bytes"]
    packed = compiler["per_device_total_bytes"] - compiler.get("generated_code_bytes", 0) - live
    print(f"  compiler's peak            {_gib(live)} GiB live at once: the state and batch {_gib(args)} GiB, "
          f"the step's buffers {_gib(live - args)} GiB"
          + (f"; its total is {_gib(packed)} GiB more, where its allocator could not pack buffers of different "
             "lifetimes tightly" if packed > 0.05 * live else "")
          + (f"; and {_gib(peak['host_bytes'])} GiB offloaded to host memory" if peak.get("host_bytes") else ""))
    for b in peak["buffers"][:PEAK_SHOWN]:
        shape = b["shape"].split("{")[0] if b["shape"] else "?"
        print(f"    {b['bytes'] / 2**20:>9.1f} MiB  {shape:<28} {_operation(b['operation'])}")


PEAK_SHOWN = 8  # buffers of the compiler's peak that estimate-memory prints


def _operation(name: str, width: int = 72) -> str:
    """A jax operation's name as the HLO metadata gives it, without the outer jit(step) and cut to its tail."""
    name = name.removeprefix("jit(step)/")
    return name if len(name) <= width else "..." + name[-(width - 3):]


def _print_max_batch(found, analytical_only: bool, smallest=None) -> None:
    if not found.fits:
        print("no per_device_batch_size fits" + (" (analytical, no compile)" if analytical_only else
                                                  f" ({found.compiles} compiles)"))
    elif analytical_only:
        print(f"largest per_device_batch_size that fits (analytical, no compile): {found.per_device_batch_size}")
    else:
        print(f"largest per_device_batch_size that fits: {found.per_device_batch_size} ({found.compiles} compiles; "
              f"perfmodel's guess was {found.analytical_guess})")
        for trial in found.trials:
            print(f"  B={trial.per_device_batch_size:<6} {'fits' if trial.fits else 'does not fit':<13} "
                  f"{_gib(trial.per_device_total_bytes):>9} GiB  ({trial.compile_seconds:.1f} s)")
    if found.hit_limit:
        print(f"  (the search stops at per_device_batch_size={found.per_device_batch_size})")
    if found.best is not None:
        _print_comparison(found.best)
    if smallest is not None:
        need, hbm = smallest.per_device_total_bytes, smallest.hbm_bytes
        remedies = " or ".join(["more chips", "more fsdp sharding"]
                               + ([] if str(smallest.plan.configs.train.remat_policy) == "full"
                                  else ["remat_policy=full"]))
        print(f"  nothing fits: per_device_batch_size={smallest.plan.configs.train.per_device_batch_size:g} needs "
              f"{need / GIB:.2f} GiB per device of {hbm / GIB:.2f} GiB "
              f"({(need - hbm) / GIB:.2f} GiB over, {need / hbm:.2f}x); {remedies} need less per device, host "
              "offload (optimizer_memory_host_offload=true) moves the state off it")
        _print_comparison(smallest)


def _gib(value) -> str:
    return "" if value is None else f"{value / GIB:.2f}"


def add_parser(sub) -> None:
    p = sub.add_parser("estimate-memory", help="analytical memory per device beside the compiler's, fit, max batch")
    add_request_arguments(p, model_default=None, model_required=False)
    add_step_argument(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--analytical-only", action="store_true", help="perfmodel's figures only, no compile")
    p.add_argument("--max-batch", action="store_true",
                   help="find the largest per_device_batch_size that fits, by compiles started at perfmodel's guess")
    p.add_argument("--out", help="keep the compiled artifact here (with --max-batch: one per trial, DIR/batch-B); "
                                 "default: a temporary directory, removed")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier output of this command in --out even if it holds other files")
    add_cluster_arguments(p)
    p.add_argument("--verbose", action="store_true",
                   help="show everything jax and its plugins write (C++ logs, warnings), not only maxperf's lines; "
                        "with --step, the traceback of a failing factory or step")
    # a compile loads the plugins, which write to the terminal from C++: run it in a watched child, as compile does
    p.set_defaults(func=cmd_estimate_memory, supervised=lambda args: not args.analytical_only)
