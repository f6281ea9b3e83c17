"""Devices and meshes for a topology, ahead-of-time lowering and compilation, and artifacts.

`maxperf.aot.compile(...)` and `maxperf.aot.load(...)` are the Python API behind `maxperf compile`. The names load
on first use, so importing one module of aot does not import the compiler.
"""

import importlib

_EXPORTS = {"Artifact": "maxperf.aot.loading", "load": "maxperf.aot.loading", "CompileResult": "maxperf.aot.compiler",
            "compile": "maxperf.aot.compiler"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'maxperf.aot' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
