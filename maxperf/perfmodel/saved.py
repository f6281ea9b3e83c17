"""What one decoder layer keeps for its backward pass, per local token: each checkpoint name's tensor, what a remat
policy keeps on device and what it offloads to pinned host memory (maxperf.spec.remat decides which names).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4):
count, per layer and token, every tensor the backward pass reads, then divide by the mesh axes that shard it. The
family here differs from their GPT: grouped-query attention (K kv heads), gated MLPs (three F-wide tensors), norms
computed in float32, no dropout (so no masks); under attention=dot_product the scores in the compute dtype unless
MaxText's float32 switches say otherwise, under flash no [L, L] scores at all (models/layers/attention_kernels.py).
Every assumption is a named constant, checked against XLA's memory_analysis where the note says so.
"""

from __future__ import annotations

from maxperf.perfmodel.flops import attention_kernel, gated, head_dims, is_mla
from maxperf.perfmodel.moe import MoeShape, dispatch, moe_shape, routed_buffer_rows, rows_per_token
from maxperf.perfmodel.sharding import activation_split
from maxperf.spec.memo import model_memo
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.remat import remat_names
from maxperf.spec.train import DTYPE_BYTES, TrainConfig

# Norms upcast to float32; the backward reads the float32 input and the normalized float32 value (8 bytes/elem), at
# the residual stream's width on the device (a.D); the compute-dtype output, gathered over tensor for the next
# matmul, is not kept (the shape of GATED_MLP_SAVED_F's note: four f32[4,8,2048,1024] per layer for two norms, no
# bf16[.., 4096]).
NORM_SAVED_BYTES = 8
# RMSNorm (MaxText's form) rounds the normalized value to the compute dtype before its scale, so the backward keeps the
# float32 input and the normalized value in the compute dtype: 4 + 2 bytes per element in bf16 (a tiny model on v5p-8,
# tensor 2, no remat: the forward scan's saved buffers shrank by 2 bytes per element of each norm's width when the
# norm took that form, tests/test_estimate_memory.py's tiny compile).
RMS_NORM_SAVED_FLOAT32_BYTES = 4
# Gated MLP (SwiGLU/GeGLU) keeps gate, up, the activation's internals (sigmoid s and its derivative s (1 - s)), the
# activation and the product: 6 x F (measured here with libtpu 0.0.52: llama2-7b widths at 4 layers on v5p-32,
# tensor 4, B 2, L 2048, remat_policy=none: the forward scan stacks six bf16[4,8,2048,2752] per layer); the plain
# GELU MLP keeps its input, the tanh internals and the output: 3 x F.
GATED_MLP_SAVED_F = 6
PLAIN_MLP_SAVED_F = 3
# Per attention score under the dot product: two buffers in the logits' dtype (float32 with MaxText's
# float32_qk_product or float32_logits, else the compute dtype): the exponentials and the normalized probabilities,
# and, when that dtype is wider, a compute-dtype copy (for P V); soft-capping adds the tanh output in the product's
# dtype. The mask is one shared [L, L] boolean, negligible. Measured here with libtpu 0.0.52 (the shape of
# GATED_MLP_SAVED_F's note, attention=dot_product): the forward scan stacks two bf16[4,8,8,1,2048,2048] per layer.
SCORE_SAVED = 2
SOFTCAP_SAVED = 1
# Flash kernels keep, per query and head, the float32 log-sum-exp of the softmax beside their output (the shape of
# GATED_MLP_SAVED_F's note, attention=flash: the forward scan stacks f32[4,8,8,2048], [N, B, H, L], beside the
# kernel's bf16[4,8,8,2048,128] output). The TPU's figure, for every platform.
FLASH_LSE_BYTES = 4
# A MoE layer keeps (models/layers/moe.py; counted from its tensors, not yet measured): per token the router's
# float32 logits and probabilities over the E experts and the float32 top-k weights; per routed row the experts'
# input (D) and MLP internals (GATED_MLP_SAVED_F x Fe), the rows of the sorted dispatch being the worst-case receive
# buffer under expert parallelism (perfmodel.moe.routed_buffer_rows), those of the einsum dispatch its E x C slots
# per sequence; the combine reads the top-k expert outputs per token (sorted dispatch), or every slot's output and
# the [L, E, C] dispatch and combine masks (einsum dispatch).
ROUTER_FLOAT32_PER_EXPERT = 2
# Multi-token prediction (models/layers/mtp.py), per module and token beside its decoder layer's input and saved
# tensors: the projection's input, the normed embedding and hidden state concatenated (2 x D in the compute dtype), and
# its three norms' saved values (norm_saved_bytes; counted from the module). Each depth's logits are live beside the
# decoder's in the loss phase, and each head's gradient of the vocabulary table is whole, beside the other's, through
# the decoder's backward: deepseek-v3 at 4 layers with mtp_num_layers=1 on v5p-128 (expert 8), B 1, L 1024, remat full,
# flash compiles with libtpu 0.0.52 to 17.98 GiB per device (19.88 analytical), two bf16[1024,129280] logits fusions
# live at the loss and two bf16[7168,129280] table gradients (transpose of BLD,DV->BLV, all-reduced) at the backward
# scan.
MTP_SAVED_D = 2
MTP_SAVED_NORMS = 3
MTP_LOGITS_PER_DEPTH = 1
MTP_TABLE_GRADIENTS_PER_HEAD = 1
# The checkpoint names of the attention block's tensors and of the MLP's (a MoE layer's experts'), for the breakdown
ATTENTION_NAMES = ("query_proj", "key_proj", "value_proj", "qkv_proj", "context", "attention_out", "out_proj")


