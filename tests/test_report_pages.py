"""What `maxperf report` pages say: scaling within one chip type, memory bars as long as their totals, blank cells
where a figure does not apply, the verdict of a step that does not fit, runs told apart, and what a run measured."""

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
from reports_browser import CHROMIUM, check_in_chromium

from maxperf import aot, perfmodel
from maxperf.reports import memory as parts
from maxperf.reports import render
from maxperf.reports.page import fmt
from maxperf.search.sweep import sweep
from maxperf.spec.errors import DoesNotFit
from maxperf.spec.request import resolve

FIXTURES = Path(__file__).parent / "fixtures"
MIXED = ["v5p-8", "v5p-16", "v5e-16", "h100-8"]


def tables(result) -> dict[str, list[dict]]:
    """The report's CSV tables by title (the part of the file name after its number)."""
    out = {}
    for path in result.csv_paths:
        with open(path, newline="") as f:
            out[path.stem.split("-", 1)[1]] = list(csv.DictReader(f))
    return out


def headlines(html: str) -> list[str]:
    return [re.sub(r"\s+", " ", h) for h in re.findall(r'<p class="headline[^"]*">(.*?)</p>', html, flags=re.S)]


@pytest.fixture(scope="module")
def mixed_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / "s"
    return sweep("llama2-7b", MIXED, axes={"per_device_batch_size": ["1", "2"]}, analytical_only=True, out=out,
                 workers=1)


@pytest.fixture(scope="module")
def mixed_report(mixed_sweep, tmp_path_factory):
    return render([mixed_sweep.out_dir], tmp_path_factory.mktemp("mixed-report") / "scaling.html")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    return aot.compile("cpu-8", "tiny", ["seq_len=64"], out=d / "a").out_dir


def _chip_of(mixed_sweep) -> dict[str, str]:
    return {r["topology"]: r["chip"] for r in mixed_sweep.rows}


# defect 1: scaling within one chip type


def test_scaling_lines_stay_within_one_chip_type(mixed_sweep, mixed_report):
    chip_of = _chip_of(mixed_sweep)
    for title in ("tflop-s-per-chip-against-chips", "mfu-against-chips", "step-time-against-chips",
                  "tokens-s-against-chips"):
        rows = tables(mixed_report)[title]
        assert {"chip", "topology"} <= set(rows[0]), title
        assert len(rows) == 8 and all(chip_of[r["topology"]] == r["chip"] for r in rows)
        for r in rows:  # a line's ideal starts from its own fewest chips: none for a chip swept at one size
            assert (r["ideal"] == "") == (r["chip"] != "tpu-v5p"), (title, r)
            if r["topology"] == "v5p-8":
                assert float(r["ideal"]) == pytest.approx(float(r[next(iter(r.keys() - {
                    "chip", "settings", "topology", "chips", "global batch", "ideal"}))]))


def test_efficiency_compares_only_the_same_chip(mixed_sweep, mixed_report):
    chip_of = _chip_of(mixed_sweep)
    rows = tables(mixed_report)["scaling-efficiency-against-the-fewest-chips-of-the-same-chip-and-settings"]
    assert len(rows) == 8
    for r in rows:
        if r["against"] == "(the base)":
            assert r["weak-scaling efficiency"] == ""
        else:
            assert chip_of[r["against"]] == chip_of[r["topology"]] == r["chip"]
    v5p = [r for r in rows if r["topology"] == "v5p-16"]
    assert all(0.5 < float(r["weak-scaling efficiency"]) < 1.2 for r in v5p)
    h100 = [r for r in rows if r["chip"] == "h100-sxm"]  # one topology: nothing to compare with
    assert all(r["against"] == "(the base)" and r["weak-scaling efficiency"] == "" for r in h100)


