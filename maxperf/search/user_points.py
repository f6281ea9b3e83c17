"""A sweep's points of a user's step (`maxperf sweep --step MODULE:FACTORY`): each compiled, its step time read
from the compiled program (there is no analytical model of a user's step, so there is no --analytical-only)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maxperf.spec.errors import DoesNotFit, MaxperfError
from maxperf.spec.steps import resolve_user


def check(step: str, points: Sequence, analytical_only: bool) -> set[str]:
    """The chips of the grid's topologies, after every point's request is checked (before any work): its mesh words,
    and the factory's words against its parameters (the factory imported once here; what it does when called is each
    point's own)."""
    if analytical_only:
        raise MaxperfError(f"--step {step}: --analytical-only needs maxperf's analytical model of the step, which a "
                           "user's step does not have; its points are compiled")
    from maxperf.aot.user_step import factory_arguments, load_factory

    requests = [resolve_user(p.topology, step, p.overrides, num_slices=p.num_slices) for p in points]
    if requests:
        factory = load_factory(requests[0].step)
        for r in requests:
            factory_arguments(factory, r.step, r.args)
    return {r.topology.chip for r in requests}


def point(step: str, p, out: Path) -> dict[str, Any]:
    """One point's row: the compile's memory and verdict, and the HLO-derived prediction; failures recorded."""
    from maxperf.aot import user_compile

    try:
        result = user_compile.compile_step(p.topology, step, p.overrides, num_slices=p.num_slices, out=out)
    except DoesNotFit as e:
        return {"status": "does not fit", "reason": str(e), "fits": False, "artifact": str(out)}
    except MaxperfError as e:
        return {"status": "error", "reason": str(e)}
    except Exception as e:  # one broken point must not end the sweep
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    topo, e = result.request.topology, result.estimate
    return {"chips": topo.chips, "devices": topo.num_devices, "platform": topo.platform, "chip": topo.chip,
            "hbm_bytes": result.memory["hbm_bytes"], "predicted_step_time_s": e["step_time_s"],
            "prediction_source": e["source"], "hlo_step_time_s": e["step_time_s"],
            "predicted_tokens_per_s": e["tokens_per_s"], "unit": e["unit"],
            "predicted_tflops_per_chip": e["tflops_per_chip"], "predicted_mfu": e["mfu"],
            "bottleneck": e["bottleneck"], "compiler_memory_bytes": result.memory["per_device_total_bytes"],
            "fits": result.fits, "compile_seconds": result.compile_seconds,
            "compiler_flops_per_device": result.cost["flops_per_device"], "artifact": str(out),
            **({} if result.fits else {"status": "does not fit", "reason": "compiler memory exceeds HBM"})}
