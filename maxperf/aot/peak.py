"""What the compiler holds at its step's peak: the buffers live at once where XLA's liveness analysis of the
scheduled program peaks, read from the live-range report XLA writes beside its dumps (`--xla_dump_to`: the module's
`*after_optimizations-live-range.txt`, "Live ranges at N (peak)"), each named by the instruction that defines it and
described from the optimized HLO by its shape and the jax operation it came from (its `op_name` metadata).

The peak counts the step's arguments (the state and the batch) and every temporary live at that instruction; the
compiler's per-device total (memory_analysis) can exceed it where its allocator could not pack buffers of different
lifetimes tightly (a few large ones, as a long context's gathered keys and values make).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from maxperf.aot import artifacts

LIVE_RANGE_GLOB = "*after_optimizations-live-range.txt"
# A compile's dump folder: DUMP_PREFIX, the compiling process's id, "-" and tempfile's 8 characters of [a-z0-9_]
DUMP_PREFIX = "maxperf-peak-"
# The dump folder as an executable's debug options keep it (executables compiled before the process id was part of
# the name have none)
_DUMP_DIR = re.compile(rb"(/[^\x00-\x20\"']*/" + re.escape(DUMP_PREFIX.encode())
                       + rb"(?:\d+-)?[a-z0-9_]{8})(?![a-z0-9_])")
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"\s+([^\s{]+)(\{[\d,]*\})?: (\d+) bytes")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([^\s=]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
SHOWN = 12  # buffers kept in the report, the largest first
HOST_MEMORY_SPACE = "S(5)"  # a layout's memory space of pinned host memory on TPU, as the optimized HLO writes it


@dataclass(frozen=True)
class Buffer:
    bytes: int
    name: str  # the defining instruction, with its tuple index where it is an element of one ("while.129{2}")
    shape: str  # as the optimized HLO writes it, layout included; "" where the instruction was not found
    operation: str  # the jax operation (op_name metadata), or the HLO opcode where there is none
    argument: bool  # a parameter of the entry computation: part of the step's state or batch


@dataclass(frozen=True)
class Peak:
    live_bytes: int  # every device buffer live at the peak, arguments included
    argument_bytes: int  # of which the entry computation's parameters (the step's state and batch)
    instruction: int  # the peak's position in the program's schedule
    buffers: tuple[Buffer, ...]  # the largest SHOWN of the others: what the step makes and holds at its peak
    # buffers the report counts at the peak that live in host memory (memory space S(5): offloaded activations and
    # their copies), which take no device memory; left out of live_bytes and buffers
    host_bytes: int = 0

    def as_dict(self) -> dict:
        return {"source": "XLA's live ranges of the scheduled program (the peak of its live-range report)",
                "live_bytes": self.live_bytes, "argument_bytes": self.argument_bytes,
                "host_bytes": self.host_bytes, "instruction": self.instruction,
                "buffers": [asdict(b) for b in self.buffers]}


def compile_with_peak(lowered, options: dict):
    """`lowered.compile(options)`, with XLA dumping the module into a temporary folder for its live-range report:
    (the compiled executable, the Peak read from it or None where XLA wrote none). The folder, named with this
    process's id, is removed when the compile returns; those of compiles killed before theirs returned go first."""
    import tempfile

    artifacts.remove_orphaned_temp_dirs(DUMP_PREFIX)
    with tempfile.TemporaryDirectory(prefix=f"{DUMP_PREFIX}{os.getpid()}-") as tmp:
        compiled = lowered.compile({**options, "xla_dump_to": tmp})
        try:
            found = read(tmp, compiled.as_text())
        except (OSError, ValueError):  # a report in a form this reader does not know: the compile stands without it
            found = None
    return compiled, found


