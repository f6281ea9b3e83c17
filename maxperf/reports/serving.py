"""Sections of the serving artifacts: a `plan --step decode` directory (its winner and the Pareto curve of time per
output token against tokens/s per chip), a `compile --step prefill|decode` directory and its `run`."""

from __future__ import annotations

import json
from pathlib import Path

from maxperf.reports import figures
from maxperf.reports.page import GIB, Page, Section, read_json
from maxperf.spec.errors import MaxperfError

PLAN_SCHEMA = "maxperf.serving-plan/1"
RUN_SCHEMA = "maxperf.serving-run/1"
STEPS = ("prefill", "decode")


def is_serving(kind: str, directory: Path) -> bool:
    """Whether a compile, run or plan directory holds a serving step's (a file that cannot be read is left to the
    section that reads it, which says what is wrong)."""
    name, key, wanted = {"plan": ("plan.json", "schema", (PLAN_SCHEMA,)),
                         "run": ("run.json", "schema", (RUN_SCHEMA,))}.get(kind, ("manifest.json", "step", STEPS))
    try:
        data = read_json(directory / name)
    except MaxperfError:
        return False
    return isinstance(data, dict) and data.get(key) in wanted


def _curve(layouts: list[dict], front: list[dict], winner: dict | None, bound_ms: float | None) -> str:
    plt = figures._pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    ax.scatter([x["tpot_s"] * 1e3 for x in layouts], [x["tokens_per_s_per_chip"] for x in layouts], s=8,
               alpha=0.35, color="#7f7f7f", label="ranked layouts")
    ax.plot([x["tpot_s"] * 1e3 for x in front], [x["tokens_per_s_per_chip"] for x in front], "-o", color="#1f77b4",
            markersize=4, label="Pareto front")
    if winner is not None:
        ax.scatter([winner["tpot_s"] * 1e3], [winner["tokens_per_s_per_chip"]], s=140, marker="*", color="#d62728",
                   zorder=5, label="chosen")
    if bound_ms is not None:
        ax.axvline(bound_ms, color="black", linestyle="--", linewidth=1)
        ax.text(bound_ms, 0, " bound", va="bottom", fontsize=8)
    ax.set_xlabel("time per output token (ms, predicted)")
    ax.set_ylabel("output tokens/s per chip (predicted)")
    ax.legend(fontsize=8, loc="upper left")
    alt = (f"time per output token against tokens/s per chip: {len(front)} layouts on the Pareto front, "
           f"{len(layouts)} ranked" + ("; the chosen one marked" if winner else ""))
    return figures.to_svg(fig, alt)


def read_plan(page: Page, directory: Path) -> None:
    data = read_json(directory / "plan.json")
    if data is None or data.get("schema") != PLAN_SCHEMA:
        raise MaxperfError(f"{directory / 'plan.json'} is not a {PLAN_SCHEMA} document; run `maxperf plan` again")
    s = Section(f"serving plan: {data['model']} decode on {data['topology']} ({directory})", "plan")
    w = data.get("winner")
    if w:
        s.headline = (f"chosen: {w['mesh']}, {w['batch']} sequences, {w['quantization']} weights"
                      + (", int8 cache" if w["kv_int8"] else "") + f": {w['tpot_s'] * 1e3:.3g} ms per output token, "
                      f"{w['tokens_per_s_per_chip']:,.0f} tokens/s per chip, time to first token "
                      f"{w['ttft_s'] * 1e3:.3g} ms")
        s.verdict = "fits"
    else:
        s.headline = "no layout meets the bounds"
        s.verdict = "does not fit"
    bounds = data["bounds"]
    s.facts = [("devices", str(data["devices"])),
               ("bounds", ", ".join(f"{k.replace('_s', '').replace('_', ' ')} {v * 1e3:g} ms"
                                    for k, v in bounds.items() if v) or "none"),
               ("layouts", f"{data['candidates']:,} priced, {data['fitting']:,} fit, {data['meeting']:,} meet the "
                           "bounds"),
               ("search", f"{data['search_seconds']:.2f} s analytical (perfmodel.serving)")]
    if w:
        s.facts.append(("maxperf", w["compile"]))
    front = data["pareto"]
    if front:
        svg = _curve(data["top"], front, w, (bounds.get("max_time_per_token_s") or 0) * 1e3 or None)
        s.figures.append((svg, page.table("Pareto front: time per output token against tokens/s per chip", [
            "mesh", "sequences", "weights", "int8 cache", "ms/token", "TTFT ms", "tokens/s/chip", "memory GiB"],
            [[x["mesh"], x["batch"], x["quantization"], x["kv_int8"], round(x["tpot_s"] * 1e3, 3),
              round(x["ttft_s"] * 1e3, 3), round(x["tokens_per_s_per_chip"]), round(x["memory_bytes"] / GIB, 3)]
             for x in front])))
    s.tables.append(page.table("layouts meeting the bounds, best first", [
        "mesh", "sequences", "weights", "int8 cache", "ms/token", "TTFT ms", "tokens/s/chip", "memory GiB", "bound"],
        [[x["mesh"], x["batch"], x["quantization"], x["kv_int8"], round(x["tpot_s"] * 1e3, 3),
          round(x["ttft_s"] * 1e3, 3), round(x["tokens_per_s_per_chip"]), round(x["memory_bytes"] / GIB, 3),
          x["bottleneck"]] for x in data["top"]]))
    page.sections.append(s)


