"""The chip table: every expected chip, sane units, helpful errors, calibrated CPU peaks."""

import json
from dataclasses import replace

import pytest
from perfmodel_util import Topo

from maxperf.perfmodel import Overlap, calibration, chips, estimate
from maxperf.perfmodel.cpu import FRESH_MAPPING_THRESHOLD
from maxperf.spec import hardware, presets
from maxperf.spec.errors import MaxperfError
from maxperf.spec.request import Request
from maxperf.spec.train import TrainConfig

CPU2 = Topo("cpu", 2, 2)

EXPECTED = {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu7x", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200",
            "gb200", "cpu"}


def test_table_has_exactly_the_expected_chips():
    assert set(chips.CHIPS) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED - {"cpu"}))
def test_published_numbers_are_in_plausible_units(name):
    c = chips.CHIPS[name]
    assert 1e14 < c.peak_bf16_flops < 1e16  # 100 TFLOP/s .. 10 PFLOP/s
    assert 1e10 < c.hbm_bytes < 3e11 and 5e11 < c.hbm_bandwidth < 1e13
    assert 1e10 < c.link_bandwidth < 1e12 and c.link_count >= 4
    assert 1e9 < c.host_network_per_chip < 1e11
    assert (c.torus_dims is not None) == (c.kind == "tpu") and (c.nvlink_domain is not None) == (c.kind == "gpu")
    for low in (c.peak_fp8_flops, c.peak_int8_ops):
        assert low is None or low >= c.peak_bf16_flops


def test_quoted_aggregates_round_trip():
    assert chips.CHIPS["tpu-v5p"].ici_bandwidth_per_chip == pytest.approx(1200e9)  # 1200 GBps bidirectional
    assert chips.CHIPS["h100-sxm"].ici_bandwidth_per_chip == pytest.approx(900e9)  # NVLink 900 GB/s
    assert chips.CHIPS["h100-sxm"].host_network_bandwidth == pytest.approx(8 * 400e9 / 8)  # 8 x 400 Gb/s
    # Google's "DCN bandwidth per chip" is its NICs' line rate, each way: v5p's 50 Gbps a chip as v5e's 25 (its
    # 2 x 100 Gbps NICs a host of 8, 6.4 Tbps a pod of 256) and TPU7x's 100 (two NICs a VM of 4)
    assert chips.CHIPS["tpu-v5p"].host_network_per_chip == pytest.approx(50e9 / 8)
    assert chips.CHIPS["tpu7x"].host_network_per_chip == pytest.approx(100e9 / 8)
    assert chips.CHIPS["tpu-v4"].host_network_per_chip == chips.CHIPS["tpu-v5p"].host_network_per_chip
    assert chips.CHIPS["tpu-v5e"].host_network_per_chip == pytest.approx(25e9 / 8)
    assert chips.CHIPS["gb200"].nvlink_domain == 72


def test_unknown_chip_names_close_matches():
    with pytest.raises(MaxperfError, match="tpu-v5p"):
        chips.get("tpu-v5")
    with pytest.raises(MaxperfError, match="h100-sxm"):
        chips.get("h100")


def test_cpu_uses_labelled_defaults_without_a_calibration():
    cpu = chips.get("cpu")
    assert not cpu.calibrated and "uncalibrated" in cpu.note
    assert cpu.peak_fp32_flops == hardware.CPU_DEFAULT_FP32_FLOPS


def test_cpu_takes_the_measured_peaks_of_a_calibration_passed_in():
    cal = calibration.Calibration(
        platform="cpu", device_kind="cpu", num_devices=1, jax_version="x", created="2025-01-01T00:00:00+00:00",
        matmul=(calibration.MatmulSample("float32", 256, 3e10), calibration.MatmulSample("float32", 512, 4e10),
                calibration.MatmulSample("bfloat16", 512, 2e10)),
        memory_bandwidth=7e9, collective_bandwidth=None, all_reduce_bandwidth=None, page_fault_bandwidth=None,
        transpose_bandwidth=1e9, elementwise_bandwidth=3e9, attention=(), collective_latency=None,
    )
    assert not chips.get("cpu").calibrated  # nothing passed in: the defaults, whatever is stored on disk
    cpu = chips.get("cpu", cal)
    assert cpu.calibrated
    assert (cpu.peak_fp32_flops, cpu.peak_bf16_flops, cpu.hbm_bandwidth) == (4e10, 2e10, 7e9)
    assert cpu.link_bandwidth == 7e9  # one device: collectives go through memory
    # nothing measured for thin matmuls, collectives or page faults: steptime's assumptions, and no fault cost
    assert cpu.matmul_half == () and cpu.collective_efficiency == () and cpu.page_fault_bandwidth is None
    assert cpu.transpose_bandwidth == 1e9 and cpu.elementwise_bandwidth == 3e9 and cpu.collective_latency is None
    assert cpu.attention_rates == () and cpu.attention_rate("bfloat16", 128) is None


