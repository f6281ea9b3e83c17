"""Causal attention kernels timed on this machine's GPU against the rate perfmodel prices them at: maxperf's own GPU
flash kernel (jax's Pallas Triton attention, as the step runs it: kv heads repeated, query pre-scaled), cuDNN's fused
attention (jax.nn.dot_product_attention, implementation "cudnn": what MaxText's attention=cudnn_flash_jax runs, and
the kernels that Transformer Engine's cudnn_flash_te calls), and XLA's dot product, forward and forward + backward.

    .venv/bin/python bench/gpu_attention.py [--chip h200] [--shapes BxLxHxKxD,...]
                                            [--kernels pallas,cudnn,xla] [--reps 20] [--json FILE]
    .venv/bin/python bench/gpu_attention.py --fit ROWS.json ...

Each row: the kernel's median time over --reps calls (after warm-up, random bf16 inputs), its rate in TFLOP/s counted
as FlashAttention's papers count it (causal: half of 4 B H L^2 D forward; the backward 2.5x the forward), the rate
perfmodel prices it at (the chip's peak x its sustained matmul fraction x FLASH_EFFICIENCY, x CUDNN_FLASH_SPEEDUP for
cuDNN's kernels, over the 128 x 128 blocks it computes whole), measured over predicted time, and its output's and
gradients' error against XLA's dot product in float32 on the first shape; then, per kernel, the law
rate_inf x L / (L + half) fitted to its rows at head dim 128 (`--fit FILE...` fits saved rows alone; the rows measured
on an H200 are bench/measured/h200_attention.json). A kernel that fails prints its one-line reason and the bench goes
on. On a machine without a GPU, `--interpret` runs the Pallas kernel in interpret mode and `--kernels pallas,xla` (the
test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import outfile  # noqa: E402
from kernel_timing import check_reps_and_gpu, choices, median_seconds  # noqa: E402

# llama3-8b's heads (32 query, 8 kv, 128 wide) at the sequence lengths of training steps; qwen3-0.6b's 16/8 at 128
DEFAULT_SHAPES = "8x2048x32x8x128,2x8192x32x8x128,1x16384x32x8x128,16x2048x16x8x128"
KERNELS = ("pallas", "cudnn", "xla")


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    parts = text.strip().lower().split("x")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape {text!r}: give BxLxHxKxD, five positive integers (batch, tokens, query heads, "
                         "kv heads, head dim), e.g. 8x2048x32x8x128")
    B, L, H, K, D = map(int, parts)
    if H % K:
        raise ValueError(f"shape {text!r}: {H} query heads do not split into {K} kv heads")
    return B, L, H, K, D


def paper_flops(B: int, L: int, H: int, D: int) -> tuple[float, float]:
    """Forward and backward FLOPs of causal attention as FlashAttention's papers count them."""
    forward = 4 * B * H * L * L * D / 2
    return forward, 2.5 * forward


def predicted_seconds(kernel: str, chip_name: str, B: int, L: int, H: int, D: int) -> tuple[float, float] | None:
    """perfmodel's forward and backward seconds for the flash kernel `kernel` ("pallas": FLASH_EFFICIENCY's kernels;
    "cudnn": at CUDNN_FLASH_SPEEDUP where the chip has it), over the 128 x 128 blocks it computes whole; None for the
    dot product (priced as einsums, not as a kernel)."""
    if kernel == "xla":
        return None
    from maxperf.perfmodel import chips, flops, work

    chip = chips.get(chip_name)
    train = SimpleNamespace(attention="cudnn_flash_jax" if kernel == "cudnn" else "flash")
    rate = (chip.peak_bf16_flops * chips.MATMUL_FRACTION[chip.name] * work.FLASH_EFFICIENCY[chip.kind]
            * work.flash_speedup(chip, train))
    forward = forward_flops(B, L, H, D)
    return forward / rate, forward * flops.FLASH_BACKWARD_MATMULS / 2 / rate


def forward_flops(B: int, L: int, H: int, D: int) -> float:
    """The forward's FLOPs as perfmodel counts a flash kernel's: its two matmuls over the 128 x 128 blocks holding an
    unmasked pair, whole (flops.executed_pairs)."""
    from maxperf.perfmodel import flops

    return 2 * B * flops.block_pairs(L, 0, flops.GPU_FLASH_BLOCK, flops.GPU_FLASH_BLOCK) * H * (D + D)


