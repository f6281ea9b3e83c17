"""`maxperf report`: one self-contained HTML page from compile, run and sweep directories.

Every figure is inline SVG with a text alternative and its numbers in a table beside it; every table is also written
as CSV next to the page (`NAME_files/*.csv`) and linked by a relative path; nothing is fetched from a network.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxperf.errors import MaxperfError

GIB = 1 << 30
MEMORY_PARTS = ("params", "optimizer", "gradients", "grad_accumulator", "activations", "saved_copy", "logits",
                "temporaries")
COMPILER_PARTS = ("argument_bytes", "temp_bytes", "generated_code_bytes")


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    csv_name: str
    best: dict[int, int] = field(default_factory=dict)  # row index -> column index of a best value


@dataclass
class Section:
    title: str
    kind: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    figures: list[tuple[str, Table]] = field(default_factory=list)  # (svg, its numbers)
    tables: list[Table] = field(default_factory=list)


@dataclass(frozen=True)
class ReportResult:
    html_path: Path
    csv_paths: list[Path]
    sections: int


def _read(path: Path) -> dict | None:
    """A JSON object the directory holds, None when absent; a damaged one is an error naming the file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MaxperfError(f"{path} is not readable JSON ({type(e).__name__}: {e}); the directory is damaged: "
                           "produce it again") from None
    if not isinstance(data, dict):
        raise MaxperfError(f"{path} holds a JSON {type(data).__name__}, not an object; the directory is damaged: "
                           "produce it again")
    return data


def _manifest(directory: Path) -> dict:
    """manifest.json of a compile directory, checked (schema and the types of its fields)."""
    from maxperf.aot.artifacts import read_manifest

    return read_manifest(directory)


