"""`maxperf estimate-memory` and maxperf.search.memory_fit: the analytical side, the compiler beside it, the max-batch
search, and bad input as one-line errors."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from maxperf.perfmodel import working
from maxperf.perfmodel.memory import MINIMAL_SAVED_COPIES
from maxperf.search import memory_fit
from maxperf.search.memory_fit import Trial, _next_batch
from maxperf.spec.errors import MaxperfError

TINY = ["seq_len=128", "per_device_batch_size=2"]  # TPU flash attention takes L in multiples of 128


def maxperf(*args):
    return subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate-memory", *args], capture_output=True,
                          text=True, env={**os.environ}, timeout=600)


def test_analytical_only_json_has_both_objects_and_no_compile():
    r = maxperf("--topology", "v5p-8", "--model", "llama2-7b", "--analytical-only", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["compiler"] is None and d["verdict_source"] == "analytical"
    assert d["analytical"]["per_device_total_bytes"] > 0 and d["analytical"]["fits"] is True
    assert d["mesh"] == {"fsdp": 4} and d["difference"] is None


def test_analytical_total_is_the_sum_of_its_parts():
    cmp = memory_fit.compare("v5p-64", "llama2-7b", ["remat_policy=minimal"], analytical_only=True)
    a = cmp.analytical
    phases = a.phases()
    state = a.params + a.optimizer + a.grad_accumulator
    assert a.per_device_total_bytes == pytest.approx(state + phases[a.peak_phase])
    assert phases["optimizer"] == pytest.approx(2 * a.gradients)  # gradients and their scaled copy
    assert phases["backward"] - phases["loss"] == pytest.approx(a.temporaries - a.logits - a.saved_copy)
    # minimal remat: a partial second copy of the saved dot outputs (not of the scan carry) in the loss phase
    carry = 32 * 2048 * 4096 * 2  # N x T x D in bfloat16
    assert a.saved_copy == pytest.approx((MINIMAL_SAVED_COPIES - 1) * (a.activations - carry))
    full = memory_fit.compare("v5p-64", "llama2-7b", ["remat_policy=full"], analytical_only=True).analytical
    assert full.saved_copy == 0 and full.activations == pytest.approx(carry)
    assert cmp.fits == a.fits and cmp.headroom_bytes == pytest.approx(a.hbm_bytes - a.per_device_total_bytes)


def test_a_step_that_cannot_fit_exits_3_with_the_verdict():
    r = maxperf("--topology", "v5p-8", "--model", "llama2-70b", "--analytical-only")
    assert r.returncode == 3, r.stderr
    assert "DOES NOT FIT" in r.stdout


def test_analytical_max_batch_is_the_boundary():
    found = memory_fit.max_batch("v5p-8", "llama2-7b", ["remat_policy=full"], analytical_only=True)
    b = found.per_device_batch_size
    assert b >= 1 and found.compiles == 0
    at = memory_fit.compare("v5p-8", "llama2-7b", ["remat_policy=full", f"per_device_batch_size={b}"],
                            analytical_only=True)
    above = memory_fit.compare("v5p-8", "llama2-7b", ["remat_policy=full", f"per_device_batch_size={b + 1}"],
                               analytical_only=True)
    assert at.fits and not above.fits


def test_max_batch_searches_the_batches_a_pipelines_microbatches_split():
    """16 pipeline microbatches over 8 devices need 2 rows a device: the search steps by 2 (it tried 1 and stopped,
    naming a batch the user never gave); the answer is the boundary among those multiples."""
    words = ["ici_pipeline_parallelism=4", "num_pipeline_microbatches=16", "per_device_batch_size=2"]
    found = memory_fit.max_batch("v5p-16", "llama2-7b", words, analytical_only=True)
    b = found.per_device_batch_size
    assert b >= 2 and b % 2 == 0
    at = memory_fit.compare("v5p-16", "llama2-7b", [*words, f"per_device_batch_size={b}"], analytical_only=True)
    above = memory_fit.compare("v5p-16", "llama2-7b", [*words, f"per_device_batch_size={b + 2}"],
                               analytical_only=True)
    assert at.fits and not above.fits
    # nothing fits (llama2-70b): the search says so at the smallest batch the microbatches take, 2 (it stopped at 1)
    none = memory_fit.max_batch("v5p-16", "llama2-70b", words, analytical_only=True)
    assert (none.per_device_batch_size, none.smallest) == (0, 2)
    # a limit that is no power of two times the unit: the answer is checked, never the limit taken unchecked
    p = memory_fit.resolve("v5p-8", "tiny", [])
    assert memory_fit.analytical_max_batch(p, [], 1, limit=100) == 100
    assert memory_fit.analytical_max_batch(memory_fit.resolve("v5p-8", "llama2-7b", ["remat_policy=full"]),
                                           ["remat_policy=full"], 1, limit=100) == b_7b(memory_fit)


def b_7b(memory_fit) -> int:
    """llama2-7b's largest batch on v5p-8 under full remat, by perfmodel, found by stepping up one at a time."""
    b = 0
    while memory_fit.compare("v5p-8", "llama2-7b", ["remat_policy=full", f"per_device_batch_size={b + 1}"],
                             analytical_only=True).fits:
        b += 1
    return b


def test_next_batch_aims_at_the_crossing_and_stays_inside_the_bracket():
    gib = 1 << 30
    # 10 GiB fixed + 2 GiB per example, 95 GiB device: the line crosses at B = 42.5
    trials = [Trial(8, True, 26 * gib, 1.0), Trial(64, False, 138 * gib, 1.0)]
    assert _next_batch(trials, 8, 64, 1.0, 95 * gib) == 42
    # an aim outside the bracket is pulled inside it, so every compile narrows the search
    assert _next_batch([Trial(8, True, 26 * gib, 1.0)], 8, 10, 0.1 * gib, 95 * gib) == 9
    assert _next_batch([Trial(8, True, 94.5 * gib, 1.0)], 8, 1 << 17, 2 * gib, 95 * gib) == 9


