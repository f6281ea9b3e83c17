"""`maxperf estimate` on Google's published MaxText recipes, pasted as they are: throughput per device against the
step each recipe's README logs. None of these rows is fitted on; they check the model where it was not tuned.

    .venv/bin/python bench/recipes.py [--json FILE]

Rows: bench/published/recipes.csv, one per tpu-recipes README (`training/trillium/*`, `training/v5p/*`) that logs a
step: the topology and slices of its launch script, and the tuning parameters of the MaxText benchmark config that
script names (MaxText's `benchmarks/maxtext_trillium_model_configs.py`, `maxtext_v5p_model_configs.py`), less the
keys that only say where data, logs and profiles go; and one per Ironwood mixture-of-experts recipe
(`training/ironwood/*/xpk/run_recipe.sh`, its MAXTEXT_ARGS, measured by the summary table of
`training/ironwood/README.md`, whose tokens/s per chip is two JAX devices'). Each row runs as a user would type it,
`maxperf estimate --model M --topology T --num-slices S --json WORDS...`, in this process. The error is
predicted / published - 1 of tokens/s per device; every row ran in production, so each must also fit.
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

from maxperf import cli  # noqa: E402
from maxperf.spec import presets  # noqa: E402

ROWS = ROOT / "bench" / "published" / "recipes.csv"


@dataclass(frozen=True)
class Row:
    id: str
    topology: str
    num_slices: int
    model: str
    words: tuple[str, ...]
    published: float  # tokens/s per device, as the README's log line states it


def load_rows(path: Path = ROWS) -> list[Row]:
    with open(path, newline="") as f:
        return [Row(r["id"], r["topology"], int(r["num_slices"]), r["model"], tuple(r["words"].split()),
                    float(r["published_tokens_per_s_per_device"])) for r in csv.DictReader(f)]


def estimate(row: Row) -> tuple[int, dict, str]:
    """(exit code, the estimate's JSON document, what it wrote on stderr) of the row's command line."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["estimate", "--json", "--model", row.model, "--topology", row.topology, "--num-slices",
            str(row.num_slices), *row.words]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, json.loads(out.getvalue()) if code == 0 else {}, err.getvalue()


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
    args = ap.parse_args(argv)
    args.json = outfile.checked(ap, args.json)
    rows, results = load_rows(), {}
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
    data = {"rows": results, "summary": summaries}
    if args.json:
        outfile.write(args.json, data)
    return data


if __name__ == "__main__":
    main()
