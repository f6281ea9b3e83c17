"""Nothing of the user's is lost by writing: only an earlier output of the same command is replaced or written into
(holding nothing else, or anything with `--force`); anything else is refused before any work with one line and exit
2, by every command that writes; one writer at a time; an interrupted run or sweep keeps what it measured."""

import csv
import json
import os
import shutil
import signal
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


@pytest.mark.parametrize("out, checkpoint, said", [
    ("r", "r/ck", "holds"), ("r", "r", "which this run uses"), ("r/sub", "r", "lies inside --checkpoint")])
def test_a_checkpoint_inside_the_output_or_around_it_is_refused_before_the_first_step(compiled, tmp_path, out,
                                                                                      checkpoint, said):
    proc = maxperf("run", str(compiled), "--steps", "1", "--warmup", "0", "--out", str(tmp_path / out),
                   "--checkpoint", str(tmp_path / checkpoint))
    err = _one_line_refusal(proc)
    assert said in err and "step 1" not in err and "loading" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written: no checkpoint, no half output


@pytest.mark.parametrize("option, said", [("--restore", "is not a checkpoint directory"), ("--data", "is not a file")])
def test_a_missing_input_is_refused_before_the_executable_loads(compiled, tmp_path, option, said):
    proc = maxperf("run", str(compiled), "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "r"), option,
                   str(tmp_path / "absent"))
    err = _one_line_refusal(proc)
    assert said in err and "loading" not in err and not (tmp_path / "r").exists()


def test_a_data_file_of_the_wrong_rows_is_refused_before_the_executable_loads(compiled, tmp_path):
    import numpy as np

    np.save(tmp_path / "short_rows.npy", np.zeros((4, 10), dtype=np.int32))
    proc = maxperf("run", str(compiled), "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "r"), "--data",
                   str(tmp_path / "short_rows.npy"))
    err = _one_line_refusal(proc)
    assert "need rows of at least L+1" in err and "loading" not in err and not (tmp_path / "r").exists()


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


@pytest.mark.slow
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


# --force replaces only an earlier output of the same command (issue 28, item 1)


def _one_line_refusal(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    return proc.stderr


def test_force_never_replaces_a_users_directory(tmp_path):
    repo = tmp_path / "myproject"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "train.py").write_text("print('mine')\n")
    err = _one_line_refusal(maxperf("compile", "--topology", "cpu-8", "--model", "tiny", *TINY, "--out", str(repo),
                                    "--force"))
    assert "did not write" in err and "--force" not in err  # no advice to do what --force may not do
    assert (repo / ".git" / "HEAD").is_file() and (repo / "train.py").read_text() == "print('mine')\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["myproject"]


def test_force_never_replaces_the_runs_own_input(compiled, tmp_path):
    files = sorted(p.name for p in compiled.iterdir())
    err = _one_line_refusal(maxperf("run", str(compiled), "--steps", "1", "--warmup", "0", "--out", str(compiled),
                                    "--force"))
    assert "--force" not in err
    assert sorted(p.name for p in compiled.iterdir()) == files and (compiled / "compiled.pkl").is_file()
    # an earlier run's output that holds the artifact run now: --force would delete what it runs
    out = tmp_path / "r"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"schema": runner.RUN_SCHEMA}))
    shutil.copytree(compiled, out / "art", ignore=shutil.ignore_patterns("run"))
    with pytest.raises(OutputRefused, match="which this run uses"):
        runner.run(out / "art", steps=1, warmup=0, out=out, force=True)
    assert (out / "art" / "compiled.pkl").is_file() and (out / "run.json").is_file()
    with pytest.raises(OutputRefused, match="did not write; give a new directory$"):
        aot.compile("cpu-8", "tiny", TINY, out=out, force=True)  # a run's output is not a compile's
    assert (out / "run.json").is_file()


# every command that writes checks its destination by the same rule, before any work (item 2)


def _users_table(path):
    path.mkdir()
    (path / "results.csv").write_text("mine,1\n")
    (path / "sweep.json").write_text('{"mine": true}\n')
    return path


def test_a_sweep_refuses_a_users_tables_and_a_compile_artifact_before_any_work(compiled, tmp_path):
    from maxperf.search.sweep import sweep

    said = []
    for out in (_users_table(tmp_path / "mine"), compiled):
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        with pytest.raises(OutputRefused, match="did not write; give a new directory$"):
            sweep("tiny", ["cpu-1", "cpu-2"], analytical_only=True, out=out, workers=1, progress=said.append)
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing added or changed
    assert said == []  # refused before it started
    err = _one_line_refusal(maxperf("sweep", "--model", "tiny", "--topologies", "cpu-1", "--analytical-only",
                                    "--out", str(tmp_path / "mine")))
    assert "--force" not in err and (tmp_path / "mine" / "results.csv").read_text() == "mine,1\n"


