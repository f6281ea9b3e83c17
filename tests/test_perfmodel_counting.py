"""perfmodel's parameter and FLOP counts: hand-worked cases, published totals, MaxText's conventions."""

from dataclasses import replace

import pytest

from maxperf.perfmodel.flops import attention_pairs, count_flops, count_params
from maxperf.spec import presets
from maxperf.spec.model import Activation, AttentionType, ModelConfig, Norm, Positions
from maxperf.spec.train import TrainConfig

# every option on a model small enough to count by hand: layer 0 sees a window of 3 tokens, layer 1 all of them
WINDOWED = ModelConfig(name="windowed", vocab_size=10, d_model=4, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=2, d_ff=6, activation=Activation.GELU, norm=Norm.LAYERNORM,
                       positions=Positions.LEARNED, max_position=8, tie_embeddings=True, qk_norm=True, post_norms=True,
                       attention_type=AttentionType.LOCAL_GLOBAL, window=3, local_per_global=1)


def test_tiny_preset_by_hand():
    # V=256 D=64 N=2 H=4 K=2 Dh=16 F=128, SwiGLU, RMSNorm, RoPE, untied
    q, kv, o, mlp, norms = 64 * 64, 2 * 64 * 2 * 16, 64 * 64, 3 * 64 * 128, 2 * 64
    per_layer = q + kv + o + mlp + norms
    counts = count_params(presets.get("tiny"))
    assert counts.per_layer == per_layer == 36992
    assert counts.total == 2 * per_layer + 64 + 256 * 64 + 64 * 256 == 106816
    assert counts.non_embedding == 2 * per_layer + 64


def test_every_option_by_hand():
    # GELU (2DF), LayerNorm (scale+bias), post-norms (4 norms), QK-norm (2 RMSNorm scales of Dh), tied, learned
    m = WINDOWED
    per_layer = 4 * 4 + 2 * 4 * 2 + 4 * 4 + 2 * 4 * 6 + 4 * 2 * 4 + 2 * 2
    counts = count_params(m)
    assert counts.per_layer == per_layer
    assert counts.embedding == 10 * 4 + 8 * 4 and counts.unembedding == 0
    assert counts.total == 2 * per_layer + 2 * 4 + 10 * 4 + 8 * 4


@pytest.mark.parametrize("name", sorted(presets.PUBLISHED_PARAMS))
def test_published_totals(name):
    assert count_params(presets.get(name)).total == pytest.approx(presets.PUBLISHED_PARAMS[name], rel=0.01)


def test_llama2_7b_model_flops_match_6nd_plus_attention():
    m = presets.get("llama2-7b")
    B, L = 1, 4096
    flops = count_flops(m, TrainConfig(per_device_batch_size=B, seq_len=L))
    N = count_params(m).total
    attention = 3 * 4 * B * L * L * m.num_heads * m.head_dim * m.num_layers / 2
    assert flops.model_flops == pytest.approx(6 * N * B * L + attention, rel=0.03)
    # MaxText's exact terms: 6 x tokens x (layer matmul weights x layers + the D x V unembedding)
    weights = m.num_layers * count_params(m).layer_matmul + m.d_model * m.vocab_size
    assert flops.weight_flops == 6 * B * L * weights


def test_causal_mask_halves_attention():
    m = presets.get("llama2-7b")
    f = count_flops(m, TrainConfig(per_device_batch_size=2, seq_len=2048, remat_policy="none",
                                   attention="dot_product"))
    unmasked = 3 * 4 * 2 * 2048**2 * m.num_heads * m.head_dim * m.num_layers
    assert f.attention_flops == unmasked / 2
    assert f.attention_executed_flops == unmasked  # the dot product computes and masks the full score matrix
    # flash skips the masked half; its backward kernel runs 5 matmuls per block against the forward's 2
    flash = count_flops(m, TrainConfig(per_device_batch_size=2, seq_len=2048, remat_policy="none", attention="flash"))
    assert flash.attention_executed_flops == unmasked / 2 / 3 * (1 + 5 / 2)


def test_sliding_window_counted_by_its_window():
    assert attention_pairs(8192, None) == 8192**2 / 2
    assert attention_pairs(8192, 4096) == 8192 * 4096 - 4096**2 / 2
    assert attention_pairs(1024, 4096) == attention_pairs(1024, None)  # a window longer than L changes nothing
    mistral = presets.get("mistral-7b")
    full = replace(mistral, attention_type=AttentionType.GLOBAL, window=None)
    train = TrainConfig(seq_len=8192)
    ratio = count_flops(mistral, train).attention_flops / count_flops(full, train).attention_flops
    assert ratio == pytest.approx(0.75)


def test_local_global_layers_counted_separately():
    m = WINDOWED
    assert m.layer_windows() == (3, None)
    train = TrainConfig(per_device_batch_size=1, seq_len=8)
    per_pair = 4 * m.num_heads * m.head_dim * 3
    assert count_flops(m, train).attention_flops == per_pair * (attention_pairs(8, None) + attention_pairs(8, 3))


def test_remat_adds_hardware_flops_not_model_flops():
    m = presets.get("llama3-8b")
    f = {r: count_flops(m, TrainConfig(seq_len=4096, remat_policy=r, attention="dot_product"))
         for r in ("none", "minimal", "full")}
    assert f["none"].model_flops == f["minimal"].model_flops == f["full"].model_flops
    assert f["none"].recompute_flops == 0
    assert 0 < f["minimal"].recompute_flops < f["full"].recompute_flops
    assert f["none"].hardware_flops < f["minimal"].hardware_flops < f["full"].hardware_flops
    # full remat redoes the layers' forward (a third of their training FLOPs) but for the MLP down projection,
    # whose output the backward never reads (XLA drops it: tests/test_perfmodel_xla_flops.py)
    layers_fwd = (f["full"].weight_flops - 6 * 4096 * m.d_model * m.vocab_size) / 3
    down_fwd = 2 * 4096 * m.num_layers * m.d_model * m.d_ff
    assert f["full"].recompute_flops == pytest.approx(layers_fwd - down_fwd + f["full"].attention_executed_flops / 3)


def test_optimizer_flops_scale_with_the_shard():
    m = presets.get("tiny")
    whole = count_flops(m, TrainConfig())
    shard = count_flops(m, TrainConfig(), params_per_device=count_params(m).total / 8)
    assert shard.optimizer_flops == pytest.approx(whole.optimizer_flops / 8)
    assert whole.optimizer_flops > 0


def test_counts_match_the_flax_model_for_every_option():
    from maxperf.models import train_step

    variants = [
        presets.get("tiny"),
        replace(presets.get("tiny"), activation=Activation.GELU, norm=Norm.LAYERNORM, positions=Positions.LEARNED,
                tie_embeddings=True, qk_norm=True, post_norms=True),
        replace(presets.get("tiny"), activation=Activation.GEGLU, qk_norm=True),
    ]
    for m in variants:
        assert count_params(m).total == train_step.param_count(m), m
