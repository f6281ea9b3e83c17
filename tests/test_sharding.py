"""Sharding and batching as MaxText does them: its logical-axis rules (fsdp_transpose, activations under tensor
parallelism), its mesh axes over ICI and DCN, fractional per_device_batch_size and vocabulary tiling, in the model
and in perfmodel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models_util import tiny, two_step_losses

from maxperf import perfmodel
from maxperf.models import train_step
from maxperf.perfmodel import memory as perf_memory
from maxperf.perfmodel import saved as perf_saved
from maxperf.perfmodel.sharding import activation_split, gather_axes, gathered_size, param_arrays
from maxperf.spec import overrides, presets
from maxperf.spec.errors import MaxperfError
from maxperf.spec.logical_axes import MESH_AXES, RULES, mesh_axes_for, over_data
from maxperf.spec.mesh import Mesh
from maxperf.spec.request import resolve
from maxperf.spec.train import TrainConfig


@pytest.fixture(autouse=True)
def strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


def test_rules_are_maxtexts():
    # MaxText configs/base.yml mesh_axes and logical_axis_rules (its `context` is maxperf's `sequence`)
    assert MESH_AXES == ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert")
    assert RULES["activation_embed_and_logits_batch"] == ("data", "stage", "fsdp", "fsdp_transpose", "expert")
    assert RULES["activation_stage"] == ("stage",)
    assert RULES["activation_batch"] == ("data", "fsdp", "fsdp_transpose", "expert")
    assert RULES["activation_embed"] == ("tensor",)
    assert RULES["mlp"] == ("fsdp_transpose", "tensor")
    assert RULES["embed"] == ("fsdp", "fsdp_transpose", "sequence", "expert")
    assert list(RULES).index("mlp") < list(RULES).index("embed")


def test_fsdp_transpose_splits_the_mlp_width_and_the_attention_model_width():
    sizes = {"fsdp": 4, "fsdp_transpose": 2, "tensor": 2}
    # "mlp" takes its axes before "embed", whichever dimension comes first
    assert mesh_axes_for((4096, 11008), ("embed", "mlp"), sizes) == ("fsdp", ("fsdp_transpose", "tensor"))
    assert mesh_axes_for((11008, 4096), ("mlp", "embed"), sizes) == (("fsdp_transpose", "tensor"), "fsdp")
    assert mesh_axes_for((4096, 32, 128), ("embed", "heads", "head_dim"), sizes) == (
        ("fsdp", "fsdp_transpose"), "tensor", None)
    assert mesh_axes_for((32, 2048, 4096), ("activation_batch", "activation_length", "activation_embed"),
                         sizes) == (("fsdp", "fsdp_transpose"), None, "tensor")


def test_parameters_and_batch_follow_the_rules_in_the_step():
    _, spec = tiny("ici_fsdp=2", "ici_fsdp_transpose=2", "ici_tensor=2")
    params = spec.state_shardings["params"]
    assert params["layers"]["mlp"]["up_DxF"].spec == P("fsdp", None, ("fsdp_transpose", "tensor"))
    assert params["layers"]["mlp"]["down_FxD"].spec == P(("fsdp_transpose", "tensor"), None, "fsdp")
    assert params["layers"]["attention"]["q_DxHxDh"].spec == P(("fsdp", "fsdp_transpose"), None, "tensor", None)
    assert spec.batch_shardings["inputs"].spec == P(("fsdp", "fsdp_transpose"), None)


def test_plan_reads_maxtexts_fsdp_transpose_and_dcn_keys():
    p = resolve("v5p-8", "tiny", ["ici_fsdp_transpose_parallelism=2", "dcn_data_parallelism=1",
                               "dcn_fsdp_transpose_parallelism=2"], num_slices=2)
    assert p.mesh.ici == {"data": 1, "stage": 1, "fsdp": 2, "fsdp_transpose": 2, "sequence": 1, "tensor": 1,
                          "expert": 1}
    assert p.mesh.dcn["fsdp_transpose"] == 2
    assert p.mesh.axes["fsdp_transpose"] == 4
    mesh = Mesh.of(p.mesh.axes, p.mesh.dcn).check(p.topology)
    assert mesh.ici["fsdp_transpose"] == 2


@pytest.mark.parametrize("key", ["dcn_tensor_parallelism", "dcn_sequence_parallelism", "dcn_expert_parallelism"])
def test_every_mesh_axis_may_span_dcn(key):
    p = resolve("v5p-8", "tiny", [f"{key}=2", "dcn_data_parallelism=1"], num_slices=2)
    axis = key.removeprefix("dcn_").removesuffix("_parallelism")
    assert p.mesh.dcn[axis] == 2 and p.mesh.axes[axis] == 2


def test_fractional_batch_is_maxtexts():
    assert TrainConfig(per_device_batch_size=0.5).global_batch(64) == 32
    assert overrides.apply(presets.get("tiny"), ["per_device_batch_size=4"]).train.per_device_batch_size == 4
    assert isinstance(overrides.apply(presets.get("tiny"), ["per_device_batch_size=4.0"]).train.per_device_batch_size,
                      int)
    with pytest.raises(MaxperfError, match="microbatch of 2.4 examples, which must be a whole number"):
        resolve("v5p-8", "tiny", ["per_device_batch_size=0.6"])
    # a fractional B is the microbatch, as in MaxText: A of them make the step
    accumulated = TrainConfig(per_device_batch_size=0.5, grad_accum_steps=4)
    assert (accumulated.micro_batch(4), accumulated.global_batch(4)) == (2, 8)


def test_fractional_batch_splits_over_the_axes_that_divide_it():
    # 0.5 x 8 devices = 4 examples: over fsdp=4; the 2 devices along fsdp_transpose compute the same ones
    _, spec = tiny("per_device_batch_size=0.5", "ici_fsdp=4", "ici_fsdp_transpose=2")
    assert spec.batch["inputs"].shape == (4, 16)
    assert spec.batch_shardings["inputs"].spec == P("fsdp", None)
    split = activation_split(presets.get("tiny"), 0.5, 16, Mesh.of({**dict.fromkeys(MESH_AXES, 1), "fsdp": 4,
                                                                  "fsdp_transpose": 2}, {}))
    assert (split.B, split.T) == (1, 16)
    p = resolve("cpu-8", "tiny", ["per_device_batch_size=0.5", "ici_fsdp=4", "ici_fsdp_transpose=2"])
    assert any("each device holds 1 of the 4, and the 2 devices along fsdp_transpose compute the same ones" in w
               for w in p.warnings)


@pytest.mark.slow
def test_fractional_batch_step_matches_one_device():
    _, sharded = tiny("per_device_batch_size=0.5", "ici_fsdp=4", "ici_fsdp_transpose=2")
    _, single = tiny("per_device_batch_size=4", devices=1)
    batch = jax.device_get(train_step.synthetic_batch(single, seed=3))

    def one_step(spec):
        state = train_step.init_state(spec, seed=0)
        with jax.set_mesh(spec.mesh):
            _, metrics = train_step.jit_step(spec)(state, jax.device_put(batch, spec.batch_shardings))
        return float(metrics["loss"]), float(metrics["grad_norm"])

    np.testing.assert_allclose(one_step(sharded), one_step(single), rtol=1e-5)


@pytest.mark.parametrize("words", [(), ("tie_embeddings=true", "final_logit_softcap=30")])
def test_vocab_tiling_gives_the_same_loss_and_gradients(words):
    cfg, spec = tiny(*words, devices=1)
    graphdef, params = nnx.split(train_step.build_model(cfg.model, cfg.train, nnx.Rngs(params=0)))
    batch = jax.device_get(train_step.synthetic_batch(spec, seed=1))
    mask = jnp.asarray(np.random.default_rng(0).random(batch["mask"].shape) < 0.8, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), batch["inputs"].shape)

    def loss(params, tiles):
        net = nnx.merge(graphdef, params)
        x = net.forward(batch["inputs"], positions).hidden
        if tiles == 1:
            import optax
            return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(net.logits(x), batch["targets"]) * mask)
        return train_step.tiled_nll_sum(net, x, batch["targets"], mask, tiles)

    whole, g_whole = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, 1)
    tiled, g_tiled = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, 4)
    np.testing.assert_allclose(tiled, whole, rtol=1e-6)
    # float32 sums taken in another order (chunk by chunk): equal to 1e-5 of each gradient's largest entry
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max()), g_tiled, g_whole)


def test_vocab_tiling_must_divide_the_sequence():
    with pytest.raises(MaxperfError, match=r"num_vocab_tiling must be >= 1 and divide seq_len \(16\), got 3"):
        overrides.apply(presets.get("tiny"), ["seq_len=16", "num_vocab_tiling=3"])


# perfmodel

def _mesh(**sizes) -> Mesh:
    return Mesh.of({**dict.fromkeys(MESH_AXES, 1), **sizes}, {})


def test_perfmodel_splits_the_residual_over_tensor():
    model = presets.get("llama2-7b")
    assert activation_split(model, 1, 2048, _mesh(fsdp=4, tensor=4)).D == 4096 / 4
    train = TrainConfig(per_device_batch_size=4, remat_policy="full")
    one, four = (perf_memory.estimate_memory(model, train, _mesh(fsdp=16 // t, tensor=t), 0) for t in (1, 4))
    # the full-remat carry: N x T x D, T 4x larger per device with tensor=4 (batch over 4 devices, not 16), D split 4
    assert four.activations == pytest.approx(one.activations * 4 / 4)


def test_perfmodel_gathers_weights_over_fsdp_transpose():
    model = presets.get("llama2-7b")
    mesh = _mesh(fsdp=8, fsdp_transpose=2, tensor=2)
    layer = [x for x in param_arrays(model) if x.count == model.num_layers and x.matmul]
    assert gather_axes(layer, mesh) == ("fsdp", "fsdp_transpose")
    up = next(x for x in layer if x.name == "up")
    assert gathered_size(up.shape, up.logical, mesh) == 4096 * 11008 / 2  # tensor only
    # fsdp_transpose shards the state as fsdp does: the same bytes per device as fsdp=16
    assert perf_memory.params_per_device(model, mesh) == pytest.approx(
        perf_memory.params_per_device(model, _mesh(fsdp=16, tensor=2)))


def test_perfmodel_logits_follow_vocab_tiling():
    model = presets.get("llama2-7b")
    mesh = _mesh(fsdp=64)
    base = TrainConfig(per_device_batch_size=4)
    whole = perf_memory.estimate_memory(model, base, mesh, 0)
    tiled = perf_memory.estimate_memory(model, dataclasses.replace(base, num_vocab_tiling=4), mesh, 0)
    table = 32000 * 4096 * 2  # the gathered unembedding in bfloat16, the same either way
    assert whole.logits - table == 4 * 2048 * 32000 * 2  # bfloat16 logits, the float32 work fused into reductions
    # a quarter of the tokens' logits at a time, with their float32 gradient, and the table's float32 gradient shard
    assert tiled.logits - table == 2048 * 32000 * (2 + 4) + 4 * 4096 * 32000 / 64


@pytest.mark.slow
def test_maxtext_sharding_keys_compile_together(tmp_path):
    """fsdp_transpose, tensor, a fractional batch and vocabulary tiling in one compiled step on cpu-8."""
    from maxperf.aot import compiler

    result = compiler.compile("cpu-8", "tiny", ["per_device_batch_size=0.5", "ici_fsdp=2", "ici_fsdp_transpose=2",
                                                "ici_tensor=2", "num_vocab_tiling=4", "seq_len=64"], out=tmp_path / "a")
    assert result.global_batch == 4
    assert result.plan.mesh.shown() == "fsdp=2 x fsdp_transpose=2 x tensor=2"


# fused projections (MaxText's fused_qkv, fused_mlp)

def _fused_params(unfused: dict, K: int, G: int) -> dict:
    """The unfused model's weights in the fused layout: [D, K, G + 2, Dh] and [D, 2, F]."""
    layers = unfused["layers"]
    attn, mlp = dict(layers["attention"]), dict(layers["mlp"])
    q, k, v = attn.pop("q_DxHxDh"), attn.pop("k_DxKxDh"), attn.pop("v_DxKxDh")
    N, D, _, Dh = q.shape
    attn["qkv_DxKxExDh"] = jnp.concatenate([q.reshape(N, D, K, G, Dh), k[:, :, :, None], v[:, :, :, None]], axis=3)
    mlp["wi_Dx2xF"] = jnp.stack([mlp.pop("gate_DxF"), mlp.pop("up_DxF")], axis=2)
    return {**unfused, "layers": {**layers, "attention": attn, "mlp": mlp}}


