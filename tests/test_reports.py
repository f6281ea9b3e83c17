"""`maxperf sweep` and `maxperf report`: resumable sweeps, and self-contained HTML that a browser opens cleanly."""

import csv
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from reports_browser import CHROMIUM, check_in_chromium

from maxperf import aot
from maxperf.aot.artifacts import ArtifactError
from maxperf.reports import render
from maxperf.reports.page import percent
from maxperf.search.sweep import sweep
from maxperf.spec.errors import MaxperfError

TOPOLOGIES = ["v5p-8", "v5p-16", "v5p-32", "v5p-64"]


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.svgs, self.labelled_svgs, self.refs, self.open = [], 0, 0, [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "svg":
            self.svgs += 1
            self.labelled_svgs += bool(attrs.get("aria-label")) and attrs.get("role") == "img"
        for key in ("src", "href", "xlink:href"):
            if attrs.get(key):
                self.refs.append(attrs[key])


def parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    page.close()
    return page


def assert_self_contained(path: Path) -> _Page:
    text = path.read_text()
    page = parse(path)
    assert "script" not in page.tags and "link" not in page.tags and "img" not in page.tags
    assert not re.search(r"(https?:)?//[A-Za-z0-9]", text.replace("<!doctype", "")), "a URL in the page"
    for ref in page.refs:
        assert ref.startswith("#") or (path.parent / ref).is_file(), ref
    return page


@pytest.fixture(scope="module")
def analytical_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "s"
    return sweep("llama2-7b", TOPOLOGIES, axes={"per_device_batch_size": ["1", "2"]}, analytical_only=True,
                 out=out, workers=1)


def test_sweep_writes_a_row_per_point_and_tables(analytical_sweep):
    import pandas as pd

    assert len(analytical_sweep.rows) == 8 and all(r["status"] == "ok" for r in analytical_sweep.rows)
    frame = pd.read_parquet(analytical_sweep.out_dir / "results.parquet")
    assert len(frame) == 8 and set(frame["chips"]) == {4, 8, 16, 32}
    assert len(pd.read_csv(analytical_sweep.out_dir / "results.csv")) == 8
    assert (frame["predicted_step_time_s"] > 0).all()


def test_a_sweep_resumes_where_it_stopped(analytical_sweep, tmp_path):
    out = tmp_path / "resume"
    shutil.copytree(analytical_sweep.out_dir, out)
    (out / "points" / "v5p-16_per_device_batch_size=2" / "point.json").unlink()
    again = sweep("llama2-7b", TOPOLOGIES, axes={"per_device_batch_size": ["1", "2"]}, analytical_only=True, out=out,
                  workers=1)
    assert again.computed == 1 and len(again.rows) == 8


def test_a_sweep_over_part_of_its_grid_keeps_every_point_in_its_tables(analytical_sweep, tmp_path):
    """A sweep run again into its directory over fewer points (one topology, one value) computes nothing new and its
    tables still list every point the directory holds, as points/ does."""
    import pandas as pd

    out = tmp_path / "part"
    shutil.copytree(analytical_sweep.out_dir, out)
    again = sweep("llama2-7b", ["v5p-8"], axes={"per_device_batch_size": ["1"]}, analytical_only=True, out=out,
                  workers=1)
    assert again.computed == 0 and len(again.rows) == 1  # this request's point; the tables hold all of them
    assert len(pd.read_csv(out / "results.csv")) == len(list((out / "points").iterdir())) == 8
    assert json.loads((out / "sweep.json").read_text())["points"] == 8


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    result = sweep("llama2-70b", ["v5p-8", "v5p-128"], analytical_only=True, out=tmp_path / "f", workers=1)
    by_topology = {r["topology"]: r for r in result.rows}
    assert by_topology["v5p-8"]["status"] == "does not fit" and by_topology["v5p-8"]["reason"]
    assert by_topology["v5p-128"]["status"] == "ok"


def test_bad_sweeps_are_errors(tmp_path):
    with pytest.raises(MaxperfError, match="did you mean"):
        sweep("llama2-7b", ["v5p-9"], analytical_only=True, out=tmp_path / "x")
    with pytest.raises(MaxperfError, match="empty"):
        sweep("llama2-7b", [], analytical_only=True, out=tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    a = aot.compile("cpu-8", "tiny", ["seq_len=64"], out=d / "a").out_dir
    b = aot.compile("cpu-8", "tiny", ["seq_len=64", "remat_policy=none"], out=d / "b").out_dir
    return a, b


def test_scaling_report(analytical_sweep, tmp_path):
    result = render([analytical_sweep.out_dir], tmp_path / "scaling.html", command=["maxperf", "report"])
    page = assert_self_contained(result.html_path)
    assert page.svgs == 5 and page.labelled_svgs == 5
    text = result.html_path.read_text()
    assert "weak-scaling efficiency" in text and "(CSV)" in text
    assert all(p.is_file() for p in result.csv_paths)
    points = next(p for p in result.csv_paths if p.name.endswith("all-points.csv"))
    with open(points, newline="") as f:
        cells = [cell for row in csv.reader(f) for cell in row]
    assert "nan" not in cells  # an empty reason or warnings cell is empty


def test_mfu_and_comparison_report(compiled, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    predicted = json.loads((compiled[0] / "estimate.json").read_text())["step_time_s"]  # what the run was set against
    (run_dir / "run.json").write_text(json.dumps({
        "schema": "maxperf.run/1", "artifact": str(compiled[0]), "steps": 2, "devices": 8, "device_kind": "cpu",
        "step_times_s": [2 * predicted] * 2, "step_time_s": 2 * predicted, "predicted_step_time_s": predicted,
        "measured_over_predicted": 2.0, "tflops_per_device": 0.001, "mfu": 0.2,
        "memory": {"measured_peak_bytes": None}}))
    result = render([compiled[0], compiled[1], run_dir], tmp_path / "mfu.html", command=["maxperf", "report"])
    page = assert_self_contained(result.html_path)
    # the time breakdown, the HLO-derived time by kind and memory, for each of three; step times
    assert page.svgs == 11 and page.labelled_svgs == 11  # and the run's steps one by one
    text = result.html_path.read_text()
    assert "measured against predicted" in text and "side by side" in text and "★" in text
    assert "step time read from the compiled program" in text and "instructions taking the most time" in text
    assert "jax" in text and "maxperf report" in text


def test_report_errors(tmp_path):
    with pytest.raises(MaxperfError, match="not a maxperf"):
        render([tmp_path], tmp_path / "r.html")
    with pytest.raises(MaxperfError, match="does not exist"):
        render([tmp_path / "missing"], tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def _report_cli(capsys, *argv):
    from maxperf.cli import main

    code = main(["report", *map(str, argv)])
    return code, capsys.readouterr().err


def test_report_to_an_existing_directory_is_one_line_and_leaves_nothing(compiled, tmp_path, capsys):
    target = tmp_path / "out"
    target.mkdir()
    code, err = _report_cli(capsys, compiled[0], "-o", target)
    assert code == 2 and err.count("\n") == 1 and f"-o {target} is a directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not list(target.iterdir())


def _damaged_copy(compiled, tmp_path, change) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(compiled[0], copy)
    manifest = copy / "manifest.json"
    manifest.write_text(change(manifest.read_text()))
    return copy


@pytest.mark.parametrize("change, message", [
    (lambda text: text[:100], "manifest.json is not valid JSON"),
    (lambda text: json.dumps({**json.loads(text), "files": "oops"}), "'files' should be an object"),
    (lambda text: json.dumps({**json.loads(text), "compiled": "yes"}), "'compiled' should be true or false"),
    (lambda text: "[1, 2]", "holds a JSON list"),
], ids=["truncated", "files", "compiled", "list"])
def test_a_damaged_manifest_is_one_line_and_exit_2(compiled, tmp_path, capsys, change, message):
    damaged = _damaged_copy(compiled, tmp_path, change)
    code, err = _report_cli(capsys, damaged, "-o", tmp_path / "r.html")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    with pytest.raises(ArtifactError, match=re.escape(message)):
        aot.load(damaged)
    assert not list(tmp_path.glob("*.html")) and not list(tmp_path.glob(".*"))


def test_a_damaged_sweep_table_is_an_error(analytical_sweep, tmp_path):
    copy = tmp_path / "s"
    shutil.copytree(analytical_sweep.out_dir, copy)
    (copy / "results.csv").write_text('point,status\n"unterminated')
    with pytest.raises(MaxperfError, match="results.csv is not a readable table"):
        render([copy], tmp_path / "r.html")
    (copy / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(MaxperfError, match="lacks a sweep's columns"):
        render([copy], tmp_path / "r.html")
    # cut short: a header and part of a row, or the header alone, where sweep.json counts every point
    whole = (analytical_sweep.out_dir / "results.csv").read_text()
    for cut in (whole[:whole.index("\n") + 40], whole[:whole.index("\n") + 1]):
        (copy / "results.csv").write_text(cut)
        with pytest.raises(MaxperfError, match="the table is damaged; run the sweep again"):
            render([copy], tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.slow
def test_a_small_compiled_sweep(tmp_path):
    result = sweep("tiny", ["v5p-8", "v5p-16"], axes={"seq_len": ["128"]}, out=tmp_path / "c", workers=1)
    assert all(r["status"] == "ok" and r["compiler_memory_bytes"] > 0 for r in result.rows)
    assert all((Path(r["artifact"]) / "compiled.pkl").is_file() for r in result.rows)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_reports_open_in_headless_chromium(analytical_sweep, compiled, tmp_path):
    mixed = sweep("llama2-7b", ["v5p-8", "v5p-16", "v5e-16", "h100-8"], axes={"per_device_batch_size": ["1", "2"]},
                  analytical_only=True, out=tmp_path / "mixed", workers=1)
    h100 = tmp_path / "h100"
    h100.mkdir()
    shutil.copy(Path(__file__).parent / "fixtures" / "h100_profiled_run.json", h100 / "run.json")
    for name, paths in (("scaling", [analytical_sweep.out_dir, mixed.out_dir]), ("compare", list(compiled)),
                        ("h100", [h100])):
        check_in_chromium(render(paths, tmp_path / f"{name}.html").html_path, tmp_path)


@pytest.mark.slow
def test_a_killed_sweep_resumes_where_it_stopped(tmp_path):
    import signal
    import time

    out = tmp_path / "killed"
    args = [sys.executable, "-m", "maxperf.cli", "sweep", "--model", "tiny", "--topologies", "v5p-8,v5p-16,v5p-32",
            "--out", str(out), "--workers", "1", "seq_len=128"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(out.glob("points/*/point.json")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = len(list(out.glob("points/*/point.json")))
    assert 1 <= finished < 3 and not (out / "results.csv").exists()
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"{finished} already done, {3 - finished} to run" in again.stderr
    assert len(list(out.glob("points/*/point.json"))) == 3 and (out / "results.csv").is_file()


# report refuses what `run` refuses: altered or truncated artifacts, damaged run directories (issue 28, item 5)


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("damage, message", [
    (lambda d: _edit_json(d / "estimate.json", step_time_s=0.001), "estimate.json does not match the sha256"),
    (lambda d: (d / "compiled.pkl").write_bytes((d / "compiled.pkl").read_bytes()[:1000]),
     "compiled.pkl does not match the sha256"),
    (lambda d: (d / "memory.json").unlink(), "memory.json is missing"),
], ids=["edited", "truncated", "missing"])
def test_report_refuses_an_artifact_that_run_refuses(compiled, tmp_path, capsys, damage, message):
    tampered = tmp_path / "tampered"
    shutil.copytree(compiled[0], tampered)
    damage(tampered)
    with pytest.raises(ArtifactError, match=message):
        aot.load(tampered)
    run_dir = tmp_path / "run"  # a run of the tampered compile: the same refusal
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"schema": "maxperf.run/1", "artifact": str(tampered), "steps": 1,
                                                  "devices": 8, "device_kind": "cpu", "step_times_s": [0.1],
                                                  "step_time_s": 0.1}))
    for given in (tampered, tampered / "compiled.pkl", run_dir):
        code, err = _report_cli(capsys, given, "-o", tmp_path / "r.html")
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not list(tmp_path.glob("*.html")) and not list(tmp_path.glob("r_files"))


@pytest.mark.parametrize("change, message", [
    (lambda text: text[:200], "run.json is not readable JSON"),
    (lambda text: json.dumps({**json.loads(text), "schema": "maxperf.sweep/1"}), 'schema "maxperf.sweep/1", not '
                                                                                  "maxperf.run/1"),
    (lambda text: json.dumps({**json.loads(text), "step_time_s": "fast"}), "'step_time_s' should be a number >= 0"),
    (lambda text: json.dumps({**json.loads(text), "mfu": -0.5}), "'mfu' should be a number >= 0"),
    (lambda text: json.dumps({**json.loads(text), "losses": [10.7, "x"]}), "'losses' should be a list of numbers"),
    (lambda text: json.dumps({**json.loads(text), "memory": [1]}), "'memory' should be an object"),
    (lambda text: json.dumps({**json.loads(text), "artifact": 5}), "'artifact' should be a string"),
    (lambda text: json.dumps({"schema": "maxperf.run/1"}), "lacks steps, devices, device_kind, step_times_s"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "device_kind"}),
     "lacks device_kind, which every run writes"),
    (lambda text: json.dumps({**json.loads(text), "step_times_s": [0.3, -0.3, 0.3, 0.3, 0.3]}),
     "'step_times_s' should be a list of numbers >= 0"),
    (lambda text: json.dumps({**json.loads(text), "steps": 2}), "lists 5 step times for its 2 timed steps"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "step_time_s"}),
     "lacks step_time_s, the median of its 5 step times"),
], ids=["truncated", "schema", "step-time", "mfu", "losses", "memory", "artifact", "empty", "no-device",
        "negative-time", "count", "no-median"])
def test_a_damaged_run_json_is_one_line_and_exit_2(tmp_path, capsys, change, message):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    text = (Path(__file__).parent / "fixtures" / "h100_profiled_run.json").read_text()
    (run_dir / "run.json").write_text(change(text))
    code, err = _report_cli(capsys, run_dir, "-o", tmp_path / "r.html")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "r.html").exists()


