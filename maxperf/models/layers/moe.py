"""Mixture of experts (Shazeer et al. 2017; Fedus et al. 2021, "Switch Transformers"): a router picks the top-k of E
experts for each token, each expert is a gated MLP of width F, and the picked experts' outputs are summed with the
router's weights; shared experts (DeepSeek-MoE, Llama 4) see every token. Llama 4's router instead scales each
token by its weight before the expert (`routed_input_scaling`); gpt-oss's experts carry biases (`mlp_bias`) and
a clamped SwiGLU.

T tokens (B x L flattened), E experts, K experts per token (top-k), F each expert's width, C an expert's capacity.

Dispatch, as MaxText chooses it (`sparse_matmul`, `capacity_factor`):
- dropless (capacity_factor=-1, sparse_matmul=true): each device sorts its own tokens by expert and multiplies them
  group by group with `jax.lax.ragged_dot`, inside `jax.shard_map`. With experts sharded over the `expert` mesh axis
  (expert parallelism), the sorted tokens go to the device holding their expert by `all_to_all` and come back the
  same way. The exchange buffers hold, for every expert shard, as many rows as one device's tokens could send it
  (T min(K, E / expert)): nothing is dropped.
- capacity (sparse_matmul=false): dense one-hot dispatch and combine einsums over [B, L, E, C]; an expert takes at
  most C = ceil(L K / E x capacity_factor) tokens of each sequence, in token order, and drops the rest (C = L when
  dropless). The partitioner moves tokens between expert shards.

Checkpoint names as MaxText gives them (layers/moe.py): the expert projections carry both MaxText's MLP names
(mlpwi_0, mlpwi_1, mlpwo) and its MoE ones (moe_mlpwi_0, moe_mlpwi_1, moe_mlpwo), so the remat policies save them;
but for the dropless path's up projection, which MaxText names moe_mlpwi_1 alone (its sparse_matmul branches), so
a policy that keeps mlpwi_1 (minimal, minimal_offloaded, custom mlpwi_1=) recomputes it there.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from maxperf.models.layers import offload, quantization
from maxperf.models.layers.mlp import _ACT, MLP, gate
from maxperf.models.layers.params import param
from maxperf.models.sharding import constrain, mesh_axes_for
from maxperf.spec.errors import MaxperfError
from maxperf.spec.grouped_matmul import MegabloxTiles, capacity, megablox_tiling
from maxperf.spec.model import Activation, ModelConfig, RoutedScoreFunc
from maxperf.spec.params import expert_axes
from maxperf.spec.train import TrainConfig

BATCH_TOKENS = ("activation_batch", "activation_length", None)


@dataclass(frozen=True)
class MoEOptions:
    """What the MoE layer needs of the train config: how tokens reach their experts."""

    capacity_factor: float = -1.0  # -1: dropless
    sparse_matmul: bool = True
    # on TPU, the Pallas megablox grouped matmul in these tiles (as MaxText); None, and elsewhere: ragged_dot
    megablox: MegabloxTiles | None = MegabloxTiles()
    # a layer with a selection bias records its experts' loads (`EXPERT_COUNTS`) for the step's bias update
    count_experts: bool = False

    @classmethod
    def from_train(cls, train: TrainConfig) -> MoEOptions:
        return cls(capacity_factor=train.capacity_factor, sparse_matmul=train.sparse_matmul,
                   megablox=MegabloxTiles.from_train(train) if train.megablox else None,
                   count_experts=train.routed_bias_update_rate > 0)


@dataclass(frozen=True)
class Routing:
    weights_TxK: jax.Array  # float32 combine weights of the picked experts
    experts_TxK: jax.Array  # int32 expert ids
    probs_TxE: jax.Array  # float32 router probabilities over all experts (each row sums to 1), for the aux loss


def route(logits_TxE: jax.Array, cfg: ModelConfig, bias_E: jax.Array | None = None) -> Routing:
    """Top-k routing as the models' reference code does it.

    softmax (Mixtral, Qwen3-MoE, gpt-oss) or sigmoid (DeepSeek-V3, Llama 4) scores. With softmax scores the bias is
    the router's own (gpt-oss), added to the logits; with sigmoid scores it is DeepSeek-V3's e_score_correction_bias,
    which like the group limit (the best `topk_routing_group` of `n_routing_groups` groups, a group scored by the sum
    of its two best experts; DeepSeek-V3's modeling code) steers the choice only (MaxText's GateLogit and
    get_topk do the same by model). The weights are the unbiased scores of the chosen experts, renormalized to sum to
    1 with norm_topk_prob, then multiplied by routed_scaling_factor."""
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    logits_TxE = logits_TxE.astype(jnp.float32)
    if bias_E is not None and cfg.routed_score_func is RoutedScoreFunc.SOFTMAX:
        logits_TxE = logits_TxE + bias_E.astype(jnp.float32).reshape((1,) * (logits_TxE.ndim - 1) + (E,))
        bias_E = None
    if cfg.routed_score_func is RoutedScoreFunc.SIGMOID:
        scores_TxE = jax.nn.sigmoid(logits_TxE)
        probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
    else:
        scores_TxE = probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    if bias_E is None and cfg.norm_topk_prob and cfg.routed_score_func is RoutedScoreFunc.SOFTMAX \
            and cfg.n_routing_groups == 0:
        # a softmax over the top-k logits, as Mixtral's reference code and MaxText's get_topk compute it: the same
        # weights as the renormalized top-k of the full softmax, with top_k's own gradient for the picked logits
        top_TxK, experts_TxK = jax.lax.top_k(logits_TxE, K)
        weights_TxK = jax.nn.softmax(top_TxK, axis=-1) * cfg.routed_scaling_factor
        return Routing(weights_TxK, experts_TxK.astype(jnp.int32), probs_TxE)
    if bias_E is None:
        choice_TxE = scores_TxE
    else:
        choice_TxE = scores_TxE + bias_E.astype(jnp.float32).reshape((1,) * (scores_TxE.ndim - 1) + (E,))
    choice_TxE = jax.lax.stop_gradient(choice_TxE)
    if cfg.n_routing_groups > 0:
        G = cfg.n_routing_groups
        grouped_TxGxS = choice_TxE.reshape(*choice_TxE.shape[:-1], G, E // G)
        best_TxGx2, _ = jax.lax.top_k(grouped_TxGxS, min(2, E // G))
        _, groups_TxR = jax.lax.top_k(jnp.sum(best_TxGx2, axis=-1), cfg.topk_routing_group)
        keep_TxG = jnp.sum(jax.nn.one_hot(groups_TxR, G, dtype=jnp.bool_), axis=-2, dtype=jnp.bool_)
        keep_TxE = jnp.repeat(keep_TxG, E // G, axis=-1)
        choice_TxE = jnp.where(keep_TxE, choice_TxE, -jnp.inf)
    _, experts_TxK = jax.lax.top_k(choice_TxE, K)
    weights_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
    if cfg.norm_topk_prob:
        weights_TxK = weights_TxK / (jnp.sum(weights_TxK, axis=-1, keepdims=True) + 1e-20)
    weights_TxK = weights_TxK * cfg.routed_scaling_factor
    return Routing(weights_TxK, experts_TxK.astype(jnp.int32), probs_TxE)


# The router attribute that holds a forward's expert loads (an nnx.Intermediate), beside its `bias`.
EXPERT_COUNTS = "expert_counts"


def expert_counts(experts_TxK: jax.Array, E: int) -> jax.Array:
    """int32 [E]: how many of the T x K assignments went to each expert (MaxText's calculate_expert_counts). Under
    jit this counts the whole global batch, however the tokens are sharded."""
    return jnp.sum(jax.nn.one_hot(experts_TxK.reshape(-1), E, dtype=jnp.int32), axis=0)


def bias_update(counts_E: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024, sec. 2.1.2; Wang et al. 2024): each expert's
    selection bias moves by `rate` towards balance, rate x sign(mean load - its load), as MaxText's
    load_balance_updates_from_counts computes it; loads of any leading shape [..., E] (a scanned stack's layers)."""
    counts_E = counts_E.astype(jnp.float32)
    mean = jnp.sum(counts_E, axis=-1, keepdims=True) / counts_E.shape[-1]
    return rate * jnp.sign(mean - counts_E)


def load_balance_loss(routing: Routing, E: int) -> jax.Array:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4): E sum_e f_e P_e, f_e the fraction of the
    T x K assignments that go to expert e, P_e the mean router probability of e; 1 when perfectly balanced."""
    K = routing.experts_TxK.shape[-1]
    counts_E = jnp.sum(jax.nn.one_hot(routing.experts_TxK, E, dtype=jnp.float32),
                       axis=tuple(range(routing.experts_TxK.ndim)))
    f_E = counts_E / (routing.experts_TxK.size // K * K)
    P_E = jnp.mean(routing.probs_TxE.reshape(-1, E), axis=0)
    return E * jnp.sum(f_E * P_E)


class Router(nnx.Module):
    def __init__(self, D: int, E: int, dtype, rngs: nnx.Rngs, bias: bool):
        self.kernel_DxE = param(rngs, (D, E), ("embed", None), dtype)
        if bias:  # named `bias` so that weight decay skips it (`route` says how each model uses it)
            self.bias = param(rngs, (E,), (None,), dtype, init="zeros")

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return quantization.einsum("BLD,DE->BLE", x_BxLxD, self.kernel_DxE[...].astype(x_BxLxD.dtype))


class MoE(nnx.Module):
    """The routed experts, and the shared experts where the model has them. Returns the output and the
    load-balancing loss of this layer's routing."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, options: MoEOptions = MoEOptions()):
        D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_mlp_dim
        self.cfg = cfg
        self.options = options
        self.router = Router(D, E, dtype, rngs, cfg.routed_bias)
        wi, wo = expert_axes(cfg)
        if cfg.activation.gated:
            self.wi_0_ExDxF = param(rngs, (E, D, F), wi, dtype, fan_in=D)
        self.wi_1_ExDxF = param(rngs, (E, D, F), wi, dtype, fan_in=D)
        self.wo_ExFxD = param(rngs, (E, F, D), wo, dtype, fan_in=F)
        if cfg.mlp_bias:
            if cfg.activation.gated:
                self.wi_0_bias_ExF = param(rngs, (E, F), ("exp", "mlp"), dtype, init="zeros")
            self.wi_1_bias_ExF = param(rngs, (E, F), ("exp", "mlp"), dtype, init="zeros")
            self.wo_bias_ExD = param(rngs, (E, D), ("exp", "embed"), dtype, init="zeros")
        if cfg.shared_experts:
            self.shared = MLP(D, cfg.shared_experts * F, cfg.activation, dtype, rngs, limit=cfg.mlp_activations_limit)

    def __call__(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, dtype = self.cfg, x_BxLxD.dtype
        bias = self.router.bias[...] if cfg.routed_bias else None
        routing = route(self.router(x_BxLxD), cfg, bias)
        aux = load_balance_loss(routing, cfg.num_experts)
        if cfg.routed_bias and self.options.count_experts:  # read and cleared by the Transformer (collect_counts)
            setattr(self.router, EXPERT_COUNTS, nnx.Intermediate(expert_counts(routing.experts_TxK, cfg.num_experts)))
        weights = (self.wi_0_ExDxF[...] if cfg.activation.gated else None, self.wi_1_ExDxF[...], self.wo_ExFxD[...])
        biases = None
        if cfg.mlp_bias:
            biases = tuple(None if b is None else b.astype(dtype) for b in (
                self.wi_0_bias_ExF[...] if cfg.activation.gated else None, self.wi_1_bias_ExF[...],
                self.wo_bias_ExD[...]))
        if self.options.sparse_matmul:
            out_BxLxD = sparse_dispatch(x_BxLxD, routing.experts_TxK, routing.weights_TxK, weights, cfg,
                                        megablox=self.options.megablox, biases=biases)
        else:
            weights = tuple(None if w is None else w.astype(dtype) for w in weights)
            out_BxLxD = dense_dispatch(x_BxLxD, routing.experts_TxK, routing.weights_TxK, weights, cfg,
                                       self.options.capacity_factor, biases=biases)
        if cfg.shared_experts:
            out_BxLxD = out_BxLxD + self.shared(x_BxLxD)
        return out_BxLxD, aux


def grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, tiles: tuple[int, int, int] | None) -> jax.Array:
    """Rows of `x_MxK` sorted by group times their group's weight. On TPU with megablox `tiles` (rows, K, N), jax's
    Pallas megablox kernel (MaxText's default there: `megablox=true`) where the shapes tile; else
    jax.lax.ragged_dot."""
    from maxperf.models.layers.attention_kernels import platform_of_mesh

    tiling = None if tiles is None else megablox_tiling(x_MxK.shape[0], x_MxK.shape[1], w_GxKxN.shape[2], tiles)
    if tiling is not None and platform_of_mesh() == "tpu":
        from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

        return megablox_ops.gmm(x_MxK, w_GxKxN, group_sizes_G.astype(jnp.int32), x_MxK.dtype, tiling)
    return jax.lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G)


