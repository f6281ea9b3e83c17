"""What the command modules share: the request's options, JSON and error documents, progress lines, the batch in
words, and the compile-only environment."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import weakref

from maxperf.aot.artifacts import to_json
from maxperf.spec.gpu_targets import CHIP_TO_DEVICE, driver_present

GIB = 1 << 30
JSON_HELP = "print the result as one JSON document on stdout (progress stays on stderr); same exit codes"
ERROR_SCHEMA = "maxperf.error/1"  # what `--json` prints on stdout when the command fails


def add_request_arguments(parser: argparse.ArgumentParser, *, model_default: str | None,
                          model_required: bool | None = None) -> None:
    """--topology, --model, --num-slices and the key=value overrides: what names a request (spec.request.resolve).
    `model_required`: None, required when there is no default. A MaxText command line's words name them too
    (spec.maxtext_line: compile_topology=, model_name=, ...), so neither option is required by the parser itself:
    parser.read_maxtext_words checks them once MaxText's words are read."""
    parser.add_argument("--topology", help="e.g. v5p-1024, v5e-256, h100-8x16, cpu-8 (MaxText's compile_topology=)")
    parser.add_argument("--model", default=model_default,
                        help="a preset name (see `maxperf models`; MaxText's model_name= or global_parameter_scale=)"
                        + (f"; default {model_default}" if model_default else ""))
    parser.add_argument("--num-slices", type=int, default=None,
                        help="slices side by side over DCN (MaxText's compile_topology_num_slices=; default 1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. per_device_batch_size=4 ici_tensor=4 (see `maxperf keys`); a "
                             "MaxText command line's words as they are (its config file, model_name, "
                             "compile_topology, and keys with no effect on the step, which are named and ignored)")
    parser.set_defaults(request_words=True, model_required=model_default is None if model_required is None
                        else model_required)


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
    launches = f"kernel launches {hlo['launch_s']:.3g} s, " if hlo.get("launch_s") else ""
    print(f"  from the HLO     {hlo['step_time_s']:.4g} s/step, bound by {hlo['bottleneck']} (compute "
          f"{hlo['compute_s']:.3g} s, memory {hlo['hbm_s']:.3g} s, {launches}collectives "
          f"{hlo['ici_s'] + hlo['dcn_s']:.3g} s, {hlo['exposed_s']:.3g} s exposed){against}")


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


# While one phase runs (XLA's compile can take minutes), a line says it still does this often: more often on a
# terminal, where someone watches
STILL_RUNNING_S = {"tty": 10.0, "other": 30.0}


def progress():
    """A function that prints a phase on stderr with the seconds since this call: `[  12.3s] compiling`; while a
    phase lasts, a line every STILL_RUNNING_S says work goes on: `[  42.3s] still working (30 s since the last step
    above)`. The watching thread ends once the function is gone (the command done)."""
    return _Progress(STILL_RUNNING_S["tty" if sys.stderr.isatty() else "other"])


class _Progress:
    def __init__(self, every: float):
        self.start = self.said = self.began = time.perf_counter()
        self.every, self.phase, self.lock = every, None, threading.Lock()
        threading.Thread(target=_watch, args=(weakref.ref(self),), name="maxperf-progress", daemon=True).start()

    def __call__(self, phase: str) -> None:
        with self.lock:
            self.said = self.began = time.perf_counter()
            self.phase = phase
            print(f"[{self.said - self.start:6.1f}s] {phase}", file=sys.stderr, flush=True)

    def tick(self) -> None:
        with self.lock:
            now = time.perf_counter()
            if self.phase is not None and now - self.said >= self.every:
                print(f"[{now - self.start:6.1f}s] still working ({now - self.began:.0f} s since the last step "
                      "above)", file=sys.stderr, flush=True)
                self.said = now


def _watch(ref: weakref.ref) -> None:
    while (progress_of := ref()) is not None:
        progress_of.tick()
        del progress_of
        time.sleep(1.0)


def step_settings(p) -> dict:
    """How the request's step runs, as `compile --json` and `estimate --json` say it: the remat policy, the attention
    kernel asked for and the one it resolves to on the chip, the matmuls' precision, and a pipeline's schedule."""
    from maxperf.perfmodel.flops import attention_kernel, resolve_attention
    from maxperf.spec import pipeline

    train = p.configs.train
    schedule = pipeline.of(p.model, train, p.mesh)
    return {"remat_policy": train.remat_policy.value, "attention": train.attention.value,
            "attention_kernel": attention_kernel(resolve_attention(p.model, train, p.topology.platform)),
            "quantization": train.quantization.value, "compute_dtype": train.compute_dtype,
            "pipeline": None if schedule is None else schedule.as_dict()}


def print_step_settings(p) -> None:
    """The `step` line of compile's and estimate's summaries (step_settings in words)."""
    s = step_settings(p)
    kernel = s["attention_kernel"] + (f" ({s['attention']})" if s["attention"] != s["attention_kernel"] else "")
    precision = s["compute_dtype"] if s["quantization"] == "none" else f"{s['quantization']} matmuls"
    piped = s["pipeline"]
    pipe = (f", pipeline {piped['stages']} stages x {piped['repeats']} repeats, {piped['microbatches']} microbatches"
            if piped else "")
    if piped and sum(piped.get("empty_places", ())):
        first, last = piped["empty_places"]
        pipe += ", " + " and ".join(n for n, k in (("the embedding's", first), ("the loss's", last)) if k)
        pipe += f" place{'s' * (first + last > 1)} empty"
    print(f"  step             remat {s['remat_policy']}, attention {kernel}, {precision}{pipe}")


def short_count(n: float) -> str:
    """12345678 -> '12.3M': parameter counts at a glance."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def serving_words(train) -> str:
    """A serving step's cache, weights and decode pricing beyond the defaults: ", int8 cache, fp8 weights, ..." (empty
    where all are defaults)."""
    return ((", int8 cache" if train.quantize_kvcache else "")
            + (f", {train.quantization} weights" if train.quantization != "none" else "")
            + (", decode priced as reading the cache once per query head"
               if train.decode_cache_reads == "per_query_head" else ""))


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


def host_total(compiler: dict | None) -> int | None:
    """Pinned host memory per device in the compiler's figures (state offloaded between steps, offloaded
    activations): arguments and outputs, donated ones once, and host temporaries; None where it gave none."""
    if not compiler or "host_argument_bytes" not in compiler:
        return None
    return (compiler["host_argument_bytes"] + compiler["host_output_bytes"] - compiler["host_alias_bytes"]
            + compiler["host_temp_bytes"])
