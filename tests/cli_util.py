"""`maxperf` as a user runs it: a subprocess of this Python, its output captured."""

import os
import subprocess
import sys


def maxperf(*args, cwd=None, timeout=600, unset=("XLA_FLAGS",)) -> subprocess.CompletedProcess:
    """Runs `python -m maxperf.cli ARGS`; the variables in `unset` are left out of its environment (XLA_FLAGS: each
    command sets its own device count)."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run([sys.executable, "-m", "maxperf.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)