@pytest.mark.parametrize("args, message", [
    (["--topology", "v9z-8", "--model", "tiny"], "unknown"),
    (["--topology", "v5p-8", "--model", "tiny", "ici_fsdp=3"], "3"),
    (["--topology", "v5p-8", "--model", "tiny", "per_device_batch_size=0"], "per_device_batch_size"),
    (["--topology", "v5p-8", "--model", "tiny", "remat_policy=some"], "remat_policy"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = maxperf(*args, "--analytical-only")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxperf: error:") and message in lines[0]
    assert "Traceback" not in r.stderr


def test_bad_input_raises_before_any_compile():
    with pytest.raises(MaxperfError, match="per_device_batch_size"):
        memory_fit.compare("v5p-8", "tiny", ["per_device_batch_size=0"])


@pytest.mark.slow
def test_compiler_figures_sit_beside_the_analytical_ones():
    r = maxperf("--topology", "v5p-8", "--model", "tiny", *TINY, "remat_policy=full", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    c, a = d["compiler"], d["analytical"]
    assert c["source"] == "xla memory_analysis" and d["verdict_source"] == "compiler"
    assert c["per_device_total_bytes"] == (c["argument_bytes"] + c["output_bytes"] - c["alias_bytes"]
                                           + c["temp_bytes"] + c["generated_code_bytes"])
    assert c["fits"] is True and a["fits"] is True and d["fits"] is True
    assert d["difference"] == pytest.approx((a["per_device_total_bytes"] - c["per_device_total_bytes"])
                                            / c["per_device_total_bytes"])
    assert d["out_dir"] is None


@pytest.mark.slow
def test_max_batch_finds_the_boundary_on_a_small_device(tmp_path):
    # cpu-2 devices share this host's memory; a tiny model fits any small batch, so bound the search instead by a
    # configuration whose memory grows fast with B: long sequences on v5e (16 GiB per chip)
    found = memory_fit.max_batch("v5e-4", "tiny", ["seq_len=4096", "remat_policy=none"])
    b = found.per_device_batch_size
    assert b >= 1 and found.compiles == len(found.trials) >= 2
    fits = {t.per_device_batch_size: t.fits for t in found.trials}
    assert fits[b] is True and fits.get(b + 1) is False  # the boundary was compiled on both sides
    assert found.best is not None and found.best.compiler["fits"]


@pytest.mark.slow
def test_a_compile_cache_hit_says_so(tmp_path, monkeypatch):
    args = ["--topology", "cpu-8", "--model", "tiny", "seq_len=64", "remat_policy=none"]
    env = {**os.environ, "MAXPERF_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate-memory", *args], capture_output=True,
                           text=True, env=env, timeout=600) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert "; compiled in " in runs[0].stdout and "from the compile cache" not in runs[0].stdout
    assert "; from the compile cache" in runs[1].stdout and "compiled in" not in runs[1].stdout
    # the compiler's peak comes back with the cached executable, as it was read at the compile
    peaks = [next(x for x in r.stdout.splitlines() if "compiler's peak" in x) for r in runs]
    assert peaks[0] == peaks[1]
    monkeypatch.setenv("MAXPERF_CACHE_DIR", str(tmp_path / "cache"))
    again = memory_fit.compare("cpu-8", "tiny", args[4:])
    assert again.cache_hit is True and again.as_dict()["cache_hit"] is True
    assert again.compiler["peak"]["live_bytes"] > 0


def test_a_mixture_of_experts_breakdown_names_experts_attention_and_the_rest():
    r = maxperf("--topology", "v5p-128", "--model", "deepseek-v3", "ici_expert_parallelism=8", "--analytical-only")
    assert r.returncode == 3, r.stderr
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("by block"))
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[at + 1:at + 4]}
    assert list(rows) == ["experts", "attention", "rest"]
    assert rows["experts"][0] > 10 * rows["attention"][0] > 0  # 256 experts hold almost all of DeepSeek-V3's state
    dense = maxperf("--topology", "v5p-8", "--model", "llama2-7b", "--analytical-only")
    assert "by block" not in dense.stdout


# The forward scan's stacked saved tensors, read by memory_fit.scan_saved_bytes from the optimized HLO of compiles of
# llama2-7b's widths at 4 layers on v5p-32 (libtpu 0.0.52; `bench/memory_accuracy.py`'s cases): bytes per device.
# They pin perfmodel's saved set per policy and kernel to what the compiled step keeps.
LLAMA_4 = ["num_layers=4", "seq_len=2048"]


@pytest.mark.parametrize("overrides, stacked", [
    (["ici_tensor_parallelism=4", "per_device_batch_size=2", "remat_policy=none", "attention=flash"], 3929014272),
    (["ici_tensor_parallelism=4", "per_device_batch_size=2", "remat_policy=none", "attention=dot_product"],
     8225030144),
    (["ici_tensor_parallelism=1", "per_device_batch_size=1", "remat_policy=none", "attention=flash"], 1955729408),
    (["ici_tensor_parallelism=4", "per_device_batch_size=2", "remat_policy=minimal", "attention=flash"], 1400897536),
    (["ici_tensor_parallelism=1", "per_device_batch_size=1", "remat_policy=full", "attention=dot_product",
      "seq_len=8192"], 268435456),
])
def test_saved_activations_are_what_the_compiled_forward_scan_stacks(overrides, stacked):
    a = memory_fit.compare("v5p-32", "llama2-7b", [*LLAMA_4, *overrides], analytical_only=True).analytical
    # the compiler's stacks also hold each norm's float32 per-token statistic (4 bytes a token), not counted
    assert a.activations == pytest.approx(stacked, rel=0.01)


def test_scan_saved_bytes_reads_the_forward_loop_stacks_only():
    hlo = ("HloModule m\n\nENTRY %main (p: f32[2]) -> f32[2] {\n"
           "  %while.1 = (s32[], bf16[8,16,32]{2,1,0}, bf16[4,8,16,32]{3,2,1,0:T(8,128)}, f32[4,64,128], "
           "f32[4,8,16,2,8]) while(%t), condition=%c, body=%b\n"
           "  %while.2 = (s32[], bf16[4,8,16,32]) while(%u), condition=%c2, body=%b2\n}\n")
    # the [4, 8, ...] stacks of the first loop: bf16 4x8x16x32 and f32 4x8x16x2x8; not the carry, not the weights
    assert memory_fit.scan_saved_bytes(hlo, num_layers=4, local_batch=8) == 4 * 8 * 16 * 32 * 2 + 4 * 8 * 16 * 2 * 8 * 4


@pytest.mark.slow
def test_a_tiny_compile_keeps_the_saved_activations_perfmodel_counts(tmp_path):
    """The same property as the llama2-7b figures above on a compile made now: tiny on v5p-8, tensor 2."""
    overrides = ["seq_len=128", "per_device_batch_size=2", "ici_tensor_parallelism=2", "remat_policy=none"]
    cmp = memory_fit.compare("v5p-8", "tiny", overrides, out=tmp_path / "artifact")
    hlo = (tmp_path / "artifact" / "hlo" / "optimized.hlo.txt").read_text()
    local_batch = 2 * 2  # MaxText's per-device batch counts the tensor-parallel devices: B x tensor examples each
    stacked = memory_fit.scan_saved_bytes(hlo, num_layers=2, local_batch=local_batch)
    assert cmp.analytical.activations == pytest.approx(stacked, rel=0.03)


# XLA's per-device totals (argument + output - alias + temp + code) of compiles in bench/memory_accuracy.py's design
# (libtpu 0.0.52, the current step): the analytical total stays within the fidelity issue's worst 20% of each and its
# median 10% over them; a change to a formula that moves one past it must come with the compiled step that justifies it.
# Under tensor parallelism with the batch split too the compiler keeps the logits' gradient and the gathered final
# hidden state through the backward scan (perfmodel.working.LATE_TABLE_GRADIENT_INPUTS); without a batch split
# (tensor 16 on 16 chips) it does not.
RECORDED_COMPILES = [
    ("llama2-7b", "v5p-32", [*LLAMA_4, "ici_tensor_parallelism=4", "per_device_batch_size=2", "remat_policy=none",
                             "attention=flash"], 6663319744),
    ("llama2-7b", "v5p-32", [*LLAMA_4, "ici_tensor_parallelism=1", "per_device_batch_size=1", "seq_len=8192",
                             "remat_policy=full", "attention=dot_product"], 11823151808),
    ("llama2-7b", "v5p-32", [*LLAMA_4, "ici_tensor_parallelism=2", "per_device_batch_size=4", "seq_len=4096",
                             "remat_policy=minimal", "attention=dot_product"], 17294763712),
    ("mixtral-8x7b", "v5p-32", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full", "attention=flash"],
     11229612224),
    ("deepseek-v2-lite", "v5p-8", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full", "attention=flash"],
     12100400000),
    # twice the depth: the error moves by a few points, so the bench's 4-layer MoE figures stand for full depth
    ("deepseek-v2-lite", "v5p-8", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full", "attention=flash",
                                   "num_layers=8"], 22685074816),
    # FSDP over 64 devices: the weights are gathered whole, not windowed
    ("llama2-7b", "v5p-128", [*LLAMA_4, "per_device_batch_size=4", "remat_policy=full", "attention=flash"],
     2483404992),
    ("llama2-7b", "v5p-32", [*LLAMA_4, "ici_tensor_parallelism=4", "per_device_batch_size=2",
                             "remat_policy=qkv_proj_offloaded", "attention=dot_product"], 3366803136),
    ("llama2-7b", "v5p-32", [*LLAMA_4, "ici_tensor_parallelism=4", "per_device_batch_size=2", "remat_policy=custom",
                             "query_proj=device", "key_proj=offload", "value_proj=offload", "context=device",
                             "mlpwi_0=device", "mlpwo=offload", "attention=flash"], 3385174720),
    ("llama2-7b", "v5p-32", [*LLAMA_4, "ici_tensor_parallelism=8", "per_device_batch_size=16", "seq_len=4096",
                             "remat_policy=full", "attention=flash"], 29085014720),
    ("llama2-7b", "v5p-32", [*LLAMA_4, "ici_tensor_parallelism=16", "per_device_batch_size=2", "seq_len=8192",
                             "remat_policy=save_dot_except_mlp", "attention=flash"], 11833242304),
    # FSDP over 256 devices at llama3-70b's widths (weights gathered whole), L 8192: MaxText's v6e host-offload recipe
    # (the layer input and q, k, v offloaded) and full remat
    ("llama3-70b", "v6e-256", ["num_layers=4", "seq_len=8192", "attention=flash", "per_device_batch_size=5",
                               "remat_policy=custom", "decoder_layer_input=offload", "query_proj=offload",
                               "key_proj=offload", "value_proj=offload"], 18974766272),
    ("llama3-70b", "v6e-256", ["num_layers=4", "seq_len=8192", "attention=flash", "per_device_batch_size=2",
                               "remat_policy=full"], 11271573184),
    # expert parallelism: the experts' backward over the dropless receive buffer's rows
    ("qwen3-235b-a22b", "v5p-256", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full", "attention=flash",
                                    "ici_expert_parallelism=16"], 36065454304),
    # TPU7x: libtpu takes the vocabulary table's gradient after the backward scan (working.LATE_TABLE_GRADIENT_CHIPS)
    ("llama2-7b", "tpu7x-128", [*LLAMA_4, "per_device_batch_size=2", "ici_fsdp_parallelism=128", "remat_policy=full",
                                "attention=flash"], 1787093696),
    ("llama2-7b", "tpu7x-128", [*LLAMA_4, "per_device_batch_size=2", "ici_data_parallelism=2",
                                "ici_fsdp_parallelism=64", "remat_policy=full", "attention=flash"], 2102551232),
    ("llama2-7b", "tpu7x-8", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full", "attention=flash"], 4212114112),
    # tpu-recipes' gpt-oss-120b at 4 layers: remat full, and the recipe's offloads in both expert layouts
    *(("gpt-oss-120b", "tpu7x-128", ["num_layers=4", "per_device_batch_size=10", "seq_len=8192", "attention=flash",
                                     "ici_fsdp_parallelism=64", "ici_data_parallelism=2", *extra], compiled)
      for extra, compiled in ((("remat_policy=full", "shard_exp_on_fsdp=true"), 68874917696),
                              (("remat_policy=custom", "decoder_layer_input=offload", "mlpwo=offload",
                                "shard_exp_on_fsdp=true"), 67761346880),
                              (("remat_policy=custom", "decoder_layer_input=offload", "mlpwo=offload"),
                               69900762432))),
]


