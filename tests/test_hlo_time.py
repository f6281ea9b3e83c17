"""`hlo_time`: the step time read from optimized HLO. Hand-written modules with known answers (rooflines, loops,
overlap on each platform, replica groups, bytes of fusions), and compiled steps whose prediction lands in
estimate.json."""

import json
import math

import pytest

from maxperf.aot import hlo_time
from maxperf.perfmodel import chips, network
from maxperf.perfmodel.work import SHIPPED, half_scale, matmul_efficiency, mxu_fill
from maxperf.spec import mesh as mesh_mod
from maxperf.spec import topology as topologies
from maxperf.spec.parallelism import ParallelismConfig


def predict(text: str, topology: str = "v5p-16", parallelism: ParallelismConfig | None = None):
    topo = topologies.get(topology)
    mesh = mesh_mod.resolve(parallelism or ParallelismConfig(), topo)
    return hlo_time.hlo_time(text, chips.get(topo.chip), topo, mesh)


def seconds_of(result, name: str) -> float:
    return next(op.seconds for op in result.top if op.name == name)


DOT = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[4096,2048], w: bf16[2048,8192]) -> bf16[4096,8192] {
  %x = bf16[4096,2048]{1,0} parameter(0)
  %w = bf16[2048,8192]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4096,8192]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_matmul_is_a_roofline_at_perfmodels_efficiency():
    result = predict(DOT)
    chip = chips.get("tpu-v5p")
    flops = 2 * 4096 * 2048 * 8192
    half = SHIPPED.matmul_half["tpu"] * half_scale(chip)
    efficiency = matmul_efficiency(chip, 2048, half) * mxu_fill(chip, 2048, 8192)
    nbytes = 2 * (4096 * 2048 + 2048 * 8192 + 4096 * 8192)
    expected = max(flops / (chip.peak_bf16_flops * efficiency), nbytes / chip.hbm_bandwidth)
    assert result.step_time_s == pytest.approx(expected)
    assert result.flops == flops and result.bottleneck == "compute"
    assert result.top[0].kind == "matmul" and result.top[0].bound == "compute"


def test_a_thin_matmul_runs_at_perfmodels_thin_matmul_rate():
    text = DOT.replace("4096,2048", "8,2048").replace("4096,8192", "8,8192")
    result = predict(text)
    chip = chips.get("tpu-v5p")
    efficiency = matmul_efficiency(chip, 8, SHIPPED.matmul_half["tpu"] * half_scale(chip)) * mxu_fill(chip, 2048, 8192)
    assert result.step_time_s == pytest.approx(2 * 8 * 2048 * 8192 / (chip.peak_bf16_flops * efficiency))


def test_a_wide_matmul_on_v6e_runs_no_faster_than_its_gemm_plateau():
    # v6e's published GEMM gains nothing past 4096 (chips.matmul_plateau): an 8192-cubed dot reads at the rate of a
    # 4096-wide one, where the law alone would give it 13% more
    text = DOT.replace("4096,2048", "8192,8192").replace("2048,8192", "8192,8192").replace("4096,8192", "8192,8192")
    result = predict(text, "v6e-8")
    chip = chips.get("tpu-v6e")
    half = SHIPPED.matmul_half["tpu"] * half_scale(chip)
    plateau = SHIPPED.fraction(chip) * 4096 / (4096 + half)
    assert result.step_time_s == pytest.approx(2 * 8192**3 / (chip.peak_bf16_flops * plateau))
    law = SHIPPED.fraction(chip) * 8192 / (8192 + half)
    assert law > 1.1 * plateau


ADD = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[4096,4096], b: f32[4096,4096]) -> f32[4096,4096] {
  %a = f32[4096,4096]{1,0} parameter(0)
  %b = f32[4096,4096]{1,0} parameter(1)
  ROOT %add.1 = f32[4096,4096]{1,0} add(%a, %b)
}
"""


def test_elementwise_work_is_its_bytes_at_hbm_bandwidth():
    result = predict(ADD)
    assert result.top[0].bound == "hbm" and result.bottleneck == "hbm"
    assert result.step_time_s == pytest.approx(3 * 4 * 4096 * 4096 / chips.get("tpu-v5p").hbm_bandwidth)


LOOP = """HloModule m, is_scheduled=true

%body (p: (s32[], bf16[1024,1024], bf16[1024,1024])) -> (s32[], bf16[1024,1024], bf16[1024,1024]) {
  %p = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = bf16[1024,1024]{1,0} get-tuple-element(%p), index=1
  %w = bf16[1024,1024]{1,0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %dot.2 = bf16[1024,1024]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%next, %dot.2, %w)
}

