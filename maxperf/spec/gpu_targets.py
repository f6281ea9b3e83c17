"""GPU device specs (`stream_executor.GpuTargetConfigProto` text) for compiling without a GPU.

The CUDA PJRT plugin (`jax-cuda12-plugin`) compiles for a GPU it cannot see when it is given the GPU's target config:
a text proto with the device description (SM count, memory, compute capability, clocks, library versions). The
plugin's shared library embeds such specs for the GPUs XLA tests against, each a NUL-terminated text block that
starts with `# proto-message: stream_executor.GpuTargetConfigProto` and ends with `device_description_str: "..."`.
We find them once per process by scanning the library's read-only data section (.rodata, 25 MB of the 486 MB
`xla_cuda_plugin.so` of jax-cuda12-plugin 0.12.0.1, 22 blocks); scanning the whole file took 0.26 s warm and up
to 1.8 s from a cold page cache here.
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import re
import struct
from pathlib import Path

from maxperf.spec.errors import MaxperfError, unknown
from maxperf.spec.notes import note

PROTO_MARKER = b"# proto-message: stream_executor.GpuTargetConfigProto"
INSTALL_HINT = "install the CUDA plugin to compile for GPUs: pip install 'maxperf[gpu]'"

# chip-table key -> the plugin's `device_description_str` for that GPU (the SXM parts that training clusters use).
CHIP_TO_DEVICE = {
    "a100-40gb": "NVIDIA A100-SXM4-40GB",
    "a100-80gb": "NVIDIA A100-SXM4-80GB",
    "h100-sxm": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200 141GB HBM3e",
    "b200": "NVIDIA B200",
    "gb200": "NVIDIA GB200",
}
# Other names the CUDA runtime gives the same chip as a device kind (its device properties' name): an H200 SXM board
# reported "NVIDIA H200" on 2026-11-28, where the plugin's target spec says "NVIDIA H200 141GB HBM3e".
OTHER_DEVICE_KINDS = {"h200": ("NVIDIA H200",)}


def is_chip(device_kind: str, chip: str) -> bool:
    """Whether a GPU whose jax device kind is `device_kind` is the chip-table key `chip`."""
    return device_kind in (CHIP_TO_DEVICE.get(chip, chip), *OTHER_DEVICE_KINDS.get(chip, ()))

_DESCRIPTION = re.compile(rb'^device_description_str:\s*"([^"]*)"', re.MULTILINE)
_PLATFORM = re.compile(r'^platform_name:\s*"([^"]*)"', re.MULTILINE)
_MEMORY = re.compile(r"device_memory_size:\s*(\d+)")


@functools.cache  # asked by every estimate of a GPU step; the installed packages do not change under a process
def plugin_library() -> Path | None:
    """The CUDA plugin's shared library (jax-cuda12-plugin, else jax-cuda13-plugin), or None when neither is installed.

    Found without importing the plugin.
    """
    for module in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            path = Path(folder) / "xla_cuda_plugin.so"
            if path.exists():
                return path
    return None


@functools.cache
def embedded_targets() -> dict[str, str]:
    """Every target config embedded in the plugin, keyed by its device description (e.g. "NVIDIA H100 80GB HBM3")."""
    path = plugin_library()
    if path is None:
        raise MaxperfError(f"the CUDA plugin is not installed; {INSTALL_HINT}")
    targets: dict[str, str] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        first, last = _rodata_range(data) or (0, len(data))
        start = data.find(PROTO_MARKER, first, last)
        while start != -1:
            end = data.find(b"\0", start, last)
            block = data[start:end]
            found = _DESCRIPTION.search(block)
            if found:
                targets.setdefault(found.group(1).decode(), block.decode())
            start = data.find(PROTO_MARKER, end, last)
    if not targets:
        raise MaxperfError(f"no GPU target specs found in {path}; this plugin version embeds none")
    return targets


def _rodata_range(data: mmap.mmap) -> tuple[int, int] | None:
    """File offsets of a little-endian ELF64 library's .rodata section, where string constants live; else None."""
    if data[:6] != b"\x7fELF\x02\x01":
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:  # name offset, file offset, size
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name, offset, size

    _, names_at, _ = section(shstrndx)
    for i in range(shnum):
        name, offset, size = section(i)
        if data[names_at + name:names_at + name + 8] == b".rodata\0":
            return offset, offset + size
    return None


