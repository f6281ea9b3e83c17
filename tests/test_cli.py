"""The `maxperf` command line: argument order, exit codes, one-line errors, help, JSON forms, signals."""

import argparse
import csv
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxperf.cli import main
from maxperf.cli.compile import COMPILE_SCHEMA
from maxperf.cli.parser import build_parser, parse_args
from maxperf.spec.request import resolve

ROOT = Path(__file__).resolve().parent.parent
NO_FIT = ["--topology", "v5p-8", "--model", "llama2-70b"]  # 70B parameters and AdamW in 8 x 95 GiB: no


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# key=value words on both sides of options (item 10)


def test_key_values_on_both_sides_of_an_option(capsys):
    code, out, _ = run_main(capsys, "estimate", "--topology", "v5e-256", "per_device_batch_size=2", "--json",
                            "seq_len=1024", "--model", "scaled-1")
    est = json.loads(out)
    assert code == 0 and est["per_device_batch_size"] == 2 and est["seq_len"] == 1024


def test_estimate_counts_maxtexts_global_batch_under_accumulation(capsys):
    words = ["--topology", "cpu-8", "--model", "tiny", "seq_len=16", "per_device_batch_size=8",
             "gradient_accumulation_steps=4"]
    code, out, _ = run_main(capsys, "estimate", *words)
    assert code == 0 and "global batch     256 x 16 tokens (4 microbatches of 64)" in out
    code, out, _ = run_main(capsys, "estimate", *words, "--json")
    est = json.loads(out)
    assert (est["per_device_batch_size"], est["grad_accum_steps"], est["global_batch"]) == (8, 4, 256)
    assert est["tokens_per_s"] * est["step_time_s"] == pytest.approx(256 * 16, rel=1e-12)


@pytest.mark.parametrize("command", [["compile"], ["estimate-memory", "--max-batch"], ["sweep", "--out", "o"]])
def test_every_plan_command_reads_intermixed_overrides(command):
    topology = ["--topologies", "v5p-8"] if command[0] == "sweep" else ["--topology", "v5p-8"]
    args = parse_args(build_parser(), [command[0], "a=1", *topology, "b=2", "--model", "tiny", *command[1:], "c=3"])
    assert args.overrides == ["a=1", "b=2", "c=3"] and args.model == "tiny"


def test_report_reads_paths_around_its_option():
    args = parse_args(build_parser(), ["report", "a", "-o", "r.html", "b"])
    assert args.paths == ["a", "b"] and args.out == "r.html"


def test_unknown_options_are_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), ["estimate", "--topology", "v5p-8", "--model", "tiny", "--bogus"])
    assert e.value.code == 2 and "--bogus" in capsys.readouterr().err


# exit codes and JSON forms (items 11, 18)


def test_estimate_exits_3_when_the_step_does_not_fit_with_or_without_json(capsys):
    plain, _, _ = run_main(capsys, "estimate", *NO_FIT)
    as_json, out, _ = run_main(capsys, "estimate", *NO_FIT, "--json")
    assert plain == as_json == 3 and json.loads(out)["fits"] is False


def test_estimate_json_says_what_it_was_for(capsys):
    code, out, _ = run_main(capsys, "estimate", "--topology", "v5p-16", "--model", "llama2-7b", "ici_fsdp=4",
                            "ici_tensor=2", "per_device_batch_size=3", "--json")
    est = json.loads(out)
    assert code == 0 and est["schema"] == "maxperf.estimate/1"
    assert est["topology"] == "v5p-16" and est["num_slices"] == 1
    assert {k: v for k, v in est["mesh"]["axes"].items() if v > 1} == {"fsdp": 4, "tensor": 2}
    assert est["per_device_batch_size"] == 3 and est["global_batch"] == 3 * 8 and est["seq_len"] > 0


SCHEMA_FORM = re.compile(r"maxperf\.[a-z]+(-[a-z]+)*/[0-9]+")


def test_every_schema_name_has_one_form():
    names = {m for path in (ROOT / "maxperf").rglob("*.py")
             for m in re.findall(r"[\"'](maxperf\.[^\"'\s/]+/[^\"'\s]*)[\"']", path.read_text())}
    assert len(names) >= 10
    assert sorted(n for n in names if not SCHEMA_FORM.fullmatch(n)) == []


def test_sweep_exits_1_when_points_fail(capsys, monkeypatch, tmp_path):
    from maxperf.search import sweep as sweeping

    rows = [{"point": "v5p-8", "status": "error", "reason": "XLA could not compile the step"},
            {"point": "v5p-16", "status": "ok", "reason": None, "predicted_step_time_s": 0.1, "predicted_mfu": 0.5}]
    monkeypatch.setattr(sweeping, "sweep", lambda *a, **k: sweeping.SweepResult(tmp_path, rows, 2, 1.0))
    argv = ["sweep", "--model", "tiny", "--topologies", "v5p-8,v5p-16", "--out", str(tmp_path)]
    code, _, err = run_main(capsys, *argv)
    assert code == 1 and "1 of 2 points failed" in err
    code, out, _ = run_main(capsys, *argv, "--json")
    assert code == 1 and json.loads(out)["errors"] == 1
    rows[0].update(status="ok", reason=None)
    assert run_main(capsys, *argv)[0] == 0


def test_max_batch_with_nothing_fitting_prints_the_figures_at_batch_1(capsys):
    code, out, _ = run_main(capsys, "estimate-memory", *NO_FIT, "--max-batch", "--analytical-only")
    assert code == 3
    need = re.search(r"per_device_batch_size=1 needs ([\d.]+) GiB per device of ([\d.]+) GiB \(([\d.]+) GiB over",
                     out)
    assert need and float(need[1]) - float(need[2]) == pytest.approx(float(need[3]), abs=0.011)
    assert "B=1" in out and "per-device total" in out  # the comparison table at B=1
    code, out, _ = run_main(capsys, "estimate-memory", *NO_FIT, "--max-batch", "--analytical-only", "--json")
    found = json.loads(out)
    assert code == 3 and found["schema"] == "maxperf.max-batch/1"
    assert found["at_batch_1"]["per_device_batch_size"] == 1 and found["at_batch_1"]["fits"] is False


# one-line errors, exit 2 (item 12)


def test_a_coordinator_without_a_port_is_one_line(capsys):
    code, _, err = run_main(capsys, "compile", "--topology", "cpu-4x2", "--model", "tiny", "--num-processes", "2",
                            "--process-id", "0", "--coordinator", "nohostport")
    assert code == 2 and err.count("\n") == 1 and "HOST:PORT" in err


# help and version (item 13)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.fullmatch(r"maxperf \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_every_option_has_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in sub.choices.items() for a in p._actions
               if not a.help and not isinstance(a, argparse._HelpAction)]
    assert missing == []


def test_compile_help_names_the_default_model(capsys):
    from maxperf.spec.presets import DEFAULT_MODEL

    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    assert f"default {DEFAULT_MODEL}" in " ".join(capsys.readouterr().out.split())


