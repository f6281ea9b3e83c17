"""Named model presets: the published shapes, a tiny test model, and the synthetic `scaled-S` family.

Shapes are taken from each model's published config (the Hugging Face `config.json` of the released weights, or the
paper where no weights were released); `PUBLISHED_PARAMS` holds the publisher's total for the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

from maxperf.spec.errors import unknown
from maxperf.spec.model import (
    Activation,
    AttentionType,
    ModelConfig,
    Norm,
    Positions,
    RopeScaling,
    RoutedScoreFunc,
    YarnScaling,
)

_REGISTRY: dict[str, Callable[[], ModelConfig]] = {}

DEFAULT_MODEL = "scaled-1"


def names() -> list[str]:
    return list(_REGISTRY)


def canonical(name: str) -> str:
    """The preset a name selects: MaxText's model_name for it (`deepseek3-671b` is `deepseek-v3`: FROM_MAXTEXT;
    `default`, MaxText's base model, is scaled-1), or the name as it is."""
    return DEFAULT_MODEL if name == "default" else FROM_MAXTEXT.get(name, name)


def get(name: str) -> ModelConfig:
    """The preset called `name`, or by MaxText's model_name for it."""
    name = canonical(name)
    if name not in _REGISTRY:
        raise unknown("model", name, sorted({*_REGISTRY, *FROM_MAXTEXT}))
    return _REGISTRY[name]()


def _llama(name: str, V: int, D: int, N: int, H: int, K: int, F: int, theta: float, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=V, d_model=D, num_layers=N, num_heads=H, num_kv_heads=K, head_dim=D // H, d_ff=F,
        rope_theta=theta, **kw,
    )


def register(name: str, make: Callable[[], ModelConfig]) -> None:
    """Adds a named preset; `make` builds its config."""
    _REGISTRY[name] = make


# Llama 2 (Touvron et al. 2023, table 1; meta-llama/Llama-2-*-hf config.json)
register("llama2-7b", lambda: _llama("llama2-7b", 32000, 4096, 32, 32, 32, 11008, 1e4, norm_fsdp=True))
register("llama2-13b", lambda: _llama("llama2-13b", 32000, 5120, 40, 40, 40, 13824, 1e4, norm_fsdp=True))
register("llama2-70b", lambda: _llama("llama2-70b", 32000, 8192, 80, 64, 8, 28672, 1e4, norm_fsdp=True))
# Llama 3 and 3.1 (meta-llama/Meta-Llama-3-*, Llama-3.1-405B config.json)
register("llama3-8b", lambda: _llama("llama3-8b", 128256, 4096, 32, 32, 8, 14336, 5e5))
register("llama3-70b", lambda: _llama("llama3-70b", 128256, 8192, 80, 64, 8, 28672, 5e5))
register(
    "llama3.1-405b",
    lambda: _llama("llama3.1-405b", 128256, 16384, 126, 128, 8, 53248, 5e5, rope_scaling=RopeScaling()),
)
# MaxText's other names of the same widths (its configs/models/llama3.1-8b, llama3.1-70b, llama3.3-70b and
# llama3-405b.yml equal llama3-8b's, llama3-70b's and llama3.1-405b's); it scales RoPE for the names starting
# "llama3.1" only (layers/attentions.py)
register("llama3.1-8b", lambda: _llama("llama3.1-8b", 128256, 4096, 32, 32, 8, 14336, 5e5, rope_scaling=RopeScaling()))
register("llama3.1-70b",
         lambda: _llama("llama3.1-70b", 128256, 8192, 80, 64, 8, 28672, 5e5, rope_scaling=RopeScaling()))
register("llama3.3-70b", lambda: _llama("llama3.3-70b", 128256, 8192, 80, 64, 8, 28672, 5e5))
register("llama3-405b", lambda: _llama("llama3-405b", 128256, 16384, 126, 128, 8, 53248, 5e5))
# Mistral 7B v0.1 (Jiang et al. 2023, table 1): sliding window of 4096
register(
    "mistral-7b",
    lambda: _llama("mistral-7b", 32000, 4096, 32, 32, 8, 14336, 1e4, attention_type=AttentionType.LOCAL_SLIDING,
                   window=4096),
)


