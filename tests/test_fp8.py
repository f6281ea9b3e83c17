"""FP8 training (maxperf.spec.fp8, models/layers/fp8.py): each recipe's numerics against a reference (flax's own
fp8_ops for MaxText's `fp8`, numpy for the others), the delayed recipes' scales and histories in the state and in a
checkpoint, a tiny model that learns under FP8, and the chips that refuse it."""

import dataclasses
import functools
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.linen import fp8_ops

from maxperf.models import train_step
from maxperf.models.layers import fp8, quantization
from maxperf.spec import fp8 as recipes
from maxperf.spec import gpu_targets, overrides, presets, resolve
from maxperf.spec.errors import MaxperfError
from maxperf.spec.params import param_arrays
from tests.models_util import tiny, train_losses

DIMS = (((1,), (0,)), ((), ()))  # x [M, K] @ W [K, N]
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _operands(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 64)) * 3
    w = rng.normal(size=(64, 96)) * 0.1
    g = rng.normal(size=(32, 96)) * 1e-3
    return (jnp.asarray(a, dtype) for a in (x, w, g))


def _cast(a, scale, fmt):
    """numpy: a / scale in `fmt` (clipped to its finite range), back in float32."""
    top = float(ml_dtypes.finfo(fmt).max)
    return np.clip(np.asarray(a, np.float32) / scale, -top, top).astype(fmt).astype(np.float32)


def _run(name, x, w, g):
    """The recipe's product and its two gradients (dy = g), jitted."""

    @jax.jit
    def run(x, w, g):
        y, vjp = jax.vjp(lambda a, b: fp8.dot_general(a, b, None, DIMS, recipes.RECIPES[name]), x, w)
        return (y, *vjp(g))

    return (np.asarray(v, np.float32) for v in run(x, w, g))


def test_fp8_matches_flax_bit_for_bit():
    """MaxText's quantization=fp8 is flax's Fp8DirectDotGeneralOp: the product, both gradients and the updated
    scales and amax histories equal flax's fp8_scaled_dot_general exactly, in bfloat16, from a state with history."""
    x, w, g = _operands(dtype=jnp.bfloat16)
    history = np.zeros((3, recipes.HISTORY), np.float32)
    history[:, 5] = [10.0, 0.5, 0.01]
    scales = np.array([0.7, 0.3, 0.2], np.float32)
    meta = jnp.asarray(np.concatenate([scales[:, None], history], axis=1))
    y, vjp = jax.vjp(lambda a, b, m: fp8.dot_general(a, b, m, DIMS, recipes.RECIPES["fp8"]), x, w, meta)
    dx, dw, new_meta = vjp(g)

    def flax(x, w, sx, sw, sg, hx, hw, hg):
        return fp8_ops.fp8_scaled_dot_general(
            x, w, DIMS, preferred_element_type=x.dtype, lhs_scale=sx, rhs_scale=sw, grad_scale=sg,
            lhs_amax_history=hx, rhs_amax_history=hw, grad_amax_history=hg, quantize_compute_type=x.dtype)

    args = (x, w, *(jnp.asarray(scales[i:i + 1]) for i in range(3)), *(jnp.asarray(history[i]) for i in range(3)))
    y_ref, vjp_ref = jax.vjp(flax, *args)
    ref = vjp_ref(g)
    for ours, theirs in ((y, y_ref), (dx, ref[0]), (dw, ref[1])):
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    for i in range(3):  # x's, W's and dy's rows: the new scale, the history with this step's amax in it
        np.testing.assert_array_equal(np.asarray(new_meta[i, :1]), np.asarray(ref[2 + i]))
        np.testing.assert_array_equal(np.asarray(new_meta[i, 1:]), np.asarray(ref[5 + i]))


def test_delayed_scaling_scales_by_the_history_not_the_operand():
    """The first step's scales are 1 (an empty history); its amaxes enter the history; the next step's scales are
    amax / 448 (e4m3) and amax / 57344 (e5m2) of that history."""
    x, w, g = _operands()
    meta = fp8.initial_meta(recipes.RECIPES["te_fp8_delayedscaling"], 1)[0]
    first = jax.vjp(lambda m: fp8.dot_general(x, w, m, DIMS, recipes.RECIPES["te_fp8_delayedscaling"]), meta)[1](g)[0]
    amax = [float(jnp.max(jnp.abs(a))) for a in (x, w, g)]
    np.testing.assert_allclose(first[:, 1], amax, rtol=1e-6)
    np.testing.assert_allclose(first[:, 0], 1.0)  # this step scaled by 1: the history was empty
    _, _, second = jax.vjp(lambda a, b, m: fp8.dot_general(a, b, m, DIMS, recipes.RECIPES["fp8"]), x, w, first)[1](g)
    np.testing.assert_allclose(second[:, 0], [amax[0] / 448, amax[1] / 448, amax[2] / 57344], rtol=1e-6)


