"""Attention kernels behind `attention=auto|dot_product|flash`: the materialized dot product, Pallas splash attention
on TPU, Pallas (Triton) flash attention on GPU, and a blockwise online-softmax attention on CPU.

Every kernel takes the query already scaled, q [B, L, K, G, Dh] (G = H / K query heads per kv head), k [B, L, K, Dh]
and v [B, L, K, Dv] (Dv = Dh but for latent attention's 128 beside Dh 192), and a mask W (an int, or a traced int32
for interleaved local and global layers; `attention_rule.layer_masks`): query i sees key j when j <= i and, for
W > 0, i - j < W (a sliding window), for W < 0, i // C = j // C with C = -W (Llama 4's chunks). Attention sinks
(gpt-oss), where given, are a float32 logit per query head [K, G] that joins each softmax's denominator only.
It returns the context [B, L, K, G, Dv].

Under context parallelism (the sequence split over `sequence`, MaxText's `context`; models/context.py) each device
attends with its own queries to the keys and values gathered whole (MaxText's all_gather strategy): splash attention
with its mask split by query shard (q_seq_shards), the blockwise kernel elsewhere (the GPU's Triton kernel knows no
query offset), and the dot product by the sharding rules. Load-balanced sequences come reordered; each kernel then
masks by each query's place in the original sequence and restores the gathered keys' order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from maxperf.models import context
from maxperf.spec import attention_rule
from maxperf.spec.attention_rule import SPLASH_BLOCKS, choose, implementation, unserved  # noqa: F401 (the model's names for them)
from maxperf.spec.model import ModelConfig
from maxperf.spec.train import AttentionKernel, TrainConfig

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
# The blockwise (CPU) kernel's key block: scores live as [.., L, CPU_BLOCK] tiles, never [L, L].
CPU_BLOCK = 512


@dataclass(frozen=True)
class AttentionOptions:
    """What the attention layer needs of the train config: the kernel and its settings."""

    kernel: AttentionKernel = AttentionKernel.AUTO
    float32_qk_product: bool = False
    float32_logits: bool = False
    splash_blocks: tuple[int, ...] = (512,) * 8  # in SPLASH_BLOCKS order
    fused_bwd: bool = False  # sa_use_fused_bwd_kernel: splash's backward as one kernel (dq, dk and dv together)
    layouts: tuple[str, str, str] = ("HEAD_DIM_MINOR",) * 3  # sa_q_layout, sa_k_layout, sa_v_layout
    interpret: bool = False  # run Pallas kernels in interpret mode (tests on CPU)
    load_balance: bool = False  # context_parallel_load_balance: sequences come reordered under context parallelism

    @classmethod
    def from_train(cls, train: TrainConfig) -> AttentionOptions:
        return cls(kernel=AttentionKernel(train.attention), float32_qk_product=train.float32_qk_product,
                   float32_logits=train.float32_logits,
                   splash_blocks=tuple(getattr(train, name) for name in SPLASH_BLOCKS),
                   fused_bwd=train.sa_use_fused_bwd_kernel,
                   layouts=(train.sa_q_layout, train.sa_k_layout, train.sa_v_layout),
                   load_balance=train.context_parallel_load_balance)


def platform_kind(platform: str) -> str:
    """"tpu", "gpu" or "cpu" for a jax platform name (CUDA and ROCm devices are "gpu")."""
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def platform_of_mesh() -> str:
    """The platform kind of the mesh set by `jax.set_mesh`, else of jax's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    return platform_kind(jax.default_backend() if mesh.empty else mesh.abstract_device.platform)


def check(model: ModelConfig, train: TrainConfig, platform: str) -> str:
    """The implementation for this model and step on a platform, before anything is traced (`attention_rule`, the
    rule perfmodel applies too)."""
    return attention_rule.for_config(model, train, platform)