%cond (q: (s32[], bf16[1024,1024], bf16[1024,1024])) -> pred[] {
  %q = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(TRIPS)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (h0: bf16[1024,1024], w0: bf16[1024,1024]) -> bf16[1024,1024] {
  %h0 = bf16[1024,1024]{1,0} parameter(0)
  %w0 = bf16[1024,1024]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%zero, %h0, %w0)
  %loop = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[1024,1024]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_costs_its_trip_count_times_its_body():
    one, many = predict(LOOP.replace("TRIPS", "1")), predict(LOOP.replace("TRIPS", "48"))
    dot = next(op for op in many.top if op.name == "dot.2")
    assert dot.executions == 48
    assert many.flops == 48 * one.flops == 48 * 2 * 1024**3
    assert many.step_time_s == pytest.approx(48 * seconds_of(many, "dot.2") + 49 * seconds_of(many, "lt")
                                             + 48 * seconds_of(many, "next"))
    assert many.kernels == 48 * 2 + 49  # the add and the dot of each iteration, each condition's compare


# A gathered weight used by the second matmul (LATE) or by the first (EARLY), the gather issued before both.
GATHER = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048], g: bf16[256,2048]) -> bf16[2048,2048] {
  %x = bf16[2048,2048]{1,0} parameter(0)
  %w = bf16[2048,2048]{1,0} parameter(1)
  %g = bf16[256,2048]{1,0} parameter(2)
  %ag = bf16[2048,2048]{1,0} all-gather(%g), replica_groups=GROUPS, dimensions={0}
  %d1 = bf16[2048,2048]{1,0} dot(%x, FIRST), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = bf16[2048,2048]{1,0} dot(%d1, SECOND), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
LATE = GATHER.replace("FIRST", "%w").replace("SECOND", "%ag")
EARLY = GATHER.replace("FIRST", "%ag").replace("SECOND", "%w")
EVERY_DEVICE = "[1,8]<=[8]"


def test_a_tpu_collective_overlaps_the_work_before_its_first_use():
    late = predict(LATE.replace("GROUPS", EVERY_DEVICE))
    early = predict(EARLY.replace("GROUPS", EVERY_DEVICE))
    ag, d1, d2 = (seconds_of(late, n) for n in ("ag", "d1", "d2"))
    assert ag > 0
    assert late.step_time_s == pytest.approx(max(ag, d1) + d2)
    assert early.step_time_s == pytest.approx(ag + d1 + d2)
    assert early.exposed_s == pytest.approx(ag) and late.exposed_s == pytest.approx(max(ag - d1, 0.0))


# The same gather handed to the SparseCores, as TPU7x's compiler does with FSDP's gathers: a start without operands,
# an update passing it the shard (where it is issued), a done; and a layout change of a result on the SparseCores.
SPARSECORE = """HloModule m, is_scheduled=true

%gather_call (p: bf16[256,2048]) -> bf16[2048,2048] {
  %p = bf16[256,2048]{1,0} parameter(0)
  ROOT %ag.inner = bf16[2048,2048]{1,0} all-gather(%p), channel_id=7, replica_groups=GROUPS, dimensions={0}
}

%format_call (f: bf16[2048,2048]) -> bf16[2048,2048] {
  %f = bf16[2048,2048]{1,0} parameter(0)
  ROOT %c = bf16[2048,2048]{0,1} copy(%f)
}

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048], g: bf16[256,2048]) -> bf16[2048,2048] {
  %x = bf16[2048,2048]{1,0} parameter(0)
  %w = bf16[2048,2048]{1,0} parameter(1)
  %g = bf16[256,2048]{1,0} parameter(2)
  %ag.call-start = ((), (), (s32[16]{0})) custom-call-start(), async_execution_thread="sparsecore", custom_call_target="sc", called_computations={%gather_call}
  %ag.call-update = ((bf16[256,2048]{1,0}), bf16[2048,2048]{1,0}, (s32[16]{0})) custom-call-update(%ag.call-start, %g)
  %fmt.call-start = ((), (), (s32[16]{0})) custom-call-start(), async_execution_thread="sparsecore", custom_call_target="sc", called_computations={%format_call}
  %fmt.call-update = ((bf16[2048,2048]{1,0}), bf16[2048,2048]{0,1}, (s32[16]{0})) custom-call-update(%fmt.call-start, %x)
  %fmt = bf16[2048,2048]{0,1} custom-call-done(%fmt.call-update)
  %ag = bf16[2048,2048]{1,0} custom-call-done(%ag.call-update)
  %d1 = bf16[2048,2048]{1,0} dot(%fmt, FIRST), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = bf16[2048,2048]{1,0} dot(%d1, SECOND), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_collective_on_the_sparsecores_is_priced_and_overlaps_until_its_first_use():
    late = predict(SPARSECORE.replace("FIRST", "%w").replace("SECOND", "%ag").replace("GROUPS", EVERY_DEVICE),
                   "tpu7x-16")
    early = predict(SPARSECORE.replace("FIRST", "%ag").replace("SECOND", "%w").replace("GROUPS", EVERY_DEVICE),
                    "tpu7x-16")
    ag, fmt, d1, d2 = (seconds_of(late, n) for n in ("ag.call-update", "fmt.call-update", "d1", "d2"))
    gathered = predict(LATE.replace("GROUPS", EVERY_DEVICE), "tpu7x-16")
    assert ag == pytest.approx(seconds_of(gathered, "ag")) and ag > 0  # the collective its computation runs
    assert fmt == pytest.approx(2 * 2 * 2048 * 2048 / chips.get("tpu7x").hbm_bandwidth)  # read and written
    assert late.ici_s == pytest.approx(ag)
    assert late.step_time_s == pytest.approx(max(ag, fmt + d1) + d2)
    assert early.step_time_s == pytest.approx(max(ag, fmt) + d1 + d2)


ASYNC = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048], g: bf16[256,2048]) -> bf16[2048,2048] {
  %x = bf16[2048,2048]{1,0} parameter(0)
  %w = bf16[2048,2048]{1,0} parameter(1)
  %g = bf16[256,2048]{1,0} parameter(2)
  %ags = (bf16[256,2048]{1,0}, bf16[2048,2048]{1,0}) all-gather-start(%g), replica_groups=[1,8]<=[8], dimensions={0}
  %d1 = bf16[2048,2048]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %agd = bf16[2048,2048]{1,0} all-gather-done(%ags)
  ROOT %d2 = bf16[2048,2048]{1,0} dot(%d1, %agd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_gpu_async_pair_overlaps_what_lies_between_and_a_synchronous_collective_blocks():
    overlapped = predict(ASYNC, "h100-8")
    ag, d1, d2 = (seconds_of(overlapped, n) for n in ("ags", "d1", "d2"))
    overhead = hlo_time.KERNEL_OVERHEAD_S["gpu"]
    assert overlapped.step_time_s == pytest.approx(max(ag, d1 + overhead) + d2 + overhead)
    blocking = predict(LATE.replace("GROUPS", EVERY_DEVICE), "h100-8")
    assert blocking.step_time_s == pytest.approx(seconds_of(blocking, "ag") + seconds_of(blocking, "d1")
                                                 + seconds_of(blocking, "d2") + 2 * overhead)


def test_a_gpus_kernel_launches_are_their_own_part_and_can_bound_the_step():
    """A GPU launches each kernel at a fixed cost: the part the step's line shows beside compute and memory, and the
    bottleneck where it is the largest (a small add whose 2 us launch outlasts its bytes)."""
    small = ADD.replace("4096,4096", "64,64")
    result = predict(small, "h100-8")
    overhead = hlo_time.KERNEL_OVERHEAD_S["gpu"]
    assert result.launch_s == pytest.approx(overhead * result.kernels) and result.kernels == 1
    assert result.step_time_s == pytest.approx(result.hbm_s + result.launch_s)
    assert result.bottleneck == "launches" and result.as_dict()["launch_s"] == result.launch_s
    big = predict(ADD, "h100-8")
    assert big.bottleneck == "hbm" and big.launch_s == pytest.approx(overhead)
    assert predict(ADD, "v5p-16").launch_s == 0.0


def test_on_cpu_devices_nothing_overlaps():
    result = predict(LATE.replace("GROUPS", EVERY_DEVICE), "cpu-8")
    total = sum(seconds_of(result, n) for n in ("ag", "d1", "d2"))
    assert result.step_time_s == pytest.approx(total + 3 * hlo_time.KERNEL_OVERHEAD_S["cpu"])  # the collective too


@pytest.mark.parametrize("groups", ["{{0,1,2,3,4,5,6,7}}", "[1,8]<=[8]", "[1,8]<=[2,4]T(1,0)",
                                    "mesh['data'=1,'fsdp'=8] {'fsdp'}", "mesh['axis_0'=8] {'axis_0'}"])
def test_every_spelling_of_one_group_is_priced_by_perfmodels_network(groups):
    topo = topologies.get("v5p-16")
    mesh = mesh_mod.resolve(ParallelismConfig(), topo)
    nets = network.axis_networks(mesh, chips.get("tpu-v5p"), topo)
    expected = network.collective_time("all-gather", 2048 * 2048 * 2, ("fsdp",), nets).ici_s
    result = predict(EARLY.replace("GROUPS", groups))
    assert seconds_of(result, "ag") == pytest.approx(expected)


@pytest.mark.parametrize("dtype, size", [("f8e4m3fn", 1), ("f8e5m2", 1), ("f8e8m0fnu", 1), ("f4e2m1fn", 0.5),
                                         ("bf16", 2), ("f32", 4)])
def test_a_collective_moves_its_element_types_bytes(dtype, size):
    """An FP8 weight's gather moves one byte an element (an FP8 step's all-gathers of f8e4m3fn weights), MXFP4 half of
    one: each at perfmodel's network time for its bytes."""
    topo = topologies.get("v5p-16")
    mesh = mesh_mod.resolve(ParallelismConfig(), topo)
    nets = network.axis_networks(mesh, chips.get("tpu-v5p"), topo)
    expected = network.collective_time("all-gather", 2048 * 2048 * size, ("fsdp",), nets).ici_s
    result = predict(EARLY.replace("GROUPS", "[1,8]<=[8]").replace("bf16[", f"{dtype}["))
    assert seconds_of(result, "ag") == pytest.approx(expected)


