"""Pure arithmetic on numbers: parameter counts, FLOPs, memory, step time, chip specs. Never imports jax."""