# Gemma (google/gemma-2b, gemma-7b config.json): GeGLU, tied, embeddings scaled by sqrt(D)
def _gemma(name: str, D: int, N: int, H: int, K: int, Dh: int, F: int, vocab_size: int = 256000,
           **kw) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=vocab_size, d_model=D, num_layers=N, num_heads=H, num_kv_heads=K, head_dim=Dh, d_ff=F,
        activation=Activation.GEGLU, norm_eps=1e-6, tie_embeddings=True, scale_embeddings=True, **kw,
    )


register("gemma-2b", lambda: _gemma("gemma-2b", 2048, 18, 8, 1, 256, 16384))
register("gemma-7b", lambda: _gemma("gemma-7b", 3072, 28, 16, 16, 256, 24576))


# Gemma 2 (Gemma Team 2024, table 1; google/gemma-2-* config.json): local (4096) and global layers alternate,
# logits soft-capped (attention 50, final 30), norms before and after each block; query scaled by
# query_pre_attn_scalar^-1/2.
def _gemma2(name: str, D: int, N: int, H: int, K: int, Dh: int, F: int, query_pre_attn: int) -> ModelConfig:
    return _gemma(
        name, D, N, H, K, Dh, F, attention_type=AttentionType.LOCAL_GLOBAL, window=4096, local_per_global=1,
        attn_logit_softcap=50.0, final_logit_softcap=30.0, post_norms=True, query_scale=query_pre_attn**-0.5,
    )


register("gemma2-2b", lambda: _gemma2("gemma2-2b", 2304, 26, 8, 4, 256, 9216, 256))
register("gemma2-9b", lambda: _gemma2("gemma2-9b", 3584, 42, 16, 8, 256, 14336, 256))
register("gemma2-27b", lambda: _gemma2("gemma2-27b", 4608, 46, 32, 16, 128, 36864, 144))


# Gemma 3, text only (Gemma Team 2025, "Gemma 3 Technical Report", table 1; google/gemma-3-{1b,4b,12b,27b}-pt
# config.json; MaxText's configs/models/gemma3-{4b,12b,27b}.yml and models/gemma3.py): five sliding-window layers
# (RoPE base 1e4, local_rope_theta) to each global one (base 1e6, positions divided by 8 except in 1B), QK-norm, norms
# after attention and MLP too, no soft-capping; query scaled by Dh^-1/2 (1B, 4B, 12B) or (D / H)^-1/2 (27B, as
# MaxText's get_query_pre_attn_scalar). Windows: 512 tokens in 1B, 1024 in the others.
def _gemma3(name: str, D: int, N: int, H: int, K: int, Dh: int, F: int, window: int, query_scale: float,
            linear_scaling: float = 8.0) -> ModelConfig:
    return _gemma(name, D, N, H, K, Dh, F, vocab_size=262144, attention_type=AttentionType.LOCAL_GLOBAL,
                  window=window, local_per_global=5, qk_norm=True, post_norms=True, query_scale=query_scale,
                  rope_theta=1e6, local_rope_theta=1e4, rope_linear_scaling_factor=linear_scaling)


register("gemma3-1b", lambda: _gemma3("gemma3-1b", 1152, 26, 4, 1, 256, 6912, 512, 256**-0.5, linear_scaling=1.0))
register("gemma3-4b", lambda: _gemma3("gemma3-4b", 2560, 34, 8, 4, 256, 10240, 1024, 256**-0.5))
register("gemma3-12b", lambda: _gemma3("gemma3-12b", 3840, 48, 16, 8, 256, 15360, 1024, 256**-0.5))
register("gemma3-27b", lambda: _gemma3("gemma3-27b", 5376, 62, 32, 16, 128, 21504, 1024, 168**-0.5))


