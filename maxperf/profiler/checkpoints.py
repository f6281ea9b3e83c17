"""Saving and restoring the train state with orbax-checkpoint, as a training job would (asynchronously)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from maxperf.spec.errors import MaxperfError


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise MaxperfError("checkpoints need orbax-checkpoint: pip install 'maxperf[checkpoint]'") from None
    return ocp


class CheckpointFailed(MaxperfError):
    """A save that was started and did not finish (the destination was checked before the run)."""

    exit_code = 1


def check_destination(directory: Path) -> None:
    """Refuses, in one line, a `--checkpoint` that a save could not write: one that holds files, or lies under a
    file, or where nothing can be created (read-only, /proc). orbax writes DIR.orbax-checkpoint-tmp-* beside DIR
    and renames it, so DIR's parent (or its nearest existing ancestor, which orbax creates the rest under) must
    take a new directory."""
    directory = directory.absolute()
    if directory.is_dir():
        if any(directory.iterdir()):
            raise MaxperfError(f"--checkpoint {directory} exists and is not empty; give a new directory")
    elif os.path.lexists(directory):
        raise MaxperfError(f"--checkpoint {directory} is a file; give a new directory")
    base = directory.parent
    while not os.path.lexists(base):
        base = base.parent
    if not base.is_dir():
        raise MaxperfError(f"--checkpoint {directory}: {base} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".maxperf-probe-", dir=base))
    except OSError as e:
        raise MaxperfError(f"--checkpoint {directory}: cannot create directories in {base} ({e.strerror})") from None


def save(directory: Path, state: dict) -> dict[str, Any]:
    """Saves `state` under `directory` in the background; returns how long the step loop was blocked, how long
    the whole save took, and the bytes written."""
    ocp = _orbax()
    directory = directory.absolute()
    check_destination(directory)
    checkpointer = ocp.StandardCheckpointer()
    start = time.perf_counter()
    try:
        checkpointer.save(directory, state)
        blocking = time.perf_counter() - start
        checkpointer.wait_until_finished()
    except Exception as e:  # orbax raises what its writer threads hit (disk full, a path removed meanwhile)
        raise CheckpointFailed(f"--checkpoint {directory}: the save failed ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''})") from None
    finally:
        checkpointer.close()
    total = time.perf_counter() - start
    _write_meta(directory)
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return {"path": str(directory), "blocking_seconds": blocking, "total_seconds": total, "bytes": size}


# maxperf's word on a checkpoint beside orbax's files: a pipelined decoder's layers are kept in the model's order
# (models/train_step.model_order_layers); checkpoints saved before kept them as the pipeline stored them
META = "maxperf_checkpoint.json"
META_SCHEMA = "maxperf.checkpoint/1"


def _write_meta(directory: Path) -> None:
    tmp = directory / f".{META}.tmp"
    tmp.write_text(json.dumps({"schema": META_SCHEMA, "layer_order": "model"}) + "\n")
    os.replace(tmp, directory / META)


def layers_in_model_order(directory: Path) -> bool:
    """Whether the checkpoint says it keeps a pipelined decoder's layers in the model's order (every checkpoint
    maxperf writes now does; one without the word may hold them stage-major)."""
    try:
        meta = json.loads((Path(directory) / META).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("schema") == META_SCHEMA and meta.get("layer_order") == "model"


# What orbax's StandardCheckpointer writes into every checkpoint it saves: the pytree's metadata, and the checkpoint's
CHECKPOINT_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA")


def is_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a saved checkpoint (orbax's markers), read before the executable loads."""
    return directory.is_dir() and any((directory / name).is_file() for name in CHECKPOINT_MARKERS)


def restore(directory: Path, spec) -> dict:
    """The state saved under `directory`, placed with the step's shardings."""
    import jax

    ocp = _orbax()
    directory = directory.absolute()
    if not is_checkpoint(directory):
        raise MaxperfError(f"--restore {directory} is not a checkpoint directory")
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), spec.state,
                          spec.state_shardings)
    checkpointer = ocp.StandardCheckpointer()
    try:
        return checkpointer.restore(directory, target)
    except Exception as e:  # orbax reports a mismatched tree or missing files in many ways, some pages long
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        said = said if len(said) <= 200 else said[:200] + "..."
        raise MaxperfError(f"--restore {directory}: cannot be restored into this model's state: it is damaged "
                           f"(files missing or altered) or the checkpoint of another model, layout or optimizer "
                           f"(orbax: {said})") from None
    finally:
        checkpointer.close()
