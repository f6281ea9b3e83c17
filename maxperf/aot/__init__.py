"""Topologies, meshes, ahead-of-time lowering and compilation, and artifacts.

`maxperf.aot.compile(...)` and `maxperf.aot.load(...)` are the Python API behind `maxperf compile`.
"""

from maxperf.aot.compiler import CompileResult, Plan, compile, plan
from maxperf.aot.load import Artifact, load

__all__ = ["Artifact", "CompileResult", "Plan", "compile", "load", "plan"]
