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
from dataclasses import dataclass
from pathlib import Path

from maxperf.reports.page import Page, fmt
from maxperf.spec.errors import MaxperfError


@dataclass(frozen=True)
class ReportResult:
    html_path: Path
    csv_paths: list[Path]
    sections: int


def _classify(given: Path) -> tuple[str, Path]:
    """A path's kind and directory: a maxperf directory, or a file in one."""
    path = given.parent if given.is_file() else given
    if (path / "run.json").is_file():
        return "run", path
    if (path / "manifest.json").is_file():
        return "compile", path
    if (path / "results.csv").is_file() or (path / "sweep.json").is_file():
        return "sweep", path
    if (path / "plan.json").is_file():
        return "plan", path
    if given.is_file():
        raise MaxperfError(f"{given} is a file, and {path} is not a maxperf compile, run, sweep or plan directory; "
                           "give one (a directory with a manifest.json, run.json, results.csv or plan.json)")
    raise MaxperfError(f"{path} is not a maxperf compile, run, sweep or plan directory (no manifest.json, run.json, "
                       "results.csv or plan.json)")


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
    """Renders the report for `paths` into `out_html` (and its CSVs beside it), atomically. `out_html` must be new
    or an earlier report; it is checked, and locked, before anything is read."""
    if not paths:
        raise MaxperfError("give at least one compile, run or sweep directory")
    from maxperf.aot import artifacts

    out = Path(out_html).resolve()
    for path in paths:  # a compile's or run's directory holds only what maxperf compile or run writes there
        given = Path(path).resolve()
        home = given if given.is_dir() else given.parent
        homes = [(home, f"{path},")]
        if (home / "run.json").is_file():  # and the compile directory the run ran
            try:
                ran = json.loads((home / "run.json").read_text()).get("artifact")
            except (OSError, ValueError, AttributeError):
                ran = None
            if isinstance(ran, str) and ran:
                homes.append((Path(ran).resolve(), f"{ran}, the compile directory {path} ran,"))
        for where, said in homes:
            if out.is_relative_to(where) and ((where / "manifest.json").is_file() or (where / "run.json").is_file()):
                raise MaxperfError(f"-o {out_html} lies inside {said} which holds only what maxperf compile or run "
                                   f"writes there; write the report beside it (e.g. -o {where.name}.html)")
    with artifacts.hold_output(Path(out_html), "report"):
        return _render(paths, out_html, command)


def _render(paths: list[str | os.PathLike], out_html: str | os.PathLike, command: list[str] | None) -> ReportResult:
    from maxperf.reports import compare, scaling
    from maxperf.reports import steps as step_sections

    report = Page()
    steps, serving = [], []
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise MaxperfError(f"{path} does not exist")
        kind, directory = _classify(path)
        from maxperf.reports import serving as serving_sections

        if kind != "sweep" and serving_sections.is_serving(kind, directory):
            if kind == "plan":
                serving_sections.read_plan(report, directory)
            elif (figures := serving_sections.read_step(report, kind, directory)) is not None:
                serving.append(figures)
            continue
        if kind == "sweep":
            scaling.read(report, directory)
        elif kind == "plan":
            from maxperf.reports import plan as plan_section

            plan_section.read(report, directory)
        else:
            steps.append(step_sections.read(report, kind, directory))
    if len(steps) >= 2:
        compare.section(report, steps)
    if len(serving) >= 2:
        from maxperf.reports import serving as serving_sections

        serving_sections.compare_section(report, serving)
    out = Path(out_html)
    if out.is_dir():
        raise MaxperfError(f"-o {out} is a directory; give the HTML file to write, e.g. -o "
                            f"{out.parent / (out.name + '.html')} (beside it, not inside: a compile's or run's "
                            "directory holds only what maxperf writes there)")
    from maxperf.aot.artifacts import directory_mode

    files = out.with_name(out.stem + "_files")
    if os.path.lexists(files) and not files.is_dir():
        raise MaxperfError(f"{files} is a file, where the report's CSV tables go; move it or choose another -o")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{files.name}.", dir=out.parent))
        os.chmod(staging, directory_mode())  # mkdtemp's 0700 made the user's umask's
    except OSError as e:
        raise MaxperfError(f"-o {out}: cannot write in {out.parent} ({e.strerror})") from None
    try:
        return _write(report, out, files, staging, command)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write(report: Page, out: Path, files: Path, staging: Path, command: list[str] | None) -> ReportResult:
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
        files_dir=files.name, fmt=fmt, python=sys.version.split()[0])
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
