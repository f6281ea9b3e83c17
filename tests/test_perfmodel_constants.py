"""perfmodel's TPU/GPU constants: each chip's sustained matmul rate and the fitted rates it scales, where every
constant comes from, and the assumptions an estimate names; XLA:CPU keeps its own terms (perfmodel.cpu)."""

import argparse
import json
import math
from dataclasses import replace

import pytest
from bench_util import BENCH, bench_module
from perfmodel_util import Topo
from test_perfmodel_chips import CAL

from maxperf.perfmodel import calibration, chips, estimate, work
from maxperf.spec import presets
from maxperf.spec.request import Request
from maxperf.spec.train import TrainConfig

LLAMA = presets.get("llama2-7b")
TRAIN = TrainConfig(per_device_batch_size=2, seq_len=2048)


def v5p(chips_, torus=(4, 4, 4)):
    return Topo("tpu-v5p", chips_, hosts=chips_ // 4, torus=torus)


def test_every_accelerator_has_a_sustained_matmul_fraction_that_says_where_it_comes_from():
    accelerators = {name for name, chip in chips.CHIPS.items() if chip.kind != "cpu"}
    assert set(chips.MATMUL_FRACTION) == set(chips.MATMUL_FRACTION_ORIGIN) == accelerators
    assert {name for name, origin in chips.MATMUL_FRACTION_ORIGIN.items() if origin == "fitted"} == {
        "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu7x", "a100-40gb", "a100-80gb", "h100-sxm"}  # the chips with rows
    # H100 SXM sustains a smaller share of its datasheet peak than A100 (MaxText and MPT measured 37-50% MFU)
    shipped = work.SHIPPED
    assert shipped.fraction(chips.get("h100-sxm")) < shipped.fraction(chips.get("a100-40gb"))
    assert shipped.fraction(chips.get("cpu")) == 1.0  # calibrated CPU peaks are achieved rates


def test_an_h100_matmul_runs_at_the_chips_sustained_fraction_of_peak():
    e = estimate(Request.of(Topo("h100-sxm", 8, 8), LLAMA, TRAIN, {"fsdp": 8}, {}))
    row = next(r for r in e.breakdown if r.name == "mlp down")
    # T = 2 x 2048 tokens, D 4096, F 11008: each of the three matmuls' smallest side is 4096; a GPU's HALF whole
    half = work.MATMUL_HALF["gpu"]
    assert row.kind == "compute"
    assert row.seconds == pytest.approx(row.flops / (989e12 * chips.MATMUL_FRACTION["h100-sxm"] * 4096 / (4096 + half)),
                                        rel=1e-12)


def test_a_gpus_half_scales_with_its_flops_per_hbm_byte():
    """The same matmul on an A100 80GB: H100 SXM's HALF scaled by the A100's FLOPs per HBM byte over the H100's
    (312 / 2.039 against 989 / 3.35: about half), at the A100's own fraction."""
    e = estimate(Request.of(Topo("a100-80gb", 8, 8), LLAMA, TRAIN, {"fsdp": 8}, {}))
    row = next(r for r in e.breakdown if r.name == "mlp down")
    half = work.MATMUL_HALF["gpu"] * (312e12 / 2039e9) / (989e12 / 3.35e12)
    assert work.half_scale(chips.get("a100-80gb")) == pytest.approx(0.518, abs=0.001)
    rate = 312e12 * chips.MATMUL_FRACTION["a100-80gb"] * 4096 / (4096 + half)
    assert row.seconds == pytest.approx(row.flops / rate, rel=1e-12)
    # and what serving and the HLO reading ask of the law is the same
    assert work.matmul_efficiency(chips.get("a100-80gb"), 4096) == pytest.approx(
        chips.MATMUL_FRACTION["a100-80gb"] * 4096 / (4096 + half), rel=1e-12)


def test_flash_attention_runs_at_its_fraction_of_the_sustained_matmul_rate():
    e = estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 64}, {}))
    row = next(r for r in e.breakdown if r.name == "attention (flash kernel)")
    rate = 459e12 * chips.MATMUL_FRACTION["tpu-v5p"] * work.FLASH_EFFICIENCY["tpu"]  # Dh 128 fills v5p's units
    assert row.seconds == pytest.approx(row.flops / rate, rel=1e-12)
    # on a 256-wide TPU a head dim of 128 fills half the matrix units: the kernel takes twice as long a FLOP
    wide = estimate(Request.of(Topo("tpu-v6e", 64, torus=(8, 8)), LLAMA, TRAIN, {"fsdp": 64}, {}))
    row = next(r for r in wide.breakdown if r.name == "attention (flash kernel)")
    rate = 918e12 * chips.MATMUL_FRACTION["tpu-v6e"] * work.FLASH_EFFICIENCY["tpu"] / 2
    assert row.seconds == pytest.approx(row.flops / rate, rel=1e-12)


