"""The residual stream's tensors that a remat policy offloads to host memory, written there in the layout the backward
reads them in.

XLA cannot change a layout in host memory. Where the forward produces a residual-stream tensor ([B, L, D]) in one
layout and the backward consumes it in another, TPU's layout assignment leaves the stacked host buffer in the
forward's and, between the forward and backward loops, copies the whole stack to the device, transposes it there and
copies it back: llama3.1-8b on v6e-256 with Trillium's recipe (decoder_layer_input and out_proj offloaded, batch 4 x
8192) moved four 8.6 GB stacks over the host link and held one on the device. Pinned to the row-major layout that the
backward's matmuls, which contract over D, read, the offloaded tensor is written to host memory once, in the layout
it is read back in: that step's compiler memory 28.21 GiB per device before, 12.73 after (9.28 analytical), its step
time read from the HLO 6.44 s before, 5.34 after (4.60 analytical, 4.55 published). Tensors that stay on the device,
and every tensor on steps without offloading, keep the layouts XLA chooses."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

# Checkpoint names of the residual stream's [B, L, D] tensors: the layer's input, attention's output projection and the
# MLP's (and the experts') down projection
RESIDUAL_NAMES = frozenset({"decoder_layer_input", "out_proj", "mlpwo"})

_OFFLOADED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("maxperf_offloaded", default=frozenset())


@contextlib.contextmanager
def offloading(names: Iterable[str]) -> Iterator[None]:
    """Within it, the layers traced offload the tensors named `names` (a remat policy's offloaded names)."""
    token = _OFFLOADED.set(frozenset(names))
    try:
        yield
    finally:
        _OFFLOADED.reset(token)


def residual(x: jax.Array, name: str) -> jax.Array:
    """checkpoint_name(x, name) for a residual-stream tensor, pinned to the row-major layout where it is offloaded."""
    if name in _OFFLOADED.get():
        x = with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))
    return checkpoint_name(x, name)
