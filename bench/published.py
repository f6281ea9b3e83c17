"""maxperf's TPU/GPU step-time model against published training measurements, with held-out fits of its fitted
constants.

    .venv/bin/python bench/published.py [--no-fit] [--only SUBSTRING] [--json FILE] [--free NAMES]
                                        [--hold-out row,source,hardware] [--hlo [--hlo-rows IDS]]
                                        [--mapping FILE] [--compile-misfits]

Rows: bench/published/training.csv (what each source states, with its citation) and
bench/published/maxperf_mapping.csv (how a row is written for maxperf: a preset, key=value overrides, a topology
and slices; or why it cannot be). For every expressible row the script plans and estimates the step
(maxperf.spec.resolve, maxperf.perfmodel.estimate) and compares throughput per chip:

- rows that state tokens/s per chip are compared on tokens/s (the measurement itself);
- rows that state TFLOP/s per chip in MaxText's count are compared on TFLOP/s in the same count, which is
  maxperf's model FLOPs (perfmodel/flops.py follows MaxText's calculate_tflops_training_per_device).

Either way the error is predicted / published - 1 of throughput per chip, which is also the error of TFLOP/s per chip
in maxperf's FLOP count. The "published TF" column shows a tokens/s row converted by maxperf's FLOPs per token,
marked "~".

The fit. These constants of the perfmodel (work.Constants and Overlap) are fitted, by Nelder-Mead on the mean
|log(predicted / published)|:

    matmul_fraction[chip]                  the share of its peak a large matmul sustains on each chip that has rows
    matmul_half["tpu"], ["gpu"]            HALF, the thin side at which a matmul runs at half that rate
    elementwise_d_passes                   elementwise HBM passes per token per layer over D
    Overlap.fsdp, .tensor, .data           hidden fraction of each collective family
    flash_efficiency["tpu"], ["gpu"]       flash attention kernels' fraction of the sustained matmul rate
    dcn_step_latency["tpu"]                seconds per step of a collective's ring across slices
    fp8_efficiency["tpu"], ["gpu"]         FP8 matmuls' share of the FP8 peak relative to bf16 matmuls' (FP8 rows)

By default all but elementwise_d_passes, Overlap.tensor, Overlap.data, both HALFs and TPU7x's fraction are fitted
(FREE: those trade off against the others and stay as the perfmodel ships them; the TPU's HALF because it is read from
Ironwood's published GEMM sweep, work.half_from_sweep, and fitted on the rows it wandered with whichever source was
left out, to 946 without MaxText's v5e table; the GPU's HALF because refitted it rose where the single-H100 steps
measured on hardware do not bear it; TPU7x's fraction because its rows' large matmuls run at Ironwood's measured
ceiling, chips.MEASURED_MATMUL, which leaves it undetermined), each fit starting from
PRIOR (the assumptions before any fit, with the GPUs' measured GEMM rates, which chips.py cites); `--free` names the
ones to fit. Each step is recorded once by perfmodel.estimate as its Terms (every matmul's FLOPs, smallest side and HBM
time; the flash kernels' FLOPs; the elementwise traffic per pass; every collective's and host copy's seconds and
overlap), and all rows' terms are priced at once by the perfmodel's own work.price and work.settle (the terms that
price alike summed first, work.Terms.merged), so that one evaluation of all rows is a few numpy operations, and the
held-out fits run side by side, each round pricing every fit's next points in one evaluation; the result is
checked against perfmodel.estimate at the shipped and at the fitted constants (the "replay" line). "unfitted" is
maxperf as shipped. In-sample: constants fitted on all rows.
Held out (`--hold-out`, default row,source): each row (leave-one-out), each source (leave-one-source-out: its rows
predicted by constants fitted on every other source's), or each hardware generation, predicted by constants fitted, from
PRIOR, on the rest; a chip left with no rows in a fit takes the rule chips.py applies to chips without rows
(`stand_in`). Leave-one-source-out is the figure to expect on runs the model has not seen. The script also prints, for
rows stating both TFLOP/s and tokens/s, the source's FLOPs per token over maxperf's, and the published runs that
maxperf's memory model says would not fit (`--compile-misfits` compiles each of those and prints the compiler's verdict
beside it; `--mapping` reads another writing of the rows). The rows that train in FP8 (quantization set to an FP8
recipe) are summarized again as their own group. Rows on a chip with no fitted fraction (B200) take the rule for chips
without rows (chips.fraction_without_rows) over the fitted fractions, as the perfmodel does.

`--hlo` adds the step time read from the compiled program (maxperf.aot.hlo_time) on every expressible row (or those
of `--hlo-rows`): each row is compiled by `maxperf compile` (one process at a time, HLO_TIMEOUT_S each) under the libtpu
flags its launch script set (the mapping's xla_flags, less those this libtpu compiles on another chip alone, each
named; a LIBTPU_INIT_ARGS in the environment, even empty, replaces them; the compile
cache keeps the programs, so a second run re-reads them in seconds), and its HLO-derived error is printed beside the
analytical one, with the HLO prediction over the analytical one, and summarized per chip. All 90 rows compiled in 65
minutes on a 2-core machine (2026-12-01), each in under 5; QUICK_HLO_ROWS (`--hlo-rows quick`) are ten of them, every
chip generation with rows, single slices and several, FSDP and tensor parallelism, in about 7 minutes.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import sys
import textwrap
import time
from collections.abc import Generator
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from maxperf import perfmodel, spec
from maxperf.perfmodel import chips, work
from maxperf.spec.errors import MaxperfError, unknown
from maxperf.spec.fp8 import recipe as fp8_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
import outfile  # noqa: E402
from compiled import compile_and_read, launch_flags, run_cpu, seconds, step_reading  # noqa: E402

HERE = Path(__file__).resolve().parent / "published"
ROOT = HERE.parent.parent
# `--hlo-rows quick` (see the docstring), and how long one compile may take here.
QUICK_HLO_ROWS = ("maxtext-v4-22b-x1", "maxtext-v4-22b-x4", "maxtext-v5e-16b-x1", "maxtext-v5p-32b-v5p-128-x1",
                  "mpt-h100-7b-L2048-8gpu", "maxtext-v5e-32b-x1", "maxtext-v5p-64b-v5p-128-x1",
                  "mpt-a100-7b-L2048-8gpu", "mpt-h100-1b-L2048-8gpu", "ironwood-llama3.1-70b-L8192-bf16-64chips")
HLO_TIMEOUT_S = 900
# the collectives' Overlap fields; the first three fitted
FAMILY_ORDER = ("fsdp", "tensor", "data", "sequence", "expert")


# ---------------------------------------------------------------------------------------------------------------
# rows


@dataclass
class Row:
    data: dict
    mapping: dict
    request: object = None
    reason: str = ""  # why maxperf cannot express the row ("" when it can)
    published_tokens: float = 0.0  # tokens/s per chip, stated or converted from a stated TFLOP/s
    flops_per_token: float = 0.0  # maxperf's model FLOPs per token
    estimate: object = None

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def group(self) -> str:
        return self.data["hardware"].split(" (")[0].replace("NVIDIA ", "")

    @property
    def pipelined(self) -> bool:
        """Whether the row runs pipeline stages (a `stage` axis of more than one)."""
        return self.request is not None and self.request.mesh.axes["stage"] > 1

    @property
    def fp8(self) -> bool:
        """The row trains in FP8 (its request's quantization is an FP8 recipe)."""
        return self.request is not None and fp8_recipe(str(self.request.train.quantization)) is not None


MAPPING = HERE / "maxperf_mapping.csv"


def load_rows(only: str = "", mapping_path: Path = MAPPING) -> list[Row]:
    with open(HERE / "training.csv", newline="") as f:
        data = {r["id"]: r for r in csv.DictReader(f)}
    with open(mapping_path, newline="") as f:
        mapping = {r["id"]: r for r in csv.DictReader(f)}
    missing = sorted(set(data) ^ set(mapping))
    if missing:
        raise SystemExit(f"training.csv and maxperf_mapping.csv disagree on ids: {', '.join(missing)}")
    wanted = [w for w in only.split(",") if w]
    return [Row(data[i], mapping[i]) for i in data if not wanted or any(w in i for w in wanted)]


def _overrides(row: Row) -> list[str]:
    return row.mapping["overrides"].split()


def resolve(row: Row) -> None:
    """Plans the row and works out its published throughput per chip; or records why it cannot be expressed."""
    m = row.mapping
    if m["not_expressible"]:
        row.reason = m["not_expressible"]
        return
    try:
        row.request = spec.resolve(m["topology"], m["maxperf_model"], _overrides(row), num_slices=int(m["num_slices"]))
    except MaxperfError as e:
        row.reason = f"maxperf rejects the mapping: {e}"
        return
    est = run_estimate(row)
    if est.chips != int(row.data["chips"]):
        row.reason = f"the topology has {est.chips} chips, the source {row.data['chips']}"
        return
    row.estimate = est
    row.flops_per_token = est.flops.model_flops / est.flops.tokens
    if m["compare_on"] == "tokens_per_s":
        row.published_tokens = float(row.data["published_tokens_per_s_per_chip"])
    else:
        row.published_tokens = float(row.data["published_tflops_per_chip"]) * 1e12 / row.flops_per_token


def run_estimate(row: Row, overlap=None, constants: work.Constants = work.SHIPPED):
    p = row.request
    return perfmodel.estimate(p,
                              overlap=overlap, constants=constants)


def predicted_tokens(est) -> float:
    return est.tokens_per_s / est.chips


# ---------------------------------------------------------------------------------------------------------------
# constants and their patching


FRACTION_CHIPS = ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu7x", "a100-40gb", "a100-80gb", "h100-sxm")  # chips with rows


def _fraction_field(chip: str) -> str:
    return "fraction_" + chip.replace("-", "_")


@dataclass(frozen=True)
class Constants:
    fraction_tpu_v4: float
    fraction_tpu_v5e: float
    fraction_tpu_v5p: float
    fraction_tpu7x: float
    fraction_a100_40gb: float
    fraction_a100_80gb: float
    fraction_h100_sxm: float
    tpu_half: float
    gpu_half: float
    elementwise_d_passes: float
    overlap_fsdp: float
    overlap_tensor: float
    overlap_data: float
    flash_tpu: float
    flash_gpu: float
    dcn_latency_tpu: float
    fp8_tpu: float
    fp8_gpu: float

    @classmethod
    def current(cls) -> Constants:
        o, shipped = work.Overlap(), work.SHIPPED
        return cls(*(shipped.matmul_fraction[c] for c in FRACTION_CHIPS), shipped.matmul_half["tpu"],
                   shipped.matmul_half["gpu"], float(shipped.elementwise_d_passes), o.fsdp, o.tensor, o.data,
                   shipped.flash_efficiency["tpu"], shipped.flash_efficiency["gpu"], shipped.dcn_step_latency["tpu"],
                   shipped.fp8_efficiency["tpu"], shipped.fp8_efficiency["gpu"])

    def fractions(self) -> dict[str, float]:
        return {c: getattr(self, _fraction_field(c)) for c in FRACTION_CHIPS}

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=float)

    @classmethod
    def from_vector(cls, x) -> Constants:
        return cls(*(float(v) for v in x))

    def overlap(self) -> work.Overlap:
        return replace(work.Overlap(), fsdp=self.overlap_fsdp, tensor=self.overlap_tensor, data=self.overlap_data)

    def perfmodel(self) -> work.Constants:
        """These values as the perfmodel's Constants, the chips without rows taking the rule over these fitted
        fractions (rounded as chips.py rounds the shipped rule)."""
        shipped, fitted = work.SHIPPED, self.fractions()
        rule = {name: round(chips.fraction_without_rows(name, fitted), 3)
                for name, origin in chips.MATMUL_FRACTION_ORIGIN.items() if origin == "assumed"}
        return work.Constants(
            matmul_fraction={**shipped.matmul_fraction, **rule, **fitted},
            matmul_half={**shipped.matmul_half, "tpu": self.tpu_half, "gpu": self.gpu_half},
            elementwise_d_passes=self.elementwise_d_passes,
            flash_efficiency={**shipped.flash_efficiency, "tpu": self.flash_tpu, "gpu": self.flash_gpu},
            dcn_step_latency={**shipped.dcn_step_latency, "tpu": self.dcn_latency_tpu},
            fp8_efficiency={**shipped.fp8_efficiency, "tpu": self.fp8_tpu, "gpu": self.fp8_gpu})


