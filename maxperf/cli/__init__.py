"""The `maxperf` command: parse, call the Python API, print. Exit codes: 0 ok, 1 failure, 2 bad input, 3 no fit."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from maxperf.spec.errors import MaxperfError, Terminated

GIB = 1 << 30


def _print_json(value) -> None:
    from maxperf.aot.artifacts import to_json

    print(json.dumps(to_json(value), indent=2))


def _count(n: float) -> str:
    """12345678 -> '12.3M': parameter counts at a glance."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def _progress():
    start = time.perf_counter()

    def say(phase: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {phase}", file=sys.stderr, flush=True)

    return say


def _compile_only_environment(topology: str = "") -> None:
    """Compiling needs no local accelerator: keep jax on the CPU so TPU and GPU targets are virtual. The exception is
    a GPU topology on a machine with an NVIDIA driver, whose attached GPUs (when they are the target's) compile the
    step autotuned (`targets.compiles_on_attached_gpus`)."""
    from maxperf.spec.gpu_targets import CHIP_TO_DEVICE, driver_present

    family = topology.strip().lower().split("-")[0]
    if driver_present() and any(chip.split("-")[0] == family for chip in CHIP_TO_DEVICE):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cmd_models(args) -> int:
    from maxperf.perfmodel import count_params  # pure Python: listing the presets never starts jax
    from maxperf.spec import presets

    rows = []
    for name in presets.names():
        m = presets.get(name)
        counts = count_params(m)
        rows.append({"name": name, "params": counts.total, "active_params": counts.active, "V": m.vocab_size,
                     "D": m.d_model, "N": m.num_layers, "H": m.num_heads, "K": m.num_kv_heads, "Dh": m.head_dim,
                     "F": m.d_ff, "E": m.num_experts, "top_k": m.num_experts_per_tok,
                     "activation": m.activation.value, "attention_type": m.attention_type.value})
    if args.json:
        _print_json(rows)
        return 0
    print(f"{'model':<24} {'params':>9} {'active':>9} {'V':>7} {'D':>6} {'N':>4} {'H':>4} {'K':>4} {'Dh':>4} {'F':>7} "
          f"{'E':>4} {'k':>2}  attention_type")
    for r in rows:
        print(f"{r['name']:<24} {_billions(r['params']):>9} {_billions(r['active_params']):>9} {r['V']:>7} {r['D']:>6} "
              f"{r['N']:>4} {r['H']:>4} {r['K']:>4} {r['Dh']:>4} {r['F']:>7} {r['E']:>4} {r['top_k']:>2}  "
              f"{r['attention_type']}")
    return 0


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e7 else f"{n / 1e6:.3f}M"


def cmd_topologies(args) -> int:
    from maxperf.spec import topology as topologies

    rows = [t for t in topologies.catalog() if args.platform in (None, t.platform)]
    if args.json:
        _print_json([t.as_dict() for t in rows])
        return 0
    print(f"{'topology':<16} {'platform':<8} {'chips':>6} {'hosts':>6} {'HBM/chip':>9} {'bf16 TFLOP/s':>13}  layout")
    for t in rows:
        hbm = f"{t.hbm_bytes_per_chip / GIB:.0f} GiB" if t.hbm_bytes_per_chip else "-"
        peak = f"{t.peak_bf16_flops_per_chip / 1e12:.0f}" if t.peak_bf16_flops_per_chip else "-"
        layout = t.libtpu_topology or t.gpu_target or ""
        print(f"{t.name:<16} {t.platform:<8} {t.chips:>6} {t.hosts:>6} {hbm:>9} {peak:>13}  {layout}")
    print("cpu-N: N devices of this process (any N)")
    return 0


def cmd_keys(args) -> int:
    from maxperf.spec import overrides

    aliases: dict[str, list[str]] = {}
    for alias, key in overrides.ALIASES.items():
        aliases.setdefault(key, []).append(alias)
    for key in overrides.valid_keys():
        extra = f"  (MaxText: {', '.join(aliases[key])})" if key in aliases else ""
        print(f"{key}{extra}")
    return 0


def _check_compile_processes(args) -> None:
    """The job's process count against the topology's, before any process waits for peers that will not come: a
    cpu-NxP compile is P processes, like the run it is for; a TPU or GPU compile is one, whatever its hosts (its
    devices are virtual)."""
    from maxperf.spec import topology as topologies

    topology = topologies.get(args.topology, args.num_slices, args.target_config)
    want = topology.hosts if topology.platform == "cpu" else 1
    given = args.num_processes or 1
    if given != want:
        start = ("run it without --num-processes" if want == 1 else
                 f"start {want} processes, each with --coordinator HOST:PORT --num-processes {want} --process-id I")
        how = (f"as {want} processes" if want > 1 else "in one process" if topology.platform == "cpu" else
               "in one process, whatever its hosts (its devices are virtual)")
        raise MaxperfError(f"{topology.name} compiles {how}, this job has {given}: {start}")


def cmd_compile(args) -> int:
    _compile_only_environment(args.topology)
    from maxperf import aot
    from maxperf.aot import distributed
    from maxperf.cli import supervisor

    _check_compile_processes(args)
    say = _progress()
    if distributed.initialize(args, "cpu"):
        say(f"{supervisor.JOINED} {args.coordinator} as process {args.process_id} of {args.num_processes}")

    result = aot.compile(args.topology, args.model, args.overrides, num_slices=args.num_slices, out=args.out,
                         target_config=args.target_config, progress=say, argv=sys.argv, force=args.force)
    p, mem, cost = result.plan, result.memory, result.cost
    if args.json:
        _print_json(compile_summary(result))
        return 0 if result.fits else 3
    print(f"compiled {p.model.name} for {p.topology.name}"
          + (f" x {p.topology.num_slices} slices" if p.topology.num_slices > 1 else "") + f" -> {result.out_dir}")
    print(f"  parameters       {_count(result.param_count)}; global batch "
          f"{batch_words(p.configs.train, result.global_batch)}")
    print("  mesh             " + " x ".join(f"{a}={n}" for a, n in p.mesh.axes.items() if n > 1))
    print(f"  memory/device    {mem['per_device_total_bytes'] / GIB:.2f} GiB of {mem['hbm_bytes'] / GIB:.2f} GiB "
          f"({'fits' if mem['fits'] else 'DOES NOT FIT'}, headroom {mem['headroom_bytes'] / GIB:.2f} GiB)")
    print(f"  FLOPs/device     {cost['flops_per_device'] / 1e12:.4g} TFLOP per step ({cost['flops_source']})")
    if result.estimate:
        e = result.estimate
        print(f"  predicted        {e['step_time_s']:.4g} s/step, {e['tflops_per_chip']:.4g} TFLOP/s per chip, "
              f"MFU {e['mfu']:.1%}, bound by {e['bottleneck']}")
    compiled = ("from the compile cache, no compile" if result.cache_hit else f"{result.compile_seconds:.1f} s")
    print(f"  compile time     {compiled} (lowering {result.lower_seconds:.1f} s, whole "
          f"{result.total_seconds:.1f} s); host peak RSS {result.peak_rss_bytes / GIB:.2f} GiB")
    for note in result.limitations:
        print(f"  note: {note}")
    return 0 if result.fits else 3


def batch_words(train, global_batch: int) -> str:
    """The step's batch in words: "256 x 2048 tokens (4 microbatches of 64)" under gradient accumulation."""
    A = train.grad_accum_steps
    micro = f" ({A} microbatches of {global_batch // A})" if A > 1 else ""
    return f"{global_batch} x {train.seq_len} tokens{micro}"


COMPILE_SCHEMA = "maxperf.compile/1"  # `maxperf compile --json`
JSON_HELP = "print the result as one JSON document on stdout (progress stays on stderr); same exit codes"


def compile_summary(result) -> dict:
    """What `maxperf compile` prints, as JSON: the plan (topology, mesh, batch) and the compile's figures."""
    p = result.plan
    return {"schema": COMPILE_SCHEMA, "out_dir": str(result.out_dir), "model": p.model.name,
            "topology": p.topology.name, "num_slices": p.topology.num_slices,
            "mesh": {"axes": p.mesh.axes, "ici": p.mesh.ici, "dcn": p.mesh.dcn},
            "per_device_batch_size": p.configs.train.per_device_batch_size, "global_batch": result.global_batch,
            "grad_accum_steps": p.configs.train.grad_accum_steps,
            "seq_len": p.configs.train.seq_len, "param_count": result.param_count, "fits": result.fits,
            "memory": result.memory, "cost": result.cost, "estimate": result.estimate,
            "cache_hit": result.cache_hit, "compile_seconds": result.compile_seconds,
            "lower_seconds": result.lower_seconds, "total_seconds": result.total_seconds,
            "peak_rss_bytes": result.peak_rss_bytes, "limitations": result.limitations}


def _add_plan_arguments(parser: argparse.ArgumentParser, *, model_default: str | None) -> None:
    parser.add_argument("--topology", required=True, help="e.g. v5p-1024, v5e-256, h100-8x16, cpu-8")
    parser.add_argument("--model", default=model_default, required=model_default is None,
                        help="a preset name (see `maxperf models`)"
                        + (f"; default {model_default}" if model_default else ""))
    parser.add_argument("--num-slices", type=int, default=1, help="slices side by side over DCN")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. per_device_batch_size=4 ici_tensor=4 (see `maxperf keys`)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), except that a usage error on a command line with --json also
    prints the error document."""

    json_words = False  # set by parse_args when the words hold --json

    def error(self, message):
        if self.json_words:
            print_error_document(f"{self.prog}: {message}", 2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    from maxperf import __version__
    from maxperf.spec.presets import DEFAULT_MODEL

    parser = _Parser(prog="maxperf", description=__doc__)
    parser.add_argument("--version", action="version", version=f"maxperf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list the model presets")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("topologies", help="list the topologies maxperf compiles for")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--platform", choices=["tpu", "gpu", "cpu"], help="only this platform's topologies")
    p.set_defaults(func=cmd_topologies)

    p = sub.add_parser("keys", help="list the key=value override keys and their MaxText aliases")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("compile", help="compile the train step for a topology and write its artifacts")
    _add_plan_arguments(p, model_default=DEFAULT_MODEL)
    p.add_argument("--out", help="output directory (default: artifacts/MODEL_TOPOLOGY); an existing one must be an "
                                 "earlier compile's artifact")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier output of this command in --out even if it holds other files")
    p.add_argument("--target-config", help="GPU: a GpuTargetConfigProto text file instead of the built-in spec")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    from maxperf.aot import distributed
    from maxperf.cli import supervisor

    distributed.add_arguments(p)  # cpu-NxP compiles as P processes, like the run it is for
    supervisor.add_arguments(p)  # a dead peer ends a multi-process compile in one line; a killed one leaves nothing
    p.set_defaults(func=cmd_compile)

    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands():
    """Each command module adds its subcommands to the parser."""
    import importlib

    for module in ("maxperf.cli.estimate", "maxperf.cli.run", "maxperf.cli.reports", "maxperf.cli.plan"):
        yield from importlib.import_module(module).COMMANDS


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command's options and its key=value words in any order (`estimate a=1 --json b=2`): the command's own
    parser reads its arguments intermixed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if not argv or argv[0] not in commands:  # no command, -h, --version, or a mistake: the top parser says
        return parser.parse_args(argv)
    command = commands[argv[0]]
    command.json_words = "--json" in argv[1:]
    args = command.parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    code = _run(args, argv)
    if getattr(args, "child", False) and args.command == "compile":
        from maxperf.cli import supervisor

        supervisor.leave(code)
    return code


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    previous = _raise_on_sigterm()
    try:
        if getattr(args, "supervised", False):  # commands that start devices run in a watched child process
            from maxperf.cli import supervisor

            code = supervisor.supervise(sys.argv[1:] if argv is None else list(argv), args)
            if code is not None:
                return code
        return args.func(args)
    except MaxperfError as e:
        return fail(args, f"maxperf: error: {e}", e.exit_code)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM as Terminated
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        return fail(args, f"maxperf: interrupted by {signum.name}", 128 + signum)
    except BrokenPipeError:  # `maxperf models | head`: the reader left; say nothing more on a closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # anything unexpected: one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        code = fail(args, f"maxperf: error: {type(e).__name__}: {first[:400]}", 1)
        if os.environ.get("MAXPERF_DEBUG"):
            raise
        return code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm():
    """SIGTERM raises Terminated, so a command stops as on Ctrl-C (its cleanup runs) and exits 143; the handler it
    replaces, None off the main thread (where no handler can be set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminate)


ERROR_SCHEMA = "maxperf.error/1"  # what `--json` prints on stdout when the command fails


def fail(args: argparse.Namespace, line: str, code: int) -> int:
    """Says why the command failed: `line` on stderr, and with --json an error document on stdout (a supervised
    child leaves the document to its supervisor, which also sees the failures the child cannot report)."""
    print(line, file=sys.stderr, flush=True)
    if getattr(args, "json", False) and not getattr(args, "child", False):
        print_error_document(line, code)
    return code


def print_error_document(line: str, code: int) -> None:
    """`{"schema": "maxperf.error/1", "error": "...", "exit": N}` on stdout for the one-line error `line`."""
    message = line.removeprefix("maxperf: ").removeprefix("error: ")
    print(json.dumps({"schema": ERROR_SCHEMA, "error": message, "exit": code}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
