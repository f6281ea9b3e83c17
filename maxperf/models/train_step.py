"""The train step, its abstract shapes and shardings over a mesh, and concrete initialization for running.

The state is a plain pytree: {"step", "params" (nested dicts of arrays), "opt_state" (optax's)}, and under a delayed
FP8 recipe "fp8": each stack's scales and amax histories (fp8_state), which the step replaces by their gradient, the
recipe's update, instead of updating them with the optimizer. The batch follows MaxText's convention: the global
batch is B x (all devices), so each device sees B x L tokens per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxperf.models import context
from maxperf.models.layers import attention_kernels, fp8, quantization
from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.decoder import OUTER_RESIDUAL
from maxperf.models.layers.moe import MoEOptions, bias_update
from maxperf.models.sharding import constrain, partition_spec
from maxperf.models.transformer import PipelineOptions, Transformer, stack_axis, stacks
from maxperf.spec import pipeline as pipeline_spec
from maxperf.spec.fp8 import recipe as fp8_recipe
from maxperf.spec.logical_axes import over_data
from maxperf.spec.model import ModelConfig
from maxperf.spec.remat import remat_names
from maxperf.spec.train import AttentionKernel, TrainConfig

# the step's input batch: over the pipeline's stages too (MaxText's input_data_sharding_logical_axes)
BATCH_AXES = ("activation_embed_and_logits_batch", "activation_length")
EPS = 1e-8  # MaxText's EPS (utils/globals.py) under a loss's token count


def build_model(model: ModelConfig, train: TrainConfig, rngs: nnx.Rngs) -> Transformer:
    return Transformer(
        model, param_dtype=jnp.dtype(train.param_dtype), compute_dtype=jnp.dtype(train.compute_dtype),
        scan_layers=train.scan_layers, param_scan_axis=train.param_scan_axis, remat=remat_names(train), rngs=rngs,
        attention=AttentionOptions.from_train(train), moe=MoEOptions.from_train(train),
        quantization=quantization.from_train(train), pipeline=PipelineOptions.from_train(train),
        logits_in_fp32=train.logits_dot_in_fp32,
    )


def _nested(pairs) -> dict:
    out: dict = {}
    for path, value in pairs:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


@dataclass(frozen=True)
class ModelDef:
    """The model's structure without values: its graph, parameter shapes and logical axes."""

    graphdef: Any
    params: dict  # ShapeDtypeStructs, nested like the parameters
    logical_axes: dict  # tuples of logical names, nested like the parameters

    @property
    def param_count(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.params))


