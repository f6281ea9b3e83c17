"""The benches' --json: a file that cannot be written is a one-line usage error before any row runs (exit 2, no
traceback, nothing written), and the file is written whole (bench/outfile.py)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
WRITERS = ("published", "recipes", "serving", "serving_memory", "memory_accuracy", "maxtext_configs", "gpu_measured",
           "gpu_attention")


@pytest.mark.parametrize("name", WRITERS)
def test_a_json_path_that_cannot_be_written_is_a_usage_error(name, tmp_path):
    for target, message in ((tmp_path / "missing" / "out.json", "no directory"), (tmp_path, "a directory")):
        proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--json", str(target)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_file_is_written_whole(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_outfile", BENCH / "outfile.py")
    outfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(outfile)
    target = tmp_path / "rows.json"
    outfile.write(target, {"rows": [1, 2]})
    assert json.loads(target.read_text()) == {"rows": [1, 2]}
    assert [p.name for p in target.parent.iterdir()] == ["rows.json"]  # no temporary left beside it
