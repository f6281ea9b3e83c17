"""The section of one `maxperf plan` directory (plan.json): the winner, a Pareto plot of memory per device against
tokens/s over the candidates that fit (the chosen one marked), the ranked table and why the others were rejected."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from maxperf.reports import figures
from maxperf.reports.page import GIB, Page, Section, percent, read_json, seconds, topology_label
from maxperf.spec.errors import MaxperfError

SCHEMA = "maxperf.plan/2"
RANKED_ROWS = 25  # rows of the ranked table on the page (the CSV beside it holds the same)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other beats on both axes (less memory, more tokens/s), by memory ascending."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def _memory(c: dict) -> float:
    return c["compiler_memory_bytes"] if c.get("compiler_memory_bytes") is not None else c["analytical_memory_bytes"]


def _scatter(fit: list[dict], chosen: dict | None, front: list[int], hbm: float, objective: str) -> str:
    plt = figures._pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    xs, ys = [_memory(c) / GIB for c in fit], [c["tokens_per_s"] for c in fit]
    ax.scatter(xs, ys, s=8, alpha=0.35, color="#7f7f7f", label="fits")
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "-o", color="#1f77b4", markersize=4,
            label="Pareto front")
    if chosen is not None:
        ax.scatter([_memory(chosen) / GIB], [chosen["tokens_per_s"]], s=140, marker="*", color="#d62728",
                   zorder=5, label="chosen")
    ax.axvline(hbm / GIB, color="black", linestyle="--", linewidth=1)
    ax.text(hbm / GIB, min(ys), " HBM", va="bottom", fontsize=8)
    ax.set_xlabel("memory per device (GiB)")
    ax.set_ylabel("tokens/s (predicted)")
    ax.legend(fontsize=8, loc="upper left")
    alt = (f"memory per device against predicted tokens/s for {len(fit)} candidates that fit; "
           f"{len(front)} on the Pareto front; the chosen one ({objective}) marked")
    return figures.to_svg(fig, alt)


def read(page: Page, directory: Path) -> None:
    data = read_json(directory / "plan.json")
    if data is None or data.get("schema") != SCHEMA:
        raise MaxperfError(f"{directory / 'plan.json'} is not a {SCHEMA} document; run `maxperf plan` again")
    cands = data["candidates"]
    chosen = cands[data["chosen"]] if data.get("chosen") is not None else None
    fit = [c for c in cands if c["status"] in ("chosen", "slower") and c["step_time_s"] > 0]
    s = Section(f"plan: {data['model']} on {topology_label(data['topology'], data['num_slices'])} ({directory})",
                "plan")
    if chosen is not None:
        proof = "compiled and fits" if chosen["verified"] else "not compiled"
        s.headline = (f"chosen: {chosen['mesh']}, remat {chosen['remat_policy']}, {chosen['attention']}, "
                      f"B={chosen['per_device_batch_size']:g} A={chosen['grad_accum_steps']}: "
                      f"{seconds(chosen['step_time_s'])} per step, {chosen['tokens_per_s']:,.0f} tokens/s, MFU "
                      f"{percent(chosen['mfu'])} ({proof})")
        s.verdict = "fits"
    else:
        s.headline = "no candidate fits"
        s.verdict = "does not fit"
    n = data["counts"]
    s.facts = [("objective", data["objective"]), ("devices", str(data["devices"])),
               ("global batch", f"{data['global_batch_rows']} x {data['seq_len']} tokens"
                if data.get("global_batch_rows") else f"L={data['seq_len']}, per-device batch searched"),
               ("candidates", f"{n['enumerated']:,} enumerated, {n['indivisible']:,} indivisible, "
                              f"{n['does_not_fit']:,} do not fit, {n['fit']:,} fit and ranked"),
               ("memory margin", f"{data['margin']['value']:.1%}: {data['margin']['source']}"),
               ("search", f"{data['search_seconds']:.2f} s analytical" + (
                   f"; {n['compiled']} compiled in {data['verify_seconds']:.0f} s" if n["compiled"] else ""))]
    if data.get("command"):
        s.facts += [("maxperf", data["command"]["maxperf"]),
                    ("MaxText", data["command"]["maxtext"] or data["command"].get("maxtext_note", ""))]
    if fit:
        points = [(_memory(c), c["tokens_per_s"]) for c in fit]
        front = pareto(points)
        svg = _scatter(fit, chosen, front, data["hbm_bytes"], data["objective"])
        s.figures.append((svg, page.table("Pareto front: memory per device against tokens per second", [
            "mesh", "remat", "kernel", "B", "A", "memory GiB", "tokens/s", "chosen"],
            [[fit[i]["mesh"], fit[i]["remat_policy"], fit[i]["attention"], fit[i]["per_device_batch_size"],
              fit[i]["grad_accum_steps"], round(points[i][0] / GIB, 3), round(points[i][1]),
              fit[i] is chosen] for i in front])))
    ranked = [c for c in cands if c["status"] in ("chosen", "slower") and c["step_time_s"] > 0][:RANKED_ROWS]
    s.tables.append(page.table("ranked candidates", [
        "mesh", "remat", "kernel", "B", "A", "step s", "tokens/s", "MFU", "memory GiB", "memory from", "bottleneck",
        "verified", "status"],
        [[c["mesh"], c["remat_policy"], c["attention"], c["per_device_batch_size"], c["grad_accum_steps"],
          c["step_time_s"], round(c["tokens_per_s"]), round(c["mfu"], 4), round(_memory(c) / GIB, 3),
          "compiler" if c.get("compiler_memory_bytes") is not None else "analytical", c["bottleneck"],
          c["verified"], c["status"]] for c in ranked],
        emphasis={i for i, c in enumerate(ranked) if c is chosen}))
    # the groups of candidates left out whole: their parameters and optimizer state alone do not fit
    state_alone = ("does not fit", "parameters and optimizer state alone over HBM")
    reasons = {state_alone: len({p["mesh"] for p in data["pruned"]})} if data["pruned"] else {}
    counted = Counter()
    for p in data["pruned"]:
        counted[state_alone] += p["candidates"]
    for c in cands:
        if c["status"] == "does not fit":
            why = "compiler: does not fit" if c["verified"] is False else (
                "keeps more than a policy that does not fit" if c["reason"].startswith("keeps") else
                "analytical memory with the margin over HBM")
            counted[("does not fit", why)] += 1
        elif c["status"] == "compile failed":
            counted[("compile failed", c["reason"][:120])] += 1
        elif c["status"] == "slower":  # the search's skips (not timed), then those timed and ranked below
            reason = c["reason"]
            counted[("slower", "more accumulation than needed" if reason.startswith("A=") else
                     "a smaller batch than one that fits" if reason.startswith("B=") else
                     "another remat policy keeps more and fits" if reason.startswith("remat_policy=") else
                     "fits, lower objective")] += 1
    s.tables.append(page.table("rejections by reason", ["status", "reason", "candidates", "meshes"],
                               [[k[0], k[1], v, reasons.get(k, "")] for k, v in counted.most_common(20)]))
    if data.get("closest_miss"):
        miss = data["closest_miss"]
        s.notes.append(f"closest miss: {miss['candidate']['mesh']} needs {miss['memory_with_margin_bytes'] / GIB:.2f} "
                       f"GiB of {miss['hbm_bytes'] / GIB:.2f} GiB; " + "; ".join(miss["would_need"]))
    s.notes += data.get("notes", [])
    page.sections.append(s)
