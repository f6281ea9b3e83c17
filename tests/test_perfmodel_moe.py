"""perfmodel for mixtures of experts and latent attention: parameter counts (total and active), FLOPs as MaxText
counts them and as the hardware runs them, memory of experts under their sharding, the all-to-all, load imbalance and
the grouped matmul's efficiency. Small configs are counted by hand; published models are built from their Hugging
Face config.json."""

import math
from dataclasses import replace

import pytest
from perfmodel_util import Topo

from maxperf.perfmodel import count_flops, count_params, estimate, get_chip
from maxperf.perfmodel.memory import estimate_memory, params_per_block
from maxperf.perfmodel.network import LATENCY_S, all_to_all_time, axis_networks
from maxperf.perfmodel.work import matmul_efficiency
from maxperf.spec import presets
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import AttentionType, ModelConfig, RoutedScoreFunc
from maxperf.spec.request import Request
from maxperf.spec.train import TrainConfig

# E 4 experts of Fe 32, top-2, one shared expert, the first layer dense, DeepSeek's selection bias
SMALL = ModelConfig(name="small-moe", vocab_size=256, d_model=64, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=16, d_ff=128, num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=32, shared_experts=1,
                    first_num_dense_layers=1, routed_bias=True)


def test_moe_parameters_by_hand():
    attention = 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64  # q, k and v, o
    norms = 2 * 64
    dense_mlp = 3 * 64 * 128
    expert = 3 * 64 * 32  # gate, up, down of width Fe
    block = 64 * 4 + (4 + 1) * expert + 4  # router, 4 routed and 1 shared expert, the bias
    block_active = 64 * 4 + (2 + 1) * expert + 4
    tables = 2 * 256 * 64 + 64  # embedding, unembedding, final norm
    counts = count_params(SMALL)
    assert counts.total == tables + 3 * (attention + norms) + dense_mlp + 2 * block == 156616
    assert counts.active == tables + 3 * (attention + norms) + dense_mlp + 2 * block_active == 132040
    assert counts.experts == 2 * block == 61960
    assert counts.attention == 3 * attention == 36864


def test_multi_token_prediction_modules_count_apart():
    """Each MTP module: 3 norms of D, the 2D x D projection, one more layer like the last (a MoE layer here)."""
    with_mtp = count_params(replace(SMALL, mtp_num_layers=2))
    layer = 12288 + 128 + 30980  # attention, norms, the MoE block
    assert with_mtp.mtp == 2 * (3 * 64 + 2 * 64 * 64 + layer) == 103560
    assert (with_mtp.total, with_mtp.active) == (count_params(SMALL).total, count_params(SMALL).active)
    assert count_params(SMALL).mtp == 0


def test_latent_attention_parameters_by_hand():
    m = presets.get("tiny-mla")  # D 64, H 4, R 32, C 32, Dn 16, Dr 8, Dv 16
    attention = 64 * 32 + 32 + 32 * 4 * 24 + 64 * (32 + 8) + 32 + 32 * 4 * (16 + 16) + 4 * 16 * 64
    counts = count_params(m)
    assert counts.attention == 2 * attention == 2 * 15936
    assert counts.total == counts.active == 2 * (attention + 3 * 64 * 128 + 2 * 64) + 2 * 256 * 64 + 64 == 114112
    direct = count_params(replace(m, q_lora_rank=0))  # q straight from D: D x H x (Dn + Dr), no latent norm
    assert direct.attention == 2 * (attention - (64 * 32 + 32 + 32 * 4 * 24) + 64 * 4 * 24)


def test_counts_match_the_flax_model():
    from maxperf.models import train_step

    for m in (SMALL, presets.get("tiny-moe"), replace(presets.get("tiny-mla"), q_lora_rank=0),
              replace(SMALL, attention_type=AttentionType.MLA, num_kv_heads=4, head_dim=24, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)):
        assert count_params(m).total == train_step.param_count(m), m.name