def test_models_lists_the_presets_without_jax():
    code = ("import json, sys; from maxperf.cli import main; main(['models', '--json']); "
            "print(json.dumps(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    *table, imported = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and json.loads(imported) == []
    assert len(json.loads("\n".join(table))) >= 10


@pytest.mark.slow
def test_models_parameter_counts_are_the_flax_models(capsys):
    from maxperf.models import train_step
    from maxperf.spec import presets

    code, out, _ = run_main(capsys, "models", "--json")
    listed = {r["name"]: r["params"] for r in json.loads(out)}
    assert code == 0 and listed == {name: train_step.param_count(presets.get(name)) for name in presets.names()}


# compile --json and the compile cache (item 13)


@pytest.mark.slow
def test_compile_json_and_a_cache_hit(capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["compile", "--topology", "cpu-8", "--model", "tiny", "seq_len=64", "remat_policy=none"]
    # the compile runs in a child process (maxperf.cli.supervisor) that prints on file descriptor 1
    code, out, _ = run_main(capfd, *argv, "--out", str(tmp_path / "a"), "--json")
    first = json.loads(out)
    assert code == 0 and first["schema"] == COMPILE_SCHEMA and first["cache_hit"] is False
    assert first["topology"] == "cpu-8" and first["mesh"]["axes"] and first["global_batch"] > 0
    code, out, _ = run_main(capfd, *argv, "--out", str(tmp_path / "b"))
    assert code == 0 and "from the compile cache" in out and "compile time     0.0 s" not in out


# sweeps: signals, workers and resuming (items 6, 17)


def _children(pid: int) -> list[int]:
    return [int(c) for path in glob.glob(f"/proc/{pid}/task/*/children") for c in Path(path).read_text().split()]


def _alive(pids: list[int]) -> list[int]:
    """The pids still running (a zombie has exited)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _wait_gone(pids: list[int], limit_s: float = 30.0) -> list[int]:
    """Waits up to limit_s for `pids` to end, then kills what is left (no test leaves a process behind)."""
    deadline = time.monotonic() + limit_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _alive(pids)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _start_sweep(out: Path, topologies: str) -> tuple[subprocess.Popen, list[int]]:
    """A compiled sweep in its own process group, once its first point is done: (process, its child processes)."""
    args = [sys.executable, "-m", "maxperf.cli", "sweep", "--model", "tiny", "--topologies", topologies, "--out",
            str(out), "--workers", "2", "seq_len=128"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(out.glob("points/*/point.json")):
        if proc.poll() is not None or time.monotonic() > deadline:
            workers = _children(proc.pid)
            proc.kill()
            _wait_gone(workers, 0)
            pytest.fail(f"the sweep ended or hung before its first point: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    return proc, _children(proc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_sweep_stops_its_workers_and_keeps_finished_points(tmp_path, signum):
    out = tmp_path / "s"
    proc, workers = _start_sweep(out, "v5p-8,v5p-16,v5p-32,v5p-64,v5p-128,v5p-256")
    assert len(workers) >= 2
    try:
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # as Ctrl-C does: the whole foreground group
        else:
            os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        left = _wait_gone(workers)
    assert left == []
    finished = sorted(p.parent.name for p in out.glob("points/*/point.json"))
    assert proc.returncode == 128 + signum
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"maxperf: error: interrupted by {signal.Signals(signum).name}: {len(finished)} of 6 points finished now and "
        f"kept in {out}; run the same command again to resume")
    assert 1 <= len(finished) < 6
    with open(out / "results.csv") as f:  # the table is written from the finished points, on this exit too
        assert sorted(row["point"] for row in csv.DictReader(f)) == finished
    assert sorted(p.name for p in (out / "points").iterdir()) == finished  # no empty point folder
    assert not list(out.glob("points/*/.artifact.*.partial"))
    assert all(json.loads((out / "points" / name / "point.json").read_text())["status"] == "ok" for name in finished)


@pytest.mark.slow
def test_a_killed_sweeps_workers_die_with_it(tmp_path):
    proc, workers = _start_sweep(tmp_path / "k", "v5p-8,v5p-16,v5p-32,v5p-64,v5p-128,v5p-256")
    proc.kill()
    proc.communicate(timeout=60)
    assert len(workers) >= 2 and _wait_gone(workers) == []  # it kills what outlived the sweep, after 30 s


def test_a_point_of_many_words_gets_a_folder_name_the_file_system_takes(tmp_path):
    """A plan's candidate of long keys (the places of a pipeline split, every mesh axis) named a point folder over
    255 bytes; a long name is cut short and ended by a digest of the whole, distinct points keeping distinct names."""
    from maxperf.search.sweep import MAX_NAME, Point

    words = ("account_for_embedding_in_pipeline_split=true", "account_for_loss_in_pipeline_split=true",
             "ici_fsdp=2", "ici_tensor=4", "dcn_data=2", "dcn_stage=8", "dcn_fsdp=8",
             "remat_policy=minimal_offloaded", "attention=flash", "per_device_batch_size=0.5", "grad_accum_steps=1")
    a = Point("h100-8x128", 1, (*words, "num_pipeline_microbatches=8"))
    b = Point("h100-8x128", 1, (*words, "num_pipeline_microbatches=16"))
    assert len(a.name) <= MAX_NAME and a.name != b.name and a.name.startswith("h100-8x128_account_for")
    (tmp_path / a.name).mkdir()
    short = Point("v5p-8", 1, ("ici_fsdp=4",))
    assert short.name == "v5p-8_ici_fsdp=4"


def test_a_point_stopped_between_its_artifact_and_its_point_json_leaves_no_folder(tmp_path):
    """An interrupted sweep keeps the folders of the points with a point.json (done, or failed) and removes the
    others: one whose artifact was in place but whose point.json was not is not finished, and the tables do not
    list it. A folder holding what maxperf did not write there (a run's files in the artifact, a user's file) stays."""
    from maxperf.aot.artifacts import MANIFEST_SCHEMA
    from maxperf.search.sweep import grid, remove_partials

    points = grid(["v5p-8", "v5p-16", "v5p-32", "v5p-64", "v5p-128"], [1], {})
    done, stopped, partial, ran, users = (tmp_path / "points" / pt.name for pt in points)
    (done / "artifact").mkdir(parents=True)
    (done / "point.json").write_text("{}")
    manifest = json.dumps({"schema": MANIFEST_SCHEMA, "files": {"executable.bin": "0"}})
    for folder in (stopped, ran, users):
        (folder / "artifact").mkdir(parents=True)
        (folder / "artifact" / "manifest.json").write_text(manifest)
        (folder / "artifact" / "executable.bin").write_bytes(b"x")
    (ran / "artifact" / "run.json").write_text("{}")
    (users / "notes.txt").write_text("mine")
    (partial / ".artifact.1.partial").mkdir(parents=True)
    remove_partials(tmp_path, points)
    assert sorted(p.name for p in (tmp_path / "points").iterdir()) == sorted(pt.name for pt in (points[0], *points[3:]))
    assert (done / "artifact").is_dir()
    assert (ran / "artifact" / "run.json").read_text() == "{}" and (users / "notes.txt").read_text() == "mine"


def test_a_sweep_is_not_resumed_by_another_request(tmp_path):
    from maxperf.search.sweep import _finished, grid, point_key, sweep
    from maxperf.spec.errors import MaxperfError

    out = tmp_path / "s"
    first = sweep("llama2-7b", ["v5p-8", "v5p-16"], analytical_only=True, out=out, workers=1)
    assert first.computed == 2
    point = grid(["v5p-8"], [1], {})[0]
    assert _finished(out / "points" / point.name, point_key("llama2-7b", point, True))
    assert not _finished(out / "points" / point.name, point_key("llama2-7b", point, False))
    # another model's sweep would replace this one's tables and its points of the same names: refused, untouched
    tables = {name: (out / name).read_bytes() for name in ("results.csv", "sweep.json")}
    with pytest.raises(MaxperfError, match="holds a sweep of llama2-7b; give a new directory for llama2-13b"):
        sweep("llama2-13b", ["v5p-8", "v5p-16"], analytical_only=True, out=out, workers=1)
    assert {name: (out / name).read_bytes() for name in tables} == tables
    # so too where the sweep was killed before its tables were written: its points say whose it is
    killed = tmp_path / "killed"
    shutil.copytree(out, killed)
    for table in killed.iterdir():  # a killed sweep left its points alone
        if table.name != "points":
            table.unlink()
    with pytest.raises(MaxperfError, match="holds a sweep of llama2-7b; give a new directory for llama2-13b"):
        sweep("llama2-13b", ["v5p-8", "v5p-16"], analytical_only=True, out=killed, workers=1)
    other = sweep("llama2-13b", ["v5p-8", "v5p-16"], analytical_only=True, out=tmp_path / "other", workers=1)
    assert other.computed == 2 and {r["model"] for r in other.rows} == {"llama2-13b"}
    # the same model grows its sweep: the points done are not run again
    again = sweep("llama2-7b", ["v5p-8", "v5p-16", "v5p-32"], analytical_only=True, out=out, workers=1)
    assert again.computed == 1 and len(again.rows) == 3
    # the same preset by MaxText's name is the same model
    deepseek = sweep("deepseek-v3", ["v5p-256"], analytical_only=True, out=tmp_path / "ds", workers=1)
    assert sweep("deepseek3-671b", ["v5p-256"], analytical_only=True, out=tmp_path / "ds", workers=1).rows
    assert deepseek.rows


def test_a_value_given_twice_is_one_point_and_an_axis_given_twice_is_refused(capsys, tmp_path):
    from maxperf.search.sweep import grid

    points = grid(["v5p-8", "v5p-8"], [1, 1], {"per_device_batch_size": ["1", "2", "1"]})
    assert [p.name for p in points] == ["v5p-8_per_device_batch_size=1", "v5p-8_per_device_batch_size=2"]
    code, out, _ = run_main(capsys, "sweep", "--model", "tiny", "--topologies", "cpu-1",
                            "per_device_batch_size=1,1,1.0,01", "--analytical-only", "--out", str(tmp_path / "s"),
                            "--json")
    assert code == 0 and [r["point"] for r in json.loads(out)["rows"]] == ["cpu-1_per_device_batch_size=1"]
    code, _, err = run_main(capsys, "sweep", "--model", "tiny", "--topologies", "cpu-1", "ici_tensor=1,2",
                            "ici_tensor_parallelism=1,2", "--analytical-only", "--out", str(tmp_path / "u"))
    assert code == 2 and "sweep axis ici_tensor is given twice (ici_tensor and ici_tensor_parallelism)" in err
    code, _, err = run_main(capsys, "sweep", "--model", "tiny", "--topologies", "cpu-1", "per_device_batch_size=1",
                            "per_device_batch_size=2", "--analytical-only", "--out", str(tmp_path / "t"))
    assert code == 2 and "sweep axis per_device_batch_size is given twice" in err and not (tmp_path / "t").exists()


# traces open in xprof's server on loopback only (item 14)


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(IPv4 or IPv6 address in /proc's hex, port) of every socket `pid` listens on."""
    inodes = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


@pytest.mark.slow
def test_xprof_serves_a_trace_on_loopback_only(tmp_path):
    import gzip
    import socket
    import urllib.request

    trace = tmp_path / "run" / "trace"
    code = ("import jax, jax.numpy as jnp, sys\n"
            "f = jax.jit(lambda a: (a @ a).sum()); x = jnp.ones((64, 64)); f(x).block_until_ready()\n"
            "with jax.profiler.trace(sys.argv[1]):\n    f(x).block_until_ready()\n")
    subprocess.run([sys.executable, "-c", code, str(trace)], check=True, capture_output=True, timeout=300)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "maxperf.cli", "xprof", str(tmp_path / "run"), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == f"xprof at http://127.0.0.1:{port}/ (this machine only; Ctrl-C " \
                                                 "stops it)"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/profile/runs", timeout=10) as r:
                    body = r.read()
                    runs = json.loads(gzip.decompress(body) if r.headers.get("Content-Encoding") == "gzip" else body)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert runs == [p.name for p in (trace / "plugins" / "profile").iterdir()]
        assert _listening_addresses(proc.pid) == {("0100007F", port)}  # 127.0.0.1, and no other listener
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# plugin noise, partial output of a killed compile (supervised compile)


def _maxperf(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "maxperf.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | (env or {}))


def _have_plugins() -> bool:
    import importlib.util

    from maxperf.spec import gpu_targets

    return importlib.util.find_spec("libtpu") is not None and gpu_targets.plugin_library() is not None


PROGRESS = r"\[\s*\d+\.\ds\] "
COMPILE_PROGRESS = ["devices", "abstract state", "lowering", "compiling", "writing artifacts",
                    "reading the step time from the optimized HLO"]


@pytest.mark.slow
@pytest.mark.skipif(not _have_plugins(), reason="needs the tpu and gpu extras: pip install 'maxperf[tpu,gpu]'")
@pytest.mark.parametrize("argv, progress", [
    (["compile", "--topology", "v5p-8", "--out", "c"], COMPILE_PROGRESS),
    (["compile", "--topology", "h100-8", "--out", "c"], COMPILE_PROGRESS),
    (["estimate-memory", "--topology", "v5p-8"], [*COMPILE_PROGRESS[:4], "reading the compiler's figures",
                                                  COMPILE_PROGRESS[5]]),
    (["sweep", "--topologies", "v5p-8,h100-8", "--out", "s"], ["2 points", r"\[1/2\]", r"\[2/2\]"]),
], ids=["compile-tpu", "compile-gpu", "estimate-memory", "sweep"])
def test_commands_that_load_plugins_write_only_maxperfs_lines_on_stderr(tmp_path, argv, progress):
    """libtpu, the CUDA plugin and absl write nothing that reaches the terminal: stderr is maxperf's progress."""
    proc = _maxperf(*argv, "--model", "tiny", "seq_len=128", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == len(progress), proc.stderr[-3000:]
    assert all(re.match(PROGRESS + want, line) for want, line in zip(progress, lines)), lines


def test_a_child_notes_and_its_supervisor_removes_only_partial_output_directories(tmp_path):
    from maxperf.cli import supervisor

    notes = tmp_path / "notes"
    fd = os.open(notes, os.O_WRONLY | os.O_CREAT)
    hook = supervisor._note_partials(fd)
    partial, other = tmp_path / ".out.abcd1234.partial", tmp_path / "out.abcd1234.partial"
    for path in (partial, other, tmp_path / ".out.abcd1234.old"):
        hook("os.mkdir", (str(path), 0o700, -1))
        path.mkdir()
    hook("os.mkdir", (partial.name, 0o700, 5))  # relative to a directory descriptor: not a writer's
    hook("open", (str(partial), "r", 0))
    os.close(fd)
    assert notes.read_text() == f"{partial}\n"
    assert supervisor.remove_partials(notes.read_bytes() * 2) == [str(partial)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.abcd1234.old", "notes", "out.abcd1234.partial"]


@pytest.mark.slow
def test_a_killed_compile_ends_in_one_line_and_leaves_no_partial_output(tmp_path):
    """The process that compiles, killed (as the system's out-of-memory killer would): its supervisor says so in
    one line, exits 1, and removes the `.c.*.partial` directory beside --out."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"MAXPERF_NO_CACHE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "maxperf.cli", "compile", "--topology", "cpu-8", "--model", "tiny",
                             "seq_len=64", "--out", "c"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while "compiling" not in proc.stderr.readline():
            assert proc.poll() is None and time.monotonic() < deadline
        assert list(tmp_path.glob(".c.*.partial"))
        (child,) = _children(proc.pid)
        os.kill(child, signal.SIGKILL)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert code == 1 and err.startswith("maxperf: error: the compile process was ended by SIGKILL") \
        and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_childs_error_after_another_threads_unended_line_is_still_its_error(capsys):
    """asyncio's tracebacks at exit (orbax's threads after a failed restore) come a piece at a time, and the child's
    error line can land after one without its newline: the relay still takes it as the child's, and hides the rest."""
    import io

    from maxperf.cli import supervisor

    args = argparse.Namespace(command="run", num_processes=1)
    stream = (b"Traceback (most recent call last):\n"
              b"    self._check_closed()maxperf: error: --restore ck: it is damaged\n"
              b"RuntimeError: Event loop is closed\n")
    relay = supervisor._Relay(io.BytesIO(stream), verbose=False)
    relay.thread.join()
    assert relay.error == "maxperf: error: --restore ck: it is damaged" and relay.hidden == 3
    assert supervisor.ending(2, None, relay, args) == (None, 2)  # it said why
    assert capsys.readouterr().err == "maxperf: error: --restore ck: it is damaged\n"
    verbose = supervisor._Relay(io.BytesIO(stream), verbose=True)
    verbose.thread.join()
    assert capsys.readouterr().err.splitlines()[1:3] == ["    self._check_closed()",
                                                          "maxperf: error: --restore ck: it is damaged"]


def test_a_supervised_compile_that_does_not_fit_or_is_killed_ends_as_it_should():
    import io

    from maxperf.cli import supervisor

    args = argparse.Namespace(command="compile", num_processes=2, process_id=0, coordinator="127.0.0.1:5", timeout=20)
    relay = supervisor._Relay(io.BytesIO(b"[   0.1s] joined the job at 127.0.0.1:5 as process 0 of 2\n"), verbose=False)
    relay.thread.join()
    assert supervisor.ending(3, False, relay, args) == (None, 3)  # it printed its result: the step does not fit
    assert supervisor.ending(-9, False, relay, args) == (
        "maxperf: error: process 0 of 2: the compile process was ended by SIGKILL (sent by a person or by the system "
        "when memory runs out)", 1)  # not "lost its job": nothing in the job ended it


def test_a_child_leaves_at_once_with_its_code_and_its_output_flushed_but_not_out_of_a_job():
    """leave() ends the process with the command's code after flushing what Python printed and what C buffered (as
    libtpu's logs), running Python's exit handlers but nothing after; in a multi-process job (jax.distributed
    initialized) it returns, so that jax shuts the job down in order."""
    script = ("import atexit, ctypes, sys; from maxperf.cli import supervisor; print('result', end='');"
              " sys.stderr.write('said'); atexit.register(lambda: sys.stderr.write(' handled'));"
              " ctypes.CDLL(None).printf(b' c-buffered'); supervisor.leave(3); print('after')")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "result c-buffered", "said handled")
    in_a_job = ("import jax, sys; from maxperf.cli import supervisor; jax.distributed.is_initialized = lambda: True;"
                " supervisor.leave(3); print('returned')")
    proc = subprocess.run([sys.executable, "-c", in_a_job], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "returned\n")


# SIGINT exits 130 and SIGTERM 143 from every command, naming the signal (issue 28, item 12)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_command_stopped_by_a_signal_exits_128_plus_it_and_names_it(signum):
    script = ("import os, signal, sys, time\nfrom maxperf import cli\nfrom maxperf.cli import catalogs\n"
              "def stopped(args):\n"
              f"    os.kill(os.getpid(), {int(signum)})\n"
              "    time.sleep(30)\n"
              "catalogs.cmd_models = stopped\n"
              "sys.exit(cli.main(['models', '--json']))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum and proc.stderr == f"maxperf: interrupted by {name}\n", proc.stderr
    assert json.loads(proc.stdout) == {"schema": "maxperf.error/1", "error": f"interrupted by {name}",
                                       "exit": 128 + signum}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_supervised_compile_stopped_by_a_signal_exits_128_plus_it_and_names_it(tmp_path, signum):
    # not served from the session's compile cache, where another test compiled the same step, and a step of several
    # seconds' compile (unscanned layers), not the one second of a scanned tiny model that a loaded machine can finish
    # before the signal lands; the signal comes once XLA's compile has begun (its progress line), not at the first
    # line, after which a child scheduled ahead of the test could finish the whole step: it is still at work
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "MAXPERF_NO_CACHE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "maxperf.cli", "compile", "--topology", "cpu-1", "--model", "tiny",
                             "seq_len=64", "num_layers=12", "scan_layers=false", "--out", str(tmp_path / "c")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = [proc.stderr.readline() for _ in range(1)]
        while seen[-1] and "compiling" not in seen[-1] and len(seen) < 20:
            seen.append(proc.stderr.readline())
        assert seen[0].startswith("[") and "compiling" in seen[-1], seen
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert code == 128 + signum
    # the compile stops at once, or (busy in XLA past the grace period) is killed, which the line adds
    assert proc.stderr.read().splitlines()[-1].startswith(f"maxperf: interrupted by {signal.Signals(signum).name}")
    assert not list(tmp_path.iterdir())


def test_a_supervised_child_ended_after_a_signal_names_the_signal_that_came():
    import io

    from maxperf.cli import supervisor

    args = argparse.Namespace(command="compile", num_processes=None, process_id=0, coordinator=None, timeout=20)
    relay = supervisor._Relay(io.BytesIO(b"[   0.1s] compiling\n"), verbose=False)
    relay.thread.join()
    # a child busy in XLA's compiler cannot stop at once: the supervisor kills it after its grace period
    assert supervisor.ending(-signal.SIGKILL, signal.SIGTERM, relay, args) == (
        "maxperf: interrupted by SIGTERM; the compile process did not stop within 10 s and was killed", 143)
    assert supervisor.ending(-signal.SIGTERM, signal.SIGTERM, relay, args) == ("maxperf: interrupted by SIGTERM", 143)
    assert supervisor.ending(-signal.SIGINT, signal.SIGINT, relay, args) == ("maxperf: interrupted by SIGINT", 130)
    said = supervisor._Relay(io.BytesIO(b"maxperf: interrupted by SIGTERM\n"), verbose=False)
    said.thread.join()
    assert supervisor.ending(143, signal.SIGTERM, said, args) == (None, 143)
    assert supervisor.ending(1, signal.SIGTERM, said, args) == (None, 143)  # whatever the child made of it


# --json on an error: a JSON error document on stdout, the one line on stderr (issue 28, item 13)


def _json_commands() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name for name, p in sub.choices.items() if any("--json" in a.option_strings for a in p._actions)}


def test_every_json_command_prints_an_error_document_on_stdout(capfd, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{")
    failing = {  # a usage error, or a bad input that the command itself refuses
        "models": (["models", "--json", "extra"], "maxperf models: unrecognized arguments: extra"),
        "topologies": (["topologies", "--json", "--platform", "tpx"], "maxperf topologies: argument --platform: "),
        "compile": (["compile", "--topology", "v5p-9", "--json"], "unknown topology 'v5p-9'"),  # in its child
        "estimate": (["estimate", "--topology", "v5p-8", "--model", "nomodel", "--json"], "unknown model 'nomodel'"),
        "estimate-memory": (["estimate-memory", "--topology", "v5p-9", "--model", "tiny", "--json"],
                            "unknown topology 'v5p-9'"),
        "run": (["run", str(damaged), "--json"], "manifest.json is not valid JSON"),  # in its child
        "sweep": (["sweep", "--model", "tiny", "--topologies", "v5p-9", "--out", str(tmp_path / "s"), "--json"],
                  "unknown topology 'v5p-9'"),
        "plan": (["plan", "--model", "tiny", "--topology", "v5p-9", "--out", str(tmp_path / "p"), "--json"],
                 "unknown topology 'v5p-9'"),
        "keys": (["keys", "--json", "extra"], "maxperf keys: unrecognized arguments: extra"),
        "cache": (["cache", "list", "--older-than", "2", "--json"], "--older-than is for `maxperf cache clear`"),
    }
    assert set(failing) == _json_commands()
    for command, (argv, says) in failing.items():
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capfd.readouterr()
        doc = json.loads(out)
        assert code == 2 and doc == {"schema": "maxperf.error/1", "error": doc["error"], "exit": 2}, (command, out)
        assert says in doc["error"], (command, doc)
        if command in ("models", "topologies", "keys"):  # argparse's usage errors
            assert err.splitlines()[-1] == doc["error"].replace(": ", ": error: ", 1), err
        else:
            assert err == f"maxperf: error: {doc['error']}\n", (command, err)
    assert main(["estimate", "--topology", "v5p-9", "--model", "tiny"]) == 2
    assert capfd.readouterr().out == ""  # without --json, stdout stays empty


# MaxText command lines as they are


@pytest.mark.parametrize("theirs, ours", [("deepseek3-671b", "deepseek-v3"),
                                          ("llama4-17b-128e", "llama4-maverick-17b-128e"),
                                          ("llama4-17b-16e", "llama4-scout-17b-16e"), ("kimi-k2-1t", "kimi-k2"),
                                          ("deepseek2-16b", "deepseek-v2-lite"), ("llama2-7b", "llama2-7b")])
def test_model_takes_maxtexts_model_names(theirs, ours):
    """MaxText's model_name for a preset selects it under --model too (MaxText's name wins where the two differ)."""
    from maxperf.spec import presets
    from maxperf.spec.errors import MaxperfError

    assert presets.get(theirs) == presets.get(ours) and presets.get(theirs).name == ours
    with pytest.raises(MaxperfError, match="did you mean llama4-17b-128e"):
        presets.get("llama4-17b-12e")


def test_a_maxtext_command_line_names_the_request_its_options_would(capsys):
    """train_compile's words (its config file, model_name, compile_topology and compile_topology_num_slices) give the
    same estimate as maxperf's options; the words that change nothing of the step are named once and ignored."""
    code, out, err = run_main(capsys, "estimate", "--json", "maxtext/configs/base.yml", "model_name=llama2-7b",
                              "compile_topology=v5p-256", "compile_topology_num_slices=2", "steps=10",
                              "run_name=x", "dataset_type=synthetic", "base_output_directory=gs://b",
                              "per_device_batch_size=2")
    assert code == 0, err
    mine = run_main(capsys, "estimate", "--json", "--model", "llama2-7b", "--topology", "v5p-256", "--num-slices",
                    "2", "learning_rate=3e-5", "load_balance_loss_weight=0", "per_device_batch_size=2")
    assert json.loads(out) == json.loads(mine[1])
    assert err.splitlines() == [
        "maxperf: note: maxtext/configs/base.yml: MaxText's defaults where maxperf's differ, before the line's own "
        "words (per_device_batch_size=12 learning_rate=3e-5 load_balance_loss_weight=0)",
        "maxperf: note: MaxText's steps, run_name, dataset_type, base_output_directory change nothing of the step: "
        "ignored"]
    # the line's batch where it gives none is base.yml's, 12 a device, as MaxText would train it
    code, out, _ = run_main(capsys, "estimate", "--json", "maxtext/configs/base.yml", "model_name=llama2-7b",
                            "compile_topology=v5p-8")
    assert code == 0 and json.loads(out)["global_batch"] == 48


def test_a_tpu_recipes_keys_paste_as_they_are(capsys):
    """An Ironwood recipe's MaxText keys: those that tune MaxText's own kernels are named once as not reproduced, the
    experts' sharding switch at its default changes nothing, and the rest are the step's (the optimizer's first
    moment in bfloat16, tokamax's splash as jax's with the fused backward and the recipe's layouts, the grouped
    matmul's tiles)."""
    recipe = ["compile_topology=tpu7x-8", "model_name=llama3.1-8b", "per_device_batch_size=1", "use_iota_embed=True",
              "opt_type=adamw", "mu_dtype=bfloat16", "sa_q_layout=SEQ_MINOR", "sa_k_layout=SEQ_MINOR",
              "use_tokamax_splash=True", "use_splash_scheduler=True", "cost_estimate_flops_fwd=5000000000000",
              "wi_tile_fwd_batch_seq=256", "wi_tile_fwd_buffer_count=2", "shard_exp_on_fsdp=False", "attention=flash",
              "steps=30"]
    code, out, err = run_main(capsys, "estimate", "--json", *recipe)
    assert code == 0, err
    assert err.splitlines() == [
        "maxperf: note: MaxText's steps change nothing of the step: ignored",
        "maxperf: note: MaxText's use_splash_scheduler, cost_estimate_flops_fwd, wi_tile_fwd_buffer_count tune its own "
        "kernels and collectives; maxperf compiles jax's kernels and XLA's collectives as they come: not reproduced"]
    args = parse_args(build_parser(), ["estimate", *recipe])
    train = resolve(args.topology, args.model, args.overrides).configs.train
    assert (train.mu_dtype, train.sa_q_layout, train.sa_v_layout) == ("bfloat16", "SEQ_MINOR", "HEAD_DIM_MINOR")
    assert (train.wi_tile_fwd_batch_seq, train.wo_tile_fwd_batch_seq) == (256, 512)  # the grouped matmul's tiles
    assert train.use_tokamax_splash and train.sa_use_fused_bwd_kernel  # tokamax's splash has only the fused backward
    plain = run_main(capsys, "estimate", "--json", *(w for w in recipe if not w.startswith("mu_dtype")))[1]
    # AdamW's first moment in 2 bytes instead of 4: the optimizer's 8 bytes per float32 parameter become 6
    mine, theirs = json.loads(out)["memory"], json.loads(plain)["memory"]
    assert mine["optimizer"] == pytest.approx(theirs["optimizer"] * 6 / 8)


def test_maxtexts_gpu_recipe_pastes_as_it_is(capsys):
    """MaxText's configs/gpu/a3/llama_3.1_405b/128vm.sh: cuDNN's attention through Transformer Engine, the logits'
    dot in bfloat16 and cuDNN's packed segments, over 128 hosts of 8 H100s."""
    recipe = ["compile_topology=h100-8x128", "hardware=gpu", "model_name=llama3.1-405b", "attention=cudnn_flash_te",
              "remat_policy=full", "use_iota_embed=True", "scan_layers=True", "logits_dot_in_fp32=False",
              "per_device_batch_size=1.0", "max_target_length=8192", "dcn_fsdp_parallelism=128",
              "ici_fsdp_parallelism=8", "max_segments_per_seq=32"]
    code, out, err = run_main(capsys, "estimate", "--json", *recipe)
    assert code == 0, err
    d = json.loads(out)
    assert (d["topology"], d["attention_kernel"], d["fits"]) == ("h100-8x128", "flash", True)
    assert "max_segments_per_seq tune its own kernels" in err and "compiled as attention=flash" in err


def test_deepseek_v3_2d_fsdp_recipe_pastes_as_its_plain_config_and_says_so(capsys):
    """tpu-recipes' DeepSeek-V3 on tpu7x-4x8x8 names deepseek3-671b-2dfsdp, MaxText's DeepSeek-V3 with logical-axis
    rules of its own, and use_2d_fsdp_sharding=True: the same bytes per device by maxperf's rules, so the estimate is
    the plain config's, with a line naming what is not reproduced."""
    recipe = ["compile_topology=tpu7x-4x8x8", "per_device_batch_size=8", "max_target_length=4096",
              "ici_fsdp_transpose_parallelism=2", "ici_fsdp_parallelism=-1", "remat_policy=custom",
              "decoder_layer_input=offload", "use_2d_fsdp_sharding=True", "attention=flash"]
    code, out, err = run_main(capsys, "estimate", "--json", "model_name=deepseek3-671b-2dfsdp", *recipe)
    assert code == 0, err
    assert ("maxperf: note: MaxText's model_name=deepseek3-671b-2dfsdp, use_2d_fsdp_sharding lay the weights out over "
            "fsdp and fsdp_transpose by rules of their own") in err
    code, plain, err = run_main(capsys, "estimate", "--json", "model_name=deepseek3-671b",
                                *(w for w in recipe if not w.startswith("use_2d")))
    assert code == 0, err
    assert json.loads(out)["step_time_s"] == json.loads(plain)["step_time_s"]
    assert json.loads(out)["model"] == "deepseek-v3"


def test_gpt_oss_ironwood_recipe_pastes_with_its_experts_stored_over_fsdp(capsys):
    """tpu-recipes' gpt-oss-120b on tpu7x-4x4x4 (xpk's name for its 64 chips) sets fsdp_shard_on_exp, MaxText's earlier
    name of shard_exp_on_fsdp: the experts stored with E over fsdp gather the same bytes, so the step time is the
    default layout's; with D whole the experts' shards are not thin, and the memory is 1.98 GiB less (compiled at 4
    layers with libtpu 0.0.52: 63.11 against 65.10 GiB per device, 1.99 less)."""
    recipe = ["compile_topology=tpu7x-4x4x4", "model_name=gpt-oss-120b", "per_device_batch_size=10",
              "max_target_length=8192", "weight_dtype=float32", "remat_policy=custom", "decoder_layer_input=offload",
              "mlpwo=offload", "megablox=True", "sparse_matmul=True", "attention=flash", "ici_fsdp_parallelism=64",
              "ici_data_parallelism=2", "dcn_data_parallelism=-1"]
    code, out, err = run_main(capsys, "estimate", "--json", *recipe, "fsdp_shard_on_exp=True")
    assert code == 0, err
    code, plain, err = run_main(capsys, "estimate", "--json", *recipe)
    assert code == 0, err
    mine, theirs = json.loads(out), json.loads(plain)
    assert (mine["topology"], mine["chips"]) == ("tpu7x-128", 64)
    assert mine["step_time_s"] == pytest.approx(theirs["step_time_s"], rel=1e-9)
    # the default layout's overlapped schedule would pass the 94.74 GiB libtpu gives a device, so perfmodel prices
    # the experts' dispatch serialized there (MemoryBreakdown.overlapped_bytes keeps what overlapping would need)
    overlapped = theirs["memory"]["overlapped_bytes"] or theirs["memory_per_device_bytes"]
    assert overlapped - mine["memory_per_device_bytes"] == pytest.approx(1.98 * 2**30, rel=0.01)
    assert mine["fits"] and theirs["fits"]


@pytest.mark.parametrize("word, line", [
    ("opt_type=sgd", "opt_type=sgd: maxperf compiles AdamW, as MaxText's adamw and adam_pax"),
    ("sa_q_layout=SEQ", "sa_q_layout must be one of HEAD_DIM_MINOR, SEQ_MINOR"),
    ("grad_dtype=int8", "grad_dtype must be one of float32, bfloat16, float16"),
])
def test_maxtext_values_maxperf_does_not_compile_are_refused(capsys, word, line):
    try:  # a MaxText word leaves through argparse (SystemExit), a bad value through main's one line
        code = main(["estimate", "--model", "tiny", "--topology", "v5p-8", word])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and line in err.strip().splitlines()[-1] and "Traceback" not in err


def test_maxtext_keys_at_the_values_that_leave_them_off_paste_as_they_are(capsys):
    """Keys of MaxText's base.yml that production command lines restate (Trillium's mixtral config: dropout off,
    gradient_clipping_threshold=0, its model's decoder_block, a cloud logger) read as MaxText reads them: no dropout,
    no clipping at a threshold of 0 (the step without clipping), the block the model has; the estimate is the one
    without them."""
    words = ["enable_dropout=False", "dropout_rate=0.0", "decoder_block=mixtral", "enable_checkpoint_cloud_logger=True",
             "matmul_precision=default", "moe_mlpwo=remat", "num_slices=-1", "learning_rate_schedule_steps=-1",
             "shardy=False", "learning_rate_final_fraction=0.1", "use_sft=False"]
    base = ["estimate", "--json", "--model", "mixtral-8x7b", "--topology", "v5p-64"]
    code, out, err = run_main(capsys, *base, *words)
    assert code == 0, err
    assert err.splitlines()[0] == (
        "maxperf: note: MaxText's enable_dropout, dropout_rate, enable_checkpoint_cloud_logger, matmul_precision, "
        "moe_mlpwo, num_slices, learning_rate_schedule_steps, use_sft change nothing of the step: ignored")
    assert "shardy tune its own kernels" in err
    code, plain, _ = run_main(capsys, *base)
    assert json.loads(out)["step_time_s"] == json.loads(plain)["step_time_s"]
    args = parse_args(build_parser(), ["estimate", "--model", "tiny", "--topology", "v5p-8",
                                       "gradient_clipping_threshold=0", "gradient_accumulation_steps=2"])
    assert resolve(args.topology, args.model, args.overrides).configs.train.grad_clip_norm is None
    args = parse_args(build_parser(), ["estimate", "--model", "tiny", "--topology", "v5p-8",
                                       "gradient_clipping_threshold=0.5"])
    assert resolve(args.topology, args.model, args.overrides).configs.train.grad_clip_norm == 0.5


@pytest.mark.parametrize("argv, line", [
    (["model_name=llama2-7b", "decoder_block=mixtral"],
     "decoder_block=mixtral: MaxText builds llama2-7b with decoder_block=llama2"),
    (["--model", "tiny", "decoder_block=llama2"], "decoder_block=llama2: tiny is not one of MaxText's model configs"),
    (["--model", "tiny", "dropout_rate=0.1"], "dropout_rate=0.1: maxperf's steps have no dropout"),
    (["--model", "tiny", "matmul_precision=highest"],
     "matmul_precision=highest: maxperf builds MaxText's step at matmul_precision=default (its default) only"),
    (["--model", "tiny", "num_slices=2", "compile_topology_num_slices=1"],
     "compile_topology_num_slices=1 and num_slices=2 disagree"),
    (["--model", "tiny", "num_slices=0"], "error: num_slices=0 must be a whole number of slices, 1 or more"),
])
def test_maxtext_keys_maxperf_does_not_build_are_one_line_exit_2(capsys, argv, line):
    try:
        code = main(["estimate", "--topology", "v5p-8", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and line in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_every_preset_with_a_maxtext_name_has_its_maxtext_decoder_block():
    from maxperf.spec import maxtext_line, presets

    assert set(maxtext_line.DECODER_BLOCKS) == set(presets.MAXTEXT_NAMES)


def test_maxtexts_scaled_default_model_is_the_scaled_family(capsys):
    assert parse_args(build_parser(), ["estimate", "global_parameter_scale=8", "compile_topology=v5p-8"]).model == \
        "scaled-8"
    assert parse_args(build_parser(), ["compile", "model_name=default", "compile_topology=v5p-8"]).model == "scaled-1"
    assert parse_args(build_parser(), ["estimate", "model_name=deepseek3-671b", "compile_topology=v5p-8"]).model == \
        "deepseek-v3"
    # the same model named twice, by maxperf's name and MaxText's
    assert parse_args(build_parser(), ["estimate", "--model", "deepseek-v3", "model_name=deepseek3-671b",
                                       "compile_topology=v5p-8"]).model == "deepseek-v3"


@pytest.mark.parametrize("argv, line", [
    (["estimate", "model_name=llama9", "compile_topology=v5p-8"], "model_name=llama9 names no model maxperf has; did "
                                                                  "you mean llama3-8b"),
    (["estimate", "--model", "tiny"], "the following arguments are required: --topology (or MaxText's "
                                      "compile_topology=)"),
    (["estimate", "--model", "tiny", "--topology", "v5p-8", "compile_topology=v5p-16"],
     "--topology v5p-8 and compile_topology=v5p-16 disagree: give one"),
    (["estimate", "model_name=llama2-7b", "global_parameter_scale=4", "compile_topology=v5p-8"],
     "global_parameter_scale=4 grows MaxText's default model"),
    (["estimate", "--model", "tiny", "--topology", "v5p-8", "steps_to_run=5"], "unknown override key 'steps_to_run'"),
    # the model, the slice count and the topology are named once: a second naming that disagrees is refused
    (["estimate", "--model", "llama3-8b", "--topology", "v5p-8", "model_name=llama2-7b"],
     "--model llama3-8b and model_name=llama2-7b disagree: give one"),
    (["estimate", "--model", "llama3-8b", "--topology", "v5p-8", "global_parameter_scale=4"],
     "--model llama3-8b and global_parameter_scale=4 disagree: give one"),
    (["estimate", "--model", "tiny", "--topology", "v5p-8", "--num-slices", "2", "num_slices=3"],
     "--num-slices 2 and num_slices=3 disagree: give one"),
    (["estimate", "--topology", "v5p-8", "model_name=llama2-7b", "model_name=llama3-8b"],
     "model_name=llama2-7b and model_name=llama3-8b disagree: give one"),
    # one setting spelled two ways with two values; each named as the user spelled it
    (["estimate", "--model", "tiny", "--topology", "v5p-8", "seq_len=1024", "max_target_length=4096"],
     "seq_len=1024 and max_target_length=4096 set the same seq_len: give one"),
    (["estimate", "--model", "tiny", "--topology", "v5p-8", "ici_fsdp_parallelism=4", "ici_fsdp=2"],
     "ici_fsdp_parallelism=4 and ici_fsdp=2 set the same ici_fsdp: give one"),
])
def test_maxtext_words_maxperf_cannot_take_are_one_line_exit_2(capsys, argv, line):
    try:  # a usage error leaves through argparse (SystemExit), a bad key through main's one line
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and line in err.strip().splitlines()[-1] and "Traceback" not in err


def test_keys_describes_every_key(capsys):
    """Every override key with its config, type, default, bound, MaxText's spellings and a meaning; --json the same."""
    from maxperf.spec import overrides

    code, out, _ = run_main(capsys, "keys", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "maxperf.keys/1"
    rows = {k["key"]: k for k in doc["keys"]}
    assert sorted(rows) == overrides.valid_keys()
    assert all(k["meaning"] and k["type"] and k["config"] in ("model", "train", "parallelism") for k in rows.values())
    assert rows["seq_len"]["maxtext"] == ["max_target_length"] and rows["seq_len"]["bound"] == 1 << 21
    assert rows["ici_stage"]["maxtext"] == ["ici_pipeline_parallelism"] and rows["ici_stage"]["default"] == 1
    assert rows["remat_policy"]["default"] == "full" and "minimal" in rows["remat_policy"]["type"].split("|")
    assert rows["sa_use_fused_bwd_kernel"] == {"key": "sa_use_fused_bwd_kernel", "config": "train", "type": "bool",
                                               "default": False, "bound": None, "maxtext": [],
                                               "meaning": "splash's backward as one kernel instead of two"}
    code, out, _ = run_main(capsys, "keys")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 1 + len(rows)
    assert any(line.startswith("seq_len ") and "(max_target_length)" in line for line in lines)


def test_a_long_phase_says_it_is_still_working(capsys, monkeypatch):
    """XLA's compile can be silent for minutes: while a phase lasts, a line every STILL_RUNNING_S (shortened here)."""
    from maxperf.cli import common

    monkeypatch.setitem(common.STILL_RUNNING_S, "other", 1.0)
    say = common.progress()
    say("compiling")
    time.sleep(2.6)
    say("writing artifacts")
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(PROGRESS + "compiling", lines[0]) and re.fullmatch(PROGRESS + "writing artifacts", lines[-1])
    middle = lines[1:-1]
    assert len(middle) >= 1 and all(re.fullmatch(PROGRESS + r"still working \(\d+ s since the last step above\)", x)
                                    for x in middle), lines


def test_megablox_tiles_by_their_earlier_names_paste_too(capsys):
    """MaxText's v5p benchmark configs (benchmarks/maxtext_v5p_model_configs.py, DeepSeek-V3 on v5p-1024) still set
    the tiles by the names they had before they were split per kernel: accepted as the split ones are."""
    words = ["compile_topology=v5p-8", "model_name=tiny-moe", "per_device_batch_size=1", "seq_len=16",
             "tile_batch_seq=512", "tile_embed_dim=1024", "tile_mlp_dim=1024"]
    code, out, err = run_main(capsys, "estimate", "--json", *words)
    assert code == 0, err
    assert err.splitlines() == [
        "maxperf: note: MaxText's tile_batch_seq, tile_embed_dim, tile_mlp_dim tune its own kernels and collectives; "
        "maxperf compiles jax's kernels and XLA's collectives as they come: not reproduced"]


def test_errors_name_the_key_as_the_user_spelled_it(capsys):
    # MaxText's spellings of maxperf's keys come back in the error as typed, not as maxperf's own names
    code, _, err = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b", "max_target_length=0")
    assert code == 2 and "max_target_length must be >= 1, got 0" in err and "seq_len" not in err
    code, _, err = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b",
                            "ici_context_parallelism=3")
    assert code == 2 and "ici_context_parallelism=3 cannot fill 4 devices" in err and "ici_sequence" not in err
    code, out, _ = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b", "--json",
                            "gradient_accumulation_steps=0")
    assert code == 2 and "gradient_accumulation_steps must be >= 1" in json.loads(out)["error"]
    # maxperf's own spelling stays its own
    code, _, err = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b", "seq_len=0")
    assert code == 2 and "seq_len must be >= 1, got 0" in err


def test_options_and_keys_that_would_change_nothing_are_said(capsys, tmp_path):
    """A window on a model none of whose layers reads one is noted; --out (or --keep-executables) with
    --analytical-only, which compiles nothing to keep, is refused in one line and nothing is written."""
    code, _, err = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b", "window=100")
    assert code == 0 and "window=100 (sliding_window_size)" in err and "it changes nothing" in err
    code, _, err = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b", "window=100",
                            "attention_type=local_sliding")
    assert code == 0 and "window=100" not in err
    out = tmp_path / "kept"
    for extra in (["--out", str(out)], ["--keep-executables"]):
        code, _, err = run_main(capsys, "estimate-memory", "--analytical-only", "--topology", "v5p-8", "--model",
                                "llama2-7b", *extra)
        assert code == 2 and "--analytical-only compiles nothing" in err and not out.exists()


def test_a_key_given_again_takes_its_last_value_and_two_spellings_that_agree_stand(capsys):
    for words, batch in ((["per_device_batch_size=2", "per_device_batch_size=3"], "global batch     12 x 1024"),
                         (["seq_len=1024", "max_target_length=1024"], "global batch     4 x 1024")):
        code, out, _ = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b", "seq_len=1024",
                                *words)
        assert code == 0 and batch in out


def test_maxtexts_default_model_is_scaled_1_by_either_spelling(capsys):
    for words in (["--model", "default"], ["model_name=default"], ["--model", "scaled-1", "model_name=default"]):
        code, out, _ = run_main(capsys, "estimate", "--topology", "v5p-8", *words)
        assert code == 0 and out.startswith("scaled-1 on v5p-8")
    with pytest.raises(SystemExit):  # another model named by --model: refused, not replaced
        run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "llama2-7b", "model_name=default")
    assert "--model llama2-7b and model_name=default disagree: give one" in capsys.readouterr().err


def test_a_mistake_in_the_words_content_is_one_line_without_usage():
    from cli_util import maxperf

    for words, message in ((["dropout_rate=0.1"], "dropout_rate=0.1: maxperf's steps have no dropout"),
                           (["num_slices=2", "--num-slices", "3"], "--num-slices 3 and")):
        proc = maxperf("estimate", "--topology", "v5p-8", "--model", "llama2-7b", *words)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "usage:" not in proc.stderr
        assert proc.stderr.startswith("maxperf: error: ") and message in proc.stderr


def test_an_unknown_name_with_no_close_one_points_to_the_whole_catalog(capsys):
    code, _, err = run_main(capsys, "estimate", "--topology", "v5p-8", "--model", "nosuchxx")
    assert code == 2 and "unknown model 'nosuchxx'; valid: " in err and "more (`maxperf models` lists them)" in err
    code, _, err = run_main(capsys, "cache", "clear", "--older-than", "nan")
    assert code == 2 and "--older-than takes days, 0 or more, got nan" in err


def test_maxtexts_serving_keys_at_their_defaults_paste_and_other_values_are_refused(capsys):
    """MaxText's inference keys of features maxperf's serving steps do not build are taken at base.yml's default
    (named once as ignored) and refused at any other value, one line, exit 2."""
    words = ["estimate", "--step", "decode", "model_name=llama3-8b", "compile_topology=v5e-8",
             "ici_tensor_parallelism=8"]
    defaults = ["ici_autoregressive_parallelism=1", "checkpoint_is_quantized=false", "ar_cache_axis_order=1,2,0,3",
                "prefill_cache_axis_order=1,2,0,3", "compute_axis_order=0,1,2,3", "reshape_q=false",
                "model_call_mode=", "decode_sampling_strategy=greedy", "inference_server=MaxtextInterleavedServer"]
    assert main([*words, *defaults]) == 0
    err = capsys.readouterr().err
    assert "ici_autoregressive_parallelism" in err and "change nothing of the step: ignored" in err
    with pytest.raises(SystemExit) as refused:  # refused as the words are parsed
        main([*words, "ici_autoregressive_parallelism=2"])
    assert refused.value.code == 2
    assert "at ici_autoregressive_parallelism=1 (its default) only" in capsys.readouterr().err
    # a quantized checkpoint gives the int8 weights the step holds: the same step, with the precision it needs
    assert main([*words, "quantization=int8", "checkpoint_is_quantized=True"]) == 0
    assert "checkpoint_is_quantized" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*words, "checkpoint_is_quantized=True"])
    assert "checkpoint_is_quantized=True reads int8 or fp8 weights: give quantization=int8" in capsys.readouterr().err


def test_maxtexts_training_keys_at_their_defaults_paste_and_other_values_are_refused(capsys):
    words = ["estimate", "model_name=llama2-7b", "compile_topology=v5p-8"]
    defaults = ["context_parallel_strategy=all_gather", "ici_tensor_sequence_parallelism=1",
                "dcn_tensor_sequence_parallelism=1", "enable_padding_causal_mask=true",
                "inhomogeneous_layer_cycle_interval=1"]
    assert main([*words, *defaults]) == 0
    err = capsys.readouterr().err
    assert all(w.partition("=")[0] in err for w in defaults) and "change nothing of the step: ignored" in err
    for word in ("context_parallel_strategy=ring", "ici_tensor_sequence_parallelism=2"):
        with pytest.raises(SystemExit) as refused:
            main([*words, word])
        assert refused.value.code == 2 and "(its default) only" in capsys.readouterr().err


def test_the_catalog_gives_a_cpu_device_its_share_of_host_memory(capsys):
    """compile and run count a CPU device's memory as its share of the host's: the catalog says the same (before, every
    cpu-N showed the whole host's memory and a bf16 peak of 0)."""
    code, out, _ = run_main(capsys, "topologies", "--platform", "cpu")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("cpu-")}
    assert code == 0 and float(rows["cpu-1"][4]) == pytest.approx(2 * float(rows["cpu-2"][4]), abs=0.02)
    assert rows["cpu-4"][6] == "-"
    code, out, _ = run_main(capsys, "topologies", "--platform", "cpu", "--json")  # the JSON as the text
    shares = {t["name"]: t["hbm_bytes_per_device"] / 2**30 for t in json.loads(out)}
    assert shares["cpu-2"] == pytest.approx(float(rows["cpu-2"][4]), abs=0.01)