@pytest.mark.parametrize("model, topology, overrides, compiled", RECORDED_COMPILES)
def test_analytical_total_is_within_twenty_percent_of_recorded_compiles(model, topology, overrides, compiled):
    a = memory_fit.compare(topology, model, overrides, analytical_only=True).analytical
    assert abs(a.per_device_total_bytes / compiled - 1) <= 0.20


def test_analytical_total_median_error_over_recorded_compiles_is_within_ten_percent():
    errors = [abs(memory_fit.compare(topology, model, overrides, analytical_only=True).analytical.per_device_total_bytes
                  / compiled - 1) for model, topology, overrides, compiled in RECORDED_COMPILES]
    assert statistics.median(errors) <= 0.10


@pytest.mark.parametrize("tensor, late", [(4, True), (16, False)])
def test_the_unembedding_gradient_inputs_stay_through_the_backward_only_when_tensor_and_batch_split(
        monkeypatch, tensor, late):
    overrides = [*LLAMA_4, f"ici_tensor_parallelism={tensor}", "per_device_batch_size=2", "remat_policy=full",
                 "attention=flash"]
    counted = memory_fit.compare("v5p-32", "llama2-7b", overrides, analytical_only=True).analytical
    monkeypatch.setattr(working, "LATE_TABLE_GRADIENT_INPUTS", 0)
    without = memory_fit.compare("v5p-32", "llama2-7b", overrides, analytical_only=True).analytical
    tokens = 2 * 16 // (16 // tensor) * 2048  # one data shard's tokens: the global batch over fsdp = 16 / tensor
    expected = tokens * (4096 + 32000 // tensor) * 2 if late else 0  # bf16 [T, D] and [T, V / tensor]
    assert counted.temporaries - without.temporaries == expected


def test_weights_gathered_whole_hold_the_table_gradient_and_fuse_the_recomputed_mlp(monkeypatch):
    """FSDP shards thinner than the matrix unit (v6e-256: 32 rows of D 8192): the table's weight gradient all-reduced
    whole through the backward scan, and the MLP's recomputed up projection fused into its gradients' fusion
    (perfmodel.working: GATHERED_TABLE_GRADIENTS, RECOMPUTED_MLP_F_GATHERED)."""
    overrides = ["num_layers=4", "seq_len=8192", "attention=flash", "per_device_batch_size=2", "remat_policy=full"]
    counted = memory_fit.compare("v6e-256", "llama3-70b", overrides, analytical_only=True).analytical
    monkeypatch.setattr(working, "GATHERED_TABLE_GRADIENTS", 0)
    monkeypatch.setattr(working, "RECOMPUTED_MLP_F_GATHERED", working.RECOMPUTED_MLP_F)
    windowed = memory_fit.compare("v6e-256", "llama3-70b", overrides, analytical_only=True).analytical
    T, D, F, V = 2 * 8192, 8192, 28672, 128256
    assert counted.temporaries - windowed.temporaries == 2 * D * V - 2 * (working.RECOMPUTED_MLP_F - 1) * F * T
    # where the shards are thick enough for windowed einsums (v5p-32, fsdp 16: 256 rows) neither applies
    thick = ["num_layers=4", "per_device_batch_size=2", "remat_policy=full", "attention=flash"]
    a = memory_fit.compare("v5p-32", "llama2-7b", thick, analytical_only=True).analytical
    monkeypatch.undo()
    assert memory_fit.compare("v5p-32", "llama2-7b", thick, analytical_only=True).analytical.temporaries == \
        a.temporaries


# The MoE issue's target, 15% of XLA's per-device total (libtpu 0.0.52), on the compiles whose buffers the MoE
# formulas were read from: the exchange serialized where it would not fit (kimi-k2, deepseek-v3 at 5 layers), thin
# expert shards (Llama 4, mixtral-8x22b) and the experts' gradients under fsdp_transpose (mixtral-8x7b's plan, full
# depth), all of the current step.
@pytest.mark.parametrize("model, topology, overrides, compiled", [
    ("kimi-k2", "v5p-1024", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full", "attention=flash",
                             "ici_expert_parallelism=32"], 72547736480),
    ("deepseek-v3", "v5p-512", ["num_layers=5", "seq_len=2048", "per_device_batch_size=2", "remat_policy=full",
                                "attention=flash", "ici_expert_parallelism=32"], 70045582752),
    ("llama4-maverick-17b-128e", "v5p-512", ["seq_len=2048", "per_device_batch_size=1", "remat_policy=full",
                                             "attention=flash"],
     73563667808),
    ("llama4-scout-17b-16e", "v5p-256", ["seq_len=2048", "per_device_batch_size=1", "remat_policy=full",
                                         "attention=flash"],
     23286386912),
    ("llama4-maverick-17b-128e", "v5p-512", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full",
                                             "attention=flash"], 51766391136),
    ("llama4-scout-17b-16e", "v5p-256", [*LLAMA_4, "per_device_batch_size=2", "remat_policy=full", "attention=flash"],
     9989615328),
    ("mixtral-8x7b", "v5p-64", ["ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=4",
                                "ici_tensor_parallelism=4", "seq_len=2048", "per_device_batch_size=2",
                                "grad_accum_steps=8", "remat_policy=minimal", "attention=flash"], 100595807936),
])
def test_moe_analytical_total_is_within_fifteen_percent_of_recorded_compiles(model, topology, overrides, compiled):
    a = memory_fit.compare(topology, model, overrides, analytical_only=True).analytical
    assert abs(a.per_device_total_bytes / compiled - 1) <= 0.15


