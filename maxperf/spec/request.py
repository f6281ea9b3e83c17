"""One resolution of a request (topology, model, overrides, slices) into configs and a mesh.

Every command resolves through `resolve()`: compile, estimate, estimate-memory, sweep, plan and run read the same
configs and mesh (maxperf.spec.mesh turns the parallelism config into mesh sizes over the topology).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from maxperf.spec import attention_rule, fp8, pipeline, presets, remat
from maxperf.spec import mesh as mesh_mod
from maxperf.spec import overrides as overrides_mod
from maxperf.spec import topology as topologies
from maxperf.spec.configs import Configs
from maxperf.spec.errors import MaxperfError
from maxperf.spec.hardware import CHIPS
from maxperf.spec.logical_axes import RULES, mesh_axes_for, undivided_axes
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import AttentionType, ModelConfig
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.params import param_arrays, params_per_device
from maxperf.spec.topology import Topology
from maxperf.spec.train import DTYPE_BYTES, Quantization, TrainConfig, optimizer_state_bytes

GIB = 1 << 30


@dataclass(frozen=True)
class Request:
    """What to compile or estimate: the configs, the topology, the resolved mesh, and what the user should know about
    it."""

    topology: Topology
    configs: Configs
    mesh: Mesh
    warnings: tuple[str, ...] = ()  # one line each: dimensions the mesh does not divide, with their cost

    @property
    def model(self) -> ModelConfig:
        return self.configs.model

    @property
    def train(self) -> TrainConfig:
        return self.configs.train

    @classmethod
    def of(cls, topology: Topology, model: ModelConfig, train: TrainConfig, axes: Mapping[str, int],
           dcn: Mapping[str, int] | None = None) -> Request:
        """A request from configs and a mesh given as whole-axis sizes with their DCN parts (a search's candidates and
        tests choose their meshes themselves); the mesh is checked against the topology."""
        mesh = Mesh.of(axes, dcn).check(topology)
        parallelism = ParallelismConfig(**{f"ici_{a}": n for a, n in mesh.ici.items()},
                                        **{f"dcn_{a}": n for a, n in mesh.dcn.items()})
        return cls(topology, _pipelined_remat(Configs(model, train, parallelism), mesh)[0], mesh)

    def default_dir(self, step: str = "train") -> Path:
        slices = f"_x{self.topology.num_slices}" if self.topology.num_slices > 1 else ""
        kind = "" if step == "train" else f"_{step}"
        return Path("artifacts") / f"{self.model.name}{kind}_{self.topology.name}{slices}"


def resolve(topology: str | Topology, model: str | ModelConfig = presets.DEFAULT_MODEL,
            overrides: Sequence[str] = (), *, num_slices: int = 1,
            target_config: str | os.PathLike | None = None) -> Request:
    """Resolves names and overrides into configs and a mesh; every mistake is a MaxperfError naming what is valid."""
    topo = topology if isinstance(topology, Topology) else topologies.get(
        topology, num_slices=num_slices, target_config_path=None if target_config is None else str(target_config))
    model_cfg = model if isinstance(model, ModelConfig) else presets.get(model)
    configs = overrides_mod.apply(model_cfg, list(overrides))
    notes: tuple[str, ...] = ()
    if configs.train.quantization is Quantization.AUTO:  # only a search chooses the precision
        configs = dataclasses.replace(configs, train=dataclasses.replace(configs.train,
                                                                         quantization=Quantization.NONE))
        chip = CHIPS[topo.chip]
        recipe = fp8.PREFERRED.get(chip.name) if fp8.has_fp8(chip) else None
        notes = ("quantization=auto: bf16 here; `maxperf plan` chooses the precision: "
                 + (f"bf16 or {recipe} for training" if recipe else
                    f"bf16 for training ({chip.name} has no FP8 matrix units)")
                 + ", the weights' and cache's for serving",)
    fp8.check_chip(configs.train.quantization, CHIPS[topo.chip])
    if configs.model.window != model_cfg.window and configs.model.window not in configs.model.layer_windows():
        notes += (f"window={configs.model.window} (sliding_window_size) bounds the layers of attention_type="
                  "local_sliding or local_global; under attention_type="
                  f"{getattr(configs.model.attention_type, 'value', configs.model.attention_type)} no layer reads it, "
                  "and it changes nothing",)
    if configs.model.shard_exp_on_fsdp and not configs.model.is_moe:
        notes += ("shard_exp_on_fsdp=true shards a mixture of experts' weights; this model has none, and it changes "
                  "nothing, as in MaxText",)
    if configs.model.is_moe and configs.train.sparse_matmul and configs.train.capacity_factor > 0:
        notes += (f"capacity_factor={configs.train.capacity_factor:g} drops tokens only in the einsum dispatch "
                  "(sparse_matmul=false); the sparse dispatch is dropless and does not read it, as in MaxText",)
    quantized = str(configs.train.quantization) not in ("none", "auto")
    if configs.model.is_moe and configs.train.sparse_matmul and quantized:
        notes += (f"quantization={configs.train.quantization} with the dropless (sparse_matmul) experts: priced as "
                  "MaxText runs it, its grouped matmul quantized (megablox's int8, Qwix's FP8 rule); `maxperf "
                  "compile` of the train step does not build that kernel and refuses it (sparse_matmul=false, the "
                  "capacity einsums, it compiles quantized); the serving steps (--step prefill|decode) compile it",)
    if unread := unread_remat_keys(configs.train):
        notes += (f"{', '.join(unread)} place tensors only under remat_policy=custom, as in MaxText; under "
                  f"remat_policy={configs.train.remat_policy} they change nothing (set remat_policy=custom to apply "
                  "them)",)
    if str(configs.train.attention) in attention_rule.CUDNN:
        kernel = attention_rule.implementation(configs.train.attention, topo.platform)  # refuses a TPU
        notes += (f"attention={configs.train.attention} (cuDNN's fused attention in MaxText) is compiled as "
                  f"attention=flash, maxperf's {'Pallas Triton kernel' if kernel == 'gpu_flash' else 'CPU kernel'}, "
                  "and priced as cuDNN's kernel (on H100 and H200 1.6x the flash rate, measured against "
                  "FlashAttention-2 in the FlashAttention-3 paper; elsewhere the flash rate)",)
    recipe = fp8.recipe(str(configs.train.quantization))
    if recipe is not None and recipe.transformer_engine and topo.platform == "gpu" and recipe.block:
        notes += (f"quantization={recipe.name} is Transformer Engine's recipe in MaxText: compiled with its numerics "
                  f"as jax's block-scaled MXFP8 products (a power-of-two scale per {recipe.block} elements, which "
                  "XLA:GPU runs as cuDNN's block-scaled GEMM), and priced at the rate of TE's kernels",)
    elif recipe is not None and recipe.transformer_engine and topo.platform == "gpu":
        notes += (f"quantization={recipe.name} is Transformer Engine's recipe in MaxText: compiled with its numerics "
                  "as XLA's FP8 matmuls, and priced at the rate of TE's kernels (on an H200 such an XLA step took 0.82 "
                  "of its bf16 step's time, where TE's rate gives 0.58: docs/accuracy.md)",)
    mesh = mesh_mod.resolve(configs.parallelism, topo)
    configs.train.micro_batch(mesh.devices)  # B x devices examples per microbatch: a whole number
    _check_experts(configs.model, mesh)
    if configs.parallelism == ParallelismConfig() and (keep := _fsdp_dividing_width(configs, mesh)):
        # the default mesh would replicate every weight along fsdp: fsdp takes what divides D, data the rest
        notes += (f"the default fsdp={mesh.ici['fsdp']} does not divide D={configs.model.d_model}: planned "
                  f"ici_fsdp={keep} ici_data={mesh.ici['fsdp'] // keep} instead, which does (set ici_fsdp to "
                  "choose)",)
        configs = dataclasses.replace(configs, parallelism=ParallelismConfig(ici_data=-1, ici_fsdp=keep))
        mesh = mesh_mod.resolve(configs.parallelism, topo)
    configs, note = _pipelined_remat(configs, mesh)
    schedule = pipeline.of(configs.model, configs.train, mesh)  # a pipeline's schedule: each mistake one line
    notes += _schedule_note(configs.train, schedule)
    notes += (note,) if note else ()
    _check_context(configs, mesh)
    _check_zero1(configs.train, mesh)
    notes += _load_imbalance_note(configs, mesh)
    if configs.train.decode_cache_reads == "per_query_head":
        if configs.model.attention_type is AttentionType.MLA:
            raise MaxperfError("decode_cache_reads=per_query_head reads a grouped-query cache once per query head; "
                               "latent attention (MLA) decodes from one latent shared by every head: use per_kv_head")
        notes += ("decode_cache_reads=per_query_head prices the decode as TensorRT-LLM's masked multi-head attention "
                  "kernel runs it, the cache read once per query head; maxperf's compiled decode step is XLA's "
                  "grouped dot",)
    if topo.platform == "gpu":
        fp8.check_blocks(configs.train.quantization, configs.model, mesh, configs.train)
    return Request(topo, configs, mesh, notes + replication_warnings(configs, mesh)
                   + gpu_grouped_matmul_warnings(configs, mesh, topo))


def _load_imbalance_note(configs: Configs, mesh: Mesh) -> tuple[str, ...]:
    """moe_load_imbalance (perfmodel's: the busiest expert shard's routed rows over the mean) is at most the expert
    shards' count (every row on one shard), and prices only expert parallelism with the sparse dispatch: a note
    where it changes nothing, one line where it cannot be."""
    value = configs.train.moe_load_imbalance
    if value is None:
        return ()
    shards = mesh.axes.get("expert", 1)
    if not configs.model.is_moe or shards <= 1 or not configs.train.sparse_matmul:
        why = ("this model has no experts" if not configs.model.is_moe else
               "there is no expert parallelism (each device runs every expert on its own tokens)" if shards <= 1 else
               "the einsum dispatch (sparse_matmul=false) computes fixed-size slots")
        return (f"moe_load_imbalance={value:g} prices the busiest expert shard under expert parallelism with the "
                f"sparse dispatch; here {why}, and it changes nothing",)
    if value > shards:
        raise MaxperfError(f"moe_load_imbalance={value:g} is the busiest of {shards} expert shards' rows over the "
                           f"mean, so at most {shards} (every row on one shard); choose 1 to {shards}")
    return ()


def unread_remat_keys(train: TrainConfig) -> list[str]:
    """The per-tensor keys of remat_policy=custom (remat.CHECKPOINT_NAMES) given a value of their own under another
    policy, which reads none of them (MaxText's base.yml: "If 'custom' remat_policy is chosen, you can select
    tensors ..."), as `key=value` words."""
    if train.remat_policy is remat.RematPolicy.CUSTOM:
        return []
    default = TrainConfig()
    return [f"{name}={getattr(train, name)}" for name in remat.CHECKPOINT_NAMES
            if getattr(train, name) != getattr(default, name)]


def _pipelined_remat(configs: Configs, mesh: Mesh) -> tuple[Configs, str]:
    """The configs with the remat policy a pipelined decoder runs under (maxperf.spec.remat.pipelined), and a
    note where that is not the one asked for; without a pipeline, the configs without the places of a pipeline's
    split (account_for_*_in_pipeline_split: no empty places stored), and a note where there were."""
    train = configs.train
    if mesh.axes["stage"] <= 1:
        if not sum(pipeline.empty_places(train)):
            return configs, ""
        train = dataclasses.replace(train, account_for_embedding_in_pipeline_split=False,
                                    account_for_loss_in_pipeline_split=False)
        return dataclasses.replace(configs, train=train), (
            "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split place the layers of "
            "pipeline stages; the mesh has one stage, so they change nothing")
    scan = ""
    if not train.scan_layers:
        # MaxText's pipeline stacks and runs its layers by stage whatever scan_layers says (its base.yml recommends
        # false with pipeline parallelism, scanning the pipeline's iterations instead): maxperf's pipelined stack
        train = dataclasses.replace(train, scan_layers=True)
        scan = ("scan_layers=false with pipeline stages: the pipeline holds and runs its layers by stage, as MaxText's "
                "does whatever scan_layers says")
    policy = remat.pipelined(train.remat_policy, train.set_remat_policy_on_pipeline_iterations)
    if policy == train.remat_policy:
        return dataclasses.replace(configs, train=train), scan
    why = ("set_remat_policy_on_pipeline_iterations=false leaves the pipeline's layers unrematerialized" if
           policy is remat.RematPolicy.NONE else "each pipeline iteration is rematerialized whole, keeping its "
           "input and each layer's input (set_remat_policy_on_pipeline_iterations=true)")
    note = f"remat_policy={train.remat_policy} under a pipeline runs as remat_policy={policy}, as in MaxText: {why}"
    return (dataclasses.replace(configs, train=dataclasses.replace(train, remat_policy=policy)),
            "; ".join(n for n in (scan, note) if n))


def gpu_grouped_matmul_warnings(configs: Configs, mesh: Mesh, topo: Topology) -> tuple[str, ...]:
    """On GPU a dropless MoE step's jax.lax.ragged_dot has no grouped GEMM: XLA multiplies every routed row by each
    local expert (perfmodel's RAGGED_EXPANDED_D_BUFFERS), which the einsum dispatch avoids."""
    if topo.platform != "gpu" or not configs.model.is_moe or not configs.train.sparse_matmul:
        return ()
    local = configs.model.num_experts // mesh.axes["expert"]
    if local <= 1:
        return ()
    return (f"on GPU XLA runs the dropless experts (sparse_matmul=true) as dense products of every routed row with "
            f"each of the device's {local} local experts: its buffers and FLOPs are {local}x a grouped matmul's. "
            f"sparse_matmul=false with a capacity_factor (e.g. 1.25) dispatches by einsums instead; more expert "
            f"parallelism leaves fewer local experts",)


def _check_experts(model: ModelConfig, mesh: Mesh) -> None:
    """A mixture of experts puts E / (ici_expert x dcn_expert) whole experts on each device: the axis must divide E."""
    ep = mesh.axes["expert"]
    if model.is_moe and model.num_experts % ep:
        fits = [n for n in range(1, ep + 1) if model.num_experts % n == 0 and mesh.devices % n == 0]
        raise MaxperfError(f"the expert axis ({mesh.ici['expert']} ICI x {mesh.dcn['expert']} DCN = {ep}) does not "
                           f"divide num_experts={model.num_experts}; choose an ici_expert x dcn_expert product that "
                           f"does, e.g. {fits[-1]}")
    if (why := experts_on_fsdp_problem(model, mesh.axes)) is not None:
        raise MaxperfError(why)


def experts_on_fsdp_problem(model: ModelConfig, axes: Mapping[str, int]) -> str | None:
    """Why a mesh of these axis sizes cannot store a mixture of experts' weights with E over fsdp
    (shard_exp_on_fsdp=true), as MaxText's own checks of the key say (pyconfig); None where it can, or where the key
    is off or the model has no routed experts."""
    if not (model.shard_exp_on_fsdp and model.is_moe):
        return None
    if axes["tensor"] > 1 or axes["expert"] > 1:
        return (f"shard_exp_on_fsdp=true needs ici_tensor=1 and ici_expert=1 (as MaxText), not tensor={axes['tensor']} "
                f"expert={axes['expert']}; set them to 1 or shard_exp_on_fsdp=false")
    if model.num_experts % axes["fsdp"]:
        return (f"shard_exp_on_fsdp=true splits the {model.num_experts} experts over fsdp={axes['fsdp']}, which does "
                "not divide them; choose an fsdp that does, e.g. "
                f"{max(n for n in range(1, axes['fsdp'] + 1) if model.num_experts % n == 0)}")
    return None


def _check_context(configs: Configs, mesh: Mesh) -> None:
    """Context parallelism's load balancing (models/context.py) cuts each sequence into 2 x context chunks, and
    reorders the tokens, which multi-token prediction's shifted targets do not follow."""
    cp, train = mesh.axes["sequence"], configs.train
    if cp <= 1:
        return
    L, unit = train.seq_len, (2 * cp if train.context_parallel_load_balance else cp)
    if L % unit:
        lower, upper = max(unit, L // unit * unit), (L // unit + 1) * unit
        sizes = [n for n in range(2, mesh.devices + 1) if mesh.devices % n == 0
                 and L % (2 * n if train.context_parallel_load_balance else n) == 0]
        raise MaxperfError(
            f"context parallelism over {cp} devices splits each sequence into "
            + (f"2 x {cp} chunks (context_parallel_load_balance)" if train.context_parallel_load_balance else
               f"{cp} shards")
            + f": seq_len={L} must be a multiple of {unit} (e.g. {lower} or {upper})"
            + (f", or ici_context_parallelism one of {', '.join(map(str, sizes[:6]))}" if sizes else ""))
    if not train.context_parallel_load_balance:
        return
    if train.seq_len % (2 * cp):
        raise MaxperfError(f"context_parallel_load_balance cuts each sequence into 2 x {cp} chunks: seq_len="
                           f"{train.seq_len} must be a multiple of {2 * cp}, or set "
                           "context_parallel_load_balance=false")
    if configs.model.mtp_num_layers:
        raise MaxperfError("multi-token prediction shifts targets along the sequence, which "
                           "context_parallel_load_balance reorders: set context_parallel_load_balance=false with "
                           f"context parallelism ({cp})")


def _schedule_note(train: TrainConfig, schedule: pipeline.Schedule | None) -> tuple[str, ...]:
    """What pipeline_schedule=1f1b does here: nothing without stages; with them, perfmodel's memory holds the
    microbatches in flight, where the compiled step runs MaxText's schedule and holds every iteration's."""
    if schedule is None:
        default = TrainConfig()
        keys = [k for k in ("num_pipeline_microbatches", "num_pipeline_repeats", "num_layers_per_pipeline_stage",
                            "pipeline_delay_activation_forwarding", "pipeline_fsdp_ag_once", "pipeline_schedule")
                if getattr(train, k) != getattr(default, k)]
        return (f"{', '.join(keys)} {'shape' if len(keys) > 1 else 'shapes'} a pipeline's loop; this mesh has one "
                f"stage, and {'they change' if len(keys) > 1 else 'it changes'} nothing",) if keys else ()
    if str(train.pipeline_schedule) != "1f1b":
        return ()
    return (f"pipeline_schedule=1f1b (Megatron-LM's) is priced: each stage holds the activations of "
            f"{schedule.held_iterations} of its {schedule.iterations} loop iterations at once; the compiled step runs "
            "MaxText's schedule, which holds them all, so a compile's memory is that schedule's (estimate-memory sets "
            "it beside that schedule's analytical figure)",)


def _check_zero1(train: TrainConfig, mesh: Mesh) -> None:
    """ZeRO-1 splits the optimizer state over `data` on top of the parameters' own split; MaxText refuses it beside
    FSDP (its config check: the gradients, split over fsdp, would meet moments split over data and fsdp)."""
    fsdp = mesh.axes["fsdp"] * mesh.axes["fsdp_transpose"]
    if train.shard_optimizer_over_data and fsdp > 1:
        raise MaxperfError(f"shard_optimizer_over_data=true (ZeRO-1) cannot be combined with FSDP, as in MaxText: the "
                           f"mesh has fsdp x fsdp_transpose = {fsdp}; set ici_fsdp and ici_fsdp_transpose (and their "
                           "dcn_ counterparts) to 1, the devices over data, or shard_optimizer_over_data=false")


def _fsdp_dividing_width(configs: Configs, mesh: Mesh) -> int | None:
    """The largest ICI fsdp size that divides the model width D, where the mesh's own does not; else None."""
    keep = math.gcd(mesh.ici["fsdp"], configs.model.d_model)
    return keep if keep < mesh.ici["fsdp"] else None


# The letter of each logical axis, for messages (one letter per dimension).
_LETTERS = {"embed": "D", "vocab": "V", "mlp": "F", "heads": "H", "kv_heads": "K", "activation_batch": "B",
            "activation_length": "L", "activation_heads": "H", "activation_kv_heads": "K", "activation_mlp": "F",
            "activation_vocab": "V", "activation_embed": "D"}


def replication_warnings(configs: Configs, mesh: Mesh) -> tuple[str, ...]:
    """A line for each mesh axis that does not divide a dimension it would shard.

    The sharding rules (`maxperf.spec.logical_axes`) replicate a dimension along such an axis, and so does the compiled
    step: every device then holds the whole dimension. Weights say what their state costs per device."""
    model, train, axes = configs.model, configs.train, mesh.axes
    found: dict[tuple[str, str], tuple[int, int, bool]] = {}  # (letter, axis) -> (size, axis size, a weight?)
    arrays = [(x.shape, x.logical, True) for x in param_arrays(model)]
    arrays += [((train.micro_batch(mesh.devices), train.seq_len), ("activation_batch", "activation_length"), False)]
    arrays += [((size,), (name,), False) for size, name in (
        (model.num_heads, "activation_heads"), (model.num_kv_heads, "activation_kv_heads"),
        (model.d_ff, "activation_mlp"), (model.vocab_size, "activation_vocab"))]
    held_of: dict[tuple[str, str], int] = {}  # what one device holds of an activation dimension
    split_by: dict[tuple[str, str], tuple[str, ...]] = {}  # the axes that do split it
    for shape, logical, weight in arrays:
        spec = mesh_axes_for(shape, logical, axes)
        for dim, axis in undivided_axes(shape, logical, axes):
            key = (_LETTERS.get(logical[dim], logical[dim]), axis)
            _, _, was_weight = found.get(key, (0, 0, False))
            found[key] = (shape[dim], axes[axis], weight or was_weight)
            split = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],) if spec[dim] else ()
            held_of[key] = shape[dim] // math.prod(axes[a] for a in split)
            split_by[key] = split
    if not found:
        return tuple(_pipeline_microbatch_lines(configs, mesh))
    state_per_param = DTYPE_BYTES[str(train.param_dtype)] + optimizer_state_bytes(train)
    held = params_per_device(model, mesh.sizes) * state_per_param
    even = sum(x.count * math.prod(x.shape) for x in param_arrays(model)) * state_per_param / mesh.devices
    lines = []
    for (letter, axis), (size, n, weight) in found.items():
        line = f"{axis}={n} does not divide {letter}={size}: {letter} is replicated along {axis}, not split"
        if split_by[(letter, axis)]:  # the axes before it split the dimension, and it does not divide what they leave
            others = " x ".join(f"{a}={axes[a]}" for a in split_by[(letter, axis)])
            line = (f"{axis}={n} does not divide the {held_of[(letter, axis)]} of {letter}={size} that {others} "
                    f"leave{'s' if len(split_by[(letter, axis)]) == 1 else ''} on a device: {letter} is split over "
                    f"{others} and replicated along {axis}")
        if weight:
            line += (f"; parameters and optimizer state take {held / GIB:.2f} GiB per device ({even / GIB:.2f} GiB "
                     f"if split over all {mesh.devices} devices)")
        elif held_of[(letter, axis)] == size:
            line += f"; each device holds all {size} of it"
        else:
            line += (f"; each device holds {held_of[(letter, axis)]} of the {size}, and the {n} devices along {axis} "
                     "compute the same ones")
        # a load-balanced context split cuts the sequence into 2 x context chunks: what it keeps must divide L / 2
        balanced = letter == "L" and train.context_parallel_load_balance
        if split_by[(letter, axis)] and letter != "B":
            names = " x ".join((*split_by[(letter, axis)], axis))
            lines.append(line + f"; choose axis sizes whose product {names} divides {size}")
            continue
        lines.append(line + f"; {_suggestion(mesh, axis, size // 2 if balanced else size, letter == 'B')}")
    return tuple(lines + _pipeline_microbatch_lines(configs, mesh))