def test_plan_refuses_a_users_folder_before_the_search_and_reuses_its_own(tmp_path):
    mine = _user_dir(tmp_path / "mine")
    err = _one_line_refusal(maxperf("plan", "--model", "tiny", "--topology", "cpu-2", "--verify", "0", "--out",
                                    str(mine), "seq_len=64"))
    assert "did not write" in err and "estimated" not in err and _intact(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "old_runs"]
    for _ in range(2):  # its own earlier output is written again
        proc = maxperf("plan", "--model", "tiny", "--topology", "cpu-2", "--verify", "0", "--out",
                       str(tmp_path / "p"), "seq_len=64")
        assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "p"]


def test_report_replaces_only_an_earlier_report(compiled, tmp_path):
    from maxperf.reports.render import render

    afile = tmp_path / "afile"
    afile.write_text("my notes")
    with pytest.raises(OutputRefused, match="did not write; give a new file name"):
        render([compiled], afile)
    assert afile.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    page = tmp_path / "r.html"
    render([compiled], page)
    render([compiled], page)  # an earlier report, and its tables, are replaced
    (tmp_path / "r_files" / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match=r"r_files holds files maxperf report did not write \(notes.txt\)"):
        render([compiled], page)
    assert (tmp_path / "r_files" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "r.html", "r_files"]


# one writer at a time (item 3)


def test_a_second_writer_of_the_same_output_is_refused_at_once(compiled, tmp_path):
    from maxperf.search.sweep import sweep

    out = tmp_path / "art"
    with artifacts.OutputLock(out):  # another maxperf writing there
        with pytest.raises(OutputRefused, match="another maxperf is writing there"):
            aot.compile("cpu-8", "tiny", TINY, out=out)
        with pytest.raises(OutputRefused, match="another maxperf is writing there"):
            sweep("tiny", ["cpu-1"], analytical_only=True, out=out, workers=1)
        err = _one_line_refusal(maxperf("compile", "--topology", "cpu-8", "--model", "tiny", *TINY, "--out",
                                        str(out)))
        assert f"--out {out}: another maxperf is writing there" in err
        assert not out.exists()
    aot.compile("cpu-8", "tiny", TINY, out=out)  # once it is done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # and no lock file is left


# an interrupted run or sweep keeps what it measured, and says so consistently (item 4)


def test_an_interrupted_run_keeps_its_timed_steps(compiled, tmp_path):
    def interrupt_at_step_3(line):  # Ctrl-C, as the step loop sees it
        if line.startswith("step 3:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run(compiled, steps=50, warmup=1, out=tmp_path / "r", progress=interrupt_at_step_3)
    data = json.loads((tmp_path / "r" / "run.json").read_text())
    assert data["partial"] is True and data["steps"] == 3
    assert len(data["step_times_s"]) == len(data["losses"]) == 3
    assert data["step_time_s"] > 0 and "interrupted after 3 of 50 timed steps" in data["notes"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


@pytest.mark.slow
@pytest.mark.parametrize("signum, twice", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-twice"])
def test_a_signal_keeps_what_the_run_measured(compiled, tmp_path, signum, twice):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "maxperf.cli", "run", str(compiled), "--steps", "100000",
                             "--warmup", "1", "--out", str(tmp_path / "out")], stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    for line in proc.stderr:
        if "] step 2:" in line:
            break
    if twice:  # `timeout -s INT` signals the command and then its process group: one interrupt, delivered twice
        os.kill(proc.pid, signum)
    os.killpg(proc.pid, signum)  # the command and its child, as Ctrl-C or a job scheduler does
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signum, rest
    data = json.loads((tmp_path / "out" / "run.json").read_text())
    assert data["partial"] is True and data["steps"] >= 2 and len(data["step_times_s"]) == data["steps"]
    assert f"timed steps: {tmp_path / 'out'}/run.json keeps them, marked partial" in rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_interrupted_sweep_rewrites_its_tables_from_its_points(tmp_path):
    from maxperf.search.sweep import SweepInterrupted, sweep

    out = tmp_path / "s"
    sweep("tiny", ["cpu-1", "cpu-2"], analytical_only=True, out=out, workers=1)
    # a point folder a killed compile left with only its temporary directory in it
    (out / "points" / "cpu-8" / ".artifact.abcd1234.partial").mkdir(parents=True)

    def interrupt(line):
        if line.startswith("[1/"):
            raise KeyboardInterrupt

    with pytest.raises(SweepInterrupted):
        sweep("tiny", ["cpu-1", "cpu-2", "cpu-4", "cpu-8"], analytical_only=True, out=out, workers=1,
              progress=interrupt)
    finished = sorted(p.parent.name for p in out.glob("points/*/point.json"))
    assert len(finished) >= 3
    with open(out / "results.csv") as f:
        assert sorted(row["point"] for row in csv.DictReader(f)) == finished
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["points"] == len(finished) and summary["partial"] == (len(finished) < 4)
    assert all(any(d.iterdir()) for d in (out / "points").iterdir())  # no empty point folder
    resumed = sweep("tiny", ["cpu-1", "cpu-2", "cpu-4", "cpu-8"], analytical_only=True, out=out, workers=1)
    assert resumed.computed == 4 - len(finished) and len(resumed.rows) == 4


# profile.files names the trace where the run put it (item 7)


def test_profile_files_are_in_the_output_directory(compiled, tmp_path):
    result = runner.run(compiled, steps=1, warmup=0, profile=True, out=tmp_path / "p")
    files = json.loads((tmp_path / "p" / "run.json").read_text())["profile"]["files"]
    assert files and files == result.profile["files"]
    assert all(f.startswith(str(tmp_path / "p" / "trace") + os.sep) and os.path.isfile(f) for f in files)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700), (0o002, 0o775)])
