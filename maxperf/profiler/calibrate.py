"""`maxperf calibrate`: measure this machine's jax devices (matmul FLOP/s, memory bandwidth) for perfmodel.

The result is stored as JSON in the user's cache (perfmodel.calibration.cache_dir()), where perfmodel reads it to
give the "cpu" chip measured peaks. jax is imported inside `calibrate`, so importing this module stays cheap.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from maxperf.perfmodel.calibration import Calibration, MatmulSample, save

MATMUL_SIZES = (256, 512, 1024)
DTYPES = ("float32", "bfloat16")
BANDWIDTH_BYTES = 64 * 2**20  # per operand of the add: large enough to leave the caches, quick on a laptop
REPEATS = 5


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed runs after one warm-up (compile) run; the minimum filters out noise."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(*, sizes: Sequence[int] = MATMUL_SIZES, dtypes: Sequence[str] = DTYPES,
              bandwidth_bytes: int = BANDWIDTH_BYTES, repeats: int = REPEATS, store: bool = True,
              path: Path | None = None) -> Calibration:
    """Times square matmuls (2 n^3 FLOPs each) per dtype and size, and a large float32 add (read 2, write 1) on the
    first jax device; stores the result unless `store` is False."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    samples = []
    matmul = jax.jit(lambda a, b: a @ b)
    for dtype in dtypes:
        for n in sizes:
            a = jax.device_put(jnp.ones((n, n), dtype), device)
            b = jax.device_put(jnp.full((n, n), 0.5, dtype), device)
            seconds = _best_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
            samples.append(MatmulSample(dtype=dtype, size=n, flops_per_s=2 * n**3 / seconds))
    count = bandwidth_bytes // 4
    x = jax.device_put(jnp.ones((count,), jnp.float32), device)
    y = jax.device_put(jnp.full((count,), 2.0, jnp.float32), device)
    add = jax.jit(lambda x, y: x + y)
    seconds = _best_seconds(lambda: add(x, y).block_until_ready(), repeats)
    cal = Calibration(
        platform=device.platform, device_kind=device.device_kind, num_devices=jax.device_count(),
        matmul=tuple(samples), memory_bandwidth=3 * count * 4 / seconds, jax_version=jax.__version__,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    if store:
        save(cal, path)
    return cal
