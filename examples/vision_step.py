"""A user's step through maxperf: a small convolutional image classifier (Flax NNX), trained with AdamW.

    maxperf compile --step examples.vision_step:make_step --topology v5p-256 per_device_batch=64
    maxperf compile --step examples.vision_step:make_step --topology h100-8x2 width=64
    maxperf compile --step examples.vision_step:make_step --topology cpu-8 --out artifacts/vision_cpu-8
    maxperf run artifacts/vision_cpu-8

`make_step(mesh, ...)` is the factory: maxperf calls it with the jax Mesh of the topology (its devices may be
compile-only TPUs or GPUs) and the `key=value` words of the command line, converted to the types of its parameters.
It returns a maxperf Step: the step function, its abstract arguments (nothing is allocated), which argument is
donated, the model FLOPs and images per step (for TFLOP/s, MFU and images/s), and how to make real arguments for
`maxperf run`.

The layout is plain data parallelism: the batch is split over every device of the mesh (all its axes together),
the parameters and optimizer state are replicated.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxperf.aot.user_step import Step


class Block(nnx.Module):
    """A residual stage: a strided 3x3 convolution to `out` channels, then a residual 3x3 convolution."""

    def __init__(self, channels: int, out: int, rngs: nnx.Rngs):
        self.down = nnx.Conv(channels, out, (3, 3), strides=(2, 2), rngs=rngs)
        self.norm = nnx.GroupNorm(out, num_groups=min(8, out), rngs=rngs)
        self.conv = nnx.Conv(out, out, (3, 3), rngs=rngs)

    def __call__(self, x_BxHxWxC):
        x_BxHxWxC = nnx.relu(self.norm(self.down(x_BxHxWxC)))
        return x_BxHxWxC + nnx.relu(self.conv(x_BxHxWxC))


class Classifier(nnx.Module):
    def __init__(self, channels: int, width: int, stages: int, classes: int, rngs: nnx.Rngs):
        self.stem = nnx.Conv(channels, width, (3, 3), rngs=rngs)
        self.blocks = nnx.List([Block(width * 2**i, width * 2 ** (i + 1), rngs) for i in range(stages)])
        self.head = nnx.Linear(width * 2**stages, classes, rngs=rngs)

    def __call__(self, x_BxHxWxC):
        x_BxHxWxC = nnx.relu(self.stem(x_BxHxWxC))
        for block in self.blocks:
            x_BxHxWxC = block(x_BxHxWxC)
        return self.head(jnp.mean(x_BxHxWxC, axis=(1, 2)))


def conv_flops(size: int, channels: int, width: int, stages: int, classes: int) -> float:
    """Forward multiply-adds x 2 of one image: each 3x3 convolution 2 x 9 x C_in x C_out per output pixel."""
    flops = 2 * 9 * channels * width * size * size
    c = width
    for _ in range(stages):
        size = math.ceil(size / 2)
        flops += 2 * 9 * c * 2 * c * size * size + 2 * 9 * 2 * c * 2 * c * size * size
        c *= 2
    return flops + 2 * c * classes


def make_step(mesh, per_device_batch: int = 32, image_size: int = 32, channels: int = 3, width: int = 32,
              stages: int = 2, classes: int = 10, learning_rate: float = 1e-3) -> Step:
    """The training step of `Classifier` over `mesh`: a batch of per_device_batch images per device."""
    devices = mesh.devices.size
    B, H = per_device_batch * devices, image_size
    optimizer = optax.adamw(learning_rate)

    def init_state(key):
        model = Classifier(channels, width, stages, classes, nnx.Rngs(params=key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": optimizer.init(params)}

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Classifier(channels, width, stages, classes, nnx.Rngs(0))))

    def loss_fn(params, images_BxHxWxC, labels_B):
        model = nnx.merge(graphdef, params)
        logits_BxV = model(images_BxHxWxC)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxV, labels_B).mean()

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch["images"], batch["labels"])
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"step": state["step"] + 1, "params": params, "opt": opt}, {"loss": loss}

    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(mesh.axis_names))  # the batch over every device
    abstract_state = jax.eval_shape(init_state, jax.random.key(0))
    state_shardings = jax.tree.map(lambda _: replicated, abstract_state)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state,
                         state_shardings)
    batch = {"images": jax.ShapeDtypeStruct((B, H, H, channels), jnp.float32, sharding=split),
             "labels": jax.ShapeDtypeStruct((B,), jnp.int32, sharding=split)}
    batch_shardings = {"images": split, "labels": split}

    def init(seed: int):
        """A fresh state and a batch of random images, placed with the step's shardings."""
        key = jax.random.key(seed)
        state_key, image_key, label_key = jax.random.split(key, 3)
        real_state = jax.jit(init_state, out_shardings=state_shardings)(state_key)
        make_batch = jax.jit(lambda k1, k2: {"images": jax.random.normal(k1, (B, H, H, channels)),
                                             "labels": jax.random.randint(k2, (B,), 0, classes)},
                             out_shardings=batch_shardings)
        return real_state, make_batch(image_key, label_key)

    return Step(
        fn=train_step, args=(state, batch), donate=(0,), out_shardings=(state_shardings, replicated),
        model_flops=3 * B * conv_flops(H, channels, width, stages, classes),  # forward + backward (2x forward)
        tokens_per_step=B, unit="images", init=init, loss=lambda out: out[1]["loss"],
    )
