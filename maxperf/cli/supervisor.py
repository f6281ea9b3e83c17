"""Commands that start real devices (`run`, `calibrate`) do their work in a child process that this one watches.

Plugins and jax's runtime write to fds 1 and 2 from C++ (libtpu's and the CUDA plugin's start-up warnings, gloo's
"[Gloo] Rank ..." lines, absl logs), and the coordination service of a multi-process job ends a process whose peer
died with a C++ check failure (SIGABRT and a stack trace) that no Python code in that process can catch. The child
sends everything it writes to stdout from C++ to its stderr; this process shows only maxperf's own lines of it
(progress, `maxperf: ...`) unless --verbose, and turns a child killed by a signal into one line and exit code 1.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

CHILD = "MAXPERF_SUPERVISOR_PID"  # set in the child's environment: the pid of the process that watches it
GRACE_SECONDS = 10  # after Ctrl-C, the child's time to clean up before it is killed
_OURS = re.compile(r"^(maxperf: |\[\s*\d+\.\ds\] )")  # lines maxperf writes on stderr: messages and progress
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ \S+\] (.*)")  # an absl/glog fatal line: Fyyyy hh:mm:ss.us tid file:l] msg
JOINED = "joined the job at"  # the progress line of a process that joined its multi-process job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--verbose, and the mark that makes main() run the command under a supervisor."""
    parser.add_argument("--verbose", action="store_true",
                        help="show everything jax and its plugins write (C++ logs, warnings), not only maxperf's lines")
    parser.set_defaults(supervised=True)


def supervise(argv: list[str], args: argparse.Namespace) -> int | None:
    """In the child, sets it up and returns None (the command then runs here); else runs the command in a child
    and returns the exit code to leave with."""
    parent = os.environ.pop(CHILD, None)
    if parent is not None:
        _become_child(int(parent))
        return None
    if os.environ.get("MAXPERF_DEBUG"):
        return None  # tracebacks wanted: run in this process, as it is
    return _watch(argv, args)


def _become_child(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor
        if os.getppid() != parent:  # it died before prctl took effect
            os._exit(1)
    # C++ writes to fd 1 (gloo's connection lines) go to fd 2, which the supervisor filters; Python's stdout keeps
    # the real fd 1, so `--json` prints one parsable document
    sys.stdout.flush()
    keep = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(keep, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)

    interrupted = []

    def on_interrupt(signum, frame):  # Ctrl-C reaches the child twice: from the terminal and from the supervisor
        if not interrupted:
            interrupted.append(signum)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)


class _Relay:
    """Copies the child's stderr to this process's stderr, line by line: all of it with `verbose`, else maxperf's
    lines only. Remembers what the one-line verdict on a dead child needs."""

    def __init__(self, stream, verbose: bool):
        self.stream, self.verbose = stream, verbose
        self.joined = self.said_error = False
        self.fatal: str | None = None
        self.hidden = 0
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        for raw in iter(self.stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            ours = bool(_OURS.match(line))
            if ours:
                self.joined |= JOINED in line
                self.said_error |= line.startswith(("maxperf: error", "maxperf: interrupted"))
            elif (m := _FATAL.match(line)) and self.fatal is None:
                self.fatal = m.group(1)
            if ours or self.verbose:
                print(line, file=sys.stderr, flush=True)
            else:
                self.hidden += 1


def _watch(argv: list[str], args: argparse.Namespace) -> int:
    env = {**os.environ, CHILD: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "maxperf.cli", *argv], stderr=subprocess.PIPE, env=env)
    relay = _Relay(child.stderr, args.verbose)
    stop: list[float] = []  # when the first interrupt came

    def on_signal(signum, frame):
        if child.poll() is not None:
            return
        if stop:
            child.kill()  # a second Ctrl-C: at once
            return
        stop.append(time.monotonic())
        child.send_signal(signal.SIGINT)  # SIGTERM too: the child cleans up as for Ctrl-C

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop and time.monotonic() - stop[0] > GRACE_SECONDS:
                    child.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    relay.thread.join(timeout=5)
    line, exit_code = ending(code, bool(stop), relay, args)
    if line:
        print(line, file=sys.stderr)
    return exit_code


def ending(code: int, interrupted: bool, relay, args: argparse.Namespace) -> tuple[str | None, int]:
    """What to say (None: the child said it) and the exit code, for a child that ended with `code` (-N: signal
    N), after an interrupt or not."""
    if code == 0 or (code > 0 and relay.said_error):
        return None, code  # it finished (perhaps as the interrupt came), or said why not
    if interrupted:
        return (None if relay.said_error else
                "maxperf: interrupted" + ("" if code >= 0 else f"; stopped by {_name(-code)}")), 130
    if relay.said_error:
        return None, 1  # jax's runtime ended it (an abort at exit) after it had said why it stopped
    if code > 0:
        return (f"maxperf: error: the {args.command} process exited with status {code} without saying why"
                f"{_hint(relay)}"), code
    return f"maxperf: error: {_verdict(-code, relay, args)}", 1


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _hint(relay: _Relay) -> str:
    return f"; --verbose shows the {relay.hidden} lines jax and its plugins wrote" if relay.hidden else ""


def _verdict(signum: int, relay: _Relay, args: argparse.Namespace) -> str:
    """One line on a child that a signal ended: jax's coordination service aborts a process whose job lost a peer,
    or whose peers did not all join in time, after a fatal log line that says which."""
    status = ""
    if relay.fatal:
        status = relay.fatal.split("absl::Status: ", 1)[-1].split(". ")[0].strip()[:200]
    n = getattr(args, "num_processes", None) or 1
    if n > 1:
        who = f"process {args.process_id} of {n}"
        why = f" ({status})" if status else f" (jax's runtime ended it with {_name(signum)})"
        if not relay.joined:
            return (f"{who} could not join the job at {args.coordinator} within --timeout {args.timeout} s{why}: "
                    f"start all {n} processes with the same --coordinator and --num-processes {n}, each with its "
                    "own --process-id")
        return (f"{who} lost its job{why}: another process of the job stopped or cannot be reached, so this one "
                "gives up")
    what = f": {status}" if status else ""
    return f"the {args.command} process was ended by {_name(signum)}{what}{_hint(relay)}"