def load_executable(payload: bytes, in_tree, out_tree, *, backend, execution_devices):
    """jax's `deserialize_and_load` of a serialized executable, leaving no files behind: an executable compiled by
    `compile_with_peak` keeps the dump folder in its debug options, and XLA dumps the module there again each time it
    is loaded, long after the compile removed the folder. A folder of that name that the load made is removed."""
    import shutil

    from jax.experimental import serialize_executable

    named = {Path(m.decode()) for m in _DUMP_DIR.findall(payload)}
    absent = {d for d in named if not d.exists()}
    try:
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, backend=backend,
                                                         execution_devices=execution_devices)
    finally:
        for folder in absent:
            shutil.rmtree(folder, ignore_errors=True)


def read(dump_dir: str | Path, optimized_hlo: str) -> Peak | None:
    """The peak of the module XLA dumped into `dump_dir` with the largest one (a compile dumps one module); None where
    no live-range report was written (an XLA that writes none)."""
    peaks = [p for f in Path(dump_dir).glob(LIVE_RANGE_GLOB)
             if (p := parse(f.read_text(), _module_text(f, optimized_hlo)))]
    return max(peaks, key=lambda p: p.live_bytes, default=None)


def _module_text(live_range: Path, optimized_hlo: str) -> str:
    """The optimized module the live-range report describes, as XLA dumped it beside the report (its instructions
    include those buffer assignment's passes add, as the host offload's copies, which the executable's text may
    name otherwise); the executable's text where there is no such file."""
    dumped = live_range.with_name(live_range.name.replace("-live-range.txt", ".txt"))
    return dumped.read_text() if dumped.is_file() else optimized_hlo


def parse(live_ranges: str, optimized_hlo: str) -> Peak | None:
    lines = live_ranges.splitlines()
    start = next((i for i, line in enumerate(lines) if _PEAK.search(line)), None)
    if start is None:
        return None
    live = []
    for line in lines[start + 1:]:
        m = _LIVE.match(line)
        if not m:
            break
        live.append((m.group(1), m.group(2) or "", int(m.group(3))))
    described = _instructions(optimized_hlo)
    buffers, host = [], 0
    for name, index, size in live:
        shape, opcode, op_name = described.get(name, ("", "", ""))
        element = _element(shape, index)
        if HOST_MEMORY_SPACE in element:
            host += size
            continue
        buffers.append(Buffer(bytes=size, name=name + (index if index != "{}" else ""),
                              shape=element, operation=op_name or opcode,
                              argument=opcode == "parameter" and name in described.entry_parameters))
    made = sorted((b for b in buffers if not b.argument), key=lambda b: -b.bytes)
    return Peak(live_bytes=sum(b.bytes for b in buffers), argument_bytes=sum(b.bytes for b in buffers if b.argument),
                instruction=int(_PEAK.search(lines[start]).group(1)), buffers=tuple(made[:SHOWN]), host_bytes=host)


class _Described(dict):
    entry_parameters: set[str]


def _instructions(hlo: str) -> _Described:
    """name -> (shape, opcode, op_name) of every instruction of `hlo`; and the entry computation's parameters."""
    out = _Described()
    out.entry_parameters = set()
    in_entry = False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
        elif line.startswith("}"):
            in_entry = False
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        meta = _OP_NAME.search(rest)
        out.setdefault(name, (shape, opcode, meta.group(1).replace("\\'", "'") if meta else ""))
        if in_entry and opcode == "parameter":
            out.entry_parameters.add(name)
    return out


def _element(shape: str, index: str) -> str:
    """The element of a tuple `shape` at the live-range report's `index` ("{2}", "{1,0}"); `shape` itself for {}."""
    for i in (int(x) for x in index.strip("{}").split(",") if x):
        parts = _split_tuple(shape)
        if parts is None or i >= len(parts):
            return shape
        shape = parts[i]
    return shape


def _split_tuple(shape: str) -> list[str] | None:
    if not (shape.startswith("(") and shape.endswith(")")):
        return None
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape[1:-1], start=1):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(shape[start:i].strip())
            start = i + 1
    parts.append(shape[start:-1].strip())
    return parts
