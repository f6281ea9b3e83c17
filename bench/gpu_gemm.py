"""Decode-shaped matmuls timed on this machine's GPU against the two ways a decode step's matmul can be priced:
x [M, K] @ W [K, N] with few rows M (a decode step's sequences on one device) against a model's weight shapes, in
bf16 and in FP8 (float8_e4m3fn operands, a bf16 result: XLA's cuBLASLt FP8 GEMM on Hopper), each row's median time
beside

- the roofline, as perfmodel.serving prices a TPU's decode matmul: the longer of its FLOPs at the chip's sustained
  rate (its bf16 or FP8 peak x chips.MATMUL_FRACTION) and its bytes (the weights, the rows in and out) at the share
  of HBM bandwidth fitted on published serving runs (serving.DECODE_HBM_EFFICIENCY);
- the sum of the two: the weights streamed, then the math, neither hiding the other, as it prices a GPU's
  (serving.DECODE_KERNEL_LAW).

    .venv/bin/python bench/gpu_gemm.py [--chip h200] [--rows 16,64,...] [--shapes KxN,...] [--dtypes bf16,fp8]
                                       [--reps 10] [--json FILE]

Published serving runs alone cannot tell the two apart from a lower FP8 rate at these shapes (docs/serving.md): a
sweep of GEMMs can. Each call runs as many distinct weight matrices of the shape as make up at least L2_SPAN bytes,
one after another in one program, so that no matrix is read from the L2 cache a step's other weights would have
evicted; a row's time is the call's median over --reps over that count. The summary gives, per dtype, the median and
worst |measured / predicted - 1| of each price, over all rows and over the rows near the ridge (where the smaller of
the two terms is at least a quarter of the larger), which tell the prices apart. A shape that fails prints its one-line
reason and the bench goes on. On a machine without a GPU it runs as well (the test: tiny shapes on the CPU, priced as
the chosen GPU's).

`--published` sets the same two prices beside published GEMM timings instead (bench/published/gemm.csv; no GPU
needed): DeepSeek's DeepGEMM table, FP8 on an H800 SXM5 (an H100 SXM's SMs, clock and HBM3, priced as h100-sxm), M =
64 to 8,192 rows against DeepSeek-V3's weight shapes, dense and grouped (each group its own weight), for two kernels:
DeepGEMM's own (its stated TFLOP/s) and the CUTLASS 3.6 implementation it states its speedup over (DeepGEMM's time
x that speedup, stated to a tenth: a few percent of rounding). Each row's stated memory bandwidth is checked against
the bytes the prices count (the weights, the rows in, the bf16 rows out).

    .venv/bin/python bench/gpu_gemm.py --published [--json FILE]
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import outfile  # noqa: E402
from kernel_timing import check_reps_and_gpu, choices, median_seconds  # noqa: E402

# The decode steps' weight shapes (K x N, one device, no tensor parallelism): Llama 2 70B's fused q/k/v, output
# projection, fused gate and up, and down projections, and Llama 2 7B's
DEFAULT_SHAPES = ("8192x10240,8192x8192,8192x57344,28672x8192,"
                  "4096x12288,4096x4096,4096x22016,11008x4096")
DEFAULT_ROWS = "16,32,64,128,256,512,1024,2048"
DTYPES = ("bf16", "fp8")
L2_SPAN = 256 * 2**20  # bytes of distinct weights per call: five times an H100's or H200's 50 MB L2
MAX_COPIES = 32
NEAR_RIDGE = 0.25  # a row is near the ridge where its smaller term is at least this share of its larger
PUBLISHED = Path(__file__).resolve().parent / "published" / "gemm.csv"
# The kernels a published row times: DeepGEMM's own, and the CUTLASS 3.6 implementation it states its speedup over
PUBLISHED_KERNELS = ("DeepGEMM", "CUTLASS 3.6")


def parse_shape(text: str) -> tuple[int, int]:
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape {text!r}: give KxN, two positive integers (the weight's input and output widths), "
                         "e.g. 8192x8192")
    return int(parts[0]), int(parts[1])


def parse_rows(text: str) -> list[int]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    if not rows or not all(r.isdigit() and int(r) > 0 for r in rows):
        raise ValueError(f"--rows {text!r}: give comma-separated positive integers (the matmuls' rows M), "
                         "e.g. 16,64,256")
    return [int(r) for r in rows]


def priced(chip_name: str, dtype: str, M: int, K: int, N: int) -> dict:
    """The matmul's compute and memory seconds as perfmodel.serving's decode step prices them, and the two prices."""
    from maxperf.perfmodel import chips, serving, work

    chip = chips.get(chip_name)
    fp8 = dtype == "fp8"
    peak = chip.peak_fp8_flops if fp8 and chip.peak_fp8_flops else chip.peak_bf16_flops
    operand = 1 if fp8 else 2
    compute = 2 * M * K * N / (peak * work.SHIPPED.fraction(chip))
    nbytes = K * N * operand + M * K * operand + M * N * 2  # the weights, the rows in, the bf16 rows out
    memory = nbytes / (chip.hbm_bandwidth * serving.DECODE_HBM_EFFICIENCY[chip.kind])
    return {"compute_s": compute, "memory_s": memory, "roofline_s": max(compute, memory), "sum_s": compute + memory,
            "bytes": nbytes}


def copies_for(K: int, N: int, dtype: str) -> int:
    """How many distinct weight matrices one call reads: at least L2_SPAN bytes of them, at most MAX_COPIES."""
    return max(1, min(MAX_COPIES, math.ceil(L2_SPAN / (K * N * (1 if dtype == "fp8" else 2)))))


def measure(chip: str, dtype: str, M: int, K: int, N: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    copies = copies_for(K, N, dtype)
    row: dict = {"dtype": dtype, "M": M, "K": K, "N": N, "copies": copies, "chip": chip,
                 "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "date": time.strftime("%Y-%m-%d", time.gmtime()), **priced(chip, dtype, M, K, N)}
    stored = jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16

    # the weights stored [N, K], as a serving stack keeps a linear layer's (out, in), which is the operand layout
    # cuBLASLt's FP8 GEMM takes without a transpose (contracting the second dim of both operands)
    contract = (((1,), (1,)), ((), ()))

    @jax.jit
    def matmuls(xs, ws):  # one matmul per weight matrix, each its own buffer; a scalar of each result kept
        return sum(jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.bfloat16)[0, 0].astype(jnp.float32)
                   for x, w in zip(xs, ws))

    try:
        key = jax.random.key(M * 7919 + K * 31 + N)
        keys = jax.random.split(key, 2 * copies)
        # values of a few units: in range for float8_e4m3fn, and no different to the hardware's speed
        xs = [jax.random.normal(keys[i], (M, K), jnp.float32).astype(stored) for i in range(copies)]
        ws = [jax.random.normal(keys[copies + i], (N, K), jnp.float32).astype(stored) for i in range(copies)]
        call_s = median_seconds(matmuls, (xs, ws), reps)
        del xs, ws
    except Exception as e:  # one shape's failure is its row's reason; the others still run
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    row["measured_s"] = call_s / copies
    row["tflops"] = 2 * M * K * N / row["measured_s"] / 1e12
    row["roofline_ratio"] = row["measured_s"] / row["roofline_s"]
    row["sum_ratio"] = row["measured_s"] / row["sum_s"]
    return row


def published_rows(path: Path = PUBLISHED) -> list[dict]:
    """The published GEMM timings, one row per kernel of each table line, each with its prices and the bytes they
    count (perfmodel's for the chip it is priced as, times its groups), the bytes its stated bandwidth moves in
    DeepGEMM's time, and its measured / priced ratios, as `measure` gives them."""
    rows = []
    with open(path, newline="") as f:
        for line in csv.DictReader(f):
            groups, M, N, K = (int(line[k]) for k in ("groups", "m", "n", "k"))
            flops = groups * 2 * M * N * K
            deepgemm_s = flops / (float(line["tflops"]) * 1e12)
            prices = {key: groups * value for key, value in priced(line["priced_as"], line["dtype"], M, K, N).items()}
            stated_bytes = float(line["gb_per_s"]) * 1e9 * deepgemm_s
            cutlass_s = deepgemm_s * float(line["speedup_over_cutlass"])
            for kernel, seconds in zip(PUBLISHED_KERNELS, (deepgemm_s, cutlass_s)):
                rows.append({"dtype": line["dtype"], "kernel": kernel, "groups": groups, "M": M, "K": K, "N": N,
                             "chip": line["priced_as"], "device": line["device"], "source": line["source"],
                             "stated_bytes": stated_bytes, **prices, "measured_s": seconds,
                             "tflops": flops / seconds / 1e12, "roofline_ratio": seconds / prices["roofline_s"],
                             "sum_ratio": seconds / prices["sum_s"]})
    return rows


def near_ridge(row: dict) -> bool:
    small, large = sorted((row["compute_s"], row["memory_s"]))
    return small >= NEAR_RIDGE * large


def summary(rows: list[dict]) -> list[str]:
    """Per dtype, each price's median and worst |measured / predicted - 1|, over all rows and those near the ridge."""
    lines = []
    kinds = sorted({(r["dtype"], r.get("kernel", "")) for r in rows})
    for dtype, kernel in kinds:
        timed = [r for r in rows if r["dtype"] == dtype and r.get("kernel", "") == kernel and "measured_s" in r]
        for label, subset in (("all rows", timed), ("near the ridge", [r for r in timed if near_ridge(r)])):
            if not subset:
                continue
            parts = []
            for price in ("roofline", "sum"):
                errors = [abs(r[f"{price}_ratio"] - 1) for r in subset]
                parts.append(f"{price} median {statistics.median(errors):.1%} worst {max(errors):.1%}")
            head = f"{dtype:<4} {kernel:<11} {label:<15}" if kernel else f"{dtype:<4} {label:<15}"
            lines.append(f"{head} n={len(subset):<3} " + ", ".join(parts))
    return lines


def line(row: dict) -> str:
    shape = f"M {row['M']:>5}  K {row['K']:>6}  N {row['N']:>6}"
    kernel = f"{row['kernel']:<11} {row['groups']} x " if "kernel" in row else ""
    head = f"{row['dtype']:<4} {kernel}{shape}"
    if "error" in row:
        return f"{head}  {row['error']}"
    return (f"{head}  {row['measured_s'] * 1e6:9.1f} us {row['tflops']:7.1f} TFLOP/s   roofline "
            f"{row['roofline_s'] * 1e6:9.1f} us (x{row['roofline_ratio']:.2f})   sum {row['sum_s'] * 1e6:9.1f} us "
            f"(x{row['sum_ratio']:.2f}){'   near the ridge' if near_ridge(row) else ''}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="h200", help="the GPU whose perfmodel prices the rows are set against")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated row counts M")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated KxN weight shapes")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--published", action="store_true",
                        help=f"price the published GEMM timings of {PUBLISHED.relative_to(PUBLISHED.parents[2])} "
                             "instead of timing this machine's GPU")
    args = parser.parse_args(argv)
    args.json = outfile.checked(parser, args.json)
    if args.published:
        return published_main(args.json)
    try:
        rows_m = parse_rows(args.rows)
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except ValueError as e:
        parser.error(str(e))
    dtypes = choices(parser, args.dtypes, DTYPES, "dtype")
    if not shapes or not dtypes:
        parser.error("give at least one shape (--shapes) and one dtype (--dtypes)")
    check_reps_and_gpu(parser, args.reps, args.chip)
    import jax

    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, priced as {args.chip}", flush=True)
    rows = []
    for dtype in dtypes:
        for K, N in shapes:
            for M in rows_m:
                row = measure(args.chip, dtype, M, K, N, args.reps)
                rows.append(row)
                print(line(row), flush=True)
                if args.json:
                    outfile.write(args.json, rows)
    for text in summary(rows):
        print(text)
    return 0


def published_main(json_path: str) -> int:
    rows = published_rows()
    gemms = len(rows) // len(PUBLISHED_KERNELS)
    print(f"# {PUBLISHED.name}: {gemms} published GEMMs x {len(PUBLISHED_KERNELS)} kernels, "
          f"priced as {rows[0]['chip']} at perfmodel's constants")
    for row in rows:
        print(line(row))
    for text in summary(rows):
        print(text)
    off = max(abs(r["bytes"] / r["stated_bytes"] - 1) for r in rows)
    print(f"bytes counted against each row's stated bandwidth x time: within {off:.1%} on every row")
    if json_path:
        outfile.write(json_path, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
