"""`maxperf sweep`: a model estimated and compiled over a grid of topologies and settings, into tables."""

from __future__ import annotations

import os
import sys

from maxperf.cli.common import JSON_HELP, add_cluster_arguments, add_step_argument, print_json, progress
from maxperf.spec import overrides
from maxperf.spec.errors import MaxperfError
from maxperf.spec.steps import parse_step


def _grid_axes(words: list[str]) -> dict[str, list[str]]:
    """The grid's axes: each setting once (under whichever spelling), each value once (1, 1.0 and 01 are one)."""
    axes: dict[str, list[str]] = {}
    spelled: dict[str, str] = {}  # setting -> the key that gave it
    for word in words:
        key, sep, values = word.partition("=")
        if not sep or not key or not values:
            raise MaxperfError(f"sweep axis {word!r} is not key=v1,v2,... (e.g. per_device_batch_size=1,2,4)")
        name, _ = overrides.setting(key)
        if name in spelled:
            both = key if spelled[name] == key else f"{spelled[name]} and {key}"
            raise MaxperfError(f"sweep axis {name} is given twice ({both}); give its values once: {key}=v1,v2,...")
        spelled[name] = key
        seen: dict = {}
        for text in (v.strip() for v in values.split(",") if v.strip()):
            value = overrides.setting(key, text)[1]
            seen.setdefault(("value", value) if value is not None else ("text", text), text)
        axes[key] = list(seen.values())
    return axes


def cmd_sweep(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from maxperf.search.sweep import sweep  # loads numpy, and the compiler in its workers

    try:
        slices = [int(s) for s in args.num_slices.split(",") if s]
    except ValueError:
        raise MaxperfError(f"--num-slices takes whole numbers separated by commas, got {args.num_slices!r}")
    if args.workers is not None and args.workers < 1:
        raise MaxperfError(f"--workers must be >= 1, got {args.workers}")
    if args.keep_executables and args.cluster is None:
        raise MaxperfError("--keep-executables is for --cluster, whose compiles send home only their JSON; a local "
                           "sweep keeps every artifact")
    if args.cluster is not None and args.workers is not None:
        raise MaxperfError("--workers sizes this machine's pool; with --cluster, Ray runs as many compiles as the "
                           "nodes hold: drop --workers")
    step = parse_step(args.step)
    if step.builtin in ("prefill", "decode"):
        raise MaxperfError(f"sweep --step {step.builtin}: sweeps take the train step or a user's step; for serving "
                           "layouts use `maxperf plan --step decode`, for one step `maxperf estimate --step "
                           f"{step.builtin}` or `maxperf compile --step {step.builtin}`")
    if step.is_user and args.model is not None:
        raise MaxperfError(f"--model names one of maxperf's models; --step {step} builds its own step: drop --model")
    if not step.is_user and args.model is None:
        raise MaxperfError("give --model (a preset, see `maxperf models`), or --step MODULE:FACTORY for your own "
                           "step")
    # a user's step is swept under its factory's name (MODULE:FACTORY; presets never hold ':')
    topologies = list(dict.fromkeys(t.strip() for t in args.topologies.split(",") if t.strip()))
    result = sweep(str(step) if step.is_user else args.model, topologies, num_slices=slices,
                   axes=_grid_axes(args.overrides), analytical_only=args.analytical_only, out=args.out,
                   workers=args.workers, progress=progress(), cluster=args.cluster,
                   keep_executables=args.keep_executables)
    for r in result.rows:
        if r.get("warnings"):
            print(f"maxperf: warning: {r['point']}: {r['warnings']}", file=sys.stderr)
    # exit 1 when a point failed (the table is written all the same): a script must not take it for a full result
    code = 1 if result.errors else 0
    if args.json:
        print_json(result.as_dict())
        return code
    bad = [r for r in result.rows if r["status"] != "ok"]
    where = (f" on the Ray cluster at {result.cluster['address']} ({len(result.cluster['nodes'])} nodes)"
             if result.cluster else "")
    print(f"swept {len(result.rows)} points ({result.computed} run now, {len(bad)} failed or did not fit){where} in "
          f"{result.seconds:.1f} s -> {result.out_dir}/results.csv, results.parquet")
    for r in result.rows:
        step, mfu = r.get("predicted_step_time_s"), r.get("predicted_mfu")
        figures = f"step {step:.4g} s  MFU {mfu:.1%}" if step and mfu is not None else "no estimate"
        print(f"  {r['point']:<40} {r['status']:<13} {figures}" + (f"  ({r['reason']})" if r.get("reason") else ""))
    if result.errors:
        print(f"maxperf: error: {len(result.errors)} of {len(result.rows)} points failed (status error in "
              f"{result.out_dir}/results.csv)", file=sys.stderr)
    return code


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="estimate and compile a model over a grid of topologies and settings")
    p.add_argument("--model", help="a preset name (see `maxperf models`)")
    add_step_argument(p)
    p.add_argument("--topologies", required=True, help="comma-separated, e.g. v5p-8,v5p-16,v5p-32")
    p.add_argument("--num-slices", default="1", help="comma-separated slice counts, e.g. 1,2,4")
    p.add_argument("--analytical-only", action="store_true", help="estimate only, no compiles")
    p.add_argument("--out", required=True, help="sweep directory (re-running it resumes)")
    p.add_argument("--workers", type=int, help="parallel worker processes (default: bounded by cores and memory)")
    add_cluster_arguments(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP + " (1 when a point failed)")
    p.add_argument("overrides", nargs="*", metavar="key=v1,v2", help="grid axes, e.g. per_device_batch_size=1,2")
    p.set_defaults(func=cmd_sweep)