def test_every_chip_has_its_own_hbm_line(mixed_sweep, mixed_report):
    html = mixed_report.html_path.read_text()
    hbm = {r["chip"]: r["hbm_bytes"] / (1 << 30) for r in mixed_sweep.rows}
    assert len(set(round(v) for v in hbm.values())) == 3
    for chip, gib in hbm.items():
        assert f"{chip} HBM {gib:.1f} GiB" in html  # the panel's limit line label, as SVG text
    for r in tables(mixed_report)["memory-per-device-against-chips"]:
        assert float(r["HBM (GiB)"]) == pytest.approx(hbm[r["chip"]], abs=0.01)


def test_each_chip_type_has_its_panel_and_ideal_line(mixed_report):
    html = mixed_report.html_path.read_text()
    svgs = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    assert len(svgs) == 5
    for svg in svgs:
        assert all(f">{chip}<" in svg or f"{chip} " in svg for chip in ("tpu-v5p", "tpu-v5e", "h100-sxm"))
    assert sum("ideal (dashed)" in svg for svg in svgs) == 4  # every metric but memory
    rows = tables(mixed_report)["tokens-s-against-chips"]
    base, bigger = (next(r for r in rows if r["topology"] == t and r["settings"] == "per_device_batch_size=1")
                    for t in ("v5p-8", "v5p-16"))
    assert float(bigger["ideal"]) == pytest.approx(2 * float(base["tokens/s"]), rel=1e-3)


def test_a_scaling_headline_opens_the_page(mixed_report):
    html = mixed_report.html_path.read_text()
    line = headlines(html)[0]
    assert "8 points: 8 fit, 0 do not fit" in line and "highest predicted MFU" in line
    assert html.index('class="headline') < html.index("<svg")


# defect 2: memory bars as long as their totals


def test_phase_parts_add_up_as_perfmodel_adds_them():
    for topology, overrides in (("v5p-8", ["remat_policy=minimal"]),
                                ("v5p-8", ["grad_accum_steps=2", "per_device_batch_size=2"]),
                                ("v5e-16", ["per_device_batch_size=4"])):
        p = resolve(topology, "llama2-7b", overrides)
        memory = perfmodel.estimate(p).memory.as_dict()
        state = sum(memory[k] for k in parts.STATE_PARTS)
        for phase, value in memory["phases"].items():
            assert parts.phase_total(memory, phase) == pytest.approx(state + value)
        peak, inside, outside = parts.peak_parts(memory)
        assert sum(memory[k] for k in inside) == pytest.approx(memory["per_device_total_bytes"])
        assert set(inside) | set(outside) == set(parts.ANALYTICAL_PARTS)


def test_memory_bars_sum_to_their_totals(compiled, tmp_path):
    result = render([compiled], tmp_path / "mfu.html")
    estimate = json.loads((compiled / "estimate.json").read_text())["memory"]
    memory = json.loads((compiled / "memory.json").read_text())
    assert sum(estimate[k] for k in parts.ANALYTICAL_PARTS) > estimate["per_device_total_bytes"] * 1.05
    [name] = [n for n in tables(result) if n.startswith("memory-per-device-by-phase")]
    rows = {r["part"]: r for r in tables(result)[name]}
    scale = 1 << (20 if name.endswith("mib") else 30)
    columns = [c for c in rows["total"] if c != "part"]
    for column in columns:
        values = [float(r[column]) for k, r in rows.items() if k not in ("total", "verdict") and not
                  k.startswith(("HBM", "host memory")) and r[column]]
        assert sum(values) == pytest.approx(float(rows["total"][column]), rel=1e-3), column
    [peak] = [c for c in columns if "peak: the total" in c]
    assert float(rows["total"][peak]) * scale == pytest.approx(estimate["per_device_total_bytes"], rel=1e-3)
    assert max(float(rows["total"][c]) for c in columns if c.startswith("analytical")) == float(rows["total"][peak])
    assert float(rows["total"]["compiler (XLA)"]) * scale == pytest.approx(memory["per_device_total_bytes"], rel=1e-3)
    assert sum(parts.compiler_parts(memory).values()) == memory["per_device_total_bytes"]


