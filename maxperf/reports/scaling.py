"""The section of one sweep directory: scaling within each chip type (a panel per chip, a line per setting, the
ideal beside it), memory against each chip's own HBM, and efficiency against the fewest chips of the same line."""

from __future__ import annotations

from pathlib import Path

from maxperf.reports import figures
from maxperf.reports.page import GIB, Page, Section, percent, read_json, seconds, topology_label
from maxperf.spec.errors import MaxperfError

# (title, column, axis label, ideal): the ideal of a line from its fewest chips `b` to a point `r` with n = chips
# ratio: throughput grows n-fold, per-chip rates stay, a step takes (global batch ratio / n) times as long.
METRICS = (
    ("TFLOP/s per chip", "predicted_tflops_per_chip", "TFLOP/s per chip", lambda b, r: b.value),
    ("MFU", "predicted_mfu", "MFU", lambda b, r: b.value),
    ("step time", "predicted_step_time_s", "seconds per step",
     lambda b, r: b.value * (r.global_batch / b.global_batch) * (b.chips / r.chips)),
    ("tokens/s", "predicted_tokens_per_s", "tokens/s", lambda b, r: b.value * r.chips / b.chips),
)
HIDDEN_COLUMNS = ("schema", "key")  # the point's name says the same, shorter


def _batch(row) -> float | None:
    """A point's global batch; for a user's step, whose results have no such column, its units (tokens, images) per
    step: its throughput times its step time (None where it gives no throughput)."""
    v = row.get("global_batch")
    if v is not None and v == v:
        return float(v)
    rate, step = row.get("predicted_tokens_per_s"), row.get("predicted_step_time_s")
    if rate is None or step is None or rate != rate or step != step or not rate:
        return None
    return round(float(rate) * float(step), 6)


class _Point:
    def __init__(self, row, column: str):
        self.row = row
        self.chips = int(row["chips"])
        batch = _batch(row)
        self.global_batch = batch if batch is not None else 1.0
        v = row.get(column)
        self.value = None if v is None or v != v else float(v)


def _lines(frame) -> list[tuple[str, str, object]]:
    """(chip, line label, rows sorted by chips): one line per chip type and setting; points of one setting at the
    same chip count (e.g. v5p-16 and 2 x v5p-8) are split by slice count, then by topology."""
    out = []
    for (chip, settings), g in frame.groupby(["chip", "settings"], sort=False):
        parts = [(settings, g)]
        for split in ("num_slices", "label"):
            if all(p["chips"].is_unique for _, p in parts):
                break
            parts = [(f"{name}, {split.replace('num_', '')} {v}" if split == "num_slices" else f"{name}, {v}", p)
                     for name, q in parts for v, p in q.groupby(split, sort=False)]
        out += [(chip, name, p.sort_values("chips")) for name, p in parts]
    return out


