"""bench/gpu_measured.py's rows, measured on this machine's CPU devices with tiny steps: the bench compiles and runs
each case through the CLI and sets the analytical and HLO-derived predictions beside the measurement, for training
and serving steps alike (on a GPU the same code runs the cases of its table)."""


import pytest
from bench_util import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("gpu_measured") as module:
        yield module


@pytest.mark.slow
@pytest.mark.parametrize("name,args", [
    ("tiny fp8", ["--model", "tiny", "per_device_batch_size=2", "quantization=fp8"]),
    ("tiny decode", ["--step", "decode", "--model", "tiny", "per_device_batch_size=2",
                     "max_prefill_predict_length=16", "max_target_length=64"]),
    ("tiny prefill", ["--step", "prefill", "--model", "tiny", "per_device_batch_size=2",
                      "max_prefill_predict_length=16", "max_target_length=64"]),
])
def test_a_case_is_compiled_run_and_set_beside_both_predictions(bench, name, args, tmp_path):
    row = bench.measure(name, args, "cpu-1", 2, tmp_path)
    assert "error" not in row, row.get("error")
    assert row["serving"] == ("--step" in args)
    assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0 and row["hlo_predicted_step_s"] > 0
    assert row["measured_over_predicted"] == pytest.approx(row["measured_step_s"] / row["predicted_step_s"])
    assert row["measured_over_hlo_predicted"] == pytest.approx(row["measured_step_s"] / row["hlo_predicted_step_s"])
    assert row["compiler_gib"] > 0 and row["predicted_memory_gib"] > 0
    line = bench.line(row)
    assert line.startswith(name) and "from HLO" in line
    if row["serving"]:
        assert row["tokens_per_s"] > 0 and "tokens/s" in line
    else:
        assert row["loss_first"] > 0 and 0 < row["measured_mfu"] and "MFU predicted" in line


def test_a_case_that_does_not_compile_is_one_line(bench, tmp_path):
    row = bench.measure("bad", ["--model", "tiny", "per_device_batch_size=0"], "cpu-1", 2, tmp_path)
    assert row["error"] and "\n" not in row["error"]
    assert bench.line(row).startswith("bad") and "Traceback" not in bench.line(row)
