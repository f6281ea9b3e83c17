"""Multi-head latent attention: the kernels with a value head dim other than the query's, the layer's causality and
checkpoint names, YaRN, flash against the dot product, tensor parallelism against one device, the kernel each
platform takes, a TPU compile, and tiny-mla training through `maxperf compile` and `maxperf run`."""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_util import maxperf
from flax import nnx
from jax.sharding import PartitionSpec as P
from models_util import loss_and_grads, tiny, train_losses, two_step_losses

from maxperf.models import train_step
from maxperf.models.layers import attention_kernels as ak
from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.mla import LatentAttention, softmax_scale
from maxperf.models.layers.rope import inverse_frequencies, yarn_softmax_factor
from maxperf.spec import attention_rule, overrides, presets
from maxperf.spec.errors import MaxperfError
from maxperf.spec.model import YarnScaling
from maxperf.spec.train import AttentionKernel

# float32 throughout: flash and the dot product agree to float32 rounding of sums that the blockwise kernel adds in
# another order
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


tiny_mla = functools.partial(tiny, preset="tiny-mla", devices=1)


def _qkv(L=256, B=1, H=2, Dq=24, Dv=16):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = 0.3 * jax.random.normal(keys[0], (B, L, H, 1, Dq))
    k = jax.random.normal(keys[1], (B, L, H, Dq))
    v = jax.random.normal(keys[2], (B, L, H, Dv))
    return q, k, v


def _value_and_grads(kernel, q, k, v):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(kernel(q, k, v))), argnums=(0, 1, 2)))(q, k, v)


def _dot(q, k, v):
    return ak.dot_product(q, k, v, 0, softcap=None, float32_qk_product=False, float32_logits=False)


def _assert_close(got, ref):
    np.testing.assert_allclose(got[0], ref[0], **TOLERANCE)
    for a, b in zip(got[1], ref[1]):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, **TOLERANCE)


def test_blockwise_takes_a_narrower_value_head():
    q, k, v = _qkv(L=1024)  # two key blocks of CPU_BLOCK
    ref = _value_and_grads(_dot, q, k, v)
    assert ref[1][2].shape == v.shape
    ids = jnp.arange(q.shape[1], dtype=jnp.int32)
    _assert_close(_value_and_grads(lambda q, k, v: ak.blockwise(q, k, v, jnp.int32(0), None, ids, None), q, k, v), ref)


@pytest.mark.slow
def test_splash_in_interpret_mode_takes_a_narrower_value_head():
    q, k, v = _qkv(L=256)
    ref = _value_and_grads(_dot, q, k, v)
    got = _value_and_grads(lambda q, k, v: ak.splash(q, k, v, 0, softcap=None, blocks=(128,) * 8, interpret=True),
                           q, k, v)
    _assert_close(got, ref)


def test_dot_product_of_zero_padded_heads_is_the_narrow_one():
    # what the GPU kernel is given: v padded to the query's head dim gives the same context in its first Dv columns
    # and nothing in the rest, and the padding's gradient does not reach v
    q, k, v = _qkv(L=64)
    padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 8)))
    out, wide = _dot(q, k, v), _dot(q, k, padded)
    np.testing.assert_allclose(wide[..., :16], out, **TOLERANCE)
    np.testing.assert_array_equal(wide[..., 16:], 0)


@pytest.mark.parametrize("Dh, itemsize, block, backward, backward_small", [
    (64, 2, 128, 128, 64), (128, 2, 128, 128, 64), (192, 2, 64, 64, 32), (256, 2, 64, 64, 32), (128, 4, 64, 32, 32),
    (192, 4, 32, 32, 32)])
