"""Pipeline parallelism: the schedule's rules (MaxText's configs/types.py checks) and the SPMD pipeline's loop
(models/pipeline.py) against the same units applied one after another."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_util import cpu_mesh

from maxperf.models import pipeline
from maxperf.spec.errors import MaxperfError
from maxperf.spec.pipeline import schedule


def test_the_schedule_derives_repeats_and_microbatches_as_maxtext():
    s = schedule(4, 32, 64)
    assert (s.stages, s.repeats, s.units_per_stage, s.microbatches) == (4, 8, 1, 4)
    assert s.iterations == 4 * 8 + 3 and s.bubble_fraction == pytest.approx(3 / 35)
    assert not s.circular_storage  # microbatches = stages: the last stage sends straight to the first
    s = schedule(4, 32, 64, microbatches=16, units_per_stage=2)
    assert (s.repeats, s.iterations, s.circular_storage) == (4, 16 * 4 + 3, True)
    s = schedule(4, 32, 64, delay=True)
    assert (s.microbatches, s.delay, s.iterations) == (8, 2, 8 * 8 + 6)
    assert schedule(1, 32, 64) is None


def test_the_embeddings_and_losss_places_make_megatrons_uneven_stages():
    """Llama 3.1 405B's 126 layers over 8 stages x 8 repeats x 2 (Megatron-Bridge's layout): the embedding and the
    loss take a layer's place each, 128 places; the first and the last hold no layer."""
    s = schedule(8, 126, 64, microbatches=32, units_per_stage=2, empty_first=1, empty_last=1)
    assert (s.repeats, s.places, s.units, s.iterations) == (8, 128, 126, 32 * 8 + 7)
    live = s.live()
    assert not live[0] and not live[-1] and live[1:-1].all()
    stored = live[pipeline.stage_major(s.places, s)].reshape(8, 8, 2)
    # stage 0's first repeat and stage 7's last hold one layer each, every other (stage, repeat) two
    assert stored.sum(axis=2).tolist() == [[1] + [2] * 7] + [[2] * 8] * 6 + [[2] * 7 + [1]]
    assert s.as_dict()["empty_places"] == [1, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"stages": 3}, "3 pipeline stages x num_layers_per_pipeline_stage=1 do not divide the 32 pipelined layers"),
    ({"pipelined_units": 30}, "or give the embedding and the loss a layer's place each"),
    ({"pipelined_units": 30, "empty_first": 1, "repeats": 4}, r"must equal the 30 pipelined layers and the "
     r"embedding's place \(31\)"),
    ({"pipelined_units": 30, "empty_last": 1}, "do not divide the 30 pipelined layers and the loss's place"),
    ({"units_per_stage": 3}, "num_layers_per_pipeline_stage can be 1, 2, 4, 8"),
    ({"repeats": 3}, r"stages \(4\) x num_pipeline_repeats \(3\) x num_layers_per_pipeline_stage \(1\) must equal"),
    ({"microbatches": 6}, "num_pipeline_microbatches=6 must be a positive multiple of the 4 pipeline stages"),
    ({"microbatches": 4, "delay": True}, "needs at least 2 x 4 = 8 microbatches"),
    ({"microbatches": 128}, "the batch of 64 examples does not split into num_pipeline_microbatches=128"),
    # the delay's default count (2 x the stages) that the batch does not split: a fix that works, not a smaller count
    ({"batch": 4, "delay": True}, r"does not split into num_pipeline_microbatches=8 \(2 x the 4 stages, its default "
     r"with pipeline_delay_activation_forwarding\); make the batch .* a multiple of 8 or drop "
     r"pipeline_delay_activation_forwarding"),
    ({"stages": 8, "pipelined_units": 30, "units_per_stage": 1},
     r"choose a stage count that divides 30 \(2, 3, 5, 6, 10, 15, 30\)"),
])
def test_a_schedule_that_cannot_run_names_what_would(kwargs, message):
    args = {"stages": 4, "pipelined_units": 32, "batch": 64} | kwargs
    stages, units, batch = args.pop("stages"), args.pop("pipelined_units"), args.pop("batch")
    with pytest.raises(MaxperfError, match=message):
        schedule(stages, units, batch, **args)