def routed_rows_held(moe: MoeShape, train: TrainConfig, mesh: Mesh) -> float:
    """Rows of the routed experts' buffers per local token: the sorted dispatch's (top-k, in the worst-case receive
    buffer under expert parallelism), or the einsum dispatch's E x C / L slots."""
    if dispatch(train) == "sparse":
        return routed_buffer_rows(moe, mesh.axes.get("expert", 1))
    return rows_per_token(moe, train)

def named_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, moe_layer: bool = False) -> dict[str, float]:
    """_named_per_token, kept per model for what it reads (the mesh, the compute dtype, the attention kernel and the
    MoE dispatch: not the batch, whose split it does not read); callers must not change the dict."""
    key = ("named per token", mesh.sizes, moe_layer, train.compute_dtype, attention_kernel(train), train.sparse_matmul,
           train.capacity_factor, train.seq_len)
    memo = model_memo(model)
    if (sizes := memo.get(key)) is None:
        sizes = memo[key] = _named_per_token(model, train, mesh, moe_layer)
    return sizes


def _named_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, moe_layer: bool) -> dict[str, float]:
    """Bytes per local token of each checkpoint name's tensor that the backward reads back, in one layer (the layer
    input, decoder_layer_input, is the scan carry: on device it is counted apart, as the carry; qkv_proj only under
    fused_qkv, mlpwi of a gated MLP only under
    fused_mlp; the MLP's output, mlpwo, only a post-norm reads, or in a MoE layer (`moe_layer`) the routing
    weights' gradient: elsewhere a policy that names it keeps nothing, tests/test_remat.py). A MoE layer's MLP names
    are its experts' tensors over the rows they hold, and its shared experts'."""
    c = DTYPE_BYTES[train.compute_dtype]
    D, Dh = model.d_model, model.head_dim
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    # MaxText's "context" is a flash kernel's residuals: its output in the kernel's [B, H, L, Dh] layout and the
    # float32 log-sum-exp (measured here: jax's saved_residuals of a layer); the dot product names none. The output in
    # the model's layout is "attention_out".
    flash = attention_kernel(train) == "flash"
    moe = moe_shape(model) if moe_layer else None
    F = a.F if moe is None else (routed_rows_held(moe, train, mesh) + moe.S) * a.Fe
    # MaxText's fused_mlp names the gate and up outputs together mlpwi, its fused_qkv q, k and v together qkv_proj
    if gated(model) and model.fused_mlp:
        wi = {"mlpwi": 2 * c * F}
    else:
        wi = {"mlpwi_0": c * F, "mlpwi_1": c * F} if gated(model) else {"mlpwi": c * F}
    if moe is not None and train.sparse_matmul and "mlpwi_1" in wi:
        # MaxText's dropless experts name their up projection moe_mlpwi_1 alone: mlpwi_1 keeps the shared experts'
        wi["mlpwi_1"] = c * moe.S * a.Fe
    if moe is not None:  # the experts' output rows are whole D wide, partial sums over a tensor-split width (the
        # forward scan of expert_gradient_excess's compile, at tensor 4, stacks bf16[32,32768,4096] for them)
        wo = c * (D * routed_rows_held(moe, train, mesh) + (a.D if moe.S else 0))
    else:
        wo = c * a.D if model.post_norms else 0.0
    if is_mla(model):
        Dq, Dv = head_dims(model)
        kernel = c * a.H * Dv + FLASH_LSE_BYTES * a.H if flash else 0.0
        return {"query_proj": c * a.H * Dq, "key_proj": c * a.H * Dq, "value_proj": c * a.H * Dv,
                "context": kernel, "attention_out": c * a.H * Dv, "out_proj": c * a.D, **wi, "mlpwo": wo,
                "decoder_layer_input": c * a.D}
    kernel = c * a.H * Dh + FLASH_LSE_BYTES * a.H if flash else 0.0
    if model.fused_qkv:
        qkv = {"qkv_proj": c * (a.H + 2 * a.K) * Dh}
    else:
        qkv = {"query_proj": c * a.H * Dh, "key_proj": c * a.K * Dh, "value_proj": c * a.K * Dh}
    return {**qkv, "context": kernel, "attention_out": c * a.H * Dh, "out_proj": c * a.D, **wi, "mlpwo": wo,
            "decoder_layer_input": c * a.D}

