"""What `maxperf plan` searches: every candidate configuration of a request, each one divisible, before anything is
estimated.

A candidate is one mesh (ICI and DCN sizes of data, fsdp, fsdp_transpose, sequence, tensor, expert), one remat
policy, one attention kernel, a per-device batch B and gradient accumulation A, and where `quantization=auto` lets the
search choose, a precision: bf16 or the chip's FP8 recipe (spec.fp8.PREFERRED). Only meshes that divide what they must
are enumerated: expert divides E (a dense model's expert axis is 1), tensor divides H and K, sequence divides L, each
weight's and activation's sharded dimensions divide by their axes (a dimension the mesh does not divide would be
replicated: `maxperf.spec.request` warns of it), and the batch axes divide a microbatch's rows. The axes are sized one
at a time, and a size is kept only where the mesh so far (the axes not yet sized at 1) divides all of that: a
dimension that a product of axis sizes does not divide, no multiple of that product divides, so a partial mesh that
fails has no completion that passes (tests/test_plan_search.py checks the enumeration against every factorization
filtered afterwards). A batch (B, A) is paired with a mesh only where the mesh's batch axes divide its rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from maxperf.spec import fp8, presets
from maxperf.spec import overrides as overrides_mod
from maxperf.spec import pipeline as pipeline_spec
from maxperf.spec import request as requests
from maxperf.spec.errors import MaxperfError
from maxperf.spec.hardware import CHIPS
from maxperf.spec.logical_axes import MESH_AXES, undivided_axes
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.params import param_arrays
from maxperf.spec.remat import CHECKPOINT_NAMES, REMAT_SAVED, RematPolicy, pipelined
from maxperf.spec.topology import Topology
from maxperf.spec.train import AttentionKernel, Quantization, TrainConfig

# The remat policies searched: every named policy of MaxText's (custom needs its per-tensor keys: pin it to use it).
REMAT_POLICIES = tuple(p.value for p in RematPolicy if p is not RematPolicy.CUSTOM)
# auto is flash on TPU and GPU (and the blockwise flash on CPU): the two distinct kernels.
KERNELS = (AttentionKernel.FLASH.value, AttentionKernel.DOT_PRODUCT.value)


def servable_kernels(model, train, platform: str) -> list[str]:
    """KERNELS less those that cannot serve the model on the platform (GPU flash and sliding windows: gemma 2 and
    3, mistral, gpt-oss on a GPU search the dot product only), which a candidate would be refused for."""
    from maxperf.spec import attention_rule

    out = []
    for kernel in KERNELS:
        try:
            attention_rule.for_config(model, replace(train, attention=AttentionKernel(kernel)), platform)
        except MaxperfError:
            continue
        out.append(kernel)
    return out or [AttentionKernel.DOT_PRODUCT.value]
# Without --global-batch or --per-device-batch: these B (fractions where B x devices is whole), no accumulation.
FREE_BATCHES = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
# What the search decides; a pin (key=value) fixes it. Names after MaxText's aliases are resolved.
SEARCHED_KEYS = {*(f"ici_{a}" for a in MESH_AXES), *(f"dcn_{a}" for a in MESH_AXES), "remat_policy", "attention",
                 "per_device_batch_size", "grad_accum_steps", "quantization"}
DCN_SEARCHED = ("data", "fsdp")  # the axes searched across slices (others only where pinned)
# The policies that keep their tensors in host memory, and what each policy keeps in device memory (`none`: all)
OFFLOADED = frozenset(p for p in REMAT_POLICIES if p != "none" and REMAT_SAVED[RematPolicy(p)][1])
SAVED = {p: frozenset(CHECKPOINT_NAMES if p == "none" else REMAT_SAVED[RematPolicy(p)][0]) for p in REMAT_POLICIES}


def number(x: float) -> str:
    """B as a key=value word: 2, not 2.0; 0.125 as it is."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(eq=False, slots=True)  # compared by identity: thousands are sorted and looked up
