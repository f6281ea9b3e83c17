"""`maxperf xprof`: a `run --profile` trace in xprof's web server, on 127.0.0.1 only."""

from __future__ import annotations

from maxperf.profiler.viewer import DEFAULT_PORT, serve


def cmd_xprof(args) -> int:
    serve(args.trace, port=args.port, say=lambda line: print(line, flush=True))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("xprof", help="open a `run --profile` trace in xprof's web server, on 127.0.0.1 only")
    p.add_argument("trace", help="OUT/trace of `maxperf run --profile` (or OUT)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port on 127.0.0.1 (default {DEFAULT_PORT})")
    p.set_defaults(func=cmd_xprof)
