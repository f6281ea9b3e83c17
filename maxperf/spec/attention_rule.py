"""Which implementation serves `attention=auto|dot_product|flash` on a platform, in plain Python (no jax, no models).

The model (models/layers/attention_kernels.py) and perfmodel decide by this one rule, so the estimate counts the
kernel the compiled step runs: `auto` is flash (splash on TPU, Pallas Triton on GPU, blockwise on CPU, as MaxText's
`autoselected` picks), falling back to the dot product where flash cannot serve the setting.
"""

from __future__ import annotations

from collections.abc import Sequence

from maxperf.spec.errors import MaxperfError
from maxperf.spec.memo import per_model

# MaxText's splash attention block sizes (configs/base.yml sa_block_*), the train config's keys for them
SPLASH_BLOCKS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv",
                 "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")


def _value(x) -> str:
    return str(getattr(x, "value", x))


def implementation(kernel, platform: str) -> str:
    """The kernel that serves `attention=kernel` on a platform kind ("tpu", "gpu", "cpu")."""
    if _value(kernel) == "dot_product":
        return "dot_product"
    if _value(kernel) in CUDNN and platform == "tpu":
        raise MaxperfError(f"attention={_value(kernel)} is cuDNN's fused attention, a GPU kernel; on TPU use "
                           "attention=flash (splash) or dot_product")
    return {"tpu": "splash", "gpu": "gpu_flash"}.get(platform, "blockwise")


# MaxText's kernels of cuDNN's fused attention (Transformer Engine's and jax's bindings): GPU only, compiled as the GPU
# flash kernel (spec.train.AttentionKernel)
CUDNN = ("cudnn_flash_te", "cudnn_flash_jax")


def layer_masks(model) -> tuple[int, ...]:
    """Each layer's mask as the kernels take it: 0 causal over the whole prefix, W > 0 a sliding window of W tokens,
    -C causal within chunks of C tokens (attention_type=chunk's local layers)."""
    sign = -1 if _value(model.attention_type) == "chunk" else 1
    return tuple(sign * (w or 0) for w in model.layer_windows())


@per_model
def windows_of(model) -> tuple[int, ...]:
    """Every mask the model's layers use (`layer_masks`), sorted: the attention layer's `windows`."""
    return tuple(sorted(set(layer_masks(model))))


def unserved(impl: str, *, L: int, Dh: int, windows: tuple[int, ...], softcap: float | None,
             blocks: Sequence[int], Dv: int | None = None, sinks: bool = False) -> str | None:
    """Why a kernel cannot serve the setting (a phrase that names it and what would do), or None where it can;
    `windows` as `windows_of` gives them, `blocks` the splash block sizes in SPLASH_BLOCKS order, Dh the query and
    key head dim and Dv the value's (None: Dh; latent attention's differ), `sinks` whether the softmax has attention
    sinks. Splash attention takes separate qk and v head dims, chunked masks and sinks; the GPU kernel takes one head
    dim (the narrower side is padded with zeros) and chunks (as segments), but no sliding window and no sinks (MaxText
    serves sinks on GPU with cuDNN through Transformer Engine only)."""
    if impl == "splash":
        if L % 128:  # the kernel's tiles are multiples of the 128 lanes (any head dim compiles: it is padded)
            nearest = sorted({max(128, L // 128 * 128), (L // 128 + 1) * 128})
            return (f"needs seq_len a multiple of 128, got {L} (e.g. seq_len="
                    f"{' or '.join(str(n) for n in nearest)}); or attention=dot_product")
        for name, value in zip(SPLASH_BLOCKS, blocks):
            if L % min(value, L):
                fits = [b for b in range(128, L + 1, 128) if L % b == 0 and b <= value]
                return (f"needs {name} ({value}) to divide seq_len={L} or exceed it; set {name}={fits[-1]} (a "
                        f"multiple of 128 that divides {L}), or attention=dot_product")
    if impl == "gpu_flash":
        if any(w > 0 for w in windows):
            sliding = ", ".join(str(w) for w in windows if w > 0)
            return (f"serves attention_type=global and chunk only, got sliding windows of {sliding} tokens; "
                    "valid: attention=dot_product")
        if sinks:
            return "has no attention sinks (attention_sinks=true); valid: attention=dot_product"
        if softcap is not None:
            return f"has no logit soft-capping (attn_logit_softcap={softcap}); valid: attention=dot_product"
        if max(Dh, Dv or Dh) > 256:
            return f"takes head_dim up to 256, got {max(Dh, Dv or Dh)}; valid: attention=dot_product"
        if L % min(L, 128) or L % 32:  # its tiles: 128 rows (64 or 32 at wide heads), the whole sequence below 128
            return f"needs seq_len a multiple of 128 (or of 32 below 128), got {L}; valid: attention=dot_product"
    return None


def choose(kernel, platform: str, **setting) -> str:
    """The implementation for `attention=kernel` on a platform: `auto` falls back to the dot product where flash
    cannot serve the setting (`unserved`'s keywords), an explicit `flash` is refused with one line saying why."""
    impl = implementation(kernel, platform)
    why = unserved(impl, **setting)
    if why is None:
        return impl
    if _value(kernel) == "auto":
        return "dot_product"
    raise MaxperfError(f"attention={_value(kernel)} ({impl} on {platform}) {why}")


def for_config(model, train, platform: str) -> str:
    """The implementation for a model and train config (or perfmodel's shapes of them) on a platform kind."""
    Dh, Dv = head_dims(model)
    return choose(train.attention, platform, L=train.seq_len, Dh=Dh, Dv=Dv,
                  windows=windows_of(model), softcap=model.attn_logit_softcap,
                  blocks=tuple(getattr(train, name) for name in SPLASH_BLOCKS),
                  sinks=model.attention_sinks)


def head_dims(model) -> tuple[int, int]:
    """(query and key head dim, value head dim) the kernel sees: latent attention's (qk_nope_head_dim +
    qk_rope_head_dim, v_head_dim), else (head_dim, head_dim)."""
    if _value(model.attention_type) == "mla":
        return model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    return model.head_dim, model.head_dim