def test_mtp_analytical_total_is_within_sixteen_percent_of_its_recorded_compile():
    """deepseek-v3 with one MTP module: 19.88 GiB analytical against 17.29 compiled, +15.0% (the MoE issue's 15% is
    missed by 0.004 points). At the compiler's peak three whole bf16[7168, 129280] gradients of the unembedding live
    (perfmodel counts two, one per head) and four bf16[65536, 7168] buffers of the MoE layers' rows and gathered
    experts (perfmodel counts more of them); the bound keeps the case from drifting further."""
    overrides = [*LLAMA_4, "per_device_batch_size=1", "seq_len=1024", "ici_expert_parallelism=8",
                 "routed_bias_update_rate=0.001", "mtp_num_layers=1"]
    a = memory_fit.compare("v5p-128", "deepseek-v3", overrides, analytical_only=True).analytical
    assert abs(a.per_device_total_bytes / 18559931040 - 1) <= 0.16


# The same target on GPU (jax 0.12's CUDA 12 plugin compiling without a GPU, L 2048, remat full,
# bench/memory_accuracy.py group "gpu"): dropless steps whose grouped matmuls XLA:GPU expands over the local experts
# (perfmodel.working.RAGGED_EXPANDED_*) and whose FSDP-sharded expert gradients it holds in two layouts
# (GPU_EXPERT_GRADIENT_COPIES); without those the analytical figure was 24-80% under every one of these.
@pytest.mark.parametrize("model, topology, overrides, compiled", [
    ("deepseek-v2-lite", "h100-8", ["per_device_batch_size=1"], 60858325008),
    ("deepseek-v2-lite", "h100-8", ["per_device_batch_size=2"], 68547537680),
    ("deepseek-v2-lite", "h100-8", ["per_device_batch_size=1", "ici_expert_parallelism=8"], 49649761008),
    ("gpt-oss-20b", "h100-8", ["per_device_batch_size=1"], 65418669544),
    ("qwen3-30b-a3b", "h100-8", ["per_device_batch_size=1", "ici_expert_parallelism=8"], 83500623792),
    ("qwen3-30b-a3b", "h100-8", ["num_layers=2", "per_device_batch_size=2", "ici_expert_parallelism=8"],
     61234319024),
    ("deepseek-v2-lite", "h100-1", ["num_layers=3", "per_device_batch_size=2"], 54332681200),
    ("qwen3-30b-a3b", "h100-1", ["num_layers=2", "per_device_batch_size=1"], 57337510320),
    ("mixtral-8x7b", "h100-1", ["num_layers=2", "per_device_batch_size=4"], 69464750944),
    ("gpt-oss-20b", "h100-1", ["num_layers=2", "per_device_batch_size=4"], 72851259848),
])
def test_gpu_moe_analytical_total_is_within_fifteen_percent_of_recorded_compiles(model, topology, overrides,
                                                                                 compiled):
    a = memory_fit.compare(topology, model, overrides, analytical_only=True).analytical
    assert abs(a.per_device_total_bytes / compiled - 1) <= 0.15


