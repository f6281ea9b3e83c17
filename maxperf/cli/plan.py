"""`maxperf plan`: search the configurations of a model on a topology, rank them, compile the best."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from maxperf.aot import artifacts
from maxperf.cli.common import JSON_HELP, add_cluster_arguments, join_cluster, print_json, progress
from maxperf.spec.errors import MaxperfError

GIB = 1 << 30
RESULT_SCHEMA = "maxperf.plan-result/2"  # `maxperf plan --json`; 2: B is one microbatch
SHOWN = 12  # rows of the ranked table printed (plan.json holds them all)


def parse_tokens(text: str) -> int:
    """'4194304', '4M', '4Mi' or '512K' tokens: M and K are powers of two, as global batches are counted."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?\s*", text, flags=re.I)
    if not m:
        raise MaxperfError(f"--global-batch {text!r} is not a token count; give e.g. 4194304 or 4M (M = 2^20 tokens)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def cmd_serving_plan(args) -> int:
    """`plan --step decode`: the serving layout (search/serving_plan.py), its winner compiled unless --verify 0."""
    from maxperf.search import plan, serving_plan

    if args.global_batch is not None or args.per_device_batch is not None:
        raise MaxperfError("plan --step decode searches the batch itself (pin one with per_device_batch_size=N): "
                           "drop --global-batch / --per-device-batch")
    if args.num_slices > 1:
        raise MaxperfError(f"plan --step decode searches one slice or host group; --num-slices {args.num_slices} "
                           "serves from several: plan one and replicate it")
    if args.objective != "tokens_per_s":
        raise MaxperfError(f"plan --step decode ranks by tokens/s per chip under its latency bounds; --objective "
                           f"{args.objective} is a training plan's: drop it")
    say = progress()
    out = Path(args.out) if args.out else default_out(args, "decode")
    with artifacts.hold_output(out, "plan"):
        result = serving_plan.search(
            args.model, args.topology, tuple(args.overrides),
            max_tpot_s=None if args.max_time_per_token is None else args.max_time_per_token / 1e3,
            max_ttft_s=None if args.max_ttft is None else args.max_ttft / 1e3)
        say(f"estimated {result.candidates} layouts in {result.search_seconds:.2f} s")
        if result.winner is None:  # nothing is written
            raise serving_plan.NoLayout(serving_plan.miss_line(result))
        if args.verify:
            _verify_serving(result, args, out, say)
        path = plan.write(result, out)
    if args.json:
        print_json({**result.as_dict(), "plan_json": str(path)})
        return 0 if result.winner is not None else 3
    else:
        w = result.winner
        print(f"{result.model} decode on {result.topology} ({result.devices} devices): {result.candidates} layouts, "
              f"{result.fitting} fit, {len(result.meeting)} meet the bounds")
        print(f"{'mesh':<40} {'batch':>6} {'weights':>7} {'cache':>5} {'ms/token':>9} {'TTFT ms':>8} "
              f"{'tok/s/chip':>10} bound")
        for x in result.meeting[:SHOWN]:
            print(f"{x.as_dict()['mesh']:<40} {x.batch:>6} {x.quantization:>7} {'int8' if x.kv_int8 else 'bf16':>5} "
                  f"{x.tpot_s * 1e3:>9.4g} "
                  f"{x.ttft_s * 1e3:>8.4g} {x.tokens_per_s_per_chip:>10.4g} {x.bottleneck}")
        for v in result.verified:
            total = v["per_device_total_bytes"]
            print(f"compiled: {v['compile']}: {'-' if total is None else f'{total / GIB:.2f}'} GiB of "
                  f"{v['hbm_bytes'] / GIB:.2f} GiB ({'fits' if v['fits'] else 'DOES NOT FIT'})")
        if w is not None:
            print(f"best: {result.compile_line(w)}" + (f" (compiled and fits -> {out / 'winner'})"
                                                       if result.verified else ""))
        else:
            print(f"maxperf: error: none of the {len(result.verified)} best layouts fits as compiled (the "
                  f"compiler's memory above); --verify N compiles more of them", file=sys.stderr)
        print(f"wrote {path}")
    return 0 if result.winner is not None else 3


def _verify_serving(result, args, out: Path, say) -> None:
    """Compiles the best layouts in rank order, up to --verify of them, until one fits (a layout the analytical
    memory fits may not compile within HBM): its artifact is out/winner; each verdict is in plan.json."""
    from maxperf import aot
    from maxperf.cli.common import compile_only_environment
    from maxperf.spec.errors import DoesNotFit

    compile_only_environment(args.topology)
    best = result.meeting[:args.verify]  # a copy: a layout that does not fit leaves result.meeting (reject)
    for i, layout in enumerate(best):
        say(f"compiling layout {i + 1} of {len(best)}: {layout.as_dict()['mesh']}, {layout.batch} sequences")
        words = [*result.pinned, *layout.words(result.devices)]
        try:
            compiled = aot.compile(args.topology, args.model, words, out=out / "winner", progress=say, step="decode",
                                   force=True)
            memory, fits = compiled.memory, compiled.fits
        except DoesNotFit:
            memory, fits = json.loads((out / "winner" / "memory.json").read_text()), False
        result.verified.append({"compile": result.compile_line(layout), "fits": bool(fits),
                                "per_device_total_bytes": memory.get("per_device_total_bytes"),
                                "hbm_bytes": memory.get("hbm_bytes")})
        if fits:
            return
        result.reject(layout)  # the ranking and the front go on without it
    shutil.rmtree(out / "winner", ignore_errors=True)  # no layout compiled fits: no winner's artifact


def cmd_plan(args) -> int:
    # the compiles of --verify run in worker processes that start jax: on the host's CPU alone, as a sweep's do (no
    # GPU plugin's start-up traceback on a machine without one)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from maxperf.search import plan, verify

    if args.verify < 0:  # a serving plan's as well: it compiles up to that many layouts
        raise MaxperfError(f"--verify must be >= 0 (0: no compile), got {args.verify}")
    if args.step == "decode":
        if args.cluster is not None:  # its verification compiles here, one layout at a time
            raise MaxperfError("plan --step decode compiles its layouts here, in one process: drop --cluster")
        return cmd_serving_plan(args)
    if args.max_time_per_token is not None or args.max_ttft is not None:
        raise MaxperfError("--max-time-per-token and --max-ttft bound a serving plan: add --step decode")

    if args.workers is not None and args.workers < 1:
        raise MaxperfError(f"--workers must be >= 1, got {args.workers}")
    if args.per_device_batch is not None and args.per_device_batch <= 0:
        raise MaxperfError(f"--per-device-batch must be > 0, got {args.per_device_batch:g}")
    say = progress()
    request = plan.PlanRequest(args.model, args.topology, args.num_slices,
                               None if args.global_batch is None else parse_tokens(args.global_batch),
                               args.per_device_batch, args.objective, tuple(args.overrides))
    out = Path(args.out) if args.out else default_out(args)
    if args.cluster is not None:
        if args.workers is not None:
            raise MaxperfError("--workers sizes this machine's pool; with --cluster, Ray runs as many compiles as the "
                               "nodes hold: drop --workers")
        artifacts.claim_output(out, "plan")  # a --out that would be refused is said before joining
    # before the search: the cluster is joined and checked, a directory that is not an earlier plan's is refused, and
    # one plan writes there at a time
    with (join_cluster(args, [(f"{args.model} on {args.topology}", base_request(args))], say,
                       compiles=args.verify > 0) as cluster,
          artifacts.hold_output(out, "plan")):
        result = plan.search(request, progress=say)
        say(f"estimated in {result.search_seconds:.2f} s")
        if args.verify and result.fitting:
            verify.verify(result, args.verify, out, workers=args.workers, progress=say, cluster=cluster,
                          keep_executables=args.keep_executables)
        path = plan.write(result, out)
        if stale := verify.prune_points(result, out):
            say(f"removed {len(stale)} compiled point(s) of an earlier plan in {out} that this plan did not compile")
    code = 0 if result.winner is not None else 3
    if args.json:
        print_json(summary(result, path))
        return code
    print_plan(result, path)
    return code


def base_request(args):
    """The request before the search, for the cluster's memory check: the model on the topology with the pins given
    (or, where the pins alone do not resolve, without them; each candidate's compile is checked again)."""
    from maxperf.spec.request import resolve

    try:
        return resolve(args.topology, args.model, args.overrides, num_slices=args.num_slices)
    except MaxperfError:
        return resolve(args.topology, args.model, [], num_slices=args.num_slices)


def default_out(args, step: str = "train") -> Path:
    """artifacts/plan_MODEL[_decode]_TOPOLOGY[_xS]."""
    from maxperf.spec import presets
    from maxperf.spec import topology as topologies

    slices = f"_x{args.num_slices}" if args.num_slices > 1 else ""
    kind = "" if step == "train" else f"_{step}"
    return Path("artifacts") / (f"plan_{presets.get(args.model).name}{kind}_{topologies.get(args.topology).name}"
                                f"{slices}")


def summary(result, path: Path) -> dict:
    """What `maxperf plan --json` prints: plan.json's header, the winner and the first rows of the ranking."""
    shown = result.as_dict(rows=False)
    return {**shown, "schema": RESULT_SCHEMA, "plan_json": str(path),
            "winner": None if result.winner is None else result.winner.as_dict(),
            "top": [c.as_dict() for c in result.candidates[:SHOWN]]}


COUNTED = (("indivisible", "indivisible"), ("does_not_fit", "do not fit"), ("fit", "fit and ranked"),
           ("more_accumulation", "need less accumulation"), ("smaller_batch", "a smaller batch than one that fits"),
           ("keeps_less_than_fitting", "recompute more than a policy that fits"))


def count_line(counts: dict[str, int]) -> str:
    """'N candidates: ...', every rule that settled one named (the always-present first three even at 0), and any the
    rules leave over (compiles that failed), so that the parts add up to the whole."""
    n = counts["enumerated"]
    parts = [f"{counts[k]:,} {words}" for i, (k, words) in enumerate(COUNTED) if i < 3 or counts[k]]
    rest = n - sum(counts[k] for k, _ in COUNTED)
    if rest:
        parts.append(f"{rest:,} failed to compile")
    return f"{n:,} candidate{'s' if n != 1 else ''}: " + ", ".join(parts)


def print_plan(result, path: Path) -> None:
    counts = result.counts()
    r = result.request
    pinned = next((w.split("=", 1)[1] for w in r.pins if w.split("=", 1)[0] == "per_device_batch_size"), None)
    batch = (f"global batch {r.global_batch_tokens:,} tokens ({result.global_batch_rows} x {result.seq_len})"
             if r.global_batch_tokens else f"per-device batch {r.per_device_batch:g} per step" if r.per_device_batch
             else f"per-device batch {pinned} (pinned)" if pinned else "per-device batch searched")
    print(f"{result.model_name} on " + (f"{r.num_slices} x " if r.num_slices > 1 else "") + result.topology_name
          + f" ({result.devices} devices), {batch}, L={result.seq_len}, objective {r.objective}")
    print(f"  {count_line(counts)}; searched in {result.search_seconds:.2f} s"
          + (f", {result.compiles} compiled in {result.verify_seconds:.0f} s" if result.compiles else ""))
    print(f"  memory margin {result.margin.value:.1%}: {result.margin.source}")
    for note in result.notes:
        print(f"  note: {note}")
    ranked = result.fitting[:SHOWN]
    objective = r.objective
    # the fastest candidate that fits is always in the table, though ties rank it below simpler layouts
    fastest = max(result.fitting, key=lambda c: getattr(c, objective), default=None)
    numbered = list(enumerate(ranked, 1))
    if fastest is not None and fastest not in ranked:
        numbered.append((result.fitting.index(fastest) + 1, fastest))
    precisions = any(c.quantization != "none" for c in result.candidates)
    pipelined = any(c.pipeline_microbatches for c in result.candidates)
    if ranked:
        print(f"  {'#':>2} {'mesh':<40} {'remat':<20} {'kernel':<11} " + (f"{'precision':<21} " if precisions else "")
              + f"{'B':>5} {'A':>3} " + (f"{'M':>4} " if pipelined else "")
              + f"{'step':>9} {'tokens/s':>10} {'MFU':>6} {'GiB':>7} {'bound':<7} verified")
        for i, c in numbered:
            mem = f"{c.memory_shown_bytes() / GIB:.2f}" + ("*" if c.compiler_memory_bytes is not None else "")
            verified = {None: "-", True: "fits", False: "NO"}[c.verified]
            print(f"  {i:>2} {c.mesh_shown():<40} {c.remat_policy:<20} {c.attention:<11} "
                  + (f"{precision_name(c.quantization):<21} " if precisions else "") +
                  f"{c.per_device_batch_size:>5g} {c.grad_accum_steps:>3} "
                  + (f"{c.pipeline_microbatches:>4} " if pipelined else "") + f"{c.step_time_s:>8.4g}s "
                  f"{c.tokens_per_s:>10,.0f} {c.mfu:>6.1%} {mem:>7} {c.bottleneck:<7} {verified}"
                  + ("  (the fastest)" if c is fastest and len(result.fitting) > 1 else ""))
        print(f"  (GiB: per device, * the compiler's; HBM {result.hbm_bytes / GIB:.2f} GiB)")
    rejected = [c for c in result.candidates if c.verified is False]
    for c in rejected:
        print(f"  compiled, {c.status}: {c.mesh_shown()} {c.remat_policy} {c.attention} ({c.reason})")
    winner = result.winner
    if winner is not None:
        cmd = result.command(winner)
        proof = "compiled and fits" if winner.verified else "not compiled (--verify 0)" if not result.compiles \
            else "not verified"
        precision = f", {winner.quantization}" if winner.quantization != "none" else ""
        print(f"winner ({proof}): {winner.mesh_shown()}, remat {winner.remat_policy}, {winner.attention}{precision}, "
              f"B={winner.per_device_batch_size:g} A={winner.grad_accum_steps}"
              + (f" M={winner.pipeline_microbatches}" if winner.pipeline_microbatches else "")
              + f": {winner.step_time_s:.4g} s/step, "
              f"{winner.tokens_per_s:,.0f} tokens/s, MFU {winner.mfu:.1%}")
        if fastest is not None and fastest is not winner:
            print(f"  the fastest by perfmodel, #{result.fitting.index(fastest) + 1}, gives "
                  f"{getattr(fastest, objective) / getattr(winner, objective):.3f}x the winner's {objective}: "
                  + (winner.reason or "the winner is the fastest compiled"))
        print(f"  {cmd['maxperf']}")
        print(f"  MaxText: {cmd['maxtext'] or cmd['maxtext_note']}"
              + (f"\n  ({cmd['maxtext_note']})" if cmd["maxtext"] and cmd.get("maxtext_note") else ""))
    else:
        print_miss(result)
    print(f"wrote {path}")


def precision_name(quantization: str) -> str:
    """bf16 for "none" (the compute dtype), else the FP8 recipe's name."""
    return "bf16" if quantization == "none" else quantization


def print_miss(result) -> None:
    miss = result.closest_miss
    if miss is None:
        compiled = [c for c in result.candidates if c.verified is False]
        print("no candidate fits" + (f": the {len(compiled)} compiled did not fit" if compiled else ""),
              file=sys.stderr)
        return
    c = miss["candidate"]
    print(f"no candidate fits. closest: {c['mesh']}, remat {c['remat_policy']}, {c['attention']}, "
          f"B={c['per_device_batch_size']:g} A={c['grad_accum_steps']} needs "
          f"{miss['memory_with_margin_bytes'] / GIB:.2f} GiB with the margin, of {miss['hbm_bytes'] / GIB:.2f} GiB",
          file=sys.stderr)
    for option in miss["would_need"]:
        print(f"  {option}", file=sys.stderr)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="find the fastest mesh, remat, kernel and batch that fit; compile the best")
    p.add_argument("--model", required=True, help="a preset name (see `maxperf models`)")
    p.add_argument("--topology", required=True, help="e.g. v5p-256, v5e-256, h100-8x16, cpu-8")
    p.add_argument("--num-slices", type=int, default=1, help="slices side by side over DCN")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", help="tokens per step (e.g. 4194304 or 4M): B x devices x A x L, with "
                                              "per_device_batch_size B and grad_accum_steps A searched")
    batch.add_argument("--per-device-batch", type=float,
                       help="examples per device per step, B x A (fractions allowed): the search splits them into A "
                            "microbatches of per_device_batch_size B")
    p.add_argument("--step", choices=("train", "decode"), default="train",
                   help="train (default), or decode: the serving layout with the most tokens/s per chip under "
                        "--max-time-per-token and --max-ttft (quantization=auto also searches int8 / fp8 weights)")
    p.add_argument("--max-time-per-token", type=float, metavar="MS", help="decode: the bound on time per output token")
    p.add_argument("--max-ttft", type=float, metavar="MS", help="decode: the bound on one prompt's time to first token")
    p.add_argument("--objective", default="tokens_per_s", help="tokens_per_s (default) or mfu")
    p.add_argument("--verify", type=int, default=3, help="compile the best K until K fit (default 3; 0: none)")
    p.add_argument("--workers", type=int, help="compile worker processes (default: bounded by cores and memory)")
    p.add_argument("--out", help="directory for plan.json and the compiled candidates (default "
                                 "artifacts/plan_MODEL_TOPOLOGY)")
    add_cluster_arguments(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="pin a searched key (ici_tensor=4, remat_policy=full, attention=flash, grad_accum_steps=2) "
                        "or set any other (seq_len=8192)")
    p.set_defaults(func=cmd_plan)
