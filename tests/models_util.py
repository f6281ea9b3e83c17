"""Small helpers shared by the model tests: tiny configs, meshes over this process's CPU devices."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.aot import targets
from maxperf.models import train_step
from maxperf.spec import overrides, presets
from maxperf.spec import topology as topologies
from maxperf.spec.mesh import Mesh
from maxperf.spec.mesh import resolve as resolve_mesh


def cpu_mesh(sizes, devices=None):
    """A jax mesh over this process's CPU devices (`devices`, else the first ones), from a spec Mesh or axis sizes."""
    mesh = sizes if isinstance(sizes, Mesh) else Mesh.of(sizes)
    n = math.prod(mesh.axes.values())
    return targets.jax_mesh(topologies.get(f"cpu-{n}"), mesh, list(jax.devices()[:n] if devices is None else devices))


def tiny(*words: str, devices: int = 8, preset: str = "tiny"):
    """A tiny preset in float32 with the given overrides, and its abstract step over the first `devices` CPU
    devices."""
    cfg = overrides.apply(
        presets.get(preset),
        ["seq_len=16", "per_device_batch_size=2", "compute_dtype=float32", "warmup_steps=0", *words],
    )
    mesh = cpu_mesh(resolve_mesh(cfg.parallelism, topologies.get(f"cpu-{devices}")), jax.devices()[:devices])
    return cfg, train_step.abstract_step(cfg.model, cfg.train, mesh)


def loss_and_grads(*words: str, preset: str = "tiny", perturb=None):
    """A tiny model's mean next-token loss on one seeded batch, and its gradients, on one device; `perturb` (params ->
    params), where given, changes the initial parameters first."""
    cfg, spec = tiny(*words, devices=1, preset=preset)
    params = train_step.init_state(spec, seed=0)["params"]
    if perturb is not None:
        params = perturb(params)
    batch = jax.device_get(train_step.synthetic_batch(spec, seed=1))
    graphdef = train_step.model_def(cfg.model, cfg.train).graphdef

    def loss(params):
        positions = jnp.broadcast_to(jnp.arange(cfg.train.seq_len, dtype=jnp.int32), batch["inputs"].shape)
        logits = nnx.merge(graphdef, params)(batch["inputs"], positions)
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1))

    return jax.jit(jax.value_and_grad(loss))(params)


def two_step_losses(spec, batch_np) -> tuple[float, float]:
    """The losses of two jitted steps of `spec` on the same batch (numpy arrays, placed as the step shards them)."""
    step = train_step.jit_step(spec)
    state = train_step.init_state(spec, seed=0)
    batch = jax.device_put({k: jnp.asarray(v) for k, v in batch_np.items()}, spec.batch_shardings)
    with jax.set_mesh(spec.mesh):
        state, m1 = step(state, batch)
        _, m2 = step(state, batch)
    return float(m1["loss"]), float(m2["loss"])


def train_losses(spec, steps: int) -> tuple[list[float], dict]:
    """The loss after each of `steps` jitted steps of `spec` on one seeded synthetic batch, and the last step's
    metrics."""
    step = train_step.jit_step(spec)
    state = train_step.init_state(spec, seed=0)
    batch = train_step.synthetic_batch(spec, seed=1)
    losses = []
    with jax.set_mesh(spec.mesh):
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, metrics