NAMES = {
    **{_fraction_field(c): f'matmul_fraction["{c}"]' for c in FRACTION_CHIPS},
    "tpu_half": 'matmul_half["tpu"]', "gpu_half": 'matmul_half["gpu"]',
    "elementwise_d_passes": "elementwise_d_passes", "overlap_fsdp": "Overlap.fsdp",
    "overlap_tensor": "Overlap.tensor", "overlap_data": "Overlap.data",
    "flash_tpu": 'flash_efficiency["tpu"]', "flash_gpu": 'flash_efficiency["gpu"]',
    "dcn_latency_tpu": 'dcn_step_latency["tpu"]',
    "fp8_tpu": 'fp8_efficiency["tpu"]', "fp8_gpu": 'fp8_efficiency["gpu"]',
}
BOUNDS = {**{_fraction_field(c): (0.3, 1.0) for c in FRACTION_CHIPS}, "tpu_half": (0.0, 4096.0),
          "gpu_half": (0.0, 4096.0),
          "elementwise_d_passes": (0.0, 60.0), "overlap_fsdp": (0.0, 1.0), "overlap_tensor": (0.0, 1.0),
          "overlap_data": (0.0, 1.0), "flash_tpu": (0.2, 1.0), "flash_gpu": (0.2, 1.0),
          "dcn_latency_tpu": (0.0, 0.05), "fp8_tpu": (0.3, 1.5), "fp8_gpu": (0.3, 1.5)}