class Candidate:
    ici: dict[str, int]
    dcn: dict[str, int]
    remat_policy: str
    attention: str
    per_device_batch_size: float  # B: one microbatch per device (MaxText's meaning)
    grad_accum_steps: int  # A: microbatches per step
    quantization: str = "none"  # the decoder layers' matmuls: "none" (the compute dtype) or an FP8 recipe
    pipeline_microbatches: int = 0  # a pipelined mesh's num_pipeline_microbatches (0: no pipeline)
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    memory_bytes: float = 0.0  # perfmodel's, per device
    bottleneck: str = ""
    status: str = ""  # "chosen", "slower", "does not fit", "compile failed"
    reason: str = ""
    # set where the search needs no step time: a larger microbatch of the same configuration fits, or a policy
    # keeping more does (why)
    skipped: str = ""
    # set where the search needs no memory figure: a policy keeping less does not fit at the same mesh and batch
    unfit: str = ""
    compiler_memory_bytes: float | None = None
    verified: bool | None = None  # None: not compiled; True: the compiler says it fits; False: it does not
    compile_seconds: float | None = None
    artifact: str | None = None
    compile_error: str = ""  # the compile failed (not for memory): why
    shown: str = ""  # mesh_shown(), where the enumeration made it once for the mesh's candidates

    @property
    def axes(self) -> dict[str, int]:
        return {a: self.ici[a] * self.dcn[a] for a in MESH_AXES}

    def mesh_shown(self) -> str:
        return self.shown or mesh_shown(self.ici, self.dcn)

    def memory_shown_bytes(self) -> float:
        """The compiler's figure where there was a compile, else perfmodel's."""
        return self.compiler_memory_bytes if self.compiler_memory_bytes is not None else self.memory_bytes

    def overrides(self) -> tuple[str, ...]:
        """maxperf's key=value words for this candidate: the axes over 1 and ici_fsdp (whose default, -1, would fill
        the slice), so the mesh resolves to exactly this one; the DCN axes left out are 1, dcn_data's -1 fills 1."""
        return (*(f"ici_{a}={n}" for a, n in self.ici.items() if n > 1 or a == "fsdp"),
                *(f"dcn_{a}={n}" for a, n in self.dcn.items() if n > 1),
                f"remat_policy={self.remat_policy}", f"attention={self.attention}",
                f"per_device_batch_size={number(self.per_device_batch_size)}",
                f"grad_accum_steps={self.grad_accum_steps}", *precision_words(self.quantization),
                *((f"num_pipeline_microbatches={self.pipeline_microbatches}",) if self.pipeline_microbatches else ()))

    def as_dict(self) -> dict[str, Any]:
        return {"ici": self.ici, "dcn": self.dcn, "mesh": self.mesh_shown(), "remat_policy": self.remat_policy,
                "attention": self.attention, "per_device_batch_size": self.per_device_batch_size,
                "grad_accum_steps": self.grad_accum_steps, "quantization": self.quantization,
                "pipeline_microbatches": self.pipeline_microbatches,
                "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "analytical_memory_bytes": self.memory_bytes,
                "compiler_memory_bytes": self.compiler_memory_bytes, "bottleneck": self.bottleneck,
                "status": self.status, "reason": self.reason, "verified": self.verified,
                "compile_seconds": self.compile_seconds, "artifact": self.artifact}


def precision_words(quantization: str) -> tuple[str, ...]:
    """The key=value words of a precision ("none": none, the request's default); MaxText's Qwix recipe with the key
    that selects Qwix."""
    if quantization == "none":
        return ()
    return (f"quantization={quantization}",
            *(("use_qwix_quantization=true",) if quantization in ("fp8_full", "fp8_gpu") else ()))


def mesh_shown(ici: dict[str, int], dcn: dict[str, int]) -> str:
    """'fsdp=8 x tensor=4 | dcn data=2': the axes over 1."""
    inside = " x ".join(f"{a}={n}" for a, n in ici.items() if n > 1) or "1"
    across = " x ".join(f"{a}={n}" for a, n in dcn.items() if n > 1)
    return inside + (f" | dcn {across}" if across else "")


@dataclass(eq=False)
class MeshChoice:
    """One mesh of the search and its candidates, by (kernel, precision, pipeline microbatches, B, A, remat
    policy)."""

    ici: dict[str, int]
    dcn: dict[str, int]
    pairs: list[tuple[float, int]]  # the (B, A) whose microbatch rows its batch axes divide
    cells: dict[tuple[str, str, int, float, int, str], Candidate]


