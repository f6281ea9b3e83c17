"""Llama 4, gpt-oss and Gemma 3 on CPU with tiny configs: chunked attention, RoPE-free layers, L2 QK-norm and
temperature tuning, sigmoid-weighted token routing; attention sinks, projection and expert biases, the clamped
SwiGLU; the local layers' RoPE base; each kernel against the dot product, and the presets' parameter counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_util import loss_and_grads

from maxperf.models import train_step
from maxperf.models.layers import attention as attention_layer
from maxperf.models.layers.attention import Attention
from maxperf.models.layers.mlp import gate
from maxperf.models.layers.moe import route
from maxperf.perfmodel.flops import count_flops, count_params
from maxperf.spec import attention_rule, overrides, presets
from maxperf.spec import params as params_spec
from maxperf.spec.errors import MaxperfError
from maxperf.spec.model import Activation, ModelConfig

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}

# Llama 4's mechanisms on the tiny mixture of experts: 4 layers, the 2nd and 4th RoPE-free and global, the others in
# chunks of 4 of the 16 tokens; every other layer a mixture of experts, top-1 with the sigmoid weight on the token
LLAMA4 = ("num_layers=4", "attention_type=chunk", "chunk_attn_window_size=4", "nope_layer_interval=2",
          "qk_l2_norm=true", "temperature_tuning=true", "routed_score_func=sigmoid", "routed_input_scaling=true",
          "shared_experts=1", "num_experts_per_tok=1", "norm_topk_prob=false", "interleave_moe_layer_step=2")
# gpt-oss's: sliding (4) and global layers alternating, sinks, biases everywhere, the clamped SwiGLU with a limit the
# tiny model's activations cross
GPT_OSS = ("attention_type=local_global", "window=4", "attention_sinks=true", "attention_bias=true", "mlp_bias=true",
           "routed_bias=true", "activation=clamped_swiglu", "mlp_activations_limit=0.5")


@pytest.fixture(autouse=True)
def strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


def _perturbed(params):
    """Biases and sinks moved off their zero initialization, so that the forward depends on them."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    keys = iter(jax.random.split(jax.random.PRNGKey(7), len(leaves)))

    def move(path, x):
        key = next(keys)
        named = jax.tree_util.keystr(path)
        if "bias" in named or "sinks" in named:
            return x + 0.5 * jax.random.normal(key, x.shape, x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(move, params)


def _loss_and_grads(*words: str):
    """The tiny mixture of experts' mean next-token loss on one seeded batch, and its gradients, on one device, with
    biases and sinks perturbed."""
    return loss_and_grads(*words, preset="tiny-moe", perturb=_perturbed)


def _assert_same(got, ref):
    np.testing.assert_allclose(got[0], ref[0], **TOLERANCE)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE), got[1], ref[1])


# --- Llama 4 ------------------------------------------------------------------------------------------------------

def test_llama4_layers_follow_maxtext():
    """MaxText's llama4 decoder: layer i is RoPE-free and global when (i + 1) % 4 == 0, chunked otherwise; MoE when
    (i + 1) % interleave_moe_layer_step == 0."""
    maverick = presets.get("llama4-maverick-17b-128e")
    nope = [(i + 1) % 4 == 0 for i in range(48)]
    assert list(maverick.nope_layers()) == nope
    assert list(attention_rule.layer_masks(maverick)) == [0 if n else -8192 for n in nope]
    assert list(maverick.moe_layers()) == [i % 2 == 1 for i in range(48)]
    assert all(presets.get("llama4-scout-17b-16e").moe_layers())


@pytest.mark.slow
@pytest.mark.parametrize("scan", ["true", "false"])
def test_llama4_flash_matches_dot_product(scan):
    # the blockwise kernel with the chunk mask and the global layers' causal one (traced through the scan, or static
    # per unrolled layer), RoPE skipped on the RoPE-free layers either way
    ref = _loss_and_grads(*LLAMA4, f"scan_layers={scan}", "attention=dot_product")
    _assert_same(_loss_and_grads(*LLAMA4, f"scan_layers={scan}", "attention=flash"), ref)


