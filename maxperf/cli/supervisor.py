"""Commands that start devices or load plugins (`run`, `calibrate`, `compile`) do their work in a child process that
this one watches.

Plugins and jax's runtime write to fds 1 and 2 from C++ (libtpu's and the CUDA plugin's start-up warnings, gloo's
"[Gloo] Rank ..." lines, absl logs), and the coordination service of a multi-process job ends a process whose peer
died with a C++ check failure (SIGABRT and a stack trace) that no Python code in that process can catch. The child
sends everything it writes to stdout from C++ to its stderr; this process shows only maxperf's own lines of it
(progress, `maxperf: ...`) unless --verbose, and turns a child killed by a signal into one line and exit code 1.
SIGINT and SIGTERM reach the child as they came, and the command exits 128 + that signal (130, 143), however the
child ended. With --json, this process prints the error document of a child that failed (`maxperf.cli.fail`).

A child that dies without cleaning up (a signal, an abort) leaves its output half-written in `.NAME.*.partial`
directories beside --out (aot.artifacts.ArtifactWriter makes them with tempfile.mkdtemp): the child notes each one it
makes in a file this process reads, and this process removes those that are left once the child has ended.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from maxperf.aot import artifacts, distributed
from maxperf.cli.common import print_error_document
from maxperf.spec.errors import Terminated

CHILD = "MAXPERF_SUPERVISOR_PID"  # set in the child's environment: the pid of the process that watches it
NOTES = "MAXPERF_SUPERVISOR_NOTES"  # and the descriptor where it notes the partial output directories it makes
ARGV0 = "MAXPERF_SUPERVISOR_ARGV0"  # and the command's name as the user typed it (manifests record the command)
_PARTIAL = re.compile(r"\..+\.[a-z0-9_]+\.partial")  # ArtifactWriter's temporary directory: .NAME.XXXXXXXX.partial
RESULT_CODES = (0, 3)  # exit codes of a command that printed its result: done, and 3 (the step does not fit)
GRACE_SECONDS = 10  # after Ctrl-C, the child's time to clean up before it is killed
_OURS = re.compile(r"^(maxperf: |\[\s*\d+\.\ds\] )")  # lines maxperf writes on stderr: messages and progress
# One of maxperf's messages after another thread's output that had not ended its line (asyncio's tracebacks at exit
# are written a piece at a time, and a line of ours can land after "    self._check_closed()")
_OURS_AFTER = re.compile(r"maxperf: (?:error|interrupted|warning|note)\b")
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ \S+\] (.*)")  # an absl/glog fatal line: Fyyyy hh:mm:ss.us tid file:l] msg
# XLA:CPU's note on a device waiting at a collective: "... waiting for `all gather RendezvousKey{..., op_id=7}` ..."
_WAITING = re.compile(r"waiting for `([a-z\- ]+) RendezvousKey\{.*?op_id=(\d+)\}`")
JOINED = "joined the job at"  # the progress line of a process that joined its multi-process job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--verbose, and the mark that makes main() run the command under a supervisor."""
    parser.add_argument("--verbose", action="store_true",
                        help="show everything jax and its plugins write (C++ logs, warnings), not only maxperf's lines")
    parser.set_defaults(supervised=True)


def supervise(argv: list[str], args: argparse.Namespace) -> int | None:
    """In the child, sets it up and returns None (the command then runs here); else runs the command in a child
    and returns the exit code to leave with."""
    parent, notes, argv0 = (os.environ.pop(name, None) for name in (CHILD, NOTES, ARGV0))
    if parent is not None:
        _become_child(int(parent), None if notes is None else int(notes), argv0)
        args.child = True
        return None
    if os.environ.get("MAXPERF_DEBUG"):
        return None  # tracebacks wanted: run in this process, as it is
    return _watch(argv, args)


