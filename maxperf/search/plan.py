"""`maxperf plan`: the fastest configuration that fits, found analytically (maxperf.search.verify proves the best by
the compiler).

    from maxperf.search import plan, verify
    req = plan.PlanRequest("llama3-70b", "v5p-256", global_batch_tokens=4 << 20)
    result = plan.search(req)                  # every candidate estimated or ruled out, and ranked; nothing compiled
    result = verify.verify(result, k=3, out="artifacts/plan")   # the best K compiled in worker processes
    result.winner, result.as_dict()            # plan.json

The candidates (maxperf.search.candidates) are estimated by perfmodel (no jax) and ranked by the objective among
those that fit with a safety margin taken from measured analytical-versus-compiler memory error (search.margin).

Orderings spare estimates without changing the answer (perfmodel's figures obey each; checked as said, no exception):
- memory, by remat policy: a policy that keeps on the device all that another keeps needs at least as much memory
  (18,150 pairs over llama3-70b, mixtral-8x7b and llama2-7b meshes), so once a policy does not fit, those keeping more
  are not estimated;
- step time, by remat policy: of two policies that fit, the one keeping more recomputes less and is at least as fast
  (4,224 pairs over five presets and TPU and CPU meshes), so only the fitting policies no other fitting one keeps more
  than are timed;
- step time, by microbatch: a configuration's larger microbatch, where it fits, is at least as fast per token. With
  the global batch fixed, its smaller accumulation A does fewer weight gathers per step (720 successive pairs of A
  over the same presets); with the batch free, each step does the same weight gathers for more tokens (26,177
  successive pairs of B at A=1 over 13 presets in 14 cases: dense, MoE and MLA, TPU, GPU and CPU meshes, two slices;
  bench/plan_orderings.py). So each configuration is estimated from its largest microbatch down, and none below the
  first that fits;
- memory, by microbatch: memory does not fall as B grows at a given accumulation (the same 26,177 pairs at A=1, and
  28,096 at A=2 over 14 presets in 15 cases, a pipeline among them: bench/plan_orderings.py --accumulation 2), and it
  reads A only as whether there is accumulation (its accumulator). So among the batches alike in that (all of them
  with the batch free; those with A > 1 with the global batch fixed), a policy no other keeps less than that does not
  fit at one is estimated at their smallest B next, and where it does not fit there, at none of them.
- memory, by state: the parameters and the optimizer state on a device (memory.state_floor_bytes) depend on the
  mesh and the precision, not on the batch, the remat policy or the kernel, and every phase holds them; where they
  alone exceed HBM with the margin, none of a mesh's candidates of that precision is estimated.
plan.json counts each (more_accumulation, smaller_batch, keeps_less_than_fitting, keeps_more_than_unfit,
unfit_at_smallest_batch, state_does_not_fit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxperf import perfmodel
from maxperf.perfmodel import MemoryBreakdown
from maxperf.perfmodel.estimate import device_for
from maxperf.perfmodel.flops import resolve_attention
from maxperf.perfmodel.work import SHIPPED, uncertainty
from maxperf.search import commands
from maxperf.search.candidates import OFFLOADED, SAVED, Candidate, MeshChoice, Space, mesh_shown, number, space
from maxperf.search.margin import Margin, load_margin
from maxperf.spec.configs import Configs
from maxperf.spec.errors import MaxperfError, closest
from maxperf.spec.mesh import Mesh
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.remat import RematPolicy, remat_names
from maxperf.spec.request import Request
from maxperf.spec.train import AttentionKernel, Quantization, TrainConfig
from maxperf.user_cache import calibration_for

SCHEMA = "maxperf.plan/2"  # 2: per_device_batch_size is one microbatch, as in MaxText
GIB = 1 << 30
STATE_ALONE = "its parameters and optimizer state alone"  # how a candidate ruled out by its state's bytes begins
OBJECTIVES = ("tokens_per_s", "mfu")


@dataclass(frozen=True)
class PlanRequest:
    model: str
    topology: str
    num_slices: int = 1
    global_batch_tokens: int | None = None
    per_device_batch: float | None = None
    objective: str = "tokens_per_s"
    pins: tuple[str, ...] = ()


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
    search_seconds: float
    verify_seconds: float = 0.0
    compiles: int = 0
    notes: list[str] = field(default_factory=list)
    closest_miss: dict[str, Any] | None = None
    # candidates whose objective is within this fraction of the best are ties (perfmodel's held-out error on the
    # chip: what the model cannot tell apart); 0 ranks by the objective alone
    tie: float = 0.0
    # the candidates left out of `candidates` a group at a time (a mesh's of one kernel, precision and pipeline
    # microbatch count whose parameters and optimizer state alone do not fit): each group's mesh, kernel, precision,
    # microbatches, reason and how many candidates
    pruned: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fitting(self) -> list[Candidate]:
        """The candidates that fit and were ranked by their step time (best first)."""
        return [c for c in self.candidates if _ranked(c)]

    @property
    def winner(self) -> Candidate | None:
        return next((c for c in self.candidates if c.status == "chosen"), None)

    def command(self, c: Candidate) -> dict[str, str | None]:
        """`c` as a maxperf compile command line and as MaxText's (maxperf.search.commands)."""
        return commands.command(c, model=self.model_name, topology=self.topology_name, platform=self.platform,
                                num_slices=self.request.num_slices, seq_len=self.seq_len, fixed=self.fixed)

    def counts(self) -> dict[str, int]:
        """How many candidates each rule settled: every candidate enumerated divides the model and the batch
        (maxperf.search.candidates), none is indivisible. One tally of the few kinds of (status, skipped, unfit)
        there are, then a pass over the kinds."""
        cands = self.candidates
        n = dict.fromkeys(("memory_estimated", "step_estimated", "fit", "more_accumulation", "smaller_batch",
                           "keeps_less_than_fitting", "keeps_more_than_unfit", "unfit_at_smallest_batch",
                           "state_does_not_fit", "does_not_fit"), 0)
        n["memory_estimated"] = sum(1 for c in cands if c.memory_bytes > 0)
        n["step_estimated"] = sum(1 for c in cands if c.step_time_s > 0)
        skipped_as = {"A=": "more_accumulation", "B=": "smaller_batch", "remat": "keeps_less_than_fitting"}
        unfit_as = {"keeps": "keeps_more_than_unfit", "does not fit": "unfit_at_smallest_batch"}
        kinds = Counter((c.status, c.skipped[:5], c.unfit[:12]) for c in cands)
        for (status, skipped, unfit), count in kinds.items():
            n["fit"] += count if status in ("chosen", "slower") and not skipped else 0
            n["does_not_fit"] += count if status == "does not fit" else 0
            for table, text in ((skipped_as, skipped), (unfit_as, unfit)):
                if (key := next((k for w, k in table.items() if text.startswith(w[:12])), None)) is not None:
                    n[key] += count
        left_out = sum(p["candidates"] for p in self.pruned)
        n["state_does_not_fit"] = left_out
        n["does_not_fit"] += left_out
        return {"enumerated": len(cands) + left_out, "indivisible": 0, **n, "compiled": self.compiles}

    def as_dict(self, rows: bool = True) -> dict[str, Any]:
        """plan.json; `rows` False leaves out its candidates (a summary's header, built fast)."""
        r = self.request
        winner = self.winner
        return {
            "schema": SCHEMA, "model": self.model_name, "topology": self.topology_name, "num_slices": r.num_slices,
            "platform": self.platform, "devices": self.devices, "chips": self.chips, "objective": r.objective,
            "global_batch_tokens": r.global_batch_tokens, "per_device_batch": r.per_device_batch,
            "global_batch_rows": self.global_batch_rows, "seq_len": self.seq_len, "pins": list(r.pins),
            "fixed_overrides": list(self.fixed), "hbm_bytes": self.hbm_bytes, "margin": self.margin.as_dict(),
            "tie": self.tie,  # candidates within this share of the fastest rank as ties, the simplest first
            # every candidate enumerated divides the model and the batch (maxperf.search.candidates): none indivisible
            "counts": self.counts(),
            "search_seconds": self.search_seconds, "verify_seconds": self.verify_seconds,
            "chosen": None if winner is None else self.candidates.index(winner),
            "command": None if winner is None else self.command(winner),
            "closest_miss": self.closest_miss, "notes": self.notes,
        } | ({"candidates": [c.as_dict() for c in self.candidates], "pruned": self.pruned} if rows else {})



