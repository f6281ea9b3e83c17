"""int8 training matmuls: MaxText's `quantization=int8`, written with jax primitives.

MaxText (layers/quantizations.py, `_get_int8_quant_config`) builds this from Google's AQT library (package `aqtp`,
`aqt.jax.v2.config.config_v3(fwd_bits=8, dlhs_bits=8, rng_type="jax.uniform", ...)`) and applies it to every
DenseGeneral (the q, k, v and out projections, the MLP, an MoE's router) and to an MoE's expert einsums; attention's
own q k^T and context products and the logits are not quantized. What one such matmul does, as AQT does it:

- forward: both operands quantized to int8, symmetric, with a scale per channel: absmax over the operand's
  contracting axes (one scale per token row of the activations, one per output column of the weights), scale =
  absmax / 127.5, x / scale rounded half to even and clipped to [-127, 127]; an int8 x int8 dot with int32
  accumulation; the int32 result cast to the compute dtype and multiplied by both scales.
- backward, input gradient (dlhs = dy . W^T): the same, dy quantized per row with stochastic rounding (uniform
  noise in [-0.5, 0.5) added before rounding, AQT's "jax.uniform"), W quantized again from its compute-dtype copy
  (AQT's use_fwd_quant=False), scaled over its output axes.
- backward, weight gradient (drhs = x^T . dy): int8 as well unless `quantization_local_shard_count` is 0 (then a
  plain compute-dtype dot). The first contracting (token) axis is split into `local_shard_count` shards, each
  calibrated on its own (AQT's LocalAqt), dy with stochastic rounding; the shards' dequantized products are summed.
  MaxText's default -1 means jax.local_device_count() of the host that runs the step; maxperf takes the target
  topology's chips per host (what that count is on the machine the compiled step runs on).
- saved for the backward: the two compute-dtype operands, as AQT's bwd reads them (its int8 copies are residuals
  the backward never reads, dead once compiled); the backward requantizes.

Why not depend on `aqtp`: it installs (0.9.0, pure Python over jax and flax) but is deprecated in MaxText in favour
of Qwix, is a Linen module that wants flax's rng collections, and the numerics above are a hundred lines of jax;
tests/test_quantization.py checks this module against AQT's own outputs (a stored fixture).

The matmul sites call `einsum`; it quantizes only inside `scope(...)` with a config, which the decoder sets around
each layer with that layer's noise key, so layers need no extra argument. The same sites run MaxText's FP8 values
(maxperf.spec.fp8's recipes) through models/layers/fp8.py; a delayed-scaling recipe's scope holds the layer's
scales and amax histories, one row per matmul in the order the layer calls them."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from maxperf.models.layers import fp8
from maxperf.spec.errors import MaxperfError
from maxperf.spec.fp8 import Fp8Recipe
from maxperf.spec.fp8 import recipe as fp8_recipe

INT8_BOUND = 127.5  # AQT's int8 quant bound (preserve_zero, not preserve_max_val): scale = absmax / 127.5
INT8_CLIP = 127.0  # values are clipped to the last bucket's edge less half a bucket before rounding
# the noise keys' generator: MaxText's train and train_compile set jax_default_prng_impl=unsafe_rbg, which on TPU is
# XLA's RngBitGenerator
NOISE_IMPL = "unsafe_rbg"


@dataclass(frozen=True)
class Int8:
    """MaxText's quantization=int8. `local_shard_count`: the weight gradient's token-axis shards (0: that
    gradient in the compute dtype, not int8)."""

    local_shard_count: int = 1


def from_train(train) -> Int8 | Fp8Recipe | None:
    """The train config's quantization (TrainConfig.quantization): Int8, an FP8 recipe, or None. int8's
    local_shard_count -1 is jax.local_device_count(), MaxText's reading, unless the step's planner resolved it for
    the target (`resolve_local_shards`)."""
    value = str(train.quantization)
    if value == "none":
        return None
    if value == "auto":
        raise MaxperfError("quantization=auto is a choice for `maxperf plan`; resolve the request first "
                           "(maxperf.spec.resolve makes it bf16)")
    if (recipe := fp8_recipe(value)) is not None:
        return recipe
    count = train.quantization_local_shard_count
    return Int8(jax.local_device_count() if count == -1 else count)


def resolve_local_shards(train, mesh):
    """The train config with quantization_local_shard_count -1 read as MaxText reads it where the step runs:
    jax.local_device_count() of one host of `mesh`'s devices (4 on a v5p host)."""
    if str(train.quantization) != "int8" or train.quantization_local_shard_count != -1:
        return train
    devices = list(mesh.devices.flat)
    per_host = sum(d.process_index == devices[0].process_index for d in devices)
    return dataclasses.replace(train, quantization_local_shard_count=per_host)


