"""Which kernel serves a mixture of experts' grouped matmul on TPU and with which tiles, and how many slots the
einsum dispatch gives each expert, in plain Python: the model (models/layers/moe.py), perfmodel and the spec's checks
decide by these rules."""

from __future__ import annotations

import math

# MaxText's megablox tiles (configs/base.yml wi_tile_* / wo_tile_*: 512 rows, 1024 wide), clipped to the matmul
MEGABLOX_TILES = (512, 1024, 1024)


def megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int] | None:
    """The megablox kernel's (rows, contraction, output) tiles for an m x k by k x n group matmul: the row tile must
    divide m and every tile be a multiple of 128 (the TPU's lanes); None where the shapes allow none (the model then
    runs jax.lax.ragged_dot)."""
    tm = next((t for t in (MEGABLOX_TILES[0], 256, 128) if m % t == 0), None)
    tk, tn = (min(tile, (dim // 128) * 128) for tile, dim in zip(MEGABLOX_TILES[1:], (k, n)))
    return None if tm is None or tk < 128 or tn < 128 else (tm, tk, tn)


def capacity(L: int, K: int, E: int, capacity_factor: float) -> int:
    """An expert's capacity C per sequence of L tokens (MaxText's dense dispatch): its even share L K / E times the
    capacity factor, rounded up, within [1, L]; L (nothing dropped) when dropless (capacity_factor <= 0)."""
    if capacity_factor <= 0:
        return L
    return max(1, min(L, math.ceil(L * K / E * capacity_factor)))