# Published models from their Hugging Face config.json:
# mistralai/Mixtral-8x7B-v0.1: hidden_size 4096, intermediate_size 14336, num_hidden_layers 32, num_attention_heads 32,
#   num_key_value_heads 8, num_local_experts 8, num_experts_per_tok 2, vocab_size 32000 (46.7B total, 12.9B active:
#   Mistral AI, "Mixtral of experts", 2023/2024)
MIXTRAL = ModelConfig(name="mixtral-8x7b", vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, d_ff=14336, num_experts=8, num_experts_per_tok=2)
# deepseek-ai/DeepSeek-V3: hidden_size 7168, intermediate_size 18432, moe_intermediate_size 2048,
#   num_hidden_layers 61, first_k_dense_replace 3, num_attention_heads 128, n_routed_experts 256, n_shared_experts 1,
#   num_experts_per_tok 8, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
#   v_head_dim 128, vocab_size 129280, scoring_func sigmoid, topk_method noaux_tc (671B total without the MTP module,
#   37B activated: DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024)
DEEPSEEK_V3 = ModelConfig(
    name="deepseek-v3", vocab_size=129280, d_model=7168, num_layers=61, num_heads=128, num_kv_heads=128,
    head_dim=192, d_ff=18432, attention_type=AttentionType.MLA, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_tok=8,
    base_moe_mlp_dim=2048, shared_experts=1, first_num_dense_layers=3, routed_score_func=RoutedScoreFunc.SIGMOID,
    routed_bias=True, n_routing_groups=8, topk_routing_group=4, norm_topk_prob=True)
# Qwen/Qwen3-30B-A3B: hidden_size 2048, moe_intermediate_size 768, num_hidden_layers 48, num_attention_heads 32,
#   num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8, vocab_size 151936, QK-norm
#   (30.5B total, 3.3B activated, 29.9B non-embedding: the model card)
QWEN3_30B = ModelConfig(name="qwen3-30b-a3b", vocab_size=151936, d_model=2048, num_layers=48, num_heads=32,
                        num_kv_heads=4, head_dim=128, d_ff=6144, qk_norm=True, num_experts=128, num_experts_per_tok=8,
                        base_moe_mlp_dim=768, norm_topk_prob=True)


def test_published_totals_within_one_percent():
    for m, total in ((MIXTRAL, 46.7e9), (DEEPSEEK_V3, 671e9), (QWEN3_30B, 30.5e9)):
        assert count_params(m).total == pytest.approx(total, rel=0.01), m.name
    assert count_params(QWEN3_30B).non_embedding == pytest.approx(29.9e9, rel=0.01)


def test_published_active_counts():
    """Mixtral's 12.9B counts the tables too: within 1%. DeepSeek-V3's 37B and Qwen3's 3.3B are stated to two
    significant figures, which our exact counts (37.55B and 3.353B) meet at that precision but not within 1%:
    exact integers, and the published figure to within one unit of its last digit."""
    assert count_params(MIXTRAL).active == pytest.approx(12.9e9, rel=0.01)
    ds, qwen = count_params(DEEPSEEK_V3), count_params(QWEN3_30B)
    assert ds.active == 37_552_297_472 and abs(ds.active - 37e9) < 1e9
    assert qwen.active == 3_353_032_704 and abs(qwen.active - 3.3e9) < 0.1e9


def _maxtext_routed_training_flops(m: ModelConfig, B: int, L: int, n_dense: int, n_moe: int) -> float:
    """maxtext utils/maxtext_utils.py calculate_tflops_training_per_device for the DeepSeek decoder block (routed and
    shared experts, first dense layers), its grouped-query attention, without the 1e12."""
    ffn = lambda width: 2 * B * L * width * m.d_model * 2 + 2 * B * L * width * m.d_model  # swiglu: two wi
    gate = 2 * B * L * m.d_model * m.num_experts
    ffn_all = ffn(m.d_ff) * n_dense + (gate + ffn(m.moe_mlp_dim) * m.shared_experts
                                       + ffn(m.moe_mlp_dim) * m.num_experts_per_tok) * n_moe
    qkv = 2 * B * L * m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    projection = 2 * B * L * m.d_model * m.num_heads * m.head_dim
    embedding = 2 * B * L * m.d_model * m.vocab_size
    causal = 4 * B * L * L * m.num_heads * m.head_dim / 2
    return (ffn_all + (qkv + projection) * m.num_layers + embedding) * 3 + causal * m.num_layers * 3


def test_moe_model_flops_as_maxtext_counts_them():
    flops = count_flops(SMALL, TrainConfig(per_device_batch_size=2, seq_len=32))
    assert flops.model_flops == _maxtext_routed_training_flops(SMALL, 2, 32, 1, 2) == 46596096
    assert flops.weight_flops == 3 * 2 * 64 * (3 * 12288 + 24576 + 2 * (64 * 4 + 3 * 6144) + 64 * 256)


def test_latent_attention_flops_as_maxtext_counts_them():
    m = presets.get("tiny-mla")
    B, L, BL = 2, 32, 64
    # maxtext calculate_mla_tflops_per_device: q down and up, kv down (with the RoPE key) and up, attention with
    # (Dq + Dv) halved for the mask, the output projection H x Dv x D
    q = 2 * BL * (64 * 32 + 32 * 4 * 24)
    kv = 2 * BL * (64 * (32 + 8) + 32 * 4 * (16 + 16))
    attention = 2 * BL * L * 4 * (24 + 16) / 2
    projection = 2 * BL * 64 * 4 * 16
    ffn = 3 * 2 * BL * 128 * 64
    expected = (2 * ffn + (q + kv + projection) * 2 + 2 * BL * 64 * 256) * 3 + attention * 2 * 3
    assert count_flops(m, TrainConfig(per_device_batch_size=B, seq_len=L)).model_flops == expected == 39321600