def _unit(x_bxLxD, positions_bxL, w):
    y = jnp.tanh(x_bxLxD @ w["a"] + positions_bxL[..., None] * 0.01) + x_bxLxD
    return y, jnp.mean(y), {"positive": jnp.sum(y > 0, axis=(0, 1)).astype(jnp.int32)}


def _sequential(W_NxDxD, x_BxLxD, positions_BxL, M):
    """Each unit over each microbatch in turn: the pipeline's answer."""
    b = x_BxLxD.shape[0] // M
    aux, counts = 0.0, []
    for w in W_NxDxD:
        outs, a, c = [], 0.0, 0
        for m in range(M):
            y, a_m, c_m = _unit(x_BxLxD[m * b:(m + 1) * b], positions_BxL[m * b:(m + 1) * b], {"a": w})
            outs, a, c = outs + [y], a + a_m, c + c_m["positive"]
        x_BxLxD, aux = jnp.concatenate(outs), aux + a / M
        counts.append(c)
    return x_BxLxD, aux, jnp.stack(counts)


@pytest.mark.parametrize("S, M, R, U, delay, axes", [
    pytest.param(2, 2, 1, 1, False, {"stage": 2, "fsdp": 4}, marks=pytest.mark.slow),  # one repeat
    pytest.param(2, 4, 1, 2, False, {"stage": 2, "fsdp": 4}, marks=pytest.mark.slow),  # two units per stage
    # circular, the last stage straight to the first
    pytest.param(2, 2, 2, 1, False, {"stage": 2, "fsdp": 4}, marks=pytest.mark.slow),
    (4, 8, 3, 1, False, {"stage": 4, "data": 2}),  # circular storage
    pytest.param(2, 4, 2, 2, True, {"stage": 2, "fsdp": 4}, marks=pytest.mark.slow),  # the forwarding delay
])
def test_the_pipeline_equals_its_units_in_turn(S, M, R, U, delay, axes):
    N, B, L, D = S * R * U, 2 * M, 4, 8
    W = jax.random.normal(jax.random.key(0), (N, D, D)) * 0.3
    x = jax.random.normal(jax.random.key(1), (B, L, D))
    positions = jnp.broadcast_to(jnp.arange(L), (B, L)) + jnp.arange(B)[:, None]
    s = schedule(S, N, B, microbatches=M, repeats=R, units_per_stage=U, delay=delay)
    order = pipeline.stage_major(N, s)
    assert sorted(order) == list(range(N)) and (order[pipeline.natural_order(N, s)] == np.arange(N)).all()
    W_stored = W[order].reshape(S, R, U, D, D)

    def run(W_stored, x):
        like = {"positive": jax.ShapeDtypeStruct((D,), jnp.int32)}
        return pipeline.run(_unit, {"a": W_stored}, x, positions, s, counts_like=like)

    def loss(run_out):
        out, aux, _ = run_out
        return jnp.sum(out ** 2) + aux

    with jax.set_mesh(cpu_mesh(axes)):
        out, aux, counts = jax.jit(run)(W_stored, x)
        grads = jax.jit(jax.grad(lambda W, x: loss(run(W, x)), argnums=(0, 1)))(W_stored, x)
    ref_out, ref_aux, ref_counts = _sequential(W, x, positions, M)
    ref_grads = jax.grad(lambda W, x: loss(_sequential(W, x, positions, M)), argnums=(0, 1))(W, x)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(aux, ref_aux, rtol=1e-5)
    np.testing.assert_array_equal(counts["positive"], ref_counts)
    np.testing.assert_allclose(grads[0], ref_grads[0][order].reshape(W_stored.shape), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads[1], ref_grads[1], rtol=1e-4, atol=1e-4)


