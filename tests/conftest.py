"""Every test runs on CPU with 8 host devices, set before jax initializes its backends, and with a maxperf cache
directory (compiled steps, calibration) of its own: made for this session and removed at its end, so no test sees
what another session, or the user, left there."""

import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="maxperf-test-cache-")
os.environ["MAXPERF_CACHE_DIR"] = SESSION_CACHE_DIR


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)
