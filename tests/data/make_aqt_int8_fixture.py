"""Writes aqt_int8_dot.npz: AQT's own outputs for MaxText's quantization=int8 matmul (aqt.jax.v2.config.config_v3 as
MaxText's layers/quantizations.py _get_int8_quant_config builds it), which tests/test_quantization.py compares
maxperf's int8 matmul against. Run with a Python that has `aqtp` (MaxText's environment), on CPU:

    JAX_PLATFORMS=cpu python tests/data/make_aqt_int8_fixture.py tests/data/aqt_int8_dot.npz
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from aqt.jax.v2 import config as aqt_config

# (name, lhs shape, rhs shape, dimension numbers, quantization_local_shard_count)
CASES = [
    ("dense", (4, 6, 32), (32, 16), (((2,), (0,)), ((), ())), 2),
    ("out_proj", (2, 8, 4, 8), (4, 8, 24), (((2, 3), (0, 1)), ((), ())), 1),
    ("bf16_drhs", (4, 6, 32), (32, 16), (((2,), (0,)), ((), ())), 0),
]


def int8_config(local_shard_count: int):
    """MaxText 0.2.5 layers/quantizations.py _get_int8_quant_config, for a given quantization_local_shard_count."""
    drhs = {}
    if local_shard_count != 0:
        drhs = dict(drhs_bits=8, drhs_accumulator_dtype=jnp.int32,
                    drhs_local_aqt=aqt_config.LocalAqt(contraction_axis_shard_count=local_shard_count))
    return aqt_config.config_v3(fwd_bits=8, dlhs_bits=8, rng_type="jax.uniform", dlhs_local_aqt=None,
                                fwd_accumulator_dtype=jnp.int32, dlhs_accumulator_dtype=jnp.int32, **drhs)


def main(path: str) -> None:
    out = {}
    for i, (name, ls, rs, dims, shards) in enumerate(CASES):
        k_lhs, k_rhs, k_g, key = jax.random.split(jax.random.key(100 + i), 4)
        lhs = (3 * jax.random.normal(k_lhs, ls)).astype(jnp.bfloat16)
        rhs = (0.05 * jax.random.normal(k_rhs, rs)).astype(jnp.bfloat16)
        cfg = aqt_config.set_context(int8_config(shards), key, train_step=None)
        y, vjp = jax.vjp(lambda a, b: cfg(a, b, dims), lhs, rhs)
        g = jax.random.normal(k_g, y.shape).astype(jnp.bfloat16)
        dlhs, drhs = vjp(g)
        for field, value in dict(lhs=lhs, rhs=rhs, g=g, y=y, dlhs=dlhs, drhs=drhs).items():
            out[f"{name}/{field}"] = np.asarray(value.astype(jnp.float32))
        out[f"{name}/key"] = np.asarray(jax.random.key_data(key))
    tmp = path + ".tmp.npz"
    np.savez(tmp, **out)
    os.replace(tmp, path)


if __name__ == "__main__":
    main(sys.argv[1])
