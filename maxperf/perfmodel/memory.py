"""Memory per device: state (params, AdamW, grads), saved activations per remat policy, logits, temporaries.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4):
count, per layer and token, every tensor the backward pass reads, then divide by the mesh axes that shard it. The
family here differs from their GPT: grouped-query attention (K kv heads), gated MLPs (three F-wide tensors), norms
computed in float32, no dropout (so no masks), and scores kept in float32 (models/layers/attention.py).
Every assumption is a named constant; the figures are to be checked against XLA's memory_analysis.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxperf.perfmodel.flops import gated
from maxperf.perfmodel.shapes import (
    Mesh,
    ModelShape,
    TrainShape,
    check_model,
    check_train,
    dtype_bytes,
)
from maxperf.perfmodel.sharding import activation_split, local_size, param_arrays

# optax.adamw keeps mu and nu with the parameters' dtype (optax scale_by_adam: mu_dtype=None, nu like params).
OPTIMIZER_STATES_PER_PARAM = 2
# Gradient accumulation sums microbatch gradients in a float32 buffer (models/train_step.py).
GRAD_ACCUMULATOR_BYTES = 4
# The train step donates the state, so the updated params and optimizer state reuse the input buffers.
STATE_DONATED = True
# Norms upcast to float32; the backward reads the float32 input and the normalized float32 value (8 bytes/elem).
NORM_SAVED_BYTES = 8
# Gated MLP (SwiGLU/GeGLU) keeps gate, up, activation internals (sigmoid or tanh), activation and product: 5 x F;
# the plain GELU MLP keeps its input, the tanh internals and the output: 3 x F.
GATED_MLP_SAVED_F = 5
PLAIN_MLP_SAVED_F = 3
# Per attention score: the float32 softmax output and its compute-dtype copy (for P V); soft-capping adds the
# float32 tanh output. The mask is one shared [L, L] boolean, negligible.
SCORE_SAVED_FLOAT32 = 1
SOFTCAP_SAVED_FLOAT32 = 1
# Logits: the compute-dtype unembedding output and one float32 [T, V] buffer (the softmax / gradient of the
# cross-entropy); XLA fuses the float32 upcast, and Gemma 2's final soft-capping (tanh), into the log-softmax
# reductions, so neither is a buffer of its own. Measured here: qwen3-0.6b (V = 151936) and gemma-2b (V = 256000) on
# v5p-8, where the loss phase is the peak, fit c + 4 bytes per logit with the gradients and the gathered vocabulary
# table alive beside them; gemma2-2b (soft-capped, V = 256000) on v5p-64 takes the same 6 bytes per logit as
# gemma-2b (bench/memory_accuracy.py).
LOGITS_FLOAT32_BUFFERS = 1
# The optimizer phase: the gradients are divided by the token count and clipped by their global norm, which needs
# every gradient reduced before any update, so XLA materializes one more float32 gradient-sized buffer (the scaled
# gradients) beside the gradients themselves. Measured here: llama2-7b v5p-8, B=1, L=2048, full remat: temp
# 12.77 GiB = 2 x 6.28 GiB of gradients + 0.2 GiB.
OPTIMIZER_GRADIENT_COPIES = 1
# Under "minimal", the saved outputs of weight matmuls are written per layer into stacked [N, ...] buffers by the
# forward scan and read back by the backward scan in another layout, so XLA holds a second, partial copy of them from
# the end of the forward until the backward loop runs: about 1.8 copies in the loss phase, one in the backward.
# Measured here (bench/memory_accuracy.py, B=1, L=2048): where the loss phase is the peak (qwen3-0.6b, large
# vocabulary) temp(minimal) - temp(full) = 2.40 GiB = 1.83 x the 1.31 GiB of saved dot outputs on v5p-8 and v5p-64;
# where the backward is the peak (llama2-7b and mistral-7b on v5p-64) the difference is 5.32 and 5.13 GiB = 1.02 and
# 0.98 x their 5.19 and 5.25 GiB.
MINIMAL_SAVED_COPIES = 1.8
# FSDP all-gathers one layer's weights in compute dtype while the next one is prefetched: two layers' worth.
GATHERED_LAYERS = 2
# Gradients of one layer's weights exist unsharded (param dtype) before their reduce-scatter.
UNSHARDED_GRAD_LAYERS = 1
# Backward of one layer with remat none: float32 gradients of the scores plus two float32 B x L x D buffers.
BACKWARD_SCORE_FLOAT32 = 1
BACKWARD_D_FLOAT32 = 2


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device."""

    params: float
    optimizer: float
    gradients: float
    grad_accumulator: float  # only with grad_accum_steps > 1
    activations: float  # saved for the backward pass, all layers
    saved_copy: float  # minimal remat: the second copy of the saved dot outputs, live until the backward starts
    logits: float
    temporaries: float  # one layer's gathered weights, unsharded grads and backward working set
    optimizer_temporaries: float  # the scaled gradients of the clipped update
    hbm_bytes: float

    def phases(self) -> dict[str, float]:
        """What is live beside the state (params, optimizer, accumulator) in each phase of the step: "loss" (the
        logits and the gathered vocabulary table atop the saved activations, and under minimal remat the second
        copy of the saved dot outputs), "backward" (a layer being differentiated atop the saved activations) and
        "optimizer" (the activations freed, a scaled copy of the gradients). XLA allocates the gradient buffers
        before the loss (they are outputs of the whole backward), so they count in every phase; the phases do not
        overlap, so the peak is the largest."""
        return {
            "loss": self.gradients + self.activations + self.saved_copy + self.logits,
            "backward": self.gradients + self.activations + self.temporaries,
            "optimizer": self.gradients + self.optimizer_temporaries,
        }

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.get)

    @property
    def per_device_total_bytes(self) -> float:
        return self.params + self.optimizer + self.grad_accumulator + max(self.phases().values())

    @property
    def headroom_bytes(self) -> float:
        return self.hbm_bytes - self.per_device_total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def as_dict(self) -> dict:
        return {
            "params": self.params, "optimizer": self.optimizer, "gradients": self.gradients,
            "grad_accumulator": self.grad_accumulator, "activations": self.activations,
            "saved_copy": self.saved_copy, "logits": self.logits,
            "temporaries": self.temporaries, "optimizer_temporaries": self.optimizer_temporaries,
            "peak_phase": self.peak_phase, "phases": self.phases(),
            "per_device_total_bytes": self.per_device_total_bytes,
            "hbm_bytes": self.hbm_bytes, "headroom_bytes": self.headroom_bytes, "fits": self.fits,
        }