def test_a_run_beside_another_compile_in_its_directory_shows_what_was_measured_only(compiled, tmp_path, capsys):
    """A compile written into the directory a run ran after it ran (run.json's artifact_sha256 is not the manifest's
    compiled.pkl) is not set beside the run: the page shows the measurement alone and says why."""
    art = compiled[0]
    manifest = json.loads((art / "manifest.json").read_text())
    base = {"schema": "maxperf.run/1", "artifact": str(art), "steps": 2, "devices": 8, "device_kind": "cpu",
            "step_times_s": [0.02, 0.02], "step_time_s": 0.02}
    pages = {}
    for name, sha in (("same", manifest["files"]["compiled.pkl"]), ("other", "0" * 64)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "run.json").write_text(json.dumps({**base, "artifact_sha256": sha}))
        code, err = _report_cli(capsys, run_dir, "-o", tmp_path / f"{name}.html")
        assert code == 0, err
        pages[name] = (tmp_path / f"{name}.html").read_text()
    assert "holds another compile now" in pages["other"] and "holds another compile now" not in pages["same"]
    assert "tiny / " in pages["same"] and "tiny / " not in pages["other"]


def test_a_run_whose_compile_predicts_anew_shows_its_own_prediction_and_one_peaks_mfu(compiled, tmp_path, capsys):
    """The same executable compiled again into a run's directory (a compile-cache hit under another calibration)
    predicts another step time: the page shows the run's own prediction, not the new estimate's figures beside it
    (it divided one by the other's ratio); and the predicted MFU, in the headline as in the table, is taken on the
    run's peak where the run measured on another (it set 23.5% predicted beside 6.1% measured for a step that ran as
    predicted)."""
    art = compiled[0]
    manifest = json.loads((art / "manifest.json").read_text())
    estimate = json.loads((art / "estimate.json").read_text())
    predicted = estimate["step_time_s"]
    base = {"schema": "maxperf.run/1", "artifact": str(art), "steps": 2, "devices": 8, "device_kind": "cpu",
            "step_times_s": [predicted, predicted], "step_time_s": predicted,
            "artifact_sha256": manifest["files"]["compiled.pkl"], "measured_over_predicted": 1.0}
    pages = {}
    for name, extra in (("restated", {"predicted_step_time_s": predicted * 1.46}),
                        ("peak", {"predicted_step_time_s": predicted, "mfu": estimate["mfu"] / 4,
                                  "peak_flops_per_device": estimate["peak_flops"] * 4})):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "run.json").write_text(json.dumps({**base, **extra}))
        code, err = _report_cli(capsys, run_dir, "-o", tmp_path / f"{name}.html")
        assert code == 0, err
        pages[name] = (tmp_path / f"{name}.html").read_text()
    assert "was compiled again since" in pages["restated"]
    assert "was compiled again since" not in pages["peak"]
    mfu = percent(estimate["mfu"] / 4)
    assert f"MFU {mfu} predicted, {mfu} measured" in pages["peak"]


