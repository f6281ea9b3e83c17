"""Mixture of experts: routing, the load-balancing loss, dropless and capacity dispatch, expert parallelism against
one device, the decoder's dense and MoE layers, presets against their published sizes, and refusals."""

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
from models_util import cpu_mesh

from maxperf.models import train_step
from maxperf.models.layers import moe
from maxperf.models.transformer import stack_axis, stacks
from maxperf.spec import overrides, presets
from maxperf.spec import topology as topologies
from maxperf.spec.errors import MaxperfError
from maxperf.spec.mesh import resolve as resolve_mesh
from maxperf.spec.model import Activation, ModelConfig, RoutedScoreFunc
from maxperf.spec.request import resolve
from maxperf.spec.train import TrainConfig

BASE = ["seq_len=16", "compute_dtype=float32", "warmup_steps=0"]


@pytest.fixture(autouse=True)
def strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


def tiny_moe(**kw) -> ModelConfig:
    return dataclasses.replace(presets.get("tiny-moe"), **kw)


def loss_and_grads(words, devices: int, model: ModelConfig | None = None, params=None):
    """The training loss (cross-entropy + weighted load-balancing loss) and its gradients on one seeded batch of 4
    sequences, over a mesh of `devices` CPU devices; and the parameters it used (seed 0 unless given)."""
    B = 4 / devices
    cfg = overrides.apply(model or presets.get("tiny-moe"), [*BASE, f"per_device_batch_size={B:g}", *words])
    mesh = cpu_mesh(resolve_mesh(cfg.parallelism, topologies.get(f"cpu-{devices}")), jax.devices()[:devices])
    spec = train_step.abstract_step(cfg.model, cfg.train, mesh)
    graphdef = train_step.model_def(cfg.model, cfg.train).graphdef
    if params is None:
        params = jax.device_get(train_step.init_state(spec, seed=0)["params"])
    tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (4, 17), dtype=np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, spec.batch_shardings["inputs"])
    weight = cfg.train.load_balance_loss_weight

    def loss(params, batch):
        net = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), batch["inputs"].shape)
        out = net.forward(batch["inputs"], positions)
        x, lb = out.hidden, out.lb_loss
        return jnp.mean(train_step.cross_entropy(net.logits(x), batch["targets"])) + weight * lb

    with jax.set_mesh(mesh):
        placed = jax.device_put(params, spec.state_shardings["params"])
        value, grads = jax.jit(jax.value_and_grad(loss))(placed, batch)
    return float(value), jax.device_get(grads), params


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# --- routing -------------------------------------------------------------------------------------------------------

def test_softmax_routing_picks_the_best_and_renormalizes():
    cfg = tiny_moe(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.0)
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0]])
    r = moe.route(logits, cfg)
    assert r.experts_TxK.tolist() == [[1, 3]]
    # the picked experts' softmax, renormalized: a softmax over the picked logits, times the scaling factor
    expected = 2.0 * jax.nn.softmax(jnp.asarray([3.0, 2.0]))
    np.testing.assert_allclose(r.weights_TxK[0], expected, rtol=1e-6)
    unnormalized = moe.route(logits, dataclasses.replace(cfg, norm_topk_prob=False, routed_scaling_factor=1.0))
    np.testing.assert_allclose(unnormalized.weights_TxK[0], jax.nn.softmax(logits[0])[jnp.asarray([1, 3])], rtol=1e-6)


def test_the_bias_steers_sigmoid_selection_but_not_the_weights():
    cfg = tiny_moe(num_experts=4, num_experts_per_tok=1, routed_score_func=RoutedScoreFunc.SIGMOID,
                   norm_topk_prob=False)
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    bias = jnp.asarray([0.0, 0.0, 0.0, 1.0])  # sigmoid(-1) + 1 beats sigmoid(2)
    r = moe.route(logits, cfg, bias)
    assert r.experts_TxK.tolist() == [[3]]
    np.testing.assert_allclose(r.weights_TxK[0, 0], jax.nn.sigmoid(-1.0), rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(r.probs_TxE), 1.0, rtol=1e-6)


def test_group_limited_routing_takes_experts_from_the_best_groups_only():
    cfg = tiny_moe(num_experts=8, num_experts_per_tok=2, n_routing_groups=4, topk_routing_group=1,
                   routed_score_func=RoutedScoreFunc.SIGMOID)
    # expert 0 is the best alone, but group 3 (experts 6, 7) has the best sum of its two best
    logits = jnp.asarray([[5.0, -5.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0]])
    assert sorted(moe.route(logits, cfg).experts_TxK[0].tolist()) == [6, 7]
    ungrouped = dataclasses.replace(cfg, n_routing_groups=-1, topk_routing_group=-1)
    assert 0 in moe.route(logits, ungrouped).experts_TxK[0].tolist()


