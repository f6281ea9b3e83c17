"""Saving and restoring the train state with orbax-checkpoint, as a training job would (asynchronously)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from maxperf.errors import MaxperfError


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise MaxperfError("checkpoints need orbax-checkpoint: pip install 'maxperf[checkpoint]'") from None
    return ocp


def save(directory: Path, state: dict) -> dict[str, Any]:
    """Saves `state` under `directory` in the background; returns how long the step loop was blocked, how long
    the whole save took, and the bytes written."""
    ocp = _orbax()
    directory = directory.absolute()
    if directory.exists() and any(directory.iterdir()):
        raise MaxperfError(f"--checkpoint {directory} exists and is not empty; give a new directory")
    checkpointer = ocp.StandardCheckpointer()
    start = time.perf_counter()
    checkpointer.save(directory, state)
    blocking = time.perf_counter() - start
    checkpointer.wait_until_finished()
    total = time.perf_counter() - start
    checkpointer.close()
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return {"path": str(directory), "blocking_seconds": blocking, "total_seconds": total, "bytes": size}


def restore(directory: Path, spec) -> dict:
    """The state saved under `directory`, placed with the step's shardings."""
    import jax

    ocp = _orbax()
    directory = directory.absolute()
    if not directory.is_dir():
        raise MaxperfError(f"--restore {directory} is not a checkpoint directory")
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), spec.state,
                          spec.state_shardings)
    checkpointer = ocp.StandardCheckpointer()
    try:
        return checkpointer.restore(directory, target)
    except Exception as e:  # orbax reports a mismatched tree or missing files in many ways
        raise MaxperfError(f"--restore {directory}: not a checkpoint of this model's state ({str(e).splitlines()[0]})")
    finally:
        checkpointer.close()
