"""Artifact directories: written atomically, hashed, and read back without trusting their contents.

`compiled.pkl` is a pickle of plain Python values only (dict, str, bytes, int, ...): reading it goes through an
unpickler that refuses every class. The executable inside is jax's own serialized form; before jax unpickles it,
every class it names is checked against the modules that jax's executables are made of, so a crafted file cannot
reach os, subprocess, builtins.eval and the like.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import io
import json
import os
import pickle
import pickletools
import shutil
import tempfile
from pathlib import Path
from typing import Any

from maxperf.errors import MaxperfError

MANIFEST_SCHEMA = "maxperf.manifest/2"  # 2: per_device_batch_size is one microbatch (MaxText's meaning)
COMPILED_SCHEMA = "maxperf.compiled/1"


class ArtifactError(MaxperfError):
    """An artifact that is missing, truncated, altered, crafted, or from other library versions."""


class OutputRefused(MaxperfError):
    """An output path whose present contents maxperf would lose by writing there."""


def to_json(value: Any) -> Any:
    """Configs and results as JSON-ready values: dataclasses as dicts, enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# What each kind of output directory holds: the file that marks it, its schema, and the files it may contain.
_OUTPUT_KINDS = {
    "compile": ("manifest.json", MANIFEST_SCHEMA),
    "run": ("run.json", "maxperf.run/1"),
}


