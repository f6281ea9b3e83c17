"""The section of one compile or run directory: the answer in one line, the predicted step (time by kind, memory by
phase against HBM) and, for a run, what was measured (step times, losses, profile, checkpoint) beside it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxperf.reports import figures, hlo
from maxperf.reports import memory as parts
from maxperf.reports.page import GIB, MIB, Page, Section, gib, percent, read_json, seconds, size, topology_label

# Profile categories (profiler.trace_summary.category) against the perfmodel kinds they correspond to. The
# profile files elementwise fusions under compute where the model may call them memory-bound (hbm): the first row
# adds both sides' on-chip work so that this split cannot mislead on its own.
COMPONENTS = (("compute", ("compute",), ("compute",)), ("memory-bound", ("hbm",), ("memory",)),
              ("collectives", ("ici", "dcn"), ("collective",)), ("host transfers", ("host",), ()),
              ("other (not attributed)", (), ("other",)))
OTHER_LIMIT = 0.5  # above this share of 'other' time the profile cannot be split into components
RUN_SCHEMA = "maxperf.run/1"


@dataclass
class Step:
    """One compile or run as the comparison needs it."""

    label: str
    settings: dict[str, str]
    config: dict[str, dict[str, str]]  # "model", "train", "parallelism": the configs' values as text
    figures: dict[str, Any]
    section: Section
    directory: Path = field(default=Path("."))


def _overrides(manifest: dict) -> str:
    """The key=value words of the `maxperf compile` command that made the artifact ("" when the Python API did)."""
    command = manifest.get("command", [])
    if "compile" not in command[1:2]:
        return ""
    return " ".join(w for w in command[2:] if "=" in w and not w.startswith("-"))


def _config(manifest: dict) -> dict[str, dict[str, str]]:
    return {part: {k: str(v) for k, v in manifest.get(part, {}).items()} for part in ("model", "train", "parallelism")}


def _artifact_of(run: dict, directory: Path) -> Path:
    """The compile directory a run ran: as recorded, else the default layout DIR/run."""
    recorded = Path(run.get("artifact") or "")
    return recorded if (recorded / "manifest.json").is_file() else directory.parent


def _verified_manifest(directory: Path) -> dict:
    """The compile directory's manifest, once every file it lists matches its sha256: a page never shows an artifact
    that `maxperf run` would refuse as altered or truncated."""
    from maxperf.aot.artifacts import read_manifest, verify_hashes

    manifest = read_manifest(directory)
    verify_hashes(directory, manifest)
    return manifest


# What the page reads of run.json, and what each field must be when present (null is always allowed).
_NUMBER, _TEXT, _OBJECT = "a number >= 0", "a string", "an object"
RUN_FIELDS = {
    **dict.fromkeys(("steps", "warmup", "devices", "processes", "step_time_s", "step_time_p10_s", "step_time_p90_s",
                     "step_time_min_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_flops_per_device",
                     "predicted_step_time_s", "measured_over_predicted"), _NUMBER),
    "step_times_s": "a list of numbers >= 0",
    "losses": "a list of numbers",
    **dict.fromkeys(("memory", "profile", "checkpoint"), _OBJECT),
    **dict.fromkeys(("artifact", "device_kind", "peak_source", "data", "restored_from", "platform", "artifact_sha256",
                     "unit"), _TEXT),
    "notes": "a list of strings",
}
# what every run.json maxperf run writes holds, interrupted or not
RUN_REQUIRED = ("steps", "devices", "device_kind", "step_times_s")


def _fits(value, what: str) -> bool:
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if what == _NUMBER:
        return number(value) and value >= 0
    if what == "a list of numbers":  # losses may be negative: finite numbers only
        return isinstance(value, list) and all(number(v) for v in value)
    if what == "a list of numbers >= 0":
        return isinstance(value, list) and all(number(v) and v >= 0 for v in value)
    if what == "a list of strings":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, dict if what == _OBJECT else str)


def _run_json(directory: Path) -> dict:
    """run.json, refused in one line when it is not a run's or a field the page reads is of the wrong form."""
    from maxperf.aot.artifacts import ArtifactError

    path = directory / "run.json"
    run = read_json(path) or {}
    if run.get("schema") != RUN_SCHEMA:
        raise ArtifactError(f"{path} has schema {json.dumps(run.get('schema'))[:60]}, not {RUN_SCHEMA}; the run "
                            "directory is damaged: run the step again")
    missing = [name for name in RUN_REQUIRED if run.get(name) is None]
    if missing:
        raise ArtifactError(f"{path} lacks {', '.join(missing)}, which every run writes; the run directory is damaged: "
                            "run the step again")
    for name, what in RUN_FIELDS.items():
        if run.get(name) is not None and not _fits(run[name], what):
            raise ArtifactError(f"{path}: {name!r} should be {what}, not {json.dumps(run[name])[:60]}; the run "
                                "directory is damaged: run the step again")
    times = run["step_times_s"]
    if len(times) != run["steps"]:
        raise ArtifactError(f"{path} lists {len(times)} step times for its {run['steps']} timed steps; the run "
                            "directory is damaged: run the step again")
    if times and run.get("step_time_s") is None:
        raise ArtifactError(f"{path} lacks step_time_s, the median of its {len(times)} step times; the run directory "
                            "is damaged: run the step again")
    return run