def test_fused_projections_compute_what_the_separate_ones_do():
    cfg, spec = tiny(devices=1)
    fused_cfg, _ = tiny("fused_qkv=true", "fused_mlp=true", devices=1)
    plain = nnx.to_pure_dict(nnx.state(train_step.build_model(cfg.model, cfg.train, nnx.Rngs(params=0))))
    params = _fused_params(plain, cfg.model.num_kv_heads, cfg.model.kv_groups)
    batch = jax.device_get(train_step.synthetic_batch(spec, seed=1))
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), batch["inputs"].shape)

    def logits(model_cfg, p):
        graphdef = train_step.model_def(model_cfg.model, model_cfg.train).graphdef
        return nnx.merge(graphdef, p)(batch["inputs"], positions)

    np.testing.assert_allclose(logits(fused_cfg, params), logits(cfg, plain), rtol=1e-5, atol=1e-5)
    assert train_step.param_count(fused_cfg.model) == train_step.param_count(cfg.model)


def test_fused_weights_shard_like_the_separate_ones():
    _, spec = tiny("fused_qkv=true", "fused_mlp=true", "ici_fsdp=4", "ici_tensor=2")
    params = spec.state_shardings["params"]["layers"]
    assert params["attention"]["qkv_DxKxExDh"].spec == P("fsdp", None, "tensor", None, None)
    assert params["mlp"]["wi_Dx2xF"].spec == P("fsdp", None, None, "tensor")