def _owned_files(directory: Path, kind: str) -> set[str] | None:
    """The files under `directory` that an earlier `kind` output wrote; None when it is no such output."""
    marker, schema = _OUTPUT_KINDS[kind]
    try:
        data = json.loads((directory / marker).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != schema:
        return None
    if kind == "compile":
        files = data.get("files")
        return {marker, *files} if isinstance(files, dict) else None
    return {marker} | {str(p.relative_to(directory)) for p in (directory / "trace").rglob("*")}


def _protected(path: Path) -> bool:
    """The working directory, the home directory, the filesystem root and their ancestors are never replaced."""
    resolved = path.resolve()
    keep = {Path.cwd().resolve(), Path.home().resolve()}
    return resolved == Path(resolved.anchor) or any(resolved == k or resolved in k.parents for k in keep)


def claim_output(out: Path, kind: str, *, force: bool = False) -> None:
    """Refuses an `--out` that would lose what is there: only an earlier output of the same kind, holding nothing
    but what maxperf wrote, or an empty directory, is replaced; `force` replaces anything but a protected path."""
    out = Path(out)
    if not os.path.lexists(out):
        if out.parent.exists() and not out.parent.is_dir():
            raise OutputRefused(f"--out {out}: {out.parent} is a file, not a directory")
        return
    if _protected(out):
        raise OutputRefused(f"--out {out} is the working directory, the home directory or one of their parents; "
                            "give a new directory")
    if force:
        return
    if out.is_symlink() or not out.is_dir():
        raise OutputRefused(f"--out {out} is a file, not a maxperf output directory; give a new directory, or pass "
                            "--force to replace it")
    present = {str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir() or p.is_symlink()}
    if not present:
        return
    owned = _owned_files(out, kind)
    if owned is None:
        raise OutputRefused(f"--out {out} is a directory maxperf {kind} did not write; give a new directory, or "
                            f"pass --force to replace it")
    foreign = sorted(present - owned)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputRefused(f"--out {out} holds files maxperf {kind} did not write ({shown}); move them, give a new "
                            f"directory, or pass --force to replace it")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


class ArtifactWriter:
    """Collects files in a temporary directory beside `out` and moves them into place in one rename.

    `out` is checked when the writer is made (see `claim_output`) and again just before the rename."""

    def __init__(self, out: Path, kind: str, *, force: bool = False):
        self.out = Path(out)
        self.kind, self.force = kind, force
        claim_output(self.out, kind, force=force)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".partial", dir=self.out.parent))
        except OSError as e:
            raise OutputRefused(f"--out {self.out}: cannot write in {self.out.parent} ({e.strerror})") from None

    def write_bytes(self, name: str, data: bytes) -> None:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def write_json(self, name: str, value: Any) -> None:
        self.write_text(name, json.dumps(to_json(value), indent=2, sort_keys=False) + "\n")

    def hashes(self) -> dict[str, str]:
        return {
            str(p.relative_to(self.tmp)): sha256(p) for p in sorted(self.tmp.rglob("*")) if p.is_file()
        }

    def commit(self) -> Path:
        """Replaces `out` (if any) with the finished directory."""
        claim_output(self.out, self.kind, force=self.force)
        if os.path.lexists(self.out):
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".old", dir=self.out.parent))
            os.replace(self.out, old / "replaced")
            os.replace(self.tmp, self.out)
            _remove(old)
        else:
            os.replace(self.tmp, self.out)
        return self.out

    def abandon(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------------------
# Reading back


class _PlainUnpickler(pickle.Unpickler):
    """Builds only plain values: any class or function reference is refused."""

    def find_class(self, module: str, name: str):
        raise ArtifactError(f"compiled.pkl names {module}.{name}; maxperf artifacts hold plain values only")


def read_plain_pickle(data: bytes) -> Any:
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except ArtifactError:
        raise
    except Exception as e:
        raise ArtifactError(f"compiled.pkl is not a readable maxperf artifact ({type(e).__name__}: {e})")


# jax's executable pickle names data types of these packages only (seen on CPU, TPU and GPU compiles with jax
# 0.12: Mesh, NamedSharding, ShapedArray, UnloadedMeshExecutable, DeviceList, numpy dtypes and arrays, ...).
_ALLOWED_PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes")
_ALLOWED_EXACT = {
    ("builtins", n) for n in ("tuple", "list", "dict", "set", "frozenset", "slice", "int", "float", "complex",
                              "str", "bytes", "bytearray", "bool", "object", "range", "NoneType", "type")
} | {("copyreg", "_reconstructor"), ("copyreg", "__newobj__"), ("collections", "OrderedDict"),
     # the functions (not classes) that jax's and numpy's own pickles rebuild their objects with
     ("jax._src.named_sharding", "_unpickle_named_sharding"), ("numpy._core.multiarray", "_reconstruct"),
     ("numpy.core.multiarray", "_reconstruct")}
_FORBIDDEN_PREFIXES = ("jax.experimental.compilation_cache", "jax._src.compilation_cache", "jax._src.path",
                       "numpy.f2py", "numpy.distutils", "numpy.testing", "jax._src.clusters", "jax.tools")


def _globals_named(data: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a pickle refers to, following memoized strings for STACK_GLOBAL."""
    found, memo, strings = set(), {}, []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.add((module, name))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = strings[-1] if strings else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(arg))
        elif op.name == "STACK_GLOBAL":
            module, name = (strings[-2], strings[-1]) if len(strings) >= 2 else (None, None)
            if not isinstance(module, str) or not isinstance(name, str):
                raise ArtifactError("the executable's pickle refers to a class it does not name plainly")
            found.add((module, name))
    return found


def check_executable_pickle(data: bytes) -> None:
    """Refuses a serialized executable that names anything but jax's own data types."""
    try:
        named = _globals_named(data)
    except ArtifactError:
        raise
    except Exception as e:
        raise ArtifactError(f"the serialized executable is corrupt ({type(e).__name__}: {e})")
    for module, name in sorted(named):
        if (module, name) in _ALLOWED_EXACT:
            continue
        if module.split(".")[0] not in _ALLOWED_PACKAGES or module.startswith(_FORBIDDEN_PREFIXES):
            raise ArtifactError(f"the serialized executable names {module}.{name}, which maxperf never writes")
        try:
            obj = getattr(importlib.import_module(module), name, None)
        except ImportError:
            obj = None
        if not isinstance(obj, type):
            raise ArtifactError(f"the serialized executable names {module}.{name}, which is not a jax data type")


def read_manifest(directory: Path) -> dict:
    path = directory / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{directory} has no manifest.json; is it a `maxperf compile` output directory?")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ArtifactError(f"{path} is not valid JSON ({e}); the artifact is damaged: compile again") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path} holds a JSON {type(manifest).__name__}, not an object; the artifact is damaged: "
                            "compile again")
    if manifest.get("schema") != MANIFEST_SCHEMA:
        raise ArtifactError(f"{path} has schema {manifest.get('schema')!r}; this maxperf reads {MANIFEST_SCHEMA}")
    for name, kind, what in _MANIFEST_FIELDS:
        if not isinstance(manifest.get(name), kind):
            raise ArtifactError(f"{path}: {name!r} should be {what}, not {json.dumps(manifest.get(name))[:60]}; the "
                                "artifact is damaged: compile again")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["files"].items()):
        raise ArtifactError(f"{path}: 'files' should map file names to sha256 digests; the artifact is damaged: "
                            "compile again")
    return manifest


# What a reader relies on in manifest.json: (field, type, in words).
_MANIFEST_FIELDS = (("compiled", bool, "true or false"), ("files", dict, "an object of file names and sha256 digests"),
                    *((name, dict, "an object") for name in ("model", "train", "parallelism", "mesh", "topology",
                                                             "devices", "versions")))


def verify_hashes(directory: Path, manifest: dict) -> None:
    for name, expected in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{path} is missing; the manifest lists it")
        if sha256(path) != expected:
            raise ArtifactError(f"{path} does not match the sha256 in manifest.json: the file was altered or truncated")