def test_gpu_tiles_fit_shared_memory(Dh, itemsize, block, backward, backward_small):
    # latent attention's qk head dim 192 is padded to 256: the Triton kernel's default 128-row tile overran an
    # H100's shared memory there (measured), 64 rows ran; the backward's tiles as measured fastest on an H200 that
    # fit (bf16: the forward's; float32: 32, where 64 ran slower and 128 overran), half of them on GPUs of less
    # shared memory (the A100's)
    for large, want in ((True, backward), (False, backward_small)):
        blocks = ak.gpu_blocks(Dh, itemsize, large)
        assert blocks["block_q"] == blocks["block_k"] == block
        assert blocks["block_q_dkv"] == blocks["block_kv_dkv"] == blocks["block_q_dq"] == blocks["block_kv_dq"] == want


def test_the_mesh_gpus_say_which_tiles_fit():
    from jax.sharding import AbstractDevice, AbstractMesh

    for kind, large in (("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", True), ("NVIDIA B200", False),
                        ("NVIDIA A100-SXM4-80GB", False)):
        mesh = AbstractMesh((1,), ("data",), abstract_device=AbstractDevice(device_kind=kind, num_cores=None,
                                                                               platform="gpu"))
        with jax.sharding.use_abstract_mesh(mesh):
            assert ak._large_shared_memory() == large, kind


def test_each_platform_takes_a_kernel_that_serves_mla():
    cfg = overrides.apply(presets.get("tiny-mla"), ["seq_len=256"])
    picks = {p: attention_rule.for_config(cfg.model, cfg.train, p) for p in ("tpu", "gpu", "cpu")}
    assert picks == {"tpu": "splash", "gpu": "gpu_flash", "cpu": "blockwise"}
    assert attention_rule.head_dims(cfg.model) == (24, 16)
    # the GPU kernel's head dim is the wider of q and v; past 256 auto falls back and an explicit flash is refused
    wide = overrides.apply(presets.get("tiny-mla"), ["seq_len=256", "qk_nope_head_dim=250", "qk_rope_head_dim=8"])
    assert attention_rule.for_config(wide.model, wide.train, "gpu") == "dot_product"
    flash = overrides.apply(presets.get("tiny-mla"), ["seq_len=256", "qk_nope_head_dim=250", "attention=flash"])
    with pytest.raises(MaxperfError, match="head_dim up to 256, got 258"):
        attention_rule.for_config(flash.model, flash.train, "gpu")


def _layer(cfg, kernel="dot_product"):
    return LatentAttention(cfg, jnp.float32, nnx.Rngs(0), AttentionOptions(kernel=AttentionKernel(kernel)))


def test_the_layer_is_causal():
    cfg = presets.get("tiny-mla")
    layer = _layer(cfg)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 12, cfg.d_model))
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    t = 5
    # the output at t depends on inputs at t and before only
    grad = jax.grad(lambda x: jnp.sum(layer(x, positions, 0)[0, t]))(x)
    assert np.all(np.asarray(grad[0, t + 1 :]) == 0)
    assert np.all(np.abs(np.asarray(grad[0, : t + 1])).sum(axis=-1) > 0)