def test_splash_backward_computes_the_pairs_of_its_own_tiles():
    # causal over 2,048 tokens: the forward's 512 x 512 tiles compute 10 of their 16; the split backward's dK/dV
    # kernel (4 matmuls a pair) 3 of 4 tiles of 1024 x 1024, its dQ kernel (3 matmuls) 36 of 64 tiles of 256 x 256
    fwd, dkv, dq = 10 * 512**2, 3 * 1024**2, 36 * 256**2
    train = TrainConfig(per_device_batch_size=2, seq_len=2048, remat_policy="none", attention="flash",
                        sa_block_q_dkv=1024, sa_block_kv_dkv=1024, sa_block_q_dq=256, sa_block_kv_dq=256)
    per_pair = 2 * 32 * 32 * (128 + 128)  # B x H x layers x (Dq + Dv): 2 Dh FLOPs a pair in each matmul

    def flash_flops(t):
        e = estimate(Request.of(v5p(64), LLAMA, t, {"fsdp": 64}, {}))
        return next(r for r in e.breakdown if r.name == "attention (flash kernel)").flops

    assert flash_flops(train) == per_pair * (2 * fwd + 4 * dkv + 3 * dq)
    # the fused backward is one kernel of 5 matmuls over the dK/dV tiles
    assert flash_flops(replace(train, sa_use_fused_bwd_kernel=True)) == per_pair * (2 * fwd + 5 * dkv)


def test_accelerators_fuse_elementwise_passes_that_xla_cpu_runs_on_their_own():
    model, train = presets.get("tiny"), TrainConfig(per_device_batch_size=2, seq_len=256)
    cpu_row, tpu_row = (next(r for r in estimate(Request.of(topo, model, train, {"fsdp": n}, {})).breakdown
                             if r.name == "norms, residuals, activations")
                        for n, topo in ((2, Topo("cpu", 2, 2)), (4, Topo("tpu-v5p", 4, 4, torus=(2, 2, 1)))))
    # per token and layer, bf16: passes x D 64 + 3 x F 128, and rope over 4 + 2 heads of 16 (read and write)
    rope = 2 * 2 * 6 * 16
    assert cpu_row.bytes / tpu_row.bytes == pytest.approx((2 * (18 * 64 + 3 * 128) + rope)
                                                          / (2 * (2.7 * 64 + 3 * 128) + rope), rel=1e-12)