# the decoder pipelined in the model: the same loss and gradients as the unpipelined step


def _stage_layer_axis(logical) -> int | None:
    return logical.index("stage_layers") if "stage_layers" in logical else None


def _pipelined_against_unpipelined(preset: str, words: tuple[str, ...], pipe: tuple[str, ...]):
    """(loss, grads) of one batch through the decoder on 4 CPU devices pipelined over 2 stages by `pipe`, and the
    same unpipelined (fsdp 4), the pipelined gradients put back in the model's layer order."""
    from flax import nnx

    from maxperf.models import train_step
    from maxperf.models.transformer import stacks
    from maxperf.spec import overrides, presets
    from maxperf.spec import pipeline as pipeline_spec
    from maxperf.spec import topology as topologies
    from maxperf.spec.mesh import resolve as resolve_mesh

    base = ["seq_len=16", "per_device_batch_size=2", "compute_dtype=float32", *words]
    out, ref_params = [], None
    for extra in (("ici_fsdp=4",), ("ici_stage=2", "ici_fsdp=2", *pipe)):
        cfg = overrides.apply(presets.get(preset), [*base, *extra])
        spec_mesh = resolve_mesh(cfg.parallelism, topologies.get("cpu-4"))
        mesh = cpu_mesh(spec_mesh)
        md = train_step.model_def(cfg.model, cfg.train)
        params = ref_params = ref_params or nnx.to_pure_dict(
            nnx.state(train_step.build_model(cfg.model, cfg.train, nnx.Rngs(params=0))))
        schedule = pipeline_spec.of(cfg.model, cfg.train, spec_mesh)
        order = None
        if schedule is not None:  # the same weights, stored stage-major, an empty place with the first unit's
            order = pipeline.stage_major(schedule.places, schedule)
            units = np.arange(stacks(cfg.model)[0].count)
            at = np.concatenate([units[:1]] * schedule.empty_first + [units] + [units[:1]] * schedule.empty_last)
            params = jax.tree.map(lambda v, ax: v if _stage_layer_axis(ax) is None else
                                  jnp.take(v, at[order], axis=_stage_layer_axis(ax)), params, md.logical_axes,
                                  is_leaf=lambda x: isinstance(x, tuple))
        rows = 8
        tokens = jax.random.randint(jax.random.key(1), (rows, 17), 0, cfg.model.vocab_size)
        positions = jnp.broadcast_to(jnp.arange(16), (rows, 16))

        def loss(params):
            logits = nnx.merge(md.graphdef, params)(tokens[:, :-1], positions)
            return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

        with jax.set_mesh(mesh):
            value, grads = jax.jit(jax.value_and_grad(loss))(params)
        if order is not None:  # back to the model's order, the empty places' (zero) gradients left out
            back = pipeline.natural_order(len(order), schedule)[schedule.live()]
            grads = jax.tree.map(lambda v, ax: v if _stage_layer_axis(ax) is None else
                                 jnp.take(v, back, axis=_stage_layer_axis(ax)), grads, md.logical_axes,
                                 is_leaf=lambda x: isinstance(x, tuple))
        out.append((value, grads))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset, words, pipe", [
    ("tiny", ("num_layers=4",), ()),  # 2 stages, 2 repeats of a layer (MaxText's -1)
    ("tiny", ("num_layers=4",), ("num_pipeline_microbatches=4", "num_layers_per_pipeline_stage=2")),
    ("tiny", ("num_layers=4",), ("num_pipeline_microbatches=4", "pipeline_delay_activation_forwarding=true")),
    ("tiny", ("num_layers=4",), ("pipeline_fsdp_ag_once=true",)),
    # Megatron's uneven stages: 6 layers and the embedding's and loss's places over 2 stages x 2 repeats x 2
    ("tiny", ("num_layers=6",), ("num_pipeline_microbatches=4", "num_layers_per_pipeline_stage=2",
                                 "account_for_embedding_in_pipeline_split=true",
                                 "account_for_loss_in_pipeline_split=true")),
    ("tiny-moe", (), ()),
    ("tiny-mla", (), ()),
])
def test_the_pipelined_decoder_equals_the_unpipelined_one(preset, words, pipe):
    """Loss equal to 1e-5 and gradients to 1e-4 of each one's largest entry (float32: the pipelined step sums its
    microbatches' contributions in another order)."""
    (ref_loss, ref_grads), (loss, grads) = _pipelined_against_unpipelined(preset, words, pipe)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(np.abs(b).max(), 1e-6)),
                 grads, ref_grads)


