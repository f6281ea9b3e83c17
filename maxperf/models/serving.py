"""The serving steps of maxperf's models: prefill and decode with a key/value cache (layers/kv_cache.py).

- prefill: B prompts of P tokens (MaxText's max_prefill_predict_length) into a fresh cache of S positions
  (max_target_length); gives the cache and each prompt's next token (greedy).
- decode: one token for each of B sequences at its own position against the cache; gives the cache with that
  position stored (donated: updated in place) and each sequence's next token.

B is per_device_batch_size x devices, as MaxText's inference configs count it. The weights are served in the
compute dtype, or with `quantization=int8` (`fp8`) stored in int8 (float8_e4m3fn) with a float32 scale per channel of
the last axis (absmax / 127, / 448 for e4m3, over the other axes) and widened at their use, as MaxText serves an int8
checkpoint (`checkpoint_is_quantized`) and TensorRT-LLM an FP8 one;
the embedding table, the output head and the norms stay in the compute dtype. Multi-token-prediction modules are
training-only and not built. The steps take no pipeline stages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxperf.models import train_step
from maxperf.models.layers import attention_kernels, kv_cache
from maxperf.models.sharding import constrain, partition_spec
from maxperf.models.transformer import stacks
from maxperf.spec.errors import MaxperfError
from maxperf.spec.logical_axes import RULES
from maxperf.spec.model import AttentionType, ModelConfig
from maxperf.spec.train import Quantization, TrainConfig

PREFILL, DECODE = kv_cache.PREFILL, kv_cache.DECODE
STEPS = (PREFILL, DECODE)
# the stored dtype of quantized weights, and its largest value
STORAGE = {Quantization.INT8: (jnp.int8, 127.0), Quantization.FP8: (jnp.float8_e4m3fn, 448.0)}
UNQUANTIZED = ("embed", "unembed", "positions")  # top-level parameters kept in the compute dtype
TOKENS_AXES = ("cache_batch", None)


def check_weights(train: TrainConfig) -> None:
    """The weights the serving steps build: in the compute dtype, or stored int8 or fp8 (STORAGE); else one line."""
    if train.quantization not in (Quantization.NONE, *STORAGE):
        raise MaxperfError(f"quantization={train.quantization}: the serving steps take int8 or fp8 weights "
                           "(quantization=int8 or fp8) or none")


def serving_configs(model: ModelConfig, train: TrainConfig) -> tuple[ModelConfig, TrainConfig]:
    """The model without its training-only modules, and the step's settings: weights in the compute dtype, no
    remat, no training quantization (int8 weights are stored so instead)."""
    check_weights(train)
    model = dataclasses.replace(model, mtp_num_layers=0)
    train = dataclasses.replace(train, param_dtype=train.compute_dtype, quantization=Quantization.NONE,
                                grad_accum_steps=1, remat_policy="none", parameter_memory_host_offload=False,
                                optimizer_memory_host_offload=False)
    return model, train


def storage(train: TrainConfig) -> tuple | None:
    """(dtype, largest value) of the stored weights where they are quantized; None in the compute dtype."""
    return STORAGE.get(train.quantization)


def quant_axis(train: TrainConfig) -> str | None:
    return train.kv_quant_axis if train.quantize_kvcache else None


def _quantized(path: tuple, logical: tuple) -> bool:
    """A matmul's weight: two or more axes besides the layer axis, outside the embeddings and the head."""
    return path[0] not in UNQUANTIZED and len([a for a in logical if a not in ("layers", "stage_layers")]) >= 2


def _channel_axes(logical: tuple) -> tuple[int, ...]:
    """The axes a weight's int8 scale keeps: its last (the output channel) and its layer axis."""
    return tuple(i for i, a in enumerate(logical) if a in ("layers", "stage_layers")) + (len(logical) - 1,)


def quantize_weight(w: jax.Array, logical: tuple, dtype, bound: float) -> dict[str, jax.Array]:
    keep = _channel_axes(logical)
    reduce = tuple(i for i in range(w.ndim) if i not in keep)
    scale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=reduce, keepdims=True) / bound
    q = w.astype(jnp.float32) / jnp.where(scale == 0, 1.0, scale)
    if jnp.issubdtype(dtype, jnp.integer):
        q = jnp.round(q)
    return {"q": jnp.clip(q, -bound, bound).astype(dtype), "scale": scale}