def _percent(x: float) -> str:
    """A share as the percentage it is to a tenth, without a trailing .0 (0.08: 8%, 0.055: 5.5%): a tie said as 6%
    where it was 5.5% let a layout 5.9% slower read as inside it."""
    return f"{x * 100:.1f}".rstrip("0").rstrip(".") + "%"

def search(req: PlanRequest, progress: Callable[[str], None] | None = None, margin: Margin | None = None
           ) -> SearchResult:
    """Enumerates, estimates and ranks every candidate; compiles nothing. `margin`: instead of the measured one
    (load_margin), as verification raises it."""
    with _no_cycle_collection():
        return _search(req, progress, margin)


def _search(req: PlanRequest, progress: Callable[[str], None] | None, margin: Margin | None) -> SearchResult:
    start = time.perf_counter()
    say = progress or (lambda _: None)
    if req.objective not in OBJECTIVES:
        hits = closest(req.objective, OBJECTIVES)
        raise MaxperfError(f"--objective {req.objective} is not valid; "
                           f"{'did you mean ' + hits[0] + '? ' if hits else ''}valid: {', '.join(OBJECTIVES)}")
    if req.global_batch_tokens is not None and req.per_device_batch is not None:
        raise MaxperfError("give --global-batch or --per-device-batch, not both")
    found = space(req.model, req.topology, num_slices=req.num_slices, global_batch_tokens=req.global_batch_tokens,
                  per_device_batch=req.per_device_batch, pins=req.pins)
    topo, model, train0 = found.topology, found.model, found.train
    calibration = calibration_for(topo)
    margin = margin or load_margin(topo.platform, chip=topo.chip, moe=model.is_moe)
    say(f"{len(found.candidates):,} candidate{'s' if len(found.candidates) != 1 else ''} over {len(found.meshes)} "
        f"mesh{'es' if len(found.meshes) != 1 else ''} that divide the model and the batch")

    estimator = _Estimator(found, device_for(topo, calibration), calibration, margin)
    for choice in found.meshes:
        estimator.mesh(choice)
    if estimator.floored and not any(c.memory_bytes for c in found.candidates):
        # none was estimated: of the groups with the least state, every candidate is, and the one needing the least
        # memory stands as the closest to fitting
        least = min(floor for floor, *_ in estimator.floored)
        options = []
        for floor, group, cells, mesh in estimator.floored:
            if floor <= least * (1 + 1e-9):
                for c in cells.values():
                    estimator.memory(c, mesh)
                    options.append((c, group))
        c, group = min(options, key=lambda option: option[0].memory_bytes)
        c.unfit = ""
        group["candidates"] -= 1
        if not group["candidates"]:
            estimator.pruned.remove(group)
    # the groups whose state alone does not fit are listed by group, not candidate by candidate
    candidates = [c for c in found.candidates if not c.unfit.startswith(STATE_ALONE)]
    held_out = uncertainty(estimator.chip, SHIPPED, model.is_moe)
    result = SearchResult(req, model.name, topo.name, topo.platform, topo.num_devices, topo.chips, train0.seq_len,
                          found.rows, estimator.hbm, margin, found.fixed, candidates, 0.0,
                          tie=held_out.relative if held_out else 0.0, pruned=estimator.pruned)
    result.notes.extend(found.notes)
    rank(result)
    if not result.fitting and result.candidates:
        result.closest_miss = closest_miss(result, model, estimator.trains, topo, calibration)
    result.search_seconds = time.perf_counter() - start
    return result


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused: a search and its plan.json allocate hundreds of thousands of small objects
    that form no cycles, and each of the collector's passes over them is time the command waits (3% to 5% of a
    67,200-candidate search)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _ranked(c: Candidate) -> bool:
    """Whether a candidate fits and was ranked by its step time (SearchResult.fitting)."""
    return c.status in ("chosen", "slower") and not c.skipped