LIBTPU_LOG = """I1127 11:21:33.724044 6842 deepsea_compiler_backend.cc:2385] XLA::TPU module name: jit_step
I1127 11:21:33.724049 6842 deepsea_compiler_backend.cc:2387] XLA::TPU program HBM usage: 10.27G / 31.24G
I1127 11:21:33.724078 6842 deepsea_compiler_backend.cc:2434] Program sflag requirement 484B:
    HLO temp           120B (100.0% utilization: Unpadded (120B) Padded (120B), 0.0% fragmentation (0B))
Program hbm requirement 10.27G:
    global            1.58M
    scoped           15.81M
    HLO temp         10.21G (100.0% utilization: Unpadded (8.47G) Padded (8.47G), 17.0% fragmentation (1.74G))
Program vmem requirement 127.18M:
    HLO temp         95.92M (0.0% utilization: Unpadded (0B) Padded (0B), 100.0% fragmentation (95.92M))
"""


def test_memory_bench_reads_the_train_steps_hbm_temporaries_from_libtpus_log(tmp_path, monkeypatch):
    """bench/memory_accuracy.py: the train step's HBM block (not the sflag or vmem ones), libtpu's G being GiB; what a
    read returned is not returned again."""
    import importlib.util

    monkeypatch.setenv("TPU_LOG_DIR", str(tmp_path))
    for name in ("MAXPERF_NO_CACHE", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS"):  # the bench sets them: restored after
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    spec = importlib.util.spec_from_file_location("memory_accuracy_bench",
                                                  Path(__file__).parent.parent / "bench" / "memory_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "LOG_WAIT_S", 0.0)
    log = bench.LibtpuLog()
    (tmp_path / "tpu_driver.INFO").write_text("I1127 earlier lines\n" + LIBTPU_LOG)
    assert log.read() == {"temp": 10.21 * 2**30, "live": 8.47 * 2**30, "fragmentation": 1.74 * 2**30}
    assert log.read() is None


def test_tpu7x_holds_the_logits_gradient_and_final_hidden_state_through_the_backward():
    """On TPU7x libtpu takes the vocabulary table's gradient after the backward scan: the logits' gradient [T, V] and
    the final hidden state [T, D] (compute dtype) join the backward's working set, and the table's own gradient is not
    held through it; v5p at the same mesh takes the gradient before the scan."""
    words = [*LLAMA_4, "per_device_batch_size=2", "ici_fsdp_parallelism=128", "remat_policy=full", "attention=flash"]
    tpu7x = memory_fit.compare("tpu7x-128", "llama2-7b", words, analytical_only=True).analytical
    T, D, V, c = 2 * 2048, 4096, 32000, 2
    table = D * V * c  # the gathered table's gradient, held through the backward scan on v5p (gathered whole)
    v5p_words = [w for w in words if not w.startswith("ici_fsdp")] + ["ici_fsdp_parallelism=128"]
    v5p = memory_fit.compare("v5p-256", "llama2-7b", v5p_words, analytical_only=True).analytical
    assert tpu7x.temporaries - v5p.temporaries == pytest.approx(T * (D + V) * c - table, rel=1e-6)


# Compiled with libtpu 0.0.52 (llama3-8b at 4 layers on v6e-8, fsdp 8, L 2048): libtpu took the vocabulary table's
# gradient after the backward scan in each, which perfmodel counts before it; the compiler's totals in GiB
LATE_SCHEDULE_COMPILES = [
    (["per_device_batch_size=8", "remat_policy=minimal"], 17.50),
    (["per_device_batch_size=8", "remat_policy=full"], 12.75),
    (["per_device_batch_size=32", "remat_policy=minimal_offloaded"], 41.47),
]


@pytest.mark.parametrize("words, compiled", LATE_SCHEDULE_COMPILES)
def test_a_late_table_gradient_is_the_risk_reported_beside_the_verdict(words, compiled):
    """The logits' gradient a late placement holds, [T, V] in bf16, is the risk on top of perfmodel's total, and the
    total with it comes within 6% of each compile; where that crosses HBM (B 32, 41.47 GiB compiled against 31.25) the
    verdict that fits as counted is flagged may_not_fit."""
    a = memory_fit.compare("v6e-8", "llama3-8b", ["num_layers=4", "seq_len=2048", *words],
                           analytical_only=True).analytical
    B = int(words[0].split("=")[1])
    assert a.late_risk_bytes == B * 2048 * 128256 * 2
    GIB = 2**30
    assert a.per_device_total_bytes / GIB < compiled
    assert abs((a.per_device_total_bytes + a.late_risk_bytes) / GIB / compiled - 1) <= 0.06
    assert a.fits and a.may_not_fit == (B == 32)


def test_no_late_risk_where_the_placement_is_counted_or_cannot_differ():
    """TPU7x counts the late placement; a GPU, one unsplit batch and vocabulary tiling have no such choice."""
    base = ["num_layers=4", "seq_len=2048", "per_device_batch_size=2", "remat_policy=full"]
    for topology, words in (("tpu7x-8", base), ("h100-8", base), ("v6e-8", [*base, "num_vocab_tiling=4"]),
                            ("v6e-8", [*base, "ici_fsdp_parallelism=1", "ici_tensor_parallelism=8"])):
        a = memory_fit.compare(topology, "llama3-8b", words, analytical_only=True).analytical
        assert a.late_risk_bytes == 0 and not a.may_not_fit, (topology, words)
    split = memory_fit.compare("v6e-8", "llama3-8b", base, analytical_only=True).analytical
    assert split.late_risk_bytes == 2 * 2048 * 128256 * 2


def test_estimate_says_a_step_may_not_fit_and_keeps_its_verdict():
    words = ["num_layers=4", "seq_len=2048", "per_device_batch_size=32", "remat_policy=minimal_offloaded"]
    r = subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate", "--topology", "v6e-8", "--model",
                        "llama3-8b", *words], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "(fits)" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "memory check" in x)
    assert "may not fit" in line and "15.66 GiB" in line and "39.35 GiB" in line
    r = maxperf("--topology", "v6e-8", "--model", "llama3-8b", "--analytical-only", *words)
    assert r.returncode == 0 and "may not fit" in r.stdout and "without --analytical-only" in r.stdout