def test_an_output_directory_takes_the_users_umask(tmp_path, umask, mode):
    """The artifact is written in a temporary directory renamed into place: it ends with the mode a mkdir would give
    it, not tempfile's 0700."""
    from maxperf.aot import artifacts

    previous = os.umask(umask)
    try:
        writer = artifacts.ArtifactWriter(tmp_path / "out", "compile")
        writer.write_text("a.txt", "x")
        out = writer.commit()
    finally:
        os.umask(previous)
    assert (out.stat().st_mode & 0o777) == mode


def _cached(k: str, size: int, label: str):
    from maxperf.aot import cache

    cache.put(k, cache.Entry(payload=b"x" * size, in_tree="t", out_tree="t", memory={}, xla_cost=None,
                             optimized_hlo="", compile_seconds=1.0, label=label))


def test_the_compile_cache_keeps_to_its_bound_least_recently_used_first(tmp_path, monkeypatch):
    from maxperf.aot import cache

    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("MAXPERF_CACHE_MAX_BYTES", str(2600))  # two entries of 1000 bytes and their meta, not three
    for i, k in enumerate(("a" * 64, "b" * 64)):
        _cached(k, 1000, f"step {i}")
        os.utime(cache.directory() / k / cache.USED, (1000 + i, 1000 + i))
    assert cache.get("a" * 64) is not None  # a hit: "a" is now the most recently used
    _cached("c" * 64, 1000, "step 2")  # past 2600 bytes: "b", used least recently, goes
    assert sorted(e.key[0] for e in cache.entries()) == ["a", "c"]
    assert [e.label for e in cache.entries()][0] == "step 2"


def test_a_damaged_cache_entry_is_a_miss_left_out_of_the_list_and_replaced(tmp_path, monkeypatch):
    """An executable cut short on disk is not served, not listed as an entry, and the next store of its step replaces
    it (before, the damaged entry stayed and the step compiled again every time)."""
    from maxperf.aot import cache

    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path / "c"))
    k = "e" * 64
    _cached(k, 1000, "step")
    with open(cache.directory() / k / "executable.bin", "r+b") as f:
        f.truncate(500)
    assert cache.get(k) is None and cache.entries() == []
    _cached(k, 1000, "step")
    assert cache.get(k) is not None and [e.label for e in cache.entries()] == ["step"]
    assert [p.name for p in cache.directory().iterdir()] == [k]  # nothing set aside is left behind


@pytest.mark.parametrize("text, size", [("2500", 2500), ("5G", 5 << 30), ("512MiB", 512 << 20), ("1.5K", 1536)])
def test_the_cache_bound_takes_bytes_or_binary_units(monkeypatch, text, size):
    from maxperf.aot import cache

    monkeypatch.setenv("MAXPERF_CACHE_MAX_BYTES", text)
    assert cache.max_bytes() == size


@pytest.mark.parametrize("text", ["lots", "inf", "1e400", "nan", "-1"])
def test_a_cache_bound_that_is_not_a_size_is_refused(monkeypatch, text):
    from maxperf.aot import cache
    from maxperf.spec.errors import MaxperfError

    monkeypatch.setenv("MAXPERF_CACHE_MAX_BYTES", text)
    with pytest.raises(MaxperfError, match=f"MAXPERF_CACHE_MAX_BYTES='{text}' is not a size"):
        cache.enabled()


