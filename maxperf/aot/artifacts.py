"""Artifact directories: written atomically, hashed, and read back without trusting their contents.

`compiled.pkl` is a pickle of plain Python values only (dict, str, bytes, int, ...): reading it goes through an
unpickler that refuses every class. The executable inside is jax's own serialized form; before jax unpickles it,
every class it names is checked against the modules that jax's executables are made of, so a crafted file cannot
reach os, subprocess, builtins.eval and the like.
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import hashlib
import importlib
import io
import json
import os
import pickle
import pickletools
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maxperf.spec.errors import MaxperfError

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


# What each command writes: the file that marks its output (with a `schema` of that name, any version), and how it
# writes there. A "replace" output is replaced whole, so anything else in it would be lost; an "into" output is
# written into (a sweep's or plan's points, which a re-run resumes), so what else it holds stays.
@dataclasses.dataclass(frozen=True)
class _Kind:
    marker: str
    schemas: tuple[str, ...]  # the marker's schema names (any version)
    replaces: bool


_OUTPUT_KINDS = {
    "compile": _Kind("manifest.json", ("maxperf.manifest",), True),
    "run": _Kind("run.json", ("maxperf.run", "maxperf.serving-run"), True),  # a train or user step's run, a serving one
    "sweep": _Kind("sweep.json", ("maxperf.sweep",), False),
    # a training plan's or a serving plan's (plan --step decode)
    "plan": _Kind("plan.json", ("maxperf.plan", "maxperf.serving-plan"), False),
}


# The opening of a marker whose schema comes first, as maxperf writes them
_SCHEMA_FIRST = re.compile(rb'\{\s*"schema":\s*"([^"\\]*)"')


def _marked(directory: Path, kind: _Kind) -> dict | None:
    """The marker file's content when it is this kind's, else None; of a sweep or plan, whose content is not needed
    (a plan.json holds every candidate: tens of MB), its schema alone where the file opens with it."""
    if not kind.replaces:
        try:
            with open(directory / kind.marker, "rb") as f:
                head = _SCHEMA_FIRST.match(f.read(256))
        except OSError:
            return None
        if head is not None:
            schema = head.group(1).decode("utf-8", "replace")
            return {"schema": schema} if schema.rpartition("/")[0] in kind.schemas else None
    try:
        data = json.loads((directory / kind.marker).read_text())
    except (OSError, ValueError):
        return None
    schema = data.get("schema") if isinstance(data, dict) else None
    return data if isinstance(schema, str) and schema.rpartition("/")[0] in kind.schemas else None


def _owned_files(directory: Path, kind: str, marker: dict) -> set[str]:
    """The files under `directory` that an earlier `kind` output wrote."""
    if kind == "compile":
        files = marker.get("files")
        return {"manifest.json", *(files if isinstance(files, dict) else ())}
    return {"run.json"} | {str(p.relative_to(directory)) for p in (directory / "trace").rglob("*")}


def _points_only(present: set[str]) -> bool:
    """A sweep or plan stopped before it wrote its table: points/NAME/... only, and the temporary files of a table."""
    return all(name.startswith("points/") or (name.startswith(".") and name.endswith(".partial"))
               for name in present)


def _protected(path: Path) -> bool:
    """The working directory, the home directory, the filesystem root and their ancestors are never replaced."""
    resolved = path.resolve()
    keep = {Path.cwd().resolve(), Path.home().resolve()}
    return resolved == Path(resolved.anchor) or any(resolved == k or resolved in k.parents for k in keep)


def claim_output(out: Path, kind: str, *, force: bool = False, inputs: Sequence[str | os.PathLike] = ()) -> None:
    """Refuses an output path whose present contents maxperf would lose by writing there. The one rule for every
    command that writes (`kind`: compile, run, sweep, plan, report):

    - new, or an empty directory: written;
    - an earlier output of the same command: a compile's or run's is replaced when it holds only what maxperf wrote
      there (with `force`, whatever else it holds); a sweep or plan is written into, and resumes;
    - anything else (a file, a user's directory, another command's output, the command's own `inputs` or a directory
      that holds one, the working or home directory) is refused, `force` or not.
    """
    if kind == "report":
        return _claim_report(Path(out))
    out, spec = Path(out), _OUTPUT_KINDS[kind]
    resolved = out.resolve()
    for given in inputs:  # whether or not they exist yet (a checkpoint this run will write)
        path = Path(given).resolve()
        if path == resolved:
            raise OutputRefused(f"--out {out} is {given}, which this {kind} uses; give another directory")
        if resolved in path.parents:
            raise OutputRefused(f"--out {out} holds {given}, which this {kind} uses; give another directory")
    if not os.path.lexists(out):
        if out.parent.exists() and not out.parent.is_dir():
            raise OutputRefused(f"--out {out}: {out.parent} is a file, not a directory")
        return
    if _protected(out):
        raise OutputRefused(f"--out {out} is the working directory, the home directory or one of their parents; "
                            "give a new directory")
    if out.is_symlink() or not out.is_dir():
        raise OutputRefused(f"--out {out} is a file, not a maxperf {kind} output; give a new directory")
    present = {str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir() or p.is_symlink()}
    if not present:
        return
    marker = _marked(out, spec)
    if marker is None:
        if not spec.replaces and _points_only(present):
            return
        raise OutputRefused(f"--out {out} is a directory maxperf {kind} did not write; give a new directory")
    if not spec.replaces or force:
        return
    foreign = sorted(present - _owned_files(out, kind, marker))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputRefused(f"--out {out} holds files maxperf {kind} did not write ({shown}); move them, give a new "
                            f"directory, or pass --force to replace it and them")


# An HTML page of `maxperf report`: its tables go to NAME_files/ beside it.
_REPORT_MARKS = (b'<meta name="generator" content="maxperf', b"<title>maxperf report")


def report_files(out: Path) -> Path:
    return out.with_name(out.stem + "_files")


def _claim_report(out: Path) -> None:
    """A report replaces only an earlier report (the page and its CSV tables), never a user's file."""
    if out.is_dir():
        raise OutputRefused(f"-o {out} is a directory; give the HTML file to write, e.g. -o "
                            f"{out.parent / (out.name + '.html')} (beside it, not inside: a compile's or run's "
                            "directory holds only what maxperf writes there)")
    ours = False
    if os.path.lexists(out):
        try:
            with open(out, "rb") as f:
                head = f.read(4096)
        except OSError:
            head = b""
        ours = not out.is_symlink() and any(mark in head for mark in _REPORT_MARKS)
        if not ours:
            raise OutputRefused(f"-o {out} is a file maxperf report did not write; give a new file name")
    elif out.parent.exists() and not out.parent.is_dir():
        raise OutputRefused(f"-o {out}: {out.parent} is a file, not a directory")
    files = report_files(out)
    if not os.path.lexists(files):
        return
    if files.is_symlink() or not files.is_dir():
        raise OutputRefused(f"{files} is a file, where the report's CSV tables go; move it or choose another -o")
    present = [p for p in files.iterdir()]
    foreign = [p.name for p in present if p.suffix != ".csv" or p.is_dir() or p.is_symlink()]
    if foreign or (present and not ours):  # an earlier report's tables are replaced with it, and only then
        shown = ", ".join(sorted(foreign or [p.name for p in present])[:3])
        raise OutputRefused(f"{files} holds files maxperf report did not write ({shown}); move them or choose "
                            "another -o")