# Qwen3 (Qwen/Qwen3-* config.json): QK-norm, RoPE theta 1e6, head dim 128 throughout
def _qwen3(name: str, D: int, N: int, H: int, K: int, F: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=151936, d_model=D, num_layers=N, num_heads=H, num_kv_heads=K, head_dim=128, d_ff=F,
        norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_embeddings=tied,
    )


register("qwen3-0.6b", lambda: _qwen3("qwen3-0.6b", 1024, 28, 16, 8, 3072, tied=True))
register("qwen3-8b", lambda: _qwen3("qwen3-8b", 4096, 36, 32, 8, 12288, tied=False))
register("qwen3-32b", lambda: _qwen3("qwen3-32b", 5120, 64, 64, 8, 25600, tied=False))

# GPT-3 175B (Brown et al. 2020, table 2.1): learned positions over 2048 tokens, LayerNorm, GELU, F = 4D, tied. As
# MaxText's gpt3-175b.yml runs it: the 50257-token vocabulary padded to 50304 (a multiple of 128, so tensor
# parallelism splits it), q, k and v in one matmul, the embedding lookup as a one-hot matmul.
register(
    "gpt3-175b",
    lambda: ModelConfig(
        name="gpt3-175b", vocab_size=50304, d_model=12288, num_layers=96, num_heads=96, num_kv_heads=96, head_dim=128,
        d_ff=49152, activation=Activation.GELU, norm=Norm.LAYERNORM, positions=Positions.LEARNED, max_position=2048,
        tie_embeddings=True, fused_qkv=True, use_iota_embed=True,
    ),
)

# A model small enough for tests to train on CPU in seconds.
register(
    "tiny",
    lambda: ModelConfig(
        name="tiny", vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
        max_position=512,
    ),
)

# Dense multi-head latent attention small enough for tests: q through a rank-32 latent, kv through 32, query and key
# heads of 16 + 8 (position-free and RoPE) beside values of 16
register(
    "tiny-mla",
    lambda: ModelConfig(
        name="tiny-mla", vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=24, d_ff=128,
        max_position=512, attention_type=AttentionType.MLA, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
    ),
)


# DeepSeek's multi-head latent attention and mixture of experts (the Hugging Face config.json of each release; MaxText's
# configs/models/deepseek2-16b.yml, deepseek3-671b.yml and kimi-k2-1t.yml): q through a rank-1536 latent (none in
# V2-Lite), kv through 512, heads of 128 position-free and 64 RoPE features for q and k and 128 for v; the first layers
# dense, the rest 1 or 2 shared experts beside the routed ones; RoPE extended with YaRN. MTP is off
# (mtp_num_layers=1 adds V3's one module). head_dim holds the q and k head dim.
def _deepseek(name: str, V: int, D: int, N: int, H: int, F: int, q_lora: int, experts: int, top_k: int, moe_F: int,
              shared: int, dense: int, theta: float, yarn: YarnScaling, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=V, d_model=D, num_layers=N, num_heads=H, num_kv_heads=H, head_dim=192, d_ff=F,
        norm_eps=1e-6, rope_theta=theta, rope_scaling=yarn, attention_type=AttentionType.MLA, q_lora_rank=q_lora,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=experts,
        num_experts_per_tok=top_k, base_moe_mlp_dim=moe_F, shared_experts=shared, first_num_dense_layers=dense, **kw,
    )


