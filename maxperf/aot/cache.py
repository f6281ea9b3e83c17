"""A persistent cache of compiled steps in the user's cache directory, so compiling the same thing twice is fast.

jax's own persistent cache does not serve compile-only TPU and GPU targets, and a CPU executable it returns cannot
be serialized again; this cache keeps what `maxperf compile` writes instead: the serialized executable, XLA's
memory and cost analyses and the optimized HLO, keyed by the lowered module, the target, the compile options and
the library versions.

A second store can be shared (`share`): on a cluster (maxperf.search.cluster), every node's compiles ask the machine
that started them after a miss here, and give it what they compile, so a step is compiled once anywhere.

The cache holds at most `max_bytes()` (MAXPERF_CACHE_MAX_BYTES, default 10 GiB): after each new entry the entries
used least recently go until it fits. `maxperf cache` lists, sizes and clears it (`entries`, `clear`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from maxperf.spec.errors import MaxperfError
from maxperf.user_cache import cache_dir

SCHEMA = "maxperf.compile-cache/1"
DEFAULT_MAX_BYTES = 10 << 30


@dataclass(frozen=True)
class Entry:
    payload: bytes  # jax's serialized executable
    in_tree: str
    out_tree: str
    memory: dict[str, int]  # XLA's memory analysis fields
    xla_cost: dict[str, float] | None  # XLA's cost analysis, None where the compiler gives none
    optimized_hlo: str
    compile_seconds: float  # how long the original compile took
    label: str = ""  # what was compiled, for `maxperf cache list` ("llama2-7b on v5p-8", a user's step)
    peak: dict | None = None  # what is live at the compiled step's peak (aot.peak.Peak.as_dict), where XLA reported it


@dataclass(frozen=True)
class Stored:
    """One entry as the cache holds it."""

    key: str
    bytes: int
    label: str
    created: float  # seconds since the epoch
    used: float  # the last hit, or the creation


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def max_bytes() -> int:
    """MAXPERF_CACHE_MAX_BYTES (bytes, or with a binary unit: 512M, 5G, 5GiB), else DEFAULT_MAX_BYTES; any other value
    is refused (MaxperfError), not taken for the default."""
    text = os.environ.get("MAXPERF_CACHE_MAX_BYTES", "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    number, unit = text.rstrip("BbIi").rstrip(), ""
    if number and number[-1].upper() in _SIZE_UNITS:
        number, unit = number[:-1].strip(), number[-1].upper()
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except ValueError:
        value = -1.0
    if value < 0 or not math.isfinite(value):
        raise MaxperfError(f"MAXPERF_CACHE_MAX_BYTES={text!r} is not a size: give bytes, or a number with K, M, G or "
                           "T (binary units), e.g. 5G")
    return int(value)


class SharedStore(Protocol):
    def get(self, k: str) -> Entry | None: ...

    def put(self, k: str, entry: Entry) -> None: ...


_shared: SharedStore | None = None


def share(store: SharedStore | None) -> None:
    """Makes `store` this process's second cache (None: none): asked on a miss, given every new entry."""
    global _shared
    _shared = store


def enabled() -> bool:
    """Whether compiles use the cache (MAXPERF_NO_CACHE unset or 0); a MAXPERF_CACHE_MAX_BYTES that is not a size is
    refused here, before any compile."""
    on = os.environ.get("MAXPERF_NO_CACHE", "") in ("", "0")
    if on:
        max_bytes()
    return on


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
        if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
            return None
        payload = (path / "executable.bin").read_bytes()
        if hashlib.sha256(payload).hexdigest() != meta["executable_sha256"]:
            return None
        entry = Entry(payload=payload, in_tree=meta["in_tree"], out_tree=meta["out_tree"], memory=meta["memory"],
                      xla_cost=meta["xla_cost"], optimized_hlo=(path / "optimized.hlo.txt").read_text(),
                      compile_seconds=meta["compile_seconds"], label=meta.get("label", ""),
                      # a peak read before host buffers were told apart (no host_bytes) may count them: left out
                      peak=meta.get("peak") if "host_bytes" in (meta.get("peak") or {}) else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        (path / USED).touch()  # the last use, which eviction goes by
    except OSError:
        pass
    return entry


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
        meta.update(schema=SCHEMA, executable_sha256=hashlib.sha256(entry.payload).hexdigest(),
                    executable_bytes=len(entry.payload))
        (tmp / "meta.json").write_text(json.dumps(meta))
        (tmp / USED).touch()
        final = root / k
        if final.exists() and _local(k) is not None:  # another process stored it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            if final.exists():  # a damaged entry (a miss each time it is read): set aside, then replaced
                aside = Path(tempfile.mkdtemp(prefix=f".{k[:16]}.damaged.", dir=root))
                os.replace(final, aside / k)
                shutil.rmtree(aside, ignore_errors=True)
            os.replace(tmp, final)
    except OSError:
        return
    evict(max_bytes(), keep=k)


USED = "used"  # an empty file in each entry, touched on each hit


def entries() -> list[Stored]:
    """Every complete entry, the most recently used first."""
    root = directory()
    out = []
    for path in root.iterdir() if root.is_dir() else ():
        if path.name.startswith(".") or not path.is_dir():
            continue  # an entry being written
        try:
            meta = json.loads((path / "meta.json").read_text())
            if not isinstance(meta, dict) or meta.get("executable_bytes", -1) not in (
                    -1, (path / "executable.bin").stat().st_size):
                continue  # damaged: a miss, replaced by the next compile of its step
            size = sum(f.stat().st_size for f in path.iterdir())
            created = (path / "meta.json").stat().st_mtime
            used = (path / USED).stat().st_mtime if (path / USED).exists() else created
        except (OSError, ValueError):
            continue
        out.append(Stored(path.name, size, meta.get("label", ""), created, used))
    return sorted(out, key=lambda e: -e.used)


def evict(limit: int, keep: str | None = None) -> list[Stored]:
    """Removes the entries used least recently until the cache holds at most `limit` bytes (never `keep`, the entry
    just stored); the entries removed."""
    held = entries()
    total = sum(e.bytes for e in held)
    removed = []
    for e in reversed(held):  # least recently used first
        if total <= limit:
            break
        if e.key == keep:
            continue
        shutil.rmtree(directory() / e.key, ignore_errors=True)
        total -= e.bytes
        removed.append(e)
    return removed


def clear(older_than_s: float | None = None) -> list[Stored]:
    """Removes every entry (or those not used for `older_than_s` seconds), and what an interrupted write left; the
    entries removed."""
    now = time.time()
    gone = [e for e in entries() if older_than_s is None or now - e.used > older_than_s]
    for e in gone:
        shutil.rmtree(directory() / e.key, ignore_errors=True)
    if older_than_s is None and directory().is_dir():
        for path in directory().iterdir():  # half-written entries of a killed compile, and damaged ones
            ours = _TEMPORARY.fullmatch(path.name) or _KEY.fullmatch(path.name)
            if ours and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
    return gone


# The names maxperf gives the cache's directories: an entry's key (sha256 hex), and _store's temporary ones
_KEY = re.compile(r"[0-9a-f]{64}")
_TEMPORARY = re.compile(r"\.[0-9a-f]{16}\.(damaged\.)?[A-Za-z0-9_]+")