def test_estimate_memory_lists_the_parts_of_its_total(capsys):
    from maxperf.cli import main

    for overrides in (["remat_policy=minimal"], ["remat_policy=full"]):
        assert main(["estimate-memory", "--topology", "v5p-8", "--model", "llama2-7b", "--analytical-only",
                     *overrides]) == 0
        lines = capsys.readouterr().out.splitlines()
        split = next(i for i, line in enumerate(lines) if "(only in other phases:)" in line)
        total = next(line for line in lines if line.strip().startswith("total ("))
        summed = [float(line.split()[1]) for line in lines[2:split]]
        outside = [float(line.split()[1]) for line in lines[split + 1:] if line.strip().startswith("(")]
        assert sum(summed) == pytest.approx(float(total.split()[3]), abs=0.01 * len(summed))
        assert sum(outside) > 0.1  # the parts left out are real parts, live in another phase


# defect 3: blank cells, totals and verdicts


def test_cells_that_do_not_apply_are_blank_and_tables_have_totals(compiled, tmp_path):
    assert fmt(None) == "" and fmt(float("nan")) == "" and fmt(0.0) == "0"
    result = render([compiled], tmp_path / "mfu.html")
    [name] = [n for n in tables(result) if n.startswith("memory-per-device-by-phase")]
    rows = {r["part"]: r for r in tables(result)[name]}
    assert rows["logits"]["analytical, optimizer phase"] == "" and rows["logits"]["compiler (XLA)"] == ""
    assert rows["xla temporaries"]["analytical, loss phase"] == ""
    assert set(rows["verdict"].values()) == {"verdict", "fits"}
    time = tables(result)["predicted-step-time-by-component"]
    assert time[-1]["component"] == "total" and time[-1]["kind"] == ""
    html = result.html_path.read_text()
    assert '<tr class="emphasis"><td>total</td>' in html and "<td></td>" in html
    assert "<td>-</td>" not in html


def test_strong_scaling_is_left_out_where_the_global_batch_grows_with_the_chips(mixed_report):
    """A per-device-batch sweep's global batch grows with the chips: no strong scaling to show, and a note says why."""
    rows = tables(mixed_report)["scaling-efficiency-against-the-fewest-chips-of-the-same-chip-and-settings"]
    grown = [r for r in rows if r["against"] not in ("(the base)",)]
    assert grown and all("strong-scaling efficiency (same global batch only)" not in r for r in grown)
    assert all(r["weak-scaling efficiency"] != "" for r in grown)
    html = mixed_report.html_path.read_text()
    assert "global batch grows with the chips (a per-device batch), so only weak scaling is shown" in html


# defect 4: a step that does not fit says so


@pytest.mark.slow
def test_a_step_that_does_not_fit_says_so_first(tmp_path):
    with pytest.raises(DoesNotFit):
        aot.compile("v5e-1", "tiny", ["d_model=8192", "d_ff=32768", "num_heads=64", "num_kv_heads=64",
                                      "head_dim=128", "vocab_size=256000", "num_layers=4", "seq_len=128"],
                    out=tmp_path / "oom")
    result = render([tmp_path / "oom"], tmp_path / "oom.html")
    html = result.html_path.read_text()
    [line] = headlines(html)
    assert line.startswith("tiny / v5e-1: DOES NOT FIT: needs ") and "of 15.75 GiB" in line and " over " in line
    assert "no step time: the step was not compiled" in line
    assert 'class="headline does-not-fit"' in html and html.index("DOES NOT FIT") < html.index("<svg")
    assert "- s/step" not in html and "? s" not in html
    rows = {r["part"]: r for r in tables(result)["memory-per-device-by-phase-gib"]}
    assert rows["verdict"]["compiler (XLA)"] == "does not fit"
    if CHROMIUM:
        check_in_chromium(result.html_path, tmp_path)


# defect 5: runs told apart, slices named


