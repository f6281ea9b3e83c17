"""perfmodel's memory per device against XLA's, over the grid of the fidelity and MoE issues.

    .venv/bin/python bench/memory_accuracy.py [--cache FILE] [--only SUBSTRING] [--group NAME] [--json FILE]
                                              [--error-json FILE]

For each case it compiles the train step for a TPU or GPU topology (compile-only devices, through maxperf.aot, into
a temporary directory; one compile at a time) and prints the analytical per-device total (perfmodel.estimate_memory)
beside the compiler's (argument + output - alias + temp + code, from memory_analysis), the signed error of the
analytical figure, and per group the median and worst absolute error; beside them, from libtpu's INFO log (TPU_LOG_DIR,
unbuffered), the bytes live at the peak (the total less the heap's fragmentation), the analytical figure's error
against them and the fragmentation's share of the temporaries. Every case not in the cache compiles (maxperf's
compile cache off: a cached compile logs nothing). `--cache FILE` keeps the compiler's figures
in a JSON file keyed by the case, so that a second run after a change to perfmodel's formulas recompiles nothing
(the compiler's figures depend on the step, not on perfmodel); delete the file to measure again; `--cached-only`
reports the cached cases alone. `--error-json` writes the summary of every TPU case reported (median and worst
absolute error, the 90th percentile of the signed underestimate) as maxperf/search/memory_error.json's entry for
"tpu", TPU7x's for "tpu7x" and the GPU mixture-of-experts steps that fit for "gpu moe" (entries a run does not
measure stay), from which
`maxperf plan` takes its memory margin and `maxperf estimate` its "too close to call" line (maxperf.search.margin).

The design. A full factorial of tensor parallelism (1, 2, 4, 8, 16) x per-device batch (1 to 32) x sequence length
(2048, 4096, 8192) x 12 remat policies x 2 kernels is 2160 compiles; on a shared 2-core machine one TPU compile of
this step takes 100-200 s, so the design covers every level of every factor once or more instead. On llama2-7b's
widths (D 4096, H = K = 32, F 11008, V 32000) cut to 4 scanned layers (`num_layers=4`: a scanned step keeps one
stacked buffer per saved tensor and one layer's working set, so the per-layer terms are those of the full depth),
all on v5p-32 (16 chips; the rest of the mesh is FSDP):
- "policies": every remat policy (custom as CUSTOM below) at one base shape (tensor 4, B 2, L 2048), the kernels
  alternating (12 compiles), and "rest": each policy with the other kernel (12 more, run last);
- "shapes": SHAPES, 7 compiles: every tensor-parallel degree, batch and length at least once, each kernel three
  times or more, every step within v5p's 95 GiB (past it the compiler's own rematerialization changes the step);
  and WIDE_FSDP, the same widths on v5p-128 (FSDP over 64 devices, as MaxText's llama2-7b runs it);
- "moe": every MoE preset of the MoE issue at 4 layers (DeepSeek's first dense layers included; deepseek-v3 at 5,
  so that its MoE layers run as a scan) on a v5p topology where the full-depth model fits, B 2, L 2048, remat full,
  flash, with expert parallelism for those with 128 or more experts of 100B parameters or more except Llama 4 (run
  as `maxperf estimate-memory` runs it by default); mixtral-8x7b under tensor parallelism with the mesh, policy and
  accumulation `maxperf plan` chose; deepseek-v3 with multi-token prediction (13 compiles); "depth":
  deepseek-v2-lite at 8 layers beside its 4, to check that the error does not depend on the depth (1 compile).
And "offload": MaxText's host-offload recipe on v6e-256 at llama3-70b's widths (OFFLOAD, 5 compiles); "pipeline":
MaxText's pipeline parallelism at llama2-7b's widths cut to 8 layers (PIPELINE, 10 compiles). 61 TPU compiles in all.
The groups run interleaved (policies, shapes, moe with depth), then rest and offload, so that a run cut short covers
each; then pipeline, then "gpu" (GPU_MOE, 21 compiles for H100s), whose summary stands apart: `--error-json` writes
it as the "gpu moe" entry, which GPU mixtures of experts alone take.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
import outfile  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices; nothing runs here
# libtpu logs, for each program it compiles, its HBM temporaries: the bytes live at the heap's peak ("Unpadded") and
# the heap's fragmentation beside them; memory_analysis's temp counts both. Set before libtpu loads.
if "TPU_LOG_DIR" not in os.environ:  # a folder of this run's own, removed when it ends
    os.environ["TPU_LOG_DIR"] = tempfile.mkdtemp(prefix="maxperf-memacc-tpulog-")
    atexit.register(shutil.rmtree, os.environ["TPU_LOG_DIR"], ignore_errors=True)
TPU_LOG = Path(os.environ["TPU_LOG_DIR"])
# unbuffered (glog writes a buffered message out only when a later one comes), so that a compile's block is in the
# log when it returns; a compile served from maxperf's compile cache logs nothing: every case not in --cache compiles
os.environ["LIBTPU_INIT_ARGS"] = " ".join((os.environ.get("LIBTPU_INIT_ARGS", ""), "--logbuflevel=-1")).strip()
os.environ["MAXPERF_NO_CACHE"] = "1"
LOG_WAIT_S = 10.0

from maxperf.search import memory_fit  # noqa: E402

GIB = 1 << 30
DENSE = "llama2-7b"
DENSE_TOPOLOGY = "v5p-32"
LAYERS = "num_layers=4"
# MaxText's remat policies, those least like the others first (a run cut short still covers offload and custom)
POLICIES = ("none", "minimal", "qkv_proj_offloaded", "minimal_offloaded", "custom", "minimal_with_context",
            "save_dot_with_context_except_mlp", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
            "save_out_proj", "full")
# remat_policy=custom: a mix of all three locations
CUSTOM = ("query_proj=device", "key_proj=offload", "value_proj=offload", "context=device", "mlpwi_0=device",
          "mlpwo=offload")
KERNELS = ("flash", "dot_product")
TENSOR = (1, 2, 4, 8, 16)
BATCH = (1, 2, 4, 8, 16, 32)
LENGTH = (2048, 4096, 8192)
BASE = (4, 2, 2048)  # tensor, batch, length of the "policies" group
# tensor, batch, length, remat policy, kernel of the "shapes" group: every level of tensor, batch and length at
# least once, each kernel three times, policies other than the base's kernel; every step fits v5p's 95 GiB
SHAPES = ((1, 1, 8192, "full", "dot_product"), (2, 4, 4096, "minimal", "dot_product"),
          (4, 32, 2048, "full", "flash"), (8, 16, 4096, "full", "flash"),
          (16, 2, 8192, "save_dot_except_mlp", "flash"), (8, 8, 2048, "save_out_proj", "dot_product"),
          (1, 1, 2048, "none", "flash"))
# and one on a wider FSDP axis (64), the reference step (llama2-7b, v5p-128, B 4, L 2048) at 4 layers
WIDE_FSDP = ("v5p-128", 1, 4, 2048, "full", "flash")
# MoE presets, a v5p topology where each fits at full depth (its state and one step's activations in 95 GiB) and
# the expert parallelism MaxText's users give the ones with many experts (else FSDP gathers every expert)
MOE = (("mixtral-8x7b", "v5p-32", ()), ("deepseek-v2-lite", "v5p-8", ()), ("qwen3-30b-a3b", "v5p-32", ()),
       ("gpt-oss-20b", "v5p-16", ()), ("mixtral-8x22b", "v5p-128", ()),
       ("gpt-oss-120b", "v5p-64", ("ici_expert_parallelism=8",)),
       ("qwen3-235b-a22b", "v5p-256", ("ici_expert_parallelism=16",)),
       # DeepSeek-V3 at 5 layers, its 3 first dense ones and 2 MoE layers, so that the MoE layers run as a scan as at
       # full depth (a stack of one MoE layer compiled to 87.87 GiB per device where kimi-k2's scan of three, the
       # same widths and exchange buffers, took 67.53)
       ("deepseek-v3", "v5p-512", ("num_layers=5", "ici_expert_parallelism=32")),
       ("kimi-k2", "v5p-1024", ("ici_expert_parallelism=32",)),
       # Llama 4 at 4 layers: scout's fourth is global (nope_layer_interval 4); maverick's interleaving keeps two
       # dense and two MoE layers. Without expert parallelism, as `maxperf estimate-memory` runs them by default
       ("llama4-scout-17b-16e", "v5p-256", ()), ("llama4-maverick-17b-128e", "v5p-512", ()),
       # tensor parallelism on the experts' width: the mesh, policy and accumulation `maxperf plan` chose for
       # mixtral-8x7b on v5p-64 (1M tokens a step)
       ("mixtral-8x7b", "v5p-64", ("ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=4",
                                   "ici_tensor_parallelism=4", "remat_policy=minimal", "grad_accum_steps=8")),
       # DeepSeek-V3's multi-token prediction: one module (README's compile line; beside the case above, B 2, it
       # needs 107.90 GiB, past v5p's 95)
       ("deepseek-v3", "v5p-128", ("per_device_batch_size=1", "seq_len=1024", "ici_expert_parallelism=8",
                                   "routed_bias_update_rate=0.001", "mtp_num_layers=1")))
MOE_COMMON = ("per_device_batch_size=2", "seq_len=2048", "remat_policy=full", "attention=flash")
# "gpu": the MoE presets on H100s (jax's CUDA plugin compiling without a GPU; a compile takes 15-60 s here), L 2048,
# remat full, the attention kernel `auto` picks: at full depth where the step fits an H100's 80 GB, cut to a few
# layers on one H100 (B 1 to 4) and on eight with expert parallelism, and the two largest presets past it on
# h100-8x16 (their verdict); the summary counts the steps that fit
GPU_MOE = (("deepseek-v2-lite", "h100-8", ("per_device_batch_size=1",)),
           ("deepseek-v2-lite", "h100-8", ("per_device_batch_size=2",)),
           ("deepseek-v2-lite", "h100-8", ("per_device_batch_size=1", "ici_expert_parallelism=8")),
           ("gpt-oss-20b", "h100-8", ("per_device_batch_size=1",)),
           ("gpt-oss-20b", "h100-8", ("per_device_batch_size=2",)),
           ("qwen3-30b-a3b", "h100-8", ("per_device_batch_size=1", "ici_expert_parallelism=8")),
           ("deepseek-v2-lite", "h100-1", ("num_layers=3", "per_device_batch_size=1")),
           ("deepseek-v2-lite", "h100-1", ("num_layers=3", "per_device_batch_size=2")),
           ("deepseek-v2-lite", "h100-8", ("num_layers=3", "per_device_batch_size=2", "ici_expert_parallelism=8")),
           ("qwen3-30b-a3b", "h100-1", ("num_layers=2", "per_device_batch_size=1")),
           ("qwen3-30b-a3b", "h100-8", ("num_layers=2", "per_device_batch_size=2", "ici_expert_parallelism=8")),
           *(("mixtral-8x7b", "h100-1", ("num_layers=2", f"per_device_batch_size={b}")) for b in (1, 2, 4)),
           # FSDP alone over eight: every layer's experts gathered whole (bf16[8, 4096, 14336] each)
           *(("mixtral-8x7b", "h100-8", ("num_layers=2", f"per_device_batch_size={b}")) for b in (1, 4)),
           *(("gpt-oss-20b", "h100-1", ("num_layers=2", f"per_device_batch_size={b}")) for b in (1, 2, 4)),
           *((m, "h100-8x16", ("per_device_batch_size=1", "ici_expert_parallelism=8", "dcn_fsdp_parallelism=16"))
             for m in ("deepseek-v3", "qwen3-235b-a22b")))
DEPTHS = (8,)
# "pipeline": MaxText's pipeline (ici_pipeline_parallelism) at llama2-7b's widths cut to 8 layers, L 2048, flash, on
# v5p-16 (8 chips: stage x fsdp) and v5p-32: MaxText's defaults (circular, as many microbatches as stages), more
# microbatches, one repeat, the forwarding delay, the weights gathered once, 4 stages, tensor parallelism beside,
# another remat policy, 6 layers with the embedding's and loss's places (Megatron's uneven stages), and an
# offloading policy
PIPELINE_COMMON = ("num_layers=8", "seq_len=2048", "attention=flash")
PIPELINE = (("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=4", "remat_policy=full")),
            ("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=4", "remat_policy=full",
                        "num_pipeline_microbatches=8")),
            ("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=4", "remat_policy=full",
                        "num_layers_per_pipeline_stage=4")),
            ("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=4", "remat_policy=full",
                        "num_pipeline_microbatches=4", "pipeline_delay_activation_forwarding=true")),
            ("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=4", "remat_policy=full",
                        "pipeline_fsdp_ag_once=true")),
            ("v5p-32", ("ici_pipeline_parallelism=4", "per_device_batch_size=2", "remat_policy=full")),
            ("v5p-32", ("ici_pipeline_parallelism=2", "ici_tensor_parallelism=2", "per_device_batch_size=4",
                        "remat_policy=full")),
            ("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=2", "remat_policy=minimal")),
            # Megatron's uneven stages: 6 layers and the embedding's and loss's places, 2 stages x 2 repeats x 2
            ("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=4", "remat_policy=full", "num_layers=6",
                        "num_layers_per_pipeline_stage=2", "account_for_embedding_in_pipeline_split=true",
                        "account_for_loss_in_pipeline_split=true")),
            # an offloading policy on each iteration
            ("v5p-16", ("ici_pipeline_parallelism=2", "per_device_batch_size=4", "remat_policy=minimal_offloaded")))
# "offload": MaxText's host-offload recipes on v6e (its llama3.1-70b recipe offloads the layer input and q, k, v), at
# llama3-70b's widths cut to 4 layers on v6e-256 (fsdp 256), L 8192, flash: the policy MaxText's recipe sets, the layer
# input alone, q, k, v alone, and full remat beside them, at the recipe's B 5 and at B 2
OFFLOAD_MODEL, OFFLOAD_TOPOLOGY = "llama3-70b", "v6e-256"
OFFLOAD_COMMON = ("num_layers=4", "seq_len=8192", "attention=flash")
OFFLOAD = (("per_device_batch_size=5", "remat_policy=custom", "decoder_layer_input=offload", "query_proj=offload",
            "key_proj=offload", "value_proj=offload"),
           ("per_device_batch_size=5", "remat_policy=custom", "decoder_layer_input=offload"),
           ("per_device_batch_size=5", "remat_policy=custom", "query_proj=offload", "key_proj=offload",
            "value_proj=offload"),
           ("per_device_batch_size=5", "remat_policy=full"),
           ("per_device_batch_size=2", "remat_policy=full"))


# "tpu7x": libtpu's TPU7x target (working.LATE_TABLE_GRADIENT_CHIPS): llama2-7b's widths at 4 layers, B 2, L 2048,
# full remat, on tpu7x-128 over fsdp alone and beside a data axis (shards thinner than the matrix unit) and on tpu7x-8
# (thick), and tpu-recipes' gpt-oss-120b recipe cut to 4 layers (data 2 x fsdp 64, B 10, L 8192): full remat, and the
# recipe's offloads with the experts stored both ways
LLAMA_TPU7X = ("num_layers=4", "seq_len=2048", "per_device_batch_size=2")
TPU7X = (*(("llama2-7b", t, (*LLAMA_TPU7X, *mesh, "remat_policy=full", "attention=flash"))
           for t, mesh in (("tpu7x-128", ("ici_fsdp_parallelism=128",)),
                           ("tpu7x-128", ("ici_data_parallelism=2", "ici_fsdp_parallelism=64")), ("tpu7x-8", ()))),
         *(("gpt-oss-120b", "tpu7x-128", ("num_layers=4", "per_device_batch_size=10", "seq_len=8192",
                                          "attention=flash", "ici_fsdp_parallelism=64", "ici_data_parallelism=2",
                                          *extra))
           for extra in (("remat_policy=full", "shard_exp_on_fsdp=true"),
                         ("remat_policy=custom", "decoder_layer_input=offload", "mlpwo=offload",
                          "shard_exp_on_fsdp=true"),
                         ("remat_policy=custom", "decoder_layer_input=offload", "mlpwo=offload"))))


def dense(tp: int, b: int, length: int, policy: str, kernel: str) -> tuple[str, ...]:
    return (LAYERS, f"ici_tensor_parallelism={tp}", f"per_device_batch_size={b}", f"seq_len={length}",
            f"remat_policy={policy}", *(CUSTOM if policy == "custom" else ()), f"attention={kernel}")


def merged(common: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    """`common` less the keys `extra` sets, then `extra`."""
    mine = {e.split("=", 1)[0] for e in extra}
    return (*(c for c in common if c.split("=", 1)[0] not in mine), *extra)


def cases() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(group, model, topology, overrides) of every case, in the order they run: the three groups interleaved, so
    that a run cut short has covered each (the "depth" case after the MoE preset it deepens), then the "rest" (the
    other kernel of each policy)."""
    policies = [("policies", DENSE, DENSE_TOPOLOGY, dense(*BASE, p, KERNELS[(i + 1) % 2]))
                for i, p in enumerate(POLICIES)]
    shapes = [("shapes", DENSE, DENSE_TOPOLOGY, dense(*shape)) for shape in SHAPES]
    shapes.insert(2, ("shapes", DENSE, WIDE_FSDP[0], dense(*WIDE_FSDP[1:])))
    moe = [("moe", m, t, merged((LAYERS, *MOE_COMMON), extra)) for m, t, extra in MOE]
    depth = [("depth", m, t, (f"num_layers={n}", *MOE_COMMON, *extra)) for m, t, extra in MOE[1:2] for n in DEPTHS]
    first = [c for trio in itertools.zip_longest(policies, shapes, moe[:2] + depth + moe[2:]) for c in trio if c]
    rest = [("rest", DENSE, DENSE_TOPOLOGY, dense(*BASE, p, KERNELS[i % 2])) for i, p in enumerate(POLICIES)]
    offload = [("offload", OFFLOAD_MODEL, OFFLOAD_TOPOLOGY, (*OFFLOAD_COMMON, *extra)) for extra in OFFLOAD]
    pipeline = [("pipeline", DENSE, t, (*PIPELINE_COMMON, *extra)) for t, extra in PIPELINE]
    tpu7x = [("tpu7x", m, t, extra) for m, t, extra in TPU7X]
    gpu = [("gpu", m, t, extra) for m, t, extra in GPU_MOE]
    return first + rest + offload + pipeline + tpu7x + gpu


