"""Pure arithmetic on a resolved request (maxperf.spec): parameter counts, FLOPs, memory, step time, what each chip
sustains. Imports nothing of maxperf but maxperf.spec, and never jax.

    from maxperf import perfmodel, spec
    est = perfmodel.estimate(spec.resolve("v5p-128", "llama2-7b", ["per_device_batch_size=4"]))
    est.step_time_s, est.mfu, est.memory.per_device_total_bytes, est.bottleneck, est.as_dict()
"""

from maxperf.perfmodel.chips import get as get_chip
from maxperf.perfmodel.estimate import Estimate, estimate
from maxperf.perfmodel.flops import FlopCounts, ParamCounts, count_flops, count_params
from maxperf.perfmodel.memory import MemoryBreakdown, estimate_memory
from maxperf.perfmodel.steptime import Row, StepTime, step_time
from maxperf.perfmodel.work import Constants, Overlap

__all__ = ["Constants", "Estimate", "FlopCounts", "MemoryBreakdown", "Overlap", "ParamCounts", "Row", "StepTime",
           "count_flops", "count_params", "estimate", "estimate_memory", "get_chip", "step_time"]
