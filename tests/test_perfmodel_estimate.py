"""perfmodel.estimate: memory sharding, step-time monotonicity, bottlenecks, errors, JSON, no jax.

How fast it estimates is measured by bench/quick_paths.py, not asserted here."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from perfmodel_util import Topo

from maxperf.perfmodel import Overlap, count_flops, estimate, network
from maxperf.perfmodel.chips import get as get_chip
from maxperf.perfmodel.network import axis_networks
from maxperf.perfmodel.saved import layer_saved_per_token
from maxperf.perfmodel.work import SHIPPED
from maxperf.spec import overrides, presets, topology
from maxperf.spec.errors import MaxperfError
from maxperf.spec.mesh import Mesh
from maxperf.spec.params import reduced_arrays
from maxperf.spec.request import Request
from maxperf.spec.train import TrainConfig


def v5p(chips, torus=(4, 4, 4)):
    return Topo("tpu-v5p", chips, hosts=chips // 4, torus=torus)


LLAMA = presets.get("llama2-7b")
TRAIN = TrainConfig(per_device_batch_size=2, seq_len=2048)


def test_as_dict_is_json_with_the_documented_keys():
    d = json.loads(json.dumps(estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 64}, {})).as_dict()))
    for key in ("step_time_s", "tokens_per_s", "tflops_per_chip", "mfu", "model_flops_per_device",
                "hardware_flops_per_device", "memory_per_device_bytes", "fits", "bottleneck", "breakdown", "memory"):
        assert key in d, key
    assert d["memory"]["per_device_total_bytes"] == d["memory_per_device_bytes"]
    assert {"name", "kind", "seconds", "exposed_seconds", "flops", "bytes"} <= set(d["breakdown"][0])


def test_mfu_and_throughput_follow_from_step_time():
    e = estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 64}, {}))
    assert e.peak_flops == 459e12
    assert e.mfu == e.model_flops_per_device / (e.step_time_s * 459e12)
    assert e.tokens_per_s == pytest.approx(2 * 2048 * 64 / e.step_time_s, rel=1e-12)
    assert e.tflops_per_chip == pytest.approx(e.mfu * 459, rel=1e-12)
    assert e.hardware_flops_per_device > e.model_flops_per_device


def test_accumulation_runs_a_microbatches_of_b_per_device():
    # MaxText's meaning: per_device_batch_size is one microbatch, the step A of them (B x A x L tokens per device)
    one = TrainConfig(per_device_batch_size=2, seq_len=2048)
    four = replace(one, grad_accum_steps=4)
    e1 = estimate(Request.of(v5p(64), LLAMA, one, {"fsdp": 64}, {}))
    e4 = estimate(Request.of(v5p(64), LLAMA, four, {"fsdp": 64}, {}))
    assert count_flops(LLAMA, four).tokens == 2 * 4 * 2048
    assert e4.model_flops_per_device == pytest.approx(4 * e1.model_flops_per_device, rel=1e-12)
    assert e4.tokens_per_s == pytest.approx(2 * 4 * 2048 * 64 / e4.step_time_s, rel=1e-12)
    # the activations are one microbatch's, as without accumulation; the float32 accumulator is added
    assert e4.memory.activations == e1.memory.activations and e4.memory.logits == e1.memory.logits
    assert e1.memory.grad_accumulator == 0 < e4.memory.grad_accumulator
    rows = {r.name: r for r in e1.breakdown}
    for r in e4.breakdown:  # each microbatch's matmuls once per microbatch; the optimizer's update once per step
        if r.kind == "compute":
            assert r.flops == pytest.approx(4 * rows[r.name].flops, rel=1e-12), r.name
    update = next(r for r in e4.breakdown if r.name == "optimizer update")
    assert update.bytes == rows["optimizer update"].bytes


def test_the_largest_preset_on_a_full_pod_adds_up():
    e = estimate(Request.of(v5p(8960, (16, 20, 28)), presets.get("llama3.1-405b"), TrainConfig(seq_len=8192),
                            {"fsdp": 1120, "tensor": 8}, {}))
    t = e.time
    assert e.step_time_s == pytest.approx(t.compute_s + t.hbm_s + t.exposed_ici_s + t.exposed_dcn_s, rel=1e-12)
    assert e.mfu == e.model_flops_per_device / (e.step_time_s * e.peak_flops)


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_estimates_and_its_figures_follow_from_each_other(name):
    e = estimate(Request.of(v5p(256, (4, 8, 8)), presets.get(name), TRAIN, {"fsdp": 256}, {}))
    assert e.mfu == e.model_flops_per_device / (e.step_time_s * 459e12)
    assert e.tokens_per_s == pytest.approx(2 * 2048 * 256 / e.step_time_s, rel=1e-12)
    assert e.memory_per_device_bytes == e.memory.per_device_total_bytes
    assert e.fits == (e.memory.per_device_total_bytes <= e.memory.hbm_bytes)


def test_state_divides_by_fsdp_and_activations_by_the_batch_shards():
    small = estimate(Request.of(v5p(8, (2, 2, 2)), LLAMA, TrainConfig(per_device_batch_size=4), {"fsdp": 8}, {})).memory
    large = estimate(Request.of(v5p(32, (2, 4, 4)), LLAMA, TrainConfig(per_device_batch_size=1), {"fsdp": 32},
                                {})).memory
    # the same global batch (32 sequences): 4x the shards, 1/4 of everything but the replicated norms
    for field in ("params", "optimizer", "gradients", "activations"):
        assert getattr(large, field) == pytest.approx(getattr(small, field) / 4, rel=1e-3), field


def test_tensor_parallelism_splits_per_token_activations():
    train = TrainConfig(remat_policy="minimal")
    topo = v5p(8, (2, 2, 2))
    fsdp = layer_saved_per_token(LLAMA, train, Mesh.of({"fsdp": 8}, {}).check(topo), remat="minimal")
    tensor = layer_saved_per_token(LLAMA, train, Mesh.of({"fsdp": 2, "tensor": 4}, {}).check(topo), remat="minimal")
    assert tensor < fsdp


def test_remat_trades_memory_for_time():
    e = {r: estimate(Request.of(v5p(64), LLAMA, replace(TRAIN, remat_policy=r), {"fsdp": 64}, {})) for r in
         ("none", "minimal", "full")}
    assert e["none"].memory.activations > e["minimal"].memory.activations > e["full"].memory.activations
    assert e["none"].step_time_s < e["minimal"].step_time_s < e["full"].step_time_s


def test_fit_verdict_and_headroom():
    fits = estimate(Request.of(v5p(8, (2, 2, 2)), presets.get("tiny"), TRAIN, {"fsdp": 8}, {}))
    assert fits.fits and fits.memory.headroom_bytes > 0
    big = estimate(Request.of(Topo("tpu-v5e", 8, 8, torus=(2, 4)), presets.get("llama3.1-405b"), TRAIN, {"fsdp": 8},
                              {}))
    assert not big.fits and big.memory.headroom_bytes < 0


def test_more_chips_at_fixed_per_device_batch_do_not_add_compute():
    times = [estimate(Request.of(v5p(n, t), LLAMA, TRAIN, {"fsdp": n}, {})).time.compute_s
             for n, t in ((16, (2, 2, 4)), (64, (4, 4, 4)), (256, (4, 8, 8)))]
    assert times[0] >= times[1] >= times[2]


def test_tensor_parallelism_adds_collectives():
    fsdp = estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 64}, {}))
    tensor = estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 16, "tensor": 4}, {}))
    assert not any("tensor" in r.name for r in fsdp.breakdown)
    assert any(r.name.startswith("tensor all-reduce") and r.seconds > 0 for r in tensor.breakdown)
    more = estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 8, "tensor": 8}, {}))
    tp = [sum(r.seconds for r in e.breakdown if r.name.startswith("tensor")) for e in (tensor, more)]
    assert tp[1] > tp[0]


def test_overlap_never_lengthens_the_step():
    steps = [estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 16, "tensor": 4}, {}), overlap=f).step_time_s
             for f in (0.0, 0.5, 1.0)]
    assert steps[0] > steps[1] > steps[2]
    assert estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 64}, {}), overlap=Overlap(fsdp=0.3)).overlap.fsdp == 0.3


def test_bottleneck_compute_for_a_big_model_on_big_batches():
    e = estimate(Request.of(v5p(1024, (8, 8, 16)), presets.get("gpt3-175b"), TrainConfig(seq_len=2048),
                            {"fsdp": 1024}, {}))
    assert e.bottleneck == "compute"


def test_bottleneck_hbm_for_a_tiny_model():
    # L < 128: the GPU's flash kernel cannot serve it, the model runs the dot product, whose scores grow as L^2
    # (compute-bound at 64); on a TPU its D of 64 fills half of the 128-wide matrix units, its Dh of 16 an eighth
    e = estimate(Request.of(Topo("h100-sxm", 1, chips_per_host=1), presets.get("tiny"),
                            TrainConfig(per_device_batch_size=1, seq_len=32), {}, {}))
    assert e.bottleneck == "hbm"


def test_bottleneck_ici_for_heavy_tensor_parallelism_on_short_sequences():
    e = estimate(Request.of(Topo("tpu-v5e", 1024, 8, num_slices=4, hosts=128, torus=(16, 16)), LLAMA,
                            TrainConfig(per_device_batch_size=1, seq_len=128), {"data": 4, "fsdp": 256}, {"data": 4}))
    assert e.bottleneck == "ici"


def test_bottleneck_dcn_when_gradients_cross_slices():
    e = estimate(Request.of(Topo("tpu-v5e", 16, 4, num_slices=4, hosts=4, torus=(2, 2)), LLAMA,
                            TrainConfig(per_device_batch_size=1, seq_len=128), {"data": 4, "fsdp": 4}, {"data": 4}))
    assert e.bottleneck == "dcn"
    assert any(r.kind == "dcn" and r.name.startswith("data all-reduce") for r in e.breakdown)


def test_gpu_collectives_cross_infiniband_beyond_the_nvlink_domain():
    hgx = Topo("h100-sxm", 128, 8, hosts=16, torus=(16, 8))
    inside = estimate(Request.of(hgx, LLAMA, TRAIN, {"fsdp": 16, "tensor": 8}, {"fsdp": 16}))
    assert all(r.kind != "dcn" for r in inside.breakdown if r.name.startswith("tensor"))
    assert any(r.kind == "dcn" for r in inside.breakdown if r.name.startswith("fsdp"))
    nvl72 = estimate(Request.of(Topo("gb200", 64, 4, hosts=16), LLAMA, TRAIN, {"fsdp": 64}, {}))
    assert not any(r.kind == "dcn" for r in nvl72.breakdown)
    # four racks of which the job takes 64 GPUs each: the NVLink domain is the job's 64 GPUs of a rack, not 72
    racks = topology.get("gb200-64x4")
    nets = axis_networks(Mesh(ici={"fsdp": 64}, dcn={"fsdp": 4}), get_chip("gb200"), racks)
    assert (nets["fsdp"].inner, nets["fsdp"].outer) == (64, 4)
    part = axis_networks(Mesh(ici={"fsdp": 8}, dcn={}), get_chip("gb200"), topology.get("gb200-8"))
    assert (part["fsdp"].inner, part["fsdp"].outer) == (8, 1)


def test_a_gpu_meshs_dcn_axes_cross_hosts_whatever_their_order():
    """The device mesh puts ici axes inside a host's NVLink domain and dcn axes across hosts (aot.targets), so the
    network follows ici and dcn: fsdp across two HGX hosts with data inside them runs over the NICs alone, as does
    a pipeline's stage axis across 8 hosts beside tensor 4 x data 2 inside each (NVIDIA's Llama 3 70B layout)."""
    chip, hosts = get_chip("h100-sxm"), topology.get("h100-8x2")
    nets = axis_networks(Mesh(ici={"data": 8}, dcn={"fsdp": 2}), chip, hosts)
    assert (nets["fsdp"].inner, nets["fsdp"].outer) == (1, 2) and (nets["data"].inner, nets["data"].outer) == (8, 1)
    nemo = axis_networks(Mesh(ici={"tensor": 4, "data": 2}, dcn={"stage": 8}), chip, topology.get("h100-8x8"))
    assert [(nemo[a].inner, nemo[a].outer) for a in ("tensor", "data", "stage")] == [(4, 1), (2, 1), (1, 8)]


def test_an_a3_vms_gradients_cross_its_slower_network():
    """The same step on 16 A3 High VMs and on 16 HGX H100 hosts: its gradient all-reduce across them takes 4 times as
    long over A3 High's 800 Gbps a VM as over HGX's 3,200, and nothing inside a VM changes."""
    train = TrainConfig(per_device_batch_size=4, seq_len=4096)

    bandwidth_only = replace(SHIPPED, dcn_step_latency={**SHIPPED.dcn_step_latency, "gpu": 0.0})

    def rows(name):
        e = estimate(Request.of(topology.get(name), LLAMA, train, {"fsdp": 8, "data": 16}, {"data": 16}),
                     constants=bandwidth_only)
        return {r.name: r.seconds for r in e.breakdown}

    a3, hgx = rows("a3-high-8x16"), rows("h100-8x16")
    assert a3["data all-reduce (dcn)"] == pytest.approx(4 * hgx["data all-reduce (dcn)"], rel=1e-9)
    assert a3["fsdp all-gather (ici)"] == hgx["fsdp all-gather (ici)"] and a3["mlp down"] == hgx["mlp down"]


def test_an_unscanned_steps_gradient_reductions_hide_as_fsdps_collectives():
    """Scanned, the stacked gradients are reduced over `data` once after the backward, exposed (Overlap.data);
    unscanned, each layer's as its backward ends, behind the layers still to compute, hidden as FSDP's per-layer
    collectives are (Overlap.fsdp)."""
    def reduction(scan):
        e = estimate(Request.of(topology.get("h100-8x4"), LLAMA,
                                TrainConfig(per_device_batch_size=4, seq_len=4096, scan_layers=scan),
                                {"fsdp": 8, "data": 4}, {"data": 4}))
        row = next(r for r in e.breakdown if r.name == "data all-reduce (dcn)")
        return row, e

    (scanned, _), (unscanned, e) = reduction(True), reduction(False)
    assert scanned.exposed_seconds == scanned.seconds
    assert unscanned.exposed_seconds == pytest.approx(unscanned.seconds * (1 - Overlap().fsdp), rel=1e-9)
    assert any("gradient reductions of unscanned layers" in a and f"{Overlap().fsdp:.0%} hidden" in a
               for a in e.assumptions)


@pytest.mark.parametrize("name, wrapped, closed", [
    ("v6e-256", (16, 16), (True, True)),  # the pod's 16 x 16: both dimensions close into rings
    ("v6e-128", (8, 16), (False, True)),  # only the 16-chip dimension wraps
    ("v6e-64", (8, 8), (False, False)),
    ("v5p-128", (4, 4, 4), (True, True, True)),  # one whole cube
    ("v5p-64", (2, 4, 4), (False, False, False)),  # below a cube, no optical wraparound
])
def test_torus_dimensions_without_wraparound_give_rings_half_the_links(name, wrapped, closed):
    topo = topology.get(name)
    chip = get_chip(topo.chip)
    assert tuple(topo.torus) == wrapped and network.wraparounds(chip, topo.torus) == closed
    every = Mesh(ici={"fsdp": topo.chips}, dcn={})
    links = sum(2 if c else 1 for c in closed)
    assert axis_networks(every, chip, topo)["fsdp"].inner_bandwidth == pytest.approx(links * chip.link_bandwidth)


def test_an_all_gather_over_a_slice_without_wraparound_takes_twice_as_long():
    chip = get_chip("tpu-v6e")
    lines, rings = topology.get("v6e-64"), topology.get("v6e-256")
    t_lines = network.collective_time("all-gather", 1e9, ("fsdp",), axis_networks(Mesh(ici={"fsdp": 64}, dcn={}),
                                                                                 chip, lines))
    t_rings = network.collective_time("all-gather", 1e9, ("fsdp",), axis_networks(Mesh(ici={"fsdp": 256}, dcn={}),
                                                                                 chip, rings))
    latency = network.LATENCY_S["ici"]
    assert (t_lines.ici_s - latency) / (t_rings.ici_s - latency) == pytest.approx(2 * (63 / 64) / (255 / 256))


def test_tpu7x_two_devices_per_chip():
    topo = Topo("tpu7x", 64, 4, hosts=16, torus=(4, 4, 4), devices_per_chip=2)
    e = estimate(Request.of(topo, LLAMA, TRAIN, {"fsdp": 128}, {}))
    assert e.peak_flops == pytest.approx(2307e12 / 2)
    with pytest.raises(MaxperfError, match="128 devices"):
        estimate(Request.of(topo, LLAMA, TRAIN, {"fsdp": 64}, {}))


@pytest.mark.parametrize("mesh, dcn, match", [
    ({"fsdp": 60}, {}, "multiply to 60 but the topology has 64"),
    ({"fsdp": 64, "pipeline": 2}, {}, "unknown mesh axes pipeline"),
    ({"fsdp": 64}, {"fsdp": 3}, "dcn fsdp=3 must be >= 1 and divide"),
    ({"fsdp": 64}, {"fsdp": 2}, "multiply to 2 but the topology has 1 DCN domain"),
    ({"fsdp": 0, "data": 64}, {}, "must be >= 1"),
])
def test_bad_meshes_are_one_line_errors(mesh, dcn, match):
    with pytest.raises(MaxperfError, match=match) as err:
        estimate(Request.of(v5p(64), LLAMA, TRAIN, mesh, dcn))
    assert "\n" not in str(err.value)


def test_zero_batch_is_an_error():
    with pytest.raises(MaxperfError, match="per_device_batch_size must be > 0"):
        TrainConfig(per_device_batch_size=0)


def test_unknown_chip_is_an_error_naming_close_matches():
    from maxperf.perfmodel import get_chip

    with pytest.raises(MaxperfError, match="unknown chip 'tpu-v5pp'; did you mean tpu-v5p"):
        get_chip("tpu-v5pp")


def test_bad_overlap_is_an_error():
    with pytest.raises(MaxperfError, match="overlap fsdp must be between 0 and 1"):
        Overlap(fsdp=1.5)


def test_shard_counts_follow_the_models_partition_specs():
    from maxperf.models.sharding import mesh_axes_for
    from maxperf.spec.logical_axes import split
    from maxperf.spec.mesh import Mesh

    sizes = {"data": 2, "fsdp": 4, "sequence": 1, "tensor": 8, "expert": 1}
    mesh = Mesh.of(sizes, {}).check(Topo("tpu-v5p", 64))
    for shape, logical in [((4096, 32, 128), ("embed", "heads", "head_dim")), ((4096, 4, 128), ("embed", "kv_heads",
                           "head_dim")), ((16, 2048), ("activation_batch", "activation_length"))]:
        entries = mesh_axes_for(shape, logical, sizes)
        expected = tuple(1 if e is None else sizes[e] if isinstance(e, str) else sizes[e[0]] * sizes[e[1]]
                         for e in entries)
        assert split(shape, logical, mesh.axes) == expected
    assert split((4096, 4, 128), ("embed", "kv_heads", "head_dim"), mesh.axes) == (4, 1, 1)


def test_perfmodel_imports_only_the_spec_and_no_jax():
    code = ("import sys, maxperf.perfmodel, maxperf.perfmodel.estimate; "
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.') or (m.startswith('maxperf.') and not "
            "m.startswith(('maxperf.perfmodel', 'maxperf.spec')))]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_memory_is_the_target_specs_where_the_topology_states_it(monkeypatch):
    from maxperf.spec import gpu_targets

    hgx = Topo("h100-sxm", 16, 8, hosts=2, torus=(2, 8))
    monkeypatch.setattr(gpu_targets, "target_memory_bytes", lambda chip, path: 84942979072)  # the plugin's H100 spec
    spec = estimate(Request.of(hgx, LLAMA, TRAIN, {"fsdp": 16}, {"fsdp": 2}))
    assert spec.memory.hbm_bytes == 84942979072 and spec.notes == ()
    assert spec.fits == (spec.memory.per_device_total_bytes <= 84942979072)
    monkeypatch.setattr(gpu_targets, "target_memory_bytes", lambda chip, path: None)  # no CUDA plugin
    datasheet = estimate(Request.of(hgx, LLAMA, TRAIN, {"fsdp": 16}, {"fsdp": 2}))
    assert datasheet.memory.hbm_bytes == 80e9
    assert datasheet.notes == ("h100-sxm memory is the datasheet's 80 GB, not read from the GPU target spec that "
                               "compiles (it needs the CUDA plugin: pip install 'maxperf[gpu]')",)
    assert datasheet.as_dict()["notes"] == list(datasheet.notes)


def test_dot_product_attention_costs_what_an_h100_measured_over_flash():
    """On one H100 (bench/gpu_measured.py, 2026-11-23), scaled-1 at B 8, L 2048, full remat: the dot product's step
    was 89.2 ms longer than flash's (384.7 against 295.5 ms). The model's difference stays within 15% of that: the
    head-dim-wide sides of the batched attention einsums once made it 247 ms."""
    h100 = Topo("h100-sxm", 1, chips_per_host=1, torus=(1, 1))
    scaled = presets.get("scaled-1")

    def step(kernel):
        train = TrainConfig(per_device_batch_size=8, seq_len=2048, attention=kernel)
        return estimate(Request.of(h100, scaled, train, {"fsdp": 1}, {})).step_time_s

    difference = step("dot_product") - step("flash")
    assert difference == pytest.approx(0.0892, rel=0.15)


@pytest.mark.parametrize("name, batch, compiled_gib", [("qwen3-0.6b", 16, 27.44), ("scaled-4", 4, 64.01),
                                                        ("scaled-1", 8, 18.88), ("gemma2-2b", 4, 47.55)])
def test_gpu_memory_follows_what_an_h100_compiled(name, batch, compiled_gib):
    """XLA's per-device memory for steps compiled and run on one H100 (bench/gpu_measured.py, 2026-11-23; the run's
    measured peak equalled it): L 2048, full remat, the kernel auto picks. Within 8%: before GPU's own loss and
    optimizer buffers, qwen3-0.6b (large vocabulary) was 26% under and scaled-4 21% over."""
    h100 = Topo("h100-sxm", 1, chips_per_host=1, torus=(1, 1))
    train = TrainConfig(per_device_batch_size=batch, seq_len=2048)
    total = estimate(Request.of(h100, presets.get(name), train, {"fsdp": 1}, {})).memory_per_device_bytes
    assert total / 2**30 == pytest.approx(compiled_gib, rel=0.08)


@pytest.mark.parametrize("topology, rate", [("h100-8", 0.5), ("v5p-8", 1.0)])
def test_logits_dot_in_fp32_prices_the_unembedding_in_float32(topology, rate):
    """Four-byte operands everywhere; on GPUs the TF32 peak (half of bf16's on an H100), on TPUs one bf16 pass."""
    from maxperf.spec.request import resolve

    def unembedding(words):
        e = estimate(resolve(topology, "llama2-7b", ["per_device_batch_size=2", *words]))
        return next(b for b in e.breakdown if b.name == "unembedding")

    plain, fp32 = unembedding([]), unembedding(["logits_dot_in_fp32=true"])
    assert fp32.flops == plain.flops and fp32.bytes == pytest.approx(2 * plain.bytes, rel=1e-12)
    if rate < 1:  # compute-bound at half the rate
        assert fp32.seconds == pytest.approx(plain.seconds / rate, rel=1e-9)
    else:  # the same peak: no slower unless its bytes now bind
        assert plain.seconds <= fp32.seconds < 1.5 * plain.seconds


def test_gradients_cross_slices_one_array_at_a_time_as_the_state_holds_them():
    """Gemma 3 12B's decoder scans blocks of six layers (MaxText's), each layer of a block with arrays of its own: 80
    arrays, each all-reduced across the two slices in a ring of two steps, each step a DCN latency. On the published
    Trillium runs (tpu-recipes training/trillium/Gemma3-12B-MaxText, 1, 2 and 4 slices of v6e-256), the step grows
    6.5% and 14.6% from one slice."""
    gemma = presets.get("gemma3-12b")
    assert reduced_arrays(gemma) == 6 * 13 + 2  # q, k, v, o, 3 MLP, 4 norms, 2 QK-norms; embedding, final norm
    cfg = overrides.apply(gemma, ["per_device_batch_size=1", "seq_len=32768", "attention=flash", "remat_policy=full"])

    def dcn_seconds(constants):
        e = estimate(Request.of(topology.get("v6e-256", num_slices=2), gemma, cfg.train, {"data": 2, "fsdp": 256},
                                {"data": 2}), constants=constants)
        return sum(r.seconds for r in e.breakdown if r.name == "data all-reduce (dcn)")

    latency = SHIPPED.dcn_step_latency["tpu"]
    no_latency = replace(SHIPPED, dcn_step_latency={**SHIPPED.dcn_step_latency, "tpu": 0.0})
    assert dcn_seconds(SHIPPED) - dcn_seconds(no_latency) == pytest.approx(80 * 2 * latency)


def test_zero1_reduce_scatters_the_gradients_and_gathers_the_parameters_over_data():
    # shard_optimizer_over_data: once a step the gradients reduce-scattered and the parameters gathered over `data`
    # where the plain step all-reduces them; float32 gradients, and on a TPU parameters gathered in the compute dtype
    # (the compiler casts before gathering): buffers of 4 and 2 bytes a parameter, each crossing the ring once, where
    # the all-reduce's 4 cross it twice
    topo = Topo("tpu-v5e", 16, 4, num_slices=4, hosts=4, torus=(2, 2))
    train = TrainConfig(per_device_batch_size=1, seq_len=128)

    def data_rows(train):
        e = estimate(Request.of(topo, LLAMA, train, {"data": 4, "tensor": 4}, {"data": 4}))
        return {r.name: r for r in e.breakdown if r.name.startswith("data ")}

    plain, zero1 = data_rows(train), data_rows(replace(train, shard_optimizer_over_data=True))
    assert set(plain) == {"data all-reduce (dcn)"}
    assert set(zero1) == {"data reduce-scatter (dcn)", "data all-gather (dcn)"}
    reduced, gathered, all_reduce = (zero1["data reduce-scatter (dcn)"], zero1["data all-gather (dcn)"],
                                     plain["data all-reduce (dcn)"])
    assert reduced.bytes == pytest.approx(all_reduce.bytes) and gathered.bytes == pytest.approx(all_reduce.bytes / 2)
    assert reduced.seconds + gathered.seconds == pytest.approx(0.75 * all_reduce.seconds, rel=0.05)


def test_a_tpus_vocabulary_chunks_gather_the_table_and_all_reduce_its_gradient_once_a_chunk():
    """Gemma 3 12B on v6e-256 at 32,768 tokens in 16 chunks (its Trillium recipe): MaxText's and maxperf's compiled
    steps gather the table's FSDP shard for each chunk and again for its recomputation, and all-reduce each chunk's
    gradient of the whole table in bfloat16, 16 x bf16[3840, 262144] (32.2 GB) a step, as their optimized HLO reads;
    in one chunk the table is gathered twice and its gradient reduce-scattered once."""
    from maxperf import spec

    words = ["per_device_batch_size=1", "ici_fsdp_parallelism=-1", "remat_policy=full", "max_target_length=32768",
             "attention=flash"]

    def fsdp_bytes(tiles):
        e = estimate(spec.resolve("v6e-256", "gemma3-12b", [*words, f"num_vocab_tiling={tiles}"]))
        return {b.name: b.bytes for b in e.breakdown if b.name.startswith("fsdp")}

    table = 262144 * 3840 * 2
    one, tiled = fsdp_bytes(1), fsdp_bytes(16)
    assert "fsdp all-reduce (ici)" not in one
    assert tiled["fsdp all-reduce (ici)"] == pytest.approx(16 * table)
    # the gathers: 2 x 16 of the table where there were 2, the layers' alike
    assert tiled["fsdp all-gather (ici)"] - one["fsdp all-gather (ici)"] == pytest.approx(30 * table)
    # the layers' gradient reduce-scatters stay; the table's (float32) leaves them
    assert one["fsdp reduce-scatter (ici)"] - tiled["fsdp reduce-scatter (ici)"] == pytest.approx(2 * table)
