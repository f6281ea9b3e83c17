"""The `maxperf` command: parse, call the Python API, print. Exit codes: 0 ok, 1 failure, 2 bad input, 3 no fit.

One module per command (`compile`, `estimate`, `run`, ...), each with its `add_parser`; `parser` joins them. main()
runs the command and turns what goes wrong into one line on stderr and an exit code (and, with --json, an error
document on stdout).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading

from maxperf.cli import supervisor
from maxperf.cli.common import print_error_document
from maxperf.cli.parser import build_parser, parse_args
from maxperf.spec.errors import MaxperfError, Terminated, was_terminated

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    code = _run(args, argv)
    if getattr(args, "child", False) and args.command == "compile":
        supervisor.leave(code)
    return code


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    previous = _raise_on_sigterm()
    try:
        # commands that start devices or load plugins run in a watched child process (`supervised`: True, or whether
        # this invocation does)
        supervised = getattr(args, "supervised", False)
        if supervised(args) if callable(supervised) else supervised:
            code = supervisor.supervise(sys.argv[1:] if argv is None else list(argv), args)
            if code is not None:
                return code
        return args.func(args)
    except MaxperfError as e:
        if getattr(e, "details", None) and getattr(args, "verbose", False):  # the user's traceback (their step's)
            print(e.details, file=sys.stderr, end="", flush=True)
        return fail(args, f"maxperf: error: {in_user_words(str(e), args)}", e.exit_code)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM as Terminated
        signum = signal.SIGTERM if was_terminated(e) else signal.SIGINT
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
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminate)


def in_user_words(message: str, args: argparse.Namespace) -> str:
    """`message` with each key the user spelled by another name (MaxText's `max_target_length` for maxperf's
    `seq_len`, `ici_context_parallelism` for `ici_sequence`: spec.overrides.ALIASES) written as they spelled it."""
    from maxperf.spec.overrides import ALIASES

    keys = [str(word).split("=", 1)[0] for word in getattr(args, "overrides", None) or ()]
    for key in keys:
        ours = ALIASES.get(key)
        if ours and ours != key and ours not in keys:  # where they spelled it both ways, each stands as given
            message = re.sub(rf"(?<![\w.]){re.escape(ours)}(?!\w)", key, message)
    return message


def fail(args: argparse.Namespace, line: str, code: int) -> int:
    """Says why the command failed: `line` on stderr, and with --json an error document on stdout (a supervised
    child leaves the document to its supervisor, which also sees the failures the child cannot report)."""
    sys.stderr.write(line + "\n")  # in one write: no other thread's output lands between the line and its end
    sys.stderr.flush()
    if getattr(args, "json", False) and not getattr(args, "child", False):
        print_error_document(line, code)
    return code
