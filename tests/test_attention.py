"""Attention kernels: flash (the CPU's blockwise kernel, and TPU splash attention run in interpret mode) against the
materialized dot product, MaxText's key names, and one-line errors for settings a kernel cannot serve."""

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_util import loss_and_grads

from maxperf.models import train_step
from maxperf.models.layers import attention_kernels as ak
from maxperf.spec import overrides, presets
from maxperf.spec.errors import MaxperfError
from maxperf.spec.model import AttentionType
from maxperf.spec.train import AttentionKernel

# float32 throughout: flash and the dot product agree to float32 rounding of sums over up to 1024 keys, which the
# blockwise kernel adds in another order
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


def _qkv(L=256, B=1, K=2, G=2, Dh=16):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = 0.3 * jax.random.normal(keys[0], (B, L, K, G, Dh))
    k = jax.random.normal(keys[1], (B, L, K, Dh))
    v = jax.random.normal(keys[2], (B, L, K, Dh))
    return q, k, v


def _value_and_grads(kernel, q, k, v, *more):
    """sum(sin(attention)) and its gradients with respect to q, k, v (and sinks, where given)."""
    def f(q, k, v, *more):
        return jnp.sum(jnp.sin(kernel(q, k, v, *more)))

    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(3 + len(more)))))(q, k, v, *more)


def _ids(q):
    """The blockwise kernel's query positions: the keys' own."""
    return jnp.arange(q.shape[1], dtype=jnp.int32)


def _dot(window, softcap):
    return lambda q, k, v, sinks=None: ak.dot_product(q, k, v, window, softcap=softcap, float32_qk_product=False,
                                                      float32_logits=False, sinks_KxG=sinks)


def _assert_all_close(got, ref):
    np.testing.assert_allclose(got[0], ref[0], **TOLERANCE)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, **TOLERANCE)


# masks: causal, a sliding window of 100, chunks of 384 (Llama 4's chunked attention; not a divisor of the block)
@pytest.mark.parametrize("window, softcap", [(0, None), (100, None), (0, 5.0), (100, 5.0), (-384, None)])
def test_blockwise_matches_dot_product(window, softcap):
    q, k, v = _qkv(L=1024)  # two key blocks of CPU_BLOCK
    ref = _value_and_grads(_dot(window, softcap), q, k, v)
    got = _value_and_grads(lambda q, k, v: ak.blockwise(q, k, v, jnp.int32(window), None, _ids(q), softcap), q, k, v)
    _assert_all_close(got, ref)


SINKS_KxG = jnp.asarray([[0.5, -1.0], [2.0, 0.0]])  # one learned logit per query head (K 2 x G 2)


@pytest.mark.parametrize("window", [0, 100, -384])
def test_blockwise_with_sinks_matches_dot_product_and_their_gradient(window):
    q, k, v = _qkv(L=1024)
    ref = _value_and_grads(_dot(window, None), q, k, v, SINKS_KxG)
    got = _value_and_grads(lambda q, k, v, s: ak.blockwise(q, k, v, jnp.int32(window), s, _ids(q), None), q, k, v,
                           SINKS_KxG)
    _assert_all_close(got, ref)
    assert float(jnp.max(jnp.abs(ref[1][3]))) > 1e-3  # the sinks' gradient is there, and equal


def test_sinks_join_only_the_softmax_denominator():
    """softmax over [scores, sink] without the sink's column: each query's weights sum to 1 / (1 + e^(sink - lse))."""
    q, k, v = _qkv(L=32)
    got = _dot(0, None)(q, k, v, SINKS_KxG)
    s_BxKxGxLxS = jnp.einsum("BLKGd,BSKd->BKGLS", q, k)
    s_BxKxGxLxS = jnp.where(jnp.tril(jnp.ones((32, 32), bool)), s_BxKxGxLxS, -jnp.inf)
    sink_1xKxGxLx1 = jnp.broadcast_to(SINKS_KxG[None, :, :, None, None], (1, 2, 2, 32, 1))
    p = jax.nn.softmax(jnp.concatenate([s_BxKxGxLxS, sink_1xKxGxLx1], axis=-1), axis=-1)[..., :-1]
    ref = jnp.einsum("BKGLS,BSKd->BLKGd", p, v)
    np.testing.assert_allclose(got, ref, **TOLERANCE)
    plain = _dot(0, None)(q, k, v)
    assert float(jnp.max(jnp.abs(got - plain))) > 1e-2  # the sink shrinks every query's weights