def test_an_interrupted_run_is_shown_as_partial(tmp_path, capsys):
    """run.json's `partial` (a run stopped before its steps were done) is said in the page's headline and facts."""
    fixture = json.loads((Path(__file__).parent / "fixtures" / "h100_profiled_run.json").read_text())
    pages = {}
    for partial in (False, True):
        run_dir = tmp_path / f"run-{partial}"
        run_dir.mkdir()
        (run_dir / "run.json").write_text(json.dumps({**fixture, "partial": partial}))
        code, err = _report_cli(capsys, run_dir, "-o", tmp_path / f"r-{partial}.html")
        assert code == 0, err
        pages[partial] = (tmp_path / f"r-{partial}.html").read_text()
    assert "PARTIAL: the run was interrupted" in pages[True] and "partial: interrupted after" in pages[True]
    assert "PARTIAL" not in pages[False] and "partial: interrupted" not in pages[False]


def test_a_file_that_marks_no_directory_is_named_as_a_file(tmp_path, capsys):
    stray = tmp_path / "c1.out"
    stray.write_text("not a report input\n")
    code, err = _report_cli(capsys, stray, "-o", tmp_path / "r.html")
    assert code == 2 and f"{stray} is a file, and {tmp_path} is not a maxperf compile, run, sweep or plan" in err
    assert not (tmp_path / "r.html").exists()


