"""A persistent cache of compiled steps in the user's cache directory, so compiling the same thing twice is fast.

jax's own persistent cache does not serve compile-only TPU and GPU targets, and a CPU executable it returns cannot
be serialized again; this cache keeps what `maxperf compile` writes instead: the serialized executable, XLA's
memory and cost analyses and the optimized HLO, keyed by the lowered module, the target, the compile options and
the library versions.

A second store can be shared (`share`): on a cluster (maxperf.search.cluster), every node's compiles ask the machine
that started them after a miss here, and give it what they compile, so a step is compiled once anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from maxperf.user_cache import cache_dir

SCHEMA = "maxperf.compile-cache/1"


@dataclass(frozen=True)
class Entry:
    payload: bytes  # jax's serialized executable
    in_tree: str
    out_tree: str
    memory: dict[str, int]  # XLA's memory analysis fields
    xla_cost: dict[str, float] | None  # XLA's cost analysis, None where the compiler gives none
    optimized_hlo: str
    compile_seconds: float  # how long the original compile took


class SharedStore(Protocol):
    def get(self, k: str) -> Entry | None: ...

    def put(self, k: str, entry: Entry) -> None: ...


_shared: SharedStore | None = None


def share(store: SharedStore | None) -> None:
    """Makes `store` this process's second cache (None: none): asked on a miss, given every new entry."""
    global _shared
    _shared = store


def enabled() -> bool:
    return os.environ.get("MAXPERF_NO_CACHE", "") in ("", "0")


def directory() -> Path:
    return cache_dir() / "compiled"


def key(lowered_text: str, target: dict[str, Any], options: dict[str, Any], versions: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for part in (SCHEMA, json.dumps(target, sort_keys=True, default=str), json.dumps(options, sort_keys=True),
                 json.dumps(versions, sort_keys=True), lowered_text):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def get(k: str) -> Entry | None:
    """The entry for `k`, or None when absent or unreadable (a damaged entry is a miss, never an error); after a
    miss, the shared store's entry, kept here too."""
    if not enabled():
        return None
    entry = _local(k)
    if entry is None and _shared is not None:
        entry = _shared.get(k)
        if entry is not None:
            _store(k, entry)
    return entry


def _local(k: str) -> Entry | None:
    path = directory() / k
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("schema") != SCHEMA:
            return None
        payload = (path / "executable.bin").read_bytes()
        if hashlib.sha256(payload).hexdigest() != meta["executable_sha256"]:
            return None
        return Entry(payload=payload, in_tree=meta["in_tree"], out_tree=meta["out_tree"], memory=meta["memory"],
                     xla_cost=meta["xla_cost"], optimized_hlo=(path / "optimized.hlo.txt").read_text(),
                     compile_seconds=meta["compile_seconds"])
    except (OSError, ValueError, KeyError):
        return None


def put(k: str, entry: Entry) -> None:
    """Stores `entry` under `k` atomically, and in the shared store; a cache that cannot be written is skipped
    silently."""
    if not enabled():
        return
    _store(k, entry)
    if _shared is not None:
        _shared.put(k, entry)


def _store(k: str, entry: Entry) -> None:
    root = directory()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{k[:16]}.", dir=root))
        (tmp / "executable.bin").write_bytes(entry.payload)
        (tmp / "optimized.hlo.txt").write_text(entry.optimized_hlo)
        meta = {k2: v for k2, v in asdict(entry).items() if k2 not in ("payload", "optimized_hlo")}
        meta.update(schema=SCHEMA, executable_sha256=hashlib.sha256(entry.payload).hexdigest())
        (tmp / "meta.json").write_text(json.dumps(meta))
        final = root / k
        if final.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except OSError:
        return
