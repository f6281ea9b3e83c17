"""`maxperf plan`: the fastest configuration that fits, found analytically, then proved by the compiler.

    from maxperf.studies import search
    req = search.PlanRequest("llama3-70b", "v5p-256", global_batch_tokens=4 << 20)
    result = search.search(req)                # every valid candidate estimated and ranked, nothing compiled
    result = search.verify(result, k=3, out="artifacts/plan")   # the best K compiled in worker processes
    result.winner, result.as_dict()            # plan.json

A candidate is one mesh (ICI and DCN sizes of data, fsdp, fsdp_transpose, sequence, tensor, expert), one remat
policy, one attention kernel, a per-device batch B and gradient accumulation A. Divisibility prunes meshes before
anything is estimated: tensor must divide H and K, expert must divide E (1 for a dense model), sequence must divide L,
each weight's and activation's sharded dimensions must divide by their axes (a dimension the mesh does not divide
would be replicated: `maxperf.plan.replication_warnings`), and the batch axes must divide each microbatch's rows.
The rest are estimated by perfmodel (no jax) and ranked by the objective among those that fit with a safety margin
taken from measured analytical-versus-compiler memory error.

Two orderings spare estimates without changing the answer. Memory: a remat policy that keeps on the device all that
another keeps needs at least as much memory (perfmodel's figures obey it: 18,150 pairs checked over llama3-70b,
mixtral-8x7b and llama2-7b meshes, no exception), so once a policy does not fit, those keeping more are not
estimated. Step time: of two policies that fit, the one keeping more recomputes less and is at least as fast (4,224
pairs checked over five presets and TPU and CPU meshes, no exception), so only the fitting policies no other fitting
one keeps more than are timed; and gradient accumulation beyond the smallest A that fits only repeats each
microbatch's weight gathers, so a configuration's larger A are not estimated once one fits (720 successive pairs of A
checked over the same presets, no exception). All are counted in plan.json (more_accumulation,
keeps_less_than_fitting, keeps_more_than_unfit).

Verification compiles the best K; a compile that needs more memory than perfmodel said raises the margin to the error
it measured, and the search runs again under it before the next compile, so a model perfmodel underestimates does
not cost a compile per near-identical candidate.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxperf.spec import overrides as overrides_mod
from maxperf.spec import presets
from maxperf.spec import request as planning
from maxperf.spec.errors import MaxperfError, closest
from maxperf.spec.logical_axes import MESH_AXES, undivided_axes
from maxperf.spec.remat import CHECKPOINT_NAMES, REMAT_SAVED, RematPolicy
from maxperf.spec.request import Request
from maxperf.spec.train import AttentionKernel

SCHEMA = "maxperf.plan/2"  # 2: per_device_batch_size is one microbatch, as in MaxText
GIB = 1 << 30
OBJECTIVES = ("tokens_per_s", "mfu")
# The remat policies searched: every named policy of MaxText's (custom needs its per-tensor keys: pin it to use it).
REMAT_POLICIES = tuple(p.value for p in RematPolicy if p is not RematPolicy.CUSTOM)
# auto is flash on TPU and GPU (and the blockwise flash on CPU): the two distinct kernels.
KERNELS = (AttentionKernel.FLASH.value, AttentionKernel.DOT_PRODUCT.value)
# Without --global-batch or --per-device-batch: these B (fractions where B x devices is whole), no accumulation.
FREE_BATCHES = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
# What the search decides; a pin (key=value) fixes it. Names after MaxText's aliases are resolved.
SEARCHED_KEYS = {*(f"ici_{a}" for a in MESH_AXES), *(f"dcn_{a}" for a in MESH_AXES), "remat_policy", "attention",
                 "per_device_batch_size", "grad_accum_steps"}
DCN_SEARCHED = ("data", "fsdp")  # the axes searched across slices (others only where pinned)
MAX_COMPILES_PER_FIT = 4  # verification gives up after K x this many compiles

MEMORY_ERROR_PATH = Path(__file__).resolve().parent.parent / "perfmodel" / "memory_error.json"
# Where memory_error.json has no figure at all: the worst of three cases of `bench/memory_accuracy.py --only v5p-8`
# measured here (qwen3-0.6b remat full: analytical 3.20 GiB, compiler 3.55 GiB, -9.9%; minimal -7.2%; gemma-2b full
# +1.5%; B=1, L=2048, libtpu compile-only).
FALLBACK_MARGIN = 0.109  # 3.55 / 3.20 - 1
FALLBACK_SOURCE = "the largest underestimate of bench/memory_accuracy.py --only v5p-8 measured here (3 cases)"


@dataclass(frozen=True)
class Margin:
    """Memory a candidate must leave free: it fits when analytical x (1 + value) <= HBM."""

    value: float
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}


def load_margin(platform: str, path: Path = MEMORY_ERROR_PATH) -> Margin:
    """The largest measured underestimate of memory (compiler / analytical - 1) for `platform` from
    memory_error.json ({platform: {"worst_underestimate": x, "median": y, "cases": n, ...}}, written by
    bench/memory_accuracy.py --error-json); a platform it does not name takes the largest of those it does; no
    file, the fallback figure. Each
    Margin says where its figure came from."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return Margin(FALLBACK_MARGIN, f"{FALLBACK_SOURCE} ({path.name} not found)")
    except (OSError, ValueError) as e:
        return Margin(FALLBACK_MARGIN, f"{FALLBACK_SOURCE} ({path.name} unreadable: {type(e).__name__})")
    rows = {name: row for name, row in data.items() if isinstance(row, dict)
            and isinstance(row.get("worst_underestimate"), (int, float))} if isinstance(data, dict) else {}

    def need(row: dict) -> float:  # an over-estimate needs no margin
        return max(float(row["worst_underestimate"]), 0.0)

    if platform in rows:
        row = rows[platform]
        return Margin(need(row), f"the largest measured {platform} underestimate of memory (compiler over analytical) "
                      f"in {path.name} ({row.get('cases', '?')} cases, median |error| "
                      f"{abs(float(row.get('median', 0))):.1%})")
    if rows:
        name = max(rows, key=lambda n: need(rows[n]))
        return Margin(need(rows[name]), f"the largest measured underestimate of memory in {path.name}, on {name} "
                      f"({path.name} has no {platform} figure)")
    return Margin(FALLBACK_MARGIN, f"{FALLBACK_SOURCE} ({path.name} names no platform's underestimate)")