def test_a_group_along_one_axis_is_priced_over_that_axis_only():
    two = ParallelismConfig(ici_fsdp=4, ici_tensor=2)
    topo = topologies.get("v5p-16")
    mesh = mesh_mod.resolve(two, topo)
    nets = network.axis_networks(mesh, chips.get("tpu-v5p"), topo)
    # devices in mesh order (data, stage, fsdp, ..., tensor, expert): pairs along tensor are consecutive ids
    result = predict(EARLY.replace("GROUPS", "[4,2]<=[8]").replace("bf16[256,2048]", "bf16[1024,2048]"), "v5p-16",
                     two)
    expected = network.collective_time("all-gather", 2048 * 2048 * 2, ("tensor",), nets).ici_s
    assert seconds_of(result, "ag") == pytest.approx(expected)


def test_collectives_across_slices_pay_the_dcn():
    one = predict(EARLY.replace("GROUPS", "[1,8]<=[8]"), "v5p-16")
    topo = topologies.get("v5p-8", num_slices=2)
    mesh = mesh_mod.resolve(ParallelismConfig(), topo)  # data=2 over DCN, fsdp=4 inside each slice
    across = hlo_time.hlo_time(EARLY.replace("GROUPS", "[4,2]<=[2,4]T(1,0)"), chips.get("tpu-v5p"), topo, mesh)
    op = next(o for o in across.top if o.name == "ag")
    assert op.bound == "dcn"
    assert op.seconds > 10 * seconds_of(one, "ag")


FUSED = """HloModule m, is_scheduled=true

%sliced (p0: f32[64,1024,1024], p1: s32[]) -> f32[1,1024,1024] {
  %p0 = f32[64,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,1024,1024}
  ROOT %neg = f32[1,1024,1024]{2,1,0} negate(%ds)
}

%updated (q0: f32[64,1024,1024], q1: f32[1,1024,1024], q2: s32[]) -> f32[64,1024,1024] {
  %q0 = f32[64,1024,1024]{2,1,0} parameter(0)
  %q1 = f32[1,1024,1024]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z2 = s32[] constant(0)
  ROOT %dus = f32[64,1024,1024]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %z2, %z2)
}

ENTRY %main (a: f32[64,1024,1024], i: s32[]) -> f32[64,1024,1024] {
  %a = f32[64,1024,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %f1 = f32[1,1024,1024]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%sliced
  ROOT %f2 = f32[64,1024,1024]{2,1,0} fusion(%a, %f1, %i), kind=kLoop, calls=%updated
}
"""


def test_a_fusion_reads_only_its_slices_and_writes_only_its_update():
    result = predict(FUSED)
    layer = 4 * 1024 * 1024
    by_name = {op.name: op for op in result.top}
    assert by_name["f1"].bytes == pytest.approx(2 * layer + 4)  # the slice read, the result written, the index
    assert by_name["f2"].bytes == pytest.approx(2 * layer + 4)  # the update read and written in place
    assert by_name["f1"].kind == "memory" and by_name["f1"].bound == "hbm"


NESTED = """HloModule m, is_scheduled=true

%norm (n0: f32[64,1024,1024], n1: s32[]) -> f32[1,1024,1024] {
  %n0 = f32[64,1024,1024]{2,1,0} parameter(0)
  %n1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,1024,1024]{2,1,0} dynamic-slice(%n0, %n1, %z, %z), dynamic_slice_sizes={1,1024,1024}
  ROOT %sq = f32[1,1024,1024]{2,1,0} multiply(%ds, %ds)
}

%outer (p0: f32[64,1024,1024], p1: s32[], p2: f32[1,1024,1024]) -> f32[1,1024,1024] {
  %p0 = f32[64,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[1,1024,1024]{2,1,0} parameter(2)
  %inner = f32[1,1024,1024]{2,1,0} fusion(%p0, %p1), kind=kLoop, calls=%norm
  ROOT %sum = f32[1,1024,1024]{2,1,0} add(%inner, %p2)
}

ENTRY %main (a: f32[64,1024,1024], i: s32[], b: f32[1,1024,1024]) -> f32[1,1024,1024] {
  %a = f32[64,1024,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %b = f32[1,1024,1024]{2,1,0} parameter(2)
  ROOT %f = f32[1,1024,1024]{2,1,0} fusion(%a, %i, %b), kind=kLoop, calls=%outer
}
"""


def test_a_fusion_reads_only_the_slice_a_nested_fusion_takes_of_a_stacked_operand():
    """The backward of a scanned layer recomputes a norm from the scan's stacked inputs inside a nested fusion that
    dynamic-slices one layer: the outer fusion reads that layer, not the 64 stacked."""
    layer = 4 * 1024 * 1024
    f = next(op for op in predict(NESTED).top if op.name == "f")
    assert f.bytes == pytest.approx(3 * layer + 4)  # the slice and b read, the result written, the index


def test_matmul_sides_from_sizes_read_a_batched_matmul_written_as_a_convolution():
    G, M, K, N = 32, 2048, 128, 2048
    assert hlo_time.matmul_sides(G * M * K, G * K * N, G * M * N, 2 * G * M * N * K) == (M, K, N)


def test_the_result_is_json_with_its_source_and_top_instructions():
    out = predict(LOOP.replace("TRIPS", "4")).as_dict()
    assert out["schema"] == hlo_time.SCHEMA and out["source"] == hlo_time.SOURCE
    assert out["top"][0]["name"] == "dot.2" and out["top"][0]["executions"] == 4
    assert out["top"][0]["seconds"] == pytest.approx(4 * out["top"][0]["seconds_each"])
    assert json.loads(json.dumps(out)) == out
    assert any("matmuls at" in line for line in out["assumptions"])


@pytest.mark.slow
def test_a_compiled_tpu_step_carries_its_hlo_time_beside_the_analytical_one(tmp_path):
    from maxperf import aot

    result = aot.compile("v5p-8", "tiny", ["seq_len=256", "per_device_batch_size=8"], out=tmp_path / "out")
    hlo = json.loads((tmp_path / "out" / "estimate.json").read_text())["hlo_time"]
    assert hlo["chip"] == "tpu-v5p" and hlo["step_time_s"] > 0
    assert hlo["flops_per_device"] == pytest.approx(result.cost["flops_per_device"], rel=1e-6)
    assert {op["kind"] for op in hlo["top"]} & {"matmul", "attention kernel"}
    assert math.isfinite(hlo["step_time_s"] / result.estimate["step_time_s"])