BIG_MATMUL = '''
import jax
import jax.numpy as jnp

from maxperf.aot.user_step import Step


def make_step(mesh, n: int = 1024):
    s = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
    return Step(fn=lambda a, b: a @ b, args=(s, s))
'''


def test_a_compile_shows_the_plugins_c_plus_plus_logs_only_with_verbose(tmp_path):
    """estimate-memory compiles in a watched child as compile does: the CUDA plugin's scheduler logs an error line
    for arguments past its limit (a 200,000-square bf16 matmul, 224 GiB a device), which only --verbose shows; the
    verdict is exit 3 either way."""
    (tmp_path / "big_matmul.py").write_text(BIG_MATMUL)
    stderr = {}
    for verbose in (False, True):
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "MAXPERF_CACHE_DIR": str(tmp_path / f"cache{verbose}")}
        proc = subprocess.run([sys.executable, "-m", "maxperf.cli", "estimate-memory", "--step",
                               "big_matmul:make_step", "--topology", "h100-8", "n=200000",
                               *(["--verbose"] if verbose else [])], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)
        assert proc.returncode == 3 and "DOES NOT FIT" in proc.stdout, proc.stderr
        stderr[verbose] = proc.stderr.splitlines()
    assert all(line.startswith(("maxperf: ", "[")) for line in stderr[False]), stderr[False]
    assert any("gpu_hlo_schedule" in line for line in stderr[True]), stderr[True]


