"""Step time read from the compiled program: the optimized HLO's schedule walked instruction by instruction, each
costed on the target chip with perfmodel's rates and network model, while loops by their trip counts.

Pure text processing (no jax): the module is parsed by maxperf.aot.hlo_cost, which also counts the matmul FLOPs.

How an instruction is costed, per execution (`OpTime`):
- matmuls (a dot, a convolution, or a fusion or GEMM custom call holding them): a roofline, max(FLOPs / (peak x
  efficiency), bytes / HBM bandwidth), with perfmodel's matmul efficiency (perfmodel.work: the chip's sustained
  fraction of its peak x m / (m + HALF), m the matmul's smallest side, no wider than where the chip's published GEMM
  sweep stops gaining, x the share of a TPU's matrix units its contraction and output dims fill), at the peak of its
  operands' element type;
- flash attention kernels (splash on TPU, Pallas Triton on GPU): their FLOPs (hlo_cost.attention_kernel) at the
  chip's sustained rate x perfmodel's fitted flash efficiency x the share of the matrix units the head dim fills;
  other Pallas kernels by the cost estimate they carry (FLOPs and bytes, a roofline);
- everything else (fusions of elementwise work, reductions, copies, slices, sorts): the bytes it reads and writes
  in device memory at HBM bandwidth (on CPU devices, the calibrated rate of a fused elementwise kernel). A fusion
  reads of an operand only what its slices take, writes an in-place dynamic-update-slice's update only, and on
  TPUs what lives in on-chip memory (memory space S(1)) costs nothing;
- collectives (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute, and fusions wrapping them):
  the bytes of the whole buffer over the devices of one replica group, priced by perfmodel.network over the
  topology's links (ICI torus or NVLink inside a slice or host, DCN or InfiniBand across), the group's devices
  mapped to mesh axes through the device assignment (partition i is the i-th device of the mesh); a TPU's transfer
  between slices (written as a send and a recv for the Megascale runtime) as a permute across slices where it is a
  ppermute, as the ring's traffic over its slices where the runtime runs it as a collective (a data-parallel
  all-reduce across slices), issued at the send and waited for at the recv's done;
- asynchronous copies (copy-start / copy-done, and TPU's slice-start, dynamic-slice-start, ...): their bytes at
  HBM bandwidth, or over the host link where one side is pinned host memory (S(5));
- work a TPU hands to its SparseCores (`custom-call-start` / `-update` / `-done` with
  `async_execution_thread="sparsecore"`, TPU7x's default for FSDP gathers and gradient reduce-scatters, and the
  layout changes they need): the collective its called computation runs, priced as above, or the bytes of the
  layout change read and written at HBM bandwidth, issued where the update hands the SparseCore its operand.

How instructions combine (`_Walker`): the schedule is the instruction order of each computation (the module is
scheduled). Compute runs in order on one stream; a collective or an asynchronous copy runs on its own resource
(ICI, DCN, host link, DMA) from where it is issued until its result is first needed: an async start/done pair
(GPU, TPU copies) overlaps what the schedule puts between them; on TPUs, whose collectives the printed HLO shows
synchronous (or as a start with its done right after) but which the TPU backend runs asynchronously, a collective
overlaps the work up to the first user of its result; on
CPUs nothing overlaps (XLA:CPU's collectives are copies on the cores that compute: perfmodel.cpu.OVERLAP). A while
loop costs its trip count times its body, whose collectives may overlap the next iteration (an iteration takes the
longer of its compute and each resource's busy time); a conditional its costliest branch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from maxperf.aot import hlo_cost
from maxperf.perfmodel import network
from maxperf.perfmodel.chips import Chip, flash_architecture
from maxperf.perfmodel.work import SHIPPED, Constants, flash_speedup_note, half_scale, matmul_efficiency, mxu_fill
from maxperf.spec.logical_axes import MESH_AXES
from maxperf.spec.mesh import Mesh
from maxperf.spec.topology import Topology

SCHEMA = "maxperf.hlo-time/1"  # estimate.json's `hlo_time`
SOURCE = "read from the optimized HLO"
TOP = 15  # instructions listed by predicted time

# Bytes per element of HLO's element types.
_ELEMENT_BYTES = {"pred": 1, "s1": 0.125, "u1": 0.125, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
                  "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                  "c64": 8, "c128": 16, "token": 0, "tuple": 0}
# XLA's small floats name their bits in their prefix: f8e4m3fn, f8e5m2, f8e8m0fnu (FP8 and MX scales) are one byte an
# element, f4e2m1fn half of one, f6e2m3fn three quarters
_SMALL_FLOAT = re.compile(r"f([468])e\d+m\d+")


def _element_bytes(t: str) -> float:
    """Bytes of one element of an HLO element type; a type not known here counts 4 bytes."""
    if (known := _ELEMENT_BYTES.get(t)) is not None:
        return known
    return int(m.group(1)) / 8 if (m := _SMALL_FLOAT.match(t)) else 4
# An array in a shape: element type, dims, and its layout (where the memory space S(n) is).
_TYPED_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^}]*)\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
ON_CHIP = 1  # TPU memory space 1: VMEM, on-chip (copies into it are prefetches)
HOST = 5  # memory space 5: pinned host memory (offloaded activations or state)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BYTES_ESTIMATE = re.compile(r'"cost_estimate":\{[^}]*?"bytes_accessed":"?(\d+)')
_REPLICA_GROUPS = re.compile(r"replica_groups=(\{\{[^=]*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|"
                             r"mesh\[[^\]]*\]\s*\{[^}]*\})")
_CHANNEL = re.compile(r"channel_id=(\d+)")
# A send or recv that the Megascale runtime carries between TPU slices, and the rendezvous that pairs them
_MEGASCALE = re.compile(r'_xla_host_transfer_handler_name="xla_megascale_runtime"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')
# A Megascale transfer that is a collective over slices (a data-parallel all-reduce across slices, split by XLA into
# one send per gradient): its kind, and its members as slice ids by device ranges ("{1,...,32}x{0:255}": 32 slices)
_MEGASCALE_KIND = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="\{([\d,]+)\}x')
_MEGASCALE_COLLECTIVES = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter"}
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_LHS_BATCH = re.compile(r"lhs_batch_dims=\{([\d,]*)\}")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_RHS_BATCH = re.compile(r"rhs_batch_dims=\{([\d,]*)\}")
_RHS_CONTRACTING = re.compile(r"rhs_contracting_dims=\{([\d,]*)\}")
_PARAMETER_NUMBER = re.compile(r"^\s*(\d+)\)")

# Work handed to a TPU's SparseCores: a start (no operands), an update that passes it its operands (where the work
# is issued) and a done.
_OFFLOAD_START, _OFFLOAD_UPDATE, _OFFLOAD_DONE = "custom-call-start", "custom-call-update", "custom-call-done"
# Opcodes that move nothing and take no time: values renamed, tuples assembled, scheduling marks (and a SparseCore
# call's start: its update issues the work).
_FREE = frozenset(
    "parameter get-tuple-element tuple bitcast constant partition-id replica-id after-all add-dependency "
    f"opt-barrier domain get-dimension-size set-dimension-size {_OFFLOAD_START}".split())
COLLECTIVES = frozenset("all-gather all-reduce reduce-scatter all-to-all collective-permute ragged-all-to-all "
                        "collective-broadcast".split())
# Asynchronous pairs: the start issues the work, the done waits for it.
_STARTS = {f"{c}-start": c for c in ("all-gather", "all-reduce", "collective-permute", "reduce-scatter",
                                     "all-to-all", "ragged-all-to-all", "collective-broadcast")}
_DONES = frozenset({f"{c}-done" for c in _STARTS.values()} | {"async-done", "fusion-done", "copy-done",
                                                                "slice-done", "dynamic-slice-done",
                                                                "dynamic-update-slice-done", "recv-done",
                                                                "send-done", _OFFLOAD_DONE})
# The dones a TPU waits for only where their result is first used: its collectives' and its SparseCores' work
_WAITED_WHERE_USED = frozenset({f"{c}-done" for c in _STARTS.values()} | {_OFFLOAD_DONE})
_ASYNC_MEMORY = frozenset("copy-start slice-start dynamic-slice-start dynamic-update-slice-start".split())
_ATTENTION = "attention kernel"

# A fixed cost per kernel a device launches, beside its work: an assumption. TPUs run the whole step as one
# program of bundles (no launches); a GPU launches each fusion as a kernel, a few microseconds apart when XLA does not
# capture them in a CUDA graph; XLA:CPU runs each operation as a thunk.
KERNEL_OVERHEAD_S = {"tpu": 0.0, "gpu": 2e-6, "cpu": 1e-6}


@dataclass(frozen=True)
class OpTime:
    """One instruction of the schedule: its predicted seconds, FLOPs and bytes per execution, and how often it
    runs per step (a loop body's instructions by the trip count)."""

    name: str
    opcode: str  # "fusion", "convolution", "all-gather", "custom-call:tpu_custom_call", ...
    kind: str  # "matmul", "attention kernel", "kernel", "memory", "collective", "async copy", "host copy"
    source: str  # the jax operation it came from (the instruction's op_name metadata)
    executions: float
    seconds: float
    flops: float
    bytes: float
    bound: str  # "compute", "hbm", "ici", "dcn", "host"
    computation: str = ""

    @property
    def total_s(self) -> float:
        return self.seconds * self.executions

    def as_dict(self) -> dict:
        return {"name": self.name, "opcode": self.opcode, "kind": self.kind, "source": self.source,
                "executions": self.executions, "seconds_each": self.seconds, "seconds": self.total_s,
                "flops": self.flops * self.executions, "bytes": self.bytes * self.executions, "bound": self.bound,
                "computation": self.computation}


@dataclass(frozen=True)
class HloTime:
    """The step time predicted from one optimized HLO module on one topology (SOURCE says where it came from)."""

    step_time_s: float
    compute_s: float  # matmuls and kernels bound by their FLOPs, on the compute stream
    hbm_s: float  # work bound by device memory bandwidth, on the compute stream
    ici_s: float  # collectives inside a slice or NVLink domain, total before overlap
    dcn_s: float  # collectives across slices or hosts (their ICI part included), total before overlap
    host_s: float  # copies over the host link
    exposed_s: float  # network and copy time not hidden behind compute: step time - compute stream
    bottleneck: str  # "compute", "hbm", "ici", "dcn", "host", or "launches" (the kernels' fixed cost, a GPU's)
    flops: float  # matmul FLOPs per device per step, attention kernels included
    top: tuple[OpTime, ...]
    by_kind: Mapping[str, float]  # seconds per instruction kind, before overlap
    kernels: int  # instructions executed per step (loop bodies by their trip counts), free ones not counted
    assumptions: tuple[str, ...]
    not_modelled: tuple[str, ...]  # what was costed by bytes only or not at all, one line each
    chip: str
    seconds: float = 0.0  # reading and costing the module here
    source: str = SOURCE
    launch_s: float = 0.0  # the kernels' fixed cost on the compute stream (KERNEL_OVERHEAD_S x kernels)

    def as_dict(self) -> dict:
        out = {"schema": SCHEMA, "source": self.source, "chip": self.chip, "step_time_s": self.step_time_s,
               "compute_s": self.compute_s, "hbm_s": self.hbm_s, "ici_s": self.ici_s, "dcn_s": self.dcn_s,
               "host_s": self.host_s, "launch_s": self.launch_s, "exposed_s": self.exposed_s,
               "bottleneck": self.bottleneck,
               "flops_per_device": self.flops, "kernels": self.kernels, "by_kind": dict(self.by_kind),
               "top": [op.as_dict() for op in self.top], "assumptions": list(self.assumptions),
               "not_modelled": list(self.not_modelled), "costing_seconds": self.seconds}
        return out


@dataclass
class _Cost:
    seconds: float
    kind: str
    bound: str
    flops: float = 0.0
    nbytes: float = 0.0
    resource: str = "compute"  # "compute" or a network / copy resource: "ici", "dcn", "host", "dma"
    mode: str = "run"  # "run" (the compute stream), "issue" (asynchronous), "block" (a synchronous collective)
    carried: str = ""  # the start of a collective in flight whose buffers this instruction only carries along
    waits_for: str = ""  # the start of the collective this instruction waits for (an async collective's done)


@dataclass
class _Stats:
    op: OpTime
    executions: float = 0.0


@dataclass
class _Accounts:
    ops: dict[tuple[str, str], _Stats] = field(default_factory=dict)
    not_modelled: dict[str, int] = field(default_factory=dict)


def _arrays(shape: str) -> list[tuple[str, list[int], int]]:
    """(element type, dims, memory space) of each array in a shape, a tuple's elements in order."""
    out = []
    for dtype, dims, layout in _TYPED_ARRAY.findall(shape):
        space = _MEMORY_SPACE.search(layout or "")
        out.append((dtype, [int(d.lstrip("<=")) for d in dims.split(",") if d], int(space.group(1)) if space else 0))
    return out


def _bytes(shape: str, skip_on_chip: bool = True) -> float:
    """Bytes of a shape's arrays in device memory (on-chip arrays left out)."""
    return sum(math.prod(d) * _element_bytes(t) for t, d, s in _arrays(shape) if not (skip_on_chip and
                                                                                        s == ON_CHIP))


def _pairs(rest: str) -> list[tuple[str, str]]:
    """A collective permute's (source, target) pairs."""
    return re.findall(r"\{(\d+),(\d+)\}", m.group(1)) if (m := _PAIRS.search(rest)) else []


def _elements(shape: str) -> int:
    """The elements of the arrays a shape names (a tuple's summed)."""
    return sum(math.prod(dims) for _, dims, _ in _arrays(shape))


def _space(shape: str) -> set[int]:
    return {s for _, _, s in _arrays(shape)}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class _Walker:
    """Costs the instructions of one module and simulates its schedule (see the module docstring)."""

    def __init__(self, hlo_text: str, chip: Chip, topology: Topology, mesh: Mesh, constants: Constants):
        self.comps, self.entry = hlo_cost.parse_computations(hlo_text)
        self.chip, self.topology, self.mesh, self.constants = chip, topology, mesh, constants
        self.kind = chip.kind
        self.nets = network.axis_networks(mesh, chip, topology)
        self.axes = [mesh.axes[a] for a in MESH_AXES]
        self.bandwidth = chip.elementwise_bandwidth or chip.hbm_bandwidth
        self.locals: dict[str, hlo_cost.LocalWork] = {}
        self.fusion_io: dict[str, tuple[dict[int, float], float | None]] = {}
        self.accounts = _Accounts()
        self.span_cache: dict[tuple[int, ...] | None, dict[str, tuple[int, int]]] = {}
        self.overlaps = chip.kind != "cpu"
        self.tpu_async = chip.kind == "tpu"
        self.users: dict[int, dict[str, list[tuple[str, int]]]] = {}
        self.issued: dict[str, tuple[int, str]] = {}  # an async collective fusion's channel: its start
        self.sends: dict[str, str] = {}  # a transfer across slices' rendezvous: its send
        self.current = ""  # the computation being simulated
        self.window_cache: dict[str, int] = {}

    # -- costing one instruction --------------------------------------------------------------------------------

    def local(self, name: str) -> hlo_cost.LocalWork:
        if name not in self.locals:
            self.locals[name] = hlo_cost.local_work(self.comps[name], self.comps)
        return self.locals[name]

    def matmul_flops(self, comp_name: str, depth: int = 0) -> tuple[float, float]:
        """(matmul FLOPs, attention kernel FLOPs) of a fused computation, nested fusions included."""
        if comp_name not in self.comps or depth > 8:
            return 0.0, 0.0
        local = self.local(comp_name)
        attention = sum(v for k, v in local.by_opcode.items() if k.startswith(hlo_cost.ATTENTION_KEY))
        flops = local.vector[0] + local.vector[1] + local.vector[2] - attention
        for callee, multiplier, applying in local.edges:
            if not applying:
                f, a = self.matmul_flops(callee, depth + 1)
                flops += multiplier * f
                attention += multiplier * a
        return flops, attention

    def operand_bytes(self, instrs, rest: str, skip_on_chip: bool = True) -> tuple[float, set[int]]:
        total, spaces = 0.0, set()
        for o in hlo_cost.operands(rest):
            if o in instrs:
                total += _bytes(instrs[o][0], skip_on_chip)
                spaces |= _space(instrs[o][0])
        return total, spaces

    def fused_io(self, comp_name: str) -> tuple[dict[int, float], float | None]:
        """For a fused computation: the bytes read of each parameter that is only sliced (its slices' sizes) or only
        updated in place (nothing), and the bytes written when its root updates a parameter in place (the
        update's); None where the output is written whole."""
        if comp_name in self.fusion_io:
            return self.fusion_io[comp_name]
        comp = self.comps[comp_name]
        params: dict[str, int] = {}
        users = self.users_of(comp)
        for name, (shape, opcode, rest) in comp.instrs.items():
            if opcode == "parameter":
                m = _PARAMETER_NUMBER.match(rest)
                if m:
                    params[name] = int(m.group(1))
        read: dict[int, float] = {}
        in_place: set[str] = set()
        written: float | None = None
        roots = [comp.root] if comp.root else []
        if comp.root and comp.instrs[comp.root][1] == "tuple":
            roots = hlo_cost.operands(comp.instrs[comp.root][2])
        def source(name: str) -> str:
            """What a chain of bitcasts (which move no bytes) starts from."""
            while name in comp.instrs and comp.instrs[name][1] == "bitcast":
                name = hlo_cost.operands(comp.instrs[name][2])[0]
            return name

        # roots that write into their first operand in place: a dynamic-update-slice its update (operand 1), a
        # scatter its updates (operand 2), with the indices
        update_operand = {"dynamic-update-slice": 1, "scatter": 2}

        def into_parameter(r: str) -> bool:
            """A scatter writes in place only into a buffer it is given (one it fills inside is written whole)."""
            ops = hlo_cost.operands(comp.instrs[r][2])
            return comp.instrs[r][1] != "scatter" or bool(ops) and source(ops[0]) in params

        # a TPU async collective fusion's own buffers: the collective in flight and the parameters it passes on (its
        # operands and results, which the fusion hands back unread); the collective's traffic is priced apart
        collectives = {n for n, (_, op, _) in comp.instrs.items() if op in COLLECTIVES}

        def passed_on(r: str) -> bool:
            return bool(collectives) and (source(r) in params or source(r) in collectives)

        updates = [r for r in roots if r in comp.instrs and comp.instrs[r][1] in update_operand and into_parameter(r)]
        in_place_via: set[str] = set()
        if collectives and not updates:
            written = sum(_bytes(comp.instrs[r][0]) for r in roots if r in comp.instrs and not passed_on(r))
        if updates:  # each in-place root writes its update, any other root (a multi-output fusion's) itself whole
            written = 0.0
            for r in roots:
                if r not in updates:
                    written += _bytes(comp.instrs[r][0]) if r in comp.instrs and not passed_on(r) else 0.0
                    continue
                ops = hlo_cost.operands(comp.instrs[r][2])
                k = update_operand[comp.instrs[r][1]]
                written += _bytes(comp.instrs[ops[k]][0]) if len(ops) > k and ops[k] in comp.instrs else 0.0
                if ops and source(ops[0]) in params:
                    in_place.add(source(ops[0]))
                    in_place_via.add(ops[0])
        for name, number in params.items():
            uses = users.get(name, [])
            sliced = self.through_bitcasts(comp, name)
            if collectives and uses and all(u in collectives or u == comp.root for u, _ in uses):
                read[number] = 0.0  # handed to the collective or back out: not read by the fusion's own work
                continue
            if name in in_place and all((u in updates or u in in_place_via) and i == 0 for u, i in uses) and all(
                    u in updates and i == 0 for u, i in sliced):
                read[number] = 0.0
            elif sliced and None not in (parts := [self.slice_read(comp, comp_name, u, i) for u, i in sliced]):
                read[number] = sum(parts)
        self.fusion_io[comp_name] = (read, written)
        return read, written

    def users_of(self, comp) -> dict[str, list[tuple[str, int]]]:
        """Each instruction of `comp` -> its users and the operand it is to each."""
        users = self.users.get(id(comp))
        if users is None:
            users = self.users[id(comp)] = {}
            for name, (_, _, rest) in comp.instrs.items():
                for i, o in enumerate(hlo_cost.operands(rest)):
                    users.setdefault(o, []).append((name, i))
        return users

    def through_bitcasts(self, comp, name: str) -> list[tuple[str, int]]:
        """The uses of `name` in `comp`, a bitcast's taken as its own users' (a bitcast moves no bytes), and a pad's
        (a padded operand that is then only sliced, as a windowed einsum takes its chunk of two interleaved pieces,
        is read no further than the slices reach into it)."""
        out = []
        for u, i in self.users_of(comp).get(name, []):
            through = comp.instrs[u][1] == "bitcast" or comp.instrs[u][1] == "pad" and i == 0
            out.extend(self.through_bitcasts(comp, u) if through else [(u, i)])
        return out

    def slice_read(self, comp, comp_name: str, u: str, i: int) -> float | None:
        """The bytes the use `u` in `comp` reads of its operand i where it reads only a slice of it: a slice's own
        size, or what a nested fusion reads of its parameter i where that fusion only slices it (a layer's slice of
        the scan's stacked residuals, taken inside the fusion that recomputes a norm from it); None where it reads it
        whole."""
        shape, opcode, rest = comp.instrs[u]
        if opcode in ("dynamic-slice", "slice", "gather"):
            return _bytes(shape) if i == 0 else None
        if opcode == "fusion":
            callee = next((names[0] for key, names in hlo_cost.callees(rest) if key == "calls" and names), None)
            if callee in self.comps and callee != comp_name:
                read = self.fused_io(callee)[0].get(i)
                if read is not None or "kind=kLoop" not in rest:
                    return read
                # an elementwise pass over the whole operand (a relayout, a convert) whose result is only sliced: a
                # fusion computes what its consumers take, so it reads their slices' share of the operand
                ops = hlo_cost.operands(rest)
                whole, out = (_bytes(comp.instrs[ops[i]][0]) if i < len(ops) and ops[i] in comp.instrs
                              else 0.0), _bytes(shape)
                if not whole or not out or _elements(comp.instrs[ops[i]][0]) != _elements(shape):
                    return None
                taken = [self.slice_read(comp, comp_name, v, j) for v, j in self.through_bitcasts(comp, u)]
                return sum(taken) * whole / out if taken and None not in taken else None
        return None

    def fusion_bytes(self, instrs, shape: str, rest: str, comp_name: str) -> float:
        read, written = self.fused_io(comp_name) if comp_name in self.comps else ({}, None)
        total = 0.0
        for i, o in enumerate(hlo_cost.operands(rest)):
            if o in instrs:
                total += read.get(i, _bytes(instrs[o][0]))
        return total + (_bytes(shape) if written is None else written)

    def peak(self, dtype: str) -> float:
        chip = self.chip
        if dtype.startswith("f8"):
            return chip.peak_fp8_flops or chip.peak_bf16_flops
        if dtype in ("s8", "u8", "s4", "u4"):
            return chip.peak_int8_ops or chip.peak_bf16_flops
        return chip.peak_flops("float32" if dtype in ("f32", "f64") else "bfloat16")

    def matmul_shape(self, comp_name: str | None, instrs, rest: str, opcode: str, shape: str
                     ) -> tuple[float, float, float, str]:
        """(M, K, N, operand element type) of the largest matmul in a fusion or of one dot / convolution."""
        candidates = []
        if comp_name is not None and comp_name in self.comps:
            inner = self.comps[comp_name].instrs
            for s, op, r in inner.values():
                if op in ("dot", "convolution") or _is_gemm(op, r):
                    candidates.append((inner, s, op, r))
                elif op == "fusion":
                    for key, names in hlo_cost.callees(r):
                        if key == "calls" and names and names[0] in self.comps:
                            sub = self.comps[names[0]].instrs
                            candidates += [(sub, s2, op2, r2) for s2, op2, r2 in sub.values()
                                           if op2 in ("dot", "convolution") or _is_gemm(op2, r2)]
        else:
            candidates.append((instrs, shape, opcode, rest))
        best = None
        for inner, s, op, r in candidates:
            dims = self.gemm_dims(inner, s, r) if op == "custom-call" else self.dot_dims(inner, s, op, r)
            if dims and (best is None or math.prod(dims[:3]) > math.prod(best[:3])):
                best = dims
        return best or (1.0, 1.0, 1.0, "bf16")

    def dot_dims(self, instrs, shape: str, opcode: str, rest: str) -> tuple[float, float, float, str] | None:
        ops = hlo_cost.operands(rest)
        if len(ops) < 2 or ops[0] not in instrs or ops[1] not in instrs:
            return None
        lhs, rhs = _arrays(instrs[ops[0]][0]), _arrays(instrs[ops[1]][0])
        if not lhs or not rhs:
            return None
        dtype, lhs_dims, _ = lhs[0]
        rhs_dims = rhs[0][1]
        out = math.prod(hlo_cost.dims(shape)) or 1
        if opcode == "dot":
            lb = _ints(m.group(1)) if (m := _LHS_BATCH.search(rest)) else []
            lc = _ints(m.group(1)) if (m := _LHS_CONTRACTING.search(rest)) else []
            rb = _ints(m.group(1)) if (m := _RHS_BATCH.search(rest)) else []
            rc = _ints(m.group(1)) if (m := _RHS_CONTRACTING.search(rest)) else []
            M = math.prod(d for i, d in enumerate(lhs_dims) if i not in lb and i not in lc)
            K = math.prod(lhs_dims[i] for i in lc if i < len(lhs_dims))
            N = math.prod(d for i, d in enumerate(rhs_dims) if i not in rb and i not in rc)
            return float(M), float(K), float(N), dtype
        # a convolution (TPUs write batched and plain matmuls so): sides from its operands' and result's sizes
        flops = hlo_cost.convolution_flops(shape, rest, instrs) or 0.0
        return (*matmul_sides(math.prod(lhs_dims), math.prod(rhs_dims), out, flops), dtype)

    def gemm_dims(self, instrs, shape: str, rest: str, flops: float | None = None) -> tuple[float, float, float, str]:
        """(M, K, N, operand element type) of a GEMM or convolution custom call, from its operands' and result's
        sizes and its FLOPs (matmul_sides)."""
        if flops is None:
            flops = hlo_cost.custom_call_flops(shape, rest, instrs) or 0.0
        ops = hlo_cost.operands(rest)
        sizes = [math.prod(hlo_cost.dims(instrs[o][0])) for o in ops[:2] if o in instrs]
        if len(sizes) < 2:
            sizes = [1, 1]
        M, K, N = matmul_sides(sizes[0], sizes[1], math.prod(hlo_cost.dims(shape)) or 1, flops)
        dtype = _arrays(instrs[ops[0]][0])[0][0] if ops and ops[0] in instrs else "bf16"
        return M, K, N, dtype

    def matmul_seconds(self, flops: float, nbytes: float, M: float, K: float, N: float, dtype: str) -> tuple[float,
                                                                                                               str]:
        chip, c = self.chip, self.constants
        half = chip.measured_matmul_half("bfloat16" if dtype == "bf16" else "float32") if chip.kind == "cpu" else None
        sides = sorted((M, K, N))
        # a window of a windowed einsum (a collective matmul's loop: the matmul cut along one side into as many
        # chunks as the ring it runs around has devices, each chunk computed as its piece arrives) runs at the rate
        # of the matmul it is a window of: the chunks follow one another on the matrix units, and the published steps
        # whose programs run them (Trillium's Llama 3.1 70B on v6e-32: each FSDP matmul in 32 windows) take the
        # whole matmul's time, where the thin-matmul law on a chunk's side would double it
        windows = self.windows(self.current) if self.current else 1
        m = max(min(sides[1], sides[0] * windows) if windows > 1 else sides[0], 1.0)
        efficiency = matmul_efficiency(chip, m, half, c)  # half: a CPU's measured one, else the chip's scaled
        efficiency *= mxu_fill(chip, *(d for d in (K, N) if d >= 128))
        at_rate = flops / (self.peak(dtype) * max(efficiency, 1e-6))
        at_bandwidth = nbytes / chip.hbm_bandwidth
        return (at_rate, "compute") if at_rate >= at_bandwidth else (at_bandwidth, "hbm")

    def memory_cost(self, nbytes: float, kind: str = "memory") -> _Cost:
        return _Cost(nbytes / self.bandwidth, kind, "hbm", nbytes=nbytes)

    def cost(self, comp, name: str) -> _Cost:
        shape, opcode, rest = comp.instrs[name]
        instrs = comp.instrs
        if opcode in COLLECTIVES or opcode in _STARTS:
            used = self.share_used(comp, name) if opcode == "all-reduce" else 1.0
            return self.collective(instrs, _STARTS.get(opcode, opcode), shape, rest,
                                   asynchronous=opcode in _STARTS or self.tpu_async, used=used)
        if opcode in _ASYNC_MEMORY:
            return self.async_copy(instrs, shape, rest, opcode)
        if opcode == _OFFLOAD_UPDATE:
            return self.offloaded(instrs, shape, rest)
        if opcode == "fusion" or opcode == "fusion-start":
            if opcode == "fusion-start" and len(parts := hlo_cost.tuple_elements(shape)) >= 2:
                shape = parts[1]  # an async start's shape is (its operands, its result, a context): the result
            called = next((names[0] for key, names in hlo_cost.callees(rest) if key == "calls" and names), None)
            if called is not None and called in self.comps:
                inner = self.wrapped_collective(called)
                if inner is not None:
                    kind, inner_shape, inner_rest, inner_instrs = inner
                    # a TPU async collective fusion: a start, fusions that carry its buffers while it runs (with the
                    # matmuls the schedule put beside it), and a done, each wrapping the same collective (one
                    # channel): it is issued once, at the start
                    channel = m.group(1) if (m := _CHANNEL.search(inner_rest)) else None
                    start = self.issued.setdefault(channel, (id(comp), name)) if channel else (id(comp), name)
                    if start != (id(comp), name):
                        # its matmuls run here, wherever the collective was issued (a windowed einsum's loop body
                        # continues a gather issued before the loop: XLA gives them one channel)
                        if any(op in ("dot", "convolution") for _, op, _ in inner_instrs.values()):
                            work = self.kernel(instrs, shape, rest, called)
                            return dataclasses.replace(work, carried=start[1]) if start[0] == id(comp) else work
                        return _Cost(0.0, "collective", "ici", resource="wait", mode="issue",
                                     waits_for=start[1] if start[0] == id(comp) else "")
                    comm = self.collective(inner_instrs, kind, inner_shape, inner_rest,
                                           asynchronous=opcode == "fusion-start" or self.tpu_async)
                    if not any(op in ("dot", "convolution") for _, op, _ in inner_instrs.values()):
                        return comm
                    # a collective matmul (a TPU continuation fusion): the matmul runs as the collective's pieces
                    # arrive, so the slower of the two sets its time
                    work = self.kernel(instrs, shape, rest, called)
                    return work if work.seconds >= comm.seconds else comm
            return self.kernel(instrs, shape, rest, called)
        if opcode in ("dot", "convolution"):
            return self.kernel(instrs, shape, rest, None, opcode)
        if opcode == "custom-call":
            return self.custom_call(instrs, name, shape, rest)
        if opcode in ("send", "recv") and _MEGASCALE.search(rest):
            return self.across_slices(instrs, name, rest, opcode)
        read, spaces = self.operand_bytes(instrs, rest)
        out = _bytes(shape)
        if opcode in ("dynamic-slice", "slice", "gather"):
            return self.memory_cost(2 * out)
        if opcode in ("dynamic-update-slice", "scatter"):  # in place: the update read and written
            ops = hlo_cost.operands(rest)
            k = 1 if opcode == "dynamic-update-slice" else 2
            update = _bytes(instrs[ops[k]][0]) if len(ops) > k and ops[k] in instrs else out
            return self.memory_cost(2 * update)
        if opcode in ("broadcast", "iota", "rng-bit-generator", "rng"):
            return self.memory_cost(out)
        if opcode == "copy" and (HOST in spaces or HOST in _space(shape)):
            return _Cost((read + out) / 2 / (self.chip.host_link_bandwidth or self.chip.hbm_bandwidth), "host copy",
                         "host", nbytes=read + out)
        return self.memory_cost(read + out)

    def kernel(self, instrs, shape: str, rest: str, called: str | None, opcode: str = "fusion") -> _Cost:
        if called is not None:
            flops, attention = self.matmul_flops(called)
            nbytes = self.fusion_bytes(instrs, shape, rest, called)
        else:
            local_flops = hlo_cost.convolution_flops(shape, rest, instrs) if opcode == "convolution" else None
            if opcode == "dot":
                dims = self.dot_dims(instrs, shape, opcode, rest)
                local_flops = 2.0 * dims[0] * dims[1] * dims[2] * self.batch(instrs, rest) if dims else 0.0
            flops, attention = local_flops or 0.0, 0.0
            nbytes = self.operand_bytes(instrs, rest)[0] + _bytes(shape)
        if attention:
            return self.attention_cost(attention, nbytes, hlo_cost.DEFAULT_HEAD_DIM)
        if flops <= 0:
            return self.memory_cost(nbytes)
        M, K, N, dtype = self.matmul_shape(called, instrs, rest, opcode, shape)
        seconds, bound = self.matmul_seconds(flops, nbytes, M, K, N, dtype)
        return _Cost(seconds, "matmul", bound, flops, nbytes)

    def batch(self, instrs, rest: str) -> float:
        ops = hlo_cost.operands(rest)
        batch = _ints(m.group(1)) if (m := _LHS_BATCH.search(rest)) else []
        if not ops or ops[0] not in instrs:
            return 1.0
        dims = hlo_cost.dims(instrs[ops[0]][0])
        return float(math.prod(dims[i] for i in batch if i < len(dims)))

    def attention_cost(self, flops: float, nbytes: float, head_dim: float) -> _Cost:
        chip, c = self.chip, self.constants
        rate = (self.peak("bf16") * c.fraction(chip) * c.flash_efficiency.get(chip.kind, 1.0)
                * flash_architecture(chip) * mxu_fill(chip, head_dim))
        seconds = max(flops / rate, nbytes / chip.hbm_bandwidth)
        return _Cost(seconds, _ATTENTION, "compute" if flops / rate >= nbytes / chip.hbm_bandwidth else "hbm", flops,
                     nbytes)

    def custom_call(self, instrs, name: str, shape: str, rest: str) -> _Cost:
        target = m.group(1) if (m := hlo_cost.CUSTOM_CALL_TARGET.search(rest)) else "?"
        if target in hlo_cost.NO_FLOP_TARGETS:
            return _Cost(0.0, "memory", "hbm")
        nbytes = self.operand_bytes(instrs, rest)[0] + _bytes(shape)
        attention = hlo_cost.attention_kernel(name, shape, rest, instrs)
        if attention is not None:
            _, flops, head_dim = attention
            return self.attention_cost(flops, nbytes, head_dim)
        flops = hlo_cost.custom_call_flops(shape, rest, instrs)
        if flops is None:
            self.note(f"custom call {target}: costed by the bytes of its operands and results only")
            return self.memory_cost(nbytes, "kernel")
        if target.startswith((*hlo_cost.GEMM_TARGETS, hlo_cost.CUDNN_CONVOLUTION)):  # cuBLAS GEMMs, cuDNN convs
            seconds, bound = self.matmul_seconds(flops, nbytes, *self.gemm_dims(instrs, shape, rest, flops))
            return _Cost(seconds, "matmul", bound, flops, nbytes)
        estimated = _BYTES_ESTIMATE.search(rest)  # a Pallas kernel's own cost estimate
        nbytes = float(estimated.group(1)) if estimated else nbytes
        rate = self.peak("bf16") * self.constants.fraction(self.chip)
        seconds = max(flops / rate, nbytes / self.chip.hbm_bandwidth)
        return _Cost(seconds, "kernel", "compute" if flops / rate >= nbytes / self.chip.hbm_bandwidth else "hbm",
                     flops, nbytes)

    def wrapped_collective(self, comp_name: str):
        """(kind, shape, rest, instructions) of the collective a fusion or async wrapper runs, if it runs one. A TPU
        "all-reduce-scatter" fusion, an all-reduce of which each device keeps its own slice (the computation's root
        dynamic-slices the all-reduce's result), runs as a reduce-scatter."""
        comp = self.comps[comp_name]
        for name, (shape, opcode, rest) in comp.instrs.items():
            if opcode in COLLECTIVES:
                if opcode == "all-reduce" and comp.root in comp.instrs:
                    _, root_op, root_rest = comp.instrs[comp.root]
                    if root_op == "dynamic-slice" and hlo_cost.operands(root_rest)[:1] == [name]:
                        return "reduce-scatter", shape, rest, comp.instrs
                return opcode, shape, rest, comp.instrs
        return None

    def offloaded(self, instrs, shape: str, rest: str) -> _Cost:
        """The work of a SparseCore call, issued by its update (`custom-call-update(start, operands...)`, shaped
        (operands, result, context)): the collective its start's called computation runs, or else a layout change,
        its result read and written over HBM."""
        ops = hlo_cost.operands(rest)
        start = instrs.get(ops[0]) if ops else None
        called = next((names[0] for key, names in hlo_cost.callees(start[2]) if names), None) if start else None
        inner = self.wrapped_collective(called) if called in self.comps else None
        if inner is not None:
            kind, inner_shape, inner_rest, inner_instrs = inner
            return self.collective(inner_instrs, kind, inner_shape, inner_rest, asynchronous=True)
        parts = hlo_cost.tuple_elements(shape)
        moved = 2 * _bytes(parts[1] if len(parts) > 1 else shape)
        return _Cost(moved / self.chip.hbm_bandwidth, "async copy", "hbm", nbytes=moved, resource="sparsecore",
                     mode="issue")

    def async_copy(self, instrs, shape: str, rest: str, opcode: str = "copy-start") -> _Cost:
        """An asynchronous copy's bytes over the host link or HBM: a copy's whole operand, a dynamic-update-slice's
        update alone (written into its buffer in place; a remat policy's offload of one layer into the stacked host
        buffer), a dynamic-slice's result alone (one layer brought back)."""
        read, spaces = self.operand_bytes(instrs, rest)
        ops = hlo_cost.operands(rest)
        if opcode == "dynamic-update-slice-start" and len(ops) > 1 and ops[1] in instrs:
            moved = _bytes(instrs[ops[1]][0], skip_on_chip=False)
        elif opcode == "dynamic-slice-start" and read:
            # ((operand, indices...), result, context): the result beside what it reads
            moved = max(_bytes(shape, skip_on_chip=False) - read - 4, 0.0)
        else:
            moved = (_bytes(shape, skip_on_chip=False) / 2 if shape.startswith("(")
                     else _bytes(shape, skip_on_chip=False))
            moved = min(moved, read) if read else moved
        host = HOST in spaces or HOST in _space(shape)
        if host and self.chip.host_link_bandwidth:
            return _Cost(moved / self.chip.host_link_bandwidth, "host copy", "host", nbytes=moved, resource="host",
                         mode="issue")
        return _Cost(moved / self.chip.hbm_bandwidth, "async copy", "hbm", nbytes=moved, resource="dma",
                     mode="issue")

    # -- collectives --------------------------------------------------------------------------------------------

    def group(self, rest: str) -> tuple[int, ...] | None:
        """The devices (partition ids) of the first replica group; None: every device."""
        m = _REPLICA_GROUPS.search(rest)
        if m is None or m.group(1) == "{}":
            return None
        return _first_group(m.group(1))

    def spans(self, members: tuple[int, ...] | None) -> dict[str, tuple[int, int]]:
        """For each mesh axis a group spans: (members inside a fast-interconnect domain, domains)."""
        if members not in self.span_cache:
            self.span_cache[members] = self._spans(members)
        return self.span_cache[members]

    def _spans(self, members: tuple[int, ...] | None) -> dict[str, tuple[int, int]]:
        sizes = self.axes
        total = math.prod(sizes)
        ids = np.arange(total) if members is None else np.array([d for d in members if d < total], dtype=int)
        coords = np.unravel_index(ids, sizes)
        out = {}
        for i, axis in enumerate(MESH_AXES):
            values = np.unique(coords[i])
            if len(values) > 1:
                ici = self.mesh.ici.get(axis, 1)
                out[axis] = (len(np.unique(values % ici)), len(np.unique(values // ici)))
        return out

    def share_used(self, comp, name: str) -> float:
        """The largest share of `name`'s result that any one of its users reads (a dynamic slice its slice, a fusion
        what it reads of that operand): 1 where one reads it whole."""
        whole = _bytes(comp.instrs[name][0], skip_on_chip=False)
        users = self.users_of(comp).get(name, [])
        if not whole or not users:
            return 1.0
        share = 0.0
        for u, i in users:
            shape, opcode, rest = comp.instrs[u]
            if opcode == "dynamic-slice" and i == 0:
                read = _bytes(shape, skip_on_chip=False)
            elif opcode == "fusion":
                callee = next((n[0] for key, n in hlo_cost.callees(rest) if key == "calls" and n), None)
                read = self.fused_io(callee)[0].get(i) if callee in self.comps else None
            else:
                read = None
            share = max(share, 1.0 if read is None else read / whole)
        return share

    def collective(self, instrs, kind: str, shape: str, rest: str, asynchronous: bool, used: float = 1.0) -> _Cost:
        """One collective: its buffer over its group, priced by perfmodel.network. Its buffer is its own operands,
        also inside a fusion that wraps it: a TPU's continuation fusion (an all-gather or reduce-scatter fused with
        the matmul it feeds) takes the loop's carried buffers too (llama2-7b's widths at 48 layers on v5e-256: its
        [32, 6, 2048, 4096] saved activations, which priced as gathered made a 10 s step 890 s)."""
        # the buffer wherever it lives (a TPU gathers from and into on-chip memory too)
        operand = self.operand_bytes(instrs, rest, skip_on_chip=False)[0]
        if kind == "collective-permute":
            return self.permute(rest, operand, asynchronous)
        spans = self.spans(self.group(rest))
        n = math.prod(i * o for i, o in spans.values()) if spans else 1
        if kind == "all-reduce" and n > 1 and used <= 1.01 / n:
            # each device takes only its own shard of the sum: a reduce-scatter's traffic (XLA turns all-reduce and
            # dynamic-slice into one where it sees them apart; here the slice sits in the consumer's fusion)
            kind = "reduce-scatter"
        if n <= 1:
            return _Cost(0.0, "collective", "ici", resource="ici", mode="issue" if asynchronous else "block")
        axes = tuple(spans)
        nets = {a: dataclasses.replace(self.nets[a], inner=spans[a][0], outer=spans[a][1]) for a in axes}
        if kind in ("all-to-all", "ragged-all-to-all"):
            t = network.all_to_all_time(operand, axes, nets)
        else:
            full = operand * n if kind == "all-gather" else operand
            t = network.collective_time("all-reduce" if kind not in network.FACTOR else kind, full, axes, nets)
        latency = self.constants.dcn_step_latency.get(self.kind, 0.0) * t.dcn_steps
        seconds = t.ici_s + t.dcn_s + latency
        across = t.dcn_s > 0 or t.dcn_steps > 0
        # inside a slice or host each axis's collectives have its links to themselves (a torus dimension's, NVLink's
        # ports to the axis's peers); across, the hosts' network is one
        return _Cost(seconds, "collective", "dcn" if across else "ici", nbytes=operand,
                     resource="dcn" if across else "ici:" + "+".join(axes),
                     mode="issue" if asynchronous else "block")

    def across_slices(self, instrs, name: str, rest: str, opcode: str) -> _Cost:
        """A TPU's transfer between slices, which XLA writes as a send and a recv handed to the Megascale runtime
        over the data-center network: the send's buffer over the chip's share of its hosts' network, issued at the
        send, with one ring step's latency; the recv of the same rendezvous takes no time of its own and is ready
        when the send is, its done waiting for it. A ppermute across slices (a pipeline's stage-to-stage moves) sends
        its buffer once, as a permute across slices (`permute`); a send the runtime runs as a collective over n
        slices (`_xla_megascale_transfer_type` ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER: XLA's data-parallel
        all-reduce across slices, one send per gradient) moves what that collective's ring moves of it
        (network.FACTOR: 2 (n - 1) / n of an all-reduced buffer, (n - 1) pieces of a gathered one)."""
        key = m.group(1) if (m := _RENDEZVOUS.search(rest)) else ""
        if opcode == "recv":
            return _Cost(0.0, "collective", "dcn", resource="dcn", mode="issue", waits_for=self.sends.get(key, ""))
        self.sends[key] = name
        nbytes = self.operand_bytes(instrs, rest, skip_on_chip=False)[0]
        moved = nbytes
        kind = _MEGASCALE_COLLECTIVES.get(m.group(1)) if (m := _MEGASCALE_KIND.search(rest)) else None
        if kind and (members := _MEGASCALE_SLICES.search(rest)):
            n = len(members.group(1).split(","))
            moved = network.FACTOR[kind](n) * nbytes * (n if kind == "all-gather" else 1)
        seconds = moved / self.chip.host_network_per_chip + self.constants.dcn_step_latency.get(self.kind, 0.0)
        return _Cost(seconds, "collective", "dcn", nbytes=nbytes, resource="dcn", mode="issue")

    def permute(self, rest: str, nbytes: float, asynchronous: bool) -> _Cost:
        pairs = _pairs(rest)
        mode = "issue" if asynchronous else "block"
        if not pairs:
            return _Cost(0.0, "collective", "ici", resource="ici", mode=mode)
        across = any(self.domain(int(a)) != self.domain(int(b)) for a, b in pairs)
        chip = self.chip
        if across:
            seconds = nbytes / chip.host_network_per_chip + self.constants.dcn_step_latency.get(self.kind, 0.0)
            return _Cost(seconds, "collective", "dcn", nbytes=nbytes, resource="dcn", mode=mode)
        link = chip.link_bandwidth * (chip.link_count if chip.kind == "gpu" else 1)
        seconds = nbytes / link + network.LATENCY_S["ici"]
        return _Cost(seconds, "collective", "ici", nbytes=nbytes, resource=self.permute_lane(pairs), mode=mode)

    def windows(self, comp_name: str) -> int:
        """The windows of a windowed einsum's loop body (XLA names them windowed_dot_general_body_*): the devices of
        the ring its permutes go around; 1 for any other computation."""
        if comp_name in self.window_cache:
            return self.window_cache[comp_name]
        n = 1
        if "windowed_dot_general_body" in comp_name and comp_name in self.comps:
            for _, opcode, rest in self.comps[comp_name].instrs.values():
                if opcode in ("collective-permute", "collective-permute-start") and (pairs := _pairs(rest)):
                    n = math.prod(size for _, _, size in self.moves(pairs[0]))
                    break
        self.window_cache[comp_name] = n
        return n

    def permute_lane(self, pairs: list[tuple[str, str]]) -> str:
        """The links a permute within a slice or host sends over: the mesh axes its first pair moves along and which
        way round (a bidirectional ring's two permutes, and permutes along other axes, do not wait on each other)."""
        moved = self.moves(pairs[0])
        if not moved:
            return "ici"
        return "ici:" + "+".join(a for a, _, _ in moved) + (":up" if moved[0][1] == 1 else ":down")

    def moves(self, pair: tuple[str, str]) -> list[tuple[str, int, int]]:
        """(axis, steps forward round it, its size) of each mesh axis along which a (source, target) pair moves."""
        src, dst = _unravel(int(pair[0]), self.axes), _unravel(int(pair[1]), self.axes)
        return [(a, (d - c) % n, n) for a, c, d, n in zip(MESH_AXES, src, dst, self.axes) if c != d]

    def domain(self, device: int) -> tuple[int, ...]:
        coords = _unravel(device, self.axes)
        return tuple(c // self.mesh.ici.get(a, 1) for c, a in zip(coords, MESH_AXES))

    def note(self, line: str) -> None:
        self.accounts.not_modelled[line] = self.accounts.not_modelled.get(line, 0) + 1

    # -- the schedule -------------------------------------------------------------------------------------------

    def simulate(self, comp_name: str, executions: float, steady: bool = False) -> float:
        """The seconds one execution of `comp_name` takes (see the module docstring); each instruction's cost is
        recorded `executions` times. `steady`: a loop body, whose asynchronous work may run into the next
        iteration."""
        comp = self.comps[comp_name]
        t = 0.0
        ready: dict[str, float] = {}
        free: dict[str, float] = {}
        busy: dict[str, float] = {}
        overhead = KERNEL_OVERHEAD_S.get(self.kind, 0.0)
        origin: dict[str, str] = {}  # what a tuple element or bitcast came from
        for name, (shape, opcode, rest) in comp.instrs.items():
            operands = hlo_cost.operands(rest) if "%" in rest else []
            arrived = max((ready.get(o, 0.0) for o in operands), default=0.0)
            origin[name] = origin.get(operands[0], operands[0]) if opcode in _FREE and operands else name
            if opcode in _FREE:
                if arrived:
                    ready[name] = arrived
                continue
            if opcode in _DONES:
                if self.tpu_async and opcode in _WAITED_WHERE_USED:  # waited for where its result is first used
                    ready[name] = arrived
                    continue
                t = max(t, arrived)
                ready[name] = t
                continue
            if opcode == "while":
                t = max(t, arrived) + self.loop(comp, name, rest, executions)
                continue
            if opcode in ("call", "conditional", "async-start"):
                t = max(t, arrived) + self.calls(opcode, rest, executions)
                continue
            self.current = comp_name
            cost = self.cost(comp, name)
            if cost.carried:  # the buffers of a collective in flight pass through: they are not waited for
                arrived = max((ready.get(o, 0.0) for o in operands if origin.get(o) != cost.carried), default=0.0)
            if cost.waits_for:
                arrived = max(arrived, ready.get(cost.waits_for, 0.0))
            self.record(comp_name, name, opcode, rest, cost, executions)
            if cost.mode == "run" or not self.overlaps:
                t = max(t, arrived) + cost.seconds + (overhead if cost.seconds else 0.0)
                continue
            begin = max(t, arrived, free.get(cost.resource, 0.0))
            end = begin + cost.seconds
            free[cost.resource] = end
            busy[cost.resource] = busy.get(cost.resource, 0.0) + cost.seconds
            if cost.mode == "block":
                t = end
            ready[name] = end
        if steady:
            return max(t, *busy.values()) if busy else t
        return max(t, *free.values()) if free else t

    def loop(self, comp, name: str, rest: str, executions: float) -> float:
        trip, _ = hlo_cost.trip_count(comp, name, self.comps)
        callees = dict(hlo_cost.callees(rest))
        body = callees.get("body", [None])[0]
        cond = callees.get("condition", [None])[0]
        if trip is None:
            self.note("a while loop whose trip count was not found: its body counted once")
            trip = 1
        seconds = 0.0
        if body in self.comps:
            seconds += trip * self.simulate(body, executions * trip, steady=True)
        if cond in self.comps:
            seconds += (trip + 1) * self.simulate(cond, executions * (trip + 1))
        return seconds

    def calls(self, opcode: str, rest: str, executions: float) -> float:
        names = [n for _, group in hlo_cost.callees(rest) for n in group if n in self.comps]
        if not names:
            return 0.0
        if opcode != "conditional":
            return sum(self.simulate(n, executions) for n in names)
        longest = max(names, key=lambda n: self.simulate(n, 0.0))
        return self.simulate(longest, executions)

    def record(self, comp_name: str, name: str, opcode: str, rest: str, cost: _Cost, executions: float) -> None:
        if not executions:
            return
        key = (comp_name, name)
        stats = self.accounts.ops.get(key)
        if stats is None:
            source = m.group(1) if (m := _OP_NAME.search(rest)) else ""
            label = opcode
            if opcode == "custom-call" and (t := hlo_cost.CUSTOM_CALL_TARGET.search(rest)):
                label = f"custom-call:{t.group(1)}"
            op = OpTime(name, label, cost.kind, source, 0.0, cost.seconds, cost.flops, cost.nbytes, cost.bound,
                        comp_name)
            stats = self.accounts.ops[key] = _Stats(op)
        stats.executions += executions

    def run(self) -> float:
        return self.simulate(self.entry, 1.0)


def _is_gemm(opcode: str, rest: str) -> bool:
    """Whether an instruction is a cuBLAS GEMM custom call (one XLA:GPU may wrap in a fusion: a dynamic-slice fusion
    feeds it a slice of a stacked weight)."""
    target = m.group(1) if opcode == "custom-call" and (m := hlo_cost.CUSTOM_CALL_TARGET.search(rest)) else ""
    return target.startswith(hlo_cost.GEMM_TARGETS)


def matmul_sides(lhs: float, rhs: float, out: float, flops: float) -> tuple[float, float, float]:
    """(M, K, N) of G matmuls [M, K] x [K, N] from the element counts of their operands (G M K, G K N), result
    (G M N) and their FLOPs (2 G M N K): M = GMNK / GKN, and so on. It reads the sides of a convolution whatever
    dims play the batch, contraction and output (TPUs write matmuls as convolutions whose windows walk heads or
    layers)."""
    p = flops / 2
    if p <= 0 or min(lhs, rhs, out) <= 0:
        return 1.0, 1.0, 1.0
    return max(p / rhs, 1.0), max(p / out, 1.0), max(p / lhs, 1.0)


def _unravel(index: int, sizes: list[int]) -> list[int]:
    coords = []
    for n in reversed(sizes):
        coords.append(index % n)
        index //= n
    return coords[::-1]


@functools.lru_cache(maxsize=1024)
def _first_group(text: str) -> tuple[int, ...]:
    """The devices of the first group of a replica_groups attribute: explicit ({{0,1},{2,3}}), iota
    ([G,S]<=[dims]T(perm): arange laid out in dims, transposed, cut into G groups of S) or a mesh
    (mesh['a'=2,'b'=4] {'b'}: devices in mesh order, the group varying over the listed axes)."""
    if text.startswith("{{"):
        return tuple(_ints(text[2:text.index("}")]))
    if text.startswith("["):
        shape_text, _, source = text.partition("<=")
        shape = _ints(shape_text.strip("[]"))
        dims_text, _, perm_text = source.partition("T")
        dims = _ints(dims_text.strip("[]"))
        order = np.arange(math.prod(dims)).reshape(dims)
        if perm_text:
            order = order.transpose(_ints(perm_text.strip("()")))
        return tuple(int(d) for d in order.reshape(-1)[:shape[-1] if len(shape) > 1 else shape[0]])
    names = re.findall(r"'([^']+)'=(\d+)", text)
    listed = re.findall(r"'([^']+)'", text[text.index("{"):])
    dims = [int(n) for _, n in names]
    axis_names = [a for a, _ in names]
    varying = [axis_names.index(a) for a in listed if a in axis_names]
    fixed = [i for i in range(len(dims)) if i not in varying]
    order = np.arange(math.prod(dims)).reshape(dims).transpose(fixed + varying).reshape(-1)
    return tuple(int(d) for d in order[:math.prod(dims[i] for i in varying)])


def assumptions(chip: Chip, constants: Constants) -> tuple[str, ...]:
    lines = [f"each instruction costed on one {chip.name} device at perfmodel's rates: matmuls at "
             f"{constants.fraction(chip):.2f} of peak x m / (m + HALF) (HALF {constants.matmul_half[chip.kind]:g}"
             f"{f' x {half_scale(chip):.3g}' if half_scale(chip) != 1 else ''}), memory-bound work at "
             f"{(chip.elementwise_bandwidth or chip.hbm_bandwidth) / 1e9:.0f} GB/s"]
    if chip.kind in ("tpu", "gpu"):
        lines.append(f"flash attention kernels at {constants.flash_efficiency.get(chip.kind, 1.0):.2f} of the matmul "
                     "rate (perfmodel's fit)" + flash_speedup_note(chip, flash_architecture(chip)))
    lines.append({"tpu": "collectives overlap compute from where the schedule issues them to their first use (the TPU "
                         "backend runs them asynchronously)",
                  "gpu": "asynchronous collectives overlap what the schedule puts between their start and done; "
                         "synchronous ones block",
                  "cpu": "nothing overlaps: XLA:CPU's collectives run on the cores that compute"}[chip.kind])
    if KERNEL_OVERHEAD_S.get(chip.kind):
        lines.append(f"{KERNEL_OVERHEAD_S[chip.kind] * 1e6:g} us per kernel launched (assumed)")
    return tuple(lines)


def hlo_time(hlo_text: str, chip: Chip, topology: Topology, mesh: Mesh, constants: Constants = SHIPPED,
             top: int = TOP) -> HloTime:
    """The step time of the optimized HLO module `hlo_text` on one device of `topology` (`chip`: the device as
    perfmodel.estimate.device_for gives it), its mesh `mesh`: see the module docstring."""
    start = time.perf_counter()
    walker = _Walker(hlo_text, chip, topology, mesh, constants)
    step = walker.run()
    ops = [dataclasses.replace(s.op, executions=s.executions) for s in walker.accounts.ops.values()]
    totals = {"compute": 0.0, "hbm": 0.0, "ici": 0.0, "dcn": 0.0, "host": 0.0}
    by_kind: dict[str, float] = {}
    flops = 0.0
    kernels = 0.0
    for op in ops:
        resource = op.bound
        totals[resource] = totals.get(resource, 0.0) + op.total_s
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.total_s
        flops += op.flops * op.executions if op.kind in ("matmul", _ATTENTION, "kernel") else 0.0
        kernels += op.executions
    on_stream = totals["compute"] + totals["hbm"]
    launches = KERNEL_OVERHEAD_S.get(chip.kind, 0.0) * kernels
    stream = on_stream + launches
    exposed = max(step - stream, 0.0)
    networks = {k: totals[k] for k in ("ici", "dcn", "host")}
    slow = max(networks, key=networks.get)
    if networks[slow] > stream:
        bottleneck = slow
    else:
        stream_parts = {"compute": totals["compute"], "hbm": totals["hbm"], "launches": launches}
        bottleneck = max(stream_parts, key=stream_parts.get)
        if exposed > max(stream_parts.values()):
            bottleneck = slow
    ranked = sorted(ops, key=lambda op: -op.total_s)[:top]
    notes = [f"{line} ({n}x)" if n > 1 else line for line, n in walker.accounts.not_modelled.items()]
    return HloTime(step_time_s=step, compute_s=totals["compute"], hbm_s=totals["hbm"], ici_s=totals["ici"],
                   dcn_s=totals["dcn"], host_s=totals["host"], exposed_s=exposed, bottleneck=bottleneck, flops=flops,
                   top=tuple(ranked), by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
                   kernels=int(kernels), assumptions=assumptions(chip, constants), not_modelled=tuple(notes),
                   chip=chip.name, seconds=time.perf_counter() - start, launch_s=launches)


def predict(hlo_text: str, topology: Topology, mesh: Mesh, calibration=None, constants: Constants = SHIPPED
            ) -> HloTime:
    """`hlo_time` on one device of `topology` as perfmodel sees it (perfmodel.estimate.device_for), with the user's
    stored calibration for CPU topologies unless `calibration` is given."""
    from maxperf.perfmodel.estimate import device_for
    from maxperf.user_cache import calibration_for

    if calibration is None and topology.platform == "cpu":
        calibration = calibration_for(topology)
    return hlo_time(hlo_text, device_for(topology, calibration), topology, mesh, constants)
