"""`maxperf run`: the compiled tiny step on this machine's CPU devices, its measurements and its refusals."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_util import maxperf

from maxperf import aot
from maxperf.profiler import run as runner
from maxperf.spec.errors import MaxperfError

LEARNS = ["seq_len=64", "per_device_batch_size=2", "learning_rate=1e-2", "warmup_steps=0"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return aot.compile("cpu-8", "tiny", LEARNS, out=tmp_path_factory.mktemp("run") / "tiny").out_dir


def test_run_measures_and_the_loss_falls(artifact, tmp_path):
    result = runner.run(artifact, steps=5, warmup=1, out=tmp_path / "r")
    data = json.loads((tmp_path / "r" / "run.json").read_text())
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "losses", "predicted_step_time_s",
                "measured_over_predicted", "memory"):
        assert key in data, key
    assert data["schema"] == runner.RUN_SCHEMA
    assert len(data["losses"]) == 5 and len(data["step_times_s"]) == 5
    assert data["losses"][-1] < data["losses"][0]
    assert data["step_time_min_s"] <= data["step_time_s"] <= data["step_time_p90_s"]
    assert data["tokens_per_s"] == pytest.approx(8 * 2 * 64 / data["step_time_s"])
    # MFU and TFLOP/s follow from the model's FLOPs, the median step and the peak of the calibration recorded
    from maxperf import perfmodel
    from maxperf.perfmodel.estimate import device_for
    from maxperf.user_cache import calibration_for

    p = aot.load(artifact).plan
    flops = perfmodel.count_flops(p.configs.model, p.configs.train).model_flops
    stored = calibration_for(p.topology)
    peak = device_for(p.topology, stored).peak_flops(p.configs.train.compute_dtype)
    assert data["peak_flops_per_device"] == peak
    assert data["mfu"] == flops / (data["step_time_s"] * peak)
    assert data["tflops_per_device"] == flops / data["step_time_s"] / 1e12
    # the same calibration (here: none stored in the session's cache) as the compile's estimate.json, so no note
    estimate = json.loads((artifact / "estimate.json").read_text())
    assert data["calibration"] == estimate["calibration"] == stored.record()
    assert not any("estimate.json predicted with calibration" in n for n in data["notes"])
    assert data["measured_over_predicted"] == pytest.approx(data["step_time_s"] / data["predicted_step_time_s"])
    assert data["memory"]["compiler_per_device_bytes"] > 0
    assert data["memory"]["measured_peak_bytes"] is None and "missing" in data["memory"]["measured_note"]
    assert result.step_time_s == data["step_time_s"]


def test_a_run_says_when_its_calibration_is_not_the_estimates(monkeypatch, capsys):
    from maxperf.spec import notes

    monkeypatch.setattr(notes, "_said", set())
    before = {"path": "/c/calibration.json", "created": "2025-01-01T00:00:00+00:00", "sha256": "ab" * 32}
    now = {**before, "created": "2025-02-01T00:00:00+00:00", "sha256": "cd" * 32}
    message = ("estimate.json predicted with calibration /c/calibration.json of 2025-01-01T00:00:00+00:00 (sha256 "
               "abababababab); this run's peak uses /c/calibration.json of 2025-02-01T00:00:00+00:00 (sha256 "
               "cdcdcdcdcdcd)")
    assert runner.calibration_mismatch({"calibration": before}, now) == [message]
    assert capsys.readouterr().err == f"maxperf: note: {message}\n"
    assert runner.calibration_mismatch({"calibration": before}, before) == []
    assert runner.calibration_mismatch({"calibration": None}, None) == []  # TPU and GPU artifacts: none on either
    assert runner.calibration_mismatch({"calibration": before}, None) == [
        "estimate.json predicted with calibration /c/calibration.json of 2025-01-01T00:00:00+00:00 (sha256 "
        "abababababab); this run's peak uses none"]


def test_profile_writes_a_trace_and_summarizes_it(artifact, tmp_path):
    result = runner.run(artifact, steps=2, warmup=1, profile=True, out=tmp_path / "p")
    assert list((tmp_path / "p" / "trace").rglob("*.xplane.pb"))
    prof = result.profile
    assert prof["top_ops"] and all(op["self_seconds"] >= 0 for op in prof["top_ops"])
    assert sum(prof["seconds_by_category"].values()) > 0
    assert prof["step_time_s"] and prof["steps_traced"] >= 3
    assert prof["device_planes"] == [] and any("device planes" in m for m in prof["missing"])
    assert prof["open_command"] == f"maxperf xprof {tmp_path / 'p' / 'trace'}"  # served on 127.0.0.1 only


@pytest.mark.slow
def test_restored_run_continues_the_loss(artifact, tmp_path):
    straight = runner.run(artifact, steps=6, warmup=0, out=tmp_path / "a")
    first = runner.run(artifact, steps=3, warmup=0, out=tmp_path / "b", checkpoint=tmp_path / "ckpt")
    assert first.checkpoint["bytes"] > 0 and first.checkpoint["total_seconds"] >= first.checkpoint["blocking_seconds"]
    resumed = runner.run(artifact, steps=3, warmup=0, out=tmp_path / "c", restore=tmp_path / "ckpt")
    assert first.losses == pytest.approx(straight.losses[:3], rel=1e-6)
    assert resumed.losses == pytest.approx(straight.losses[3:], rel=1e-6)
    # a directory that holds no checkpoint (the run's own output) is refused before the executable loads
    with pytest.raises(MaxperfError, match="is not a checkpoint directory"):
        runner.run(artifact, steps=1, warmup=0, out=tmp_path / "d", restore=tmp_path / "b")


@pytest.mark.slow
def test_token_file_feeds_the_step(artifact, tmp_path):
    import numpy as np

    np.save(tmp_path / "tokens.npy", np.arange(40 * 65, dtype=np.int32) % 256)
    result = runner.run(artifact, steps=2, warmup=0, data=tmp_path / "tokens.npy", out=tmp_path / "d")
    assert result.data.endswith("tokens.npy") and len(result.losses) == 2
    # a file shorter than the steps read: its rows are read again, and run.json says so
    np.save(tmp_path / "short.npy", np.arange(3 * 65, dtype=np.int32) % 256)
    short = runner.run(artifact, steps=2, warmup=0, data=tmp_path / "short.npy", out=tmp_path / "s")
    said = [n for n in short.notes if "read again" in n]
    assert len(said) == 1 and "short.npy holds 3 rows" in said[0]
    np.save(tmp_path / "bad.npy", np.full((4, 65), 999, dtype=np.int32))
    with pytest.raises(MaxperfError, match=r"\[0, 256\)"):
        runner.run(artifact, steps=1, warmup=0, data=tmp_path / "bad.npy", out=tmp_path / "e")


def test_each_step_reads_the_global_batch_of_rows_under_accumulation(tmp_path):
    # per_device_batch_size=2 x 8 devices x 4 microbatches: 64 rows a step (MaxText's global batch)
    import jax
    import numpy as np

    from maxperf.aot import targets
    from maxperf.models import train_step
    from maxperf.spec.request import resolve

    p = resolve("cpu-8", "tiny", ["seq_len=8", "per_device_batch_size=2", "gradient_accumulation_steps=4"])
    spec = train_step.abstract_step(p.configs.model, p.configs.train, targets.jax_mesh(p.topology, p.mesh,
                                                                                       jax.devices()[:8]))
    rows = np.arange(200 * 9, dtype=np.int32).reshape(200, 9) % 256
    np.save(tmp_path / "tokens.npy", rows)
    tokens = runner._token_rows(tmp_path / "tokens.npy", 8, p.configs.model.vocab_size)
    batch_for = runner.batches(spec, tokens, first_step=0, seed=0)
    first, second = (jax.device_get(batch_for(i)) for i in (0, 1))
    assert first["inputs"].shape == second["inputs"].shape == (64, 8)
    np.testing.assert_array_equal(first["inputs"], rows[:64, :-1])
    np.testing.assert_array_equal(second["inputs"], rows[64:128, :-1])


def test_bad_step_counts_are_refused(artifact):
    with pytest.raises(MaxperfError, match="--steps must be >= 1"):
        runner.run(artifact, steps=0)


@pytest.mark.slow
def test_cli_run_prints_and_writes_json(artifact, tmp_path):
    proc = maxperf("run", str(artifact / "compiled.pkl"), "--steps", "3", "--warmup", "1", "--out",
                   str(tmp_path / "cli"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 3
    assert (tmp_path / "cli" / "run.json").is_file()


@pytest.mark.slow
def test_altered_artifact_is_refused_and_runs_nothing(artifact, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    data = bytearray((bad / "compiled.pkl").read_bytes())
    data[-100] ^= 0x01
    (bad / "compiled.pkl").write_bytes(bytes(data))
    proc = maxperf("run", str(bad), "--steps", "1")
    assert proc.returncode == 2 and "sha256" in proc.stderr and "Traceback" not in proc.stderr
    assert not (bad / "run").exists()


@pytest.mark.slow
def test_mismatched_topology_is_refused_in_one_line(tmp_path):
    """Starting jax here loads libtpu and the CUDA plugin, which write warnings and tracebacks: only --verbose shows
    them."""
    tpu = aot.compile("v5p-8", "tiny", ["seq_len=128"], out=tmp_path / "tpu").out_dir
    everything = ("XLA_FLAGS", "JAX_PLATFORMS")  # as a user runs it: jax starts every platform it has a plugin for
    proc = maxperf("run", str(tpu), "--steps", "1", unset=everything)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("maxperf: error: this machine does not match the artifact: compiled for 4 tpu device(s)")
    assert not (Path(tpu) / "run").exists()
    verbose = maxperf("run", str(tpu), "--steps", "1", "--verbose", unset=everything)
    assert verbose.returncode == 2 and verbose.stderr.splitlines()[-1] == line
    assert len(verbose.stderr.splitlines()) > 1  # what the CUDA plugin and libtpu wrote as jax started them


def test_a_checkpoint_that_cannot_be_written_is_refused_before_the_first_step(artifact, tmp_path):
    (tmp_path / "file.txt").write_text("not a directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("kept")
    cases = [(tmp_path / "file.txt" / "ckpt", "file.txt is a file, not a directory"),
             (Path("/proc/maxperf-ckpt"), "cannot create directories in /proc"),  # unwritable even for root
             (tmp_path / "full", "exists and is not empty")]
    for destination, why in cases:
        said = []
        with pytest.raises(MaxperfError, match=why):
            runner.run(artifact, steps=1, warmup=0, checkpoint=destination, out=tmp_path / "out", progress=said.append)
        assert said == [] and not (tmp_path / "out").exists()
    assert (tmp_path / "full" / "kept.txt").read_text() == "kept"


@pytest.mark.slow
def test_cli_refuses_an_unwritable_checkpoint_in_one_line(artifact, tmp_path):
    (tmp_path / "file.txt").write_text("not a directory")
    proc = maxperf("run", str(artifact), "--checkpoint", str(tmp_path / "file.txt" / "ckpt"), "--out",
                   str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"maxperf: error: --checkpoint {tmp_path / 'file.txt' / 'ckpt'}: "
                                        f"{tmp_path / 'file.txt'} is a file, not a directory"]


@pytest.mark.slow
def test_a_failed_save_ends_the_run_at_once(artifact, tmp_path):
    """A save that fails after the destination was checked (here: the check skipped) leaves orbax's writer threads
    waiting 20 minutes for signals; the command still ends, with exit code 1 and one last line."""
    (tmp_path / "file.txt").write_text("not a directory")
    script = ("import sys\n"
              "from maxperf.profiler import checkpoints\n"
              "checkpoints.check_destination = lambda directory: None\n"
              "from maxperf.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"MAXPERF_DEBUG": "1"}  # in this process
    proc = subprocess.run([sys.executable, "-c", script, "run", str(artifact), "--steps", "1", "--warmup", "0",
                           "--checkpoint", str(tmp_path / "file.txt" / "ckpt"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith(
        f"maxperf: error: --checkpoint {tmp_path / 'file.txt' / 'ckpt'}: the save failed (NotADirectoryError")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_its_child(artifact, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "maxperf.cli", "run", str(artifact), "--steps", "1", "--warmup",
                             "100000", "--out", str(tmp_path / "out")], stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:  # the child's progress: wait until it is in the step loop (in warm-up: no step timed)
        if "warm-up 1:" in line:
            break
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    assert rest.splitlines()[-1] == "maxperf: interrupted by SIGINT"
    assert not Path(f"/proc/{children[0]}").exists()  # the supervisor waited for it
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))  # it cleaned up


def test_the_supervisor_shows_maxperfs_lines_and_ends_in_one(capsys):
    """What `run` and `calibrate` pass on from their child's stderr, and the one line for how the child ended."""
    import argparse
    import io

    from maxperf.cli import supervisor

    child_stderr = (b"Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda12.initialize()\n"
                    b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
                    b"[   1.1s] joined the job at 127.0.0.1:5 as process 1 of 2\n"
                    b"F1123 03:31:58.380221    8995 client.h:86] Terminating process because the JAX distributed "
                    b"service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination "
                    b"service. Either the leader task was preempted/died/restarted unexpectedly\n"
                    b"*** Check failure stack trace: ***\n")
    relay = supervisor._Relay(io.BytesIO(child_stderr), verbose=False)
    relay.thread.join()
    assert capsys.readouterr().err.splitlines() == ["[   1.1s] joined the job at 127.0.0.1:5 as process 1 of 2"]
    assert relay.joined and not relay.said_error and relay.hidden == 4
    args = argparse.Namespace(command="run", num_processes=2, process_id=1, coordinator="127.0.0.1:5", timeout=20)
    assert supervisor.ending(-6, False, relay, args) == (
        "maxperf: error: process 1 of 2 lost its job (UNAVAILABLE: Failed to send RPC to coordination service): "
        "another process of the job stopped or cannot be reached, so this one gives up", 1)
    assert supervisor.ending(0, signal.SIGINT, relay, args) == (None, 0)  # it finished as the interrupt came
    assert supervisor.ending(-9, signal.SIGINT, relay, args) == (
        "maxperf: interrupted by SIGINT; the run process did not stop within 10 s and was killed", 130)
    relay = supervisor._Relay(io.BytesIO(child_stderr + b"maxperf: error: a reason\n"), verbose=True)
    relay.thread.join()
    assert capsys.readouterr().err == child_stderr.decode() + "maxperf: error: a reason\n"
    assert supervisor.ending(2, False, relay, args) == (None, 2)  # the child said why
    assert supervisor.ending(-6, False, relay, args) == (None, 1)  # an abort at exit, after it said why