@dataclass(frozen=True)
class PlanRequest:
    model: str
    topology: str
    num_slices: int = 1
    global_batch_tokens: int | None = None
    per_device_batch: float | None = None
    objective: str = "tokens_per_s"
    pins: tuple[str, ...] = ()


@dataclass(eq=False)  # compared by identity: thousands are sorted and looked up
class Candidate:
    ici: dict[str, int]
    dcn: dict[str, int]
    remat_policy: str
    attention: str
    per_device_batch_size: float  # B: one microbatch per device (MaxText's meaning)
    grad_accum_steps: int  # A: microbatches per step
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    memory_bytes: float = 0.0  # perfmodel's, per device
    bottleneck: str = ""
    status: str = ""  # "chosen", "slower", "does not fit", "compile failed"
    reason: str = ""
    # set where the search needs no step time: a smaller accumulation of the same configuration fits (why)
    skipped: str = ""
    # set where the search needs no memory figure: a policy keeping less does not fit at the same mesh and batch
    unfit: str = ""
    compiler_memory_bytes: float | None = None
    verified: bool | None = None  # None: not compiled; True: the compiler says it fits; False: it does not
    compile_seconds: float | None = None
    artifact: str | None = None
    compile_error: str = ""  # the compile failed (not for memory): why

    @property
    def axes(self) -> dict[str, int]:
        return {a: self.ici[a] * self.dcn[a] for a in MESH_AXES}

    def mesh_shown(self) -> str:
        ici = " x ".join(f"{a}={n}" for a, n in self.ici.items() if n > 1) or "1"
        dcn = " x ".join(f"{a}={n}" for a, n in self.dcn.items() if n > 1)
        return ici + (f" | dcn {dcn}" if dcn else "")

    def memory_shown_bytes(self) -> float:
        """The compiler's figure where there was a compile, else perfmodel's."""
        return self.compiler_memory_bytes if self.compiler_memory_bytes is not None else self.memory_bytes

    def overrides(self) -> tuple[str, ...]:
        """maxperf's key=value words for this candidate: the axes over 1 and ici_fsdp (whose default, -1, would fill
        the slice), so the mesh resolves to exactly this one; the DCN axes left out are 1, dcn_data's -1 fills 1."""
        return (*(f"ici_{a}={n}" for a, n in self.ici.items() if n > 1 or a == "fsdp"),
                *(f"dcn_{a}={n}" for a, n in self.dcn.items() if n > 1),
                f"remat_policy={self.remat_policy}", f"attention={self.attention}",
                f"per_device_batch_size={_number(self.per_device_batch_size)}",
                f"grad_accum_steps={self.grad_accum_steps}")

    def maxtext_flags(self) -> tuple[str, ...]:
        """The same in MaxText's spellings: per_device_batch_size (one microbatch, in both), its
        gradient_accumulation_steps the microbatches (A); mesh axes as *_parallelism, sequence as context."""
        words = []
        for prefix, sizes in (("ici", self.ici), ("dcn", self.dcn)):
            for a, n in sizes.items():
                if n > 1 or (prefix == "ici" and a == "fsdp"):  # MaxText's ici_fsdp defaults to -1: always say it
                    words.append(f"{prefix}_{'context' if a == 'sequence' else a}_parallelism={n}")
        words += [f"remat_policy={self.remat_policy}", f"attention={self.attention}",
                  f"per_device_batch_size={_number(self.per_device_batch_size)}"]
        if self.grad_accum_steps > 1:
            words.append(f"gradient_accumulation_steps={self.grad_accum_steps}")
        return tuple(words)

    def as_dict(self) -> dict[str, Any]:
        return {"ici": self.ici, "dcn": self.dcn, "mesh": self.mesh_shown(), "remat_policy": self.remat_policy,
                "attention": self.attention, "per_device_batch_size": self.per_device_batch_size,
                "grad_accum_steps": self.grad_accum_steps, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "analytical_memory_bytes": self.memory_bytes,
                "compiler_memory_bytes": self.compiler_memory_bytes, "bottleneck": self.bottleneck,
                "status": self.status, "reason": self.reason, "verified": self.verified,
                "compile_seconds": self.compile_seconds, "artifact": self.artifact}


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Pruned:
    """A mesh that divisibility rejects, and how many candidates it stood for."""

    ici: dict[str, int]
    dcn: dict[str, int]
    reason: str
    candidates: int

    def as_dict(self) -> dict[str, Any]:
        return {"ici": self.ici, "dcn": self.dcn, "reason": self.reason, "candidates": self.candidates,
                "status": "indivisible"}