# perfmodel: the bubble, the stage transfers, the weights and activations a stage holds


def _estimate(*words: str, topology: str = "v5p-16"):
    from maxperf.perfmodel import estimate
    from maxperf.spec import resolve

    return estimate(resolve(topology, "llama2-7b", ["per_device_batch_size=4", "remat_policy=full", *words]))


def _row(est, name):
    return next(r for r in est.breakdown if r.name == name)


def test_a_pipeline_computes_its_bubble_and_moves_its_stage_outputs():
    """2 stages x 16 repeats (MaxText's -1: the layers over the stages) and 4 microbatches: 4 x 16 + 1 iterations, each
    a layer on a quarter of the device's tokens, which are twice the unpipelined device's (the batch is not split over
    `stage`): the layers' FLOPs are 65/64 of the unpipelined step's; the logits' are the same (their batch is split
    over stages). Each iteration moves its outputs on, forward and backward."""
    flat = _estimate()
    piped = _estimate("ici_stage=2", "num_pipeline_microbatches=4")
    assert _row(piped, "mlp down").flops == pytest.approx(_row(flat, "mlp down").flops * 65 / 64, rel=1e-12)
    assert _row(piped, "unembedding").flops == pytest.approx(_row(flat, "unembedding").flops, rel=1e-12)
    transfers = _row(piped, "pipeline stage transfers (ici)")
    tokens = 4 * 2 * 2048 / 4  # B x stages x L over the microbatches
    assert transfers.bytes == pytest.approx(2 * 65 * (2 + 1) * tokens * 4096 * 2)  # circular storage: 3 permutes
    assert any("65 iterations (1.5% bubble" in a for a in piped.assumptions)
    more = _estimate("ici_stage=2", "num_pipeline_microbatches=8")
    assert _row(more, "mlp down").flops < _row(piped, "mlp down").flops  # a smaller bubble: 8 x 16 + 1 iterations
    # 16 microbatches of 2 rows: fsdp=4 does not divide them, so each device computes both rows, as the compiled
    # step does (replicated along fsdp): 16 x 16 + 1 iterations of 2 rows against 8 x 16 + 1 of 1
    replicated = _estimate("ici_stage=2", "num_pipeline_microbatches=16")
    assert _row(replicated, "mlp down").flops == pytest.approx(_row(more, "mlp down").flops * 257 * 2 / 129, rel=1e-9)
    from maxperf.spec import resolve

    request = resolve("v5p-16", "llama2-7b", ["per_device_batch_size=4", "ici_stage=2", "num_pipeline_microbatches=16"])
    assert any("fsdp=4 does not divide a pipeline microbatch's 2 row(s)" in w
               and "e.g. num_pipeline_microbatches=8," in w for w in request.warnings)
    suggested = resolve("v5p-16", "llama2-7b", ["per_device_batch_size=4", "ici_stage=2",
                                                "num_pipeline_microbatches=8"])
    assert not any("pipeline microbatch" in w for w in suggested.warnings)