@pytest.mark.slow
def test_compared_runs_are_told_apart(compiled, tmp_path):
    same = tmp_path / "again"
    shutil.copytree(compiled, same)
    other = aot.compile("cpu-8", "tiny", ["seq_len=64", "remat_policy=none"], out=tmp_path / "b").out_dir
    result = render([compiled, same, other], tmp_path / "cmp.html")
    html = result.html_path.read_text()
    titles = re.findall(r"<h2>(.*?)</h2>", html)
    assert titles == ["comparison", f"A: tiny / cpu-8 (remat_policy=full; {compiled.name})",
                      "B: tiny / cpu-8 (remat_policy=full; again)", "C: tiny / cpu-8 (remat_policy=none)"]
    assert [h.split(":")[0] for h in headlines(html)[:3]] == ["A", "B", "C"]
    side = {r["figure"]: r for r in tables(result)["side-by-side"]}
    assert side["remat_policy"]["A"] == side["remat_policy"]["B"] == "full" and side["remat_policy"]["C"] == "none"
    assert side["directory"]["A"] == str(compiled) and side["directory"]["C"] == str(other)


def test_a_comparison_names_the_config_values_that_differ():
    from maxperf.reports.compare import names
    from maxperf.reports.page import Section
    from maxperf.reports.steps import Step

    def step(directory, kind="compile", **train):
        config = {"model": {"name": "tiny"}, "train": {"seq_len": "64", **train}, "parallelism": {}}
        return Step("tiny / cpu-8", {"topology": "cpu-8", "kind": kind}, config, {}, Section("", ""), Path(directory))

    assert names([step("x/a", remat_policy="full"), step("y/a", remat_policy="full"),
                  step("z", remat_policy="none"), step("x/a/run", "measured run", remat_policy="full")]) == [
        "A: tiny / cpu-8 (remat_policy=full; x/a)", "B: tiny / cpu-8 (remat_policy=full; y/a)",
        "C: tiny / cpu-8 (remat_policy=none)", "D: tiny / cpu-8 (remat_policy=full)"]
    many = [step(str(i), **{f"k{j}": str(i) for j in range(6)}) for i in range(2)]
    assert names(many)[1] == "B: tiny / cpu-8 (k0=1; k1=1; k2=1; k3=1; ...)"


def test_names_in_a_comparison_say_what_differs(compiled, tmp_path):
    same = tmp_path / "again"
    shutil.copytree(compiled, same)
    result = render([compiled, same], tmp_path / "cmp.html")
    titles = re.findall(r"<h2>(.*?)</h2>", result.html_path.read_text())
    assert titles == ["comparison", f"A: tiny / cpu-8 ({compiled.name})", "B: tiny / cpu-8 (again)"]
    assert tables(result)["side-by-side"][0]["figure"] == "directory"


def test_two_slices_are_named_as_such(tmp_path, capsys):
    from maxperf.cli import main
    from maxperf.spec.topology import get

    assert get("v5p-128", num_slices=2).display_name == "2 x v5p-128" and get("v5p-128").display_name == "v5p-128"
    assert main(["estimate", "--topology", "v5p-128", "--num-slices", "2", "--model", "llama2-7b"]) == 0
    assert capsys.readouterr().out.startswith("llama2-7b on 2 x v5p-128 (128 tpu-v5p chips)")
    swept = sweep("llama2-7b", ["v5p-8", "v5p-16"], num_slices=[1, 2], analytical_only=True, out=tmp_path / "s",
                  workers=1)
    result = render([swept.out_dir], tmp_path / "slices.html")
    rows = tables(result)["tflop-s-per-chip-against-chips"]
    assert {r["topology"] for r in rows} == {"v5p-8", "v5p-16", "2 x v5p-8", "2 x v5p-16"}
    lines = {r["settings"] for r in rows}  # v5p-16 and 2 x v5p-8 have 8 chips each: two lines, not a jump
    assert lines == {"defaults, slices 1", "defaults, slices 2"}