def _become_child(parent: int, notes: int | None, argv0: str | None) -> None:
    if argv0:
        sys.argv[0] = argv0
    if notes is not None:
        sys.addaudithook(_note_partials(notes))
    if sys.platform.startswith("linux"):
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

    def on_interrupt(signum, frame):  # a signal to the process group reaches the child twice: directly and from
        if not interrupted:  # the supervisor
            interrupted.append(signum)
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_interrupt)


def leave(code: int) -> None:
    """Ends a child whose command has written all it makes, with `code`, skipping the interpreter's finalization (its
    teardown of every module and object took 0.5-1 s after a TPU compile on 2 cores, time the user waits for). Python's
    exit handlers run first (jax's closes its backends), then the C library's exit, which flushes what C++ buffers
    (libtpu's logs in TPU_LOG_DIR). Not in a multi-process job, whose coordination service needs jax's orderly
    shutdown."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    ctypes.CDLL(None).exit(code)


def _note_partials(fd: int):
    """An audit hook that writes each `.NAME.*.partial` directory this process makes to `fd`, one path a line."""

    def hook(event: str, args: tuple) -> None:
        if event != "os.mkdir" or args[2] != -1:  # (path, mode, dir_fd), -1: none; mkdtemp gives a plain path
            return
        try:
            path = os.path.abspath(os.fsdecode(args[0]))
            if _PARTIAL.fullmatch(os.path.basename(path)):
                os.write(fd, path.encode() + b"\n")
        except (TypeError, ValueError, OSError):
            pass  # an audit hook's exception would fail the mkdir itself

    return hook


def remove_partials(noted: bytes) -> list[str]:
    """Removes the partial output directories a child noted (one path a line) that are still there, and the lock
    files of their outputs (`.NAME.lock`, freed when the child died); the directories removed."""
    removed = []
    for path in dict.fromkeys(noted.decode(errors="replace").splitlines()):  # once each, in order
        name = os.path.basename(path)
        if _PARTIAL.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            artifacts.remove_stale_lock(os.path.join(os.path.dirname(path), name[1:].rsplit(".", 2)[0]))
    return removed


class _Relay:
    """Copies the child's stderr to this process's stderr, line by line: all of it with `verbose`, else maxperf's
    lines only. Remembers what the one-line verdict on a dead child needs."""

    def __init__(self, stream, verbose: bool):
        self.stream, self.verbose = stream, verbose
        self.joined = self.said_error = False
        self.error: str | None = None  # the last `maxperf: error ...` or `maxperf: interrupted ...` line
        self.fatal: str | None = None
        self.waiting: dict[str, None] = {}  # the collectives XLA:CPU's devices were stuck at ("all gather 7"), in order
        self.hidden = 0
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        for raw in iter(self.stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            ours = bool(_OURS.match(line))
            if not ours and (late := _OURS_AFTER.search(line)):
                foreign, line, ours = line[:late.start()], line[late.start():], True
                if self.verbose:
                    print(foreign, file=sys.stderr, flush=True)
                else:
                    self.hidden += 1
            if ours:
                self.joined |= JOINED in line
                if line.startswith(("maxperf: error", "maxperf: interrupted")):
                    self.said_error, self.error = True, line
            elif (m := _FATAL.match(line)) and self.fatal is None:
                self.fatal = m.group(1)
            if not ours and (w := _WAITING.search(line)):
                self.waiting[f"{w.group(1)} {w.group(2)}"] = None
            if ours or self.verbose:
                print(line, file=sys.stderr, flush=True)
            else:
                self.hidden += 1


SAME_INTERRUPT_SECONDS = 1.0  # signals this close after the first are the same interrupt, delivered twice


def _watch(argv: list[str], args: argparse.Namespace) -> int:
    notes = tempfile.TemporaryFile()  # unnamed: nothing is left behind, whatever happens to this process
    env = {**os.environ, CHILD: str(os.getpid()), NOTES: str(notes.fileno()), ARGV0: sys.argv[0]}
    child = subprocess.Popen([sys.executable, "-m", "maxperf.cli", *argv], stderr=subprocess.PIPE, env=env,
                             pass_fds=(notes.fileno(),))
    relay = _Relay(child.stderr, args.verbose)
    stop: list[tuple[float, int]] = []  # when the first interrupt came, and its signal

    def on_signal(signum, frame):
        if child.poll() is not None:
            return
        if stop:
            # a second Ctrl-C: at once; but one interrupt can arrive twice (`timeout -s INT` signals the command and
            # its process group, a terminal's Ctrl-C the group), a moment apart: that is still the first
            if time.monotonic() - stop[0][0] >= SAME_INTERRUPT_SECONDS:
                child.kill()
            return
        stop.append((time.monotonic(), signum))
        child.send_signal(signum)  # the child cleans up and says which signal stopped it

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop and time.monotonic() - stop[0][0] > GRACE_SECONDS:
                    child.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    relay.thread.join(timeout=5)
    if code != 0:  # a child that ended abnormally cannot have cleaned up its partial output
        notes.seek(0)
        remove_partials(notes.read())
    notes.close()
    line, exit_code = ending(code, stop[0][1] if stop else None, relay, args)
    if line:
        print(line, file=sys.stderr)
    if getattr(args, "json", False) and exit_code != 0 and (line or relay.error):
        print_error_document(line or relay.error, exit_code)
    return exit_code


def ending(code: int, interrupted: int | None, relay, args: argparse.Namespace) -> tuple[str | None, int]:
    """What to say (None: the child said it) and the exit code, for a child that ended with `code` (-N: signal
    N), after the signal `interrupted` (SIGINT or SIGTERM) or none."""
    if code in RESULT_CODES:
        return None, code  # it finished, perhaps as the interrupt came
    if interrupted:  # 128 + the signal the user sent, whatever the child made of it
        if relay.said_error:
            return None, 128 + interrupted
        killed = (f"; the {args.command} process did not stop within {GRACE_SECONDS} s and was killed"
                  if code == -signal.SIGKILL else "")
        return f"maxperf: interrupted by {_name(interrupted)}{killed}", 128 + interrupted
    if code > 0 and relay.said_error:
        return None, code  # it said why not
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
    or whose peers did not all join in time, after a fatal log line that says which; any other signal came from
    outside (a person, the system's out-of-memory killer)."""
    status = ""
    if relay.fatal:
        status = relay.fatal.split("absl::Status: ", 1)[-1].split(". ")[0].strip()[:200]
    n = getattr(args, "num_processes", None) or 1
    if n > 1 and (signum == signal.SIGABRT or relay.fatal):
        who = f"process {args.process_id} of {n}"
        why = f" ({status})" if status else f" (jax's runtime ended it with {_name(signum)})"
        if not relay.joined:
            return (f"{who} could not join the job at {args.coordinator} within --timeout {args.timeout} s{why}: "
                    f"start all {n} processes with the same --coordinator and --num-processes {n}, each with its "
                    "own --process-id")
        return distributed.lost_job(args.process_id, n, why)
    who = f"process {args.process_id} of {n}: " if n > 1 else ""
    if n == 1 and len(relay.waiting) > 1:
        return cpu_collective_deadlock(list(relay.waiting), args.command)
    what = (f": {status}" if status else
            " (sent by a person or by the system when memory runs out)" if signum == signal.SIGKILL else "")
    return f"{who}the {args.command} process was ended by {_name(signum)}{what}{_hint(relay)}"


def cpu_collective_deadlock(waiting: list[str], command: str) -> str:
    """The line for CPU devices stuck at different collectives, each waiting for devices that wait at another."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"the {command} process was ended by XLA:CPU: its devices waited at different collectives "
            f"({', '.join(f'{w.rsplit(' ', 1)[0]} op {w.rsplit(' ', 1)[1]}' for w in waiting)}), each for devices "
            "stuck at another, which its runtime can do where a device's collectives do not depend on each other "
            f"and its devices outnumber this machine's {cores} cores: run again, or compile for as many CPU devices "
            "as there are cores")

