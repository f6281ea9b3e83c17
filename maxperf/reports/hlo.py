"""The step time read from the compiled program (estimate.json's `hlo_time`, maxperf.aot.hlo_time) on a compile's or
run's section: the total and its parts beside the analytical prediction where there is one, and the instructions
that take the most time."""

from __future__ import annotations

from maxperf.reports import figures
from maxperf.reports.page import Page, Section

TOP = 12  # instructions listed


def section(page: Page, s: Section, hlo: dict, analytical_s: float | None, label: str) -> None:
    step = hlo.get("step_time_s")
    rows = [["step time", step], ["compute (matmuls and kernels bound by FLOPs)", hlo.get("compute_s")],
            ["memory-bound work", hlo.get("hbm_s")], ["collectives inside a slice or NVLink domain", hlo.get("ici_s")],
            ["collectives across slices or hosts", hlo.get("dcn_s")], ["host copies", hlo.get("host_s")],
            ["exposed (not hidden behind compute)", hlo.get("exposed_s")]]
    if analytical_s:
        rows.append(["analytical step time", analytical_s])
        rows.append(["read from the HLO / analytical", step / analytical_s if step else None])
    s.tables.append(page.table("step time read from the compiled program (s)", ["part", "seconds"], rows,
                               emphasis={0}))
    kinds = hlo.get("by_kind") or {}
    if kinds:
        names = list(kinds)
        svg = figures.grouped_bars(names, {"seconds per step (before overlap)": [kinds[k] for k in names]},
                                   unit="seconds per step",
                                   alt=f"Step time of {label} read from its optimized HLO, by kind of instruction")
        s.figures.append((svg, page.table("step time read from the HLO by kind of instruction",
                                          ["kind", "seconds (before overlap)"], [[k, kinds[k]] for k in names])))
    top = hlo.get("top") or []
    if top:
        rows = [[op.get("name"), op.get("kind"), op.get("bound"), op.get("executions"), op.get("seconds"),
                 op["seconds"] / step if step and op.get("seconds") is not None else None, op.get("source")]
                for op in top[:TOP]]
        s.tables.append(page.table("instructions taking the most time (read from the HLO)",
                                   ["instruction", "kind", "bound by", "runs per step", "seconds per step",
                                    "share of the step", "from"], rows))
    s.facts.append(("step time from the HLO", f"{step:.4g} s, bound by {hlo.get('bottleneck')} ({hlo.get('source')})"
                    if step is not None else "not read"))
    s.notes += [f"HLO step time: {line}" for line in (hlo.get("not_modelled") or [])]
