"""Properties of the model family and its train step, on CPU with tiny configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models_util import cpu_mesh, tiny, train_losses, two_step_losses

from maxperf.models import train_step
from maxperf.models.sharding import RULES, mesh_axes_for
from maxperf.models.transformer import stack_axis
from maxperf.spec import overrides, presets
from maxperf.spec import topology as topologies
from maxperf.spec.errors import MaxperfError
from maxperf.spec.mesh import resolve as resolve_mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.parallelism import ParallelismConfig


@pytest.fixture(autouse=True)
def strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.mark.parametrize("name", sorted(presets.PUBLISHED_PARAMS))
def test_published_parameter_counts(name):
    count = train_step.param_count(presets.get(name))
    assert count == pytest.approx(presets.PUBLISHED_PARAMS[name], rel=0.01)


def test_every_preset_builds_abstractly():
    for name in presets.names():
        assert train_step.param_count(presets.get(name)) > 0


@pytest.mark.parametrize(
    "size, D, H, F, N",
    [(1, 2048, 16, 7168, 16), (2, 2048, 32, 14336, 16), (4, 4096, 32, 14336, 16), (8, 4096, 32, 14336, 32),
     (16, 4096, 64, 28672, 32), (1024, 16384, 256, 114688, 128)],
)
def test_scaled_family_follows_its_rule(size, D, H, F, N):
    m = presets.get(f"scaled-{size}")
    assert (m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.num_layers) == (D, H, H, F, N)
    assert (m.vocab_size, m.head_dim) == (32000, 128)


def test_scaled_family_roughly_doubles():
    counts = [train_step.param_count(presets.get(f"scaled-{2**i}")) for i in range(6)]
    ratios = np.array(counts[1:]) / np.array(counts[:-1])
    assert np.all((ratios > 1.5) & (ratios < 2.6)), ratios


def test_unknown_model_suggests_close_names():
    with pytest.raises(MaxperfError, match="llama2-7b"):
        presets.get("llama2-7")


@pytest.mark.slow
def test_loss_falls_on_a_fixed_batch():
    _, spec = tiny("learning_rate=1e-2")
    losses, metrics = train_losses(spec, 30)
    assert losses[-1] < 0.5 * losses[0], losses
    assert int(metrics["tokens"]) == spec.batch["inputs"].size


@pytest.mark.slow
def test_sharded_step_matches_one_device():
    _, sharded = tiny("ici_data=2", "ici_fsdp=2", "ici_tensor=2")
    _, single = tiny("per_device_batch_size=16", devices=1)
    assert sharded.batch["inputs"].shape == single.batch["inputs"].shape
    batch = jax.device_get(train_step.synthetic_batch(single, seed=3))
    a, b = two_step_losses(sharded, batch), two_step_losses(single, batch)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def _logits(cfg, tokens):
    net = train_step.build_model(cfg.model, cfg.train, nnx.Rngs(params=0))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return net(tokens, positions)


@pytest.mark.slow
def test_logits_dot_in_fp32_multiplies_the_hidden_states_and_table_in_float32():
    """MaxText's logits_dot_in_fp32: the logits' matmul takes float32 operands, where by default it takes the compute
    dtype's (bfloat16 here) and only its result is cast."""
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 256, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), tokens.shape)
    for tied in ("false", "true"):
        cfg = overrides.apply(presets.get("tiny"), ["compute_dtype=bfloat16", f"tie_embeddings={tied}",
                                                    "logits_dot_in_fp32=true"])
        net = train_step.build_model(cfg.model, cfg.train, nnx.Rngs(params=0))
        assert net.logits_in_fp32
        hidden = net.forward(tokens, positions).hidden
        table = net.embed.table_VxD[...].T if cfg.model.tie_embeddings else net.unembed.w_DxV[...]
        expected = jnp.einsum("BLD,DV->BLV", hidden.astype(jnp.float32), table.astype(jnp.float32))
        np.testing.assert_allclose(net.logits(hidden), expected, rtol=1e-5, atol=1e-5)
        net.logits_in_fp32 = False  # MaxText's default: the product in bfloat16, rounded
        assert not np.allclose(net.logits(hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("words", [(), ("attention_type=local_sliding", "window=4"), ("positions=learned",)])
def test_causality(words):
    cfg, _ = tiny(*words)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, 256, jnp.int32)
    t = 9
    changed = tokens.at[:, t + 1].set((tokens[:, t + 1] + 1) % 256)
    a, b = _logits(cfg, tokens), _logits(cfg, changed)
    np.testing.assert_array_equal(a[:, : t + 1], b[:, : t + 1])
    assert not np.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_sliding_window_forgets_tokens_outside_it():
    cfg, _ = tiny("attention_type=local_sliding", "window=3", "num_layers=1")
    tokens = jax.random.randint(jax.random.PRNGKey(0), (1, 16), 0, 256, jnp.int32)
    changed = tokens.at[:, 2].set((tokens[:, 2] + 1) % 256)
    a, b = _logits(cfg, tokens), _logits(cfg, changed)
    # with one layer of window 3, position 2 reaches positions 2, 3 and 4 only
    np.testing.assert_array_equal(a[:, 5:], b[:, 5:])
    assert not np.allclose(a[:, 2:5], b[:, 2:5])


def _grads(*words):
    """Gradients of the mean loss, from the same initial values whether layers are scanned or not."""
    cfg, spec = tiny(*words, devices=1)
    scanned = cfg.train.scan_layers
    _, stacked_spec = tiny(*words, "scan_layers=true", devices=1)
    params = train_step.init_state(stacked_spec, seed=0)["params"]
    at = lambda ndim: stack_axis(ndim - 1, cfg.train.param_scan_axis)  # noqa: E731 (the stacked array's layer axis)
    if not scanned:
        layers = params["layers"]
        params = {**params, "layers": {i: jax.tree.map(lambda x: jnp.take(x, i, axis=at(x.ndim)), layers)
                                       for i in range(cfg.model.num_layers)}}
    batch = jax.device_get(train_step.synthetic_batch(spec, seed=1))
    graphdef = train_step.model_def(cfg.model, cfg.train).graphdef

    def loss(params):
        net = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), batch["inputs"].shape)
        logits = net(batch["inputs"], positions)
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1))

    grads = jax.jit(jax.grad(loss))(params)
    if not scanned:  # stack the unrolled layers' gradients like the scanned ones
        layers = grads["layers"]
        grads = {**grads, "layers": jax.tree.map(lambda *xs: jnp.stack(xs, axis=at(xs[0].ndim + 1)),
                                                 *[layers[i] for i in sorted(layers)])}
    return grads


