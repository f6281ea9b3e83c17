"""Every parameter array of the model with its logical axes, as the Flax model declares them
(maxperf/models/layers/*.py): the one list that perfmodel counts memory and collectives by, that the mesh warnings
weigh, and that a test checks against the model's own state."""

from __future__ import annotations

from dataclasses import dataclass, replace

from maxperf.spec.logical_axes import local_size
from maxperf.spec.memo import model_memo, per_model
from maxperf.spec.model import AttentionType, ModelConfig, Norm, Positions


@dataclass(frozen=True)
class ParamArray:
    name: str
    shape: tuple[int, ...]
    logical: tuple[str | None, ...]
    count: int  # how many such arrays (the layer count for per-layer weights, the MoE layers' for expert weights)
    matmul: bool  # enters a matmul (gathered for FSDP in compute dtype)
    # the decoder-layer block it belongs to: "attention", "mlp" (a dense layer's), "moe" (router, routed and shared
    # experts), "norm" (the layer's D-wide norms); "" outside the layers (tables, final norm)
    block: str = ""
    # stacked routed experts [E, ...] (logical "exp", over the `expert` axis): each device multiplies its own
    # experts, so their FSDP gather leaves the expert axis split
    expert_parallel: bool = False


def param_arrays(model: ModelConfig) -> list[ParamArray]:
    """Every parameter array of the Flax model with its logical axes (models/layers/*.py)."""
    return list(_param_arrays(model))