def params_per_device(model: ModelShape, mesh: Mesh) -> float:
    """Parameters held by one device after sharding (the optimizer and gradients are sharded alike)."""
    return sum(a.count * local_size(a.shape, a.logical, mesh) for a in param_arrays(model))


def layer_saved_per_token(model: ModelShape, train: TrainShape, mesh: Mesh, *, remat: str) -> float:
    """Bytes one layer keeps per local token for its backward, beyond the layer input, under a remat policy."""
    c = dtype_bytes(train.compute_dtype, "compute_dtype")
    D, Dh = model.d_model, model.head_dim
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    mlp_f = (GATED_MLP_SAVED_F if gated(model) else PLAIN_MLP_SAVED_F) * a.F
    if remat == "full":  # nothing but the layer input (the scan carry)
        return 0.0
    if remat == "minimal":  # outputs of weight matmuls: q, k, v, o-projection, gate/up, down
        return c * ((a.H + 2 * a.K) * Dh + D + (2 if gated(model) else 1) * a.F + D)
    norms = (4 if model.post_norms else 2) * (NORM_SAVED_BYTES + c) * D
    residual = c * D  # the sum after attention, input of the MLP block
    qkv = c * (a.H + 2 * a.K) * Dh
    qk_norm = (NORM_SAVED_BYTES + c) * (a.H + a.K) * Dh if model.qk_norm else 0.0
    rope = c * (a.H + a.K) * Dh if str(model.positions) == "rope" else 0.0
    scaled_q_and_context = 2 * c * a.H * Dh
    score_bytes = 4 * SCORE_SAVED_FLOAT32 + c + (4 * SOFTCAP_SAVED_FLOAT32 if _softcapped(model) else 0)
    scores = a.H * train.seq_len * score_bytes  # each local query attends over all L keys (full matrix, masked)
    return norms + residual + qkv + qk_norm + rope + scaled_q_and_context + scores + c * mlp_f