def test_current_scaling_per_tensor_matches_numpy():
    """te_fp8_currentscaling (and aqt_fp8_full): one scale per operand from its own amax; the product e4m3 x e4m3,
    both gradients e5m2 x e4m3 against the forward's e4m3 operands."""
    x, w, g = _operands()
    sx, sw, sg = (float(np.max(np.abs(a))) / top for a, top in ((x, 448), (w, 448), (g, 57344)))
    qx, qw, qg = _cast(x, sx, E4M3), _cast(w, sw, E4M3), _cast(g, sg, E5M2)
    for name in ("te_fp8_currentscaling", "aqt_fp8_full"):
        y, dx, dw = _run(name, x, w, g)
        np.testing.assert_allclose(y, qx @ qw * (sx * sw), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dx, qg @ qw.T * (sg * sw), rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(dw, qx.T @ qg * (sg * sx), rtol=1e-5, atol=1e-9)
    assert not np.allclose(y, np.asarray(x) @ np.asarray(w), rtol=1e-4)  # the product did lose precision


def test_per_channel_with_scale_shifting_matches_numpy():
    """fp8_full (Qwix): a scale per row of x and per column of W; the input gradient multiplies dy by W's column
    scales, casts it to e5m2 per row, and multiplies W's e4m3 values; the weight gradient alike with x's rows."""
    x, w, g = _operands()
    x_, w_, g_ = (np.asarray(a, np.float32) for a in (x, w, g))
    sx = np.max(np.abs(x_), axis=1, keepdims=True) / 448
    sw = np.max(np.abs(w_), axis=0, keepdims=True) / 448
    qx, qw = _cast(x_, sx, E4M3), _cast(w_, sw, E4M3)
    g_in = g_ * sw  # [M, N]: W's scales along N, the input gradient's contraction
    s_in = np.max(np.abs(g_in), axis=1, keepdims=True) / 57344
    g_w = g_ * sx  # x's scales along M, the weight gradient's contraction
    s_w = np.max(np.abs(g_w), axis=0, keepdims=True) / 57344
    y, dx, dw = _run("fp8_full", x, w, g)
    np.testing.assert_allclose(y, (qx @ qw) * sx * sw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, (_cast(g_in, s_in, E5M2) @ qw.T) * s_in, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(dw, (qx.T @ _cast(g_w, s_w, E5M2)) * s_w, rtol=1e-5, atol=1e-9)


def test_forward_only_recipe_keeps_the_backward_plain():
    """aqt_fp8 quantizes the forward per channel and leaves both gradients as plain products."""
    x, w, g = _operands()
    y, dx, dw = _run("aqt_fp8", x, w, g)
    # as plain as float32 sums in another order (an e5m2 gradient would be off by percents)
    np.testing.assert_allclose(dx, np.asarray(g) @ np.asarray(w).T, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(dw, np.asarray(x).T @ np.asarray(g), rtol=1e-4, atol=1e-7)
    assert not np.allclose(y, np.asarray(x) @ np.asarray(w), rtol=1e-4)


def test_mxfp8_block_scales_follow_the_rows_where_one_scale_cannot():
    """te_mxfp8 scales every 32 elements: rows of magnitudes 1e-4 to 1e2 keep their precision, where one scale per
    tensor flushes the small rows (e4m3's smallest subnormal is 2^-9 of its scale's unit)."""
    x, w, g = _operands()
    x = x * jnp.logspace(-4, 2, x.shape[0])[:, None]
    exact = np.asarray(x) @ np.asarray(w)
    rel = {}
    for name in ("te_mxfp8", "te_fp8_currentscaling"):
        y = next(_run(name, x, w, g))
        rel[name] = np.max(np.abs(y - exact).sum(1) / np.abs(exact).sum(1))  # the worst row
    assert rel["te_mxfp8"] < 0.1 and rel["te_fp8_currentscaling"] > 0.5, rel


def test_mxfp8_refuses_a_contraction_off_its_block():
    x, w, g = _operands()
    with pytest.raises(MaxperfError, match="multiple of 32"):
        _run("te_mxfp8", x[:, :48], w[:48], g)


def test_state_holds_each_layers_scales_and_histories():
    """Under a delayed recipe the state has, per stack, [layers, matmuls, 3, 1 + 1024]: the tiny preset's 7
    projections per layer (q, k, v, out, gate, up, down); the current-scaling recipes keep none."""
    _, spec = tiny("quantization=fp8", devices=1)
    assert spec.state["fp8"]["layers"].shape == (2, 7, 3, 1 + recipes.HISTORY)
    _, current = tiny("quantization=te_fp8_currentscaling", devices=1)
    assert "fp8" not in current.state


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_step_writes_the_amaxes_into_the_state(accumulation):
    """After one step every matmul's history holds its x, W and dy amaxes (one per microbatch) and its scales are
    the last microbatch's (1 from the empty history, else the earlier microbatches' amaxes / 448 or 57344); after a
    second step too."""
    _, spec = tiny("quantization=te_fp8_delayedscaling", f"grad_accum_steps={accumulation}", devices=2)
    step = train_step.jit_step(spec)
    state = train_step.init_state(spec, seed=0)
    batch = train_step.synthetic_batch(spec, seed=1)
    tops = np.array([448.0, 448.0, 57344.0])  # e4m3 for x and W, e5m2 for dy
    with jax.set_mesh(spec.mesh):
        state, _ = step(state, batch)
        meta = np.asarray(state["fp8"]["layers"])
        assert np.all(np.sum(meta[..., 1:] > 0, axis=-1) == accumulation)
        if accumulation == 1:  # the step scaled by 1: its history was empty
            np.testing.assert_allclose(meta[..., 0], 1.0)
        else:  # the second microbatch scaled by the first's amaxes (flax's window keeps the older one last)
            np.testing.assert_allclose(meta[..., 0], meta[..., -1] / tops, rtol=1e-6)
        state, _ = step(state, batch)
    after = np.asarray(state["fp8"]["layers"])
    # the last microbatch scaled by the amaxes before its own (written first, at history index 0)
    np.testing.assert_allclose(after[..., 0], after[..., 2:].max(-1) / tops, rtol=1e-6)


@pytest.mark.slow
def test_checkpoint_keeps_the_fp8_state(tmp_path):
    """`run --checkpoint` saves the whole state: the scales and histories come back as they were saved."""
    from maxperf.profiler import checkpoints

    _, spec = tiny("quantization=fp8", devices=1)
    state = train_step.init_state(spec, seed=0)
    with jax.set_mesh(spec.mesh):
        state, _ = train_step.jit_step(spec)(state, train_step.synthetic_batch(spec, seed=1))
    checkpoints.save(tmp_path / "ckpt", state)
    restored = checkpoints.restore(tmp_path / "ckpt", spec)
    saved = np.asarray(state["fp8"]["layers"])
    assert np.any(saved[..., 1:] > 0)
    np.testing.assert_array_equal(np.asarray(restored["fp8"]["layers"]), saved)


def test_einsum_in_a_scope_runs_the_recipe():
    """The layers' einsums under an FP8 scope are the recipe's dot_general; outside, plain."""
    x, w, _ = _operands()
    r = recipes.RECIPES["te_fp8_currentscaling"]
    with quantization.scope(r, None):
        y = quantization.einsum("MK,KN->MN", x, w)
    np.testing.assert_array_equal(y, fp8.dot_general(x, w, None, DIMS, r))
    np.testing.assert_array_equal(quantization.einsum("MK,KN->MN", x, w), jnp.einsum("MK,KN->MN", x, w))


LEARNING = ("learning_rate=1e-2", "compute_dtype=bfloat16")


@functools.cache
def _bf16_losses() -> tuple[float, ...]:
    _, plain = tiny(*LEARNING, devices=2)
    return tuple(train_losses(plain, 30)[0])


@pytest.mark.slow
@pytest.mark.parametrize("value", ["fp8", "te_fp8_currentscaling", "fp8_full", "te_mxfp8"])
def test_tiny_model_learns_under_fp8_as_with_bf16(value):
    """30 steps on one batch: the loss falls below half its start, and ends within 50% of bf16's."""
    qwix = ["use_qwix_quantization=true"] if value == "fp8_full" else []
    _, spec = tiny(*LEARNING, f"quantization={value}", *qwix, devices=2)
    losses, _ = train_losses(spec, 30)
    bf16 = _bf16_losses()
    assert losses[-1] < 0.5 * losses[0], losses
    assert losses[-1] < 1.5 * bf16[-1] + 1e-3, (losses[-1], bf16[-1])


@pytest.mark.parametrize("topology, chip", [("v5p-8", "tpu-v5p"), ("v5e-8", "tpu-v5e"),
                                            ("a100-8", "a100-80gb"), ("v6e-8", "tpu-v6e")])
def test_chips_without_fp8_refuse_it_naming_those_with_it(topology, chip):
    with pytest.raises(MaxperfError) as e:
        resolve(topology, "tiny", ["quantization=te_fp8_currentscaling"])
    assert chip in str(e.value) and "h100-sxm, h200, b200, gb200" in str(e.value) and "tpu7x" in str(e.value)


def test_mxfp8_is_refused_off_blackwell():
    with pytest.raises(MaxperfError, match="Blackwell"):
        resolve("h100-8", "tiny", ["quantization=te_mxfp8"])
    assert str(resolve("b200-8", "tiny", ["quantization=te_mxfp8", "d_model=256", "d_ff=512"]).train.quantization) \
        == "te_mxfp8"


def test_cli_fp8_on_v5p_exits_2_in_one_line():
    run = subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate", "--topology", "v5p-8", "--model", "tiny",
                          "quantization=fp8"], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "tpu-v5p" in lines[0] and "h100-sxm" in lines[0] and "Traceback" not in run.stderr


def test_qwix_values_need_qwix_and_qwix_builds_fp8_full_and_fp8_gpu_only():
    model = presets.get("tiny")
    for value in ("fp8_full", "fp8_gpu"):
        with pytest.raises(MaxperfError, match=f"quantization={value} is MaxText's Qwix recipe: set "
                                               "use_qwix_quantization=true"):
            overrides.apply(model, [f"quantization={value}"])
        qwix = overrides.apply(model, [f"quantization={value}", "use_qwix_quantization=true"])
        assert qwix.train.use_qwix_quantization
    with pytest.raises(MaxperfError, match="fp8_full and fp8_gpu only"):
        overrides.apply(model, ["quantization=fp8", "use_qwix_quantization=true"])


def test_qwix_fp8_gpu_is_flaxs_fp8_recipe():
    """MaxText's Qwix fp8_gpu provider wraps flax's Fp8DirectDotGeneralOp and Fp8Einsum, as quantization=fp8 does: the
    same recipe, the same estimate."""
    from maxperf import perfmodel

    ours, flax = recipes.RECIPES["fp8_gpu"], recipes.RECIPES["fp8"]
    assert (ours.scaling, ours.granularity, ours.forward, ours.gradient, ours.reuses_forward, ours.history) == (
        flax.scaling, flax.granularity, flax.forward, flax.gradient, flax.reuses_forward, flax.history)
    qwix = perfmodel.estimate(resolve("h100-8", "tiny", ["quantization=fp8_gpu", "use_qwix_quantization=true"]))
    plain = perfmodel.estimate(resolve("h100-8", "tiny", ["quantization=fp8"]))
    assert (qwix.step_time_s, qwix.memory_per_device_bytes) == (plain.step_time_s, plain.memory_per_device_bytes)


def test_auto_is_bf16_outside_plan_and_bf16_is_none():
    req = resolve("h100-8", "tiny", ["quantization=auto"])
    assert str(req.train.quantization) == "none" and any("maxperf plan" in w for w in req.warnings)
    assert str(resolve("h100-8", "tiny", ["quantization=bf16"]).train.quantization) == "none"


# Compiled for the targets without their hardware: the optimized HLO's matmuls by operand types
# (aot.hlo_cost.matmul_flops_by_operands). A step whose quantized matmuls fell back to bf16 multiplies more than the
# logits in bf16, which these tests refuse.
NEEDS_LIBTPU = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install 'maxperf[tpu]')")
NEEDS_CUDA_PLUGIN = pytest.mark.skipif(gpu_targets.plugin_library() is None,
                                       reason="the CUDA plugin is not installed (pip install 'maxperf[gpu]')")
T, D, V = 256, 64, 256  # tokens per device (B 1 x L 256), the tiny preset's width and vocabulary
PROJECTIONS = 2 * T * 36864 * 2  # one pass over the 2 layers' q, k, v, out, gate, up, down weights (36864 a layer)


def _compiled_matmuls(topology: str, value: str, *widths: str) -> dict[str, float]:
    from maxperf.aot import hlo_cost, targets

    words = ["compute_dtype=bfloat16", "attention=flash", f"seq_len={T}", "per_device_batch_size=1",
             f"quantization={value}", *(["use_qwix_quantization=true"] if value == "fp8_full" else []), *widths]
    req = resolve(topology, "tiny", words)
    if req.topology.platform == "tpu":
        targets.quiet_libtpu()
    mesh = targets.jax_mesh(req.topology, req.mesh)
    spec = train_step.abstract_step(req.model, req.train, mesh)
    with jax.set_mesh(mesh):
        compiled = train_step.jit_step(spec).lower(spec.state, spec.batch).compile(
            targets.compiler_options(req.topology) or None)
    cost = hlo_cost.hlo_flops(compiled.as_text())
    assert not cost.unhandled_custom_calls, cost.unhandled_custom_calls
    return cost.matmul_flops_by_operands


@pytest.mark.slow
@pytest.mark.parametrize("topology, value", [
    pytest.param("h100-8", "te_fp8_currentscaling", marks=NEEDS_CUDA_PLUGIN),
    pytest.param("h100-8", "fp8", marks=NEEDS_CUDA_PLUGIN),
    pytest.param("gb200-72", "te_fp8_currentscaling", marks=NEEDS_CUDA_PLUGIN),
    pytest.param("tpu7x-8", "fp8_full", marks=NEEDS_LIBTPU),
])
def test_compiled_step_multiplies_the_projections_in_fp8(topology, value):
    """Only the logits' three products (forward, input and weight gradient) stay bf16 x bf16 (attention runs in
    its flash kernel); the projections' two backward products are e5m2 x e4m3, exactly 2 passes over their weights,
    and their forward (with full remat's recomputation) e4m3 x e4m3."""
    flops = _compiled_matmuls(topology, value)
    assert flops.pop("bf16 x bf16") == 3 * 2 * T * D * V, flops
    gradient = sum(f for types, f in flops.items() if "f8e5m2" in types)
    forward = flops.pop("f8e4m3fn x f8e4m3fn")
    assert gradient == 2 * PROJECTIONS and forward >= PROJECTIONS, flops
    assert all("f8e5m2" in types for types in flops), flops


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
@pytest.mark.parametrize("topology", ["b200-8", "gb200-72"])
def test_compiled_mxfp8_step_runs_cudnn_block_scaled_gemms(topology):
    """te_mxfp8 on Blackwell: every projection product an E4M3 block-scaled GEMM (cuDNN's, which pads small widths
    to its tiles: at least the three passes' FLOPs), only the logits' in bf16. The tiny model is widened so that
    FSDP over 8 leaves whole 32-element blocks of D on each device (check_blocks refuses the tiny widths)."""
    D8, F8 = 256, 512
    flops = _compiled_matmuls(topology, "te_mxfp8", f"d_model={D8}", f"d_ff={F8}")
    model = overrides.apply(presets.get("tiny"), [f"d_model={D8}", f"d_ff={F8}"]).model
    projections = 2 * T * 2 * sum(math.prod(a.shape) for a in param_arrays(model) if a.matmul and a.block)
    assert flops.pop("bf16 x bf16") == 3 * 2 * T * D8 * V, flops
    assert set(flops) == {"f8e4m3fn x f8e4m3fn"} and flops["f8e4m3fn x f8e4m3fn"] >= 3 * projections, flops


def test_mxfp8_refuses_a_mesh_that_splits_a_weight_below_a_block():
    """tiny's D=64 over fsdp=8 leaves 8 elements of each weight's D on a device, a quarter of an MXFP8 block: one line
    naming the weight, the split and the mesh."""
    with pytest.raises(MaxperfError, match=r"splits q's embed axis \(64\) 8 ways, leaving runs of 8 contracted "
                                           r"elements per device, not a multiple of 32.*fsdp=8"):
        resolve("b200-8", "tiny", ["quantization=te_mxfp8"])
    assert resolve("b200-8", "tiny", ["quantization=te_mxfp8", "d_model=256", "d_ff=512"]).mesh.axes["fsdp"] == 8


def test_mxfp8_splits_heads_and_experts_which_no_product_contracts_alone():
    """Blocks run along a product's contraction: tensor parallelism splits q's heads, whose head_dim (128) stays whole
    within each device's run of the backward's (heads, head_dim) contraction, and expert parallelism the experts'
    own axis, which no product contracts; both are NVIDIA's Blackwell MXFP8 layouts. A mixture of experts' einsum
    dispatch contracts each device's experts' capacity slots, refused where they make no whole block."""
    assert resolve("b200-8", "llama3-8b", ["quantization=te_mxfp8",
                                           "ici_tensor_parallelism=8"]).mesh.axes["tensor"] == 8
    moe = ["quantization=te_mxfp8", "ici_expert_parallelism=8", "sparse_matmul=false", "capacity_factor=1.25",
           "max_target_length=4096"]
    assert resolve("b200-8", "qwen3-30b-a3b", moe).mesh.axes["expert"] == 8  # 16 experts x 320 slots a device
    # the experts' own axis sharded over fsdp instead (shard_exp_on_fsdp): a batch axis still, whatever its name
    fsdp = [w for w in moe if not w.startswith("ici_expert")] + ["shard_exp_on_fsdp=true", "ici_fsdp_parallelism=8"]
    assert resolve("b200-8", "qwen3-30b-a3b", fsdp).mesh.axes["fsdp"] == 8
    with pytest.raises(MaxperfError, match=r"combine contracts 4 experts x 20 slots \(capacity_factor=1.25 x 256 "
                                           r"tokens x 2 / 32\) per device, 80, not a multiple of 32.*expert=8"):
        resolve("b200-8", "tiny-moe", ["quantization=te_mxfp8", "d_model=256", "d_ff=512", "num_experts=32",
                                       "ici_expert_parallelism=8", "sparse_matmul=false", "capacity_factor=1.25",
                                       "seq_len=256"])


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
@pytest.mark.parametrize("words", [
    ["ici_tensor_parallelism=8", "num_heads=8", "num_kv_heads=8", "head_dim=32"],
    ["model=tiny-moe", "num_experts=32", "sparse_matmul=false", "capacity_factor=1.25"],
    ["model=tiny-moe", "num_experts=32", "sparse_matmul=false", "capacity_factor=1.25", "ici_expert_parallelism=8"],
], ids=["tensor8", "moe-fsdp8", "moe-expert8"])
def test_mxfp8_compiles_under_tensor_and_expert_parallelism(words):
    """te_mxfp8 for b200-8 under tensor parallelism and a mixture of experts' einsum dispatch, with and without an
    expert axis, compiles (the dispatch's and combine's operands split their batch axis alike, which the partitioner
    of jax's block-scaled matmul requires) and multiplies its projections in E4M3."""
    model = "tiny-moe" if "model=tiny-moe" in words else "tiny"
    words = [w for w in words if not w.startswith("model=")]
    req = resolve("b200-8", model, ["compute_dtype=bfloat16", "attention=flash", "seq_len=2048",
                                    "per_device_batch_size=1", "quantization=te_mxfp8", "d_model=256", "d_ff=512",
                                    *words])
    from maxperf.aot import hlo_cost, targets

    mesh = targets.jax_mesh(req.topology, req.mesh)
    spec = train_step.abstract_step(req.model, req.train, mesh)
    with jax.set_mesh(mesh):
        compiled = train_step.jit_step(spec).lower(spec.state, spec.batch).compile(
            targets.compiler_options(req.topology) or None)
    flops = hlo_cost.hlo_flops(compiled.as_text()).matmul_flops_by_operands
    assert set(flops) == {"f8e4m3fn x f8e4m3fn", "bf16 x bf16"}, flops
    assert flops["f8e4m3fn x f8e4m3fn"] > 10 * flops["bf16 x bf16"], flops


# perfmodel: FP8 matmuls at the chip's FP8 peak, the quantize passes, what stays bf16, the state's bytes


def _estimate(topology: str, *words: str):
    from maxperf.perfmodel import estimate

    qwix = ["use_qwix_quantization=true"] if "quantization=fp8_full" in words else []
    return estimate(resolve(topology, "llama3-8b", ["per_device_batch_size=4", "seq_len=4096", *words, *qwix]))


def _rows(topology: str, *words: str) -> dict:
    return {r.name: r for r in _estimate(topology, *words).breakdown}


@pytest.mark.parametrize("topology, value", [("h100-8", "te_fp8_currentscaling"), ("b200-8", "te_mxfp8"),
                                             ("tpu7x-16", "fp8_full"), ("h100-8", "fp8")])
def test_perfmodel_runs_the_projections_at_the_fp8_peak(topology, value):
    """The datasheets' FP8 peaks are about twice the bf16 ones: a compute-bound projection's three products take
    that much less time (times FP8 matmuls' efficiency), for as many FLOPs; attention and the logits stay bf16, as
    long as before; the quantize passes are a row of their own."""
    from maxperf.perfmodel import work
    from maxperf.spec.hardware import CHIPS

    chip = CHIPS[resolve(topology, "tiny").topology.chip]
    key = work.fp8_key(chip.kind, recipes.recipe(value))
    speedup = chip.peak_fp8_flops / chip.peak_bf16_flops * work.SHIPPED.fp8_efficiency[key]
    assert 1.9 < chip.peak_fp8_flops / chip.peak_bf16_flops < 2.1
    bf16, fp8_rows = _rows(topology), _rows(topology, f"quantization={value}")
    assert fp8_rows["mlp down"].flops == bf16["mlp down"].flops
    # no faster than the chip's best measured share of the FP8 peak (matmul_ceiling)
    from maxperf.perfmodel.chips import matmul_ceiling

    share = bf16["mlp down"].flops / bf16["mlp down"].seconds / chip.peak_bf16_flops
    ceiling = matmul_ceiling(chip) * chip.peak_fp8_flops / chip.peak_bf16_flops
    speedup = min(speedup, ceiling / share)
    assert fp8_rows["mlp down"].seconds == pytest.approx(bf16["mlp down"].seconds / speedup, rel=1e-9)
    for unchanged in ("unembedding", "attention (flash kernel)"):
        assert fp8_rows[unchanged].seconds == bf16[unchanged].seconds
    assert fp8_rows["fp8 quantize"].seconds > 0 and "fp8 quantize" not in bf16


@pytest.mark.parametrize("topology, value", [("b200-1", "te_mxfp8"), ("h100-1", "te_fp8_currentscaling")])
def test_an_fp8_matmul_runs_at_no_more_of_the_fp8_peak_than_the_best_measured_matmul(topology, value):
    """The FP8 efficiency fitted on Transformer Engine's rows (above 1 relative to bf16's share; here 2, whatever
    the fit gives) does not lift a wide matmul past the share of its peak the chip's best measured matmul reaches: an
    FP8 GEMM of a very wide model runs at that ceiling of the FP8 peak, not above the datasheet."""
    import dataclasses

    from maxperf.perfmodel import estimate, work
    from maxperf.perfmodel.chips import matmul_ceiling
    from maxperf.spec.hardware import CHIPS

    request = resolve(topology, "llama3-8b", ["d_model=131072", "d_ff=524288", "num_heads=128", "head_dim=1024",
                                              "num_kv_heads=128", "num_layers=1", "per_device_batch_size=128",
                                              f"quantization={value}", "remat_policy=none"])
    chip = CHIPS[request.topology.chip]
    constants = dataclasses.replace(work.SHIPPED, fp8_efficiency={**work.SHIPPED.fp8_efficiency, "gpu": 2.0})
    assert work.SHIPPED.fraction(chip) * 2.0 > matmul_ceiling(chip)  # uncapped, it would run above the ceiling
    rows = {r.name: r for r in estimate(request, constants=constants).breakdown}
    rate = rows["mlp up and gate"].flops / rows["mlp up and gate"].seconds
    assert rate == pytest.approx(matmul_ceiling(chip) * chip.peak_fp8_flops, rel=1e-6)


def test_gpu_fp8_matmuls_are_priced_by_the_kernels_that_run_them():
    """On a GPU Transformer Engine's recipes (te_*) take the efficiency fitted on NVIDIA's rows, which run TE's
    kernels; the recipes whose FP8 matmuls XLA builds (flax's, Qwix's, AQT's) the one measured for XLA's FP8 step;
    a TPU's recipes its own. The estimate says which it used."""
    from maxperf.perfmodel import work

    assert work.fp8_key("gpu", recipes.recipe("te_fp8_currentscaling")) == "gpu"
    assert work.fp8_key("gpu", recipes.recipe("te_mxfp8")) == "gpu"
    for value in ("fp8", "fp8_gpu", "aqt_fp8", "aqt_fp8_full"):
        assert work.fp8_key("gpu", recipes.recipe(value)) == "gpu xla"
    assert work.fp8_key("tpu", recipes.recipe("fp8_full")) == "tpu"
    assert work.SHIPPED.fp8_efficiency["gpu xla"] < work.SHIPPED.fp8_efficiency["gpu"]
    te, xla = _rows("h100-8", "quantization=te_fp8_currentscaling"), _rows("h100-8", "quantization=fp8")
    ratio = work.SHIPPED.fp8_efficiency["gpu"] / work.SHIPPED.fp8_efficiency["gpu xla"]
    assert xla["mlp down"].seconds == pytest.approx(te["mlp down"].seconds * ratio, rel=1e-9)
    from maxperf.perfmodel.estimate import estimate

    notes = " ".join(estimate(resolve("h100-8", "tiny", ["quantization=fp8"])).assumptions)
    assert "measured: XLA's FP8 GEMMs" in notes
    # the compiled step of a TE recipe is XLA's, which the request says
    said = [n for n in resolve("h100-8", "tiny", ["quantization=te_fp8_currentscaling"]).warnings if "Transformer" in n]
    assert len(said) == 1 and "priced at the rate of TE's kernels" in said[0] and "XLA's FP8 matmuls" in said[0]
    # MXFP8's compiled products are jax's block-scaled ones, not the per-tensor XLA step measured on an H200
    (mx,) = [n for n in resolve("b200-8", "llama3-8b", ["quantization=te_mxfp8"]).warnings if "Transformer" in n]
    assert "block-scaled MXFP8 products (a power-of-two scale per 32 elements" in mx and "H200" not in mx
    assert not [n for n in resolve("h100-8", "tiny", ["quantization=fp8"]).warnings if "Transformer" in n]


def test_perfmodel_forward_only_recipe_keeps_the_backward_at_the_bf16_rate():
    """aqt_fp8 quantizes the forward only: of a projection's three products one runs at twice the rate."""
    from maxperf.perfmodel import work

    speedup = 1979 / 989 * work.SHIPPED.fp8_efficiency["gpu xla"]  # h100-sxm's datasheet peaks; AQT's ops are XLA's
    bf16 = _rows("h100-8")["mlp down"].seconds
    assert _rows("h100-8", "quantization=aqt_fp8")["mlp down"].seconds == pytest.approx(
        bf16 * (1 / 3 / speedup + 2 / 3), rel=1e-9)


def test_perfmodel_delayed_scaling_reads_each_operand_once():
    """Current scaling reads an operand for its amax and again to cast it (2 x 2 + 1 bytes per bf16 element);
    delayed scaling casts with the scale it has (2 + 1): its quantize passes move less."""
    current = _rows("h100-8", "quantization=te_fp8_currentscaling")["fp8 quantize"].bytes
    delayed = _rows("h100-8", "quantization=te_fp8_delayedscaling")["fp8 quantize"].bytes
    assert delayed < current < 2 * delayed


def test_transformer_engine_casts_each_weight_once_a_step_and_xlas_recipes_every_microbatch():
    """Transformer Engine keeps a weight's FP8 cast and transpose from the first microbatch of a step for the others
    (Megatron's is_first_microbatch): with 4 microbatches of accumulation its quantize passes move 4 x the
    activations' bytes and the weights' once, the weights' being every quantized projection's K x N of the 32 layers
    at a current-scaling cast (2 x 2 + 1 bytes) and a transpose (FP8_TRANSPOSE_BYTES); flax's recipe, which XLA
    builds inside each microbatch, moves 4 x all of it."""
    from maxperf.perfmodel import work

    def moved(value: str, accumulation: int) -> float:
        return _rows("h100-8", f"quantization={value}", f"grad_accum_steps={accumulation}")["fp8 quantize"].bytes

    D, H, K, Dh, F, N = 4096, 32, 8, 128, 14336, 32  # llama3-8b
    weights = N * (D * (2 * H * Dh + 2 * K * Dh) + 3 * D * F)
    once, four = moved("te_fp8_currentscaling", 1), moved("te_fp8_currentscaling", 4)
    activations = (four - once) / 3
    assert once - activations == pytest.approx(weights * (2 * 2 + 1 + work.FP8_TRANSPOSE_BYTES["gpu"]), rel=1e-9)
    assert moved("fp8", 4) == pytest.approx(4 * moved("fp8", 1), rel=1e-9)


@pytest.mark.parametrize("preset, words", [("tiny", ()), ("tiny-moe", ("sparse_matmul=false", "capacity_factor=1.25")),
                                           ("tiny", ("mtp_num_layers=1",)), ("tiny-mla", ())])
def test_perfmodel_counts_the_state_the_model_keeps(preset, words):
    """The scales and amax histories perfmodel counts are the bytes of the state the train step initializes."""
    from maxperf.perfmodel.memory import fp8_state_bytes

    cfg = overrides.apply(presets.get(preset), ["quantization=fp8", *words])
    state = train_step.fp8_state(cfg.model, cfg.train)
    assert fp8_state_bytes(cfg.model, cfg.train) == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def test_estimate_holds_the_fp8_state_in_memory():
    est = _estimate("h100-8", "quantization=fp8")
    assert est.memory.fp8_state == pytest.approx(32 * 7 * 3 * (1 + recipes.HISTORY) * 4)
    assert _estimate("h100-8", "quantization=te_fp8_currentscaling").memory.fp8_state == 0


# plan: precision searched only where quantization=auto lets it choose


def test_plan_searches_bf16_and_the_chips_fp8_recipe_under_auto():
    """quantization=auto on H100 doubles the candidates (bf16 and Transformer Engine's current scaling), each FP8
    candidate faster than its bf16 twin, and the winner's command names its recipe; without auto, bf16 alone."""
    from maxperf.search import plan

    req = plan.PlanRequest("llama3-8b", "h100-8", per_device_batch=2, pins=("attention=flash",
                                                                            "remat_policy=full"))
    bf16 = plan.search(req)
    auto = plan.search(dataclasses.replace(req, pins=(*req.pins, "quantization=auto")))
    assert {c.quantization for c in bf16.candidates} == {"none"}
    assert len(auto.candidates) == 2 * len(bf16.candidates)
    pairs = {(c.mesh_shown(), c.per_device_batch_size): c for c in bf16.fitting}
    faster = [c.step_time_s < pairs[(c.mesh_shown(), c.per_device_batch_size)].step_time_s
              for c in auto.fitting if c.quantization == "te_fp8_currentscaling"]
    assert faster and all(faster)
    assert auto.winner.quantization == "te_fp8_currentscaling"
    assert "quantization=te_fp8_currentscaling" in auto.command(auto.winner)["maxperf"]
    assert "quantization=te_fp8_currentscaling" in auto.command(auto.winner)["maxtext"]


def test_plan_under_auto_keeps_bf16_on_a_chip_without_fp8_and_qwix_on_tpu7x():
    from maxperf.search import candidates, plan

    v5p = plan.search(plan.PlanRequest("tiny", "v5p-8", per_device_batch=1, pins=("quantization=auto",)))
    assert {c.quantization for c in v5p.candidates} == {"none"}
    words = candidates.precision_words("fp8_full")
    assert words == ("quantization=fp8_full", "use_qwix_quantization=true")
    tpu7x = plan.search(plan.PlanRequest("tiny", "tpu7x-8", per_device_batch=1, pins=("quantization=auto",
                                                                                       "remat_policy=full")))
    assert {c.quantization for c in tpu7x.candidates} == {"none", "fp8_full"}
    with pytest.raises(MaxperfError, match="no matrix units"):
        plan.search(plan.PlanRequest("tiny", "v5p-8", per_device_batch=1, pins=("quantization=fp8",)))


def test_plan_leaves_out_mxfp8_on_meshes_that_split_a_weight_below_a_block():
    """tiny's D=64 on b200-8: MXFP8 only where D stays whole or splits into 32s (fsdp <= 2 along it)."""
    from maxperf.search import plan

    found = plan.search(plan.PlanRequest("tiny", "b200-8", per_device_batch=1, pins=("quantization=auto",
                                                                                      "remat_policy=full",
                                                                                      "attention=flash")))
    mx = [c for c in found.candidates if c.quantization == "te_mxfp8"]
    assert mx and len(mx) < len(found.candidates) / 2
    for c in mx:
        resolve("b200-8", "tiny", c.overrides())  # each one resolves: check_blocks passes it


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
def test_nvidias_llama3_8b_fp8_layout_compiles_for_h100_8_and_fits():
    """NVIDIA's Megatron-Bridge Llama 3 8B FP8 run on 8 H100s as bench/published writes it (its FSDP, micro batch 1
    x 16, current scaling, no matmul recomputed: remat_policy=minimal_with_context, which keeps what Transformer
    Engine's layers keep): the compiler fits it, and the analytical memory agrees within 10%. Under
    remat_policy=none, JAX's every residual, the same step compiles to 89.6 GiB."""
    import csv

    from maxperf.search import memory_fit

    rows = csv.DictReader(open(Path(__file__).resolve().parents[1] / "bench" / "published" / "maxperf_mapping.csv",
                               newline=""))
    row = next(r for r in rows if r["id"] == "nemo-dgx-h100-llama3-8b-fp8-cs-8gpu")
    assert (row["topology"], row["maxperf_model"]) == ("h100-8", "llama3-8b")
    cmp = memory_fit.compare("h100-8", "llama3-8b", row["overrides"].split())
    total, hbm = cmp.compiler["per_device_total_bytes"], cmp.compiler["hbm_bytes"]
    assert total <= hbm, (total / 2**30, hbm / 2**30)
    assert cmp.analytical.per_device_total_bytes == pytest.approx(total, rel=0.10)


@pytest.mark.slow
@NEEDS_CUDA_PLUGIN
def test_nvidias_llama3_70b_fp8_layout_compiles_for_h100_8x8_and_fits_with_its_iterations_recomputed():
    """NVIDIA's Megatron-Bridge Llama 3 70B FP8 run on 64 H100s, its layout as bench/published writes it (tensor 4,
    data 2 with the optimizer split over it, 8 stages over the hosts of 5 virtual stages, 64 microbatches, current
    scaling): the compiled step runs MaxText's schedule, which holds every iteration's activations, so it is compiled
    with each iteration recomputed (remat_policy=full), as MaxText would run it; the compiler fits it, and the
    analytical memory agrees within 15%."""
    import csv

    from maxperf.search import memory_fit

    rows = csv.DictReader(open(Path(__file__).resolve().parents[1] / "bench" / "published" / "maxperf_mapping.csv",
                               newline=""))
    row = next(r for r in rows if r["id"] == "nemo-dgx-h100-llama3-70b-fp8-cs-64gpu")
    assert (row["topology"], row["maxperf_model"]) == ("h100-8x8", "llama3-70b")
    words = [w for w in row["overrides"].split() if not w.startswith(("remat_policy=", "pipeline_schedule="))]
    cmp = memory_fit.compare("h100-8x8", "llama3-70b", [*words, "remat_policy=full"])
    total, hbm = cmp.compiler["per_device_total_bytes"], cmp.compiler["hbm_bytes"]
    assert total <= hbm, (total / 2**30, hbm / 2**30)
    assert cmp.analytical.per_device_total_bytes == pytest.approx(total, rel=0.15)


def test_transformer_engine_recipes_are_refused_on_tpus_naming_maxtexts_tpu_recipe():
    from maxperf.spec.errors import MaxperfError
    from maxperf.spec.request import resolve

    for name in ("te_fp8_currentscaling", "te_fp8_delayedscaling", "te_mxfp8"):
        with pytest.raises(MaxperfError, match="runs on NVIDIA GPUs only; on tpu7x MaxText trains in FP8 with "
                                               "quantization=fp8_full use_qwix_quantization=true"):
            resolve("tpu7x-8", "llama3-8b", [f"quantization={name}"])
    assert resolve("tpu7x-8", "llama3-8b", ["quantization=fp8_full", "use_qwix_quantization=true"])
    assert resolve("h100-8", "llama3-8b", ["quantization=te_fp8_currentscaling"])


@pytest.mark.slow
def test_a_step_jax_cannot_serialize_keeps_the_compilers_figures_and_says_why(tmp_path):
    """te_mxfp8's block-scaled products are partitioned by jax's custom partitioning, whose lowering holds a local
    function that does not pickle: `maxperf compile` ends in one line (exit 2, not a traceback's AttributeError),
    writes the compiler's memory and HLO without compiled.pkl, and the report reads it."""
    from cli_util import maxperf

    out = tmp_path / "mx"
    proc = maxperf("compile", "--topology", "b200-8", "--model", "tiny", "d_model=256", "d_ff=512",
                   "quantization=te_mxfp8", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("maxperf: error:")]
    assert "jax cannot serialize this compiled step" in line and "te_mxfp8's block-scaled products" in line
    assert (out / "memory.json").is_file() and (out / "hlo" / "optimized.hlo.txt").is_file()
    assert not (out / "compiled.pkl").exists()
    assert maxperf("report", str(out), "-o", str(tmp_path / "r.html")).returncode == 0


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_compile_refuses_a_quantized_dropless_moe_before_any_work(tmp_path, quantization):
    """The train step quantizes the capacity einsums only: compile refuses a quantized dropless MoE at once, in one
    line, with no pricing warning before it and nothing written (it warned that the step was priced, set up the
    devices and the state, then refused)."""
    from cli_util import maxperf

    proc = maxperf("compile", "--topology", "tpu7x-8", "--model", "mixtral-8x7b", "num_layers=1",
                   "per_device_batch_size=1", "seq_len=1024", f"quantization={quantization}", "--out",
                   str(tmp_path / "a"))
    assert proc.returncode == 2 and "needs sparse_matmul=false" in proc.stderr
    assert "warning" not in proc.stderr and "abstract state" not in proc.stderr and not (tmp_path / "a").exists()