def test_an_estimate_names_the_fitted_and_assumed_constants_it_rests_on():
    e = estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 16, "tensor": 4}, {}))
    shipped = work.SHIPPED
    assert e.assumptions == (
        f"matmuls at {chips.MATMUL_FRACTION['tpu-v5p']:.2f} of peak (fitted) x m / "
        f"(m + {work.MATMUL_HALF['tpu']:.0f}), "
        "m a matmul's smallest side (HALF read from Ironwood's GEMM sweep), x the share of its 128-wide matrix units a "
        "matmul fills",
        f"flash attention at {work.FLASH_EFFICIENCY['tpu']:.2f} of the matmul rate (fitted)",
        f"{work.ELEMENTWISE_D_PASSES:g} elementwise HBM passes over D per token and layer (fitted), 3 over F (assumed)",
        f"fsdp collectives {work.Overlap().fsdp:.0%} hidden (fitted)",
        "5 us per collective inside a slice or NVLink domain (assumed), "
        f"{shipped.dcn_step_latency['tpu'] * 1e6:g} us per step of its ring across (fitted)",
        "tensor collectives 99% hidden (fitted)",
    )
    assert json.loads(json.dumps(e.as_dict()))["assumptions"] == list(e.assumptions)
    given = estimate(Request.of(v5p(64), LLAMA, TRAIN, {"fsdp": 64}, {}), overlap=0.3).assumptions
    assert "fsdp collectives 30% hidden (as given)" in given
    h200 = estimate(Request.of(Topo("h200", 16, 8, hosts=2), LLAMA, TRAIN, {"data": 2, "fsdp": 8},
                               {"data": 2})).assumptions
    # H200 is H100 SXM's compute (chips.SAME_COMPUTE): its fraction, not fitted on a row of its own
    # and its HALF is H100's scaled by its FLOPs per HBM byte (989 / 4.8 against 989 / 3.35)
    assert h200[0].startswith(f"matmuls at {chips.MATMUL_FRACTION['h100-sxm']:.2f} of peak (assumed) x m / "
                              f"(m + {work.MATMUL_HALF['gpu'] * 3.35 / 4.8:.0f}), m a matmul's smallest side (HALF "
                              "fitted on H100 SXM, x 0.70 for this chip's FLOPs per HBM byte)")
    assert "data collectives 0% hidden (fitted)" in h200


def test_a_chip_without_rows_takes_the_rate_of_a_chip_of_its_compute_before_the_rule():
    """H200 takes H100 SXM's fitted fraction, and either A100 SXM4 part the other's (one GA100 at the same clocks and
    power, chips.SAME_COMPUTE); a GPU with no such chip fitted takes its measured GEMM rate times the fitted GPUs'
    mean of fitted over measured; a TPU the mean of the fitted TPUs driving as many TensorCores a device."""
    fitted = {"a100-40gb": 0.79, "h100-sxm": 0.64, "tpu-v5e": 0.99, "tpu7x": 0.97, "tpu-v5p": 0.88}
    assert chips.fraction_without_rows("a100-80gb", fitted) == 0.79
    assert chips.fraction_without_rows("h200", fitted) == 0.64
    assert chips.fraction_without_rows("a100-40gb", {"a100-80gb": 0.86}) == 0.86
    ratio = (0.79 / chips.MEASURED_MATMUL["a100-40gb"] + 0.64 / chips.MEASURED_MATMUL["h100-sxm"]) / 2
    assert chips.fraction_without_rows("b200", fitted) == pytest.approx(chips.MEASURED_MATMUL["b200"] * ratio)
    assert chips.fraction_without_rows("tpu-v6e", fitted) == pytest.approx((0.99 + 0.97) / 2)


def test_cpu_estimates_name_only_what_calibrate_did_not_measure():
    model, train = presets.get("tiny"), TrainConfig(per_device_batch_size=2, seq_len=128)
    bare = estimate(Request.of(Topo("cpu", 2, 2), model, train, {"fsdp": 2}, {}))
    assert bare.assumptions == ("matmul HALF 32 (assumed: maxperf calibrate measures it)",)
    thin = [calibration.MatmulSample("bfloat16", 1024, 8e11 * m / (m + 48), thin=m, side=side)
            for m in (16, 64, 256) for side in ("m", "k", "n")]
    cal = calibration.Calibration(matmul=(calibration.MatmulSample("bfloat16", 1024, 8e11), *thin), **CAL)
    assert estimate(Request.of(Topo("cpu", 2, 2), model, train, {"fsdp": 2}, {}), calibration=cal).assumptions == ()


