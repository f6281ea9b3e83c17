"""FLOPs per device counted from optimized HLO text (`compiled.as_text()`), loop bodies times their trip counts.

Why: XLA's `compiled.cost_analysis()` costs a while loop's body once, so with scanned layers it undercounts by about
the layer count, and for GPU targets compiled without a GPU it returns None. This module reads the optimized HLO
module instead: pure text processing, no jax.

What counts (per device: SPMD-partitioned HLO already has per-device shapes):
- `dot`: 2 x result elements x product of the lhs contracting dims (a multiply and an add per MAC, as in XLA's
  HloCostAnalysis). `convolution` (TPU lowers matmuls, batched ones too, to these inside fusions): 2 x output
  batch and feature elements x kernel input features x the (output, window) position pairs that read a real input
  element, per `dim_labels` and `window`, as XLA counts them: padding and dilation holes cost nothing.
  cuDNN convolution custom calls (`__cudnn$conv...`, forward and backward): 2 x the forward convolution's output
  elements x its kernel's elements per output feature, padding counted as computed.
  cuBLAS gemm custom calls (`__cublas$gemm`, `__cublas$lt$matmul...`): the dot formula on the dimension numbers
  in their backend_config; cuDNN's block-scaled GEMM (`__cudnn$blockScaledDot`, MXFP8) its [B, M, K] x [B, N, K]
  product. `matmul_flops_by_operands` splits these matmul FLOPs by their operands' element types (f8e4m3fn x
  f8e4m3fn for an FP8 forward, bf16 x bf16, ...), which says whether an FP8 step's matmuls stayed FP8. Other custom
  calls are listed in `unhandled_custom_calls` unless their backend_config
  carries a `cost_estimate` (Pallas kernels), which is used.
- Elementwise arithmetic: 1 flop per result element; transcendental ops counted apart, as XLA does.
  Reductions (`reduce`, `all-reduce`, `reduce-window`, `scatter`, `sort`, `map`, ...): their scalar
  `to_apply` body's flops times how often it is applied, kept in `reduction_flops`.
- Call graph: fusions, calls and async wrappers run once per execution of their caller; a while body runs
  trip-count times (its condition once more); a conditional costs its most expensive branch.

`flops` is the matmul work (dot + convolution + gemm custom calls), the figure to compare with model FLOPs;
`xla_style_flops` adds elementwise and reduction flops, the figure comparable to `cost_analysis()['flops']`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable

# One instruction per line: `  [ROOT] %name = SHAPE opcode(operands), attr=..., ...`. A tuple shape holds spaces but
# never ` word(`, so the first ` word(` after `= ` is the opcode.
_INSTR = re.compile(r"\s+(?:ROOT )?%?([^\s=]+) = (.*?) ([a-z][\w\-]*)\((.*)")
_HEADER = re.compile(r"(ENTRY )?%?([^\s(]+) \(")
_ARGS_END = re.compile(r"\)(?=,\s[\w\-]+=|\s*$)")
_NAME = re.compile(r"%([^\s,(){}]+)")
_ARRAY = re.compile(r"[a-z]\w*\[([^\]]*)\]")
_CALLEES = re.compile(
    r"\b(calls|to_apply|body|condition|select|scatter|true_computation|false_computation|branch_computations|"
    r"called_computations)=(\{[^}]*\}|%?[^\s,{}]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([^_\s]+)_([^-\s]+)->([^,\s]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_WINDOW_SIZE = re.compile(r"window=\{size=([\dx]+)")
_DIMENSIONS = re.compile(r"dimensions=\{([\d,]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_COST_ESTIMATE = re.compile(r'"cost_estimate":\{[^}]*?"flops":"?(\d+)')
_KNOWN_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_INDEX = re.compile(r"\bindex=(\d+)")
_DIRECTION = re.compile(r"direction=([A-Z]+)")
_CONSTANT = re.compile(r"\s*(-?\d+)\s*$")
# Pallas attention kernels, by the name their pallas_call gives them (in the op name or the instruction name):
# splash attention on TPU (splash_{mha,mqa}_{fwd,dq,dkv}...), jax's Pallas Triton flash attention on GPU.
_ATTENTION_KERNEL = re.compile(r"\b(splash_m[hq]a_(fwd|dq|dkv)\w*|mha_(forward|backward|preprocess_backward))\b")
_BLOCK = re.compile(r'\\?"(block_(?:q|kv|q_dq|kv_dq|q_dkv|kv_dkv))\\?": (\d+)')
# splash's operand layouts in its kernel metadata (jax's QKVLayout: 1 HEAD_DIM_MINOR [..., L, Dh], 2 SEQ_MINOR
# [..., Dh, L])
_LAYOUT = re.compile(r'\\?"(q|k)_layout\\?": (\d+)')
SEQ_MINOR = 2
# The head dim an attention kernel is priced at where its operands do not say
DEFAULT_HEAD_DIM = 128
_GRID_X = re.compile(r"grid_x = (\d+)")
_FLOAT_ARRAY = re.compile(r"^(?:bf16|f16|f32|f64|f8\w*)\[")
# A splash kernel's block mask, the first integer array among its operands' layout constraints: [heads, q blocks,
# kv blocks] of the grid it walks, whose kv (forward) extent jax shrinks to the most blocks any query block meets.
_MASK_GRID = re.compile(r"operand_layout_constraints=\{s(?:8|16|32)\[(?:\d+,)*(\d+),(\d+)\]")
_KERNEL_SUFFIX = re.compile(r"\.\d+$")
_ATTENTION_KEY = "attention-kernel:"
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')

# XLA's HloCostAnalysis counts these as transcendentals, not flops.
_TRANSCENDENTAL = frozenset(
    "exponential exponential-minus-one log log-plus-one logistic power rsqrt sqrt cbrt tanh sine cosine tan atan2 "
    "erf".split())
_ELEMENTWISE = frozenset(
    "add subtract multiply divide remainder maximum minimum abs negate sign floor ceil round-nearest-afz "
    "round-nearest-even compare select clamp and or xor not shift-left shift-right-arithmetic shift-right-logical "
    "convert is-finite real imag complex popcnt count-leading-zeros stochastic-convert reduce-precision".split())
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")  # prefixes: the Lt family has $f8 / $mx variants
_CUDNN_CONVOLUTION = "__cudnn$conv"  # convForward, convBackwardInput, convBackwardFilter, convBiasActivationForward
_BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"  # operands [B, M, K] and [B, N, K] with their block scales
_ELEMENT_TYPE = re.compile(r"^\(?(\w+)\[")
# Custom calls that move or annotate data and do no arithmetic.
_NO_FLOP_TARGETS = frozenset(
    "Sharding SPMDFullToShardShape SPMDShardToFullShape AllocateBuffer MoveToHost MoveToDevice "
    "annotate_device_placement LayoutConstraint PadToStatic SliceToDynamic X64Combine X64SplitLow X64SplitHigh "
    "Pin Unpin CreateBuffer AssumeGatherIndicesInBound GatherScatterIndicesBitpacked".split())
# Ops whose `to_apply` (or select/scatter) computation is a scalar function applied many times.
_APPLYING = frozenset(
    "reduce all-reduce all-reduce-start reduce-scatter reduce-window scatter select-and-scatter sort map".split())
# Async pairs name the same computation on start, update and done: count it once, at the start.
_ASYNC_REPEATS = frozenset("async-update async-done".split())
_MAX_RESOLVE_DEPTH = 32


@dataclasses.dataclass(frozen=True)
class Loop:
    """One while op: where it is, its body, and how often the body runs per execution of the loop."""

    name: str
    computation: str  # the computation holding the while op
    body: str
    trip_count: int | None  # None: unknown, the body was counted once
    trip_count_source: str  # "backend_config" | "condition" | "unknown"
    executions: float  # how often the while op itself runs in one step (enclosing loops' trip counts)


@dataclasses.dataclass(frozen=True)
class HloCost:
    """FLOPs per device for one execution of the module's ENTRY computation."""

    flops: float  # dot + convolution + gemm custom calls: the matmul work
    dot_flops: float
    convolution_flops: float
    custom_call_flops: float  # cuBLAS gemm custom calls, Pallas attention kernels, kernels with a cost estimate
    elementwise_flops: float  # 1 per result element of arithmetic elementwise ops
    reduction_flops: float  # scalar bodies of reduce, all-reduce, scatter, sort, ... times their applications
    transcendentals: float  # exp, log, tanh, ... result elements (XLA counts these apart from flops)
    xla_style_flops: float  # flops + elementwise + reduction: comparable to cost_analysis()['flops']
    by_opcode: dict[str, float]  # flops by the op doing them ("dot", "convolution", "add", "reduce", target names)
    loops: tuple[Loop, ...]
    unknown_trip_counts: int  # while ops whose trip count was not found (their bodies counted once)
    conditionals: int  # conditional ops, each costed at its most expensive branch
    unhandled_custom_calls: dict[str, int]  # target -> count, for custom calls whose flops are not known
    unresolved_operands: int  # dots/convolutions whose operand shape was not found (skipped)
    computations: int  # computations reachable from ENTRY
    # Pallas flash attention kernels (part of custom_call_flops), counted from their operand shapes under a causal
    # mask (see `attention_kernel`): they carry no cost estimate of their own
    attention_kernel_flops: float = 0.0
    # the dots', convolutions' and GEMM custom calls' FLOPs by their two operands' element types ("bf16 x bf16",
    # "f8e5m2 x f8e4m3fn"); attention kernels and other custom calls are not in it
    matmul_flops_by_operands: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Comp:
    name: str
    instrs: dict[str, tuple[str, str, str]]  # name -> (shape, opcode, rest of the line after "opcode(")
    root: str | None = None


