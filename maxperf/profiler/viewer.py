"""A captured trace in xprof's own web server, bound to 127.0.0.1 only: `maxperf xprof OUT/trace`.

`xprof server` binds every address, and so does the gRPC worker service it starts beside the web server. A trace
shows the model's code and data shapes, so maxperf serves it on loopback and without that service (the tools of a
single trace are converted in the web server's process): from another machine, `ssh -L PORT:127.0.0.1:PORT HOST`.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Callable
from pathlib import Path

from maxperf.spec.errors import MaxperfError

HOST = "127.0.0.1"
DEFAULT_PORT = 8791  # xprof's own default


def open_command(trace_dir: str | os.PathLike) -> str:
    """The command that opens `trace_dir` (a `jax.profiler.trace` log directory) in a browser on this machine."""
    return f"maxperf xprof {shlex.quote(str(trace_dir))}"


def trace_dir(path: str | os.PathLike) -> Path:
    """The log directory under `path`: a run's output directory (OUT, holding trace/) or its trace/ itself."""
    path = Path(path)
    for candidate in (path, path / "trace"):
        if (candidate / "plugins" / "profile").is_dir():
            return candidate
    raise MaxperfError(f"{path} holds no trace (no plugins/profile/); give the trace/ directory of a "
                       "`maxperf run --profile` output")


def serve(path: str | os.PathLike, port: int = DEFAULT_PORT, say: Callable[[str], None] = print) -> None:
    """Serves the trace under `path` at http://127.0.0.1:PORT/ until interrupted."""
    logdir = str(trace_dir(path).resolve())
    if not 0 < port < 65536:
        raise MaxperfError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # a clear error before xprof starts
        try:
            probe.bind((HOST, port))
        except OSError as e:
            raise MaxperfError(f"cannot listen on {HOST}:{port} ({e.strerror}); pass another --port") from None
    try:
        from xprof import server
    except ImportError:
        raise MaxperfError("xprof is not installed: pip install 'maxperf[profile]' (./bootstrap installs every "
                           "extra)") from None
    try:  # the steps of xprof.server's own launcher, less the gRPC worker service, with the host chosen here
        context = server.TBContext(logdir, server.DataProvider(logdir), server.TBContext.Flags(False))
        plugin = server.ProfilePluginLoader().load(context)
        run = server.run_server
    except AttributeError as e:
        raise MaxperfError(f"this xprof lacks what maxperf serves traces with ({e}); `xprof server --logdir {logdir}`"
                           " opens it, listening on every address") from None
    say(f"xprof at http://{HOST}:{port}/ (this machine only; Ctrl-C stops it)")
    run(plugin, HOST, port)
