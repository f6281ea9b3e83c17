"""`maxperf calibrate`: measure this machine's jax devices (matmul FLOP/s by dtype, size and thinness, memory
bandwidth, transposing copies, fused elementwise work, the cost of first touching new memory, collective bandwidth
and fixed cost) for perfmodel.

The result is stored as JSON in the user's cache (maxperf.user_cache.calibration_path()); commands load it from
there (maxperf.user_cache.calibration_for) and pass it to perfmodel, which gives the "cpu" chip its measured peaks.
jax is imported inside `calibrate`, so importing this module stays cheap.
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from maxperf.perfmodel.calibration import THIN_SIDES, AttentionSample, Calibration, MatmulSample
from maxperf.perfmodel.cpu import FRESH_MAPPING_THRESHOLD
from maxperf.user_cache import save_calibration

MATMUL_SIZES = (256, 512, 1024)
# thin matmuls: one side this short (head dimensions, narrow models), the other two THIN_SIZE
THIN_WIDTHS = (16, 32, 64, 128, 256)
THIN_SIZE = 1024
DTYPES = ("float32", "bfloat16")
# Per device: large enough to leave the L2 caches; a reduction reads it without allocating a fresh output, whose
# first-touch page faults would be measured instead of bandwidth.
BANDWIDTH_BYTES = 128 * 2**20
# Per device, above glibc's largest dynamic mmap threshold (steptime.FRESH_MAPPING_THRESHOLD): a buffer this large
# is mapped fresh by every allocation, so its first writes fault each page in.
PAGE_FAULT_BYTES = 4 * FRESH_MAPPING_THRESHOLD
# The all-gathered array (all devices' shards together) and the all-reduced array per device: below the mmap
# threshold, so that outputs reuse memory already mapped and the page faults measured above are not counted twice.
COLLECTIVE_BYTES = FRESH_MAPPING_THRESHOLD // 2
# A float32 square matrix per device, transposed by a copy fused with an elementwise op (as XLA:CPU fuses the slices
# and casts that transpose a step's weight shards; a bare transpose runs several times faster): below the mmap
# threshold too, for the same reason.
TRANSPOSE_SIDE = math.isqrt(FRESH_MAPPING_THRESHOLD // 2 // 4)
# Fused elementwise work: a softmax over float32 rows of ELEMENTWISE_ROW, written in bfloat16, as a step's attention
# writes its probabilities (a max, exponentials, a sum and a divide in one kernel; on XLA:CPU it ran at about half
# the rate of the plain sum that measures bandwidth). Per device, below the mmap threshold for the reason above.
ELEMENTWISE_BYTES = FRESH_MAPPING_THRESHOLD // 2
ELEMENTWISE_ROW = 512
# A whole causal attention, forward and backward, per dtype with float32 scores, laid out as maxperf.models lays it
# out (examples, kv heads, query heads per kv head, length, head dim), at each of these head dimensions. XLA:CPU fuses
# the softmax's backward into the matmul that feeds it, a kernel several times slower than the matmul alone (traced
# in cpu-2 steps of tiny and qwen3-0.6b); measured whole, that cost is in the rate. Per device: the scores stay
# below the mmap threshold, so that first-touch page faults (counted apart) stay out of it. One length: the scores'
# share of the work, and so the rate, is alike at every length; at long ones the scores leave the caches, which
# this rate does not see.
ATTENTION_HEAD_DIMS = (16, 64, 128)
ATTENTION_SHAPE = (2, 4, 2, 256)  # examples, kv heads, query heads per kv head, length
# The fixed cost of a collective: a chain of this many small matmuls, each followed by an all-reduce of one number
# (so the devices meet as a step's collectives make them), against the same chain without the all-reduces. Long,
# as a train step's program is (about 570 operations per device in a cpu-2 step of tiny): on a 2-core machine with 2
# devices, chains of 32 measured about 20 us per all-reduce, chains of 128 to 512 a steady 75-85 us.
LATENCY_CHAIN = 256
LATENCY_SHAPE = (128, 64)  # float32 rows x width of the chain's activations; its matmuls are width x width
REPEATS = 5


def _typical_seconds(fn: Callable[..., object], repeats: int, make: Callable[[], object] | None = None) -> float:
    """The median of `repeats` timed runs after one warm-up (compile) run: a step's operations run under a typical
    run's conditions, not the luckiest one's (on a shared 2-core machine the fastest of 5 runs of a 1024 cubed
    matmul read up to 1.8 times its median). With `make`, each run gets a new input from it, built untimed (for an
    `fn` that consumes its input: donated buffers)."""
    args = (lambda: ()) if make is None else (lambda: (make(),))
    fn(*args())
    times = []
    for _ in range(repeats):
        inputs = args()
        t0 = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(*, sizes: Sequence[int] = MATMUL_SIZES, dtypes: Sequence[str] = DTYPES,
              thin_widths: Sequence[int] = THIN_WIDTHS, thin_size: int = THIN_SIZE,
              bandwidth_bytes: int = BANDWIDTH_BYTES, page_fault_bytes: int = PAGE_FAULT_BYTES,
              collective_bytes: int = COLLECTIVE_BYTES, transpose_side: int = TRANSPOSE_SIDE,
              elementwise_bytes: int = ELEMENTWISE_BYTES, attention_head_dims: Sequence[int] = ATTENTION_HEAD_DIMS,
              attention_shape: tuple[int, int, int, int] = ATTENTION_SHAPE,
              latency_chain: int = LATENCY_CHAIN, repeats: int = REPEATS, store: bool = True,
              path: Path | None = None) -> Calibration:
    """Runs every measurement on all of the process's devices at once, as a train step's SPMD program does, and
    stores the result unless `store` is False: square matmuls (2 n^3 FLOPs each) per dtype and size, and thin
    ones (one side of each thin width, the others thin_size); a sum over a float32 array (bandwidth_bytes per
    device); an add into a new array against the same add into its donated input (page_fault_bytes per device),
    whose difference is the cost of faulting in new pages; a fused copy that transposes a transpose_side square
    float32 matrix; a softmax over elementwise_bytes of float32 rows per device, written in bfloat16; a causal
    attention's forward and backward (attention_shape per device) per dtype at each of attention_head_dims; an
    all-gather of a collective_bytes float32 array and an all-reduce of one of collective_bytes per device; and what
    an all-reduce of one number adds between dependent small matmuls (latency_chain of them). Each is timed as the
    median of `repeats` runs."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.local_devices()
    d = len(devices)
    mesh = Mesh(devices, ("d",))
    sharded = NamedSharding(mesh, PartitionSpec("d"))

    def put(shape, dtype, value):
        return jax.device_put(jnp.full(shape, value, dtype), sharded).block_until_ready()

    if thin_widths and thin_size not in sizes:
        raise ValueError(f"thin matmuls are compared with a square one of thin_size {thin_size}: add it to sizes")
    matmul = jax.jit(lambda a, b: jnp.einsum("dij,djk->dik", a, b))  # one matmul per device
    samples = []
    for dtype in dtypes:
        for n in sizes:
            a, b = put((d, n, n), dtype, 1.0), put((d, n, n), dtype, 0.5)
            seconds = _typical_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
            samples.append(MatmulSample(dtype=dtype, size=n, flops_per_s=d * 2 * n**3 / seconds))
        n = thin_size
        for m in thin_widths:
            for side in THIN_SIDES:
                rows, inner, cols = (m if side == "m" else n), (m if side == "k" else n), (m if side == "n" else n)
                a, b = put((d, rows, inner), dtype, 1.0), put((d, inner, cols), dtype, 0.5)
                seconds = _typical_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
                samples.append(MatmulSample(dtype=dtype, size=n, flops_per_s=d * 2 * n * n * m / seconds, thin=m,
                                            side=side))
    count = bandwidth_bytes // 4
    summed = put((d, count), jnp.float32, 1.0)
    total = jax.jit(lambda x: jnp.sum(x, axis=1))
    seconds = _typical_seconds(lambda a=summed: total(a).block_until_ready(), repeats)
    bandwidth = d * count * 4 / seconds
    del summed
    count = page_fault_bytes // 4
    fresh = jax.jit(lambda x: x + 1.0)
    in_place = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    kept = put((d, count), jnp.float32, 1.0)
    fresh_s = _typical_seconds(lambda a=kept: fresh(a).block_until_ready(), repeats)
    del kept
    in_place_s = _typical_seconds(lambda x: in_place(x).block_until_ready(), repeats,
                                  make=lambda: put((d, count), jnp.float32, 1.0))
    # None where new memory costs nothing measurable (an allocator that reuses mapped memory)
    page_fault = d * count * 4 / (fresh_s - in_place_s) if fresh_s > 1.05 * in_place_s else None
    n = transpose_side
    square = put((d, n, n), jnp.float32, 1.0)
    transpose = jax.jit(lambda x: jnp.swapaxes(x, 1, 2) * 2.0)
    seconds = _typical_seconds(lambda a=square: transpose(a).block_until_ready(), repeats)
    transposed = d * 2 * n * n * 4 / seconds  # read and written
    del square
    rows = max(1, elementwise_bytes // 4 // ELEMENTWISE_ROW)
    rows_in = put((d, rows, ELEMENTWISE_ROW), jnp.float32, 1.0)
    softmax = jax.jit(lambda x: jax.nn.softmax(x, axis=-1).astype(jnp.bfloat16))
    seconds = _typical_seconds(lambda a=rows_in: softmax(a).block_until_ready(), repeats)
    elementwise = d * rows * ELEMENTWISE_ROW * (4 + 2) / seconds  # float32 read, bfloat16 written
    del rows_in
    attention = tuple(_attention(mesh, put, dtype, head_dim, attention_shape, repeats)
                      for dtype in dtypes for head_dim in attention_head_dims)
    collective = all_reduce = latency = None
    if d > 1:
        y = put((collective_bytes // 4,), jnp.float32, 1.0)
        gather = jax.jit(lambda y: y, out_shardings=NamedSharding(mesh, PartitionSpec()))
        seconds = _typical_seconds(lambda: gather(y).block_until_ready(), repeats)
        # a ring all-gather moves (d-1)/d of the array through each device's link (perfmodel.network); summed over
        # the d devices, as every rate here is
        collective = (d - 1) * collective_bytes / seconds
        z = put((d, collective_bytes // 4), jnp.float32, 1.0)
        psum = jax.jit(jax.shard_map(lambda z: lax.psum(z, "d"), mesh=mesh, in_specs=PartitionSpec("d"),
                                     out_specs=PartitionSpec("d")))
        seconds = _typical_seconds(lambda: psum(z).block_until_ready(), repeats)
        all_reduce = 2 * (d - 1) * collective_bytes / seconds  # 2(d-1)/d of the array per link, summed over d
        latency = _collective_latency(mesh, put, latency_chain, repeats)
    cal = Calibration(
        platform=devices[0].platform, device_kind=devices[0].device_kind, num_devices=d, matmul=tuple(samples),
        memory_bandwidth=bandwidth, collective_bandwidth=collective, all_reduce_bandwidth=all_reduce,
        page_fault_bandwidth=page_fault, transpose_bandwidth=transposed, elementwise_bandwidth=elementwise,
        attention=attention, collective_latency=latency, jax_version=jax.__version__,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    if store:
        save_calibration(cal, path)
    return cal


def _collective_latency(mesh, put: Callable[..., object], chain: int, repeats: int) -> float:
    """Seconds per all-reduce of one number placed between dependent small matmuls on every device: the chain with
    the all-reduces against the same chain adding a local number instead; never below zero."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec

    rows, width = LATENCY_SHAPE
    d = mesh.size

    def program(meet: bool):
        def body(x, w):
            for _ in range(chain):
                x = jnp.tanh(x @ w)
                corner = x[:1, :1]
                x = x + (lax.psum(corner, "d") if meet else corner)
            return x
        spec = PartitionSpec("d")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))

    x = put((d * rows, width), jnp.float32, 0.01)
    w = put((d * width, width), jnp.float32, 0.01)
    with_meets, without = program(True), program(False)
    met = _typical_seconds(lambda: with_meets(x, w).block_until_ready(), repeats)
    alone = _typical_seconds(lambda: without(x, w).block_until_ready(), repeats)
    return max(0.0, (met - alone) / chain)


def _attention(mesh, put: Callable[..., object], dtype: str, head_dim: int, shape: tuple[int, int, int, int],
               repeats: int) -> AttentionSample:
    """A causal attention's forward and backward on every device, as model FLOPs per second (all L x L scores). The
    output is returned with the gradients, so that the forward's context matmul is not dropped as dead code."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    B, K, G, L = shape
    d = mesh.size

    def attend(q, k, v):
        s = jnp.einsum("BLKGd,BSKd->BKGLS", q, k, preferred_element_type=jnp.float32)
        s = jnp.where(jnp.tril(jnp.ones((L, L), bool))[None, None, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        return jnp.einsum("BKGLS,BSKd->BLKGd", p, v)

    def forward_and_backward(q, k, v, do):
        out, backward = jax.vjp(attend, q, k, v)
        return out, *backward(do)

    spec = PartitionSpec("d")
    step = jax.jit(jax.shard_map(forward_and_backward, mesh=mesh, in_specs=spec, out_specs=spec))
    q, do = (put((d * B, L, K, G, head_dim), dtype, 0.01) for _ in range(2))
    k, v = (put((d * B, L, K, head_dim), dtype, 0.01) for _ in range(2))
    seconds = _typical_seconds(lambda: jax.block_until_ready(step(q, k, v, do)), repeats)
    heads = B * K * G
    return AttentionSample(dtype=dtype, head_dim=head_dim, seq_len=L, heads=heads,
                           flops_per_s=d * 12 * L * L * head_dim * heads / seconds)
