"""Which step a command compiles, and the request of a user's step: a built-in step by name, or a user's factory
(`--step MODULE:FACTORY`) with the mesh it receives and the `key=value` words passed through to it.

A `--step` value is a user's factory when it holds ':' (`examples.vision_step:make_step`, or `path/to/file.py:fn`)
or names an importable module (whose factory is then `make_step`); any other value must be a built-in step's name.
Built-in steps are maxperf's own (the train step of `--model`); others may be added beside it (serving steps).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from maxperf.spec import mesh as mesh_mod
from maxperf.spec import overrides as overrides_mod
from maxperf.spec import presets
from maxperf.spec import topology as topologies
from maxperf.spec.errors import MaxperfError
from maxperf.spec.mesh import Mesh
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.topology import Topology

BUILTIN = ("train", "prefill", "decode")  # maxperf's own steps, by name (the serving steps: models/serving.py)
DEFAULT = "train"
DEFAULT_FACTORY = "make_step"  # the factory of a `--step MODULE` that names no function


@dataclass(frozen=True)
class StepName:
    """A `--step` value read: `builtin` for maxperf's own steps, else a user's `module` (a dotted name or a .py
    file) and its `factory`."""

    builtin: str | None = None
    module: str | None = None
    factory: str | None = None

    @property
    def is_user(self) -> bool:
        return self.builtin is None

    def __str__(self) -> str:
        return self.builtin if self.builtin is not None else f"{self.module}:{self.factory}"


def importable(module: str) -> bool:
    """Whether `module` names a module Python can import from here (the working directory first, as `python -m`
    does), without importing it."""
    if module.endswith(".py"):
        return Path(module).is_file()
    if not module.replace(".", "").replace("_", "").isalnum():
        return False
    added = _working_directory_on_path()
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    finally:
        if added:
            sys.path.remove(added)


def _working_directory_on_path() -> str | None:
    cwd = os.getcwd()
    if cwd in sys.path or "" in sys.path:
        return None
    sys.path.insert(0, cwd)
    return cwd


def parse_step(value: str) -> StepName:
    """A `--step` value as a built-in step or a user's factory; anything else is a MaxperfError saying what is
    valid."""
    value = value.strip()
    if ":" in value:
        module, _, factory = value.rpartition(":")
        if not module or not factory or not factory.isidentifier():
            raise MaxperfError(f"--step {value}: give MODULE:FACTORY, e.g. examples.vision_step:make_step "
                               "(a dotted module or a .py file, and the function in it that makes the step)")
        return StepName(module=module, factory=factory)
    if value in BUILTIN:
        return StepName(builtin=value)
    if importable(value):
        return StepName(module=value, factory=DEFAULT_FACTORY)
    raise MaxperfError(f"--step {value}: not a built-in step ({', '.join(BUILTIN)}) nor an importable module; a "
                       f"user's step is MODULE:FACTORY (e.g. examples.vision_step:make_step)")


@dataclass(frozen=True)
class UserRequest:
    """A user's step on a topology: the mesh its factory receives, resolved from the `ici_*` / `dcn_*` words as
    for maxperf's own steps, and the other `key=value` words, which go to the factory as they were written."""

    topology: Topology
    step: StepName
    parallelism: ParallelismConfig
    mesh: Mesh
    args: dict[str, str]  # key -> value, in the order given

    def default_dir(self) -> Path:
        slices = f"_x{self.topology.num_slices}" if self.topology.num_slices > 1 else ""
        name = Path(self.step.module or "step").stem.replace(".", "_")
        return Path("artifacts") / f"{name}_{self.step.factory}_{self.topology.name}{slices}"

    @property
    def words(self) -> list[str]:
        """The request's words as a user writes them: the mesh's, then the factory's."""
        mesh = [f"{f.name}={getattr(self.parallelism, f.name)}" for f in dataclasses.fields(ParallelismConfig)
                if getattr(self.parallelism, f.name) != getattr(ParallelismConfig(), f.name)]
        return mesh + [f"{k}={v}" for k, v in self.args.items()]


def mesh_keys() -> set[str]:
    """The keys (and MaxText's spellings of them) that set the mesh rather than pass through to a factory."""
    fields = {f.name for f in dataclasses.fields(ParallelismConfig) if f.name.startswith(("ici_", "dcn_"))}
    return fields | {alias for alias, name in overrides_mod.ALIASES.items() if name in fields}


def resolve_user(topology: str | Topology, step: StepName | str, words: Sequence[str] = (), *, num_slices: int = 1,
                 target_config: str | os.PathLike | None = None) -> UserRequest:
    """The topology, the mesh from the words that set it, and the factory's own words; a bad word, a mesh that does
    not span the topology, or a key given twice is a MaxperfError."""
    name = step if isinstance(step, StepName) else parse_step(step)
    if not name.is_user:
        raise MaxperfError(f"--step {name} is maxperf's own step: compile it with --model")
    topo = topology if isinstance(topology, Topology) else topologies.get(
        topology, num_slices=num_slices, target_config_path=None if target_config is None else str(target_config))
    keys = mesh_keys()
    mesh_words: list[str] = []
    args: dict[str, str] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise MaxperfError(f"{word!r} is not key=value (e.g. ici_fsdp=8, or batch=64 for the step's factory)")
        if key in keys:
            mesh_words.append(word)
        elif key in args:
            raise MaxperfError(f"{key} is given twice ({key}={args[key]} and {word}); give it once")
        else:
            args[key] = value
    parallelism = overrides_mod.apply(presets.get(presets.DEFAULT_MODEL), mesh_words).parallelism
    return UserRequest(topo, name, parallelism, mesh_mod.resolve(parallelism, topo), args)