@pytest.mark.slow
def test_llama4_dense_dispatch_equals_the_dropless_one():
    # the router's weight on the token before its expert, in both dispatches (capacity 4 x its share: nothing dropped)
    ref = _loss_and_grads(*LLAMA4, "attention=dot_product")
    _assert_same(_loss_and_grads(*LLAMA4, "attention=dot_product", "sparse_matmul=false", "capacity_factor=4"), ref)


def _attention(cfg: ModelConfig):
    layer = Attention(cfg, jnp.float32, nnx.Rngs(0))
    x_BxLxD = jax.random.normal(jax.random.PRNGKey(1), (1, 12, cfg.d_model))
    return layer, x_BxLxD


def test_a_rope_free_layer_applies_no_rope():
    """Without RoPE the layer computes what RoPE at position 0 (the identity) gives; with it, something else."""
    cfg = overrides.apply(presets.get("tiny"), list(LLAMA4[:4])).model
    layer, x = _attention(cfg)
    positions, zeros = jnp.arange(12)[None], jnp.zeros((1, 12), jnp.int32)
    without = layer(x, positions, 0, rope=False)
    np.testing.assert_allclose(without, layer(x, zeros, 0, rope=True), **TOLERANCE)
    assert float(jnp.max(jnp.abs(without - layer(x, positions, 0, rope=True)))) > 1e-3
    # traced through a scan, the flag does the same
    np.testing.assert_allclose(jax.jit(lambda r: layer(x, positions, 0, rope=r))(jnp.bool_(False)), without,
                               **TOLERANCE)


def test_l2_qk_norm_makes_each_query_and_key_unit_rms_on_rope_layers():
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 2, 16)) * 5
    normed = attention_layer._l2_norm(q, 1e-5)
    np.testing.assert_allclose(jnp.mean(normed * normed, axis=-1), np.ones((1, 3, 2)), rtol=1e-4)


def test_temperature_tuning_scales_rope_free_queries_as_llama4():
    """1 + 0.1 ln(floor((p + 1) / 8192) + 1): 1 below position 8191, 1 + 0.1 ln 2 there, 1 + 0.1 ln 3 at 16383."""
    q = jnp.ones((1, 4, 1, 2))
    positions = jnp.asarray([[0, 8190, 8191, 16383]])
    got = attention_layer._tune_temperature(q, positions, False)[0, :, 0, 0]
    np.testing.assert_allclose(got, [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)], rtol=1e-6)
    np.testing.assert_allclose(attention_layer._tune_temperature(q, positions, jnp.bool_(True)), q)


def test_llama4_routing_weights_the_token_with_the_sigmoid_of_its_logit():
    cfg = overrides.apply(presets.get("tiny-moe"), list(LLAMA4)).model
    logits = jnp.asarray([[0.3, -1.0, 2.0, 0.5]])
    routing = route(logits, cfg)
    assert int(routing.experts_TxK[0, 0]) == 2
    np.testing.assert_allclose(routing.weights_TxK[0, 0], jax.nn.sigmoid(2.0), rtol=1e-6)


def test_llama4_presets_have_their_published_total_and_active_parameters():
    """Meta's 109B and 400B totals (less the vision encoder, counted from its config) within 1%; the active 17B
    within 2%: 17.17B is counted here, which its two digits round to (1.0% off)."""
    for name in ("llama4-scout-17b-16e", "llama4-maverick-17b-128e"):
        model = presets.get(name)
        counts = count_params(model)
        assert train_step.param_count(model) == counts.total
        assert counts.total == pytest.approx(presets.PUBLISHED_PARAMS[name], rel=0.01)
        assert counts.total + presets.llama4_vision_params() == pytest.approx(
            {"llama4-scout-17b-16e": 109e9, "llama4-maverick-17b-128e": 400e9}[name], rel=0.01)
        assert counts.active == pytest.approx(presets.PUBLISHED_ACTIVE_PARAMS[name], rel=0.02)