@dataclass(frozen=True)
class ExpertBias:
    """gpt-oss's expert biases for rows sorted by expert: each row's expert (`ids_T`, local to the device), the
    biases of wi_0 (or None), wi_1 [E, F] and wo [E, D], and whether this device adds wo's (one tensor shard does)."""

    ids_T: jax.Array
    wi_0: jax.Array | None
    wi_1: jax.Array
    wo: jax.Array
    add_wo: jax.Array | bool = True

    def rows(self, b_ExN: jax.Array) -> jax.Array:
        return b_ExN[jnp.clip(self.ids_T, 0, b_ExN.shape[0] - 1)]


def _expert_mlp(x_TxD, group_sizes_E, weights, activation: Activation, megablox: MegabloxTiles | None = None,
                bias: ExpertBias | None = None, limit: float = 7.0):
    """The experts' gated MLP over tokens sorted by expert, `group_sizes_E` rows each (rows past them give 0, or
    with biases what the bias makes of them; no combine weight reads them)."""
    wi_0, wi_1, wo = weights
    h_TxF = grouped_matmul(x_TxD, wi_1, group_sizes_E, megablox and megablox.wi)
    if bias is not None:
        h_TxF = h_TxF + bias.rows(bias.wi_1)
    h_TxF = checkpoint_name(h_TxF, "moe_mlpwi_1")  # and not mlpwi_1, as MaxText's sparse_matmul path names it
    if wi_0 is not None:
        g_TxF = grouped_matmul(x_TxD, wi_0, group_sizes_E, megablox and megablox.wi)
        if bias is not None:
            g_TxF = g_TxF + bias.rows(bias.wi_0)
        g_TxF = checkpoint_name(checkpoint_name(g_TxF, "mlpwi_0"), "moe_mlpwi_0")
        h_TxF = gate(activation, g_TxF, h_TxF, limit)
    else:
        h_TxF = _ACT[activation](checkpoint_name(h_TxF, "mlpwi"))
    out_TxD = grouped_matmul(h_TxF, wo, group_sizes_E, megablox and megablox.wo)
    if bias is not None:
        out_TxD = out_TxD + bias.rows(bias.wo) * jnp.asarray(bias.add_wo, out_TxD.dtype)
    return checkpoint_name(offload.residual(out_TxD, "mlpwo"), "moe_mlpwo")


