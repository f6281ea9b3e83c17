"""Two processes on 127.0.0.1, four CPU devices each, joined by jax.distributed: compile, run, and a dying peer."""

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, cwd, log_name, processes=2, timeout="20", env=None):
    """Processes 0..processes-1 of `maxperf ARGS`, joined on a free port; each one's stdout and stderr in files."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"} | (env or {})
    port = free_port()
    procs = []
    for i in range(processes):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "maxperf.cli", *args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), "--timeout", timeout], cwd=cwd, env=env,
            stdout=open(cwd / f"{log_name}{i}.out", "w"), stderr=open(cwd / f"{log_name}{i}.err", "w")))
    return procs


def only_maxperf_lines(stderr: str) -> list[str]:
    """The lines of a process's stderr, after checking that each is maxperf's own (progress or `maxperf: ...`) and
    that exactly one, the last, is an error."""
    lines = stderr.splitlines()
    assert lines and all(re.match(r"(\[\s*\d+\.\ds\] |maxperf: )", line) for line in lines), stderr[-3000:]
    assert [line for line in lines if line.startswith("maxperf: error")] == lines[-1:], stderr[-3000:]
    return lines


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    procs = launch(["compile", "--topology", "cpu-4x2", "--model", "tiny", "--out", "art", "seq_len=64",
                    "learning_rate=1e-2", "warmup_steps=0"], d, "compile")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (d / "compile0.err").read_text()[-2000:]
    return d


def test_two_process_compile_and_run(artifact):
    manifest = json.loads((artifact / "art" / "manifest.json").read_text())
    assert manifest["devices"] == {"platform": "cpu", "kind": "cpu", "count": 8, "processes": 2}
    # process 0 wrote the artifact, and only it says it did (process 1 named a directory it never wrote)
    said = [(artifact / f"compile{i}.out").read_text() for i in range(2)]
    assert "-> art\n" in said[0] and "written by process 0" in said[1] and "-> art\n" not in said[1]
    procs = launch(["run", "art", "--steps", "3", "--warmup", "1", "--out", "run", "--json"], artifact, "run")
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], (artifact / "run1.err").read_text()[-2000:]
    data = json.loads((artifact / "run" / "run.json").read_text())
    assert data["processes"] == 2 and data["devices"] == 8 and data["process_index"] == 0
    assert len(data["losses"]) == 3 and all(loss > 0 for loss in data["losses"])
    # stdout is one JSON document per process (gloo's connection lines go elsewhere); only process 0 wrote run.json
    printed = [json.loads((artifact / f"run{i}.out").read_text()) for i in range(2)]
    assert printed[0] == data
    assert printed[1]["process_index"] == 1 and printed[1]["out_dir"] is None
    assert printed[1]["losses"] == data["losses"]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_peer_ends_the_survivor_with_one_line(artifact, victim):
    """Process 0 hosts jax's coordination service: its death makes jax abort the survivor at once (SIGABRT, a C++
    stack trace); process 1's death leaves process 0 waiting in a collective until maxperf's watchdog speaks."""
    name = f"killed{victim}"
    procs = launch(["run", "art", "--steps", "100000", "--warmup", "1", "--out", name], artifact, name)
    survivor = 1 - victim
    deadline = time.monotonic() + 240
    while "step 3:" not in (artifact / f"{name}{survivor}.err").read_text():
        assert time.monotonic() < deadline and procs[survivor].poll() is None, \
            (artifact / f"{name}{survivor}.err").read_text()[-3000:]
        time.sleep(0.5)
    procs[victim].send_signal(signal.SIGKILL)
    procs[victim].wait()
    code = procs[survivor].wait(timeout=60)
    lines = only_maxperf_lines((artifact / f"{name}{survivor}.err").read_text())
    assert code == 1, lines
    # process 0 learns of process 1's death from maxperf's watchdog (half the --timeout of 20 s) or from jax's
    # heartbeats, whichever speaks first
    lost = f"maxperf: error: process {survivor} of 2 lost its job"
    assert lines[-1].startswith((lost,) if victim == 0 else (lost, "maxperf: error: no step finished for 10 s")), \
        lines[-1]
    assert not (artifact / name).exists()


def test_a_peer_that_never_joins_ends_in_one_line(artifact):
    (alone,) = launch(["run", "art", "--steps", "1", "--out", "alone"], artifact, "alone", processes=1, timeout="3")
    code = alone.wait(timeout=120)
    lines = only_maxperf_lines((artifact / "alone0.err").read_text())
    assert code == 1
    assert lines[-1].startswith("maxperf: error: process 0 of 2 could not join the job at 127.0.0.1:"), lines[-1]
    assert "--timeout 3 s" in lines[-1]


@pytest.mark.parametrize("flags", [["--num-processes", "3", "--process-id", "0", "--coordinator", "127.0.0.1:1"], []])
def test_the_process_count_is_checked_before_joining(artifact, flags):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "run", "art", *flags], cwd=artifact, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"maxperf: error: art was compiled for 2 process(es), this job has "
                                        f"{3 if flags else 1}: start 2 processes, each with --coordinator HOST:PORT "
                                        "--num-processes 2 --process-id I"]


def wait_for(path, text, proc, limit_s=240):
    deadline = time.monotonic() + limit_s
    while text not in path.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.2)


def kill_child(proc) -> None:
    """SIGKILL to the process that does a supervised command's work (as the system's out-of-memory killer would)."""
    (child,) = [int(c) for path in glob.glob(f"/proc/{proc.pid}/task/*/children")
                for c in open(path).read().split()]
    os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("command", ["compile", "run"])
def test_a_killed_process_ends_its_job_in_one_line_and_leaves_no_partial_output(artifact, command):
    """Process 0's worker killed mid-command: jax aborts process 1 (SIGABRT, a C++ stack trace, before a compile had
    a supervisor); each supervisor says one line, exits 1 and removes the `.NAME.*.partial` directory its worker
    left."""
    name = f"killed-{command}"
    args = (["compile", "--topology", "cpu-4x2", "--model", "tiny", "--out", name, "seq_len=64"] if command == "compile"
            else ["run", "art", "--steps", "100000", "--warmup", "1", "--out", name])
    procs = launch(args, artifact, name, env={"MAXPERF_NO_CACHE": "1"})  # a compile cache hit would be over at once
    try:
        wait_for(artifact / f"{name}1.err", "compiling" if command == "compile" else "step 3:", procs[1])
        assert list(artifact.glob(f".{name}.*.partial"))  # both processes are writing
        kill_child(procs[0])
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    lines = [only_maxperf_lines((artifact / f"{name}{i}.err").read_text()) for i in range(2)]
    assert codes == [1, 1], lines
    assert lines[0][-1].startswith(f"maxperf: error: process 0 of 2: the {command} process was ended by SIGKILL")
    if command == "compile":  # a run's survivor may instead see gloo fail in a collective first, and say so
        assert lines[1][-1].startswith("maxperf: error: process 1 of 2 lost its job"), lines[1][-1]
    assert not (artifact / name).exists() and not list(artifact.glob(f".{name}.*"))


@pytest.mark.parametrize("topology, flags, want", [
    ("cpu-4x2", ["--num-processes", "3", "--process-id", "0", "--coordinator", "127.0.0.1:1"],
     "cpu-4x2 compiles as 2 processes, this job has 3: start 2 processes, each with --coordinator HOST:PORT "
     "--num-processes 2 --process-id I"),
    ("cpu-4x2", [], "cpu-4x2 compiles as 2 processes, this job has 1: start 2 processes, each with --coordinator "
                    "HOST:PORT --num-processes 2 --process-id I"),
    ("v5p-8", ["--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1"],
     "v5p-8 compiles in one process, whatever its hosts (its devices are virtual), this job has 2: run it without "
     "--num-processes"),
])
def test_the_compile_process_count_is_checked_before_joining(tmp_path, topology, flags, want):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "compile", "--topology", topology, "--model", "tiny",
                           "--out", "c", *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"maxperf: error: {want}"]