@dataclass
class Space:
    """A request's candidates (in the order they are ranked by on ties: mesh, batch, remat policy, kernel)."""

    topology: Topology
    model: ModelConfig
    train: TrainConfig  # the request's, before the searched keys
    fixed: tuple[str, ...]  # pins that are not searched keys: every candidate has them
    rows: int | None  # the global batch in rows, where it is fixed
    pairs: list[tuple[float, int]]  # (B, A) searched, before a mesh's batch axes are asked to divide them
    remats: list[str]
    kernels: list[str]
    precisions: list[str]  # "none" and, where quantization=auto, the chip's FP8 recipe
    meshes: list[MeshChoice]
    candidates: list[Candidate]
    notes: list[str] = field(default_factory=list)  # what the search left out of the request's space, and why


def space(model_name: str, topology: str, *, num_slices: int = 1, global_batch_tokens: int | None = None,
          per_device_batch: float | None = None, pins: Sequence[str] = ()) -> Space:
    """Every candidate of the request, each one divisible; a pin or batch that cannot be met is a MaxperfError."""
    pinned, fixed = split_pins(presets.get(model_name), pins)
    base = requests.resolve(topology, model_name, fixed, num_slices=num_slices)
    topo, model, train = base.topology, base.configs.model, base.configs.train
    # the places of a pipeline's split (Megatron's), which resolving on a mesh of one stage leaves out, as the words
    # give them: each candidate's request keeps them where its mesh pipelines (request.Request.of)
    words = overrides_mod.apply(presets.get(model_name), list(fixed)).train
    train = replace(train, account_for_embedding_in_pipeline_split=words.account_for_embedding_in_pipeline_split,
                    account_for_loss_in_pipeline_split=words.account_for_loss_in_pipeline_split)
    devices = topo.num_devices
    ici_pins = {a: int(pinned[f"ici_{a}"]) for a in MESH_AXES if f"ici_{a}" in pinned}
    ici_pins.setdefault("stage", 1)  # within a slice or node, pipeline stages only where pinned
    # across slices data and fsdp, as MaxText advises (its dcn_*_parallelism notes), and pipeline stages (over DCN the
    # common case: NVIDIA's and MaxText's multi-slice recipes) where the user leaves them to the search
    # (dcn_pipeline_parallelism=-1) and the model pipelines; a pin may choose others
    stage_counts = dcn_stage_counts(model, train, topo.ici_domains, pinned, pins)
    searched = DCN_SEARCHED + (("stage",) if stage_counts else ())
    dcn_pins = {a: int(pinned[f"dcn_{a}"]) if f"dcn_{a}" in pinned else 1 for a in MESH_AXES
                if a not in searched or f"dcn_{a}" in pinned}
    check_pins(topo.devices_per_ici_domain, ici_pins, "ici")
    check_pins(topo.ici_domains, dcn_pins, "dcn")
    pairs, rows = batches(global_batch_tokens, per_device_batch, devices, train.seq_len, pinned)
    remats = [pinned["remat_policy"]] if "remat_policy" in pinned else list(REMAT_POLICIES)
    kernels = [pinned["attention"]] if "attention" in pinned else servable_kernels(model, train, topo.platform)
    precisions = precisions_for(pinned.get("quantization", "none"), CHIPS[topo.chip])
    notes = []
    if model.is_moe and train.sparse_matmul and any(p not in ("none", "bf16") for p in precisions):
        # the train step quantizes a mixture of experts' capacity einsums only (models/layers/quantization.check_moe)
        quantized = next(p for p in precisions if p not in ("none", "bf16"))
        if pinned.get("quantization") != "auto":
            raise MaxperfError(f"quantization={quantized} with a mixture of experts needs sparse_matmul=false (the "
                               "capacity einsums, which it quantizes as MaxText does); the dropless grouped matmul is "
                               "not quantized here")
        precisions = [p for p in precisions if p in ("none", "bf16")]
        notes.append(f"quantization=auto searched bf16 alone: {model.name}'s dropless experts (sparse_matmul=true) "
                     f"are not quantized here; pin sparse_matmul=false to search {quantized} over the capacity "
                     "einsums")
    pinned_microbatches = check_stages(model, train, ici_pins.get("stage", 1) * dcn_pins.get("stage", 1))

    divisible = Divisibility(model, train.seq_len, [round(b * devices) for b, _ in pairs], stage_counts)
    meshes, candidates = [], []
    for ici, dcn in meshes_that_divide(topo.devices_per_ici_domain, ici_pins, topo.ici_domains, dcn_pins, divisible):
        split = batch_axes({a: ici[a] * dcn[a] for a in MESH_AXES})
        mesh = MeshChoice(ici, dcn, [(b, a) for b, a in pairs if round(b * devices) % split == 0], {})
        shown = mesh_shown(ici, dcn)
        quants = [q for q in precisions if blocks_fit(q, model, train, topo, ici, dcn)]
        stages = ici["stage"] * dcn["stage"]
        for (b, a) in list(mesh.pairs):
            ms = pipeline_microbatches(stages, round(b * devices), train, pinned_microbatches)
            if not ms:  # the microbatch's rows split into no valid number of pipeline microbatches
                mesh.pairs.remove((b, a))
            # a pipelined decoder runs MaxText's remat of its iterations: none as full, or none whatever the policy
            # (maxperf.spec.remat.pipelined), each once
            for remat in remats if stages == 1 else dict.fromkeys(
                    str(pipelined(r, train.set_remat_policy_on_pipeline_iterations)) for r in remats):
                for kernel in kernels:
                    for q in quants:
                        for m in ms:
                            c = mesh.cells[(kernel, q, m, b, a, remat)] = Candidate(
                                ici, dcn, remat, kernel, b, a, q, m, shown=shown)
                            candidates.append(c)
        meshes.append(mesh)
    if not meshes:
        pins = {a: ici_pins.get(a, 1) * dcn_pins.get(a, 1) for a in MESH_AXES}
        if (reason := divisible.why_not(pins)) is not None:
            raise MaxperfError(f"no layout of {devices} devices with the pinned axes divides {model_name}: {reason}; "
                               "pin sizes that divide it, or leave the axis to the search")
    if not candidates:
        rows_tried = sorted({round(b * devices) for b, _ in pairs})
        smallest, largest = rows_tried[0], rows_tried[-1]
        domain = "slices" if topo.platform == "tpu" else ("NVLink domains" if topo.hosts_per_nvlink_domain > 1
                                                           else "hosts")
        across = f", across the {topo.ici_domains} {domain} too" if topo.ici_domains > 1 else ""
        shared = math.gcd(largest, devices)
        tried = (f"{largest} rows a microbatch without accumulation ({smallest} at the most accumulation tried)"
                 if largest != smallest else f"{largest} row{'s' if largest != 1 else ''}")
        raise MaxperfError(
            f"no layout of {devices} devices divides this step: each splits the batch over its data and fsdp axes"
            f"{across}, and the batch's {tried} shares only a factor of {shared} with the {devices} devices (the "
            f"factor {devices // shared} divides neither it nor the model's other dims); a batch of a multiple of "
            f"{devices} rows (e.g. {-(-largest // devices) * devices}), or pins that split something else "
            "(dcn_sequence_parallelism, ici_tensor_parallelism), would")
    # the policies searched, with those a pipelined mesh runs them as (none as full, or none)
    remats = list(dict.fromkeys([*remats, *(c.remat_policy for c in candidates)]))
    return Space(topo, model, train, fixed, rows, pairs, remats, kernels, precisions, meshes, candidates, notes)