@jax.custom_vjp
def _permute(x_AxN: jax.Array, order_A: jax.Array, inverse_A: jax.Array) -> jax.Array:
    """Rows of `x_AxN` in the order `order_A`, a permutation whose inverse is `inverse_A`. Its gradient is the
    inverse permutation of the incoming one, a gather, where autodiff would scatter-add (MaxText's
    _sort_activations_custom, use_custom_sort_vjp=true: the TPU's scatter is slow and large)."""
    return x_AxN[order_A]


def _permute_fwd(x_AxN, order_A, inverse_A):
    return x_AxN[order_A], (order_A, inverse_A)


def _permute_bwd(residuals, g_AxN):
    order_A, inverse_A = residuals
    return g_AxN[inverse_A], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _counts(ids, n: int) -> jax.Array:
    """How many of `ids` equal each of 0..n-1 (ids outside are not counted)."""
    return jnp.sum(ids[:, None] == jnp.arange(n, dtype=ids.dtype)[None, :], axis=0, dtype=jnp.int32)


def _local_experts(x_TxD, experts_TxK, weights_TxK, weights, *, E: int, activation: Activation,
                   megablox: MegabloxTiles | None, ep_axis: str | None, ep: int, tensor_axis: str | None,
                   biases=None, scale_input: bool = False, limit: float = 7.0):
    """One device's routed experts over its own T tokens: sort the T x K assignments by expert and, with experts
    split over `ep` devices along `ep_axis`, exchange them with all_to_all so that each device multiplies the tokens
    of its E / ep experts. `biases`: the experts' (wi_0 or None, wi_1, wo) biases, local like the weights;
    `scale_input`: each assignment's weight multiplies the token before its expert and the outputs add with weight
    1 (Llama 4)."""
    T, D = x_TxD.shape
    K = experts_TxK.shape[-1]
    flat_A = experts_TxK.reshape(-1)  # A = T K assignments, token-major
    order_A = jnp.argsort(flat_A, stable=True)
    inverse_A = jnp.argsort(order_A)
    # each token repeated K times and the copies sorted, as MaxText's permute: the repeat's gradient is a sum
    x_AxD = _permute(jnp.repeat(x_TxD, K, axis=0), order_A, inverse_A)
    if scale_input:
        x_AxD = x_AxD * _permute(weights_TxK.reshape(-1), order_A, inverse_A)[:, None].astype(x_AxD.dtype)
        weights_TxK = jnp.ones_like(weights_TxK)
    e_A = flat_A[order_A]
    add_wo = True if tensor_axis is None else jax.lax.axis_index(tensor_axis) == 0  # wo's bias once, not per shard

    def bias_for(ids):
        return None if biases is None else ExpertBias(ids, *biases, add_wo=add_wo)

    if ep == 1:
        y_AxD = _expert_mlp(x_AxD, _counts(e_A, E), weights, activation, megablox, bias_for(e_A), limit)
    else:
        El, A = E // ep, T * K
        # a token sends at most min(K, El) of its assignments to one shard: a buffer of M = T min(K, El) rows for
        # each shard is dropless even if all of this device's tokens pick the same shard (MaxText's worst case)
        M = T * min(K, El)
        shard_A = e_A // El
        counts_S = _counts(shard_A, ep)
        slot_A = jnp.arange(A, dtype=jnp.int32) - (jnp.cumsum(counts_S) - counts_S)[shard_A]
        send_SxMxD = jnp.zeros((ep, M, D), x_AxD.dtype).at[shard_A, slot_A].set(x_AxD)
        send_SxM = jnp.full((ep, M), El, jnp.int32).at[shard_A, slot_A].set(e_A % El)  # El marks an empty row
        recv_SxMxD = jax.lax.all_to_all(send_SxMxD, ep_axis, 0, 0)
        recv_R = jax.lax.all_to_all(send_SxM, ep_axis, 0, 0).reshape(-1)  # R = ep M rows, from every source
        order_R = jnp.argsort(recv_R, stable=True)
        y_RxD = _expert_mlp(recv_SxMxD.reshape(ep * M, D)[order_R], _counts(recv_R, El), weights, activation,
                            megablox, bias_for(recv_R[order_R]), limit)
        y_SxMxD = y_RxD[jnp.argsort(order_R)].reshape(ep, M, D)
        y_AxD = jax.lax.all_to_all(y_SxMxD, ep_axis, 0, 0)[shard_A, slot_A]
    y_TxKxD = _permute(y_AxD, inverse_A, order_A).reshape(T, K, D)
    # the weighted sum in float32 (MaxText's float32_weight_sum, default true)
    out_TxD = jnp.einsum("TKD,TK->TD", y_TxKxD.astype(jnp.float32), weights_TxK.astype(jnp.float32))
    out_TxD = out_TxD.astype(x_TxD.dtype)
    if tensor_axis is not None:  # each device held a slice of every expert's F: partial sums
        out_TxD = jax.lax.psum(out_TxD, tensor_axis)
    return out_TxD


