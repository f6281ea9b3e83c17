"""The serving steps (models/serving.py): greedy decoding with the cache gives the tokens, and the logits, of
recomputing the whole sequence without it; int8 weights and an int8 cache stay close to them; bad requests are
refused in one line."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxperf.models import serving, train_step
from maxperf.models.layers import kv_cache
from maxperf.spec import overrides, presets
from maxperf.spec.errors import MaxperfError

P, STEPS, B = 8, 6, 2
BASE = ["max_target_length=24", f"max_prefill_predict_length={P}", "compute_dtype=float32",
        "per_device_batch_size=2", "attention=dot_product"]


def configs(name: str, words: list[str] = ()):
    c = overrides.apply(presets.get(name), [*BASE, *words])
    return c.model, c.train


def generate(model, train, params, prompt_BxP, first: bool = True):
    """Greedy tokens through prefill and decode with the cache (`first`: its layout, serving.heads_first)."""
    prefill = jax.jit(serving.make_prefill(model, train, first))
    decode = jax.jit(serving.make_decode(model, train, first))
    cache, token = prefill(params, {"tokens": prompt_BxP})
    tokens = [token]
    for i in range(STEPS):
        positions = jnp.full((prompt_BxP.shape[0],), P + i, jnp.int32)
        cache, token = decode(params, cache, {"tokens": tokens[-1], "positions": positions})
        tokens.append(token)
    return jnp.stack(tokens, 1)


def recompute(model, train, params, prompt_BxP):
    """Greedy tokens by running the whole sequence through the model at every step, and the last step's logits."""
    smodel, strain = serving.serving_configs(model, train)
    net = nnx.merge(train_step.model_def(smodel, strain).graphdef, serving.widen(params, jnp.float32))
    seq, tokens = prompt_BxP, []
    for _ in range(STEPS + 1):
        logits = net(seq, jnp.broadcast_to(jnp.arange(seq.shape[1], dtype=jnp.int32), seq.shape))
        tokens.append(jnp.argmax(logits[:, -1], -1).astype(jnp.int32))
        seq = jnp.concatenate([seq, tokens[-1][:, None]], 1)
    return jnp.stack(tokens, 1), seq


def prompt(model):
    return jnp.asarray(np.random.default_rng(1).integers(0, model.vocab_size, (B, P)), jnp.int32)


@pytest.mark.parametrize("name,words", [
    ("tiny", []),  # dense, grouped-query
    ("tiny", ["scan_layers=false"]),
    ("tiny", ["attention_type=local_sliding", "sliding_window_size=4"]),
    ("tiny", ["attention_type=chunk", "chunk_attn_window_size=4"]),
    ("tiny", ["attn_logit_softcap=20", "final_logit_softcap=30", "attention_sinks=true"]),
    ("tiny-moe", []),
    ("tiny-mla", []),
    ("tiny", ["quantization=int8"]),  # int8 weights, widened one layer at a time inside the loop
    ("tiny-moe", ["quantization=fp8", "scan_layers=false"]),
])
def test_decoding_with_the_cache_gives_the_tokens_of_recomputing(name, words):
    model, train = configs(name, words)
    params = serving.init_params(model, train, seed=0)
    x = prompt(model)
    with_cache = generate(model, train, params, x)
    without, _ = recompute(model, train, params, x)
    np.testing.assert_array_equal(np.asarray(with_cache), np.asarray(without))


@pytest.mark.parametrize("words", [[], ["quantize_kvcache=true", "kv_quant_axis=dkv"]])
def test_the_tpu_cache_layout_decodes_alike(words):
    """TPUs store the cache [B, S, K, Dh] (serving.heads_first): the same tokens as the [B, K, S, Dh] layout."""
    model, train = configs("tiny", words)
    params = serving.init_params(model, train, seed=0)
    x = prompt(model)
    np.testing.assert_array_equal(np.asarray(generate(model, train, params, x, first=False)),
                                  np.asarray(generate(model, train, params, x, first=True)))


def test_decode_logits_equal_the_full_forward():
    """Beyond the argmax: the logits a decode step computes are the full forward's at that position."""
    model, train = configs("tiny-mla")
    params = serving.init_params(model, train, seed=0)
    x = prompt(model)
    _, seq = recompute(model, train, params, x)
    smodel, strain = serving.serving_configs(model, train)
    net = nnx.merge(train_step.model_def(smodel, strain).graphdef, params)
    L = seq.shape[1]
    full = net(seq, jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), seq.shape))
    cache = serving.empty_cache(serving.cache_layout(smodel, strain, B))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    _, cache = net.serve(seq[:, :P], positions, cache, kv_cache.PREFILL)
    for t in range(P, L):
        logits, cache = net.serve(seq[:, t:t + 1], jnp.full((B, 1), t, jnp.int32), cache, kv_cache.DECODE)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(full[:, t]), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("words", [["quantize_kvcache=true"], ["quantize_kvcache=true", "kv_quant_axis=dkv"],
                                   ["quantization=int8"], ["quantization=fp8"]])
def test_int8_weights_and_cache_stay_close(words):
    """int8 storage changes the numbers a little, not the model: the logits of a decode step stay within a few
    percent of the unquantized ones, and the int8 arrays are what is stored."""
    model, train = configs("tiny", words)
    ref_model, ref_train = configs("tiny")
    params = serving.init_params(model, train, seed=0)
    ref_params = serving.init_params(ref_model, ref_train, seed=0)
    if words[0].startswith("quantization="):
        narrow = [x for x in jax.tree.leaves(params) if x.dtype in (jnp.int8, jnp.float8_e4m3fn)]
        assert narrow and params["embed"]["table_VxD"].dtype == jnp.float32
    else:
        layout = serving.cache_layout(*serving.serving_configs(model, train), B)
        assert layout["layers"][0]["k"].dtype == jnp.int8
    x = prompt(model)
    outs = []
    for m, t, p in ((model, train, params), (ref_model, ref_train, ref_params)):
        cache, token = jax.jit(serving.make_prefill(m, t))(p, {"tokens": x})
        smodel, strain = serving.serving_configs(m, t)
        net = nnx.merge(train_step.model_def(smodel, strain).graphdef, serving.widen(p, jnp.float32))
        logits, _ = net.serve(token[:, None], jnp.full((B, 1), P, jnp.int32), cache, kv_cache.DECODE,
                              serving.quant_axis(t))
        outs.append(np.asarray(logits))
    scale = np.abs(outs[1]).max()
    error = np.abs(outs[0] - outs[1]).max() / scale
    # e4m3 keeps 3 mantissa bits (a weight within 1/16 of itself), int8 about 1/250 of its channel's largest
    assert 0 < error < (0.15 if "quantization=fp8" in words else 0.05), error


def test_int8_cache_is_a_quarter_of_float32():
    model, train = configs("tiny")
    _, q_train = configs("tiny", ["quantize_kvcache=true"])
    full = serving.cache_bytes(serving.cache_layout(model, train, B))
    quantized = serving.cache_bytes(serving.cache_layout(model, q_train, B))
    K, Dh = model.num_kv_heads, model.head_dim
    # int8 values plus one float32 scale per position over K x Dh numbers
    assert quantized == pytest.approx(full * (1 + 4 / (K * Dh)) / 4)