@dataclass
class SearchResult:
    request: PlanRequest
    model_name: str
    topology_name: str
    platform: str
    devices: int
    chips: int
    seq_len: int
    global_batch_rows: int | None
    hbm_bytes: float
    margin: Margin
    fixed: tuple[str, ...]  # pins that are not searched keys: every candidate has them
    candidates: list[Candidate]  # ranked: fitting ones by objective first, then those that do not fit
    pruned: list[Pruned]
    enumerated: int
    search_seconds: float
    verify_seconds: float = 0.0
    compiles: int = 0
    notes: list[str] = field(default_factory=list)
    closest_miss: dict[str, Any] | None = None

    @property
    def fitting(self) -> list[Candidate]:
        """The candidates that fit and were ranked by their step time (best first)."""
        return [c for c in self.candidates if c.status in ("chosen", "slower") and not c.skipped]

    @property
    def winner(self) -> Candidate | None:
        return next((c for c in self.candidates if c.status == "chosen"), None)

    def command(self, c: Candidate) -> dict[str, str | None]:
        """`c` as a maxperf compile command line and as MaxText's (None, with `maxtext_note` saying why, where
        MaxText has no config of the model)."""
        slices = f" --num-slices {self.request.num_slices}" if self.request.num_slices > 1 else ""
        fixed = "".join(f" {w}" for w in self.fixed)
        out = {"maxperf": f"maxperf compile --model {self.model_name} --topology {self.topology_name}{slices}{fixed} "
                          + " ".join(c.overrides())}
        pinned = {overrides_mod.ALIASES.get(k, k) for k in (w.partition("=")[0] for w in self.fixed)}
        model = presets.maxtext_model(self.model_name, pinned)
        if model is None:
            return out | {"maxtext": None,
                          "maxtext_note": f"no equivalent: MaxText has no config of {self.model_name}"}
        maxtext_fixed = "".join(f" {w}" for w in _maxtext_fixed(self.fixed))
        flags = f"max_target_length={self.seq_len}{maxtext_fixed} " + " ".join(c.maxtext_flags())
        # MaxText's train_compile names TPU topologies as maxperf does; elsewhere its flags alone
        start = (f"python3 -m maxtext.train_compile maxtext/configs/base.yml {' '.join(model)} "
                 f"compile_topology={self.topology_name} compile_topology_num_slices={self.request.num_slices} "
                 if self.platform == "tpu" else f"{' '.join(model)} ")
        return out | {"maxtext": start + flags}

    def as_dict(self, rows: bool = True) -> dict[str, Any]:
        """plan.json; `rows` False leaves out its candidates and pruned meshes (a summary's header, built fast)."""
        r = self.request
        winner = self.winner
        statuses = [c.status for c in self.candidates]
        return {
            "schema": SCHEMA, "model": self.model_name, "topology": self.topology_name, "num_slices": r.num_slices,
            "platform": self.platform, "devices": self.devices, "chips": self.chips, "objective": r.objective,
            "global_batch_tokens": r.global_batch_tokens, "per_device_batch": r.per_device_batch,
            "global_batch_rows": self.global_batch_rows, "seq_len": self.seq_len, "pins": list(r.pins),
            "fixed_overrides": list(self.fixed), "hbm_bytes": self.hbm_bytes, "margin": self.margin.as_dict(),
            "counts": {"enumerated": self.enumerated, "indivisible": self.enumerated - len(self.candidates),
                       "memory_estimated": sum(c.memory_bytes > 0 for c in self.candidates),
                       "step_estimated": sum(c.step_time_s > 0 for c in self.candidates),
                       "fit": len(self.fitting),
                       "more_accumulation": sum(c.skipped.startswith("A=") for c in self.candidates),
                       "keeps_less_than_fitting": sum(c.skipped.startswith("remat") for c in self.candidates),
                       "keeps_more_than_unfit": sum(bool(c.unfit) for c in self.candidates),
                       "does_not_fit": statuses.count("does not fit"), "compiled": self.compiles},
            "search_seconds": self.search_seconds, "verify_seconds": self.verify_seconds,
            "chosen": None if winner is None else self.candidates.index(winner),
            "command": None if winner is None else self.command(winner),
            "closest_miss": self.closest_miss, "notes": self.notes,
        } | ({"candidates": [c.as_dict() for c in self.candidates], "pruned": [p.as_dict() for p in self.pruned]}
             if rows else {})