def test_capacity_dispatch_hardware_flops():
    """sparse_matmul=false, capacity_factor 1.5: C = ceil(L k / E x 1.5) = 24 slots per expert and sequence, so the
    experts compute E C / L = 3 rows per token against top-k 2, and the dispatch and combine einsums run."""
    train = TrainConfig(per_device_batch_size=2, seq_len=32, sparse_matmul=False, capacity_factor=1.5,
                        remat_policy="none", attention="dot_product")
    flops = count_flops(SMALL, train)
    assert flops.expert_padding_flops == 3 * 2 * 2 * 64 * (3 - 2) * (3 * 64 * 32) == 4718592
    einsums = 2 * 2 * 2 * (2 * 32 * 64 * 4 * 24)  # MoE layers x sequences x (dispatch + combine), forward
    assert flops.dispatch_flops == einsums * (1 + 3 / 2) == 7864320  # backward: 1 dispatch, 2 combine einsums
    assert flops.recompute_flops == 0
    assert flops.model_flops == count_flops(SMALL, replace(train, sparse_matmul=True, capacity_factor=-1)).model_flops


def test_full_remat_recomputes_the_experts_and_router():
    flops = count_flops(SMALL, TrainConfig(per_device_batch_size=2, seq_len=32, remat_policy="full"))
    dense = 8192 + 4096 + 4096 + 8192 + 2 * 2 * 64 * 128  # q, k, v, out, the gate and up of the dense MLP
    # a MoE layer: its attention, the gate, up and down over top-k and shared rows (the routing weights' gradient
    # reads the experts' outputs), and the router
    moe = 24576 + 3 * 2 * 64 * (2 + 1) * 32 + 2 * 64 * 4
    flash_forward = 3 * 2 * 2 * 512 * 4 * 32  # the attention kernel's forward, once more
    assert flops.recompute_flops == 64 * (dense + 2 * moe) + flash_forward == 12386304


def test_experts_state_under_expert_and_fsdp_sharding():
    mesh = Mesh.of({"expert": 4, "fsdp": 2}, {}).check(Topo("tpu-v5p", 8, torus=(2, 2, 2)))
    # per MoE layer: 3 expert arrays [4, 64, 32] -> one local expert, D over fsdp: 32 x 32; the router [64, 4] and
    # the shared expert's [64, 32] arrays with D over fsdp and expert (8); the bias whole
    per_layer = 3 * 32 * 32 + 8 * 4 + 3 * 8 * 32 + 4
    assert params_per_block(SMALL, mesh)["experts"] == 2 * per_layer == 7752
    memory = estimate_memory(SMALL, TrainConfig(per_device_batch_size=2, seq_len=32), mesh, 95e9)
    state = dict(memory.state_blocks)
    assert state["experts"] == 7752 * 4 * 4  # float32 params, gradients and two Adam moments
    assert sum(state.values()) == pytest.approx(memory.params + memory.gradients + memory.optimizer, rel=1e-12)


def test_all_to_all_over_nvlink_and_infiniband():
    chip = get_chip("h100-sxm")
    topo = Topo("h100-sxm", 16, chips_per_host=8, hosts=2, num_slices=2)
    nets = axis_networks(Mesh.of({"expert": 16}, {"expert": 2}).check(topo), chip, topo)
    t = all_to_all_time(8e6, ("expert",), nets)
    nvlink = chip.link_bandwidth * chip.link_count
    assert t.ici_s == pytest.approx(8e6 * (8 / 16) * (7 / 8) / nvlink + LATENCY_S["ici"], rel=1e-12)
    assert t.dcn_s == pytest.approx(8e6 * (1 / 2) / chip.host_network_per_chip, rel=1e-12)
    assert t.dcn_steps == 1  # NCCL pipelines its steps: one latency a collective


