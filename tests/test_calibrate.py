"""`maxperf calibrate` measures this machine and perfmodel's CPU estimate then says it used measured peaks."""

from maxperf.models import presets
from maxperf.models.config import TrainConfig
from maxperf.perfmodel import calibration, estimate
from maxperf.profiler.calibrate import calibrate
from perfmodel_util import Topo


def test_calibrate_stores_measurements_that_estimates_use(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    cal = calibrate(sizes=(64, 128), dtypes=("float32",), thin_widths=(16,), thin_size=128,
                    bandwidth_bytes=4 * 2**20, page_fault_bytes=4 * 2**20, collective_bytes=2**20, transpose_side=256,
                    elementwise_bytes=2**20, attention_head_dims=(16, 32), attention_shape=(1, 2, 2, 64),
                    latency_chain=4, repeats=2)
    square = [s.size for s in cal.matmul if s.thin is None]
    thin = [(s.size, s.thin, s.side) for s in cal.matmul if s.thin is not None]
    assert square == [64, 128] and thin == [(128, 16, side) for side in ("m", "k", "n")]
    assert all(s.flops_per_s > 1e6 for s in cal.matmul) and cal.memory_bandwidth > 1e6
    assert cal.matmul_half("float32") >= 0 and cal.matmul_half("bfloat16") is None
    assert cal.num_devices == 8  # tests run on 8 host devices (conftest)
    assert cal.collective_bandwidth > 1e6 and cal.all_reduce_bandwidth > 1e6
    assert cal.page_fault_bandwidth is None or cal.page_fault_bandwidth > 1e6
    assert cal.transpose_bandwidth > 1e6 and cal.elementwise_bandwidth > 1e6 and 0 <= cal.collective_latency < 1.0
    assert [(s.dtype, s.head_dim, s.seq_len, s.heads) for s in cal.attention] == [("float32", 16, 64, 4),
                                                                               ("float32", 32, 64, 4)]
    assert all(s.flops_per_s > 1e6 for s in cal.attention)
    assert calibration.load() == cal
    est = estimate(presets.get("tiny"), TrainConfig(compute_dtype="float32", seq_len=64), {}, {}, Topo("cpu", 1, 1))
    assert est.peaks_calibrated and est.peak_flops == cal.peak_flops("float32")