@pytest.mark.slow
def test_a_two_slice_compile_is_named_as_such(tmp_path):
    out = aot.compile("v5p-8", "tiny", ["seq_len=128"], num_slices=2, out=tmp_path / "two").out_dir
    html = render([out], tmp_path / "two.html").html_path.read_text()
    assert re.findall(r"<h2>(.*?)</h2>", html) == ["tiny / 2 x v5p-8"]
    assert headlines(html)[0].startswith("tiny / 2 x v5p-8: fits: ")
    assert "<dd>data=2 (2 over DCN) x fsdp=4</dd>" in html
    assert "<dd>2 x v5p-8: 8 tpu-v5p chips, 8 devices, 2 hosts</dd>" in html


# defect 6 and the headline: what a run measured


@pytest.fixture(scope="module")
def h100_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("h100") / "run"
    d.mkdir()
    shutil.copy(FIXTURES / "h100_profiled_run.json", d / "run.json")
    return d


def test_a_run_shows_what_it_measured(h100_run, tmp_path):
    run = json.loads((h100_run / "run.json").read_text())
    result = render([h100_run], tmp_path / "run.html")
    html = result.html_path.read_text()
    t = tables(result)
    assert [float(r["loss"]) for r in t["loss-at-each-step"]] == pytest.approx(run["losses"])
    steps = {r["step"]: r["seconds"] for r in t["step-time-of-each-timed-step"]}
    assert float(steps["median"]) == pytest.approx(run["step_time_s"])
    assert float(steps["p90"]) == pytest.approx(run["step_time_p90_s"])
    assert float(steps["predicted"]) == pytest.approx(run["predicted_step_time_s"])
    ops = t["top-operations-by-self-time-profile"]
    assert [r["operation"] for r in ops] == [o["op"] for o in run["profile"]["top_ops"]]
    assert {r["category"]: float(r["seconds"]) for r in t["profiled-time-by-category"]}["other"] == pytest.approx(
        run["profile"]["seconds_by_category"]["other"])
    assert "no measured-against-predicted comparison by component: the profile puts 100% of its time in " \
           "&#39;other&#39;" in html
    for alt in ("Loss at each step", "Step time of each timed step", "Profiled time"):
        assert f'aria-label="{alt}' in html
    [line] = headlines(html)
    assert html.index('class="headline') < html.index("<svg")
    assert "0.2953 s measured (0.84x predicted)" in line and "step 0.3505 s predicted" in line
    assert "MFU 37.2% measured" in line and "ran in 18.88 GiB per device at its peak (measured)" in line


@pytest.mark.slow
def test_a_profiled_run_compares_components_and_shows_its_checkpoint(compiled, tmp_path):
    from maxperf.profiler.run import run

    measured = run(compiled, steps=3, warmup=1, profile=True, checkpoint=tmp_path / "ckpt", out=tmp_path / "run")
    result = render([measured.out_dir], tmp_path / "run.html")
    t = tables(result)
    by = {r["component"]: r for r in t["measured-against-predicted-by-component-s-per-step"]}
    assert {"compute", "memory-bound", "step time"} <= set(by)
    assert all(float(r["measured"]) > 0 for k, r in by.items() if k in ("compute", "step time"))
    assert float(by["step time"]["measured"]) == pytest.approx(json.loads(
        (measured.out_dir / "run.json").read_text())["step_time_s"])
    checkpoint = {r["figure"]: r["value"] for r in t["checkpoint"]}
    assert checkpoint["path"] == str(tmp_path / "ckpt") and float(checkpoint["size (GiB)"]) > 0
    assert float(checkpoint["blocking the loop (s)"]) <= float(checkpoint["until written (s)"])
    html = result.html_path.read_text()
    assert 'aria-label="Measured against predicted seconds per step' in html
    [line] = headlines(html)
    assert "measured (" in line and "predicted" in line and "bound by" in line
    if CHROMIUM:
        check_in_chromium(result.html_path, tmp_path)


# a comparison crowns only what fits, and compares throughput where the steps' work differs (issue 28, item 6)


def _compared(*steps):
    from maxperf.reports import compare
    from maxperf.reports.page import Page

    page = Page()
    page.sections += [st.section for st in steps]
    compare.section(page, list(steps))
    comparison = page.sections[0]
    [table] = comparison.tables
    return comparison, {row[0]: (row, table.best.get(i)) for i, row in enumerate(table.rows)}