CAL = dict(platform="cpu", device_kind="cpu", num_devices=2, jax_version="x", created="2025-01-01T00:00:00+00:00",
           memory_bandwidth=4e10, collective_bandwidth=3e9, all_reduce_bandwidth=1.5e9, page_fault_bandwidth=None,
           transpose_bandwidth=2e9, elementwise_bandwidth=1e10, attention=(), collective_latency=None)


def test_thin_matmuls_run_at_their_measured_rate():
    # rate(thin) = rate(square) x thin / (thin + HALF) with HALF = 48 for every sample
    thin = [calibration.MatmulSample("bfloat16", 1024, 8e11 * m / (m + 48), thin=m, side=side)
            for m in (16, 64, 256) for side in ("m", "k", "n")]
    thin_cal = calibration.Calibration(matmul=(calibration.MatmulSample("bfloat16", 1024, 8e11), *thin), **CAL)
    cpu = chips.get("cpu", thin_cal)
    assert cpu.measured_matmul_half("bfloat16") == pytest.approx(48) and cpu.measured_matmul_half("float32") is None
    model, train = presets.get("tiny"), TrainConfig(per_device_batch_size=2, seq_len=256, remat_policy="none")
    measured = estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=thin_cal).breakdown
    square_cal = calibration.Calibration(matmul=(calibration.MatmulSample("bfloat16", 1024, 8e11),), **CAL)
    assumed = estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=square_cal).breakdown
    # the attention scores contract over the head dimension: 2 x 16 x 256 x 256 FLOPs per (example, head), thin 16
    row = lambda rows: next(r for r in rows if r.name == "attention scores")
    assert row(measured).seconds / row(assumed).seconds == pytest.approx((16 + 48) / (16 + 32), rel=1e-6)


def test_page_faults_of_large_temporaries_count_on_cpu():
    square = (calibration.MatmulSample("bfloat16", 1024, 8e11),)
    cal = calibration.Calibration(matmul=square, **{**CAL, "page_fault_bandwidth": 4e9})
    model = presets.get("tiny")
    # the materialized scores (dot_product attention) make the large temporaries
    big = estimate(Request.of(CPU2, model, TrainConfig(per_device_batch_size=8, seq_len=512, attention="dot_product"),
                              {"fsdp": 2}, {}), calibration=cal)
    temporaries = max(big.memory.phases().values())
    assert temporaries > FRESH_MAPPING_THRESHOLD
    faults = next(r for r in big.breakdown if r.name == "page faults (new temporaries)")
    assert faults.seconds == pytest.approx(temporaries / 2e9)  # two devices share the measured 4 GB/s
    small = estimate(Request.of(CPU2, model, TrainConfig(per_device_batch_size=1, seq_len=64), {"fsdp": 2}, {}),
                     calibration=cal)
    assert max(small.memory.phases().values()) < FRESH_MAPPING_THRESHOLD  # reused by the allocator: no faults
    assert not any(r.name.startswith("page faults") for r in small.breakdown)


def test_long_contractions_with_large_outputs_fault_in_a_float32_accumulator_on_cpu():
    square = (calibration.MatmulSample("bfloat16", 1024, 8e11),)
    cal = calibration.Calibration(matmul=square, **{**CAL, "page_fault_bandwidth": 4e9})
    model = replace(presets.get("scaled-1"), num_layers=1, vocab_size=1024)

    def faults(seq_len):
        train = TrainConfig(per_device_batch_size=2, seq_len=seq_len)
        rows = estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=cal).breakdown
        return next((r for r in rows if r.name == "page faults (dot accumulators, XLA:CPU)"), None)

    # 512 tokens per device contract the weight gradients of up, gate (2048 x 7168) and down (7168 x 2048): each a
    # 58.7 MB float32 accumulator, above the mmap threshold; q, k, v, o (2048 x 2048, 16.8 MB), the unembedding
    # (2048 x 1024) and every forward and input-gradient output (512 rows) stay below it
    row = faults(256)
    assert row.bytes == 3 * 4 * 2048 * 7168 > 3 * FRESH_MAPPING_THRESHOLD
    assert row.seconds == pytest.approx(row.bytes / 2e9)  # two devices share the measured 4 GB/s
    assert faults(128) is None  # 256 tokens fit one contraction block: no accumulator