def read(page: Page, kind: str, directory: Path) -> Step:
    run = _run_json(directory) if kind == "run" else None
    art = _artifact_of(run, directory) if run else directory
    manifest = _verified_manifest(art) if (art / "manifest.json").is_file() else {}
    # a compile written into the run's compile directory since it ran is another step: set aside, as if gone
    replaced = bool(run and manifest and run.get("artifact_sha256")
                    and manifest.get("files", {}).get("compiled.pkl") != run["artifact_sha256"])
    if replaced:
        manifest = {}
    estimate, memory = ({}, {}) if replaced else (read_json(art / "estimate.json") or {}, read_json(art / "memory.json")
                                                 or {})
    # a compile written again into the run's directory with the same executable (a compile-cache hit under another
    # calibration) may predict another step time: its estimate is not the one this run was measured against
    predicted_then = (run or {}).get("predicted_step_time_s")
    restated = bool(predicted_then and estimate.get("step_time_s")
                    and abs(estimate["step_time_s"] / predicted_then - 1) > 1e-6)
    if restated:
        now, estimate = estimate["step_time_s"], {}
    page.versions = page.versions or manifest.get("versions", {})
    topo = manifest.get("topology", {})
    model = manifest.get("model", {}).get("name")
    if manifest:
        where = topology_label(topo.get("name", "?"), topo.get("num_slices"))
    else:  # a run directory moved away from its compile: what run.json says of the devices
        where = f"{run.get('devices', '?')} x {run.get('device_kind', '?')}" if run else "?"
    label = f"{model or 'model unknown'} / {where}"
    train = manifest.get("train", {})
    user = manifest.get("step") if isinstance(manifest.get("step"), dict) else None  # a user's step
    dcn = manifest.get("mesh", {}).get("dcn", {})
    mesh = " x ".join(f"{a}={n}" + (f" ({dcn[a]} over DCN)" if dcn.get(a, 1) > 1 else "")
                      for a, n in manifest.get("mesh", {}).get("axes", {}).items() if n > 1) or "one device"
    settings = {"topology": where, "mesh": mesh if manifest else "",
                "batch": (f"B={train.get('per_device_batch_size')} per device"
                          + (f" x A={train['grad_accum_steps']} microbatches" if train.get("grad_accum_steps", 1) > 1
                             else "") + f", global {manifest.get('global_batch')}" if manifest else ""),
                "sequence": f"L={train.get('seq_len')}" if manifest else "", "directory": str(directory),
                "step": user.get("factory", "") if user else "train",
                "kind": "measured run" if run else "compile"}
    if user:
        settings["batch"] = (f"{user['tokens_per_step']:g} {user.get('unit', 'tokens')} per step"
                             if user.get("tokens_per_step") else "")
        settings["sequence"] = ""
    s = Section(label + (" (measured)" if run else ""), "mfu")
    _facts(s, manifest, topo, where, settings, run)
    verdict = _verdict(estimate, memory, topo, run)
    s.verdict = "" if verdict[0] is None else "fits" if verdict[0] else "does not fit"
    s.headline = _headline(label, verdict[1], estimate, run, manifest)
    if run:  # what was measured first, the prediction's details after it
        _measured(page, s, run, estimate, memory, topo, label)
    if estimate.get("breakdown"):
        _time(page, s, estimate, label)
    if estimate.get("hlo_time"):
        hlo.section(page, s, estimate["hlo_time"], estimate.get("step_time_s") if not user else None, label)
    if estimate.get("memory") or memory:
        _memory(page, s, estimate.get("memory") or {}, memory, topo, label)
    s.notes = list(dict.fromkeys([*s.notes, *(estimate.get("notes") or []), *((run or {}).get("notes") or [])]))
    if manifest and not manifest.get("compiled", True) and not estimate:
        s.notes.append("the step was not compiled (it does not fit), so no step time was predicted for it")
    if restated:
        s.notes.append(f"the compile directory this run ran ({run.get('artifact')}) was compiled again since, its "
                       f"estimate.json predicting {seconds(now)} a step where this run was measured against "
                       f"{seconds(predicted_then)}: only the prediction run.json holds is shown")
    if run and not manifest:
        why = ("holds another compile now (its compiled.pkl is not the executable this run measured)" if replaced
               else "is not there")
        s.notes.append(f"the compile directory this run ran ({run.get('artifact')}) {why}: only what run.json holds "
                       "is shown")
    unit = (user or {}).get("unit") or (run or {}).get("unit") or "tokens"  # a user's step counts its own
    tokens = manifest.get("tokens_per_step")
    if tokens is None and run and run.get("tokens_per_s") and run.get("step_time_s"):
        tokens = round(run["tokens_per_s"] * run["step_time_s"])  # a run away from its compile
    numbers = {"fits": verdict[0], "tokens per step": tokens, "predicted step time (s)": estimate.get("step_time_s")
               or (run or {}).get("predicted_step_time_s"), f"predicted {unit}/s": estimate.get("tokens_per_s"),
               "predicted TFLOP/s per chip": estimate.get("tflops_per_chip"),
               "predicted MFU": predicted_mfu(estimate, run)[0],
               "predicted step time from the HLO (s)": (estimate.get("hlo_time") or {}).get("step_time_s"),
               "analytical memory (GiB)": gib(estimate.get("memory_per_device_bytes")),
               "compiler memory (GiB)": gib(memory.get("per_device_total_bytes")),
               # a compile-cache hit compiled nothing: its seconds are no compile time to rank
               "compile (s)": None if manifest.get("compile_cache_hit") else manifest.get("compile_seconds")}
    if run:
        numbers.update({"measured step time (s)": run.get("step_time_s"), f"measured {unit}/s": run.get("tokens_per_s"),
                        "measured TFLOP/s per device": run.get("tflops_per_device"), "measured MFU": run.get("mfu"),
                        "measured / predicted step time": run.get("measured_over_predicted"),
                        "measured / HLO-predicted step time": run.get("measured_over_hlo_predicted"),
                        "final loss": (run.get("losses") or [None])[-1]})
    page.sections.append(s)
    return Step(label, settings, _config(manifest), numbers, s, directory)