def test_fsdp_gathers_once_per_step_with_pipeline_fsdp_ag_once():
    """Each iteration gathers its layer forward and again backward (2 x 65 gathers), or the stage's 16 layers are
    gathered once for the step (and the vocabulary table twice in both), held with their gradients."""
    per_iteration = _estimate("ici_stage=2", "num_pipeline_microbatches=4")
    once = _estimate("ici_stage=2", "num_pipeline_microbatches=4", "pipeline_fsdp_ag_once=true")
    gathers = _row(per_iteration, "fsdp all-gather (ici)").bytes
    assert gathers / 8.2 < _row(once, "fsdp all-gather (ici)").bytes < gathers / 7
    assert once.memory_per_device_bytes > per_iteration.memory_per_device_bytes + 6 * 2**30  # the stage's 16 layers


def test_a_stage_holds_its_layers_and_its_microbatches_activations():
    from maxperf.perfmodel import estimate_memory
    from maxperf.spec import resolve

    def memory(*words):
        r = resolve("v5p-16", "llama2-7b", ["per_device_batch_size=4", "remat_policy=full", *words])
        return estimate_memory(r.model, r.train, r.mesh, 95 * 2**30, "tpu")

    flat, piped = memory("ici_fsdp=4", "ici_data=2"), memory("ici_stage=2", "ici_fsdp=4")
    # data=2 replicates every weight; stage=2 halves the layers' (not the embeddings')
    assert piped.params < 0.6 * flat.params
    # the same layer calls x tokens (33 iterations of a half-batch against 32 layers of the batch), plus the loop's
    # buffers: each microbatch's outputs in the circular storage and state_io's share, with their gradients
    carry = 32 * 4 * 2048 * 4096 * 2
    assert piped.activations == pytest.approx(flat.activations * 33 / 32 + 2 * (1 + 0.5 + 0.5) * carry / 32,
                                              rel=1e-9)


def test_megatrons_1f1b_holds_the_microbatches_in_flight_where_maxtexts_schedule_holds_them_all():
    """pipeline_schedule=1f1b: the first stage holds S microbatches' activations (R = 1), or interleaved over R repeats
    2 (S - 1) + (R - 1) S + 1 chunks (Megatron-LM's warm-up and one more); MaxText's schedule every iteration's. The
    loop's buffers and the step time stay as they are; the compiled step's manifest says it runs MaxText's."""
    from maxperf.aot.compiler import step_limitations
    from maxperf.perfmodel import estimate, estimate_memory
    from maxperf.perfmodel.memory import pipeline_buffers
    from maxperf.perfmodel.pipeline import view
    from maxperf.spec import resolve

    assert schedule(8, 80, 64, microbatches=64, repeats=5, units_per_stage=2, one_f_one_b=True).held_iterations == 47
    assert schedule(4, 32, 16, microbatches=16, units_per_stage=8, one_f_one_b=True).held_iterations == 4
    assert schedule(4, 32, 16, microbatches=16, units_per_stage=8).held_iterations == 16 + 3  # the bubble's too
    assert schedule(4, 32, 2 * 4, microbatches=4, repeats=8, one_f_one_b=True).held_iterations == 32  # all of them

    words = ["per_device_batch_size=4", "remat_policy=full", "ici_stage=2", "ici_fsdp=4", "num_pipeline_microbatches=8"]
    gpipe, one = (resolve("v5p-16", "llama2-7b", [*words, f"pipeline_schedule={s}"]) for s in ("gpipe", "1f1b"))
    g, o = (estimate_memory(r.model, r.train, r.mesh, 95 * 2**30, "tpu") for r in (gpipe, one))
    s = view(one.model, one.train, one.mesh)
    assert (s.schedule.held_iterations, s.schedule.iterations) == (2 * 1 + 15 * 2 + 1, 8 * 16 + 1)  # S = 2, R = 16
    buffers = pipeline_buffers(s, 4 * 2048 * 2, 4096, 2)  # B x L over stage=2's halved batch split
    assert o.activations - buffers == pytest.approx((g.activations - buffers) * 33 / 129, rel=1e-9)
    assert o.params == g.params and o.optimizer == g.optimizer
    assert estimate(one).step_time_s == pytest.approx(estimate(gpipe).step_time_s, rel=1e-12)
    assert any("holds the activations of 33 of its 129 loop iterations" in w for w in one.warnings)
    assert not any("1f1b" in w for w in gpipe.warnings)
    assert any("MaxText's" in line for line in step_limitations(one, "train"))
    assert step_limitations(gpipe, "train") == []
    flat = resolve("v5p-16", "llama2-7b", ["pipeline_schedule=1f1b"])
    assert any("one stage, and it changes nothing" in w for w in flat.warnings)
    keys = resolve("v5p-16", "llama2-7b", ["num_pipeline_microbatches=8", "pipeline_fsdp_ag_once=true"])
    assert ("num_pipeline_microbatches, pipeline_fsdp_ag_once shape a pipeline's loop; this mesh has one stage, and "
            "they change nothing") in keys.warnings
    with pytest.raises(MaxperfError, match="pipeline_schedule=1f1b .* has no such delay"):
        resolve("v5p-16", "llama2-7b", [*words, "pipeline_schedule=1f1b", "pipeline_delay_activation_forwarding=true"])