def attend(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, window, *, softcap: float | None, options: AttentionOptions,
           windows: tuple[int, ...] = (0,), sinks_KxG: jax.Array | None = None) -> jax.Array:
    """`windows`: every mask the model's layers use (`attention_rule.windows_of`), for kernels whose masks must be
    static."""
    _, L, _, _, Dh = q_BxLxKxGxDh.shape
    impl = choose(options.kernel, platform_of_mesh(), L=L, Dh=Dh, Dv=v_BxLxKxDh.shape[-1], windows=windows,
                  softcap=softcap, blocks=options.splash_blocks, sinks=sinks_KxG is not None)
    cp_axes, cp = context.shards(L)
    balanced = options.load_balance and cp > 1
    if impl == "dot_product":
        return dot_product(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, window, softcap=softcap,
                           float32_qk_product=options.float32_qk_product, float32_logits=options.float32_logits,
                           sinks_KxG=sinks_KxG, ids=context.query_ids(L, cp, balanced))
    if impl == "splash":
        return splash(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, window, softcap=softcap, blocks=options.splash_blocks,
                      windows=windows, interpret=options.interpret, sinks_KxG=sinks_KxG, cp=(cp_axes, cp, balanced),
                      fused_bwd=options.fused_bwd, layouts=options.layouts)
    if cp > 1:
        return blockwise_context(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, window, sinks_KxG, softcap,
                                 (cp_axes, cp, balanced))
    if impl == "gpu_flash":
        return gpu_flash(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, window)
    return blockwise(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, jnp.asarray(window, jnp.int32), sinks_KxG,
                     jnp.arange(L, dtype=jnp.int32), softcap)