def step_key(train, step: jax.Array) -> jax.Array | None:
    """The step's stochastic-rounding key (None without int8): the seed's key folded with the step."""
    if str(train.quantization) != "int8":
        return None
    return jax.random.fold_in(jax.random.key(train.seed, impl=NOISE_IMPL), step)


def check_moe(config: Int8 | Fp8Recipe | None, is_moe: bool, sparse_matmul: bool) -> None:
    """Quantization reaches a mixture of experts' dense (capacity) dispatch; MaxText quantizes the sparse path's
    grouped matmul inside its megablox kernel (int8) or Qwix's grouped-matmul rule (fp8_full), which maxperf does
    not."""
    if config is not None and is_moe and sparse_matmul:
        name = "int8" if isinstance(config, Int8) else config.name
        raise MaxperfError(f"quantization={name} with a mixture of experts needs sparse_matmul=false (the capacity "
                           "einsums, which it quantizes as MaxText does); the dropless grouped matmul is not quantized "
                           "here")


@dataclass(frozen=True)
class _Scope:
    config: Int8 | Fp8Recipe
    key: jax.Array | None  # int8's stochastic rounding
    meta: jax.Array | None  # a delayed FP8 recipe's scales and histories, one row per einsum call
    tag: str  # what `count_sites` files this scope's calls under
    calls: list[int]  # einsum calls traced so far in this scope, each folded into the key


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("maxperf_quantization", default=None)
_SITES: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("maxperf_fp8_sites", default=None)


@contextlib.contextmanager
def scope(config: Int8 | Fp8Recipe | None, key: jax.Array | None, meta: jax.Array | None = None, tag: str = ""):
    """Quantizes the `einsum` calls traced inside under `config` (None: none): int8's stochastic rounding drawing
    from `key` folded with the call's index in the scope; a delayed FP8 recipe reading call i's scales and
    histories from `meta[i]` (None while `count_sites` counts the calls)."""
    active = None if config is None else _Scope(config, key, meta, tag, [0])
    token = _SCOPE.set(active)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        if active is not None and (sites := _SITES.get()) is not None:
            sites[tag] = max(sites.get(tag, 0), active.calls[0])


def block_scaled() -> bool:
    """Whether the einsums traced here are quantized by a block-scaled FP8 recipe (MXFP8: jax's cuDNN scaled matmul,
    whose partitioner takes a product only where its two operands split their batch axis alike)."""
    active = _SCOPE.get()
    return active is not None and getattr(active.config, "block", 0) > 0


@contextlib.contextmanager
def count_sites():
    """Within, each scope files its einsum calls under its tag: {tag: calls} (a delayed FP8 recipe's state has a
    row per call)."""
    sites: dict[str, int] = {}
    token = _SITES.set(sites)
    try:
        yield sites
    finally:
        _SITES.reset(token)