# What the page reads of a serving run.json, and what each field must be when present (null is always allowed).
RUN_FIELDS = {**dict.fromkeys(("steps", "devices", "batch", "step_time_s", "step_time_min_s", "tokens_per_s",
                                "tokens_per_s_per_chip", "predicted_step_time_s", "measured_over_predicted",
                                "hlo_predicted_step_time_s", "measured_over_hlo_predicted"), "a number >= 0"),
              "step_times_s": "a list of numbers", "artifact": "a string", "device_kind": "a string"}


def _run_json(directory: Path) -> dict:
    """A serving run.json, refused in one line where a field the page reads is of the wrong form or its steps are
    missing."""
    from maxperf.aot.artifacts import ArtifactError
    from maxperf.reports.steps import _fits

    path = directory / "run.json"
    run = read_json(path) or {}
    for name, what in RUN_FIELDS.items():
        if run.get(name) is not None and not _fits(run[name], what):
            raise ArtifactError(f"{path}: {name!r} should be {what}, not {json.dumps(run[name])[:60]}; the run "
                                "directory is damaged: run the step again")
    if not run.get("step_times_s") or run.get("step_time_s") is None:
        raise ArtifactError(f"{path} holds no measured steps; the run directory is damaged: run the step again")
    return run


def read_step(page: Page, kind: str, directory: Path) -> dict | None:
    """A serving compile directory, or its run (run.json beside or inside it), its artifact's files checked against
    their sha256 as for the train step's. Returns its figures for a side-by-side table (`compare_section`), None
    for a step the compiler refused."""
    from maxperf.reports.steps import _artifact_of, _verified_manifest

    run = _run_json(directory) if kind == "run" else None
    artifact = _artifact_of(run, directory) if run else directory
    manifest = _verified_manifest(artifact) if (artifact / "manifest.json").is_file() or not run else {}
    # a compile written into the run's compile directory since it ran is another step (as for the train step's)
    replaced = bool(run and manifest and run.get("artifact_sha256")
                    and manifest.get("files", {}).get("compiled.pkl") != run["artifact_sha256"])
    if replaced:
        manifest = {}
    estimate = {} if replaced else read_json(artifact / "estimate.json") or {}
    memory = {} if replaced else read_json(artifact / "memory.json") or {}
    step = manifest.get("step") or (run or {}).get("step")
    model = manifest.get("model", {}).get("name") or (run or {}).get("model") or "?"
    topology = manifest.get("topology", {}).get("name") or (run or {}).get("topology") or "?"
    s = Section(f"{step}: {model} on {topology} ({directory})", kind)
    if memory.get("per_device_total_bytes"):
        s.verdict = "fits" if memory.get("fits") else "does not fit"
    if memory and not memory.get("fits") and not manifest.get("compiled", True):
        # a compile the compiler refused: no executable, no prediction; what it needed instead
        total, hbm = memory.get("per_device_total_bytes"), memory.get("hbm_bytes")
        s.verdict = "does not fit"
        s.headline = (f"DOES NOT FIT: needs {total / GIB:.2f} GiB per device of {hbm / GIB:.2f} GiB (over by "
                      f"{(total - hbm) / GIB:.2f} GiB)" if total and hbm else "DOES NOT FIT (the compiler's verdict)")
        if memory.get("compiler_message"):
            s.facts.append(("compiler", memory["compiler_message"]))
        page.sections.append(s)
        return None
    if replaced:
        s.headline = "no prediction shown"
        s.notes.append(f"the compile directory this run ran ({run.get('artifact')}) holds another compile now (its "
                       "compiled.pkl is not the executable this run measured): only what run.json holds is shown")
    elif step == "decode":
        s.headline = (f"predicted {estimate.get('time_per_output_token_s', 0) * 1e3:.3g} ms per output token, "
                      f"{estimate.get('tokens_per_s_per_chip', 0):,.0f} tokens/s per chip")
    else:
        s.headline = f"predicted {estimate.get('prefill', {}).get('seconds', 0) * 1e3:.3g} ms for the batch's prompts"
    if run:
        s.headline += (f"; measured {run['step_time_s'] * 1e3:.3g} ms on {run['devices']} {run['device_kind']} "
                       f"(measured/predicted {run['measured_over_predicted']:.2f})"
                       if run.get("measured_over_predicted") else "")
    if estimate.get("memory"):
        m = estimate["memory"]
        compiled = (memory.get("per_device_total_bytes") or 0) / GIB
        s.facts += [("memory/device", f"{compiled:.2f} GiB compiled, {m['total_bytes'] / GIB:.2f} GiB analytical "
                                      f"(weights {m['weights_bytes'] / GIB:.2f}, cache {m['cache_bytes'] / GIB:.2f}) "
                                      f"of {m['hbm_bytes'] / GIB:.2f} GiB"),
                    ("batch", f"{estimate['batch']} sequences, prompt {estimate['prompt_tokens']}, cache "
                              f"{estimate['cache_positions']} positions"),
                    ("time to first token", f"{estimate['ttft_s'] * 1e3:.3g} ms (one prompt)"),
                    ("largest batch", f"{estimate['max_batch_per_device']:.4g} sequences per device fit")]
    if (hlo := estimate.get("hlo_time")) is not None:
        s.facts.append(("read from the HLO", f"{hlo['step_time_s'] * 1e3:.3g} ms per step"))
    if run:
        s.tables.append(page.table("measured steps", ["step", "seconds"],
                                   [[i, t] for i, t in enumerate(run["step_times_s"])]))
    page.sections.append(s)
    m = estimate.get("memory") or {}
    predicted = (estimate.get("time_per_output_token_s") if step == "decode"
                 else estimate.get("prefill", {}).get("seconds"))
    return {"label": f"{step}: {model} on {topology}", "directory": str(directory), "section": s, "figures": {
        "step": step, "model": model, "topology": topology, "batch (sequences)": estimate.get("batch"),
        "prompt tokens": estimate.get("prompt_tokens"), "cache positions": estimate.get("cache_positions"),
        "predicted ms a step": None if predicted is None else predicted * 1e3,
        "tokens/s per chip (predicted)": estimate.get("tokens_per_s_per_chip"),
        "time to first token ms (predicted)": None if estimate.get("ttft_s") is None else estimate["ttft_s"] * 1e3,
        "measured ms a step": None if not run or run.get("step_time_s") is None else run["step_time_s"] * 1e3,
        "measured / predicted": (run or {}).get("measured_over_predicted"),
        "memory/device GiB (compiler)": (memory.get("per_device_total_bytes") or 0) / GIB or None,
        "memory/device GiB (analytical)": m["total_bytes"] / GIB if m.get("total_bytes") else None,
        "largest batch per device": estimate.get("max_batch_per_device")}}


def compare_section(page: Page, steps: list[dict]) -> None:
    """Two or more serving steps side by side: their settings, predicted and measured times and memory, and the
    ratio of the last to the first."""
    columns = ["figure", *[f"{chr(ord('A') + i)}: {st['label']}" for i, st in enumerate(steps)],
               "ratio last / first"]
    rows = []
    for key in steps[0]["figures"]:
        values = [st["figures"].get(key) for st in steps]
        first, last = values[0], values[-1]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (first, last))
        rows.append([key, *values, last / first if numeric and first else None])
    rows.append(["directory", *[st["directory"] for st in steps], None])
    s = Section("serving steps compared", "comparison", headline=f"{len(steps)} serving steps side by side",
                tables=[page.table("serving steps side by side", columns, rows)])
    page.sections.insert(page.sections.index(steps[0]["section"]), s)  # the comparison before the details