def test_a_cache_entry_whose_meta_is_not_an_object_is_damaged_and_clear_removes_only_the_caches_own(tmp_path,
                                                                                                   monkeypatch):
    """A meta.json of `[]` is a damaged entry: a miss, left out of the list, removed by `cache clear` (it made list,
    clear and compile fail with an AttributeError); clear leaves a directory of the user's (`.git`) alone."""
    from maxperf.aot import cache

    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path / "c"))
    k = "f" * 64
    _cached(k, 100, "step")
    (cache.directory() / k / "meta.json").write_text("[]")
    (cache.directory() / ".git").mkdir()
    (cache.directory() / ".git" / "HEAD").write_text("ref")
    assert cache.get(k) is None and cache.entries() == []
    cache.clear()
    assert sorted(p.name for p in cache.directory().iterdir()) == [".git"]


def test_maxperf_cache_sizes_lists_and_clears(tmp_path, monkeypatch, capsys):
    from maxperf.cli import main

    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path / "c"))
    _cached("d" * 64, 2 << 20, "tiny on cpu-2")
    assert main(["cache", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "maxperf.cache/1" and [e["label"] for e in doc["entries"]] == ["tiny on cpu-2"]
    assert doc["bytes"] > 2 << 20 and doc["max_bytes"] == 10 << 30
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "1 entries, 2.0 MiB" in out and "dddddddddddddddd" in out and "tiny on cpu-2" in out
    assert main(["cache", "clear", "--older-than", "1"]) == 0  # used just now: kept
    assert "removed 0 entries" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries (2.0 MiB)" in capsys.readouterr().out
    assert main(["cache", "list", "--older-than", "1"]) == 2
    assert capsys.readouterr().err.strip() == "maxperf: error: --older-than is for `maxperf cache clear`"


def test_a_plan_directory_is_told_by_the_schema_its_plan_json_opens_with(tmp_path):
    # plan.json holds every candidate (tens of MB): its schema is read from its first bytes where it opens with it,
    # the whole file parsed only where it does not
    for name, text, ours in (("plan", '{"schema":"maxperf.plan/2","candidates":[' + "{}," * 1000 + "{}]}", True),
                             ("spaced", '{ "schema": "maxperf.plan/1", "x": 1}', True),
                             ("sweep", '{"schema":"maxperf.sweep/1"}', False),
                             ("later", '{"mine": true, "schema": "maxperf.plan/2"}', True),
                             ("truncated", '{"schema":"maxperf.pl', False),
                             ("users", '{"mine": true}', False)):
        out = tmp_path / name
        out.mkdir()
        (out / "plan.json").write_text(text)
        if ours:
            artifacts.claim_output(out, "plan")
        else:
            with pytest.raises(OutputRefused, match="did not write; give a new directory$"):
                artifacts.claim_output(out, "plan")


def test_a_run_writes_beside_its_artifact_or_in_its_run_directory_only(tmp_path):
    """`run a1 --out a1/sub` wrote into the compile's directory, which a later compile to a1 then refused; the run's
    default, a1/run, and any directory beside a1 stay allowed."""
    from maxperf.profiler.run import refuse_inside_artifact
    from maxperf.spec.errors import MaxperfError

    artifact = tmp_path / "a1"
    artifact.mkdir()
    for allowed in (artifact / "run", tmp_path / "a1-run", tmp_path / "elsewhere" / "r"):
        refuse_inside_artifact(allowed, artifact)
    for refused in (artifact / "sub", artifact / "run" / "deeper", artifact):
        with pytest.raises(MaxperfError, match="lies inside the compile artifact"):
            refuse_inside_artifact(refused, artifact)


def test_a_report_given_a_directory_suggests_a_file_beside_it(tmp_path):
    from maxperf.aot import artifacts

    (tmp_path / "a1").mkdir()
    with pytest.raises(artifacts.OutputRefused, match=r"e\.g\. -o .*a1\.html \(beside it, not inside"):
        artifacts.claim_output(tmp_path / "a1", "report")


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_in_one_short_line(compiled, tmp_path):
    """A checkpoint missing part of its arrays: one line that says it is damaged or another model's, with orbax's
    reason cut short (its tensorstore error ran to 2,500 characters), exit 2, nothing written."""
    import shutil

    runner.run(compiled, steps=1, warmup=0, out=tmp_path / "r", checkpoint=tmp_path / "ck")
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "ck", damaged)
    arrays = [p for p in damaged.iterdir() if p.is_dir()]
    assert arrays
    for p in arrays:
        shutil.rmtree(p)
    proc = maxperf("run", str(compiled), "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "r2"),
                   "--restore", str(damaged))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]  # after the progress lines of loading
    assert err.startswith("maxperf: error:") and "is damaged" in err and len(err) < 700
    assert not (tmp_path / "r2").exists()
