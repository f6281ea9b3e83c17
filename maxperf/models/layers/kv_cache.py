"""The serving steps' key/value cache: what each attention layer stores, how it is written, and decoding against it.

A layer's cache holds, for B sequences and S positions (MaxText's max_target_length):
- grouped-query attention: its keys and values after RoPE and the QK norms, `k` and `v` [B, K, S, Dh] on GPUs and
  CPUs, [B, S, K, Dh] on TPUs (`heads_first`): the layout each compiler's decode matmuls read without copying the
  whole cache into another one (MaxText orders its cache's axes for the same reason, `ar_cache_axis_order`);
- latent attention (MLA): the normed kv latent `c` [B, S, C] and the shared RoPE key `kr` [B, S, Dr], from which
  decoding attends in the latent space (DeepSeek-AI 2024, "DeepSeek-V2", appendix: the up-projections absorbed
  into the query and the output), so that a token's cache is C + Dr numbers per layer whatever the head count.

With MaxText's `quantize_kvcache=true` (`kv_quant_dtype=int8`) each stored tensor is int8 with a scale per
position: absmax / 127 over the heads and head dim (`kv_quant_axis=heads_and_dkv`, MaxText's default) or over the
head dim only (`dkv`), the scales in the compute dtype.

The decoder opens a `session` around each scanned unit with the caches of its stack (each array with the stack's
repeats first) and the repeat it runs; each attention block of the unit takes the next cache (`take`), writes its new
positions into that repeat's slice in place and hands the cache back (`give`), so the layers need no extra argument
and no layer's slice is copied out and back. Prefill writes positions 0..P-1 and attends within the prompt with
the training kernels; decode writes each sequence's one new position and attends over the whole cache, masked to
the positions at or before it (and within the layer's window or chunk).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from maxperf.models.layers.attention_kernels import visible
from maxperf.models.sharding import constrain

PREFILL, DECODE = "prefill", "decode"
INT8_MAX = 127.0

# logical axes of the stored tensors (maxperf.spec.logical_axes: sequences over the batch axes, heads over tensor)
KV_AXES = ("cache_batch", "cache_kv_heads", "cache_sequence", None)  # heads first; else K and S swap
LATENT_AXES = ("cache_batch", "cache_sequence", None)
SCALE_AXES = {"heads_and_dkv": ("cache_batch", "cache_sequence"),
              "dkv": ("cache_batch", "cache_kv_heads", "cache_sequence")}


@dataclass
class Session:
    """The caches of one decoder unit's layers, in call order (each with the stack's repeats first), the repeat
    `index` the unit runs, and the updated caches handed back."""

    mode: str
    caches: list[dict[str, jax.Array]]
    quant_axis: str | None  # None: the cache in the compute dtype
    index: jax.Array | int = 0
    heads_first: bool = True  # the grouped-query cache as [B, K, S, Dh] (else [B, S, K, Dh])
    updated: list[dict[str, jax.Array]] = field(default_factory=list)


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("maxperf_kv_session", default=None)


@contextlib.contextmanager
def session(mode: str, caches: list[dict[str, jax.Array]], quant_axis: str | None = None, index: jax.Array | int = 0,
            heads_first: bool = True):
    active = Session(mode, list(caches), quant_axis, index, heads_first)
    token = _SESSION.set(active)
    try:
        yield active
    finally:
        _SESSION.reset(token)
        if len(active.updated) != len(caches):
            raise RuntimeError(f"a decoder unit with {len(caches)} cached layers handed back {len(active.updated)}")


def current() -> Session | None:
    return _SESSION.get()


def take() -> dict[str, jax.Array]:
    return current().caches[len(current().updated)]


def give(cache: dict[str, jax.Array]) -> None:
    current().updated.append(cache)


def quantize(x: jax.Array, axis: str, dtype, heads_first: bool = True) -> tuple[jax.Array, jax.Array]:
    """int8 values and their scales, of x [B, K, L, Dh] ([B, L, K, Dh] unless `heads_first`) over the head dim
    (`dkv`) or the heads and head dim (`heads_and_dkv`: scales [B, L]); of a latent [B, L, C] over its width."""
    reduce = (-1,) if axis == "dkv" or x.ndim < 4 else ((1, 3) if heads_first else (2, 3))
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=reduce, keepdims=True) / INT8_MAX
    q = jnp.round(x32 / jnp.where(scale == 0, 1.0, scale))
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), jnp.squeeze(scale, reduce).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype, heads_first: bool = True) -> jax.Array:
    if q.ndim == 4 and scale.ndim == 2:  # heads_and_dkv: one scale per [B, S] position
        scale = scale[:, None, :, None] if heads_first else scale[:, :, None, None]
    else:
        scale = scale[..., None]
    return q.astype(dtype) * scale.astype(dtype)


def write(cache: dict[str, jax.Array], name: str, x: jax.Array, positions_BxL: jax.Array, mode: str,
          quant_axis: str | None, index: jax.Array | int = 0, heads_first: bool = True) -> dict[str, jax.Array]:
    """`cache` (repeats first) with `x` [B, L, ...] stored in repeat `index` at each sequence's positions (prefill:
    0..L-1, one block; decode: one position per sequence, a scatter)."""
    out = dict(cache)
    heads = x.ndim == 4 and heads_first
    if heads:  # [B, L, K, Dh] -> the stored [B, K, L, Dh]
        x = jnp.swapaxes(x, 1, 2)
    parts = {name: x}
    if quant_axis is not None:
        q, scale = quantize(x, quant_axis, cache[f"{name}_scale"].dtype, heads_first)
        parts = {name: q, f"{name}_scale": scale}
    for key, value in parts.items():
        stored = cache[key]
        value = value.astype(stored.dtype)
        rows_Bx1 = jnp.arange(stored.shape[1])[:, None]
        if mode == PREFILL:
            start = (jnp.asarray(index, jnp.int32),) + (jnp.int32(0),) * (stored.ndim - 1)
            out[key] = jax.lax.dynamic_update_slice(stored, value[None], start)
        elif heads and value.ndim >= 3:  # [repeats, B, K, S, ...]: numpy's rule puts the indexed (B, L) first
            out[key] = stored.at[index, rows_Bx1, :, positions_BxL].set(jnp.moveaxis(value, 2, 1), mode="drop")
        else:  # [repeats, B, S, ...]: a latent, heads_and_dkv scales, or a [B, S, K, Dh] cache
            out[key] = stored.at[index, rows_Bx1, positions_BxL].set(value, mode="drop")
    return out


def read(cache: dict[str, jax.Array], name: str, dtype, index: jax.Array | int = 0, heads_first: bool = True
         ) -> jax.Array:
    """Repeat `index`'s stored tensor in the compute dtype: keys and values as [B, K, S, Dh] whatever the stored
    layout, a latent as [B, S, C]."""
    one = lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False)  # noqa: E731
    if f"{name}_scale" in cache:
        x = dequantize(one(cache[name]), one(cache[f"{name}_scale"]), dtype, heads_first)
    else:
        x = one(cache[name]).astype(dtype)
    return jnp.swapaxes(x, 1, 2) if x.ndim == 4 and not heads_first else x


def _softmax_rows(s_BxKxGxLxS: jax.Array, mask_Bx1x1xLxS: jax.Array, sinks_KxG: jax.Array | None) -> jax.Array:
    """Softmax over the cache positions in float32, a sink logit joining each row's max and sum."""
    s = jnp.where(mask_Bx1x1xLxS, s_BxKxGxLxS.astype(jnp.float32), -1e30)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks_KxG is not None:
        sink = sinks_KxG.astype(jnp.float32)[None, :, :, None, None]
        m = jnp.maximum(m, sink)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sinks_KxG is not None:
        total = total + jnp.exp(sink - m)
    return e / total