def gpu_target_config(chip: str) -> str:
    """The target config text for a chip-table key ("h100-sxm") or a device description ("NVIDIA H100 80GB HBM3")."""
    targets = embedded_targets()
    device = CHIP_TO_DEVICE.get(chip, chip)
    if device not in targets:
        cuda = [d for d, text in targets.items()
                if (found := _PLATFORM.search(text)) is not None and found.group(1) == "CUDA"]
        raise unknown("GPU target", chip, list(CHIP_TO_DEVICE) + cuda)
    return targets[device]


def validate_target_config(text: str, source: str = "target config") -> str:
    """Checks that `text` reads as a CUDA GpuTargetConfigProto in text form and returns it; else a one-line error."""
    if "gpu_device_info" not in text or "cuda_compute_capability" not in text:
        raise MaxperfError(
            f"{source} is not a stream_executor.GpuTargetConfigProto text proto for a CUDA GPU "
            "(it needs a gpu_device_info block with cuda_compute_capability)"
        )
    platform = _PLATFORM.search(text)
    if platform and platform.group(1) != "CUDA":
        raise MaxperfError(f"{source} is for platform {platform.group(1)!r}; maxperf compiles GPU targets for CUDA")
    return text


def read_target_config(path: str | Path) -> str:
    """The validated text of a `--target-config FILE`."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise MaxperfError(f"cannot read target config {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise MaxperfError(f"target config {str(path)!r} is not text; pass a GpuTargetConfigProto text proto") from None
    return validate_target_config(text, f"target config {str(path)!r}")


def device_memory_bytes(text: str) -> int | None:
    """`device_memory_size` of a target config: the bytes the GPU reports as its memory."""
    found = _MEMORY.search(text)
    return int(found.group(1)) if found else None


def target_memory_bytes(chip: str, target_config_path: str | None = None) -> int | None:
    """The memory of the GPU a topology compiles for, from its spec: the user's `--target-config` file, else the
    plugin's embedded spec for `chip`. None, said once on stderr, when the CUDA plugin that holds the embedded spec
    is not installed (perfmodel then takes the datasheet's figure and records that it did)."""
    if target_config_path is not None:
        return device_memory_bytes(read_target_config(target_config_path))
    if plugin_library() is None:
        note(f"{chip}: GPU memory from the datasheet, not the target spec compiled for; {INSTALL_HINT}")
        return None
    try:
        return device_memory_bytes(gpu_target_config(chip))
    except MaxperfError as e:  # a plugin that embeds no specs (jax-cuda13-plugin 0.11.2)
        note(f"{chip}: GPU memory from the datasheet ({e})")
        return None


def driver_present() -> bool:
    """Whether this machine has an NVIDIA driver's device files (a GPU may be attached)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0"))


def attached_gpus(chip: str, count: int) -> tuple | None:
    """This machine's first `count` GPUs when at least that many are attached and they are the chip `chip` names
    (the device kind equals the target spec's description); else None. Only looks where a GPU driver is present,
    so a machine without one does not start jax's GPU backend."""
    gpus = _cuda_gpus()
    return tuple(gpus[:count]) if _serve(gpus, chip, count) else None


def _cuda_gpus() -> list:
    """jax's CUDA devices on this machine; none where no GPU driver is present (jax's GPU backend is then not
    started) or the backend cannot start."""
    if not driver_present():
        return []
    import jax

    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


def _serve(gpus: list, chip: str, count: int) -> bool:
    """Whether `gpus` hold `count` GPUs of the chip `chip` names."""
    return len(gpus) >= count and is_chip(gpus[0].device_kind, chip)


def chip_of_kind(device_kind: str) -> str | None:
    """The chip-table key of a GPU whose jax device kind is `device_kind`; None for a GPU outside the catalog."""
    return next((chip for chip in CHIP_TO_DEVICE if is_chip(device_kind, chip)), None)


def unserved_by_attached(chip: str, count: int) -> str | None:
    """Why this machine's attached GPUs do not compile a one-host topology of `count` `chip` GPUs, in words for an
    error or a note ("this machine's 1 GPU is an NVIDIA H200 (h200): a topology of 8 needs 8 attached"); None where
    no GPU is attached (or none can be read) or the attached ones serve it."""
    gpus = _cuda_gpus()
    if not gpus or _serve(gpus, chip, count):
        return None
    kind = gpus[0].device_kind
    have = chip_of_kind(kind)
    what = (f"this machine's {len(gpus)} GPU{'s are' if len(gpus) > 1 else ' is an'} {kind}"
            + (f" ({have})" if have else ", a GPU outside maxperf's catalog"))
    if have == chip:
        return f"{what}: a topology of {count} needs {count} attached"
    return f"{what}, not the topology's {CHIP_TO_DEVICE.get(chip, chip)} ({chip})"
