"""Which memory parts make a per-device total, analytical and compiler's alike.

perfmodel's analytical parts do not all live at once: the state (params, optimizer, accumulator, staged optimizer)
is live through the whole step, and the rest only in some phases of it (perfmodel.memory.MemoryBreakdown.phases);
the total is the state plus the largest phase. XLA's total is arguments + outputs - aliased + temporaries + code.
The report's bars and `maxperf estimate-memory` both add only the parts listed here, so what they show sums to the
total."""

from __future__ import annotations

STATE_PARTS = ("params", "optimizer", "grad_accumulator", "optimizer_staged")
PHASE_PARTS = {  # as perfmodel.memory.MemoryBreakdown.phases adds them
    "loss": ("gradients", "gathered_params", "activations", "saved_copy", "logits"),
    "backward": ("gradients", "gathered_params", "activations", "temporaries"),
    "optimizer": ("gradients", "optimizer_temporaries"),
}
ANALYTICAL_PARTS = STATE_PARTS + ("gradients", "gathered_params", "activations", "saved_copy", "logits",
                                  "temporaries", "optimizer_temporaries")


def phase_total(memory: dict, phase: str) -> float:
    """Bytes per device live in `phase`: the state and that phase's parts."""
    return sum(memory.get(p) or 0.0 for p in STATE_PARTS + PHASE_PARTS[phase])


def peak_parts(memory: dict) -> tuple[str, list[str], list[str]]:
    """(peak phase, the parts whose sum is the total, the parts not live at the peak) of an analytical breakdown
    (`MemoryBreakdown.as_dict()`, or estimate.json's `memory`)."""
    peak = memory.get("peak_phase") or max(PHASE_PARTS, key=lambda ph: phase_total(memory, ph))
    inside = list(STATE_PARTS + PHASE_PARTS[peak])
    outside = [p for p in ANALYTICAL_PARTS if p not in inside]
    return peak, inside, outside


def compiler_parts(memory: dict) -> dict[str, float] | None:
    """memory.json's figures as parts that sum to its `per_device_total_bytes`; None where the compiler gave only a
    total (a step that does not fit reports what it can)."""
    total = memory.get("per_device_total_bytes")
    if total is None or "argument_bytes" not in memory or "temp_bytes" not in memory:
        return None
    outputs = (memory.get("output_bytes") or 0) - (memory.get("alias_bytes") or 0)
    parts = {"arguments": memory["argument_bytes"], "outputs not aliased to arguments": outputs,
             "temporaries": memory["temp_bytes"], "generated code": memory.get("generated_code_bytes") or 0}
    if abs(sum(parts.values()) - total) > max(1.0, 1e-6 * total):
        return None
    return parts
