"""FP8 training recipes: what each of MaxText's FP8 `quantization` values does to the decoder layers' matmuls, and
which chips multiply in FP8. The model (models/layers/fp8.py) builds the recipe from this table and perfmodel prices
it from the same table.

Every recipe quantizes what MaxText quantizes: the decoder layers' projections (q, k, v, out, the MLP's, MLA's,
an MoE's router and its capacity einsums). Attention's own products (scores, context), the logits, norms and the
rest stay in the compute dtype. The formats, scales and what the backward multiplies, per MaxText's source
(src/maxtext/layers/quantizations.py, configs/base.yml) and the libraries it calls:

- `fp8` (MaxText's default path): flax's Fp8DirectDotGeneralOp / Fp8Einsum (flax/linen/fp8_ops.py). Delayed
  scaling: one scale per tensor (the input, the kernel, the output gradient), each from the max of a 1024-step amax
  history; e4m3 operands forward, the output gradient e5m2 in both backward products, which reuse the forward's
  e4m3 operands. The scales and histories are state, updated each step.
- `aqt_fp8`: AQT config_v4(fwd_bits="e4m3", dlhs_bits=None, drhs_bits=None): the forward only, e4m3 with a scale
  per channel (absmax over the contraction) computed from the operands themselves (current scaling); the backward
  in the compute dtype.
- `aqt_fp8_full`: AQT config_v4 with e4m3 forward, e5m2 gradients, every scale per tensor ("per_tensor"
  calib_shared_axes), current scaling, no stochastic rounding, the backward requantizing its operands from the
  compute dtype (dlhs/drhs_use_fwd_quant=False: per tensor, the same values the forward had).
- `fp8_full` with use_qwix_quantization=true (MaxText's Qwix path; the recipe of the TPU7x FP8 runs): Qwix's
  dot_general_qt with e4m3 weights and activations, e5m2 gradients, absmax scales per channel computed from the
  operands; the backward multiplies the forward's e4m3 operands, their scales moved onto the gradient before it is
  quantized (Qwix's scale shifting).
- `fp8_gpu` with use_qwix_quantization=true: Qwix's NvidaFp8Provider, which wraps the same flax ops as `fp8`
  (Fp8DirectDotGeneralOp for dot_general, Fp8Einsum for einsums): `fp8`'s recipe.
- `te_fp8_delayedscaling`, `te_fp8_currentscaling`, `te_mxfp8`: Transformer Engine's DelayedScaling (HYBRID:
  e4m3 forward, e5m2 gradients; amax history 1024, max, margin 0), Float8CurrentScaling (HYBRID, one scale per
  tensor from the tensor itself) and MXFP8BlockScaling (E4M3 throughout, a power-of-two E8M0 scale per 32
  elements along the contraction: jax.nn.scaled_dot_general's "mxfp8", which XLA:GPU runs as cuDNN's block-scaled
  GEMM on Blackwell). maxperf builds each recipe's numerics with jax; MaxText runs them through TE's kernels (its
  fused cast-transpose and cuBLASLt GEMMs), which maxperf does not install.

Not built: `nanoo_fp8` (AMD MI300's e4m3fnuz / e5m2fnuz formats; maxperf's catalog has no AMD GPU), te_nvfp4 (FP4),
`intmp` and the other Qwix values (fp8, fp8_e4m3, fp8_e5m2, fp8_nanoo with use_qwix_quantization=true).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from maxperf.spec.errors import MaxperfError
from maxperf.spec.grouped_matmul import capacity
from maxperf.spec.logical_axes import split
from maxperf.spec.params import param_arrays

E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"
HISTORY = 1024  # flax's Fp8DotGeneralBase.amax_history_length and TE DelayedScaling's amax_history_len defaults
MX_BLOCK = 32  # MXFP8: elements per E8M0 scale (OCP MX spec v1.0; jax's get_scaled_dot_general_config("mxfp8"))


class Scaling(enum.StrEnum):
    DELAYED = "delayed"  # scales from an amax history of earlier steps, kept in the state
    CURRENT = "current"  # scales from the operand itself, every step
    BLOCK = "block"  # a power-of-two scale per MX_BLOCK elements along the contraction


class Granularity(enum.StrEnum):
    TENSOR = "tensor"  # one scale per operand
    CHANNEL = "channel"  # one scale per row of the activations, per output column of the weights
    BLOCK = "block"


@dataclass(frozen=True)
class Fp8Recipe:
    """What one FP8 value does to a quantized matmul y = x W."""

    name: str  # MaxText's `quantization` value
    scaling: Scaling
    granularity: Granularity
    forward: str = E4M3  # x and W in the forward
    # the output gradient's format in the input gradient (dy W^T) and the weight gradient (x^T dy); None: the
    # backward's two products in the compute dtype
    gradient: str | None = E5M2
    # the backward multiplies the forward's FP8 operands (transposed where the product wants them so); False: it
    # quantizes x and W again from the compute dtype along the backward's contraction
    reuses_forward: bool = True
    history: int = 0  # delayed scaling: amax history length
    block: int = 0  # block scaling: elements per scale
    qwix: bool = False  # MaxText builds it with Qwix (use_qwix_quantization=true)
    blackwell: bool = False  # only Blackwell GPUs have its GEMM (block-scaled MXFP8)
    source: str = ""

    @property
    def state_scales(self) -> int:
        """Scales (each with its amax history) kept in the state per quantized matmul: x's, W's, dy's."""
        return 3 if self.scaling is Scaling.DELAYED else 0

    @property
    def quantizes_backward(self) -> bool:
        return self.gradient is not None

    @property
    def caches_weights(self) -> bool:
        """Its FP8 weights (each cast, and its transpose) are made once a step and reused by every microbatch of
        gradient accumulation and of a pipeline: Transformer Engine's FP8 weight caching, driven by the
        `is_first_microbatch` flag Megatron sets on each step's first microbatch (NVIDIA/Megatron-LM#5642 describes
        the refresh of TE's FP8 weight and transpose cache there). The others cast the weights in every microbatch's
        forward."""
        return self.transformer_engine

    @property
    def transformer_engine(self) -> bool:
        """MaxText runs it through Transformer Engine's kernels (the te_* values); the others' FP8 matmuls are XLA's
        (on GPU, its GEMM rewriter's cuBLASLt FP8 GEMMs, with the quantize passes as fusions of their own)."""
        return self.name.startswith("te_")


