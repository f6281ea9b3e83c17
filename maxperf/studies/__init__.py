"""Work that joins compile and estimate: sweeps over grids and the memory fit (max batch)."""
