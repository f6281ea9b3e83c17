"""`hlo_cost.hlo_flops`: hand-written HLO with known answers, and real compiles checked against XLA's cost_analysis."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxperf.aot import hlo_cost
from maxperf.aot.hlo_cost import hlo_flops

DOT = """HloModule m, entry_computation_layout={(f32[16,256]{1,0}, f32[256,512]{1,0})->f32[16,512]{1,0}}

ENTRY %main (x: f32[16,256], w: f32[256,512]) -> f32[16,512] {
  %x = f32[16,256]{1,0} parameter(0), metadata={op_name="x"}
  %w = f32[256,512]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
}
"""

# A scan of 32 steps as XLA's CPU and GPU backends print it: the trip count sits in the while's backend_config,
# the condition compares through a wrapping fusion, and the body's matmul sits in a fusion.
WHILE_KNOWN = """HloModule m

%fused_dot (p0: f32[8,64], p1: f32[64,64]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot.2 = f32[8,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_add_computation (a: s32[], b: s32[]) -> s32[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %add.3 = s32[] add(%a, %b)
}

%body (param: (s32[], f32[8,64], f32[64,64])) -> (s32[], f32[8,64], f32[64,64]) {
  %param = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %one = s32[] constant(1)
  %i = s32[] get-tuple-element(%param), index=0
  %h = f32[8,64]{1,0} get-tuple-element(%param), index=1
  %w = f32[64,64]{1,0} get-tuple-element(%param), index=2
  %next = s32[] fusion(%i, %one), kind=kLoop, calls=%wrapped_add_computation
  %ynn_fusion = f32[8,64]{1,0} fusion(%h, %w), kind=kCustom, calls=%fused_dot
  %t = f32[8,64]{1,0} tanh(%ynn_fusion)
  ROOT %tuple.6 = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}) tuple(%next, %t, %w)
}

%wrapped_compare_computation (x: s32[], y: s32[]) -> pred[] {
  %x = s32[] parameter(0)
  %y = s32[] parameter(1)
  ROOT %lt = pred[] compare(%x, %y), direction=LT
}

%cond (param.1: (s32[], f32[8,64], f32[64,64])) -> pred[] {
  %param.1 = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %limit = s32[] constant(32), metadata={op_name="jit(f)/while/cond/lt"}
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  ROOT %wrapped_compare = pred[] fusion(%i.1, %limit), kind=kLoop, calls=%wrapped_compare_computation
}

