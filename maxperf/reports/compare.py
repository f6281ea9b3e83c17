"""Two or more compiles or runs side by side: each named by a letter and by what sets it apart from the others."""

from __future__ import annotations

from maxperf.reports import figures
from maxperf.reports.page import Page, Section
from maxperf.reports.steps import Step

LOWER_IS_BETTER = {"predicted step time (s)", "predicted step time from the HLO (s)", "measured step time (s)",
                   "analytical memory (GiB)", "compiler memory (GiB)", "compile (s)", "final loss"}
NOT_RANKED = {"fits", "tokens per step", "measured / predicted step time", "measured / HLO-predicted step time"}
# comparable only at the same tokens per step
STEP_TIMES = ("predicted step time (s)", "predicted step time from the HLO (s)", "measured step time (s)")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_KEYS = 4  # differing config values named in a heading; the table lists them all


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _name(i: int) -> str:
    return LETTERS[i] if i < len(LETTERS) else f"#{i + 1}"


def _differing(steps: list[Step]) -> dict[str, list[str]]:
    """Config values that differ among the steps, as key -> each step's value; a model's own keys only among steps
    of one model (the label names the model)."""
    parts = ["train", "parallelism"]
    if len({st.config["model"].get("name") for st in steps}) == 1:
        parts.insert(0, "model")
    out = {}
    for part in parts:
        for k in dict.fromkeys(k for st in steps for k in st.config[part]):
            values = [st.config[part].get(k, "") for st in steps]
            if len(set(values)) > 1:
                out[k] = values
    return out


def names(steps: list[Step]) -> list[str]:
    """'A: tiny / cpu-8 (remat_policy=none)': a letter, the label, and what sets it apart from the others: the config
    values that differ, else the other settings that do, else its directory (a run is told from its compile by the
    section's "(measured)")."""
    differing = _differing(steps)
    keys = list(differing)
    settings = [k for k in steps[0].settings if k not in ("directory", "kind", "topology")
                and len({st.settings.get(k) for st in steps}) > 1]
    extras = [[f"{k}={differing[k][i]}" for k in keys[:MAX_KEYS]] + (["..."] if len(keys) > MAX_KEYS else [])
              if keys else [f"{k} {st.settings[k]}" for k in settings] for i, st in enumerate(steps)]
    keyed = [(st.label, tuple(extra), st.settings.get("kind")) for st, extra in zip(steps, extras)]
    clashing = [i for i, n in enumerate(keyed) if keyed.count(n) > 1]
    unique_dirs = len({steps[i].directory.name for i in clashing}) == len(clashing)
    for i in clashing:
        extras[i].append(steps[i].directory.name if unique_dirs else str(steps[i].directory))
    return [f"{_name(i)}: {st.label}" + (f" ({'; '.join(extra)})" if extra else "")
            for i, (st, extra) in enumerate(zip(steps, extras))]


def section(page: Page, steps: list[Step]) -> None:
    heads = names(steps)
    for st, head in zip(steps, heads):  # each step's own section carries the same name as its column
        st.section.title = head + (" (measured)" if st.settings.get("kind") == "measured run" else "")
        if st.section.headline.startswith(st.label):
            st.section.headline = st.section.title + st.section.headline[len(st.label):]
    shown = [k for k in steps[0].settings if len({st.settings.get(k) for st in steps}) > 1 and k != "directory"]
    config = _differing(steps)
    table = page.table("side by side", ["figure", *[h.split(":")[0] for h in heads], "ratio last / first"], [])
    for k, values in config.items():
        table.rows.append([k, *values, None])
    for k in [*shown, "directory"]:
        table.rows.append([k, *[st.settings.get(k) for st in steps], None])
    settings_rows = len(table.rows)
    tokens = [st.figures.get("tokens per step") for st in steps]
    same_tokens = None not in tokens and len(set(tokens)) == 1
    # a step that does not fit is no candidate for best; step times are ranked only when every step does the same
    # work (else tokens/s says which is faster)
    candidates = [i for i, st in enumerate(steps) if st.figures.get("fits") is not False]
    for c in dict.fromkeys(c for st in steps for c in st.figures):
        values = [st.figures.get(c) for st in steps]
        first, last = values[0], values[-1]
        ratio = (last / first if all(_number(v) for v in (first, last)) and first
                 and (same_tokens or c not in STEP_TIMES) else None)
        table.rows.append([c, *values, ratio])
        ranked = [i for i in candidates if _number(values[i])]
        if len(ranked) >= 2 and c not in NOT_RANKED and (same_tokens or c not in STEP_TIMES):
            best = (min if c in LOWER_IS_BETTER else max)(ranked, key=lambda i: values[i])
            if sum(values[i] == values[best] for i in ranked) == 1:  # a value shared by two is no one step's best
                table.best[len(table.rows) - 1] = 1 + best
    table.emphasis = set(range(settings_rows))
    s = Section("comparison", "comparison", tables=[table])
    letters = [h.split(":")[0] for h in heads]
    # step times side by side while the steps do the same work; tokens/s when their global batches differ
    what, unit, title = (("step time (s)", "seconds per step", "step time of each (s)") if same_tokens else
                         ("tokens/s", "tokens per second", "tokens per second of each"))
    predicted = [st.figures.get(f"predicted {what}") for st in steps]
    measured = [st.figures.get(f"measured {what}") for st in steps]
    if any(v is not None for v in predicted + measured):
        series = {"predicted": predicted, **({"measured": measured} if any(v is not None for v in measured) else {})}
        svg = figures.grouped_bars(letters, series, unit=unit,
                                   alt=f"{what.split(' (')[0].capitalize()} of each compared step, predicted and "
                                       "measured")
        s.figures.append((svg, page.table(title, ["step", *series], [
            [letter, *[v[i] for v in series.values()]] for i, letter in enumerate(letters)])))
    s.facts = [(h.split(":")[0], st.section.title.split(": ", 1)[1]) for h, st in zip(heads, steps)]
    s.facts.append(("differ in", ", ".join([*config, *shown]) or "nothing but their directories"))
    s.facts.append(("best value", "marked ★ in each row among the steps that fit (lowest time, memory and loss; "
                                  "highest throughput and MFU), where no other step has it too"))
    unfit = [letters[i] for i, st in enumerate(steps) if st.figures.get("fits") is False]
    if unfit:
        s.notes.append(f"{', '.join(unfit)} {'does' if len(unfit) == 1 else 'do'} not fit in device memory: marked "
                       "best in no row")
    if not same_tokens:
        s.notes.append("the steps do not all process the same tokens per step (" + ", ".join(
            f"{letter} {'?' if t is None else f'{t:,}'}" for letter, t in zip(letters, tokens)) + "): their step "
            "times are not compared, tokens/s are")
    page.sections.insert(page.sections.index(steps[0].section), s)  # the comparison before the details