def serving_warnings(request: Request) -> tuple[str, ...]:
    """A serving step's warnings: the request's notes, and for each mesh axis that does not divide a serving
    dimension (the cache's KV heads, the query heads) the line the training step's replication warning gives, in a
    serving step's words (no optimizer state)."""
    configs, mesh = request.configs, request.mesh
    training = set(replication_warnings(configs, mesh))
    lines = [w for w in request.warnings if w not in training]
    model, axes = configs.model, mesh.axes
    # (a batch the batch axes do not divide is refused by the serving steps, not replicated: no line for it)
    for size, logical, letter, what in (
            (model.num_kv_heads, "cache_kv_heads", "K", "the key/value cache's heads"),
            (model.num_heads, "heads", "H", "the query heads")):
        for _, axis in undivided_axes((size,), (logical,), axes):
            line = (f"{axis}={axes[axis]} does not divide {letter}={size}: {what} are replicated along {axis}, "
                    f"not split; {_suggestion(mesh, axis, size)}")
            if letter == "K" and request.topology.platform == "tpu" and axes[axis] > size:
                line += ("; on a TPU the compiled decode also holds a second copy of the cache, which maxperf's memory "
                         "does not count (qwen3-30b-a3b on v6e-8, tensor 8 over 4 KV heads: 35.44 GiB compiled, "
                         "25.31 counted), and `plan --step decode` keeps tensor at most the KV heads there")
            lines.append(line)
    return tuple(lines)