def layer_saved_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, *, remat: str,
                          moe_layer: bool = False) -> float:
    """Bytes one layer keeps in device memory per local token for its backward, beyond the layer input, under a
    remat policy (`custom` reads the train config's per-tensor keys); `moe_layer`: a MoE layer's."""
    return sum(layer_saved_parts(model, train, mesh, remat=remat, moe_layer=moe_layer).values())

def layer_saved_parts(model: ModelConfig, train: TrainConfig, mesh: Mesh, *, remat: str,
                      moe_layer: bool = False) -> dict[str, float]:
    """layer_saved_per_token split into the attention block's ("attention"), the MLP's or experts' ("mlp") and the
    norms' and residual's ("rest")."""
    if remat != "none":
        names = remat_names(train, remat)
        sizes = named_per_token(model, train, mesh, moe_layer)
        kept = names[0] - {"decoder_layer_input"}  # the carry, counted apart
        attention = sum(sizes.get(n, 0.0) for n in kept if n in ATTENTION_NAMES)
        return {"attention": attention, "mlp": sum(sizes.get(n, 0.0) for n in kept if n not in ATTENTION_NAMES),
                "rest": 0.0}
    c = DTYPE_BYTES[train.compute_dtype]
    Dh = model.head_dim
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    moe = moe_shape(model) if moe_layer else None
    if moe is None:
        mlp = c * (GATED_MLP_SAVED_F if gated(model) else PLAIN_MLP_SAVED_F) * a.F
    else:
        mlp = moe_saved_per_token(model, moe, train, mesh)
    # the residual stream and its float32 norm values are split over tensor (MaxText's activation_embed rule)
    norms = (4 if model.post_norms else 2) * norm_saved_bytes(model, c) * a.D
    residual = c * a.D  # the sum after attention, input of the MLP block
    if is_mla(model):
        Dq, Dv = head_dims(model)
        projections = mla_saved_per_token(model, c, a.H)
    else:
        Dq = Dv = Dh
        qkv = c * (a.H + 2 * a.K) * Dh
        qk_norm = (NORM_SAVED_BYTES + c) * (a.H + a.K) * Dh if model.qk_norm else 0.0
        # q, k and v as the kernel takes them (RoPE is linear: its backward needs no input) and the context
        projections = qkv + qk_norm + c * a.H * Dh
    if attention_kernel(train) == "flash":  # the kernel's residuals: its output in its own layout, the log-sum-exp
        scores = c * a.H * Dv + FLASH_LSE_BYTES * a.H
    else:  # each local query attends over all L keys (the full matrix, masked), and the scaled q
        product, logits = score_bytes(train)
        saved = SCORE_SAVED * logits + (c if logits > c else 0)
        scores = a.H * train.seq_len * (saved + (SOFTCAP_SAVED * product if _softcapped(model) else 0))
        scores += 0.0 if is_mla(model) else c * a.H * Dq  # (latent attention's is among its projections)
    return {"attention": projections + scores, "mlp": mlp, "rest": norms + residual}