def test_cpu_devices_stuck_at_different_collectives_are_named_in_one_line(capsys):
    """XLA:CPU can run a device's independent collectives in any order; devices that wait at different ones for each
    other end the run by its termination timeout: the line names the collectives and what to do."""
    import argparse
    import io

    from maxperf.cli import supervisor

    key = "RendezvousKey{run_id=RunId: 1, global_devices=[0, 1, 2, 3], num_local_participants=4, op_id=%d}"
    waits = [f"E1130 04:42:30.030638    102{i} rendezvous.cc:116] [id={i}] This thread has been waiting for "
             f"`{kind} {key % op}` for 20 seconds and may be stuck." for i, (kind, op) in
             enumerate([("all reduce", 29), ("all reduce", 29), ("all gather", 7)])]
    fatal = f"F1130 04:43:20.030875    1022 rendezvous.cc:161] [id=1] Termination timeout for `all reduce {key % 29}`"
    relay = supervisor._Relay(io.BytesIO("\n".join([*waits, fatal, ""]).encode()), verbose=False)
    relay.thread.join()
    args = argparse.Namespace(command="run", num_processes=None, process_id=None, coordinator=None, timeout=5)
    line, code = supervisor.ending(-6, False, relay, args)
    assert code == 1 and "waited at different collectives (all reduce op 29, all gather op 7)" in line
    assert line.endswith("run again, or compile for as many CPU devices as there are cores")