def test_load_balance_loss_is_one_when_balanced_and_grows_when_collapsed():
    E = 4
    even = moe.Routing(jnp.ones((4, 1)), jnp.arange(4)[:, None], jnp.full((4, E), 1 / E))
    assert float(moe.load_balance_loss(even, E)) == pytest.approx(1.0)
    collapsed = moe.Routing(jnp.ones((4, 1)), jnp.zeros((4, 1), jnp.int32), jnp.eye(E)[jnp.zeros(4, jnp.int32)])
    assert float(moe.load_balance_loss(collapsed, E)) == pytest.approx(E)


@pytest.mark.slow
def test_the_load_balancing_loss_enters_the_training_loss_with_its_weight():
    with_lb, _, params = loss_and_grads(["load_balance_loss_weight=0.5"], 1)
    without, _, _ = loss_and_grads(["load_balance_loss_weight=0"], 1, params=params)
    assert with_lb > without + 0.4  # the unweighted loss is at least 1


# --- dispatch ------------------------------------------------------------------------------------------------------

def test_capacity_drops_the_tokens_past_it_in_token_order():
    cfg = tiny_moe(num_experts=4, num_experts_per_tok=1, activation=Activation.GELU)
    B, L, D, E, F = 1, 8, 4, 4, 3
    x = jnp.ones((B, L, D))
    experts = jnp.zeros((B, L, 1), jnp.int32)  # every token picks expert 0
    w = (None, jnp.ones((E, D, F)), jnp.ones((E, F, D)))
    out = moe.dense_dispatch(x, experts, jnp.ones((B, L, 1)), w, cfg, capacity_factor=1.0)
    C = moe.capacity(L, 1, E, 1.0)
    assert C == 2
    kept = np.asarray(jnp.any(out[0] != 0, axis=-1))
    assert kept.tolist() == [True] * C + [False] * (L - C)
    # dropless dense dispatch keeps them all, equal to the sparse one
    full = moe.dense_dispatch(x, experts, jnp.ones((B, L, 1)), w, cfg, capacity_factor=-1)
    sparse = moe.sparse_dispatch(x, experts, jnp.ones((B, L, 1)), w, cfg)
    np.testing.assert_allclose(full, sparse, rtol=1e-6)
    np.testing.assert_allclose(full[0], jnp.broadcast_to(out[0, 0], (L, D)), rtol=1e-6)


@pytest.mark.slow
def test_dense_capacity_dispatch_with_room_for_all_equals_dropless():
    sparse, g_sparse, params = loss_and_grads([], 1)
    dense, g_dense, _ = loss_and_grads(["sparse_matmul=false", "capacity_factor=8"], 1, params=params)
    assert dense == pytest.approx(sparse, rel=1e-5)
    assert max_diff(g_dense, g_sparse) < 1e-5
    dropping, _, _ = loss_and_grads(["sparse_matmul=false", "capacity_factor=0.25"], 1, params=params)
    assert dropping != pytest.approx(sparse, rel=1e-4)  # tokens past the capacity lose their experts


# --- expert parallelism --------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["ici_expert=4", "ici_fsdp=1"], ["ici_expert=2", "ici_fsdp=2"],
                                  ["ici_expert=2", "ici_tensor=2", "ici_fsdp=1"],
                                  ["ici_expert=2", "ici_data=2", "ici_fsdp=1"]])
def test_an_expert_parallel_step_equals_one_device(mesh):
    """Tolerance: float32 loss within 1e-5 relative, every gradient within 1e-5 absolute (they are O(1e-2))."""
    one, g_one, params = loss_and_grads(["shared_experts=1"], 1)
    ep, g_ep, _ = loss_and_grads(["shared_experts=1", *mesh], 4, params=params)
    assert ep == pytest.approx(one, rel=1e-5)
    assert max_diff(g_ep, g_one) < 1e-5