def key(model: str, topology: str, overrides: tuple[str, ...]) -> str:
    return " ".join((model, topology, *overrides))


UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}  # libtpu's sizes: 10.21G is GiB
HBM_TEMP = re.compile(r"module name: jit_step\n(?:[^\n]*\n)*?Program hbm requirement [^\n]*\n(?:[^\n]*\n)*?"
                      r"\s+HLO temp\s+([\d.]+)([KMGT]?)B? \([^)]*"
                      r"Unpadded \(([\d.]+)([KMGT]?)B?\)[^)]*\)[^(]*fragmentation \(([\d.]+)([KMGT]?)B?\)")


class LibtpuLog:
    """The HBM temporaries of the train step (jit_step) libtpu compiled since the last read (tpu_driver.INFO in
    TPU_LOG)."""

    def __init__(self) -> None:
        self.offset = self._size()

    @staticmethod
    def _path() -> Path:
        return TPU_LOG / "tpu_driver.INFO"

    def _size(self) -> int:
        return self._path().stat().st_size if self._path().exists() else 0

    def read(self) -> dict | None:
        """{"temp", "live", "fragmentation"} in bytes of the train step compiled since the last read, waiting
        up to LOG_WAIT_S for glog to write it; None where libtpu logged none."""
        deadline = time.monotonic() + LOG_WAIT_S
        while True:
            data = b""
            if self._path().exists():
                with self._path().open("rb") as f:
                    f.seek(self.offset)
                    data = f.read()
            found = [{"temp": float(m[0]) * UNITS[m[1]], "live": float(m[2]) * UNITS[m[3]],
                      "fragmentation": float(m[4]) * UNITS[m[5]]}
                     for m in HBM_TEMP.findall(data.decode("utf-8", "replace"))]
            if found or time.monotonic() > deadline:
                self.offset += len(data)
                return max(found, key=lambda d: d["temp"], default=None)
            time.sleep(1.0)


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    under = sorted(-r["error"] for r in rows)  # positive where the analytical figure is below the compiler's
    # the margin that keeps every case's compiler figure within analytical x (1 + margin): a fit check's margin
    need = max(r["compiler_bytes"] / r["analytical_bytes"] - 1 for r in rows)
    return {"median": statistics.median(errors), "worst": max(errors),
            "p90_underestimate": under[min(len(under) - 1, int(0.9 * len(under)))],
            "worst_underestimate": need, "cases": len(rows),
            # the largest over-estimate (analytical / compiler - 1): how far a "does not fit" may be wrong
            "worst_overestimate": max(max(r["error"] for r in rows), 0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, help="JSON file of compiler figures to reuse and extend")
    ap.add_argument("--only", default="", help="run only cases whose key contains this text")
    ap.add_argument("--group", choices=("policies", "shapes", "moe", "depth", "rest", "offload", "pipeline", "tpu7x",
                                        "gpu"),
                    action="append",
                    help="run only this group (repeatable)")
    ap.add_argument("--cached-only", action="store_true", help="report only the cases the cache holds")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--error-json", type=Path, help="write the summaries of the TPU groups, TPU7x's and the GPUs' "
                                                    "(memory_error.json schema; the entries not measured stay)")
    args = ap.parse_args()
    args.json = outfile.checked(ap, args.json)
    args.error_json = outfile.checked(ap, args.error_json, "--error-json")
    args.cache = outfile.checked(ap, args.cache, "--cache")
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    log = LibtpuLog()
    rows = []
    print(f"{'group':<8} {'model':<16} {'topology':<8} {'tp':>2} {'B':>2} {'L':>4} {'remat':<32} {'kernel':<11} "
          f"{'analytical':>10} {'compiler':>9} {'error':>7} {'live':>6} {'error':>7} {'frag':>5}  compile")
    for group, model, topology, overrides in cases():
        k = key(model, topology, overrides)
        if (args.only and args.only not in k) or (args.group and group not in args.group):
            continue
        if k in cache:
            compiler, seconds, libtpu = cache[k]["compiler"], None, cache[k].get("libtpu")
            cmp = memory_fit.compare(topology, model, overrides, analytical_only=True)
        elif args.cached_only:
            continue
        else:
            t0 = time.perf_counter()
            cmp = memory_fit.compare(topology, model, overrides,
                                     progress=lambda s: print(f"  [{k}] {s}", file=sys.stderr, flush=True))
            compiler, seconds = cmp.compiler, time.perf_counter() - t0
            libtpu = log.read() if not topology.startswith(("h100", "a100", "h200", "b200")) else None
            if args.cache:  # reread: another run may have added cases since
                cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
                cache[k] = {"compiler": compiler, **({"libtpu": libtpu} if libtpu else {})}
                outfile.write(args.cache, cache)
        analytical = cmp.analytical.per_device_total_bytes
        total = compiler["per_device_total_bytes"]
        error = (analytical - total) / total
        # the compiler's figure less the heap's fragmentation: what is live at the peak
        live = total - libtpu["fragmentation"] if libtpu else None
        train = cmp.plan.configs.train
        tp = cmp.plan.mesh.axes.get("tensor", 1)
        remat, kernel = str(train.remat_policy.value), str(getattr(train.attention, "value", train.attention))
        rows.append({"group": group, "model": model, "topology": topology, "overrides": list(overrides),
                     "tensor": tp, "batch": train.per_device_batch_size, "seq_len": train.seq_len, "remat": remat,
                     "kernel": kernel, "analytical_bytes": analytical, "compiler_bytes": total, "error": error,
                     "live_bytes": live, "fragmentation": libtpu["fragmentation"] / libtpu["temp"] if libtpu else None,
                     "fits": bool(compiler["fits"]),
                     "compiler": compiler, "analytical": cmp.analytical.as_dict()})
        print(f"{group:<8} {model:<16} {topology:<8} {tp:>2} {train.per_device_batch_size:>2} {train.seq_len:>4} "
              f"{remat:<32} {kernel:<11} {analytical / GIB:>10.2f} {total / GIB:>9.2f} {error:>+7.1%} "
              + (f"{live / GIB:>6.2f} {(analytical - live) / live:>+7.1%} "
                 f"{libtpu['fragmentation'] / libtpu['temp']:>5.1%}  " if live else f"{'':>6} {'':>7} {'':>5}  ")
              + ("cached" if seconds is None else f"{seconds:.0f} s") + ("" if compiler["fits"] else "  (does not fit)")
              + (f"  [{' '.join(overrides)}]" if group == "gpu" else ""), flush=True)
    if not rows:
        print("no case matched")
        return 1
    print()
    for group in ("policies", "shapes", "rest", "moe", "depth", "offload", "pipeline", "tpu7x"):
        mine = [r for r in rows if r["group"] == group]
        if mine:
            s = summary(mine)
            worst = max(mine, key=lambda r: abs(r["error"]))
            print(f"{group:<8} {s['cases']:>3} cases: median |error| {s['median']:.1%}, worst {s['worst']:.1%} "
                  f"({key(worst['model'], worst['topology'], tuple(worst['overrides']))}), "
                  f"p90 underestimate {s['p90_underestimate']:.1%}")
    grid = [r for r in rows if r["group"] in ("policies", "shapes", "rest")]
    if grid:
        s = summary(grid)
        print(f"dense grid {s['cases']} cases: median |error| {s['median']:.1%} (target <= 10%), worst "
              f"{s['worst']:.1%} (target <= 20%)")
    moe = [r for r in rows if r["group"] in ("moe", "depth")]
    if moe:
        print(f"MoE worst |error| {summary(moe)['worst']:.1%} (target <= 15%)")
    gpu = [r for r in rows if r["group"] == "gpu" and r["fits"]]
    if gpu:
        s = summary(gpu)
        print(f"GPU MoE, the {s['cases']} steps that fit: median |error| {s['median']:.1%}, worst {s['worst']:.1%} "
              f"(target <= 15%)")
    if args.json:
        outfile.write(args.json, rows)
    # TPU7x's compiler schedules apart (working.LATE_TABLE_GRADIENT_CHIPS): its margin is its own (search.margin), as
    # the GPUs' (their steps that fit)
    tpu = [r for r in rows if r["group"] not in ("gpu", "tpu7x")]
    tpu7x = [r for r in rows if r["group"] == "tpu7x"]
    if args.error_json and (tpu or tpu7x or gpu):
        # the compiler's figures do not depend on perfmodel: a run from the cache measures what a fresh one would
        argv = [a for a in sys.argv[1:] if a != "--cached-only"]
        if "--cache" in argv:
            del argv[argv.index("--cache"):argv.index("--cache") + 2]
        command = " ".join([".venv/bin/python bench/memory_accuracy.py", *argv])
        # the entries this run measured replace theirs; the others stay
        doc = json.loads(args.error_json.read_text()) if args.error_json.exists() else {}
        doc |= {name: {**summary(mine), "command": command, "date": datetime.date.today().isoformat(),
                       "groups": sorted({r["group"] for r in mine})}
                for name, mine in (("tpu", tpu), ("tpu7x", tpu7x), ("gpu moe", gpu)) if mine}
        outfile.write(args.error_json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