def test_perfmodel_counts_fused_weights_and_names():
    model = presets.get("llama2-7b")
    fused = dataclasses.replace(model, fused_qkv=True, fused_mlp=True)
    mesh = _mesh(fsdp=16, tensor=4)
    assert perf_memory.params_per_device(fused, mesh) == pytest.approx(perf_memory.params_per_device(model, mesh))
    train = TrainConfig(per_device_batch_size=4, remat_policy="minimal")
    named = perf_saved.named_per_token(fused, train, mesh)
    assert named["qkv_proj"] == 2 * (32 + 2 * 32) / 4 * 128 and named["mlpwi"] == 2 * 2 * 11008 / 4
    assert perf_saved.layer_saved_per_token(fused, train, mesh, remat="minimal") == pytest.approx(
        perf_saved.layer_saved_per_token(model, train, mesh, remat="minimal"))
    # minimal keeps the fused outputs: nothing of them is recomputed
    assert not perfmodel.flops.recomputed(fused, train) & {"query_proj", "key_proj", "value_proj", "mlpwi_0",
                                                            "mlpwi_1"}


def test_perfmodel_under_tensor_splits_every_saved_tensor():
    """Per local token a layer saves S / t under tensor=t: the residual stream and the norms' float32 values over D,
    heads, MLP width; the norms' compute-dtype outputs, gathered to the full width D for the next matmuls, are not
    kept (llama2-7b widths, 4 layers, v5p-32, tensor 4, B 2, L 2048, remat none, libtpu 0.0.52: the forward scan
    stacks f32[4,8,2048,1024] and no bf16[.., 4096]); perfmodel counts them in the backward's working set."""
    model = presets.get("llama2-7b")
    train = TrainConfig(per_device_batch_size=4)
    one = perf_saved.layer_saved_per_token(model, train, _mesh(fsdp=64), remat="none")
    four = perf_saved.layer_saved_per_token(model, train, _mesh(fsdp=16, tensor=4), remat="none")
    assert 4 * four == pytest.approx(one)