def test_a_collective_that_lost_its_peer_is_named_as_such():
    seen = ("UNKNOWN: Gloo AllGather failed: [external/xla++third_party_ext+gloo/gloo/transport/tcp/pair.cc:538] "
            "Read error [127.0.0.1]:4517: Connection reset by peer")  # process 0 of a cpu-4x2 run, process 1 killed
    assert runner._PEER_LOST.search(seen)
    assert runner._PEER_LOST.search("Gloo AllReduce failed: Connection closed by peer")
    assert not runner._PEER_LOST.search("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2G")
    assert runner.PeerLost.exit_code == 1


def test_a_cpu_run_gives_xla_collectives_time_to_wait_for_busy_cores(monkeypatch):
    """XLA:CPU aborts a collective whose device threads have not all arrived in 40 s; on a loaded host they arrive late
    without anything being wrong, so a CPU run sets the termination timeout from --timeout and keeps the user's own."""
    from maxperf.cli import run as cli_run

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    cli_run.patient_cpu_collectives(60)
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=600" in flags
    assert "--xla_cpu_collective_timeout_seconds=600" in flags
    assert flags[0] == "--xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_call_terminate_timeout_seconds=5")
    cli_run.patient_cpu_collectives(60)
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=5" in os.environ["XLA_FLAGS"].split()
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=600" not in os.environ["XLA_FLAGS"]


