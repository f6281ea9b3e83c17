"""Every `key=value` key described for `maxperf keys`: its config, type, default, upper bound, MaxText's spellings and
what it means in a line (the config classes' comments say more)."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass

from maxperf.spec import overrides
from maxperf.spec.model import ModelConfig
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.train import TrainConfig

_CLASSES = {"model": ModelConfig, "train": TrainConfig, "parallelism": ParallelismConfig}


@dataclass(frozen=True)
class Key:
    name: str
    config: str  # "model", "train" or "parallelism"
    type: str  # "int", "float", "bool", "str", or the choices of an enum as "a|b|c"
    default: object
    bound: float | None  # the largest value a number takes (None for other types)
    maxtext: tuple[str, ...]  # MaxText's spellings
    meaning: str

    def as_dict(self) -> dict:
        default = self.default.value if isinstance(self.default, enum.Enum) else self.default
        return {"key": self.name, "config": self.config, "type": self.type, "default": default, "bound": self.bound,
                "maxtext": list(self.maxtext), "meaning": self.meaning}


def _type_name(kind) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return _type_name(args[0]) + " or none"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "|".join(m.value for m in kind)
    return getattr(kind, "__name__", str(kind))


# What each key means, in a line (the mesh axes' keys are described by _axis_meaning)
MEANINGS = {
    # model
    "vocab_size": "V, the vocabulary", "d_model": "D, the model width", "num_layers": "N, decoder layers",
    "num_heads": "H, query heads", "num_kv_heads": "K, key and value heads (grouped-query attention)",
    "head_dim": "Dh, each head's width", "d_ff": "F, the dense MLP's hidden width",
    "max_position": "size of the learned position table (positions=learned)",
    "activation": "the MLP's activation", "mlp_activations_limit": "clamped_swiglu's clip",
    "norm": "rmsnorm or layernorm", "norm_eps": "the norms' epsilon", "norm_fsdp": "norm scales sharded over fsdp, as "
    "MaxText's llama2 configs do", "shard_exp_on_fsdp": "MoE: the experts' weights stored with E over fsdp and D "
    "whole (MaxText's key; needs fsdp dividing E, no tensor or expert parallelism)",
    "post_norms": "norms after attention and MLP too (Gemma 2)",
    "positions": "rope, learned or none", "rope_theta": "RoPE's base", "local_rope_theta": "the sliding-window layers' "
    "RoPE base (none: rope_theta)", "rope_linear_scaling_factor": "positions divided by this on RoPE layers",
    "nope_layer_interval": "every n-th layer uses no RoPE (-1: all do)", "temperature_tuning": "the RoPE-free layers' "
    "query scaled with position (Llama 4)", "tie_embeddings": "the logits use the embedding table",
    "scale_embeddings": "embeddings multiplied by sqrt(D) (Gemma)", "use_iota_embed": "the embedding lookup as a "
    "one-hot matmul (MaxText's key)",
    "attention_type": "the pattern: global, local_sliding, local_global, chunk or mla",
    "window": "W, the sliding window", "local_per_global": "local layers per global one (local_global)",
    "chunk_attn_window_size": "chunk attention's chunk",
    "attention_bias": "biases on q, k, v and the output projection",
    "attention_sinks": "a learned per-head logit in each softmax's denominator", "attn_logit_softcap": "soft cap of "
    "attention logits", "final_logit_softcap": "soft cap of the output logits", "query_scale": "the query scale "
    "(none: 1/sqrt(Dh))", "qk_norm": "RMSNorm of q and k per head", "qk_l2_norm": "parameter-free L2 norm of q and k "
    "after RoPE", "fused_qkv": "one matmul for q, k and v", "fused_mlp": "one matmul for the MLP's gate and up",
    "layer_kind": "the decoder layer's structure", "q_lora_rank": "MLA: q's latent rank (0: q from D directly)",
    "kv_lora_rank": "MLA: the key-value latent's rank", "qk_nope_head_dim": "MLA: the RoPE-free part of q and k",
    "qk_rope_head_dim": "MLA: the RoPE part of q and k", "v_head_dim": "MLA: each value head's width",
    "num_experts": "E, routed experts (0: dense)", "num_experts_per_tok": "k, experts per token",
    "base_moe_mlp_dim": "each routed expert's hidden width", "shared_experts": "experts every "
    "token goes through", "first_num_dense_layers": "leading dense layers (DeepSeek)", "interleave_moe_layer_step":
    "every n-th layer is MoE (Llama 4 Maverick: 2)", "n_routing_groups": "group-limited routing's groups (-1: none)",
    "topk_routing_group": "groups each token routes within", "routed_score_func": "the router's softmax or sigmoid",
    "routed_scaling_factor": "multiplies the routed experts' output (DeepSeek-V3: 2.5)", "routed_bias": "a selection-"
    "only per-expert bias (DeepSeek-V3)", "routed_input_scaling": "the router weight scales each token before its "
    "expert", "norm_topk_prob": "renormalize the top-k weights to sum to 1", "mlp_bias": "biases on the experts' "
    "matmuls", "mtp_num_layers": "DeepSeek-V3's multi-token prediction modules",
    # train
    "max_prefill_predict_length": "serving: P, the prompt's tokens (prefill)", "quantize_kvcache":
    "serving: the key/value cache in int8", "kv_quant_dtype": "serving: the cache's quantized dtype (int8)",
    "kv_quant_axis": "serving: the cache scales' axes (heads_and_dkv or dkv)",
    "decode_cache_reads": "serving: decode priced as reading the cache once per KV head (per_kv_head) or per query "
    "head (per_query_head: TensorRT-LLM's masked MHA kernel)",
    "per_device_batch_size": "B, one microbatch per device (fractions allowed, as in MaxText)", "seq_len": "L, tokens "
    "per sequence (MaxText's max_target_length)", "grad_accum_steps": "A, microbatches per step",
    "compute_dtype": "the activations' and matmuls' dtype", "param_dtype": "the parameters' and optimizer's dtype",
    "mu_dtype": "AdamW's first moment's dtype (param_dtype's where empty)",
    "grad_dtype": "float32 gradients are cast to it before the update", "opt_type": "the optimizer: adamw or "
    "adam_pax (compiled as AdamW)", "sa_q_layout": "splash's q layout (HEAD_DIM_MINOR or SEQ_MINOR)",
    "sa_k_layout": "splash's k layout", "sa_v_layout": "splash's v layout", "use_tokamax_splash": "MaxText's tokamax "
    "splash (compiled as jax's splash with the fused backward)",
    "learning_rate": "AdamW's peak learning rate", "warmup_steps": "linear warm-up steps",
    "decay_steps": "cosine decay steps after warm-up", "min_lr_ratio": "the learning rate's final fraction",
    "weight_decay": "AdamW's weight decay",
    "adam_b1": "AdamW's beta1", "adam_b2": "AdamW's beta2", "adam_eps": "AdamW's epsilon", "grad_clip_norm": "clip the "
    "gradients' global norm (none: no clipping)", "seed": "the initialization seed", "remat_policy": "what the "
    "backward keeps, recomputes or offloads (MaxText's policies)", "decoder_layer_input": "remat_policy=custom: the "
    "layer input kept (device), recomputed or offloaded",
    "context": "remat_policy=custom: a flash kernel's residuals (its output and log-sum-exp)",
    "attention_out": "remat_policy=custom: attention's output",
    "mlpwi": "remat_policy=custom: the MLP's up projection", "mlpwi_0": "remat_policy=custom: the MLP's gate",
    "mlpwi_1": "remat_policy=custom: the MLP's up projection (gated)", "mlpwo": "remat_policy=custom: the MLP's output",
    "query_proj": "remat_policy=custom: q", "key_proj": "remat_policy=custom: k", "value_proj": "remat_policy=custom: "
    "v", "qkv_proj": "remat_policy=custom: the fused q, k, v", "out_proj": "remat_policy=custom: attention's output "
    "projection", "attention": "the kernel: auto, flash or dot_product (MaxText's autoselected is auto; its GPU "
    "cudnn_flash_te and cudnn_flash_jax compile as flash)",
    "float32_qk_product": "dot_product: q k^T in float32", "float32_logits": "dot_product: the softmax in float32",
    "logits_dot_in_fp32": "the logits' matmul in float32",
    "sa_block_q": "splash attention's query tile", "sa_block_kv": "splash attention's key tile",
    "sa_block_kv_compute": "splash attention's key compute tile", "sa_block_q_dkv": "splash dK/dV kernel's query tile",
    "sa_block_kv_dkv": "splash dK/dV kernel's key tile", "sa_block_kv_dkv_compute": "splash dK/dV kernel's key "
    "compute tile", "sa_block_q_dq": "splash dQ kernel's query tile", "sa_block_kv_dq": "splash dQ kernel's key tile",
    "sa_use_fused_bwd_kernel": "splash's backward as one kernel instead of two", "num_vocab_tiling": "the loss over "
    "this many chunks of the tokens (no whole logits)", "optimizer_memory_host_offload": "the optimizer state in host "
    "memory between steps", "parameter_memory_host_offload": "the parameters in host memory between steps",
    "shard_optimizer_over_data": "ZeRO-1: the optimizer state and parameters split over data too",
    "scan_layers": "the layers as one scanned stack", "param_scan_axis": "where a scanned weight's layer axis sits",
    "capacity_factor": "MoE: each expert's capacity (-1: dropless)", "sparse_matmul": "MoE: dropless sorted dispatch "
    "(false: dense einsums)", "megablox": "MoE on TPU: the megablox grouped-matmul kernel",
    **{f"{w}_tile_{p}_{d}": f"MoE grouped matmul: the {what} tile of the {product} of the {which}"
       for w, which in (("wi", "up and gate projections"), ("wo", "down projection"))
       for p, product in (("fwd", "forward"), ("dlhs", "input gradient"), ("drhs", "weight gradient"))
       for d, what in (("batch_seq", "rows'"), ("embed_dim", "model width's"), ("mlp_dim", "experts' width's"))},
    "load_balance_loss_weight": "MoE: the router's auxiliary loss weight", "routed_bias_update_rate": "MoE: the "
    "selection bias's update rate (DeepSeek-V3)", "mtp_loss_scaling_factor": "the multi-token-prediction loss weight",
    "moe_load_imbalance": "perfmodel only: the busiest expert shard's rows over the mean", "quantization": "the "
    "layers' matmuls: none, int8 or an FP8 recipe (auto: plan chooses)", "quantization_local_shard_count": "int8: "
    "separately scaled shards of the weight gradient", "use_qwix_quantization": "MaxText's Qwix path (fp8_full)",
    "num_pipeline_microbatches": "pipeline: microbatches (-1: the stages)", "num_pipeline_repeats": "pipeline: "
    "circular repeats (-1: derived)", "num_layers_per_pipeline_stage": "pipeline: layers a stage runs per repeat",
    "pipeline_parallel_layers": "pipeline: layers pipelined (-1: all)", "pipeline_delay_activation_forwarding":
    "pipeline: outputs move on an iteration later", "pipeline_fsdp_ag_once": "pipeline: weights gathered once a step",
    "set_remat_policy_on_pipeline_iterations": "pipeline: the remat policy on each loop iteration (false: no remat)",
    "account_for_embedding_in_pipeline_split": "pipeline (Megatron's): the embedding takes a layer's place in the "
    "first stage", "account_for_loss_in_pipeline_split": "pipeline (Megatron's): the loss takes a layer's place in "
    "the last stage", "pipeline_schedule": "pipeline: gpipe (MaxText's, compiled) or 1f1b (Megatron-LM's, priced): "
    "the activations each stage holds",
    "context_parallel_load_balance": "context parallelism: sequences reordered so shards share the causal work",
}


# The mesh axes' keys, which ParallelismConfig documents as a group
_AXES = {"data": "data parallelism (the batch split, weights replicated)",
         "stage": "pipeline stages (MaxText's pipeline_parallelism)",
         "fsdp": "FSDP (the batch split, weights sharded and gathered)",
         "fsdp_transpose": "FSDP sharding the MLP width", "sequence": "context parallelism (the sequence split)",
         "tensor": "tensor parallelism (heads and MLP width split)", "expert": "expert parallelism"}


def _axis_meaning(name: str) -> str:
    side, _, axis = name.partition("_")
    where = "inside one ICI domain (a slice, an NVLink host or rack)" if side == "ici" else "across ICI domains (DCN)"
    return f"devices on the {axis} axis {where}: {_AXES[axis]}; -1 takes what is left"


def describe() -> list[Key]:
    aliases: dict[str, list[str]] = {}
    for alias, key in overrides.ALIASES.items():
        aliases.setdefault(key, []).append(alias)
    keys = []
    for config, cls in _CLASSES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in overrides.valid_keys():
                continue
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            number = hints[f.name] in (int, float) or _type_name(hints[f.name]) in ("int or none", "float or none")
            sample = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 0
            keys.append(Key(f.name, config, _type_name(hints[f.name]), default,
                            overrides.limit(f.name, config, sample) if number else None,
                            tuple(sorted(aliases.get(f.name, ()))),
                            _axis_meaning(f.name) if config == "parallelism" and f.name.startswith(("ici_", "dcn_"))
                            else MEANINGS[f.name]))
    return sorted(keys, key=lambda k: k.name)