def test_the_token_sort_has_autodiffs_gradient_through_a_gather_not_a_scatter():
    """The dispatch's permutation of rows (MaxText's custom sort VJP): the same gradient as indexing, by a gather."""
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
    order = jnp.asarray([4, 0, 5, 2, 1, 3])
    inverse = jnp.argsort(order)
    cotangent = jax.random.normal(jax.random.PRNGKey(1), (6, 3))

    def grad(f):
        return jax.vjp(f, x)[1](cotangent)[0]

    np.testing.assert_array_equal(moe._permute(x, order, inverse), x[order])
    np.testing.assert_array_equal(grad(lambda x: moe._permute(x, order, inverse)), grad(lambda x: x[order]))
    ops = str(jax.make_jaxpr(lambda x: grad(lambda x: moe._permute(x, order, inverse)))(x))
    assert "scatter" not in ops and "gather" in ops
    assert "scatter" in str(jax.make_jaxpr(lambda x: grad(lambda x: x[order]))(x))  # what autodiff would do


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_dispatch_drops_nothing_when_every_token_picks_one_shard(ep):
    """The worst case of the exchange buffers: all tokens of every device route to experts 0 and 1 (one shard for
    ep=2, two full shards for ep=4)."""
    cfg = tiny_moe()  # E = 4, K = 2
    B, L, D, F = 4, 8, 8, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (B, L, D))
    experts = jnp.broadcast_to(jnp.asarray([0, 1], jnp.int32), (B, L, 2))
    weights = jax.random.uniform(keys[1], (B, L, 2))
    w = (jax.random.normal(keys[2], (4, D, F)), jax.random.normal(keys[3], (4, D, F)),
         jax.random.normal(keys[4], (4, F, D)))
    expected = moe.sparse_dispatch(x, experts, weights, w, cfg)
    sizes = {"data": 1, "fsdp": 4 // ep, "fsdp_transpose": 1, "sequence": 1, "tensor": 1, "expert": ep}
    with jax.set_mesh(cpu_mesh(sizes, jax.devices()[:4])):
        got = jax.jit(lambda *a: moe.sparse_dispatch(*a, cfg))(x, experts, weights, w)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert float(jnp.min(jnp.abs(got))) > 0  # every token got its experts' output


@pytest.mark.slow
def test_dense_dispatch_over_the_expert_axis_equals_one_device():
    words = ["sparse_matmul=false", "capacity_factor=1.5"]
    one, g_one, params = loss_and_grads(words, 1)
    ep, g_ep, _ = loss_and_grads([*words, "ici_expert=4", "ici_fsdp=1"], 4, params=params)
    assert ep == pytest.approx(one, rel=1e-5)
    assert max_diff(g_ep, g_one) < 1e-5


def test_expert_weights_shard_their_experts_over_the_expert_axis():
    cfg = overrides.apply(presets.get("tiny-moe"), [*BASE, "per_device_batch_size=1", "ici_expert=2", "ici_fsdp=2"])
    mesh = cpu_mesh(resolve_mesh(cfg.parallelism, topologies.get("cpu-4")), jax.devices()[:4])
    spec = train_step.abstract_step(cfg.model, cfg.train, mesh)
    mlp = spec.state_shardings["params"]["layers"]["mlp"]
    assert tuple(mlp["wi_0_ExDxF"].spec) == ("expert", None, "fsdp", None)  # [E, N, D, F]: param_scan_axis 1
    assert tuple(mlp["wo_ExFxD"].spec) == ("expert", None, None, "fsdp")


@pytest.mark.parametrize("name", ["shard_exp_on_fsdp", "fsdp_shard_on_exp"])  # MaxText's name and its earlier one
def test_shard_exp_on_fsdp_stores_the_experts_over_fsdp_with_d_whole(name):
    cfg = overrides.apply(presets.get("tiny-moe"), [*BASE, "per_device_batch_size=1", "ici_fsdp=4", f"{name}=true"])
    assert cfg.model.shard_exp_on_fsdp
    mesh = cpu_mesh(resolve_mesh(cfg.parallelism, topologies.get("cpu-4")), jax.devices()[:4])
    spec = train_step.abstract_step(cfg.model, cfg.train, mesh)
    mlp = spec.state_shardings["params"]["layers"]["mlp"]
    assert tuple(mlp["wi_0_ExDxF"].spec) == ("fsdp", None, None, None)  # [E, N, D, F]: E over fsdp, D whole
    assert tuple(mlp["wo_ExFxD"].spec) == ("fsdp", None, None, None)


@pytest.mark.slow
def test_a_step_with_the_experts_stored_over_fsdp_equals_one_device():
    """The same computation as MaxText's default layout: only where the experts' weights are stored differs."""
    one, g_one, params = loss_and_grads(["shared_experts=1"], 1)
    fsdp, g_fsdp, _ = loss_and_grads(["shared_experts=1", "ici_fsdp=4", "shard_exp_on_fsdp=true"], 4, params=params)
    assert fsdp == pytest.approx(one, rel=1e-5)
    assert max_diff(g_fsdp, g_one) < 1e-5


def test_the_experts_gathered_inside_the_dispatch_keep_their_shards_layout():
    """Each expert weight enters the dispatch as its parameter is stored and is gathered over the FSDP axes of the
    dimension stored sharded: D by default, E under shard_exp_on_fsdp; the expert and tensor axes are kept."""
    sizes = {"data": 1, "fsdp": 2, "fsdp_transpose": 1, "sequence": 1, "tensor": 2, "expert": 1}
    spec, gathered = moe._stored_and_gathered((4, 8, 16), ("exp", "embed", "mlp"), sizes, None, "tensor")
    assert (tuple(spec), gathered) == ((None, "fsdp", "tensor"), ((1, ("fsdp",)),))
    spec, gathered = moe._stored_and_gathered((4, 8, 16), ("exp_fsdp", None, "mlp"), {**sizes, "tensor": 1}, None,
                                              None)
    assert (tuple(spec), gathered) == (("fsdp", None, None), ((0, ("fsdp",)),))
    spec, gathered = moe._stored_and_gathered((4, 16, 8), ("exp", "mlp", "embed"), {**sizes, "expert": 2}, "expert",
                                              "tensor")
    assert (tuple(spec), gathered) == (("expert", "tensor", "fsdp"), ((2, ("fsdp",)),))


# --- the decoder ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N,dense,step", [(2, 0, 1), (5, 1, 2), (6, 2, 3), (4, 0, 2), (4, 3, 1)])
def test_stacks_follow_the_moe_layers(N, dense, step):
    cfg = tiny_moe(num_layers=N, first_num_dense_layers=dense, interleave_moe_layer_step=step)
    flat, start = [], 0
    for st in stacks(cfg):
        assert st.start == start
        flat += list(st.pattern) * st.count
        start += st.count * len(st.pattern)
    assert tuple(flat) == cfg.moe_layers()


@pytest.mark.parametrize("N,dense,step", [(3, 3, 1), (2, 3, 1), (1, 0, 2), (3, 2, 2)])
def test_a_mixture_of_experts_with_no_layer_of_experts_is_refused(N, dense, step):
    """MaxText's num_moe_layers of 0 or less (num_layers=2 of DeepSeek-V3's 3 dense layers first): refused, naming
    the first layer of experts, where it was estimated as a dense model with the MoE's uncertainty."""
    with pytest.raises(MaxperfError, match="no layer of experts"):
        tiny_moe(num_layers=N, first_num_dense_layers=dense, interleave_moe_layer_step=step)


@pytest.mark.slow
def test_scanned_and_unrolled_interleaved_layers_agree():
    model = tiny_moe(num_layers=5, first_num_dense_layers=1, interleave_moe_layer_step=2)
    scanned, g_scanned, params = loss_and_grads([], 1, model=model)
    abstract = train_step.model_def(model, overrides.apply(model, ["scan_layers=false"]).train)
    unrolled_params = unstack(params, model)
    assert jax.tree.structure(unrolled_params) == jax.tree.structure(abstract.params)
    unrolled, g_unrolled, _ = loss_and_grads(["scan_layers=false"], 1, model=model, params=unrolled_params)
    assert unrolled == pytest.approx(scanned, rel=1e-5)
    assert max_diff(unstack(g_scanned, model), g_unrolled) < 1e-5


def unstack(params, model):
    """Scanned parameters (a layer axis per stack, where stack_axis puts it under the default param_scan_axis) as
    the unrolled model holds them."""
    scan_axis = overrides.apply(model, []).train.param_scan_axis

    def layer(x, i):
        return jnp.take(x, i, axis=stack_axis(x.ndim - 1, scan_axis))

    out = {k: v for k, v in params.items() if k not in {st.name for st in stacks(model)}}
    for st in stacks(model):
        out[st.name] = {i: jax.tree.map(lambda x, i=i: layer(x, i), params[st.name]) for i in range(st.count)}
    return out


def test_remat_keeps_the_expert_projections_by_name():
    """minimal saves MaxText's MLP names, which the expert projections carry: with it, the backward of a MoE layer
    recomputes no ragged_dot; with full remat it does."""
    def ragged_dots(policy):
        cfg = overrides.apply(presets.get("tiny-moe"), [*BASE, "per_device_batch_size=1", f"remat_policy={policy}"])
        spec = train_step.abstract_step(cfg.model, cfg.train, cpu_mesh({"data": 1}, jax.devices()[:1]))
        jaxpr = jax.make_jaxpr(train_step.make_train_step(cfg.model, cfg.train))(spec.state, spec.batch)
        return str(jaxpr).count("ragged_dot")

    assert ragged_dots("full") > ragged_dots("minimal")


# --- presets -------------------------------------------------------------------------------------------------------

def counted(name: str) -> tuple[int, int]:
    """(total, active) parameters of a preset from its abstract model state: active counts top-k of the E routed
    experts in each MoE layer."""
    model = presets.get(name)
    md = train_step.model_def(model, overrides.apply(model, []).train)
    total = md.param_count
    routed = sum(math.prod(x.shape) for path, x in _flat(md.params) if "_ExDxF" in path[-1] or "_ExFxD" in path[-1])
    return total, total - routed * (model.num_experts - model.num_experts_per_tok) // model.num_experts


def _flat(tree, path=()):
    for k, v in tree.items():
        yield from _flat(v, (*path, str(k))) if isinstance(v, dict) else [((*path, str(k)), v)]


@pytest.mark.parametrize("name", ["mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b",
                                  "gpt-oss-120b"])
def test_moe_presets_have_their_published_total_and_active_parameters(name):
    total, active = counted(name)
    if name in presets.ACTIVE_WITHOUT_INPUT_EMBEDDING:
        model = presets.get(name)
        active -= model.vocab_size * model.d_model
    assert total == pytest.approx(presets.PUBLISHED_PARAMS[name], rel=0.01)
    # Qwen's 3.3B is two digits: the 3.35B counted here rounds to it, 1.6% off
    rel = 0.02 if name == "qwen3-30b-a3b" else 0.01
    assert active == pytest.approx(presets.PUBLISHED_ACTIVE_PARAMS[name], rel=rel)


# --- auxiliary-loss-free balancing (routed_bias_update_rate) ------------------------------------------------------

def test_the_bias_update_is_rate_times_the_sign_of_mean_minus_load():
    # 8 assignments over 4 experts: mean 2; over-loaded experts lose the rate, under-loaded gain it, the mean stays
    update = moe.bias_update(jnp.asarray([5, 1, 2, 0], jnp.int32), 0.001)
    np.testing.assert_array_equal(update, np.float32([-0.001, 0.001, 0.0, 0.001]))
    stacked = moe.bias_update(jnp.asarray([[5, 1, 2, 0], [0, 0, 0, 8]], jnp.int32), 0.5)  # a scanned stack [N, E]
    np.testing.assert_array_equal(stacked, np.float32([[-0.5, 0.5, 0, 0.5], [0.5, 0.5, 0.5, -0.5]]))
    counts = moe.expert_counts(jnp.asarray([[[0, 1], [0, 2]], [[0, 3], [1, 0]]]), 4)  # [B, L, K]
    assert counts.tolist() == [4, 2, 1, 1]


def balanced_tiny(scan: bool, rate: float = 0.02):
    model = tiny_moe(routed_score_func=RoutedScoreFunc.SIGMOID, routed_bias=True)
    train = overrides.apply(model, [*BASE, "per_device_batch_size=4", f"routed_bias_update_rate={rate}",
                                    f"scan_layers={str(scan).lower()}", "learning_rate=1e-9"]).train
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (4, 17), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((4, 16), np.bool_)}
    return model, train, batch