def norm_saved_bytes(model: ModelConfig, c: int) -> int:
    """What the backward reads of one element of a residual-width norm: RMSNorm's float32 input and its normalized
    value in the compute dtype (MaxText's form), LayerNorm's two float32 values."""
    return RMS_NORM_SAVED_FLOAT32_BYTES + c if str(model.norm) == "rmsnorm" else NORM_SAVED_BYTES

def mla_saved_per_token(model: ModelConfig, c: int, H: float) -> float:
    """Latent attention's tensors per token (models/layers/mla.py), H the local heads: the q latent and its float32
    norm, the kv latent with the shared RoPE key and the latent's norm, then per head q, its rotated RoPE part, the
    up-projected keys' and values' product, the assembled keys, the scaled q and the context."""
    R, C, Dn, Dr, Dv = (model.q_lora_rank, model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim,
                        model.v_head_dim)
    Dq = Dn + Dr
    latents = c * R + (NORM_SAVED_BYTES + c) * R + c * (C + Dr) + (NORM_SAVED_BYTES + c) * C + c * Dr
    heads = c * H * (Dq + Dr + (Dn + Dv) + Dq + Dq + Dv)
    return latents + heads

def moe_saved_per_token(model: ModelConfig, moe: MoeShape, train: TrainConfig, mesh: Mesh) -> float:
    """A MoE block's tensors per local token without remat (see ROUTER_FLOAT32_PER_EXPERT's note)."""
    c = DTYPE_BYTES[train.compute_dtype]
    D = model.d_model
    a = activation_split(model, train.per_device_batch_size, train.seq_len, mesh)
    rows = routed_rows_held(moe, train, mesh)
    mlp_f = GATED_MLP_SAVED_F if gated(model) else PLAIN_MLP_SAVED_F
    router = 4 * ROUTER_FLOAT32_PER_EXPERT * moe.E + 4 * moe.k
    experts = c * D * rows + c * mlp_f * rows * a.Fe  # the experts' input rows and MLP internals
    if dispatch(train) == "sparse":  # the combine reads each token's top-k expert outputs
        outputs = c * D * moe.k
    else:  # the combine reads the experts' output slots, and the dispatch and combine masks [L, E, C] per sequence
        outputs = c * D * rows + 2 * c * rows
    shared = c * mlp_f * moe.S * a.Fe
    return router + experts + outputs + shared

def layer_offloaded_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh, moe_layer: bool = False) -> float:
    """Bytes one layer offloads to pinned host memory per local token under the step's remat policy."""
    names = remat_names(train)
    if names is None:
        return 0.0
    sizes = named_per_token(model, train, mesh, moe_layer)
    return sum(sizes.get(n, 0.0) for n in names[1])

def offloaded_per_token(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> float:
    """Bytes every layer together offloads per local token, each layer kind at its own size (a MoE layer's experts'
    rows beside a dense layer's)."""
    return over_layers(model, lambda moe_layer: layer_offloaded_per_token(model, train, mesh, moe_layer))

def over_layers(model: ModelConfig, per_layer) -> float:
    """The sum of `per_layer(moe_layer)` over the decoder layers: dense layers' and MoE layers'."""
    moe = moe_shape(model)
    n_moe = moe.moe_layers if moe else 0
    dense = model.num_layers - n_moe
    return (dense * per_layer(False) if dense else 0.0) + (n_moe * per_layer(True) if n_moe else 0.0)

def score_bytes(train: TrainConfig) -> tuple[int, int]:
    """Bytes per score of the dot product's q k^T (float32 with float32_qk_product) and of the softmax's logits
    (float32 with either switch), else the compute dtype: MaxText's apply_attention_dot."""
    c = DTYPE_BYTES[train.compute_dtype]
    product = 4 if train.float32_qk_product else c
    return product, 4 if train.float32_logits else product

def _softcapped(model: ModelConfig) -> bool:
    return model.attn_logit_softcap is not None

def layer_kinds(model: ModelConfig) -> tuple[bool, ...]:
    """The kinds of decoder layer the model has, as `moe_layer` flags: (False,), (True,) or both."""
    moe = moe_shape(model)
    if moe is None:
        return (False,)
    return tuple(kind for kind, n in ((False, moe.dense_layers), (True, moe.moe_layers)) if n)
