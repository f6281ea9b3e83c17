"""Host memory and CPUs of one compile: what a cluster's compile task declares to Ray (maxperf.search.cluster), so that
a node never runs more compiles than its memory holds.

Measured by bench/compile_host_memory.py (2026-11-27, jax 0.12.0.1, libtpu 0.0.52, the CUDA 12 plugin; 13 whole
`maxperf compile` processes with a fresh compile cache, their peak RSS):
- CPU and GPU targets: 0.63-0.71 GiB whatever the model (cpu-1 tiny 0.66, cpu-8 scaled-1 0.71, h100-8 tiny and
  llama2-7b 0.63).
- TPU targets with scanned layers: 0.77 GiB for tiny, growing with the model's parameters by about 0.1 GiB per
  doubling above 1e8: scaled-1 1.21 (1.30 on v5p-1024), llama2-7b 1.23, mixtral-8x7b 1.62, llama3.1-405b 1.74.
- Unscanned layers (scan_layers=false), each its own copy in the program: 16 layers of tiny 1.83 GiB (+0.07 a
  layer), of scaled-1 3.24 (+0.13 a layer).
The estimate, MARGIN x (BASE_BYTES + PER_DOUBLING_BYTES x log2(1 + parameters / 1e8) on TPU + PER_LAYER_BYTES x
unscanned layers), is above every measured peak (1.11x to 1.97x of it).
"""

from __future__ import annotations

import math

from maxperf.spec.params import param_arrays

GIB = 1 << 30
SOURCE = "search.host_memory, from bench/compile_host_memory.py"
CPUS_PER_COMPILE = 2  # XLA's backend passes use a second core for part of a compile
DEFAULT_BYTES = 3 * GIB  # a user's step, whose size maxperf does not know before it is built
BASE_BYTES = {"cpu": 0.7 * GIB, "tpu": 0.8 * GIB, "gpu": 0.7 * GIB}
PER_DOUBLING_BYTES = {"tpu": 0.1 * GIB}
PER_LAYER_BYTES = 0.13 * GIB
MARGIN = 1.25


def compile_host_bytes(request) -> int:
    """Peak host bytes of one compile of `request` (a spec.Request; None: a user's step)."""
    if request is None:
        return int(DEFAULT_BYTES)
    model, platform = request.configs.model, request.topology.platform
    params = sum(math.prod(x.shape) * x.count for x in param_arrays(model))
    unscanned = 0 if request.configs.train.scan_layers else model.num_layers
    need = (BASE_BYTES[platform] + PER_DOUBLING_BYTES.get(platform, 0.0) * math.log2(1 + params / 1e8)
            + PER_LAYER_BYTES * unscanned)
    return int(MARGIN * need)
