"""Parameters that carry the logical names of their axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, *, fan_in: int | None = None,
          init: str = "normal", gain: float = 1.0) -> nnx.Param:
    """A parameter initialized by fan-in scaled normals times `gain` (or ones/zeros), tagged with its logical axes."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        std = gain * (fan_in or shape[0]) ** -0.5
        value = (std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=logical)


def cast(p: nnx.Param, dtype) -> jax.Array:
    return p[...].astype(dtype)
