"""`--out` never loses what is there: only an earlier output of the same command, holding nothing else, is
replaced; anything else is refused with one line and exit 2 unless `--force`."""

import json
import os
import subprocess
import sys

import pytest

from maxperf import aot
from maxperf.aot import artifacts
from maxperf.aot.artifacts import OutputRefused
from maxperf.profiler import run as runner

TINY = ["seq_len=64", "per_device_batch_size=2"]


def maxperf(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "maxperf.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def _user_dir(path):
    (path / "old_runs").mkdir(parents=True)
    (path / "notes.txt").write_text("important")
    (path / "old_runs" / "r1.json").write_text("{}")
    return path


def _intact(path):
    return (path / "notes.txt").read_text() == "important" and (path / "old_runs" / "r1.json").is_file()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return aot.compile("cpu-8", "tiny", TINY, out=tmp_path_factory.mktemp("o") / "art").out_dir


@pytest.mark.parametrize("command", [
    ["compile", "--topology", "cpu-8", "--model", "tiny", *TINY],
    ["estimate-memory", "--topology", "cpu-8", "--model", "tiny", *TINY],
    ["estimate-memory", "--topology", "cpu-8", "--model", "tiny", "--max-batch", *TINY],
])
def test_a_directory_of_the_users_files_is_refused_and_kept(tmp_path, command):
    if "--max-batch" in command:  # there --out is a folder of trials: a file in its place is refused
        exp = tmp_path / "precious.txt"
        exp.write_text("important")
    else:
        exp = _user_dir(tmp_path / "myexp")
    proc = maxperf(*command, "--out", str(exp))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--out" in proc.stderr
    assert _intact(exp) if exp.is_dir() else exp.read_text() == "important"
    assert sorted(p.name for p in tmp_path.iterdir()) == [exp.name]  # no .old, no .partial left beside it


def test_a_file_is_refused_and_kept(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("important")
    proc = maxperf("compile", "--topology", "cpu-8", "--model", "tiny", *TINY, "--out", str(precious))
    assert proc.returncode == 2 and "is a file" in proc.stderr
    assert precious.read_text() == "important"
    assert [p.name for p in tmp_path.iterdir()] == ["precious.txt"]


def test_run_refuses_before_the_first_step(compiled, tmp_path):
    exp = _user_dir(tmp_path / "myexp")
    proc = maxperf("run", str(compiled), "--steps", "1", "--warmup", "0", "--out", str(exp))
    assert proc.returncode == 2, proc.stderr
    assert "did not write" in proc.stderr and "step 1" not in proc.stderr
    assert _intact(exp)


def test_an_earlier_artifact_is_replaced_and_a_foreign_file_in_it_is_refused(compiled, tmp_path):
    out = tmp_path / "again"
    aot.compile("cpu-8", "tiny", TINY, out=out)
    first = json.loads((out / "manifest.json").read_text())["created_unix"]
    aot.compile("cpu-8", "tiny", TINY, out=out)  # an earlier compile's artifact: replaced
    assert json.loads((out / "manifest.json").read_text())["created_unix"] > first
    (out / "notes.txt").write_text("important")
    with pytest.raises(OutputRefused, match="notes.txt"):
        aot.compile("cpu-8", "tiny", TINY, out=out)
    assert (out / "notes.txt").read_text() == "important"
    aot.compile("cpu-8", "tiny", TINY, out=out, force=True)
    assert not (out / "notes.txt").exists() and (out / "compiled.pkl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_a_compile_artifact_is_not_replaced_by_a_run(compiled, tmp_path):
    out = tmp_path / "art"
    aot.compile("cpu-8", "tiny", TINY, out=out)
    with pytest.raises(OutputRefused, match="maxperf run did not write"):
        runner.run(compiled, steps=1, warmup=0, out=out)
    assert (out / "compiled.pkl").is_file()
    runner.run(compiled, steps=1, warmup=0, out=tmp_path / "r")
    runner.run(compiled, steps=1, warmup=0, out=tmp_path / "r")  # an earlier run's output: replaced
    assert json.loads((tmp_path / "r" / "run.json").read_text())["steps"] == 1


def test_protected_and_unwritable_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in (tmp_path, tmp_path.parent, os.path.expanduser("~")):
        with pytest.raises(OutputRefused, match="working directory"):
            artifacts.claim_output(path, "compile", force=True)
    with pytest.raises(OutputRefused, match="cannot write"):
        artifacts.ArtifactWriter("/proc/maxperf-nope/out", "compile")
    empty = tmp_path / "empty"
    empty.mkdir()
    artifacts.claim_output(empty, "compile")  # an empty directory holds nothing to lose
