"""FP8 training matmuls: MaxText's FP8 `quantization` values (the recipes of maxperf.spec.fp8), written with jax.

One quantized matmul y = dot_general(x, W) under a recipe:

- forward: x and W cast to the forward format (e4m3) after dividing by their scales, an FP8 x FP8 dot_general with
  the compute dtype as its result type (XLA:GPU runs it as an FP8 GEMM, XLA:TPU as an f8 convolution; XLA:CPU
  converts the operands to float32 first), the result multiplied by both scales. A scale is amax / the format's
  largest finite value (448 for e4m3, 57344 for e5m2), amax over the whole operand (per tensor) or over its
  contracting axes (per channel: a row of x, a column of W), an amax of 0 taking scale 1.
- backward, with a gradient format: the output gradient dy cast to it (e5m2) with its own scale, and both backward
  products (dx = dy W^T, dW = x^T dy) FP8 x FP8. Per tensor they multiply the forward's FP8 operands (the same
  values a requantization gives). Per channel (Qwix's fp8_full), the forward operand's scales lie along the
  backward product's contraction, so they move onto dy before dy is quantized (Qwix's scale shifting), and the
  forward's FP8 values are multiplied as they are. Without a gradient format (aqt_fp8) the backward's two products
  are plain, in the compute dtype.
- delayed scaling (fp8, te_fp8_delayedscaling): each operand's scale comes from its amax history, not from itself:
  scale = max(history) / largest (the earlier scale while the history holds no positive finite amax; the first
  step's scales are 1), and the operand's amax enters the history, a window of the last `history` steps kept as
  flax's fp8_ops.update_fp8_meta keeps it (rolled by one, the newest written first). x's and W's scales are
  updated in the forward, dy's in the backward. The scales and histories of a matmul are one float32 array `meta`
  [3, 1 + history] (rows x, W, dy; column 0 the scale, the rest the history), and its gradient is its updated
  value: the train step stores the gradient of `meta` in the state instead of applying an update (flax's
  `_overwrite_with_gradient` collection).
- block scaling (te_mxfp8): jax.nn.scaled_dot_general with its "mxfp8" config for x, W and dy alike (E4M3 values, an
  E8M0 scale per 32 elements of the contraction, quantized again along the backward's contraction from the compute
  dtype); XLA:GPU runs it as cuDNN's block-scaled GEMM on Blackwell. Every contraction must be a multiple of 32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from maxperf.spec.errors import MaxperfError
from maxperf.spec.fp8 import MX_BLOCK, Fp8Recipe, Granularity, Scaling


def meta_shape(recipe: Fp8Recipe) -> tuple[int, ...]:
    """The shape of one matmul's scales and amax histories (delayed scaling); () where the recipe keeps none."""
    return (recipe.state_scales, 1 + recipe.history) if recipe.state_scales else ()


def initial_meta(recipe: Fp8Recipe, sites: int, stack: tuple[int, ...] = ()) -> jax.Array:
    """`sites` matmuls' state (per layer of a `stack`): scales 1, histories empty, as flax initializes them."""
    meta = jnp.zeros((*stack, sites, *meta_shape(recipe)), jnp.float32)
    return meta.at[..., 0].set(1.0)


def _largest(fmt) -> float:
    return float(jnp.finfo(fmt).max)


def _amax(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=axes, keepdims=True).astype(jnp.float32)


def scale_of(amax: jax.Array, fmt) -> jax.Array:
    """amax / the format's largest value; 1 where amax is 0 (nothing to scale) or not finite."""
    ok = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(ok, amax / _largest(fmt), 1.0)