@dataclasses.dataclass
class _Local:
    """One computation's own work per execution, and what it calls."""

    vector: list[float]  # dot, convolution, custom call, elementwise, transcendental
    by_opcode: dict[str, float]
    edges: list[tuple[str, float, str]]  # (callee, executions per caller execution, applying opcode or "")
    branch_groups: list[list[str]]  # conditional branches: only the costliest one runs
    loops: list[tuple[str, str, int | None, str]]  # (while op, body, trip count, source)
    custom_calls: dict[str, int]
    unresolved: int
    by_operands: dict[str, float]  # matmul flops by operand element types


_DOT, _CONV, _CUSTOM, _ELEM, _TRANS = range(5)


def _parse(hlo_text: str) -> tuple[dict[str, _Comp], str]:
    """The module's computations by name, and the ENTRY computation's name."""
    comps: dict[str, _Comp] = {}
    entry = None
    current: _Comp | None = None
    match_instr = _INSTR.match
    pending: list[str] = []  # an instruction whose attributes span lines, until its braces balance
    depth = 0
    for line in hlo_text.split("\n"):
        if pending:
            pending.append(line)
            depth += _brace_balance(line)
            if depth > 0:
                continue
            line = "".join(pending)
            pending = []
        elif current is not None and line.startswith(" "):
            depth = _brace_balance(line)
            if depth > 0:  # e.g. Mosaic kernels' frontend_attributes hold multi-line JSON
                pending = [line]
                continue
        if current is not None and line.startswith(" "):
            m = match_instr(line)
            if m:
                name, shape, opcode, rest = m.groups()
                current.instrs[name] = (shape, opcode, rest)
                if line.lstrip().startswith("ROOT "):
                    current.root = name
            continue
        if line.endswith("{") and not line.startswith(" ") and " -> " in line:
            h = _HEADER.match(line)
            if h:
                current = _Comp(h.group(2), {})
                comps[current.name] = current
                if h.group(1):
                    entry = current.name
            continue
        if line.startswith("}"):
            if current is not None:
                _add_element_reads(current)
            current = None
    if entry is None and comps:
        entry = next(reversed(comps))  # XLA prints callees before callers: the last one is the entry
    if entry is None:
        raise ValueError("no HLO computation found in the text")
    return comps, entry


