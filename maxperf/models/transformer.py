"""The decoder-only transformer: embeddings, a stack of decoder layers (scanned or unrolled), and the logits."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.config import ModelConfig, Positions
from maxperf.models.layers.attention_kernels import AttentionOptions
from maxperf.models.layers.decoder import LAYERS, RESIDUAL
from maxperf.models.layers.embedding import Embed, LearnedPositions, Unembed
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


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, scan_layers: bool,
                 remat: tuple | None, rngs: nnx.Rngs, attention: AttentionOptions = AttentionOptions()):
        """`remat`: TrainConfig.remat_names(), the checkpoint names each layer saves and offloads; None: no remat."""
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.scan_layers = scan_layers
        self.remat = remat
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = Embed(V, D, param_dtype, rngs)
        if cfg.positions is Positions.LEARNED:
            self.positions = LearnedPositions(cfg.max_position, D, param_dtype, rngs)
        layer_cls = LAYERS[cfg.layer_kind]
        if scan_layers:
            # one set of parameters with a leading layer axis, iterated by lax.scan
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs: nnx.Rngs):
                return layer_cls(cfg, param_dtype, rngs, attention)

            self.layers = stack(rngs)
        else:
            self.layers = nnx.List([layer_cls(cfg, param_dtype, rngs, attention) for _ in range(cfg.num_layers)])
        self.final_norm = make_norm(cfg.norm, D, cfg.norm_eps, param_dtype, rngs)
        if not cfg.tie_embeddings:
            self.unembed = Unembed(D, V, param_dtype, rngs)

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """float32 logits [B, L, V]."""
        return self.logits(self.hidden(tokens_BxL, positions_BxL))

    def hidden(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """The final-normed hidden states [B, L, D] that the logits are computed from."""
        cfg = self.cfg
        x_BxLxD = self.embed(tokens_BxL, self.compute_dtype)
        if cfg.scale_embeddings:
            x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(cfg.d_model), self.compute_dtype)
        if cfg.positions is Positions.LEARNED:
            x_BxLxD = x_BxLxD + self.positions(positions_BxL, self.compute_dtype)
        x_BxLxD = constrain(x_BxLxD, RESIDUAL)
        x_BxLxD = self._layers(x_BxLxD, positions_BxL)
        return self.final_norm(x_BxLxD)

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

    def _layers(self, x_BxLxD: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        windows = [w or 0 for w in self.cfg.layer_windows()]
        # one window for every layer stays a Python constant, so the mask is static; only interleaved
        # local and global layers pass each layer's window through the scan
        static = len(set(windows)) == 1

        def layer_fn(graphdef):
            def apply(x_BxLxD, state, window):
                return nnx.merge(graphdef, state)(x_BxLxD, positions_BxL, windows[0] if static else window)

            if self.remat is None:
                return apply
            # inside scan, CSE cannot merge the recomputation into the forward pass, so it need not be prevented
            return jax.checkpoint(apply, policy=remat_policy(self.remat), prevent_cse=not self.scan_layers)

        per_layer = jnp.asarray(windows, jnp.int32)
        if self.scan_layers:
            graphdef, state = nnx.split(self.layers)
            apply = layer_fn(graphdef)
            x_BxLxD, _ = jax.lax.scan(lambda x, sw: (apply(x, *sw), None), x_BxLxD, (state, per_layer))
            return x_BxLxD
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            x_BxLxD = layer_fn(graphdef)(x_BxLxD, state, per_layer[i])
        return x_BxLxD
