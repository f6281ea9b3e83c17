"""How long maxperf's quick paths take, printed beside the figure each used to be held to by a test's wall clock
(tests on a shared 2-core machine time noise, not maxperf; here the figures are read, not asserted).

    .venv/bin/python bench/quick_paths.py

  estimate, 405b      perfmodel.estimate of llama3.1-405b on a full v5p pod (8960 chips)        was held to 0.1 s
  estimate, presets   perfmodel.estimate of every preset on v5p-512                             was held to 2 s
  gpu specs           finding the GPU target specs in the CUDA plugin (first scan in a process)  was held to 2 s
  abstract 405b       llama3.1-405b's abstract train state over 512 stand-in devices (jax)       was held to 10 s
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@dataclass(frozen=True)
class V5p:  # perfmodel's TopologyShape, without maxperf.aot
    chips: int
    torus: tuple[int, ...]
    chip: str = "tpu-v5p"
    chips_per_host: int = 4
    num_slices: int = 1

    @property
    def hosts(self) -> int:
        return self.chips // 4


def timed(label: str, held_to: float, fn) -> None:
    start = time.perf_counter()
    note = fn()
    seconds = time.perf_counter() - start
    print(f"{label:<18} {seconds:>8.3f} s   (was held to {held_to:g} s){'  ' + note if note else ''}", flush=True)


def main() -> int:
    from maxperf.models import presets
    from maxperf.models.config import TrainConfig
    from maxperf.perfmodel import estimate

    train = TrainConfig(per_device_batch_size=2, seq_len=2048)
    timed("estimate, 405b", 0.1, lambda: estimate(presets.get("llama3.1-405b"), TrainConfig(seq_len=8192),
                                                    {"fsdp": 1120, "tensor": 8}, {}, V5p(8960, (16, 20, 28))) and "")
    timed("estimate, presets", 2.0, lambda: f"{sum(1 for name in presets.names() if estimate(
        presets.get(name), train, {'fsdp': 256}, {}, V5p(256, (4, 8, 8))))} presets")

    from maxperf.aot import gpu_targets

    if gpu_targets.plugin_library() is None:
        print("gpu specs          skipped: the CUDA plugin is not installed (maxperf[gpu])")
    else:
        timed("gpu specs", 2.0, lambda: f"{len(gpu_targets.embedded_targets())} specs")

    import jax
    import numpy as np

    from maxperf.models import train_step
    from maxperf.models.sharding import make_mesh
    from maxperf.plan import plan

    p = plan("v5p-1024", "llama3.1-405b")  # 512 chips: stand-in devices, shapes only, never placed
    mesh = make_mesh(np.array(jax.devices() * 512)[:512], p.mesh_shape.axes)
    timed("abstract 405b", 10.0,
          lambda: f"{train_step.abstract_step(p.model, p.configs.train, mesh).param_count / 1e9:.1f}B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