CUDNN = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[64,32,32,64], k: f32[3,3,64,128]) -> f32[64,32,32,128] {
  %x = f32[64,32,32,64]{3,2,1,0} parameter(0)
  %k = f32[3,3,64,128]{3,2,1,0} parameter(1)
  %conv = (f32[64,32,32,128]{3,2,1,0}, u8[0]) custom-call(%x, %k), CONVOLUTION, custom_call_target="__cudnn$convForward"
  ROOT %out = f32[64,32,32,128]{3,2,1,0} get-tuple-element(%conv), index=0
}
""".replace("CONVOLUTION", "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f")


def test_a_cudnn_convolution_is_a_matmul_of_its_forward_products():
    result = predict(CUDNN, "h100-8")
    op = result.top[0]
    assert op.kind == "matmul" and op.opcode == "custom-call:__cudnn$convForward"
    assert op.flops == 2 * (64 * 32 * 32 * 128) * (3 * 3 * 64)  # output elements x kernel elements per feature
    assert not result.not_modelled


SCATTER = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%all-reduce-scatter (input: bf16[2048,2048]) -> bf16[256,2048] {
  %input = bf16[2048,2048]{1,0} parameter(0)
  %ar = bf16[2048,2048]{1,0} all-reduce(%input), replica_groups=[1,8]<=[8], to_apply=%add
  %pid = u32[] partition-id()
  %c = u32[] constant(256)
  %offset = u32[] multiply(%pid, %c)
  %zero = u32[] constant(0)
  ROOT %ds = bf16[256,2048]{1,0} dynamic-slice(%ar, %offset, %zero), dynamic_slice_sizes={256,2048}
}

ENTRY %main (g: bf16[2048,2048]) -> bf16[256,2048] {
  %g = bf16[2048,2048]{1,0} parameter(0)
  ROOT %rs = bf16[256,2048]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter
}
"""


def test_a_tpu_all_reduce_scatter_fusion_is_priced_as_a_reduce_scatter():
    topo = topologies.get("v5p-16")
    nets = network.axis_networks(mesh_mod.resolve(ParallelismConfig(), topo), chips.get("tpu-v5p"), topo)
    result = predict(SCATTER)
    expected = network.collective_time("reduce-scatter", 2048 * 2048 * 2, ("fsdp",), nets).ici_s
    assert seconds_of(result, "rs") == pytest.approx(expected)
    assert result.top[0].kind == "collective"


COLLECTIVE_MATMUL = """HloModule m, is_scheduled=true

%collective_matmul (w: bf16[256,2048], x: bf16[4096,2048], saved: bf16[32,4096,2048]) -> bf16[4096,2048] {
  %w = bf16[256,2048]{1,0} parameter(0)
  %x = bf16[4096,2048]{1,0} parameter(1)
  %saved = bf16[32,4096,2048]{2,1,0} parameter(2)
  %ag = bf16[2048,2048]{1,0} all-gather(%w), replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %dot = bf16[4096,2048]{1,0} dot(%x, %ag), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[256,2048], x: bf16[4096,2048], saved: bf16[32,4096,2048]) -> bf16[4096,2048] {
  %w = bf16[256,2048]{1,0} parameter(0)
  %x = bf16[4096,2048]{1,0} parameter(1)
  %saved = bf16[32,4096,2048]{2,1,0} parameter(2)
  ROOT %cm = bf16[4096,2048]{1,0} fusion(%w, %x, %saved), kind=kOutput, calls=%collective_matmul
}
"""


def test_a_collective_matmul_fusion_is_its_matmul_or_its_gather_of_its_own_operand():
    """A TPU continuation fusion gathers a weight shard and multiplies as the pieces arrive: the slower of its matmul
    and its all-gather, the gather's buffer its own operand (the 0.5 MiB shard x 8), not the fusion's operands (a
    loop's carried [32, 4096, 2048] buffer came in as one, and was priced as gathered)."""
    topo = topologies.get("v5p-16")
    nets = network.axis_networks(mesh_mod.resolve(ParallelismConfig(), topo), chips.get("tpu-v5p"), topo)
    gather = network.collective_time("all-gather", 256 * 2048 * 2 * 8, ("fsdp",), nets).ici_s
    matmul = predict(DOT.replace("4096,8192", "4096,2048").replace("bf16[2048,8192]", "bf16[2048,2048]")).step_time_s
    result = predict(COLLECTIVE_MATMUL)
    # the fusion's own traffic (its operands read, its result written) may add to the matmul's roofline; the
    # carried buffer priced as gathered would be 8 x 512 MiB over the ICI, about 200 times the matmul
    assert gather < matmul <= seconds_of(result, "cm") < 3 * matmul
    assert result.top[0].kind == "matmul"


OFFLOAD = """HloModule m, is_scheduled=true

ENTRY %main (h: bf16[4,1024,2048], x: bf16[1,1024,2048], i: s32[]) -> bf16[1,1024,2048] {
  %h = bf16[4,1024,2048]{2,1,0:S(5)} parameter(0)
  %x = bf16[1,1024,2048]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %us = ((bf16[4,1024,2048]{2,1,0:S(5)}, bf16[1,1024,2048]{2,1,0}, s32[], s32[], s32[]), \
bf16[4,1024,2048]{2,1,0:S(5)}, u32[]) dynamic-update-slice-start(%h, %x, %i, %i, %i)
  %ud = bf16[4,1024,2048]{2,1,0:S(5)} dynamic-update-slice-done(%us)
  %ss = ((bf16[4,1024,2048]{2,1,0:S(5)}, s32[], s32[], s32[]), bf16[1,1024,2048]{2,1,0}, u32[]) \
dynamic-slice-start(%ud, %i, %i, %i), dynamic_slice_sizes={1,1024,2048}
  ROOT %sd = bf16[1,1024,2048]{2,1,0} dynamic-slice-done(%ss)
}
"""


def test_an_offload_moves_one_layers_slice_over_the_host_link_not_the_stacked_buffer():
    """A remat policy's offload writes one layer into the stacked host buffer (dynamic-update-slice) and brings one
    back (dynamic-slice): each crosses the host link with the slice's bytes, not the buffer's four layers."""
    result = predict(OFFLOAD, "v6e-8")
    layer = 1024 * 2048 * 2
    link = chips.get("tpu-v6e").host_link_bandwidth
    assert seconds_of(result, "us") == pytest.approx(layer / link, rel=1e-6)
    assert seconds_of(result, "ss") == pytest.approx(layer / link, rel=1e-3)


