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

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def timed(label: str, held_to: float, fn) -> None:
    start = time.perf_counter()
    note = fn()
    seconds = time.perf_counter() - start
    print(f"{label:<18} {seconds:>8.3f} s   (was held to {held_to:g} s){'  ' + note if note else ''}", flush=True)


def main() -> int:
    from maxperf.perfmodel import estimate
    from maxperf.spec import presets
    from maxperf.spec import topology as topologies
    from maxperf.spec.request import Request
    from maxperf.spec.train import TrainConfig

    train = TrainConfig(per_device_batch_size=2, seq_len=2048)
    big, pod = topologies.get("v5p-12288"), topologies.get("v5p-512")
    timed("estimate, 405b", 0.1, lambda: estimate(Request.of(big, presets.get("llama3.1-405b"), TrainConfig(
        seq_len=8192), {"fsdp": 768, "tensor": 8})) and "")
    timed("estimate, presets", 2.0, lambda: f"{sum(1 for name in presets.names() if estimate(Request.of(
        pod, presets.get(name), train, {'fsdp': 256})))} presets")

    from maxperf.spec import gpu_targets

    if gpu_targets.plugin_library() is None:
        print("gpu specs          skipped: the CUDA plugin is not installed (maxperf[gpu])")
    else:
        timed("gpu specs", 2.0, lambda: f"{len(gpu_targets.embedded_targets())} specs")

    import jax
    import numpy as np

    from maxperf.aot import targets
    from maxperf.models import train_step
    from maxperf.spec import resolve

    p = resolve("v5p-1024", "llama3.1-405b")  # 512 chips: stand-in devices, shapes only, never placed
    mesh = targets.jax_mesh(topologies.get("cpu-512"), p.mesh, list(np.array(jax.devices() * 512)[:512]))
    timed("abstract 405b", 10.0,
          lambda: f"{train_step.abstract_step(p.model, p.configs.train, mesh).param_count / 1e9:.1f}B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
