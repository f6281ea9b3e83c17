"""`maxperf cache`: the compile cache (maxperf.aot.cache) listed, sized and cleared."""

from __future__ import annotations

import time

from maxperf.aot import cache
from maxperf.cli.common import JSON_HELP, print_json
from maxperf.spec.errors import MaxperfError

SCHEMA = "maxperf.cache/1"
MIB = 1 << 20


def cmd_cache(args) -> int:
    if args.older_than is not None and args.action != "clear":
        raise MaxperfError("--older-than is for `maxperf cache clear`")
    if args.action == "clear":
        if args.older_than is not None and not args.older_than >= 0:  # NaN too
            raise MaxperfError(f"--older-than takes days, 0 or more, got {args.older_than:g}")
        gone = cache.clear(None if args.older_than is None else args.older_than * 86400)
        freed = sum(e.bytes for e in gone)
        if args.json:
            print_json({"schema": SCHEMA, "directory": str(cache.directory()), "removed": len(gone),
                        "removed_bytes": freed, "entries": [_row(e) for e in cache.entries()]})
        else:
            print(f"removed {len(gone)} entries ({freed / MIB:,.1f} MiB) from {cache.directory()}")
        return 0
    held = cache.entries()
    total = sum(e.bytes for e in held)
    if args.json:
        print_json({"schema": SCHEMA, "directory": str(cache.directory()), "enabled": cache.enabled(),
                    "bytes": total, "max_bytes": cache.max_bytes(), "entries": [_row(e) for e in held]})
        return 0
    state = "" if cache.enabled() else " (disabled by MAXPERF_NO_CACHE)"
    print(f"{cache.directory()}{state}: {len(held)} entries, {total / MIB:,.1f} MiB of at most "
          f"{cache.max_bytes() / MIB:,.0f} MiB (MAXPERF_CACHE_MAX_BYTES); the least recently used go first")
    if args.action == "list":
        now = time.time()
        for e in held:
            print(f"  {e.key[:16]}  {e.bytes / MIB:9,.1f} MiB  used {_age(now - e.used):>9} ago  "
                  f"made {_age(now - e.created):>9} ago  {e.label or '-'}")
    return 0


def _row(e: cache.Stored) -> dict:
    return {"key": e.key, "bytes": e.bytes, "label": e.label, "created": e.created, "used": e.used}


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="the compile cache: its size (default), its entries (list), or clear it")
    p.add_argument("action", nargs="?", choices=("size", "list", "clear"), default="size",
                   help="size: where it is and how big; list: every entry; clear: remove entries")
    p.add_argument("--older-than", type=float, metavar="DAYS",
                   help="with clear: only the entries not used for this many days")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_cache)