# deepseek-ai/DeepSeek-V2-Lite: 64 experts, top-6 softmax routing without renormalization
register(
    "deepseek-v2-lite",
    lambda: _deepseek("deepseek-v2-lite", 102400, 2048, 27, 16, 10944, 0, 64, 6, 1408, 2, 1, 1e4,
                      YarnScaling(factor=40, beta_fast=32, beta_slow=1, original_max_position=4096, mscale=0.707)),
)
# deepseek-ai/DeepSeek-V3: 256 experts, top-8 of the best 4 of 8 groups, sigmoid scores with a selection bias,
# renormalized and scaled by 2.5
register(
    "deepseek-v3",
    lambda: _deepseek("deepseek-v3", 129280, 7168, 61, 128, 18432, 1536, 256, 8, 2048, 1, 3, 1e4,
                      YarnScaling(factor=40, beta_fast=32, beta_slow=1, original_max_position=4096, mscale=1.0),
                      routed_score_func=RoutedScoreFunc.SIGMOID, routed_bias=True, routed_scaling_factor=2.5,
                      n_routing_groups=8, topk_routing_group=4, norm_topk_prob=True),
)
# moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer, no groups
register(
    "kimi-k2",
    lambda: _deepseek("kimi-k2", 163840, 7168, 61, 64, 18432, 1536, 384, 8, 2048, 1, 1, 5e4,
                      YarnScaling(factor=32, beta_fast=1, beta_slow=1, original_max_position=4096, mscale=1.0),
                      routed_score_func=RoutedScoreFunc.SIGMOID, routed_bias=True, routed_scaling_factor=2.827,
                      norm_topk_prob=True),
)


# Mixtures of experts with grouped-query attention (the Hugging Face config.json of each release; MaxText's
# configs/models/*.yml): every layer's MLP is num_experts experts of width base_moe_mlp_dim, top-k per token.
def _moe(name: str, V: int, D: int, N: int, H: int, K: int, Dh: int, E: int, top_k: int, moe_F: int, theta: float,
         **kw) -> ModelConfig:
    kw.setdefault("d_ff", moe_F)  # the dense layers' MLP, where some layers are dense (Llama 4 Maverick)
    kw.setdefault("base_moe_mlp_dim", moe_F)  # None: the experts are d_ff wide (MaxText's mixtral block)
    return ModelConfig(
        name=name, vocab_size=V, d_model=D, num_layers=N, num_heads=H, num_kv_heads=K, head_dim=Dh, rope_theta=theta,
        num_experts=E, num_experts_per_tok=top_k, **kw,
    )


# mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1: top-2 of 8, the two weights a softmax over the picked logits
# (norm_topk_prob); their config.json sets no sliding window ("sliding_window": null), as MaxText's configs run them
# MaxText's mixtral block makes the experts mlp_dim (base_mlp_dim) wide: d_ff is their width (base_moe_mlp_dim unset)
register("mixtral-8x7b", lambda: _moe("mixtral-8x7b", 32000, 4096, 32, 32, 8, 128, 8, 2, 14336, 1e6,
                                      norm_topk_prob=True, base_moe_mlp_dim=None))
register("mixtral-8x22b", lambda: _moe("mixtral-8x22b", 32768, 6144, 56, 48, 8, 128, 8, 2, 16384, 1e6,
                                       norm_topk_prob=True, base_moe_mlp_dim=None))
# Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B: 128 experts of width 768 or 1536, top-8 renormalized, QK-norm;
# Qwen3-Coder-480B-A35B-Instruct (MaxText's configs/models/qwen3-480b-a35b.yml): 160 experts of width 2560
register("qwen3-30b-a3b", lambda: _moe("qwen3-30b-a3b", 151936, 2048, 48, 32, 4, 128, 128, 8, 768, 1e6,
                                       norm_eps=1e-6, qk_norm=True, norm_topk_prob=True))
register("qwen3-235b-a22b", lambda: _moe("qwen3-235b-a22b", 151936, 4096, 94, 64, 4, 128, 128, 8, 1536, 1e6,
                                         norm_eps=1e-6, qk_norm=True, norm_topk_prob=True))
register("qwen3-480b-a35b", lambda: _moe("qwen3-480b-a35b", 151936, 6144, 62, 96, 8, 128, 160, 8, 2560, 1e7,
                                         norm_eps=1e-6, qk_norm=True, norm_topk_prob=True))