@pytest.mark.slow
def test_layer_axis_second_is_the_same_model():
    """param_scan_axis 1 (MaxText's default) moves the scanned weights' layer axis, nothing else: the same initial
    values, moved, and the same losses as param_scan_axis 0."""
    second, first = tiny(devices=1)[1], tiny("param_scan_axis=0", devices=1)[1]
    up_second = train_step.init_state(second, seed=0)["params"]["layers"]["mlp"]["up_DxF"]
    up_first = train_step.init_state(first, seed=0)["params"]["layers"]["mlp"]["up_DxF"]
    assert up_second.shape == (64, 2, 128) and up_first.shape == (2, 64, 128)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(up_second), 1, 0), np.asarray(up_first))
    np.testing.assert_allclose(train_losses(second, 2)[0], train_losses(first, 2)[0], rtol=1e-6)


@pytest.mark.slow
def test_remat_and_scan_do_not_change_gradients():
    reference = _grads("remat_policy=none")
    for words in [("remat_policy=minimal",), ("remat_policy=full",), ("remat_policy=full", "scan_layers=false")]:
        other = _grads(*words)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), reference, other)


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch():
    _, whole = tiny(devices=2)
    _, accumulated = tiny("per_device_batch_size=1", "grad_accum_steps=2", devices=2)  # 2 microbatches of 1
    assert accumulated.batch["inputs"].shape == whole.batch["inputs"].shape
    batch = jax.device_get(train_step.synthetic_batch(whole, seed=5))
    np.testing.assert_allclose(two_step_losses(whole, batch), two_step_losses(accumulated, batch), rtol=1e-5)