def test_a_chunk_cannot_see_across_its_boundary():
    """Gradients of chunked attention (chunks of 8): query i's output moves with key j exactly when j <= i in i's
    chunk."""
    q, k, v = _qkv(L=32)
    for kernel in (_dot(-8, None), lambda q, k, v: ak.blockwise(q, k, v, jnp.int32(-8), None, _ids(q), None)):
        dk = jax.jacrev(lambda k: kernel(q, k, v)[0, :, 0, 0, 0])(k)  # [L queries, B, L keys, K, Dh]
        seen = np.asarray(jnp.any(dk[:, 0, :, 0] != 0, axis=-1))  # [query, key]
        i, j = np.arange(32)[:, None], np.arange(32)[None, :]
        # a chunk's first query sees only its own key: its output does not move with it (no gradient to check)
        rows = np.arange(32) % 8 != 0
        np.testing.assert_array_equal(seen[rows], ((j <= i) & (i // 8 == j // 8))[rows])


@pytest.mark.slow
@pytest.mark.parametrize("window, softcap", [(0, None), (100, 5.0)])
def test_splash_in_interpret_mode_matches_dot_product(window, softcap):
    q, k, v = _qkv(L=256)
    ref = _value_and_grads(_dot(window, softcap), q, k, v)
    got = _value_and_grads(lambda q, k, v: ak.splash(q, k, v, window, softcap=softcap, blocks=(128,) * 8,
                                                     interpret=True), q, k, v)
    _assert_all_close(got, ref)


@pytest.mark.slow
def test_splash_with_its_fused_backward_matches_dot_product():
    """sa_use_fused_bwd_kernel: dq, dk and dv from one kernel (the dq kernel's tiles unused), the same values."""
    q, k, v = _qkv(L=256)
    ref = _value_and_grads(_dot(0, None), q, k, v)
    got = _value_and_grads(lambda q, k, v: ak.splash(q, k, v, 0, softcap=None, blocks=(128,) * 8, interpret=True,
                                                     fused_bwd=True), q, k, v)
    _assert_all_close(got, ref)


@pytest.mark.slow
def test_splash_with_maxtexts_layouts_matches_dot_product():
    """sa_q_layout, sa_k_layout, sa_v_layout: the kernel's layouts (as the Ironwood recipes set them), the same
    values; the layouts reach the kernel's block sizes."""
    q, k, v = _qkv(L=256)
    ref = _value_and_grads(_dot(0, None), q, k, v)
    layouts = ("SEQ_MINOR", "SEQ_MINOR", "HEAD_DIM_MINOR")
    got = _value_and_grads(lambda q, k, v: ak.splash(q, k, v, 0, softcap=None, blocks=(128,) * 8, interpret=True,
                                                     fused_bwd=True, layouts=layouts), q, k, v)
    _assert_all_close(got, ref)


def test_splash_kernel_takes_the_layouts_it_is_given():
    blocks = {**dict(zip(ak.SPLASH_BLOCKS, (128,) * 8)), ak.FUSED: True, ak.LAYOUTS: ("SEQ_MINOR", "HEAD_DIM_MINOR",
                                                                                       "SEQ_MINOR")}
    sizes = ak._splash_kernel(4, 256, 0, None, blocks, True).tree_flatten()[1]["block_sizes"]
    assert (sizes.q_layout.name, sizes.k_layout.name, sizes.v_layout.name) == blocks[ak.LAYOUTS]
    assert sizes.use_fused_bwd_kernel


def test_splash_backward_counts_the_kernels_it_runs():
    """perfmodel: splash's default backward is two kernels (dk and dv, then dq), each computing the scores and dP
    again: 7 matmuls a block against 5 fused; with full remat the forward's two run again, so 4 + 7 against 4 + 5."""
    from maxperf.perfmodel import estimate
    from maxperf.spec import resolve

    def attention(*words):
        e = estimate(resolve("v5p-8", "llama2-7b", ["remat_policy=full", "attention=flash", *words]))
        return next(r for r in e.breakdown if r.name == "attention (flash kernel)").flops

    assert attention("sa_use_fused_bwd_kernel=true") / attention() == pytest.approx(9 / 11, rel=1e-12)


@pytest.mark.slow
def test_splash_chunks_and_sinks_in_interpret_mode_match_dot_product():
    # splash's ChunkedCausalMask (chunks of 128) with sinks, and the sinks' gradient
    q, k, v = _qkv(L=256)
    ref = _value_and_grads(_dot(-128, None), q, k, v, SINKS_KxG)
    got = _value_and_grads(lambda q, k, v, s: ak.splash(q, k, v, -128, softcap=None, blocks=(128,) * 8,
                                                        interpret=True, sinks_KxG=s), q, k, v, SINKS_KxG)
    _assert_all_close(got, ref)


@pytest.mark.slow
def test_splash_under_shard_map_matches_dot_product():
    # batch over fsdp and heads over tensor, as the layer's logical rules shard them; interpret mode on CPU devices
    from models_util import cpu_mesh

    mesh = cpu_mesh({"data": 1, "fsdp": 2, "sequence": 1, "tensor": 2, "expert": 1}, jax.devices()[:4])
    q, k, v = _qkv(L=256, B=2)
    ref = _value_and_grads(_dot(0, None), q, k, v)
    with jax.set_mesh(mesh):
        got = _value_and_grads(lambda q, k, v: ak.splash(q, k, v, 0, softcap=None, blocks=(128,) * 8,
                                                         interpret=True), q, k, v)
    np.testing.assert_allclose(got[0], ref[0], **TOLERANCE)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, **TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [(), ("attention_type=local_global", "window=5", "attn_logit_softcap=20")])
def test_model_loss_and_gradients_agree_across_kernels(pattern):
    # the train step's model on CPU: flash runs the blockwise kernel (interleaved windows traced through the scan)
    ref = loss_and_grads("attention=dot_product", *pattern)
    got = loss_and_grads("attention=flash", *pattern)
    np.testing.assert_allclose(got[0], ref[0], **TOLERANCE)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE), got[1], ref[1])