LIVE_RANGES = """HloLiveRange (max 9):
  Live ranges at 7 (peak):
    loop{1}: 4096 bytes (cumulative: 4096 bytes)
    p0{}: 2048 bytes (cumulative: 6144 bytes)
    big{}: 1024 bytes (cumulative: 7168 bytes)
  Stack trace breakdown for peak usage: 7168 bytes
"""
HLO = """HloModule m

%body (x: (s32[], f32[32,32])) -> (s32[], f32[32,32]) {
  %p0 = (s32[], f32[32,32]) parameter(0)
}

ENTRY %main (p0: f32[16,32]) -> f32[16,32] {
  %p0 = f32[16,32]{1,0} parameter(0), metadata={op_name="state[\\'params\\'][\\'w\\']"}
  %big = bf16[16,32]{1,0} fusion(%p0), kind=kLoop, calls=%f, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %loop = (s32[], f32[32,32]{1,0}) while(%t), condition=%c, body=%body
}
"""


def test_the_compilers_peak_names_each_buffer_by_its_shape_and_operation():
    from maxperf.aot import peak

    found = peak.parse(LIVE_RANGES, HLO)
    assert (found.live_bytes, found.argument_bytes, found.instruction) == (7168, 2048, 7)
    # the entry's parameter is the state; a tuple element takes its own shape; the largest first
    assert [(b.name, b.shape, b.operation) for b in found.buffers] == [
        ("loop{1}", "f32[32,32]{1,0}", "while"), ("big", "bf16[16,32]{1,0}", "jit(step)/transpose(jvp())/dot_general")]
    assert peak.parse("HloLiveRange (max 0):\n", HLO) is None


def test_the_compilers_peak_leaves_host_memory_out_and_reads_the_module_xla_dumped(tmp_path):
    """An offloading step's live-range report counts the activations copied to host memory (memory space S(5)) at
    its peak: they take no device memory and are counted apart. Buffers that buffer assignment's passes add (the
    offload's dynamic-update-slices) are named in the module XLA dumps beside the report, not in the executable's
    text (Llama 3.1 70B on v6e-32: 45 GiB of host buffers read as device memory, and four of them without a shape)."""
    from maxperf.aot import peak

    report = LIVE_RANGES.replace("    big{}: 1024 bytes", "    big{}: 1024 bytes (cumulative: 7168 bytes)\n"
                                 "    offloaded{}: 8192 bytes")
    module = HLO.replace("  %loop = ", "  %offloaded = bf16[64,32]{1,0:T(8,128)(2,1)S(5)} dynamic-update-slice(%p0)\n"
                                       "  %loop = ")
    (tmp_path / "m.after_optimizations-live-range.txt").write_text(report)
    (tmp_path / "m.after_optimizations.txt").write_text(module)
    found = peak.read(tmp_path, HLO)  # the executable's text lacks `offloaded`; the dumped module has it
    assert (found.live_bytes, found.host_bytes, found.argument_bytes) == (7168, 8192, 2048)
    assert "offloaded" not in [b.name for b in found.buffers]


def test_estimate_memory_prints_what_the_compiler_holds_at_its_peak(tmp_path):
    r = maxperf("--topology", "cpu-4", "--model", "tiny", *TINY)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "compiler's peak" in x)
    assert "GiB live at once: the state and batch" in line
    listed = r.stdout.splitlines()[r.stdout.splitlines().index(line) + 1:]
    assert listed[0].strip().split()[1] == "MiB" and "[" in listed[0]


def test_weights_gathered_whole_come_a_matrix_at_a_time_where_a_layers_worth_would_not_fit():
    """tpu-recipes' GPT-3 175B on v6e-256 (fsdp 256: 48 rows of D a shard, the weights gathered whole) ran in
    production and compiles to 30.10 GiB of the 31.24 GiB libtpu gives a device, one gathered [49152, 12288] matrix
    live at its peak: perfmodel prices that schedule where a layer's worth ahead would not fit, and keeps what the
    layer's worth would need."""
    words = ["per_device_batch_size=3", "ici_fsdp_parallelism=-1", "remat_policy=full", "attention=flash"]
    a = memory_fit.compare("v6e-256", "gpt3-175b", words, analytical_only=True).analytical
    layer, matrix = 12 * 12288**2 * 2, 49152 * 12288 * 2  # q, k, v, o and the MLP's two matrices; the largest
    assert a.fits and a.overlapped_bytes > a.hbm_bytes
    assert a.overlapped_bytes - a.per_device_total_bytes == pytest.approx(layer - matrix, rel=0.01)
    assert abs(a.per_device_total_bytes / (30.10 * 2**30) - 1) <= 0.05
    # where the layer's worth fits, it is counted: the same step at a quarter of the batch
    small = memory_fit.compare("v6e-256", "gpt3-175b", ["per_device_batch_size=1", *words[1:]],
                               analytical_only=True).analytical
    assert small.overlapped_bytes == 0