def _map_weights(fn, params: dict, logical: dict, path: tuple = ()) -> dict:
    out = {}
    for key, value in params.items():
        if isinstance(value, dict) and not _is_quantized(value):
            out[key] = _map_weights(fn, value, logical[key], (*path, key))
        else:
            out[key] = fn((*path, key), value, logical[key])
    return out


def _is_quantized(node) -> bool:
    return isinstance(node, dict) and set(node) == {"q", "scale"}


def widen(params: dict, dtype) -> dict:
    """The weights in the compute dtype: quantized ones times their scales (all at once: for tests and references;
    the steps widen one layer at a time, `split_quantized`)."""
    return jax.tree.map(lambda n: (n["q"].astype(dtype) * n["scale"].astype(dtype)) if _is_quantized(n) else n,
                        params, is_leaf=_is_quantized)


def split_quantized(params: dict) -> tuple[dict, dict[str, jax.Array]]:
    """(the weights with each quantized one as its stored values, their scales by "/"-joined path): the module
    holds the narrow values and the decoder widens each layer's inside its loop (Transformer.serve)."""
    scales: dict[str, jax.Array] = {}

    def walk(node, path):
        if _is_quantized(node):
            scales["/".join(path)] = node["scale"]
            return node["q"]
        if isinstance(node, dict):
            return {k: walk(v, (*path, str(k))) for k, v in node.items()}
        return node

    return walk(params, ()), scales


@dataclass(frozen=True)
class CacheArray:
    shape: tuple[int, ...]
    dtype: Any
    logical: tuple


def heads_first(platform: str) -> bool:
    """Whether the grouped-query cache is stored [B, K, S, Dh] (GPUs, CPUs) or [B, S, K, Dh] (TPUs): what each
    compiler's decode matmuls read in place (layers/kv_cache.py)."""
    return platform != "tpu"


def cache_layout(model: ModelConfig, train: TrainConfig, B: int, first: bool = True
                 ) -> dict[str, list[dict[str, CacheArray]]]:
    """For each stack of the decoder, one cache per layer of its repeating unit, with the stack's repeats first;
    `first`: heads_first."""
    S, dtype = train.seq_len, jnp.dtype(train.compute_dtype)
    axis = quant_axis(train)
    out = {}
    for st in stacks(model):
        pre, pre_axes = (st.count,), ("layers",)
        if model.attention_type is AttentionType.MLA:
            tensors = {"c": ((B, S, model.kv_lora_rank), kv_cache.axes("latent")),
                       "kr": ((B, S, model.qk_rope_head_dim), kv_cache.axes("latent"))}
        else:
            K, Dh = model.num_kv_heads, model.head_dim
            tensors = {name: ((B, K, S, Dh) if first else (B, S, K, Dh), kv_cache.axes("kv", first))
                       for name in ("k", "v")}
        layer = {}
        for name, (shape, logical) in tensors.items():
            if axis is None:
                layer[name] = CacheArray(pre + shape, dtype, pre_axes + logical)
                continue
            layer[name] = CacheArray(pre + shape, jnp.int8, pre_axes + logical)
            if len(shape) == 4 and axis == "dkv":
                scale_shape, scale_axes = shape[:3], kv_cache.axes("dkv", first)  # [B, K, S] or [B, S, K]
            else:
                scale_shape, scale_axes = (B, S), kv_cache.axes("heads_and_dkv")
            layer[f"{name}_scale"] = CacheArray(pre + scale_shape, dtype, pre_axes + scale_axes)
        out[st.name] = [dict(layer) for _ in st.pattern]
    return out


def cache_bytes(layout: dict[str, list[dict[str, CacheArray]]]) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for layers in layout.values() for layer in layers
               for a in layer.values())