def test_maxperf_estimate_prints_its_assumptions(capsys):
    from maxperf.cli.estimate import cmd_estimate

    args = argparse.Namespace(topology="v5p-8", model="tiny", overrides=["seq_len=256"], num_slices=1, overlap=None,
                              json=False)
    assert cmd_estimate(args) == 0
    out = capsys.readouterr().out
    assert (f"\n  assumptions:     matmuls at {chips.MATMUL_FRACTION['tpu-v5p']:.2f} of peak (fitted) x m / "
            f"(m + {work.MATMUL_HALF['tpu']:.0f})") in out
    # a tiny step's compute cannot hide its collectives: the line says the share applied beside the fitted one
    line = next(x for x in out.splitlines() if "fsdp collectives" in x).strip()
    assert line.startswith(f"fsdp collectives {work.Overlap().fsdp:.0%} hidden (fitted), ")
    assert line.endswith("% here: the compute beside them runs out")
    held_out = work.HELD_OUT_ERROR["source"][0]
    assert (f"\n  uncertainty      +-{held_out:.0%}: each source's published runs predicted by constants fitted "
            "without them") in out


def test_no_matmul_runs_faster_than_the_chips_best_measured_one():
    """Ironwood's published GEMM sweep levels off at 0.829 of a TensorCore's peak (956.4 TFLOP/s at 32768 cubed),
    where the law fitted on steps would keep rising; v6e's 8192-cubed GEMM ran at 0.901, and no faster than its
    4096-cubed one. Thinner matmuls stay on the law below it, and a chip without a published measurement has no cap."""
    ironwood, v6e, v5p_chip = chips.get("tpu7x"), chips.get("tpu-v6e"), chips.get("tpu-v5p")
    assert chips.MEASURED_MATMUL["tpu7x"] == pytest.approx(956.4 / (2307 / 2), abs=5e-4)
    assert work.matmul_efficiency(ironwood, 32768) == chips.MEASURED_MATMUL["tpu7x"]
    half = work.MATMUL_HALF["tpu"] * work.half_scale(ironwood)
    law = work.SHIPPED.fraction(ironwood) * 2048 / (2048 + half)
    assert law < chips.MEASURED_MATMUL["tpu7x"] and work.matmul_efficiency(ironwood, 2048, half) == pytest.approx(law)
    # v6e's GEMM gains nothing from 4096 to 8192 (chips.GEMM_SWEEPS): wider matmuls run at the 4096-wide one's rate,
    # below its ceiling, where the law would give a 16384-wide one 22% more
    assert chips.matmul_plateau(v6e) == 4096
    at_4096 = work.matmul_efficiency(v6e, 4096)
    assert work.matmul_efficiency(v6e, 16384) == work.matmul_efficiency(v6e, 8192) == at_4096
    assert at_4096 < chips.MEASURED_MATMUL["tpu-v6e"]
    assert work.matmul_efficiency(v6e, 2048) < at_4096
    # Ironwood's gains up to 16384, past the width where its ceiling stops the law; a chip without a sweep has none
    assert chips.matmul_plateau(ironwood) == 16384 and chips.matmul_plateau(v5p_chip) == math.inf
    v5p_law = work.SHIPPED.fraction(v5p_chip) * 32768 / (32768 + work.MATMUL_HALF["tpu"])
    assert work.matmul_efficiency(v5p_chip, 32768) == pytest.approx(v5p_law)
    # the step prices its matmuls so: Llama 3.1 405B's MLP (smallest side 16384) on a TPU7x slice runs at the cap
    e = estimate(Request.of(Topo("tpu7x", 64, 4, hosts=16, torus=(4, 4, 4)), presets.get("llama3.1-405b"),
                            TrainConfig(per_device_batch_size=2, seq_len=8192), {"fsdp": 64}, {}))
    row = next(r for r in e.breakdown if r.name == "mlp down")
    T = 2 * 8192
    flops = 3 * 2 * T * 16384 * 53248 * 126  # forward and the two backward matmuls of each layer
    assert row.seconds == pytest.approx(flops / (ironwood.peak_bf16_flops * chips.MEASURED_MATMUL["tpu7x"]), rel=1e-6)


# Google's Ironwood GEMM sweep, bf16 m = n = k, TFLOP/s per device (one TensorCore: 1153.5 peak): tpu-recipes
# microbenchmarks/ironwood/README.md, "Results: GEMM"
IRONWOOD_GEMM = chips.GEMM_SWEEPS["tpu7x"]