def model_def(model: ModelConfig, train: TrainConfig) -> ModelDef:
    """Builds the model abstractly (jax.eval_shape through nnx): nothing is allocated."""
    abstract = nnx.eval_shape(lambda: build_model(model, train, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes, logical = [], []
    # a decoder of one stack may be pipelined: its layer axis is stored stage-major and split over `stage`
    # (models/pipeline.py), a no-op on a mesh of one stage
    pipelinable = len(stacks(model)) == 1
    for path, var in nnx.to_flat_state(state):
        axes = tuple(var.get_metadata()["logical_axes"])
        value = var.get_value() if hasattr(var, "get_value") else var.value
        if len(value.shape) == len(axes) + 1:  # a scanned stack carries a layer axis (transformer.stack_axis)
            at = stack_axis(len(axes), train.param_scan_axis)
            layers = "stage_layers" if pipelinable and path[0] == stacks(model)[0].name else "layers"
            axes = (*axes[:at], layers, *axes[at:])
        shapes.append((path, jax.ShapeDtypeStruct(value.shape, value.dtype)))
        logical.append((path, axes))
    return ModelDef(graphdef, _nested(shapes), _nested(logical))


def param_count(model: ModelConfig) -> int:
    """Total parameters, counted from the abstract parameter shapes."""
    return model_def(model, TrainConfig()).param_count


def make_optimizer(train: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (Loshchilov & Hutter 2019) with linear warm-up and cosine decay, after global-norm clipping; MaxText's
    opt_type adam_pax (the same two states per parameter and the same update's cost) compiles as AdamW too."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train.learning_rate, warmup_steps=train.warmup_steps,
        decay_steps=train.warmup_steps + train.decay_steps, end_value=train.learning_rate * train.min_lr_ratio,
    )

    # every parameter decays, norm scales and biases too: MaxText's adamw_mask is empty by default
    # mu_dtype: the first moment's dtype (MaxText's key), the parameters' where unset
    adamw = optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps,
                        weight_decay=train.weight_decay, mu_dtype=jnp.dtype(train.mu_dtype) if train.mu_dtype else None)
    if train.grad_clip_norm is None:
        return adamw, schedule
    return optax.chain(optax.clip_by_global_norm(train.grad_clip_norm), adamw), schedule


def fp8_sites(model: ModelConfig, train: TrainConfig) -> dict[str, int]:
    """The quantized matmuls one unit of each stack (and each multi-token-prediction module, "mtp/k") calls: counted
    by tracing the forward abstractly (the attention kernel does not change them)."""
    md = model_def(model, dataclasses.replace(train, attention=AttentionKernel.DOT_PRODUCT))
    L = train.seq_len

    def forward(params):
        net = nnx.merge(md.graphdef, params)
        tokens = jnp.zeros((1, L), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), tokens.shape)
        out = net.forward(tokens, positions)
        if model.mtp_num_layers:
            net.predict_ahead(out.pre_norm, tokens, tokens, jnp.ones((1, L)), positions,
                              lambda x, t, m: jnp.zeros((), jnp.float32))
        return out.hidden

    with quantization.count_sites() as sites:
        jax.eval_shape(forward, md.params)
    return sites


def fp8_state(model: ModelConfig, train: TrainConfig) -> dict[str, jax.Array] | None:
    """A delayed FP8 recipe's initial scales (1) and amax histories (empty), per stack [repeats, matmuls, 3,
    1 + history] and per multi-token-prediction module [1, ...]; None for any other quantization."""
    recipe = fp8_recipe(str(train.quantization))
    if recipe is None or not recipe.state_scales:
        return None
    sites = fp8_sites(model, train)
    repeats = {st.name: st.count for st in stacks(model)}
    if len(repeats) == 1:  # a pipelined stack's empty places carry state too (transformer.PipelineOptions)
        repeats = {name: n + sum(pipeline_spec.empty_places(train)) for name, n in repeats.items()}
    return {tag: fp8.initial_meta(recipe, n, (repeats.get(tag, 1),)) for tag, n in sites.items()}


def init_fn(model: ModelConfig, train: TrainConfig) -> Callable[[jax.Array], dict]:
    """key -> the initial train state."""
    optimizer, _ = make_optimizer(train)
    sites = fp8_state(model, train)

    def init(key: jax.Array) -> dict:
        params = nnx.to_pure_dict(nnx.state(build_model(model, train, nnx.Rngs(params=key))))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}
        if sites is not None:
            state["fp8"] = jax.tree.map(jnp.array, sites)
        return state

    return init


