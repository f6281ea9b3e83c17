"""What the command modules share: the request's options, JSON and error documents, progress lines, the batch in
words, and the compile-only environment."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from maxperf.aot.artifacts import to_json
from maxperf.spec.gpu_targets import CHIP_TO_DEVICE, driver_present

GIB = 1 << 30
JSON_HELP = "print the result as one JSON document on stdout (progress stays on stderr); same exit codes"
ERROR_SCHEMA = "maxperf.error/1"  # what `--json` prints on stdout when the command fails


def add_request_arguments(parser: argparse.ArgumentParser, *, model_default: str | None,
                          model_required: bool | None = None) -> None:
    """--topology, --model, --num-slices and the key=value overrides: what names a request (spec.request.resolve).
    `model_required`: None, required when there is no default."""
    parser.add_argument("--topology", required=True, help="e.g. v5p-1024, v5e-256, h100-8x16, cpu-8")
    parser.add_argument("--model", default=model_default,
                        required=model_default is None if model_required is None else model_required,
                        help="a preset name (see `maxperf models`)"
                        + (f"; default {model_default}" if model_default else ""))
    parser.add_argument("--num-slices", type=int, default=1, help="slices side by side over DCN")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. per_device_batch_size=4 ici_tensor=4 (see `maxperf keys`)")


def add_step_argument(parser: argparse.ArgumentParser) -> None:
    """--step: maxperf's own train step (`train`, the default), or a user's factory MODULE:FACTORY (spec.steps)."""
    parser.add_argument("--step", default="train",
                        help="the step to compile: train (maxperf's, of --model; the default), or your own as "
                             "MODULE:FACTORY (e.g. examples.vision_step:make_step), a function that receives the "
                             "mesh and the key=value words and returns a maxperf Step")


def print_hlo_line(hlo: dict, analytical_s: float | None = None) -> None:
    """The step time read from the optimized HLO, in one line (beside the analytical one where there is one)."""
    against = (f"; {hlo['step_time_s'] / analytical_s - 1:+.0%} against the analytical"
               if analytical_s else "")
    print(f"  from the HLO     {hlo['step_time_s']:.4g} s/step, bound by {hlo['bottleneck']} (compute "
          f"{hlo['compute_s']:.3g} s, memory {hlo['hbm_s']:.3g} s, collectives {hlo['ici_s'] + hlo['dcn_s']:.3g} s, "
          f"{hlo['exposed_s']:.3g} s exposed){against}")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """--cluster and --keep-executables: compiles as tasks of a Ray cluster (maxperf.search.cluster)."""
    parser.add_argument("--cluster", metavar="ADDRESS",
                        help="compile on a Ray cluster: ray (the cluster this machine is a node of), "
                             "ray://HOST:PORT (a head's Ray Client server) or HOST:PORT (its GCS address); needs "
                             "pip install 'maxperf[cluster]' here and on every node")
    parser.add_argument("--keep-executables", action="store_true",
                        help="with --cluster: bring each compile's whole artifact home (compiled.pkl, hlo/), not "
                             "only its JSON")


def join_cluster(args, named, say, *, compiles: bool = True):
    """The Ray cluster of --cluster, joined and checked before any work (its nodes' versions, room for each (name,
    request) of `named`); a null context without --cluster. `compiles`: whether the command compiles at all."""
    from maxperf.spec.errors import MaxperfError

    if args.cluster is None:
        if args.keep_executables:
            raise MaxperfError("--keep-executables is for --cluster, whose compiles send home only their JSON; a "
                               "compile on this machine keeps its whole artifact")
        return contextlib.nullcontext()
    if not compiles:
        raise MaxperfError("--cluster sends compiles to Ray, and this command compiles nothing as asked; drop "
                           "--cluster")
    from maxperf.search import cluster

    return cluster.connect(args.cluster, named, progress=say)


def print_top(hlo: dict, shown: int = 8) -> None:
    """The instructions that take the most time, read from the HLO, one line each with the jax operation they come
    from."""
    step = hlo["step_time_s"] or 1.0
    print("  top instructions by predicted time (per step, before overlap):")
    for op in hlo["top"][:shown]:
        source = op["source"].rsplit("/", 1)[-1][:50] if op["source"] else ""
        runs = f" x{op['executions']:g}" if op["executions"] != 1 else ""
        print(f"    {op['seconds']:9.4g} s {op['seconds'] / step:5.1%}  {op['kind']:<16} {op['name'][:36]:<36}"
              f"{runs:>6}  {source}")


def print_json(value) -> None:
    print(json.dumps(to_json(value), indent=2))


def print_error_document(line: str, code: int) -> None:
    """`{"schema": "maxperf.error/1", "error": "...", "exit": N}` on stdout for the one-line error `line`."""
    message = line.removeprefix("maxperf: ").removeprefix("error: ")
    print(json.dumps({"schema": ERROR_SCHEMA, "error": message, "exit": code}), flush=True)


def print_warnings(request) -> None:
    """The request's warnings (mesh axes that do not divide a dimension), one line each on stderr."""
    for line in request.warnings:
        print(f"maxperf: warning: {line}", file=sys.stderr)


def progress():
    """A function that prints a phase on stderr with the seconds since this call: `[  12.3s] compiling`."""
    start = time.perf_counter()

    def say(phase: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {phase}", file=sys.stderr, flush=True)

    return say


def short_count(n: float) -> str:
    """12345678 -> '12.3M': parameter counts at a glance."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def batch_words(train, global_batch: int) -> str:
    """The step's batch in words: "256 x 2048 tokens (4 microbatches of 64)" under gradient accumulation."""
    A = train.grad_accum_steps
    micro = f" ({A} microbatches of {global_batch // A})" if A > 1 else ""
    return f"{global_batch} x {train.seq_len} tokens{micro}"


def compile_only_environment(topology: str = "") -> None:
    """Compiling needs no local accelerator: keep jax on the CPU so TPU and GPU targets are virtual. The exception is
    a GPU topology on a machine with an NVIDIA driver, whose attached GPUs (when they are the target's) compile the
    step autotuned (`targets.compiles_on_attached_gpus`). Call it before jax is imported."""
    family = topology.strip().lower().split("-")[0]
    if driver_present() and any(chip.split("-")[0] == family for chip in CHIP_TO_DEVICE):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