RECIPES = {r.name: r for r in (
    Fp8Recipe("fp8", Scaling.DELAYED, Granularity.TENSOR, history=HISTORY,
              source="flax.linen Fp8DirectDotGeneralOp / Fp8Einsum"),
    Fp8Recipe("aqt_fp8", Scaling.CURRENT, Granularity.CHANNEL, gradient=None, source="AQT config_v4, forward only"),
    Fp8Recipe("aqt_fp8_full", Scaling.CURRENT, Granularity.TENSOR, reuses_forward=False,
              source="AQT config_v4, per-tensor scales"),
    Fp8Recipe("fp8_full", Scaling.CURRENT, Granularity.CHANNEL, qwix=True, source="Qwix dot_general_qt"),
    Fp8Recipe("fp8_gpu", Scaling.DELAYED, Granularity.TENSOR, history=HISTORY, qwix=True,
              source="Qwix NvidaFp8Provider: flax.linen Fp8DirectDotGeneralOp / Fp8Einsum, as fp8"),
    Fp8Recipe("te_fp8_delayedscaling", Scaling.DELAYED, Granularity.TENSOR, history=HISTORY,
              source="Transformer Engine DelayedScaling (HYBRID)"),
    Fp8Recipe("te_fp8_currentscaling", Scaling.CURRENT, Granularity.TENSOR,
              source="Transformer Engine Float8CurrentScaling (HYBRID)"),
    Fp8Recipe("te_mxfp8", Scaling.BLOCK, Granularity.BLOCK, gradient=E4M3, reuses_forward=False, block=MX_BLOCK,
              blackwell=True, source="Transformer Engine MXFP8BlockScaling (E4M3)"),
)}
BLACKWELL = ("b200", "gb200")
# What `maxperf plan` tries where quantization=auto lets it choose FP8: NVIDIA's published recipes (current scaling
# on Hopper, MXFP8 on Blackwell: Megatron-Bridge's performance summary) and the TPU7x recipes' Qwix fp8_full
# (AI-Hypercomputer tpu-recipes, training/ironwood)
PREFERRED = {"h100-sxm": "te_fp8_currentscaling", "h200": "te_fp8_currentscaling", "b200": "te_mxfp8",
             "gb200": "te_mxfp8", "tpu7x": "fp8_full", "cpu": "te_fp8_currentscaling"}


def recipe(quantization: str) -> Fp8Recipe | None:
    """The FP8 recipe a `quantization` value names; None for none and int8."""
    return RECIPES.get(str(quantization))


def has_fp8(chip) -> bool:
    """A chip multiplies in FP8 faster than in bf16 (its datasheet's FP8 peak above its bf16 one): v5p and v6e list
    FP8 at their bf16 rate (no FP8 matrix units), v4, v5e and A100 none."""
    return chip.peak_fp8_flops is not None and chip.peak_fp8_flops > chip.peak_bf16_flops


def fp8_chips() -> list[str]:
    from maxperf.spec.hardware import CHIPS

    return [name for name, chip in CHIPS.items() if has_fp8(chip)]


