"""Which kernel serves a mixture of experts' grouped matmul on TPU and with which tiles, and how many slots the
einsum dispatch gives each expert, in plain Python: the model (models/layers/moe.py), perfmodel and the spec's checks
decide by these rules."""

from __future__ import annotations

import math
from dataclasses import dataclass

# MaxText's megablox tiles (configs/base.yml wi_tile_* / wo_tile_*: 512 rows, 1024 wide), clipped to the matmul
MEGABLOX_TILES = (512, 1024, 1024)
# MaxText's keys for the grouped matmuls' tiles: for the experts' up and gate projections (wi) and their down
# projection (wo), for each of the three products the kernel runs (fwd: x @ W; dlhs: the input gradient dy @ W^T;
# drhs: the weight gradient x^T @ dy), the tile of the rows (batch_seq) and of the model's and the experts' widths
# (embed_dim, mlp_dim), whichever of the product's sides they are (layers/moe.py hands them to the kernel so)
GMM_WEIGHTS = ("wi", "wo")
GMM_PASSES = ("fwd", "dlhs", "drhs")
GMM_TILE_DIMS = ("batch_seq", "embed_dim", "mlp_dim")
GMM_TILE_KEYS = tuple(f"{w}_tile_{p}_{d}" for w in GMM_WEIGHTS for p in GMM_PASSES for d in GMM_TILE_DIMS)


def pass_tiles(train, weight: str, pass_: str) -> tuple[int, int, int]:
    """The (rows, K, N) tiles of one product of `weight`'s grouped matmul ("wi" or "wo"), K and N the forward's
    contraction and output (wi: the model's width and the experts'; wo: the other way round), read from the train
    config's wi_tile_* / wo_tile_* keys."""
    rows, embed, mlp = (getattr(train, f"{weight}_tile_{pass_}_{d}") for d in GMM_TILE_DIMS)
    return (rows, embed, mlp) if weight == "wi" else (rows, mlp, embed)


@dataclass(frozen=True)
class MegabloxTiles:
    """The tiles the megablox kernel runs the experts' grouped matmuls in: the forward's of the up and gate
    projections (wi) and of the down projection (wo), (rows, K, N) as `pass_tiles` gives them; jax's kernel runs its
    backward in the forward's tiles (MaxText's megablox path reads the forward's keys alone)."""

    wi: tuple[int, int, int] = MEGABLOX_TILES
    wo: tuple[int, int, int] = MEGABLOX_TILES

    @classmethod
    def from_train(cls, train) -> MegabloxTiles:
        return cls(pass_tiles(train, "wi", "fwd"), pass_tiles(train, "wo", "fwd"))


def megablox_tiling(m: int, k: int, n: int, tiles: tuple[int, int, int] = MEGABLOX_TILES
                    ) -> tuple[int, int, int] | None:
    """The megablox kernel's (rows, contraction, output) tiles for an m x k by k x n group matmul, from `tiles` (the
    forward's, `pass_tiles`): the row tile must divide m (the first of tiles' and the halvings down to 128 that
    does) and every tile be a multiple of 128 (the TPU's lanes), clipped to the matmul; None where the shapes allow
    none (the model then runs jax.lax.ragged_dot)."""
    tm = next((t for t in (tiles[0], *(t for t in (512, 256, 128) if t < tiles[0])) if m % t == 0), None)
    tk, tn = (min(tile, (dim // 128) * 128) for tile, dim in zip(tiles[1:], (k, n)))
    return None if tm is None or tk < 128 or tn < 128 else (tm, tk, tn)


def capacity(L: int, K: int, E: int, capacity_factor: float) -> int:
    """An expert's capacity C per sequence of L tokens (MaxText's dense dispatch): its even share L K / E times the
    capacity factor, rounded up, within [1, L]; L (nothing dropped) when dropless (capacity_factor <= 0)."""
    if capacity_factor <= 0:
        return L
    return max(1, min(L, math.ceil(L * K / E * capacity_factor)))
