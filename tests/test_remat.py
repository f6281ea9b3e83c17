"""MaxText's remat policies: the tensors each keeps by checkpoint name, the same gradients under every policy,
offload to pinned host memory, and perfmodel's saved sets and recompute FLOPs that follow them."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from models_util import loss_and_grads

from maxperf.models.layers.decoder import DenseDecoderLayer
from maxperf.models.transformer import remat_policy
from maxperf.perfmodel import flops
from maxperf.perfmodel.memory import estimate_memory
from maxperf.perfmodel.saved import layer_saved_per_token, named_per_token
from maxperf.spec import overrides, presets
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.remat import RematPolicy, remat_names
from maxperf.spec.request import Request
from maxperf.spec.train import TrainConfig

# MaxText's layers/decoders.py get_remat_policy, written out: (saved on device, offloaded to the host)
QKV = {"query_proj", "key_proj", "value_proj", "qkv_proj"}
MINIMAL = QKV | {"out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"}
MAXTEXT = {
    "minimal": (MINIMAL, set()),
    "minimal_with_context": (MINIMAL | {"context"}, set()),
    "save_dot_with_context_except_mlp": (QKV | {"context", "out_proj"}, set()),
    "save_dot_except_mlpwi": (QKV | {"out_proj", "mlpwo"}, set()),
    "save_dot_except_mlp": (QKV | {"out_proj"}, set()),
    "save_qkv_proj": (QKV, set()),
    "save_out_proj": ({"out_proj"}, set()),
    "qkv_proj_offloaded": (set(), {"query_proj", "key_proj", "value_proj"}),
    "minimal_offloaded": (set(), MINIMAL),
    "full": (set(), set()),
}


@pytest.mark.parametrize("policy", sorted(MAXTEXT))
def test_policies_keep_maxtexts_names(policy):
    saved, offloaded = remat_names(TrainConfig(remat_policy=policy))
    assert (set(saved), set(offloaded)) == MAXTEXT[policy]
    assert remat_names(TrainConfig(remat_policy="none")) is None


def test_custom_policy_reads_maxtexts_per_tensor_keys():
    cfg = overrides.apply(presets.get("tiny"), ["remat_policy=custom", "query_proj=device", "mlpwo=offload",
                                                 "context=offload"])
    saved, offloaded = remat_names(cfg.train)
    assert set(saved) == {"decoder_layer_input", "query_proj"}  # MaxText keeps the layer input on device by default
    assert set(offloaded) == {"mlpwo", "context"}


def _layer_residual_names(policy: str, kernel: str, *words: str) -> set[str]:
    """The checkpoint names among what one dense layer keeps for its backward under a policy (`words`: custom's
    per-name keys, name=device)."""
    model = ModelConfig(name="t", vocab_size=16, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                        d_ff=32)
    train = TrainConfig(remat_policy=policy, attention=kernel, **dict(w.split("=") for w in words))
    from maxperf.models.layers.attention_kernels import AttentionOptions

    layer = DenseDecoderLayer(model, jnp.float32, nnx.Rngs(0), AttentionOptions.from_train(train))
    graphdef, state = nnx.split(layer)
    positions = jnp.arange(8, dtype=jnp.int32)[None]

    def apply(x, state):
        return jnp.sum(nnx.merge(graphdef, state)(x, positions, 0))

    fn = jax.checkpoint(apply, policy=remat_policy(remat_names(train)))
    names = set()
    for _, where in saved_residuals(fn, jnp.ones((1, 8, 16)), state):
        if where.startswith("named '"):
            names.add(where.split("'")[1])
    return names


@pytest.mark.parametrize("policy", ["minimal", "save_dot_except_mlpwi", "save_qkv_proj", "minimal_with_context",
                                    "full"])
def test_the_model_names_what_each_policy_keeps(policy):
    # a gated MLP, no fused qkv; the MLP's output (mlpwo) only a post-norm would read back, so it is never kept here
    read_back = {"query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1"}
    expected = MAXTEXT[policy][0] & read_back
    # as in MaxText, "context" names a flash kernel's residuals (its output and log-sum-exp) only: the dot product's
    # output is "attention_out", which none of these policies keeps
    assert _layer_residual_names(policy, "dot_product") == expected - {"context"}
    assert _layer_residual_names(policy, "flash") == expected


def test_custom_keeps_the_attention_output_by_its_own_name():
    # custom keeps the layer input on device by default (MaxText's decoder_layer_input=device)
    words = ["attention_out=device"]
    assert _layer_residual_names("custom", "dot_product", *words) == {"decoder_layer_input", "attention_out"}
    assert _layer_residual_names("custom", "flash", *words) == {"decoder_layer_input", "attention_out"}
    assert _layer_residual_names("custom", "flash", "context=device") == {"decoder_layer_input", "context"}
    assert _layer_residual_names("custom", "dot_product", "context=device") == {"decoder_layer_input"}


def _pinned_names(*words: str) -> set[str]:
    """The checkpoint names whose tensors the tiny model's scanned layers pin to a layout (a layout_constraint right
    before the name), traced under remat_policy=custom with `words`."""
    from models_util import tiny

    from maxperf.models import train_step

    cfg, spec = tiny("remat_policy=custom", *words, devices=1)
    graphdef = train_step.model_def(cfg.model, cfg.train).graphdef
    params = train_step.init_state(spec, seed=0)["params"]
    tokens = jnp.zeros((2, 16), jnp.int32)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(tokens, jnp.broadcast_to(jnp.arange(16), tokens.shape)))

    lines = str(jax.make_jaxpr(jax.grad(loss))(params)).splitlines()
    pinned = set()
    for i, line in enumerate(lines):
        # its printed parameters span lines: a checkpoint name follows within a few (the backward's transposed
        # constraints on the cotangents carry none)
        follow = [f for f in lines[i:i + 4] if "name[name=" in f] if "layout_constraint" in line else []
        if follow:
            pinned.add(follow[0].split("name[name=")[1].split("]")[0])
    return pinned


def test_offloaded_residual_stream_tensors_are_pinned_to_the_layout_the_backward_reads():
    """Offloaded to host memory, the layer's input and the attention's and MLP's output projections are pinned to
    row-major (layers/offload.py: TPU cannot relayout host memory, and copied a whole stack back and forth where the
    forward wrote it seq-minor); kept on the device, or offloaded but not of the residual stream, nothing is pinned."""
    assert _pinned_names("decoder_layer_input=offload", "out_proj=offload", "mlpwo=offload",
                         "query_proj=offload") == {"decoder_layer_input", "out_proj", "mlpwo"}
    assert _pinned_names("decoder_layer_input=device", "out_proj=device", "query_proj=offload") == set()


@pytest.mark.slow
def test_every_policy_gives_the_same_gradients():
    # offloading policies included: XLA:CPU has a pinned host memory space of its own
    reference = loss_and_grads("remat_policy=none")[1]
    for policy in [p for p in RematPolicy if p is not RematPolicy.NONE]:
        words = (["context=offload", "mlpwi_0=device", "decoder_layer_input=offload", "out_proj=offload"]
                 if policy is RematPolicy.CUSTOM else [])
        other = loss_and_grads(f"remat_policy={policy.value}", *words)[1]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), reference, other)


# perfmodel


LLAMA = presets.get("llama2-7b")
MESH = Mesh.of({"fsdp": 8})


@pytest.mark.parametrize("policy", sorted(MAXTEXT))
def test_perfmodel_saves_and_offloads_each_policys_names(policy):
    train = TrainConfig(per_device_batch_size=2, seq_len=4096, remat_policy=policy)
    sizes = named_per_token(LLAMA, train, MESH)
    saved, offloaded = MAXTEXT[policy]
    assert layer_saved_per_token(LLAMA, train, MESH, remat=policy) == sum(sizes.get(n, 0) for n in saved)
    memory = estimate_memory(LLAMA, train, MESH, hbm_bytes=95e9)
    T = 2 * 4096
    assert memory.host_offload == LLAMA.num_layers * T * sum(sizes.get(n, 0) for n in offloaded)


def test_offloading_moves_bytes_from_hbm_to_host():
    train = TrainConfig(per_device_batch_size=2, seq_len=4096)
    kept = estimate_memory(LLAMA, replace(train, remat_policy="minimal"), MESH, hbm_bytes=95e9)
    moved = estimate_memory(LLAMA, replace(train, remat_policy="minimal_offloaded"), MESH, hbm_bytes=95e9)
    full = estimate_memory(LLAMA, replace(train, remat_policy="full"), MESH, hbm_bytes=95e9)
    assert moved.activations == full.activations  # only the layer inputs stay on device
    assert moved.host_offload == kept.activations - full.activations
    assert full.host_offload == kept.host_offload == 0


def test_flash_keeps_no_scores():
    train = TrainConfig(per_device_batch_size=1, seq_len=8192, remat_policy="none")
    a = named_per_token(LLAMA, train, MESH)
    flash = layer_saved_per_token(LLAMA, replace(train, attention="flash"), MESH, remat="none")
    dot = layer_saved_per_token(LLAMA, replace(train, attention="dot_product"), MESH, remat="none")
    H, Dh = LLAMA.num_heads, LLAMA.head_dim
    # two bf16 score buffers (exponentials and probabilities, MaxText's defaults) and the scaled q, against flash's
    # residuals: its output in its own layout and the float32 log-sum-exp per head (perfmodel/memory.py SCORE_SAVED,
    # FLASH_LSE_BYTES: the forward scan's stacks of a compiled step)
    assert dot - flash == H * 2 * 2 * 8192 + 2 * H * Dh - (2 * H * Dh + 4 * H)
    # "context" the kernel's residuals, as MaxText names them; the output in the model's layout "attention_out"
    assert a["context"] == 2 * H * Dh + 4 * H
    assert a["attention_out"] == 2 * H * Dh


def test_recompute_follows_what_each_policy_keeps():
    model = presets.get("llama3-8b")  # gated MLP, grouped-query attention, no post-norms
    counts = {p: flops.count_flops(model, TrainConfig(seq_len=4096, remat_policy=p, attention="dot_product"))
              for p in [*MAXTEXT, "none"]}
    per_token = flops.projection_flops_per_token(model)
    T, N = 4096, model.num_layers
    attention_fwd = counts["none"].attention_executed_flops / 3
    qkv = sum(per_token[n] for n in ("query_proj", "key_proj", "value_proj"))
    mlp_in = per_token["mlpwi_0"] + per_token["mlpwi_1"]
    assert counts["none"].recompute_flops == 0
    assert counts["minimal"].recompute_flops == attention_fwd  # the dot product's scores and context, again
    # MaxText's dot product names no "context": minimal_with_context recomputes what minimal does
    assert counts["minimal_with_context"].recompute_flops == attention_fwd
    assert counts["save_dot_except_mlp"].recompute_flops == pytest.approx(N * T * mlp_in + attention_fwd)
    assert counts["save_qkv_proj"].recompute_flops == pytest.approx(
        N * T * (per_token["out_proj"] + mlp_in) + attention_fwd)
    assert counts["full"].recompute_flops == pytest.approx(
        N * T * (qkv + per_token["out_proj"] + mlp_in) + attention_fwd)
    # offloaded tensors come back from the host instead of being recomputed
    assert counts["minimal_offloaded"].recompute_flops == counts["minimal"].recompute_flops


@pytest.mark.slow
def test_offload_compiles_for_tpu(tmp_path):
    from maxperf import aot

    result = aot.compile("v5p-8", "tiny", ["seq_len=256", "per_device_batch_size=2", "remat_policy=minimal_offloaded",
                                           "attention=flash"], out=tmp_path / "off")
    hlo = (tmp_path / "off" / "hlo" / "optimized.hlo.txt").read_text()
    assert "S(5)" in hlo  # XLA's pinned host memory space holds the offloaded activations
    assert result.estimate["memory"]["host_offload"] > 0


def test_step_time_follows_the_kernel_and_the_offload():
    from perfmodel_util import Topo

    from maxperf.perfmodel import estimate
    from maxperf.perfmodel.chips import get

    topo = Topo("tpu-v5p", 64, hosts=16, torus=(4, 4, 4))
    train = TrainConfig(per_device_batch_size=2, seq_len=4096, remat_policy="minimal")
    rows = {m: {r.name: r for r in estimate(Request.of(topo, LLAMA, replace(train, attention=m), {"fsdp": 64},
                                                       {})).breakdown}
            for m in ("flash", "dot_product")}
    assert "attention (flash kernel)" in rows["flash"] and "softmax" not in rows["flash"]  # no passes over HBM
    assert {"attention scores", "attention context", "softmax"} <= set(rows["dot_product"])
    offload = estimate(Request.of(topo, LLAMA, replace(train, remat_policy="minimal_offloaded"), {"fsdp": 64}, {}))
    link = next(r for r in offload.breakdown if r.name == "remat offload (host link)")
    moved = 2 * offload.memory.host_offload  # to the host in the forward, back in the backward
    assert (link.kind, link.bytes) == ("host", moved)
    assert link.seconds == pytest.approx(moved / get("tpu-v5p").host_link_bandwidth)


def test_custom_policy_keys_under_another_policy_change_nothing_and_say_so():
    """MaxText reads decoder_layer_input, out_proj and the rest only under remat_policy=custom: given with another
    policy they are named in a warning and the step is the one without them."""
    from maxperf.perfmodel import estimate
    from maxperf.spec.request import resolve

    plain = resolve("cpu-8", "tiny", ["remat_policy=minimal"])
    given = resolve("cpu-8", "tiny", ["remat_policy=minimal", "decoder_layer_input=offload", "out_proj=device"])
    said = [w for w in given.warnings if "only under remat_policy=custom" in w]
    assert len(said) == 1 and "decoder_layer_input=offload, out_proj=device" in said[0]
    assert "remat_policy=minimal they change nothing" in said[0]
    assert not any("only under remat_policy=custom" in w for w in plain.warnings)
    assert estimate(given).memory == estimate(plain).memory
    assert estimate(given).step_time_s == estimate(plain).step_time_s
    custom = resolve("cpu-8", "tiny", ["remat_policy=custom", "decoder_layer_input=offload"])
    assert not any("only under remat_policy=custom" in w for w in custom.warnings)
    on_device = estimate(resolve("cpu-8", "tiny", ["remat_policy=custom"])).memory
    assert estimate(custom).memory.host_offload > on_device.host_offload == 0