def _mask(positions_BxL: jax.Array, S: int, window) -> jax.Array:
    """[B, 1, 1, L, S]: cache position j visible from query position i."""
    j = jnp.arange(S, dtype=jnp.int32)[None, None, :]
    return visible(positions_BxL[:, :, None], j, window)[:, None, None]


def decode_attention(q_BxLxKxGxDh: jax.Array, k_BxKxSxDh: jax.Array, v_BxKxSxDh: jax.Array, positions_BxL: jax.Array,
                     window, *, softcap: float | None, sinks_KxG: jax.Array | None) -> jax.Array:
    """The queries (already scaled) over the whole cache, masked to the positions each may see."""
    s = jnp.einsum("BLKGd,BKSd->BKGLS", q_BxLxKxGxDh, k_BxKxSxDh, preferred_element_type=jnp.float32)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    p = _softmax_rows(s, _mask(positions_BxL, k_BxKxSxDh.shape[2], window), sinks_KxG)
    return jnp.einsum("BKGLS,BKSd->BLKGd", p.astype(v_BxKxSxDh.dtype), v_BxKxSxDh)


def cached_gqa(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, positions_BxL, window, *, softcap, sinks_KxG, attend_prompt):
    """A grouped-query layer's attention in a serving step: stores its keys and values, then attends within the
    prompt (prefill, `attend_prompt()`) or over the cache (decode)."""
    s = current()
    cache = take()
    cache = write(cache, "k", k_BxLxKxDh, positions_BxL, s.mode, s.quant_axis, s.index, s.heads_first)
    cache = write(cache, "v", v_BxLxKxDh, positions_BxL, s.mode, s.quant_axis, s.index, s.heads_first)
    cache = {k: constrain(v, _axes_of(k, v, s.heads_first)) for k, v in cache.items()}
    give(cache)
    if s.mode == PREFILL:
        return attend_prompt()
    dtype = q_BxLxKxGxDh.dtype
    return decode_attention(q_BxLxKxGxDh, read(cache, "k", dtype, s.index, s.heads_first),
                            read(cache, "v", dtype, s.index, s.heads_first),
                            positions_BxL, window, softcap=softcap, sinks_KxG=sinks_KxG)