# An operand written as `%name#N`: element N of the tuple `name` (newer HLO printers write it so in place of a
# get-tuple-element instruction, e.g. in the loops XLA:TPU peels).
_ELEMENT_READ = re.compile(r"%([^\s,(){}#]+)#(\d+)\b")
_COMMENT = re.compile(r"/\*.*?\*/")


def _add_element_reads(comp: _Comp) -> None:
    """Gives each `%name#N` operand in `comp` an instruction of its own, the get-tuple-element it stands for, so that
    whatever reads an operand's shape or follows it to its source finds it."""
    reads = {}
    for _, _, rest in comp.instrs.values():
        if "#" in rest:
            for m in _ELEMENT_READ.finditer(rest):
                reads.setdefault(f"{m.group(1)}#{m.group(2)}", (m.group(1), int(m.group(2))))
    for name, (source, index) in reads.items():
        if name in comp.instrs or source not in comp.instrs:
            continue
        elements = tuple_elements(comp.instrs[source][0])
        if index < len(elements):
            comp.instrs[name] = (elements[index], "get-tuple-element", f"%{source}), index={index}")


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape ("(a, (b, c), d)" -> ["a", "(b, c)", "d"], less the printer's
    `/*index=5*/` comments); [] for an array."""
    shape = _COMMENT.sub("", shape).strip()
    if not shape.startswith("("):
        return []
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(shape[start:i].strip())
                break
        elif ch == "," and depth == 1:
            out.append(shape[start:i].strip())
            start = i + 1
    return [e for e in out if e]


def _brace_balance(line: str) -> int:
    """Opening minus closing braces outside double-quoted strings (HLO attributes and JSON may span lines)."""
    opened, closed = line.count("{"), line.count("}")
    if opened == closed or '"' not in line:
        return opened - closed
    unquoted = _QUOTED.sub("", line)
    return unquoted.count("{") - unquoted.count("}")


def _dims(shape: str) -> list[int]:
    """The first array's dimensions in a shape ('f32[16,<=8]{1,0}' -> [16, 8]); a tuple gives its first element."""
    m = _ARRAY.search(shape)
    if m is None or not m.group(1):
        return []
    return [int(d.lstrip("<=")) for d in m.group(1).split(",")]


def _elements(shape: str) -> int:
    return math.prod(_dims(shape))


def _operands(rest: str) -> list[str]:
    end = _ARGS_END.search(rest)
    return _NAME.findall(rest[:end.start()] if end else rest)


def _int_list(text: str) -> list[int]:
    return [int(x.strip().strip('"')) for x in text.split(",") if x.strip()]


def _callees(rest: str) -> list[tuple[str, list[str]]]:
    found = []
    for key, value in _CALLEES.findall(rest):
        names = _NAME.findall(value) if value.startswith("{") else [value.lstrip("%")]
        found.append((key, names))
    return found