@pytest.mark.slow
def test_a_run_on_a_loaded_host_slows_down_instead_of_aborting(artifact, tmp_path):
    """Four processes spinning on this machine's cores while a cpu-8 step runs its collectives: the run finishes."""
    burners = [subprocess.Popen([sys.executable, "-c",
                                 "import time\nend = time.time() + 120\nwhile time.time() < end: pass"])
               for _ in range(4)]
    try:
        proc = maxperf("run", str(artifact), "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "loaded"),
                       "--json", timeout=600)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["steps"] == 3


def test_token_data_that_cannot_serve_says_what_would(tmp_path):
    """--data: a missing file, a file that is not numpy's, and a stream shorter than one row each name what is
    wanted, where numpy's own messages spoke of pickles and a shape of (0, L+1)."""
    import numpy as np

    short, text = tmp_path / "short.npy", tmp_path / "text.npy"
    np.save(short, np.arange(100))
    text.write_text("hello")
    for path, message in ((tmp_path / "none.npy", "no such file"),
                          (text, "not a .npy file (numpy.save of an integer array of token ids"),
                          (short, "a 1-D stream of 100 tokens holds no row of L+1 = 2049 tokens")):
        with pytest.raises(MaxperfError, match=re.escape(message)):
            runner._token_rows(path, 2048, 32000)
    rows = runner._token_rows(short, 9, 32000)
    assert rows.shape == (10, 10)