def test_a_user_steps_sweep_row_has_no_global_batch_and_counts_its_own_unit(compiled, tmp_path, capsys):
    """A user's step sweeps without a global_batch column (its batch is its own); its run counts images, not
    tokens, and the page's measured-against-predicted table says so."""
    from maxperf.reports.scaling import _Point

    assert _Point({"chips": 4, "predicted_mfu": 0.5}, "predicted_mfu").global_batch == 1.0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({
        "schema": "maxperf.run/1", "artifact": str(compiled[0]), "steps": 1, "devices": 8, "device_kind": "cpu",
        "step_times_s": [0.02], "step_time_s": 0.02, "tokens_per_s": 100.0, "unit": "images"}))
    code, err = _report_cli(capsys, run_dir, "-o", tmp_path / "r.html")
    assert code == 0, err
    page = (tmp_path / "r.html").read_text()
    assert ">images/s<" in page and ">tokens/s<" not in page


def test_scaling_tables_of_a_user_steps_sweep_and_of_cpu_devices():
    """A user's step's sweep has no global batch nor tokens/s: its efficiency table leaves them empty rather than
    failing; and each point's memory limit is its own device's (a CPU device's share of the host shrinks with the
    devices), not the largest of its chip type."""
    import pandas as pd

    from maxperf.reports.page import GIB, Page, Section
    from maxperf.reports.scaling import _efficiency, _memory

    frame = pd.DataFrame({"chip": ["cpu", "cpu"], "settings": ["s", "s"], "label": ["cpu-1", "cpu-2"], "chips": [1, 2],
                          "num_slices": [1, 1], "predicted_step_time_s": [1.0, 0.6], "status": ["ok", "ok"],
                          "hbm_bytes": [24 * GIB, 12 * GIB], "analytical_memory_bytes": [GIB, GIB / 2]})
    page, section = Page(), Section("s", "sweep")
    _efficiency(page, section, frame)
    (rows,) = [t.rows for _, t in section.figures] or [t.rows for t in section.tables]
    assert [r[5] for r in rows] == [None, None] and rows[1][6] is None and len(rows[1]) == 7
    page, section = Page(), Section("s", "sweep")
    _memory(page, section, frame)
    (_, table), = section.figures
    assert [r[6] for r in table.rows] == [24.0, 12.0]