def _stored_and_gathered(shape, logical, sizes, e_axis: str | None, f_axis: str | None
                         ) -> tuple[PartitionSpec, tuple[tuple[int, tuple[str, ...]], ...]]:
    """An expert weight's PartitionSpec entering the shard_map and (dimension, mesh axes) of what is gathered inside
    it: each device keeps its experts (E over `e_axis`) and its slice of F (over `f_axis`); the FSDP axes of the
    dimension the parameter stores sharded (D, or E under shard_exp_on_fsdp) enter sharded and are gathered inside."""
    entries, gathered = [], []
    for dim, (name, entry) in enumerate(zip(logical, mesh_axes_for(shape, logical, sizes))):
        kept = e_axis if name == "exp" else f_axis if name == "mlp" else None
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        fsdp = tuple(a for a in axes if a not in (e_axis, f_axis)) if name in ("embed", "exp_fsdp") else ()
        if fsdp:
            gathered.append((dim, fsdp))
        both = ((kept,) if kept else ()) + fsdp
        entries.append(None if not both else both[0] if len(both) == 1 else both)
    return PartitionSpec(*entries), tuple(gathered)


def _gather(w, gathered: tuple[tuple[int, tuple[str, ...]], ...]):
    for dim, axes in gathered:
        w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def sparse_dispatch(x_BxLxD, experts_BxLxK, weights_BxLxK, weights, cfg: ModelConfig,
                    megablox: MegabloxTiles | None = None, biases=None) -> jax.Array:
    """Dropless routed experts: ragged_dot over each device's tokens sorted by expert, all_to_all between expert
    shards. Without a mesh (one device), the same computation on all tokens. The expert weights (wi_0 or None,
    wi_1, wo) come in their parameter dtype, are cast to the tokens' dtype on their FSDP shards and all-gathered
    inside the shard_map. MaxText's sparse_matmul has the partitioner gather them at the shard_map's boundary
    instead; measured on mixtral-8x7b v5p-128 (B 1, full remat), that gave the backward scan's float32 gradient
    carry of wo a layout with D's 64-wide shard minor, padded to 128: 17.54 GiB per device against 16.67 here
    (MaxText 16.68), for the same code size."""
    B, L, D = x_BxLxD.shape
    E = cfg.num_experts
    kw = dict(E=E, activation=cfg.activation, megablox=megablox, scale_input=cfg.routed_input_scaling,
              limit=cfg.mlp_activations_limit)
    mesh = jax.sharding.get_abstract_mesh()
    dtype = x_BxLxD.dtype
    if mesh.empty:
        weights = tuple(None if w is None else w.astype(dtype) for w in weights)
        out_TxD = _local_experts(x_BxLxD.reshape(B * L, D), experts_BxLxK.reshape(B * L, -1),
                                 weights_BxLxK.reshape(B * L, -1), weights, ep_axis=None, ep=1, tensor_axis=None,
                                 biases=biases, **kw)
        return out_TxD.reshape(B, L, D)
    sizes = dict(mesh.shape)
    ep, tp = sizes.get("expert", 1), sizes.get("tensor", 1)
    if E % ep:
        raise MaxperfError(f"num_experts={E} is not divisible by the expert axis ({ep}); choose ici_expert and "
                           f"dcn_expert whose product divides {E}")
    tokens = mesh_axes_for((B, L, D), BATCH_TOKENS, sizes)
    batch_axes = tokens[0] if isinstance(tokens[0], tuple) else (tokens[0],) if tokens[0] else ()
    if ep > 1 and "expert" not in batch_axes:
        raise MaxperfError(f"expert parallelism splits the batch over the expert axis ({ep}), but the microbatch "
                           f"of {B} examples does not divide over it; choose a per_device_batch_size that gives a "
                           "whole number of examples per device")
    F = cfg.moe_mlp_dim
    f_axis = "tensor" if tp > 1 and F % tp == 0 else None
    e_axis = "expert" if ep > 1 else None
    # each weight enters sharded as the parameter holds it (FSDP over D, or over E under shard_exp_on_fsdp), cast on
    # its shard, and is gathered inside: each device keeps its experts (`expert`) and its slice of F (`tensor`)
    wi_logical, wo_logical = expert_axes(cfg)
    wi_spec, wi_gather = _stored_and_gathered(weights[1].shape, wi_logical, sizes, e_axis, f_axis)
    wo_spec, wo_gather = _stored_and_gathered(weights[2].shape, wo_logical, sizes, e_axis, f_axis)
    x_spec, routed_spec = PartitionSpec(*tokens), PartitionSpec(*tokens[:2], None)

    gated = weights[0] is not None
    w_specs = (wi_spec, wi_spec, wo_spec)[0 if gated else 1:]
    gathers = (wi_gather, wi_gather, wo_gather)[0 if gated else 1:]
    b_specs = ()
    if biases is not None:
        b_specs = (PartitionSpec(e_axis, f_axis), PartitionSpec(e_axis, f_axis), PartitionSpec(e_axis, None))
        b_specs, biases = b_specs[0 if gated else 1:], biases[0 if gated else 1:]

    def shard(x_bxlxD, experts_bxlxK, weights_bxlxK, ws, bs):
        ws = tuple(_gather(w, gather) for w, gather in zip(ws, gathers))
        b, length, _ = x_bxlxD.shape
        out_TxD = _local_experts(x_bxlxD.reshape(b * length, D), experts_bxlxK.reshape(b * length, -1),
                                 weights_bxlxK.reshape(b * length, -1), ws if gated else (None, *ws), ep_axis=e_axis,
                                 ep=ep, tensor_axis=f_axis, biases=None if not bs else bs if gated else (None, *bs),
                                 **kw)
        return out_TxD.reshape(b, length, D)

    # check_vma=False as MaxText's MoE shard_map has it (configs/base.yml check_vma): the megablox Pallas kernel's
    # outputs carry no varying-axes types
    return jax.shard_map(shard, mesh=mesh, in_specs=(x_spec, routed_spec, routed_spec, w_specs, b_specs),
                         out_specs=x_spec, check_vma=False)(x_BxLxD, experts_BxLxK, weights_BxLxK,
                                                            tuple(w.astype(dtype) for w in weights[0 if gated else 1:]),
                                                            biases or ())