# openai/gpt-oss-20b and gpt-oss-120b (their config.json; MaxText's configs/models/gpt-oss-{20b,120b}.yml and
# models/gpt_oss.py): 32 or 128 experts of width 2880, top-4 of the router's biased logits, weighted by a softmax over
# the picked ones; sliding-window (128) and full layers alternate, the sliding one first; attention sinks, biases on
# q, k, v, o and on every expert's projections, the clamped SwiGLU (limit 7); RoPE extended by YaRN (factor 32 over
# 4096).
def _gpt_oss(name: str, N: int, E: int) -> ModelConfig:
    return _moe(name, 201088, 2880, N, 64, 8, 64, E, 4, 2880, 150000.0, norm_topk_prob=True,
                attention_type=AttentionType.LOCAL_GLOBAL, window=128, local_per_global=1,
                rope_scaling=YarnScaling(factor=32, beta_fast=32, beta_slow=1, original_max_position=4096),
                attention_sinks=True, attention_bias=True, mlp_bias=True, routed_bias=True,
                activation=Activation.CLAMPED_SWIGLU, mlp_activations_limit=7.0)


register("gpt-oss-20b", lambda: _gpt_oss("gpt-oss-20b", 24, 32))
register("gpt-oss-120b", lambda: _gpt_oss("gpt-oss-120b", 36, 128))

# Llama 4's text decoders (meta-llama/Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E config.json; MaxText's
# configs/models/llama4-17b-16e.yml and llama4-17b-128e.yml, models/llama4.py): every 4th layer global and RoPE-free
# (nope_layer_interval 4, with attention temperature tuning), the others attend within chunks of 8192; top-1 of E
# experts of width 8192 by a sigmoid weight on the token, plus one shared expert. Scout: 16 experts in every layer, L2
# QK-norm on the RoPE layers, RoPE scaled as MaxText's llama3.1 rope does it (its fixed factor 8, low 1, high 4 over
# 8192; Meta's config gives factor 16, high 1). Maverick: 128 experts in every other layer, dense MLPs of 16384
# between, no QK-norm, unscaled RoPE (rope_use_scale false).
def _llama4(name: str, E: int, F: int, step: int, qk_l2_norm: bool, rope_scaling: RopeScaling | None) -> ModelConfig:
    return _moe(name, 202048, 5120, 48, 40, 8, 128, E, 1, 8192, 5e5, d_ff=F, interleave_moe_layer_step=step,
                shared_experts=1, routed_score_func=RoutedScoreFunc.SIGMOID, routed_input_scaling=True,
                attention_type=AttentionType.CHUNK, chunk_attn_window_size=8192, nope_layer_interval=4,
                temperature_tuning=True, qk_l2_norm=qk_l2_norm, rope_scaling=rope_scaling)


register("llama4-scout-17b-16e", lambda: _llama4("llama4-scout-17b-16e", 16, 8192, 1, True, RopeScaling()))
register("llama4-maverick-17b-128e", lambda: _llama4("llama4-maverick-17b-128e", 128, 16384, 2, False, None))

# A mixture of experts small enough for tests: 4 experts of width 64, top-2
register(
    "tiny-moe",
    lambda: ModelConfig(
        name="tiny-moe", vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
        max_position=512, num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=64, norm_topk_prob=True,
    ),
)


def scaled(size: int) -> ModelConfig:
    """`scaled-S`: with log2(S) = 3b + r, heads and F grow by 2^(b+[r>0]), D by 2^(b+[r>1]), N by 2^b.

    This is MaxText's default model at global_parameter_scale=S: its base.yml dims (base_emb_dim 2048, 16 query and
    kv heads of 128, base_mlp_dim 7168, 16 layers, vocabulary 32000, SwiGLU, RMSNorm, untied) grown by its
    get_individual_scales (configs/types.py), which rotates the same doublings."""
    log2 = size.bit_length() - 1
    b, r = divmod(log2, 3)
    heads = 16 * 2 ** (b + (r > 0))
    return ModelConfig(
        name=f"scaled-{size}", vocab_size=32000, d_model=2048 * 2 ** (b + (r > 1)), num_layers=16 * 2**b,
        num_heads=heads, num_kv_heads=heads, head_dim=128, d_ff=7168 * 2 ** (b + (r > 0)),
    )