def test_a_cpu_step_that_does_not_fit_says_so_in_its_headline():
    """A CPU device's memory is its share of the host's; a step over it does not fit there either, and the report's
    headline says DOES NOT FIT as compile did (before, a CPU step's headline gave its size alone)."""
    from maxperf.reports.steps import _verdict

    fits, words = _verdict({}, {"per_device_total_bytes": 800 * 2**30, "hbm_bytes": 12 * 2**30, "fits": False},
                           {"platform": "cpu"}, None)
    assert fits is False and words.startswith("DOES NOT FIT: needs 800.00 GiB per device") and "CPU" in words
    fits, words = _verdict({}, {"per_device_total_bytes": 2**30, "hbm_bytes": 12 * 2**30, "fits": True},
                           {"platform": "cpu"}, None)
    assert fits is True and "CPU: host memory" in words


def test_an_interrupted_sweeps_page_says_it_is_partial(tmp_path):
    """sweep.json marks a sweep cut short (partial); its page says so in its headline and a note, and a finished
    sweep's does not."""
    from maxperf.reports.page import Page
    from maxperf.reports.scaling import read

    (tmp_path / "results.csv").write_text("point,model,status,reason\np0,tiny,ok,\n")
    for partial in (True, False):
        (tmp_path / "sweep.json").write_text(json.dumps({"schema": "maxperf.sweep/1", "model": "tiny", "points": 1,
                                                         "partial": partial}))
        page = Page()
        read(page, tmp_path)
        (section,) = page.sections
        assert section.headline.startswith("(partial: the sweep was interrupted") is partial
        assert any("the sweep was interrupted" in n for n in section.notes) is partial