def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum of two operands, quantized under an active `scope` (MaxText's quantized DenseGeneral and
    einsums): int8, or an FP8 recipe."""
    active = _SCOPE.get()
    if active is None:
        return jnp.einsum(spec, x, w)
    index = active.calls[0]
    active.calls[0] += 1
    dims, perm = _einsum_dims(spec, x.ndim, w.ndim)
    if isinstance(active.config, Int8):
        out = int8_dot_general(x, w, jax.random.fold_in(active.key, index), dims, active.config.local_shard_count)
        return jnp.transpose(out, perm)
    meta = None
    if active.config.state_scales:
        if active.meta is None:  # counting the calls: a stand-in state
            meta = fp8.initial_meta(active.config, 1)[0]
        elif index < active.meta.shape[0]:
            meta = active.meta[index]
        else:
            raise MaxperfError(f"the FP8 state of {active.tag} has {active.meta.shape[0]} matmuls' scales; the layer "
                               f"calls more")
    return jnp.transpose(fp8.dot_general(x, w, meta, dims, active.config), perm)


def _einsum_dims(spec: str, x_rank: int, w_rank: int) -> tuple[tuple, tuple[int, ...]]:
    """dot_general dimension numbers of a two-operand einsum, and the permutation from dot_general's output order
    (batch, x's free, w's free) to the spec's."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    if len(xs) != x_rank or len(ws) != w_rank or "." in spec:
        raise ValueError(f"einsum {spec!r} does not match operands of rank {x_rank} and {w_rank}")
    for letter in set(xs) | set(ws):
        if letter not in out and not (letter in xs and letter in ws):
            raise ValueError(f"einsum {spec!r}: {letter!r} is summed over one operand only")
    contract = [c for c in xs if c in ws and c not in out]
    batch = [c for c in xs if c in ws and c in out]
    dims = ((tuple(xs.index(c) for c in contract), tuple(ws.index(c) for c in contract)),
            (tuple(xs.index(c) for c in batch), tuple(ws.index(c) for c in batch)))
    order = batch + [c for c in xs if c not in ws] + [c for c in ws if c not in xs]
    return dims, tuple(order.index(c) for c in out)