def test_the_rope_key_is_shared_and_positions_only_move_it():
    # shifting every position by the same offset changes nothing: scores depend on relative positions only
    cfg = presets.get("tiny-mla")
    layer = _layer(cfg)
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 10, cfg.d_model))
    positions = jnp.arange(10, dtype=jnp.int32)[None]
    np.testing.assert_allclose(layer(x, positions, 0), layer(x, positions + 37, 0), rtol=1e-4, atol=1e-5)
    assert layer.wkv_a_DxE.shape == (cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_checkpoint_names_are_maxtexts():
    cfg = presets.get("tiny-mla")
    layer = _layer(cfg)
    x = jnp.ones((1, 8, cfg.d_model))
    jaxpr = jax.make_jaxpr(lambda x: layer(x, jnp.arange(8, dtype=jnp.int32)[None], 0))(x)
    names = {str(e.params["name"]) for e in jaxpr.eqns if e.primitive.name == "name"}
    # MaxText's: the attention's output is "attention_out"; "context" names a flash kernel's residuals, which only its
    # backward's forward half computes
    assert names == {"query_proj", "key_proj", "value_proj", "attention_out", "out_proj"}


def test_mla_parameters_follow_from_the_ranks():
    cfg = presets.get("tiny-mla")
    D, H, R, C = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    attention = D * R + R + R * H * (Dn + Dr) + D * (C + Dr) + C + C * H * (Dn + Dv) + H * Dv * D
    per_layer = attention + 3 * D * cfg.d_ff + 2 * D
    assert train_step.param_count(cfg) == cfg.num_layers * per_layer + 2 * cfg.vocab_size * D + D
    direct = overrides.apply(cfg, ["q_lora_rank=0"]).model
    assert train_step.param_count(cfg) - train_step.param_count(direct) == cfg.num_layers * (
        D * R + R + R * H * (Dn + Dr) - D * H * (Dn + Dr))


def test_yarn_keeps_fast_features_and_interpolates_slow_ones():
    # DeepSeek-V3's rope_scaling (deepseek-ai/DeepSeek-V3 config.json) over its 64 RoPE features
    yarn = YarnScaling(factor=40, beta_fast=32, beta_slow=1, original_max_position=4096, mscale=1.0)
    plain, scaled = inverse_frequencies(64, 1e4, None), inverse_frequencies(64, 1e4, yarn)
    # features that turn more than 32 times over 4096 tokens (wavelength under 128) keep their frequency; those that
    # turn less than once are divided by the factor
    turns = np.asarray(plain) * 4096 / (2 * math.pi)
    np.testing.assert_allclose(np.asarray(scaled)[turns > 32], np.asarray(plain)[turns > 32], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(scaled)[turns < 1], np.asarray(plain)[turns < 1] / 40, rtol=1e-6)
    assert np.all(np.diff(np.asarray(scaled)) < 0)
    assert yarn_softmax_factor(yarn) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert yarn_softmax_factor(None) == 1.0


def test_softmax_scale_is_deepseeks():
    cfg = presets.get("tiny-mla")
    assert softmax_scale(cfg) == pytest.approx((16 + 8) ** -0.5)
    # DeepSeek-V2-Lite's mscale_all_dim 0.707 with YaRN's factor 40
    yarn = dataclasses.replace(cfg, rope_scaling=YarnScaling(factor=40, mscale=0.707))
    assert softmax_scale(yarn) == pytest.approx(24**-0.5 * (0.0707 * math.log(40) + 1) ** 2)


def test_rope_scalings_survive_the_manifest():
    # an artifact's manifest holds the model config as JSON; `maxperf run` rebuilds it from there
    from maxperf.aot.artifacts import to_json
    from maxperf.spec.configs import from_dict
    from maxperf.spec.model import ModelConfig, RopeScaling

    for scaling in (YarnScaling(factor=32, beta_fast=1, mscale=0.707), RopeScaling(), None):
        cfg = dataclasses.replace(presets.get("tiny-mla"), rope_scaling=scaling)
        assert from_dict(ModelConfig, json.loads(json.dumps(to_json(cfg)))) == cfg


@pytest.mark.parametrize(
    "words, message",
    [
        (["num_kv_heads=2"], "num_kv_heads must equal num_heads"),
        (["kv_lora_rank=0"], "kv_lora_rank >= 1"),
        (["qk_rope_head_dim=7"], "even qk_rope_head_dim"),
        (["fused_qkv=true"], "fused_qkv=false"),
    ],
)
def test_inconsistent_mla_settings_are_refused(words, message):
    with pytest.raises(MaxperfError, match=message):
        overrides.apply(presets.get("tiny-mla"), words)


@pytest.mark.slow
def test_flash_and_dot_product_give_the_same_loss_and_gradients():
    # seq_len 1024: two key blocks of the blockwise kernel, its masked and its unmasked tiles
    words = ("seq_len=1024", "per_device_batch_size=1")
    flash_loss, flash_grads = loss_and_grads(*words, "attention=flash", preset="tiny-mla")
    dot_loss, dot_grads = loss_and_grads(*words, "attention=dot_product", preset="tiny-mla")
    np.testing.assert_allclose(flash_loss, dot_loss, **TOLERANCE)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(flash_grads), jax.tree.leaves(dot_grads)):
        np.testing.assert_allclose(a, b, **TOLERANCE, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_tensor_parallel_step_matches_one_device():
    _, sharded = tiny_mla("ici_tensor=4", "ici_fsdp=1", "per_device_batch_size=1", "seq_len=64", devices=4)
    _, single = tiny_mla("per_device_batch_size=4", "seq_len=64", devices=1)
    # every head-carrying weight of the latent attention is split over the heads; the stacked weights carry the
    # layer axis second (param_scan_axis=1): [R, N, H, Dq], [C, N, H, E], [H, N, Dv, D]
    attention = sharded.state_shardings["params"]["layers"]["attention"]
    assert attention["wq_b_RxHxDq"].spec == P(None, None, "tensor", None)
    assert attention["wkv_b_CxHxE"].spec == P(None, None, "tensor", None)
    assert attention["o_HxDvxD"].spec == P("tensor", None, None, None)
    assert sharded.batch["inputs"].shape == single.batch["inputs"].shape
    batch = jax.device_get(train_step.synthetic_batch(single, seed=3))
    np.testing.assert_allclose(two_step_losses(sharded, batch), two_step_losses(single, batch), rtol=0, atol=1e-5)


# DeepSeek-V3's shape in miniature: latent attention, a first dense layer, then sigmoid routing over two groups of
# experts with a selection bias, renormalized and scaled, beside a shared expert
DEEPSEEK_TINY = ("num_experts=4", "num_experts_per_tok=2", "shared_experts=1", "first_num_dense_layers=1",
                 "base_moe_mlp_dim=32", "routed_score_func=sigmoid", "routed_bias=true", "n_routing_groups=2",
                 "topk_routing_group=1", "norm_topk_prob=true", "routed_scaling_factor=2.5")


@pytest.mark.slow
def test_latent_attention_with_experts_learns_under_expert_and_tensor_parallelism():
    _, spec = tiny_mla(*DEEPSEEK_TINY, "seq_len=64", "learning_rate=1e-2", "attention=flash", "ici_expert=2",
                       "ici_tensor=2", "ici_fsdp=1", devices=4)
    losses, _ = train_losses(spec, 20)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_tiny_mla_trains_on_cpu_devices(tmp_path):
    out = tmp_path / "tiny-mla"
    proc = maxperf("compile", "--topology", "cpu-4", "--model", "tiny-mla", "seq_len=64", "per_device_batch_size=2",
                   "learning_rate=1e-2", "warmup_steps=0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    # a learnable stream: each token is the last one plus 7, mod 256
    np.save(tmp_path / "tokens.npy", (np.arange(64 * 65, dtype=np.int32) * 7) % 256)
    proc = maxperf("run", str(out / "compiled.pkl"), "--steps", "10", "--warmup", "0", "--data",
                   str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    losses = json.loads(proc.stdout)["losses"]
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_tpu_compile_takes_splash_attention(tmp_path):
    from maxperf import aot

    result = aot.compile("v5p-8", "tiny-mla", ["seq_len=256"], out=tmp_path / "tpu")
    hlo = (result.out_dir / "hlo" / "optimized.hlo.txt").read_text()
    assert "splash_mha_fwd" in hlo and "splash_mha_dkv" in hlo and "splash_mha_dq" in hlo
    assert json.loads((result.out_dir / "manifest.json").read_text())["model"]["attention_type"] == "mla"


def test_bad_kernel_name_is_one_line_and_exit_2():
    proc = maxperf("estimate", "--topology", "v5p-8", "--model", "tiny-mla", "attention=splashy", timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "attention=splashy" in lines[0] and "dot_product" in lines[0], proc.stderr
