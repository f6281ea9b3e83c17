"""The chip table: every expected chip, sane units, helpful errors, calibrated CPU peaks."""

import json

import pytest

from maxperf.errors import MaxperfError
from maxperf.models import presets
from maxperf.models.config import TrainConfig
from maxperf.perfmodel import calibration, chips, estimate
from perfmodel_util import Topo

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
    assert chips.CHIPS["gb200"].nvlink_domain == 72


def test_unknown_chip_names_close_matches():
    with pytest.raises(MaxperfError, match="tpu-v5p"):
        chips.get("tpu-v5")
    with pytest.raises(MaxperfError, match="h100-sxm"):
        chips.get("h100")


def test_cpu_uses_labelled_defaults_without_a_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    cpu = chips.get("cpu")
    assert not cpu.calibrated and "uncalibrated" in cpu.note
    assert cpu.peak_fp32_flops == chips.CPU_DEFAULT_FP32_FLOPS


def test_cpu_reads_a_stored_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    cal = calibration.Calibration(
        platform="cpu", device_kind="cpu", num_devices=1, jax_version="x", created="2025-01-01T00:00:00+00:00",
        matmul=(calibration.MatmulSample("float32", 256, 3e10), calibration.MatmulSample("float32", 512, 4e10),
                calibration.MatmulSample("bfloat16", 512, 2e10)),
        memory_bandwidth=7e9, collective_bandwidth=None,
    )
    path = calibration.save(cal)
    assert path == tmp_path / "calibration.json" and json.loads(path.read_text())["schema"] == 2
    cpu = chips.get("cpu")
    assert cpu.calibrated
    assert (cpu.peak_fp32_flops, cpu.peak_bf16_flops, cpu.hbm_bandwidth) == (4e10, 2e10, 7e9)
    assert cpu.link_bandwidth == 7e9  # one device: collectives go through memory
    assert cpu.matmul_form_efficiency("float32", "tn") == 1.0  # forms not measured


def test_calibrated_matmul_forms_slow_the_weight_gradients(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    samples = [calibration.MatmulSample("bfloat16", 512, rate, form) for form, rate in
               (("nn", 8e11), ("nt", 8e11), ("tn", 2e11))]
    base = dict(platform="cpu", device_kind="cpu", num_devices=2, jax_version="x", created="2025-01-01T00:00:00+00:00",
                memory_bandwidth=4e10, collective_bandwidth=3e9)
    calibration.save(calibration.Calibration(matmul=tuple(samples), **base))
    cpu = chips.get("cpu")
    assert cpu.matmul_form_efficiency("bfloat16", "tn") == pytest.approx(0.25) and cpu.link_bandwidth == 3e9
    model, train = presets.get("scaled-1"), TrainConfig(per_device_batch_size=1, seq_len=512, remat_policy="none")
    slow = estimate(model, train, {"fsdp": 2}, {}, CPU2).time.compute_s
    even = [calibration.MatmulSample("bfloat16", 512, 8e11, form) for form in ("nn", "nt", "tn")]
    calibration.save(calibration.Calibration(matmul=tuple(even), **base))
    fast = estimate(model, train, {"fsdp": 2}, {}, CPU2).time.compute_s
    # a third of the matmul FLOPs are weight gradients, at a quarter of the rate: (1 + 1 + 4) / 3 = 2x the time
    assert slow / fast == pytest.approx(2.0, rel=0.02)


def test_unreadable_calibration_falls_back_to_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    (tmp_path / "calibration.json").write_text("{not json")
    assert not chips.get("cpu").calibrated


def test_cache_dir_honours_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("MAXPERF_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration.cache_dir() == tmp_path / "maxperf"
