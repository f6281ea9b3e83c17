"""bench/gpu_gemm.py on this machine's CPU: tiny matmuls in bf16 and FP8 timed and set beside the two prices of a
decode matmul (the roofline perfmodel.serving uses, and the sum of compute and memory time); the prices against the
chip's figures; the summary over rows; bad input a one-line usage error."""

import json
import statistics
import subprocess
import sys

import pytest
from bench_util import BENCH, bench_module

from maxperf.perfmodel import chips, serving, work


@pytest.fixture(scope="module")
def bench():
    with bench_module("gpu_gemm") as module:
        yield module


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_matmul_is_timed_and_priced(bench, dtype):
    row = bench.measure("h200", dtype, 8, 128, 256, reps=2)
    assert "error" not in row, row.get("error")
    assert row["measured_s"] > 0 and row["tflops"] == pytest.approx(2 * 8 * 128 * 256 / row["measured_s"] / 1e12)
    assert row["roofline_ratio"] == pytest.approx(row["measured_s"] / row["roofline_s"])
    assert row["sum_ratio"] == pytest.approx(row["measured_s"] / row["sum_s"])
    # a 32 or 64 KiB weight: as many copies as the bench allows, so that none is re-read from the L2 cache
    assert row["copies"] == bench.MAX_COPIES
    assert bench.line(row).startswith(f"{dtype:<4} M     8") and " us " in bench.line(row)


def test_the_prices_are_the_decode_steps(bench):
    h200 = chips.get("h200")
    M, K, N = 512, 8192, 8192
    fp8 = bench.priced("h200", "fp8", M, K, N)
    rate = h200.peak_fp8_flops * work.SHIPPED.fraction(h200)
    bandwidth = h200.hbm_bandwidth * serving.DECODE_HBM_EFFICIENCY["gpu"]
    assert fp8["compute_s"] == pytest.approx(2 * M * K * N / rate)
    assert fp8["memory_s"] == pytest.approx((K * N + M * K + 2 * M * N) / bandwidth)
    assert fp8["bytes"] == K * N + M * K + 2 * M * N
    assert fp8["roofline_s"] == max(fp8["compute_s"], fp8["memory_s"])
    assert fp8["sum_s"] == pytest.approx(fp8["compute_s"] + fp8["memory_s"])
    # bf16: its own peak (half FP8's), twice the operand bytes
    bf16 = bench.priced("h200", "bf16", M, K, N)
    assert bf16["compute_s"] == pytest.approx(2 * M * K * N / (h200.peak_bf16_flops * work.SHIPPED.fraction(h200)))
    assert bf16["memory_s"] == pytest.approx((2 * K * N + 2 * M * K + 2 * M * N) / bandwidth)
    # 512 rows of FP8 on an H200 sit near its ridge (the two terms within 4x); 16 rows are bandwidth-bound
    assert bench.near_ridge(fp8) and not bench.near_ridge(bench.priced("h200", "fp8", 16, K, N))
    # enough distinct weights per call to span the L2 cache five times over, never more than MAX_COPIES
    assert bench.copies_for(8192, 8192, "fp8") == 4 and bench.copies_for(4096, 4096, "bf16") == 8
    assert bench.copies_for(8192, 57344, "bf16") == 1


def test_the_summary_tells_the_prices_apart(bench):
    def row(M, measured, compute, memory):
        r = {"dtype": "fp8", "M": M, "compute_s": compute, "memory_s": memory, "measured_s": measured,
             "roofline_s": max(compute, memory), "sum_s": compute + memory}
        return {**r, "roofline_ratio": measured / r["roofline_s"], "sum_ratio": measured / r["sum_s"]}

    rows = [row(16, 1.0, 0.05, 1.0), row(512, 2.0, 1.0, 1.0), row(1024, 2.4, 2.0, 0.5), {"dtype": "fp8", "M": 8,
                                                                                          "error": "X"}]
    lines = bench.summary(rows)
    assert lines[0].startswith("fp8  all rows        n=3 ")
    # near the ridge: the 512- and 1024-row matmuls; measured at the sum there, twice and 1.2x the roofline
    assert lines[1] == ("fp8  near the ridge  n=2   roofline median 60.0% worst 100.0%, sum median 2.0% worst 4.0%")


def test_the_published_gemms_are_priced_and_tell_which_kernels_each_law_fits(bench, tmp_path):
    """--published (bench/published/gemm.csv, DeepGEMM's H800 table): every table line for both kernels, the bytes
    the prices count equal to each line's stated bandwidth x time, and the figures perfmodel.serving cites for
    DECODE_KERNEL_LAW: the CUTLASS kernels' times are the sum of the two terms, DeepGEMM's the roofline."""
    out = tmp_path / "published.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_gemm.py"), "--published", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 28 and {r["kernel"] for r in rows} == {"DeepGEMM", "CUTLASS 3.6"}
    assert all(r["chip"] == "h100-sxm" and r["dtype"] == "fp8" for r in rows)
    for r in rows:
        assert abs(r["bytes"] / r["stated_bytes"] - 1) < 0.005, r
    # M = 64 x N 7168 x K 16384: 336 TFLOP/s stated, CUTLASS 1.4x slower
    row = next(r for r in rows if (r["M"], r["N"], r["K"], r["kernel"]) == (64, 7168, 16384, "DeepGEMM"))
    assert row["measured_s"] == pytest.approx(2 * 64 * 7168 * 16384 / 336e12)
    twin = next(r for r in rows if (r["M"], r["N"], r["K"], r["kernel"]) == (64, 7168, 16384, "CUTLASS 3.6"))
    assert twin["measured_s"] == pytest.approx(1.4 * row["measured_s"])
    grouped = next(r for r in rows if (r["groups"], r["M"], r["N"]) == (4, 256, 4096))
    assert grouped["sum_s"] == pytest.approx(4 * bench.priced("h100-sxm", "fp8", 256, 7168, 4096)["sum_s"])

    def median_error(kernel, price):
        return statistics.median(abs(r[f"{price}_ratio"] - 1) for r in rows if r["kernel"] == kernel)

    assert median_error("CUTLASS 3.6", "sum") == pytest.approx(0.111, abs=0.0005)
    assert median_error("CUTLASS 3.6", "roofline") == pytest.approx(0.487, abs=0.0005)
    assert median_error("DeepGEMM", "roofline") == pytest.approx(0.144, abs=0.0005)
    assert "fp8  CUTLASS 3.6 all rows        n=28  roofline median 48.7%" in proc.stdout
    assert "within 0.1% on every row" in proc.stdout


@pytest.mark.parametrize("args, message", [(["--rows", "0,16"], "positive integers"),
                                           (["--rows", ""], "positive integers"),
                                           (["--shapes", "8192"], "KxN"),
                                           (["--dtypes", "int4"], "unknown dtype"),
                                           (["--chip", "tpu7x"], "unknown GPU chip"),
                                           (["--reps", "0"], "at least 1"),
                                           (["--json", "/nonexistent/rows.json"], "no directory")])
def test_bad_input_is_one_line(args, message):
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_gemm.py"), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_the_sweep_runs_and_writes_its_rows(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_gemm.py"), "--rows", "4,32", "--shapes", "128x256",
                           "--dtypes", "bf16", "--reps", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["dtype"], r["M"], r["K"], r["N"]) for r in rows] == [("bf16", 4, 128, 256), ("bf16", 32, 128, 256)]
    assert all(r["measured_s"] > 0 for r in rows)
    assert "bf16 all rows        n=2 " in proc.stdout