def test_405b_abstract_state_allocates_nothing():  # how long it takes: bench/quick_paths.py
    model = presets.get("llama3.1-405b")
    cfg = overrides.apply(model, [])
    devices = np.array(jax.devices() * 64)  # 512 stand-ins: shapes only, never placed
    mesh = cpu_mesh(resolve_mesh(cfg.parallelism, topologies.get("cpu-512")), devices)
    before = len(jax.live_arrays())
    spec = train_step.abstract_step(cfg.model, cfg.train, mesh)
    assert len(jax.live_arrays()) == before
    leaves = jax.tree.leaves(spec.state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert spec.param_count == pytest.approx(405.8e9, rel=0.01)
    # AdamW keeps two moments per parameter
    assert sum(x.size for x in leaves) == pytest.approx(3 * spec.param_count, rel=1e-6)


def test_logical_rules_are_pinned():
    assert RULES["embed"] == ("fsdp", "fsdp_transpose", "sequence", "expert")
    assert RULES["heads"] == RULES["kv_heads"] == RULES["vocab"] == ("tensor",)
    assert RULES["mlp"] == ("fsdp_transpose", "tensor")
    assert RULES["activation_batch"] == ("data", "fsdp", "fsdp_transpose", "expert")
    assert RULES["activation_length"] == ("sequence",)
    sizes = {"data": 2, "fsdp": 4, "sequence": 1, "tensor": 8, "expert": 1}
    assert mesh_axes_for((4096, 32, 128), ("embed", "heads", "head_dim"), sizes) == ("fsdp", "tensor", None)
    # 4 kv heads cannot be split 8 ways: replicated along `tensor`
    assert mesh_axes_for((4096, 4, 128), ("embed", "kv_heads", "head_dim"), sizes) == ("fsdp", None, None)
    assert mesh_axes_for((16, 2048), ("activation_batch", "activation_length"), sizes) == (("data", "fsdp"), None)
    assert mesh_axes_for((2, 2048), ("activation_batch", "activation_length"), sizes) == ("data", None)


def test_parameters_are_sharded_by_their_logical_axes():
    _, spec = tiny("ici_fsdp=2", "ici_tensor=4")
    shardings = spec.state_shardings["params"]
    # a scanned weight carries its layer axis second ([D, N, F]: MaxText's param_scan_axis 1)
    assert shardings["layers"]["mlp"]["up_DxF"].spec == P("fsdp", None, "tensor")
    assert shardings["embed"]["table_VxD"].spec == P("tensor", "fsdp")
    mu = spec.state_shardings["opt_state"][1][0].mu
    assert mu["layers"]["mlp"]["up_DxF"].spec == P("fsdp", None, "tensor")
    assert shardings["layers"]["attn_norm"]["scale"].spec == P(None, "tensor")  # a vector keeps its layer axis first
    _, first = tiny("ici_fsdp=2", "ici_tensor=4", "param_scan_axis=0")
    assert first.state_shardings["params"]["layers"]["mlp"]["up_DxF"].spec == P(None, "fsdp", "tensor")


@pytest.mark.parametrize(
    "word, message",
    [
        ("per_device_batch_size=-1", "per_device_batch_size must be > 0"),
        ("remat_policy=fulll", "did you mean full"),
        ("per_device_bach_size=2", "did you mean per_device_batch_size"),
        ("scan_layers=maybe", "true or false"),
        ("seq_len=many", "integer"),
        ("grad_accum_steps=0", "grad_accum_steps must be >= 1"),
        ("noequals", "key=value"),
    ],
)
def test_bad_overrides_say_what_is_valid(word, message):
    with pytest.raises(MaxperfError, match=message):
        overrides.apply(presets.get("tiny"), [word])


def test_maxtext_aliases():
    cfg = overrides.apply(
        presets.get("tiny"),
        ["max_target_length=64", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "dcn_data_parallelism=2",
         "gradient_accumulation_steps=1", "base_num_decoder_layers=3"],
    )
    assert cfg.train.seq_len == 64 and cfg.model.num_layers == 3
    assert cfg.parallelism == ParallelismConfig(ici_fsdp=4, ici_tensor=2, dcn_data=2)


def test_model_config_rejects_inconsistent_heads():
    with pytest.raises(MaxperfError, match="multiple of num_kv_heads"):
        ModelConfig(name="x", vocab_size=8, d_model=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, d_ff=8)


def _subjaxprs(eqn):
    """The jaxprs an equation holds in its parameters (scan and while bodies, remat, custom rules, pjit)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def _shapes_in(jaxpr, primitive: str) -> list[tuple]:
    """Operand shapes of every `primitive` equation in a closed jaxpr, sub-jaxprs (scan, remat, custom rules) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found += [tuple(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")]
        for sub in _subjaxprs(eqn):
            found += _shapes_in(sub, primitive)
    return found


def test_cross_entropy_matches_optax_without_a_gather_on_the_logits():
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 11), jnp.float32) * 3
    targets = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 11)
    import optax

    np.testing.assert_allclose(train_step.cross_entropy(logits, targets),
                               optax.softmax_cross_entropy_with_integer_labels(logits, targets), rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda x: jnp.sum(train_step.cross_entropy(x, targets)))(logits)
    g_ref = jax.grad(lambda x: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, targets)))(logits)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-6)
    # a gather of the target logits makes XLA materialize the float32 [B, L, V] logits (MaxText picks them by a
    # one-hot reduction that fuses with the logits)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda x: jnp.sum(train_step.cross_entropy(x, targets))))(logits)
    assert (2, 5, 11) not in _shapes_in(jaxpr.jaxpr, "gather")