# Where every fit starts: the constants as assumed before any fit (commit 3960e00: matmul MAX 0.9 on TPU, HALF 128,
# 18 passes, overlaps 0.8 / 0 / 0.5, flash 0.6 / 0.5) with the GPUs' measured GEMM rates, so that neither the
# in-sample nor a leave-one-out fit starts from constants that a held-out row helped fit. FP8 matmuls start as
# efficient as bf16 ones (1.0).
PRIOR = Constants(0.9, 0.9, 0.9, 0.9, 0.869, 0.869, 0.803, 128.0, 128.0, 18.0, 0.8, 0.0, 0.5, 0.6, 0.5, 30e-6, 1.0,
                  1.0)
# The constants fitted by default: the others trade off against them (or, TPU7x's fraction, sit under the measured
# matmul ceiling on its rows) and are held at their earlier fit, or (the TPU's HALF) are measured
FREE = tuple(f.name for f in fields(Constants)
             if f.name not in ("elementwise_d_passes", "overlap_tensor", "overlap_data", "tpu_half", "gpu_half",
                               "fraction_tpu7x"))
_NAMES = tuple(f.name for f in fields(Constants))
_FRACTION_AT = tuple(_NAMES.index(_fraction_field(c)) for c in FRACTION_CHIPS)
LO = np.array([BOUNDS[f.name][0] for f in fields(Constants)])
HI = np.array([BOUNDS[f.name][1] for f in fields(Constants)])
# a search (nelder_mead, fitting): yields arrays of points, is sent what they evaluate to, returns its result
Search = Generator[np.ndarray, np.ndarray, object]


class Replay:
    """All rows' recorded steps (perfmodel's Terms, as `estimate` recorded them), priced for any Constants at once by
    the perfmodel's own work.price and work.settle."""

    def __init__(self, rows: list[Row]):
        terms = [r.estimate.time.terms for r in rows]
        self.n = len(rows)
        # the terms that price alike summed (work.Terms.merged): a fit prices them some thousands of times
        self.terms, self.step = work.Terms.concat(terms).merged(
            np.concatenate([np.full(len(t.law), i) for i, t in enumerate(terms)]).astype(int))
        self.chip = [r.estimate.chip for r in rows]
        # chips with no fitted fraction take the rule for chips without rows, after the fitted ones
        self.chips = (*FRACTION_CHIPS, *sorted(set(self.chip) - set(FRACTION_CHIPS)))
        self.chip_index = np.array([self.chips.index(self.chip[i]) for i in self.step], dtype=int)
        # the rule for chips without rows is a weighted mean of the fitted fractions: its weights, read off the rule
        # at each fitted chip alone (and checked at the shipped fractions) price it for many points at once
        without = self.chips[len(FRACTION_CHIPS):]
        self.rule = np.array([[chips.fraction_without_rows(name, dict(zip(FRACTION_CHIPS, unit))) for name in without]
                              for unit in np.eye(len(FRACTION_CHIPS)).tolist()]).reshape(len(FRACTION_CHIPS), -1)
        shipped = Constants.current().fractions()
        if not np.allclose(np.array(list(shipped.values())) @ self.rule,
                           [chips.fraction_without_rows(name, shipped) for name in without], rtol=1e-12):
            raise SystemExit("chips.fraction_without_rows is no longer a weighted mean of the fitted fractions: "
                             "Replay.times prices it as one")
        self.gpu = np.array([steptime_kind(self.chip[i]) == "gpu" for i in self.step])
        # GPU steps whose FP8 matmuls XLA builds (work.fp8_key) keep the measured efficiency; only Transformer
        # Engine's ("gpu") is fitted here
        keys = [work.fp8_key("gpu", fp8_recipe(str(r.request.train.quantization))) for r in rows]
        self.gpu_xla_fp8 = np.array([keys[i] == "gpu xla" for i in self.step])
        self.comm = self.terms.comm
        family = list(self.terms.family)
        unpriced = sorted(set(family) - set(FAMILY_ORDER) - {""})
        if unpriced:
            raise SystemExit(f"collectives of overlap families this script does not know: {', '.join(unpriced)}")
        # each term's overlap: its family's (FAMILY_ORDER), or for the host links their own (the last slot)
        self.family_index = np.array([FAMILY_ORDER.index(f) if f else len(FAMILY_ORDER) for f in family], dtype=int)
        self.fixed_overlap = np.where(self.family_index == len(FAMILY_ORDER), self.terms.overlap, 0.0)
        self.unfitted = work.Overlap()
        self.gpu_dcn_latency = work.SHIPPED.dcn_step_latency["gpu"]
        self.tokens = tokens_per_chip(rows)
        self.published = np.array([r.published_tokens for r in rows])

    def step_times(self, c: Constants) -> np.ndarray:
        return self.times(c.vector())

    def times(self, x: np.ndarray) -> np.ndarray:
        """The step times under the Constants whose vector() is `x` (what a fit evaluates), or under each of a
        batch of them (`x` of shape (points, constants) gives (points, steps))."""
        points = np.atleast_2d(x)
        fitted = points[:, _FRACTION_AT]
        # rounded as chips.py rounds the shipped rule, so that the shipped constants replay estimate exactly
        fraction = np.hstack([fitted, np.round(fitted @ self.rule, 3)])[:, self.chip_index]

        def column(name: str) -> np.ndarray:
            return points[:, _NAMES.index(name), None]

        half = np.where(self.gpu, column("gpu_half"), column("tpu_half"))
        flash = np.where(self.gpu, column("flash_gpu"), column("flash_tpu"))
        latency = np.where(self.gpu, self.gpu_dcn_latency, column("dcn_latency_tpu"))
        fp8 = np.where(self.gpu, np.where(self.gpu_xla_fp8, work.SHIPPED.fp8_efficiency["gpu xla"],
                                          column("fp8_gpu")), column("fp8_tpu"))
        seconds, _ = work.price(self.terms, fraction, half, flash, column("elementwise_d_passes"), latency, fp8)
        unfitted = np.broadcast_to([self.unfitted.sequence, self.unfitted.expert, 0.0], (len(points), 3))
        per_family = np.hstack([column("overlap_fsdp"), column("overlap_tensor"), column("overlap_data"), unfitted])
        overlap = per_family[:, self.family_index] + self.fixed_overlap
        steps, _, _ = work.settle(seconds, self.comm, overlap, self.step, self.n)
        return steps.reshape(np.shape(x)[:-1] + (self.n,))

    def errors(self, x: np.ndarray) -> np.ndarray:
        """Each row's |log(predicted / published)| throughput under the Constants vector(s) `x`, as `times`."""
        return np.abs(np.log(self.tokens / self.times(x) / self.published))


