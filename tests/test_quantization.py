"""quantization=int8 (models/layers/quantization.py): AQT's numerics bit for bit, gradients as AQT defines them, a
tiny model that learns under it, s8 dots in the compiled step, and MaxText's values maxperf does not build refused
(the FP8 ones: tests/test_fp8.py)."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxperf.models import train_step
from maxperf.models.layers import quantization
from maxperf.spec import overrides, presets
from maxperf.spec.errors import MaxperfError
from maxperf.spec.request import Request
from tests.models_util import tiny, train_losses

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "aqt_int8_dot.npz")
# the cases tests/data/make_aqt_int8_fixture.py ran AQT on: (name, dimension numbers, local shard count)
AQT_CASES = [
    ("dense", (((2,), (0,)), ((), ())), 2),
    ("out_proj", (((2, 3), (0, 1)), ((), ())), 1),
    ("bf16_drhs", (((2,), (0,)), ((), ())), 0),
]


@pytest.mark.parametrize("name, dims, shards", AQT_CASES)
def test_matches_aqt_bit_for_bit(name, dims, shards):
    """Forward, input gradient and weight gradient equal AQT's config_v3 (as MaxText builds it) exactly, stochastic
    rounding included, given the same key."""
    data = np.load(FIXTURE)
    lhs, rhs, g = (jnp.asarray(data[f"{name}/{k}"], jnp.bfloat16) for k in ("lhs", "rhs", "g"))
    key = jax.random.wrap_key_data(data[f"{name}/key"])
    # op by op, as AQT ran: a fused computation may keep bf16 intermediates in float32 (XLA:CPU does)
    y, vjp = jax.vjp(lambda a, b: quantization.int8_dot_general(a, b, key, dims, shards), lhs, rhs)
    dlhs, drhs = vjp(g)
    for field, ours in (("y", y), ("dlhs", dlhs), ("drhs", drhs)):
        np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), data[f"{name}/{field}"], err_msg=field)


def _reference_int8_matmul(x, w):
    """x [M, K] @ w [K, N] as int8 with per-row and per-column absmax scales, in numpy integers."""
    def q(a, axis):
        s = (np.max(np.abs(a), axis=axis, keepdims=True) / 127.5).astype(np.float32)
        return np.clip(np.rint(a / s), -127, 127).astype(np.int8), s

    qx, sx = q(x, 1)
    qw, sw = q(w, 0)
    acc = qx.astype(np.int32) @ qw.astype(np.int32)
    return acc, sx, sw


def test_forward_is_an_int8_matmul_with_int32_accumulation():
    """In float32 (where x / scale is exact enough to round alike), the forward is the int32 product of the rounded
    operands times the two scales: the dot itself loses nothing."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    acc, sx, sw = _reference_int8_matmul(x, w)
    ours = quantization.int8_dot_general(jnp.asarray(x), jnp.asarray(w), jax.random.key(0), (((1,), (0,)), ((), ())), 1)
    np.testing.assert_allclose(np.asarray(ours), acc.astype(np.float32) * sx * sw, rtol=1e-6)
    assert not np.allclose(np.asarray(ours), x @ w, rtol=1e-4)  # quantized, not the float product