def model_flops(B: int, L: int, H: int, D: int) -> float:
    """Forward + backward FLOPs as perfmodel counts them: FLASH_BACKWARD_MATMULS backward to the forward's two."""
    from maxperf.perfmodel import flops

    return forward_flops(B, L, H, D) * (2 + flops.FLASH_BACKWARD_MATMULS) / 2


def fit_length_law(rows: list[dict]) -> dict[str, dict]:
    """Per kernel, over its rows at head dim 128: the rate (in perfmodel's FLOPs, forward + backward) as
    rate_inf x L / (L + half), least squares on log rate (half on a grid of 10 tokens); with the worst row's
    deviation from the law."""
    import numpy as np

    fits = {}
    for kernel in sorted({r["kernel"] for r in rows}):
        points = [(r["L"], model_flops(r["B"], r["L"], r["H"], r["D"]) / r["forward_backward_s"])
                  for r in rows if r["kernel"] == kernel and r["D"] == 128 and "forward_backward_s" in r]
        if len({L for L, _ in points}) < 3:
            continue
        L, rate = np.array([p[0] for p in points], float), np.log([p[1] for p in points])
        best = None
        for half in np.arange(0.0, 8000.0, 10.0):
            shape = np.log(L / (L + half))
            scale = float(np.mean(rate - shape))
            residual = rate - shape - scale
            if best is None or float(residual @ residual) < best[0]:
                best = (float(residual @ residual), half, scale, float(np.max(np.abs(np.expm1(residual)))))
        _, half, scale, worst = best
        fits[kernel] = {"half_length": half, "rate_inf_tflops": float(np.exp(scale)) / 1e12, "worst": worst,
                        "rows": len(points)}
    return fits


def valid_row(row) -> bool:
    """A row as measure() writes it: its kernel and shape, and a positive time or the reason it has none."""
    if not isinstance(row, dict) or not isinstance(row.get("kernel"), str):
        return False
    if not all(isinstance(row.get(k), int) and row[k] > 0 for k in ("B", "L", "H", "D")):
        return False
    seconds = row.get("forward_backward_s")
    return "error" in row or (isinstance(seconds, (int, float)) and seconds > 0)


def fit_lines(fits: dict[str, dict]) -> list[str]:
    return [f"fit {kernel:<14} rate {f['rate_inf_tflops']:6.1f} TFLOP/s x L / (L + {f['half_length']:.0f}) over "
            f"{f['rows']} rows at head dim 128, worst row {f['worst']:.1%} off the law" for kernel, f in fits.items()]