def test_estimate_memory_sets_a_1f1b_compile_beside_maxtexts_schedule_analytical(tmp_path):
    """The compiled pipeline runs MaxText's schedule whatever pipeline_schedule says: estimate-memory compares the
    compiler's figure with that schedule's analytical one, not 1F1B's smaller one."""
    from maxperf.search import memory_fit

    words = ["ici_stage=2", "num_layers=4", "per_device_batch_size=2", "num_pipeline_microbatches=8", "seq_len=128"]
    one = memory_fit.compare("cpu-4", "tiny", [*words, "pipeline_schedule=1f1b"])
    gpipe = memory_fit.compare("cpu-4", "tiny", words, analytical_only=True)
    held = memory_fit.compare("cpu-4", "tiny", [*words, "pipeline_schedule=1f1b"], analytical_only=True)
    assert one.compiler is not None
    assert one.analytical.per_device_total_bytes == gpipe.analytical.per_device_total_bytes
    assert held.analytical.activations < gpipe.analytical.activations


def test_an_empty_place_is_computed_and_stores_a_layers_weights():
    """The embedding's and loss's places of 30 layers over 2 stages x 4 repeats x 4: 32 places, whose iterations each
    compute a stage's 4 places (the empty ones pass their input on), and whose weights the stages store alike."""
    from maxperf.perfmodel import estimate_memory
    from maxperf.spec import resolve

    words = ("ici_stage=2", "num_pipeline_microbatches=4", "num_layers_per_pipeline_stage=4", "num_layers=30")
    places = ("account_for_embedding_in_pipeline_split=true", "account_for_loss_in_pipeline_split=true")
    even, uneven = _estimate(*words, "num_layers=32"), _estimate(*words, *places)
    # the same iterations, places and work per device as 32 layers
    assert _row(uneven, "mlp down").flops == pytest.approx(_row(even, "mlp down").flops, rel=1e-12)
    assert any("2 of 32 places empty" in a for a in uneven.assumptions)

    def memory(*more):
        r = resolve("v5p-16", "llama2-7b", ["per_device_batch_size=4", "remat_policy=full", *words, *more])
        return estimate_memory(r.model, r.train, r.mesh, 95 * 2**30, "tpu")

    assert memory(*places).params == pytest.approx(memory("num_layers=32").params, rel=1e-12)


def test_the_places_of_a_pipeline_split_without_a_pipeline_change_nothing():
    from maxperf.spec import resolve

    r = resolve("v5p-16", "llama2-7b", ["account_for_embedding_in_pipeline_split=true"])
    assert not r.train.account_for_embedding_in_pipeline_split
    assert any("the mesh has one stage, so they change nothing" in w for w in r.warnings)


# MaxText's remat of a pipelined decoder (layers/pipeline.py get_pipeline_remat_policy): each iteration of the loop
# under the policy, its layers not one by one; remat_policy=none recomputes the iteration as full does, and with
# set_remat_policy_on_pipeline_iterations=false nothing in the pipeline is rematerialized