def test_the_output_is_locked_before_the_executable_loads(artifact, tmp_path, monkeypatch):
    """Two runs to one --out at once: the second is refused at once, while the first still loads its executable
    (before, the lock came after the load and init, so both ran and one result replaced the other)."""
    from maxperf.aot import artifacts
    from maxperf.aot.artifacts import OutputRefused

    loaded = aot.load(artifact)
    refused = []

    class Loading:  # the artifact, whose executable loads while a second writer tries --out
        def __getattr__(self, name):
            return getattr(loaded, name)

        def step(self, devices):
            try:
                artifacts.ArtifactWriter(tmp_path / "r", "run")
            except OutputRefused as e:
                refused.append(str(e))
            return loaded.step(devices)

    monkeypatch.setattr(runner, "load", lambda path: Loading())
    runner.run(artifact, steps=1, warmup=0, out=tmp_path / "r")
    assert len(refused) == 1 and "another maxperf is writing there now" in refused[0]


def test_a_checkpoint_inside_the_artifact_or_the_restored_checkpoint_is_refused(artifact, tmp_path):
    """A checkpoint written into the compile artifact would make a later compile to it refuse, or --force delete it;
    one inside the checkpoint being restored would write into what the run reads."""
    with pytest.raises(MaxperfError, match="lies inside the compile artifact"):
        runner.run(artifact, steps=1, warmup=0, checkpoint=Path(artifact) / "ck", out=tmp_path / "r1")
    first = tmp_path / "ck1"
    runner.run(artifact, steps=1, warmup=0, checkpoint=first, out=tmp_path / "r2")
    with pytest.raises(MaxperfError, match="lies inside --restore"):
        runner.run(artifact, steps=1, warmup=0, restore=first, checkpoint=first / "next", out=tmp_path / "r3")
    assert not (Path(artifact) / "ck").exists() and not (first / "next").exists()


def test_a_restored_runs_data_note_counts_from_its_first_step(tmp_path):
    class Batches:
        rows, batch_rows = 3, 1

    assert runner.data_note("d.npy", Batches(), 2) == []
    (note,) = runner.data_note("d.npy", Batches(), 2, first=4)
    assert "from step 4 read up to row 6" in note