def make_train_step(model: ModelConfig, train: TrainConfig) -> Callable[[dict, dict], tuple[dict, dict]]:
    """(state, batch) -> (state, metrics): loss in float32, gradient norm before clipping, tokens counted."""
    md = model_def(model, train)
    graphdef = md.graphdef
    optimizer, schedule = make_optimizer(train)
    A = train.grad_accum_steps

    def loss_sum(params, meta, batch, key):
        """The masked cross-entropy summed over tokens, plus the auxiliary losses scaled by the token count so that
        dividing by the tokens gives MaxText's loss + weight x moe_lb_loss + mtp_loss: for a mixture of experts the
        load-balancing loss (its weight times the mean over MoE layers, those of the MTP modules too), with
        multi-token prediction its loss (MaxText's calculate_mtp_loss: the depths' cross-entropy sums over their
        tokens, times mtp_loss_scaling_factor). With the token count, the unweighted load-balancing loss, the MTP
        loss and the expert loads of the layers that record them."""
        net = nnx.merge(graphdef, params)
        positions_BxL = jnp.broadcast_to(jnp.arange(batch["inputs"].shape[1], dtype=jnp.int32),
                                         batch["inputs"].shape)
        cp = context.shards(train.seq_len)[1]
        if train.context_parallel_load_balance and cp > 1:
            # every sequence in the balanced order (MaxText reorders its input so), its positions with it: the
            # attention kernels mask by each token's original place
            batch = {k: context.reorder(v, cp) for k, v in batch.items()}
            positions_BxL = context.reorder(positions_BxL, cp)
        inputs_BxL = batch["inputs"]
        mask_BxL = batch["mask"].astype(jnp.float32)
        tokens = jnp.sum(mask_BxL)

        def nll_sum(x_BxLxD, targets_BxL, m_BxL):
            if train.num_vocab_tiling > 1:
                return tiled_nll_sum(net, x_BxLxD, targets_BxL, m_BxL, train.num_vocab_tiling)
            return jnp.sum(cross_entropy(net.logits(x_BxLxD), targets_BxL) * m_BxL)

        out = net.forward(inputs_BxL, positions_BxL, key, meta)
        total, lb_loss, counts = nll_sum(out.hidden, batch["targets"], mask_BxL), out.lb_loss, out.counts
        mtp_loss = jnp.zeros((), jnp.float32)
        if model.mtp_num_layers:
            ahead = net.predict_ahead(out.pre_norm, inputs_BxL, batch["targets"], mask_BxL, positions_BxL, nll_sum,
                                      key, meta)
            mtp_loss = train.mtp_loss_scaling_factor * jnp.sum(ahead.nll_K) / (jnp.sum(ahead.weights_K) + EPS)
            total = total + mtp_loss * tokens
            counts = {**counts, **ahead.counts}
            n_moe, n_mtp = sum(model.moe_layers()), model.mtp_num_layers * model.moe_layers()[-1]
            if n_mtp:
                lb_loss = (lb_loss * n_moe + ahead.lb_sum) / (n_moe + n_mtp)
        if model.is_moe and train.load_balance_loss_weight > 0:
            total = total + train.load_balance_loss_weight * lb_loss * tokens
        return total, (tokens, lb_loss, mtp_loss, counts)

    # the gradients of the parameters and of a delayed FP8 recipe's state (its update: layers/fp8.py)
    grad_fn = jax.value_and_grad(loss_sum, argnums=(0, 1), has_aux=True)

    def loss_mean(params, meta, batch, key):
        """MaxText's objective without gradient accumulation: the summed loss over the tokens (+ EPS), so that the
        backward pass yields the gradient normalized (1/tokens enters with the logits' gradient), not a sum that is
        divided afterwards; with accumulation, as MaxText's, the microbatches' sums and then one division."""
        total, aux = loss_sum(params, meta, batch, key)
        return total / (aux[0] + EPS), (total, aux)

    mean_grad_fn = jax.value_and_grad(loss_mean, argnums=(0, 1), has_aux=True)

    def step(state: dict, batch: dict) -> tuple[dict, dict]:
        params, opt_state = state["params"], state["opt_state"]
        zero1 = zero1_sizes(train)

        def split(tree, over_data_too: bool = False):
            """ZeRO-1: `tree`, shaped like the parameters, constrained to the model's own split, or to the state's
            (over `data` too); `tree` as it is without ZeRO-1."""
            if zero1 is None:
                return tree

            def one(x, axes):
                spec = partition_spec(x.shape, axes, zero1)
                return jax.lax.with_sharding_constraint(
                    x, PartitionSpec(*over_data(x.shape, spec, zero1)) if over_data_too else spec)

            return jax.tree.map(one, tree, md.logical_axes)

        # state offloaded to pinned host memory (MaxText's *_memory_host_offload) comes to the device where the step
        # needs it, the parameters for the forward, the optimizer state for the update (as in MaxText's train_step);
        # the out shardings send the updated state back
        if train.parameter_memory_host_offload:
            params = jax.device_put(params, jax.memory.Space.Device)
        # ZeRO-1: the state's parameters are split over `data` too; the forward and backward take them gathered back
        # to the model's own split, in bfloat16 under accumulation, once before its loop (MaxText's
        # gradient_accumulation_loss_and_grad)
        cast = zero1 is not None and A > 1
        grad_params = split(jax.tree.map(lambda p: p.astype(jnp.bfloat16) if cast and p.dtype == jnp.float32 else p,
                                         params))
        key = quantization.step_key(train, state["step"])  # int8's stochastic rounding; None without it
        meta = state.get("fp8")  # a delayed FP8 recipe's scales and histories; None without one
        if A == 1:
            (_, (total, (tokens, lb_loss, mtp_loss, counts))), (grads, meta) = mean_grad_fn(grad_params, meta, batch,
                                                                                           key)
        else:
            # the step's A x B x devices rows, microbatch a the rows a, a+A, ...: every device keeps 1/A of its own
            # rows in each, B of them per device (MaxText's per_device_batch_size is one microbatch)
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // A, A, *x.shape[1:]), 0, 1), batch)

            def accumulate(carry, mb_a):
                mb, a = mb_a
                c_total, c_tokens, c_lb, c_mtp, c_counts, c_grads, c_meta = carry
                # each microbatch scales by the FP8 state the one before it left, as steps do
                (t, (n, lb, mtp, c)), (g, m) = grad_fn(grad_params, c_meta, mb,
                                                        None if key is None else jax.random.fold_in(key, a))
                return (c_total + t, c_tokens + n, c_lb + lb / A, c_mtp + mtp / A, jax.tree.map(jnp.add, c_counts, c),
                        split(jax.tree.map(jnp.add, c_grads, g)), m), None

            # the accumulator in float32; under ZeRO-1 MaxText's, in the dtype of the parameters it differentiates
            # and with their split (its carry's grad_shardings)
            zeros = split(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32 if zero1 is None else p.dtype),
                                       grad_params))
            # the expert loads summed over the microbatches: one update from the step's whole batch, as MaxText's
            # gradient accumulation does
            no_counts = {path: jnp.zeros(c.shape, c.dtype) for path, c in jax.eval_shape(
                lambda: grad_fn(grad_params, meta, jax.tree.map(lambda x: x[0], micro), key)[0][1][3]).items()}
            (total, tokens, lb_loss, mtp_loss, counts, grads, meta), _ = jax.lax.scan(
                accumulate, (0.0, 0.0, 0.0, 0.0, no_counts, zeros, meta), (micro, jnp.arange(A)))

            def mean(g, p):
                dtype = p.dtype if zero1 is None else g.dtype  # ZeRO-1's bfloat16 sums stay so, as MaxText's
                return g.astype(dtype) / (tokens + EPS).astype(dtype)

            grads = jax.tree.map(mean, grads, params)
        # MaxText's grad_dtype: float32 gradients cast to it before the update
        grads = jax.tree.map(lambda g: g.astype(train.grad_dtype) if g.dtype == jnp.float32 else g, grads)
        # ZeRO-1: reduced over `data` to the state's split, a reduce-scatter rather than an all-reduce
        grads = split(grads, over_data_too=True)
        denom = jnp.maximum(tokens, 1.0)
        if train.optimizer_memory_host_offload:
            opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if counts:  # after the optimizer's update, as MaxText applies it; the bias has no gradient (route)
            new_params = update_routed_bias(new_params, counts, train.routed_bias_update_rate)
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
        if meta is not None:
            new_state["fp8"] = meta
        metrics = {
            "loss": total / denom,
            "grad_norm": optax.tree.norm(grads),
            "tokens": tokens.astype(jnp.int32),
            "learning_rate": schedule(state["step"]),
        }
        if model.is_moe:  # the router's load-balancing loss, unweighted (1 when balanced); `loss` includes it weighted
            metrics["moe_lb_loss"] = lb_loss
        if model.mtp_num_layers:  # scaled by mtp_loss_scaling_factor, as MaxText's learning/mtp_loss; in `loss` too
            metrics["mtp_loss"] = mtp_loss
        return new_state, metrics

    return step


