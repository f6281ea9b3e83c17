"""`maxperf calibrate`: measure this machine's jax devices (matmul FLOP/s by dtype and operand layout, memory and
collective bandwidth) for perfmodel.

The result is stored as JSON in the user's cache (perfmodel.calibration.cache_dir()), where perfmodel reads it to
give the "cpu" chip measured peaks. jax is imported inside `calibrate`, so importing this module stays cheap.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from maxperf.perfmodel.calibration import FORMS, Calibration, MatmulSample, save

MATMUL_SIZES = (256, 512, 1024)
DTYPES = ("float32", "bfloat16")
# Per device: large enough to leave the L2 caches; a reduction reads it without allocating a fresh output, whose
# first-touch page faults would be measured instead of bandwidth.
BANDWIDTH_BYTES = 128 * 2**20
COLLECTIVE_BYTES = 32 * 2**20  # the all-gathered array, all devices' shards together
REPEATS = 5
_EINSUM = {"nn": "dij,djk->dik", "nt": "dij,dkj->dik", "tn": "dji,djk->dik"}


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
              bandwidth_bytes: int = BANDWIDTH_BYTES, collective_bytes: int = COLLECTIVE_BYTES,
              repeats: int = REPEATS, store: bool = True, path: Path | None = None) -> Calibration:
    """Runs every measurement on all of the process's devices at once, as a train step's SPMD program does, and
    stores the result unless `store` is False: square matmuls (2 n^3 FLOPs each) per dtype, form and size; a sum
    over a float32 array (bandwidth_bytes per device); and an all-gather of a collective_bytes float32 array."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.local_devices()
    d = len(devices)
    mesh = Mesh(devices, ("d",))
    sharded = NamedSharding(mesh, PartitionSpec("d"))

    def put(shape, dtype, value):
        return jax.device_put(jnp.full(shape, value, dtype), sharded)

    samples = []
    for dtype in dtypes:
        for n in sizes:
            a, b = put((d, n, n), dtype, 1.0), put((d, n, n), dtype, 0.5)
            for form in FORMS:
                matmul = jax.jit(lambda a, b, spec=_EINSUM[form]: jnp.einsum(spec, a, b))
                seconds = _best_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
                samples.append(MatmulSample(dtype=dtype, size=n, flops_per_s=d * 2 * n**3 / seconds, form=form))
    count = bandwidth_bytes // 4
    x = put((d, count), jnp.float32, 1.0)
    total = jax.jit(lambda x: jnp.sum(x, axis=1))
    seconds = _best_seconds(lambda: total(x).block_until_ready(), repeats)
    bandwidth = d * count * 4 / seconds
    collective = None
    if d > 1:
        y = put((collective_bytes // 4,), jnp.float32, 1.0)
        gather = jax.jit(lambda y: y, out_shardings=NamedSharding(mesh, PartitionSpec()))
        seconds = _best_seconds(lambda: gather(y).block_until_ready(), repeats)
        # a ring all-gather moves (d-1)/d of the array through each device's link (perfmodel.network); summed over
        # the d devices, as every rate here is
        collective = (d - 1) * collective_bytes / seconds
    cal = Calibration(
        platform=devices[0].platform, device_kind=devices[0].device_kind, num_devices=d, matmul=tuple(samples),
        memory_bandwidth=bandwidth, collective_bandwidth=collective, jax_version=jax.__version__,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    if store:
        save(cal, path)
    return cal