def test_the_thin_matmul_law_follows_ironwoods_measured_gemms():
    """The law (HALF at a 128-wide array, read from the 2048- and 4096-cubed GEMMs and doubled for TPU7x's 256-wide
    units; TPU7x's fraction, fitted on training steps; the 32768-cubed GEMM as its ceiling) against the measured cubes:
    within 5% from 2048 to 32768 (the training rows' own fit of HALF, 640, was so too). At 1024 the cube is 2 GFLOP,
    a few microseconds, where the kernel's start and end are most of the time: the law, made for a step's long
    matmuls, is above it there (the figure is stated so, not matched)."""
    ironwood = chips.get("tpu7x")
    half = work.MATMUL_HALF["tpu"] * work.half_scale(ironwood)
    per_device = ironwood.peak_bf16_flops / 2  # a chip's two TensorCores, one JAX device each
    for m, measured in IRONWOOD_GEMM.items():
        law, rate = work.matmul_efficiency(ironwood, m, half), measured * 1e12 / per_device
        if m >= 2048:
            assert law == pytest.approx(rate, rel=0.05), (m, law, rate)
        else:
            assert 1.2 < law / rate < 1.6, (m, law, rate)


def test_the_tpu_half_is_read_from_ironwoods_sweep(monkeypatch):
    """The TPU's HALF is not fitted on the training rows: it is the HALF that puts the law nearest Ironwood's GEMM
    sweep, from its sizes between the kernels' start-up and the plateau (2048 and 4096). A sweep made by the law at
    another HALF gives that HALF back; the real one gives 638, where the training rows' fit had given 640."""
    assert work.MATMUL_HALF["tpu"] == work.SHIPPED.matmul_half["tpu"] == work.half_from_sweep("tpu7x") == 638
    ironwood = chips.get("tpu7x")
    per_device = ironwood.peak_bf16_flops / chips.SWEEP_DEVICES_PER_CHIP["tpu7x"]
    fraction = chips.MATMUL_FRACTION["tpu7x"]
    law = {m: fraction * m / (m + 420 * work.half_scale(ironwood)) * per_device / 1e12 for m in (2048, 4096)}
    # the 1024 cube (its start-up) and the plateau's sizes do not move it
    made = {1024: 349.7270639, **law, 16384: 950.1286983, 32768: 956.3824592}
    monkeypatch.setitem(work.GEMM_SWEEPS, "tpu7x", made)
    assert work.half_from_sweep("tpu7x") == 420
    monkeypatch.setitem(work.GEMM_SWEEPS, "tpu7x", {1024: 349.7270639, 16384: 950.1286983, 32768: 956.3824592})
    with pytest.raises(Exception, match="no size between"):
        work.half_from_sweep("tpu7x")


@pytest.mark.parametrize("chip, speedup", [("h100-sxm", work.CUDNN_FLASH_SPEEDUP), ("h200", work.CUDNN_FLASH_SPEEDUP),
                                           ("a100-80gb", 1.0), ("b200", 1.0)])
def test_cudnn_attention_runs_at_its_measured_rate_over_the_flash_kernels_on_hopper(chip, speedup):
    """MaxText's attention=cudnn_flash_te is priced as cuDNN's kernel: on H100 and H200 at the FlashAttention-3
    paper's measured 1.6x of the FlashAttention-2 class the flash rate is fitted on; where no such measurement
    exists (A100, Blackwell), at the flash rate. The FLOPs are the same; the estimate names the speedup."""
    assert 1.5 <= work.CUDNN_FLASH_SPEEDUP <= 1.7  # the paper's 1.57-1.70

    def attention(kernel):
        train = TrainConfig(per_device_batch_size=2, seq_len=4096, attention=kernel)
        e = estimate(Request.of(Topo(chip, 8, 8), LLAMA, train, {"fsdp": 8}, {}))
        return next(r for r in e.breakdown if r.name == "attention (flash kernel)"), e.assumptions

    (flash, _), (cudnn, assumed) = attention("flash"), attention("cudnn_flash_te")
    assert cudnn.flops == flash.flops
    assert flash.seconds / cudnn.seconds == pytest.approx(speedup, rel=1e-9)
    assert any("cuDNN" in a for a in assumed) == (speedup != 1.0)