def test_a_report_inside_a_compile_artifact_is_refused(compiled, capsys, tmp_path):
    """A compile's directory holds only what maxperf compile writes there (a later compile to it would refuse the
    report, or --force delete it): the report goes beside it."""
    target = compiled[0] / "report.html"
    code, err = _report_cli(capsys, compiled[0], "-o", target)
    assert code == 2 and "lies inside" in err and not target.exists()
    # nor inside the compile directory a run given ran (a later compile there refused it; --force deleted it)
    run_dir = tmp_path / "a-run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"schema": "maxperf.run/1", "artifact": str(compiled[0]), "steps": 1,
                                                  "devices": 8, "device_kind": "cpu", "step_times_s": [0.1],
                                                  "step_time_s": 0.1}))
    code, err = _report_cli(capsys, run_dir, "-o", target)
    assert code == 2 and "the compile directory" in err and "lies inside" in err and not target.exists()


def test_an_analytical_sweep_keeps_a_points_earlier_compile_and_its_run(tmp_path):
    """A point compiled before (and run there by `maxperf run`'s default --out) is not deleted by an analytical
    re-run of the sweep: the row names the artifact kept."""
    from maxperf.profiler import run as runner

    out = tmp_path / "sw"
    sweep("tiny", ["cpu-1"], axes={"seq_len": ["64"]}, out=out, workers=1)
    (point,) = (out / "points").iterdir()
    runner.run(point / "artifact", steps=1, warmup=0)
    result = sweep("tiny", ["cpu-1"], axes={"seq_len": ["64"]}, analytical_only=True, out=out, workers=1)
    assert (point / "artifact" / "compiled.pkl").is_file() and (point / "artifact" / "run" / "run.json").is_file()
    assert result.rows[0]["earlier_artifact"] == str(point / "artifact")