for _log2 in range(11):
    register(f"scaled-{2**_log2}", lambda s=2**_log2: scaled(s))

# MaxText's model_name for each preset it has a config of (its configs/models/NAME.yml); `scaled-S` is its
# global_parameter_scale=S. The others have no MaxText equivalent: the tiny test models, and gemma3-1b (MaxText's
# gemma3 configs are 4b, 12b and 27b).
MAXTEXT_NAMES = {
    **{name: name for name in (
        "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3.1-405b", "llama3.1-8b",
        "llama3.1-70b", "llama3.3-70b", "llama3-405b", "mistral-7b", "gemma-2b",
        "gemma-7b", "gemma2-2b", "gemma2-9b", "gemma2-27b", "gemma3-4b", "gemma3-12b", "gemma3-27b", "qwen3-0.6b",
        "qwen3-8b", "qwen3-32b", "gpt3-175b", "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b",
        "qwen3-480b-a35b", "gpt-oss-20b", "gpt-oss-120b")},
    "deepseek-v2-lite": "deepseek2-16b", "deepseek-v3": "deepseek3-671b", "kimi-k2": "kimi-k2-1t",
    "llama4-scout-17b-16e": "llama4-17b-16e", "llama4-maverick-17b-128e": "llama4-17b-128e",
}
# The preset each of MaxText's model names selects
FROM_MAXTEXT = {theirs: ours for ours, theirs in MAXTEXT_NAMES.items()}
# maxperf's keys of the dims that MaxText's global_parameter_scale multiplies, and MaxText's names for them
SCALED_DIMS = {"d_model": "base_emb_dim", "num_heads": "base_num_query_heads", "num_kv_heads": "base_num_kv_heads",
               "d_ff": "base_mlp_dim", "num_layers": "base_num_decoder_layers"}


def maxtext_model(name: str, pinned: Collection[str] = ()) -> tuple[str, ...] | None:
    """MaxText's words that select preset `name`'s model, None where MaxText has no config of it. `pinned`: the model
    keys (maxperf's names) the command sets too; MaxText would multiply a pinned dim of scaled-S by S's scale, so
    such a model is given at scale 1 with its other dims."""
    if name in MAXTEXT_NAMES:
        return (f"model_name={MAXTEXT_NAMES[name]}",)
    if not name.startswith("scaled-") or name not in _REGISTRY:
        return None
    size = int(name.removeprefix("scaled-"))
    if size == 1 or not set(pinned) & set(SCALED_DIMS):
        return (f"global_parameter_scale={size}",)
    model = scaled(size)
    return ("global_parameter_scale=1", *(f"{theirs}={getattr(model, ours)}" for ours, theirs in SCALED_DIMS.items()
                                          if ours not in pinned))


