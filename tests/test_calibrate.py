"""`maxperf calibrate` measures this machine; maxperf.user_cache stores and loads it, says when a stored one cannot
be used, and perfmodel's CPU estimate records which calibration it was given."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
from perfmodel_util import Topo

from maxperf import user_cache
from maxperf.perfmodel import calibration, estimate
from maxperf.profiler.calibrate import calibrate
from maxperf.spec import notes, presets
from maxperf.spec.request import Request
from maxperf.spec.train import TrainConfig

CAL = calibration.Calibration(
    platform="cpu", device_kind="cpu", num_devices=2, jax_version="x", created="2025-01-01T00:00:00+00:00",
    matmul=(calibration.MatmulSample("bfloat16", 1024, 8e11),), memory_bandwidth=4e10, collective_bandwidth=3e9,
    all_reduce_bandwidth=1.5e9, page_fault_bandwidth=None, transpose_bandwidth=2e9, elementwise_bandwidth=1e10,
    attention=(), collective_latency=None)
TINY, TRAIN, CPU2 = presets.get("tiny"), TrainConfig(seq_len=64), Topo("cpu", 2, 2)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(notes, "_said", set())  # notes are said once per process: each test starts afresh
    return tmp_path


def test_calibrate_stores_measurements_that_estimates_use(cache):
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
    stored = user_cache.calibration_for(Topo("cpu", 1, 1))
    assert stored.calibration == cal and stored.path == str(cache / "calibration.json")
    est = estimate(Request.of(Topo("cpu", 1, 1), TINY, TrainConfig(compute_dtype="float32", seq_len=64), {}, {}),
                   calibration=stored)
    assert est.peaks_calibrated and est.peak_flops == cal.peak_flops("float32")


def test_a_loaded_calibration_carries_its_path_and_hash(cache):
    path = user_cache.save_calibration(CAL)
    assert path == cache / "calibration.json" and json.loads(path.read_text())["schema"] == 5
    stored = user_cache.load_calibration()
    assert stored.calibration == CAL and stored.problem is None
    assert stored.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    record = estimate(Request.of(CPU2, TINY, TRAIN, {"fsdp": 2}, {}), calibration=stored).as_dict()["calibration"]
    assert (record["path"], record["sha256"], record["created"]) == (str(path), stored.sha256, CAL.created)


def test_a_stale_schema_is_said_on_stderr_and_recorded(cache, capsys):
    (cache / "calibration.json").write_text(json.dumps({**CAL.as_dict(), "schema": 4}))
    stored = user_cache.load_calibration()
    assert stored.calibration is None
    problem = (f"the calibration {cache / 'calibration.json'} has schema 4, this maxperf reads schema 5; run "
               "`maxperf calibrate` again; CPU estimates use the uncalibrated defaults until then")
    assert stored.problem == problem
    assert capsys.readouterr().err == f"maxperf: note: {problem}\n"
    est = estimate(Request.of(CPU2, TINY, TRAIN, {"fsdp": 2}, {}), calibration=stored)
    assert not est.peaks_calibrated and est.notes == (problem,)
    record = est.as_dict()["calibration"]
    assert (record["used"], record["schema"], record["problem"]) == (False, 4, problem)
    assert est.as_dict()["notes"] == [problem]


def test_an_unreadable_calibration_is_said_on_stderr(cache, capsys):
    (cache / "calibration.json").write_text("{not json")
    stored = user_cache.load_calibration()
    assert stored.calibration is None and stored.problem.startswith(f"the calibration {cache / 'calibration.json'} "
                                                                    "is unreadable (JSONDecodeError")
    assert capsys.readouterr().err == f"maxperf: note: {stored.problem}\n"


def test_no_calibration_is_recorded_but_not_said(cache, capsys):
    stored = user_cache.load_calibration()
    assert stored.calibration is None and stored.sha256 is None
    assert stored.problem == f"no calibration at {cache / 'calibration.json'}: run `maxperf calibrate`"
    assert capsys.readouterr().err == ""  # the estimate's chip note says "uncalibrated defaults" already
    assert estimate(Request.of(CPU2, TINY, TRAIN, {"fsdp": 2}, {}), calibration=stored).notes == (stored.problem,)


def test_tpu_and_gpu_topologies_read_no_calibration(cache, monkeypatch):
    def refuse(path=None):
        raise AssertionError("read a calibration for a topology that has no use for one")

    monkeypatch.setattr(user_cache, "load_calibration", refuse)
    assert user_cache.calibration_for(Topo("tpu-v5p", 4, 4)) is None
    assert user_cache.calibration_for(Topo("h100-sxm", 8, 8)) is None


def test_cache_dir_honours_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("MAXPERF_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache.cache_dir() == tmp_path / "maxperf"


@pytest.mark.slow
def test_calibrate_keeps_plugin_noise_off_the_terminal():
    """jax starting platforms that are not here: the CUDA plugin logs a traceback, libtpu its warnings, and jax
    raises; the command says one line."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cuda,tpu"}
    proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "calibrate"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("maxperf: error: RuntimeError: Unable to initialize backend 'tpu'"), line