@pytest.mark.parametrize("words, policy, noted", [
    (("ici_stage=2", "remat_policy=none"), "full", True),
    (("ici_stage=2", "remat_policy=minimal"), "minimal", False),
    (("ici_stage=2", "remat_policy=minimal", "set_remat_policy_on_pipeline_iterations=false"), "none", True),
    (("remat_policy=none",), "none", False),  # no pipeline: the policy as asked
])
def test_a_pipelined_decoder_runs_maxtexts_remat(words, policy, noted):
    from maxperf.spec import resolve

    r = resolve("v5p-16", "llama2-7b", ["per_device_batch_size=4", *words])
    assert str(r.train.remat_policy) == policy
    note = [w for w in r.warnings if "under a pipeline runs as" in w]
    assert bool(note) == noted
    if noted:
        assert f"runs as remat_policy={policy}, as in MaxText" in note[0]


def _checkpoints(jaxpr) -> list[int]:
    """The nesting depth of each rematerialized region (jax.checkpoint) in `jaxpr`, its sub-jaxprs included."""
    out = []

    def walk(j, depth):
        for eqn in j.eqns:
            inner = depth + (eqn.primitive.name in ("checkpoint", "remat", "remat2"))
            if inner > depth:
                out.append(inner)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr's
                    if hasattr(sub, "eqns"):
                        walk(sub, inner)

    walk(jaxpr.jaxpr, 0)
    return out


def _tiny_pipelined_jaxpr(words, grad: bool = False):
    """The jaxpr of the tiny model's forward (or its gradient) pipelined over 2 stages of 4 CPU devices."""
    from flax import nnx

    from maxperf.models import train_step
    from maxperf.spec import overrides, presets
    from maxperf.spec import topology as topologies
    from maxperf.spec.mesh import resolve as resolve_mesh

    cfg = overrides.apply(presets.get("tiny"), ["num_layers=4", "seq_len=16", "per_device_batch_size=2",
                                                "ici_stage=2", "ici_fsdp=2", *words])
    mesh = cpu_mesh(resolve_mesh(cfg.parallelism, topologies.get("cpu-4")))
    md = train_step.model_def(cfg.model, cfg.train)
    params = nnx.to_pure_dict(nnx.state(train_step.build_model(cfg.model, cfg.train, nnx.Rngs(params=0))))
    tokens = jnp.zeros((8, 16), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), (8, 16))

    def forward(p):
        return nnx.merge(md.graphdef, p)(tokens, positions)

    with jax.set_mesh(mesh):
        return jax.make_jaxpr(jax.grad(lambda p: jnp.sum(forward(p))) if grad else forward)(params)


@pytest.mark.parametrize("words, depths", [
    (("remat_policy=full",), [1]),  # the iteration only: no layer rematerialized inside it
    (("remat_policy=none",), [1]),
    (("remat_policy=full", "set_remat_policy_on_pipeline_iterations=false"), []),
])
def test_the_pipeline_rematerializes_its_iterations_not_its_layers(words, depths):
    assert _checkpoints(_tiny_pipelined_jaxpr(words)) == depths


def test_a_pipeline_differentiates_under_an_offloading_policy():
    """The iteration's policy keeps its input and each layer's input besides the policy's own choices, which for an
    offloading policy say where to (jax's save_from_both_policies takes only save-or-not policies and raised here)."""
    assert 1 in _checkpoints(_tiny_pipelined_jaxpr(("remat_policy=minimal_offloaded",), grad=True))


def test_the_microbatch_suggestion_keeps_to_the_delayed_forwarding_floor():
    """With pipeline_delay_activation_forwarding MaxText needs at least 2 x stages microbatches: the warning about
    replicated microbatch rows does not suggest fewer (it suggested 2 for 2 stages, which is then refused)."""
    from maxperf.spec.request import resolve

    words = ["per_device_batch_size=1", "max_target_length=4096", "dcn_pipeline_parallelism=2",
             "pipeline_delay_activation_forwarding=true"]
    (line,) = [w for w in resolve("v5p-64", "llama2-70b", words, num_slices=2).warnings if "pipeline microbatch" in w]
    assert "num_pipeline_microbatches=2" not in line and line.endswith("a larger per_device_batch_size")


