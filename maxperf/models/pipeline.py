"""Pipeline parallelism as MaxText runs it (layers/pipeline.py): one SPMD program in which the `stage` mesh axis holds
consecutive layers, microbatches flow through the stages one loop iteration at a time, and circular repeats
(virtual stages) send each microbatch round the stages `repeats` times.

Each iteration runs every stage at once, vmapped over the stage axis (so each device computes only its stage), on
the array `stages_in` [S, b, L, D]: stage 0 takes a fresh microbatch while any is left, else the last stage's output
of the previous repeat; stage s > 0 takes what stage s - 1 gave the iteration before. After the stage computation the
outputs move one stage on (a collective permute over `stage`), and the last stage's output is written to `state_io`
[S, M / S, b, L, D], which holds the inputs at first and the outputs at the end. With more microbatches than stages a
circular pipeline parks the last stage's outputs in `circ_storage` [S, M, b, L, D] until stage 0 takes them for the
next repeat. The loop runs M x R + delay x (S - 1) iterations, the last delay x (S - 1) of them the bubble; with
`pipeline_delay_activation_forwarding` the outputs move on one iteration later (delay 2), which leaves each
iteration's communication independent of its compute. The backward is the scan's, autodiffed: each iteration keeps
its input (checkpoint name "iteration_input") and whatever the layers' remat policy saves.

Weights of a pipelined stack are stored stage-major: stage s holds its repeats' layers contiguously, so the stored
layer axis sharded over `stage` gives each stage its own layers (`stage_major`, `natural_order`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from maxperf.models.sharding import constrain, partition_spec
from maxperf.spec.pipeline import Schedule

STAGES_IN = ("activation_stage", "activation_batch", "activation_length", "activation_embed")
STATE_IO = ("activation_stage", None, "activation_batch", "activation_length", "activation_embed")


def stage_major(n_units: int, schedule: Schedule) -> np.ndarray:
    """For each stored position of a pipelined stack of `n_units` units, the unit (in the model's order) stored there:
    stage s, repeat r, unit l of the stage is unit (r x S + s) x U + l, stored at (s x R + r) x U + l."""
    S, R = schedule.stages, schedule.repeats
    U = n_units // (S * R)
    order = np.arange(n_units).reshape(R, S, U).transpose(1, 0, 2)
    return order.reshape(-1)


def natural_order(n_units: int, schedule: Schedule) -> np.ndarray:
    """The inverse of `stage_major`: for each unit in the model's order, where it is stored."""
    return np.argsort(stage_major(n_units, schedule))


def _specs(shape, logical):
    mesh = jax.sharding.get_abstract_mesh()
    return partition_spec(shape, logical, dict(mesh.shape))


def _permute(x: jax.Array, logical, shift: int, *, zero_first: bool = False) -> jax.Array:
    """x [S, ...] moved `shift` stages along the stage axis (+1: stage s's to s + 1, the last's to stage 0), as a
    collective permute over `stage`; `zero_first`: stage 0 receives zeros instead (a non-circular shift)."""
    spec = _specs(x.shape, logical)

    def local(x_local):
        n = jax.lax.axis_size("stage")
        out = jax.lax.ppermute(x_local, "stage", [(i, (i + shift) % n) for i in range(n)])
        if zero_first:
            out = jnp.where(jax.lax.axis_index("stage") == 0, jnp.zeros_like(out), out)
        return out

    return jax.shard_map(local, in_specs=spec, out_specs=spec, check_vma=False)(x)


def _shift_in_last(column: jax.Array, output: jax.Array) -> jax.Array:
    """column [S, ...] moved one stage back (stage s takes stage s + 1's), the last stage taking its own `output`."""
    spec = _specs(column.shape, STAGES_IN)

    def local(column_local, output_local):
        n = jax.lax.axis_size("stage")
        moved = jax.lax.ppermute(column_local, "stage", [(i, (i - 1) % n) for i in range(n)])
        return jnp.where(jax.lax.axis_index("stage") == n - 1, output_local, moved)

    return jax.shard_map(local, in_specs=(spec, spec), out_specs=spec, check_vma=False)(column, output)


def _keeping_inputs(policy):
    """`policy`, saving besides on the device the iteration's input and each layer's input (MaxText's
    save_from_both_policies with save_only_these_names; written out, as jax's helper takes only policies that answer
    save or not, where an offloading policy answers where to)."""
    saved = jax.checkpoint_policies.save_only_these_names("iteration_input", "decoder_layer_input")

    def either(prim, *args, **params):
        return True if saved(prim, *args, **params) else policy(prim, *args, **params)

    return either


def run(unit: Callable, per_unit, x_BxLxD: jax.Array, positions_BxL: jax.Array, schedule: Schedule, *,
        policy=None, keep_inputs: bool = True, counts_like: dict | None = None
        ) -> tuple[jax.Array, jax.Array, dict]:
    """The pipelined stack's output [B, L, D], its summed auxiliary loss (each unit's, averaged over microbatches),
    and each unit's expert loads [N units, ...] in the model's order, summed over microbatches.

    `unit(x_bxLxD, positions_bxL, one_unit) -> (x, aux, counts)`: one unit of the stack on a microbatch.
    `per_unit`: a pytree whose leaves are [S, R, U, ...] (stage, repeat, unit of the stage; `stage_major` order).
    `policy`: the remat policy of each iteration (None: no remat), which saves the iteration's input and each
    layer's input besides with `keep_inputs` (MaxText's get_pipeline_remat_policy; not under its custom policy).
    `counts_like`: the shapes and dtypes of one unit's expert loads ({} for a dense stack).
    Places that hold no unit (Schedule.empty_first, empty_last) pass their input on, adding no loss and no loads;
    the loads come back for every place, empty ones as zeros."""
    S, M, R, delay = schedule.stages, schedule.microbatches, schedule.repeats, schedule.delay
    B, L, D = x_BxLxD.shape
    b, per_stage = B // M, M // S
    U = jax.tree.leaves(per_unit)[0].shape[2]
    dtype = x_BxLxD.dtype
    counts_like = counts_like or {}

    inputs = x_BxLxD.reshape(M, b, L, D)
    positions_MxbxL = positions_BxL.reshape(M, b, L)
    state_io = constrain(inputs.reshape(S, per_stage, b, L, D), STATE_IO)
    shift = constrain(jnp.zeros((S, b, L, D), dtype), STAGES_IN)
    circular = schedule.circular_storage
    circ = constrain(jnp.zeros((S, M, b, L, D), dtype), STATE_IO) if circular else None
    mover = shift if circular else None
    prev = shift if delay == 2 else None
    counts0 = {k: jnp.zeros((S, R, U, *v.shape), v.dtype) for k, v in counts_like.items()}
    stage_ids = jnp.arange(S)
    uneven = schedule.places != schedule.units
    live_SxRxU = jnp.asarray(schedule.live()[stage_major(schedule.places, schedule)].reshape(S, R, U))

    def stage(one_stage, live_U, x_bxLxD, positions_bxL):
        aux = jnp.zeros((), jnp.float32)
        counts = []
        for u in range(U):
            y, a, c = unit(x_bxLxD, positions_bxL, jax.tree.map(lambda w, u=u: w[u], one_stage))
            if uneven:  # an empty place passes its input on
                x_bxLxD = jnp.where(live_U[u], y, x_bxLxD)
                a, c = jnp.where(live_U[u], a, 0.0), {k: jnp.where(live_U[u], v, 0) for k, v in c.items()}
            else:
                x_bxLxD = y
            aux, counts = aux + a, counts + [c]
        stacked = {k: jnp.stack([c[k] for c in counts]) for k in counts_like}
        return x_bxLxD, aux, stacked

    stages = jax.vmap(stage, in_axes=(0, 0, 0, 0), spmd_axis_name="stage")

    def iteration(carry, t):
        state_io, shift, circ, mover, prev, aux, counts = carry
        processed = jnp.maximum(t - delay * stage_ids, 0)
        microbatch, repeat = processed % M, processed // M
        valid = (t - delay * stage_ids >= 0) & (t - delay * stage_ids < M * R)
        fresh = state_io[:, t % per_stage]
        looped = circ[:, t % M] if circular else shift
        first = jnp.where(t < M, fresh, looped)
        stages_in = jnp.where((stage_ids == 0)[:, None, None, None], first, shift)
        stages_in = checkpoint_name(constrain(stages_in, STAGES_IN), "iteration_input")
        weights = jax.vmap(lambda w_stage, r: jax.tree.map(lambda w: w[r], w_stage), spmd_axis_name="stage")(
            per_unit, repeat)
        out, a_S, c_S = stages(weights, live_SxRxU[stage_ids, repeat], stages_in, positions_MxbxL[microbatch])
        out = constrain(out, STAGES_IN)
        aux = aux + jnp.sum(jnp.where(valid, a_S, 0.0))
        for k in counts:
            add = jnp.where(valid.reshape((S,) + (1,) * (c_S[k].ndim - 1)), c_S[k], 0)
            counts[k] = counts[k].at[stage_ids, repeat].add(add.astype(counts[k].dtype))
        sent = prev if delay == 2 else out
        if R == 1 or circular:
            new_shift = _permute(sent, STAGES_IN, 1, zero_first=True)
        else:
            new_shift = _permute(sent, STAGES_IN, 1)
        if circular:
            at = (t - delay * (S - 1) - 1) % M
            moved = _permute(mover, STAGES_IN, 1)
            circ = jax.lax.dynamic_update_slice_in_dim(circ, moved[:, None], at, axis=1)
            circ = constrain(circ, STATE_IO)
            mover = out
        column = _shift_in_last(state_io[:, t % per_stage], out)
        state_io = jax.lax.dynamic_update_slice_in_dim(state_io, column[:, None], t % per_stage, axis=1)
        state_io = constrain(state_io, STATE_IO)
        return (state_io, new_shift, circ, mover, out if delay == 2 else None, aux, counts), None

    if policy is not None:
        if keep_inputs:
            policy = _keeping_inputs(policy)
        iteration = jax.checkpoint(iteration, policy=policy, prevent_cse=False)
    carry = (state_io, shift, circ, mover, prev, jnp.zeros((), jnp.float32), counts0)
    (state_io, *_, aux, counts), _ = jax.lax.scan(iteration, carry, jnp.arange(schedule.iterations))
    first_out = (M * (R - 1) + delay * (S - 1)) % per_stage  # where microbatch 0 ended up
    outputs = jnp.roll(state_io, -first_out, axis=1).reshape(B, L, D)
    back = natural_order(S * R * U, schedule)
    counts = {k: v.reshape(S * R * U, *v.shape[3:])[back] for k, v in counts.items()}
    return outputs, aux / M, counts


__all__ = ["STAGES_IN", "STATE_IO", "natural_order", "run", "stage_major"]