def contractions(logical) -> list[list[int]]:
    """The axes of a weight (by index) that its products contract: its input axes in the forward, its output axes in
    the backward's input gradient. A mixture of experts' expert axis (`exp`, or `exp_fsdp` under shard_exp_on_fsdp)
    is a batch axis of both, contracted by neither; a weight whose last axis is `embed` maps its other axes onto the
    model width (the attention's output, the MLPs' down projections), every other one the model width (or its first
    axis, a latent's up projection) onto the rest."""
    axes = [i for i, name in enumerate(logical) if name not in ("exp", "exp_fsdp")]
    if logical[axes[-1]] == "embed":
        return [axes[:-1], axes[-1:]]
    return [axes[:1], axes[1:]]


def check_blocks(quantization: str, model, mesh, train=None) -> None:
    """On GPU, a MaxperfError, one line, where a block-scaled recipe's weight is split over the mesh so that a block
    would straddle devices: each device quantizes its own shard in blocks of MX_BLOCK elements along each product's
    contraction (its contracted axes flattened, the last fastest), so an axis split within a contraction must leave a
    multiple of MX_BLOCK elements per device in the run it starts (its share times the axes after it in that
    contraction), or the scales straddle devices and XLA:GPU reshards them with an all-reduce NCCL cannot run on E8M0
    ("element type f8e8m0fnu not supported by NCCL"). Axes no product contracts (the expert axis) split freely. With
    `train`, a mixture of experts' einsum dispatch too: its combine contracts each device's experts' C slots, which
    must make whole blocks (XLA:GPU's block-scaling rewrite fails on any other)."""
    r = recipe(quantization)
    if r is None or r.scaling is not Scaling.BLOCK:
        return
    for array in param_arrays(model):
        if not array.matmul or not array.block:
            continue
        shards = split(array.shape, array.logical, mesh.axes)
        local = [size // n for size, n in zip(array.shape, shards)]
        for group in contractions(array.logical):
            for k, i in enumerate(group):
                run = local[i] * math.prod(local[j] for j in group[k + 1:])
                if shards[i] > 1 and run % MX_BLOCK:
                    raise MaxperfError(
                        f"quantization={r.name} scales every {MX_BLOCK} elements along a product's contraction, and "
                        f"this mesh splits {array.name}'s {array.logical[i]} axis ({array.shape[i]}) {shards[i]} ways, "
                        f"leaving runs of {run} contracted elements per device, not a multiple of {MX_BLOCK}; choose "
                        f"a mesh that leaves whole blocks on each device (now {mesh.shown()})")
    if train is None or not model.is_moe or train.sparse_matmul:
        return
    L, K, E, cf = train.seq_len, model.num_experts_per_tok, model.num_experts, train.capacity_factor
    C = capacity(L, K, E, cf)
    local = E // split((E,), ("activation_exp",), mesh.axes)[0]  # the combine's experts, as the dispatch splits them
    if (local * C) % MX_BLOCK:
        slots = f"capacity_factor={cf:g} x {L} tokens x {K} / {E}" if cf > 0 else f"dropless: all {L} tokens"
        raise MaxperfError(
            f"quantization={r.name} scales every {MX_BLOCK} elements along a product's contraction, and the expert "
            f"dispatch's combine contracts {local} experts x {C} slots ({slots}) per device, {local * C}, not a "
            f"multiple of {MX_BLOCK}; choose a capacity_factor, sequence length or expert axis that makes it one "
            f"(now {mesh.shown()})")


def check_chip(quantization: str, chip) -> None:
    """A MaxperfError, one line, where `chip` cannot run the recipe: no FP8 matrix units, or MXFP8 off Blackwell.
    CPU devices emulate any recipe (each FP8 product in float32 after a cast), as the tests run it."""
    r = recipe(quantization)
    if r is None or chip.kind == "cpu":
        return
    if not has_fp8(chip):
        raise MaxperfError(f"quantization={r.name} multiplies in FP8, which {chip.name} has no matrix units for; "
                           f"the chips that have them: {', '.join(fp8_chips())}")
    if r.transformer_engine and chip.kind == "tpu":
        raise MaxperfError(f"quantization={r.name} is a Transformer Engine recipe, which runs on NVIDIA GPUs only; on "
                           f"{chip.name} MaxText trains in FP8 with quantization=fp8_full use_qwix_quantization=true")
    if r.blackwell and chip.name not in BLACKWELL:
        raise MaxperfError(f"quantization={r.name} is block-scaled MXFP8, which only Blackwell GPUs multiply "
                           f"({', '.join(BLACKWELL)}); on {chip.name} use te_fp8_currentscaling or "
                           "te_fp8_delayedscaling")
