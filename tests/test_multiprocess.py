"""Two processes on 127.0.0.1, four CPU devices each, joined by jax.distributed: compile, run, and a dying peer."""

import json
import os
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


def launch(args, cwd, log_name):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    port = free_port()
    procs = []
    for i in range(2):
        log = open(cwd / f"{log_name}{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "maxperf.cli", *args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    procs = launch(["compile", "--topology", "cpu-4x2", "--model", "tiny", "--out", "art", "seq_len=64",
                    "learning_rate=1e-2", "warmup_steps=0"], d, "compile")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (d / "compile0.log").read_text()[-2000:]
    return d


def test_two_process_compile_and_run(artifact):
    manifest = json.loads((artifact / "art" / "manifest.json").read_text())
    assert manifest["devices"] == {"platform": "cpu", "kind": "cpu", "count": 8, "processes": 2}
    procs = launch(["run", "art", "--steps", "3", "--warmup", "1", "--out", "run"], artifact, "run")
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], (artifact / "run1.log").read_text()[-2000:]
    data = json.loads((artifact / "run" / "run.json").read_text())
    assert data["processes"] == 2 and data["devices"] == 8
    assert len(data["losses"]) == 3 and all(loss > 0 for loss in data["losses"])


def test_a_killed_peer_makes_the_survivor_exit_promptly(artifact):
    procs = launch(["run", "art", "--steps", "100000", "--warmup", "1", "--timeout", "10", "--out", "killed"],
                   artifact, "killed")
    deadline = time.monotonic() + 240
    while "step 3:" not in (artifact / "killed0.log").read_text():
        assert time.monotonic() < deadline and procs[0].poll() is None, (artifact / "killed0.log").read_text()
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    start = time.monotonic()
    code = procs[0].wait(timeout=60)
    waited = time.monotonic() - start
    log = (artifact / "killed0.log").read_text()
    assert code != 0 and waited < 30, (code, waited)
    assert "maxperf: error: no step finished" in log
    assert not (artifact / "killed").exists()
