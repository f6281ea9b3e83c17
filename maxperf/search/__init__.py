"""Work that joins compile and estimate: `maxperf plan` (candidates, plan, verify, margin, commands), sweeps over grids
(sweep) and the memory fit with the max batch (memory_fit)."""