def test_an_interruption_after_a_sigterm_is_told_as_sigterm_however_a_library_rethrew_it():
    """Ray's waits turn the Terminated that SIGTERM raises into a plain KeyboardInterrupt: the command still says
    SIGTERM and exits 143 (it said SIGINT, 130); a later Ctrl-C is SIGINT again."""
    from maxperf.spec.errors import Terminated, was_terminated

    try:
        try:
            raise Terminated()
        except Terminated:
            raise KeyboardInterrupt from None  # what the library let through
    except KeyboardInterrupt as e:
        assert was_terminated(e)
    assert not was_terminated(KeyboardInterrupt())


def test_a_compiled_sweep_of_cpu_devices_in_several_processes_is_refused_before_work(capsys, tmp_path):
    """cpu-1x2 compiles only in two processes joined by jax.distributed: a compiled sweep refuses it before any work
    (each point failed in its worker), an analytical one estimates it."""
    code, _, err = run_main(capsys, "sweep", "--model", "tiny", "--topologies", "cpu-1x2", "--out",
                            str(tmp_path / "s"))
    assert code == 2 and "2 processes joined by jax.distributed" in err and not (tmp_path / "s").exists()
    code, _, _ = run_main(capsys, "sweep", "--model", "tiny", "--topologies", "cpu-1x2", "--analytical-only",
                          "--out", str(tmp_path / "a"))
    assert code == 0