def _step(directory: str, B: int, fits: bool, step_time: float, memory_gib: float):
    from maxperf.reports.page import Section
    from maxperf.reports.steps import Step

    tokens = B * 8 * 2048
    config = {"model": {"name": "llama2-7b"}, "train": {"per_device_batch_size": str(B)}, "parallelism": {}}
    numbers = {"fits": fits, "tokens per step": tokens, "predicted step time (s)": step_time,
               "predicted tokens/s": tokens / step_time, "analytical memory (GiB)": memory_gib}
    return Step("llama2-7b / v5p-16", {"topology": "v5p-16", "kind": "compile", "directory": directory}, config,
                numbers, Section("llama2-7b / v5p-16", "mfu"), Path(directory))


def test_a_comparison_crowns_only_steps_that_fit_and_ranks_throughput_not_step_time():
    # A: 32 sequences a step; B: 256, slower per step but more tokens/s; C: 256 and fastest, but it does not fit
    comparison, rows = _compared(_step("a", 4, True, 1.0, 40.0), _step("b", 32, True, 6.0, 90.0),
                                 _step("c", 32, False, 5.0, 30.0))
    tokens_row, best = rows["predicted tokens/s"]
    assert best == 2 and max(tokens_row[1:4]) == tokens_row[3]  # B, not the faster C that does not fit
    assert rows["analytical memory (GiB)"][1] == 1  # A: C needs less but does not fit
    step_row, best = rows["predicted step time (s)"]
    assert best is None and step_row[-1] is None  # 32 and 256 sequences: no best step time, no ratio
    assert rows["tokens per step"][0][1:4] == [65536, 524288, 524288] and rows["tokens per step"][1] is None
    assert "C does not fit in device memory: marked best in no row" in comparison.notes
    assert any("not all process the same tokens per step" in n for n in comparison.notes)
    [(svg, numbers)] = comparison.figures
    assert numbers.title == "tokens per second of each" and 'aria-label="Tokens/s of each compared step' in svg


def test_steps_of_the_same_work_compare_step_times(compiled, tmp_path):
    same = tmp_path / "again"
    shutil.copytree(compiled, same)
    result = render([compiled, same], tmp_path / "cmp.html")
    side = {r["figure"]: r for r in tables(result)["side-by-side"]}
    assert side["tokens per step"]["A"] == side["tokens per step"]["B"] == str(8 * 64)  # 8 devices x B=1 x L=64
    assert float(side["predicted tokens/s"]["A"]) > 0 and side["predicted step time (s)"]["ratio last / first"]
    assert "step-time-of-each-s" in tables(result)  # the same work: step times side by side


def test_numbers_read_as_numbers():
    """Throughputs in thousands, host memory in MiB: no scientific notation in a table cell."""
    from maxperf.reports.page import fmt, size

    assert fmt(128103.4) == "128,103" and fmt(1234.5) == "1234" and fmt(0.01234) == "0.01234"
    assert size(24110 * 2**20) == "23.54 GiB" and size(512.25 * 2**20) == "512.2 MiB"
    assert size(1000.5 * 2**20) == "1,000.5 MiB"


def test_a_limit_far_above_the_lines_is_named_not_drawn():
    """A 95 GiB HBM line over 2-6 GiB of memory would flatten the lines against the axis: the panel's title names it
    instead; within reach it is drawn."""
    from maxperf.reports import figures

    far = figures.Panel("v5p", lines=[("a", [8, 16], [2.0, 6.0])], limit=(95.0, "HBM 95 GiB"))
    near = figures.Panel("v5p", lines=[("a", [8, 16], [40.0, 80.0])], limit=(95.0, "HBM 95 GiB"))
    svg_far = figures.panels([far], xlabel="chips", ylabel="GiB", alt="far", from_zero=True)
    svg_near = figures.panels([near], xlabel="chips", ylabel="GiB", alt="near", from_zero=True)
    assert "above the chart" in svg_far and "above the chart" not in svg_near
