"""What perfmodel reads: protocols for the model, the training step and the topology, and the checked mesh.

perfmodel imports nothing else from maxperf, so it states here the attributes it reads; `maxperf.models.config`'s
ModelConfig and TrainConfig and `maxperf.aot.topologies`' Topology satisfy these protocols structurally. Enums are
read through `str(...)`, so a StrEnum member and its plain string value are the same to perfmodel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from maxperf.errors import MaxperfError
from maxperf.logical_axes import DCN_AXES, MESH_AXES  # the one table, shared with the models

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACTIVATIONS = ("swiglu", "geglu", "gelu", "clamped_swiglu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
REMAT_POLICIES = ("none", "minimal", "minimal_with_context", "save_dot_with_context_except_mlp",
                  "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj",
                  "qkv_proj_offloaded", "minimal_offloaded", "custom", "full")  # MaxText's (perfmodel.flops)


@runtime_checkable
class ModelShape(Protocol):
    vocab_size: int  # V
    d_model: int  # D
    num_layers: int  # N
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # Dh
    d_ff: int  # F
    activation: str
    norm: str
    positions: str
    max_position: int
    tie_embeddings: bool
    qk_norm: bool
    post_norms: bool

    def layer_windows(self) -> tuple[int | None, ...]: ...


@runtime_checkable
class TrainShape(Protocol):
    per_device_batch_size: float  # B: one microbatch per device, fractional as in MaxText, B x devices whole
    seq_len: int  # L
    compute_dtype: str
    param_dtype: str
    remat_policy: str
    grad_accum_steps: int  # A: microbatches per step (MaxText's gradient_accumulation_steps)
    scan_layers: bool


@runtime_checkable
class TopologyShape(Protocol):
    chip: str  # a key of perfmodel.chips.CHIPS
    chips: int  # all slices together
    chips_per_host: int
    num_slices: int
    hosts: int
    torus: tuple[int, ...] | None  # TPU: the ICI torus of one slice, e.g. (8, 8, 8); read for TPUs only


def dcn_domains(topology: TopologyShape) -> int:
    """How many fast-interconnect domains the DCN mesh axes span: TPU slices, GPU NVLink domains (an HGX host, a
    GB200 NVL72 rack). Optional: `ici_domains` where the topology has it (maxperf.aot's does), else its slices."""
    return int(getattr(topology, "ici_domains", None) or topology.num_slices)


def devices_per_chip(topology: TopologyShape) -> int:
    """JAX devices per chip: 2 on tpu7x (one per chiplet), else 1. Optional: read only where the topology has it."""
    return int(getattr(topology, "devices_per_chip", 1) or 1)


def per_model(fn: Callable) -> Callable:
    """Caches a function of the model alone: a search estimates thousands of meshes, batches and remat policies of one
    model. Only a frozen dataclass (which cannot change) is cached, by identity; any other model is computed afresh.
    Callers must not mutate what comes back."""
    cache: dict[int, tuple[Any, Any]] = {}  # id(model) -> (model, value): the model held so its id stays its own

    @functools.wraps(fn)
    def wrapper(model):
        hit = cache.get(id(model))
        if hit is not None and hit[0] is model:
            return hit[1]
        value = fn(model)
        params = getattr(type(model), "__dataclass_params__", None)
        if params is not None and params.frozen:
            if len(cache) >= 64:
                cache.clear()
            cache[id(model)] = (model, value)
        return value

    wrapper.cache_clear = cache.clear
    return wrapper


@per_model
def model_memo(model) -> dict:
    """A dict for results of this model's functions of small arguments, kept with the model (a fresh, unshared dict
    for a model per_model does not cache)."""
    return {}


def check(ok: bool, message: str) -> None:
    if not ok:
        raise MaxperfError(message)


def dtype_bytes(name: str, field: str) -> int:
    name = str(name)
    check(name in DTYPE_BYTES, f"{field} must be one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name]


def check_model(model: ModelShape) -> None:
    memo = model_memo(model)
    if "checked" in memo:  # a frozen model that passed once passes again
        return
    for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff"):
        value = getattr(model, field)
        check(isinstance(value, int) and value >= 1, f"model {field} must be a positive integer, got {value!r}")
    check(model.num_heads % model.num_kv_heads == 0,
          f"num_heads ({model.num_heads}) must be a multiple of num_kv_heads ({model.num_kv_heads})")
    check(str(model.activation) in ACTIVATIONS, f"activation must be one of {', '.join(ACTIVATIONS)}, "
          f"got {str(model.activation)!r}")
    check(str(model.norm) in NORMS, f"norm must be one of {', '.join(NORMS)}, got {str(model.norm)!r}")
    check(str(model.positions) in POSITIONS, f"positions must be one of {', '.join(POSITIONS)}, "
          f"got {str(model.positions)!r}")
    windows = model.layer_windows()
    check(len(windows) == model.num_layers,
          f"layer_windows() gave {len(windows)} windows for {model.num_layers} layers")
    memo["checked"] = True


def check_train(train: TrainShape) -> None:
    B, L = train.per_device_batch_size, train.seq_len
    check(isinstance(B, (int, float)) and not isinstance(B, bool) and B > 0,
          f"per_device_batch_size must be a positive number, got {B!r}")
    check(isinstance(L, int) and L >= 1, f"seq_len must be a positive integer, got {L!r}")
    check(str(train.remat_policy) in REMAT_POLICIES,
          f"remat_policy must be one of {', '.join(REMAT_POLICIES)}, got {str(train.remat_policy)!r}")
    check(isinstance(train.grad_accum_steps, int) and train.grad_accum_steps >= 1,
          f"grad_accum_steps must be a positive integer, got {train.grad_accum_steps!r}")
    dtype_bytes(train.compute_dtype, "compute_dtype")
    dtype_bytes(train.param_dtype, "param_dtype")


def micro_batch(B: float, devices: int) -> int:
    """B x devices examples per microbatch (MaxText's micro_batch_size_to_train_on), which must be whole."""
    rows = B * devices
    check(float(rows).is_integer() and rows >= 1, f"per_device_batch_size={B} over {devices} devices gives a "
          f"microbatch of {rows:g} examples, which must be a whole number")
    return int(rows)


@dataclass(frozen=True)
class Mesh:
    """Mesh axis sizes (each the product of its ICI and DCN parts) and the DCN part of each axis."""

    axes: Mapping[str, int]
    dcn: Mapping[str, int]

    @functools.cached_property
    def sizes(self) -> tuple[tuple[str, int], ...]:
        """The axes as a hashable key (computed once per mesh: caches key on it)."""
        return tuple(self.axes.items())

    def size(self, *names: str) -> int:
        return math.prod(self.axes[a] for a in names)

    def ici(self, name: str) -> int:
        return self.axes[name] // self.dcn.get(name, 1)

    @property
    def devices(self) -> int:
        return math.prod(self.axes.values())


def make_mesh(mesh_axes: Mapping[str, int], dcn_axes: Mapping[str, int] | None, topology: TopologyShape) -> Mesh:
    """Takes resolved sizes (maxperf.plan resolves them) and checks them against the topology: known axes, positive
    sizes, product = devices, DCN parts divide their axes and multiply to the topology's DCN domains."""
    unknown = sorted(set(mesh_axes) - set(MESH_AXES))
    check(not unknown, f"unknown mesh axes {', '.join(unknown)}; valid: {', '.join(MESH_AXES)}")
    axes = {a: int(mesh_axes.get(a, 1)) for a in MESH_AXES}
    bad = [f"{a}={n}" for a, n in axes.items() if n < 1]
    check(not bad, f"mesh axis sizes must be >= 1, got {', '.join(bad)}")
    devices = math.prod(axes.values())
    expected = topology.chips * devices_per_chip(topology)
    check(devices == expected,
          f"mesh axes {_shown(axes)} multiply to {devices} but the topology has {expected} devices")
    dcn_axes = dict(dcn_axes or {})
    unknown = sorted(set(dcn_axes) - set(DCN_AXES))
    check(not unknown, f"unknown dcn axes {', '.join(unknown)}; valid: {', '.join(DCN_AXES)}")
    dcn = {a: int(dcn_axes.get(a, 1)) for a in DCN_AXES}
    for a, n in dcn.items():
        check(n >= 1 and axes[a] % n == 0, f"dcn {a}={n} must be >= 1 and divide mesh {a}={axes[a]}")
    domains = dcn_domains(topology)
    check(math.prod(dcn.values()) == domains,
          f"dcn axes {_shown(dcn)} multiply to {math.prod(dcn.values())} but the topology has {domains} DCN "
          f"domain(s) (slices, or GPU NVLink domains); make their product {domains}")
    return Mesh(axes=axes, dcn=dcn)


def _shown(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{a}={n}" for a, n in sizes.items() if n != 1) or "all 1"