def visible(i, j, window):
    """Query positions i see key positions j (broadcast): causal, within the window where W > 0, within the same
    chunk of -W tokens where W < 0."""
    if isinstance(window, int):
        if window > 0:
            return (j <= i) & (i - j < window)
        if window < 0:
            return (j <= i) & (i // -window == j // -window)
        return j <= i
    chunk = jnp.maximum(-window, 1)
    return (j <= i) & ((window == 0) | ((window > 0) & (i - j < window)) | ((window < 0) & (i // chunk == j // chunk)))


# --- the materialized dot product (MaxText's apply_attention_dot) ---------------------------------------------


def dot_product(q, k, v, window, *, softcap, float32_qk_product: bool, float32_logits: bool,
                sinks_KxG: jax.Array | None = None, ids=None) -> jax.Array:
    """Scores [B, K, G, L, L] in the compute dtype (float32 with float32_qk_product), softmax in float32 with
    float32_logits, as MaxText's defaults (both off) and switches; a sink logit joins each row's max and sum (MaxText
    appends it to the scores as one more column that meets no value). `ids`: each position's place in the original
    sequence (a load-balanced reorder's; None: in order)."""
    L, dtype = q.shape[1], q.dtype
    if float32_qk_product:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    s_BxKxGxLxS = jnp.einsum("BLKGd,BSKd->BKGLS", q, k)
    if softcap is not None:
        s_BxKxGxLxS = softcap * jnp.tanh(s_BxKxGxLxS / softcap)
    if float32_logits:
        s_BxKxGxLxS = s_BxKxGxLxS.astype(jnp.float32)
    ids = jnp.arange(L) if ids is None else jnp.asarray(ids)
    i, j = ids[:, None], ids[None, :]
    masked = jnp.asarray(max(_MASKED, float(jnp.finfo(s_BxKxGxLxS.dtype).min) * 0.7), s_BxKxGxLxS.dtype)
    s_BxKxGxLxS = jnp.where(visible(i, j, window)[None, None, None], s_BxKxGxLxS, masked)
    # MaxText's compute_local_attention: unnormalized exponentials times v, the output divided by their sum; the
    # backward then holds one score-sized buffer fewer than a normalized softmax's
    m_BxKxGxLx1 = jnp.max(s_BxKxGxLxS, axis=-1, keepdims=True)
    if sinks_KxG is not None:
        sink_1xKxGx1x1 = sinks_KxG.astype(s_BxKxGxLxS.dtype)[None, :, :, None, None]
        m_BxKxGxLx1 = jnp.maximum(m_BxKxGxLx1, sink_1xKxGx1x1)
    e_BxKxGxLxS = jnp.exp(s_BxKxGxLxS - m_BxKxGxLx1)
    l_BxKxGxLx1 = jnp.sum(e_BxKxGxLxS, axis=-1, keepdims=True)
    if sinks_KxG is not None:
        l_BxKxGxLx1 = l_BxKxGxLx1 + jnp.exp(sink_1xKxGx1x1 - m_BxKxGxLx1)
    l_BxLxKxGx1 = jnp.einsum("BKGLx->BLKGx", l_BxKxGxLx1)
    o_BxLxKxGxDh = jnp.einsum("BKGLS,BSKd->BLKGd", e_BxKxGxLxS.astype(dtype), v)
    return (o_BxLxKxGxDh / l_BxLxKxGx1).astype(dtype)


# --- blockwise online softmax (CPU flash): keys in blocks, a custom backward that recomputes each block -------


def _block(S: int) -> int:
    return math.gcd(S, CPU_BLOCK)


def _scores(q, kj, i, j, window, softcap):
    """One block of capped, masked float32 scores [B, K, G, L, b], the tanh (for the cap's derivative), the mask."""
    s = jnp.einsum("BLKGd,BSKd->BKGLS", q, kj, preferred_element_type=jnp.float32)
    t = None
    if softcap is not None:
        t = jnp.tanh(s / softcap)
        s = softcap * t
    mask = visible(i[:, None], j[None, :], window)[None, None, None]
    return jnp.where(mask, s, _MASKED), t, mask


def _kv_blocks(x_BxSxKxDh, b):
    B, S, K, Dh = x_BxSxKxDh.shape
    return jnp.moveaxis(x_BxSxKxDh.reshape(B, S // b, b, K, Dh), 1, 0)


def _blockwise_forward(q, k, v, window, sinks_KxG, q_ids, softcap):
    B, L, K, G, _ = q.shape
    Dv = v.shape[-1]
    b = _block(k.shape[1])
    i = q_ids

    def body(carry, xs):
        o, m, total = carry  # o [B, K, G, L, Dv], running max m and sum total [B, K, G, L], all float32
        kj, vj, j0 = xs
        s, _, mask = _scores(q, kj, i, j0 + jnp.arange(b), window, softcap)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        total = total * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum("BKGLS,BSKd->BKGLd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
        return (o * correction[..., None] + pv, m_new, total), None

    if sinks_KxG is None:
        m0, l0 = jnp.full((B, K, G, L), _MASKED, jnp.float32), jnp.zeros((B, K, G, L), jnp.float32)
    else:  # the sink starts the running max and adds exp(sink - max) = 1 to the sum
        m0 = jnp.broadcast_to(sinks_KxG.astype(jnp.float32)[None, :, :, None], (B, K, G, L))
        l0 = jnp.ones((B, K, G, L), jnp.float32)
    init = (jnp.zeros((B, K, G, L, Dv), jnp.float32), m0, l0)
    starts = jnp.arange(0, k.shape[1], b)
    (o, m, total), _ = jax.lax.scan(body, init, (_kv_blocks(k, b), _kv_blocks(v, b), starts))
    out_BxLxKxGxDh = jnp.einsum("BKGLd->BLKGd", o / total[..., None]).astype(q.dtype)
    return out_BxLxKxGxDh, m + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def blockwise(q, k, v, window, sinks_KxG, q_ids, softcap):
    """Flash attention's algorithm (Dao et al. 2022) in plain JAX: no [L, L] scores forward or backward. `q_ids`:
    int32 [Lq], each query's position among the keys (arange: the queries are the keys' own positions)."""
    return _blockwise_forward(q, k, v, window, sinks_KxG, q_ids, softcap)[0]


def _blockwise_fwd(q, k, v, window, sinks_KxG, q_ids, softcap):
    out, lse = _blockwise_forward(q, k, v, window, sinks_KxG, q_ids, softcap)
    # the residuals beyond q, k, v carry the context's checkpoint name: a remat policy that keeps the context keeps
    # them too, and the backward needs no second forward (as MaxText names splash attention's)
    out, lse = checkpoint_name(out, "context"), checkpoint_name(lse, "context")
    return out, (q, k, v, window, sinks_KxG, q_ids, out, lse)


def _blockwise_bwd(softcap, residuals, do_BxLxKxGxDh):
    q, k, v, window, sinks_KxG, q_ids, out, lse = residuals
    b = _block(k.shape[1])
    i = q_ids
    do = do_BxLxKxGxDh.astype(jnp.float32)
    delta = jnp.einsum("BLKGd,BLKGd->BKGL", do, out.astype(jnp.float32))

    def body(dq, xs):
        kj, vj, j0 = xs
        s, t, mask = _scores(q, kj, i, j0 + jnp.arange(b), window, softcap)
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
        dv = jnp.einsum("BKGLS,BLKGd->BSKd", p, do)
        dp = jnp.einsum("BLKGd,BSKd->BKGLS", do, vj.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        if softcap is not None:
            ds = ds * (1 - t * t)
        dq = dq + jnp.einsum("BKGLS,BSKd->BLKGd", ds, kj.astype(jnp.float32))
        dk = jnp.einsum("BKGLS,BLKGd->BSKd", ds, q.astype(jnp.float32))
        return dq, (dk, dv)

    starts = jnp.arange(0, k.shape[1], b)
    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32), (_kv_blocks(k, b), _kv_blocks(v, b), starts))

    def unblock(x, like):
        return jnp.moveaxis(x, 0, 1).reshape(like.shape).astype(like.dtype)

    dsinks = None
    if sinks_KxG is not None:  # the sink's probability exp(sink - lse) meets no value: d sink = -sum p_sink delta
        p_sink = jnp.exp(sinks_KxG.astype(jnp.float32)[None, :, :, None] - lse)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 3))).astype(sinks_KxG.dtype)
    return dq.astype(q.dtype), unblock(dk, k), unblock(dv, v), None, dsinks, None


blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def _context_specs(B: int, H: int, K: int, cp_axes: tuple[str, ...]):
    """shard_map specs under context parallelism for q [B, L, K, G, Dh] (its sequence split), k and v [B, L, K, Dh]
    (gathered whole), and the query ids [L] (split as q's sequence)."""
    from jax.sharding import PartitionSpec as P

    q_spec, kv_spec = _head_specs(B, H, K)
    seq = cp_axes[0] if len(cp_axes) == 1 else cp_axes
    return (P(q_spec[0], seq, kv_spec[1], None, None), P(kv_spec[0], None, kv_spec[1], None), P(seq))


def blockwise_context(q, k, v, window, sinks_KxG, softcap, cp) -> jax.Array:
    """The blockwise kernel under context parallelism: each device's queries (their places in the sequence beside
    them) against the keys and values gathered whole, put back in sequence order where the sequence came balanced."""
    from jax.sharding import PartitionSpec as P

    cp_axes, n, balanced = cp
    B, L, K, G, _ = q.shape
    q_spec, kv_spec, ids_spec = _context_specs(B, K * G, K, cp_axes)
    ids = jnp.asarray(context.query_ids(L, n, balanced), jnp.int32)
    sinks = () if sinks_KxG is None else (sinks_KxG,)

    def local(q, k, v, ids, window, *sinks):
        if balanced:
            k, v = context.restore(k, n), context.restore(v, n)
        return blockwise(q, k, v, window, sinks[0] if sinks else None, ids, softcap)

    fn = jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, ids_spec, P(), *(P(kv_spec[2]) for _ in sinks)),
                       out_specs=q_spec, check_vma=False)
    return fn(q, k, v, ids, jnp.asarray(window, jnp.int32), *sinks)


# --- TPU: Pallas splash attention, under shard_map over batch and heads (as MaxText) --------------------------


def _head_specs(B: int, H: int, K: int):
    """shard_map specs for q [B, H, L, Dh] and k, v [B, K, L, Dh]: the batch and head axes as the logical rules
    shard them; query heads split only as far as kv heads split, so each shard holds whole groups."""
    from jax.sharding import PartitionSpec as P

    from maxperf.models.sharding import mesh_axes_for

    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    q_axes = mesh_axes_for((B, H, 1, 1), ("activation_batch", "activation_heads", None, None), sizes)
    kv_axes = mesh_axes_for((B, K, 1, 1), ("activation_batch", "activation_kv_heads", None, None), sizes)
    heads = kv_axes[1]
    return P(q_axes[0], heads, None, None), P(kv_axes[0], heads, None, None)


def splash(q, k, v, window, *, softcap, blocks: tuple[int, ...], windows: tuple[int, ...] = (0,),
           interpret: bool = False, sinks_KxG: jax.Array | None = None, cp=((), 1, False),
           fused_bwd: bool = False, layouts: tuple[str, str, str] = ("HEAD_DIM_MINOR",) * 3) -> jax.Array:
    """`cp`: (the mesh axes splitting the sequence, their product, whether the sequence came balanced);
    `fused_bwd`: the backward as one kernel (MaxText's sa_use_fused_bwd_kernel), the dq kernel's tiles unused;
    `layouts`: q's, k's and v's layouts in the kernel (MaxText's sa_q_layout, sa_k_layout, sa_v_layout)."""
    if cp[1] > 1:
        return _splash_context(q, k, v, window, softcap=softcap, blocks=blocks, windows=windows, interpret=interpret,
                               sinks_KxG=sinks_KxG, cp=cp, fused_bwd=fused_bwd, layouts=layouts)
    B, L, K, G, Dh = q.shape
    q_BxHxLxDh = jnp.einsum("BLKGd->BKGLd", q).reshape(B, K * G, L, Dh)
    k_BxKxLxDh, v_BxKxLxDh = jnp.einsum("BLKd->BKLd", k), jnp.einsum("BLKd->BKLd", v)
    kernel_blocks = {**dict(zip(SPLASH_BLOCKS, (min(x, L) for x in blocks))), FUSED: fused_bwd, LAYOUTS: layouts}

    sinks_H = None if sinks_KxG is None else sinks_KxG.astype(jnp.float32).reshape(K * G)

    sinks = () if sinks_H is None else (sinks_H,)

    def local(window_value, q_BxHxLxDh, k_BxKxLxDh, v_BxKxLxDh, *sinks_H):
        kernel = _splash_kernel(q_BxHxLxDh.shape[1], L, window_value, softcap, kernel_blocks, interpret)
        sinks = sinks_H[0] if sinks_H else None
        return jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks))(q_BxHxLxDh, k_BxKxLxDh, v_BxKxLxDh)

    def run(window_value):
        fn = functools.partial(local, window_value)
        if not jax.sharding.get_abstract_mesh().empty:
            from jax.sharding import PartitionSpec as P

            q_spec, kv_spec = _head_specs(B, K * G, K)
            fn = jax.shard_map(fn, in_specs=(q_spec, kv_spec, kv_spec, *(P(q_spec[1]) for _ in sinks)),
                               out_specs=q_spec, check_vma=False)
        return fn(q_BxHxLxDh, k_BxKxLxDh, v_BxKxLxDh, *sinks)

    if isinstance(window, int):
        o_BxHxLxDh = run(window)
    else:
        # interleaved local and global layers share one scanned body: a splash mask is static, so both are built
        # and the layer's window picks one (only that branch runs)
        choices = sorted(set(windows))
        index = jnp.searchsorted(jnp.asarray(choices, jnp.int32), window)
        o_BxHxLxDh = jax.lax.switch(index, [functools.partial(run, w) for w in choices])
    return jnp.einsum("BKGLd->BLKGd", o_BxHxLxDh.reshape(B, K, G, L, v.shape[-1]))