def steptime_kind(chip: str) -> str:
    return chips.CHIPS[chip].kind


# ---------------------------------------------------------------------------------------------------------------
# the fit


# Every fit runs Nelder-Mead again from its last best point until runs gain less than CONVERGED in the loss (mean
# |log(predicted / published)|), at most MAX_RESTARTS runs. A fixed count stopped short: a source or a generation held
# out leaves fewer rows to pin the constants, and the held-out figures moved with the count (leave-one-source-out 5.8%
# at 2 runs, 6.1% at 4, 6.3% at 6 and beyond, 2026-12-02); converged, a held-out figure is the held-out rows' error
# under the other rows' best fit, as it is meant to be. The loss is not smooth (a mean of absolute values): a run can
# gain next to nothing and the one after it escape a corner (MosaicML's rows held out, 2026-12-02: a run gained 4.7e-7
# and the next 3.4e-5), so a fit stops only after PATIENCE runs in a row each gain less than CONVERGED.
CONVERGED = 1e-6
PATIENCE = 3
MAX_RESTARTS = 40


def nelder_mead(x0: np.ndarray, scale: np.ndarray, iters: int = 600, tol: float = 1e-7) -> Search:
    """Minimizes a function from x0 (a simplex of steps `scale`), the textbook reflection/expansion/contraction/
    shrink. A generator: it yields the points it needs valued (an array of them, one per row), is sent their values,
    and returns the best point."""
    pts = np.vstack([x0, x0 + np.diag(scale)])
    vals = yield pts
    for _ in range(iters):
        order = np.argsort(vals, kind="stable")
        pts, vals = pts[order], vals[order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        centroid = pts[:-1].sum(axis=0) / (len(pts) - 1)
        xr = centroid + (centroid - pts[-1])
        [fr] = yield xr[None]
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - pts[-1])
            [fe] = yield xe[None]
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (pts[-1] - centroid)
            [fc] = yield xc[None]
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = pts[0] + 0.5 * (pts - pts[0])
                vals = yield pts
    return pts[int(np.argmin(vals))]


def fitting(mask: np.ndarray, start: Constants, free: tuple[str, ...], max_restarts: int = MAX_RESTARTS) -> Search:
    """Constants minimizing mean |log(predicted / published)| over the rows in `mask`, within BOUNDS, moving only the
    `free` ones; Nelder-Mead from `start`, restarted from its best point until PATIENCE runs in a row each improve the
    loss by less than CONVERGED (or `max_restarts` runs in all). A generator, as nelder_mead is: it yields the
    Constants vectors it needs priced (one per row) and is sent every row's |log(predicted / published)| under each
    (Replay.errors); `fit` and `fit_together` drive it."""
    weight = mask / mask.sum()
    x_all = start.vector()
    # a constant that no row of the fit depends on (the FP8 efficiency of a kind with no FP8 row among them) keeps
    # its start: with nothing to fit it would drift anywhere within its bounds, and price the held-out rows so
    tried = []
    for name in free:
        x, (low, high) = x_all.copy(), BOUNDS[name]
        i = _NAMES.index(name)
        x[i] = low + 0.5 * (high - low) if x[i] != low + 0.5 * (high - low) else low
        tried.append(x)
    errors = yield np.vstack([x_all, *tried])
    idx = np.array([_NAMES.index(n) for n, e in zip(free, errors[1:]) if np.any(e[mask] != errors[0][mask])],
                   dtype=int)
    lo, hi = LO[idx], HI[idx]

    def losses(points: np.ndarray) -> Search:
        clipped = np.minimum(np.maximum(points, lo), hi)
        full = np.repeat(x_all[None], len(points), axis=0)
        full[:, idx] = clipped
        errors = yield full
        return errors @ weight + 10 * np.abs(points - clipped).sum(axis=1)

    def search(x: np.ndarray) -> Search:
        run = nelder_mead(x, 0.1 * (hi - lo))
        points = next(run)
        while True:
            values = yield from losses(points)
            try:
                points = run.send(values)
            except StopIteration as done:
                return done.value

    x = x_all[idx]
    [best] = yield from losses(x[None])
    quiet = 0  # runs in a row that gained less than CONVERGED
    for _ in range(max_restarts):
        x = np.clip((yield from search(x)), lo, hi)
        [now] = yield from losses(x[None])
        quiet = quiet + 1 if best - now < CONVERGED else 0
        best = now
        if quiet >= PATIENCE:
            break
    out = x_all.copy()
    out[idx] = x
    return Constants.from_vector(out)