def dcn_stage_counts(model: ModelConfig, train: TrainConfig, domains: int, pinned: dict[str, str],
                     words: Sequence[str] = ()) -> set[int]:
    """The pipeline stage counts searched across slices or hosts where the words leave them to the search
    (dcn_pipeline_parallelism=-1, or dcn_stage=-1): the divisors of the ICI domains that can run the model (its stack
    split into whole stages, maxperf.spec.pipeline's rules); empty otherwise (the stage axis is then 1, or the pin).
    Not searched by default: it multiplies the space about tenfold (llama3-70b on h100-8x16: 211k candidates
    against 19k, 30 s of search against 3.8 s)."""
    asked = any(w.replace(" ", "") in ("dcn_pipeline_parallelism=-1", "dcn_stage=-1") for w in words)
    if not asked or domains <= 1 or "dcn_stage" in pinned or "ici_stage" in pinned:
        return set()
    counts = {1}
    for n in divisors(domains)[1:]:
        try:
            check_stages(model, train, n)
        except MaxperfError:
            continue
        counts.add(n)
    return counts if len(counts) > 1 else set()


# num_pipeline_microbatches searched where the stage axis is pinned and the count is not: these multiples of the stages
MICROBATCH_MULTIPLES = (1, 2, 4, 8, 16)