def _grads(shards, key=0):
    x = jax.random.normal(jax.random.key(1), (8, 6, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (32, 16), jnp.float32)
    g = jax.random.normal(jax.random.key(3), (8, 6, 16), jnp.float32)
    dims = (((2,), (0,)), ((), ()))

    @jax.jit
    def grads(x, w, g):
        _, vjp = jax.vjp(lambda a, b: quantization.int8_dot_general(a, b, jax.random.key(key), dims, shards), x, w)
        return vjp(g)

    return x, w, g, grads(x, w, g)


def test_input_gradient_is_quantized_with_stochastic_rounding():
    x, w, g, (dlhs, _) = _grads(1)
    exact = jnp.einsum("BLN,KN->BLK", g, w)
    assert 0 < float(jnp.max(jnp.abs(dlhs - exact))) < 0.05 * float(jnp.max(jnp.abs(exact)))
    _, _, _, (other_key, _) = _grads(1, key=7)
    assert not np.array_equal(np.asarray(dlhs), np.asarray(other_key))  # the noise follows the key


def test_weight_gradient_unquantized_at_local_shard_count_zero():
    x, w, g, (_, drhs) = _grads(0)
    np.testing.assert_allclose(np.asarray(drhs), np.asarray(jnp.einsum("BLK,BLN->KN", x, g)), rtol=1e-5, atol=1e-4)
    _, _, _, (_, drhs_int8) = _grads(2)
    assert not np.allclose(np.asarray(drhs_int8), np.asarray(drhs), rtol=1e-4)


def test_weight_gradient_shards_are_scaled_apart():
    """With 2 local shards the weight gradient is the sum of each half-batch's own int8 product (AQT's LocalAqt),
    op by op on both sides."""
    x = jax.random.normal(jax.random.key(1), (8, 6, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (32, 16), jnp.float32)
    g = jax.random.normal(jax.random.key(3), (8, 6, 16), jnp.float32)
    key = jax.random.key(0)
    _, vjp = jax.vjp(lambda a, b: quantization.int8_dot_general(a, b, key, (((2,), (0,)), ((), ())), 2), x, w)
    _, drhs = vjp(g)
    noise = jax.random.split(jax.random.split(key, 3)[2], 2)[0]
    product = quantization._quantized_dot(g.reshape(2, 4, 6, 16), x.reshape(2, 4, 6, 32),
                                          (((1, 2), (1, 2)), ((0,), (0,))), noise)
    np.testing.assert_array_equal(np.asarray(drhs), np.asarray(jnp.sum(product, axis=0).T))


@pytest.mark.parametrize("spec, x_shape, w_shape", [
    ("BECD,EDF->BECF", (4, 3, 5, 16), (3, 16, 8)),  # an expert matmul: E a batch axis
    ("BLD,BLEC->BECD", (4, 6, 16), (4, 6, 3, 5)),  # the capacity dispatch
    ("BECD,BLEC->BLD", (4, 3, 5, 16), (4, 6, 3, 5)),  # the capacity combine
])
def test_einsums_with_batch_axes_follow_the_float_ones(spec, x_shape, w_shape):
    """The MoE's einsums quantized (batch axes, several contracting axes, 2 local shards): outputs and gradients
    within 8% of the float einsum's (random normal operands)."""
    x = jax.random.normal(jax.random.key(1), x_shape)
    w = jax.random.normal(jax.random.key(2), w_shape)
    probe = jax.random.normal(jax.random.key(3), jnp.einsum(spec, x, w).shape)

    @jax.jit
    def run(x, w):
        def loss(x, w, config):
            with quantization.scope(config, jax.random.key(0)):
                return jnp.sum(quantization.einsum(spec, x, w) * probe)
        return [jax.value_and_grad(loss, (0, 1))(x, w, c) for c in (quantization.Int8(2), None)]

    (v, grads), (v_ref, grads_ref) = run(x, w)
    for ours, ref in ((v, v_ref), *zip(grads, grads_ref)):
        assert ours.shape == ref.shape
        assert float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref)) < 0.08


def test_einsum_outside_a_scope_is_plain():
    x = jnp.ones((2, 3, 4))
    w = jnp.ones((4, 5))
    np.testing.assert_array_equal(quantization.einsum("BLD,DF->BLF", x, w), jnp.einsum("BLD,DF->BLF", x, w))


@pytest.mark.slow
def test_tiny_model_learns_under_int8():
    _, spec = tiny("learning_rate=1e-2", "quantization=int8", "compute_dtype=bfloat16", devices=2)
    assert spec.train.quantization_local_shard_count == 2  # -1 read as the devices of this host
    losses, _ = train_losses(spec, 30)
    assert losses[-1] < 0.5 * losses[0], losses