def quantize(x: jax.Array, axes: tuple[int, ...], noise_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(int8 values, scale) of `x` with one scale per slice over `axes` (kept as size-1 dims), in x's dtype as AQT
    computes it (calibration.AbsMaxCalibration, aqt_tensor.QTensor.quant, int_numerics.IntSymmetric); `noise_key`:
    stochastic rounding, uniform noise in [-0.5, 0.5) added to x / scale."""
    dtype = x.dtype
    absmax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    absmax = jnp.where(absmax == 0, jnp.ones_like(absmax), absmax)
    scale = (absmax / INT8_BOUND).astype(dtype)
    inverse = lax.reciprocal(scale)
    inverse = jnp.where(jnp.isinf(inverse), jnp.ones_like(inverse), inverse)
    v = x * inverse
    if noise_key is not None:
        v = (v + (jax.random.uniform(noise_key, v.shape) - 0.5)).astype(dtype)
    v = lax.round(jnp.clip(v, -INT8_CLIP, INT8_CLIP), lax.RoundingMethod.TO_NEAREST_EVEN)
    return v.astype(jnp.int8), scale


def _free(rank: int, contract, batch) -> list[int]:
    return [i for i in range(rank) if i not in contract and i not in batch]


def _scale_to_output(scale: jax.Array, contract, batch, before: int, after: int) -> jax.Array:
    """A keepdims scale laid out as dot_general's output: batch axes, this operand's free axes, `before`/`after`
    size-1 axes standing for the other operand's free axes (before: the rhs's scale, after: the lhs's)."""
    free = _free(scale.ndim, contract, batch)
    s = jnp.transpose(scale, (*batch, *free, *contract))
    s = s.reshape(s.shape[:len(batch) + len(free)])
    nb = len(batch)
    return s.reshape(s.shape[:nb] + (1,) * before + s.shape[nb:] + (1,) * after)


def _quantized_dot(lhs: jax.Array, rhs: jax.Array, dims, lhs_noise: jax.Array | None) -> jax.Array:
    """AQT's DotGeneralRaw at 8 bits: int8 x int8 -> int32, dequantized in the operands' dtype (dot_general order)."""
    (lc, rc), (lb, rb) = dims
    q_lhs, s_lhs = quantize(lhs, lc, lhs_noise)
    q_rhs, s_rhs = quantize(rhs, rc, None)
    out = lax.dot_general(q_lhs, q_rhs, dims, preferred_element_type=jnp.int32)
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    lhs_free, rhs_free = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
    out = out.astype(dtype) * _scale_to_output(s_lhs, lc, lb, 0, len(rhs_free))
    out = out * _scale_to_output(s_rhs, rc, rb, len(lhs_free), 0)
    return out.astype(dtype)


def _split_first_contracting(x: jax.Array, contract, batch, shards: int):
    """AQT's LocalAqt (factor_reshape): the first contracting axis split into (shards, rest), shards a new leading
    batch axis."""
    ax = contract[0]
    shape = list(x.shape)
    if shape[ax] % shards:
        raise MaxperfError(f"quantization_local_shard_count={shards} must divide the weight gradient's contracting "
                         f"axis of {shape[ax]}")
    shape[ax:ax + 1] = [shards, shape[ax] // shards]
    new_contract = tuple(c + (c >= ax) for c in contract)
    new_batch = (ax, *(b + (b > ax) for b in batch))
    return x.reshape(shape), new_contract, new_batch


def _grad_dims(dims, x_rank: int, y_rank: int, g_rank: int, grad_of_lhs: bool):
    """dot_general(g, other) giving the gradient of one operand of out = dot_general(lhs, rhs, dims), and the
    permutation of that product's axes into the operand's layout. `other` is rhs for the lhs's gradient, lhs for
    the rhs's (AQT's _update_dimension_numbers_for_backward)."""
    (lc, rc), (lb, rb) = dims
    if grad_of_lhs:
        (xc, yc), (xb, yb) = (lc, rc), (lb, rb)  # x: the operand whose gradient this is; y: the other
    else:
        (xc, yc), (xb, yb) = (rc, lc), (rb, lb)
    nb = len(lb)
    x_free, y_free = _free(x_rank, xc, xb), _free(y_rank, yc, yb)
    n_lfree = g_rank - nb - (len(y_free) if grad_of_lhs else len(x_free))
    g_lhs_free = list(range(nb, nb + n_lfree))
    g_rhs_free = list(range(nb + n_lfree, g_rank))
    g_y_free = g_rhs_free if grad_of_lhs else g_lhs_free
    g_contract = tuple(g_y_free)
    gdims = ((g_contract, tuple(y_free)), (tuple(range(nb)), tuple(yb)))
    # the product's axes: batch, g's remaining (x's free), y's remaining (y's contracting, in y's order)
    y_ca_sorted = sorted(yc)
    product_axes = list(xb) + x_free + [xc[yc.index(a)] for a in y_ca_sorted]
    perm = tuple(product_axes.index(i) for i in range(x_rank))
    return gdims, perm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def int8_dot_general(lhs: jax.Array, rhs: jax.Array, key: jax.Array, dims, local_shard_count: int) -> jax.Array:
    """lax.dot_general(lhs, rhs, dims) quantized as MaxText's quantization=int8 (AQT config_v3): see the module
    docstring. `key`: the stochastic rounding's noise key of this call."""
    return _quantized_dot(lhs, rhs, dims, None).astype(lhs.dtype)


def _fwd(lhs, rhs, key, dims, local_shard_count):
    return int8_dot_general(lhs, rhs, key, dims, local_shard_count), (lhs, rhs, key)


def _bwd(dims, local_shard_count, res, g):
    lhs, rhs, key = res
    # AQT's DotGeneral keys: fwd, dlhs, drhs; each split again into its lhs (the gradient's) and rhs keys
    _, key_dlhs, key_drhs = jax.random.split(key, 3)
    noise_dlhs = jax.random.split(key_dlhs, 2)[0]
    noise_drhs = jax.random.split(key_drhs, 2)[0]
    gdims, perm = _grad_dims(dims, lhs.ndim, rhs.ndim, g.ndim, grad_of_lhs=True)
    dlhs = jnp.transpose(_quantized_dot(g, rhs, gdims, noise_dlhs), perm)
    gdims, perm = _grad_dims(dims, rhs.ndim, lhs.ndim, g.ndim, grad_of_lhs=False)
    if local_shard_count == 0:
        drhs = lax.dot_general(g, lhs, gdims)
    else:
        (gc, xc), (gb, xb) = gdims
        g_s, gc, gb_s = _split_first_contracting(g, gc, gb, local_shard_count)
        x_s, xc, xb_s = _split_first_contracting(lhs, xc, xb, local_shard_count)
        drhs = jnp.sum(_quantized_dot(g_s, x_s, ((gc, xc), (gb_s, xb_s)), noise_drhs), axis=0)
    drhs = jnp.transpose(drhs, perm)
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


int8_dot_general.defvjp(_fwd, _bwd)