def _pipeline_microbatch_lines(configs: Configs, mesh: Mesh) -> list[str]:
    """A line where the batch axes do not divide a pipeline microbatch's rows: each is replicated along them, and the
    devices along them compute the same rows (what the step time and memory count)."""
    schedule = pipeline.of(configs.model, configs.train, mesh)
    if schedule is None:
        return []
    micro = configs.train.micro_batch(mesh.devices)
    rows = micro // schedule.microbatches
    if rows * schedule.microbatches != micro:
        return []
    lines = []
    shards = _batch_shards(mesh)
    # the most microbatches the stages take (a multiple of them, at least two rounds of them where activations are
    # forwarded a step late: pipeline_delay_activation_forwarding) whose rows the batch axes divide
    least = schedule.stages * (2 if configs.train.pipeline_delay_activation_forwarding else 1)
    fewer = max((m for m in range(least, schedule.microbatches, schedule.stages)
                 if micro % m == 0 and (micro // m) % shards == 0), default=None)
    for _, axis in undivided_axes((rows,), ("activation_batch",), mesh.axes):
        lines.append(f"{axis}={mesh.axes[axis]} does not divide a pipeline microbatch's {rows} row(s) ({micro} "
                     f"examples over num_pipeline_microbatches={schedule.microbatches}): they are replicated along "
                     f"{axis}, and its {mesh.axes[axis]} devices compute the same rows; "
                     + (f"e.g. num_pipeline_microbatches={fewer}, or a larger per_device_batch_size"
                        if fewer else "a larger per_device_batch_size"))
    return lines


def _batch_shards(mesh: Mesh) -> int:
    """The product of the mesh axes the batch is split over (the logical rules' activation_batch)."""
    return math.prod(mesh.axes.get(a, 1) for a in RULES["activation_batch"])


def _suggestion(mesh: Mesh, axis: str, size: int, batch: bool = False) -> str:
    """A mesh that divides: the ICI part of `axis` cut to what divides `size`, the rest moved to data; for the
    batch, which data splits too, a batch the batch axes divide."""
    if batch:
        shards = _batch_shards(mesh)
        return (f"a microbatch of a multiple of {shards} examples splits over them (per_device_batch_size="
                f"{shards / mesh.devices:g} or a multiple of it)")
    ici = mesh.ici[axis]
    keep = math.gcd(ici, size // math.gcd(size, mesh.dcn.get(axis, 1)))
    if axis == "data" or keep == ici:
        return f"choose axis sizes whose product on {axis} divides {size}"
    return f"e.g. ici_{axis}={keep} ici_data={mesh.ici['data'] * ici // keep}"