def empty_cache(layout: dict[str, list[dict[str, CacheArray]]]) -> dict:
    return jax.tree.map(lambda a: constrain(jnp.zeros(a.shape, a.dtype), a.logical), layout,
                        is_leaf=lambda x: isinstance(x, CacheArray))


@dataclass(frozen=True)
class AbstractServe:
    """Shapes and shardings of what a serving step takes, over one mesh; nothing allocated. `args` in the step's
    order: (params, batch) for prefill, (params, cache, batch) for decode."""

    kind: str
    model: ModelConfig
    train: TrainConfig
    mesh: Mesh
    args: tuple
    arg_shardings: tuple
    out_shardings: tuple
    donate: tuple[int, ...]
    param_count: int

    @property
    def global_batch(self) -> int:
        return self.batch["tokens"].shape[0]

    @property
    def micro_batch(self) -> int:
        return self.global_batch

    @property
    def batch(self) -> dict:
        return self.args[-1]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * (self.train.max_prefill_predict_length if self.kind == PREFILL else 1)

    def jitted(self):
        first = heads_first(self.mesh.devices.flat[0].platform)
        make = make_prefill if self.kind == PREFILL else make_decode
        fn = make(self.model, self.train, first)
        return jax.jit(fn, in_shardings=self.arg_shardings, out_shardings=self.out_shardings,
                       donate_argnums=self.donate)


def batch_shards(sizes: dict[str, int]) -> int:
    return math.prod(sizes.get(a, 1) for a in RULES["cache_batch"])


def check(model: ModelConfig, train: TrainConfig, devices: int, sizes: dict[str, int], kind: str) -> None:
    """A serving request's bad input, one line each: an unknown step, a prompt longer than the cache, a batch the
    mesh cannot split, pipeline stages."""
    if kind not in STEPS:
        raise MaxperfError(f"--step {kind}: the serving steps are {' and '.join(STEPS)}")
    check_weights(train)
    P, S = train.max_prefill_predict_length, train.seq_len
    if P > S:
        raise MaxperfError(f"max_prefill_predict_length={P} is longer than the cache (max_target_length={S}): a "
                           f"prompt must fit in the cache; set max_target_length >= {P}")
    if kind == DECODE and P == S:
        raise MaxperfError(f"max_prefill_predict_length={P} fills the cache (max_target_length={S}): a decode step "
                           f"needs positions after the prompt; set max_target_length > {P}")
    if sizes.get("stage", 1) > 1:
        raise MaxperfError("the serving steps take no pipeline stages: drop ici_pipeline_parallelism / "
                           "dcn_pipeline_parallelism")
    B = train.micro_batch(devices)
    shards = batch_shards(sizes)
    if B % shards:
        raise MaxperfError(f"a batch of {B} sequences (per_device_batch_size={train.per_device_batch_size} x "
                           f"{devices} devices) cannot be split over the mesh's {shards} batch shards (data x fsdp x "
                           f"expert): use a batch that {shards} divides, or shard the model over tensor instead")