def check_stages(model: ModelConfig, train: TrainConfig, stages: int) -> int:
    """Where `stages` (the pinned ici and dcn stage axes; 1: no pipeline) cannot run the model, one line saying
    why; the pinned num_pipeline_microbatches (-1: searched)."""
    if stages > 1:
        units, _ = pipeline_spec.pipelined_units(model)
        first, last = pipeline_spec.empty_places(train)
        pipeline_spec.schedule(stages, units, stages * train.num_pipeline_microbatches
                               if train.num_pipeline_microbatches > 0 else 2 * stages,
                               microbatches=train.num_pipeline_microbatches, repeats=train.num_pipeline_repeats,
                               units_per_stage=train.num_layers_per_pipeline_stage,
                               delay=train.pipeline_delay_activation_forwarding,
                               empty_first=first, empty_last=last)
    return train.num_pipeline_microbatches


def pipeline_microbatches(stages: int, rows: int, train: TrainConfig, pinned: int) -> list[int]:
    """The num_pipeline_microbatches searched for a microbatch of `rows` over `stages` stages ([0] without a
    pipeline): the pinned count, else multiples of the stages (2 x with the forwarding delay, as MaxText requires)
    that divide the rows."""
    if stages <= 1:
        return [0]
    least = 2 if train.pipeline_delay_activation_forwarding else 1
    options = [pinned] if pinned > 0 else [k * stages for k in MICROBATCH_MULTIPLES if k >= least]
    return [m for m in options if rows % m == 0 and m >= least * stages]


def precisions_for(quantization: str, chip) -> list[str]:
    """The precisions searched: quantization=auto tries bf16 and the chip's FP8 recipe where it has FP8 matrix units
    (bf16 alone where it has none); any other value is searched alone, after checking the chip runs it."""
    if quantization != "auto":
        fp8.check_chip(quantization, chip)
        return [quantization]
    preferred = fp8.PREFERRED.get(chip.name)
    return ["none", preferred] if preferred and (fp8.has_fp8(chip) or chip.kind == "cpu") else ["none"]


def blocks_fit(quantization: str, model: ModelConfig, train: TrainConfig, topo: Topology, ici: dict[str, int],
               dcn: dict[str, int]) -> bool:
    """Whether a block-scaled recipe's products (the weights', and a mixture of experts' einsum dispatch) split into
    whole blocks on this mesh (spec.fp8.check_blocks; GPUs only)."""
    if topo.platform != "gpu" or quantization == "none":
        return True
    try:
        fp8.check_blocks(quantization, model, Mesh.of({a: ici[a] * dcn[a] for a in MESH_AXES}, dcn), train)
    except MaxperfError:
        return False
    return True


def batch_axes(axes: dict[str, int]) -> int:
    """The mesh axes a microbatch's rows are split over (logical_axes' activation_batch)."""
    return axes["data"] * axes["fsdp"] * axes["fsdp_transpose"] * axes["expert"]