def _classify(path: Path) -> tuple[str, Path]:
    path = path.parent if path.is_file() else path
    if (path / "run.json").is_file():
        return "run", path
    if (path / "manifest.json").is_file():
        return "compile", path
    if (path / "results.csv").is_file() or (path / "sweep.json").is_file():
        return "sweep", path
    raise MaxperfError(f"{path} is not a maxperf compile, run or sweep directory (no manifest.json, run.json or "
                       "results.csv)")


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):  # None or NaN: nothing to show
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class _Report:
    def __init__(self):
        self.sections: list[Section] = []
        self.versions: dict[str, Any] = {}

    def table(self, title: str, columns: list[str], rows: list[list[Any]]) -> Table:
        slug = "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")
        return Table(title, columns, rows, f"{len(self.sections):02d}-{slug}.csv")

    def step(self, kind: str, directory: Path) -> dict:
        """The compile (and run) figures of one directory as a flat dict, adding its MFU section."""
        from maxperf.reports import figures

        run = _read(directory / "run.json") if kind == "run" else None
        art = directory
        if run:  # the compile directory it ran: as recorded, else the default layout DIR/run
            recorded = Path(run.get("artifact") or "")
            art = recorded if (recorded / "manifest.json").is_file() else directory.parent
        manifest = _manifest(art) if (art / "manifest.json").is_file() else {}
        estimate, memory = _read(art / "estimate.json") or {}, _read(art / "memory.json") or {}
        self.versions = self.versions or manifest.get("versions", {})
        model = manifest.get("model", {}).get("name", "?")
        topology = manifest.get("topology", {}).get("name", "?")
        mesh = " x ".join(f"{a}={n}" for a, n in manifest.get("mesh", {}).get("axes", {}).items() if n > 1) or "1"
        train = manifest.get("train", {})
        s = Section(f"{model} on {topology}" + (" (measured)" if run else ""), "mfu")
        s.facts = [("model", model), ("topology", topology), ("mesh", mesh),
                   ("batch", f"B={train.get('per_device_batch_size')} per device, global "
                             f"{manifest.get('global_batch')} x L={train.get('seq_len')}"),
                   ("remat", str(train.get("remat_policy"))), ("directory", str(directory))]
        row = {"name": f"{model} / {topology}", "predicted step time (s)": estimate.get("step_time_s"),
               "predicted TFLOP/s per chip": estimate.get("tflops_per_chip"), "predicted MFU": estimate.get("mfu"),
               "analytical memory (GiB)": (estimate.get("memory_per_device_bytes") or 0) / GIB or None,
               "compiler memory (GiB)": (memory.get("per_device_total_bytes") or 0) / GIB or None,
               "compile (s)": manifest.get("compile_seconds")}
        if estimate.get("breakdown"):
            kinds: dict[str, list[float]] = {}
            for r in estimate["breakdown"]:
                exposed, total = r["exposed_seconds"], r["seconds"]
                kinds.setdefault(r["kind"], [0.0, 0.0])
                kinds[r["kind"]][0] += exposed
                kinds[r["kind"]][1] += total - exposed
            names = list(kinds)
            numbers = self.table("predicted step time by kind", ["kind", "exposed (s)", "overlapped (s)"],
                                 [[k, kinds[k][0], kinds[k][1]] for k in names])
            svg = figures.stacked_bars(names, {"exposed": [kinds[k][0] for k in names],
                                               "overlapped (hidden under compute)": [kinds[k][1] for k in names]},
                                       unit="seconds per step", alt=f"Predicted step time of {model} on {topology} "
                                       "by kind of work, exposed and overlapped")
            s.figures.append((svg, numbers))
            s.tables.append(self.table("predicted step time breakdown",
                                       ["component", "kind", "seconds", "exposed seconds"],
                                       [[r["name"], r["kind"], r["seconds"], r["exposed_seconds"]]
                                        for r in estimate["breakdown"]]))
        analytical = estimate.get("memory", {})
        if analytical or memory:
            bars = {part: [analytical.get(part, 0) / GIB, 0.0] for part in MEMORY_PARTS if analytical.get(part)}
            for part in COMPILER_PARTS:
                if memory.get(part):
                    bars[f"xla {part.removesuffix('_bytes')}"] = [0.0, memory[part] / GIB]
            hbm = memory.get("hbm_bytes") or analytical.get("hbm_bytes")
            numbers = self.table("memory per device", ["part", "analytical (GiB)", "compiler (GiB)"],
                                 [[k, v[0], v[1]] for k, v in bars.items()])
            svg = figures.stacked_bars(["analytical", "compiler"], bars, unit="GiB per device",
                                       line=hbm / GIB if hbm else None, line_label="HBM",
                                       alt=f"Memory per device of {model} on {topology}: analytical parts beside "
                                       "the compiler's, against HBM")
            s.figures.append((svg, numbers))
        s.facts += [("predicted", f"{_fmt(estimate.get('step_time_s'))} s/step, "
                                  f"{_fmt(estimate.get('tflops_per_chip'))} TFLOP/s per chip, MFU "
                                  f"{_fmt(estimate.get('mfu'))}, bound by {estimate.get('bottleneck', '-')}")]
        if run:
            ratio = run.get("measured_over_predicted")
            row.update({"measured step time (s)": run.get("step_time_s"),
                        "measured TFLOP/s per device": run.get("tflops_per_device"), "measured MFU": run.get("mfu"),
                        "measured / predicted": ratio})
            s.tables.append(self.table("measured against predicted", ["figure", "measured", "predicted", "ratio"], [
                ["step time (s)", run.get("step_time_s"), run.get("predicted_step_time_s"), ratio],
                ["MFU", run.get("mfu"), estimate.get("mfu"), None],
                ["memory per device (GiB)", (run.get("memory", {}).get("measured_peak_bytes") or 0) / GIB or None,
                 (memory.get("per_device_total_bytes") or 0) / GIB or None, None]]))
        self.sections.append(s)
        return row

    def sweep(self, directory: Path) -> None:
        import pandas as pd

        from maxperf.reports import figures

        try:
            frame = pd.read_csv(directory / "results.csv")
        except (OSError, ValueError) as e:  # pandas' parser errors are ValueErrors
            raise MaxperfError(f"{directory / 'results.csv'} is not a readable table ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); run the sweep again to "
                               "rewrite it") from None
        if not {"point", "status", "model"} <= set(frame.columns):
            raise MaxperfError(f"{directory / 'results.csv'} lacks a sweep's columns (point, status, model); run "
                               "the sweep again to rewrite it")
        for artifact in frame["artifact"].dropna() if "artifact" in frame else []:
            manifest = _read(Path(artifact) / "manifest.json")
            if manifest and not self.versions:
                self.versions = manifest.get("versions", {})
        ok = frame[frame["status"] == "ok"].sort_values("chips") if "chips" in frame else frame.iloc[0:0]
        s = Section(f"scaling: {frame['model'].iloc[0] if len(frame) else '?'} ({directory})", "scaling")
        s.facts = [("points", str(len(frame))), ("finished without error or overflow", str(len(ok)))]
        groups = ([(str(k) if str(k) != "nan" else "", g) for k, g in ok.groupby("overrides", dropna=False, sort=False)]
                  if len(ok) else [])

        def values(g, col):
            return [None if pd.isna(v) else float(v) for v in g[col]] if col in g else [None] * len(g)

        for title, col, ylabel in (("TFLOP/s per chip", "predicted_tflops_per_chip", "TFLOP/s per chip"),
                                   ("MFU", "predicted_mfu", "MFU"), ("step time", "predicted_step_time_s", "s"),
                                   ("tokens/s", "predicted_tokens_per_s", "tokens/s")):
            if not groups:
                break
            series = {f"predicted {label or title}": values(g, col) for label, g in groups}
            svg = figures.lines_against_groups([g["chips"].tolist() for _, g in groups], series, xlabel="chips",
                                               ylabel=ylabel, alt=f"Predicted {title} against chips, log scale")
            rows = [[label, int(c), v] for (label, g) in groups for c, v in zip(g["chips"], values(g, col))]
            s.figures.append((svg, self.table(f"{title} against chips", ["settings", "chips", title], rows)))
        if groups:
            hbm = float(ok["hbm_bytes"].iloc[0]) / GIB if "hbm_bytes" in ok else None
            series, xs, rows = {}, [], []
            for label, g in groups:
                for source, col in (("analytical", "analytical_memory_bytes"), ("compiler", "compiler_memory_bytes")):
                    series[f"{source} {label}".strip()] = [v / GIB if v else None for v in values(g, col)]
                    xs.append(g["chips"].tolist())
                rows += [[label, int(c), a / GIB if a else None, b / GIB if b else None] for c, a, b in
                         zip(g["chips"], values(g, "analytical_memory_bytes"), values(g, "compiler_memory_bytes"))]
            svg = figures.lines_against_groups(xs, series, xlabel="chips", ylabel="GiB per device", hline=hbm,
                                               hline_label="HBM", alt="Memory per device against chips, with HBM")
            s.figures.append((svg, self.table("memory per device against chips", ["settings", "chips",
                                              "analytical (GiB)", "compiler (GiB)"], rows)))
            rows = []
            for label, g in groups:
                base = g.iloc[0]
                for _, r in g.iterrows():
                    n = r["chips"] / base["chips"]
                    weak = r["predicted_tokens_per_s"] / (base["predicted_tokens_per_s"] * n)
                    strong = (base["predicted_step_time_s"] / (r["predicted_step_time_s"] * n)
                              if r["global_batch"] == base["global_batch"] else None)
                    rows.append([label, int(r["chips"]), int(r["global_batch"]), weak, strong])
            s.tables.append(self.table("scaling efficiency against the smallest topology", [
                "settings", "chips", "global batch", "weak-scaling efficiency",
                "strong-scaling efficiency (same global batch only)"], rows))
        failed = frame[frame["status"] != "ok"]
        if len(failed):
            s.tables.append(self.table("points that failed", ["point", "status", "reason"],
                                       failed[["point", "status", "reason"]].values.tolist()))
        s.tables.append(self.table("all points", list(frame.columns), frame.values.tolist()))
        self.sections.append(s)

    def comparison(self, rows: list[dict]) -> None:
        columns = [c for c in rows[0] if c != "name"]
        lower_is_better = {"predicted step time (s)", "measured step time (s)", "analytical memory (GiB)",
                           "compiler memory (GiB)", "compile (s)"}
        table = self.table("side by side", ["figure", *[r["name"] for r in rows], "ratio last / first"], [])
        for i, c in enumerate(columns):
            values = [r.get(c) for r in rows]
            numbers = [v for v in values if isinstance(v, (int, float))]
            ratio = values[-1] / values[0] if numbers and values[0] and values[-1] is not None else None
            table.rows.append([c, *values, ratio])
            if numbers:
                best = (min if c in lower_is_better else max)(numbers)
                table.best[i] = 1 + values.index(best)
        s = Section("comparison", "comparison", tables=[table])
        s.facts = [("best value", "marked ★ in each row (lowest time and memory, highest throughput and MFU)")]
        self.sections.append(s)