def test_auto_picks_flash_on_tpu_and_gpu_and_blockwise_on_cpu():
    assert [ak.implementation(AttentionKernel.AUTO, p) for p in ("tpu", "gpu", "cpu")] == [
        "splash", "gpu_flash", "blockwise"]
    assert ak.implementation(AttentionKernel.DOT_PRODUCT, "tpu") == "dot_product"


@pytest.mark.parametrize("kernel", ["cudnn_flash_te", "cudnn_flash_jax"])
def test_maxtexts_cudnn_kernels_are_the_gpu_flash_kernel_and_refused_on_tpu(kernel):
    """MaxText's GPU configs choose cuDNN's fused attention (cudnn_flash_te): maxperf compiles and prices it as its GPU
    flash kernel, says so, and refuses it on TPU as MaxText's cuDNN kernels cannot run there."""
    from maxperf import perfmodel
    from maxperf.spec.request import resolve

    assert [ak.implementation(AttentionKernel(kernel), p) for p in ("gpu", "cpu")] == ["gpu_flash", "blockwise"]
    request = resolve("h100-8", "tiny", [f"attention={kernel}"])
    assert any(f"attention={kernel} (cuDNN's fused attention in MaxText) is compiled as attention=flash" in w
               for w in request.warnings)
    flash = perfmodel.estimate(resolve("h100-8", "tiny", ["attention=flash"]))
    assert perfmodel.estimate(request).step_time_s == flash.step_time_s
    with pytest.raises(MaxperfError, match=f"attention={kernel} is cuDNN's fused attention, a GPU kernel; on TPU use "
                                           "attention=flash"):
        resolve("v5p-8", "tiny", [f"attention={kernel}"])