def test_max_batch_says_which_fraction_fits_where_one_sequence_per_device_does_not(capsys):
    """A 256k-token context split four ways does not fit one sequence per v5p device; half a sequence (two devices a
    sequence, MaxText's fractional per_device_batch_size) does: the search says so beside its 'nothing fits'."""
    from maxperf import cli

    words = ["--topology", "v5p-8", "--model", "llama3.1-8b", "ici_context_parallelism=4",
             "max_target_length=262144"]
    assert cli.main(["estimate-memory", "--analytical-only", "--max-batch", *words]) == 3
    out = capsys.readouterr().out
    assert "no per_device_batch_size fits" in out
    assert "below one sequence per device: per_device_batch_size=0.5 fits by perfmodel" in out
    assert cli.main(["estimate-memory", "--analytical-only", "--max-batch", "--json", *words]) == 3
    assert json.loads(capsys.readouterr().out)["fractional"]["per_device_batch_size"] == 0.5
    assert cli.main(["estimate-memory", "--analytical-only", *words, "per_device_batch_size=0.5"]) == 0


def test_logits_dot_in_fp32_holds_float32_logits_beside_the_compute_dtypes():
    """The compiler's temporaries grow by 4 bytes a logit (llama3-8b, 2 layers, B 4 on v5p-8: 3.57 to 7.51 GiB): the
    analytical memory with them, not the same figure whatever the key says."""
    from maxperf.perfmodel.estimate import estimate
    from maxperf.spec.request import resolve

    words = ["num_layers=2", "per_device_batch_size=4"]
    plain = estimate(resolve("v5p-8", "llama3-8b", words)).memory
    fp32 = estimate(resolve("v5p-8", "llama3-8b", [*words, "logits_dot_in_fp32=true"])).memory
    assert fp32.logits - plain.logits == pytest.approx(4 * 4 * 2048 * 128256, rel=1e-6)


def test_pinned_host_memory_past_the_hosts_is_said():
    """Offloaded activations live in the hosts' memory: 370 GiB a v5p chip (llama3-70b, B 4, L 8192, every
    projection offloaded) is past the 112 GB a chip of a 448 GB 4-chip host has, which a note says; the 70B Trillium
    recipe's 45 GiB a chip is within its 192 GiB."""
    from maxperf.perfmodel.estimate import estimate
    from maxperf.spec.request import resolve

    over = estimate(resolve("v5p-512", "llama3-70b", ["per_device_batch_size=4", "max_target_length=8192",
                                                      "remat_policy=minimal_offloaded"]))
    assert any("passes the 104 GiB of host memory a tpu-v5p chip has" in n for n in over.notes), over.notes
    within = estimate(resolve("v6e-32", "llama3.1-70b", ["per_device_batch_size=2", "max_target_length=8192",
                                                         "remat_policy=custom", "decoder_layer_input=offload",
                                                         "query_proj=offload"]))
    assert within.memory.host_bytes > 0 and not any("host memory" in n for n in within.notes)


def test_loading_a_step_compiled_for_its_peak_leaves_no_dump_behind():
    """A step compiled with its peak read keeps XLA's dump folder in its debug options, and XLA dumps the module there
    again each time the executable is loaded (every `maxperf run`, long after the compile removed the folder):
    loading through peak.load_executable removes what the load wrote, where jax's own loader leaves it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import serialize_executable

    from maxperf.aot import peak

    lowered = jax.jit(lambda x: x @ x + 1).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32))
    compiled, found = peak.compile_with_peak(lowered, {})
    assert found is not None and found.live_bytes > 0
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    [folder] = {Path(m.decode()) for m in peak._DUMP_DIR.findall(payload)}
    assert folder.name.startswith(f"{peak.DUMP_PREFIX}{os.getpid()}-") and not folder.exists()
    backend = jax.devices()[0].client
    loaded = peak.load_executable(payload, in_tree, out_tree, backend=backend, execution_devices=jax.devices()[:1])
    assert not folder.exists()
    assert float(loaded(jnp.ones((64, 64), jnp.float32))[0, 0]) == 65.0
    try:  # what the loader guards against: jax's load writes the dump again
        serialize_executable.deserialize_and_load(payload, in_tree, out_tree, backend=backend,
                                                  execution_devices=jax.devices()[:1])
        assert folder.exists()
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_a_compile_removes_the_dumps_that_killed_compiles_left(tmp_path):
    """A compile killed before it could remove its dump folder (a timeout's SIGKILL) leaves it; the next compile
    removes the folders of processes that have ended, and keeps those of running ones and anything else."""
    from maxperf.aot import artifacts, peak

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{peak.DUMP_PREFIX}{int(ended.stdout)}-abcd_123"
    alive = tmp_path / f"{peak.DUMP_PREFIX}{os.getpid()}-abcd_123"
    other = tmp_path / f"{peak.DUMP_PREFIX}not-a-pid"
    for d in (dead, alive, other):
        d.mkdir()
        (d / "module_0001.jit_step.before_optimizations.txt").write_text("HloModule step")
    assert artifacts.remove_orphaned_temp_dirs(peak.DUMP_PREFIX, tmp_path) == [dead]
    assert not dead.exists() and alive.is_dir() and other.is_dir()