def test_a_ring_across_slices_pays_a_latency_per_step():
    """On TPUs each step of a collective's ring across n slices waits for the one before: n - 1 for an all-gather,
    2 (n - 1) for an all-reduce, each at dcn_step_latency."""
    from maxperf.perfmodel.network import collective_time

    chip = get_chip("tpu-v5e")
    topo = Topo("tpu-v5e", 1024, 4, num_slices=4, hosts=256, torus=(16, 16))
    nets = axis_networks(Mesh.of({"data": 4, "fsdp": 256}, {"data": 4}).check(topo), chip, topo)
    assert collective_time("all-reduce", 1e9, ("data",), nets, pieces=10).dcn_steps == 10 * 2 * 3
    assert collective_time("all-gather", 1e9, ("data",), nets).dcn_steps == 3
    two = estimate(Request.of(Topo("tpu-v5e", 512, 4, num_slices=2, hosts=128, torus=(16, 16)), SMALL, TrainConfig(),
                              {"data": 2, "fsdp": 256}, {"data": 2}))
    eight = estimate(Request.of(Topo("tpu-v5e", 2048, 4, num_slices=8, hosts=512, torus=(16, 16)), SMALL,
                                TrainConfig(), {"data": 8, "fsdp": 256}, {"data": 8}))
    dcn = {n: sum(r.seconds for r in e.breakdown if r.kind == "dcn") for n, e in ((2, two), (8, eight))}
    assert dcn[8] > 3 * dcn[2] > 0  # 14 steps of the ring against 2; its bandwidth term grows by 7/4 only


def test_all_to_all_on_a_torus_pays_the_mean_hops():
    chip = get_chip("tpu-v5p")
    topo = Topo("tpu-v5p", 64, hosts=16, torus=(4, 4, 4))
    ring = axis_networks(Mesh.of({"expert": 4, "fsdp": 16}, {}).check(topo), chip, topo)
    plane = axis_networks(Mesh.of({"expert": 16, "fsdp": 4}, {}).check(topo), chip, topo)
    # a ring of 4 over 2 links: a mean of 1 hop; a 4 x 4 plane over 4 links: 2 hops
    assert all_to_all_time(1e6, ("expert",), ring).ici_s == pytest.approx(
        1e6 * 1 / (2 * chip.link_bandwidth) + LATENCY_S["ici"], rel=1e-12)
    assert all_to_all_time(1e6, ("expert",), plane).ici_s == pytest.approx(
        1e6 * 2 / (4 * chip.link_bandwidth) + LATENCY_S["ici"], rel=1e-12)


def _row(e, name):
    return next(r for r in e.breakdown if r.name == name)


def test_all_to_all_rows_of_the_step():
    """Per MoE layer: dispatch and combine forward, their gradients, the dispatch again under remat; each device sends
    its routed rows, k = 2 a token of its 64, as MaxText's ragged_all_to_all sends them (not the worst-case buffer
    maxperf's own step exchanges, min(k, E / expert) = 1 row for each of the 4 shards, which XLA:CPU runs)."""
    topo = Topo("h100-sxm", 8, chips_per_host=8)
    train = TrainConfig(per_device_batch_size=2, seq_len=32, remat_policy="full")
    e = estimate(Request.of(topo, SMALL, train, {"expert": 4, "fsdp": 2}, {}), load_imbalance=1.5)
    sent = 64 * 2 * 64 * 2  # tokens x routed rows x D x bfloat16
    nets = axis_networks(Mesh.of({"expert": 4, "fsdp": 2}, {}).check(topo), get_chip("h100-sxm"), topo)
    assert _row(e, "expert all-to-all (ici)").seconds == pytest.approx(
        2 * 5 * all_to_all_time(sent, ("expert",), nets).ici_s, rel=1e-12)
    assert any("1.5x the mean of the routed rows" in line for line in e.assumptions)


def test_load_imbalance_scales_the_busiest_experts_work():
    topo = Topo("tpu-v5p", 8, torus=(2, 2, 2))
    train = TrainConfig(per_device_batch_size=2, seq_len=32, remat_policy="none")
    down = {f: _row(estimate(Request.of(topo, SMALL, train, {"expert": 4, "fsdp": 2}, {}), load_imbalance=f),
                    "experts down")
            for f in (1.0, 2.0)}
    assert down[2.0].flops == 2 * down[1.0].flops == 2 * (3 * 2 * 64 * 2 * 32 * 64 * 2)  # fwd + bwd, 2 MoE layers
    # without an expert axis every device runs all experts on its own tokens: no imbalance
    alone = _row(estimate(Request.of(topo, SMALL, train, {"fsdp": 8}, {}), load_imbalance=2.0), "experts down")
    assert alone.flops == down[1.0].flops


