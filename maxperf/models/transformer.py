"""The decoder-only transformer: embeddings, a stack of decoder layers (scanned or unrolled), and the logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxperf.models import pipeline
from maxperf.models.layers import offload
from maxperf.models.layers import quantization as quant
from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.decoder import OUTER_RESIDUAL, DecoderBlock, make_layer, norm_axis
from maxperf.models.layers.embedding import Embed, LearnedPositions, Unembed
from maxperf.models.layers.moe import EXPERT_COUNTS, MoEOptions
from maxperf.models.layers.mtp import MTPModule, shift_left
from maxperf.models.layers.norms import make_norm
from maxperf.models.sharding import constrain, partition_spec
from maxperf.spec import attention_rule
from maxperf.spec import pipeline as pipeline_spec
from maxperf.spec.fp8 import Fp8Recipe
from maxperf.spec.model import ModelConfig, Positions
from maxperf.spec.params import stacks
from maxperf.spec.train import TrainConfig


@dataclass(frozen=True)
class PipelineOptions:
    """What a pipelined decoder needs of the train config (MaxText's keys; maxperf.spec.pipeline resolves them with
    the mesh's stages when the step is traced)."""

    microbatches: int = -1
    repeats: int = -1
    units_per_stage: int = 1
    delay: bool = False
    fsdp_gather_once: bool = False
    # MaxText's iteration policy keeps each iteration's input and each layer's input besides what the layers' policy
    # names, except under remat_policy=custom, whose own names decide (layers/pipeline.py get_pipeline_remat_policy)
    keep_inputs: bool = True
    # set_remat_policy_on_pipeline_iterations: each iteration rematerialized under the policy (remat_policy=none
    # recomputing it whole, as full does); False: nothing in the pipeline rematerialized
    iteration_remat: bool = True
    # places of the stack that hold no unit, before its first and after its last (Megatron's embedding and loss
    # places, maxperf.spec.pipeline.empty_places): the stack stores a unit's weights for each, unused
    empty_first: int = 0
    empty_last: int = 0

    @classmethod
    def from_train(cls, train: TrainConfig) -> PipelineOptions:
        first, last = pipeline_spec.empty_places(train)
        return cls(train.num_pipeline_microbatches, train.num_pipeline_repeats, train.num_layers_per_pipeline_stage,
                   train.pipeline_delay_activation_forwarding, train.pipeline_fsdp_ag_once,
                   keep_inputs=str(train.remat_policy) != "custom",
                   iteration_remat=train.set_remat_policy_on_pipeline_iterations, empty_first=first, empty_last=last)


def mesh_stages() -> int:
    """The `stage` axis of the mesh the step is traced under (jax.set_mesh); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("stage", 1)


def remat_policy(names: tuple[tuple[str, ...], tuple[str, ...]]):
    """The jax.checkpoint policy of MaxText's remat setting (layers/decoders.py get_remat_policy) from
    maxperf.spec.remat.remat_names(train): tensors saved by checkpoint name, offloaded ones to pinned host memory."""
    saved, offloaded = names
    if offloaded:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded),
            offload_src="device", offload_dst="pinned_host")
    if saved:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.nothing_saveable


def stack_axis(per_layer_ndim: int, param_scan_axis: int) -> int:
    """Where the layer axis of a scanned stack sits in a weight of `per_layer_ndim` dims: at `param_scan_axis`
    (MaxText's key, default 1: [D, N, F]) in a matrix or wider. A vector ([D] norm scales, biases, a router's bias)
    keeps its layer axis first, where MaxText moves it too: the same bytes and shardings, in another order.
    Measured (llama2-7b, v5p-1024, B 1, flash, full remat): the same memory at 0 and 1, and 646,535 TPU bundles at
    0 against 664,609 at 1 (MaxText's own step: 650,791)."""
    return min(param_scan_axis, 1) if per_layer_ndim >= 2 else 0


def _move_layer_axis(state: nnx.State, source: int, destination: int) -> nnx.State:
    """The scanned stack's parameters with their layer axis moved from `source` to `destination` (stack_axis's
    positions; 0 is the scan's). Other variables keep theirs at 0."""
    if source == destination:
        return state

    def move(path, var):
        if not isinstance(var, nnx.Param):
            return var
        value = var.get_value()
        a, b = stack_axis(value.ndim - 1, source), stack_axis(value.ndim - 1, destination)
        return var.replace(jnp.moveaxis(value, a, b)) if a != b else var

    return nnx.map_state(move, state)


def _widened(state: nnx.State, scales: dict[str, jax.Array], dtype) -> nnx.State:
    """`state` with each quantized weight (the ones `scales` names by "/"-joined path) times its scale, in `dtype`."""
    if not scales:
        return state
    pure = nnx.to_pure_dict(state)
    for key, scale in scales.items():
        *parents, leaf = key.split("/")
        node = pure
        for name in parents:  # a list's entries (DecoderBlock's layers) are keyed by int
            node = node[name] if name in node else node[int(name)]
        leaf = leaf if leaf in node else int(leaf)
        node[leaf] = node[leaf].astype(dtype) * scale.astype(dtype)
    nnx.replace_by_pure_dict(state, pure)
    return state


def _pinned_for_pipeline(state: nnx.State, gather_fsdp: bool) -> nnx.State:
    """A pipelined stack's parameters (layer axis first) pinned to the model's own split before the pipeline's loop,
    and so their gradients, which the loop accumulates, after it: the layers over `stage`, the rest as the model
    splits it. Under ZeRO-1 (shard_optimizer_over_data) the state's split over `data` too is gathered here once and
    the gradients reduced to it once after the loop; unpinned, the loop kept its gradient accumulator split as the
    state is, and moved the weights and their gradients across devices every iteration (llama3-70b on h100-8x8, data
    2 x 8 stages x tensor 4, 5 repeats: four collective-permutes of 0.6 to 2.2 GiB an iteration over the hosts'
    network, 56 s a step read from the HLO, 17.6 s pinned). With `gather_fsdp` (MaxText's pipeline_fsdp_ag_once) the
    FSDP axes are gathered too: split over `stage` and `tensor` only, a mixture of experts' over `expert` too (each
    device keeps its own experts)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return state
    sizes = dict(mesh.shape)

    def pin(path, var):
        if not isinstance(var, nnx.Param):
            return var
        logical = ("stage_layers", *var.get_metadata()["logical_axes"])
        kept = sizes
        if gather_fsdp:
            kept = {**sizes, **{a: 1 for a in FSDP_GATHERED if not (a == "expert" and "exp" in logical)}}
        value = var.get_value()
        return var.replace(jax.lax.with_sharding_constraint(value, partition_spec(value.shape, logical, kept)))

    return nnx.map_state(pin, state)


# The mesh axes a weight is gathered over before its matmul (perfmodel.sharding.FSDP_AXES)
FSDP_GATHERED = ("fsdp", "fsdp_transpose", "sequence", "expert")


@dataclass(frozen=True)
class Forward:
    """What the loss needs of the decoder (Transformer.forward)."""

    pre_norm: jax.Array  # [B, L, D], the last layer's output (multi-token prediction starts from it)
    hidden: jax.Array  # [B, L, D], final-normed: the logits' input
    lb_loss: jax.Array  # the load-balancing loss averaged over MoE layers
    counts: dict[str, jax.Array]  # int32 expert loads, keyed by the "/"-joined parameter path of the router's bias


@dataclass(frozen=True)
class Ahead:
    """What the multi-token-prediction modules give the loss (Transformer.predict_ahead)."""

    nll_K: jax.Array  # [mtp_num_layers] masked cross-entropy sums, depth by depth
    weights_K: jax.Array  # [mtp_num_layers] the tokens each depth predicts
    lb_sum: jax.Array  # the load-balancing losses of its MoE layers, summed
    counts: dict[str, jax.Array]  # expert loads, as Forward.counts


def collect_counts(module: nnx.Module) -> dict[str, jax.Array]:
    """Takes the expert loads a forward left on `module`'s routers (moe.EXPERT_COUNTS), keyed by the "/"-joined
    path of each router's bias inside `module`."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.pop(module, nnx.Intermediate)):
        if path[-1] == EXPERT_COUNTS:
            out["/".join(map(str, (*path[:-1], "bias")))] = var.get_value()
    return out


# for each layer of a stack's unit, its mask and its RoPE flag where every repeat shares them, else None
Static = tuple[tuple[int | None, ...], tuple[bool | None, ...]]


def _static(windows: list[int], ropes: list[bool], P: int) -> Static:
    """For each of the P layers of a stack's unit (the stack's `windows` and `ropes`, unit after unit), its mask and
    RoPE flag where every repeat shares them: they stay Python constants, so the kernel's mask is static (Gemma 3's
    local and global layers each have their own place in its block); None where repeats differ, passed through the
    scan."""
    def shared(values, j):
        column = set(values[j::P])
        return column.pop() if len(column) == 1 else None

    return tuple(shared(windows, j) for j in range(P)), tuple(shared(ropes, j) for j in range(P))


def _unit_maker(pattern: tuple[bool, ...], cfg: ModelConfig, dtype, attention: AttentionOptions, moe: MoEOptions):
    """rngs -> one repeat of a stack: a layer, or a block of layers."""

    def make(rngs: nnx.Rngs):
        if len(pattern) == 1:
            return make_layer(pattern[0], cfg, dtype, rngs, attention, moe)
        return DecoderBlock(pattern, cfg, dtype, rngs, attention, moe)

    return make


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, scan_layers: bool,
                 remat: tuple | None, rngs: nnx.Rngs, attention: AttentionOptions = AttentionOptions(),
                 moe: MoEOptions = MoEOptions(), quantization: quant.Int8 | Fp8Recipe | None = None,
                 param_scan_axis: int = 1, pipeline: PipelineOptions = PipelineOptions(),
                 logits_in_fp32: bool = False):
        """`remat`: maxperf.spec.remat.remat_names(train), the checkpoint names each layer saves and offloads; None: no
        remat.
        `quantization`: the layers' matmuls in int8 or an FP8 recipe (layers/quantization.py, layers/fp8.py); None:
        in the compute dtype.
        `param_scan_axis`: where a scanned stack's layer axis sits in its weights (`stack_axis`).
        `pipeline`: how the decoder's stack runs where the mesh has more than one `stage` (models/pipeline.py; its
        weights are then stored stage-major, `pipeline.stage_major`).
        `logits_in_fp32`: the logits' matmul in float32 (MaxText's logits_dot_in_fp32)."""
        quant.check_moe(quantization, cfg.is_moe, moe.sparse_matmul)
        self.cfg = cfg
        self.quantization = quantization
        self.compute_dtype = compute_dtype
        self.scan_layers = scan_layers
        self.param_scan_axis = param_scan_axis
        self.pipeline = pipeline
        self.remat = remat
        self.logits_in_fp32 = logits_in_fp32
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = Embed(V, D, param_dtype, rngs)
        if cfg.positions is Positions.LEARNED:
            self.positions = LearnedPositions(cfg.max_position, D, param_dtype, rngs)
        self.stacks = stacks(cfg)
        # a pipelined stack's empty places store weights too (each stage holds the same shapes); only a decoder of
        # one stack is pipelined (maxperf.spec.pipeline)
        self.empty = (pipeline.empty_first, pipeline.empty_last) if len(self.stacks) == 1 else (0, 0)
        for st in self.stacks:
            unit = _unit_maker(st.pattern, cfg, param_dtype, attention, moe)
            if scan_layers:
                # one set of parameters with a layer axis (stack_axis), iterated by lax.scan
                stack = nnx.split_rngs(splits=st.count + sum(self.empty))(
                    nnx.vmap(unit, in_axes=(0,), out_axes=0))(rngs)
                graphdef, state = nnx.split(stack)
                setattr(self, st.name, nnx.merge(graphdef, _move_layer_axis(state, 0, param_scan_axis)))
            else:
                setattr(self, st.name, nnx.List([unit(rngs) for _ in range(st.count)]))
        self.final_norm = make_norm(cfg.norm, D, cfg.norm_eps, param_dtype, rngs, norm_axis(cfg))
        if not cfg.tie_embeddings:
            self.unembed = Unembed(D, V, param_dtype, rngs)
        if cfg.mtp_num_layers:
            self.mtp = nnx.List([MTPModule(cfg, param_dtype, rngs, attention, moe)
                                 for _ in range(cfg.mtp_num_layers)])

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """float32 logits [B, L, V]."""
        return self.logits(self.forward(tokens_BxL, positions_BxL).hidden)

    def forward(self, tokens_BxL: jax.Array, positions_BxL: jax.Array, key: jax.Array | None = None,
                fp8: dict[str, jax.Array] | None = None) -> Forward:
        """The decoder's outputs for the loss: hidden states before and after the final norm, the mixture of experts'
        load-balancing loss averaged over the MoE layers (MaxText's moe_lb_loss, unweighted; 0 for a dense model), and
        the expert loads of the layers that record them (MoEOptions.count_experts). `key`: the int8 matmuls'
        stochastic rounding noise (a fresh one each step; None: a fixed one). `fp8`: a delayed FP8 recipe's scales
        and amax histories per stack [repeats, matmuls, 3, 1 + history] (train_step.fp8_state; None: counting)."""
        cfg = self.cfg
        x_BxLxD = constrain(self.embed_tokens(tokens_BxL, positions_BxL), OUTER_RESIDUAL)
        x_BxLxD, aux, counts = self._layers(x_BxLxD, positions_BxL, key, fp8)
        x_BxLxD = constrain(x_BxLxD, OUTER_RESIDUAL)
        return Forward(x_BxLxD, self.final_norm(x_BxLxD), aux / max(1, sum(cfg.moe_layers())), counts)

    def embed_tokens(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """The decoder's input [B, L, D]: token embeddings, scaled (Gemma) and with learned positions (GPT-2)."""
        cfg = self.cfg
        x_BxLxD = self.embed(tokens_BxL, self.compute_dtype, iota=cfg.use_iota_embed)
        if cfg.scale_embeddings:
            x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(cfg.d_model), self.compute_dtype)
        if cfg.positions is Positions.LEARNED:
            x_BxLxD = x_BxLxD + self.positions(positions_BxL, self.compute_dtype)
        return x_BxLxD

    def predict_ahead(self, pre_norm_BxLxD: jax.Array, tokens_BxL: jax.Array, targets_BxL: jax.Array,
                      mask_BxL: jax.Array, positions_BxL: jax.Array, nll_sum, key: jax.Array | None = None,
                      fp8: dict[str, jax.Array] | None = None) -> Ahead:
        """The multi-token-prediction modules (layers/mtp.py) over the decoder's output: depth k sees the tokens and
        targets shifted k to the left (the last k positions masked out) and predicts the token k + 1 ahead.
        `nll_sum(hidden_BxLxD, targets_BxL, mask_BxL)`: the masked cross-entropy sum of final-normed hidden states
        through the model's head."""
        cfg = self.cfg
        mask, rope = attention_rule.layer_masks(cfg)[-1], not cfg.nope_layers()[-1]  # the last layer's
        masks_P, ropes_P = jnp.asarray([mask], jnp.int32), jnp.asarray([rope], jnp.bool_)
        h_BxLxD, shifted = pre_norm_BxLxD, (tokens_BxL, targets_BxL, mask_BxL, positions_BxL)
        losses, weights, aux, counts = [], [], jnp.zeros((), jnp.float32), {}
        for k, module in enumerate(self.mtp):
            shifted = tuple(shift_left(x) for x in shifted)
            tokens_k, targets_k, mask_k, positions_k = shifted
            x_BxLxD = module.project(h_BxLxD, self.embed_tokens(tokens_k, positions_k))
            graphdef, state = nnx.split(module.layer)
            apply = self._unit_fn(graphdef, positions_BxL, ((mask,), (rope,)), 1, in_scan=False, tag=f"mtp/{k}")
            unit_key = None if key is None else jax.random.fold_in(key, cfg.num_layers + k)
            meta = None if fp8 is None else fp8[f"mtp/{k}"][0]
            h_BxLxD, a, c = apply(x_BxLxD, state, masks_P, ropes_P, unit_key, meta)
            aux = aux + a
            counts.update({f"mtp/{k}/layer/{path}": v for path, v in c.items()})
            losses.append(nll_sum(module.final_norm(h_BxLxD), targets_k, mask_k))
            weights.append(jnp.sum(mask_k.astype(jnp.float32)))
        return Ahead(jnp.stack(losses), jnp.stack(weights), aux, counts)

    def logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """float32 logits [B, L, V] of hidden states (any leading dims B, L: a chunk of the tokens too)."""
        cfg = self.cfg
        if self.logits_in_fp32:  # the table is cast to the hidden states' dtype
            x_BxLxD = x_BxLxD.astype(jnp.float32)
        logits_BxLxV = self.embed.attend(x_BxLxD) if cfg.tie_embeddings else self.unembed(x_BxLxD)
        # sharded in the compute dtype, then cast (MaxText's cast_logits_to_fp32): the cast fuses into the loss
        logits_BxLxV = constrain(logits_BxLxV, ("activation_embed_and_logits_batch", "activation_length",
                                                "activation_vocab"))
        logits_BxLxV = logits_BxLxV.astype(jnp.float32)
        if cfg.final_logit_softcap is not None:
            logits_BxLxV = cfg.final_logit_softcap * jnp.tanh(logits_BxLxV / cfg.final_logit_softcap)
        return logits_BxLxV

    def _layers(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, key: jax.Array | None = None,
                fp8: dict[str, jax.Array] | None = None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(x, summed load-balancing loss, expert loads keyed by the parameter path of their router's bias)."""
        windows = list(attention_rule.layer_masks(self.cfg))
        ropes = [not nope for nope in self.cfg.nope_layers()]
        if (stages := mesh_stages()) > 1:
            return self._pipelined(x_BxLxD, positions_BxL, stages, windows, ropes, key, fp8)
        if sum(self.empty):
            raise ValueError("account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split place "
                             "a pipeline's stages: the mesh has one stage")
        aux = jnp.zeros((), jnp.float32)
        counts: dict[str, jax.Array] = {}
        for st in self.stacks:
            P = len(st.pattern)
            span = slice(st.start, st.start + st.count * P)
            static = _static(windows[span], ropes[span], P)
            keys = None
            if isinstance(self.quantization, quant.Int8):  # each unit's own noise key
                base = jax.random.key(0, impl=quant.NOISE_IMPL) if key is None else key
                keys = jax.random.split(jax.random.fold_in(base, st.start), st.count)
            per_unit = (jnp.asarray(windows[span], jnp.int32).reshape(st.count, P),
                        jnp.asarray(ropes[span], jnp.bool_).reshape(st.count, P), keys,
                        None if fp8 is None else fp8[st.name])  # each unit's FP8 scales and histories
            layers = getattr(self, st.name)
            if self.scan_layers:
                graphdef, state = nnx.split(layers)
                state = _move_layer_axis(state, self.param_scan_axis, 0)  # the scan steps over axis 0
                apply = self._unit_fn(graphdef, positions_BxL, static, P, tag=st.name)

                def body(carry, sw, apply=apply):
                    x, a = carry
                    x, a_unit, c_unit = apply(x, *sw)
                    return (x, a + a_unit), c_unit

                (x_BxLxD, aux), stacked = jax.lax.scan(body, (x_BxLxD, aux), (state, *per_unit))
                counts.update({f"{st.name}/{path}": c for path, c in stacked.items()})  # [count, E] as the bias
                continue
            for i, unit in enumerate(layers):
                graphdef, state = nnx.split(unit)
                apply = self._unit_fn(graphdef, positions_BxL, static, P, tag=st.name)
                x_BxLxD, a_unit, c_unit = apply(x_BxLxD, state, *(None if u is None else u[i] for u in per_unit))
                aux = aux + a_unit
                counts.update({f"{st.name}/{i}/{path}": c for path, c in c_unit.items()})
        return x_BxLxD, aux, counts

    def serve(self, tokens_BxL: jax.Array, positions_BxL: jax.Array, caches: dict[str, list[dict[str, jax.Array]]],
              mode: str, quant_axis: str | None = None, scales: dict[str, jax.Array] | None = None,
              heads_first: bool = True) -> tuple[jax.Array, dict[str, list[dict[str, jax.Array]]]]:
        """A serving step's forward (models/serving.py): the float32 logits of each sequence's last position
        [B, 1, V] and the caches with the new positions stored. `caches`: for each stack, one cache per layer of its
        repeating unit, each array with the stack's repeats first (layers/kv_cache.py); `mode` prefill or decode;
        `quant_axis`: the cache's int8 scales' axes (None: the cache in the compute dtype). `scales`: the scales of
        the layers' quantized weights by "/"-joined parameter path (the weights themselves, int8 or float8, are the
        module's): each layer's are widened to the compute dtype inside the loop, one layer at a time.
        `heads_first`: the grouped-query cache's layout (models/serving.heads_first)."""
        from maxperf.models.layers import kv_cache

        if mesh_stages() > 1:
            raise ValueError("serving steps run without pipeline stages")
        windows = list(attention_rule.layer_masks(self.cfg))
        ropes = [not nope for nope in self.cfg.nope_layers()]
        x_BxLxD = constrain(self.embed_tokens(tokens_BxL, positions_BxL), OUTER_RESIDUAL)
        updated = {}
        for st in self.stacks:
            P = len(st.pattern)
            span = slice(st.start, st.start + st.count * P)
            static = _static(windows[span], ropes[span], P)
            per_unit = (jnp.asarray(windows[span], jnp.int32).reshape(st.count, P),
                        jnp.asarray(ropes[span], jnp.bool_).reshape(st.count, P))
            layers = getattr(self, st.name)

            mine = {k[len(st.name) + 1:]: v for k, v in (scales or {}).items() if k.startswith(st.name + "/")}

            def unit(x, state, windows_P, ropes_P, caches_P, index, graphdef, scales_u, static=static):
                apply = self._unit_fn(graphdef, positions_BxL, static, P, in_scan=True)
                with kv_cache.session(mode, caches_P, quant_axis, index, heads_first) as s:
                    x, _, _ = apply(x, _widened(state, scales_u, self.compute_dtype), windows_P, ropes_P)
                return x, s.updated

            if self.scan_layers:
                graphdef, state = nnx.split(layers)
                state = _move_layer_axis(state, self.param_scan_axis, 0)
                mine = {k: jnp.moveaxis(v, stack_axis(v.ndim - 1, self.param_scan_axis), 0) for k, v in mine.items()}

                # the whole stack's caches ride in the carry: each repeat writes its new positions into its own
                # slice in place (as scan's outputs they would be a second copy of the cache)
                def body(carry, xs, graphdef=graphdef, unit=unit):
                    x, stacked = carry
                    i, state_u, windows_u, ropes_u, scales_u = xs
                    x, stacked = unit(x, state_u, windows_u, ropes_u, stacked, i, graphdef, scales_u)
                    return (x, stacked), None

                (x_BxLxD, updated[st.name]), _ = jax.lax.scan(
                    body, (x_BxLxD, caches[st.name]), (jnp.arange(st.count), state, *per_unit, mine))
                continue
            stacked = caches[st.name]
            for i, layer in enumerate(layers):
                graphdef, state = nnx.split(layer)
                scales_u = {k[len(str(i)) + 1:]: v for k, v in mine.items() if k.startswith(f"{i}/")}
                x_BxLxD, stacked = unit(x_BxLxD, state, per_unit[0][i], per_unit[1][i], stacked, i, graphdef,
                                        scales_u)
            updated[st.name] = stacked
        x_BxLxD = self.final_norm(constrain(x_BxLxD, OUTER_RESIDUAL))
        return self.logits(x_BxLxD[:, -1:]), updated

    def _pipelined(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, stages: int, windows, ropes,
                   key: jax.Array | None, fp8: dict[str, jax.Array] | None
                   ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """_layers over a mesh of `stages` pipeline stages: the decoder's one stack through models/pipeline.py, its
        units stored stage-major (each stored position's mask, RoPE flag and expert loads follow the unit stored
        there). spec.pipeline has checked that the model is one scanned stack the stages divide."""
        (st,) = self.stacks
        P, o = len(st.pattern), self.pipeline
        static = _static(windows, ropes, P)
        first, last = self.empty
        schedule = pipeline_spec.schedule(stages, st.count, x_BxLxD.shape[0], microbatches=o.microbatches,
                                          repeats=o.repeats, units_per_stage=o.units_per_stage, delay=o.delay,
                                          fsdp_gather_once=o.fsdp_gather_once, empty_first=first, empty_last=last)
        places = schedule.places
        order = pipeline.stage_major(places, schedule)
        keys = None
        if isinstance(self.quantization, quant.Int8):
            base = jax.random.key(0, impl=quant.NOISE_IMPL) if key is None else key
            keys = jax.random.split(jax.random.fold_in(base, st.start), places)
        graphdef, state = nnx.split(getattr(self, st.name))
        state = _pinned_for_pipeline(_move_layer_axis(state, self.param_scan_axis, 0), o.fsdp_gather_once)

        def per_place(flags, dtype):  # each unit's flags, an empty place taking the first unit's (it is not used)
            units = np.asarray(flags).reshape(st.count, P)
            return jnp.asarray(np.concatenate([units[:1]] * first + [units] + [units[:1]] * last)[order], dtype)

        stored = (state, per_place(windows, jnp.int32), per_place(ropes, jnp.bool_), keys,
                  None if fp8 is None else fp8[st.name])
        S, R, U = schedule.stages, schedule.repeats, schedule.units_per_stage
        per_unit = jax.tree.map(lambda v: v.reshape(S, R, U, *v.shape[1:]), stored)

        def unit(x_bxLxD, positions_bxL, one):
            return self._unit_fn(graphdef, positions_bxL, static, P, in_scan=True, tag=st.name,
                                 remat=False)(x_bxLxD, *one)

        b = x_BxLxD.shape[0] // schedule.microbatches
        counts_like = jax.eval_shape(lambda: unit(x_BxLxD[:b], positions_BxL[:b],
                                                  jax.tree.map(lambda v: v[0, 0, 0], per_unit)))[2]
        # each iteration rematerialized as a whole, its layers not one by one, as MaxText's pipeline does: what the
        # policy saves is kept (with its input and each layer's input, keep_inputs), the iteration's slice of the
        # stage's weights is taken again in the backward (maxperf.spec.remat.pipelined, which perfmodel counts)
        policy = None
        if o.iteration_remat:
            policy = remat_policy(((), ()) if self.remat is None else self.remat)
        x_BxLxD, aux, counts = pipeline.run(unit, per_unit, x_BxLxD, positions_BxL, schedule, policy=policy,
                                            keep_inputs=o.keep_inputs, counts_like=counts_like)
        return x_BxLxD, aux, {f"{st.name}/{path}": c[order] for path, c in counts.items()}

    def _unit_fn(self, graphdef, positions_BxL: jax.Array, static: Static, P: int, in_scan: bool | None = None,
                 tag: str = "", remat: bool = True):
        """(x, state, masks and RoPE flags of the unit's P layers, int8's noise key, FP8 state) -> (x, aux, expert
        loads by the path of their bias in the unit), rematerialized per the policy. `static`: for each of the unit's
        layers, the mask and the RoPE flag every repeat of it shares (`_static`; None where they differ). `in_scan`:
        whether the unit runs as a scan's body (default: as the decoder's layers). `tag`: the unit's stack, under which
        a delayed FP8 recipe keeps its state. `remat`: False inside a pipeline, whose iterations are rematerialized
        whole instead."""

        offloaded = () if self.remat is None else self.remat[1]

        def apply(x_BxLxD, state, windows_P, ropes_P, key=None, meta=None):
            with quant.scope(self.quantization, key, meta, tag), offload.offloading(offloaded):
                return unit_with_aux(x_BxLxD, state, windows_P, ropes_P)

        def unit_with_aux(x_BxLxD, state, windows_P, ropes_P):
            unit = nnx.merge(graphdef, state)
            windows = [static[0][j] if static[0][j] is not None else windows_P[j] for j in range(P)]
            ropes = [static[1][j] if static[1][j] is not None else ropes_P[j] for j in range(P)]
            if P == 1:
                x_BxLxD, aux = unit.with_aux(x_BxLxD, positions_BxL, windows[0], ropes[0])
            else:
                x_BxLxD, aux = unit.with_aux(x_BxLxD, positions_BxL, windows, ropes)
            return x_BxLxD, aux, collect_counts(unit)

        if self.remat is None or not remat:
            return apply
        # inside scan, CSE cannot merge the recomputation into the forward pass, so it need not be prevented
        in_scan = self.scan_layers if in_scan is None else in_scan
        return jax.checkpoint(apply, policy=remat_policy(self.remat), prevent_cse=not in_scan)