def _dot_types(hlo: str) -> list[tuple[str, str, str]]:
    """(result, lhs, rhs) element types of every dot in optimized HLO text (instruction names are module-wide)."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    out = []
    for result, lhs, rhs in re.findall(r"= (\w+)\[[^=]*? dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo):
        out.append((result, types.get(lhs, "?"), types.get(rhs, "?")))
    return out


@pytest.mark.slow
def test_compiled_step_has_int8_dots():
    """The compiled step multiplies s8 by s8 into s32: per layer the 7 projections (q, k, v, out, the MLP's gate, up
    and down) in the forward, in full remat's recomputation (less the MLP's down projection, whose output the
    backward does not need: XLA drops it), and in both backward products."""
    _, spec = tiny("quantization=int8", "compute_dtype=bfloat16", "scan_layers=false", devices=1)
    with jax.set_mesh(spec.mesh):
        dots = _dot_types(train_step.jit_step(spec).lower(spec.state, spec.batch).compile().as_text())
    int8 = [d for d in dots if d == ("s32", "s8", "s8")]
    assert len(int8) == 2 * (7 + 6 + 2 * 7), dots  # 2 layers
    _, plain = tiny("compute_dtype=bfloat16", "scan_layers=false", devices=1)
    with jax.set_mesh(plain.mesh):
        dots = _dot_types(train_step.jit_step(plain).lower(plain.state, plain.batch).compile().as_text())
    assert dots and all("s8" not in d for d in dots)


def test_moe_sparse_path_is_refused():
    with pytest.raises(MaxperfError, match="sparse_matmul=false"):
        tiny("quantization=int8", preset="tiny-moe", devices=1)


@pytest.mark.parametrize("value", ["int8w", "int4w", "intmp", "nanoo_fp8", "te_nvfp4"])
def test_other_maxtext_values_are_refused(value):
    with pytest.raises(MaxperfError, match="valid values: none, int8, fp8, aqt_fp8"):
        overrides.apply(presets.get("tiny"), [f"quantization={value}"])


def test_maxtext_empty_value_is_none():
    assert str(overrides.apply(presets.get("tiny"), ["quantization="]).train.quantization) == "none"


def test_cli_bad_value_exits_2_with_one_line():
    run = subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate", "--topology", "v5p-8", "--model", "tiny",
                          "quantization=nanoo_fp8"], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if "quantization" in line]
    assert lines == [lines[0]] and "valid values: none, int8" in lines[0] and "Traceback" not in run.stderr


def _rows(chip: str, *words: str) -> dict:
    from perfmodel_util import Topo

    from maxperf.perfmodel import estimate
    from maxperf.spec.train import TrainConfig

    train = overrides.apply(presets.get("llama2-7b"), list(words)).train
    assert isinstance(train, TrainConfig)
    e = estimate(Request.of(Topo(chip, 64, hosts=16, torus=(4, 4, 4)), presets.get("llama2-7b"), train, {"fsdp": 64},
                            {}))
    return {r.name: r for r in e.breakdown}


def test_perfmodel_runs_int8_matmuls_at_the_int8_peak():
    """v5p: 918 int8 TOPS against 459 bf16 TFLOP/s, so the projections' compute halves; the logits do not change
    (MaxText does not quantize them) and the quantize passes are a row of their own."""
    bf16, int8 = _rows("tpu-v5p"), _rows("tpu-v5p", "quantization=int8")
    assert int8["mlp down"].flops == bf16["mlp down"].flops
    assert int8["mlp down"].seconds == pytest.approx(bf16["mlp down"].seconds / 2, rel=0.02)
    assert int8["unembedding"].seconds == bf16["unembedding"].seconds
    assert "int8 quantize" in int8 and "int8 quantize" not in bf16


def test_perfmodel_weight_gradient_in_bf16_at_local_shard_count_zero():
    """quantization_local_shard_count=0: a third of each projection's matmul FLOPs (the weight gradient) stays at
    the bf16 rate."""
    bf16 = _rows("tpu-v5p")["mlp down"].seconds
    shards0 = _rows("tpu-v5p", "quantization=int8", "quantization_local_shard_count=0")["mlp down"].seconds
    assert shards0 == pytest.approx(bf16 * (1 / 3 + 2 / 3 / 2), rel=0.02)


def test_perfmodel_int8_on_v4_only_adds_the_quantize_passes():
    """TPU v4 runs int8 at its bf16 rate (275 T either way): the matmuls take as long, the quantize passes more."""
    bf16, int8 = _rows("tpu-v4"), _rows("tpu-v4", "quantization=int8")
    assert int8["mlp down"].seconds == pytest.approx(bf16["mlp down"].seconds, rel=0.02)
    assert int8["int8 quantize"].seconds > 0


@pytest.mark.parametrize("topology", ["v5p-64", "v6e-256"])
def test_local_shard_count_default_is_the_targets_chips_per_host(topology):
    """MaxText's -1 is jax.local_device_count() where the step runs: one host of the target (4 chips on these VMs),
    read from the compile-only devices' process indices."""
    from jax.sharding import Mesh

    from maxperf.aot import targets
    from maxperf.spec import topology as topologies

    per_host = topologies.get(topology).chips_per_host
    assert per_host == 4
    devices = targets.devices(topologies.get(topology))
    mesh = Mesh(np.array(devices).reshape(-1), ("fsdp",))
    train = overrides.apply(presets.get("tiny"), ["quantization=int8"]).train
    assert quantization.resolve_local_shards(train, mesh).quantization_local_shard_count == per_host
    explicit = overrides.apply(presets.get("tiny"), ["quantization=int8", "quantization_local_shard_count=0"]).train
    assert quantization.resolve_local_shards(explicit, mesh) is explicit