class _Estimator:
    """perfmodel's figures for a search's candidates, but for those the orderings (module docstring) rule out."""

    def __init__(self, found: Space, chip, calibration, margin: Margin):
        self.found, self.chip, self.calibration = found, chip, calibration
        self.hbm, self.factor = chip.hbm_bytes, 1 + margin.value
        self.trains: dict[tuple, TrainConfig] = {}  # by (remat, kernel, B, A)
        self.resolved: dict[tuple, TrainConfig] = {}  # the same with the attention kernel resolved for the chip
        # what each policy keeps on the device, and those that offload (remat_policy=custom, where pinned, by its
        # per-tensor keys)
        self.saved = {r: SAVED[r] if r in SAVED else remat_names(found.train, r)[0] for r in found.remats}
        self.offloaded = {r for r in found.remats if (r in OFFLOADED if r in SAVED else remat_names(found.train, r)[1])}
        saved, offloaded = self.saved, self.offloaded
        # the remat policies, least kept first, offloads last
        self.order = sorted(found.remats, key=lambda r: (r in offloaded, len(saved[r])))
        self.heads = [r for r in self.order if r in offloaded or not any(
            q not in offloaded and saved[q] < saved[r] for q in found.remats)]
        # the groups whose state alone does not fit: (its state's bytes, its pruned entry, its cells, its mesh)
        self.floored: list[tuple[float, dict[str, Any], dict, Mesh]] = []
        self.pruned: list[dict[str, Any]] = []  # SearchResult.pruned

    def mesh(self, choice: MeshChoice) -> None:
        """Estimates the candidates of one mesh, each kernel's from the largest microbatch down (the smallest A of a
        fixed global batch, the largest B of a free one): a policy is estimated at no batch below the first it fits
        at, nor where one keeping less does not fit; of those that fit at a batch, only those no other fitting
        policy keeps more than are timed."""
        found = self.found
        saved, offloaded = self.saved, self.offloaded
        mesh = Mesh.of({a: choice.ici[a] * choice.dcn[a] for a in choice.ici}, choice.dcn).check(found.topology)
        parallelism = ParallelismConfig(**{f"ici_{a}": n for a, n in mesh.ici.items()},
                                        **{f"dcn_{a}": n for a, n in mesh.dcn.items()})
        smaller = ("more accumulation only repeats the weight gathers per microbatch" if found.rows else
                   "a smaller per-device batch does the same weight gathers for fewer tokens")
        groups: dict[tuple[str, str, int], dict[tuple[float, int, str], Candidate]] = {}
        for (kernel, quant, m, b, a, remat), c in choice.cells.items():
            groups.setdefault((kernel, quant, m), {})[b, a, remat] = c
        for (kernel, quant, m), cells in sorted(groups.items()):
            pairs = sorted({(b, a) for b, a, _ in cells}, key=lambda p: -p[0])
            # the parameters and optimizer state are the same whatever the batch, remat policy and kernel: where they
            # alone do not fit, no candidate of these does
            b, a, remat = next(iter(cells))
            floor = perfmodel.memory.state_floor_bytes(found.model, self.train(remat, kernel, b, a, quant, m, True),
                                                       mesh, self.chip.kind)
            if floor * self.factor > self.hbm:
                why = (f"{STATE_ALONE} take {floor / GIB:.2f} GiB a device "
                       f"({floor * self.factor / GIB:.2f} GiB with the margin)")
                for c in cells.values():
                    c.unfit = why
                group = {"mesh": mesh_shown(choice.ici, choice.dcn), "ici": choice.ici, "dcn": choice.dcn,
                         "attention": kernel, "quantization": quant, "pipeline_microbatches": m, "reason": why,
                         "candidates": len(cells)}
                self.pruned.append(group)
                self.floored.append((floor, group, cells, mesh))
                continue
            # memory reads A only as whether there is accumulation (its accumulator), and grows with B: among the
            # batches alike in that (every one with the batch free; those with A > 1 with the global batch fixed), a
            # policy no other keeps less than that does not fit at one is estimated at their smallest B next, and
            # if it does not fit there either, it fits at none of them
            smallest = pairs[-1]

            def alike(a: int) -> bool:
                return (a > 1) == (smallest[1] > 1)

            probed: dict[Candidate, MemoryBreakdown] = {}
            nowhere: dict[str, str] = {}  # policy -> why it fits at none of the batches alike
            fitted_at: dict[str, str] = {}  # remat policy -> the largest microbatch it fits at ("A=2", "B=4")
            for b, a in pairs:
                # policies keeping only device memory that do not fit at this batch
                unfit: list[str] = [q for q in nowhere if q not in offloaded] if alike(a) else []
                fit: dict[str, tuple[Candidate, MemoryBreakdown]] = {}
                for remat in self.order:
                    if (c := cells.get((b, a, remat))) is None:
                        continue
                    if remat in fitted_at:
                        c.skipped = f"{fitted_at[remat]} already fits; {smaller}"
                        continue
                    if c in probed:
                        memory = probed.pop(c)
                    elif remat in nowhere and alike(a):
                        c.unfit = nowhere[remat]
                        continue
                    elif (less := None if remat in offloaded else
                          next((q for q in unfit if saved[q] <= saved[remat]), None)) is not None:
                        # keeps all that `less` keeps, which does not fit: needs at least as much
                        c.unfit = f"keeps all that remat_policy={less} keeps, which does not fit"
                        continue
                    else:
                        memory = self.memory(c, mesh)
                    if c.memory_bytes * self.factor > self.hbm:
                        if remat not in offloaded and remat not in unfit:
                            unfit.append(remat)
                        if (remat in self.heads and alike(a) and (b, a) != smallest
                                and (low := cells.get((*smallest, remat))) is not None and low not in probed):
                            probed[low] = self.memory(low, mesh)
                            if low.memory_bytes * self.factor > self.hbm:
                                nowhere[remat] = f"does not fit at {self.batch(*smallest)}, its smallest microbatch"
                        continue  # does not fit: its step time is never needed
                    fit[remat] = (c, memory)
                    fitted_at[remat] = self.batch(b, a)
                for remat, (c, memory) in fit.items():
                    more = None if remat in offloaded else next(
                        (q for q in fit if q not in offloaded and saved[q] > saved[remat]), None)
                    if more is not None:  # recomputes all that `more` recomputes, and more
                        c.skipped = f"remat_policy={more} keeps more and fits: less recompute"
                        continue
                    # the request Request.of makes, with the mesh made once for its candidates
                    request = Request(found.topology, Configs(found.model, self.train(remat, kernel, b, a, quant, m),
                                                              parallelism), mesh)
                    est = perfmodel.estimate(request, calibration=self.calibration, memory=memory)
                    c.step_time_s, c.tokens_per_s, c.mfu = est.step_time_s, est.tokens_per_s, est.mfu
                    c.memory_bytes, c.bottleneck = est.memory_per_device_bytes, est.bottleneck

    def memory(self, c: Candidate, mesh: Mesh) -> MemoryBreakdown:
        """perfmodel's memory of the candidate, its total recorded on it."""
        args = (c.remat_policy, c.attention, c.per_device_batch_size, c.grad_accum_steps, c.quantization,
                c.pipeline_microbatches)
        memory = perfmodel.estimate_memory(self.found.model, self.train(*args, resolved=True), mesh, self.hbm,
                                           self.chip.kind, self.chip.name)
        c.memory_bytes = memory.per_device_total_bytes
        return memory

    def batch(self, b: float, a: int) -> str:
        """A microbatch as a reason names it: its A where the global batch is fixed, else its B."""
        return f"A={a}" if self.found.rows else f"B={number(b)}"

    def train(self, remat: str, kernel: str, b: float, a: int, quant: str, m: int = 0,
              resolved: bool = False) -> TrainConfig:
        """The request's train config with the candidate's remat policy, kernel, B, A, precision and pipeline
        microbatches (`resolved`: its attention kernel resolved for the chip, as estimate_memory takes it)."""
        key = (remat, kernel, b, a, quant, m)
        if key not in self.trains:
            q = Quantization(quant)
            self.trains[key] = dataclasses.replace(
                self.found.train, remat_policy=RematPolicy(remat), attention=AttentionKernel(kernel),
                per_device_batch_size=b, grad_accum_steps=a, quantization=q,
                use_qwix_quantization=self.found.train.use_qwix_quantization or q is Quantization.FP8_FULL,
                num_pipeline_microbatches=m or self.found.train.num_pipeline_microbatches)
            self.resolved[key] = resolve_attention(self.found.model, self.trains[key], self.chip.kind)
        return self.resolved[key] if resolved else self.trains[key]


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
    ties = [c for c in fits if fits and getattr(c, objective) >= getattr(fits[0], objective) * (1 - result.tie)]
    if len(ties) > 1:  # what the model cannot tell apart, the simplest layout first
        ties.sort(key=lambda c: (c.verified is not True, complexity(c), -getattr(c, objective), c.mesh_shown()))
        fits = ties + fits[len(ties):]
        note = (f"{len(ties)} candidates lie within {_percent(result.tie)} of the fastest by {objective}, perfmodel's "
                f"held-out error on this chip: ties, ranked simplest layout first" if result.tie > 0 else
                f"{len(ties)} candidates predict the same {objective}: ties, ranked simplest layout first")
        if note not in result.notes:
            result.notes = [n for n in result.notes if not n.endswith("ties, ranked simplest layout first")] + [note]
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
    if len(ties) > 1 and best in ties:
        gap = getattr(best, objective) / max(getattr(c, objective) for c in ties)
        best.reason = (f"the simplest layout of {len(ties)} within {_percent(result.tie)} of the fastest"
                       + (f" ({gap:.3f}x the fastest's {objective})" if gap < 1 else ""))
    above = True
    for c in fits:
        if c is best:
            above = False
            continue
        ratio = getattr(best, objective) / getattr(c, objective)
        if c.verified is None and above:
            c.reason = "not compiled: verification stopped before it"
        elif c in ties:
            simpler = complexity(best) < complexity(c)
            c.reason = (f"a tie ({ratio:.3f}x by {objective}, within {_percent(result.tie)}), "
                        + ("less simple" if simpler else "as simple, slower" if ratio >= 1 else
                           "as simple, not compiled" if c.verified is None else "as simple"))
        else:
            c.reason = f"{ratio:.3f}x slower by {objective}"