def router_loads(model, train, params, batch) -> dict[str, np.ndarray]:
    net = nnx.merge(train_step.model_def(model, train).graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), batch["inputs"].shape)
    return jax.device_get(net.forward(batch["inputs"], positions).counts)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_each_step_moves_every_layers_bias_by_its_loads_exactly(scan):
    model, train, batch = balanced_tiny(scan)
    state = train_step.init_fn(model, train)(jax.random.PRNGKey(0))
    loads = router_loads(model, train, state["params"], batch)
    assert len(loads) == (1 if scan else 2)  # one [N, E] stack, or each layer's [E]
    new, _ = jax.jit(train_step.make_train_step(model, train))(state, batch)
    for path, counts in loads.items():
        assert np.all(counts.sum(-1) == 4 * 16 * 2)  # every token's top-2, the whole batch
        old_bias, new_bias = (functools.reduce(lambda node, k: node[int(k) if k.isdigit() else k], path.split("/"), p)
                              for p in (state["params"], new["params"]))
        mean = counts.sum(-1, keepdims=True) / 4
        np.testing.assert_array_equal(np.asarray(new_bias) - np.asarray(old_bias),
                                      (0.02 * np.sign(mean - counts)).astype(np.float32))


@pytest.mark.slow
def test_the_bias_moves_the_loads_towards_balance():
    model, train, batch = balanced_tiny(True, rate=0.01)
    state = train_step.init_fn(model, train)(jax.random.PRNGKey(0))
    step = jax.jit(train_step.make_train_step(model, train))

    def spread(params):  # the busiest expert's load over the mean, worst layer
        return max(float(c.max() / c.mean()) for c in router_loads(model, train, params, batch).values())

    before = spread(state["params"])
    for _ in range(30):
        state, _ = step(state, batch)
    assert before > 1.3 and spread(state["params"]) < before - 0.2, (before, spread(state["params"]))