def attention_fn(kernel: str, interpret: bool):
    """q [B, L, H, D] (pre-scaled), k and v [B, L, K, D] -> [B, L, H, D]."""
    import jax

    if kernel == "pallas":
        from maxperf.models.layers.attention_kernels import gpu_flash

        def pallas(q, k, v):
            B, L, H, D = q.shape
            K = k.shape[2]
            return gpu_flash(q.reshape(B, L, K, H // K, D), k, v, interpret=interpret).reshape(B, L, H, D)
        return pallas
    implementation = "cudnn" if kernel == "cudnn" else "xla"

    def fused(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation=implementation)
    return fused


def measure(kernel: str, shape: tuple[int, ...], chip: str, reps: int, interpret: bool, check: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    B, L, H, K, D = shape
    attend = attention_fn(kernel, interpret)
    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, dout):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(dout)

    row: dict = {"kernel": kernel, "shape": "x".join(map(str, shape)), "B": B, "L": L, "H": H, "K": K, "D": D,
                 "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "date": time.strftime("%Y-%m-%d", time.gmtime())}
    try:
        keys = jax.random.split(jax.random.key(sum(shape) + len(kernel)), 4)
        q = (jax.random.normal(keys[0], (B, L, H, D), jnp.float32) * D**-0.5).astype(jnp.bfloat16)
        k = jax.random.normal(keys[1], (B, L, K, D), jnp.bfloat16)
        v = jax.random.normal(keys[2], (B, L, K, D), jnp.bfloat16)
        dout = jax.random.normal(keys[3], (B, L, H, D), jnp.bfloat16)
        if check:
            reference = attention_fn("xla", False)
            wide = [x.astype(jnp.float32) for x in (q, k, v, dout)]
            want = jax.jit(lambda q, k, v, d: (lambda o, p: (o, *p(d)))(*jax.vjp(reference, q, k, v)))(*wide)
            out, grads = forward_backward(q, k, v, dout)
            errors = [np.linalg.norm(np.asarray(g, np.float64) - np.asarray(w, np.float64)) / np.linalg.norm(w)
                      for g, w in zip((out, *grads), want)]
            row["relative_error"] = float(errors[0])  # the output's
            row["gradient_relative_error"] = float(max(errors[1:]))  # the worst of dq, dk, dv
        row["forward_s"] = median_seconds(forward, (q, k, v), reps)
        row["forward_backward_s"] = median_seconds(forward_backward, (q, k, v, dout), reps)
    except Exception as e:  # one kernel's failure is a row's reason; the others still run
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    fwd_flops, bwd_flops = paper_flops(B, L, H, D)
    row["backward_s"] = max(row["forward_backward_s"] - row["forward_s"], 0.0)
    row["forward_tflops"] = fwd_flops / row["forward_s"] / 1e12
    row["forward_backward_tflops"] = (fwd_flops + bwd_flops) / row["forward_backward_s"] / 1e12
    if (predicted := predicted_seconds(kernel, chip, B, L, H, D)) is not None:
        row["predicted_forward_backward_s"] = sum(predicted)
        row["measured_over_predicted"] = row["forward_backward_s"] / sum(predicted)
    return row


def line(row: dict) -> str:
    head = f"{row['kernel']:<7} {row['shape']:<18}"
    if "error" in row:
        return f"{head} {row['error']}"
    text = (f"{head} fwd {row['forward_s'] * 1e3:8.3f} ms {row['forward_tflops']:6.1f} TFLOP/s   fwd+bwd "
            f"{row['forward_backward_s'] * 1e3:8.3f} ms {row['forward_backward_tflops']:6.1f} TFLOP/s")
    if "measured_over_predicted" in row:
        text += (f"   predicted {row['predicted_forward_backward_s'] * 1e3:8.3f} ms "
                 f"(measured x{row['measured_over_predicted']:.2f})")
    if "relative_error" in row:
        text += f"   error {row['relative_error']:.1e}, gradients {row['gradient_relative_error']:.1e}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="h200", help="the chip whose perfmodel rates the rows are set against")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BxLxHxKxD")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--interpret", action="store_true", help="the Pallas kernel in interpret mode (no GPU)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--fit", nargs="+", metavar="ROWS", default=None,
                        help="measure nothing: fit the length law to the rows of these --json files")
    args = parser.parse_args(argv)
    args.json = outfile.checked(parser, args.json)
    if args.fit is not None:
        try:
            saved = [row for path in args.fit for row in json.loads(Path(path).read_text())]
        except (OSError, ValueError, TypeError) as e:
            parser.error(f"--fit: cannot read the rows ({e})")
        if bad := next((row for row in saved if not valid_row(row)), None):
            parser.error(f"--fit: {str(bad)[:120]} is not a row of this bench's --json (kernel, B, L, H, D and "
                         "a positive forward_backward_s, or an error)")
        print("\n".join(fit_lines(fit_length_law(saved))) or "fit: fewer than 3 lengths at head dim 128 per kernel")
        return 0
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except ValueError as e:
        parser.error(str(e))
    kernels = choices(parser, args.kernels, KERNELS, "kernel")
    if not shapes or not kernels:
        parser.error("give at least one shape (--shapes) and one kernel (--kernels)")
    check_reps_and_gpu(parser, args.reps, args.chip)
    import jax

    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    for i, shape in enumerate(shapes):
        for kernel in kernels:
            if kernel == "xla" and shape[0] * shape[2] * shape[1] ** 2 * 4 > 8 * 2**30:
                continue  # the dot product's float32 scores past 8 GiB: not what a step at that length runs
            row = measure(kernel, shape, args.chip, args.reps, args.interpret, check=i == 0 and kernel != "xla")
            rows.append(row)
            print(line(row), flush=True)
            if args.json:
                outfile.write(args.json, rows)
    for text in fit_lines(fit_length_law(rows)):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
