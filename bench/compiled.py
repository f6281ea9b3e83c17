"""A bench row's step compiled by `maxperf compile` in a process of its own, and what its artifact says: the
benches that set the step time read from the compiled program beside the analytical one (bench/published.py --hlo,
bench/recipes.py --hlo) compile through here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from maxperf.aot.compiler import CONTINUATION_FUSION_FLAG

ROOT = Path(__file__).resolve().parents[1]
# Flags of the runs' launch scripts (MaxText's configs/tpu/*/*.sh, tpu-recipes' run_recipe.sh) that this libtpu
# (0.0.52) compiles on one chip alone: flag -> that chip. MaxText's CF_FOR_ALL_GATHER (continuation fusion of
# all-gathers into the matmuls they feed) is refused elsewhere ("continuation fusion for AllGather ... not supported
# ... on platforms other than TPU v5e"); the scripts' other flags stay
REFUSED = {f"{CONTINUATION_FUSION_FLAG}=true": "tpu-v5e"}


def launch_flags(flags: tuple[str, ...] | list[str], chip: str, whose: str) -> tuple[str, list[str], str]:
    """(LIBTPU_INIT_ARGS for a run's compile on `chip`, the flags left out, where they came from): the run's launch
    flags (`whose`) less REFUSED, or the environment's LIBTPU_INIT_ARGS where it is set, even empty."""
    if "LIBTPU_INIT_ARGS" in os.environ:
        return os.environ["LIBTPU_INIT_ARGS"], [], "LIBTPU_INIT_ARGS of the environment"
    dropped = [f for f in flags if REFUSED.get(f, chip) != chip]
    kept = [f for f in flags if f not in dropped]
    return " ".join(kept), [f"{f} (compiles on {REFUSED[f]} alone)" for f in dropped], whose


def seconds(text: str) -> float:
    """An argparse type: a positive number of seconds (a compile's time limit)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds, e.g. 1800")
    return value


def run_cpu(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`command` in the repository root with jax on its CPU backend (it compiles for its topology without one); the
    environment passes through (LIBTPU_INIT_ARGS: a recipe's XLA flags), `env` over it."""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {}), "JAX_PLATFORMS": "cpu"})


def compile_and_read(args: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """`maxperf compile ARGS` into a temporary directory (the compile cache keeps the program), `env` over the
    environment: its estimate.json and memory.json, and the seconds it took; or {"error": why there are none} (the
    compiler's one line)."""
    with tempfile.TemporaryDirectory(prefix="maxperf-bench-compile-") as tmp:
        start = time.time()
        try:
            done = run_cpu([sys.executable, "-m", "maxperf.cli", "compile", *args, "--out", f"{tmp}/artifact",
                            "--json"], timeout, env)
        except subprocess.TimeoutExpired:
            return {"error": f"compile over {timeout:.0f} s"}
        artifact = Path(tmp) / "artifact"
        if not (artifact / "estimate.json").is_file():
            lines = [line for line in done.stderr.splitlines() if line.startswith("maxperf:")]
            return {"error": (lines[-1] if lines else f"exit {done.returncode}")[:160]}
        return {"estimate": json.loads((artifact / "estimate.json").read_text()),
                "memory": json.loads((artifact / "memory.json").read_text()), "wall_seconds": time.time() - start}


def step_reading(read: dict) -> dict:
    """What a bench row records of a compile_and_read that succeeded: the step time read from the compiled program
    beside the analytical one, and the compiler's memory per device and verdict beside the analytical memory."""
    estimate, memory = read["estimate"], read["memory"]
    hlo = estimate["hlo_time"]
    return {"hlo_step_time_s": hlo["step_time_s"], "analytical_step_time_s": estimate["step_time_s"],
            "hlo_exposed_s": hlo["exposed_s"], "hlo_bottleneck": hlo["bottleneck"],
            "costing_seconds": hlo["costing_seconds"], "compiled_memory_bytes": memory["per_device_total_bytes"],
            "compiled_fits": memory["fits"], "analytical_memory_bytes": estimate["memory_per_device_bytes"],
            "wall_seconds": read["wall_seconds"]}