def test_the_selection_bias_has_no_gradient():
    model, train, batch = balanced_tiny(True)
    params = train_step.init_fn(model, train)(jax.random.PRNGKey(0))["params"]
    params["layers"]["mlp"]["router"]["bias"] = jnp.asarray([[0.3, -0.2, 0.1, 0.0]] * 2, jnp.float32)
    graphdef = train_step.model_def(model, train).graphdef

    def loss(params):
        net = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), batch["inputs"].shape)
        out = net.forward(batch["inputs"], positions)
        x, lb = out.hidden, out.lb_loss
        return jnp.mean(train_step.cross_entropy(net.logits(x), batch["targets"])) + lb

    grads = jax.grad(loss)(params)
    assert np.all(np.asarray(grads["layers"]["mlp"]["router"]["bias"]) == 0)
    assert np.any(np.asarray(grads["layers"]["mlp"]["router"]["kernel_DxE"]) != 0)


def test_without_a_rate_the_bias_stays_and_no_loads_are_taken():
    model, train, batch = balanced_tiny(True, rate=0.0)
    state = train_step.init_fn(model, train)(jax.random.PRNGKey(0))
    assert router_loads(model, train, state["params"], batch) == {}
    new, _ = jax.jit(train_step.make_train_step(model, train))(state, batch)
    np.testing.assert_array_equal(new["params"]["layers"]["mlp"]["router"]["bias"],
                                  state["params"]["layers"]["mlp"]["router"]["bias"])