def test_grouped_matmul_runs_at_the_efficiency_of_its_rows_per_expert():
    """128 experts top-2 over 2048 tokens: 32 rows per expert, each expert's matmul as thin as that (compute-bound
    at that efficiency), far slower per FLOP than the dense MLP of the same model."""
    m = ModelConfig(name="wide-moe", vocab_size=1024, d_model=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                    head_dim=128, d_ff=8192, num_experts=128, num_experts_per_tok=2, base_moe_mlp_dim=4096,
                    first_num_dense_layers=1)
    topo = Topo("tpu-v5p", 1, chips_per_host=1, torus=(1, 1, 1))
    e = estimate(Request.of(topo, m, TrainConfig(per_device_batch_size=1, seq_len=2048, remat_policy="none",
                                                 megablox=False), {"fsdp": 1}, {}))
    chip = get_chip("tpu-v5p")
    down = _row(e, "experts down")
    assert down.kind == "compute"
    assert down.seconds == pytest.approx(down.flops / (chip.peak_flops("bfloat16") * matmul_efficiency(chip, 32)),
                                         rel=1e-12)
    dense = _row(e, "mlp down")
    assert dense.seconds == pytest.approx(dense.flops / (chip.peak_flops("bfloat16") * matmul_efficiency(chip, 2048)),
                                          rel=1e-12)


def test_megablox_computes_a_row_tile_for_every_expert_boundary():
    """The Pallas megablox kernel runs all 4096 sorted rows in 512-row tiles; a tile straddling two experts' rows is
    computed for each, so 128 experts of 32 rows cost 8 + 127 tiles: 4096 of 69120 rows useful."""
    m = ModelConfig(name="wide-moe", vocab_size=1024, d_model=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                    head_dim=128, d_ff=8192, num_experts=128, num_experts_per_tok=2, base_moe_mlp_dim=4096,
                    first_num_dense_layers=1)
    topo = Topo("tpu-v5p", 1, chips_per_host=1, torus=(1, 1, 1))
    e = estimate(Request.of(topo, m, TrainConfig(per_device_batch_size=1, seq_len=2048, remat_policy="none"),
                            {"fsdp": 1}, {}))
    chip = get_chip("tpu-v5p")
    down = _row(e, "experts down")
    useful = 4096 / (4096 + 127 * 512)
    assert down.seconds == pytest.approx(down.flops / (chip.peak_flops("bfloat16") * matmul_efficiency(chip, 4096)
                                                       * useful), rel=1e-12)
    assert any("megablox's 512 x 1024 x 1024 tiles (forward, input and weight gradients alike)" in line
               for line in e.assumptions)


def test_megablox_prices_each_product_in_its_own_tiles():
    """MaxText's wo_tile_{fwd,dlhs,drhs}_batch_seq at 128, 256 and (its default) 512: the forward, the input gradient
    and the weight gradient of the down projection each pay a row tile per expert boundary of its own size."""
    m = ModelConfig(name="wide-moe", vocab_size=1024, d_model=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                    head_dim=128, d_ff=8192, num_experts=128, num_experts_per_tok=2, base_moe_mlp_dim=4096,
                    first_num_dense_layers=1)
    topo = Topo("tpu-v5p", 1, chips_per_host=1, torus=(1, 1, 1))
    train = TrainConfig(per_device_batch_size=1, seq_len=2048, remat_policy="none", wo_tile_fwd_batch_seq=128,
                        wo_tile_dlhs_batch_seq=256)
    e = estimate(Request.of(topo, m, train, {"fsdp": 1}, {}))
    chip = get_chip("tpu-v5p")
    down, up = _row(e, "experts down"), _row(e, "experts up and gate")
    rate = chip.peak_flops("bfloat16") * matmul_efficiency(chip, 4096)
    # the three products do equal FLOPs (no recomputation: remat none)
    assert down.seconds == pytest.approx(sum(down.flops / 3 / (rate * 4096 / (4096 + 127 * tm))
                                             for tm in (128, 256, 512)), rel=1e-12)
    assert up.seconds == pytest.approx(up.flops / (rate * 4096 / (4096 + 127 * 512)), rel=1e-12)  # wi's untouched
    assert any("down projections in megablox's 128 x 1024 x 1024 / 256 x 1024 x 1024 / 512 x 1024 x 1024 tiles"
               in line for line in e.assumptions)


def test_estimate_memory_breaks_down_experts_attention_and_the_rest():
    topo = Topo("tpu-v5p", 8, torus=(2, 2, 2))
    e = estimate(Request.of(topo, SMALL, TrainConfig(per_device_batch_size=2, seq_len=32, remat_policy="none"),
                            {"expert": 4, "fsdp": 2}, {}))
    d = e.as_dict()["memory"]
    assert set(d["state_blocks"]) == set(d["activation_blocks"]) == {"experts", "attention", "rest"}
    assert sum(d["activation_blocks"].values()) == pytest.approx(e.memory.activations, rel=1e-12)
    assert d["activation_blocks"]["experts"] > 0 and d["state_blocks"]["attention"] > 0
    assert math.isfinite(e.step_time_s) and e.params.active == 132040


