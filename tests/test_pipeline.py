"""Pipeline parallelism: the schedule's rules (MaxText's configs/types.py checks) and the SPMD pipeline's loop
(models/pipeline.py) against the same units applied one after another."""

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


@pytest.mark.parametrize("kwargs, message", [
    ({"stages": 3}, "3 pipeline stages x num_layers_per_pipeline_stage=1 do not divide the 32 pipelined layers"),
    ({"units_per_stage": 3}, "num_layers_per_pipeline_stage can be 1, 2, 4, 8"),
    ({"repeats": 3}, r"stages \(4\) x num_pipeline_repeats \(3\) x num_layers_per_pipeline_stage \(1\) must equal"),
    ({"microbatches": 6}, "num_pipeline_microbatches=6 must be a positive multiple of the 4 pipeline stages"),
    ({"microbatches": 4, "delay": True}, "needs at least 2 x 4 = 8 microbatches"),
    ({"microbatches": 128}, "the batch of 64 examples does not split into num_pipeline_microbatches=128"),
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
