"""`maxperf compile`: the train step compiled for a topology, its artifacts written, its figures printed."""

from __future__ import annotations

import sys

from maxperf import aot  # its names load on first use: the compiler (and jax) once the environment is set
from maxperf.aot import distributed
from maxperf.cli import supervisor
from maxperf.cli.common import (
    GIB,
    JSON_HELP,
    add_request_arguments,
    add_step_argument,
    batch_words,
    compile_only_environment,
    host_total,
    print_hlo_line,
    print_json,
    print_step_settings,
    print_top,
    progress,
    serving_words,
    short_count,
    step_settings,
)
from maxperf.spec import topology as topologies
from maxperf.spec.errors import MaxperfError
from maxperf.spec.presets import DEFAULT_MODEL
from maxperf.spec.steps import parse_step

COMPILE_SCHEMA = "maxperf.compile/1"  # `maxperf compile --json`


def cmd_compile(args) -> int:
    compile_only_environment(args.topology)
    _check_processes(args)
    say = progress()
    if distributed.initialize(args, "cpu"):
        say(f"{supervisor.JOINED} {args.coordinator} as process {args.process_id} of {args.num_processes}")

    step = parse_step(args.step)
    if step.is_user:
        if args.model is not None:
            raise MaxperfError(f"--model names one of maxperf's models; --step {step} builds its own step: drop "
                               "--model")
        from maxperf.cli import user_step

        return user_step.compiled(args, step, say)
    result = aot.compile(args.topology, args.model or DEFAULT_MODEL, args.overrides, num_slices=args.num_slices,
                         out=args.out, target_config=args.target_config, progress=say, argv=sys.argv,
                         force=args.force, step=step.builtin)
    p, mem, cost = result.plan, result.memory, result.cost
    if args.json:
        print_json(compile_summary(result, step.builtin))
        return 0 if result.fits else 3
    if step.builtin != "train":
        return _print_serving(result, step.builtin)
    print(f"compiled {p.model.name} for {p.topology.name}"
          + (f" x {p.topology.num_slices} slices" if p.topology.num_slices > 1 else "") + f" -> {written(result)}")
    print(f"  parameters       {short_count(result.param_count)}; global batch "
          f"{batch_words(p.configs.train, result.global_batch)}")
    print("  mesh             " + " x ".join(f"{a}={n}" for a, n in p.mesh.axes.items() if n > 1))
    print_step_settings(p)
    print(f"  memory/device    {mem['per_device_total_bytes'] / GIB:.2f} GiB of {mem['hbm_bytes'] / GIB:.2f} GiB "
          f"({'fits' if mem['fits'] else 'DOES NOT FIT'}, headroom {mem['headroom_bytes'] / GIB:.2f} GiB)")
    if host := host_total(mem):  # offloaded state or activations: pinned host memory, the compiler's and perfmodel's
        analytical = ((result.estimate or {}).get("memory") or {}).get("host_bytes")
        print(f"  host memory      {host / GIB:.2f} GiB pinned per device"
              + (f" (perfmodel {analytical / GIB:.2f} GiB)" if analytical is not None else ""))
    print(f"  FLOPs/device     {cost['flops_per_device'] / 1e12:.4g} TFLOP per step ({cost['flops_source']})")
    if result.estimate:
        e = result.estimate
        print(f"  predicted        {e['step_time_s']:.4g} s/step, {e['tflops_per_chip']:.4g} TFLOP/s per chip, "
              f"MFU {e['mfu']:.1%}, bound by {e['bottleneck']}")
        if e.get("hlo_time"):
            print_hlo_line(e["hlo_time"], e["step_time_s"])
            print_top(e["hlo_time"], shown=5)
    compiled = ("from the compile cache, no compile" if result.cache_hit else f"{result.compile_seconds:.1f} s")
    print(f"  compile time     {compiled} (lowering {result.lower_seconds:.1f} s, whole "
          f"{result.total_seconds:.1f} s); host peak RSS {result.peak_rss_bytes / GIB:.2f} GiB")
    for note in result.limitations:
        print(f"  note: {note}")
    return 0 if result.fits else 3


def _check_processes(args) -> None:
    """The job's process count against the topology's, before any process waits for peers that will not come: a
    cpu-NxP compile is P processes, like the run it is for; a TPU or GPU compile is one, whatever its hosts (its
    devices are virtual)."""
    topology = topologies.get(args.topology, args.num_slices, args.target_config)
    want = topology.hosts if topology.platform == "cpu" else 1
    given = args.num_processes or 1
    if given != want:
        start = ("run it without --num-processes" if want == 1 else
                 f"start {want} processes, each with --coordinator HOST:PORT --num-processes {want} --process-id I")
        how = (f"as {want} processes" if want > 1 else "in one process" if topology.platform == "cpu" else
               "in one process, whatever its hosts (its devices are virtual)")
        raise MaxperfError(f"{topology.name} compiles {how}, this job has {given}: {start}")