@per_model
def _param_arrays(model: ModelConfig) -> tuple[ParamArray, ...]:
    mla = model.attention_type == AttentionType.MLA
    V, D, N, H, K, Dh, F = (model.vocab_size, model.d_model, model.num_layers, model.num_heads, model.num_kv_heads,
                            model.head_dim, model.d_ff)
    norm_arrays = 2 if model.norm == Norm.LAYERNORM else 1  # scale (+ bias)
    layer_norms = (4 if model.post_norms else 2) * norm_arrays
    n_moe = sum(model.moe_layers())
    n_dense = N - n_moe
    gated = model.activation.gated
    if mla:
        arrays = mla_arrays(model)
    elif model.fused_qkv:  # each kv head beside its query heads, key and value (layers/attention.py)
        arrays = [ParamArray("qkv", (D, K, H // K + 2, Dh), ("embed", "kv_heads", None, "head_dim"), N, True,
                             "attention")]
    else:
        arrays = [ParamArray("q", (D, H, Dh), ("embed", "heads", "head_dim"), N, True, "attention"),
                  ParamArray("k", (D, K, Dh), ("embed", "kv_heads", "head_dim"), N, True, "attention"),
                  ParamArray("v", (D, K, Dh), ("embed", "kv_heads", "head_dim"), N, True, "attention")]
    fused_mlp = gated and model.fused_mlp
    if n_dense:
        if fused_mlp:
            arrays.append(ParamArray("gate_up", (D, 2, F), ("embed", None, "mlp"), n_dense, True, "mlp"))
        else:
            arrays.append(ParamArray("up", (D, F), ("embed", "mlp"), n_dense, True, "mlp"))
    if not mla:
        arrays.append(ParamArray("o", (H, Dh, D), ("heads", "head_dim", "embed"), N, True, "attention"))
    if n_dense:
        arrays.append(ParamArray("down", (F, D), ("mlp", "embed"), n_dense, True, "mlp"))
    arrays += [
        ParamArray("layer_norms", (D,), ("norm",), N * layer_norms, False, "norm"),
        ParamArray("final_norm", (D,), ("norm",), norm_arrays, False),
        ParamArray("embedding", (V, D), ("vocab", "embed"), 1, True),
    ]
    if n_dense and gated and not fused_mlp:
        arrays.append(ParamArray("gate", (D, F), ("embed", "mlp"), n_dense, True, "mlp"))
    if model.qk_norm:
        arrays.append(ParamArray("qk_norms", (Dh,), ("norm",), 2 * N, False, "attention"))
    if model.attention_sinks:
        arrays.append(ParamArray("sinks", (H,), ("heads",), N, False, "attention"))
    if model.attention_bias:  # gpt-oss (models/layers/attention.py)
        arrays += [ParamArray("q_bias", (H, Dh), ("heads", "head_dim"), N, False, "attention"),
                   ParamArray("kv_bias", (K, Dh), ("kv_heads", "head_dim"), 2 * N, False, "attention"),
                   ParamArray("o_bias", (D,), ("embed",), N, False, "attention")]
    if not model.tie_embeddings:
        arrays.append(ParamArray("unembedding", (D, V), ("embed", "vocab"), 1, True))
    if model.positions == Positions.LEARNED:
        arrays.append(ParamArray("positions", (model.max_position, D), ("position", "embed"), 1, False))
    if n_moe:
        arrays += moe_arrays(model)
    return tuple(arrays)


def mla_arrays(model: ModelConfig) -> list[ParamArray]:
    """Latent attention's arrays (models/layers/mla.py)."""
    D, N, H = model.d_model, model.num_layers, model.num_heads
    R, C, Dn, Dr, Dv = (model.q_lora_rank, model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim,
                        model.v_head_dim)
    if R:
        q = [ParamArray("wq_a", (D, R), ("embed", None), N, True, "attention"),
             ParamArray("q_norm", (R,), ("norm",), N, False, "attention"),
             ParamArray("wq_b", (R, H, Dn + Dr), ("q_lora", "heads", "head_dim"), N, True, "attention")]
    else:
        q = [ParamArray("q", (D, H, Dn + Dr), ("embed", "heads", "head_dim"), N, True, "attention")]
    return q + [ParamArray("wkv_a", (D, C + Dr), ("embed", None), N, True, "attention"),
                ParamArray("kv_norm", (C,), ("norm",), N, False, "attention"),
                ParamArray("wkv_b", (C, H, Dn + Dv), ("kv_lora", "heads", "head_dim"), N, True, "attention"),
                ParamArray("o", (H, Dv, D), ("heads", "head_dim", "embed"), N, True, "attention")]


def expert_axes(model: ModelConfig) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """The logical axes of the routed experts' wi [E, D, Fe] and wo [E, Fe, D]: E over `expert` and D over the FSDP
    axes (MaxText's default), or E over the FSDP axes and D whole (shard_exp_on_fsdp)."""
    if model.shard_exp_on_fsdp:
        return ("exp_fsdp", None, "mlp"), ("exp_fsdp", "mlp", None)
    return ("exp", "embed", "mlp"), ("exp", "mlp", "embed")


def moe_arrays(model: ModelConfig) -> list[ParamArray]:
    """A MoE block's arrays (models/layers/moe.py, as MaxText's RoutedMoE): the router [D, E], the experts' wi_0,
    wi_1 [E, D, Fe] and wo [E, Fe, D], the shared experts as one MLP of width S x Fe."""
    D, n, E, Fe = model.d_model, sum(model.moe_layers()), model.num_experts, model.moe_mlp_dim
    gated = model.activation.gated
    wi, wo = expert_axes(model)
    arrays = [ParamArray("router", (D, E), ("embed", None), n, True, "moe"),
              ParamArray("experts_up", (E, D, Fe), wi, n, True, "moe", True),
              ParamArray("experts_down", (E, Fe, D), wo, n, True, "moe", True)]
    if gated:
        arrays.append(ParamArray("experts_gate", (E, D, Fe), wi, n, True, "moe", True))
    if model.routed_bias:
        arrays.append(ParamArray("router_bias", (E,), (None,), n, False, "moe"))
    if model.mlp_bias:  # gpt-oss's expert biases
        arrays += [ParamArray("experts_wi_bias", (E, Fe), ("exp", "mlp"), n * (2 if gated else 1), False, "moe"),
                   ParamArray("experts_wo_bias", (E, D), ("exp", "embed"), n, False, "moe")]
    if model.shared_experts:
        width = model.shared_experts * Fe
        arrays += [ParamArray("shared_up", (D, width), ("embed", "mlp"), n, True, "moe"),
                   ParamArray("shared_down", (width, D), ("mlp", "embed"), n, True, "moe")]
        if gated:
            arrays.append(ParamArray("shared_gate", (D, width), ("embed", "mlp"), n, True, "moe"))
    return arrays


def mtp_arrays(model: ModelConfig) -> tuple[ParamArray, ...]:
    """The parameter arrays of the multi-token-prediction modules (models/layers/mtp.py), which param_arrays leaves
    out (published totals do not count them): per module the RMSNorms of the embedding, of the hidden state and before
    the shared head, the 2D x D projection, and one decoder layer of the last layer's kind, its arrays those of the
    decoder's layers of that kind, one layer's worth."""
    n = model.mtp_num_layers
    if not n:
        return ()
    routed = model.moe_layers()
    n_moe = sum(routed)
    layers = {"attention": model.num_layers, "norm": model.num_layers, "mlp": model.num_layers - n_moe,
              "moe": n_moe}
    kind = "moe" if routed[-1] else "mlp"
    arrays = [replace(x, count=n * x.count // layers[x.block]) for x in param_arrays(model)
              if x.block in ("attention", "norm", kind)]
    norm = next(x for x in param_arrays(model) if x.name == "final_norm")
    return tuple(arrays + [replace(norm, name="mtp_norms", count=3 * n * norm.count),
                           ParamArray("mtp_projection", (2 * model.d_model, model.d_model), ("embed", None), n, True)])


def logits_table(model: ModelConfig) -> ParamArray:
    """The vocabulary table the logits' matmul reads: the embedding where the model ties them, else the unembedding."""
    name = "embedding" if model.tie_embeddings else "unembedding"
    return next(x for x in param_arrays(model) if x.name == name)


def state_arrays(model: ModelConfig) -> tuple[ParamArray, ...]:
    """Every parameter array the train state holds: the decoder's and the MTP modules'."""
    return (*param_arrays(model), *mtp_arrays(model))


@dataclass(frozen=True)
class Stack:
    """`count` repeats of consecutive layers, `pattern` saying which of them have a mixture of experts; layer
    `start` first. Scanned, each repeat is one step of the scan, and each layer of a repeat has weights of its own."""

    name: str
    start: int
    count: int
    pattern: tuple[bool, ...]


def stacks(model: ModelConfig) -> tuple[Stack, ...]:
    """The decoder's layers as scannable stacks, as MaxText's decoders scan them: a mixture of experts' first dense
    layers (DeepSeek), then repeats of the model's layer cycle (`ModelConfig.layer_cycle`: one layer where all are
    alike, Gemma 3's six), then the layers left after the whole cycles as one block (MaxText's layers_remainder).
    Together they follow `ModelConfig.moe_layers()`."""
    N, kinds = model.num_layers, model.moe_layers()
    k = min(model.first_num_dense_layers, N) if model.is_moe else 0
    P = model.layer_cycle()
    repeats, rest = divmod(N - k, P)
    out = []
    if k:
        out.append(Stack("dense_layers", 0, k, (False,)))
    if repeats:
        out.append(Stack("layers", k, repeats, kinds[k:k + P]))
    if rest:
        out.append(Stack("rest_layers", N - rest, 1, kinds[N - rest:]))
    return tuple(out)


def reduced_arrays(model: ModelConfig, scan_layers: bool = True) -> int:
    """The arrays of the train state as the model holds them, each reduced across replicas by a collective of its
    own: a scanned stack holds every weight of each layer of its repeating unit once, its repeats stacked (Gemma 3's
    blocks of six layers hold six of each); unscanned, every layer holds its own. Compiled for 2 x v6e-8, MaxText's
    gemma3-12b and llama2-7b steps hold 112 and 20 cross-slice all-reduce instructions (80 and 12 arrays here: the
    largest go in two parts), maxperf's own llama2-7b with scan_layers=false 230 (291 here: XLA sends the norm scales
    together). These are the all-reduces nothing hides: the compiled steps send each scanned block's inside the
    backward's loop, beside the next block's backward, and the last block's after it, with the arrays outside the
    layers (MaxText's llama2-7b on 2 x v5e-256: 7 in the loop, 11 after it; gemma3-12b on 2 x v6e-256: 36 and 52;
    docs/accuracy.md, "Across slices")."""
    layers = {"attention": model.num_layers, "norm": model.num_layers, "mlp": model.num_layers - sum(
        model.moe_layers()), "moe": sum(model.moe_layers())}
    arrays = param_arrays(model)
    per_layer = {kind: sum(x.count // layers[x.block] for x in arrays if x.block in ("attention", "norm", kind))
                 for kind in ("mlp", "moe")}
    total = sum(x.count for x in arrays if not x.block) + sum(x.count for x in mtp_arrays(model))
    for st in stacks(model):
        total += (1 if scan_layers else st.count) * sum(per_layer["moe" if m else "mlp"] for m in st.pattern)
    return total


def params_per_device(model: ModelConfig, sizes: tuple[tuple[str, int], ...]) -> float:
    """Parameters one device holds after sharding over a mesh of these axis sizes (Mesh.sizes); the optimizer state
    and the gradients are sharded alike."""
    memo = model_memo(model)  # per mesh: a search asks for it again with every batch and policy
    if (held := memo.get(("params_per_device", sizes))) is None:
        axes = dict(sizes)
        held = memo["params_per_device", sizes] = (
            sum(x.count * local_size(x.shape, x.logical, axes) * stage_share(x, axes) for x in param_arrays(model))
            + sum(x.count * local_size(x.shape, x.logical, axes) for x in mtp_arrays(model)))
    return held


def stage_share(x: ParamArray, axes: dict[str, int]) -> float:
    """The share of a decoder array's layers one device holds: a pipeline's stage holds 1 / stages of the decoder's
    layers (the whole decoder is pipelined: maxperf.spec.pipeline); arrays outside the layers are on every stage."""
    return 1 / axes.get("stage", 1) if x.block else 1.0
