"""A user's step through maxperf: what a factory returns (`Step`), loading and calling the factory, checking what it
gives back, and compiling it into the same artifact maxperf's own steps make.

    maxperf compile --step examples.vision_step:make_step --topology v5p-256 batch=1024

The factory is called as `factory(mesh, **args)`: `mesh` is the jax Mesh over the topology's (possibly
compile-only) devices with maxperf's axes (data, fsdp, ..., sized by the `ici_*` / `dcn_*` words), and `args` the
other `key=value` words, each converted to the type of the factory's parameter of that name (its annotation, else
its default's type; text where it has neither, or through `**kwargs`). It returns a `Step`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from maxperf.spec.errors import MaxperfError, closest
from maxperf.spec.steps import StepName, UserRequest

Context = Callable[[], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class Step:
    """A step function and everything maxperf needs to compile, predict and run it.

    fn: the step, a function of `args` (not jitted: maxperf jits it with `donate` and `out_shardings`).
    args: its arguments, each a pytree of `jax.ShapeDtypeStruct` whose `sharding` is a NamedSharding over the
        factory's mesh (or over another mesh of the same devices), a PartitionSpec of the factory's mesh, or None
        (replicated); nothing is allocated.
    donate: the indices of the arguments the step may overwrite (a train state).
    out_shardings: the results' shardings (None: the compiler chooses).
    model_flops: the model FLOPs of one step, all devices together (for TFLOP/s and MFU).
    tokens_per_step: what one step processes, in `unit` (tokens, images, ...), for throughput.
    init: seed -> concrete arguments placed with their shardings, for `maxperf run` (a train state and a batch).
    carry: (arguments, results) -> the next step's arguments; None: a step `(state, ...) -> (state, ...)`, whose
        first result replaces its first argument.
    loss: results -> a scalar that `maxperf run` records per step (None: none recorded).
    compiler_options: XLA options the step needs, beside maxperf's own for the topology.
    context: entered around tracing, lowering and running (None: `jax.set_mesh(mesh)`); a step whose layers read
        a context of their own (flax's logical axis rules, another mesh) enters it here.
    name: what outputs call the step (default: the factory's module and name).
    """

    fn: Callable[..., Any]
    args: tuple
    donate: tuple[int, ...] = ()
    out_shardings: Any = None
    model_flops: float | None = None
    tokens_per_step: float | None = None
    unit: str = "tokens"
    init: Callable[[int], tuple] | None = None
    carry: Callable[[tuple, Any], tuple] | None = None
    loss: Callable[[Any], Any] | None = None
    compiler_options: Mapping[str, Any] = field(default_factory=dict)
    context: Context | None = None
    name: str = ""


class UserStepError(MaxperfError):
    """The user's factory or step failed, or gave something maxperf cannot use: one line, exit 2; `details` holds
    the user's traceback, which `--verbose` prints."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message)
        self.details = details


class Unserializable(UserStepError):
    """The step compiled, but jax cannot pickle its executable: the compile's memory and HLO are written, no
    compiled.pkl."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def traceback_text(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


@contextlib.contextmanager
def _importable_from_here():
    """The working directory on sys.path (as `python -m` has it), for the duration."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def source_digest(name: StepName) -> str | None:
    """The sha256 of the file that defines the factory's module (found as `load_factory` imports it, not imported),
    or None where it is not found: a sweep's point of a user step is computed again when it changes."""
    import hashlib

    try:
        with _importable_from_here():
            if name.module.endswith(".py"):
                path = Path(name.module)
            else:
                spec = importlib.util.find_spec(name.module)
                path = Path(spec.origin) if spec is not None and spec.origin else None
        return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else None
    except (ImportError, ValueError, OSError):
        return None


def load_factory(name: StepName) -> Callable[..., Any]:
    """The factory function `name` names, imported; a UserStepError saying what was expected where it fails."""
    where = f"--step {name}"
    try:
        with _importable_from_here():
            if name.module.endswith(".py"):
                path = Path(name.module)
                if not path.is_file():
                    raise UserStepError(f"{where}: {path} is not a file")
                spec = importlib.util.spec_from_file_location(f"maxperf_user_step_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(name.module)
    except UserStepError:
        raise
    except Exception as e:
        raise UserStepError(f"{where}: importing {name.module} failed ({first_line(e)}); run from the directory that "
                            "holds it or put it on PYTHONPATH (--verbose shows the traceback)",
                            traceback_text(e)) from None
    factory = getattr(module, name.factory, None)
    if factory is None:
        functions = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__]
        hits = closest(name.factory, functions)
        hint = (f"did you mean {', '.join(hits)}?" if hits else
                f"it defines: {', '.join(functions[:8]) or 'no functions'}")
        raise UserStepError(f"{where}: {name.module} has no {name.factory!r}; {hint}")
    if not callable(factory):
        raise UserStepError(f"{where}: {name.module}.{name.factory} is a {type(factory).__name__}, not a function "
                            "that makes the step")
    return factory


def _parameter_type(p: inspect.Parameter) -> type | None:
    kinds = {"int": int, "float": float, "bool": bool, "str": str}
    annotation = p.annotation
    if isinstance(annotation, str):
        text = annotation.replace(" ", "").removeprefix("typing.")
        if text.startswith("Optional[") and text.endswith("]"):
            text = text.removeprefix("Optional[").removesuffix("]")
        annotation = kinds.get(text.removesuffix("|None").removeprefix("None|"))
    else:  # Optional[int], int | None, Union[int, None]: the type beside None
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1 and type(None) in typing.get_args(annotation):
            annotation = members[0]
    if annotation in (int, float, bool, str):
        return annotation
    if p.default is not inspect.Parameter.empty and type(p.default) in (int, float, bool, str):
        return type(p.default)
    return None


def _convert(key: str, text: str, kind: type | None, where: str):
    if kind is None or kind is str:
        return text
    if kind is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise UserStepError(f"{key}={text}: {where} takes true or false for {key}")
    try:
        value = kind(text)
    except ValueError:
        raise UserStepError(f"{key}={text}: {where} takes {'an integer' if kind is int else 'a number'} for "
                            f"{key}") from None
    if kind is float and not math.isfinite(value):
        raise UserStepError(f"{key}={text}: {where} takes a finite number for {key}")
    return value


def factory_arguments(factory: Callable[..., Any], name: StepName, args: Mapping[str, str]) -> dict[str, Any]:
    """The `key=value` words as the factory's keyword arguments, each converted to its parameter's type."""
    where = str(name)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return dict(args)
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise UserStepError(f"--step {where}: the factory must take the mesh as its first argument "
                            "(def make_step(mesh, ...))")
    named = {p.name: p for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    open_ended = any(p.kind == p.VAR_KEYWORD for p in params)
    out = {}
    for key, text in args.items():
        p = named.get(key)
        if p is None and not open_ended:
            hits = closest(key, named)
            hint = f"did you mean {', '.join(hits)}? " if hits else ""
            takes = ", ".join(named) or "nothing but the mesh"
            raise UserStepError(f"{key}={text}: {where} has no parameter {key!r}; {hint}it takes: {takes} (and the "
                                "mesh words ici_* / dcn_*)")
        out[key] = _convert(key, text, _parameter_type(p) if p is not None else None, where)
    missing = [n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in out]
    if missing:
        raise UserStepError(f"--step {where}: give {', '.join(f'{n}=...' for n in missing)} (the factory's "
                            "parameters without a default)")
    return out


def make_step(name: StepName, mesh, args: Mapping[str, str]) -> Step:
    """Imports and calls the factory over `mesh`, and checks what it returns (`check`)."""
    factory = load_factory(name)
    kwargs = factory_arguments(factory, name, args)
    try:
        # what the factory prints goes to stderr: stdout holds the command's own output (one JSON document with --json)
        with contextlib.redirect_stdout(sys.stderr):
            step = factory(mesh, **kwargs)
    except Exception as e:
        raise UserStepError(f"--step {name} raised {first_line(e)} (--verbose shows its traceback)",
                            traceback_text(e)) from None
    except SystemExit as e:  # sys.exit in the factory: not maxperf's exit status (3 would say "does not fit")
        raise UserStepError(f"--step {name} called sys.exit({e.code!r}) while making its step; a factory returns a "
                            "Step (raise an exception to refuse its arguments)") from None
    return check(step, mesh, name)


def check(step: Any, mesh, name: StepName | str) -> Step:
    """The step with every argument's sharding made a NamedSharding; a UserStepError for anything maxperf cannot
    compile: not a Step, a step that is not callable, concrete arrays, shardings over axes or devices the mesh does
    not have, bad donation indices, throughput figures that are not positive numbers."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    where = f"--step {name}"
    if not isinstance(step, Step):
        raise UserStepError(f"{where} returned a {type(step).__name__}, not a maxperf Step (from "
                            "maxperf.aot.user_step import Step)")
    if not callable(step.fn):
        raise UserStepError(f"{where}: Step.fn is a {type(step.fn).__name__}, not the step function")
    if not isinstance(step.args, (tuple, list)):
        raise UserStepError(f"{where}: Step.args is a {type(step.args).__name__}; give a tuple of the step's "
                            "arguments (pytrees of jax.ShapeDtypeStruct)")
    devices = {d.id for d in mesh.devices.flat}
    leaves, tree = jax.tree_util.tree_flatten_with_path(tuple(step.args))
    fixed = []
    for path, leaf in leaves:
        at = f"Step.args{jax.tree_util.keystr(path)}"
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
            raise UserStepError(f"{where}: {at} is a concrete {type(leaf).__name__}; give a jax.ShapeDtypeStruct "
                                "(shape, dtype, sharding), e.g. from jax.eval_shape, so that nothing is allocated")
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise UserStepError(f"{where}: {at} is a {type(leaf).__name__}, not a jax.ShapeDtypeStruct")
        try:
            with jax.set_mesh(mesh):  # a PartitionSpec is read against the mesh the factory received
                sharding = leaf.sharding
        except ValueError as e:
            raise UserStepError(f"{where}: {at} is sharded over an axis the mesh lacks (its axes: "
                                f"{', '.join(mesh.axis_names)}): {first_line(e)}") from None
        if sharding is None:
            sharding = NamedSharding(mesh, PartitionSpec())
        elif isinstance(sharding, NamedSharding):
            if {d.id for d in sharding.mesh.devices.flat} != devices:
                raise UserStepError(f"{where}: {at} is sharded over a mesh of other devices than the topology's; "
                                    "shard over the mesh the factory receives")
        else:
            raise UserStepError(f"{where}: {at} has a {type(sharding).__name__}; give a NamedSharding over the "
                                "mesh the factory receives (or a PartitionSpec, or None to replicate)")
        fixed.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
    donate = tuple(step.donate) if isinstance(step.donate, (tuple, list)) else (step.donate,)
    bad = [i for i in donate if not isinstance(i, int) or not 0 <= i < len(step.args)]
    if bad:
        raise UserStepError(f"{where}: Step.donate {bad} is not an index of its {len(step.args)} arguments")
    for figure in ("model_flops", "tokens_per_step"):
        value = getattr(step, figure)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise UserStepError(f"{where}: Step.{figure} should be a positive number or None, not {value!r}")
    for hook in ("init", "carry", "loss", "context"):
        if getattr(step, hook) is not None and not callable(getattr(step, hook)):
            raise UserStepError(f"{where}: Step.{hook} should be a function or None")
    args = jax.tree_util.tree_unflatten(tree, fixed)
    return replace(step, args=tuple(args), donate=donate, name=step.name or str(name))


def context(step: Step, mesh) -> contextlib.AbstractContextManager:
    """What tracing, lowering and running the step happen inside."""
    import jax

    return step.context() if step.context is not None else jax.set_mesh(mesh)


def describe(request: UserRequest, step: Step) -> dict[str, Any]:
    """The manifest's `step`: what `maxperf run` needs to call the factory again, and the step's figures."""
    return {"kind": "user", "factory": str(request.step), "module": request.step.module,
            "function": request.step.factory, "args": dict(request.args), "name": step.name,
            "model_flops": step.model_flops, "tokens_per_step": step.tokens_per_step, "unit": step.unit,
            "donate": list(step.donate)}