def read(page: Page, directory: Path) -> None:
    import pandas as pd

    try:
        frame = pd.read_csv(directory / "results.csv")
    except (OSError, ValueError) as e:  # pandas' parser errors are ValueErrors
        raise MaxperfError(f"{directory / 'results.csv'} is not a readable table ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); run the sweep again to "
                           "rewrite it") from None
    if not {"point", "status", "model"} <= set(frame.columns):
        raise MaxperfError(f"{directory / 'results.csv'} lacks a sweep's columns (point, status, model); run "
                           "the sweep again to rewrite it")
    # the table and sweep.json are written together: rows that disagree with its count, or a row cut short (no
    # status), are a damaged table
    summary = read_json(directory / "sweep.json")
    counted = summary.get("points") if isinstance(summary, dict) else None
    statuses = set(frame["status"].dropna())
    if (isinstance(counted, int) and counted != len(frame)) or frame["status"].isna().any() \
            or not statuses <= {"ok", "does not fit", "error"}:
        raise MaxperfError(f"{directory / 'results.csv'} holds {len(frame)} rows"
                           + (f" where sweep.json counts {counted}" if isinstance(counted, int) else "")
                           + (", some cut short" if frame["status"].isna().any()
                              or not statuses <= {"ok", "does not fit", "error"} else "")
                           + ": the table is damaged; run the sweep again to rewrite it")
    for artifact in frame["artifact"].dropna() if "artifact" in frame else []:
        manifest = read_json(Path(artifact) / "manifest.json")
        if manifest and not page.versions:
            page.versions = manifest.get("versions", {})
    model = frame["model"].iloc[0] if len(frame) else "?"
    s = Section(f"scaling: {model} ({directory})", "scaling")
    has_chips = {"chips", "chip", "topology"} <= set(frame.columns)
    if has_chips:
        frame = frame.assign(
            label=[topology_label(t, None if n != n else int(n)) for t, n in
                   zip(frame["topology"], frame["num_slices"] if "num_slices" in frame else [1] * len(frame))],
            settings=[o if isinstance(o, str) and o else "defaults" for o in
                      (frame["overrides"] if "overrides" in frame else [""] * len(frame))])
    ok = frame[frame["status"] == "ok"] if has_chips else frame.iloc[0:0]
    s.headline = _headline(model, frame, ok)
    if isinstance(summary, dict) and summary.get("partial"):  # interrupted: the points not reached are not here
        s.headline = "(partial: the sweep was interrupted before all its points) " + s.headline
        s.notes.append("the sweep was interrupted: this page shows the points that finished; running the same "
                       "sweep again finishes the others and keeps these")
    fitting = (frame["status"] == "ok").sum()
    s.verdict = ("fits" if len(frame) and fitting == len(frame) else "does not fit" if len(frame) and fitting == 0
                 else "")  # some points fit and some do not: neither colour
    s.facts = [("points", str(len(frame))), ("finished and fit", str(len(ok))),
               ("chip types", ", ".join(map(str, frame["chip"].unique())) if has_chips else "")]
    if len(ok):
        s.facts.append(("scaling", "within one chip type only: a panel per chip, a line per setting; the dashed "
                                   "line is linear scaling from the line's fewest chips"))
        for title, column, ylabel, ideal in METRICS:
            _metric(page, s, ok, title, column, ylabel, ideal)
    if has_chips and "analytical_memory_bytes" in frame and frame["analytical_memory_bytes"].notna().any():
        _memory(page, s, frame[frame["analytical_memory_bytes"].notna()])
    if len(ok):
        _efficiency(page, s, ok)
    failed = frame[frame["status"] != "ok"]
    if len(failed):
        s.tables.append(page.table("points that failed or do not fit", ["point", "topology", "status", "reason"], [
            [r["point"], r.get("label"), r["status"], r["reason"]] for _, r in failed.iterrows()]))
    shown = [c for c in frame.columns if c not in HIDDEN_COLUMNS and c not in ("label", "settings")]
    # an empty cell (no reason, no warnings) as empty, not pandas' NaN
    s.tables.append(page.table("all points", shown, frame[shown].astype(object).where(frame[shown].notna(), "")
                               .values.tolist()))
    page.sections.append(s)


def _headline(model: str, frame, ok) -> str:
    if not len(frame):
        return f"{model}: the sweep has no points."
    counts = frame["status"].value_counts()
    line = (f"{model}, {len(frame)} points: {counts.get('ok', 0)} fit, {counts.get('does not fit', 0)} do not fit"
            + (f", {counts.get('error', 0)} failed" if counts.get("error", 0) else ""))
    if len(ok) and ok["predicted_mfu"].notna().any():
        best = ok.loc[ok["predicted_mfu"].idxmax()]
        line += (f"; highest predicted MFU {percent(best['predicted_mfu'])} on {best['label']} ({best['settings']}),"
                 f" step {seconds(best['predicted_step_time_s'])}, bound by {best.get('bottleneck')}")
    return line + "."


def _metric(page: Page, s: Section, ok, title: str, column: str, ylabel: str, ideal) -> None:
    panels, rows = {}, []
    for chip, name, g in _lines(ok):
        points = [_Point(r, column) for _, r in g.iterrows()]
        known = [p for p in points if p.value is not None]
        panel = panels.setdefault(chip, figures.Panel(str(chip)))
        panel.lines.append((name, [p.chips for p in points], [p.value for p in points]))
        base = known[0] if known else None
        ideals = [ideal(base, p) if base else None for p in points]
        if base and len(known) > 1:
            panel.ideal[name] = ([p.chips for p in points], ideals)
        rows += [[chip, name, p.row["label"], p.chips, int(p.global_batch), p.value, i if len(known) > 1 else None]
                 for p, i in zip(points, ideals)]
    svg = figures.panels(list(panels.values()), xlabel="chips", ylabel=ylabel,
                         alt=f"Predicted {title} against chips, one panel per chip type, with linear scaling dashed")
    s.figures.append((svg, page.table(f"{title} against chips", ["chip", "settings", "topology", "chips",
                                                                "global batch", title, "ideal"], rows)))


