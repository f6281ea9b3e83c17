"""`maxperf plan --step decode` against its target: a serving plan over >= 1,000 candidates in under 5 s.

    .venv/bin/python bench/serving_plan.py [--only NAME]

Each case runs `maxperf plan --step decode --verify 0 --json` as its own process, timed whole (CPU seconds, the
target's measure, and wall seconds), and prints the candidates it priced and its winner.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

CASES = (  # name, model, topology, words
    ("mixtral-8x7b on h100-8x8", "mixtral-8x7b", "h100-8x8",
     ["--max-time-per-token", "30", "quantization=auto", "max_target_length=4096", "max_prefill_predict_length=1024"]),
    ("llama3-70b on v5e-256", "llama3-70b", "v5e-256",
     ["--max-time-per-token", "50", "quantization=auto", "max_target_length=2048", "max_prefill_predict_length=1024"]),
    ("llama3-70b on h100-8", "llama3-70b", "h100-8",
     ["--max-time-per-token", "30", "--max-ttft", "500", "max_target_length=4096", "max_prefill_predict_length=1024"]),
)


def run(model: str, topology: str, words: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "plan", "--step", "decode", "--model", model,
                               "--topology", topology, "--verify", "0", "--json", "--out", out, *words],
                              capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 3):
        raise SystemExit(f"plan failed: {proc.stderr.strip().splitlines()[-1]}")
    result = json.loads(proc.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"result": result, "cpu_s": cpu, "wall_s": wall}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    rows = []
    for name, model, topology, words in CASES:
        if args.only not in name:
            continue
        r = run(model, topology, words)
        res = r["result"]
        w = res["winner"]
        print(f"{name:<26} {res['candidates']:>6} candidates, {res['fitting']:>6} fit, {res['meeting']:>6} meet; "
              f"{r['cpu_s']:.2f} s CPU ({r['wall_s']:.2f} s wall, search {res['search_seconds']:.2f} s)")
        if w:
            weights = "unquantized" if w["quantization"] == "none" else w["quantization"]
            print(f"  best: {w['mesh']}, {w['batch']} sequences, {weights} weights: "
                  f"{w['tpot_s'] * 1e3:.3g} ms/token, {w['tokens_per_s_per_chip']:.4g} tokens/s per chip")
        rows.append({"name": name, **r})
    return rows


if __name__ == "__main__":
    main()