ENTRY %main (h0: f32[8,64], w0: f32[64,64]) -> f32[8,64] {
  %h0 = f32[8,64]{1,0} parameter(0)
  %w0 = f32[64,64]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}) tuple(%zero, %h0, %w0)
  %while.8 = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %out = f32[8,64]{1,0} get-tuple-element(%while.8), index=1
}
"""

LOOP_DOT_FLOPS = 2 * 8 * 64 * 64
KNOWN_TRIP_COUNT = ', backend_config={"known_trip_count":{"n":"32"},"known_init_step":{"init":"0","step":"1"}}'


def test_dot_resolves_operand_shapes_from_parameters():
    cost = hlo_flops(DOT)
    assert cost.dot_flops == cost.flops == 2 * 16 * 512 * 256
    assert cost.convolution_flops == 0 and cost.loops == () and cost.unresolved_operands == 0


def test_known_trip_count_multiplies_the_body_and_its_fusions():
    cost = hlo_flops(WHILE_KNOWN)
    assert cost.dot_flops == 32 * LOOP_DOT_FLOPS
    assert cost.transcendentals == 32 * 8 * 64
    assert [(loop.name, loop.body, loop.trip_count, loop.trip_count_source) for loop in cost.loops] == [
        ("while.8", "body", 32, "backend_config")]
    # The counter add runs 32 times and the condition's compare 33 times: elementwise, not matmul work.
    assert cost.elementwise_flops == 32 + 33
    assert cost.xla_style_flops == cost.flops + cost.elementwise_flops


def test_trip_count_from_the_condition_when_the_backend_config_has_none():
    # TPU's optimized HLO prints no known_trip_count: the count comes from init 0, step 1 and `i < 32`.
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "")
    cost = hlo_flops(text)
    assert [(loop.trip_count, loop.trip_count_source) for loop in cost.loops] == [(32, "condition")]
    assert cost.dot_flops == 32 * LOOP_DOT_FLOPS and cost.unknown_trip_counts == 0


def test_trip_count_from_a_condition_with_other_start_step_and_direction():
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "")
    text = text.replace("%zero = s32[] constant(0)", "%zero = s32[] constant(2)")  # i = 2, 5, 8, ..., 29
    text = text.replace("%one = s32[] constant(1)", "%one = s32[] constant(3)")
    text = text.replace("direction=LT", "direction=LE")  # i <= 32: 2 .. 32 in steps of 3 is 11 iterations
    assert [loop.trip_count for loop in hlo_flops(text).loops] == [11]


def test_trip_count_through_element_reads_written_as_name_hash_index():
    # Newer printers write a tuple element read in place, `%param#0`, with no get-tuple-element instruction (XLA:TPU's
    # peeled layer loops under MaxText's host-offload flags); the counter and its limit are found through them.
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "")
    text = text.replace("  %i = s32[] get-tuple-element(%param), index=0\n", "")
    text = text.replace("  %h = f32[8,64]{1,0} get-tuple-element(%param), index=1\n", "")
    text = text.replace("fusion(%i, %one)", "fusion(%param#0, %one)").replace("fusion(%h, %w)", "fusion(%param#1, %w)")
    text = text.replace("  %i.1 = s32[] get-tuple-element(%param.1), index=0\n", "")
    text = text.replace("fusion(%i.1, %limit)", "fusion(%param.1#0, %limit)")
    assert "get-tuple-element(%param)" not in text.split("%w = ")[0]
    cost = hlo_flops(text)
    assert [(loop.trip_count, loop.trip_count_source) for loop in cost.loops] == [(32, "condition")]
    assert cost.dot_flops == 32 * LOOP_DOT_FLOPS and cost.unresolved_operands == 0


def test_tuple_elements_leave_out_the_printers_index_comments():
    shape = "(s32[], f32[8,64]{1,0}, /*index=2*/(bf16[4], s8[2]), f32[2]{0})"
    assert hlo_cost.tuple_elements(shape) == ["s32[]", "f32[8,64]{1,0}", "(bf16[4], s8[2])", "f32[2]{0}"]
    assert hlo_cost.tuple_elements("f32[8]{0}") == []


def test_unknown_trip_count_is_reported_and_counted_once():
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "")
    text = text.replace("%limit = s32[] constant(32)", "%limit = s32[] get-tuple-element(%param.1), index=0")
    cost = hlo_flops(text)
    assert cost.unknown_trip_counts == 1 and cost.loops[0].trip_count is None
    assert cost.dot_flops == LOOP_DOT_FLOPS


def test_nested_loops_multiply_and_report_executions():
    outer = WHILE_KNOWN.replace("ENTRY %main (h0", "%inner_main (h0").replace("ROOT %out", "%out")
    outer = outer.replace("index=1\n}", "index=1\n  ROOT %res = (f32[8,64]{1,0}, f32[64,64]{1,0}) tuple(%out, %w0)\n}")
    outer += """
