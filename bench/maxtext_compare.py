"""The same train step compiled by MaxText's train_compile and by `maxperf compile`, side by side in one run.

    .venv/bin/python bench/maxtext_compare.py              # every case (about 35 minutes on 2 cores)
    .venv/bin/python bench/maxtext_compare.py full flash   # some (CASES): full flash main mixtral mixtral4 ...
    .venv/bin/python bench/maxtext_compare.py --repeat 3 mixtral  # each side 3 times, taking turns; medians

MaxText runs from its own venv (PEER_VENV, default /tmp/peer, installed by shared/peer/maxtext_aot.sh) exactly as
that script runs it:
`python -m maxtext.trainers.pre_train.train_compile base.yml compile_topology=... jax_cache_dir=""`.
maxperf runs as a fresh `maxperf compile` process with its compile cache off (MAXPERF_NO_CACHE=1). The two of a case
run back to back, one at a time, so the machine's load falls on both alike. On this shared machine the same
program's backend passes took 38 to 59 s from one compile to the next (mixtral-8x7b, maxperf's, 2026-11-23), so
`--repeat N` compiles each side N times, the two taking turns going first, and reports the median wall time of each.

MAXPERF_PYTHON=/tmp/peer/bin/python runs maxperf (this checkout, on PYTHONPATH) under MaxText's venv instead. Both
venvs hold jax 0.12.0.1 and libtpu 0.0.52 (maxperf's `tpu` extra pins the libtpu MaxText 0.2.5 installs; jax's own
`jax[tpu]` extra pins 0.0.50.*, whose compiler planned one and the same maxperf step, llama2-7b v5p-128 B 4 dot
product, full remat, in 10.61 GiB per device against 7.81 GiB under 0.0.52).

Memory per device is the sum MaxText prints (max_utils.print_compiled_memory_stats): argument + output - alias +
temp, from XLA's memory analysis, in GiB (MaxText labels them GB). Wall seconds are the whole process, from start to
exit. Targets: maxperf's memory at most 1.10x MaxText's, its wall time at most 0.8x; llama2-7b on
v5p-1024 under 30 s and no more memory than MaxText's.

Beside them, from libtpu's INFO logs of each side (its processes log to their own TPU_LOG_DIR in the run's work
directory), for the largest program it compiled (the train step): the backend passes' seconds, the final program's
bundle count, its overlays, and its HBM temporaries with libtpu's unpadded and padded sizes, where tile padding shows.

The mixtral cases run MaxText's defaults for a mixture of experts, named on both sides: dropless
(capacity_factor=-1) sorted tokens in the megablox grouped matmul (sparse_matmul, megablox), flash attention, full
remat, and MaxText's load_balance_loss_weight default 0 (maxperf's is 0.01); MaxText's default mesh on v5p-128,
ici_fsdp_parallelism=-1 and no expert parallelism, is maxperf's too.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = Path(os.environ.get("PEER_VENV", "/tmp/peer"))


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    topology: str
    batch: int
    seq: int
    settings: tuple[str, ...]  # key=value under the same names in MaxText and maxperf
    slices: int = 1


MOE_DEFAULTS = ("attention=flash", "remat_policy=full", "sparse_matmul=true", "megablox=true", "capacity_factor=-1",
                "load_balance_loss_weight=0")

CASES = (
    Case("full", "llama2-7b", "v5p-128", 4, 2048, ("attention=dot_product", "remat_policy=full")),
    Case("flash", "llama2-7b", "v5p-128", 4, 2048, ("attention=flash", "remat_policy=minimal")),
    Case("main", "llama2-7b", "v5p-1024", 1, 2048, ("attention=flash", "remat_policy=full")),
    Case("mixtral", "mixtral-8x7b", "v5p-128", 1, 2048, MOE_DEFAULTS),
    Case("mixtral4", "mixtral-8x7b", "v5p-128", 4, 2048, MOE_DEFAULTS),
    # scanned in blocks of its six-layer cycle on both sides, its last four layers one block after them
    Case("gemma3", "gemma3-4b", "v5p-128", 1, 2048, ("attention=flash", "remat_policy=full")),
    # two pipeline stages over llama2-7b's 32 layers (MaxText's defaults: circular, a layer a stage each repeat, as
    # many microbatches as stages) under remat_policy=none, which MaxText's pipeline runs as a rematerialized iteration
    Case("pipeline", "llama2-7b", "v5p-16", 4, 2048, ("attention=flash", "remat_policy=none",
                                                     "ici_pipeline_parallelism=2")),
    # a 70B-class model over two slices, a pipeline stage each (dcn_pipeline_parallelism=2), MaxText's defaults
    # otherwise: circular, a layer a stage each repeat, as many microbatches as stages
    Case("pipeline70b", "llama2-70b", "v5p-64", 1, 4096, ("attention=flash", "remat_policy=full",
                                                          "dcn_pipeline_parallelism=2"), slices=2),
    # context parallelism at 32k tokens: the sequence over 2 devices (MaxText's all-gather strategy, its load
    # balancing for the causal mask on), fsdp over the other 4
    Case("context", "llama2-7b", "v5p-16", 1, 32768, ("attention=flash", "remat_policy=full",
                                                     "ici_context_parallelism=2")),
)


@dataclass(frozen=True)
class Backend:
    """libtpu's account of the largest program one process compiled."""

    passes_s: float
    bundles: int
    overlays: str  # e.g. "60 overlays without HLO functions (53.91M)"
    hbm_temp: str  # the HBM requirement's "HLO temp" line: size, utilization, unpadded and padded sizes

    def __str__(self) -> str:
        return (f"backend passes {self.passes_s:.1f} s, {self.bundles:,} bundles, {self.overlays}; "
                f"HBM temp {self.hbm_temp}")


