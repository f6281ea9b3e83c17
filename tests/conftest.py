"""Every test runs on CPU with 8 host devices, set before jax initializes its backends, and with a maxperf cache
directory (compiled steps, calibration) of its own: made for this session and removed at its end, so no test sees
what another session, or the user, left there."""

import os
import shutil
import signal
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="maxperf-test-cache-")
os.environ["MAXPERF_CACHE_DIR"] = SESSION_CACHE_DIR
# Tests stop the commands they start with SIGINT, as Ctrl-C does. A test run started as a background job of a shell
# without job control inherits SIGINT ignored, and so would every command it starts (an ignored signal stays ignored
# across exec, and Python then installs no handler of its own): the run takes Python's handler back, so that what it
# starts sees SIGINT as a terminal's Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)