# --- refusals ------------------------------------------------------------------------------------------------------

def test_the_sparse_dispatch_takes_a_capacity_factor_as_maxtext_does_by_not_reading_it():
    """MaxText's GPU Mixtral config sets capacity_factor=1.0 beside the default sparse_matmul=true: its sparse
    dispatch is dropless and never reads the factor. maxperf says so and steps and estimates as dropless."""
    from maxperf import perfmodel

    capped = resolve("h100-8", "tiny-moe", ["capacity_factor=1.0"])
    assert any("capacity_factor=1 drops tokens only in the einsum dispatch (sparse_matmul=false); the sparse dispatch "
               "is dropless and does not read it, as in MaxText" in w for w in capped.warnings)
    dropless = resolve("h100-8", "tiny-moe", [])
    assert perfmodel.estimate(capped).step_time_s == perfmodel.estimate(dropless).step_time_s
    assert moe.MoEOptions.from_train(capped.configs.train).sparse_matmul


def test_shard_exp_on_fsdp_on_a_dense_model_changes_nothing_and_says_so():
    dense = resolve("cpu-8", "tiny", ["shard_exp_on_fsdp=true"])
    assert any("this model has none, and it changes nothing, as in MaxText" in w for w in dense.warnings)


@pytest.mark.parametrize("words,match", [
    (["ici_expert=8", "ici_fsdp=1"], r"expert axis \(8 ICI x 1 DCN = 8\) does not divide num_experts=4.*e\.g\. 4"),
    (["num_experts_per_tok=5"], r"num_experts_per_tok \(top-k\) must be between 1 and num_experts \(4\), got 5"),
    (["capacity_factor=0", "sparse_matmul=false"], r"capacity_factor must be -1 \(dropless.*or > 0.*got 0"),
    (["n_routing_groups=3", "topk_routing_group=1"], r"n_routing_groups dividing num_experts \(4\)"),
    (["routed_bias_update_rate=-0.001"], r"routed_bias_update_rate must be >= 0 .*got -0.001"),
    (["shard_exp_on_fsdp=true", "ici_fsdp=4", "ici_tensor=2"],
     r"shard_exp_on_fsdp=true needs ici_tensor=1 and ici_expert=1 \(as MaxText\), not tensor=2 expert=1"),
    (["shard_exp_on_fsdp=true", "ici_fsdp=8"],
     r"splits the 4 experts over fsdp=8, which does not divide them.*e\.g\. 4"),
])
def test_bad_moe_settings_are_refused(words, match):
    with pytest.raises(MaxperfError, match=match):
        resolve("cpu-8", "tiny-moe", words)