def _softcapped(model: ModelShape) -> bool:
    return getattr(model, "attn_logit_softcap", None) is not None


def estimate_memory(model: ModelShape, train: TrainShape, mesh: Mesh, hbm_bytes: float) -> MemoryBreakdown:
    check_model(model)
    check_train(train)
    c = dtype_bytes(train.compute_dtype, "compute_dtype")
    p = dtype_bytes(train.param_dtype, "param_dtype")
    remat = str(train.remat_policy)
    D, N = model.d_model, model.num_layers
    micro = train.grad_accum_steps
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    T = a.T / micro  # tokens of one microbatch on this device

    local_params = params_per_device(model, mesh)
    params = local_params * p
    optimizer = OPTIMIZER_STATES_PER_PARAM * local_params * p
    gradients = local_params * p
    # models/train_step.py accumulates microbatch gradients in float32 whatever the param dtype
    accumulator = local_params * GRAD_ACCUMULATOR_BYTES if micro > 1 else 0.0
    if not STATE_DONATED:
        params, optimizer = 2 * params, 2 * optimizer

    # scanned or not, the backward reads every layer's input: N x T x D (Korthikanti's 2sbh per layer for "full")
    carry = N * T * D * c
    saved = N * T * layer_saved_per_token(model, train, mesh, remat=remat)
    activations = carry + saved
    saved_copy = (MINIMAL_SAVED_COPIES - 1) * saved if remat == "minimal" else 0.0
    logits = T * a.V * (c + 4 * LOGITS_FLOAT32_BUFFERS)

    arrays = param_arrays(model)
    layer_full = sum(local_size(x.shape, x.logical, _no_fsdp(mesh)) for x in arrays if x.count == N and x.matmul)
    gathered = GATHERED_LAYERS * layer_full * c
    grads_unsharded = UNSHARDED_GRAD_LAYERS * layer_full * p
    table = next(x for x in arrays if x.name == ("embedding" if model.tie_embeddings else "unembedding"))
    vocab_table = local_size(table.shape, table.logical, _no_fsdp(mesh)) * c  # gathered for the logits
    gradient_buffers = T * (BACKWARD_SCORE_FLOAT32 * 4 * a.H * train.seq_len + BACKWARD_D_FLOAT32 * 4 * D)
    working = gradient_buffers
    if remat != "none":  # the layer being differentiated is rematerialized: one layer's full set of saved tensors
        working += T * (D * c + layer_saved_per_token(model, train, mesh, remat="none"))
    temporaries = gathered + grads_unsharded + working
    return MemoryBreakdown(
        params=params, optimizer=optimizer, gradients=gradients, grad_accumulator=accumulator,
        activations=activations, saved_copy=saved_copy, logits=logits + vocab_table, temporaries=temporaries,
        optimizer_temporaries=OPTIMIZER_GRADIENT_COPIES * gradients, hbm_bytes=hbm_bytes,
    )


def _no_fsdp(mesh: Mesh) -> Mesh:
    """The mesh as seen by gathered weights: the axes that shard the model width, gathered away."""
    return Mesh(axes={**mesh.axes, "fsdp": 1, "sequence": 1, "expert": 1}, dcn=mesh.dcn)