def dense_dispatch(x_BxLxD, experts_BxLxK, weights_BxLxK, weights, cfg: ModelConfig,
                   capacity_factor: float, biases=None) -> jax.Array:
    """Routed experts by one-hot dispatch and combine einsums over [B, L, E, C]: per sequence, expert e takes the
    first C of the tokens that picked it (token order, then the token's k-th choice), the rest are dropped. With
    routed_input_scaling (Llama 4) the weighted tensor dispatches and the one-hot one combines."""
    B, L, D = x_BxLxD.shape
    E, K = cfg.num_experts, experts_BxLxK.shape[-1]
    C = capacity(L, K, E, capacity_factor)
    dtype = x_BxLxD.dtype
    picked_BxAxE = jax.nn.one_hot(experts_BxLxK.reshape(B, L * K), E, dtype=jnp.int32)
    slot_BxAxE = jnp.cumsum(picked_BxAxE, axis=1) * picked_BxAxE - 1  # -1 where not picked
    slot_BxA = jnp.max(slot_BxAxE, axis=-1)  # the assignment's place in its expert's queue
    kept_BxAxC = jax.nn.one_hot(slot_BxA, C, dtype=dtype)  # all zero past the capacity (or not picked)
    dispatch_BxLxExC = jnp.einsum("BAE,BAC->BAEC", picked_BxAxE.astype(dtype), kept_BxAxC).reshape(B, L, K, E, C)
    combine_BxLxExC = jnp.einsum("BLKEC,BLK->BLEC", dispatch_BxLxExC, weights_BxLxK.astype(dtype))
    dispatch_BxLxExC = jnp.sum(dispatch_BxLxExC, axis=2)  # a token picks an expert at most once
    if cfg.routed_input_scaling:
        dispatch_BxLxExC, combine_BxLxExC = combine_BxLxExC, dispatch_BxLxExC
    # the dispatch's and combine's operands split their batch axis alike (the partitioner of MXFP8's scaled matmul
    # takes no other), and so the gradients that reach them: the tokens gathered over the expert axis, which a
    # product's batch axis cannot share with the experts' own
    aligned = quantization.block_scaled()
    if aligned:
        x_BxLxD = constrain(x_BxLxD, ("activation_batch_no_exp", None, None))
        dispatch_BxLxExC = constrain(dispatch_BxLxExC, ("activation_batch_no_exp", None, None, None))
        combine_BxLxExC = constrain(combine_BxLxExC, ("activation_batch_no_exp", None, "activation_exp", None))
    # the tokens first, as MaxText's dispatch einsum takes them: under int8 their gradient is the input gradient
    x_BxExCxD = quantization.einsum("BLD,BLEC->BECD", x_BxLxD, dispatch_BxLxExC)
    x_BxExCxD = constrain(x_BxExCxD, ("activation_batch_no_exp", "activation_exp", None, None))
    wi_0, wi_1, wo = weights
    b0, b1, bo = (None, None, None) if biases is None else biases

    def biased(y_BxExCxN, b_ExN):
        return y_BxExCxN if b_ExN is None else y_BxExCxN + b_ExN[None, :, None, :]

    h_BxExCxF = checkpoint_name(biased(quantization.einsum("BECD,EDF->BECF", x_BxExCxD, wi_1), b1), "moe_mlpwi_1")
    if wi_0 is not None:
        h_BxExCxF = checkpoint_name(h_BxExCxF, "mlpwi_1")
        g_BxExCxF = biased(quantization.einsum("BECD,EDF->BECF", x_BxExCxD, wi_0), b0)
        g_BxExCxF = checkpoint_name(checkpoint_name(g_BxExCxF, "mlpwi_0"), "moe_mlpwi_0")
        h_BxExCxF = gate(cfg.activation, g_BxExCxF, h_BxExCxF, cfg.mlp_activations_limit)
    else:
        h_BxExCxF = _ACT[cfg.activation](checkpoint_name(h_BxExCxF, "mlpwi"))
    h_BxExCxF = constrain(h_BxExCxF, ("activation_batch_no_exp", "activation_exp", None, "activation_mlp"))
    y_BxExCxD = biased(quantization.einsum("BECF,EFD->BECD", h_BxExCxF, wo), bo)
    y_BxExCxD = checkpoint_name(offload.residual(y_BxExCxD, "mlpwo"), "moe_mlpwo")
    if aligned:
        y_BxExCxD = constrain(y_BxExCxD, ("activation_batch_no_exp", "activation_exp", None, None))
    out_BxLxD = quantization.einsum("BECD,BLEC->BLD", y_BxExCxD, combine_BxLxExC)
    return constrain(out_BxLxD, ("activation_batch_no_exp", None, None)) if aligned else out_BxLxD
