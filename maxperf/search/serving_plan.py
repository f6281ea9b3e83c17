"""`maxperf plan --step decode`: the serving layout with the most tokens/s per chip under latency bounds.

The search is analytical (perfmodel.serving): every mesh of the topology's chips over data, tensor and, for a mixture
of experts, expert, inside a fast-interconnect domain (a TPU slice, a GPU host's or rack's NVLink domain), and over
data and expert across the domains of a multi-host GPU topology (tensor parallelism's two all-reduces per layer and
token stay inside a domain, as serving stacks run it); every batch that the mesh's batch shards divide, two per
octave up to the largest that fits; the weights in the compute dtype or, where the user allows it
(`quantization=auto`), int8 or FP8 where the chip has such matmul units, and the cache in the compute dtype or int8
(unless `quantize_kvcache` is pinned). Each candidate is priced by its time to first token (the prefill of one
prompt), its time per output token at the middle of generation and its tokens/s per chip; those that fit and meet
`--max-time-per-token` and `--max-ttft` are ranked by tokens/s per chip. The Pareto front of time per token against
tokens/s per chip is kept for the report. No layout meeting the bounds is exit 3, naming the closest and what it
would need.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from maxperf.perfmodel import serving
from maxperf.perfmodel.estimate import device_for
from maxperf.search.candidates import divisors, mesh_shown
from maxperf.spec import overrides as overrides_mod
from maxperf.spec import presets
from maxperf.spec import topology as topologies
from maxperf.spec.errors import DoesNotFit, MaxperfError
from maxperf.spec.hardware import CHIPS
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import AttentionType
from maxperf.spec.train import Quantization

SCHEMA = "maxperf.serving-plan/1"
SEARCHED = ("ici_tensor_parallelism", "ici_data_parallelism", "ici_expert_parallelism", "per_device_batch_size")


class NoLayout(DoesNotFit):
    """No layout meets the latency bounds (exit 3)."""


@dataclass(frozen=True)
class Layout:
    axes: dict[str, int]  # each axis's size over the whole topology
    dcn: dict[str, int]  # of it, across fast-interconnect domains ({} on one domain)
    batch: int  # sequences, all devices
    quantization: str
    kv_int8: bool
    fits: bool
    memory_bytes: float
    ttft_s: float
    tpot_s: float
    tokens_per_s_per_chip: float
    bottleneck: str

    def words(self, devices: int) -> list[str]:
        words = [f"ici_{a}_parallelism={n // self.dcn.get(a, 1)}" for a, n in self.axes.items()
                 if n // self.dcn.get(a, 1) > 1]
        words += [f"dcn_{a}_parallelism={n}" for a, n in self.dcn.items() if n > 1]
        words.append(f"per_device_batch_size={self.batch / devices:g}")
        if self.quantization != "none":
            words.append(f"quantization={self.quantization}")
        if self.kv_int8:
            words.append("quantize_kvcache=true")
        return words

    def as_dict(self) -> dict[str, Any]:
        ici = {a: n // self.dcn.get(a, 1) for a, n in self.axes.items()}
        shown = mesh_shown(ici, self.dcn)
        return {**dataclasses.asdict(self), "mesh": "one device" if shown == "1" else shown}


@dataclass
class ServingPlan:
    model: str
    topology: str
    devices: int
    bounds: dict[str, float | None]
    pinned: tuple[str, ...]
    candidates: int = 0
    fitting: int = 0
    meeting: list[Layout] = field(default_factory=list)  # ranked, best first
    pareto: list[Layout] = field(default_factory=list)  # by time per token
    closest: Layout | None = None
    search_seconds: float = 0.0
    pinned_batch: int | None = None  # the sequences per_device_batch_size pinned
    most_that_fit: int = 0  # the most sequences any searched layout holds
    # the layouts compiled to verify the winner, in rank order: their compile lines, the compiler's per-device total
    # and whether it fits (`maxperf plan --step decode --verify N`); the winner is the first that fits
    verified: list[dict[str, Any]] = field(default_factory=list)

    # the layouts the analytical memory fits whose compiles did not (`--verify`): out of `meeting` and `pareto`
    rejected: list[Layout] = field(default_factory=list)

    @property
    def winner(self) -> Layout | None:
        if self.verified and not any(v["fits"] for v in self.verified):
            return None
        return self.meeting[0] if self.meeting else None

    def reject(self, layout: Layout) -> None:
        """A layout compiled by --verify to more than the device holds: no longer ranked, nor on the Pareto front."""
        self.rejected.append(layout)
        self.meeting = [x for x in self.meeting if x != layout]
        self.pareto = [x for x in self.pareto if x != layout]

    def compile_line(self, layout: Layout) -> str:
        return ("maxperf compile --step decode --model " + self.model + " --topology " + self.topology + " "
                + " ".join([*self.pinned, *layout.words(self.devices)]))

    def as_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "model": self.model, "topology": self.topology, "devices": self.devices,
                "bounds": self.bounds, "pinned": list(self.pinned), "candidates": self.candidates,
                "fitting": self.fitting, "meeting": len(self.meeting), "search_seconds": self.search_seconds,
                "winner": None if self.winner is None else {**self.winner.as_dict(),
                                                            "compile": self.compile_line(self.winner)},
                "top": [x.as_dict() for x in self.meeting[:20]], "pareto": [x.as_dict() for x in self.pareto],
                "closest": None if self.closest is None else self.closest.as_dict(), "verified": self.verified,
                "rejected_by_compiler": [x.as_dict() for x in self.rejected]}


def _check_pins(train, par) -> None:
    """The pins the search cannot honour, one line each (exit 2): weights other than int8, fp8 or bf16, a prompt that
    leaves no cache positions to decode into, and mesh axes the search does not lay out."""
    if train.quantization not in (Quantization.NONE, Quantization.INT8, Quantization.FP8, Quantization.AUTO):
        raise MaxperfError(f"quantization={train.quantization}: the serving steps take int8 or fp8 weights "
                           "(quantization=int8, fp8, none, or auto to search them)")
    P, S = train.max_prefill_predict_length, train.seq_len
    if P >= S:
        raise MaxperfError(f"max_prefill_predict_length={P} leaves no cache position to decode into "
                           f"(max_target_length={S}): set max_target_length > {P}")
    default = type(par)()
    other = [f"{side}_{a}" for side in ("ici", "dcn") for a in ("stage", "fsdp", "fsdp_transpose", "sequence")
             if getattr(par, f"{side}_{a}") != getattr(default, f"{side}_{a}")
             and getattr(par, f"{side}_{a}") not in (1, -1)]
    if other:
        raise MaxperfError(f"plan --step decode lays a serving mesh out over data, tensor and expert; it does not "
                           f"search {', '.join(other)}: drop them (`maxperf estimate --step decode` prices such a "
                           "mesh)")


def _meshes(per_domain: int, domains: int, model, pins: dict[str, int], dcn_pins: dict[str, int],
            tpu: bool = False) -> list[tuple[dict[str, int], dict[str, int]]]:
    """(each axis's whole size, its size across domains): data x tensor x expert inside a domain of `per_domain`
    devices, data x expert across the `domains`, tensor dividing the query heads and expert the experts (an axis
    that divides nothing would replicate what it was meant to split); on a TPU (`tpu`) tensor at most the KV
    heads."""
    out = []
    for de in (divisors(domains) if model.is_moe else [1]):
        dcn = {"data": domains // de, "tensor": 1, "expert": de}
        if any(dcn[a] != n for a, n in dcn_pins.items()):
            continue
        for t in divisors(per_domain):
            past_kv = t > model.num_kv_heads and model.attention_type is not AttentionType.MLA
            if model.num_heads % t or (tpu and past_kv):
                continue  # on a TPU tensor past the KV heads compiles to a second copy of the cache (serving_warnings)
            for e in (divisors(per_domain // t) if model.is_moe else [1]):
                if model.is_moe and model.num_experts % (e * de):
                    continue
                ici = {"data": per_domain // (t * e), "tensor": t, "expert": e}
                if all(ici[a] == n for a, n in pins.items()):
                    out.append(({a: ici[a] * dcn[a] for a in ici}, {a: n for a, n in dcn.items() if domains > 1}))
    return out


def _batches(shards: int, largest: int) -> list[int]:
    """Batches that `shards` divides, two per octave (n and 1.5 n), up to `largest`."""
    out, n = set(), 1
    while n * shards <= largest:
        out.add(n * shards)
        if (3 * n) % 2 == 0 and 3 * n // 2 * shards <= largest:
            out.add(3 * n // 2 * shards)
        n *= 2
    return sorted(out)


def _precisions(quantization: Quantization, chip_name: str) -> list[str]:
    if quantization is not Quantization.AUTO:
        return [quantization.value]
    chip = CHIPS[chip_name]
    return ["none"] + (["int8"] if chip.peak_int8_ops else []) + (["fp8"] if chip.peak_fp8_flops else [])


def search(model_name: str, topology_name: str, words: tuple[str, ...] = (), *, max_tpot_s: float | None = None,
           max_ttft_s: float | None = None, largest_batch: int | None = None) -> ServingPlan:
    """The serving plan (module doc). `words`: key=value pins (the mesh's ici_* sizes, quantization=auto|none|int8|fp8,
    quantize_kvcache, max_prefill_predict_length, max_target_length, ...); the mesh axes and the batch are searched
    where not pinned; `largest_batch`: the most sequences tried (default 1,024 a device; memory bounds it first)."""
    start = time.perf_counter()
    for bound, name in ((max_tpot_s, "--max-time-per-token"), (max_ttft_s, "--max-ttft")):
        if bound is not None and not (bound > 0 and math.isfinite(bound)):
            raise MaxperfError(f"{name} must be a finite number of ms > 0, got {bound * 1e3:g}")
    model = presets.get(model_name)
    topo = topologies.get(topology_name)
    if topo.num_slices > 1 or topo.platform == "cpu":
        raise MaxperfError(f"plan --step decode searches one slice or node group of TPUs or GPUs, got {topo.name}")
    configs = overrides_mod.apply(model, list(words))
    model, train, par = configs.model, configs.train, configs.parallelism
    _check_pins(train, par)
    # an axis the words set is pinned, at 1 too (1 is also the default, so the value alone cannot tell); -1 fills
    given = {overrides_mod.ALIASES.get(k, k) for k in (w.partition("=")[0] for w in words)}
    pins = {a: n for a in ("data", "tensor", "expert")
            if (n := getattr(par, f"ici_{a}")) != -1 and (n != 1 or f"ici_{a}" in given)}
    dcn_pins = {a: n for a in ("data", "tensor", "expert") if (n := getattr(par, f"dcn_{a}")) not in (1, -1)}
    if dcn_pins.get("tensor", 1) > 1:
        raise MaxperfError("plan --step decode keeps tensor parallelism inside a fast-interconnect domain: drop "
                           f"dcn_tensor_parallelism={dcn_pins['tensor']} (search data and expert across domains)")
    dcn_pins.pop("tensor", None)
    pinned_batch = any(w.startswith(("per_device_batch_size=",)) for w in words)
    kv_choices = ([False, True] if train.quantization is Quantization.AUTO
                  and not any(w.startswith("quantize_kvcache=") for w in words) else [train.quantize_kvcache])
    devices = topo.num_devices
    largest_batch = largest_batch or 1024 * devices
    chip = device_for(topo)
    bounds = {"max_time_per_token_s": max_tpot_s, "max_ttft_s": max_ttft_s}
    plan = ServingPlan(model.name, topo.name, devices, bounds,
                       tuple(w for w in words if not w.startswith(("ici_", "per_device_batch_size=", "quantization=",
                                                                   "quantize_kvcache="))))
    layouts: list[Layout] = []
    meshes = _meshes(topo.devices_per_ici_domain, topo.ici_domains, model, pins, dcn_pins, topo.platform == "tpu")
    if not meshes:
        given = ", ".join(f"ici_{a}_parallelism={n}" for a, n in pins.items())
        given += "".join(f", dcn_{a}_parallelism={n}" for a, n in dcn_pins.items())
        raise MaxperfError(f"no mesh of {topo.name} takes {given.lstrip(', ')}: a serving mesh is data x tensor x "
                           f"expert over the {topo.devices_per_ici_domain} devices of a "
                           f"{'host' if topo.platform == 'gpu' else 'slice'}, tensor dividing the "
                           f"{model.num_heads} query heads"
                           + (f" and expert the {model.num_experts} experts" if model.is_moe else "")
                           + " (tensor can be " + ", ".join(str(t) for t in divisors(topo.devices_per_ici_domain)
                                                            if model.num_heads % t == 0) + ")")
    if pinned_batch and all(train.micro_batch(devices) % (axes["data"] * axes["expert"]) for axes, _ in meshes):
        B = train.micro_batch(devices)
        raise MaxperfError(f"a batch of {B} sequences (per_device_batch_size={train.per_device_batch_size:g} x "
                           f"{devices} devices) splits over no searched mesh's batch shards (data x expert): pin a "
                           "batch they divide, or leave it to the search")
    if pinned_batch:
        plan.pinned_batch = train.micro_batch(devices)
    for axes, dcn in meshes:
        mesh = Mesh.of(axes, dcn or None).check(topo)
        shards = axes["data"] * axes["expert"]
        for precision, kv_int8 in itertools.product(_precisions(train.quantization, topo.chip), kv_choices):
            t = dataclasses.replace(train, quantization=Quantization(precision), quantize_kvcache=kv_int8)
            top = serving.max_batch_per_device(model, t, mesh, chip.hbm_bytes, platform=chip.kind) * devices
            ceiling = min(largest_batch, int(top)) if math.isfinite(top) else largest_batch
            plan.most_that_fit = max(plan.most_that_fit, ceiling - ceiling % shards)
            batches = ([train.micro_batch(devices)] if pinned_batch else _batches(shards, max(ceiling, shards)))
            for B in batches:
                if B % shards:
                    continue
                t_b = dataclasses.replace(t, per_device_batch_size=B / devices)
                e = serving.estimate(model, t_b, mesh, chip, topo, largest_batch=False)
                layouts.append(Layout(axes, dcn, B, precision, kv_int8, e.memory.fits, e.memory.total_bytes, e.ttft_s,
                                      e.time_per_output_token_s, e.tokens_per_s_per_chip, e.decode.bottleneck))
    plan.candidates = len(layouts)
    fitting = [x for x in layouts if x.fits]
    plan.fitting = len(fitting)
    meets = [x for x in fitting if (max_tpot_s is None or x.tpot_s <= max_tpot_s)
             and (max_ttft_s is None or x.ttft_s <= max_ttft_s)]
    plan.meeting = sorted(meets, key=lambda x: (-x.tokens_per_s_per_chip, x.tpot_s))
    front, best = [], -1.0
    for x in sorted(fitting, key=lambda x: (x.tpot_s, -x.tokens_per_s_per_chip)):
        if x.tokens_per_s_per_chip > best:
            front.append(x)
            best = x.tokens_per_s_per_chip
    plan.pareto = front
    if not plan.meeting and fitting:
        def shortfall(x: Layout) -> float:
            return max((x.tpot_s / max_tpot_s) if max_tpot_s else 0.0, (x.ttft_s / max_ttft_s) if max_ttft_s else 0.0)
        plan.closest = min(fitting, key=shortfall)
    plan.search_seconds = time.perf_counter() - start
    return plan


def _rounded_up(ms: float) -> str:
    """A bound in ms, three significant digits rounded up, so that the bound said is one the layout meets."""
    digits = 2 - math.floor(math.log10(ms)) if ms > 0 else 0
    return f"{math.ceil(ms * 10 ** digits) / 10 ** digits:g}"


def miss_line(plan: ServingPlan) -> str:
    """Why no layout is given, and what the closest would need."""
    if plan.closest is None and plan.pinned_batch and plan.most_that_fit:
        return (f"no layout of {plan.model} fits the pinned {plan.pinned_batch} sequences on {plan.topology} "
                f"({plan.candidates} tried); the most a searched layout holds is {plan.most_that_fit} "
                f"(per_device_batch_size={plan.most_that_fit / plan.devices:g}): pin fewer, or leave the batch to "
                "the search")
    if plan.closest is None:
        return (f"no layout of {plan.model} fits on {plan.topology} ({plan.candidates} tried): more or larger "
                "chips, or int8 / fp8 weights (quantization=auto)")
    c = plan.closest
    needs = []
    if plan.bounds["max_time_per_token_s"] and c.tpot_s > plan.bounds["max_time_per_token_s"]:
        needs.append(f"--max-time-per-token {_rounded_up(c.tpot_s * 1e3)}")
    if plan.bounds["max_ttft_s"] and c.ttft_s > plan.bounds["max_ttft_s"]:
        needs.append(f"--max-ttft {_rounded_up(c.ttft_s * 1e3)}")
    weights = "bf16" if c.quantization == "none" else c.quantization
    return (f"no layout meets the bounds ({plan.fitting} fit of {plan.candidates}); closest: "
            f"{c.as_dict()['mesh']}, {c.batch} sequence{'s' * (c.batch != 1)}, {weights} weights"
            + (", int8 cache" if c.kv_int8 else "") + ": "
            f"{c.tpot_s * 1e3:.3g} ms per token, TTFT {c.ttft_s * 1e3:.3g} ms; it would need "
            + " and ".join(needs) + ", or faster or more chips")