%outer_body (op: (f32[8,64], f32[64,64])) -> (f32[8,64], f32[64,64]) {
  %op = (f32[8,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %oh = f32[8,64]{1,0} get-tuple-element(%op), index=0
  %ow = f32[64,64]{1,0} get-tuple-element(%op), index=1
  ROOT %called = (f32[8,64]{1,0}, f32[64,64]{1,0}) call(%oh, %ow), to_apply=%inner_main
}

%outer_cond (oc: (f32[8,64], f32[64,64])) -> pred[] {
  %oc = (f32[8,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: (f32[8,64], f32[64,64])) -> (f32[8,64], f32[64,64]) {
  %a = (f32[8,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  ROOT %outer = (f32[8,64]{1,0}, f32[64,64]{1,0}) while(%a), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
}
"""
    cost = hlo_flops(outer)
    assert cost.dot_flops == 4 * 32 * LOOP_DOT_FLOPS
    assert {(loop.name, loop.trip_count, loop.executions) for loop in cost.loops} == {("outer", 4, 1.0),
                                                                                  ("while.8", 32, 4.0)}


NESTED_FUSION_CONV = """HloModule m

%inner (p: f32[4,16,16,8], k: f32[3,3,8,32]) -> f32[4,16,16,32] {
  %p = f32[4,16,16,8]{3,2,1,0} parameter(0)
  %k = f32[3,3,8,32]{3,2,1,0} parameter(1)
  ROOT %convolution.1 = f32[4,16,16,32]{3,2,1,0} convolution(%p, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
}

%outer (q: f32[4,16,16,8], r: f32[3,3,8,32]) -> f32[4,16,16,32] {
  %q = f32[4,16,16,8]{3,2,1,0} parameter(0)
  %r = f32[3,3,8,32]{3,2,1,0} parameter(1)
  %fusion.1 = f32[4,16,16,32]{3,2,1,0} fusion(%q, %r), kind=kOutput, calls=%inner
  ROOT %multiply.1 = f32[4,16,16,32]{3,2,1,0} multiply(%fusion.1, %fusion.1)
}

%add_f32 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4,16,16,8], b: f32[3,3,8,32]) -> f32[4] {
  %a = f32[4,16,16,8]{3,2,1,0} parameter(0)
  %b = f32[3,3,8,32]{3,2,1,0} parameter(1)
  %fusion.2 = f32[4,16,16,32]{3,2,1,0} fusion(%a, %b), kind=kOutput, calls=%outer
  %zero = f32[] constant(0)
  ROOT %reduce.1 = f32[4]{0} reduce(%fusion.2, %zero), dimensions={1,2,3}, to_apply=%add_f32
}
"""


def test_nested_fusion_convolution_and_reduction_kept_apart():
    cost = hlo_flops(NESTED_FUSION_CONV)
    out = 4 * 16 * 16 * 32
    # A 3x3 window with padding 1: on each spatial dim the border positions miss one of their 3 taps.
    assert cost.convolution_flops == cost.flops == 2 * (4 * 32) * 8 * (16 * 3 - 2) ** 2
    assert cost.elementwise_flops == out  # the multiply
    assert cost.reduction_flops == out - 4  # the scalar add, applied input minus output elements times
    assert cost.by_opcode == {"convolution": cost.convolution_flops, "multiply": out, "reduce": out - 4}


def test_tpu_matmul_as_convolution_without_spatial_dims():
    text = DOT.replace("dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
                       "convolution(%x, %w), dim_labels=bf_io->bf")
    assert hlo_flops(text).convolution_flops == 2 * 16 * 512 * 256


@pytest.mark.parametrize("lhs, window, labels, out", [
    # Batched matmul over 32 heads (TPU, llama2-7b): base dilation meets one input element per output position.
    ("bf16[2048,128,32]", "size=32 stride=31 lhs_dilate=32", "b0f_0io->bf0", "bf16[2048,4096,32]"),
    # The same batch made by padding a single input position: one real element per output position.
    ("bf16[2048,128,1]", "size=32 pad=31_31 rhs_reversal=1", "bf0_0io->bf0", "bf16[2048,4096,32]"),
], ids=["base-dilated", "padded"])
def test_convolution_counts_only_window_positions_on_real_input(lhs, window, labels, out):
    text = f"""HloModule m

ENTRY %main (a: {lhs}, k: bf16[32,128,4096]) -> {out} {{
  %a = {lhs}{{2,1,0}} parameter(0)
  %k = bf16[32,128,4096]{{2,1,0}} parameter(1)
  ROOT %c = {out}{{2,1,0}} convolution(%a, %k), window={{{window}}}, dim_labels={labels}
}}
"""
    assert hlo_flops(text).convolution_flops == 2 * 2048 * 4096 * 32 * 128  # 32 matmuls, not 32 x 32


def test_valid_window_pairs_match_enumerating_them():
    rng = np.random.default_rng(0)
    for _ in range(300):
        size_in, size_kernel, size_out = (int(v) for v in rng.integers(1, 12, 3))
        stride, lhs_dilate, rhs_dilate = (int(v) for v in rng.integers(1, 7, 3))
        pad_low = int(rng.integers(0, 9))
        last = (size_in - 1) * lhs_dilate
        expected = sum(1 for o in range(size_out) for k in range(size_kernel)
                       if 0 <= o * stride + k * rhs_dilate - pad_low <= last
                       and (o * stride + k * rhs_dilate - pad_low) % lhs_dilate == 0)
        assert hlo_cost._valid_window_pairs(size_in, size_kernel, size_out, stride, pad_low, lhs_dilate,
                                            rhs_dilate) == expected


def test_wide_base_dilated_batch_counts_one_pair_per_output_position():
    # A grouped matmul's 81,920 tokens as a base-dilated window (gpt-oss-120b's MoE on TPU7x): one real input
    # element per output position, counted without walking every (position, kernel element) pair.
    text = """HloModule m

ENTRY %main (a: bf16[81920,4,1], k: bf16[81920,4,2880]) -> bf16[81920,1,2880] {
  %a = bf16[81920,4,1]{2,1,0} parameter(0)
  %k = bf16[81920,4,2880]{2,1,0} parameter(1)
  ROOT %c = bf16[81920,1,2880]{2,1,0} convolution(%a, %k), window={size=81920 stride=81919 lhs_dilate=81920}, dim_labels=0fb_0io->0fb
}
"""
    assert hlo_flops(text).convolution_flops == 2 * 81920 * 2880 * 4


def test_cublas_gemm_custom_call_uses_its_dot_dimensions():
    text = DOT.replace(
        "ROOT %dot.1 = f32[16,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        '%gemm = (f32[16,512]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", '
        'backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,'
        '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
        '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}\n'
        "  ROOT %gte = f32[16,512]{1,0} get-tuple-element(%gemm), index=0")
    cost = hlo_flops(text)
    assert cost.custom_call_flops == cost.flops == 2 * 16 * 512 * 256
    assert cost.by_opcode == {"custom-call:__cublas$gemm": cost.flops} and cost.unhandled_custom_calls == {}


def test_unknown_custom_call_is_listed_not_guessed():
    text = DOT.replace("dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
                       'custom-call(%x, %w), custom_call_target="__cudnn$fmhaSoftmax"')
    cost = hlo_flops(text)
    assert cost.flops == 0 and cost.unhandled_custom_calls == {"__cudnn$fmhaSoftmax": 1}


def test_conditional_costs_its_costliest_branch():
    text = """HloModule m

%cheap (c: f32[16,256]) -> f32[16,256] {
  ROOT %c = f32[16,256]{1,0} parameter(0)
}

%costly (e: f32[16,256]) -> f32[16,256] {
  %e = f32[16,256]{1,0} parameter(0)
  %sq = f32[256,256]{1,0} constant({...})
  ROOT %d = f32[16,256]{1,0} dot(%e, %sq), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p: pred[], x: f32[16,256]) -> f32[16,256] {
  %p = pred[] parameter(0)
  %x = f32[16,256]{1,0} parameter(1)
  ROOT %cond = f32[16,256]{1,0} conditional(%p, %x, %x), true_computation=%cheap, false_computation=%costly
}
"""
    cost = hlo_flops(text)
    assert cost.dot_flops == 2 * 16 * 256 * 256 and cost.conditionals == 1
    branches = text.replace("true_computation=%cheap, false_computation=%costly",
                            "branch_computations={%costly, %cheap}")
    assert hlo_flops(branches).dot_flops == cost.dot_flops


def test_async_wrapped_computation_counts_once():
    # The async pair names its computation on start and done; GPU's fusion-start names it on the start only.
    text = """HloModule m

%wrapped (x: f32[16,256], w: f32[256,512]) -> f32[16,512] {
  %x = f32[16,256]{1,0} parameter(0)
  %w = f32[256,512]{1,0} parameter(1)
  ROOT %d = f32[16,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[16,256], b: f32[256,512]) -> f32[16,512] {
  %a = f32[16,256]{1,0} parameter(0)
  %b = f32[256,512]{1,0} parameter(1)
  %start = ((f32[16,256]{1,0}, f32[256,512]{1,0}), f32[16,512]{1,0}, u32[]) async-start(%a, %b), calls=%wrapped
  %done = f32[16,512]{1,0} async-done(%start), calls=%wrapped
  %fstart = ((f32[16,256]{1,0}, f32[256,512]{1,0}), f32[16,512]{1,0}, u32[]) fusion-start(%a, %b), kind=kCustom, calls=%wrapped
  %fdone = f32[16,512]{1,0} fusion-done(%fstart)
  ROOT %sum = f32[16,512]{1,0} add(%done, %fdone)
}
"""
    cost = hlo_flops(text)
    assert cost.dot_flops == 2 * (2 * 16 * 512 * 256) and cost.elementwise_flops == 16 * 512


def test_text_without_computations_is_an_error():
    with pytest.raises(ValueError, match="no HLO computation"):
        hlo_flops("HloModule empty\n")


# ---------------------------------------------------------------------------------------------------------------
# Real compiles on the 8 host CPU devices (and compile-only TPU devices when libtpu is installed).

B, D, F, N = 64, 256, 512, 8


def _cpu_mesh():
    return Mesh(np.array(jax.devices()[:4]), ("x",))


def _specs(mesh, *shapes_and_specs):
    return [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p)) for s, p in shapes_and_specs]


def _scanned(x, ws):
    return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()


def _unrolled(x, ws):
    h = x
    for i in range(N):
        h = jnp.tanh(h @ ws[i])
    return h.sum()


def _compile(f, args):
    compiled = jax.jit(f).lower(*args).compile()
    raw = compiled.cost_analysis()
    raw = raw[0] if isinstance(raw, (list, tuple)) else raw
    return hlo_flops(compiled.as_text()), raw


def test_cpu_mlp_matches_cost_analysis():
    mesh = _cpu_mesh()
    args = _specs(mesh, ((B, D), P("x", None)), ((D, F), P()), ((F, D), P()))
    cost, raw = _compile(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, args)
    assert cost.dot_flops == 2 * 2 * (B // 4) * D * F  # per device: the batch is split 4 ways
    assert cost.xla_style_flops == pytest.approx(raw["flops"], rel=1e-3)
    assert cost.transcendentals == raw["transcendentals"]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_cpu_scan_counts_every_layer_where_cost_analysis_counts_one(grad):
    mesh = _cpu_mesh()
    args = _specs(mesh, ((B, D), P("x", None)), ((N, D, D), P()))
    wrap = (lambda f: jax.grad(f, argnums=(0, 1))) if grad else (lambda f: f)
    scanned, scanned_raw = _compile(wrap(_scanned), args)
    unrolled, unrolled_raw = _compile(wrap(_unrolled), args)
    layer = 2 * (B // 4) * D * D
    assert unrolled.dot_flops == scanned.dot_flops == (3 if grad else 1) * N * layer
    # Unrolled, XLA's count and ours agree, tuple all-reduces of the gradients included.
    assert unrolled.xla_style_flops == pytest.approx(unrolled_raw["flops"], rel=1e-3)
    assert all(loop.trip_count == N for loop in scanned.loops) and len(scanned.loops) == (2 if grad else 1)
    assert scanned_raw["flops"] < scanned.flops / (N / 2)  # XLA's own count sees one layer per loop


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs the tpu extra: pip install 'maxperf[tpu]'")
def test_tpu_scan_trip_count_from_the_condition_and_unrolled_matches_cost_analysis():
    from maxperf.aot import targets

    targets.quiet_libtpu()
    from jax.experimental.topologies import get_topology_desc

    devices = get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = Mesh(np.array(devices), ("x",))
    args = _specs(mesh, ((B, D), P("x", None)), ((N, D, D), P()))
    grad = jax.grad(_scanned, argnums=(0, 1)), jax.grad(_unrolled, argnums=(0, 1))
    scanned, _ = _compile(grad[0], args)
    unrolled, unrolled_raw = _compile(grad[1], args)
    assert scanned.convolution_flops == unrolled.convolution_flops == 3 * N * 2 * (B // 4) * D * D
    assert {(loop.trip_count, loop.trip_count_source) for loop in scanned.loops} == {(N, "condition")}
    assert unrolled.xla_style_flops == pytest.approx(unrolled_raw["flops"], rel=0.01)


@pytest.mark.slow
def test_tiny_train_step_scanned_and_unscanned_agree():
    from models_util import cpu_mesh

    from maxperf.models import train_step
    from maxperf.spec import overrides, presets
    from maxperf.spec import topology as topologies
    from maxperf.spec.mesh import resolve as resolve_mesh

    totals = {}
    for scan in ("true", "false"):
        cfg = overrides.apply(presets.get("tiny"), ["seq_len=64", "per_device_batch_size=2", f"scan_layers={scan}"])
        devices = jax.devices()[:8]
        mesh = cpu_mesh(resolve_mesh(cfg.parallelism, topologies.get("cpu-8")), devices)
        spec = train_step.abstract_step(cfg.model, cfg.train, mesh)
        with jax.set_mesh(mesh):
            compiled = train_step.jit_step(spec).lower(spec.state, spec.batch).compile()
        totals[scan] = hlo_flops(compiled.as_text()), compiled.cost_analysis()["flops"]
    (scanned, scanned_raw), (unscanned, unscanned_raw) = totals["true"], totals["false"]
    assert scanned.loops and all(loop.trip_count for loop in scanned.loops)
    assert scanned.flops == pytest.approx(unscanned.flops, rel=1e-3)  # measured here: equal
    assert unscanned.xla_style_flops == pytest.approx(unscanned_raw, rel=1e-3)
    assert scanned_raw < 0.8 * scanned.xla_style_flops  # XLA counts the layer loop's body once


# Pallas attention kernels: splash on TPU prints its kernel metadata as multi-line JSON inside the instruction
# (a line of it starts with "}"), and neither kernel carries a cost estimate.
SPLASH = """  %q = f32[2,8,32]{2,1,0} bitcast(%h)
  %NAME.3 = RESULT custom-call(%i, %q, %q), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"BLOCK_Q\\": 4, \\"BLOCK_KV\\": 4, \\"use_fused_bwd_kernel\\": false}"
}}, metadata={op_name="jit(f)/while/body/NAME/pallas_call"}, backend_config={"custom_call_config":{"body":"TUzv"}}
"""
# (query, key) pairs in causal 4x4 blocks of an 8x8 score matrix: blocks (0,0), (1,0), (1,1), each whole
SPLASH_PAIRS = 3 * 16


@pytest.mark.parametrize("name, blocks, result, per_pair", [
    ("splash_mha_fwd_residuals", ("block_q", "block_kv"), "(f32[2,8,32]{2,1,0}, f32[2,8,128]{2,1,0})", 4),
    ("splash_mha_dq_no_residuals", ("block_q_dq", "block_kv_dq"), "f32[2,8,32]{2,1,0}", 6),
    ("splash_mha_dkv_no_residuals", ("block_q_dkv", "block_kv_dkv"), "(f32[2,8,32]{2,1,0}, f32[2,8,32]{2,1,0})", 8),
    ("splash_mha_dkv_no_residuals", ("block_q_dkv", "block_kv_dkv"),
     "(f32[2,8,32]{2,1,0}, f32[2,8,32]{2,1,0}, f32[2,8,32]{2,1,0})", 10),  # fused: dq too
], ids=["fwd", "dq", "dkv", "fused-dkv"])
def test_splash_kernel_in_a_loop_body_keeps_the_loop_and_counts_its_flops(name, blocks, result, per_pair):
    kernel = (SPLASH.replace("NAME", name).replace("RESULT", result).replace("BLOCK_Q", blocks[0])
              .replace("BLOCK_KV", blocks[1]))
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "").replace("  %t = ", kernel + "  %t = ")
    cost = hlo_flops(text)
    # the body is read to its end: its root gives the trip count, its fusion's dot is counted 32 times
    assert [(loop.trip_count, loop.trip_count_source) for loop in cost.loops] == [(32, "condition")]
    assert cost.dot_flops == 32 * LOOP_DOT_FLOPS
    kernel_flops = 32 * per_pair * 32 * 2 * SPLASH_PAIRS  # trips x per pair x Dh x heads x pairs
    assert cost.attention_kernel_flops == cost.custom_call_flops == kernel_flops
    assert cost.by_opcode[f"attention-kernel:{name}"] == kernel_flops
    assert cost.flops == cost.dot_flops + kernel_flops and cost.unhandled_custom_calls == {}


def test_splash_forward_with_a_shrunk_block_mask_counts_the_grid_it_walks():
    # a window shorter than a block: jax shrinks the forward's key blocks to one per query block, so 2 of the 3
    # causal blocks are walked (and the window's mask is in the kernel's operands: s8[heads, q blocks, kv blocks])
    kernel = (SPLASH.replace("NAME", "splash_mha_fwd_residuals")
              .replace("RESULT", "(f32[2,8,32]{2,1,0}, f32[2,8,128]{2,1,0})")
              .replace("BLOCK_Q", "block_q").replace("BLOCK_KV", "block_kv")
              .replace('custom_call_target="tpu_custom_call",',
                       'custom_call_target="tpu_custom_call", operand_layout_constraints={s8[1,2,1]{2,1,0}, '
                       's8[1,2,1]{2,1,0}, f32[2,8,32]{2,1,0}},'))
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "").replace("  %t = ", kernel + "  %t = ")
    assert hlo_flops(text).attention_kernel_flops == 32 * 4 * 32 * 2 * (2 * 16)  # trips x 4 x Dh x heads x pairs
    full = text.replace("s8[1,2,1]", "s8[1,2,2]")  # a causal mask's whole grid: the causal blocks alone count
    assert hlo_flops(full).attention_kernel_flops == 32 * 4 * 32 * 2 * SPLASH_PAIRS


def test_splash_queries_of_a_longer_sequence_count_the_keys_before_their_place():
    # context parallelism: each device's 8 queries against the whole 16-token sequence's keys; the two slices of 8
    # see 3 and 7 of the causal 4x4 blocks (the second's queries see the first slice's keys whole): 5 on average
    kernel = (SPLASH.replace("NAME", "splash_mha_fwd_residuals")
              .replace("RESULT", "(f32[2,8,32]{2,1,0}, f32[2,8,128]{2,1,0})")
              .replace("BLOCK_Q", "block_q").replace("BLOCK_KV", "block_kv")
              .replace("custom-call(%i, %q, %q)", "custom-call(%i, %q, %k)"))
    kernel = "  %k = f32[2,16,32]{2,1,0} bitcast(%h)\n" + kernel
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "").replace("  %t = ", kernel + "  %t = ")
    assert hlo_flops(text).attention_kernel_flops == 32 * 4 * 32 * 2 * (5 * 16)  # trips x 4 x Dh x heads x pairs


def test_splash_operands_laid_out_sequence_minor_count_as_the_same_attention():
    # MaxText's sa_q_layout=SEQ_MINOR (and k's): the kernel takes q and k as [heads, Dh, L], its metadata says so
    kernel = (SPLASH.replace("NAME", "splash_mha_fwd_residuals")
              .replace("RESULT", "(f32[2,8,32]{2,1,0}, f32[2,8,128]{2,1,0})")
              .replace("BLOCK_Q", "block_q").replace("BLOCK_KV", "block_kv")
              .replace("%q = f32[2,8,32]", "%q = f32[2,32,8]")
              .replace('false}"', 'false, \\"q_layout\\": 2, \\"k_layout\\": 2}"'))
    assert '\\"q_layout\\": 2' in kernel
    text = WHILE_KNOWN.replace(KNOWN_TRIP_COUNT, "").replace("  %t = ", kernel + "  %t = ")
    assert hlo_flops(text).attention_kernel_flops == 32 * 4 * 32 * 2 * SPLASH_PAIRS


TRITON = """  %q = f32[1,8,2,32]{3,2,1,0} bitcast(%h)
  %pallas_call.36 = RESULT custom-call(%q, %q, %q), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/shard_map/jit(mha)/NAME/pallas_call"}, backend_config={debug = false, grid_x = 2 : i32, grid_y = 1 : i32, grid_z = 2 : i32, ir = "ML\\EFR{\\00\\22}}{"}
"""


@pytest.mark.parametrize("name, result, flops", [
    # forward: 4x8 query blocks (8 / grid_x) against one 8-wide key block (128 clamped): 2 blocks of 32 pairs
    ("mha_forward", "(f32[1,8,2,32]{3,2,1,0}, f32[1,2,8]{2,1,0})", 4 * 32 * 2 * 64),
    # backward: 32-wide blocks clamped to 8, the whole 8x8 block, dq and dkv in one kernel
    ("mha_backward", "(f32[1,8,2,32]{3,2,1,0}, f32[1,8,2,32]{3,2,1,0}, f32[1,8,2,32]{3,2,1,0})", 14 * 32 * 2 * 64),
    ("mha_preprocess_backward", "f32[1,2,8]{2,1,0}", 0),  # the backward's elementwise row sums: known, no matmul
])
def test_triton_flash_kernel_flops_from_operand_shapes(name, result, flops):
    text = DOT.replace("  ROOT %dot.1", TRITON.replace("NAME", name).replace("RESULT", result) + "  ROOT %dot.1")
    cost = hlo_flops(text)
    assert cost.attention_kernel_flops == flops
    assert cost.flops == 2 * 16 * 512 * 256 + flops and cost.unhandled_custom_calls == {}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs the tpu extra: pip install 'maxperf[tpu]'")
def test_tiny_splash_compile_counts_every_layer_and_its_kernels(tmp_path):
    from maxperf.aot import compiler

    result = compiler.compile("v5p-8", "tiny", ["seq_len=256", "attention=flash"], out=tmp_path / "a")
    hlo = result.cost["hlo"]
    N = result.plan.configs.model.num_layers
    assert hlo["loops"] and all(loop["trip_count"] == N for loop in hlo["loops"])
    assert hlo["unhandled_custom_calls"] == {}
    # per layer: the forward, the forward again under remat, dq and dkv, each over one causal 256x256 block
    model, B = result.plan.configs.model, result.plan.configs.train.per_device_batch_size
    heads = B * model.num_heads  # the mesh (fsdp=4) splits the global batch, each device holds every head
    assert hlo["attention_kernel_flops"] == N * (4 + 4 + 6 + 8) * model.head_dim * heads * 256 * 256
    assert "attention kernels" in result.cost["flops_source"]


@pytest.mark.slow
def test_tiny_triton_flash_compile_counts_its_kernels(tmp_path):
    from maxperf.aot import compiler

    result = compiler.compile("h100-8", "tiny", ["seq_len=256", "attention=flash"], out=tmp_path / "a")
    hlo = result.cost["hlo"]
    model, B = result.plan.configs.model, result.plan.configs.train.per_device_batch_size
    heads = B * model.num_heads  # fsdp=8 splits the global batch, each device holds every head
    assert hlo["unhandled_custom_calls"] == {} and all(loop["trip_count"] == model.num_layers for loop in hlo["loops"])
    # per layer: the forward twice (remat), 128-row query blocks against 128-wide key blocks, 3 of 4 visible; the
    # backward in 32x32 blocks, 36 of 64 visible
    forward, backward = 2 * 4 * 3 * 128 * 128, 14 * 36 * 32 * 32
    assert hlo["attention_kernel_flops"] == model.num_layers * (forward + backward) * model.head_dim * heads


CUDNN_BACKWARD = """HloModule m

ENTRY %main (x: f32[8,16,16,32], dy: f32[8,16,16,64]) -> f32[3,3,32,64] {
  %x = f32[8,16,16,32]{3,2,1,0} parameter(0)
  %dy = f32[8,16,16,64]{3,2,1,0} parameter(1)
  %dk = (f32[3,3,32,64]{3,2,1,0}, u8[0]{0}) custom-call(%x, %dy), CONVOLUTION, custom_call_target="__cudnn$convBackwardFilter"
  ROOT %out = f32[3,3,32,64]{3,2,1,0} get-tuple-element(%dk), index=0
}
""".replace("CONVOLUTION", "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f")


def test_cudnn_convolutions_count_the_forward_products():
    cost = hlo_flops(CUDNN_BACKWARD)
    assert cost.unhandled_custom_calls == {}
    # the kernel gradient: the forward output's elements (dy) x the kernel's elements per output feature
    assert cost.flops == cost.custom_call_flops == 2 * (8 * 16 * 16 * 64) * (3 * 3 * 32)