def abstract_serve(model: ModelConfig, train: TrainConfig, mesh: Mesh, kind: str) -> AbstractServe:
    sizes = dict(mesh.shape)
    check(model, train, mesh.size, sizes, kind)
    stored = storage(train)
    smodel, strain = serving_configs(model, train)
    attention_kernels.check(smodel, strain, attention_kernels.platform_kind(mesh.devices.flat[0].platform))
    md = train_step.model_def(smodel, strain)

    def abstract(path, x, logical):
        if stored and _quantized(path, logical):
            keep = _channel_axes(logical)
            return {"q": jax.ShapeDtypeStruct(x.shape, stored[0]),
                    "scale": jax.ShapeDtypeStruct(tuple(n if i in keep else 1 for i, n in enumerate(x.shape)),
                                                  jnp.float32)}
        return x

    params = _map_weights(abstract, md.params, md.logical_axes)

    def shard(path, x, logical):
        if _is_quantized(x):
            return {k: NamedSharding(mesh, partition_spec(v.shape, logical, sizes)) for k, v in x.items()}
        return NamedSharding(mesh, partition_spec(x.shape, logical, sizes))

    param_shardings = _map_weights(shard, params, md.logical_axes)
    B = train.micro_batch(mesh.size)
    layout = cache_layout(smodel, strain, B, heads_first(mesh.devices.flat[0].platform))
    is_array = lambda x: isinstance(x, CacheArray)  # noqa: E731
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layout, is_leaf=is_array)
    cache_shardings = jax.tree.map(lambda a: NamedSharding(mesh, partition_spec(a.shape, a.logical, sizes)), layout,
                                   is_leaf=is_array)
    next_sharding = NamedSharding(mesh, PartitionSpec(*partition_spec((B, 1), TOKENS_AXES, sizes)[:1]))
    if kind == PREFILL:
        P = train.max_prefill_predict_length
        batch = {"tokens": jax.ShapeDtypeStruct((B, P), jnp.int32)}
        batch_shardings = {"tokens": NamedSharding(mesh, partition_spec((B, P), TOKENS_AXES, sizes))}
        args, shardings, outs, donate = (params, batch), (param_shardings, batch_shardings), (
            cache_shardings, next_sharding), ()
    else:
        batch = {"tokens": jax.ShapeDtypeStruct((B,), jnp.int32), "positions": jax.ShapeDtypeStruct((B,), jnp.int32)}
        batch_shardings = {k: next_sharding for k in batch}
        args, shardings, outs, donate = (params, cache, batch), (param_shardings, cache_shardings, batch_shardings), (
            cache_shardings, next_sharding), (1,)
    return AbstractServe(kind=kind, model=model, train=train, mesh=mesh, args=args, arg_shardings=shardings,
                         out_shardings=outs, donate=donate, param_count=md.param_count)


def _network(model: ModelConfig, train: TrainConfig):
    smodel, strain = serving_configs(model, train)
    return smodel, strain, train_step.model_def(smodel, strain).graphdef


def make_prefill(model: ModelConfig, train: TrainConfig, first: bool = True) -> Callable:
    """(params, {"tokens": [B, P]}) -> (cache, next tokens [B])."""
    smodel, strain, graphdef = _network(model, train)
    axis = quant_axis(train)

    def prefill(params, batch):
        values, scales = split_quantized(params)
        net = nnx.merge(graphdef, values)
        tokens_BxP = batch["tokens"]
        positions_BxP = jnp.broadcast_to(jnp.arange(tokens_BxP.shape[1], dtype=jnp.int32), tokens_BxP.shape)
        caches = empty_cache(cache_layout(smodel, strain, tokens_BxP.shape[0], first))
        logits_Bx1xV, caches = net.serve(tokens_BxP, positions_BxP, caches, PREFILL, axis, scales, first)
        return caches, jnp.argmax(logits_Bx1xV[:, 0], axis=-1).astype(jnp.int32)

    return prefill


def make_decode(model: ModelConfig, train: TrainConfig, first: bool = True) -> Callable:
    """(params, cache, {"tokens": [B], "positions": [B]}) -> (cache, next tokens [B]): each sequence's token at its
    position (the number of tokens before it)."""
    _, strain, graphdef = _network(model, train)
    axis = quant_axis(train)

    def decode(params, caches, batch):
        values, scales = split_quantized(params)
        net = nnx.merge(graphdef, values)
        logits_Bx1xV, caches = net.serve(batch["tokens"][:, None], batch["positions"][:, None], caches, DECODE, axis,
                                         scales, first)
        return caches, jnp.argmax(logits_Bx1xV[:, 0], axis=-1).astype(jnp.int32)

    return decode


def init_params(model: ModelConfig, train: TrainConfig, seed: int = 0) -> dict:
    """Concrete serving weights from a seed (quantized ones from the same initialization)."""
    smodel, strain = serving_configs(model, train)
    md = train_step.model_def(smodel, strain)
    params = nnx.to_pure_dict(nnx.state(train_step.build_model(smodel, strain, nnx.Rngs(params=seed))))
    if (stored := storage(train)) is None:
        return params
    return _map_weights(lambda path, w, logical: quantize_weight(w, logical, *stored) if _quantized(path, logical)
                        else w, params, md.logical_axes)