class OutputLock:
    """One writer at a time for an output path: an flock on `.NAME.lock` beside it, taken at once or refused. The
    kernel frees the lock when its process ends, even by SIGKILL; the file is removed on release, so a writer that
    finds the file it locked gone or replaced takes the lock again."""

    def __init__(self, out: Path, option: str = "--out"):
        self.path = lock_path(out)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise OutputRefused(f"{option} {out}: cannot write in {self.path.parent} ({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputRefused(f"{option} {out}: another maxperf is writing there now; wait for it to end, or "
                                    "give another path") from None
            if _same_file(fd, self.path):
                self.fd: int | None = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while it is held, so that no other writer holds a removed file
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_path(out: Path) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.lock"


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def remove_orphaned_temp_dirs(prefix: str, folder: str | Path | None = None) -> list[Path]:
    """Removes the temporary folders in `folder` (the temp folder by default) named `prefix`, a process id, "-" and
    tempfile's suffix, whose process has ended: one killed by a signal could not remove its own. The folders removed."""
    name = re.compile(re.escape(prefix) + r"(\d+)-[a-z0-9_]+")
    removed = []
    for path in Path(folder or tempfile.gettempdir()).glob(prefix + "*"):
        m = name.fullmatch(path.name)
        if m and path.is_dir() and not path.is_symlink() and not process_running(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_stale_lock(out: Path) -> None:
    """The lock file of a writer that was killed (its lock freed by the kernel); a lock still held stays."""
    if not lock_path(out).exists():
        return
    try:
        lock = OutputLock(out)
    except OutputRefused:
        return
    lock.release()


def hold_output(out: Path, kind: str, *, force: bool = False, inputs: Sequence[str | os.PathLike] = ()) -> OutputLock:
    """`claim_output`, then the output's lock, held until released: checked again under the lock, since another
    writer may have finished there in between. Refusals come before any work and create nothing."""
    out = Path(out)
    claim_output(out, kind, force=force, inputs=inputs)
    option = "-o" if kind == "report" else "--out"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputRefused(f"{option} {out}: cannot write in {out.parent} ({e.strerror})") from None
    lock = OutputLock(out, option)
    try:
        claim_output(out, kind, force=force, inputs=inputs)
    except BaseException:
        lock.release()
        raise
    return lock


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def directory_mode() -> int:
    """The mode a new directory gets under the process's umask (tempfile.mkdtemp makes its directories 0700)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


class ArtifactWriter:
    """Collects files in a temporary directory beside `out` and moves them into place in one rename.

    `out` is checked and locked when the writer is made (see `hold_output`), checked again just before the rename,
    and unlocked by `commit` or `abandon`. `inputs`: what the command reads, which `out` must not hold."""

    def __init__(self, out: Path, kind: str, *, force: bool = False, inputs: Sequence[str | os.PathLike] = ()):
        self.out = Path(out)
        self.kind, self.force, self.inputs = kind, force, tuple(inputs)
        if _writes_here():
            self.lock: OutputLock | None = hold_output(self.out, kind, force=force, inputs=self.inputs)
        else:
            claim_output(self.out, kind, force=force, inputs=self.inputs)
            self.lock = None
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".partial", dir=self.out.parent))
            os.chmod(self.tmp, directory_mode())  # mkdtemp's 0700 made the user's umask's
        except OSError as e:
            self._unlock()
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
        try:
            claim_output(self.out, self.kind, force=self.force, inputs=self.inputs)
            if os.path.lexists(self.out):
                old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".old", dir=self.out.parent))
                os.replace(self.out, old / "replaced")
                os.replace(self.tmp, self.out)
                _remove(old)
            else:
                os.replace(self.tmp, self.out)
        finally:
            self._unlock()
        return self.out

    def abandon(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _writes_here() -> bool:
    """Process 0 of a multi-process job writes the output and the others discard theirs, so it alone locks it (the
    processes of a job on one machine share the path)."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return True
    # jax.process_index() would start the backends, which a compile sets up after this; the client knows the index
    from jax._src import distributed

    return getattr(distributed.global_state, "process_id", 0) == 0


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
