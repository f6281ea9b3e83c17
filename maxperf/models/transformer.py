"""The decoder-only transformer: embeddings, a stack of decoder layers (scanned or unrolled), and the logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.config import ModelConfig, Positions
from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.decoder import RESIDUAL, DecoderBlock, make_layer
from maxperf.models.layers.embedding import Embed, LearnedPositions, Unembed
from maxperf.models.layers.moe import MoEOptions
from maxperf.models.layers.norms import make_norm
from maxperf.models.sharding import constrain


def remat_policy(names: tuple[tuple[str, ...], tuple[str, ...]]):
    """The jax.checkpoint policy of MaxText's remat setting (layers/decoders.py get_remat_policy) from
    TrainConfig.remat_names(): tensors saved by checkpoint name, offloaded ones to pinned host memory."""
    saved, offloaded = names
    if offloaded:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded),
            offload_src="device", offload_dst="pinned_host")
    if saved:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.nothing_saveable


@dataclass(frozen=True)
class Stack:
    """`count` repeats of consecutive layers, `pattern` saying which of them have a mixture of experts; layer
    `start` first. Scanned, each repeat is one step of the scan."""

    name: str
    start: int
    count: int
    pattern: tuple[bool, ...]


def stacks(cfg: ModelConfig) -> tuple[Stack, ...]:
    """The decoder's layers as scannable stacks: a dense model's N layers in one; a mixture of experts' first dense
    layers (DeepSeek), then repeats of interleave_moe_layer_step layers of which the last is MoE, then any dense
    rest. Together they follow `ModelConfig.moe_layers()`."""
    N = cfg.num_layers
    if not cfg.is_moe:
        return (Stack("layers", 0, N, (False,)),)
    k, step = min(cfg.first_num_dense_layers, N), cfg.interleave_moe_layer_step
    repeats, rest = divmod(N - k, step)
    out = []
    if k:
        out.append(Stack("dense_layers", 0, k, (False,)))
    if repeats:
        out.append(Stack("layers", k, repeats, (False,) * (step - 1) + (True,)))
    if rest:
        out.append(Stack("rest_layers", k + repeats * step, rest, (False,)))
    return tuple(out)


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
                 moe: MoEOptions = MoEOptions()):
        """`remat`: TrainConfig.remat_names(), the checkpoint names each layer saves and offloads; None: no remat."""
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.scan_layers = scan_layers
        self.remat = remat
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = Embed(V, D, param_dtype, rngs)
        if cfg.positions is Positions.LEARNED:
            self.positions = LearnedPositions(cfg.max_position, D, param_dtype, rngs)
        self.stacks = stacks(cfg)
        for st in self.stacks:
            unit = _unit_maker(st.pattern, cfg, param_dtype, attention, moe)
            if scan_layers:
                # one set of parameters with a leading layer axis, iterated by lax.scan
                stack = nnx.split_rngs(splits=st.count)(nnx.vmap(unit, in_axes=(0,), out_axes=0))
                setattr(self, st.name, stack(rngs))
            else:
                setattr(self, st.name, nnx.List([unit(rngs) for _ in range(st.count)]))
        self.final_norm = make_norm(cfg.norm, D, cfg.norm_eps, param_dtype, rngs)
        if not cfg.tie_embeddings:
            self.unembed = Unembed(D, V, param_dtype, rngs)

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """float32 logits [B, L, V]."""
        return self.logits(self.hidden(tokens_BxL, positions_BxL))

    def hidden(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """The final-normed hidden states [B, L, D] that the logits are computed from."""
        return self.hidden_and_aux(tokens_BxL, positions_BxL)[0]

    def hidden_and_aux(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The final-normed hidden states [B, L, D], and the mixture of experts' load-balancing loss averaged over
        the MoE layers (MaxText's moe_lb_loss, unweighted; 0 for a dense model)."""
        cfg = self.cfg
        x_BxLxD = self.embed(tokens_BxL, self.compute_dtype, iota=cfg.use_iota_embed)
        if cfg.scale_embeddings:
            x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(cfg.d_model), self.compute_dtype)
        if cfg.positions is Positions.LEARNED:
            x_BxLxD = x_BxLxD + self.positions(positions_BxL, self.compute_dtype)
        x_BxLxD = constrain(x_BxLxD, RESIDUAL)
        x_BxLxD, aux = self._layers(x_BxLxD, positions_BxL)
        return self.final_norm(x_BxLxD), aux / max(1, sum(cfg.moe_layers()))

    def logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """float32 logits [B, L, V] of hidden states (any leading dims B, L: a chunk of the tokens too)."""
        cfg = self.cfg
        logits_BxLxV = self.embed.attend(x_BxLxD) if cfg.tie_embeddings else self.unembed(x_BxLxD)
        # sharded in the compute dtype, then cast (MaxText's cast_logits_to_fp32): the cast fuses into the loss
        logits_BxLxV = constrain(logits_BxLxV, ("activation_batch", "activation_length", "activation_vocab"))
        logits_BxLxV = logits_BxLxV.astype(jnp.float32)
        if cfg.final_logit_softcap is not None:
            logits_BxLxV = cfg.final_logit_softcap * jnp.tanh(logits_BxLxV / cfg.final_logit_softcap)
        return logits_BxLxV

    def _layers(self, x_BxLxD: jax.Array, positions_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
        windows = [w or 0 for w in self.cfg.layer_windows()]
        # one window for every layer stays a Python constant, so the mask is static; only interleaved
        # local and global layers pass each layer's window through the scan
        static = len(set(windows)) == 1
        aux = jnp.zeros((), jnp.float32)
        for st in self.stacks:
            P = len(st.pattern)
            per_unit = jnp.asarray(windows[st.start:st.start + st.count * P], jnp.int32).reshape(st.count, P)
            layers = getattr(self, st.name)
            if self.scan_layers:
                graphdef, state = nnx.split(layers)
                apply = self._unit_fn(graphdef, positions_BxL, windows[0] if static else None, P)

                def body(carry, sw, apply=apply):
                    x, a = carry
                    x, a_unit = apply(x, *sw)
                    return (x, a + a_unit), None

                (x_BxLxD, aux), _ = jax.lax.scan(body, (x_BxLxD, aux), (state, per_unit))
                continue
            for i, unit in enumerate(layers):
                graphdef, state = nnx.split(unit)
                apply = self._unit_fn(graphdef, positions_BxL, windows[0] if static else None, P)
                x_BxLxD, a_unit = apply(x_BxLxD, state, per_unit[i])
                aux = aux + a_unit
        return x_BxLxD, aux

    def _unit_fn(self, graphdef, positions_BxL: jax.Array, static_window: int | None, P: int):
        """(x, state, windows of the unit's P layers) -> (x, aux), rematerialized per the policy."""

        def apply(x_BxLxD, state, windows_P):
            unit = nnx.merge(graphdef, state)
            windows = [static_window if static_window is not None else windows_P[j] for j in range(P)]
            return unit.with_aux(x_BxLxD, positions_BxL, windows[0] if P == 1 else windows)

        if self.remat is None:
            return apply
        # inside scan, CSE cannot merge the recomputation into the forward pass, so it need not be prevented
        return jax.checkpoint(apply, policy=remat_policy(self.remat), prevent_cse=not self.scan_layers)