def cached_latent(c_BxLxC, kr_BxLxDr, positions_BxL) -> tuple[str, dict[str, jax.Array], jax.Array | int]:
    """A latent-attention layer's cache with its new latents and RoPE keys stored; (mode, cache, repeat)."""
    s = current()
    cache = take()
    cache = write(cache, "c", c_BxLxC, positions_BxL, s.mode, s.quant_axis, s.index)
    cache = write(cache, "kr", kr_BxLxDr, positions_BxL, s.mode, s.quant_axis, s.index)
    cache = {k: constrain(v, _axes_of(k, v)) for k, v in cache.items()}
    give(cache)
    return s.mode, cache, s.index


def latent_decode(qn_BxLxHxDn, qr_BxLxHxDr, w_kv_CxHxE, Dn: int, cache: dict[str, jax.Array],
                  positions_BxL, index: jax.Array | int = 0) -> jax.Array:
    """Absorbed latent attention over the cache: the queries' position-free part taken into the latent space by the
    keys' up-projection, scores against the stored latents plus the RoPE part against the stored RoPE keys, the
    weighted latents taken out by the values' up-projection. [B, L, H, Dv]."""
    dtype = qn_BxLxHxDn.dtype
    c_BxSxC, kr_BxSxDr = read(cache, "c", dtype, index), read(cache, "kr", dtype, index)
    wk_CxHxDn, wv_CxHxDv = w_kv_CxHxE[..., :Dn], w_kv_CxHxE[..., Dn:]
    q_BxLxHxC = jnp.einsum("BLHn,CHn->BLHC", qn_BxLxHxDn, wk_CxHxDn)
    s = (jnp.einsum("BLHC,BSC->BHLS", q_BxLxHxC, c_BxSxC, preferred_element_type=jnp.float32)
         + jnp.einsum("BLHr,BSr->BHLS", qr_BxLxHxDr, kr_BxSxDr, preferred_element_type=jnp.float32))
    p = _softmax_rows(s[:, :, None], _mask(positions_BxL, c_BxSxC.shape[1], 0), None)[:, :, 0]
    o_BxLxHxC = jnp.einsum("BHLS,BSC->BLHC", p.astype(dtype), c_BxSxC)
    return jnp.einsum("BLHC,CHv->BLHv", o_BxLxHxC, wv_CxHxDv)


def axes(kind: str, heads_first: bool = True) -> tuple:
    """The logical axes of a layer's stored tensor (no repeats axis): `kv`, `latent`, or a scale's `heads_and_dkv`
    / `dkv`."""
    named = {"kv": KV_AXES, "latent": LATENT_AXES, **SCALE_AXES}[kind]
    if not heads_first and kind in ("kv", "dkv"):
        named = (named[0], named[2], named[1], *named[3:])
    return named


def _axes_of(name: str, x: jax.Array, heads_first: bool = True) -> tuple:
    """The logical axes of a stored array, its repeats first."""
    if name.endswith("_scale"):
        return ("layers", *axes("dkv" if x.ndim == 4 else "heads_and_dkv", heads_first))
    return ("layers", *axes("kv" if x.ndim == 5 else "latent", heads_first))