def _local(comp: _Comp, comps: dict[str, _Comp]) -> _Local:
    vector = [0.0] * 5
    by_opcode: dict[str, float] = {}
    edges: list[tuple[str, float, str]] = []
    branch_groups: list[list[str]] = []
    loops: list[tuple[str, str, int | None, str]] = []
    custom_calls: dict[str, int] = {}
    by_operands: dict[str, float] = {}
    unresolved = 0
    instrs = comp.instrs

    def add(kind: int, key: str, flops: float) -> None:
        vector[kind] += flops
        if kind != _TRANS:
            by_opcode[key] = by_opcode.get(key, 0.0) + flops

    def matmul(rest: str, flops: float) -> None:
        types = [_element_type(instrs[o][0]) if o in instrs else "?" for o in _operands(rest)[:2]]
        key = " x ".join(types)
        by_operands[key] = by_operands.get(key, 0.0) + flops

    for name, (shape, opcode, rest) in instrs.items():
        if opcode in _ELEMENTWISE:
            add(_ELEM, opcode, _elements(shape))
        elif opcode in _TRANSCENDENTAL:
            add(_TRANS, opcode, _elements(shape))
        elif opcode == "dot":
            lhs = instrs.get(_operands(rest)[0])
            m = _CONTRACTING.search(rest)
            if lhs is None or m is None:
                unresolved += 1
                continue
            lhs_dims = _dims(lhs[0])
            flops = 2.0 * _elements(shape) * math.prod(lhs_dims[d] for d in _int_list(m.group(1)))
            add(_DOT, "dot", flops)
            matmul(rest, flops)
        elif opcode == "convolution":
            flops = _convolution_flops(shape, rest, instrs)
            if flops is None:
                unresolved += 1
                continue
            add(_CONV, "convolution", flops)
            matmul(rest, flops)
        elif opcode == "custom-call":
            attention = attention_kernel(name, shape, rest, instrs)
            if attention is not None:
                add(_CUSTOM, f"{_ATTENTION_KEY}{_KERNEL_SUFFIX.sub('', attention[0])}", attention[1])
                continue
            flops = _custom_call_flops(shape, rest, instrs)
            target_match = _TARGET.search(rest)
            target = target_match.group(1) if target_match else "?"
            if flops is None:
                if target not in _NO_FLOP_TARGETS:
                    custom_calls[target] = custom_calls.get(target, 0) + 1
            else:
                add(_CUSTOM, f"custom-call:{target}", flops)
                if target.startswith(_GEMM_TARGETS) or target == _BLOCK_SCALED_DOT:
                    matmul(rest, flops)
        if ("=%" not in rest and "={%" not in rest) or opcode in _ASYNC_REPEATS:  # cheap: most ops call nothing
            continue
        callees = _callees(rest)
        if opcode == "conditional":
            branch_groups.append([n for _, names in callees for n in names])
            continue
        trip, source = _trip_count(comp, name, comps) if opcode == "while" else (None, "")
        for key, names in callees:
            if opcode == "while" and key == "body":
                loops.append((name, names[0], trip, source))
                edges.append((names[0], float(trip if trip is not None else 1), ""))
            elif opcode == "while" and key == "condition":
                edges.append((names[0], float(trip + 1 if trip is not None else 1), ""))
            elif opcode in _APPLYING:
                edges.extend((n, float(_applications(opcode, key, shape, rest, instrs)), opcode) for n in names)
            else:  # fusion, call, async-start, custom-call's called computations: once per execution
                edges.extend((n, 1.0, "") for n in names)
    return _Local(vector, by_opcode, edges, branch_groups, loops, custom_calls, unresolved, by_operands)


def _element_type(shape: str) -> str:
    """'f8e4m3fn' of 'f8e4m3fn[256,64]{1,0}'; a tuple's first element's."""
    m = _ELEMENT_TYPE.match(shape)
    return m.group(1) if m else "?"


def _convolution_flops(shape: str, rest: str, instrs: dict[str, tuple[str, str, str]]) -> float | None:
    """2 x MACs: per output batch and feature, kernel input features (per group) x valid window positions.

    As in XLA's HloCostAnalysis, only window positions that land on a real input element count, not padding or
    dilation holes. TPU expresses batched matmuls as convolutions whose padded or base-dilated window meets one
    input element per output position (`window={size=32 stride=31 lhs_dilate=32}`), so this matters there.
    """
    operands = _operands(rest)
    labels = _DIM_LABELS.search(rest)
    if len(operands) < 2 or labels is None or operands[0] not in instrs or operands[1] not in instrs:
        return None
    lhs_labels, kernel_labels, out_labels = labels.groups()
    lhs_dims, kernel_dims, out_dims = _dims(instrs[operands[0]][0]), _dims(instrs[operands[1]][0]), _dims(shape)
    window = _window(rest, sum(c.isdigit() for c in kernel_labels))
    per_output_position = kernel_dims[kernel_labels.index("i")]
    positions = 1
    valid_pairs = 1
    for d, (stride, pad_low, lhs_dilate, rhs_dilate) in enumerate(window):
        spatial = str(d)
        size_out = out_dims[out_labels.index(spatial)]
        positions *= size_out
        size_in, size_kernel = lhs_dims[lhs_labels.index(spatial)], kernel_dims[kernel_labels.index(spatial)]
        valid_pairs *= _valid_window_pairs(size_in, size_kernel, size_out, stride, pad_low, lhs_dilate, rhs_dilate)
    return 2.0 * (_elements(shape) // max(positions, 1)) * per_output_position * valid_pairs


def _window(rest: str, spatial: int) -> list[tuple[int, int, int, int]]:
    """(stride, low padding, lhs dilation, rhs dilation) per spatial dimension of a `window={...}` attribute."""
    fields = dict.fromkeys(("stride", "pad", "lhs_dilate", "rhs_dilate"), "")
    m = _WINDOW.search(rest)
    if m:
        for item in m.group(1).split():
            key, _, value = item.partition("=")
            fields[key] = value
    def per_dim(key: str, default: int) -> list[int]:
        values = [int(v.split("_")[0]) for v in fields[key].split("x")] if fields[key] else []
        return values or [default] * spatial
    return list(zip(per_dim("stride", 1), per_dim("pad", 0), per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)))