def test_cpu_elementwise_work_runs_at_the_measured_fused_rate():
    square = (calibration.MatmulSample("bfloat16", 1024, 8e11),)
    # dot_product attention: its softmax is a fused elementwise kernel of its own
    model, train = presets.get("tiny"), TrainConfig(per_device_batch_size=2, seq_len=128, attention="dot_product")
    cal = calibration.Calibration(matmul=square, **CAL)
    rows = {r.name: r for r in estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=cal).breakdown}
    for name in ("softmax", "norms, residuals, activations", "loss", "optimizer update"):
        assert rows[name].bytes / rows[name].seconds == pytest.approx(5e9)  # two devices share 10 GB/s, not 40
    tpu = estimate(Request.of(Topo("tpu-v5p", 4, 4, torus=(2, 2, 1)), model, train, {"fsdp": 4}, {}))
    softmax = next(r for r in tpu.breakdown if r.name == "softmax")
    assert softmax.bytes / softmax.seconds == pytest.approx(chips.get("tpu-v5p").hbm_bandwidth)


def test_cpu_attention_runs_at_its_measured_whole_rate():
    square = (calibration.MatmulSample("bfloat16", 1024, 8e11),)
    attention = (calibration.AttentionSample("bfloat16", 16, 256, 16, 2e10),
                 calibration.AttentionSample("bfloat16", 64, 256, 16, 6e10))
    cal = calibration.Calibration(matmul=square, **{**CAL, "attention": attention})
    cpu = chips.get("cpu", cal)
    # linear in log(head_dim) between the samples, the nearest sample's beyond them
    rates = [cpu.attention_rate("bfloat16", dh) for dh in (8, 16, 32, 64, 128)]
    assert rates == pytest.approx([2e10, 2e10, 4e10, 6e10, 6e10])
    assert cpu.attention_rate("float32", 16) is None  # float32 attention: its matmuls and softmax, as assumed
    model, train = presets.get("tiny"), TrainConfig(per_device_batch_size=2, seq_len=256, remat_policy="full")
    rows = {r.name: r for r in estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=cal).breakdown}
    # tiny: 2 layers x 2 examples x 4 heads, head_dim 16; full remat runs the forward twice: 4 matmuls of
    # 2 x 256 x 256 x 16 FLOPs forward (scores and context, twice), 4 backward
    flops = 2 * 2 * 4 * (2 * 2 + 4) * 2 * 256 * 256 * 16
    assert rows["attention (measured kernels)"].flops == flops
    assert rows["attention (measured kernels)"].seconds == pytest.approx(flops / 1e10)  # two devices share 2e10
    assert not {"attention scores", "attention context", "softmax"} & set(rows)
    f32 = estimate(Request.of(CPU2, model, TrainConfig(per_device_batch_size=2, seq_len=256, compute_dtype="float32"),
                              {"fsdp": 2}, {}), calibration=cal).breakdown
    assert {"attention scores", "attention context", "softmax"} <= {r.name for r in f32}


def test_cpu_collectives_use_their_measured_bandwidth_and_do_not_overlap():
    square = (calibration.MatmulSample("bfloat16", 1024, 8e11),)
    cal = calibration.Calibration(matmul=square, **CAL)
    cpu = chips.get("cpu", cal)
    assert cpu.link_bandwidth == 3e9 and cpu.collective_efficiency == (("all-reduce", 0.5),)
    model, train = presets.get("scaled-1"), TrainConfig(per_device_batch_size=1, seq_len=128)
    est = estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=cal)
    assert est.overlap == Overlap.uniform(0.0)
    rows = {r.name: r for r in est.breakdown}
    gather, reduce = rows["fsdp all-gather (ici)"], rows["fsdp all-reduce (ici)"]
    # per byte, an all-reduce moves twice an all-gather's share (2(n-1)/n against (n-1)/n) at half the bandwidth
    assert (reduce.seconds / reduce.bytes) / (gather.seconds / gather.bytes) == pytest.approx(4.0, rel=1e-3)
    assert all(r.exposed_seconds == r.seconds for r in est.breakdown)
    assert est.step_time_s == pytest.approx(sum(r.seconds for r in est.breakdown))


def test_fsdp_weight_shards_pay_xla_cpus_transposing_copies():
    square = (calibration.MatmulSample("bfloat16", 1024, 8e11),)
    cal = calibration.Calibration(matmul=square, **CAL)
    model, train = presets.get("tiny"), TrainConfig(per_device_batch_size=2, seq_len=128)
    rows = {r.name: r for r in estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=cal).breakdown}
    # tiny: D 64, 4 heads and 2 kv heads of 16, F 128, 2 layers; float32 shards split over fsdp 2 along D.
    # Model width last (o 4x16x64, down 128x64): copied on both gathers; first (q 64x4x16, k and v 64x2x16, up and
    # gate 64x128): copied once, as its gradient is written; each copy reads and writes 4 bytes per element.
    last, first = (4 * 16 * 64 + 128 * 64) / 2, (64 * 4 * 16 + 2 * 64 * 2 * 16 + 2 * 64 * 128) / 2
    moved = 2 * 4 * (2 * last + first) * 2
    copies = rows["weight layout copies (XLA:CPU)"]
    assert copies.bytes == moved == 393216
    assert copies.seconds == pytest.approx(moved / 1e9)  # two devices share the measured 2 GB/s
    # one device gathers nothing, and accelerators have no such copies
    one = estimate(Request.of(Topo("cpu", 1, 1), model, train, {}, {})).breakdown
    tpu = estimate(Request.of(Topo("tpu-v5p", 4, 4, torus=(2, 2, 1)), model, train, {"fsdp": 4}, {})).breakdown
    assert not any(r.name.startswith("weight layout") for r in (*one, *tpu))


