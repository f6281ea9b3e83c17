"""Remat policies: what each decoder layer keeps for the backward pass, by MaxText's checkpoint names, decided here
once for the model (which saves and offloads by these names) and perfmodel (which counts what is kept, offloaded and
recomputed)."""

from __future__ import annotations

import enum
import functools


class RematPolicy(enum.StrEnum):
    """MaxText's remat policies (layers/decoders.py get_remat_policy): what each decoder layer keeps for the
    backward, by checkpoint name; the rest is recomputed. `*_offloaded` keep theirs in pinned host memory."""

    NONE = "none"  # keep every activation the backward pass needs
    MINIMAL = "minimal"  # q, k, v, out projections and the MLP's wi/wo outputs
    MINIMAL_WITH_CONTEXT = "minimal_with_context"  # minimal and the attention context
    SAVE_DOT_WITH_CONTEXT_EXCEPT_MLP = "save_dot_with_context_except_mlp"  # q, k, v, context, out
    SAVE_DOT_EXCEPT_MLPWI = "save_dot_except_mlpwi"  # q, k, v, out, mlpwo
    SAVE_DOT_EXCEPT_MLP = "save_dot_except_mlp"  # q, k, v, out
    SAVE_QKV_PROJ = "save_qkv_proj"  # q, k, v
    SAVE_OUT_PROJ = "save_out_proj"  # out
    QKV_PROJ_OFFLOADED = "qkv_proj_offloaded"  # q, k, v in host memory
    MINIMAL_OFFLOADED = "minimal_offloaded"  # minimal's set in host memory
    CUSTOM = "custom"  # each named tensor as its own key says (RematLocation)
    FULL = "full"  # keep only each layer's input, recompute the whole layer


class RematLocation(enum.StrEnum):
    """Where `remat_policy=custom` keeps one named tensor (MaxText's per-tensor keys)."""

    REMAT = "remat"  # recomputed in the backward
    DEVICE = "device"  # saved in device memory
    OFFLOAD = "offload"  # saved in pinned host memory


# The checkpoint names the decoder layer gives its tensors (MaxText's), and what each remat policy saves on device
# and offloads to the host (layers/decoders.py get_remat_policy).
# "context" names only a flash kernel's residuals (its output in the kernel's layout and the log-sum-exp; MaxText's
# splash and cuDNN paths), "attention_out" the attention's output in the model's layout, as MaxText names them.
CHECKPOINT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj", "context",
                    "attention_out", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
REMAT_SAVED: dict[RematPolicy, tuple[tuple[str, ...], tuple[str, ...]]] = {
    RematPolicy.MINIMAL: (_MINIMAL, ()),
    RematPolicy.MINIMAL_WITH_CONTEXT: ((*_MINIMAL, "context"), ()),
    RematPolicy.SAVE_DOT_WITH_CONTEXT_EXCEPT_MLP: ((*_QKV, "context", "out_proj"), ()),
    RematPolicy.SAVE_DOT_EXCEPT_MLPWI: ((*_QKV, "out_proj", "mlpwo"), ()),
    RematPolicy.SAVE_DOT_EXCEPT_MLP: ((*_QKV, "out_proj"), ()),
    RematPolicy.SAVE_QKV_PROJ: (_QKV, ()),
    RematPolicy.SAVE_OUT_PROJ: (("out_proj",), ()),
    RematPolicy.QKV_PROJ_OFFLOADED: ((), ("query_proj", "value_proj", "key_proj")),
    RematPolicy.MINIMAL_OFFLOADED: ((), _MINIMAL),
    RematPolicy.FULL: ((), ()),
}


def pipelined(policy: RematPolicy | str, on_iterations: bool = True) -> RematPolicy:
    """The remat policy a pipelined decoder runs `policy` as, as MaxText's pipeline applies it (layers/pipeline.py,
    get_pipeline_remat_policy): with `on_iterations` (set_remat_policy_on_pipeline_iterations, its default) the policy
    rematerializes each iteration of the pipeline's loop as a whole, saving besides what it names the iteration's
    input and each layer's input (decoder_layer_input), so `none` (no policy) recomputes the stage as `full` does;
    without it nothing in the pipeline is rematerialized, whatever the policy (`none`)."""
    if not on_iterations:
        return RematPolicy.NONE
    policy = RematPolicy(policy)
    return RematPolicy.FULL if policy is RematPolicy.NONE else policy


def remat_names(train, policy: RematPolicy | str | None = None) -> tuple[frozenset[str], frozenset[str]] | None:
    """(names kept on device, names offloaded to pinned host memory) under the train config's remat policy (or
    `policy`, with the config's per-name keys for `custom`); None for `none`, which rematerializes nothing."""
    policy = RematPolicy(train.remat_policy if policy is None else policy)
    if policy is RematPolicy.NONE:
        return None
    if policy is RematPolicy.CUSTOM:
        return _custom_names(tuple(RematLocation(getattr(train, name)) for name in CHECKPOINT_NAMES))
    return _POLICY_NAMES[policy]


@functools.lru_cache(maxsize=256)  # asked at every estimate
def _custom_names(where: tuple[RematLocation, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """remat_policy=custom's (kept, offloaded) names, `where` the location of each of CHECKPOINT_NAMES."""
    return (frozenset(n for n, w in zip(CHECKPOINT_NAMES, where) if w is RematLocation.DEVICE),
            frozenset(n for n, w in zip(CHECKPOINT_NAMES, where) if w is RematLocation.OFFLOAD))


_POLICY_NAMES = {policy: (frozenset(saved), frozenset(offloaded)) for policy, (saved, offloaded) in REMAT_SAVED.items()}