def _facts(s: Section, manifest: dict, topo: dict, where: str, settings: dict, run: dict | None) -> None:
    user = manifest.get("step") if isinstance(manifest.get("step"), dict) else None
    if user:
        args = " ".join(f"{k}={v}" for k, v in (user.get("args") or {}).items())
        per_step = (f"{user['tokens_per_step']:g} {user.get('unit', 'tokens')} per step"
                    if user.get("tokens_per_step") else "not given")
        s.facts += [("step", f"{user.get('factory')}" + (f" ({args})" if args else "")),
                    ("topology", f"{where}: {topo.get('chips')} {topo.get('chip')} chips, {topo.get('devices')} "
                                 f"devices, {topo.get('hosts')} hosts"),
                    ("mesh", settings["mesh"]), ("throughput unit", per_step)]
        if manifest.get("compile_seconds") is not None:
            s.facts.append(("compile", f"{manifest['compile_seconds']:.1f} s"))
    elif manifest:
        s.facts += [("model", manifest.get("model", {}).get("name", "?")),
                    ("topology", f"{where}: {topo.get('chips')} {topo.get('chip')} chips, {topo.get('devices')} "
                                 f"devices, {topo.get('hosts')} hosts"),
                    ("mesh", settings["mesh"]), ("batch", f"{settings['batch']} x {settings['sequence']}"),
                    ("remat", str(manifest.get("train", {}).get("remat_policy"))),
                    ("attention", str(manifest.get("train", {}).get("attention")))]
        if _overrides(manifest):
            s.facts.append(("overrides", _overrides(manifest)))
        if manifest.get("compile_seconds") is not None:
            s.facts.append(("compile", f"{manifest['compile_seconds']:.1f} s"))
    if run:
        s.facts += [("measured on", f"{run.get('devices')} {run.get('device_kind')} device(s), "
                                    f"{run.get('processes')} process(es)"),
                    ("steps", f"{run.get('steps')} timed after {run.get('warmup')} warm-up, data: {run.get('data')}"
                              + ("; PARTIAL: the run was interrupted, and these are the steps it finished"
                                 if run.get("partial") else "")),
                    ("peak FLOP/s from", str(run.get("peak_source")))]
        if run.get("restored_from"):
            s.facts.append(("restored from", run["restored_from"]))
    s.facts.append(("directory", settings["directory"]))