def test_auto_falls_back_to_the_dot_product_where_flash_cannot_serve():
    short = overrides.apply(presets.get("tiny"), ["seq_len=64"])  # splash tiles are multiples of 128
    assert ak.check(short.model, short.train, "tpu") == "dot_product"
    with pytest.raises(MaxperfError, match=r"attention=flash .splash on tpu. needs seq_len a multiple of 128, got 64 "
                                           r"\(e.g. seq_len=128\); or"):
        ak.check(short.model, replace(short.train, attention=AttentionKernel.FLASH), "tpu")
    gemma2 = overrides.apply(presets.get("gemma2-2b"), [])
    assert ak.check(gemma2.model, gemma2.train, "gpu") == "dot_product"  # windows and soft-capping
    assert ak.check(gemma2.model, gemma2.train, "tpu") == "splash"


def test_maxtext_keys_and_values():
    cfg = overrides.apply(presets.get("tiny"), ["attention=autoselected", "attention_type=local_sliding", "window=8",
                                                 "sa_block_q=256", "float32_logits=true"])
    assert cfg.train.attention is AttentionKernel.AUTO
    assert cfg.model.attention_type is AttentionType.LOCAL_SLIDING
    assert cfg.train.sa_block_q == 256 and cfg.train.float32_logits
    assert presets.get("gemma2-2b").attention_type is AttentionType.LOCAL_GLOBAL


@pytest.mark.parametrize("words, platform, message", [
    (["attention=fast"], "cpu", "attention=fast is not valid; .*valid values: auto, dot_product, flash"),
    (["attention_type=sliding"], "cpu", "did you mean local_sliding"),
    (["sa_block_q=100"], "tpu", "sa_block_q must be a positive multiple of 128, got 100"),
    (["attention=flash", "seq_len=1000"], "tpu", r"needs seq_len a multiple of 128, got 1000 \(e.g. seq_len=896 or "
                                                 r"1024\)"),
    (["attention=flash", "seq_len=1152"], "tpu", r"needs sa_block_q \(512\) to divide seq_len=1152 or exceed it; set "
                                                 r"sa_block_q=384 \(a multiple of 128 that divides 1152\)"),
    (["attention=flash", "seq_len=200", "sa_block_q=128", "sa_block_kv=128", "sa_block_kv_compute=128",
      "sa_block_q_dkv=128", "sa_block_kv_dkv=128", "sa_block_kv_dkv_compute=128", "sa_block_q_dq=128",
      "sa_block_kv_dq=128"], "tpu", "needs seq_len a multiple of 128, got 200"),
    (["attention=flash", "attention_type=local_sliding", "window=64"], "gpu",
     "serves attention_type=global and chunk only, got sliding windows of 64 tokens; valid: attention=dot_product"),
    (["attention=flash", "attn_logit_softcap=30"], "gpu", "has no logit soft-capping"),
    (["attention=flash", "seq_len=200"], "gpu", "needs seq_len a multiple of 128 .or of 32 below 128., got 200"),
])
def test_settings_a_kernel_cannot_serve_are_one_line_errors(words, platform, message):
    with pytest.raises(MaxperfError, match=message) as err:
        cfg = overrides.apply(presets.get("tiny"), words)
        ak.check(cfg.model, cfg.train, platform)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_splash_compiles_for_tpu_and_serializes(tmp_path):
    from maxperf import aot

    # interleaved local and global layers with soft-capping: both static masks built, the layer's window picks one
    result = aot.compile("v5p-8", "tiny", ["seq_len=512", "per_device_batch_size=2", "attention=flash",
                                           "attention_type=local_global", "window=128", "attn_logit_softcap=50"],
                         out=tmp_path / "tpu")
    assert "tpu_custom_call" in (tmp_path / "tpu" / "hlo" / "optimized.hlo.txt").read_text()  # Mosaic kernels
    assert (result.out_dir / "compiled.pkl").stat().st_size > 0  # written after check_executable_pickle passed


