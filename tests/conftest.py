"""Every test runs on CPU with 8 host devices, set before jax initializes its backends."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("MAXPERF_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxperf-test-cache"))