def _installed_versions() -> dict[str, str | None]:
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for name in ("maxperf", "jax", "jaxlib", "libtpu"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def render(paths: list[str | os.PathLike], out_html: str | os.PathLike,
           command: list[str] | None = None) -> ReportResult:
    """Renders the report for `paths` into `out_html` (and its CSVs beside it), atomically."""
    if not paths:
        raise MaxperfError("give at least one compile, run or sweep directory")
    report = _Report()
    steps = []
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise MaxperfError(f"{path} does not exist")
        kind, directory = _classify(path)
        if kind == "sweep":
            report.sweep(directory)
        else:
            steps.append(report.step(kind, directory))
    if len(steps) >= 2:
        report.comparison(steps)
    out = Path(out_html)
    if out.is_dir():
        raise MaxperfError(f"-o {out} is a directory; give the HTML file to write, e.g. -o {out / 'report.html'}")
    files = out.with_name(out.stem + "_files")
    if os.path.lexists(files) and not files.is_dir():
        raise MaxperfError(f"{files} is a file, where the report's CSV tables go; move it or choose another -o")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{files.name}.", dir=out.parent))
    except OSError as e:
        raise MaxperfError(f"-o {out}: cannot write in {out.parent} ({e.strerror})") from None
    try:
        return _write(report, out, files, staging, command)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write(report: _Report, out: Path, files: Path, staging: Path, command: list[str] | None) -> ReportResult:
    """The page and its tables into place: staging becomes `files`, a temporary page becomes `out`."""
    import jinja2

    csv_paths = []
    for section in report.sections:
        for table in [t for _, t in section.figures] + section.tables:
            with open(staging / table.csv_name, "w", newline="") as f:
                csv.writer(f).writerows([table.columns, *table.rows])
            csv_paths.append(files / table.csv_name)
    if not report.versions:  # analytical sweeps only: name the installation that made the page
        report.versions = _installed_versions()
    env = jinja2.Environment(loader=jinja2.PackageLoader("maxperf.reports", "templates"), autoescape=True)
    page = env.get_template("report.html").render(
        sections=report.sections, versions=report.versions, command=" ".join(command or sys.argv),
        files_dir=files.name, fmt=_fmt, python=sys.version.split()[0])
    tmp = out.with_name(f".{out.name}.partial")
    try:
        tmp.write_text(page)
        shutil.rmtree(files, ignore_errors=True)  # the tables of an earlier report of the same name
        os.replace(staging, files)
        os.replace(tmp, out)
    except OSError as e:
        raise MaxperfError(f"-o {out}: cannot write the report ({e.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return ReportResult(out, csv_paths, len(report.sections))