class Divisibility:
    """Whether a mesh (or a partial one, the axes not yet sized at 1) splits all it must: experts, heads, sequence,
    each weight's and activation's sharded dimensions, and the rows of at least one microbatch."""

    def __init__(self, model: ModelConfig, seq_len: int, microbatch_rows: Sequence[int],
                 stage_counts: set[int] | None = None):
        self.model = model
        self.stage_counts = stage_counts  # the pipeline stage counts that can run the model (None: not searched)
        self.experts = model.num_experts if model.is_moe else 1
        self.heads, self.kv_heads, self.seq_len = model.num_heads, model.num_kv_heads, seq_len
        self.rows = tuple(microbatch_rows)
        self.arrays = [(x.shape, x.logical) for x in param_arrays(model)]
        self.arrays += [((n,), (name,)) for n, name in (
            (model.num_heads, "activation_heads"), (model.num_kv_heads, "activation_kv_heads"),
            (model.d_ff, "activation_mlp"), (model.vocab_size, "activation_vocab"))]

    def why_not(self, axes: dict[str, int]) -> str | None:
        """What a mesh (the pins alone: the other axes at 1) fails to split, in words; None where it splits the
        model's dimensions (the batch left out: the caller says that)."""
        if self.experts % axes["expert"]:
            return f"expert={axes['expert']} does not divide the {self.experts} experts"
        if self.seq_len % axes["sequence"]:
            return f"sequence={axes['sequence']} does not divide the sequence of {self.seq_len}"
        if (problem := requests.experts_on_fsdp_problem(self.model, axes)) is not None:
            return problem
        for n, what in ((self.heads, "query heads"), (self.kv_heads, "key/value heads")):
            if n % axes["tensor"]:
                return f"tensor={axes['tensor']} does not divide the {n} {what}"
        return None

    def divides(self, axes: dict[str, int]) -> bool:
        if self.experts % axes["expert"] or self.seq_len % axes["sequence"]:
            return False
        if self.stage_counts and axes["stage"] not in self.stage_counts:
            return False
        if requests.experts_on_fsdp_problem(self.model, axes) is not None:
            return False
        if self.heads % axes["tensor"] or self.kv_heads % axes["tensor"]:
            return False
        split = batch_axes(axes)
        if all(rows % split for rows in self.rows):
            return False
        return not any(undivided_axes(shape, logical, axes) for shape, logical in self.arrays)


def meshes_that_divide(per_domain: int, ici_pins: dict[str, int], domains: int, dcn_pins: dict[str, int],
                       divisible: Divisibility) -> list[tuple[dict[str, int], dict[str, int]]]:
    """(ici, dcn) sizes covering the domain's devices and the domains, every one divisible, in the order of
    itertools.product(factorizations of the ICI, of the DCN): the ICI sizes first, each axis's divisors ascending."""
    ones = dict.fromkeys(MESH_AXES, 1)
    found = []
    for dcn in _grow(domains, dcn_pins, lambda sizes: divisible.divides(sizes), ones):
        dcn_sizes = dict(zip(MESH_AXES, dcn))
        for ici in _grow(per_domain, ici_pins, lambda sizes: divisible.divides(
                {a: sizes[a] * dcn_sizes[a] for a in MESH_AXES}), ones):
            found.append((ici, dcn))
    found.sort()
    return [(dict(zip(MESH_AXES, ici)), dict(zip(MESH_AXES, dcn))) for ici, dcn in found]


