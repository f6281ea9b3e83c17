"""What the benches that time kernels on an attached GPU share: the median time of a jitted call, and the checks of
their common options (the GPU whose prices the rows are set against, a comma-separated list of choices, --reps),
each a one-line usage error."""

from __future__ import annotations

import argparse
import statistics
import time


def median_seconds(fn, args, reps: int) -> float:
    """The median wall time of `fn(*args)` over `reps` calls, after two untimed ones (the compile and a warm-up)."""
    import jax

    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def choices(parser: argparse.ArgumentParser, text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """The comma-separated `text` as a list, each of `allowed` (else the usage error naming `what` they are)."""
    picked = [t.strip() for t in text.split(",") if t.strip()]
    if unknown := [t for t in picked if t not in allowed]:
        parser.error(f"unknown {what}(s) {unknown}; choose from {', '.join(allowed)}")
    return picked


def check_reps_and_gpu(parser: argparse.ArgumentParser, reps: int, chip: str) -> None:
    """--reps at least 1, and `chip` one of perfmodel's GPUs."""
    if reps < 1:
        parser.error("--reps must be at least 1")
    from maxperf.perfmodel import chips

    gpus = sorted(name for name, c in chips.CHIPS.items() if c.kind == "gpu")
    if chip not in gpus:
        parser.error(f"unknown GPU chip {chip!r}; choose from {', '.join(gpus)}")
