"""Mixture-of-experts arithmetic: which layers route, how many expert rows a token costs as executed, and the
assumptions about routing that the step time rests on.

E experts of width Fe (MaxText's base_moe_mlp_dim), top-k routed per token, S shared experts of width Fe every token
passes through, a router gate D x E. Layer i is a MoE layer where the model's `moe_layers()` says so (MaxText's
first_num_dense_layers and interleave_moe_layer_step); the others keep the dense MLP of width F. Dispatch follows
maxperf's models/layers/moe.py, as MaxText's layers/moe.py: dropless with tokens sorted by expert and a grouped
matmul (sparse_matmul, the default), or sparse_matmul=false with one-hot dispatch and combine einsums over [E, C]
slots per sequence (capacity_factor > 0, tokens past C dropped; dropless, C = L).
"""

from __future__ import annotations

from dataclasses import dataclass

from maxperf.spec.errors import require
from maxperf.spec.grouped_matmul import capacity
from maxperf.spec.memo import per_model
from maxperf.spec.model import ModelConfig
from maxperf.spec.train import TrainConfig

# The busiest of the expert-parallel devices processes this many times the mean of the routed rows (dropless
# dispatch): the step waits for it, in its grouped matmuls and in the all-to-all it receives. An assumption: Switch
# Transformer (Fedus et al. 2022, sec. 2.2 and table 1) trains with capacity factors 1.0 to 1.25 and drops few tokens
# at 1.25, so the fullest expert holds about 1.25x its even share; DeepSeek-V3's bias-corrected routing (DeepSeek-AI
# 2024, sec. 2.1.2) keeps loads near balance too. Where `expert` is 1 every device runs all experts on its own tokens,
# so the rows per device are exactly tokens x top-k and no imbalance applies.
LOAD_IMBALANCE = 1.25
# Dropless dispatch moves each routed row through memory outside the matmuls: the sort gathers the tokens' rows into
# expert order (read and write) and the combine scatters the expert outputs back and sums them by their weights (read
# and write): 4 passes over tokens x top-k x D in the forward (counted from MaxText's permute/unpermute, assumed one
# HBM pass each); the backward, ELEMENTWISE_BACKWARD_FACTOR times that (perfmodel.steptime).
PERMUTE_PASSES = 4


@dataclass(frozen=True)
class MoeShape:
    E: int  # routed experts
    k: int  # experts per token (top-k)
    Fe: int  # each expert's hidden width
    S: int  # shared experts, each Fe wide
    moe_layers: int
    dense_layers: int
    router_bias: bool  # DeepSeek-V3's per-expert selection bias, a parameter of E


@per_model
def moe_shape(model: ModelConfig) -> MoeShape | None:
    """The model's mixture of experts, or None for a dense model (num_experts 1)."""
    if not model.is_moe:
        return None
    n_moe = sum(model.moe_layers())
    return MoeShape(E=model.num_experts, k=model.num_experts_per_tok, Fe=model.moe_mlp_dim, S=model.shared_experts,
                    moe_layers=n_moe, dense_layers=model.num_layers - n_moe, router_bias=model.routed_bias)


def routed_buffer_rows(moe: MoeShape, ep: int) -> float:
    """Rows per local token of the dropless receive buffer under expert parallelism, sized for the worst case so that
    no token is dropped however routing falls: from each of the ep devices, every token's assignments to this shard's
    E / ep experts, min(k, E / ep) of them (models/layers/moe.py _local_experts: ep x T min(k, E / ep) rows; MaxText's
    get_ragged_buffer_size sizes it alike, T k min(ep, E / k)); top-k without expert parallelism."""
    if ep <= 1:
        return float(moe.k)
    return ep * min(moe.k, moe.E / ep)


def capacity_factor(train: TrainConfig) -> float:
    """MaxText's capacity_factor: <= 0 (its -1 default) is dropless."""
    return train.capacity_factor


def dispatch(train: TrainConfig) -> str:
    """How tokens reach their experts (models/layers/moe.py): "sparse" (sparse_matmul, the default: dropless, tokens
    sorted by expert and multiplied by ragged_dot, exchanged by all-to-all between expert shards), "capacity"
    (sparse_matmul=false with capacity_factor > 0: one-hot dispatch and combine einsums over C slots per expert and
    sequence, tokens past them dropped) or "dense" (sparse_matmul=false, dropless: the same einsums with C = L)."""
    if train.sparse_matmul:
        return "sparse"
    return "capacity" if capacity_factor(train) > 0 else "dense"


def expert_capacity(moe: MoeShape, train: TrainConfig) -> int:
    """Slots C per expert and sequence of the einsum dispatch (models/layers/moe.py capacity): the even share
    L k / E times the capacity factor, rounded up, within [1, L]; L when dropless. (MaxText's generate_masks rounds
    the share up before the factor: int(max(ceil(L k / E) x cf, cf)).)"""
    return capacity(train.seq_len, moe.k, moe.E, capacity_factor(train))


def rows_per_token(moe: MoeShape, train: TrainConfig) -> float:
    """Routed-expert rows the hardware computes per token: top-k with the sorted dropless dispatch, E x C / L with
    the einsum dispatch (its empty slots included, its dropped tokens not)."""
    if dispatch(train) == "sparse":
        return float(moe.k)
    return moe.E * expert_capacity(moe, train) / train.seq_len


def load_imbalance(train: TrainConfig, expert_parallel: int, override: float | None = None) -> float:
    """How much more than the mean of the routed rows the busiest device computes: 1 without expert parallelism or
    with the einsum dispatch (fixed-size slots); else `override`, the train config's optional `moe_load_imbalance`, or
    LOAD_IMBALANCE."""
    if expert_parallel <= 1 or dispatch(train) != "sparse":
        return 1.0
    value = override if override is not None else train.moe_load_imbalance
    value = LOAD_IMBALANCE if value is None else float(value)
    require(value >= 1.0, f"the MoE load imbalance is the busiest device's rows over the mean, so >= 1; got {value}")
    return value