def zero1_sizes(train: TrainConfig) -> dict[str, int] | None:
    """The mesh's axis sizes where the step runs ZeRO-1 (shard_optimizer_over_data, `data` over more than one
    device, under `jax.set_mesh`); None otherwise."""
    if not train.shard_optimizer_over_data:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    return sizes if sizes.get("data", 1) > 1 else None


def update_routed_bias(params: dict, counts: dict[str, jax.Array], rate: float) -> dict:
    """`params` with each router's selection bias moved towards balance by its layer's expert loads
    (moe.bias_update); `counts` maps the "/"-joined path of each bias to loads shaped like it."""

    def moved(node, path: str):
        if not isinstance(node, dict):
            if path not in counts:
                return node
            return (node.astype(jnp.float32) + bias_update(counts[path], rate)).astype(node.dtype)
        return {k: moved(v, f"{path}/{k}" if path else str(k)) for k, v in node.items()}

    return moved(params, "")


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per token [B, L], as MaxText computes it (max_utils.cross_entropy_with_logits on
    one-hot targets): the target's logit is picked by comparing a vocabulary iota with the target and reducing, which
    XLA fuses with the logits. A gather (take_along_axis, as optax's integer-label loss does) makes XLA materialize
    the float32 logits [B, L, V] for it (llama2-7b v5p-128 B 4: 1 GiB per device)."""
    vocab_BxLxV = jax.lax.broadcasted_iota(jnp.int32, logits_BxLxV.shape, 2)
    target_BxL = jnp.sum(jnp.where(vocab_BxLxV == targets_BxL[..., None], logits_BxLxV, 0.0), axis=-1)
    return jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_BxL


def tiled_nll_sum(net: Transformer, x_BxLxD: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array,
                  tiles: int) -> jax.Array:
    """The masked cross-entropy summed over `tiles` chunks of the tokens (MaxText's vocabulary tiling): a scan
    computes one chunk's logits at a time and, rematerialized, again in the backward, so one chunk's [B, L/n, V]
    logits live at a time. Token l goes to chunk l mod n: each chunk keeps the batch's and sequence's shardings."""
    B, L, _ = x_BxLxD.shape

    def chunks(a):  # [B, L, ...] -> [n, B, L/n, ...]
        return jnp.moveaxis(a.reshape(B, L // tiles, tiles, *a.shape[2:]), 2, 0)

    @jax.checkpoint
    def chunk_sum(x_BxCxD, targets_BxC, mask_BxC):
        logits_BxCxV = net.logits(constrain(x_BxCxD, OUTER_RESIDUAL))
        return jnp.sum(cross_entropy(logits_BxCxV, targets_BxC) * mask_BxC)

    total, _ = jax.lax.scan(lambda t, xs: (t + chunk_sum(*xs), None), jnp.zeros((), jnp.float32),
                            (chunks(x_BxLxD), chunks(targets_BxL), chunks(mask_BxL)))
    return total


@dataclass(frozen=True)
class AbstractStep:
    """Shapes and shardings of everything the step takes, over one mesh; nothing allocated."""

    model: ModelConfig
    train: TrainConfig
    mesh: Mesh
    state: Any
    state_shardings: Any
    batch: dict
    batch_shardings: dict
    param_count: int

    @property
    def global_batch(self) -> int:
        """Examples per step: grad_accum_steps microbatches."""
        return self.batch["inputs"].shape[0]

    @property
    def micro_batch(self) -> int:
        """Examples per microbatch: per_device_batch_size x devices."""
        return self.global_batch // self.train.grad_accum_steps


def abstract_step(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> AbstractStep:
    attention_kernels.check(model, train, attention_kernels.platform_kind(mesh.devices.flat[0].platform))
    train = quantization.resolve_local_shards(train, mesh)
    sizes = dict(mesh.shape)
    md = model_def(model, train)
    state = jax.eval_shape(init_fn(model, train), jax.ShapeDtypeStruct((2,), jnp.uint32))
    param_shardings = jax.tree.map(
        lambda x, axes: NamedSharding(mesh, partition_spec(x.shape, axes, sizes)),
        md.params, md.logical_axes, is_leaf=lambda x: isinstance(x, tuple),
    )
    if train.shard_optimizer_over_data:  # ZeRO-1: the parameters and, placed alike, the optimizer state over data
        param_shardings = jax.tree.map(
            lambda x, s: NamedSharding(mesh, PartitionSpec(*over_data(x.shape, s.spec, sizes))), md.params,
            param_shardings)
    replicated = NamedSharding(mesh, PartitionSpec())
    optimizer, _ = make_optimizer(train)
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, state["opt_state"], param_shardings, transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    if train.parameter_memory_host_offload:
        param_shardings = jax.tree.map(_on_host, param_shardings)
    if train.optimizer_memory_host_offload:
        opt_shardings = jax.tree.map(_on_host, opt_shardings)
    state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
    if "fp8" in state:  # a few KiB per matmul: replicated
        state_shardings["fp8"] = jax.tree.map(lambda _: replicated, state["fp8"])
    shape = (train.global_batch(mesh.size), train.seq_len)  # A microbatches of B x devices rows
    batch = {
        "inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
        "mask": jax.ShapeDtypeStruct(shape, jnp.bool_),
    }
    # sharded as one microbatch would be, over the batch axes that divide its rows: each device's share of the step
    # is then A whole shares of the microbatches, and taking one needs no communication
    batch_sharding = NamedSharding(mesh, partition_spec((train.micro_batch(mesh.size), train.seq_len), BATCH_AXES,
                                                        sizes))
    return AbstractStep(
        model=model, train=train, mesh=mesh, state=state, state_shardings=state_shardings, batch=batch,
        batch_shardings={k: batch_sharding for k in batch}, param_count=md.param_count,
    )


def _on_host(sharding: NamedSharding) -> NamedSharding:
    """The same placement over the mesh, in the devices' pinned host memory."""
    return sharding.with_memory_kind("pinned_host")


def jit_step(spec: AbstractStep):
    """The train step jitted with its in and out shardings and the state donated; lower under `jax.set_mesh`."""
    metrics_sharding = NamedSharding(spec.mesh, PartitionSpec())
    return jax.jit(
        make_train_step(spec.model, spec.train),
        in_shardings=(spec.state_shardings, spec.batch_shardings),
        out_shardings=(spec.state_shardings, metrics_sharding),
        donate_argnums=(0,),
    )


def init_state(spec: AbstractStep, seed: int) -> dict:
    """Real, sharded initial state from a seed (for running): a pipelined stack's layers initialized in the model's
    order and then stored stage-major (`stored_layers`), so that one seed gives the same model whatever the
    pipeline's layout."""
    init = init_fn(spec.model, spec.train)
    found = _layer_order(spec)
    with jax.set_mesh(spec.mesh):
        return jax.jit(lambda key: _reorder_layers(spec, found, init(key), to_stored=True),
                       out_shardings=spec.state_shardings)(jax.random.PRNGKey(seed))


def _layer_order(spec: AbstractStep):
    """(the decoder stack's name, the unit stored at each of its positions) where the step pipelines it and so
    stores its layers stage-major (models/pipeline.stage_major); None where they are stored in the model's order."""
    from maxperf.models import pipeline
    from maxperf.spec.mesh import Mesh as SpecMesh

    schedule = pipeline_spec.of(spec.model, spec.train, SpecMesh(dict(spec.mesh.shape), {}))
    if schedule is None:
        return None
    order = pipeline.stage_major(schedule.places, schedule)
    if (order == np.arange(order.size)).all():
        return None
    return stacks(spec.model)[0].name, order


def _reorder_layers(spec: AbstractStep, found, state: dict, *, to_stored: bool) -> dict:
    """`state` (traced) with its pipelined stack's layer axis, in the parameters, their optimizer state and the FP8
    state, moved from the model's order to the stored one (`to_stored`) or back; `found`: `_layer_order(spec)`, the
    state itself where that is None."""
    if found is None:
        return state
    name, order = found
    index = jnp.asarray(order if to_stored else np.argsort(order))
    md = model_def(spec.model, spec.train)
    at = jax.tree.map(lambda axes: axes.index("stage_layers") if "stage_layers" in axes else -1, md.logical_axes,
                      is_leaf=lambda x: isinstance(x, tuple))

    def move(x, axis):
        return jnp.take(x, index, axis=axis) if axis >= 0 else x

    optimizer, _ = make_optimizer(spec.train)
    out = {**state, "params": jax.tree.map(move, state["params"], at),
           "opt_state": optax.tree_map_params(optimizer, move, state["opt_state"], at,
                                              transform_non_params=lambda x: x)}
    if name in state.get("fp8", {}):  # per stored place [places, ...]
        out["fp8"] = {**state["fp8"], name: jax.tree.map(lambda x: move(x, 0), state["fp8"][name])}
    return out


def reorders_layers(spec: AbstractStep) -> bool:
    """Whether the step stores its decoder's layers in another order than the model's (a pipeline's)."""
    return _layer_order(spec) is not None


def _moved_layers(spec: AbstractStep, state: dict, *, to_stored: bool) -> dict:
    """A real state's pipelined stack moved as `_reorder_layers` moves it, the state donated (no second copy of it:
    restored, it is replaced; saved, it is not used again); the state itself where the step does not reorder."""
    found = _layer_order(spec)
    if found is None:
        return state
    with jax.set_mesh(spec.mesh):
        return jax.jit(lambda s: _reorder_layers(spec, found, s, to_stored=to_stored),
                       out_shardings=spec.state_shardings, donate_argnums=0)(state)


def stored_layers(spec: AbstractStep, state: dict) -> dict:
    """A state whose pipelined stack is in the model's layer order (a checkpoint's) with it stored as the step
    stores it."""
    return _moved_layers(spec, state, to_stored=True)


def model_order_layers(spec: AbstractStep, state: dict) -> dict:
    """The inverse of `stored_layers`: what a checkpoint keeps, so that it restores into any pipeline's layout."""
    return _moved_layers(spec, state, to_stored=False)


def synthetic_batch(spec: AbstractStep, seed: int) -> dict:
    """Uniform random tokens, targets shifted by one, every position counted, placed with the batch sharding.

    Made with numpy on the host, so every process of a multi-process run builds the same global batch."""
    import numpy as np

    Bg, L = spec.batch["inputs"].shape
    tokens = np.random.default_rng(seed).integers(0, spec.model.vocab_size, (Bg, L + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((Bg, L), np.bool_)}
    return jax.device_put(batch, spec.batch_shardings)