def test_step_keeps_logits_and_rope_in_the_compute_dtype():
    """The logits are sharded in bfloat16 before their cast to float32 (MaxText's cast_logits_to_fp32), and rotary
    embeddings rotate q and k in bfloat16 (MaxText's RotaryEmbedding): no float32 [B, L, V] sharding constraint and
    no float32 [B, L, H, Dh] values in the step."""
    cfg, spec = tiny("compute_dtype=bfloat16", "attention=dot_product")  # CPU flash works in float32 blocks
    m = cfg.model
    step = train_step.make_train_step(cfg.model, cfg.train)
    with jax.set_mesh(spec.mesh):
        jaxpr = jax.make_jaxpr(step)(spec.state, spec.batch).jaxpr
    B, L = spec.batch["inputs"].shape

    def avals(j):
        for eqn in j.eqns:
            yield eqn, [v.aval for v in eqn.outvars]
            for sub in _subjaxprs(eqn):
                yield from avals(sub)

    constrained = [a for e, outs in avals(jaxpr) if e.primitive.name == "sharding_constraint" for a in outs]
    assert any(a.shape[-1] == m.vocab_size and a.dtype == jnp.bfloat16 for a in constrained)
    assert not any(a.shape[-1] == m.vocab_size and a.dtype == jnp.float32 and a.ndim == 3 for a in constrained)
    heads = {(B, L, m.num_heads, m.head_dim), (B, L, m.num_kv_heads, m.head_dim)}
    f32_heads = [a for _, outs in avals(jaxpr) for a in outs
                 if getattr(a, "shape", None) in heads and a.dtype == jnp.float32]
    assert not f32_heads


def test_embedding_lookup_gathers_in_the_compute_dtype():
    """MaxText's Embed casts the table before the lookup: a float32 gather keeps a float32 [B, L, D] live."""
    from maxperf.models.layers.embedding import Embed

    embed = Embed(11, 4, jnp.float32, nnx.Rngs(0))
    tokens = jnp.zeros((2, 3), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda t: embed(t, jnp.bfloat16))(tokens)

    def gathers(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "gather":
                yield eqn.invars[0].aval.dtype
            for sub in _subjaxprs(eqn):
                yield from gathers(sub)

    assert list(gathers(jaxpr.jaxpr)) == [jnp.bfloat16]


def test_maxtexts_mu_and_grad_dtypes_reach_the_optimizer_and_perfmodel():
    """mu_dtype keeps AdamW's first moment in its dtype (the second in the parameters'); grad_dtype is what the update
    reads, and perfmodel counts both in those bytes."""
    from maxperf.perfmodel import estimate_memory
    from maxperf.spec.mesh import Mesh
    from maxperf.spec.train import TrainConfig

    params = {"w": jnp.ones((4, 8), jnp.float32)}
    train = TrainConfig(mu_dtype="bfloat16")
    state = train_step.make_optimizer(train)[0].init(params)
    moments = [s for s in jax.tree.leaves(state) if getattr(s, "shape", None) == (4, 8)]
    assert sorted(str(m.dtype) for m in moments) == ["bfloat16", "float32"]
    model, mesh = presets.get("llama2-7b"), Mesh.of({"fsdp": 8})
    plain = estimate_memory(model, TrainConfig(), mesh, hbm_bytes=95e9)
    half = estimate_memory(model, TrainConfig(mu_dtype="bfloat16", grad_dtype="bfloat16"), mesh, hbm_bytes=95e9)
    assert half.optimizer == pytest.approx(plain.optimizer * 6 / 8)
    assert half.gradients == pytest.approx(plain.gradients / 2)