@pytest.mark.slow
def test_a_checkpoint_keeps_the_models_layer_order_whatever_the_pipelines_layout(tmp_path):
    """A pipelined stack stores its layers stage-major (4 layers over 2 stages x 2 repeats: 0, 2, 1, 3): the same
    shapes as the unpipelined stack's. One seed initializes the same model in both layouts, and a checkpoint, kept
    in the model's order, restores into either with the losses the other gives; before, a checkpoint restored into
    the other layout silently swapped layers 1 and 2."""
    from cli_util import maxperf

    words = ["--topology", "cpu-4", "--model", "tiny", "num_layers=4", "per_device_batch_size=2", "seq_len=64"]
    for name, extra in (("plain", []), ("piped", ["ici_pipeline_parallelism=2"])):
        proc = maxperf("compile", *words, *extra, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-2000:]

    def losses(artifact, out, *more):
        proc = maxperf("run", str(tmp_path / artifact), "--steps", "2", "--warmup", "0", "--out", str(tmp_path / out),
                       "--json", *more)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)["losses"]

    fresh = {name: losses(name, f"fresh-{name}", "--checkpoint", str(tmp_path / f"ck-{name}"))
             for name in ("plain", "piped")}
    np.testing.assert_allclose(fresh["piped"], fresh["plain"], rtol=1e-5)
    # each checkpoint (the state after the same two steps, in bfloat16 summed in each layout's order) continued in
    # each layout: the same losses, to 2e-4 (two layers swapped moved the loss 8e-4)
    resumed = {(a, c): losses(a, f"{a}-from-{c}", "--restore", str(tmp_path / f"ck-{c}"))
               for a in ("plain", "piped") for c in ("plain", "piped")}
    for got in resumed.values():
        np.testing.assert_allclose(got, resumed["plain", "plain"], rtol=2e-4)


def _permuted_per_iteration(out, *words: str) -> float:
    """Bytes a compiled pipelined step's collective-permutes move inside its loops (instructions run more than once a
    step), per step, on cpu-8; the artifact written to `out`."""
    from maxperf import aot
    from maxperf.aot import hlo_time
    from maxperf.perfmodel.estimate import device_for

    result = aot.compile("cpu-8", "tiny", ["num_layers=8", "per_device_batch_size=2", "ici_tensor=2", "ici_data=2",
                                          "ici_stage=2", "num_pipeline_microbatches=4",
                                          "num_layers_per_pipeline_stage=2", "num_pipeline_repeats=2",
                                          "remat_policy=full", *words], out=out)
    text = (out / "hlo" / "optimized.hlo.txt").read_text()
    read = hlo_time.hlo_time(text, device_for(result.plan.topology), result.plan.topology, result.plan.mesh,
                             top=1 << 20)
    return sum(op.bytes * op.executions for op in read.top
               if op.kind == "collective" and "permute" in op.name and op.executions > 1)


@pytest.mark.slow
def test_zero1_moves_no_weights_inside_the_pipelines_loop(tmp_path):
    """ZeRO-1 (shard_optimizer_over_data) gathers a pipelined stack's parameters over `data` once before the loop and
    reduces their gradients once after it: the loop's collective-permutes move the stages' activations alone, as
    without ZeRO-1 (unpinned, the loop kept its gradient accumulator split over `data` and moved each iteration's
    weight gradients to it)."""
    plain = _permuted_per_iteration(tmp_path / "plain")
    zero1 = _permuted_per_iteration(tmp_path / "zero1", "shard_optimizer_over_data=true")
    assert plain > 0 and zero1 == pytest.approx(plain, rel=0.01)
