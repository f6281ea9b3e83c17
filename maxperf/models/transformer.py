"""The decoder-only transformer: embeddings, a stack of decoder layers (scanned or unrolled), and the logits."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxperf.models.config import ModelConfig, Positions, RematPolicy
from maxperf.models.layers.decoder import LAYERS, RESIDUAL
from maxperf.models.layers.embedding import Embed, LearnedPositions, Unembed
from maxperf.models.layers.norms import make_norm
from maxperf.models.sharding import constrain


def remat_policy(policy: RematPolicy):
    """The jax.checkpoint policy for a remat setting; None means no rematerialization at all."""
    return {
        RematPolicy.NONE: None,
        # MaxText's "minimal": keep the outputs of weight matmuls (dots without batch dimensions)
        RematPolicy.MINIMAL: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        RematPolicy.FULL: jax.checkpoint_policies.nothing_saveable,
    }[policy]


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, scan_layers: bool,
                 remat: RematPolicy, rngs: nnx.Rngs):
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
                return layer_cls(cfg, param_dtype, rngs)

            self.layers = stack(rngs)
        else:
            self.layers = nnx.List([layer_cls(cfg, param_dtype, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = make_norm(cfg.norm, D, cfg.norm_eps, param_dtype, rngs)
        if not cfg.tie_embeddings:
            self.unembed = Unembed(D, V, param_dtype, rngs)

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """float32 logits [B, L, V]."""
        cfg = self.cfg
        x_BxLxD = self.embed(tokens_BxL, self.compute_dtype)
        if cfg.scale_embeddings:
            x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(cfg.d_model), self.compute_dtype)
        if cfg.positions is Positions.LEARNED:
            x_BxLxD = x_BxLxD + self.positions(positions_BxL, self.compute_dtype)
        x_BxLxD = constrain(x_BxLxD, RESIDUAL)
        x_BxLxD = self._layers(x_BxLxD, positions_BxL)
        x_BxLxD = self.final_norm(x_BxLxD)
        logits_BxLxV = self.embed.attend(x_BxLxD) if cfg.tie_embeddings else self.unembed(x_BxLxD)
        logits_BxLxV = constrain(logits_BxLxV.astype(jnp.float32), ("activation_batch", "activation_length",
                                                                     "activation_vocab"))
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

            if self.remat is RematPolicy.NONE:
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
