"""`maxperf estimate` on Google's published MaxText recipes, pasted as they are: throughput per device against the
step each recipe's README logs. None of these rows is fitted on; they check the model where it was not tuned.

    .venv/bin/python bench/recipes.py [--json FILE] [--hlo ROW,ROW...]

Rows: bench/published/recipes.csv, one per tpu-recipes README (`training/trillium/*`, `training/v5p/*`) that logs a
step: the topology and slices of its launch script, and the tuning parameters of the MaxText benchmark config that
script names (MaxText's `benchmarks/maxtext_trillium_model_configs.py`, `maxtext_v5p_model_configs.py`), less the
keys that only say where data, logs and profiles go; and one per Ironwood mixture-of-experts recipe
(`training/ironwood/*/xpk/run_recipe.sh`, its MAXTEXT_ARGS, measured by the summary table of
`training/ironwood/README.md`, whose tokens/s per chip is two JAX devices'). Each row runs as a user would type it,
`maxperf estimate --model M --topology T --num-slices S --json WORDS...`, in this process. The error is
predicted / published - 1 of tokens/s per device; every row ran in production, so each must also fit.

`--hlo ROWS` compiles rows too, each under its recipe's XLA flags as it ran (the `xla_flags` column: the config's
`xla_flags`, MaxText's benchmarks/xla_flags_library.py spelled out, or the Ironwood script's XLA_FLAGS, passed to
libtpu as LIBTPU_INIT_ARGS), less those this libtpu compiles on another chip alone (compiled.REFUSED, each named in the
output); a LIBTPU_INIT_ARGS in the environment, even empty, replaces them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
import outfile  # noqa: E402
from compiled import compile_and_read, launch_flags, seconds, step_reading  # noqa: E402

from maxperf import cli  # noqa: E402
from maxperf.spec import presets, topology  # noqa: E402

ROWS = ROOT / "bench" / "published" / "recipes.csv"


@dataclass(frozen=True)
class Row:
    id: str
    topology: str
    num_slices: int
    model: str
    words: tuple[str, ...]
    published: float  # tokens/s per device, as the README's log line states it
    xla_flags: tuple[str, ...] = ()  # the recipe's LIBTPU_INIT_ARGS


def load_rows(path: Path = ROWS) -> list[Row]:
    with open(path, newline="") as f:
        return [Row(r["id"], r["topology"], int(r["num_slices"]), r["model"], tuple(r["words"].split()),
                    float(r["published_tokens_per_s_per_device"]), tuple(r["xla_flags"].split()))
                for r in csv.DictReader(f)]


def compile_flags(row: Row) -> tuple[str, list[str], str]:
    """(LIBTPU_INIT_ARGS for the row's compile, the recipe's flags left out, where the flags came from): the recipe's
    less compiled.REFUSED, or the environment's LIBTPU_INIT_ARGS where it is set."""
    return launch_flags(row.xla_flags, topology.get(row.topology, row.num_slices).chip, "the recipe's")


