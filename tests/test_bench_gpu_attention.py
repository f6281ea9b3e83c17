"""bench/gpu_attention.py on this machine's CPU: the Pallas kernel in interpret mode and XLA's dot product at a tiny
shape, each timed, checked against the float32 dot product (output and gradients) and set beside perfmodel's price;
the length-law fit over saved rows; bad input a one-line usage error."""

import json
import subprocess
import sys

import pytest
from bench_util import BENCH, bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("gpu_attention") as module:
        yield module


def test_the_kernels_are_timed_checked_and_priced(bench):
    pallas = bench.measure("pallas", (1, 256, 4, 2, 64), "h200", 2, interpret=True, check=True)
    assert "error" not in pallas, pallas.get("error")
    assert pallas["forward_s"] > 0 and pallas["forward_backward_s"] > pallas["forward_s"] * 0.5
    # bf16 inputs against the float32 dot product: far from exact, far from wrong
    assert 1e-4 < pallas["relative_error"] < 1e-2 and 1e-4 < pallas["gradient_relative_error"] < 2e-2
    # perfmodel's price of the Triton-class kernel on an H200: its FLOPs over the rate it is fitted at
    fwd, bwd = bench.predicted_seconds("pallas", "h200", 1, 256, 4, 64)
    assert pallas["predicted_forward_backward_s"] == pytest.approx(fwd + bwd)
    assert bwd / fwd == pytest.approx(5 / 2)
    xla = bench.measure("xla", (1, 256, 4, 2, 64), "h200", 2, interpret=False, check=False)
    assert xla["forward_s"] > 0 and "measured_over_predicted" not in xla
    assert "error" in bench.measure("cudnn", (1, 256, 4, 2, 64), "h200", 1, interpret=False, check=False)
    assert bench.line(pallas).startswith("pallas") and "error" in bench.line(pallas)


def test_cudnn_is_priced_at_its_speedup_over_the_flash_rate(bench):
    from maxperf.perfmodel import work

    for shape in ((8, 2048, 32, 128), (1, 16384, 32, 128)):
        flash, cudnn = sum(bench.predicted_seconds("pallas", "h200", *shape)), sum(bench.predicted_seconds(
            "cudnn", "h200", *shape))
        assert flash / cudnn == pytest.approx(work.CUDNN_FLASH_SPEEDUP)
    # no such speedup where it was not measured (Blackwell)
    assert bench.predicted_seconds("cudnn", "b200", 8, 2048, 32, 128) == bench.predicted_seconds(
        "pallas", "b200", 8, 2048, 32, 128)


def test_the_law_is_fitted_to_rows(bench, tmp_path):
    rows = [{"kernel": "k", "B": 1, "L": L, "H": 8, "D": 128,
             "forward_backward_s": bench.model_flops(1, L, 8, 128) / (400e12 * L / (L + 1000))}
            for L in (1024, 4096, 16384)]
    fit = bench.fit_length_law(rows)["k"]
    assert fit["half_length"] == 1000 and fit["rate_inf_tflops"] == pytest.approx(400, rel=1e-6)
    assert fit["worst"] < 1e-9
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps(rows))
    assert all(bench.valid_row(r) for r in rows) and not bench.valid_row({**rows[0], "forward_backward_s": 0})
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_attention.py"), "--fit", str(saved)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "L / (L + 1000)" in proc.stdout


@pytest.mark.parametrize("args, message", [(["--shapes", "1x256x4x3x64"], "do not split"),
                                           (["--shapes", "1x256"], "BxLxHxKxD"),
                                           (["--kernels", "triton"], "unknown kernel"),
                                           (["--chip", "h300"], "unknown GPU chip"),
                                           (["--chip", "cpu"], "unknown GPU chip"),
                                           (["--shapes", ""], "at least one shape"),
                                           (["--fit", "/nonexistent.json"], "cannot read"),
                                           (["--fit", "ROWS"], "is not a row")])
def test_bad_input_is_one_line(args, message, tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps([{"kernel": "cudnn", "L": 1024}]))
    args = [str(tmp_path / "rows.json") if a == "ROWS" else a for a in args]
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_attention.py"), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