def _print_serving(result, kind: str) -> int:
    """compile's summary of a serving step: the compiler's memory, the analytical latency and throughput."""
    p, mem, e = result.plan, result.memory, result.estimate
    t = p.configs.train
    print(f"compiled {p.model.name} {kind} for {p.topology.name} -> {written(result)}")
    print(f"  parameters       {short_count(result.param_count)}; {result.global_batch} sequences, prompt "
          f"{t.max_prefill_predict_length} tokens, cache {t.seq_len} positions" + serving_words(t))
    print("  mesh             " + (" x ".join(f"{a}={n}" for a, n in p.mesh.axes.items() if n > 1) or "1 device"))
    print(f"  memory/device    {mem['per_device_total_bytes'] / GIB:.2f} GiB of {mem['hbm_bytes'] / GIB:.2f} GiB "
          f"({'fits' if mem['fits'] else 'DOES NOT FIT'}); analytical {e['memory']['total_bytes'] / GIB:.2f} GiB "
          f"(weights {e['memory']['weights_bytes'] / GIB:.2f}, cache {e['memory']['cache_bytes'] / GIB:.2f})")
    phase = e[kind]
    if kind == "prefill":
        print(f"  predicted        {phase['seconds'] * 1e3:.4g} ms for the batch's prompts, bound by "
              f"{phase['bottleneck']}; time to first token of one prompt {e['ttft_s'] * 1e3:.4g} ms")
    else:
        print(f"  predicted        {e['time_per_output_token_s'] * 1e3:.4g} ms per output token at "
              f"{e['context']:.0f} cached positions, {e['tokens_per_s_per_chip']:.4g} tokens/s per chip, bound by "
              f"{phase['bottleneck']}")
    if e.get("hlo_time"):
        print(f"  read from HLO    {e['hlo_time']['step_time_s'] * 1e3:.4g} ms per step (the compiled step attends "
              "over the whole cache)")
    from maxperf.perfmodel.serving import context_words

    print(f"  largest          {e['max_batch_per_device']:.4g} sequences per device fit; "
          f"{context_words(e['max_context'])} cache positions at {result.global_batch} sequences")
    for note in result.limitations:
        print(f"  note: {note}")
    return 0 if result.fits else 3


def _writes() -> bool:
    """Whether this process wrote the artifact: process 0 of a multi-process compile does, the others do not
    (aot.compiler.finish)."""
    import jax

    return jax.process_index() == 0


def written(result) -> str:
    """Where the artifact is, as this process says it: the others of a multi-process compile name process 0."""
    if _writes():
        return str(result.out_dir)
    return f"(written by process 0, to its --out; not to this process's {result.out_dir})"


def compile_summary(result, step: str = "train") -> dict:
    """What `maxperf compile` prints, as JSON: the plan (topology, mesh, batch) and the compile's figures."""
    p = result.plan
    return {"schema": COMPILE_SCHEMA, "out_dir": str(result.out_dir) if _writes() else None, "step": step,
            "model": p.model.name,
            "topology": p.topology.name, "num_slices": p.topology.num_slices,
            "mesh": {"axes": p.mesh.axes, "ici": p.mesh.ici, "dcn": p.mesh.dcn},
            "per_device_batch_size": p.configs.train.per_device_batch_size, "global_batch": result.global_batch,
            "grad_accum_steps": p.configs.train.grad_accum_steps,
            "seq_len": p.configs.train.seq_len, **step_settings(p), "param_count": result.param_count,
            "fits": result.fits,
            "memory": result.memory, "cost": result.cost, "estimate": result.estimate,
            "cache_hit": result.cache_hit, "compile_seconds": result.compile_seconds,
            "lower_seconds": result.lower_seconds, "total_seconds": result.total_seconds,
            "peak_rss_bytes": result.peak_rss_bytes, "limitations": result.limitations}


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="compile the train step (or your own step) for a topology and write its "
                                       "artifacts")
    add_request_arguments(p, model_default=DEFAULT_MODEL)
    p.set_defaults(model=None)  # DEFAULT_MODEL unless --step names a user's factory, which takes no --model
    add_step_argument(p)
    p.add_argument("--out", help="output directory (default: artifacts/MODEL_TOPOLOGY); an existing one must be an "
                                 "earlier compile's artifact")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier output of this command in --out even if it holds other files")
    p.add_argument("--target-config", help="GPU: a GpuTargetConfigProto text file instead of the built-in spec")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    distributed.add_arguments(p)  # cpu-NxP compiles as P processes, like the run it is for
    supervisor.add_arguments(p)  # a dead peer ends a multi-process compile in one line; a killed one leaves nothing
    p.set_defaults(func=cmd_compile)