def estimate(row: Row) -> tuple[int, dict, str]:
    """(exit code, the estimate's JSON document, what it wrote on stderr) of the row's command line."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["estimate", "--json", "--model", row.model, "--topology", row.topology, "--num-slices",
            str(row.num_slices), *row.words]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, json.loads(out.getvalue()) if code == 0 else {}, err.getvalue()


def hlo_step(row: Row, timeout: float) -> dict:
    """`maxperf compile` of the row's command line in a process of its own (compiled.compile_and_read) under the
    recipe's XLA flags (compile_flags): the step time read from the compiled program (estimate.json's hlo_time) beside
    the analytical one, or why there is none, and the flags it compiled under."""
    flags, dropped, origin = compile_flags(row)
    read = compile_and_read(["--model", row.model, "--topology", row.topology, "--num-slices", str(row.num_slices),
                             *row.words], timeout, {"LIBTPU_INIT_ARGS": flags})
    return {**(read if "error" in read else step_reading(read)), "xla_flags": flags, "xla_flags_from": origin,
            "xla_flags_left_out": dropped}


def group(row: Row) -> str:
    return "TPU " + row.topology.split("-")[0]


def is_moe(row: Row) -> bool:
    return presets.get(row.model).is_moe


def summary(errors: list[float]) -> dict:
    a = [abs(e) for e in errors]
    return {"n": len(a), "median": statistics.median(a), "worst": max(a), "median_signed": statistics.median(errors)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the per-row results and the summaries here")
    ap.add_argument("--hlo", default="", metavar="ROWS",
                    help="comma-separated row ids to compile too (minutes each), printing the step time read from the "
                         "compiled program beside the analytical one, each under its recipe's XLA flags (a "
                         "LIBTPU_INIT_ARGS in the environment replaces them)")
    ap.add_argument("--hlo-timeout", type=seconds, default=3600, help="seconds one row's compile may take")
    args = ap.parse_args(argv)
    args.json = outfile.checked(ap, args.json)
    rows, results = load_rows(), {}
    hlo_ids = [h for h in args.hlo.split(",") if h]
    unknown = sorted(set(hlo_ids) - {r.id for r in rows})
    if unknown:
        ap.error(f"--hlo: no such row: {', '.join(unknown)}")
    print(f"{'row':<44} {'topology':<11} {'published':>10} {'predicted':>10} {'error':>8}  fits")
    for row in rows:
        code, doc, err = estimate(row)
        if code != 0:
            results[row.id] = {"exit": code, "error": err.strip().splitlines()[-1] if err.strip() else ""}
            print(f"{row.id:<44} {row.topology:<11} {row.published:>10.1f} {'error':>10}  {results[row.id]['error']}")
            continue
        # MaxText's "device": a JAX device (a TPU7x chip holds two)
        predicted = doc["tokens_per_s"] / math.prod(doc["mesh"]["axes"].values())
        e = predicted / row.published - 1
        results[row.id] = {"group": group(row), "moe": is_moe(row), "published": row.published,
                           "predicted": predicted, "error": e, "fits": doc["fits"], "step_time_s": doc["step_time_s"]}
        where = f"{row.topology} x{row.num_slices}" if row.num_slices > 1 else row.topology
        print(f"{row.id:<44} {where:<11} {row.published:>10.1f} {predicted:>10.1f} {e:>+8.1%}  "
              f"{'yes' if doc['fits'] else 'NO'}")
    ok = {k: v for k, v in results.items() if "group" in v}
    summaries = {"all": summary([v["error"] for v in ok.values()])}
    for g in sorted({v["group"] for v in ok.values()}):
        summaries[g] = summary([v["error"] for v in ok.values() if v["group"] == g])
    # mixtures of experts, on every chip: what an estimate of one quotes as its error (work.UNFITTED_MOE_ERROR)
    summaries["MoE"] = summary([v["error"] for v in ok.values() if v["moe"]])
    print()
    for name, s in summaries.items():
        print(f"{name:<10} n={s['n']:<3} median {s['median']:.1%}  worst {s['worst']:.1%}  "
              f"median signed {s['median_signed']:+.1%}")
    failed = [k for k, v in results.items() if "group" not in v]
    unfit = [k for k, v in ok.items() if not v["fits"]]
    print(f"{len(ok)} of {len(rows)} rows estimated; {len(unfit)} said not to fit"
          + (f" ({', '.join(unfit)})" if unfit else "") + (f"; failed: {', '.join(failed)}" if failed else ""))
    if hlo_ids:
        print("\nstep time read from the compiled program (maxperf.aot.hlo_time), rows compiled:")
        print(f"{'row':<44} {'published s':>11} {'analytical':>10} {'from HLO':>9}  HLO error  "
              "memory/device: compiled, analytical (GiB)")
        by_id = {r.id: r for r in rows}
        for rid in hlo_ids:
            if "group" not in results[rid]:
                print(f"{rid:<44} not estimated: not compiled")
                continue
            read = hlo_step(by_id[rid], args.hlo_timeout)
            results[rid]["hlo"] = read
            if "error" in read:
                print(f"{rid:<44} {read['error']}")
                continue
            # the published step: this row's analytical step scaled by its throughput error
            r = results[rid]
            published_s = read["analytical_step_time_s"] * r["predicted"] / r["published"]
            read["error"] = published_s / read["hlo_step_time_s"] - 1
            gib = read["compiled_memory_bytes"] / 2**30
            print(f"{rid:<44} {published_s:>11.2f} {read['analytical_step_time_s']:>10.2f} "
                  f"{read['hlo_step_time_s']:>9.2f}  {read['error']:>+9.1%}  {gib:.2f} "
                  f"({'fits' if read['compiled_fits'] else 'does not fit'}), "
                  f"{read['analytical_memory_bytes'] / 2**30:.2f}")
        for rid in hlo_ids:
            if read := results[rid].get("hlo"):
                left_out = "; left out: " + ", ".join(read["xla_flags_left_out"]) if read["xla_flags_left_out"] else ""
                print(f"  {rid}: compiled under {read['xla_flags_from']} XLA flags "
                      f"({len(read['xla_flags'].split())}){left_out}")
    data = {"rows": results, "summary": summaries}
    if args.json:
        outfile.write(args.json, data)
    return data


if __name__ == "__main__":
    main()