def _verdict(estimate: dict, memory: dict, topo: dict, run: dict | None) -> tuple[bool | None, str]:
    """(fits, in words): the compiler's figures where there are some, else the analytical ones."""
    cpu = topo.get("platform") == "cpu"
    if memory.get("per_device_total_bytes") is not None:
        total, hbm, fits, source = (memory["per_device_total_bytes"], memory.get("hbm_bytes"), memory.get("fits"),
                                    "compiler")
    elif estimate.get("memory_per_device_bytes") is not None:
        total, hbm, fits, source = (estimate["memory_per_device_bytes"], estimate.get("memory", {}).get("hbm_bytes"),
                                    estimate.get("fits"), "analytical")
    elif (run or {}).get("memory", {}).get("measured_peak_bytes") is not None:  # it ran, so it fit
        return True, f"ran in {size(run['memory']['measured_peak_bytes'])} per device at its peak (measured)"
    else:
        return None, "memory not known"
    of = f" of {size(hbm)}" if hbm else ""
    if fits is False:
        over = f", {size(total - hbm)} over" if hbm else ""
        return False, (f"DOES NOT FIT: needs {size(total)} per device{of}{over} ({source}"
                       + ("; CPU: a device's share of host memory)" if cpu else ")"))
    if cpu:
        return fits, f"{size(total)} per device ({source}; CPU: host memory{of})"
    return fits, f"fits: {size(total)} per device{of} ({source})"


def predicted_mfu(estimate: dict, run: dict | None) -> tuple[float | None, str | None]:
    """The predicted MFU on the measured one's peak, and a note where that is not the prediction's own: a run on a
    calibrated CPU measures against the calibration's peak, an older compile's prediction may stand on the
    defaults'."""
    mfu, their_peak = estimate.get("mfu"), estimate.get("peak_flops")
    run_peak = (run or {}).get("peak_flops_per_device")
    if mfu is None or not run_peak or not their_peak or abs(their_peak / run_peak - 1) <= 0.01:
        return mfu, None
    return mfu * their_peak / run_peak, (
        f"the predicted MFU is taken against the run's peak ({run_peak / 1e12:.4g} TFLOP/s per device, "
        f"{run.get('peak_source') or 'as run.json gives it'}), not the prediction's ({their_peak / 1e12:.4g})")


