"""The three configs of a request together, and their JSON form read back."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from maxperf.spec.model import ModelConfig
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.train import TrainConfig


@dataclass(frozen=True)
class Configs:
    model: ModelConfig
    train: TrainConfig
    parallelism: ParallelismConfig


def from_dict(cls, data: dict):
    """Rebuilds a config dataclass from its JSON form (enums from their values, nested configs recursively)."""
    import types
    import typing

    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        kind, value = hints[f.name], data[f.name]
        options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
        dataclass_options = [o for o in options if dataclasses.is_dataclass(o)]
        if isinstance(value, dict) and len(dataclass_options) > 1:
            # a union of configs (rope_scaling): the one whose fields are the stored keys
            options = [o for o in dataclass_options if {f.name for f in dataclasses.fields(o)} == set(value)]
        if value is not None:
            for option in options:
                if isinstance(option, type) and issubclass(option, enum.Enum):
                    value = option(value)
                elif dataclasses.is_dataclass(option):
                    value = from_dict(option, value)
        values[f.name] = value
    return cls(**values)