# A layer's matmul whose result the same fusion also writes into the scan's stacked buffer in place (remat saving
# it): a multi-output fusion, one root an in-place update, the other the result itself
SAVED = """HloModule m, is_scheduled=true

%saved (s0: bf16[64,4096,4096], s1: s32[], s2: bf16[4096,4096], s3: bf16[4096,4096]) -> (bf16[64,4096,4096], bf16[4096,4096]) {
  %s0 = bf16[64,4096,4096]{2,1,0} parameter(0)
  %s2 = bf16[4096,4096]{1,0} parameter(2)
  %s3 = bf16[4096,4096]{1,0} parameter(3)
  %mm = bf16[4096,4096]{1,0} dot(%s2, %s3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bc = bf16[1,4096,4096]{2,1,0} bitcast(%mm)
  %s1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %dus = bf16[64,4096,4096]{2,1,0} dynamic-update-slice(%s0, %bc, %s1, %z, %z)
  ROOT %t = (bf16[64,4096,4096]{2,1,0}, bf16[4096,4096]{1,0}) tuple(%dus, %mm)
}

ENTRY %main (a: bf16[64,4096,4096], i: s32[], x: bf16[4096,4096], w: bf16[4096,4096]) -> (bf16[64,4096,4096], bf16[4096,4096]) {
  %a = bf16[64,4096,4096]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[4096,4096]{1,0} parameter(2)
  %w = bf16[4096,4096]{1,0} parameter(3)
  ROOT %f = (bf16[64,4096,4096]{2,1,0}, bf16[4096,4096]{1,0}) fusion(%a, %i, %x, %w), kind=kOutput, calls=%saved
}
"""


def test_a_multi_output_fusion_writes_its_in_place_root_as_its_update():
    """The stacked buffer is neither read nor written whole: the matmul's operands read, its result written twice
    (into the stack's one layer and as the fusion's other output), the index; so the matmul is compute-bound."""
    layer = 2 * 4096 * 4096
    f = next(op for op in predict(SAVED).top if op.name == "f")
    assert f.bytes == pytest.approx(4 * layer + 4)
    assert f.bound == "compute"


