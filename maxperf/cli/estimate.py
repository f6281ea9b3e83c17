"""`maxperf estimate`: perfmodel's step time, TFLOP/s per chip, MFU and memory for a request, no compile."""

from __future__ import annotations

import argparse
import sys

from maxperf.cli.common import (
    GIB,
    JSON_HELP,
    add_request_arguments,
    batch_words,
    print_json,
    print_step_settings,
    print_warnings,
    serving_words,
    step_settings,
)
from maxperf.spec import presets
from maxperf.spec.request import resolve, serving_warnings


def cmd_estimate(args) -> int:
    from maxperf import perfmodel  # both load numpy, which the other commands start without
    from maxperf.user_cache import calibration_for

    p = resolve(args.topology, args.model, args.overrides, num_slices=args.num_slices)
    if (step := getattr(args, "step", "train")) != "train":  # a Namespace made by a program may leave it out
        return _serving(p, step, args.json, calibration_for(p.topology))
    est = perfmodel.estimate(p, overlap=args.overlap, calibration=calibration_for(p.topology))
    print_warnings(p)
    if args.json:
        print_json(estimate_summary(p, est))
        return 0 if est.fits else 3
    print(f"{presets.label(p.model)} on {p.topology.display_name} ({p.topology.chips} {est.chip} chips), mesh "
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
    for line in memory_check_lines(est, memory_error(p, est)[0]):
        print(f"  memory check     {line}")
    if est.uncertainty:
        print(f"  uncertainty      +-{est.uncertainty.relative:.0%}: {est.uncertainty.basis}")
    if est.chip_note:
        print(f"  note: {est.chip_note}")
    for note in est.notes:  # the fallbacks that change the figures, host memory past the hosts'
        print(f"  note: {note}")
    if est.assumptions:
        print("  assumptions:     " + "\n                   ".join(est.assumptions))
    width = max([len("component"), *(len(row.name) for row in est.breakdown)])
    print(f"  {'component':<{width}} {'kind':<10} {'seconds':>10} {'exposed':>10}")
    for row in est.breakdown:
        print(f"  {row.name:<{width}} {row.kind:<10} {row.seconds:>10.5f} {row.exposed_seconds:>10.5f}")
    return 0 if est.fits else 3


def _serving(p, kind: str, as_json: bool, calibration) -> int:
    """`estimate --step prefill|decode`: perfmodel.serving's memory, latency and throughput (docs/serving.md)."""
    from maxperf.models.serving import check
    from maxperf.perfmodel import serving
    from maxperf.perfmodel.estimate import device_for
    from maxperf.perfmodel.serving import context_words

    check(p.model, p.train, p.mesh.devices, dict(p.mesh.sizes), kind)
    chip = device_for(p.topology, calibration)
    e = serving.estimate(p.model, p.train, p.mesh, chip, p.topology, kind=kind)
    for line in serving_warnings(p):
        print(f"maxperf: warning: {line}", file=sys.stderr)
    if as_json:
        print_json({**e.as_dict(), "step": kind, "topology": p.topology.name,
                    "mesh": {"axes": p.mesh.axes, "ici": p.mesh.ici, "dcn": p.mesh.dcn}})
        return 0 if e.memory.fits else 3
    t = p.configs.train
    print(f"{presets.label(p.model)} {kind} on {p.topology.display_name} ({p.topology.chips} {chip.name} chips), mesh "
          + (" x ".join(f"{a}={n}" for a, n in p.mesh.axes.items() if n > 1) or "1 (one device)"))
    print(f"  batch            {sequences(e.batch)}, prompt {e.prompt} tokens, cache {e.cache} positions"
          + serving_words(t))
    m = e.memory
    print(f"  memory/device    {m.total_bytes / GIB:.2f} GiB of {m.hbm_bytes / GIB:.2f} GiB "
          f"({'fits' if m.fits else 'DOES NOT FIT'}): weights {m.weights_bytes / GIB:.2f}, cache "
          f"{m.cache_bytes / GIB:.2f}, temporaries {m.temp_bytes / GIB:.2f}")
    print(f"  largest          {sequences(e.max_batch_per_device)} per device at {e.cache} positions; "
          f"{context_words(e.max_context)} positions at {sequences(e.batch)}")
    print(f"  prefill          {e.prefill.seconds * 1e3:.4g} ms for the batch, bound by {e.prefill.bottleneck}; "
          f"time to first token of one prompt {e.ttft_s * 1e3:.4g} ms")
    print(f"  decode           {e.time_per_output_token_s * 1e3:.4g} ms per output token at {e.context:.0f} cached "
          f"positions, bound by {e.decode.bottleneck}")
    if kind == "prefill":
        print(f"  tokens/s         {e.prefill_tokens_per_s:,.0f} prompt tokens/s in prefill "
              f"({e.prefill_tokens_per_s / e.chips:,.0f} per chip); decode {e.tokens_per_s:,.0f}")
    else:
        print(f"  tokens/s         {e.tokens_per_s:,.0f} ({e.tokens_per_s_per_chip:,.0f} per chip)")
    relative, worst, basis = serving.uncertainty(e.kind)
    print(f"  uncertainty      +-{relative:.0%} (worst {worst:.0%}): {basis}")
    return 0 if m.fits else 3


def sequences(n: float) -> str:
    """'1 sequence', '16,384 sequences', '2.5 sequences'."""
    shown = f"{n:,.0f}" if float(n).is_integer() else f"{n:,.4g}"
    return f"{shown} sequence" + ("" if n == 1 else "s")


# memory_error.json's entries, as the line names them
ENTRY_NAMES = {"tpu": "TPU", "tpu7x": "TPU7x", "gpu": "GPU", "gpu moe": "GPU mixture-of-experts"}


def memory_error(p, est):
    """(search.margin.MeasuredError of the platform, or None where nothing was measured; whether the compiler's count
    of the step's memory could fall on the other side of the device's HBM than perfmodel's does, within that error,
    or beyond it where libtpu holds the logits' gradient late: MemoryBreakdown.may_not_fit)."""
    from maxperf.search.margin import measured_error

    error = measured_error(p.topology.platform, p.topology.chip, moe=p.model.is_moe)
    return error, (error is not None and error.close_call(est.memory_per_device_bytes, est.memory.hbm_bytes)
                   or est.memory.may_not_fit)


COMPILE_CHECK = "`maxperf estimate-memory` compiles the step for the compiler's figure"


def memory_check_lines(est, error, check: str = COMPILE_CHECK) -> list[str]:
    """The lines that say a memory verdict is too close to call (within `error`, memory_error's) and that the step
    may not fit (MemoryBreakdown.may_not_fit), each ending with `check`, how to find out; none where neither holds."""
    lines = []
    if error is not None and error.close_call(est.memory_per_device_bytes, est.memory.hbm_bytes):
        lines.append(close_call_line(est, error, check))
    if est.memory.may_not_fit:
        lines.append(may_not_fit_line(est.memory, check))
    return lines


def close_call_line(est, error, check: str = COMPILE_CHECK) -> str:
    """The line that says a memory verdict is too close to call within `error` (memory_error's)."""
    total, hbm = est.memory_per_device_bytes, est.memory.hbm_bytes
    where = (f"on the {error.cases} {ENTRY_NAMES.get(error.name, error.name)} steps of bench/memory_accuracy.py the "
             "compiler counted")
    if total <= hbm:
        seen = f"up to {error.under:.1%} more than perfmodel ({total * (1 + error.under) / GIB:.2f} GiB here)"
    else:
        seen = f"up to {error.over:.1%} less than perfmodel ({total / (1 + error.over) / GIB:.2f} GiB here)"
    return f"too close to call: {where} {seen}; {check}"


def may_not_fit_line(memory, check: str = COMPILE_CHECK) -> str:
    """Why a step that fits as counted may not (MemoryBreakdown.may_not_fit), and `check`, how to find out."""
    late = memory.late_risk_bytes
    return (f"may not fit: where libtpu takes the vocabulary table's gradient after the backward layers, as it does "
            f"in some FSDP schedules, the logits' gradient ({late / GIB:.2f} GiB) stays live through them: "
            f"{memory.late_total_bytes / GIB:.2f} GiB; {check}")


def estimate_summary(p, est) -> dict:
    """`maxperf estimate --json`: perfmodel's estimate with what it was for (topology, mesh, batch)."""
    t = p.configs.train
    error, close = memory_error(p, est)
    per_chip = p.topology.devices_per_chip  # tpu7x: two devices a chip; peak_flops is a device's, MFU against it
    return {**est.as_dict(), "topology": p.topology.name, "num_slices": p.topology.num_slices,
            "devices_per_chip": per_chip, "peak_flops_per_chip": est.peak_flops * per_chip,
            "memory_close_call": close, "memory_error": error.as_dict() if error else None,
            "mesh": {"axes": p.mesh.axes, "ici": p.mesh.ici, "dcn": p.mesh.dcn},
            "warnings": list(p.warnings),
            "model_changed": {k: str(v) for k, v in presets.changed_from_preset(p.model).items()},
            "per_device_batch_size": t.per_device_batch_size, "grad_accum_steps": t.grad_accum_steps,
            "global_batch": t.global_batch(p.mesh.devices), "seq_len": t.seq_len, **step_settings(p)}


def _fraction(text: str) -> float:
    """--overlap's value: a number from 0 to 1 (argparse turns the error into a usage line, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1 (the share of communication hidden), "
                                         f"got {text}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="analytical step time, TFLOP/s, MFU and memory, no compile")
    add_request_arguments(p, model_default=None)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--step", choices=("train", "prefill", "decode"), default="train",
                   help="train (default), or a serving step: its memory, latency and tokens/s (docs/serving.md)")
    p.add_argument("--overlap", type=_fraction, help="fraction of communication hidden under compute (0..1); "
                   "default: per collective family on TPU and GPU, none on CPU")
    p.set_defaults(func=cmd_estimate)