def _grow(total: int, pinned: dict[str, int], ok, ones: dict[str, int]) -> list[tuple[int, ...]]:
    """The axes' sizes multiplying to `total`, the pinned ones fixed, sized in MESH_AXES order; a size is kept only
    where `ok` holds for the mesh so far (the axes after it at 1)."""
    free = [a for a in MESH_AXES if a not in pinned]
    out = []

    def grow(i: int, sizes: dict[str, int], left: int) -> None:
        if i == len(MESH_AXES):
            if left == 1:
                out.append(tuple(sizes.values()))
            return
        axis = MESH_AXES[i]
        later = math.prod(pinned.get(a, 1) for a in MESH_AXES[i + 1:])
        if axis in pinned:
            options = [pinned[axis]] if left % pinned[axis] == 0 else []
        elif axis == free[-1]:  # the last free axis takes what is left
            options = [left // later] if left % later == 0 else []
        else:
            options = [d for d in divisors(left) if (left // d) % later == 0]
        for n in options:
            sizes[axis] = n
            if ok(sizes):
                grow(i + 1, sizes, left // n)
        sizes[axis] = 1

    grow(0, dict(ones), total)
    return out


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered k-tuple of positive integers whose product is n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in factorizations(n // d, k - 1)]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pins(total: int, pinned: dict[str, int], what: str) -> None:
    """Pinned sizes of one side (ici or dcn) that cannot cover its `total` devices or slices: one line saying why."""
    fixed = math.prod(pinned.values())
    room = f"{total} devices of each slice" if what == "ici" else f"{total} slice{'s' if total > 1 else ''}"
    if total % fixed:
        shown = " x ".join(f"{what}_{a}={n}" for a, n in pinned.items() if n > 1)
        raise MaxperfError(f"the pinned {shown} multiply to {fixed}, which does not divide the {room}")
    if len(pinned) == len(MESH_AXES) and fixed != total:
        raise MaxperfError(f"the pinned {what}_* axes multiply to {fixed}, not the {room} they must cover")


def split_pins(model: ModelConfig, pins: Sequence[str]) -> tuple[dict[str, str], tuple[str, ...]]:
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
            elif name == "quantization":  # MaxText's "" and bf16 are none
                value = overrides_mod.VALUE_ALIASES.get((Quantization, value), value)
            if name == "ici_stage" and value.strip() == "-1":
                raise MaxperfError(f"{key}=-1: plan searches pipeline stages across slices or hosts "
                                   "(dcn_pipeline_parallelism=-1), not within one; pin a stage count there (e.g. "
                                   f"{key}=4) or leave it out")
            if not (name.startswith(("ici_", "dcn_")) and value.strip() == "-1"):  # -1: left to the search
                searched[name] = value
        else:
            fixed.append(word)
    return searched, tuple(fixed)


def _whole(x: float) -> float:
    return int(x) if float(x).is_integer() else x


def batches(global_batch_tokens: int | None, per_device_batch: float | None, devices: int, seq_len: int,
            pinned: dict[str, str]) -> tuple[list[tuple[float, int]], int | None]:
    """(B, A) pairs to search, B one microbatch per device (per_device_batch_size) and A the microbatches, and the
    global batch in rows where it is fixed (--global-batch, or --per-device-batch: B x A per device)."""
    pinned_b = _whole(float(pinned["per_device_batch_size"])) if "per_device_batch_size" in pinned else None
    pinned_a = int(pinned["grad_accum_steps"]) if "grad_accum_steps" in pinned else None
    if global_batch_tokens is not None:
        tokens = global_batch_tokens
        if tokens < 1 or tokens % seq_len:
            raise MaxperfError(f"--global-batch {tokens} tokens is not reachable: it must be a positive multiple "
                               f"of the sequence length L={seq_len} (e.g. {max(1, round(tokens / seq_len)) * seq_len})")
        rows = tokens // seq_len
        fixed = f"--global-batch {tokens} ({rows} rows over {devices} devices)"
    elif per_device_batch is not None:
        s = per_device_batch
        if s <= 0 or not float(s * devices).is_integer():
            raise MaxperfError(f"per-device batch {number(s)} over {devices} devices gives {s * devices:g} rows, "
                               "which must be a positive whole number")
        rows = int(s * devices)
        fixed = f"--per-device-batch {number(s)} ({rows} rows over {devices} devices)"
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
            raise MaxperfError(f"per_device_batch_size={number(pinned_b)}{steps} contradicts {fixed}: B x A must be "
                               f"{number(s)} per device (per_device_batch_size={number(s)} grad_accum_steps=1, "
                               "or a divisor of it with its A)")
        return [(pinned_b, int(a))], rows
    # A microbatches of the step's batch, each a whole number of rows, and of rows per device where B x A is whole
    valid = [a for a in divisors(rows) if not float(s).is_integer() or int(s) % a == 0]
    if pinned_a is not None and pinned_a not in valid:
        raise MaxperfError(f"grad_accum_steps={pinned_a} does not divide the per-device batch per step {number(s)} "
                           f"({fixed}); valid: {', '.join(map(str, valid))}")
    return [(_whole(s / a), a) for a in ([pinned_a] if pinned_a is not None else valid)], rows