FUSED = "use_fused_bwd_kernel"  # beside the tiles in a kernel's blocks: the backward as one kernel
LAYOUTS = "layouts"  # and q's, k's and v's layouts (QKVLayout names)


def _splash_kernel(H: int, L: int, window: int, softcap, blocks: dict, interpret: bool, head_shards: int = 1,
                   q_seq_shards: int = 1, q_ids=None):
    """`q_ids`: each query row's place in the sequence (a balanced reorder's), None: in order."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window > 0:
        mask = sm.LocalMask((L, L), window_size=(window - 1, 0), offset=0)
    elif window < 0:
        mask = sm.ChunkedCausalMask((L, L), chunk_size=-window)
    else:
        mask = sm.CausalMask((L, L))
    if q_ids is not None:  # the masks compare positions through q_sequence, and hash and compare by it
        mask.q_sequence = np.asarray(q_ids, np.int32)
    fused = blocks.get(FUSED, False)
    q_layout, k_layout, v_layout = (sk.QKVLayout[x] for x in blocks.get(LAYOUTS, ("HEAD_DIM_MINOR",) * 3))
    sizes = sk.BlockSizes(use_fused_bwd_kernel=fused, q_layout=q_layout, k_layout=k_layout, v_layout=v_layout, **{
        name.removeprefix("sa_"): value for name, value in blocks.items()
        if name not in (FUSED, LAYOUTS) and not (fused and name.endswith("_dq"))})
    return sk.make_splash_mha(sm.MultiHeadMask([mask] * H), block_sizes=sizes, head_shards=head_shards,
                              q_seq_shards=q_seq_shards, attn_logits_soft_cap=softcap,
                              residual_checkpoint_name="context", interpret=interpret)


def _splash_context(q, k, v, window, *, softcap, blocks, windows, interpret, sinks_KxG, cp,
                    fused_bwd: bool = False, layouts: tuple[str, str, str] = ("HEAD_DIM_MINOR",) * 3) -> jax.Array:
    """Splash attention under context parallelism, as MaxText's all-gather path: the kernel's mask split by query
    shard (q_seq_shards) and by head shard, each device's queries against the keys and values gathered whole (back
    in sequence order where the sequence came balanced)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cp_axes, n, balanced = cp
    B, L, K, G, Dh = q.shape
    H = K * G
    q_BxHxLxDh = jnp.einsum("BLKGd->BKGLd", q).reshape(B, H, L, Dh)
    k_BxKxLxDh, v_BxKxLxDh = jnp.einsum("BLKd->BKLd", k), jnp.einsum("BLKd->BKLd", v)
    head_q, head_kv = _head_specs(B, H, K)
    seq = cp_axes[0] if len(cp_axes) == 1 else cp_axes
    q_spec = P(head_q[0], head_q[1], seq, None)
    mesh = jax.sharding.get_abstract_mesh()
    heads = head_q[1]
    head_shards = math.prod(dict(mesh.shape)[a] for a in ((heads,) if isinstance(heads, str) else heads or ()))
    # query tiles within a device's share of the sequence, key tiles within the whole
    kernel_blocks = {name: min(x, L // n if name.startswith("sa_block_q") else L) for name, x in zip(SPLASH_BLOCKS,
                                                                                                  blocks)}
    kernel_blocks[FUSED], kernel_blocks[LAYOUTS] = fused_bwd, layouts
    ids = context.query_ids(L, n, balanced)
    choices = [window] if isinstance(window, int) else sorted(set(windows))
    kernels = [_splash_kernel(H, L, w, softcap, kernel_blocks, interpret, head_shards, n, ids) for w in choices]
    kernel_specs = [kern.manual_sharding_spec(NamedSharding(mesh, P(heads, seq))) for kern in kernels]
    sinks = () if sinks_KxG is None else (sinks_KxG.astype(jnp.float32).reshape(H),)
    index = jnp.asarray(0 if isinstance(window, int) else
                        jnp.searchsorted(jnp.asarray(choices, jnp.int32), window), jnp.int32)

    def local(q, k, v, kernels, index, *sinks):
        if balanced:
            k, v = context.restore(k, n, axis=2), context.restore(v, n, axis=2)

        def run(kernel):
            return jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks[0] if sinks else None))(q, k, v)

        if len(kernels) == 1:
            return run(kernels[0])
        return jax.lax.switch(index, [functools.partial(run, kern) for kern in kernels])

    fn = jax.shard_map(local, in_specs=(q_spec, head_kv, head_kv, kernel_specs, P(), *(P(heads) for _ in sinks)),
                       out_specs=q_spec, check_vma=False)
    o_BxHxLxDh = fn(q_BxHxLxDh, k_BxKxLxDh, v_BxKxLxDh, kernels, index, *sinks)
    return jnp.einsum("BKGLd->BLKGd", o_BxHxLxDh.reshape(B, K, G, L, v.shape[-1]))