def test_saved_expert_tensors_fill_the_worst_case_exchange_buffer():
    """Under expert=4 each device receives, for each of its 64 tokens, min(k, E / expert) = 1 row from each of the 4
    devices: 4 rows, however routing falls; the shared expert adds its own. remat minimal keeps mlpwi_0, mlpwi_1
    and, read by the routing weights' gradient in a MoE layer, mlpwo; but the dropless routed experts' up
    projection MaxText names moe_mlpwi_1 alone, so mlpwi_1 keeps the shared expert's there (the einsum dispatch
    names both)."""
    from maxperf.perfmodel.saved import named_per_token

    mesh = Mesh.of({"expert": 4, "fsdp": 2}, {}).check(Topo("tpu-v5p", 8, torus=(2, 2, 2)))
    train = TrainConfig(per_device_batch_size=2, seq_len=32, remat_policy="minimal")
    sizes = named_per_token(SMALL, train, mesh, moe_layer=True)
    assert (sizes["mlpwi_0"], sizes["mlpwi_1"], sizes["mlpwo"]) == (2 * (4 + 1) * 32, 2 * 1 * 32, 2 * 64 * 5)
    einsum = named_per_token(SMALL, replace(train, sparse_matmul=False), mesh, moe_layer=True)
    assert einsum["mlpwi_1"] == einsum["mlpwi_0"]
    dense = named_per_token(SMALL, train, mesh)
    assert (dense["mlpwi_0"], dense["mlpwo"]) == (2 * 128, 0.0)


@pytest.mark.parametrize("name, layers, overrides, measured_s", [
    ("mixtral-8x7b", 2, {}, 0.5911), ("mixtral-8x7b", 2, {"sparse_matmul": False, "capacity_factor": 1.25}, 0.1686),
    ("deepseek-v2-lite", 4, {}, 1.2793),
    ("deepseek-v2-lite", 4, {"sparse_matmul": False, "capacity_factor": 1.25}, 0.1328),
    ("qwen3-30b-a3b", 4, {"sparse_matmul": False, "capacity_factor": 1.25}, 0.1733)])
def test_moe_steps_on_an_h100_follow_the_dispatch_they_measured(name, layers, overrides, measured_s):
    """Steps cut to a few layers, B 4, L 2048, full remat, compiled and run on one H100 (bench/gpu_measured.py,
    2026-11-23): XLA:GPU's ragged_dot (dropless) ran 3.5x (8 experts) and 9.6x (64 experts) slower than the capacity
    einsums. Within 15% each; with ragged_dot at the plain per-expert rate the dropless steps were predicted at 166
    and 117 ms."""
    from perfmodel_util import Topo

    model = replace(presets.get(name), num_layers=layers)
    train = TrainConfig(per_device_batch_size=4, seq_len=2048, **overrides)
    h100 = Topo("h100-sxm", 1, chips_per_host=1, torus=(1, 1))
    assert estimate(Request.of(h100, model, train, {"fsdp": 1}, {})).step_time_s == pytest.approx(measured_s, rel=0.15)


def test_the_load_imbalance_key_reaches_the_step_time():
    from perfmodel_util import Topo

    model = presets.get("mixtral-8x7b")
    v5p = Topo("tpu-v5p", 64, hosts=16, torus=(4, 4, 4))

    def step(**kw):
        train = TrainConfig(per_device_batch_size=1, seq_len=2048, **kw)
        return estimate(Request.of(v5p, model, train, {"fsdp": 8, "expert": 8}, {}))

    assumed, balanced, skewed = step(), step(moe_load_imbalance=1.0), step(moe_load_imbalance=2.0)
    assert balanced.step_time_s < assumed.step_time_s < skewed.step_time_s
    assert any("moe_load_imbalance" in line for line in skewed.as_dict()["assumptions"])
    with pytest.raises(Exception, match="moe_load_imbalance"):
        TrainConfig(moe_load_imbalance=0.5)


def test_a_load_imbalance_is_at_most_the_expert_shards_and_said_to_change_nothing_without_them():
    from maxperf.spec.errors import MaxperfError
    from maxperf.spec.request import resolve

    with pytest.raises(MaxperfError, match="at most 8 .every row on one shard.; choose 1 to 8"):
        resolve("v5p-256", "mixtral-8x7b", ["ici_expert_parallelism=8", "moe_load_imbalance=100"])
    assert not any("moe_load_imbalance" in w for w in resolve(
        "v5p-256", "mixtral-8x7b", ["ici_expert_parallelism=8", "moe_load_imbalance=8"]).warnings)
    for words, why in ((["moe_load_imbalance=2"], "there is no expert parallelism"),
                       (["ici_expert_parallelism=8", "sparse_matmul=false", "moe_load_imbalance=2"],
                        "einsum dispatch")):
        notes = [w for w in resolve("v5p-256", "mixtral-8x7b", words).warnings if "moe_load_imbalance=2" in w]
        assert len(notes) == 1 and why in notes[0] and notes[0].endswith("it changes nothing")