def _headline(label: str, verdict: str, estimate: dict, run: dict | None, manifest: dict) -> str:
    predicted = estimate.get("step_time_s") or (run or {}).get("predicted_step_time_s")
    if predicted is None:
        step = "no step time: the step was not compiled" if manifest and not manifest.get("compiled", True) else \
            "no predicted step time"
    else:
        step = f"step {seconds(predicted)} predicted"
    if run and run.get("step_time_s") is not None:
        ratio = run.get("measured_over_predicted")
        step += (f", {seconds(run['step_time_s'])} measured" + (f" ({ratio:.2f}x predicted)" if ratio else "")
                 + (f" (partial: interrupted after {run.get('steps')} timed steps)" if run.get("partial") else ""))
    mfu = []
    if (predicted_mfu_value := predicted_mfu(estimate, run)[0]) is not None:
        mfu.append(f"{percent(predicted_mfu_value)} predicted")
    if run and run.get("mfu") is not None:
        mfu.append(f"{percent(run['mfu'])} measured")
    line = f"{label}: {verdict}; {step}"
    if mfu:
        line += "; MFU " + ", ".join(mfu)
    if estimate.get("bottleneck"):
        line += f"; bound by {estimate['bottleneck']}"
    return line + "."


def _time(page: Page, s: Section, estimate: dict, label: str) -> None:
    kinds: dict[str, list[float]] = {}
    for r in estimate["breakdown"]:
        k = kinds.setdefault(r["kind"], [0.0, 0.0])
        k[0] += r["exposed_seconds"]
        k[1] += r["seconds"] - r["exposed_seconds"]
    names = list(kinds)
    rows = [[k, kinds[k][0], kinds[k][1]] for k in names]
    rows.append(["step time (sum of exposed)", sum(v[0] for v in kinds.values()), None])
    numbers = page.table("predicted step time by kind", ["kind", "exposed (s)", "overlapped (s)"], rows,
                         emphasis={len(rows) - 1})
    svg = figures.stacked_bars(names, {"exposed": [kinds[k][0] for k in names],
                                       "overlapped (hidden under compute)": [kinds[k][1] for k in names]},
                               unit="seconds per step", alt=f"Predicted step time of {label} by kind of work, "
                               "exposed and overlapped")
    s.figures.append((svg, numbers))
    rows = [[r["name"], r["kind"], r["seconds"], r["exposed_seconds"]] for r in estimate["breakdown"]]
    rows.append(["total", None, sum(r["seconds"] for r in estimate["breakdown"]), estimate.get("step_time_s")])
    s.tables.append(page.table("predicted step time by component", ["component", "kind", "seconds",
                                                                    "exposed seconds"], rows, emphasis={len(rows) - 1}))


def _memory(page: Page, s: Section, analytical: dict, memory: dict, topo: dict, label: str) -> None:
    """One bar per phase of the step (what is live in it) and one for the compiler: each bar's length is that
    phase's total, the longest analytical one the analytical total."""
    hbm = memory.get("hbm_bytes") or analytical.get("hbm_bytes")
    bars: list[str] = []
    columns: dict[str, dict[str, float]] = {}  # bar -> part -> bytes
    if analytical:
        peak, _, _ = parts.peak_parts(analytical)
        for phase, live in parts.PHASE_PARTS.items():
            name = f"analytical, {phase} phase" + (" (peak: the total)" if phase == peak else "")
            bars.append(name)
            columns[name] = {p: analytical.get(p) or 0.0 for p in parts.STATE_PARTS + live
                             if analytical.get(p) or p in ("params", "gradients")}
    compiler = parts.compiler_parts(memory) if memory else None
    if compiler is not None:
        bars.append("compiler (XLA)")
        columns["compiler (XLA)"] = {f"xla {k}": v for k, v in compiler.items()}
    elif memory.get("per_device_total_bytes") is not None:
        bars.append("compiler (XLA), total only")
        columns[bars[-1]] = {"xla total (no breakdown given)": memory["per_device_total_bytes"]}
    part_names = list(dict.fromkeys(p for b in bars for p in columns[b]))
    cpu = topo.get("platform") == "cpu"
    largest = max(sum(c.values()) for c in columns.values())
    on_scale = bool(hbm) and not cpu and hbm <= 4 * largest  # a limit far past the bars would flatten them
    unit, scale = ("MiB", MIB) if max(largest, hbm if on_scale else 0.0) < GIB else ("GiB", GIB)
    stacks = {p.replace("_", " "): [columns[b].get(p, 0.0) / scale for b in bars] for p in part_names}
    limit = f"{'host memory' if cpu else 'HBM'} {size(hbm)}" if hbm else ""
    xlabel = f"{unit} per device" + (f" ({limit}{'' if cpu else ', off the scale'})" if hbm and not on_scale else "")
    svg = figures.stacked_bars(bars, stacks, unit=xlabel, lines=[(hbm / scale, limit)] if on_scale else [],
                               alt=f"Memory per device of {label}: what is live in each phase of the step (the "
                               f"largest is the analytical total) and the compiler's parts; {limit}")
    rows = [[p.replace("_", " "), *[_scaled(columns[b].get(p), scale) for b in bars]] for p in part_names]
    totals = [sum(columns[b].values()) for b in bars]
    rows.append(["total", *[t / scale for t in totals]])
    rows.append([f"{'host memory (no HBM limit on CPU)' if cpu else 'HBM'} per device",
                 *[_scaled(hbm, scale)] * len(bars)])
    rows.append(["verdict", *[None if hbm is None else "fits" if t <= hbm else "does not fit" for t in totals]])
    numbers = page.table(f"memory per device by phase ({unit})", ["part", *bars], rows,
                         emphasis={len(rows) - 3, len(rows) - 2, len(rows) - 1})
    s.figures.append((svg, numbers))
    if memory.get("compiler_message"):
        s.facts.append(("compiler", memory["compiler_message"]))
    if analytical.get("host_bytes"):
        s.facts.append(("pinned host memory", f"{analytical['host_bytes'] / GIB:.2f} GiB per device (analytical)"))