def fit_together(replay: Replay, searches: list[Search]) -> list:
    """Runs searches (`fitting`) side by side: each round prices every search's pending points in one call of
    Replay.errors, which costs little more for many points than for one. Returns their results, in order."""
    results = [None] * len(searches)
    pending = {}
    for i, s in enumerate(searches):
        pending[i] = next(s)
    while pending:
        order = list(pending)
        errors = replay.errors(np.vstack([pending[i] for i in order]))
        at = 0
        for i in order:
            part, at = errors[at:at + len(pending[i])], at + len(pending[i])
            try:
                pending[i] = searches[i].send(part)
            except StopIteration as done:
                results[i] = done.value
                del pending[i]
    return results


def fit(replay: Replay, mask: np.ndarray, start: Constants, free: tuple[str, ...],
        max_restarts: int = MAX_RESTARTS) -> Constants:
    """The constants `fitting` finds (see there)."""
    [fitted] = fit_together(replay, [fitting(mask, start, free, max_restarts)])
    return fitted


def stand_in(c: Constants, chips_out: set[str], chips_fitted: set[str]) -> Constants:
    """`c` with the fractions of `chips_out` (a held-out generation, fitted on no row) set by the rule the perfmodel
    applies to chips without rows (chips.fraction_without_rows) over `chips_fitted`, the chips with rows in the fit."""
    fractions = c.fractions()
    fitted = {name: fractions[name] for name in chips_fitted - chips_out}
    return replace(c, **{_fraction_field(name): chips.fraction_without_rows(name, fitted) for name in chips_out})


def tokens_per_chip(rows: list[Row]) -> np.ndarray:
    """Each row's tokens a step per chip (a step time turns them into the throughput the rows compare)."""
    return np.array([r.estimate.flops.tokens * r.request.topology.devices_per_chip for r in rows])


def predicted_from_steps(rows: list[Row], steps: np.ndarray) -> np.ndarray:
    return tokens_per_chip(rows) / steps


# ---------------------------------------------------------------------------------------------------------------
# report


def _summary(errors: np.ndarray) -> str:
    a = np.abs(errors)
    return f"median {100 * np.median(a):5.1f}%  worst {100 * a.max():5.1f}%" if a.size else "no rows"


HOLD_OUTS = {"row": "leave-one-out", "source": "leave-one-source-out", "hardware": "generation held out"}


def source_of(row: Row) -> str:
    """A row's source: the publication and its document (MaxText's v4, v5e, v5p and A3 tables are measured apart and
    count as four sources; NVIDIA's Megatron-Bridge summary as one)."""
    return f"{row.data['source']}: {row.data['source_table'].split(',')[0]}"


def held_out_sets(rows: list[Row], mode: str) -> list[np.ndarray]:
    if mode == "row":
        return [np.array([i]) for i in range(len(rows))]
    # a generation is a chip: every row on it, whichever source names its hardware how
    key = source_of if mode == "source" else (lambda r: r.estimate.chip)
    return [np.flatnonzero([key(r) == k for r in rows]) for k in sorted({key(r) for r in rows})]


# What the held-out fits share, set before their worker processes fork (fits_without)
_SHARED: tuple = ()


def _fits_without(sets: list[np.ndarray]) -> list[Constants]:
    replay, rows, start, free = _SHARED
    masks = [np.isin(np.arange(len(rows)), out, invert=True) for out in sets]
    return fit_together(replay, [fitting(mask, start, free) for mask in masks])