@functools.lru_cache(maxsize=4096)
def _valid_window_pairs(size_in: int, size_kernel: int, size_out: int, stride: int, pad_low: int, lhs_dilate: int,
                        rhs_dilate: int) -> int:
    """(output position, kernel position) pairs of one spatial dim whose input coordinate is a real element.

    Output o and kernel k read the padded, dilated input at x = o * stride + k * rhs_dilate - pad_low, a real
    element when 0 <= x <= (size_in - 1) * lhs_dilate and x is a multiple of lhs_dilate.
    """
    last = (size_in - 1) * lhs_dilate
    pairs = 0
    for k in range(size_kernel):
        offset = k * rhs_dilate - pad_low
        low = max(0, -(offset // stride))  # ceil(-offset / stride)
        high = min(size_out - 1, (last - offset) // stride)
        if high < low:
            continue
        pairs += high - low + 1 if lhs_dilate == 1 else _congruent_count(low, high, stride, offset, lhs_dilate)
    return pairs


def _congruent_count(low: int, high: int, a: int, b: int, m: int) -> int:
    """How many integers o in [low, high] have a * o + b divisible by m: a linear congruence, whose solutions, when
    gcd(a, m) divides b, repeat every m / gcd(a, m)."""
    g = math.gcd(a, m)
    if b % g:
        return 0
    period = m // g
    root = (-b // g) * pow(a // g, -1, period) % period if period > 1 else 0
    first = low + (root - low) % period
    return 0 if first > high else (high - first) // period + 1


def _custom_call_flops(shape: str, rest: str, instrs: dict[str, tuple[str, str, str]]) -> float | None:
    target = _TARGET.search(rest)
    if target is None:
        return None
    if target.group(1).startswith(_GEMM_TARGETS):
        contracting = _GEMM_CONTRACTING.search(rest)
        operands = _operands(rest)
        lhs = instrs.get(operands[0]) if operands else None
        if contracting is None or lhs is None:
            return None
        lhs_dims = _dims(lhs[0])
        # The result is a tuple (output, workspace): the output comes first.
        return 2.0 * _elements(shape) * math.prod(lhs_dims[d] for d in _int_list(contracting.group(1)))
    if target.group(1) == _BLOCK_SCALED_DOT:  # (output [B, M, N], workspace) from [B, M, K] x [B, N, K]
        operands = _operands(rest)
        lhs = instrs.get(operands[0]) if operands else None
        return None if lhs is None else 2.0 * _elements(shape) * _dims(lhs[0])[-1]
    if target.group(1).startswith(_CUDNN_CONVOLUTION):
        return _cudnn_convolution_flops(target.group(1), shape, rest, instrs)
    estimate = _COST_ESTIMATE.search(rest)
    return float(estimate.group(1)) if estimate else None


def _cudnn_convolution_flops(target: str, shape: str, rest: str, instrs: dict[str, tuple[str, str, str]]
                             ) -> float | None:
    """A cuDNN convolution custom call (XLA:GPU's convolutions, forward and backward): 2 x the forward convolution's
    output elements x its kernel's elements per output feature. The backward ones compute the same products: the
    input gradient from the output gradient (operand 0) and the kernel (operand 1), the kernel gradient from the
    input and the output gradient (operand 1). Padding is counted as computed (no valid-window correction)."""
    operands = _operands(rest)
    labels = _DIM_LABELS.search(rest)
    if labels is None or len(operands) < 2 or any(o not in instrs for o in operands[:2]):
        return None
    if "BackwardFilter" in target:
        out, kernel = instrs[operands[1]][0], shape
    elif "BackwardInput" in target:
        out, kernel = instrs[operands[0]][0], instrs[operands[1]][0]
    else:
        out, kernel = shape, instrs[operands[1]][0]
    kernel_labels, kernel_dims = labels.group(2), _dims(kernel)
    if "o" not in kernel_labels or len(kernel_dims) != len(kernel_labels):
        return None
    return 2.0 * _elements(out) * _elements(kernel) / max(kernel_dims[kernel_labels.index("o")], 1)


def attention_kernel(name: str, shape: str, rest: str, instrs: dict[str, tuple[str, str, str]]
                     ) -> tuple[str, float, int] | None:
    """(kernel, matmul FLOPs, head dim) of a Pallas flash attention custom call, counted from its operand shapes; None
    for other custom calls.

    Per (query, key) pair computed, per query head: the forward does Q K^T and P V (4 x Dh flops); splash's dq
    kernel recomputes the scores, dP = dO V^T and dQ (6 x Dh); its dkv kernel the scores, dV, dP and dK (8 x Dh; 10
    fused with dQ); the Triton backward does both in one kernel (14 x Dh), after an elementwise preprocessing
    kernel (no matmul FLOPs). Pairs computed: the blocks a causal mask
    leaves visible, each whole (the kernels skip fully masked blocks only): splash's block sizes from the kernel's
    metadata, the Triton kernel's from its grid (forward) and jax's defaults (backward, 32). A sliding-window mask
    skips more blocks than this count, as far as the grid of splash's block mask shows (jax shrinks the forward's
    key blocks to the most any query block meets: two for a window shorter than a block); the blocks it skips inside
    that grid are not seen. Keys a whole multiple of the queries' length are a whole sequence whose queries are split
    over devices (context parallelism): each slice sees the keys before its place, and the count is the slices' mean.
    """
    kernel = _ATTENTION_KERNEL.search(rest) or _ATTENTION_KERNEL.search(name)
    if kernel is None:
        return None
    if kernel.group(3) == "preprocess_backward":  # the Triton backward's row sums of dO x O: no matmul
        return kernel.group(1), 0.0, DEFAULT_HEAD_DIM
    floats = [instrs[o][0] for o in _operands(rest) if o in instrs and _FLOAT_ARRAY.match(instrs[o][0])]
    q, k = (_dims(s) for s in floats[:2]) if len(floats) >= 2 else ([], [])
    if len(q) < 3 or len(k) < 3:
        return None
    blocks = dict(_BLOCK.findall(rest))
    phase = kernel.group(2) or kernel.group(3)
    if kernel.group(2):  # splash: [..., heads, L, Dh], or [..., heads, Dh, L] in its SEQ_MINOR layout
        q, k = _splash_operand_dims(rest, q, k)
        heads, Lq, Lk, Dh = math.prod(q[:-2]), q[-2], k[-2], q[-1]
        suffix = {"fwd": "", "dq": "_dq", "dkv": "_dkv"}[phase]
        bq, bk = int(blocks.get("block_q" + suffix, 1)), int(blocks.get("block_kv" + suffix, 1))
        per_pair = {"fwd": 4, "dq": 6, "dkv": 10 if shape.count("[") >= 3 else 8}[phase]
    else:  # Triton: [B, L, heads, Dh]
        heads, Lq, Lk, Dh = math.prod(q[:-3]) * q[-2], q[-3], k[-3], q[-1]
        grid = _GRID_X.search(rest)
        if phase == "forward":
            bq, bk, per_pair = (Lq // int(grid.group(1)) if grid else 128), 128, 4
        else:
            bq, bk, per_pair = 32, 32, 14
    pairs = _causal_block_pairs(Lq, Lk, min(bq, Lq), min(bk, Lk))
    if Lk > Lq and Lk % Lq == 0:
        # the queries are one of Lk / Lq slices of a sequence whose keys are all here (context parallelism: the
        # sequence split over devices, keys and values gathered), each slice at its own place in the sequence; a
        # load-balanced layout (MaxText's default) gives every device the mean of the slices' pairs
        slices = Lk // Lq
        pairs = sum(_causal_block_pairs(Lq, Lk, min(bq, Lq), min(bk, Lk), s * Lq) for s in range(slices)) / slices
    if kernel.group(2) and (grid := _MASK_GRID.search(rest)):
        pairs = min(pairs, int(grid.group(1)) * int(grid.group(2)) * min(bq, Lq) * min(bk, Lk))
    return kernel.group(1), float(per_pair * Dh * heads * pairs), Dh


def _splash_operand_dims(rest: str, q: list[int], k: list[int]) -> tuple[list[int], list[int]]:
    """A splash kernel's query and key operand dims as [..., L, Dh]: those its kernel metadata says are laid out
    sequence-minor ([..., Dh, L]) with their last two dims swapped."""
    layouts = dict(_LAYOUT.findall(rest))

    def minor_dh(name: str, d: list[int]) -> list[int]:
        return [*d[:-2], d[-1], d[-2]] if int(layouts.get(name, 1)) == SEQ_MINOR else d

    return minor_dh("q", q), minor_dh("k", k)


def _causal_block_pairs(Lq: int, Lk: int, bq: int, bk: int, offset: int = 0) -> int:
    """(query, key) pairs in the [bq, bk] blocks that hold at least one causally visible pair (query i, at place
    offset + i in the sequence, sees key j when j <= offset + i), each block counted whole."""
    nk = -(-Lk // bk)
    return sum(bq * bk * min(nk, -(-(offset + (i + 1) * bq) // bk)) for i in range(-(-Lq // bq)))


def _applications(opcode: str, key: str, shape: str, rest: str, instrs: dict[str, tuple[str, str, str]]) -> float:
    """How often a reduction-like op applies its scalar computation, as XLA's HloCostAnalysis counts it."""
    operands = _operands(rest)

    def operand_elements(i: int) -> int:
        found = instrs.get(operands[i]) if i < len(operands) else None
        return _elements(found[0]) if found else 0

    out = _elements(shape)
    if opcode == "reduce":
        return max(operand_elements(0) - out, 0)
    if opcode == "reduce-window":
        window = _WINDOW_SIZE.search(rest)
        return out * (math.prod(_int_list(window.group(1).replace("x", ","))) - 1 if window else 0)
    if opcode == "scatter":
        return operand_elements(len(operands) - 1)  # the updates
    if opcode == "select-and-scatter":
        window = _WINDOW_SIZE.search(rest)
        size = math.prod(_int_list(window.group(1).replace("x", ","))) if window else 1
        return operand_elements(1) * (size if key == "select" else 1)
    if opcode == "sort":
        dims = _dims(shape)
        axis = _DIMENSIONS.search(rest)
        n = dims[_int_list(axis.group(1))[0]] if axis and dims else 1
        return out * max(math.ceil(math.log2(n)), 1) if n > 1 else 0
    # map, all-reduce, reduce-scatter: one application per result element, over every array of a tuple result.
    return sum(math.prod(int(d.lstrip("<=")) for d in m.split(",") if d) for m in _ARRAY.findall(shape))


def _trip_count(comp: _Comp, while_name: str, comps: dict[str, _Comp]) -> tuple[int | None, str]:
    """A while op's trip count: from its backend_config, else from its condition, init and step; else unknown.

    The fallback recognises the counted loops XLA makes of scans: the condition compares a loop-state tuple
    element against a constant, the init tuple holds a constant there, and the body adds a constant to it.
    """
    shape, _, rest = comp.instrs[while_name]
    known = _KNOWN_TRIP.search(rest)
    if known:
        return int(known.group(1)), "backend_config"
    callees = dict(_callees(rest))
    cond = comps.get(callees.get("condition", [""])[0])
    body = comps.get(callees.get("body", [""])[0])
    operands = _operands(rest)
    if cond is None or body is None or cond.root is None or body.root is None or not operands:
        return None, "unknown"
    compare = _compare(cond, cond.root, {}, comps, 0)
    if compare is None:
        return None, "unknown"
    direction, lhs, rhs = compare
    if lhs[0] == "const" and rhs[0] == "gte":
        lhs, rhs = rhs, lhs
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    if lhs[0] != "gte" or rhs[0] != "const":
        return None, "unknown"
    index, offset = lhs[1], lhs[2]
    init = _element(comp, operands[0], index, comps)
    step = _element(body, body.root, index, comps)
    if init is None or init[0] != "const" or step is None or step[0] != "gte" or step[1] != index or step[2] == 0:
        return None, "unknown"
    start, stride, limit = init[1] + offset, step[2], rhs[1]
    if direction in ("LE", "GE"):
        limit += 1 if direction == "LE" else -1
        direction = "LT" if direction == "LE" else "GT"
    if direction == "LT" and stride > 0:
        return max(0, -(-(limit - start) // stride)), "condition"
    if direction == "GT" and stride < 0:
        return max(0, -(-(start - limit) // -stride)), "condition"
    if direction == "NE" and (limit - start) % stride == 0 and (limit - start) // stride >= 0:
        return (limit - start) // stride, "condition"
    return None, "unknown"


# A symbolic value while resolving loop counters: ("const", v), ("gte", tuple index, added constant),
# ("param", number, added constant).
_Value = tuple[str, int, int] | tuple[str, int]


def _compare(comp: _Comp, name: str, env: dict[int, _Value | None], comps: dict[str, _Comp],
             depth: int) -> tuple[str, _Value, _Value] | None:
    """The condition's root as (direction, lhs, rhs), looking through fusions that wrap the compare."""
    if depth > _MAX_RESOLVE_DEPTH or name not in comp.instrs:
        return None
    shape, opcode, rest = comp.instrs[name]
    if opcode in ("copy", "bitcast"):
        return _compare(comp, _operands(rest)[0], env, comps, depth + 1)
    if opcode == "fusion":
        inner = comps.get(dict(_callees(rest)).get("calls", [""])[0])
        if inner is None or inner.root is None:
            return None
        inner_env = {i: _value(comp, n, env, comps, depth + 1) for i, n in enumerate(_operands(rest))}
        return _compare(inner, inner.root, inner_env, comps, depth + 1)
    direction = _DIRECTION.search(rest)
    if opcode != "compare" or direction is None:
        return None
    a, b = (_value(comp, n, env, comps, depth + 1) for n in _operands(rest)[:2])
    return (direction.group(1), a, b) if a is not None and b is not None else None


def _value(comp: _Comp, name: str, env: dict[int, _Value | None], comps: dict[str, _Comp],
           depth: int) -> _Value | None:
    """A scalar as a constant or as (loop-state element + constant), looking through copies and fusions."""
    if depth > _MAX_RESOLVE_DEPTH or name not in comp.instrs:
        return None
    shape, opcode, rest = comp.instrs[name]
    operands = _operands(rest)
    if opcode == "constant":
        m = _CONSTANT.match(rest[:rest.find(")")])  # a scalar literal; metadata after it may hold ")"
        return ("const", int(m.group(1))) if m else None
    if opcode == "parameter":
        number = int(rest[:rest.index(")")])
        return env.get(number) if env else ("param", number, 0)
    if opcode in ("copy", "bitcast", "convert", "reshape"):
        return _value(comp, operands[0], env, comps, depth + 1)
    if opcode == "get-tuple-element":
        index = _INDEX.search(rest)
        source = _value(comp, operands[0], env, comps, depth + 1)
        if index and source is not None and source[0] == "param":
            return ("gte", int(index.group(1)), 0)
        return None
    if opcode in ("add", "subtract") and len(operands) == 2:
        a, b = (_value(comp, n, env, comps, depth + 1) for n in operands)
        sign = 1 if opcode == "add" else -1
        if a is not None and b is not None and a[0] == "const" and b[0] == "const":
            return ("const", a[1] + sign * b[1])
        if a is not None and b is not None and b[0] == "const" and a[0] in ("gte", "param"):
            return (a[0], a[1], a[2] + sign * b[1])
        if a is not None and b is not None and a[0] == "const" and b[0] in ("gte", "param") and sign == 1:
            return (b[0], b[1], b[2] + a[1])
        return None
    if opcode == "fusion":
        inner = comps.get(dict(_callees(rest)).get("calls", [""])[0])
        if inner is None or inner.root is None:
            return None
        inner_env = {i: _value(comp, n, env, comps, depth + 1) for i, n in enumerate(operands)}
        return _value(inner, inner.root, inner_env, comps, depth + 1)
    return None


def _element(comp: _Comp, name: str, index: int, comps: dict[str, _Comp]) -> _Value | None:
    """Element `index` of a tuple-valued instruction (a while's init or a body's root)."""
    if name not in comp.instrs:
        return None
    _, opcode, rest = comp.instrs[name]
    operands = _operands(rest)
    if opcode == "tuple" and index < len(operands):
        return _value(comp, operands[index], {}, comps, 0)
    if opcode == "copy" and operands:
        return _element(comp, operands[0], index, comps)
    return None


def _post_order(entry: str, locals_: dict[str, _Local]) -> list[str]:
    """Computations reachable from `entry`, each after every computation that calls it (reversed post-order)."""
    seen = {entry}
    order: list[str] = []
    stack: list[tuple[str, Iterable[str]]] = [(entry, iter(_children(locals_[entry])))]
    while stack:
        name, children = stack[-1]
        for child in children:
            if child not in seen and child in locals_:
                seen.add(child)
                stack.append((child, iter(_children(locals_[child]))))
                break
        else:
            stack.pop()
            order.append(name)
    return order[::-1]


def _children(local: _Local) -> list[str]:
    return [e[0] for e in local.edges] + [n for group in local.branch_groups for n in group]


def hlo_flops(hlo_text: str) -> HloCost:
    """FLOPs per device of one execution of the optimized HLO module in `hlo_text` (see the module docstring)."""
    comps, entry = _parse(hlo_text)
    locals_ = {name: _local(comp, comps) for name, comp in comps.items()}
    order = _post_order(entry, locals_)

    # Bottom-up totals, only to pick each conditional's costliest branch.
    totals: dict[str, float] = {}
    for name in reversed(order):
        local = locals_[name]
        total = sum(local.vector[:_TRANS]) + sum(m * totals.get(c, 0.0) for c, m, _ in local.edges)
        for group in local.branch_groups:
            total += max((totals.get(c, 0.0) for c in group), default=0.0)
        totals[name] = total

    # Top-down execution counts; a computation applied by a reduction keeps that opcode as its kind.
    counts: dict[str, dict[str, float]] = {entry: {"": 1.0}}
    for name in order:
        local = locals_[name]
        for kind, executions in counts.get(name, {}).items():
            calls = [(c, m, kind or k) for c, m, k in local.edges]
            calls += [(max(group, key=lambda c: totals.get(c, 0.0)), 1.0, kind)
                      for group in local.branch_groups if group]
            for callee, multiplier, callee_kind in calls:
                by_kind = counts.setdefault(callee, {})
                by_kind[callee_kind] = by_kind.get(callee_kind, 0.0) + executions * multiplier

    vector = [0.0] * 5
    reduction = 0.0
    by_opcode: dict[str, float] = {}
    by_operands: dict[str, float] = {}
    custom_calls: dict[str, int] = {}
    loops: list[Loop] = []
    unresolved = conditionals = 0
    for name, kind, executions in [(c, k, n) for c, by_kind in counts.items() for k, n in by_kind.items()]:
        local = locals_[name]
        if kind:  # a scalar body applied by a reduction: its arithmetic is reduction work
            applied = executions * (local.vector[_ELEM] + local.vector[_DOT] + local.vector[_CONV])
            reduction += applied
            by_opcode[kind] = by_opcode.get(kind, 0.0) + applied
            vector[_TRANS] += executions * local.vector[_TRANS]
            continue
        for i, v in enumerate(local.vector):
            vector[i] += executions * v
        for op, flops in local.by_opcode.items():
            by_opcode[op] = by_opcode.get(op, 0.0) + executions * flops
        for types, flops in local.by_operands.items():
            by_operands[types] = by_operands.get(types, 0.0) + executions * flops
        for target, n in local.custom_calls.items():
            custom_calls[target] = custom_calls.get(target, 0) + n
        unresolved += local.unresolved
        conditionals += len(local.branch_groups)
        loops.extend(Loop(op, name, body, trip, source, executions) for op, body, trip, source in local.loops)
    flops = vector[_DOT] + vector[_CONV] + vector[_CUSTOM]
    return HloCost(
        flops=flops, dot_flops=vector[_DOT], convolution_flops=vector[_CONV], custom_call_flops=vector[_CUSTOM],
        elementwise_flops=vector[_ELEM], reduction_flops=reduction, transcendentals=vector[_TRANS],
        xla_style_flops=flops + vector[_ELEM] + reduction,
        by_opcode=dict(sorted(by_opcode.items(), key=lambda kv: -kv[1])), loops=tuple(loops),
        unknown_trip_counts=sum(1 for loop in loops if loop.trip_count is None), conditionals=conditionals,
        unhandled_custom_calls=custom_calls, unresolved_operands=unresolved, computations=len(counts),
        attention_kernel_flops=sum(v for k, v in by_opcode.items() if k.startswith(_ATTENTION_KEY)),
        matmul_flops_by_operands=dict(sorted(by_operands.items(), key=lambda kv: -kv[1])))


# The module as this file reads it, for maxperf.aot.hlo_time, which times the instructions these functions count:
# the parsed computations, one computation's own work, an instruction's operands, callees and trip count, and the
# FLOPs of a convolution or custom call.
Computation = _Comp
LocalWork = _Local
parse_computations = _parse
local_work = _local
operands = _operands
callees = _callees
dims = _dims
trip_count = _trip_count
convolution_flops = _convolution_flops
custom_call_flops = _custom_call_flops
CUSTOM_CALL_TARGET = _TARGET
NO_FLOP_TARGETS = _NO_FLOP_TARGETS
GEMM_TARGETS = _GEMM_TARGETS
CUDNN_CONVOLUTION = _CUDNN_CONVOLUTION
ATTENTION_KEY = _ATTENTION_KEY