@pytest.mark.slow
def test_gpu_flash_compiles_without_a_gpu_and_serializes(tmp_path):
    from maxperf import aot

    result = aot.compile("h100-8", "tiny", ["seq_len=256", "per_device_batch_size=2", "attention=flash"],
                         out=tmp_path / "gpu")
    assert "__gpu$xla.gpu.triton" in (tmp_path / "gpu" / "hlo" / "optimized.hlo.txt").read_text()  # Pallas Triton
    assert (result.out_dir / "compiled.pkl").stat().st_size > 0


def test_dot_product_switches_set_the_score_dtype():
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(L=16))

    def scores_dtype(**switches):
        jaxpr = jax.make_jaxpr(lambda q, k, v: ak.dot_product(q, k, v, 0, softcap=None, **switches))(q, k, v)
        softmax_in = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "reduce_max"][0]
        return softmax_in.invars[0].aval.dtype

    assert scores_dtype(float32_qk_product=False, float32_logits=False) == jnp.bfloat16  # MaxText's defaults
    assert scores_dtype(float32_qk_product=False, float32_logits=True) == jnp.float32
    assert scores_dtype(float32_qk_product=True, float32_logits=False) == jnp.float32



def test_dot_product_normalizes_its_output_not_the_scores():
    """MaxText's apply_attention_dot: exponentials times v, divided by their sum per query, so no [L, L]
    probabilities are divided out (their backward held one score-sized buffer more: llama2-7b v5p-128 B 4)."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(L=16))

    def attention_sum(q, k, v):
        return jnp.sum(ak.dot_product(q, k, v, 0, softcap=None, float32_qk_product=False,
                                      float32_logits=False).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.value_and_grad(attention_sum, argnums=(0, 1, 2)))(q, k, v)
    divided = [e.outvars[0].aval.shape for e in jaxpr.jaxpr.eqns if e.primitive.name == "div"]
    assert divided and not any(shape[-2:] == (16, 16) for shape in divided), divided

# The kernel the model traces against the one perfmodel counts: one rule (maxperf.attention_rule) for both
_GRID = [(), ("seq_len=64",), ("seq_len=96",), ("seq_len=200",), ("head_dim=320",), ("attn_logit_softcap=30",),
         ("attention_type=local_sliding", "window=8"), ("seq_len=256", "sa_block_q=512"),
         ("seq_len=384", "sa_block_q=256")]


def _traced_kernel(cfg, platform, monkeypatch) -> str:
    """The kernel the model's forward dispatches to on `platform`, each kernel stubbed to record its call."""
    ran = []

    def stub(name):
        return lambda q, *args, **kwargs: ran.append(name) or q

    monkeypatch.setattr(ak, "platform_of_mesh", lambda: platform)
    for name in ("dot_product", "splash", "gpu_flash", "blockwise"):
        monkeypatch.setattr(ak, name, stub(name))
    model = train_step.model_def(cfg.model, cfg.train)
    L = cfg.train.seq_len
    inputs = jax.ShapeDtypeStruct((1, L), jnp.int32)
    jax.eval_shape(lambda params, x: nnx.merge(model.graphdef, params)(x, jnp.broadcast_to(jnp.arange(L), x.shape)),
                   model.params, inputs)
    assert len(set(ran)) == 1, ran
    return ran[0]