def fits_without(replay: Replay, rows: list[Row], start: Constants, free: tuple[str, ...],
                 sets: list[np.ndarray]) -> list[Constants]:
    """For each held-out set, the constants fitted on the other rows: the fits run side by side (fit_together), in
    one process per CPU, each taking every so-many-th set (forked: the fits run numpy alone, so a worker needs
    nothing of its parent's threads; the bench's own process imports no jax)."""
    global _SHARED
    _SHARED = (replay, rows, start, free)
    workers = min(len(sets), os.cpu_count() or 1)
    if workers <= 1:
        return _fits_without(sets)
    shares = [sets[w::workers] for w in range(workers)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        done = pool.map(_fits_without, shares, chunksize=1)
    out = [None] * len(sets)
    for w, fitted in enumerate(done):
        out[w::workers] = fitted
    return out


def held_out_errors(replay: Replay, rows: list[Row], pub: np.ndarray, start: Constants, free: tuple[str, ...],
                    mode: str) -> np.ndarray:
    """Each held-out set predicted by constants fitted, from `start`, on the other rows; a chip left with no rows in
    the fit takes the rule chips.py applies to chips without rows (`stand_in`)."""
    err = np.zeros(len(rows))
    everything = np.ones(len(rows), bool)
    sets = held_out_sets(rows, mode)
    for out, c in zip(sets, fits_without(replay, rows, start, free, sets)):
        mask = everything.copy()
        mask[out] = False
        # the chips whose fraction is fitted (B200's always takes the rule)
        fitted_chips = {rows[i].estimate.chip for i in np.flatnonzero(mask)} & set(FRACTION_CHIPS)
        orphans = {rows[i].estimate.chip for i in out} & set(FRACTION_CHIPS) - fitted_chips
        if orphans:
            c = stand_in(c, orphans, fitted_chips)
        err[out] = predicted_from_steps(rows, replay.step_times(c))[out] / pub[out] - 1
    return err


def row_args(row: Row) -> list[str]:
    """The row's request as `maxperf` arguments: its topology, model, slices and overrides."""
    m = row.mapping
    return ["--topology", m["topology"], "--model", m["maxperf_model"], "--num-slices", m["num_slices"],
            *_overrides(row)]


def row_flags(row: Row) -> tuple[str, list[str], str]:
    """(LIBTPU_INIT_ARGS for the row's compile, its launch flags left out, where they came from): the flags its run
    was launched with (the mapping's xla_flags) less those this libtpu compiles on another chip alone
    (compiled.launch_flags)."""
    chip = spec.topology.get(row.mapping["topology"], int(row.mapping["num_slices"])).chip
    return launch_flags(row.mapping.get("xla_flags", "").split(), chip, "its launch script's")


def row_command(row: Row, command: str, *extra: str) -> list[str]:
    """`maxperf COMMAND` of the row's request, as a process of its own runs it."""
    return [sys.executable, "-m", "maxperf.cli", command, *row_args(row), *extra]


def hlo_steps(rows: list[Row], ids: list[str], timeout: float) -> dict[str, dict]:
    """For each row of `ids`: `maxperf compile` of its request in a process of its own (compiled.compile_and_read),
    and the HLO-derived and analytical step times its estimate.json holds; or why there are none."""
    out: dict[str, dict] = {}
    by_id = {r.id: r for r in rows}
    for rid in ids:
        row = by_id.get(rid)
        if row is None or row.reason:
            out[rid] = {"error": row.reason if row is not None else "no such row"}
            continue
        flags, dropped, origin = row_flags(row)
        print(f"compiling {rid} under {origin} XLA flags ({len(flags.split())})"
              + (f"; left out: {', '.join(dropped)}" if dropped else "") + " ...", file=sys.stderr, flush=True)
        read = compile_and_read(row_args(row), timeout, {"LIBTPU_INIT_ARGS": flags})
        if "error" in read:
            out[rid] = read
            continue
        out[rid] = reading = step_reading(read)
        print(f"  {rid}: from the HLO {reading['hlo_step_time_s']:.4g} s, analytical "
              f"{reading['analytical_step_time_s']:.4g} s ({reading['wall_seconds']:.0f} s)", file=sys.stderr,
              flush=True)
    return out


def compiler_verdicts(rows: list[Row], timeout: float) -> dict[str, dict]:
    """For each row: `maxperf estimate-memory` of its request in a process of its own (it compiles the step and reads
    XLA's memory figures), the compiler's fit verdict and per-device total beside the analytical one; or why there
    is none."""
    import subprocess

    out: dict[str, dict] = {}
    for row in rows:
        print(f"compiling {row.id} for its memory ...", file=sys.stderr, flush=True)
        try:
            done = run_cpu(row_command(row, "estimate-memory", "--json"), timeout,
                           {"LIBTPU_INIT_ARGS": row_flags(row)[0]})
            doc = json.loads(done.stdout)
        except subprocess.TimeoutExpired:
            out[row.id] = {"error": f"compile over {timeout:.0f} s"}
            continue
        except json.JSONDecodeError:
            out[row.id] = {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
            continue
        if doc.get("schema") == "maxperf.error/1" or doc.get("compiler") is None:
            out[row.id] = {"error": doc.get("error", "no compiler figures")}
            continue
        out[row.id] = {"compiler_fits": bool(doc["compiler"]["fits"]),
                       "compiler_bytes": float(doc["compiler"]["per_device_total_bytes"]),
                       "analytical_bytes": float(row.estimate.memory_per_device_bytes),
                       "hbm_bytes": float(doc["compiler"]["hbm_bytes"])}
    return out


def print_hlo(ok: list[Row], pub: np.ndarray, err0: np.ndarray, hlo: dict[str, dict], results: dict) -> None:
    """The HLO-derived column: per compiled row, and the summary against the targets."""
    print("\nstep time read from the compiled program (maxperf.aot.hlo_time), rows compiled:")
    print(f"  {'row':<44} {'analytical':>10} {'HLO':>8} {'HLO / analytical':>17}  bound by")
    errors, ratios, fitting, groups = [], [], [], []
    for i, r in enumerate(ok):
        h = hlo.get(r.id)
        if h is None or "hlo_step_time_s" not in h:
            continue
        tokens = r.estimate.flops.tokens * r.request.topology.devices_per_chip / h["hlo_step_time_s"]
        err = tokens / pub[i] - 1
        ratio = h["hlo_step_time_s"] / h["analytical_step_time_s"]
        errors.append(err)
        ratios.append(ratio)
        fitting.append(h.get("compiled_fits", True))
        groups.append(r.group)
        results[r.id]["hlo"] = float(err)
        results[r.id]["hlo_over_analytical"] = float(ratio)
        results[r.id]["compiled_fits"] = bool(fitting[-1])
        print(f"  {r.id:<44} {100 * err0[i]:>+9.1f}% {100 * err:>+7.1f}% {ratio:>17.3f}  {h['hlo_bottleneck']}"
              + ("" if fitting[-1] else "  (the compiled step does not fit)"))
    failed = {rid: h["error"] for rid, h in hlo.items() if "error" in h}
    for rid, why in failed.items():
        print(f"  {rid:<44} not compiled: {why}")
    if errors:
        a, close = np.abs(np.array(errors)), np.abs(np.array(ratios) - 1) <= 0.10
        print(f"  HLO-derived, {len(errors)} rows: median {100 * np.median(a):.1f}%, worst {100 * a.max():.1f}% "
              f"(targets 8% / 20%); within 10% of the analytical on {int(close.sum())} of {len(errors)} "
              f"({100 * close.mean():.0f}%, target 80%)")
        if len(set(groups)) > 1:
            for group in sorted(set(groups)):
                sel = np.array([g == group for g in groups])
                n = int(sel.sum())
                print(f"    {group:<20} {n:>3} row{'s' if n > 1 else ' '}: median {100 * np.median(a[sel]):5.1f}%, "
                      f"worst {100 * a[sel].max():5.1f}%; within 10% of the analytical on {int(close[sel].sum())}")
        fit = np.array(fitting, dtype=bool)
        if 0 < fit.sum() < len(fit):
            print(f"  on the {int(fit.sum())} rows whose compiled step fits its device memory (the others' programs "
                  "are not the ones that ran: XLA rematerializes to shrink them): "
                  f"median {100 * np.median(a[fit]):.1f}%, worst {100 * a[fit].max():.1f}%; "
                  f"within 10% of the analytical on {int(close[fit].sum())}")
        walls = [h["wall_seconds"] for h in hlo.values() if "wall_seconds" in h]
        costs = [h["costing_seconds"] for h in hlo.values() if "costing_seconds" in h]
        print(f"  compile processes {sum(walls):.0f} s in all; reading and costing each HLO at most {max(costs):.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fit", action="store_true", help="only the unfitted comparison")
    ap.add_argument("--only", default="", help="rows whose id contains this text (or any of several, comma-separated)")
    ap.add_argument("--json", type=Path, help="also write the per-row results here")
    ap.add_argument("--free", default=",".join(FREE),
                    help="comma-separated constants to fit (the others stay as the perfmodel ships them): "
                         + ", ".join(f.name for f in fields(Constants)))
    ap.add_argument("--hold-out", default="row,source",
                    help="comma-separated: row (leave one row out at a time), source (one source at a time), "
                         "hardware (one chip generation at a time); a chip left without rows takes the rule chips.py "
                         "applies to chips without rows")
    ap.add_argument("--hlo", action="store_true",
                    help="also compile every expressible row (or those of --hlo-rows) and print the step time read "
                         "from the compiled program beside the analytical one (minutes per row; the compile cache "
                         "keeps them)")
    ap.add_argument("--hlo-rows", default="all",
                    help="comma-separated row ids for --hlo; all (every expressible row) or quick (QUICK_HLO_ROWS)")
    ap.add_argument("--hlo-timeout", type=seconds, default=HLO_TIMEOUT_S, help="seconds one row's compile may take")
    ap.add_argument("--mapping", type=Path, default=MAPPING,
                    help="how the rows are written for maxperf (default bench/published/maxperf_mapping.csv): another "
                         "file of the same columns tries other writings of them")
    ap.add_argument("--compile-misfits", action="store_true",
                    help="compile the rows that ran as published but that the analytical memory says do not fit, "
                         "and print the compiler's verdict beside it (seconds to minutes per row)")
    args = ap.parse_args()
    args.json = outfile.checked(ap, args.json)
    free = tuple(n for n in args.free.split(",") if n)
    unknown_names = sorted(set(free) - {f.name for f in fields(Constants)})
    if unknown_names:
        ap.error(f"unknown constants: {', '.join(unknown_names)}")
    modes = tuple(m for m in args.hold_out.split(",") if m)
    if not modes or set(modes) - set(HOLD_OUTS):
        ap.error(f"--hold-out takes a comma-separated list of {', '.join(HOLD_OUTS)}")
    t0 = time.time()
    if not args.mapping.is_file():
        ap.error(f"--mapping {args.mapping}: no such file")
    rows = load_rows(args.only, args.mapping)
    # --hlo-rows: all and quick are the rows of those that --only keeps; named rows must be among them
    hlo_ids = [i for i in args.hlo_rows.split(",") if i] if args.hlo_rows not in ("all", "quick") else []
    for rid in hlo_ids if args.hlo else ():
        if rid not in {r.id for r in rows}:
            ap.error(str(unknown("row for --hlo-rows (or all, quick)", rid, [r.id for r in rows])))
    for row in rows:
        resolve(row)
    ok = [r for r in rows if not r.reason]
    if not ok:
        print("no expressible rows")
        return 1
    pub = np.array([r.published_tokens for r in ok])
    pred0 = np.array([predicted_tokens(r.estimate) for r in ok])
    err0 = pred0 / pub - 1
    results = {r.id: {"group": r.group, "source": source_of(r), "published_tokens_per_s_per_chip": float(p),
                      "unfitted": float(e), "fits": bool(r.estimate.fits)} for r, p, e in zip(ok, pub, err0)}

    err_in, held = None, {}
    if not args.no_fit:
        base = Constants.current()
        replay = Replay(ok)
        replay_err = np.max(np.abs(replay.step_times(base) / np.array([r.estimate.step_time_s for r in ok]) - 1))
        if replay_err > 1e-6:
            raise SystemExit(f"the recorded steps differ from perfmodel.estimate by up to {replay_err:.1e}: the "
                             "rows' recorded terms no longer price as perfmodel.estimate does")
        everything = np.ones(len(ok), bool)
        # every fit starts from PRIOR (the constants held fixed at their shipped values), so that no held-out row
        # steers the start
        start = replace(PRIOR, **{f.name: getattr(base, f.name) for f in fields(Constants) if f.name not in free})
        fitted = fit(replay, everything, start, free)
        err_in = predicted_from_steps(ok, replay.step_times(fitted)) / pub - 1
        for mode in modes:
            held[mode] = held_out_errors(replay, ok, pub, start, free, mode)
        # the recorded form against the model itself, at the fitted constants
        real = np.array([run_estimate(r, fitted.overlap(), fitted.perfmodel()).step_time_s for r in ok])
        replay_err_fitted = np.max(np.abs(replay.step_times(fitted) / real - 1))
        for i, r in enumerate(ok):
            results[r.id]["in_sample"] = float(err_in[i])
            results[r.id].update({HOLD_OUTS[m].replace("-", "_").replace(" ", "_"): float(e[i])
                                  for m, e in held.items()})

    short = {"row": "LOO", "source": "LOSO", "hardware": "held"}
    print(f"{'row':<44} {'chips':>5} {'pub TF':>7} {'pred TF':>7} {'pred MFU':>8} {'fits':>4} {'unfitted':>8}"
          + ("" if err_in is None else f" {'in-sample':>9}" + "".join(f" {short[m]:>7}" for m in held)))
    for i, r in enumerate(ok):
        est = r.estimate
        stated = r.data["published_tflops_per_chip"] if r.mapping["compare_on"] == "tflops" else ""
        pub_tf = stated or f"~{r.published_tokens * r.flops_per_token / 1e12:.0f}"
        line = (f"{r.id:<44} {est.chips:>5} {pub_tf:>7} {est.tflops_per_chip:>7.0f} {100 * est.mfu:>7.1f}% "
                f"{'yes' if est.fits else 'NO':>4} {100 * err0[i]:>+7.1f}%")
        if err_in is not None:
            line += f" {100 * err_in[i]:>+8.1f}%" + "".join(f" {100 * e[i]:>+6.1f}%" for e in held.values())
        print(line)

    print()
    groups = sorted({r.group for r in ok})
    print(f"{'rows':<22} {'n':>3}  {'unfitted':<28}" + ("" if err_in is None else f" {'in-sample':<28}"
                                                        + "".join(f" {HOLD_OUTS[m]:<28}" for m in held)))
    fp8_rows = [("FP8 (all chips)", np.array([r.fp8 for r in ok]))] if any(r.fp8 for r in ok) else []
    piped = [("pipeline parallel", np.array([r.pipelined for r in ok]))] if any(r.pipelined for r in ok) else []
    for name, sel in ([("all", np.ones(len(ok), bool))] + [(g, np.array([r.group == g for r in ok])) for g in groups]
                      + fp8_rows + piped):
        line = f"{name:<22} {int(sel.sum()):>3}  {_summary(err0[sel]):<28}"
        if err_in is not None:
            line += f" {_summary(err_in[sel]):<28}" + "".join(f" {_summary(e[sel]):<28}" for e in held.values())
        print(line)
    if "source" in held:
        print("\nleave-one-source-out, per source:")
        for src in sorted({source_of(r) for r in ok}):
            sel = np.array([source_of(r) == src for r in ok])
            print(f"  {src[:70]:<70} {int(sel.sum()):>3}  {_summary(held['source'][sel])}")

    if err_in is not None:
        print()
        print(f"{'constant':<40} {'shipped':>9} {'fitted':>9}")
        for f in fields(Constants):
            mark = "" if f.name in free else "  (held)"
            print(f"{NAMES[f.name]:<40} {getattr(base, f.name):>9.4g} {getattr(fitted, f.name):>9.4g}{mark}")
        print(f"replay of the recorded steps against perfmodel.estimate: max |relative difference| "
              f"{replay_err:.1e} at the shipped constants, {replay_err_fitted:.1e} at the fitted ones")

    both = [r for r in ok if r.data["published_tflops_per_chip"] and r.data["published_tokens_per_s_per_chip"]]
    if both:
        print("\nFLOPs per token, the source's (its TFLOP/s / its tokens/s) over maxperf's model FLOPs per token:")
        for r in both:
            theirs = (float(r.data["published_tflops_per_chip"]) * 1e12
                      / float(r.data["published_tokens_per_s_per_chip"]))
            print(f"  {r.id:<44} {theirs / r.flops_per_token:.4f}")
    unfit = [r.id for r in ok if not r.estimate.fits]
    if unfit:
        print(f"\n{len(unfit)} of {len(ok)} rows ran as published but maxperf's memory model says they do not fit:")
        print(textwrap.fill(", ".join(unfit), 116, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
        if args.compile_misfits:
            verdicts = compiler_verdicts([r for r in ok if not r.estimate.fits], args.hlo_timeout)
            print("  the compiler's verdict on the same step (XLA's memory figures, GiB per device):")
            for rid, v in verdicts.items():
                if "error" in v:
                    print(f"  {rid:<44} no verdict: {v['error']}")
                    continue
                print(f"  {rid:<44} analytical {v['analytical_bytes'] / 2**30:7.2f}  compiler "
                      f"{v['compiler_bytes'] / 2**30:7.2f}  of {v['hbm_bytes'] / 2**30:6.2f}: "
                      f"{'fits' if v['compiler_fits'] else 'does not fit'}")
                results[rid]["compiler_fits"] = v["compiler_fits"]
            agree = sum(1 for v in verdicts.values() if v.get("compiler_fits") is False)
            print(f"  the compiler agrees on {agree} of {len(verdicts)}")

    if args.hlo:
        if args.hlo_rows in ("all", "quick"):
            hlo_ids = [r.id for r in ok if args.hlo_rows == "all" or r.id in QUICK_HLO_ROWS]
        print_hlo(ok, pub, err0, hlo_steps(rows, hlo_ids, args.hlo_timeout), results)

    skipped = [r for r in rows if r.reason]
    if skipped:
        print(f"\nnot expressed ({len(skipped)} rows):")
        for r in skipped:
            print(f"  {r.id:<48} {r.reason}")
    print(f"\n{len(ok)} rows compared, {len(skipped)} not expressed, {time.time() - t0:.1f} s")
    if args.json:
        out = {"rows": results, "not_expressed": {r.id: r.reason for r in skipped}}
        if err_in is not None:
            out["shipped"] = {NAMES[f.name]: getattr(base, f.name) for f in fields(Constants)}
            out["fitted"] = {NAMES[f.name]: getattr(fitted, f.name) for f in fields(Constants)}
            out["summary"] = {HOLD_OUTS[m]: {"median": float(np.median(np.abs(e))), "worst": float(np.max(np.abs(e)))}
                              for m, e in held.items()}
            fp8 = np.array([r.fp8 for r in ok], dtype=bool)
            if fp8.any():  # the FP8 rows alone: what an FP8 step's estimate quotes (perfmodel.work.HELD_OUT_ERROR)
                out["fp8_summary"] = {HOLD_OUTS[m]: {"median": float(np.median(np.abs(e[fp8]))),
                                                     "worst": float(np.max(np.abs(e[fp8]))), "rows": int(fp8.sum())}
                                      for m, e in held.items()}
        outfile.write(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