def test_the_comparison_ranks_the_hlo_step_time_lowest_first_and_only_at_the_same_tokens():
    """The HLO-derived step time is a time: the lower is the best, and between steps of different tokens per step
    it is not ranked nor given a ratio (the larger was starred, across batches); measured over HLO-predicted is a
    ratio of accuracy, never ranked."""
    from maxperf.reports import compare
    from maxperf.reports.page import Page, Section
    from maxperf.reports.steps import Step

    def step(label, tokens, hlo):
        return Step(label, {"kind": "compile"}, {"model": {"name": "m"}, "train": {}, "parallelism": {}},
                    {"tokens per step": tokens, "fits": True,
                                                     "predicted step time from the HLO (s)": hlo,
                                                     "measured / HLO-predicted step time": hlo * 10},
                    Section(label, label))

    for tokens, best in (((4096, 4096), 1), ((4096, 8192), None)):
        page = Page()
        steps = [step("a", tokens[0], 0.035), step("b", tokens[1], 0.050)]
        page.sections.extend(st.section for st in steps)
        compare.section(page, steps)
        table = next(s for s in page.sections if s.kind == "comparison").tables[0]
        row = next(i for i, r in enumerate(table.rows) if r[0] == "predicted step time from the HLO (s)")
        assert table.best.get(row) == best and (table.rows[row][-1] is None) == (best is None)
        accuracy = next(i for i, r in enumerate(table.rows) if r[0] == "measured / HLO-predicted step time")
        assert accuracy not in table.best


def test_the_comparison_stars_no_tie_and_no_compile_cache_hits_compile_time():
    """Two steps alike in a figure: neither is starred (the first was); a compile served from the compile cache
    compiled nothing, so its compile seconds are not a figure to rank (0 s was starred as the fastest compile)."""
    from maxperf.reports import compare
    from maxperf.reports.page import Page, Section
    from maxperf.reports.steps import Step

    def step(label, seconds, compile_s):
        return Step(label, {"kind": "compile"}, {"model": {"name": "m"}, "train": {}, "parallelism": {}},
                    {"tokens per step": 4096, "fits": True, "predicted step time (s)": seconds,
                     "compile (s)": compile_s}, Section(label, label))

    page = Page()
    steps = [step("a", 0.0037, 5.73), step("b", 0.0037, None), step("c", 0.0041, 7.0)]
    page.sections.extend(st.section for st in steps)
    compare.section(page, steps)
    table = next(s for s in page.sections if s.kind == "comparison").tables[0]
    rows = {r[0]: i for i, r in enumerate(table.rows)}
    assert rows["predicted step time (s)"] not in table.best
    assert table.best[rows["compile (s)"]] == 1  # a's 5.73 s against c's 7.0; b's cache hit not ranked