def test_multi_token_prediction_modules_are_in_the_memory():
    """Two MTP modules on one device: their parameters (count_params' mtp) in float32, each depth's logits beside the
    decoder's, and per depth and token its layer's input, the concatenated 2D projection input and three RMSNorms (each
    its float32 input and its normalized value in bfloat16; full remat keeps nothing else of the layer)."""
    from maxperf.spec.params import mtp_arrays

    mesh = Mesh.of({}, {}).check(Topo("tpu-v5p", 1, chips_per_host=1, torus=(1, 1, 1)))
    train = TrainConfig(per_device_batch_size=2, seq_len=32, remat_policy="full")
    with_mtp = replace(SMALL, mtp_num_layers=2)
    assert sum(x.count * math.prod(x.shape) for x in mtp_arrays(with_mtp)) == count_params(with_mtp).mtp == 103560
    assert mtp_arrays(SMALL) == ()
    base, mtp = estimate_memory(SMALL, train, mesh, 95e9), estimate_memory(with_mtp, train, mesh, 95e9)
    assert mtp.params - base.params == 103560 * 4
    assert mtp.logits - base.logits == 2 * 64 * 256 * 2  # T 64 tokens, V 256, bfloat16
    assert mtp.activations - base.activations == 2 * 64 * (3 * 2 * 64 + 3 * (4 + 2) * 64)


def test_expert_gradients_keep_the_split_of_the_experts_shard_map():
    """fsdp_transpose 2 x tensor 2 x fsdp 2: each expert matrix [4, 64, 32] holds F over fsdp_transpose and tensor
    (8 of 32), D over fsdp; its gradient comes out of the dispatch's shard_map with F over tensor alone (16): 1024
    more elements per matrix, for 3 matrices in 2 MoE layers, in the gradients and the float32 accumulator."""
    from maxperf.perfmodel.memory import expert_gradient_excess, params_per_device

    mesh = Mesh.of({"fsdp_transpose": 2, "tensor": 2, "fsdp": 2}, {}).check(Topo("tpu-v5p", 8, torus=(2, 2, 2)))
    train = TrainConfig(per_device_batch_size=2, seq_len=32, grad_accum_steps=2)
    assert expert_gradient_excess(SMALL, train, mesh) == 2 * 3 * 1024
    memory = estimate_memory(SMALL, train, mesh, 95e9)
    assert memory.gradients == memory.grad_accumulator == (params_per_device(SMALL, mesh) + 6144) * 4
    einsum = replace(train, sparse_matmul=False, capacity_factor=1.0)  # no shard_map: split as the parameters
    assert expert_gradient_excess(SMALL, einsum, mesh) == 0.0


@pytest.mark.parametrize("L", [32, 256])
def test_the_exchange_runs_serially_where_overlapping_it_would_not_fit(L):
    """A TPU whose memory is one byte short of the overlapped estimate: three D-wide row buffers fewer in the
    experts' backward (T = 2L tokens x 4 receive rows x D 64, bfloat16); a GPU's estimate does not change."""
    mesh = Mesh.of({"expert": 4, "fsdp": 2}, {}).check(Topo("tpu-v5p", 8, torus=(2, 2, 2)))
    train = TrainConfig(per_device_batch_size=2, seq_len=L, remat_policy="full")
    roomy = estimate_memory(SMALL, train, mesh, 95e9)
    tight = estimate_memory(SMALL, train, mesh, roomy.per_device_total_bytes - 1)
    assert roomy.temporaries - tight.temporaries == 3 * 2 * L * 4 * 64 * 2
    # the serialized breakdown says what the overlapped one needed, and the overlapped one says nothing
    assert tight.overlapped_bytes == roomy.per_device_total_bytes and roomy.overlapped_bytes == 0
    gpu = estimate_memory(SMALL, train, mesh, roomy.per_device_total_bytes - 1, platform="gpu")
    assert gpu.temporaries == estimate_memory(SMALL, train, mesh, 95e9, platform="gpu").temporaries