def test_fsdp_transpose_takes_its_own_torus_dimension_and_gathers_over_it():
    from maxperf.perfmodel import chips
    from maxperf.perfmodel.network import axis_networks, collective_time
    from maxperf.spec import topology as topologies

    topology = topologies.get("v5p-128")  # a 4 x 4 x 4 torus
    mesh = _mesh(fsdp=16, fsdp_transpose=4)
    nets = axis_networks(mesh, chips.get("tpu-v5p"), topology)
    chip = chips.get("tpu-v5p")
    # fsdp_transpose, inside fsdp, spans one torus dimension (both directions of its ring); fsdp the other two
    assert nets["fsdp_transpose"].inner == 4 and nets["fsdp_transpose"].inner_bandwidth == 2 * chip.link_bandwidth
    assert nets["fsdp"].inner == 16 and nets["fsdp"].inner_bandwidth == 4 * chip.link_bandwidth
    # a weight gathered over both axes moves (n-1)/n of itself over the links of all three dimensions
    t = collective_time("all-gather", 64.0 * 2**20, ("fsdp", "fsdp_transpose"), nets)
    assert t.ici_s == pytest.approx(63 / 64 * 64 * 2**20 / (6 * chip.link_bandwidth) + 5e-6)


def test_a_mesh_written_before_fsdp_transpose_and_stage_existed_still_reads():
    from maxperf.spec.mesh import Mesh

    old = Mesh(ici={"data": 1, "fsdp": 8, "sequence": 1, "tensor": 1, "expert": 1}, dcn={"data": 1, "fsdp": 1})
    assert old.axes == {"data": 1, "stage": 1, "fsdp": 8, "fsdp_transpose": 1, "sequence": 1, "tensor": 1,
                        "expert": 1}
    assert old.devices == 8