# --- GPU: Pallas (Triton) flash attention -------------------------------------------------------------------


# The GPUs whose 227 KiB of shared memory per thread block held the backward's tiles at the forward's (Hopper), by the
# device kind jax reports; others take half of them: the A100's 163 KiB, and Blackwell, whose compile asked for 289 KiB
# at 128 x 128 (llama3-8b on b200-8, head dim 128)
LARGE_SHARED_MEMORY = ("H100", "H200", "H800")


def gpu_blocks(Dh: int, itemsize: int, large_shared_memory: bool = False) -> dict[str, int]:
    """The Triton kernel's tiles: its forward tile of 128 (the kernel's default) while a [block, Dh] tile, Dh padded
    to a power of two, holds at most 32 KiB, else 64 or 32. Measured on an H100 (jax 0.11.2, B 2, L 2048, 16 heads):
    the default 128 overran the 227 KiB of shared memory per block at Dh 192 and 256 in bfloat16 and at Dh 128 in
    float32, and 64 served them (float32 at Dh 192 and 256 needs 32). The backward's tiles, in 16-bit dtypes on Hopper
    (`large_shared_memory`, LARGE_SHARED_MEMORY), are the forward's; elsewhere half of them, at least 32; in float32
    32 (the kernel's default). Measured on an H200 (jax 0.11.2, causal, bench/gpu_attention.py and tile sweeps,
    2026-11-30): in bfloat16 B 8, L 2048, 32 heads of 128 ran forward + backward in 4.19 ms with the backward at
    128 x 128, 4.55 at 64 x 64 and 8.47 at the default 32 x 32 (Dh 64: 3.09 and 3.28 ms; Dh 256: 4.06 at 64 x 64,
    4.41 at 32 x 32); in float32 at Dh 128 64 x 64 ran 9.64 ms against 6.29 at 32 x 32, and 128 x 128 overran shared
    memory at Dh 64."""
    padded = 1 << (Dh - 1).bit_length()
    block = next((b for b in (128, 64) if b * padded * itemsize <= 32 * 1024), 32)
    backward = 32 if itemsize > 2 else block if large_shared_memory else max(block // 2, 32)
    return {"block_q": block, "block_k": block, "block_q_dkv": backward, "block_kv_dkv": backward,
            "block_q_dq": backward, "block_kv_dq": backward}


def _large_shared_memory() -> bool:
    """Whether the mesh's GPUs (jax.set_mesh's abstract device) are of LARGE_SHARED_MEMORY."""
    mesh = jax.sharding.get_abstract_mesh()
    kind = "" if mesh.empty else str(getattr(mesh.abstract_device, "device_kind", "") or "")
    if not kind and jax.default_backend() == "gpu":
        kind = jax.devices()[0].device_kind
    return any(name in kind.upper() for name in LARGE_SHARED_MEMORY)


@functools.cache
def _gpu_mha(blocks, interpret: bool = False, dv: int | None = None):
    """jax's Pallas Triton flash attention (causal, unscaled, `blocks` its tiles) whose residuals beyond q, k and v,
    its output and log-sum-exp, carry the context's checkpoint name, as the CPU kernel's and splash's do: a remat
    policy that keeps the context keeps them, and the backward runs the backward kernel alone. jax's own rule leaves
    them unnamed, so such a policy recomputed the forward kernel in the backward (its residuals are reached through
    its private backward rule, the same in jax 0.11.2 and 0.12; without it, jax's own rule). `dv`: the value's own
    head dim where the kernel's is padded past it (gpu_flash): the output's padded columns are zeros, kept cut off
    and put back for the backward, so the context kept is `dv` wide."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    options = {"sm_scale": 1.0, "causal": True, "block_sizes": blocks, "interpret": interpret}
    backward = getattr(gpu_attention, "_mha_backward", None)
    if backward is None:
        return functools.partial(gpu_attention.mha, **options)

    @jax.custom_vjp
    def attend(q, k, v, segment_ids):
        return gpu_attention.mha(q, k, v, segment_ids, **options)

    def padded(kept, width):  # the kernel's output from the kept context: its padded columns are zeros
        return kept if dv is None else jnp.pad(kept, [(0, 0)] * (kept.ndim - 1) + [(0, width - dv)])

    def forward(q, k, v, segment_ids):
        out, lse = gpu_attention.mha(q, k, v, segment_ids, return_residuals=True, **options)
        kept = out if dv is None else out[..., :dv]
        kept, lse = checkpoint_name(kept, "context"), checkpoint_name(lse, "context")
        # the output made from the named context, so that what reads it after the kernel needs no second forward
        return padded(kept, q.shape[-1]), (q, k, v, segment_ids, kept, lse)

    def backward_rule(residuals, do):
        q, k, v, segment_ids, kept, lse = residuals
        out = padded(kept, q.shape[-1])
        # jax's rule's arguments: sm_scale, causal, block_sizes, backward_pass_impl, num_warps, num_stages, grid,
        # interpret, debug, return_residuals (mha's defaults), then the residuals and the output's cotangent
        return backward(1.0, True, blocks, "triton", None, 2, None, interpret, False, False,
                        (q, k, v, segment_ids, out, lse), do)

    attend.defvjp(forward, backward_rule)
    return attend


def gpu_flash(q, k, v, window=0, interpret: bool = False) -> jax.Array:
    """jax.experimental.pallas.ops.gpu.attention.mha, causal, kv heads repeated to the query heads (the kernel
    has no grouped-query form), under shard_map over batch and heads. The query comes scaled, so sm_scale is 1.
    Chunks (a mask W < 0) are the kernel's segments: position // C, which keeps each query within its chunk.
    The kernel takes one head dim for q, k and v: the narrower side (latent attention's v, 128 beside q and k's
    192) is padded with zeros, which add nothing to the scores, and the context's padded columns are cut off."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    Dv = v.shape[-1]
    width = max(q.shape[-1], Dv)

    def pad(x):
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])

    q, k, v = pad(q), pad(k), pad(v)
    B, L, K, G, Dh = q.shape
    q_BxLxHxDh = q.reshape(B, L, K * G, Dh)
    k_BxLxHxDh, v_BxLxHxDh = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)

    blocks = gpu_attention.BlockSizes(**gpu_blocks(Dh, q.dtype.itemsize, _large_shared_memory()))
    chunked = not isinstance(window, int) or window < 0
    segments_BxL = None
    if chunked:
        chunk = jnp.maximum(-jnp.asarray(window, jnp.int32), 1)
        segments_L = jnp.where(jnp.asarray(window) < 0, jnp.arange(L, dtype=jnp.int32) // chunk, 0)
        segments_BxL = jnp.broadcast_to(segments_L[None, :], (B, L))

    segments = () if segments_BxL is None else (segments_BxL,)

    def local(q_, k_, v_, *segments_):
        return _gpu_mha(blocks, interpret, Dv if Dv < width else None)(q_, k_, v_, segments_[0] if segments_ else None)

    fn = local
    if not jax.sharding.get_abstract_mesh().empty:
        from jax.sharding import PartitionSpec as P

        q_spec, _ = _head_specs(B, K * G, K)
        spec = P(q_spec[0], None, q_spec[1], None)
        fn = jax.shard_map(local, in_specs=(spec, spec, spec, *(P(q_spec[0], None) for _ in segments)),
                           out_specs=spec, check_vma=False)
    return fn(q_BxLxHxDh, k_BxLxHxDh, v_BxLxHxDh, *segments)[..., :Dv].reshape(B, L, K, G, Dv)