def test_chunked_attention_flops_as_maxtext_counts_them():
    """MaxText's calculate_llama4_attention_tflops: 4 B L^2 H Dh per global layer, 4 B (sum of chunk lengths squared)
    H Dh per chunked layer, halved for the causal mask, x 3 for training."""
    model = presets.get("llama4-scout-17b-16e")
    cfg = overrides.apply(model, ["seq_len=20000", "per_device_batch_size=1"])
    B, L, H, Dh, C = 1, 20000, 40, 128, 8192
    chunked = 4 * B * ((L // C) * C * C + (L % C) ** 2) * H * Dh
    maxtext = (12 * 4 * B * L * L * H * Dh + 36 * chunked) / 2 * 3
    assert count_flops(model, cfg.train).attention_flops == pytest.approx(maxtext, rel=1e-12)


def test_chunked_attention_serves_on_every_platform():
    scout = overrides.apply(presets.get("llama4-scout-17b-16e"), [])
    assert [attention_rule.for_config(scout.model, scout.train, p) for p in ("tpu", "gpu", "cpu")] == [
        "splash", "gpu_flash", "blockwise"]


# --- gpt-oss ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_gpt_oss_flash_matches_dot_product():
    # sinks and biases moved off zero: the blockwise kernel's sinks and their gradients against the dot product's
    ref = _loss_and_grads(*GPT_OSS, "attention=dot_product")
    _assert_same(_loss_and_grads(*GPT_OSS, "attention=flash"), ref)
    sinks = [x for path, x in jax.tree_util.tree_leaves_with_path(ref[1]) if "sinks" in jax.tree_util.keystr(path)]
    assert sinks and all(float(jnp.max(jnp.abs(x))) > 1e-4 for x in sinks)  # the sinks learn


@pytest.mark.slow
def test_gpt_oss_dense_dispatch_equals_the_dropless_one():
    # the expert biases gathered per sorted row (dropless) against added per expert slot (dense, capacity 2 x its
    # share: nothing dropped), forward and backward
    ref = _loss_and_grads(*GPT_OSS, "attention=dot_product")
    _assert_same(_loss_and_grads(*GPT_OSS, "attention=dot_product", "sparse_matmul=false", "capacity_factor=2"), ref)


def test_clamped_swiglu_is_gpt_oss_activation():
    """MaxText's gpt_oss: g clipped at 7 from above, h to [-7, 7], then g sigmoid(1.702 g) (h + 1)."""
    g = jnp.asarray([-3.0, 0.5, 9.0])
    h = jnp.asarray([-8.0, 0.25, 2.0])
    want = [-3 * jax.nn.sigmoid(-3 * 1.702) * (-7 + 1), 0.5 * jax.nn.sigmoid(0.5 * 1.702) * 1.25,
            7 * jax.nn.sigmoid(7 * 1.702) * 3]
    np.testing.assert_allclose(gate(Activation.CLAMPED_SWIGLU, g, h, 7.0), want, rtol=1e-6)


def test_router_bias_is_a_logit_bias_with_softmax_and_selection_only_with_sigmoid():
    softmax = overrides.apply(presets.get("tiny-moe"), ["routed_bias=true"]).model
    logits, bias = jnp.asarray([[1.0, 0.0, 0.5, -1.0]]), jnp.asarray([0.0, 3.0, 0.0, 0.0])
    routed = route(logits, softmax, bias)  # gpt-oss: top-2 of the biased logits, a softmax over the two
    assert sorted(routed.experts_TxK[0].tolist()) == [0, 1]
    np.testing.assert_allclose(sorted(routed.weights_TxK[0].tolist()), sorted(jax.nn.softmax(jnp.asarray([1.0, 3.0]))),
                               rtol=1e-6)
    sigmoid = overrides.apply(presets.get("tiny-moe"), ["routed_bias=true", "routed_score_func=sigmoid"]).model
    routed = route(logits, sigmoid, bias)  # DeepSeek-V3: the bias picks, the unbiased scores weigh
    assert sorted(routed.experts_TxK[0].tolist()) == [0, 1]
    picked = jax.nn.sigmoid(jnp.asarray([1.0, 0.0]))
    np.testing.assert_allclose(sorted(routed.weights_TxK[0].tolist()), sorted((picked / picked.sum()).tolist()),
                               rtol=1e-6)


def test_sinks_and_biases_count_as_parameters_not_flops():
    base = overrides.apply(presets.get("tiny-moe"), ["seq_len=16", *GPT_OSS[:2]])  # SwiGLU, no sinks or biases
    oss = overrides.apply(presets.get("tiny-moe"), ["seq_len=16", *GPT_OSS])
    plain = overrides.apply(presets.get("tiny-moe"), ["seq_len=16", *GPT_OSS[:2], "activation=clamped_swiglu"])
    D, H, K, Dh, N, E, F, k = 64, 4, 2, 16, 2, 4, 64, 2
    extra = N * (H + H * Dh + 2 * K * Dh + D + E + E * (2 * F + D))
    assert count_params(oss.model).total - count_params(plain.model).total == extra
    assert train_step.param_count(oss.model) == count_params(oss.model).total
    active = N * (H + H * Dh + 2 * K * Dh + D + E + k * (2 * F + D))
    assert count_params(oss.model).active - count_params(plain.model).active == active
    # MaxText counts matmuls only: the sinks' one logit per query and head, and the bias adds, are not among them
    assert count_flops(oss.model, oss.train).model_flops == count_flops(plain.model, plain.train).model_flops
    assert count_flops(base.model, base.train).model_flops == count_flops(plain.model, plain.train).model_flops


def test_sinks_take_splash_on_tpu_and_the_dot_product_on_gpu():
    oss = overrides.apply(presets.get("gpt-oss-20b"), [])
    assert attention_rule.for_config(oss.model, oss.train, "tpu") == "splash"
    assert attention_rule.for_config(oss.model, oss.train, "gpu") == "dot_product"  # sliding windows and sinks
    sinks = overrides.apply(presets.get("tiny"), ["attention_sinks=true", "attention=flash", "seq_len=256"])
    with pytest.raises(MaxperfError, match=r"attention=flash \(gpu_flash on gpu\) has no attention sinks"):
        attention_rule.for_config(sinks.model, sinks.train, "gpu")


# --- Gemma 3 ------------------------------------------------------------------------------------------------------

def test_gemma3_local_layers_take_the_local_rope_base():
    """A sliding-window layer rotates by local_rope_theta, a global one by rope_theta with positions divided by
    rope_linear_scaling_factor: each equals a layer that has that base alone."""
    words = ["attention_type=local_global", "window=4", "local_per_global=5", "qk_norm=true"]
    both = overrides.apply(presets.get("tiny"), [*words, "rope_theta=1e6", "local_rope_theta=10",
                                                 "rope_linear_scaling_factor=8"]).model
    layer, x = _attention(both)
    positions = jnp.arange(12)[None]
    local_only, _ = _attention(overrides.apply(presets.get("tiny"), [*words, "rope_theta=10"]).model)
    np.testing.assert_allclose(layer(x, positions, 4), local_only(x, positions, 4), **TOLERANCE)
    global_only, _ = _attention(overrides.apply(presets.get("tiny"), [*words, "rope_theta=1e6"]).model)
    np.testing.assert_allclose(layer(x, positions * 8, 0), global_only(x, positions, 0), **TOLERANCE)
    # traced windows (a scanned stack) pick the same bases
    np.testing.assert_allclose(jax.jit(lambda w: layer(x, positions, w))(jnp.int32(4)), local_only(x, positions, 4),
                               **TOLERANCE)


@pytest.mark.parametrize("name", ["gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"])
def test_gemma3_presets_have_the_reports_text_parameters(name):
    model = presets.get(name)
    assert [w is None for w in model.layer_windows()][:6] == [False] * 5 + [True]
    assert count_params(model).total == pytest.approx(presets.PUBLISHED_PARAMS[name], rel=0.01)
    assert train_step.param_count(model) == count_params(model).total


@pytest.mark.parametrize("sizes", [{"expert": 2, "tensor": 2, "fsdp": 1}, {"expert": 4, "tensor": 1, "fsdp": 1},
                                   {"expert": 1, "tensor": 2, "fsdp": 2}])
@pytest.mark.parametrize("family", [GPT_OSS, LLAMA4])
def test_expert_parallel_dispatch_with_biases_and_token_weights_equals_one_device(sizes, family):
    """The expert biases travel with their experts (wo's added once over the tensor shards' partial sums) and the
    token weights before the experts, across expert and tensor shards."""
    from models_util import cpu_mesh

    from maxperf.models.layers import moe

    cfg = overrides.apply(presets.get("tiny-moe"), [*family, "mlp_bias=true"]).model
    B, L, D, F, E, K = 4, 8, 8, 16, 4, cfg.num_experts_per_tok
    keys = jax.random.split(jax.random.PRNGKey(0), 9)
    x = jax.random.normal(keys[0], (B, L, D))
    experts = jax.random.randint(keys[1], (B, L, K), 0, E)
    if K == 2:
        experts = experts.at[..., 1].set((experts[..., 0] + 1) % E)  # two different experts per token
    weights = jax.random.uniform(keys[2], (B, L, K))
    w = tuple(jax.random.normal(k, s) for k, s in zip(keys[3:6], [(E, D, F), (E, D, F), (E, F, D)]))
    b = tuple(jax.random.normal(k, s) for k, s in zip(keys[6:9], [(E, F), (E, F), (E, D)]))
    expected = moe.sparse_dispatch(x, experts, weights, w, cfg, biases=b)
    dense = moe.dense_dispatch(x, experts, weights, w, cfg, -1, biases=b)
    np.testing.assert_allclose(dense, expected, rtol=1e-5, atol=1e-5)
    mesh = {"data": 1, "fsdp_transpose": 1, "sequence": 1, **sizes}
    with jax.set_mesh(cpu_mesh(mesh, jax.devices()[:4])):
        got = jax.jit(lambda *a: moe.sparse_dispatch(*a[:4], cfg, biases=a[4]))(x, experts, weights, w, b)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


# --- the decoder's blocks, as MaxText scans them --------------------------------------------------------------------

@pytest.mark.parametrize("name,cycle", [("gemma3-12b", 6), ("gemma2-9b", 2), ("gpt-oss-120b", 2),
                                        ("llama4-scout-17b-16e", 4), ("llama4-maverick-17b-128e", 4),
                                        ("llama3.1-70b", 1), ("mistral-7b", 1), ("mixtral-8x7b", 1),
                                        ("deepseek-v3", 1)])
def test_layer_cycles_are_maxtexts(name, cycle):
    """MaxText's GEMMA3_ATTENTION_PATTERN (6 layers), its Gemma 2 layer (a local and a global attention), and the
    inhomogeneous_layer_cycle_interval of its gpt-oss (2) and Llama 4 (4) configs."""
    model = presets.get(name)
    assert model.layer_cycle() == cycle
    (*_, st) = params_spec.stacks(model)
    if model.first_num_dense_layers == 0:
        assert st.count == model.num_layers // cycle and len(st.pattern) == cycle


def test_a_partial_cycle_is_one_block_after_the_scan():
    """Gemma 3 27B's 62 layers: ten blocks of six scanned, the last two as one block (MaxText's layers_remainder)."""
    stacks = params_spec.stacks(presets.get("gemma3-27b"))
    assert [(st.name, st.start, st.count, len(st.pattern)) for st in stacks] == [("layers", 0, 10, 6),
                                                                                   ("rest_layers", 60, 1, 2)]


@pytest.mark.parametrize("words", [(), ("attention_type=local_global", "window=4", "local_per_global=2",
                                        "num_layers=7", "qk_norm=true", "post_norms=true"), LLAMA4, GPT_OSS])
@pytest.mark.parametrize("scan", ["true", "false"])
def test_reduced_arrays_are_the_train_states_arrays(words, scan):
    """The collectives a replicated gradient takes, one per array: as many as the model's parameter arrays."""
    preset = "tiny-moe" if words in (LLAMA4, GPT_OSS) else "tiny"
    cfg = overrides.apply(presets.get(preset), [*words, f"scan_layers={scan}"])
    md = train_step.model_def(cfg.model, cfg.train)
    assert params_spec.reduced_arrays(cfg.model, cfg.train.scan_layers) == len(jax.tree.leaves(md.params))


def test_block_layers_keep_their_masks_static():
    """Within a block each layer's mask is the same in every repeat: a constant of the traced step, so no layer
    switches between kernels at run time."""
    cfg = overrides.apply(presets.get("tiny"), ["attention_type=local_global", "window=4", "local_per_global=2",
                                                "num_layers=6", "seq_len=16", "attention=dot_product"])
    from maxperf.models import transformer
    windows = list(attention_rule.layer_masks(cfg.model))
    assert transformer._static(windows, [True] * 6, 3) == ((4, 4, 0), (True, True, True))