_MAXTEXT_NAMES = {v: k for k, v in overrides_mod.ALIASES.items() if not k.startswith(("ici_", "dcn_"))}


def _maxtext_fixed(words: Sequence[str]) -> list[str]:
    out = []
    for w in words:
        key, _, value = w.partition("=")
        if key in ("seq_len", "max_target_length"):
            continue  # said as max_target_length already
        out.append(f"{_MAXTEXT_NAMES.get(key, key)}={value}")
    return out


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered k-tuple of positive integers whose product is n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in _divisors(n) for rest in factorizations(n // d, k - 1)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split_pins(model, pins: Sequence[str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """Pins of searched keys (by canonical name) and the other key=value words; every word validated first."""
    overrides_mod.apply(model, list(pins))  # an unknown key or a bad value: one line naming what is valid
    searched: dict[str, str] = {}
    fixed = []
    for word in pins:
        key, _, value = word.partition("=")
        name = overrides_mod.ALIASES.get(key, key)
        if name in SEARCHED_KEYS:
            if name in ("remat_policy", "attention"):  # its canonical value (MaxText's `autoselected` is auto)
                value = getattr(overrides_mod.apply(model, [f"{name}={value}"]).train, name).value
            if not (name.startswith(("ici_", "dcn_")) and value.strip() == "-1"):  # -1: left to the search
                searched[name] = value
        else:
            fixed.append(word)
    return searched, tuple(fixed)


def _axis_choices(total: int, pinned: dict[str, int], what: str) -> list[tuple[int, ...]]:
    """Sizes of the six axes over `total` devices, with the pinned ones fixed."""
    fixed = math.prod(pinned.values())
    room = f"{total} devices of each slice" if what == "ici" else f"{total} slice{'s' if total > 1 else ''}"
    if total % fixed:
        shown = " x ".join(f"{what}_{a}={n}" for a, n in pinned.items() if n > 1)
        raise MaxperfError(f"the pinned {shown} multiply to {fixed}, which does not divide the {room}")
    free = [a for a in MESH_AXES if a not in pinned]
    if not free:
        if fixed != total:
            raise MaxperfError(f"the pinned {what}_* axes multiply to {fixed}, not the {room} they must cover")
        return [tuple(pinned[a] for a in MESH_AXES)]
    out = []
    for sizes in factorizations(total // fixed, len(free)):
        d = dict(zip(free, sizes)) | pinned
        out.append(tuple(d[a] for a in MESH_AXES))
    return out


def _whole(x: float) -> float:
    return int(x) if float(x).is_integer() else x


def _batches(req: PlanRequest, devices: int, seq_len: int, pinned: dict[str, str]
             ) -> tuple[list[tuple[float, int]], int | None]:
    """(B, A) pairs to search, B one microbatch per device (per_device_batch_size) and A the microbatches, and the
    global batch in rows where it is fixed (--global-batch, or --per-device-batch: B x A per device)."""
    pinned_b = _whole(float(pinned["per_device_batch_size"])) if "per_device_batch_size" in pinned else None
    pinned_a = int(pinned["grad_accum_steps"]) if "grad_accum_steps" in pinned else None
    if req.global_batch_tokens is not None:
        tokens = req.global_batch_tokens
        if tokens < 1 or tokens % seq_len:
            raise MaxperfError(f"--global-batch {tokens} tokens is not reachable: it must be a positive multiple "
                               f"of the sequence length L={seq_len} (e.g. {max(1, round(tokens / seq_len)) * seq_len})")
        rows = tokens // seq_len
        fixed = f"--global-batch {tokens} ({rows} rows over {devices} devices)"
    elif req.per_device_batch is not None:
        s = req.per_device_batch
        if s <= 0 or not float(s * devices).is_integer():
            raise MaxperfError(f"per-device batch {_number(s)} over {devices} devices gives {s * devices:g} rows, "
                               "which must be a positive whole number")
        rows = int(s * devices)
        fixed = f"--per-device-batch {_number(s)} ({rows} rows over {devices} devices)"
    else:
        rows = None
    if rows is None:  # the step's batch free: no accumulation unless pinned (a smaller B does the same, faster)
        bs = [pinned_b] if pinned_b is not None else [b for b in FREE_BATCHES if float(b * devices).is_integer()]
        return [(b, pinned_a or 1) for b in bs], None
    s = _whole(rows / devices)  # examples per device per step: B x A
    if pinned_b is not None:
        a = rows / (pinned_b * devices)
        if not a.is_integer() or (pinned_a is not None and pinned_a != a):
            steps = f" x grad_accum_steps={pinned_a}" if pinned_a is not None else ""
            raise MaxperfError(f"per_device_batch_size={_number(pinned_b)}{steps} contradicts {fixed}: B x A must be "
                               f"{_number(s)} per device (per_device_batch_size={_number(s)} grad_accum_steps=1, "
                               "or a divisor of it with its A)")
        return [(pinned_b, int(a))], rows
    # A microbatches of the step's batch, each a whole number of rows, and of rows per device where B x A is whole
    valid = [a for a in _divisors(rows) if not float(s).is_integer() or int(s) % a == 0]
    if pinned_a is not None and pinned_a not in valid:
        raise MaxperfError(f"grad_accum_steps={pinned_a} does not divide the per-device batch per step {_number(s)} "
                           f"({fixed}); valid: {', '.join(map(str, valid))}")
    return [(_whole(s / a), a) for a in ([pinned_a] if pinned_a is not None else valid)], rows


_OFFLOADED = {p for p in REMAT_POLICIES if p != "none" and REMAT_SAVED[RematPolicy(p)][1]}


def _saved(policy: str) -> frozenset[str]:
    """The checkpoint names a remat policy keeps in device memory (`none`: all of them)."""
    if policy == "none":
        return frozenset(CHECKPOINT_NAMES)
    return frozenset(REMAT_SAVED[RematPolicy(policy)][0])


def _choices(pinned: dict[str, str], key: str, options: Sequence[str]) -> list[str]:
    return [pinned[key]] if key in pinned else list(options)


class _Divisibility:
    """Why a mesh cannot split what it must (None when it can); per mesh, cached."""

    def __init__(self, model, seq_len: int):
        from maxperf.perfmodel.sharding import param_arrays

        self.model, self.seq_len = model, seq_len
        self.arrays = [(x.shape, x.logical) for x in param_arrays(model)]
        self.arrays += [((n,), (name,)) for n, name in (
            (model.num_heads, "activation_heads"), (model.num_kv_heads, "activation_kv_heads"),
            (model.d_ff, "activation_mlp"), (model.vocab_size, "activation_vocab"))]
        self.cache: dict[tuple[int, ...], str | None] = {}

    def reason(self, axes: dict[str, int]) -> str | None:
        key = tuple(axes.values())
        if key not in self.cache:
            self.cache[key] = self._reason(axes)
        return self.cache[key]

    def _reason(self, axes: dict[str, int]) -> str | None:
        m = self.model
        experts = m.num_experts if m.is_moe else 1
        if experts % axes["expert"]:
            return (f"expert={axes['expert']} does not divide E={experts}" if m.is_moe else
                    f"expert={axes['expert']} on a dense model (no experts to split)")
        if m.num_heads % axes["tensor"] or m.num_kv_heads % axes["tensor"]:
            return f"tensor={axes['tensor']} does not divide H={m.num_heads} and K={m.num_kv_heads}"
        if self.seq_len % axes["sequence"]:
            return f"sequence={axes['sequence']} does not divide L={self.seq_len}"
        for shape, logical in self.arrays:
            for dim, axis in undivided_axes(shape, logical, axes):
                return f"{axis}={axes[axis]} does not divide {logical[dim]}={shape[dim]} (it would be replicated)"
        return None


def batch_axes(axes: dict[str, int]) -> int:
    """The mesh axes a microbatch's rows are split over (logical_axes' activation_batch)."""
    return axes["data"] * axes["fsdp"] * axes["fsdp_transpose"] * axes["expert"]


def search(req: PlanRequest, progress: Callable[[str], None] | None = None, margin: Margin | None = None
           ) -> SearchResult:
    """Enumerates, prunes, estimates and ranks every candidate; compiles nothing. `margin`: instead of the measured
    one (load_margin), as verification raises it."""
    from maxperf import perfmodel
    from maxperf.perfmodel import estimate_memory
    from maxperf.perfmodel.estimate import device_for
    from maxperf.perfmodel.flops import resolve_attention
    from maxperf.spec.mesh import Mesh
    from maxperf.user_cache import calibration_for

    start = time.perf_counter()
    say = progress or (lambda _: None)
    if req.objective not in OBJECTIVES:
        hits = closest(req.objective, OBJECTIVES)
        raise MaxperfError(f"--objective {req.objective} is not valid; "
                           f"{'did you mean ' + hits[0] + '? ' if hits else ''}valid: {', '.join(OBJECTIVES)}")
    if req.global_batch_tokens is not None and req.per_device_batch is not None:
        raise MaxperfError("give --global-batch or --per-device-batch, not both")
    model0 = presets.get(req.model)
    pinned, fixed = _split_pins(model0, req.pins)
    base = planning.resolve(req.topology, req.model, fixed, num_slices=req.num_slices)
    topo, model, train0 = base.topology, base.configs.model, base.configs.train
    devices, per_domain, domains = topo.num_devices, topo.devices_per_ici_domain, topo.ici_domains
    calibration = calibration_for(topo)
    margin = margin or load_margin(topo.platform)

    ici_choices = _axis_choices(per_domain, {a: int(pinned[f"ici_{a}"]) for a in MESH_AXES
                                             if f"ici_{a}" in pinned}, "ici")
    # across slices only data and fsdp, as MaxText advises (its dcn_*_parallelism notes); a pin may choose others
    dcn_pins = {a: int(pinned[f"dcn_{a}"]) if f"dcn_{a}" in pinned else 1 for a in MESH_AXES if a not in DCN_SEARCHED
                or f"dcn_{a}" in pinned}
    dcn_choices = _axis_choices(domains, dcn_pins, "dcn")
    pairs, rows = _batches(req, devices, train0.seq_len, pinned)
    remats = _choices(pinned, "remat_policy", REMAT_POLICIES)
    kernels = _choices(pinned, "attention", KERNELS)
    per_mesh = len(remats) * len(kernels)

    divisible = _Divisibility(model, train0.seq_len)
    candidates: list[Candidate] = []
    pruned: list[Pruned] = []
    enumerated = 0
    for ici_t, dcn_t in itertools.product(ici_choices, dcn_choices):
        ici, dcn = dict(zip(MESH_AXES, ici_t)), dict(zip(MESH_AXES, dcn_t))
        axes = {a: ici[a] * dcn[a] for a in MESH_AXES}
        enumerated += per_mesh * len(pairs)
        why = divisible.reason(axes)
        if why is not None:
            pruned.append(Pruned(ici, dcn, why, per_mesh * len(pairs)))
            continue
        split = batch_axes(axes)
        ok = [(b, a) for b, a in pairs if round(b * devices) % split == 0]
        if len(ok) < len(pairs):
            bad = [(b, a) for b, a in pairs if (b, a) not in ok]
            pruned.append(Pruned(ici, dcn, f"the batch axes ({split} ways) do not divide the microbatch of "
                                           f"{round(bad[0][0] * devices)} rows (B={_number(bad[0][0])}, "
                                           f"A={bad[0][1]})", per_mesh * len(bad)))
        for (b, a), remat, kernel in itertools.product(ok, remats, kernels):
            candidates.append(Candidate(ici, dcn, remat, kernel, b, a))
    say(f"{enumerated} candidates, {enumerated - len(candidates)} pruned as indivisible, "
        f"{len(candidates)} to estimate")

    chip = device_for(topo, calibration)
    trains: dict[tuple, Any] = {}
    resolved: dict[tuple, Any] = {}
    meshes: dict[tuple, Any] = {}  # by ICI and DCN sizes: one perfmodel Mesh for its candidates
    memories: dict[Candidate, Any] = {}  # estimate_memory's breakdown, handed to estimate() for those that fit
    # by mesh, the step's rows (B x devices x A), kernel; then A and remat: a bucket's A split one step's batch
    index = {(tuple(c.ici.values()), tuple(c.dcn.values()), round(c.per_device_batch_size * devices)
              * c.grad_accum_steps, c.attention, c.grad_accum_steps, c.remat_policy): c for c in candidates}
    accums = sorted({a for _, a in pairs})
    order = sorted(remats, key=lambda r: (r in _OFFLOADED, len(_saved(r))))  # least kept first, offloads last
    limit_factor = 1 + margin.value
    for bucket in dict.fromkeys(k[:4] for k in index):
        fitted_at: dict[str, int] = {}  # remat policy -> the smallest A at which it fits
        for a in accums:
            unfit: list[str] = []  # policies keeping only device memory that do not fit at this A
            fit: dict[str, Candidate] = {}
            for remat in order:
                c = index.get((*bucket, a, remat))
                if c is None:
                    continue
                key = (c.remat_policy, c.attention, c.per_device_batch_size, c.grad_accum_steps)
                if key not in trains:
                    trains[key] = dataclasses.replace(train0, remat_policy=RematPolicy(c.remat_policy),
                                                      attention=AttentionKernel(c.attention),
                                                      per_device_batch_size=c.per_device_batch_size,
                                                      grad_accum_steps=c.grad_accum_steps)
                    resolved[key] = resolve_attention(model, trains[key], chip.kind)
                if remat in fitted_at:  # more microbatches than it needs to fit: only more weight gathers
                    c.skipped = (f"A={fitted_at[remat]} already fits; more accumulation only repeats the weight "
                                 "gathers per microbatch")
                    continue
                less = next((q for q in unfit if _saved(q) <= _saved(remat)), None) if remat not in _OFFLOADED \
                    else None
                if less is not None:  # keeps all that `less` keeps, which does not fit: needs at least as much
                    c.unfit = f"keeps all that remat_policy={less} keeps, which does not fit"
                    continue
                mesh_key = (bucket[0], bucket[1])
                if (mesh := meshes.get(mesh_key)) is None:
                    mesh = meshes[mesh_key] = Mesh.of(c.axes, c.dcn).check(topo)
                memories[c] = estimate_memory(model, resolved[key], mesh, chip.hbm_bytes, chip.kind)
                c.memory_bytes = memories[c].per_device_total_bytes
                if c.memory_bytes * limit_factor > chip.hbm_bytes:
                    if remat not in _OFFLOADED:
                        unfit.append(remat)
                    continue  # does not fit: its step time is never needed
                fit[remat] = c
                fitted_at[remat] = a
            for remat, c in fit.items():
                more = next((q for q in fit if q not in _OFFLOADED and remat not in _OFFLOADED
                             and _saved(q) > _saved(remat)), None)
                if more is not None:  # recomputes all that `more` recomputes, and more
                    c.skipped = f"remat_policy={more} keeps more and fits: less recompute"
                    continue
                key = (c.remat_policy, c.attention, c.per_device_batch_size, c.grad_accum_steps)
                est = perfmodel.estimate(Request.of(topo, model, trains[key], c.axes, c.dcn), calibration=calibration,
                                         memory=memories[c])
                c.step_time_s, c.tokens_per_s, c.mfu = est.step_time_s, est.tokens_per_s, est.mfu
                c.memory_bytes, c.bottleneck = est.memory_per_device_bytes, est.bottleneck
    hbm = chip.hbm_bytes
    result = SearchResult(req, model.name, topo.name, topo.platform, devices, topo.chips, train0.seq_len, rows, hbm,
                          margin, fixed, candidates, pruned, enumerated, 0.0)
    rank(result)
    if not result.fitting and candidates:
        result.closest_miss = closest_miss(result, model, trains, topo, calibration)
    result.search_seconds = time.perf_counter() - start
    return result


def rank(result: SearchResult) -> None:
    """Orders the candidates: those that fit (with the margin, and by the compiler where compiled) by the objective,
    best first, then those that do not by how far they miss; marks the best one chosen and the others slower."""
    limit = result.hbm_bytes
    factor = 1 + result.margin.value
    objective = result.request.objective
    for c in result.candidates:
        if c.skipped:
            c.status, c.reason = "slower", c.skipped
        elif c.unfit:
            c.status, c.reason = "does not fit", c.unfit
        elif c.compile_error:
            c.status, c.reason = "compile failed", c.compile_error
        elif c.verified is False:
            c.status = "does not fit"
            c.reason = (f"compiler: {c.compiler_memory_bytes / GIB:.2f} GiB of {limit / GIB:.2f} GiB"
                        if c.compiler_memory_bytes else "compiler: does not fit")
        elif c.verified is None and c.memory_bytes * factor > limit:
            c.status = "does not fit"
            c.reason = (f"analytical {c.memory_bytes / GIB:.2f} GiB x {factor:.2f} margin > "
                        f"{limit / GIB:.2f} GiB")
        else:
            c.status, c.reason = "slower", ""
    fits = sorted((c for c in result.candidates if c.status == "slower" and not c.skipped),
                  key=lambda c: (-getattr(c, objective), c.verified is not True, c.memory_shown_bytes()))
    skipped = [c for c in result.candidates if c.skipped]
    misses = sorted((c for c in result.candidates if c.status == "does not fit"),
                    key=lambda c: (bool(c.unfit), c.memory_shown_bytes()))
    failed = [c for c in result.candidates if c.status == "compile failed"]
    result.candidates = fits + skipped + misses + failed
    if not fits:
        return
    compiled = [c for c in fits if c.verified]
    best = compiled[0] if compiled else fits[0]
    best.status = "chosen"
    above = True
    for c in fits:
        if c is best:
            above = False
            continue
        if c.verified is None and above:
            c.reason = "not compiled: verification stopped before it"
        else:
            c.reason = f"{getattr(best, objective) / getattr(c, objective):.3f}x slower by {objective}"


def closest_miss(result: SearchResult, model, trains, topo, calibration) -> dict[str, Any]:
    """The candidate nearest to fitting, and what would make it fit: more chips, host offload, a shorter sequence,
    each estimated, not guessed."""
    from maxperf import perfmodel

    c = result.candidates[0]  # the misses are sorted by memory
    limit, factor = result.hbm_bytes, 1 + result.margin.value
    need = c.memory_bytes * factor
    train = trains[(c.remat_policy, c.attention, c.per_device_batch_size, c.grad_accum_steps)]
    options = []
    chips = result.chips * 2 ** math.ceil(math.log2(need / limit))
    options.append(f"more chips: the state and a fixed global batch split over about {chips} chips instead of "
                   f"{result.chips} ({need / limit:.2f}x the memory needed)")
    offload = dataclasses.replace(train, optimizer_memory_host_offload=True, parameter_memory_host_offload=True)
    mem = perfmodel.estimate(Request.of(topo, model, offload, c.axes, c.dcn), calibration=calibration).memory_per_device_bytes
    options.append(f"offload: optimizer_memory_host_offload=true parameter_memory_host_offload=true take it to "
                   f"{mem * factor / GIB:.2f} GiB ({'fits' if mem * factor <= limit else 'still does not fit'})")
    seq = train.seq_len
    while seq >= 256:
        seq //= 2
        shorter = dataclasses.replace(train, seq_len=seq)
        mem = perfmodel.estimate(Request.of(topo, model, shorter, c.axes, c.dcn), calibration=calibration).memory_per_device_bytes
        if mem * factor <= limit:
            options.append(f"shorter sequence: seq_len={seq} needs {mem * factor / GIB:.2f} GiB (fits)")
            break
    else:
        options.append(f"shorter sequence: even seq_len={seq} does not fit")
    return {"candidate": c.as_dict(), "memory_with_margin_bytes": need, "hbm_bytes": limit,
            "over_by_bytes": need - limit, "would_need": options}


def verify(result: SearchResult, k: int, out: str | os.PathLike, workers: int | None = None,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Compiles the best candidates in worker processes (the sweep's pool, its point.json and its resume), K at a
    time, dropping those the compiler says do not fit and compiling the next, until K fit; the compiler's memory
    replaces perfmodel's and the candidates are ranked again."""
    from maxperf.studies import sweep

    say = progress or (lambda _: None)
    start = time.perf_counter()
    out_dir = Path(out)
    compiled: dict[tuple[str, ...], Candidate] = {}  # by overrides: what the compiler said, kept across re-searches
    budget = k * MAX_COMPILES_PER_FIT
    while True:
        verified = [c for c in result.candidates if c.verified]
        want = k - len(verified)
        todo = [c for c in result.fitting if c.overrides() not in compiled][:want]
        if want <= 0 or not todo or result.compiles >= budget:
            break
        todo = todo[:budget - result.compiles]
        points = {sweep.Point(result.topology_name, result.request.num_slices, (*result.fixed, *c.overrides())): c
                  for c in todo}
        say(f"compiling {len(points)} candidate(s): " + "; ".join(c.mesh_shown() for c in todo))
        sweep._run_points(result.request.model, list(points), out_dir, False, _calibration(result),
                          workers or sweep.default_workers(len(points)), say, time.perf_counter())
        for point, c in points.items():
            compiled[c.overrides()] = c
            row = json.loads((out_dir / "points" / point.name / "point.json").read_text())
            result.compiles += 1
            if row["status"] == "error":  # recorded, and the next candidate compiled in its place
                c.verified, c.compile_error = False, f"compile failed: {row['reason']}"
                continue
            c.verified = bool(row.get("fits"))
            c.compiler_memory_bytes = row.get("compiler_memory_bytes")
            if c.compiler_memory_bytes is None and not c.verified:
                c.compiler_memory_bytes = _memory_from_artifact(row.get("artifact"))
            c.compile_seconds, c.artifact = row.get("compile_seconds"), row.get("artifact")
        if _raise_margin(result, [c for c in points.values() if c.compiler_memory_bytes and c.memory_bytes]):
            # the orderings that spared estimates held under the old margin: search again under the new one
            say(f"margin raised to {result.margin.value:.1%}; searching again")
            _search_again(result, compiled, progress)
        rank(result)
    if result.compiles >= budget and len([c for c in result.candidates if c.verified]) < k:
        result.notes.append(f"verification stopped after {result.compiles} compiles ({MAX_COMPILES_PER_FIT} per "
                            f"requested fit)")
    if not any(c.verified for c in result.candidates) and result.compiles:
        result.notes.append("no compiled candidate fits")
        for c in result.candidates:
            if c.status == "chosen":
                c.status, c.reason = "slower", "not verified: every compiled candidate failed to fit"
    result.verify_seconds += time.perf_counter() - start
    return result


def _search_again(result: SearchResult, compiled: dict[tuple[str, ...], Candidate], progress) -> None:
    """The search under the result's (raised) margin, with what the compiler said of each candidate kept."""
    again = search(result.request, progress, margin=result.margin)
    for i, c in enumerate(again.candidates):
        if (done := compiled.get(c.overrides())) is not None:
            again.candidates[i] = done
    result.candidates, result.pruned, result.closest_miss = again.candidates, again.pruned, again.closest_miss
    result.search_seconds += again.search_seconds


def _raise_margin(result: SearchResult, compiled: list[Candidate]) -> bool:
    """A compile measures perfmodel's memory error on this very model and topology: where it exceeds the margin,
    the margin becomes it, so that the candidates ranked next are those that fit by the error just seen. Whether
    it rose."""
    worst = max(compiled, key=lambda c: c.compiler_memory_bytes / c.memory_bytes, default=None)
    if worst is None:
        return False
    error = worst.compiler_memory_bytes / worst.memory_bytes - 1
    if error <= result.margin.value:
        return False
    result.notes.append(f"margin raised from {result.margin.value:.1%} to {error:.1%}: the compiler gave "
                        f"{worst.compiler_memory_bytes / GIB:.2f} GiB for {worst.mesh_shown()} {worst.remat_policy} "
                        f"A={worst.grad_accum_steps}, perfmodel {worst.memory_bytes / GIB:.2f} GiB")
    result.margin = Margin(error, f"measured by this plan's compile of {worst.mesh_shown()} (was "
                                  f"{result.margin.value:.1%}: {result.margin.source})")
    return True


def _memory_from_artifact(artifact: str | None) -> float | None:
    """A compile that does not fit records its figures in memory.json before raising."""
    if not artifact:
        return None
    try:
        return float(json.loads((Path(artifact) / "memory.json").read_text())["per_device_total_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _calibration(result: SearchResult):
    if result.platform != "cpu":
        return None
    from maxperf.user_cache import load_calibration

    return load_calibration()


def write(result: SearchResult, out: str | os.PathLike) -> Path:
    """plan.json into `out`, atomically (plain JSON values throughout: no conversion pass over the candidates)."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".plan.json.partial"
    tmp.write_text(json.dumps(result.as_dict(), allow_nan=False) + "\n")
    os.replace(tmp, directory / "plan.json")
    return directory / "plan.json"
