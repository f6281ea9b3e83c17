"""`key=value` overrides of the model, training and parallelism configs, with MaxText's spellings as aliases."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from maxperf.spec.errors import MaxperfError, closest
from maxperf.spec.model import ModelConfig
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.remat import RematPolicy
from maxperf.spec.train import AttentionKernel, Quantization, TrainConfig

# MaxText's names (MaxText/configs/base.yml) for the same settings.
ALIASES = {
    "max_target_length": "seq_len",
    "fsdp_shard_on_exp": "shard_exp_on_fsdp",  # MaxText's earlier name
    "dtype": "compute_dtype",
    "weight_dtype": "param_dtype",
    "gradient_accumulation_steps": "grad_accum_steps",
    "gradient_clipping_threshold": "grad_clip_norm",
    "adam_weight_decay": "weight_decay",
    "learning_rate_schedule_steps": "decay_steps",
    "cosine_learning_rate_final_fraction": "min_lr_ratio",
    "learning_rate_final_fraction": "min_lr_ratio",  # its later name
    "init_weights_seed": "seed",
    "ici_data_parallelism": "ici_data",
    "ici_fsdp_parallelism": "ici_fsdp",
    "ici_fsdp_transpose_parallelism": "ici_fsdp_transpose",
    "ici_sequence_parallelism": "ici_sequence",
    "ici_context_parallelism": "ici_sequence",
    "ici_tensor_parallelism": "ici_tensor",
    "ici_expert_parallelism": "ici_expert",
    "ici_pipeline_parallelism": "ici_stage",
    "dcn_data_parallelism": "dcn_data",
    "dcn_fsdp_parallelism": "dcn_fsdp",
    "dcn_fsdp_transpose_parallelism": "dcn_fsdp_transpose",
    "dcn_sequence_parallelism": "dcn_sequence",
    "dcn_context_parallelism": "dcn_sequence",
    "dcn_tensor_parallelism": "dcn_tensor",
    "dcn_expert_parallelism": "dcn_expert",
    "dcn_pipeline_parallelism": "dcn_stage",
    "base_emb_dim": "d_model",
    "base_num_query_heads": "num_heads",
    "base_num_kv_heads": "num_kv_heads",
    "base_mlp_dim": "d_ff",
    "base_num_decoder_layers": "num_layers",
    "mlp_activations": "activation",
    "sliding_window_size": "window",
    "logits_via_embedding": "tie_embeddings",
    "rope_max_timescale": "rope_theta",
    "local_rope_max_timescale": "local_rope_theta",
    "final_logits_soft_cap": "final_logit_softcap",
    "attn_logits_soft_cap": "attn_logit_softcap",
    "use_qk_norm": "qk_norm",
    "attention_sink": "attention_sinks",
    "normalization_layer_epsilon": "norm_eps",
    "moe_mlp_dim": "base_moe_mlp_dim",
}

# Upper bounds of the numeric keys: beyond any model or step trained today by orders of magnitude, and low enough
# that every figure maxperf prints stays meaningful (per_device_batch_size=1e20 made a step of 4e19 s). The
# configs check the lower bounds and the relations between keys.
LIMITS: dict[str, float] = {
    "per_device_batch_size": 1 << 16, "seq_len": 1 << 21, "grad_accum_steps": 1 << 16,  # B, L
    "vocab_size": 1 << 22, "d_model": 1 << 17, "num_layers": 1 << 12, "num_heads": 1 << 12,  # V, D, N, H
    "num_kv_heads": 1 << 12, "head_dim": 1 << 12, "d_ff": 1 << 20, "max_position": 1 << 21,  # K, Dh, F
    "window": 1 << 21, "local_per_global": 1 << 10,  # W
    "warmup_steps": 10**9, "decay_steps": 10**9, "seed": 2**32 - 1,
    "learning_rate": 10.0, "weight_decay": 10.0, "min_lr_ratio": 1.0, "adam_b1": 1.0, "adam_b2": 1.0,
    "adam_eps": 1.0, "grad_clip_norm": 1e6, "norm_eps": 1.0, "rope_theta": 1e12, "query_scale": 1e3,
    "attn_logit_softcap": 1e6, "final_logit_softcap": 1e6,
    # mixtures of experts (E, top-k, F of an expert); Kimi K2 has 384 experts, DeepSeek-V3 8 routing groups
    "num_experts": 1 << 14, "num_experts_per_tok": 1 << 10, "base_moe_mlp_dim": 1 << 20, "shared_experts": 1 << 10,
    "first_num_dense_layers": 1 << 12, "interleave_moe_layer_step": 1 << 12, "n_routing_groups": 1 << 14,
    "topk_routing_group": 1 << 14, "routed_scaling_factor": 1e3, "capacity_factor": 1e3,
    "load_balance_loss_weight": 1e3, "moe_load_imbalance": 1e3,
}
DEVICE_LIMIT = 1 << 20  # a mesh axis (ici_*, dcn_*): more devices than any machine has
OTHER_INT_LIMIT = 1 << 21  # any integer key not named above (splash attention tiles: at most a sequence)
OTHER_FLOAT_LIMIT = 1e12

_CONFIGS = {"model": ModelConfig, "train": TrainConfig, "parallelism": ParallelismConfig}
_FIXED = {"name", "rope_scaling"}  # not settable from the command line
# MaxText's spellings of values: its `attention=autoselected` is maxperf's `auto`, its `quantization=""` `none`
# (which `bf16` names too, beside `auto` and `fp8`, as `maxperf plan`'s precision choice); its remat_policy
# `minimal_flash`, which its layers/decoders.py still takes for minimal_with_context (with a deprecation warning).
VALUE_ALIASES = {(AttentionKernel, "autoselected"): "auto", (Quantization, ""): "none", (Quantization, "bf16"): "none",
                 (RematPolicy, "minimal_flash"): "minimal_with_context"}


# maxperf's settings that two of MaxText's keys set, where in MaxText they are two axes
TWO_AXES_IN_MAXTEXT = {"ici_sequence": {"ici_sequence_parallelism", "ici_context_parallelism"},
                       "dcn_sequence": {"dcn_sequence_parallelism", "dcn_context_parallelism"}}


@functools.cache
def _fields() -> Mapping[str, tuple[str, type]]:
    """Each settable field's config part and type (read once: typing.get_type_hints evaluates every annotation anew,
    and a plan or a bench resolves thousands of requests)."""
    out = {}
    for part, cls in _CONFIGS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in _FIXED:
                out[f.name] = (part, hints[f.name])
    return types.MappingProxyType(out)


def valid_keys() -> list[str]:
    return sorted(_fields())


def setting(key: str, text: str = "") -> tuple[str, object]:
    """The setting a key names (its own name for MaxText's spellings) and, where `text` is given, the value it takes
    (None where the key is unknown or the text does not parse: `apply` says why)."""
    name = ALIASES.get(key, key)
    fields = _fields()
    if name not in fields or not text:
        return name, None
    try:
        return name, _parse(key, text, fields[name][1])
    except MaxperfError:
        return name, None


def _parse(key: str, text: str, kind: type):
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null"):
            if type(None) in args:
                return None
        kind = next(a for a in args if a is not type(None))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        text = VALUE_ALIASES.get((kind, text.lower()), text)
        choices = [m.value for m in kind]
        if text.lower() not in choices:
            hits = closest(text, choices)
            hint = f"did you mean {hits[0]}? " if hits else ""
            raise MaxperfError(f"{key}={text} is not valid; {hint}valid values: {', '.join(choices)}")
        return kind(text.lower())
    if kind is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise MaxperfError(f"{key}={text} is not valid; use true or false")
    try:
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise MaxperfError(f"{key}={text} is not valid; {key} takes a{'n integer' if kind is int else ' number'}")
    return text


def limit(name: str, part: str, value: int | float) -> float:
    """The largest value `name` takes."""
    if name in LIMITS:
        return LIMITS[name]
    if part == "parallelism":
        return DEVICE_LIMIT
    return OTHER_INT_LIMIT if isinstance(value, int) else OTHER_FLOAT_LIMIT


def _bounded(key: str, name: str, part: str, value, text: str | None = None):
    """`value` when it is a finite number within its key's upper bound (or no number); else a MaxperfError naming
    `text`, the value as the user wrote it, where given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise MaxperfError(f"{key}={value} is not valid; {key} takes a finite number")
    top = limit(name, part, value)
    if value > top:
        shown = int(top) if isinstance(value, int) else f"{top:g}"
        raise MaxperfError(f"{key}={value if text is None else text} is too large; {key} takes at most {shown}")
    return value


@dataclass(frozen=True)
class Configs:
    model: ModelConfig
    train: TrainConfig
    parallelism: ParallelismConfig


# MaxText's mixtral block (models/mixtral.py) makes its experts `mlp_dim` wide and adds no shared expert: these keys
# are not read there
MIXTRAL_UNREAD = frozenset({"base_moe_mlp_dim", "shared_experts"})


def apply(model: ModelConfig, words: list[str], train: TrainConfig | None = None,
          parallelism: ParallelismConfig | None = None) -> Configs:
    """Applies `key=value` words; an unknown key or a bad value raises MaxperfError naming what is valid."""
    fields = _fields()
    changes: dict[str, dict] = {part: {} for part in _CONFIGS}
    spelled: dict[str, tuple[str, str]] = {}  # field -> the key and text that last set it
    for word in words:
        key, sep, text = word.partition("=")
        if not sep or not key:
            raise MaxperfError(f"override {word!r} is not key=value (e.g. per_device_batch_size=4)")
        name = ALIASES.get(key, key)
        if name not in fields:
            hits = closest(key, [*fields, *ALIASES])
            hint = f"did you mean {', '.join(hits)}?" if hits else "`maxperf keys` lists the valid keys"
            raise MaxperfError(f"unknown override key {key!r}; {hint}")
        if name in MIXTRAL_UNREAD and model.name.startswith("mixtral"):
            raise MaxperfError(f"{key}={text}: MaxText's mixtral block builds its experts base_mlp_dim wide and has no "
                               "shared experts, whatever base_moe_mlp_dim and shared_experts say: give base_mlp_dim "
                               "for the experts' width")
        part, kind = fields[name]
        value = _bounded(key, name, part, _parse(key, text, kind), text)
        # one setting spelled two ways with two values is a mistake; the same key given again takes the last value,
        # as MaxText's command line does
        earlier = spelled.get(name)
        if earlier is not None and earlier[0] != key and {earlier[0], key} <= TWO_AXES_IN_MAXTEXT.get(name, set()):
            # MaxText's sequence and context axes are two; maxperf's one sequence axis is its context axis, which
            # either name sets where the other is 1: both over 1 would be MaxText's two axes, which maxperf does not
            # build
            previous = changes[part][name]
            if previous not in (1, None) and value not in (1, None):
                raise MaxperfError(f"{earlier[0]}={earlier[1]} and {key}={text} are two mesh axes in MaxText "
                                   "(sequence and context); maxperf has one, its sequence axis, which is MaxText's "
                                   "context parallelism: give one of them")
            if value in (1, None):
                continue  # the other name's size stands
        elif earlier is not None and earlier[0] != key and changes[part][name] != value:
            raise MaxperfError(f"{earlier[0]}={earlier[1]} and {key}={text} set the same {name}: give one")
        spelled[name] = (key, text)
        changes[part][name] = value
    configs = Configs(
        model=dataclasses.replace(model, **changes["model"]),
        train=dataclasses.replace(train or TrainConfig(), **changes["train"]),
        parallelism=dataclasses.replace(parallelism or ParallelismConfig(), **changes["parallelism"]),
    )
    for part in _CONFIGS:  # a preset or a config object passed in holds to the same bounds
        config = getattr(configs, part)
        for f in dataclasses.fields(config):
            _bounded(f.name, f.name, part, getattr(config, f.name))
    return configs