def llama4_vision_params() -> int:
    """Llama 4's vision encoder and projector, which Meta's totals include and the text presets leave out, counted
    from their config (MaxText's llama4 yml and base.yml *_for_vit keys; its models/llama4.py modules): a 14 x 14
    patch embedding of 3 channels to 1408, a class embedding and 577 learned positions, LayerNorms before and after,
    34 layers of LayerNorm-ed attention (q, k, v, o with biases) and a GELU MLP of 5632 (with biases), the pixel
    shuffle's MLP 5632 -> 4096 -> 4096 and the projector 4096 -> 5120, no biases there."""
    D, F, N, patches = 1408, 5632, 34, (336 // 14) ** 2 + 1
    layer = 2 * 2 * D + 4 * (D * D + D) + (D * F + F) + (F * D + D)
    return 3 * 14 * 14 * D + D + patches * D + 2 * 2 * D + N * layer + F * 4096 + 4096 * 4096 + 4096 * 5120


# The publisher's total parameter count of each published preset (their model cards and papers).
PUBLISHED_PARAMS = {
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,  # released checkpoint: 68.98e9 (the paper rounds to 70B)
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3.1-405b": 405.8e9,
    "llama3.1-8b": 8.03e9,
    "llama3.1-70b": 70.6e9,
    "llama3.3-70b": 70.6e9,
    "llama3-405b": 405.8e9,
    "mistral-7b": 7.24e9,
    "gemma-2b": 2.51e9,
    "gemma-7b": 8.54e9,
    "gemma2-2b": 2.61e9,
    "gemma2-9b": 9.24e9,
    "gemma2-27b": 27.2e9,
    # the Gemma 3 report, table 1: embedding + non-embedding parameters, the vision encoder (417M) apart
    "gemma3-1b": 1.0e9,  # 302M + 698M
    "gemma3-4b": 3.884e9,  # 675M + 3,209M
    "gemma3-12b": 11.771e9,  # 1,012M + 10,759M
    "gemma3-27b": 27.016e9,  # 1,416M + 25,600M
    "qwen3-0.6b": 0.6e9,
    "qwen3-8b": 8.2e9,
    "qwen3-32b": 32.8e9,
    "gpt3-175b": 175.0e9,
    # mixtures of experts: the totals their publishers state (Mistral's Mixtral announcements, the Qwen3 model cards,
    # OpenAI's gpt-oss model card)
    "mixtral-8x7b": 46.7e9,
    "mixtral-8x22b": 141e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235e9,
    "qwen3-480b-a35b": 480e9,
    "gpt-oss-20b": 20.9e9,
    "gpt-oss-120b": 116.8e9,
    # DeepSeek-V2-Lite's model card (deepseek-ai/DeepSeek-V2-Lite): 15.7B; the DeepSeek-V3 technical report: 671B
    # without its 14B multi-token-prediction module. Kimi K2 is left out: its config.json gives 1.026T, Moonshot's
    # report states 1.04T and its model card 1T
    "deepseek-v2-lite": 15.7e9,
    "deepseek-v3": 671e9,
    # Meta's Llama 4 model cards: 109B and 400B total, with the vision encoder (llama4_vision_params, 0.87B) that
    # these text decoders leave out
    "llama4-scout-17b-16e": 109e9 - llama4_vision_params(),
    "llama4-maverick-17b-128e": 400e9 - llama4_vision_params(),
}

# The parameters a token passes through (its top-k routed experts, the shared ones and everything else) of each
# mixture of experts, as its publisher states them. OpenAI counts gpt-oss's without the input embedding table (its
# model card: 3.61B and 5.13B); Mistral and Qwen count both embedding tables.
ACTIVE_WITHOUT_INPUT_EMBEDDING = frozenset({"gpt-oss-20b", "gpt-oss-120b"})
PUBLISHED_ACTIVE_PARAMS = {
    "mixtral-8x7b": 12.9e9,
    "mixtral-8x22b": 39e9,
    "qwen3-30b-a3b": 3.3e9,
    "qwen3-235b-a22b": 22e9,
    "qwen3-480b-a35b": 35e9,
    "gpt-oss-20b": 3.61e9,
    "gpt-oss-120b": 5.13e9,
    "llama4-scout-17b-16e": 17e9,  # Meta's model cards: 17B active
    "llama4-maverick-17b-128e": 17e9,
}


def changed_from_preset(model: ModelConfig) -> dict[str, object]:
    """The fields of `model` that differ from the preset of its name (key=value overrides of the model), in the
    config's field order; empty for a model of no preset's name."""
    if canonical(model.name) not in _REGISTRY:
        return {}
    base = get(model.name)
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if getattr(model, f.name) != getattr(base, f.name)}


def label(model: ModelConfig) -> str:
    """The model's name, with what overrides changed of its preset: "llama2-7b (modified: num_layers=4)"."""
    changed = changed_from_preset(model)
    return model.name + (f" (modified: {', '.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")