@dataclass(frozen=True)
class Result:
    memory_gib: float | None
    wall_s: float
    note: str = ""
    backend: Backend | None = None


def backend_of(log_dir: Path) -> Backend | None:
    """The largest program in libtpu's INFO logs under `log_dir`: each compile logs its backend passes' duration,
    then its bundle count, overlays and, under "Program hbm requirement", its HLO temporaries."""
    lines = [line for log in sorted(log_dir.glob("tpu_driver.*.log.INFO.*"))
             for line in log.read_text(errors="replace").splitlines()]
    programs, current, section = [], {}, ""
    for line in lines:
        if m := re.search(r"BACKEND_PASSES stage duration: (?:(\d+)h)?(?:(\d+)m)?([0-9.]+)s", line):  # 2m19.9s
            hours, minutes, seconds = m.groups()
            current = {"passes_s": 3600 * int(hours or 0) + 60 * int(minutes or 0) + float(seconds)}
            programs.append(current)
        elif m := re.search(r"final program bundle count: ([0-9,]+)", line):
            current["bundles"] = int(m.group(1).replace(",", ""))
        elif m := re.search(r"Program divided into (.*)\.$", line):
            current["overlays"] = m.group(1)
        elif line.startswith("Program "):
            section = line.split(" requirement")[0]
        elif section == "Program hbm" and line.lstrip().startswith("HLO temp"):
            current["hbm_temp"] = line.split("HLO temp", 1)[1].strip()
    full = [p for p in programs if {"passes_s", "bundles", "hbm_temp"} <= p.keys()]
    if not full:
        return None
    best = max(full, key=lambda p: p["bundles"])
    return Backend(best["passes_s"], best["bundles"], best.get("overlays", "no overlays logged"), best["hbm_temp"])


def run_timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    print("  $ " + " ".join(shlex.quote(a) for a in argv), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    return proc, time.perf_counter() - start


def maxtext(case: Case, work: Path) -> Result:
    python = PEER_VENV / "bin" / "python"
    base_yml = subprocess.run([str(python), "-c", "import os, maxtext; print(os.path.join(os.path.dirname("
                               "maxtext.__file__), 'configs', 'base.yml'))"], capture_output=True, text=True,
                              check=True).stdout.strip()
    argv = [str(python), "-m", "maxtext.trainers.pre_train.train_compile", base_yml,
            f"compile_topology={case.topology}", f"compile_topology_num_slices={case.slices}",
            f"model_name={case.model}",
            f"per_device_batch_size={case.batch}", f"max_target_length={case.seq}", f"run_name=cmp_{case.name}",
            f"base_output_directory={work / 'maxtext'}", "jax_cache_dir=", "log_config=false", *case.settings]
    logs = work / f"tpu_logs_maxtext_{case.name}"
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_LOG_DIR": str(logs)}
    proc, wall = run_timed(argv, env, work)
    text = proc.stdout + proc.stderr
    m = re.search(r"CompiledMemoryStats\((.*?)\)", text)
    if proc.returncode != 0 or not m:
        return Result(None, wall, f"MaxText exit {proc.returncode}: {text.strip().splitlines()[-1:]}")
    f = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}
    total = (f["argument_size_in_bytes"] + f["output_size_in_bytes"] - f["alias_size_in_bytes"]
             + f["temp_size_in_bytes"])
    return Result(total / GIB, wall, backend=backend_of(logs))