def _memory(page: Page, s: Section, frame) -> None:
    panels, rows = {}, []
    compiled = "compiler_memory_bytes" in frame and frame["compiler_memory_bytes"].notna().any()
    for chip, name, g in _lines(frame):
        # each point's own device memory (a CPU device's is its share of the host's, less with more devices); the
        # panel's line the least of them
        each = ([None if v != v else float(v) for v in g["hbm_bytes"]] if "hbm_bytes" in g
                else [None] * len(g))
        hbm = min((v for v in each if v), default=None)
        panel = panels.setdefault(chip, figures.Panel(str(chip)))
        if hbm and (panel.limit is None or hbm / GIB < panel.limit[0]):
            panel.limit = (hbm / GIB, f"{chip} HBM {hbm / GIB:.1f} GiB")
        chips = [int(c) for c in g["chips"]]
        analytical = [None if v != v else v / GIB for v in g["analytical_memory_bytes"]]
        panel.lines.append((f"analytical, {name}", chips, analytical))
        compiler = [None if v != v else v / GIB for v in g["compiler_memory_bytes"]] if compiled else [None] * len(g)
        if compiled:
            panel.lines.append((f"compiler, {name}", chips, compiler))
        for (_, r), c, a, x, own in zip(g.iterrows(), chips, analytical, compiler, each):
            fits = r.get("fits") if r.get("fits") == r.get("fits") else r.get("analytical_fits")
            if fits is False or r["status"] == "does not fit":
                panel.over.append((c, x if x is not None else a))
            rows.append([chip, name, r["label"], c, a, x, None if own is None else own / GIB,
                         "does not fit" if r["status"] == "does not fit" else "fits" if r["status"] == "ok"
                         else r["status"]])
    svg = figures.panels(list(panels.values()), xlabel="chips", ylabel="GiB per device", from_zero=True,
                         alt="Memory per device against chips, one panel per chip type, each with its own HBM")
    s.figures.append((svg, page.table("memory per device against chips", [
        "chip", "settings", "topology", "chips", "analytical (GiB)", "compiler (GiB)", "HBM (GiB)", "verdict"], rows)))


def _efficiency(page: Page, s: Section, ok) -> None:
    rows = []
    for chip, name, g in _lines(ok):
        base = g.iloc[0]

        def batch(r):
            v = _batch(r)
            return None if v is None else round(v)

        def rate(r):
            v = r.get("predicted_tokens_per_s")
            return None if v is None or v != v else float(v)

        rows.append([chip, name, base["label"], int(base["chips"]), "(the base)", batch(base), None, None])
        for _, r in g.iloc[1:].iterrows():
            n = r["chips"] / base["chips"]
            weak = rate(r) / (rate(base) * n) if rate(r) and rate(base) else None
            strong = (base["predicted_step_time_s"] / (r["predicted_step_time_s"] * n)
                      if batch(r) is not None and batch(r) == batch(base) else None)
            rows.append([chip, name, r["label"], int(r["chips"]), base["label"], batch(r), weak, strong])
    columns = ["chip", "settings", "topology", "chips", "against", "global batch", "weak-scaling efficiency",
               "strong-scaling efficiency (same global batch only)"]
    if all(row[-1] is None for row in rows):  # the batch grows with the chips: no strong scaling to show
        rows, columns = [row[:-1] for row in rows], columns[:-1]
        s.notes.append("strong-scaling efficiency compares steps of one global batch on more chips; this sweep's "
                       "global batch grows with the chips (a per-device batch), so only weak scaling is shown")
    s.tables.append(page.table("scaling efficiency against the fewest chips of the same chip and settings", columns,
                               rows))