def complexity(c: Candidate) -> tuple[int, int, int, int]:
    """How far a candidate is from the layouts production recipes run (MaxText's default: FSDP over the slice, data
    parallelism across slices, one microbatch, bf16, flash attention): the mesh axes over 1 beyond those, gradient
    accumulation, FP8, the dot product. Ties of equal complexity rank by speed, then by the mesh in words, so that
    they order the same way every time."""
    axes = sum(1 for a, n in c.axes.items() if n > 1 and a != "fsdp" and not (a == "data" and c.ici[a] == 1))
    return axes, int(c.grad_accum_steps > 1), int(c.quantization != "none"), int(c.attention != "flash")


def closest_miss(result: SearchResult, model, trains, topo, calibration) -> dict[str, Any]:
    """The candidate nearest to fitting, and what would make it fit: more chips, host offload, a shorter sequence,
    each estimated, not guessed."""
    c = result.candidates[0]  # the misses are sorted by memory
    limit, factor = result.hbm_bytes, 1 + result.margin.value
    need = c.memory_bytes * factor
    train = trains[(c.remat_policy, c.attention, c.per_device_batch_size, c.grad_accum_steps, c.quantization,
                    c.pipeline_microbatches)]
    options = []
    chips = result.chips * 2 ** math.ceil(math.log2(need / limit))
    options.append(f"more chips: the state and a fixed global batch split over about {chips} chips instead of "
                   f"{result.chips} ({need / limit:.2f}x the memory needed)")
    offload = dataclasses.replace(train, optimizer_memory_host_offload=True, parameter_memory_host_offload=True)
    mem = perfmodel.estimate(Request.of(topo, model, offload, c.axes, c.dcn),
                             calibration=calibration).memory_per_device_bytes
    with_margin = f"with the {factor - 1:.1%} memory margin"
    options.append(f"offload: optimizer_memory_host_offload=true parameter_memory_host_offload=true take it to "
                   f"{mem * factor / GIB:.2f} GiB {with_margin} ({mem / GIB:.2f} GiB without; "
                   f"{'fits' if mem * factor <= limit else 'still does not fit'})")
    seq = train.seq_len
    while seq >= 256:
        seq //= 2
        shorter = dataclasses.replace(train, seq_len=seq)
        mem = perfmodel.estimate(Request.of(topo, model, shorter, c.axes, c.dcn),
                                 calibration=calibration).memory_per_device_bytes
        if mem * factor <= limit:
            options.append(f"shorter sequence: seq_len={seq} needs {mem * factor / GIB:.2f} GiB {with_margin} "
                           "(fits)")
            break
    else:
        options.append(f"shorter sequence: even seq_len={seq} does not fit")
    return {"candidate": c.as_dict(), "memory_with_margin_bytes": need, "hbm_bytes": limit,
            "over_by_bytes": need - limit, "would_need": options}


def write(result, out: str | os.PathLike) -> Path:
    """plan.json into `out`, atomically, from a search's `as_dict()` (a SearchResult, or a serving plan's): plain
    JSON values throughout, no conversion pass over the candidates."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".plan.json.partial"
    with _no_cycle_collection():
        text = json.dumps(result.as_dict(), allow_nan=False, check_circular=False, separators=(",", ":"))
        with open(tmp, "w") as f:
            f.write(text)
            f.write("\n")
    os.replace(tmp, directory / "plan.json")
    return directory / "plan.json"