def maxperf(case: Case, work: Path) -> Result:
    out = work / f"maxperf_{case.name}"
    python = os.environ.get("MAXPERF_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    argv = [python, "-m", "maxperf.cli", "compile", "--topology", case.topology, "--num-slices", str(case.slices),
            "--model", case.model, "--out", str(out), "--force", f"per_device_batch_size={case.batch}",
            f"seq_len={case.seq}",
            *case.settings]
    logs = work / f"tpu_logs_maxperf_{case.name}"
    env = {**os.environ, "MAXPERF_NO_CACHE": "1", "PYTHONPATH": str(ROOT), "TPU_LOG_DIR": str(logs)}
    proc, wall = run_timed(argv, env, ROOT)
    memory_path = out / "memory.json"
    if proc.returncode not in (0, 3) or not memory_path.exists():
        return Result(None, wall, f"maxperf exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    m = json.loads(memory_path.read_text())
    total = m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
    return Result(total / GIB, wall, backend=backend_of(logs))


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def bundles(backend: Backend | None) -> str:
    return f"{backend.bundles:,}" if backend else "-"


def gib(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "failed"


def libtpu_version(python: str) -> str:
    proc = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('libtpu'))"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or "absent"


def main(names: list[str], repeat: int) -> None:
    cases = [c for c in CASES if not names or c.name in names]
    maxperf_python = os.environ.get("MAXPERF_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    print(f"libtpu: MaxText {libtpu_version(str(PEER_VENV / 'bin' / 'python'))}, "
          f"maxperf {libtpu_version(maxperf_python)} ({maxperf_python})", flush=True)
    work = Path(tempfile.mkdtemp(prefix="maxtext-compare-"))
    rows = []
    for case in cases:
        where = case.topology + (f" x{case.slices}" if case.slices > 1 else "")
        print(f"{case.name}: {case.model} {where} B {case.batch} L {case.seq} {' '.join(case.settings)}",
              flush=True)
        runs: dict[str, list[Result]] = {"MaxText": [], "maxperf": []}
        for i in range(repeat):
            # the sides take turns going first, so that a drift in the machine's speed falls on both
            order = (("MaxText", maxtext), ("maxperf", maxperf))
            for side, compile_with in (order if i % 2 == 0 else order[::-1]):
                (where := work / f"run{i}").mkdir(exist_ok=True)
                r = compile_with(case, where)
                runs[side].append(r)
                if r.note:
                    print(f"  {r.note}", flush=True)
                print(f"  {side} {i + 1}: {r.wall_s:.1f} s; libtpu: {r.backend or 'no program in its libtpu logs'}",
                      flush=True)
        mt, mp = (Result(runs[s][0].memory_gib, statistics.median(r.wall_s for r in runs[s]),
                         backend=runs[s][0].backend) for s in ("MaxText", "maxperf"))
        passes = {s: [r.backend.passes_s for r in runs[s] if r.backend] for s in runs}
        rows.append((case, mt, mp, passes))
        print(f"  memory per device: MaxText {gib(mt.memory_gib)} GiB, maxperf {gib(mp.memory_gib)} GiB "
              f"({ratio(mp.memory_gib, mt.memory_gib)}); wall{' (median)' if repeat > 1 else ''}: MaxText "
              f"{mt.wall_s:.1f} s, maxperf {mp.wall_s:.1f} s ({ratio(mp.wall_s, mt.wall_s)})", flush=True)
    print()
    print("| case | topology | B | L | settings | MaxText GiB | maxperf GiB | ratio | MaxText s | maxperf s | ratio "
          "| backend s MaxText / maxperf | MaxText bundles | maxperf bundles |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case, mt, mp, passes in rows:
        backend = " / ".join(f"{statistics.median(passes[s]):.1f}" if passes[s] else "-"
                             for s in ("MaxText", "maxperf"))
        where = case.topology + (f" x{case.slices}" if case.slices > 1 else "")
        print(f"| {case.model} | {where} | {case.batch} | {case.seq} | {' '.join(case.settings)} "
              f"| {gib(mt.memory_gib)} | {gib(mp.memory_gib)} | {ratio(mp.memory_gib, mt.memory_gib)} "
              f"| {mt.wall_s:.1f} | {mp.wall_s:.1f} | {ratio(mp.wall_s, mt.wall_s)} | {backend} "
              f"| {bundles(mt.backend)} | {bundles(mp.backend)} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help=f"cases to run (default all): {', '.join(c.name for c in CASES)}")
    ap.add_argument("--repeat", type=int, default=1,
                    help="compile each case this many times per side, the sides taking turns; medians reported")
    args = ap.parse_args()
    names = [c.name for c in CASES]
    for name in args.cases:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=2)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            print(f"unknown case {name!r}; {hint}cases: {', '.join(names)}", file=sys.stderr)
            raise SystemExit(2)
    if args.repeat < 1:
        print(f"--repeat must be 1 or more, got {args.repeat}", file=sys.stderr)
        raise SystemExit(2)
    main(args.cases, args.repeat)