@pytest.mark.parametrize("shape, entries, sizes, expected", [
    # data before the first dimension whose shard it divides
    ((4096, 14336), ("fsdp", "tensor"), {"data": 8, "fsdp": 4, "tensor": 2}, (("data", "fsdp"), "tensor")),
    # not a dimension tensor splits, nor one whose shard data does not divide: the next one
    ((14336, 4096), ("tensor", None), {"data": 8, "tensor": 2}, ("tensor", ("data",))),
    ((6, 4096), (None, None), {"data": 8}, (None, ("data",))),
    # unchanged: data of one device, data already there, no dimension it divides
    ((4096,), (None,), {"data": 1}, (None,)),
    ((4096, 64), ("data", None), {"data": 8}, ("data", None)),
    ((6, 12), (None, "tensor"), {"data": 8, "tensor": 2}, (None, "tensor")),
])
def test_zero1_puts_data_where_maxtext_adds_it(shape, entries, sizes, expected):
    assert over_data(shape, entries, sizes) == expected


def test_zero1_state_is_split_over_data_and_a_step_runs_as_the_plain_one():
    # MaxText's shard_optimizer_over_data: parameters and moments split over data too, the step's loss unchanged
    words = ("ici_data_parallelism=8", "ici_fsdp_parallelism=1")
    _, plain = tiny(*words)
    _, zero1 = tiny(*words, "shard_optimizer_over_data=true")
    table = zero1.state_shardings["params"]["embed"]["table_VxD"].spec
    assert "data" in jax.tree.leaves(tuple(table))
    assert "data" not in jax.tree.leaves(tuple(plain.state_shardings["params"]["embed"]["table_VxD"].spec))
    mu = zero1.state_shardings["opt_state"]
    assert any("data" in jax.tree.leaves(tuple(s.spec)) for s in jax.tree.leaves(mu))
    batch = jax.device_get(train_step.synthetic_batch(plain, seed=5))
    np.testing.assert_allclose(two_step_losses(zero1, batch), two_step_losses(plain, batch), rtol=1e-6)


def test_zero1_beside_fsdp_is_refused_as_maxtext_refuses_it():
    with pytest.raises(MaxperfError, match="cannot be combined with FSDP, as in MaxText.*ici_fsdp"):
        resolve("v5p-32", "llama2-7b", ["ici_data=4", "ici_fsdp=4", "shard_optimizer_over_data=true"])
    assert resolve("v5p-32", "llama2-7b", ["ici_data=16", "shard_optimizer_over_data=true"]).mesh.axes["data"] == 16


@pytest.mark.slow
def test_zero1_with_accumulation_gathers_bfloat16_parameters_and_learns_as_the_plain_step():
    words = ("ici_data_parallelism=8", "ici_fsdp_parallelism=1", "per_device_batch_size=1", "grad_accum_steps=2")
    _, plain = tiny(*words)
    _, zero1 = tiny(*words, "shard_optimizer_over_data=true")
    batch = jax.device_get(train_step.synthetic_batch(plain, seed=5))
    # the forward in bfloat16 weights (the float32 state cast before the loop, as MaxText's): close, not equal
    first, second = two_step_losses(zero1, batch)
    reference = two_step_losses(plain, batch)
    np.testing.assert_allclose((first, second), reference, rtol=2e-4)
    assert (first, second) != reference and second < first


def test_zero1_updates_and_offloads_only_the_state_it_keeps():
    """Under shard_optimizer_over_data the optimizer updates, and with optimizer_memory_host_offload moves over the
    host link, the parameters and moments split over `data` (what the memory model keeps), not the whole model's."""
    from maxperf.perfmodel import estimate

    def rows(*words):
        est = estimate(resolve("h100-8", "llama3-8b", ["per_device_batch_size=2", "ici_fsdp=1", "ici_data=8",
                                                       "optimizer_memory_host_offload=true", *words]))
        return {r.name: r.seconds for r in est.breakdown}

    plain, zero1 = rows(), rows("shard_optimizer_over_data=true")
    for name in ("optimizer update", "state offload (host link)"):
        assert zero1[name] == pytest.approx(plain[name] / 8, rel=0.01)
