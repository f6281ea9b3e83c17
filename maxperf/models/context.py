"""Context parallelism as MaxText runs it by default (context_parallel_strategy=all_gather): the sequence split over
the `sequence` mesh axis (MaxText's `context`) everywhere, attention included, each device's queries against the
keys and values gathered whole. A causal mask leaves the first shard little to do and the last the most, so with
`context_parallel_load_balance` (MaxText's default) the step reorders each sequence first (MaxText's DUAL_CHUNK_SWAP,
max_utils.reorder_sequence): cut into 2 x cp chunks, shard i holds chunks i and 2 cp - 1 - i, and every shard
attends to as many keys. Tokens, targets and positions move together, so RoPE and the loss see the same tokens; the
attention kernels know each query's place in the sequence (`query_ids`) and put the gathered keys back in order."""

from __future__ import annotations

import functools

import jax
import numpy as np

from maxperf.models.sharding import mesh_axes_for

LENGTH = ("activation_length",)


def shards(L: int) -> tuple[tuple[str, ...], int]:
    """The mesh axes that split a sequence of L tokens under the current mesh (jax.set_mesh), and their product."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    sizes = dict(mesh.shape)
    entry = mesh_axes_for((L,), LENGTH, sizes)[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return axes, int(np.prod([sizes[a] for a in axes])) if axes else 1


@functools.lru_cache(maxsize=64)
def balanced_order(L: int, cp: int) -> np.ndarray:
    """For each position of the reordered sequence, the token of the original one it holds: shard i's L / cp
    positions hold chunk i then chunk 2 cp - 1 - i of the 2 cp chunks of L / (2 cp) tokens."""
    if L % (2 * cp):
        raise ValueError(f"a load-balanced context split of {cp} needs L a multiple of {2 * cp}, got {L}")
    chunks = np.arange(L).reshape(2 * cp, L // (2 * cp))
    order = np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])
    order.flags.writeable = False
    return order


def query_ids(L: int, cp: int, balanced: bool) -> np.ndarray:
    """Each position's token in the original sequence (`balanced_order`, or the identity)."""
    return balanced_order(L, cp) if balanced and cp > 1 else np.arange(L)


def reorder(x_BxL: jax.Array, cp: int) -> jax.Array:
    """A [B, L, ...] batch array in the balanced order."""
    return x_BxL[:, balanced_order(x_BxL.shape[1], cp)]


def restore(x_BxLx: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """The inverse of `reorder` along `axis`: the gathered keys and values back in sequence order."""
    return jax.numpy.take(x_BxLx, np.argsort(balanced_order(x_BxLx.shape[axis], cp)), axis=axis)