def test_each_gathered_weight_pays_the_measured_collective_latency():
    square = (calibration.MatmulSample("bfloat16", 1024, 8e11),)
    model, train = presets.get("tiny"), TrainConfig(per_device_batch_size=2, seq_len=128)

    def rows(latency):
        cal = calibration.Calibration(matmul=square, **{**CAL, "collective_latency": latency})
        return {r.name: r.seconds for r in estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}),
                                                    calibration=cal).breakdown}

    slow, fast = rows(1e-4), rows(0.0)
    # 2 layers x 2 gathers x 7 weights (q, k, v, o, up, gate, down) and 2 gathers of the vocabulary table; one
    # combined gradient all-reduce per layer and one for the table
    assert slow["fsdp all-gather (ici)"] - fast["fsdp all-gather (ici)"] == pytest.approx((2 * 2 * 7 + 2) * 1e-4)
    assert slow["fsdp all-reduce (ici)"] - fast["fsdp all-reduce (ici)"] == pytest.approx((2 + 1) * 1e-4)


def test_perfmodel_reads_no_calibration_from_disk(tmp_path, monkeypatch):
    # a valid calibration where maxperf stores one: perfmodel must not pick it up by itself
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    cal = calibration.Calibration(matmul=(calibration.MatmulSample("bfloat16", 1024, 8e11),), **CAL)
    (tmp_path / "calibration.json").write_text(json.dumps(cal.as_dict()))
    assert not chips.get("cpu").calibrated
    est = estimate(Request.of(CPU2, presets.get("tiny"), TrainConfig(seq_len=64), {"fsdp": 2}, {}))
    assert not est.peaks_calibrated and est.peak_flops == hardware.CPU_DEFAULT_BF16_FLOPS / 2
    assert est.calibration is None
    assert est.notes == ("no calibration was passed in: CPU peaks are uncalibrated defaults",)


def test_estimate_records_which_calibration_it_used():
    cal = calibration.Calibration(matmul=(calibration.MatmulSample("bfloat16", 1024, 8e11),), **CAL)
    passed = calibration.StoredCalibration("/cache/calibration.json", cal, sha256="ab" * 32)
    model, train = presets.get("tiny"), TrainConfig(seq_len=64)
    d = estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=passed).as_dict()
    assert d["calibration"] == {"path": "/cache/calibration.json", "sha256": "ab" * 32, "used": True,
                                "problem": None, "created": "2025-01-01T00:00:00+00:00", "schema": 5,
                                "device_kind": "cpu", "num_devices": 2, "jax_version": "x"}
    assert d["notes"] == [] and d["peaks_calibrated"] and d["peak_flops"] == 8e11 / 2  # two devices share it
    # a bare Calibration from a program: recorded without a file
    bare = estimate(Request.of(CPU2, model, train, {"fsdp": 2}, {}), calibration=cal)
    assert bare.calibration["path"] is None and bare.calibration["used"] and bare.peak_flops == 8e11 / 2
    # TPUs and GPUs take nothing from a CPU calibration, and record none
    tpu = estimate(Request.of(Topo("tpu-v5p", 4, 4, torus=(2, 2, 1)), model, train, {"fsdp": 4}, {}),
                   calibration=passed)
    assert tpu.calibration is None and tpu.notes == () and tpu.peak_flops == chips.CHIPS["tpu-v5p"].peak_bf16_flops


def test_an_unusable_calibration_is_a_note_in_the_estimate():
    problem = "the calibration /c/calibration.json has schema 4, this maxperf reads schema 5; run `maxperf calibrate`"
    stale = calibration.StoredCalibration("/c/calibration.json", None, sha256="cd" * 32, problem=problem)
    est = estimate(Request.of(CPU2, presets.get("tiny"), TrainConfig(seq_len=64), {"fsdp": 2}, {}), calibration=stale)
    assert est.notes == (problem,) and not est.peaks_calibrated
    assert est.as_dict()["calibration"]["used"] is False and est.as_dict()["calibration"]["sha256"] == "cd" * 32