def cast(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
    """x / scale in `fmt`, clipped to its finite range (e4m3fn has no infinity: an overflow would be NaN)."""
    top = _largest(fmt)
    return jnp.clip(x / scale.astype(x.dtype), -top, top).astype(fmt)


def _delayed(meta_row: jax.Array, x: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
    """flax's update_fp8_meta: this step's scale from the history, and the history with x's amax pushed in."""
    scale, history = meta_row[0], meta_row[1:]
    scale = jnp.where(scale > 0, scale, 1.0)  # a state never written (a zero gradient) scales as a fresh one
    amax = jnp.max(history)
    new_scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / _largest(fmt), scale)
    new_history = jnp.roll(history, -1).at[0].set(jnp.max(jnp.abs(x)).astype(jnp.float32))
    return new_scale, jnp.concatenate([new_scale[None], new_history])


def _free(rank: int, contract, batch) -> list[int]:
    return [i for i in range(rank) if i not in contract and i not in batch]


def _to_output(scale: jax.Array, contract, batch, before: int, after: int) -> jax.Array:
    """A keepdims per-channel scale laid out as dot_general's output (batch, lhs free, rhs free): `before`/`after`
    size-1 axes for the other operand's free axes."""
    free = _free(scale.ndim, contract, batch)
    s = jnp.transpose(scale, (*batch, *free, *contract))
    s = s.reshape(s.shape[:len(batch) + len(free)])
    nb = len(batch)
    return s.reshape(s.shape[:nb] + (1,) * before + s.shape[nb:] + (1,) * after)


def _grad_dims(dims, x_rank: int, y_rank: int, g_rank: int, grad_of_lhs: bool):
    """dot_general(g, y) giving the gradient of operand x of out = dot_general(lhs, rhs, dims) (y the other
    operand), and the permutation of that product's axes into x's layout."""
    (lc, rc), (lb, rb) = dims
    (xc, yc), (xb, yb) = ((lc, rc), (lb, rb)) if grad_of_lhs else ((rc, lc), (rb, lb))
    nb = len(lb)
    x_free, y_free = _free(x_rank, xc, xb), _free(y_rank, yc, yb)
    n_lfree = g_rank - nb - (len(y_free) if grad_of_lhs else len(x_free))
    g_y_free = list(range(nb + n_lfree, g_rank)) if grad_of_lhs else list(range(nb, nb + n_lfree))
    gdims = ((tuple(g_y_free), tuple(y_free)), (tuple(range(nb)), tuple(yb)))
    product_axes = list(xb) + x_free + [xc[yc.index(a)] for a in sorted(yc)]
    return gdims, tuple(product_axes.index(i) for i in range(x_rank))


def _operand_axes(x: jax.Array, contract, granularity: Granularity) -> tuple[int, ...]:
    """The axes one scale spans: all of them per tensor, the contracting ones per channel."""
    return tuple(range(x.ndim)) if granularity is Granularity.TENSOR else tuple(contract)


def _scaled_dot(q_lhs, s_lhs, q_rhs, s_rhs, dims, dtype, per_channel: bool) -> jax.Array:
    """The FP8 product of two cast operands, times their scales (per tensor: scalars; per channel: laid out)."""
    out = lax.dot_general(q_lhs, q_rhs, dims, preferred_element_type=dtype)
    (lc, rc), (lb, rb) = dims
    if not per_channel:
        return out * (s_lhs.reshape(()) * s_rhs.reshape(())).astype(dtype)
    lhs_free, rhs_free = _free(q_lhs.ndim, lc, lb), _free(q_rhs.ndim, rc, rb)
    out = out * _to_output(s_lhs, lc, lb, 0, len(rhs_free)).astype(dtype)
    return out * _to_output(s_rhs, rc, rb, len(lhs_free), 0).astype(dtype)


def _quantize(x, contract, recipe: Fp8Recipe, fmt, meta_row=None):
    """(FP8 values, scale, updated meta row or None) of an operand of a product contracting `contract`."""
    if recipe.scaling is Scaling.DELAYED:
        scale, row = _delayed(meta_row, x, fmt)
        return cast(x, scale, fmt), scale.reshape((1,) * x.ndim), row
    scale = scale_of(_amax(x, _operand_axes(x, contract, recipe.granularity)), fmt)
    return cast(x, scale, fmt), scale, None


def _forward(lhs, rhs, meta, dims, recipe: Fp8Recipe):
    (lc, rc), _ = dims
    fmt = jnp.dtype(recipe.forward)
    q_l, s_l, row_l = _quantize(lhs, lc, recipe, fmt, None if meta is None else meta[0])
    q_r, s_r, row_r = _quantize(rhs, rc, recipe, fmt, None if meta is None else meta[1])
    out = _scaled_dot(q_l, s_l, q_r, s_r, dims, lhs.dtype, recipe.granularity is Granularity.CHANNEL)
    return out, (q_l, s_l, q_r, s_r), (row_l, row_r)


def dot_general(lhs: jax.Array, rhs: jax.Array, meta: jax.Array | None, dims, recipe: Fp8Recipe) -> jax.Array:
    """lax.dot_general(lhs, rhs, dims) as `recipe` multiplies it (the module docstring); `meta`: the delayed
    recipes' scales and histories [3, 1 + history] (None for the others), whose gradient is their update."""
    if recipe.scaling is Scaling.BLOCK:
        return _mxfp8(lhs, rhs, dims)
    return _scaled_dot_general(lhs, rhs, meta, dims, recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _scaled_dot_general(lhs, rhs, meta, dims, recipe: Fp8Recipe) -> jax.Array:
    return _forward(lhs, rhs, meta, dims, recipe)[0]


def _fwd(lhs, rhs, meta, dims, recipe):
    out, cast_operands, rows = _forward(lhs, rhs, meta, dims, recipe)
    plain = (lhs, rhs) if recipe.gradient is None else None
    return out, (plain, cast_operands, meta, rows)


def _bwd(dims, recipe, res, g):
    plain, (q_l, s_l, q_r, s_r), meta, (row_l, row_r) = res
    ranks = (q_l.ndim, q_r.ndim)
    dl_dims, dl_perm = _grad_dims(dims, ranks[0], ranks[1], g.ndim, grad_of_lhs=True)
    dr_dims, dr_perm = _grad_dims(dims, ranks[1], ranks[0], g.ndim, grad_of_lhs=False)
    if plain is not None:  # forward only: the backward in the compute dtype
        lhs, rhs = plain
        dlhs = jnp.transpose(lax.dot_general(g, rhs, dl_dims), dl_perm)
        drhs = jnp.transpose(lax.dot_general(g, lhs, dr_dims), dr_perm)
        return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None
    fmt = jnp.dtype(recipe.gradient)
    dtype = g.dtype
    if recipe.granularity is Granularity.TENSOR:
        q_g, s_g, row_g = _quantize(g, (), recipe, fmt, None if meta is None else meta[2])
        dlhs = _scaled_dot(q_g, s_g, q_r, s_r, dl_dims, dtype, False)
        drhs = _scaled_dot(q_g, s_g, q_l, s_l, dr_dims, dtype, False)
        new_meta = None if meta is None else jnp.stack([row_l, row_r, row_g])
    else:  # per channel: the forward operand's scales moved onto dy, then dy quantized per channel of the product
        dlhs = _shifted(g, q_r, s_r, dl_dims, dims, grad_of_lhs=True, fmt=fmt, dtype=dtype)
        drhs = _shifted(g, q_l, s_l, dr_dims, dims, grad_of_lhs=False, fmt=fmt, dtype=dtype)
        new_meta = None
    dlhs, drhs = jnp.transpose(dlhs, dl_perm), jnp.transpose(drhs, dr_perm)
    return dlhs.astype(dtype), drhs.astype(dtype), new_meta


def _shifted(g, q_y, s_y, gdims, dims, *, grad_of_lhs: bool, fmt, dtype) -> jax.Array:
    """Qwix's backward product dot_general(g, y) against the forward's per-channel FP8 operand y: y's scale, which
    varies along this product's contraction, multiplies g first; g is then cast per channel (its scale over the
    contraction) and the FP8 values multiplied."""
    (lc, rc), (lb, rb) = dims
    y_contract, y_batch = (rc, rb) if grad_of_lhs else (lc, lb)
    # g's axes are (batch, lhs free, rhs free); y's scale varies along y's free ones, the rest of g's are the other's
    other = g.ndim - len(y_batch) - len(_free(q_y.ndim, y_contract, y_batch))
    before, after = (other, 0) if grad_of_lhs else (0, other)
    g = g * _to_output(s_y, y_contract, y_batch, before, after).astype(g.dtype)
    (g_contract, y_free), (g_batch, _) = gdims
    scale = scale_of(_amax(g, tuple(g_contract)), fmt)
    out = lax.dot_general(cast(g, scale, fmt), q_y, gdims, preferred_element_type=dtype)
    y_left = q_y.ndim - len(y_free) - len(g_batch)  # y's axes left in the product: its forward contraction
    return out * _to_output(scale, g_contract, g_batch, 0, y_left).astype(dtype)


_scaled_dot_general.defvjp(_fwd, _bwd)


def _mxfp8(lhs: jax.Array, rhs: jax.Array, dims) -> jax.Array:
    (lc, rc), (lb, rb) = dims
    # the forward contracts K, the input gradient N (W's free axes), the weight gradient M (x's free axes)
    sizes = {"K": math.prod(lhs.shape[a] for a in lc), "M": math.prod(lhs.shape[a] for a in _free(lhs.ndim, lc, lb)),
             "N": math.prod(rhs.shape[a] for a in _free(rhs.ndim, rc, rb))}
    odd = {k: n for k, n in sizes.items() if n % MX_BLOCK}
    if odd:
        raise MaxperfError(f"quantization=te_mxfp8 scales every {MX_BLOCK} elements along each product's contraction; "
                           f"a matmul of {lhs.shape} by {rhs.shape} contracts "
                           + ", ".join(f"{k}={n}" for k, n in odd.items()) + f", not a multiple of {MX_BLOCK}")
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    return jax.nn.scaled_dot_general(lhs, rhs, dims,
                                     preferred_element_type=lhs.dtype, configs=[config, config, config])