def _measured(page: Page, s: Section, run: dict, estimate: dict, memory: dict, topo: dict, label: str) -> None:
    predicted = run.get("predicted_step_time_s") or estimate.get("step_time_s")
    known = estimate.get("tflops_per_chip") is not None and topo.get("chips") and topo.get("devices")
    # tpu7x: two devices a chip
    per_device = estimate["tflops_per_chip"] * topo["chips"] / topo["devices"] if known else None
    measured_memory = run.get("memory") or {}
    compiled_bytes = memory.get("per_device_total_bytes") or measured_memory.get("compiler_per_device_bytes")
    unit = run.get("unit") or "tokens"
    mfu, note = predicted_mfu(estimate, run)
    if note:
        s.notes.append(note)
    rows = [["step time (s)", run.get("step_time_s"), predicted, run.get("measured_over_predicted")],
            [f"{unit}/s", run.get("tokens_per_s"), estimate.get("tokens_per_s"), _ratio(run.get("tokens_per_s"),
                                                                                       estimate.get("tokens_per_s"))],
            ["TFLOP/s per device", run.get("tflops_per_device"), per_device, None],
            ["MFU", run.get("mfu"), mfu, _ratio(run.get("mfu"), mfu)],
            ["memory peak per device (GiB)", gib(measured_memory.get("measured_peak_bytes")),
             gib(compiled_bytes), _ratio(measured_memory.get("measured_peak_bytes"), compiled_bytes)]]
    rows[2][3] = _ratio(rows[2][1], rows[2][2])
    s.tables.insert(0, page.table("measured against predicted", ["figure", "measured", "predicted",
                                                                 "measured / predicted"], rows))
    if measured_memory.get("measured_note"):
        s.notes.append(f"memory: {measured_memory['measured_note']}")
    times = run.get("step_times_s") or []
    if times:
        steps = list(range(1, len(times) + 1))
        lines = [(run["step_time_s"], f"median {run['step_time_s']:.4g} s")] if run.get("step_time_s") else []
        if predicted:
            lines.append((predicted, f"predicted {predicted:.4g} s"))
        svg = figures.series(steps, {"measured": times}, xlabel="timed step", ylabel="seconds", hlines=lines,
                             alt=f"Step time of each timed step of {label}, with the median and the prediction")
        rows = [[i, t] for i, t in zip(steps, times)] + [
            ["p10", run.get("step_time_p10_s")], ["median", run.get("step_time_s")],
            ["p90", run.get("step_time_p90_s")], ["min", run.get("step_time_min_s")], ["predicted", predicted]]
        s.figures.append((svg, page.table("step time of each timed step", ["step", "seconds"], rows,
                                          emphasis=set(range(len(times), len(rows))))))
    losses = run.get("losses") or []
    if losses:
        steps = list(range(1, len(losses) + 1))
        svg = figures.series(steps, {"loss": losses}, xlabel="step", ylabel="loss",
                             alt=f"Loss at each step of {label}")
        s.figures.append((svg, page.table("loss at each step", ["step", "loss"], [[i, v] for i, v in
                                                                                  zip(steps, losses)])))
    if run.get("profile"):
        _profile(page, s, run, estimate, label)
    if run.get("checkpoint"):
        c = run["checkpoint"]
        rows = [["path", c.get("path")], ["size (GiB)", gib(c.get("bytes"))],
                ["blocking the loop (s)", c.get("blocking_seconds")], ["until written (s)", c.get("total_seconds")],
                ["blocking, in steps", _ratio(c.get("blocking_seconds"), run.get("step_time_s"))]]
        s.tables.append(page.table("checkpoint", ["figure", "value"], rows))


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value / scale


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _profile(page: Page, s: Section, run: dict, estimate: dict, label: str) -> None:
    profile = run["profile"]
    by_category = profile.get("seconds_by_category") or {}
    traced = profile.get("steps_traced") or 0
    devices = run.get("devices") or 1
    total = sum(by_category.values())
    other = by_category.get("other", 0.0) / total if total else 0.0
    if profile.get("open_command"):
        s.facts.append(("profile", f"open with {profile['open_command']}"))
    s.notes += [f"profile: {m}" for m in profile.get("missing") or []]
    comparable = traced > 0 and total > 0 and other <= OTHER_LIMIT and estimate.get("breakdown")
    if comparable:
        predicted = {}
        for r in estimate["breakdown"]:
            predicted[r["kind"]] = predicted.get(r["kind"], 0.0) + r["seconds"]
        names, pred, meas = [], [], []
        for name, kinds, categories in COMPONENTS:
            p = sum(predicted.get(k, 0.0) for k in kinds) if kinds else None
            m = sum(by_category.get(c, 0.0) for c in categories) / (traced * devices) if categories else None
            if p or m:
                names.append(name)
                pred.append(p)
                meas.append(m)
        names.append("step time")
        pred.append(estimate.get("step_time_s"))
        meas.append(run.get("step_time_s"))
        svg = figures.grouped_bars(names, {"predicted": pred, "measured": meas}, unit="seconds per step per device",
                                   alt=f"Measured against predicted seconds per step of {label}, by component")
        rows = [[n, p, m, _ratio(m, p)] for n, p, m in zip(names, pred, meas)]
        s.figures.append((svg, page.table("measured against predicted by component (s per step)", [
            "component", "predicted", "measured", "measured / predicted"], rows, emphasis={len(rows) - 1})))
        s.notes.append("by component: predicted seconds are each kind's busy time (overlapped included); measured "
                       f"ones the profile's self time of XLA operations per device and traced step ({traced} steps, "
                       f"{devices} devices); the profile counts elementwise fusions as compute")
    elif by_category:
        names = sorted(by_category, key=by_category.get, reverse=True)
        svg = figures.grouped_bars(names, {"profiled": [by_category[n] for n in names]}, unit="seconds (all traced "
                                   "steps and devices)", alt=f"Profiled time of {label} by category of operation")
        rows = [[n, by_category[n], by_category[n] / total if total else None] for n in names]
        rows.append(["total", total, 1.0 if total else None])
        s.figures.append((svg, page.table("profiled time by category", ["category", "seconds", "share"], rows,
                                          emphasis={len(rows) - 1})))
        why = (f"the profile puts {other:.0%} of its time in 'other' (operations it cannot attribute, such as GPU "
               "command buffers)" if other > OTHER_LIMIT else "the trace delimits no steps" if not traced
               else "there is no predicted breakdown")
        s.notes.append(f"no measured-against-predicted comparison by component: {why}")
    ops = profile.get("top_ops") or []
    if ops:
        rows = [[o.get("op"), o.get("category"), o.get("count"), o.get("self_seconds"),
                 o.get("self_seconds", 0.0) / total if total else None] for o in ops[:15]]
        s.tables.append(page.table("top operations by self time (profile)", ["operation", "category", "count",
                                                                              "self seconds", "share"], rows))
    if profile.get("step_time_s") is not None:
        s.facts.append(("step time as traced", f"{profile['step_time_s']:.4g} s over {traced} steps"))