# A permute issued as a start with its done right after (as XLA's TPU schedule prints a windowed einsum's), the
# done's result used only after an independent matmul
PERMUTED = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048], g: bf16[2048,2048]) -> bf16[2048,2048] {
  %x = bf16[2048,2048]{1,0} parameter(0)
  %w = bf16[2048,2048]{1,0} parameter(1)
  %g = bf16[2048,2048]{1,0} parameter(2)
  %cps = (bf16[2048,2048]{1,0}, bf16[2048,2048]{1,0}, u32[], u32[]) collective-permute-start(%g), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = bf16[2048,2048]{1,0} collective-permute-done(%cps)
  %d1 = bf16[2048,2048]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = bf16[2048,2048]{1,0} dot(%d1, %cpd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_tpu_permute_waits_where_its_result_is_first_used_not_at_its_done():
    """On a TPU the permute runs beside the first matmul; on a GPU its done waits for it where the schedule put it."""
    four = ParallelismConfig(ici_fsdp=4)
    tpu = predict(PERMUTED, "v5p-8", four)
    cp, d1, d2 = (seconds_of(tpu, n) for n in ("cps", "d1", "d2"))
    assert cp > 0
    assert tpu.step_time_s == pytest.approx(max(cp, d1) + d2)
    gpu = predict(PERMUTED, "h100-8", ParallelismConfig(ici_fsdp=8))
    overhead = hlo_time.KERNEL_OVERHEAD_S["gpu"]
    assert gpu.step_time_s == pytest.approx(seconds_of(gpu, "cps") + seconds_of(gpu, "d1") + seconds_of(gpu, "d2")
                                            + 2 * overhead)


# Two permutes of a bidirectional ring (one each way round the fsdp axis), and an all-gather along the tensor axis
LANES = """HloModule m, is_scheduled=true

ENTRY %main (g: bf16[4096,4096], h: bf16[4096,4096], k: bf16[1024,4096]) -> (bf16[4096,4096], bf16[4096,4096], bf16[4096,4096]) {
  %g = bf16[4096,4096]{1,0} parameter(0)
  %h = bf16[4096,4096]{1,0} parameter(1)
  %k = bf16[1024,4096]{1,0} parameter(2)
  %up = bf16[4096,4096]{1,0} collective-permute(%g), source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}
  %down = bf16[4096,4096]{1,0} collective-permute(%h), source_target_pairs={{2,0},{4,2},{6,4},{0,6},{3,1},{5,3},{7,5},{1,7}}
  %ag = bf16[4096,4096]{1,0} all-gather(%k), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %t = (bf16[4096,4096]{1,0}, bf16[4096,4096]{1,0}, bf16[4096,4096]{1,0}) tuple(%up, %down, %ag)
}
"""


def test_collectives_on_different_links_run_together():
    """The ring's two directions and the other axis each have links of their own: the three take as long as the
    longest of them, not their sum; two permutes the same way round wait on each other."""
    mesh = ParallelismConfig(ici_fsdp=4, ici_tensor=2)
    together = predict(LANES, "v5p-16", mesh)
    up, down, ag = (seconds_of(together, n) for n in ("up", "down", "ag"))
    assert min(up, down, ag) > 0
    assert together.step_time_s == pytest.approx(max(up, down, ag))
    same_way = predict(LANES.replace("{{2,0},{4,2},{6,4},{0,6},{3,1},{5,3},{7,5},{1,7}}",
                                     "{{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}"), "v5p-16", mesh)
    assert same_way.step_time_s == pytest.approx(max(up + down, ag))


# The scan's stacked residuals relaid out by a nested elementwise fusion (a copy to another tiling) of which the
# outer fusion takes one layer
RELAID = """HloModule m, is_scheduled=true

%relayout (r0: f32[64,1024,1024]) -> f32[64,1024,1024] {
  %r0 = f32[64,1024,1024]{2,1,0} parameter(0)
  ROOT %c = f32[64,1024,1024]{1,2,0} copy(%r0)
}

%outer (p0: f32[64,1024,1024], p1: s32[]) -> f32[1,1024,1024] {
  %p0 = f32[64,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %all = f32[64,1024,1024]{1,2,0} fusion(%p0), kind=kLoop, calls=%relayout
  %ds = f32[1,1024,1024]{1,2,0} dynamic-slice(%all, %p1, %z, %z), dynamic_slice_sizes={1,1024,1024}
  ROOT %sq = f32[1,1024,1024]{1,2,0} multiply(%ds, %ds)
}

ENTRY %main (a: f32[64,1024,1024], i: s32[]) -> f32[1,1024,1024] {
  %a = f32[64,1024,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = f32[1,1024,1024]{1,2,0} fusion(%a, %i), kind=kLoop, calls=%outer
}
"""


def test_a_fusion_reads_one_layer_of_a_stack_it_relays_out_and_slices():
    layer = 4 * 1024 * 1024
    f = next(op for op in predict(RELAID).top if op.name == "f")
    assert f.bytes == pytest.approx(2 * layer + 4)  # the layer read, the result written, the index


# XLA:GPU's asynchronous dynamic-slice fusion: its start's shape holds its operands, its result and a context
ASYNC_SLICE = """HloModule m, is_scheduled=true

%sliced (s0: bf16[24,2048,8192], s1: s32[]) -> bf16[1,2048,8192] {
  %s0 = bf16[24,2048,8192]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,2048,8192]{2,1,0} dynamic-slice(%s0, %s1, %z, %z), dynamic_slice_sizes={1,2048,8192}
}

ENTRY %main (a: bf16[24,2048,8192], i: s32[]) -> bf16[1,2048,8192] {
  %a = bf16[24,2048,8192]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %fs = ((bf16[24,2048,8192]{2,1,0}, s32[]), bf16[1,2048,8192]{2,1,0}, u32[]) fusion-start(%a, %i), kind=kLoop, calls=%sliced
  ROOT %fd = bf16[1,2048,8192]{2,1,0} fusion-done(%fs)
}
"""


def test_an_asynchronous_fusion_writes_its_result_not_its_operands():
    layer = 2 * 2048 * 8192
    fs = next(op for op in predict(ASYNC_SLICE, "h100-8").top if op.name == "fs")
    assert fs.bytes == pytest.approx(2 * layer + 4)  # the layer read and written, the index


# A gradient all-reduced whole of which each device then takes only its own rows (the slice in its consumer)
SUMMED = """HloModule m, is_scheduled=true

ENTRY %main (g: f32[4096,4096], i: s32[]) -> f32[512,4096] {
  %g = f32[4096,4096]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %ar = f32[4096,4096]{1,0} all-reduce(%g), replica_groups=[1,8]<=[8], to_apply=%add
  %z = s32[] constant(0)
  ROOT %mine = f32[512,4096]{1,0} dynamic-slice(%ar, %i, %z), dynamic_slice_sizes={512,4096}
}
"""


def test_an_all_reduce_of_which_each_device_keeps_its_shard_is_a_reduce_scatter():
    sharded = predict(SUMMED, "v5p-16", ParallelismConfig(ici_fsdp=8))
    whole = predict(SUMMED.replace("f32[512,4096]{1,0} dynamic-slice(%ar, %i, %z), dynamic_slice_sizes={512,4096}",
                                   "f32[4096,4096]{1,0} negate(%ar)").replace("-> f32[512,4096]", "-> f32[4096,4096]"),
                    "v5p-16", ParallelismConfig(ici_fsdp=8))
    ring = seconds_of(whole, "ar")  # an all-reduce: a reduce-scatter and an all-gather of the same buffer
    assert seconds_of(sharded, "ar") == pytest.approx(ring / 2, rel=0.05)


# A TPU async collective fusion: a start that issues the gather (channel 5), a fusion that runs a matmul while it
# carries the gather's buffers, and a done; the gathered weight then used
INFLIGHT = """HloModule m, is_scheduled=true

%start_comp (p: bf16[256,2048]) -> (bf16[256,2048], bf16[2048,2048]) {
  %p = bf16[256,2048]{1,0} parameter(0)
  %ag = bf16[2048,2048]{1,0} all-gather(%p), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %t = (bf16[256,2048]{1,0}, bf16[2048,2048]{1,0}) tuple(%p, %ag)
}

%carry_comp (c0: bf16[256,2048], c1: bf16[2048,2048], x: bf16[2048,2048], w: bf16[2048,2048]) -> (bf16[2048,2048], bf16[256,2048], bf16[2048,2048]) {
  %c0 = bf16[256,2048]{1,0} parameter(0)
  %c1 = bf16[2048,2048]{1,0} parameter(1)
  %x = bf16[2048,2048]{1,0} parameter(2)
  %w = bf16[2048,2048]{1,0} parameter(3)
  %mm = bf16[2048,2048]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %agc = bf16[2048,2048]{1,0} all-gather(%c0), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %t = (bf16[2048,2048]{1,0}, bf16[256,2048]{1,0}, bf16[2048,2048]{1,0}) tuple(%mm, %c0, %c1)
}

%done_comp (d0: bf16[256,2048], d1: bf16[2048,2048]) -> bf16[2048,2048] {
  %d0 = bf16[256,2048]{1,0} parameter(0)
  %d1 = bf16[2048,2048]{1,0} parameter(1)
  ROOT %agd = bf16[2048,2048]{1,0} all-gather(%d0), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}
}

ENTRY %main (g: bf16[256,2048], x: bf16[2048,2048], w: bf16[2048,2048]) -> bf16[2048,2048] {
  %g = bf16[256,2048]{1,0} parameter(0)
  %x = bf16[2048,2048]{1,0} parameter(1)
  %w = bf16[2048,2048]{1,0} parameter(2)
  %s = (bf16[256,2048]{1,0}, bf16[2048,2048]{1,0}) fusion(%g), kind=kCustom, calls=%start_comp
  %s0 = bf16[256,2048]{1,0} get-tuple-element(%s), index=0
  %s1 = bf16[2048,2048]{1,0} get-tuple-element(%s), index=1
  %c = (bf16[2048,2048]{1,0}, bf16[256,2048]{1,0}, bf16[2048,2048]{1,0}) fusion(%s0, %s1, %x, %w), kind=kCustom, calls=%carry_comp
  %mm = bf16[2048,2048]{1,0} get-tuple-element(%c), index=0
  %c0 = bf16[256,2048]{1,0} get-tuple-element(%c), index=1
  %c1 = bf16[2048,2048]{1,0} get-tuple-element(%c), index=2
  %d = bf16[2048,2048]{1,0} fusion(%c0, %c1), kind=kCustom, calls=%done_comp
  ROOT %d2 = bf16[2048,2048]{1,0} dot(%mm, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_an_async_collective_fusion_is_issued_once_and_runs_beside_the_matmul_that_carries_it():
    result = predict(INFLIGHT)
    ag, mm, d2 = (seconds_of(result, n) for n in ("s", "c", "d2"))
    assert ag > 0 and seconds_of(result, "d") == 0.0
    assert result.ici_s == pytest.approx(ag)  # the gather counted once
    assert result.step_time_s == pytest.approx(max(ag, mm) + d2)


def test_a_fusion_that_carries_a_collective_moves_only_its_matmuls_bytes():
    """The carrying fusion hands the gather's buffers back unread (the gather's traffic is the collective's): its
    bytes are its matmul's, x and w read and the product written, 3 x 8 MiB."""
    carry = next(o for o in predict(INFLIGHT).top if o.name == "c")
    assert carry.bytes == 3 * 2048 * 2048 * 2


# A windowed einsum's chunk: two interleaved pieces padded together, a chunk of 512 of their 2048 columns sliced out
# and multiplied; the fusion reads the chunk, not the whole operand
PADDED_CHUNK = """HloModule m, is_scheduled=true

%chunk_comp (p0: bf16[4096,1,2048], p1: s32[], p2: bf16[1024,2048]) -> bf16[4096,2048] {
  %p0 = bf16[4096,1,2048]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[1024,2048]{1,0} parameter(2)
  %inf = bf16[] constant(-inf)
  %padded = bf16[4096,2,2048]{2,1,0} pad(%p0, %inf), padding=0_0x0_1x0_0
  %zero = s32[] constant(0)
  %chunk = bf16[4096,2,512]{2,1,0} dynamic-slice(%padded, %zero, %zero, %p1), dynamic_slice_sizes={4096,2,512}
  %flat = bf16[4096,1024]{1,0} bitcast(%chunk)
  ROOT %mm = bf16[4096,2048]{1,0} dot(%flat, %p2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[4096,1,2048], i: s32[], w: bf16[1024,2048]) -> bf16[4096,2048] {
  %x = bf16[4096,1,2048]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = bf16[1024,2048]{1,0} parameter(2)
  ROOT %f = bf16[4096,2048]{1,0} fusion(%x, %i, %w), kind=kOutput, calls=%chunk_comp
}
"""


def test_a_padded_operand_that_is_only_sliced_is_read_as_far_as_its_slices():
    fused = next(o for o in predict(PADDED_CHUNK).top if o.name == "f")
    chunk, weight, product = 4096 * 2 * 512 * 2, 1024 * 2048 * 2, 4096 * 2048 * 2
    assert fused.bytes == chunk + 4 + weight + product  # not the whole 16 MiB operand


# The same, its carrying fusion in a computation of its own (as in a windowed einsum's loop body, which continues a
# gather issued before the loop under the same channel)
INFLIGHT_CALLED = INFLIGHT.replace("ENTRY %main", """%body_comp (b0: bf16[256,2048], b1: bf16[2048,2048], bx: bf16[2048,2048], bw: bf16[2048,2048]) -> (bf16[2048,2048], bf16[256,2048], bf16[2048,2048]) {
  %b0 = bf16[256,2048]{1,0} parameter(0)
  %b1 = bf16[2048,2048]{1,0} parameter(1)
  %bx = bf16[2048,2048]{1,0} parameter(2)
  %bw = bf16[2048,2048]{1,0} parameter(3)
  ROOT %cc = (bf16[2048,2048]{1,0}, bf16[256,2048]{1,0}, bf16[2048,2048]{1,0}) fusion(%b0, %b1, %bx, %bw), kind=kCustom, calls=%carry_comp
}

ENTRY %main""").replace("fusion(%s0, %s1, %x, %w), kind=kCustom, calls=%carry_comp", "call(%s0, %s1, %x, %w), to_apply=%body_comp")


def test_a_matmul_that_carries_a_collective_issued_in_another_computation_is_costed_where_it_runs():
    """The carrying fusion's matmul runs (and its FLOPs count) in whichever computation it sits; the gather it
    carries is still issued once, at its start."""
    inline, called = predict(INFLIGHT), predict(INFLIGHT_CALLED)
    assert called.flops == inline.flops == 2 * (2 * 2048**3)
    assert seconds_of(inline, "c") > 0 and seconds_of(called, "cc") == pytest.approx(seconds_of(inline, "c"))
    assert called.ici_s == pytest.approx(inline.ici_s)
    assert inline.ici_s == pytest.approx(seconds_of(inline, "s"))


# A windowed einsum's loop (XLA's collective matmul): each iteration multiplies the piece of the weight that has
# arrived, a quarter of its 8192 columns, and passes the piece on round a ring of 4 devices
WINDOWED = """HloModule m, is_scheduled=true

%windowed_dot_general_body_ag (p: (s32[], bf16[8192,4096], bf16[4096,2048])) -> (s32[], bf16[8192,4096], bf16[4096,2048]) {
  %p = (s32[], bf16[8192,4096]{1,0}, bf16[4096,2048]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8192,4096]{1,0} get-tuple-element(%p), index=1
  %w = bf16[4096,2048]{1,0} get-tuple-element(%p), index=2
  %chunk = bf16[8192,2048]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %next_w = bf16[4096,2048]{1,0} collective-permute(%w), source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8192,4096]{1,0}, bf16[4096,2048]{1,0}) tuple(%next, %x, %next_w)
}

%cond (q: (s32[], bf16[8192,4096], bf16[4096,2048])) -> pred[] {
  %q = (s32[], bf16[8192,4096]{1,0}, bf16[4096,2048]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x0: bf16[8192,4096], w0: bf16[4096,2048]) -> bf16[4096,2048] {
  %x0 = bf16[8192,4096]{1,0} parameter(0)
  %w0 = bf16[4096,2048]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8192,4096]{1,0}, bf16[4096,2048]{1,0}) tuple(%zero, %x0, %w0)
  %loop = (s32[], bf16[8192,4096]{1,0}, bf16[4096,2048]{1,0}) while(%init), condition=%cond, body=%windowed_dot_general_body_ag
  ROOT %out = bf16[4096,2048]{1,0} get-tuple-element(%loop), index=2
}
"""


def test_a_windowed_einsums_chunks_run_at_the_whole_matmuls_rate():
    """Each chunk [8192, 4096] x [4096, 2048] runs at the rate of the whole [8192, 4096] x [4096, 8192] (its smallest
    side 4096, not the chunk's 2048); the same loop under another name is four matmuls of its own."""
    mesh = ParallelismConfig(ici_fsdp=4, ici_tensor=2)
    chip = chips.get("tpu-v5p")
    half = SHIPPED.matmul_half["tpu"] * half_scale(chip)
    flops = 2 * 8192 * 4096 * 2048

    def chunk_seconds(text):
        return seconds_of(predict(text, "v5p-16", mesh), "chunk")

    whole = flops / (chip.peak_bf16_flops * matmul_efficiency(chip, 4096, half) * mxu_fill(chip, 4096, 2048))
    alone = flops / (chip.peak_bf16_flops * matmul_efficiency(chip, 2048, half) * mxu_fill(chip, 4096, 2048))
    assert chunk_seconds(WINDOWED) == pytest.approx(whole)
    assert chunk_seconds(WINDOWED.replace("windowed_dot_general_body_ag", "body")) == pytest.approx(alone)
    assert alone > 1.1 * whole


GEMM_CONFIG = ('backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{'
               '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
               '"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}')
BARE_GEMM = f"""HloModule m, is_scheduled=true

ENTRY %main (x: bf16[4096,3584], w: bf16[3584,4096]) -> bf16[4096,4096] {{
  %x = bf16[4096,3584]{{1,0}} parameter(0)
  %w = bf16[3584,4096]{{1,0}} parameter(1)
  %gemm = (bf16[4096,4096]{{1,0}}, s8[33554432]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
  ROOT %out = bf16[4096,4096]{{1,0}} get-tuple-element(%gemm), index=0
}}
"""
SLICED_GEMM = f"""HloModule m, is_scheduled=true

%dynamic-slice-fusion (p0: bf16[1,2,3584,4096], p1: bf16[4096,3584]) -> (bf16[4096,4096], s8[33554432]) {{
  %p1 = bf16[4096,3584]{{1,0}} parameter(1)
  %p0 = bf16[1,2,3584,4096]{{3,2,1,0}} parameter(0)
  %slice = bf16[1,1,3584,4096]{{3,2,1,0}} slice(%p0), slice={{[0:1], [1:2], [0:3584], [0:4096]}}
  %w = bf16[3584,4096]{{1,0}} bitcast(%slice)
  ROOT %gemm = (bf16[4096,4096]{{1,0}}, s8[33554432]{{0}}) custom-call(%p1, %w), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
}}

ENTRY %main (x: bf16[4096,3584], ws: bf16[1,2,3584,4096]) -> bf16[4096,4096] {{
  %x = bf16[4096,3584]{{1,0}} parameter(0)
  %ws = bf16[1,2,3584,4096]{{3,2,1,0}} parameter(1)
  %fused = (bf16[4096,4096]{{1,0}}, s8[33554432]{{0}}) fusion(%ws, %x), kind=kCustom, calls=%dynamic-slice-fusion
  ROOT %out = bf16[4096,4096]{{1,0}} get-tuple-element(%fused), index=0
}}
"""


def test_a_gemm_that_a_dynamic_slice_fusion_feeds_is_priced_by_its_own_sides():
    """XLA:GPU wraps a cuBLAS GEMM whose weight is a slice of a stacked operand (a pipeline stage's repeat) in a
    dynamic-slice fusion: it runs at the rate of its own [M, K] x [K, N], as the bare GEMM does (read as a matmul
    of one row, a 4096 x 3584 x 4096 GEMM took 590x as long)."""
    bare, sliced = (predict(text, "h100-8") for text in (BARE_GEMM, SLICED_GEMM))
    flops = 2 * 4096 * 3584 * 4096
    assert bare.flops == sliced.flops == flops
    assert sliced.top[0].kind == "matmul" and sliced.step_time_s == pytest.approx(bare.step_time_s, rel=0.01)
    chip = chips.get("h100-sxm")
    assert bare.step_time_s < 1.5 * flops / (chip.peak_bf16_flops * matmul_efficiency(chip, 3584))


MEGASCALE = ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
             '_xla_host_transfer_rendezvous="ppermute.1_0"}')
ACROSS_SLICES = f"""HloModule m, is_scheduled=true

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048], a: bf16[4096,8192]) -> bf16[2048,2048] {{
  %x = bf16[2048,2048]{{1,0}} parameter(0)
  %w = bf16[2048,2048]{{1,0}} parameter(1)
  %a = bf16[4096,8192]{{1,0}} parameter(2)
  %tok = token[] after-all()
  %send = (bf16[4096,8192]{{1,0}}, u32[], token[]) send(%a, %tok), channel_id=2, {MEGASCALE}
  %d1 = bf16[2048,2048]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %recv = (bf16[4096,8192]{{1,0}}, u32[], token[]) recv(%tok), channel_id=1, {MEGASCALE}
  %sd = token[] send-done(%send), channel_id=2, {MEGASCALE}
  %rd = (bf16[4096,8192]{{1,0}}, token[]) recv-done(%recv), channel_id=1, {MEGASCALE}
  %got = bf16[4096,8192]{{1,0}} get-tuple-element(%rd), index=0
  %b = bf16[2048,2048]{{1,0}} slice(%got), slice={{[0:2048], [0:2048]}}
  ROOT %d2 = bf16[2048,2048]{{1,0}} dot(%d1, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


def test_a_megascale_all_reduce_moves_what_its_ring_over_the_slices_moves():
    """XLA splits a data-parallel all-reduce across slices into one Megascale send per gradient, marked as an
    ALL_REDUCE over the slices its target lists: over 4 slices a ring moves 2 x 3 / 4 of the buffer (a ppermute's
    send moves it once); an ALL_GATHER's send, its piece, moves the 3 other slices' pieces."""
    topo = topologies.get("v5p-8", num_slices=4)
    mesh = mesh_mod.resolve(ParallelismConfig(), topo)
    chip = chips.get("tpu-v5p")
    latency = SHIPPED.dcn_step_latency["tpu"]
    buffer = 2 * 4096 * 8192

    def send_seconds(kind: str) -> float:
        attrs = (f'_xla_megascale_target="{{1,2,3,4}}x{{0:3}}",_xla_megascale_transfer_type="{kind}",'
                 '_xla_host_transfer_rendezvous=')
        text = ACROSS_SLICES.replace("_xla_host_transfer_rendezvous=", attrs)
        return next(o for o in hlo_time.hlo_time(text, chip, topo, mesh).top if o.name == "send").seconds

    assert send_seconds("ALL_REDUCE") == pytest.approx(2 * 3 / 4 * buffer / chip.host_network_per_chip + latency)
    assert send_seconds("ALL_GATHER") == pytest.approx(3 * buffer / chip.host_network_per_chip + latency)
    assert send_seconds("ONE_TO_ONE") == pytest.approx(buffer / chip.host_network_per_chip + latency)


def test_a_transfer_between_slices_pays_the_dcn_and_overlaps_the_work_before_its_done():
    """A ppermute across TPU slices (a pipeline's stages over DCN) compiles to a send and a recv handed to the
    Megascale runtime: the send's buffer over the chip's share of its hosts' network plus a ring step's latency,
    overlapping the work the schedule puts before the recv's done, which waits for it."""
    topo = topologies.get("v5p-8", num_slices=2)
    mesh = mesh_mod.resolve(ParallelismConfig(), topo)
    chip = chips.get("tpu-v5p")
    result = hlo_time.hlo_time(ACROSS_SLICES, chip, topo, mesh)
    send = next(o for o in result.top if o.name == "send")
    transfer = 2 * 4096 * 8192 / chip.host_network_per_chip + SHIPPED.dcn_step_latency["tpu"]
    assert send.bound == "dcn" and send.seconds == pytest.approx(transfer) and result.dcn_s == pytest.approx(transfer)
    d1, d2 = seconds_of(result, "d1"), seconds_of(result, "d2")
    assert transfer > d1 and result.step_time_s == pytest.approx(transfer + seconds_of(result, "b") + d2)


def test_a_flash_kernel_read_from_the_hlo_runs_at_the_analytical_models_flash_rate_on_an_a100_and_an_h100():
    """The reader prices an attention kernel's FLOPs as perfmodel prices the flash kernels: the fitted flash share of
    the sustained matmul rate, times chips.flash_architecture (FlashAttention-2's published A100 rate over its H100
    rate, each of the chip's best matmul) on an A100, where the compiled kernel (Pallas Triton) issues the instructions
    it was written for."""
    from maxperf.perfmodel import work

    rates = {}
    for topology in ("a100-8", "h100-8"):
        topo = topologies.get(topology)
        chip = chips.get(topo.chip)
        walker = hlo_time._Walker(ADD, chip, topo, mesh_mod.resolve(ParallelismConfig(), topo), work.SHIPPED)
        cost = walker.attention_cost(1e15, 1.0, 128)
        rates[topology] = 1e15 / cost.seconds / (chip.peak_bf16_flops * work.SHIPPED.fraction(chip))
    assert rates["h100-8"] == pytest.approx(work.FLASH_EFFICIENCY["gpu"], rel=1e-9)
    assert rates["a100-8"] / rates["h100-8"] == pytest.approx(chips.flash_architecture(chips.get("a100-80gb")), rel=1e-9)
