"""Multi-token prediction (mtp_num_layers, mtp_loss_scaling_factor): the modules' parameters and shapes, the loss term
against a direct computation of what each depth predicts, training, perfmodel's counts against MaxText's formulas,
and refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_util import maxperf
from flax import nnx

from maxperf.models import train_step
from maxperf.models.layers.mtp import shift_left
from maxperf.perfmodel.flops import count_flops, count_params
from maxperf.spec import overrides, presets
from maxperf.spec.errors import MaxperfError
from maxperf.spec.model import ModelConfig, RoutedScoreFunc
from maxperf.spec.train import TrainConfig

L = 16


@pytest.fixture(autouse=True)
def strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


def with_mtp(name: str, n: int) -> ModelConfig:
    return dataclasses.replace(presets.get(name), mtp_num_layers=n)


def train_cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"per_device_batch_size": 2, "seq_len": L, "compute_dtype": "float32", "warmup_steps": 0,
                          **kw})


def batch(seed: int = 0) -> dict:
    tokens = np.random.default_rng(seed).integers(0, 256, (2, L + 1), dtype=np.int32)
    mask = np.ones((2, L), np.bool_)
    mask[1, -3:] = False  # padding: neither the model nor any depth learns from it
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def n_params(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-moe"])
def test_mtp_parameters_exist_only_with_modules_and_match_perfmodel(name):
    plain = train_step.model_def(presets.get(name), train_cfg()).params
    assert "mtp" not in plain
    params = train_step.model_def(with_mtp(name, 2), train_cfg()).params
    assert sorted(params["mtp"]) == [0, 1]
    D = presets.get(name).d_model
    module = params["mtp"][0]
    assert module["projection_2DxD"].shape == (2 * D, D)
    assert {k: v["scale"].shape for k, v in module.items() if "norm" in k} == {
        "embedding_norm": (D,), "hidden_norm": (D,), "final_norm": (D,)}
    if name == "tiny-moe":  # the last decoder layer's kind: a mixture of experts
        assert module["layer"]["mlp"]["router"]["kernel_DxE"].shape == (D, 4)
    counts = count_params(with_mtp(name, 2))
    assert n_params(params["mtp"]) == counts.mtp
    assert n_params(params) - counts.mtp == counts.total == n_params(plain)


def test_shift_left_moves_each_row_and_zeroes_the_last_position():
    x = jnp.asarray([[1, 2, 3], [4, 5, 6]])
    assert shift_left(x).tolist() == [[2, 3, 0], [5, 6, 0]]
    assert shift_left(jnp.asarray([[True, True, True]])).tolist() == [[True, True, False]]


def direct_mtp_loss(model, train, params, b) -> float:
    """The MTP loss computed by slicing: depth k at position t sees the token t + k and predicts the target t + k
    (the token t + k + 1); positions t >= L - k predict nothing."""
    net = nnx.merge(train_step.model_def(model, train).graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), b["inputs"].shape)
    h = net.forward(b["inputs"], positions).pre_norm
    total = weight = 0.0
    for k, module in enumerate(net.mtp, 1):
        ahead = jnp.pad(b["inputs"][:, k:], ((0, 0), (0, k)))
        x = module.project(h, net.embed_tokens(ahead, positions))
        h, _ = module.layer.with_aux(x, positions, 0, True)
        nll = train_step.cross_entropy(net.logits(module.final_norm(h)), jnp.pad(b["targets"][:, k:], ((0, 0), (0, k))))
        valid = jnp.pad(b["mask"][:, k:], ((0, 0), (0, k))).astype(jnp.float32)
        total, weight = total + jnp.sum(nll * valid), weight + jnp.sum(valid)
    return float(total / weight)


@pytest.mark.slow
@pytest.mark.parametrize("name,factor", [("tiny-mla", 0.1), ("tiny-moe", 0.3)])
def test_the_loss_adds_the_depths_mean_cross_entropy_times_the_scaling_factor(name, factor):
    model = with_mtp(name, 2)
    train = train_cfg(mtp_loss_scaling_factor=factor, load_balance_loss_weight=0.0)
    state = train_step.init_fn(model, train)(jax.random.PRNGKey(0))
    b = batch()
    _, metrics = jax.jit(train_step.make_train_step(model, train))(state, b)
    _, off = jax.jit(train_step.make_train_step(model, dataclasses.replace(train, mtp_loss_scaling_factor=0.0)))(
        state, b)
    expected = factor * direct_mtp_loss(model, train, state["params"], b)
    np.testing.assert_allclose(float(metrics["mtp_loss"]), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]) - float(off["loss"]), expected, rtol=1e-4)
    assert float(off["mtp_loss"]) == 0.0


@pytest.mark.slow
def test_a_tiny_model_with_mtp_learns_the_sequence():
    model, train = with_mtp("tiny-mla", 1), train_cfg(learning_rate=3e-3)
    state = train_step.init_fn(model, train)(jax.random.PRNGKey(0))
    tokens = np.tile(np.arange(L + 1, dtype=np.int32) * 3, (2, 1))
    b = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((2, L), np.bool_)}
    step = jax.jit(train_step.make_train_step(model, train))
    state, first = step(state, b)
    for _ in range(14):
        state, last = step(state, b)
    assert float(last["loss"]) < 0.3 * float(first["loss"])
    assert float(last["mtp_loss"]) < 0.3 * float(first["mtp_loss"])


def test_perfmodel_counts_the_mtp_flops_as_maxtext():
    # MaxText's calculate_tflops_training_per_device for deepseek-v3, B 1, L 4096: each MTP module adds the last
    # (MoE) layer's gate, shared and routed expert matmuls, its MLA projections, and its causal attention, x 3
    model, train = presets.get("deepseek-v3"), train_cfg(seq_len=4096, per_device_batch_size=1)
    BL, Lt, D, H, R, C, Dn, Dr, Dv = 4096, 4096, 7168, 128, 1536, 512, 128, 64, 128
    E, F, S, K = 256, 2048, 1, 8
    q = 2 * BL * (D * R + R * H * (Dn + Dr))
    kv = 2 * BL * (D * (C + Dr) + C * H * (Dn + Dv))
    projection = 2 * BL * D * H * Dv
    attention = 2 * BL * Lt * H * (Dn + Dr + Dv) / 2
    ffn = 2 * BL * F * D * 2 + 2 * BL * F * D
    maxtext = 3 * (2 * BL * D * E + S * ffn + K * ffn + q + kv + projection + attention)
    base, one = count_flops(model, train), count_flops(dataclasses.replace(model, mtp_num_layers=1), train)
    assert one.mtp_flops == pytest.approx(maxtext, rel=1e-12)
    assert one.model_flops - base.model_flops == pytest.approx(maxtext, rel=1e-12)
    two = count_flops(dataclasses.replace(model, mtp_num_layers=2), train)
    assert two.mtp_flops == pytest.approx(2 * maxtext, rel=1e-12) and base.mtp_flops == 0
    # executed: the weights' matmuls, the attention as flash runs it (fwd + a backward of 5 matmuls against 2), what
    # the remat policy recomputes, and beyond the model FLOPs the 2D x D projection and the shared head's logits
    head = 3 * 2 * BL * (2 * D * D + D * 129280)
    assert one.attention_executed_flops - base.attention_executed_flops == pytest.approx(attention * 3.5, rel=1e-12)
    assert one.hardware_flops - base.hardware_flops == pytest.approx(
        maxtext - 3 * attention + 3.5 * attention + (one.recompute_flops - base.recompute_flops) + head, rel=1e-12)


@pytest.mark.parametrize("words,match", [
    (["mtp_num_layers=-1"], r"mtp_num_layers must be >= 0 .*got -1"),
    (["mtp_loss_scaling_factor=-0.1"], r"mtp_loss_scaling_factor must be >= 0, got -0.1"),
])
def test_bad_mtp_settings_are_refused(words, match):
    with pytest.raises(MaxperfError, match=match):
        overrides.apply(presets.get("tiny-mla"), words)


def test_a_negative_mtp_depth_is_one_line_and_exit_2():
    proc = maxperf("estimate", "--topology", "v5p-8", "--model", "tiny-mla", "mtp_num_layers=-1", timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "mtp_num_layers must be >= 0" in lines[0]


@pytest.mark.slow
def test_an_mtp_moe_layer_records_its_loads_and_its_bias_moves_with_them():
    model = dataclasses.replace(with_mtp("tiny-moe", 1), routed_score_func=RoutedScoreFunc.SIGMOID, routed_bias=True)
    train = train_cfg(routed_bias_update_rate=0.01)
    params = train_step.init_fn(model, train)(jax.random.PRNGKey(0))["params"]
    graphdef, b = train_step.model_def(model, train).graphdef, batch()
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), b["inputs"].shape)

    @jax.jit
    def loads(params, b):
        net = nnx.merge(graphdef, params)
        out = net.forward(b["inputs"], positions)
        return net.predict_ahead(out.pre_norm, b["inputs"], b["targets"], b["mask"].astype(jnp.float32), positions,
                                 lambda x, t, m: jnp.zeros(())).counts

    ahead_counts = loads(params, b)
    counts = ahead_counts["mtp/0/layer/mlp/router/bias"]
    assert list(ahead_counts) == ["mtp/0/layer/mlp/router/bias"] and int(counts.sum()) == 2 * L * 2  # every row, top-2
    moved = train_step.update_routed_bias(params, ahead_counts, 0.01)["mtp"][0]["layer"]["mlp"]["router"]["bias"]
    mean = float(counts.sum()) / 4
    np.testing.assert_array_equal(np.asarray(moved), (0.01 * np.sign(mean - np.asarray(counts))).astype(np.float32))


def test_each_module_costs_step_time_so_mfu_does_not_rise_with_it():
    """The modules' FLOPs count in MaxText's model FLOPs, and their layer, projection, attention, logits and loss in
    the step time: each depth adds time, and more than its share of the model FLOPs does not raise the MFU."""
    from maxperf.perfmodel import estimate
    from maxperf.spec.request import resolve

    runs = [estimate(resolve("v5p-32", "deepseek-v2-lite", ["per_device_batch_size=4", f"mtp_num_layers={n}"]))
            for n in (0, 1, 2)]
    times = [e.step_time_s for e in runs]
    assert times[0] < times[1] < times[2]
    layer = (times[1] - times[0]) / times[0]
    assert 0.5 / 27 < layer < 3 / 27  # about one more of its 27 layers, with the head's logits
    assert runs[1].mfu <= runs[0].mfu * 1.01 and runs[2].mfu <= runs[1].mfu * 1.01
    names = {r.name for r in runs[1].breakdown}
    assert {"multi-token prediction layers", "multi-token prediction logits",
            "multi-token prediction attention"} <= names
