"""The batch orderings `maxperf plan` relies on with the per-device batch free, checked on perfmodel.

    .venv/bin/python bench/plan_orderings.py [--only TEXT] [--sample N] [--accumulation A]

maxperf.search.plan estimates a configuration (mesh, kernel, remat policy, A) from its largest B down and stops at the
first B that fits, and estimates a policy no other keeps less than at the smallest B first: both hold where memory and
tokens/s do not fall as B grows. For each case this estimates every B of N configurations drawn at random (seed 0)
from the plan's candidates, afresh through resolve() and perfmodel.estimate(), and counts the successive pairs of B
where memory, tokens/s or MFU falls, and the ties of tokens/s (where ranking by memory would decide). With
`--accumulation A` every configuration runs A microbatches a step: memory must not fall as B grows there either, which
the plan relies on with the global batch fixed (its batches with accumulation). Exit 1 on any exception.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter, defaultdict

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# (model, topology, slices, pins): dense, MoE and MLA presets on TPU, GPU and CPU meshes, one case over two slices
CASES = (
    ("llama3-70b", "v5p-256", 1, ()),
    ("llama2-7b", "v5p-8", 1, ()),
    ("mixtral-8x7b", "v5p-64", 1, ()),
    ("deepseek-v2-lite", "v5p-32", 1, ()),
    ("qwen3-30b-a3b", "v5p-64", 1, ()),
    ("gemma2-9b", "v5e-16", 1, ()),
    ("llama3-8b", "h100-8x2", 1, ()),
    ("tiny", "cpu-8", 1, ("seq_len=64",)),
    ("tiny-moe", "cpu-8", 1, ("seq_len=64",)),
    ("gpt-oss-20b", "v5p-32", 1, ()),
    ("llama4-scout-17b-16e", "v5p-64", 1, ()),
    ("llama3-8b", "v5p-16", 2, ()),
    ("tiny-mla", "cpu-4", 1, ("seq_len=64",)),
    ("gemma3-4b", "v6e-8", 1, ()),
    ("llama3-8b", "h100-8x4", 1, ("dcn_pipeline_parallelism=2",)),
)


def main() -> int:
    from maxperf import perfmodel
    from maxperf.search import candidates
    from maxperf.spec.request import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run only cases whose model contains this text")
    ap.add_argument("--sample", type=int, default=300, help="configurations per case (default 300)")
    ap.add_argument("--accumulation", type=int, default=1,
                    help="microbatches a step of every configuration (default 1)")
    args = ap.parse_args()
    if args.accumulation < 1:
        ap.error(f"--accumulation must be >= 1 (microbatches a step), got {args.accumulation}")
    rng = random.Random(0)
    total: Counter = Counter()
    for model, topology, slices, pins in CASES:
        if args.only not in model:
            continue
        start = time.perf_counter()
        space = candidates.space(model, topology, num_slices=slices, pins=pins)
        groups = defaultdict(list)
        for c in space.candidates:
            groups[(c.mesh_shown(), c.attention, c.remat_policy, c.grad_accum_steps, c.quantization,
                    c.pipeline_microbatches)].append(c)
        keys = sorted(groups)
        rng.shuffle(keys)
        n: Counter = Counter()
        for key in keys[:args.sample]:
            batch = sorted(groups[key], key=lambda c: c.per_device_batch_size)
            accumulate = [f"gradient_accumulation_steps={args.accumulation}"] if args.accumulation > 1 else []
            ests = [perfmodel.estimate(resolve(topology, model, [*space.fixed, *c.overrides(), *accumulate],
                                               num_slices=slices))
                    for c in batch]
            for small, large in zip(ests, ests[1:]):
                n["pairs"] += 1
                n["memory falls"] += large.memory_per_device_bytes < small.memory_per_device_bytes
                n["tokens/s falls"] += large.tokens_per_s < small.tokens_per_s
                n["MFU falls"] += large.mfu < small.mfu
                n["tokens/s ties"] += large.tokens_per_s == small.tokens_per_s
        print(f"{model} on {topology}{f' x {slices}' if slices > 1 else ''}: {dict(n)} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        total.update(n)
    print(f"all: {dict(total)}")
    return 1 if total["memory falls"] or total["tokens/s falls"] or total["MFU falls"] else 0


if __name__ == "__main__":
    sys.exit(main())