def test_thin_expert_shards_hold_a_gather_in_flight_not_the_gradients(monkeypatch):
    """D 64 over fsdp 2 is 32 rows a shard, thinner than a windowed gather's: the peak holds the gathered layer and
    one more gathered matrix (its zero-padded all-reduce input), whatever EXPERT_GRAD_MATRICES says."""
    from maxperf.perfmodel import working

    mesh = Mesh.of({"expert": 4, "fsdp": 2}, {}).check(Topo("tpu-v5p", 8, torus=(2, 2, 2)))
    train = TrainConfig(per_device_batch_size=2, seq_len=32, remat_policy="full")
    base = estimate_memory(SMALL, train, mesh, 95e9).temporaries
    monkeypatch.setattr(working, "EXPERT_GRAD_MATRICES", 7)
    assert estimate_memory(SMALL, train, mesh, 95e9).temporaries == base
    monkeypatch.setattr(working, "THIN_EXPERT_GATHER_IN_FLIGHT", 0)
    # one local expert [1, 64, 32] gathered over fsdp, bfloat16
    assert base - estimate_memory(SMALL, train, mesh, 95e9).temporaries == 64 * 32 * 2


@pytest.mark.parametrize("axes, local_experts, rows", [({"fsdp": 8}, 4, 2), ({"expert": 2, "fsdp": 4}, 2, 4)])
def test_gpu_grouped_matmuls_hold_their_dense_expansion_over_the_local_experts(monkeypatch, axes, local_experts, rows):
    """XLA:GPU multiplies every routed row by every local expert: two D-wide and three Fe-wide buffers of local experts
    x rows each in the experts' backward (T = 2 x 256 tokens, D 64, Fe 32, bfloat16; rows per token: top-2, or the
    receive buffer of expert 2 x min(2, 4 / 2)). TPU's grouped matmuls and the einsum dispatch hold none."""
    from maxperf.perfmodel import working

    mesh = Mesh.of(axes, {}).check(Topo("h100-sxm", 8, chips_per_host=8))
    train = TrainConfig(per_device_batch_size=2, seq_len=256, remat_policy="full")
    einsum = replace(train, sparse_matmul=False, capacity_factor=1.0)
    counted = {k: estimate_memory(SMALL, t, mesh, 80e9, platform=p).temporaries
               for k, (t, p) in {"gpu": (train, "gpu"), "tpu": (train, "tpu"), "einsum": (einsum, "gpu")}.items()}
    monkeypatch.setattr(working, "RAGGED_EXPANDED_D_BUFFERS", 0)
    monkeypatch.setattr(working, "RAGGED_EXPANDED_F_BUFFERS", 0)
    assert counted["gpu"] - estimate_memory(SMALL, train, mesh, 80e9, platform="gpu").temporaries == (
        2 * 256 * rows * local_experts * (2 * 64 + 3 * 32) * 2)
    assert counted["tpu"] == estimate_memory(SMALL, train, mesh, 80e9, platform="tpu").temporaries
    assert counted["einsum"] == estimate_memory(SMALL, einsum, mesh, 80e9, platform="gpu").temporaries


def test_gpu_holds_a_second_layout_of_fsdp_sharded_expert_gradients(monkeypatch):
    """Where FSDP shards the experts, their float32 gradients are held twice on GPU: one more copy of 2 MoE layers x
    local experts x 3 matrices of D 64 x Fe 32 over the FSDP shards, 4 bytes each (4 experts over fsdp 8; 1 over
    fsdp 2 beside expert 4). With the experts split over the expert axis alone, and on TPU, once."""
    from maxperf.perfmodel import working

    train = TrainConfig(per_device_batch_size=2, seq_len=256, remat_policy="full")  # float32 parameters
    h100 = Topo("h100-sxm", 8, chips_per_host=8)
    fsdp, expert = Mesh.of({"fsdp": 8}, {}).check(h100), Mesh.of({"expert": 4, "fsdp": 2}, {}).check(h100)
    ep_only = Mesh.of({"expert": 8}, {}).check(h100)
    counted = {(m, p): estimate_memory(SMALL, train, mesh, 80e9, platform=p).temporaries
               for m, mesh in {"fsdp": fsdp, "expert": expert, "ep": ep_only}.items() for p in ("gpu", "tpu")}
    monkeypatch.setattr(working, "GPU_EXPERT_GRADIENT_COPIES", 0)
    assert counted["fsdp", "gpu"] - estimate_memory(SMALL, train, fsdp, 80e9, platform="gpu").temporaries == (
        2 * 4 * 3 * 64 * 32 / 8 * 4)
    assert counted["expert", "gpu"] - estimate_memory(SMALL, train, expert, 80e9, platform="gpu").temporaries == (
        2 * 1 * 3 * 64 * 32 / 2 * 4)
    assert counted["ep", "gpu"] == estimate_memory(SMALL, train, ep_only, 80e9, platform="gpu").temporaries
    for m, mesh in {"fsdp": fsdp, "expert": expert}.items():
        assert counted[m, "tpu"] == estimate_memory(SMALL, train, mesh, 80e9, platform="tpu").temporaries