@pytest.mark.parametrize("platform", ["tpu", "gpu", "cpu"])
@pytest.mark.parametrize("kernel", ["auto", "dot_product", "flash"])
def test_perfmodel_counts_the_kernel_the_model_runs(platform, kernel, monkeypatch):
    from maxperf.perfmodel.flops import attention_kernel, resolve_attention

    for words in _GRID:
        cfg = overrides.apply(presets.get("tiny"), ["per_device_batch_size=1", f"attention={kernel}", *words])
        try:
            traced = _traced_kernel(cfg, platform, monkeypatch)
        except MaxperfError as err:  # an explicit flash that cannot serve: perfmodel refuses it the same way
            with pytest.raises(MaxperfError, match=re.escape(str(err))):
                resolve_attention(cfg.model, cfg.train, platform)
            continue
        counted = attention_kernel(resolve_attention(cfg.model, cfg.train, platform))
        assert counted == ("dot_product" if traced == "dot_product" else "flash"), (words, traced)


def _pallas_calls(jaxpr) -> list[str]:
    """The names of the Pallas kernels a jaxpr calls, nested jaxprs included, in order."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params.get("name_and_src_info", eqn.params.get("name"))).split(" ")[0])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names.extend(_pallas_calls(inner))
    return names


def test_gpu_flash_in_interpret_mode_matches_dot_product_and_keeps_its_residuals_by_the_context_name():
    """jax's Pallas Triton kernel, run by Pallas's interpreter on CPU: the same values and gradients as the dot
    product; and under a remat policy that keeps "context" (minimal_with_context) the backward runs the backward
    kernels alone, where jax's own rule, whose output and log-sum-exp carry no name, ran the forward kernel again."""
    q, k, v = _qkv(Dh=64)
    got = _value_and_grads(lambda q, k, v: ak.gpu_flash(q, k, v, 0, interpret=True), q, k, v)
    ref = _value_and_grads(_dot(0, None), q, k, v)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, r, **TOLERANCE)

    def kernels(policy):
        layer = jax.checkpoint(lambda q, k, v: jnp.sin(ak.gpu_flash(q, k, v, 0, interpret=True)), policy=policy)
        grad = jax.grad(lambda q, k, v: jnp.sum(layer(q, k, v)), argnums=(0, 1, 2))
        return _pallas_calls(jax.make_jaxpr(grad)(q, k, v).jaxpr)

    keeps_context = jax.checkpoint_policies.save_only_these_names("context")
    assert kernels(keeps_context) == ["mha_forward", "mha_preprocess_backward", "mha_backward"]
    assert kernels(jax.checkpoint_policies.nothing_saveable).count("mha_forward") == 2  # full remat: once again


def test_gpu_flash_keeps_a_narrower_values_context_at_its_own_width():
    """Latent attention's value head (128) is narrower than its query and key's (192): the GPU kernel runs them
    padded to 192, and the context it keeps for the backward is cut back to 128 (the padded columns are zeros, put
    back for the backward kernel), the width perfmodel counts; values and gradients as the dot product's."""
    from jax._src.ad_checkpoint import saved_residuals

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (1, 128, 2, 1, 192)) / 14
    k, v = jax.random.normal(keys[1], (1, 128, 2, 192)), jax.random.normal(keys[2], (1, 128, 2, 128))
    got = _value_and_grads(lambda q, k, v: ak.gpu_flash(q, k, v, 0, interpret=True), q, k, v)
    ref = _value_and_grads(_dot(0, None), q, k, v)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, r, **TOLERANCE)
    layer = jax.checkpoint(lambda q, k, v: jnp.sin(ak.gpu_flash(q, k, v, 0, interpret=True)),
                           policy=jax.checkpoint_policies.save_only_these_names("context"))
    kept = [aval.shape for aval, where in saved_residuals(lambda q, k, v: jnp.sum(layer(q, k, v)), q, k, v)
            if "named 'context'" in where]
    assert sorted(kept) == [(1, 2, 128), (1, 128, 2, 128)]  # the log-sum-exp and the context, at the value's width
    grad = jax.grad(lambda q, k, v: jnp.sum(layer(q, k, v)), argnums=(0, 1, 2))
    assert _pallas_calls(jax.make_jaxpr(grad)(q, k, v).jaxpr).count("mha_forward") == 1  # no second forward
