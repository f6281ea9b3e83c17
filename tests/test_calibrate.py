"""`maxperf calibrate` measures this machine and perfmodel's CPU estimate then says it used measured peaks."""

from maxperf.models import presets
from maxperf.models.config import TrainConfig
from maxperf.perfmodel import calibration, estimate
from maxperf.profiler.calibrate import calibrate
from perfmodel_util import Topo


def test_calibrate_stores_measurements_that_estimates_use(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    cal = calibrate(sizes=(64, 128), dtypes=("float32",), bandwidth_bytes=4 * 2**20, collective_bytes=2**20,
                    repeats=2)
    assert [(s.size, s.form) for s in cal.matmul] == [(n, f) for n in (64, 128) for f in ("nn", "nt", "tn")]
    assert all(s.flops_per_s > 1e6 for s in cal.matmul) and cal.memory_bandwidth > 1e6
    assert cal.num_devices == 8 and cal.collective_bandwidth > 1e6  # tests run on 8 host devices (conftest)
    assert set(cal.form_efficiency("float32")) == {"nn", "nt", "tn"} and cal.form_efficiency("bfloat16") == {}
    assert calibration.load() == cal
    est = estimate(presets.get("tiny"), TrainConfig(compute_dtype="float32", seq_len=64), {}, {}, Topo("cpu", 1, 1))
    assert est.peaks_calibrated and est.peak_flops == cal.peak_flops("float32")
