"""Pure arithmetic on numbers: parameter counts, FLOPs, memory, step time, chip specs. Never imports jax.

    from maxperf.perfmodel import estimate
    est = estimate(model_cfg, train_cfg, {"fsdp": 64}, {}, topology)
    est.step_time_s, est.mfu, est.memory.per_device_total_bytes, est.bottleneck, est.as_dict()
"""

from maxperf.perfmodel.chips import CHIPS, Chip, get as get_chip
from maxperf.perfmodel.estimate import Estimate, estimate
from maxperf.perfmodel.flops import FlopCounts, ParamCounts, count_flops, count_params
from maxperf.perfmodel.memory import MemoryBreakdown, estimate_memory
from maxperf.perfmodel.shapes import Mesh, ModelShape, TopologyShape, TrainShape, make_mesh
from maxperf.perfmodel.steptime import Overlap, Row, StepTime, step_time

__all__ = [
    "CHIPS", "Chip", "Estimate", "FlopCounts", "MemoryBreakdown", "Mesh", "ModelShape", "Overlap", "ParamCounts",
    "Row", "StepTime", "TopologyShape", "TrainShape", "count_flops", "count_params", "estimate", "estimate_memory",
    "get_chip", "make_mesh", "step_time",
]