def test_a_refusal_is_one_line_and_exit_2():
    proc = maxperf("estimate", "--topology", "v5p-16", "--model", "tiny-moe", "ici_expert_parallelism=8", timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "does not divide num_experts=4" in lines[0]


# --- training ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_moe_trains_with_expert_parallelism_through_compile_and_run(tmp_path):
    out = tmp_path / "tiny-moe"
    proc = maxperf("compile", "--topology", "cpu-4", "--model", "tiny-moe", "seq_len=64", "per_device_batch_size=2",
                   "learning_rate=1e-2", "warmup_steps=0", "ici_expert_parallelism=2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    # a learnable stream: each token is the last one plus 7, mod 256
    np.save(tmp_path / "tokens.npy", (np.arange(64 * 65, dtype=np.int32) * 7) % 256)
    proc = maxperf("run", str(out / "compiled.pkl"), "--steps", "10", "--warmup", "0", "--data",
                   str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    losses = json.loads(proc.stdout)["losses"]
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses


def test_megablox_tiles_follow_maxtext_clipped_to_the_matmul():
    from maxperf.spec.grouped_matmul import megablox_tiling as _megablox_tiling

    assert _megablox_tiling(65536, 4096, 14336) == (512, 1024, 1024)  # MaxText's wi tiles
    assert _megablox_tiling(1024 + 256, 4096, 384) == (256, 1024, 384)
    assert _megablox_tiling(1000, 4096, 4096) is None  # no row tile divides the rows: ragged_dot
    assert _megablox_tiling(1024, 64, 4096) is None  # narrower than the TPU's 128 lanes
    # a recipe's own tiles (MaxText's wi_tile_fwd_*): the row tile as set where it divides the rows, else halved
    assert _megablox_tiling(65536, 7168, 2048, (128, 7168, 2048)) == (128, 7168, 2048)
    assert _megablox_tiling(1024 + 256, 7168, 2048, (1024, 2048, 2048)) == (256, 2048, 2048)


def test_the_train_keys_give_each_weight_and_product_its_tiles():
    """MaxText's wi_tile_* / wo_tile_* keys reach the model's kernel (the forward's) and perfmodel (each product's),
    as (rows, K, N) of the forward: wi's K is the model width, wo's the experts' width."""
    from maxperf.models.layers.moe import MoEOptions
    from maxperf.spec.grouped_matmul import MegabloxTiles, pass_tiles

    train = TrainConfig(wi_tile_fwd_batch_seq=128, wi_tile_fwd_embed_dim=7168, wi_tile_fwd_mlp_dim=2048,
                        wo_tile_fwd_batch_seq=256, wo_tile_fwd_embed_dim=2048, wo_tile_fwd_mlp_dim=3584,
                        wo_tile_drhs_embed_dim=512)
    assert pass_tiles(train, "wi", "fwd") == (128, 7168, 2048)
    assert pass_tiles(train, "wo", "fwd") == (256, 3584, 2048)
    assert pass_tiles(train, "wo", "drhs") == (512, 1024, 512)  # the rest at MaxText's defaults
    assert MoEOptions.from_train(train).megablox == MegabloxTiles((128, 7168, 2048), (256, 3584, 2048))
    assert MoEOptions.from_train(TrainConfig(megablox=False)).megablox is None
    with pytest.raises(MaxperfError, match="wi_tile_dlhs_mlp_dim must be a positive multiple of 128, got 100"):
        TrainConfig(wi_tile_dlhs_mlp_dim=100)


def test_on_tpu_the_megablox_kernel_gives_ragged_dots_values_and_gradients(monkeypatch):
    """The TPU path (jax's Pallas megablox kernel, run here in interpret mode) against jax.lax.ragged_dot."""
    import functools

    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

    from maxperf.models.layers import attention_kernels, moe

    gmm, calls = megablox_ops.gmm, []

    def interpreted(*args):
        calls.append(args[4])  # the tiling
        return gmm(*args, None, None, False, True)  # interpret=True

    monkeypatch.setattr(megablox_ops, "gmm", interpreted)
    monkeypatch.setattr(attention_kernels, "platform_of_mesh", lambda: "tpu")
    x = jax.random.normal(jax.random.PRNGKey(0), (1024, 256), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 256, 384), jnp.float32)
    sizes = jnp.array([100, 300, 0, 624], jnp.int32)

    def loss(fn, x, w):
        return jnp.sum(fn(x, w) ** 2)

    mega = functools.partial(lambda x, w: moe.grouped_matmul(x, w, sizes, (512, 1024, 1024)))
    ragged = functools.partial(lambda x, w: jax.lax.ragged_dot(x, w, sizes))
    np.testing.assert_allclose(mega(x, w), ragged(x, w), rtol=1e-5, atol=1e-3)
    for a, b in zip(jax.grad(functools.partial(loss, mega), (0, 1))(x, w),
                    jax.grad(functools.partial(loss, ragged), (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-2)
    assert calls and set(calls) == {(512, 256, 384)}
    # an expert MLP takes the up and gate projections' forward tiles and the down projection's, each clipped to
    # its matmul (wi: 1024 rows by D 256 into F 384; wo: F 384 into D 256)
    calls.clear()
    from maxperf.spec.grouped_matmul import MegabloxTiles

    wi = jax.random.normal(jax.random.PRNGKey(2), (4, 256, 384), jnp.float32)
    wo = jax.random.normal(jax.random.PRNGKey(3), (4, 384, 256), jnp.float32)
    moe._expert_mlp(x, sizes, (wi, wi, wo), Activation.SWIGLU, MegabloxTiles((256, 1024, 1024), (128, 1024, 1024)))
    assert calls == [(256, 256, 384), (256, 256, 384), (128, 384, 256)]


def test_an_axis_that_does_not_divide_what_the_axes_before_it_leave_says_so():
    """gpt-oss's D=2880 split over fsdp=64 leaves 45 rows a device, which expert=4 does not divide (2880 itself it
    does): the warning names the product that fails, not a false 'expert=4 does not divide 2880'."""
    from maxperf.spec.request import resolve

    lines = [w for w in resolve("tpu7x-256", "gpt-oss-120b", ["per_device_batch_size=4", "ici_expert_parallelism=4"]
                                ).warnings if w.startswith("expert=4")]
    assert lines and all("does not divide the 45 of D=2880 that fsdp=64 leaves" in w for w in lines), lines
    assert "product fsdp x expert divides 2880" in lines[0]


def test_the_headline_says_what_overrides_changed_of_the_preset(capsys):
    """A preset changed by key=value words is not the preset: the estimate's first line and its --json say which
    fields differ; the preset as it is carries no such words."""
    import json

    from maxperf import cli

    assert cli.main(["estimate", "--topology", "v5p-8", "--model", "llama2-7b", "base_num_decoder_layers=4"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("llama2-7b (modified: num_layers=4) on v5p-8")
    assert cli.main(["estimate", "--topology", "v5p-8", "--model", "llama2-7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_changed"] == {}
    assert cli.main(["estimate", "--topology", "v5p-8", "--model", "llama2-7b", "--json", "num_layers=4"]) == 0
    assert json.loads(capsys.readouterr().out)["model_changed"] == {"num_layers": "4"}


def _checkpoint_names(jaxpr) -> list[tuple[str, ...]]:
    """Each value's checkpoint names, in order: a value named twice (checkpoint_name of a checkpoint_name) gives
    both, innermost first."""
    names, of = [], {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            chain = of.get(eqn.invars[0], ()) + (eqn.params["name"],)
            of[eqn.outvars[0]] = chain
            names = [n for n in names if n != chain[:-1]] + [chain]
    return names


def test_dropless_experts_name_their_up_projection_as_maxtext_does():
    """MaxText's sparse_matmul path names the routed experts' gate output mlpwi_0 and moe_mlpwi_0, their up output
    moe_mlpwi_1 alone (layers/moe.py), their down output mlpwo and moe_mlpwo: a policy that keeps mlpwi_1 (minimal,
    custom mlpwi_1=device) recomputes the experts' up projection."""
    E, D, F, T = 4, 8, 16, 12
    ws = [jnp.ones((E, D, F)), jnp.ones((E, D, F)), jnp.ones((E, F, D))]
    jaxpr = jax.make_jaxpr(lambda x: moe._expert_mlp(x, jnp.array([3, 3, 3, 3], jnp.int32), ws, Activation.SWIGLU))(
        jnp.ones((T, D)))
    names = _checkpoint_names(jaxpr.jaxpr)
    assert ("moe_mlpwi_1",) in names and not any("mlpwi_1" in chain for chain in names)
    assert ("mlpwi_0", "moe_mlpwi_0") in names