def test_cudnn_speedup_is_what_an_h200_measured():
    """The H200 measurements of bench/measured/h200_attention.json: cuDNN's fused attention ran within 10% of
    CUDNN_FLASH_SPEEDUP times maxperf's Pallas Triton kernel (the FlashAttention-2 class) at every length both were
    timed at, forward + backward; and both kernels' rates follow rate_inf x L / (L + half) within 6%, the law the
    model's comment states (half 1,160 and 890 tokens), rising with the sequence."""
    with bench_module("gpu_attention") as bench:
        rows = json.loads((BENCH / "measured" / "h200_attention.json").read_text())
        fits = bench.fit_length_law(rows)
        assert all(bench.valid_row(r) and r["device"] == "NVIDIA H200" for r in rows)
    time = {(r["kernel"], r["shape"]): r["forward_backward_s"] for r in rows if "forward_backward_s" in r}
    both = [shape for kernel, shape in time if kernel == "pallas" and ("cudnn", shape) in time]
    assert len(both) == 3
    ratios = [time["pallas", s] / time["cudnn", s] for s in both]
    assert all(abs(r / work.CUDNN_FLASH_SPEEDUP - 1) < 0.1 for r in ratios), ratios
    assert (fits["cudnn"]["half_length"], fits["pallas"]["half_length"]) == (1160, 890)
    assert fits["cudnn"]["worst"] < 0.06 and fits["pallas"]["worst"] < 0.06 and fits["cudnn"]["rows"] == 8


def test_flash_kernels_keep_more_of_an_a100_than_of_an_h100_as_flashattention2_was_measured():
    """chips.flash_architecture: FlashAttention-2's published forward + backward rates (2k to 8k tokens, causal,
    head dim 128) over each chip's best matmul, the A100's over the H100's, 1.71x to 1.73x: the flash kernels of an
    A100 step run that much faster than the H100-referenced flash rate (FLASH_EFFICIENCY) gives them; the H100, the
    H200 (its compute) and the chips no such figure measures at 1; the 40 GB A100 as the 80 GB one (one GA100)."""
    a100 = chips.get("a100-80gb")
    factor = chips.flash_architecture(a100)
    by_hand = [(a / (chips.MEASURED_MATMUL["a100-80gb"] * 312)) / (h / (chips.MEASURED_MATMUL["h100-sxm"] * 989.4))
               for a, h in ((155, 265), (173, 294), (182, 308))]
    assert factor == pytest.approx(sum(by_hand) / 3, rel=1e-3) and 1.71 < factor < 1.74
    assert chips.flash_architecture(chips.get("a100-40gb")) == factor
    unmeasured = ("h100-sxm", "h200", "b200", "gb200", "tpu-v5p")
    assert [chips.flash_architecture(chips.get(n)) for n in unmeasured] == [1.0] * 5

    def attention(chip, kernel="flash"):
        train = TrainConfig(per_device_batch_size=2, seq_len=4096, attention=kernel)
        e = estimate(Request.of(Topo(chip, 8, 8), LLAMA, train, {"fsdp": 8}, {}))
        row = next(r for r in e.breakdown if r.name == "attention (flash kernel)")
        return row.flops / row.seconds, e.assumptions

    for name, speedup in (("a100-80gb", factor), ("h100-sxm", 1.0)):
        chip = chips.get(name)
        rate, assumed = attention(name)
        fitted = chip.peak_bf16_flops * work.SHIPPED.fraction(chip) * work.FLASH_EFFICIENCY["gpu"]
        assert rate == pytest.approx(fitted * speedup, rel=1e-6)
        assert any("FlashAttention-2 paper" in a for a in assumed) == (speedup != 1.0)
    # cuDNN's kernel on an A100 runs the same instructions: FlashAttention-2's rate there, not Hopper's 1.6x
    assert attention("a100-80gb", "cudnn_flash_te")[0] == pytest.approx(attention("a100-80gb")[0], rel=1e-9)