@pytest.mark.parametrize("words,kind,expected", [
    (["max_prefill_predict_length=32"], "prefill", "longer than the cache"),
    (["quantization=te_mxfp8"], "decode", "int8 or fp8 weights"),
])
def test_bad_serving_requests_say_what_is_wrong(words, kind, expected):
    model, train = configs("tiny", words)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(MaxperfError, match=expected):
        serving.abstract_serve(model, train, mesh, kind)


def test_a_batch_the_mesh_cannot_split_is_refused():
    model, train = configs("tiny", ["per_device_batch_size=0.5"])
    with pytest.raises(MaxperfError, match="cannot be split over the mesh's 4 batch shards"):
        serving.check(model, train, 4, {"fsdp": 4}, "decode")


# --- compile and the perfmodel --------------------------------------------------------------------------------


def test_compile_writes_a_decode_artifact_whose_memory_the_perfmodel_follows(tmp_path):
    """`maxperf compile --step decode` on CPU devices: the artifact records its step, the compiler's memory holds the
    weights and cache as the serving perfmodel counts them, and the estimate is the serving one."""
    import json

    from cli_util import maxperf

    out = tmp_path / "decode"
    proc = maxperf("compile", "--step", "decode", "--model", "tiny", "--topology", "cpu-4", "ici_tensor_parallelism=2",
                   "per_device_batch_size=2", "max_target_length=64", "max_prefill_predict_length=16",
                   "quantize_kvcache=true", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "per output token" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["step"] == "decode" and manifest["global_batch"] == 8 and manifest["tokens_per_step"] == 8
    memory, estimate = (json.loads((out / n).read_text()) for n in ("memory.json", "estimate.json"))
    assert estimate["schema"] == "maxperf.serving-estimate/1" and estimate["step"] == "decode"
    analytical = estimate["memory"]["weights_bytes"] + estimate["memory"]["cache_bytes"]
    # the arguments are exactly the weights and the cache (the tokens and positions: 64 bytes)
    assert memory["argument_bytes"] == pytest.approx(analytical + 64, rel=0.02)
    assert memory["alias_bytes"] > 0  # the cache is donated: updated in place


def test_a_gpu_decode_compile_says_what_its_scanned_layers_cost(tmp_path):
    """On GPU a scanned decode step copies each layer's weights and cache out of the stack (measured on an H200): the
    compile says so, with the key that avoids it, and says nothing of it where the layers are not scanned or the
    platform is not a GPU."""
    import json

    from cli_util import maxperf

    words = ["--model", "tiny", "per_device_batch_size=2", "max_target_length=64", "max_prefill_predict_length=16"]
    notes = {}
    for name, topology, extra in (("scanned", "h100-1", []), ("unscanned", "h100-1", ["scan_layers=false"]),
                                  ("cpu", "cpu-1", [])):
        out = tmp_path / name
        proc = maxperf("compile", "--step", "decode", "--topology", topology, *words, *extra, "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        notes[name] = json.loads((out / "manifest.json").read_text())["limitations"]
        assert all(f"note: {n}" in proc.stdout for n in notes[name])  # printed as the manifest records them
    said = [n for n in notes["scanned"] if "scanned layers" in n]
    assert len(said) == 1 and "scan_layers=false" in said[0] and "24.4 ms" in said[0]
    assert not [n for n in notes["unscanned"] + notes["cpu"] if "scanned layers" in n]


def test_a_prompt_longer_than_the_cache_is_refused_in_one_line(tmp_path):
    from cli_util import maxperf

    out = tmp_path / "prefill"
    proc = maxperf("compile", "--step", "prefill", "--model", "tiny", "--topology", "cpu-1",
                   "max_target_length=32", "max_prefill_predict_length=64", "--out", str(out))
    assert proc.returncode == 2
    assert "longer than the cache" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_tokens_per_chip_count_chips_not_devices():
    """A TPU7x chip is two JAX devices: tokens/s per chip is the chip's, twice a device's; elsewhere a device is a
    chip."""
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.request import resolve

    words = ["per_device_batch_size=16", "max_target_length=2048", "max_prefill_predict_length=1024"]
    for topology, tensor, chips in (("tpu7x-8", 8, 4), ("v6e-8", 8, 8)):
        p = resolve(topology, "qwen3-32b", [f"ici_tensor_parallelism={tensor}", *words])
        e = model.estimate(p.model, p.train, p.mesh, device_for(p.topology), p.topology, largest_batch=False)
        assert (e.devices, e.chips) == (8, chips)
        assert e.tokens_per_s_per_chip == pytest.approx(e.tokens_per_s / chips)
        assert e.as_dict()["chips"] == chips


def test_a_decode_priced_per_query_head_reads_the_cache_once_per_head(capsys):
    """decode_cache_reads=per_query_head (TensorRT-LLM's masked multi-head attention kernel, where its XQA kernel has
    none for the group): perfmodel reads the filled cache H / K times over (Mistral 7B: 32 query heads over 8 KV heads),
    the weights once, and the prefill as before; the CLI says so; latent attention is refused."""
    from maxperf import cli
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.request import resolve

    words = ["ici_tensor_parallelism=1", "per_device_batch_size=64", "max_target_length=4096",
             "max_prefill_predict_length=2048"]
    p = resolve("h100-1", "mistral-7b", words)
    q = resolve("h100-1", "mistral-7b", [*words, "decode_cache_reads=per_query_head"])
    chip = device_for(p.topology)
    once = model.decode_phase(p.model, p.train, p.mesh, chip, p.topology, 64, 3072)
    per = model.decode_phase(q.model, q.train, q.mesh, chip, q.topology, 64, 3072)
    cache_bytes = 64 * model.cache_bytes_per_token(p.model, p.train, dict(p.mesh.sizes), lambda w: 3072)
    assert model.cache_passes(q.model, q.train, dict(q.mesh.sizes)) == 4
    assert per.bytes - once.bytes == pytest.approx(3 * cache_bytes, rel=1e-6)
    assert model.prefill_phase(q.model, q.train, q.mesh, chip, q.topology, 1, 2048).seconds == pytest.approx(
        model.prefill_phase(p.model, p.train, p.mesh, chip, p.topology, 1, 2048).seconds)
    # tensor 2 halves both head counts: still 4 query heads per KV head on each GPU
    t2 = resolve("h100-2", "mistral-7b", ["ici_tensor_parallelism=2", "decode_cache_reads=per_query_head"])
    assert model.cache_passes(t2.model, t2.train, dict(t2.mesh.sizes)) == 4
    assert any("XLA's grouped dot" in n for n in q.warnings)
    with pytest.raises(MaxperfError, match="latent attention"):
        resolve("h100-8", "deepseek-v3", ["decode_cache_reads=per_query_head"])
    assert cli.main(["estimate", "--step", "decode", "--model", "mistral-7b", "--topology", "h100-1",
                     "decode_cache_reads=per_query_head"]) == 0
    assert "decode priced as reading the cache once per query head" in capsys.readouterr().out


def test_decode_time_is_bandwidth_bound_at_small_batch_and_grows_with_the_cache():
    """The decode model's laws: at batch 1 a 70B model's step is its weights read at HBM bandwidth; a fuller cache
    costs more; int8 weights halve the weights' read; a batch that does not fit is said so."""
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.request import resolve

    p = resolve("h100-8", "llama3-70b", ["ici_tensor_parallelism=8", "per_device_batch_size=0.125",
                                          "max_target_length=4096", "max_prefill_predict_length=1024"])
    chip = device_for(p.topology)
    short = model.decode_phase(p.model, p.train, p.mesh, chip, p.topology, 1, 1024)
    long = model.decode_phase(p.model, p.train, p.mesh, chip, p.topology, 1, 4096)
    assert short.bottleneck == "HBM bandwidth" and long.seconds > short.seconds
    weights = 70.6e9 * 2 / 8
    assert short.memory_s == pytest.approx(weights / (chip.hbm_bandwidth * model.DECODE_HBM_EFFICIENCY["gpu"]),
                                           rel=0.05)
    q = resolve("h100-8", "llama3-70b", ["ici_tensor_parallelism=8", "per_device_batch_size=0.125",
                                          "max_target_length=4096", "max_prefill_predict_length=1024",
                                          "quantization=int8"])
    int8 = model.decode_phase(q.model, q.train, q.mesh, chip, q.topology, 1, 1024)
    assert int8.memory_s == pytest.approx(short.memory_s / 2, rel=0.05)
    est = model.estimate(p.model, p.train, p.mesh, chip, p.topology)
    assert est.memory.fits and 20 < est.max_batch_per_device < 60



def test_a_gpu_decode_kernel_adds_its_weights_stream_and_its_math_and_a_tpu_one_takes_the_longer():
    """DECODE_KERNEL_LAW: on a GPU each decode kernel's FLOPs time and bytes time add (CUTLASS-era GEMMs at decode
    shapes, bench/gpu_gemm.py --published), so the step's compute and memory parts are all its FLOPs at the sustained
    rate and all its bytes at the fitted bandwidth; on a TPU each kernel takes the longer, so near the ridge (some
    kernels bound by each) the parts come to less than those sums."""
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for
    from maxperf.perfmodel.work import SHIPPED
    from maxperf.spec.request import resolve

    for topology, b, law in (("h100-8", 48, "sum"), ("v5e-8", 512, "max")):
        p = resolve(topology, "llama3-70b", ["ici_tensor_parallelism=8", "per_device_batch_size=1",
                                             "max_target_length=2048", "max_prefill_predict_length=1024",
                                             "quantization=int8"])
        chip = device_for(p.topology)
        assert model.DECODE_KERNEL_LAW[chip.kind] == law
        phase = model.decode_phase(p.model, p.train, p.mesh, chip, p.topology, b, 1536)
        all_flops_s = phase.flops / (model._peak(chip, p.train) * SHIPPED.fraction(chip))
        all_bytes_s = phase.bytes / (chip.hbm_bandwidth * model.DECODE_HBM_EFFICIENCY[chip.kind])
        assert phase.seconds == pytest.approx(phase.compute_s + phase.memory_s + phase.collective_s + phase.fixed_s)
        if law == "sum":
            assert phase.compute_s == pytest.approx(all_flops_s) and phase.memory_s == pytest.approx(all_bytes_s)
        else:  # the matmuls compute-bound at 512 sequences on v5e's int8 rate, the attention bound by the cache
            assert 0 < phase.compute_s < all_flops_s and 0 < phase.memory_s < all_bytes_s


def test_weights_split_over_fsdp_are_gathered_for_every_step():
    """A device computes with whole (gathered) weights for its own sequences, as the compiled step does: the FLOPs
    and weight reads of a decode and a prefill over fsdp equal those over data, and the fsdp layout pays the
    weights' gathers on top, where splitting them once more would price a 70B prefill faster than its FLOPs at
    peak allow."""
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.request import resolve

    words = ["per_device_batch_size=1", "max_prefill_predict_length=1024", "max_target_length=2048",
             "quantization=int8"]
    over_fsdp = resolve("v5e-8", "llama3-70b", words)
    over_data = resolve("v5e-8", "llama3-70b", [*words, "ici_fsdp_parallelism=1", "ici_data_parallelism=8"])
    assert dict(over_fsdp.mesh.sizes)["fsdp"] == 8 and dict(over_data.mesh.sizes)["data"] == 8
    chip = device_for(over_fsdp.topology)
    for phase, args in ((model.decode_phase, (1, 1536)), (model.prefill_phase, (1, 1024))):
        f = phase(over_fsdp.model, over_fsdp.train, over_fsdp.mesh, chip, over_fsdp.topology, *args)
        d = phase(over_data.model, over_data.train, over_data.mesh, chip, over_data.topology, *args)
        assert f.flops == pytest.approx(d.flops) and f.bytes == pytest.approx(d.bytes)
        assert d.collective_s == 0 and f.collective_s > 0.5 * 70.6e9 * 7 / 8 / (4 * chip.link_bandwidth)
    prefill = model.prefill_phase(over_fsdp.model, over_fsdp.train, over_fsdp.mesh, chip, over_fsdp.topology, 1, 1024)
    assert prefill.seconds > 2 * 70.6e9 * 1024 / chip.peak_int8_ops
    est = model.estimate(over_fsdp.model, over_fsdp.train, over_fsdp.mesh, chip, over_fsdp.topology)
    stored = model.estimate(over_data.model, over_data.train, over_data.mesh, chip, over_data.topology)
    assert est.memory.weights_bytes < stored.memory.weights_bytes / 4  # stored split, gathered a layer at a time
def test_the_serving_bench_runs_and_reports_held_out_errors(tmp_path):
    """bench/serving.py, which the README quotes: every row predicted, the fitted constant the shipped one, and the
    held-out figures as the README states them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "serving.py"
    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, str(bench), "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["rows"] == 70
    assert result["fitted_hbm_efficiency"] == result["shipped_hbm_efficiency"] == {"gpu": 0.79, "tpu": 0.62}
    # the TPU's two sources, each predicted with the TPU constant fitted on the other's rows (docs/serving.md): vLLM's
    # decode steps on v6e-8, and its served benchmarks on TPU7x (Qwen3-32B, Qwen3-Coder-480B-A35B in FP8)
    assert result["fitted_without"]["vllm-tpu-trillium"]["tpu"] == 0.59
    assert result["fitted_without"]["vllm-tpu-ironwood"]["tpu"] == 0.64
    tpu = result["groups"]["TPU decode step"]["held out by source"]
    assert tpu["median"] == pytest.approx(0.041, abs=0.0005) and tpu["worst"] == pytest.approx(0.080, abs=0.0005)
    served = result["groups"]["TPU served tok/s"]["held out by source"]
    assert served["median"] == pytest.approx(0.101, abs=0.0005) and served["worst"] == pytest.approx(0.276, abs=0.0005)
    from maxperf.perfmodel.serving import HELD_OUT_ERROR  # what estimate quotes as its uncertainty, per chip kind

    for kind, group in (("all", "all"), ("gpu", "GPU"), ("tpu", "TPU")):
        held = result["groups"][group]["held out by source"]
        assert held["median"] == pytest.approx(HELD_OUT_ERROR[kind][0], abs=0.0005)
        assert held["worst"] == pytest.approx(HELD_OUT_ERROR[kind][1], abs=0.0005)


def _serving_bench():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    return bench


def test_the_tensorrt_llm_rows_say_which_read_the_cache_per_query_head(tmp_path):
    """bench/serving.py refuses a TensorRT-LLM row whose words disagree with its release's XQA kernels: Llama 2 70B (8
    query heads per KV head on each GPU) without XQA before the Falcon post's 0.7a, with it after; Mistral and Mixtral
    (groups of 4) without it in 0.9.0; Llama 2 7B (one query head per KV head) never per query head."""
    bench = _serving_bench()
    rows = bench.load_rows()
    flagged = {(r.source, r.model) for r in rows if bench.PER_QUERY_HEAD in r.words}
    assert flagged == {("trtllm-v0.6.1", "llama2-70b"), ("trtllm-h200-blog", "llama2-70b"),
                       ("trtllm-v0.9.0", "mistral-7b"), ("trtllm-v0.9.0", "mixtral-8x7b")}
    text = bench.ROWS.read_text()
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("trtllm-v0.9.0,") and ",mistral-7b," in line:
            lines[i] = line.replace(" " + bench.PER_QUERY_HEAD, "", 1)
            break
    broken = tmp_path / "serving.csv"
    broken.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=f"row {i + 1} .*need {bench.PER_QUERY_HEAD}"):
        bench.load_rows(broken)
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("trtllm-v0.9.0,") and ",llama2-7b," in line:
            lines[i] = line.replace("quantize_kvcache=true", "quantize_kvcache=true " + bench.PER_QUERY_HEAD, 1)
            break
    broken.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=f"row {i + 1} .*cannot have {bench.PER_QUERY_HEAD}"):
        bench.load_rows(broken)


def test_a_served_benchmark_runs_its_requests_in_waves_at_the_mean_lengths():
    """bench/serving.py's served rows: 320 requests 135 at a time are two waves of 135 and one of 50, each a static
    batch at the mean of lengths drawn from 0.8 to 1 times the stated ones; the output tokens over their time."""
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for

    bench = _serving_bench()
    row = bench.Row(0, "test", "tpu7x-2", "qwen3-32b", 135, 1024, 1024,
                    ["ici_tensor_parallelism=2", "quantization=fp8", "quantize_kvcache=true"],
                    "served_output_tokens_per_s_per_chip", 1.0, requests=320, length_ratio=0.8)

    def static(batch):
        p = bench.request(row, batch)
        assert p.train.micro_batch(2) == batch
        return model.static_batch_seconds(p.model, p.train, p.mesh, device_for(p.topology), p.topology, 922, 922)

    expected = 320 * 922 / (2 * static(135) + static(50)) / 1  # one chip
    assert bench.predict(row, model.SHIPPED_SERVING) == pytest.approx(expected, rel=1e-9)
    assert static(50) < static(135)  # the last wave's smaller batch reads less cache


def test_estimate_step_decode_prints_latency_memory_and_its_uncertainty():
    import json

    from cli_util import maxperf

    words = ["estimate", "--step", "decode", "--model", "llama3-70b", "--topology", "v5e-8", "ici_tensor_parallelism=8",
             "per_device_batch_size=8", "quantization=int8", "quantize_kvcache=true", "max_target_length=2048",
             "max_prefill_predict_length=1024"]
    proc = maxperf(*words)
    assert proc.returncode == 0, proc.stderr
    # a TPU quotes the TPU rows' held-out error, a GPU the GPU rows'
    assert "ms per output token" in proc.stdout and "uncertainty      +-7% (worst 28%)" in proc.stdout
    assert "8 published serving runs on TPUs" in proc.stdout
    d = json.loads(maxperf(*words, "--json").stdout)
    from maxperf.perfmodel.serving import HELD_OUT_ERROR

    assert d["memory"]["fits"] and d["uncertainty"]["relative"] == pytest.approx(HELD_OUT_ERROR["tpu"][0])
    gpu = json.loads(maxperf("estimate", "--step", "decode", "--model", "llama3-8b", "--topology", "h100-1",
                             "per_device_batch_size=8", "max_target_length=2048", "--json").stdout)
    assert gpu["uncertainty"]["relative"] == pytest.approx(HELD_OUT_ERROR["gpu"][0])
    assert "on GPUs" in gpu["uncertainty"]["basis"]
    # int8 weights: 70.6B numbers over 8 chips, a byte each, plus the tables in bf16
    assert d["memory"]["weights_bytes"] / 2**30 == pytest.approx(8.46, abs=0.05)
    proc = maxperf("estimate", "--step", "decode", "--model", "llama3-70b", "--topology", "v5e-8",
                   "per_device_batch_size=64", "max_target_length=8192")
    assert proc.returncode == 3 and "DOES NOT FIT" in proc.stdout


# --- plan --step decode ---------------------------------------------------------------------------------------


def test_the_serving_plan_ranks_layouts_under_a_latency_bound(tmp_path):
    """The winner meets the bound and has the most tokens/s per chip of those that do; the Pareto front falls in
    tokens/s as the time per token falls; int8 / fp8 weights and an int8 cache are tried under quantization=auto."""
    from maxperf.search import serving_plan

    plan = serving_plan.search("llama3-70b", "h100-8", ("max_target_length=4096", "max_prefill_predict_length=1024",
                                                        "quantization=auto"), max_tpot_s=0.02)
    assert plan.candidates >= 100 and plan.winner is not None
    assert all(x.tpot_s <= 0.02 and x.fits for x in plan.meeting)
    assert plan.winner.tokens_per_s_per_chip == max(x.tokens_per_s_per_chip for x in plan.meeting)
    assert {x.quantization for x in plan.meeting} >= {"none", "int8", "fp8"}
    assert {x.kv_int8 for x in plan.meeting} == {False, True}
    tpots = [x.tpot_s for x in plan.pareto]
    rates = [x.tokens_per_s_per_chip for x in plan.pareto]
    assert tpots == sorted(tpots) and rates == sorted(rates) and len(plan.pareto) >= 3
    line = plan.compile_line(plan.winner)
    assert line.startswith("maxperf compile --step decode --model llama3-70b --topology h100-8 ")


def test_the_serving_plan_across_hosts_splits_each_axis_into_ici_and_dcn():
    """On hosts of 8 GPUs the plan's meshes keep 8 devices inside each host and the rest across hosts, and its
    compile line resolves to the mesh it priced (expert parallelism across hosts paying the NICs)."""
    from maxperf.search import serving_plan
    from maxperf.spec.request import resolve

    # a loose bound, so that the experts across hosts (77-89 ms a token: each step gathers the other weights over
    # the expert axis through the NICs) are among the layouts that meet it
    plan = serving_plan.search("mixtral-8x7b", "h100-8x8",
                               ("max_target_length=4096", "max_prefill_predict_length=1024"), max_tpot_s=0.5)
    assert plan.winner is not None and plan.candidates > 50
    for x in plan.meeting[:20]:
        ici = {a: n // x.dcn.get(a, 1) for a, n in x.axes.items()}
        assert math.prod(ici.values()) == 8 and math.prod(x.dcn.values()) == 8 and x.dcn["tensor"] == 1
        words = plan.compile_line(x).split()[8:]
        request = resolve("h100-8x8", "mixtral-8x7b", words)
        assert dict(request.mesh.ici) == {**dict(request.mesh.ici), **{a: n for a, n in ici.items() if n > 1}}
        assert {a: n for a, n in request.mesh.dcn.items() if n > 1} == {a: n for a, n in x.dcn.items() if n > 1}
    same = [x for x in plan.meeting if x.axes == {"data": 8, "tensor": 1, "expert": 8}]
    across = [x for x in same if x.dcn["expert"] == 8]  # data inside the hosts, experts across them
    inside = {(x.batch, x.quantization, x.kv_int8): x for x in same if x.dcn["data"] == 8}
    pairs = [(x, inside[k]) for x in across if (k := (x.batch, x.quantization, x.kv_int8)) in inside]
    assert pairs and all(a.tpot_s > b.tpot_s for a, b in pairs)


def test_plan_decode_prints_and_compiles_its_winner(tmp_path):
    import json

    from cli_util import maxperf

    out = tmp_path / "plan"
    proc = maxperf("plan", "--step", "decode", "--model", "gemma-2b", "--topology", "h100-1", "--verify", "1",
                   "--max-time-per-token", "20", "max_target_length=2048", "max_prefill_predict_length=512",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "best: maxperf compile --step decode --model gemma-2b --topology h100-1" in proc.stdout
    assert "(fits)" in proc.stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["schema"] == "maxperf.serving-plan/1" and plan["winner"]["tpot_s"] <= 0.02
    manifest = json.loads((out / "winner" / "manifest.json").read_text())
    assert manifest["step"] == "decode"


def test_plan_decode_verification_moves_on_from_a_layout_the_compiler_does_not_fit(tmp_path, monkeypatch, capsys):
    """A layout the analytical memory fits may not compile within HBM: verification compiles the next in rank order
    (up to --verify of them), records each verdict in plan.json, and the first that fits is the winner; where none
    does, plan.json holds the verdicts, no winner's artifact is left, exit 3."""
    import json

    from maxperf import aot
    from maxperf.cli import main
    from maxperf.spec.errors import DoesNotFit

    calls = []

    def compile_(topology, model, words, *, out, **kw):
        calls.append(list(words))
        out.mkdir(parents=True, exist_ok=True)
        fits = len(calls) > fits_since[0]
        (out / "memory.json").write_text(json.dumps({"per_device_total_bytes": 20 * 2**30 if not fits else 2**30,
                                                     "hbm_bytes": 16 * 2**30, "fits": fits}))
        if not fits:
            raise DoesNotFit("does not fit: needs 20.00 GiB per device")
        return type("Compiled", (), {"fits": True, "memory": json.loads((out / "memory.json").read_text()),
                                     "out_dir": out})()

    monkeypatch.setattr(aot, "compile", compile_)
    fits_since = [1]  # the first layout does not fit, the second does
    words = ["plan", "--step", "decode", "--model", "llama3-8b", "--topology", "v5e-8", "--verify", "3",
             "max_target_length=2048", "max_prefill_predict_length=512", "--out"]
    assert main([*words, str(tmp_path / "a")]) == 0
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert [v["fits"] for v in plan["verified"]] == [False, True] and len(calls) == 2
    assert plan["winner"]["compile"] == plan["verified"][1]["compile"] != plan["verified"][0]["compile"]
    assert "DOES NOT FIT" in capsys.readouterr().out
    calls.clear()
    fits_since[0] = 99  # none fits
    assert main([*words, str(tmp_path / "b")]) == 3
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert [v["fits"] for v in plan["verified"]] == [False] * 3 and plan["winner"] is None
    assert not (tmp_path / "b" / "winner").exists()
    assert "none of the 3 best layouts fits as compiled" in capsys.readouterr().err


@pytest.mark.parametrize("words, needle", [
    (["max_target_length=512", "max_prefill_predict_length=1024"], "leaves no cache position to decode into"),
    (["max_target_length=512", "max_prefill_predict_length=512"], "leaves no cache position to decode into"),
    (["quantization=aqt_fp8"], "the serving steps take int8 or fp8 weights"),
    (["ici_pipeline_parallelism=2"], "does not search ici_pipeline_parallelism"),
    (["ici_fsdp_parallelism=8"], "does not search ici_fsdp_parallelism"),
    (["ici_tensor_parallelism=3"], "no mesh of v5e-8 takes ici_tensor_parallelism=3"),
    (["per_device_batch_size=0.125", "ici_data_parallelism=8"], "a batch of 1 sequences"),
    (["--num-slices", "2"], "--num-slices 2 serves from several"),
    (["--verify", "-1"], "--verify must be >= 0 (0: no compile), got -1"),
])
def test_plan_decode_refuses_pins_it_cannot_honour_in_one_line(tmp_path, words, needle):
    """Every pin the serving plan would drop or could not meet is bad input: one line, exit 2, nothing written."""
    from cli_util import maxperf

    out = tmp_path / "plan"
    proc = maxperf("plan", "--step", "decode", "--model", "llama3-8b", "--topology", "v5e-8", "--verify", "0",
                   "--out", str(out), *words)
    assert proc.returncode == 2 and needle in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not out.exists()


def test_serving_steps_refuse_weights_they_do_not_build_and_a_prompt_that_fills_the_cache():
    from maxperf.spec import resolve

    r = resolve("h100-8", "llama3-8b", ["ici_tensor_parallelism=8", "quantization=aqt_fp8"])
    with pytest.raises(MaxperfError, match="the serving steps take int8 or fp8 weights"):
        serving.check(r.model, r.train, 8, dict(r.mesh.sizes), serving.DECODE)
    full = resolve("h100-8", "llama3-8b", ["max_target_length=512", "max_prefill_predict_length=512"])
    with pytest.raises(MaxperfError, match="fills the cache"):
        serving.check(full.model, full.train, 8, dict(full.mesh.sizes), serving.DECODE)
    serving.check(full.model, full.train, 8, dict(full.mesh.sizes), serving.PREFILL)  # a prefill may fill it


def test_the_bound_a_missed_plan_names_is_one_its_closest_layout_meets():
    """The bound said is rounded up, not to the nearest (1.8404 ms said as 1.84 was missed again): rerun with it,
    the plan finds the layout."""
    from maxperf.search import serving_plan

    missed = serving_plan.search("qwen3-8b", "h100-8", max_tpot_s=0.5e-3)
    assert not missed.meeting and missed.closest is not None
    line = serving_plan.miss_line(missed)
    said = float(line.split("--max-time-per-token ")[1].split(",")[0])
    assert said >= missed.closest.tpot_s * 1e3 and "bf16 weights" in line and "1 sequence," in line
    assert serving_plan.search("qwen3-8b", "h100-8", max_tpot_s=said / 1e3).meeting
    assert serving_plan._rounded_up(1.8404) == "1.85" and serving_plan._rounded_up(12.01) == "12.1"


def test_plan_decode_with_a_bound_no_layout_meets_exits_3_naming_the_closest(tmp_path):
    from cli_util import maxperf

    out = tmp_path / "plan"
    proc = maxperf("plan", "--step", "decode", "--model", "llama3-70b", "--topology", "h100-8", "--verify", "0",
                   "--max-time-per-token", "1", "max_target_length=4096", "--out", str(out))
    assert proc.returncode == 3
    errors = [line for line in proc.stderr.strip().splitlines() if "error" in line]
    assert len(errors) == 1 and "no layout meets the bounds" in errors[0]
    assert "would need --max-time-per-token" in errors[0] and "Traceback" not in proc.stderr
    assert not (out / "plan.json").exists()
    proc = maxperf("plan", "--model", "llama3-70b", "--topology", "h100-8", "--max-ttft", "100", "--out", str(out))
    assert proc.returncode == 2 and "add --step decode" in proc.stderr


def test_the_serving_plan_bench_prices_over_a_thousand_layouts():
    """bench/serving_plan.py, which docs/serving.md quotes: its largest case."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "serving_plan.py"
    spec = importlib.util.spec_from_file_location("serving_plan_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench.main(["--only", "mixtral"])
    assert row["result"]["candidates"] >= 1000 and row["result"]["winner"] is not None


def test_run_measures_a_compiled_decode_step_beside_its_prediction(tmp_path):
    """`maxperf run` of a decode artifact on CPU devices: it decodes, times each step and writes run.json with the
    analytical and the HLO-derived predictions; --checkpoint has no state to save and is refused in one line."""
    import json

    from cli_util import maxperf

    art = tmp_path / "decode"
    proc = maxperf("compile", "--step", "decode", "--model", "tiny", "--topology", "cpu-2", "ici_tensor_parallelism=2",
                   "per_device_batch_size=2", "max_target_length=64", "max_prefill_predict_length=16",
                   "quantize_kvcache=true", "--out", str(art))
    assert proc.returncode == 0, proc.stderr
    proc = maxperf("run", str(art), "--steps", "3", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    run = json.loads((art / "run" / "run.json").read_text())
    assert run["schema"] == "maxperf.serving-run/1" and run["step"] == "decode" and run["steps"] == 3
    assert run["batch"] == 4 and all(t > 0 for t in run["step_times_s"])
    assert run["tokens_per_s"] == pytest.approx(4 / run["step_time_s"])
    assert run["predicted_step_time_s"] > 0 and run["hlo_predicted_step_time_s"] > 0
    proc = maxperf("run", str(art), "--checkpoint", str(tmp_path / "ckpt"), "--force")
    assert proc.returncode == 2 and "keeps no state" in proc.stderr
    again = maxperf("run", str(art), "--steps", "2", "--warmup", "1")  # its own output, written again
    assert again.returncode == 0, again.stderr


def test_the_report_shows_the_serving_plan_curve_and_the_decode_step(tmp_path):
    """`maxperf report` of a serving plan, a decode compile and its run: the plan's Pareto curve (time per token
    against tokens/s per chip) with its numbers, the step's memory and latency, the measured steps."""
    import csv

    from cli_util import maxperf

    from maxperf.search import serving_plan

    plan = serving_plan.search("llama3-8b", "h100-1", ("max_target_length=4096", "max_prefill_predict_length=512"),
                               max_tpot_s=0.02)
    from maxperf.search.plan import write

    write(plan, tmp_path / "plan")
    art = tmp_path / "decode"
    assert maxperf("compile", "--step", "decode", "--model", "tiny", "--topology", "cpu-1", "per_device_batch_size=2",
                   "max_target_length=32", "max_prefill_predict_length=8", "--out", str(art)).returncode == 0
    assert maxperf("run", str(art), "--steps", "2", "--warmup", "1").returncode == 0
    html = tmp_path / "report.html"
    proc = maxperf("report", str(tmp_path / "plan"), str(art), str(art / "run"), "-o", str(html))
    assert proc.returncode == 0, proc.stderr
    text = html.read_text()
    assert "serving plan: llama3-8b decode on h100-1" in text and "<svg" in text
    assert "ms per output token" in text and "measured" in text
    files = tmp_path / "report_files"
    with open(next(files.glob("*pareto-front*.csv"))) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(plan.pareto) and float(rows[0]["ms/token"]) == pytest.approx(
        plan.pareto[0].tpot_s * 1e3, abs=1e-3)
    # two serving steps (the compile and its run) are compared side by side, before their own sections
    proc = maxperf("report", str(art), str(art / "run"), "-o", str(tmp_path / "both.html"))
    assert proc.returncode == 0, proc.stderr
    both = (tmp_path / "both.html").read_text()
    assert "serving steps side by side" in both and "measured ms a step" in both
    assert both.index("serving steps compared") < both.index("decode: tiny on cpu-1")
    # an altered artifact or a damaged run.json is refused as for the train step: one line, exit 2
    import json
    import shutil

    tampered = tmp_path / "tampered"
    shutil.copytree(art, tampered, ignore=shutil.ignore_patterns("run"))
    estimate = json.loads((tampered / "estimate.json").read_text())
    estimate["time_per_output_token_s"] = 1.0
    (tampered / "estimate.json").write_text(json.dumps(estimate))
    proc = maxperf("report", str(tampered), "-o", str(tmp_path / "t.html"))
    assert proc.returncode == 2 and "sha256" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    damaged = tmp_path / "damaged"
    shutil.copytree(art / "run", damaged)
    run = json.loads((damaged / "run.json").read_text())
    run["step_time_s"] = "fast"
    (damaged / "run.json").write_text(json.dumps(run))
    proc = maxperf("report", str(damaged), "-o", str(tmp_path / "d.html"))
    assert proc.returncode == 2 and "'step_time_s' should be a number" in proc.stderr, proc.stderr
    # a run whose compile directory holds another compile now (compiled.pkl not the one it measured): its own
    # figures alone, not the other step's prediction under its name
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(art / "run", elsewhere)
    run = json.loads((elsewhere / "run.json").read_text())
    (elsewhere / "run.json").write_text(json.dumps({**run, "artifact_sha256": "0" * 64}))
    proc = maxperf("report", str(elsewhere), "-o", str(tmp_path / "e.html"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "e.html").read_text()
    assert "holds another compile now" in text and "no prediction shown" in text and "decode: tiny on cpu-1" in text


def test_the_report_of_a_serving_compile_that_does_not_fit_says_by_how_much(tmp_path):
    from cli_util import maxperf

    art = tmp_path / "dnf"
    proc = maxperf("compile", "--step", "decode", "--model", "llama3-8b", "--topology", "v5e-4",
                   "ici_tensor_parallelism=4", "per_device_batch_size=128", *INT8_CACHE, "--out", str(art))
    assert proc.returncode == 3, proc.stderr
    proc = maxperf("report", str(art), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "r.html").read_text()
    assert re.search(r"DOES NOT FIT: needs [\d.]+ GiB per device of 15.75 GiB \(over by [\d.]+ GiB\)", text)
    assert "predicted 0 ms" not in text


@pytest.mark.slow
def test_the_serving_memory_bench_compiles_and_agrees_with_the_compiler(tmp_path):
    """bench/serving_memory.py, which docs/serving.md quotes: its latent-attention mixture-of-experts cases (decode
    and the prefill with XLA:GPU's expanded grouped matmul), analytical within 5% of the compiler."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "serving_memory.py"
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(bench), "--only", "deepseek-v2-lite", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [c["step"] for c in result["cases"]] == ["decode", "prefill"]
    assert result["worst"] < 0.05


def test_estimate_memory_of_a_serving_step_sets_the_analytical_beside_the_compiler(tmp_path):
    """estimate-memory --step decode: the weights, cache and temporaries of perfmodel.serving beside XLA's total for
    the same step; a sweep of a serving step is refused in one line (it would sweep the train step)."""
    import json

    from cli_util import maxperf

    words = ["--model", "tiny", "--topology", "cpu-2", "ici_tensor_parallelism=2", "per_device_batch_size=2",
             "max_target_length=64", "max_prefill_predict_length=16"]
    proc = maxperf("estimate-memory", "--step", "decode", *words, "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["schema"] == "maxperf.serving-memory/1" and d["step"] == "decode"
    analytical, compiled = d["analytical"], d["compiler"]
    assert analytical["total_bytes"] == pytest.approx(
        analytical["weights_bytes"] + analytical["cache_bytes"] + analytical["temp_bytes"])
    # the step's arguments are the weights and the cache, as the analytical model counts them
    assert compiled["argument_bytes"] == pytest.approx(analytical["weights_bytes"] + analytical["cache_bytes"] + 32,
                                                       rel=0.02)
    proc = maxperf("sweep", "--step", "decode", "--model", "tiny", "--topologies", "cpu-1", "--analytical-only",
                   "--out", str(tmp_path / "sweep"))
    assert proc.returncode == 2 and "plan --step decode" in proc.stderr and not (tmp_path / "sweep").exists()


def test_a_serving_mesh_that_does_not_divide_the_cache_heads_says_so_in_serving_words(capsys):
    """tensor=16 over 8 KV heads replicates the cache's heads: said as the training step says a replicated
    dimension, without its optimizer state, with a mesh that divides."""
    from maxperf import cli

    code = cli.main(["estimate", "--step", "decode", "--topology", "h100-8x2", "--model", "llama3-70b",
                     "ici_tensor_parallelism=8", "dcn_tensor_parallelism=2"])
    err = capsys.readouterr().err
    assert code in (0, 3) and ("tensor=16 does not divide K=8: the key/value cache's heads are replicated along "
                               "tensor, not split; e.g. ici_tensor=4 ici_data=2") in err
    assert "optimizer" not in err


def test_a_prefill_estimate_gives_prompt_tokens_per_second_and_a_batch_that_can_be_asked_for(capsys):
    """The largest batch is a whole number of sequences over the devices (what per_device_batch_size accepts), and a
    prefill's throughput is its prompt tokens per second; one sequence is one sequence."""
    from maxperf import cli
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.request import resolve

    words = ["per_device_batch_size=0.125", "max_prefill_predict_length=1024", "quantization=int8",
             "ici_tensor_parallelism=8"]
    p = resolve("v5e-8", "llama3-70b", words)
    e = model.estimate(p.model, p.train, p.mesh, device_for(p.topology), p.topology, kind="prefill")
    assert (e.max_batch_per_device * 8).is_integer() and e.max_batch_per_device > 1
    assert resolve("v5e-8", "llama3-70b", [*words[1:], f"per_device_batch_size={e.max_batch_per_device:g}"])
    assert e.prefill_tokens_per_s == pytest.approx(1024 / e.prefill.seconds)
    assert cli.main(["estimate", "--step", "prefill", "--topology", "v5e-8", "--model", "llama3-70b", *words]) == 0
    out = capsys.readouterr().out
    assert "batch            1 sequence, prompt 1024 tokens" in out
    assert f"tokens/s         {e.prefill_tokens_per_s:,.0f} prompt tokens/s in prefill" in out


def test_estimate_memory_max_batch_of_a_serving_step_answers_first(capsys):
    from maxperf import cli

    code = cli.main(["estimate-memory", "--analytical-only", "--max-batch", "--step", "decode", "--topology", "v5e-8",
                     "--model", "llama3-70b", "ici_tensor_parallelism=8", "quantization=int8"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("largest per_device_batch_size that fits: ")
    assert "(decode, analytical; " in out.splitlines()[0]


INT8_CACHE = ["max_target_length=2048", "max_prefill_predict_length=512", "quantization=int8", "quantize_kvcache=true"]


def test_a_tpu_decode_copies_an_int8_cache_of_several_heads_a_device_whole():
    """libtpu relays out an int8 cache holding more than one key/value head a device into and out of the decode
    step's layer loop (2 x the keys' and values' bytes of temporaries); perfmodel counts it, within 10% of the
    compiled total, and not where a device holds one head, the cache is bf16, or the target a GPU."""
    from maxperf import aot
    from maxperf.perfmodel import serving as perf
    from maxperf.spec import resolve

    words = ["ici_tensor_parallelism=4", "per_device_batch_size=16", *INT8_CACHE]
    r = resolve("v5e-4", "llama3-8b", words)
    memory = perf.estimate_memory(r.model, r.train, r.mesh, 16 * 2**30, "decode")
    relaid = perf._relaid_int8_cache(r.model, r.train, dict(r.mesh.sizes), "tpu") * 64 * 2048
    assert relaid == 2 * 2 * (8 / 4) * 128 * 32 * 64 * 2048  # k and v, in and out, 2 heads, 32 layers
    compiled = aot.compile("v5e-4", "llama3-8b", words, step="decode").memory
    assert memory.total_bytes == pytest.approx(compiled["per_device_total_bytes"], rel=0.10)
    assert memory.total_bytes - relaid < 0.8 * compiled["per_device_total_bytes"]  # without it, far short
    one = resolve("v5e-8", "llama3-70b", ["ici_tensor_parallelism=8", *INT8_CACHE])
    assert perf._relaid_int8_cache(one.model, one.train, dict(one.mesh.sizes), "tpu") == 0
    bf16 = resolve("v5e-4", "llama3-8b", words[:-1])
    assert perf._relaid_int8_cache(bf16.model, bf16.train, dict(bf16.mesh.sizes), "tpu") == 0
    assert perf._relaid_int8_cache(r.model, r.train, dict(r.mesh.sizes), "gpu") == 0


@pytest.mark.slow
def test_the_largest_serving_batch_is_the_compilers(tmp_path):
    """estimate-memory --step decode --max-batch searches by compiles, in whole sequences over the devices: the
    largest it says fits compiles and fits, one sequence more does not."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate-memory", "--step", "decode", "--model",
                           "llama3-8b", "--topology", "v5e-4", "--max-batch", "--json", "ici_tensor_parallelism=4",
                           *INT8_CACHE], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout)["max_batch"]
    trials = {t["sequences"]: t["fits"] for t in found["trials"]}
    n = found["sequences"]
    assert n > 0 and trials[n] is True and trials[n + 1] is False, found
    assert found["per_device_batch_size"] == n / 4


def test_a_count_of_sequences_is_written_whole():
    from maxperf.cli.estimate import sequences

    assert (sequences(1), sequences(16384), sequences(2.5)) == ("1 sequence", "16,384 sequences", "2.5 sequences")


def test_expert_parallel_decode_prices_the_gathers_of_the_other_weights():
    """Under expert parallelism the attention and embedding weights are split over the expert axis too and gathered
    each step (the compiled step's all-gathers of the unembedding and the attention projections); the routed
    experts stay put. Before, one expert array in the list dropped the expert axis for every weight: no gather."""
    from maxperf.perfmodel.sharding import gather_axes
    from maxperf.spec.params import param_arrays
    from maxperf.spec.request import resolve

    request = resolve("h100-8", "gpt-oss-20b", ["ici_expert_parallelism=8"])
    arrays = [x for x in param_arrays(request.model) if x.matmul]
    assert gather_axes(arrays, request.mesh) == ("expert",)
    assert gather_axes([x for x in arrays if x.expert_parallel], request.mesh) == ()
    import contextlib
    import io
    import json

    from maxperf import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["estimate", "--step", "decode", "--model", "gpt-oss-20b", "--topology", "h100-8", "--json",
                         "ici_expert_parallelism=8", "per_device_batch_size=8", "max_target_length=8192",
                         "max_prefill_predict_length=1024"]) == 0
    decode = json.loads(out.getvalue())["decode"]
    assert decode["collective_s"] > decode["memory_s"]  # 7.9 ms of gathers beside 3.2 ms of HBM reads


def test_a_chunked_layers_prefill_is_causal_within_its_chunk():
    """llama4's chunked layers (chunks of 8192) over a 1024-token prompt: half the prompt's square, as a global
    layer's, not the whole square; a prompt of several chunks, each chunk's half square."""
    from maxperf.perfmodel.serving import _prefill_pairs

    assert _prefill_pairs(1024, -8192) == _prefill_pairs(1024, 0) == 1024 * 1024 / 2
    assert _prefill_pairs(16384, -8192) == 2 * 8192 * 8192 / 2
    assert _prefill_pairs(1024, 128) == 1024 * 128


def test_a_serving_plan_refuses_a_training_objective(capsys):
    from maxperf import cli

    assert cli.main(["plan", "--step", "decode", "--model", "llama3-8b", "--topology", "h100-8", "--objective", "mfu",
                     "--verify", "0"]) == 2
    assert "--objective mfu is a training plan's" in capsys.readouterr().err


def test_the_largest_context_says_where_its_search_stopped():
    """A tiny model's cache fits far past the search's bound: the answer is the bound, said as "at least", not the
    bound less one as if the next position did not fit."""
    from maxperf.perfmodel import serving as serving_model
    from maxperf.spec.request import resolve

    request = resolve("tpu7x-8", "tiny", [])
    found = serving_model.max_context(request.model, request.train, request.mesh, 94 * 2**30)
    assert found == serving_model.MAX_CONTEXT_SEARCHED
    assert serving_model.context_words(found) == "at least 67,108,864"
    assert serving_model.context_words(628594) == "628,594"


def test_prefill_flops_count_the_output_head_once_a_prompt_and_mla_attention_expanded():
    """The compiled prefill computes the logits of each prompt's last position only, and MLA's prefill attends over
    the keys and values expanded from the latent (the training kernels: 2 (nope + rope) + 2 v FLOPs a key and head),
    not in decode's absorbed form over the latent (2 (C + rope) + 2 C, 3.4x more for DeepSeek's dims)."""
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.request import resolve

    words = ["num_layers=1", "per_device_batch_size=1", "max_prefill_predict_length=2048", "max_target_length=4096"]
    p = resolve("cpu-1", "llama3-8b", words)
    chip = device_for(p.topology)
    one = model.prefill_phase(p.model, p.train, p.mesh, chip, p.topology, 1, 2048)
    m = p.model
    layer = 2 * 2048 * (m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                        + m.num_heads * m.head_dim * m.d_model + 3 * m.d_model * m.d_ff)
    head = 2 * m.vocab_size * m.d_model  # one position's logits
    attention = m.num_heads * 4 * m.head_dim * 2048 * 2048 / 2
    assert one.flops == pytest.approx(layer + head + attention, rel=0.01)

    d = resolve("cpu-1", "deepseek-v2-lite", ["num_layers=2", "vocab_size=256", "per_device_batch_size=1",
                                              "max_prefill_predict_length=8192", "max_target_length=8704"])
    H, per_key = model._attention(d.model, dict(d.mesh.sizes), absorbed=False)
    assert per_key == 2 * (d.model.qk_nope_head_dim + d.model.qk_rope_head_dim) + 2 * d.model.v_head_dim
    assert model._attention(d.model, dict(d.mesh.sizes))[1] > 3 * per_key


@pytest.mark.parametrize("bound", ["inf", "nan"])
def test_a_serving_plan_refuses_a_bound_that_is_not_a_finite_number(bound, tmp_path):
    from cli_util import maxperf

    proc = maxperf("plan", "--step", "decode", "--model", "llama3-8b", "--topology", "h100-8", "--max-time-per-token",
                   bound, "--verify", "0", "--out", str(tmp_path / "p"))
    assert proc.returncode == 2 and "finite number of ms" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p").exists()


def test_a_serving_plan_writes_into_its_own_output_again(tmp_path):
    from cli_util import maxperf

    args = ("plan", "--step", "decode", "--model", "llama3-8b", "--topology", "h100-8", "--max-time-per-token", "30",
            "--verify", "0", "--out", str(tmp_path / "p"))
    assert maxperf(*args).returncode == 0
    again = maxperf(*args)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("topology, speedup", [("h100-1", "cudnn"), ("a100-1", "none")])
def test_a_prefills_attention_runs_at_cudnns_rate_where_training_prices_it_so(topology, speedup):
    """attention=cudnn_flash_te prefills at cuDNN's rate on the chips the training step prices it faster on
    (work.flash_speedup: Hopper), and at the flash kernels' elsewhere; the matmuls do not change."""
    from maxperf.perfmodel import serving as model
    from maxperf.perfmodel import work
    from maxperf.perfmodel.estimate import device_for
    from maxperf.spec.request import resolve

    words = ["num_layers=2", "per_device_batch_size=1", "max_prefill_predict_length=8192", "max_target_length=8704"]
    flash, cudnn = (resolve(topology, "llama3-8b", [*words, f"attention={a}"]) for a in ("flash", "cudnn_flash_te"))
    chip = device_for(flash.topology)
    a, b = (model.prefill_phase(p.model, p.train, p.mesh, chip, p.topology, 1, 8192) for p in (flash, cudnn))
    assert a.flops == b.flops
    m = flash.model
    attention_flops = m.num_layers * m.num_heads * 4 * m.head_dim * 8192 * 8192 / 2
    rate = chip.peak_flops("bfloat16") * work.SHIPPED.fraction(chip) * work.FLASH_EFFICIENCY["gpu"]
    saved = attention_flops / rate * (1 - 1 / work.CUDNN_FLASH_SPEEDUP) if speedup == "cudnn" else 0.0
    assert a.seconds - b.seconds == pytest.approx(saved, rel=1e-6, abs=1e-12)
