"""Small helpers shared by the model tests: tiny configs, meshes over this process's CPU devices."""

import jax

from maxperf.models import overrides, presets, train_step
from maxperf.aot import topologies
from maxperf.models.sharding import make_mesh
from maxperf.plan import resolve_mesh


def tiny(*words: str, devices: int = 8):
    """The tiny preset in float32 with the given overrides, and a mesh over the first `devices` CPU devices."""
    cfg = overrides.apply(
        presets.get("tiny"),
        ["seq_len=16", "per_device_batch_size=2", "compute_dtype=float32", "warmup_steps=0", *words],
    )
    mesh = make_mesh(jax.devices()[:devices], resolve_mesh(cfg.parallelism, topologies.get(f"cpu-{devices}")).axes)
    return cfg, train_step.abstract_step(cfg.model, cfg.train, mesh)
