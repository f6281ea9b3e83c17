"""perfmodel's hardware FLOPs against XLA's cost analysis for small TPU compiles (compile-only v5p devices).

Like with like: with scan_layers=false XLA's `cost_analysis()['flops']` counts every layer (a scanned body would
count once); it counts dots (2 x M x N x K), the recomputation the remat policy leaves in the HLO, and elementwise
work (norms, softmax, the optimizer) at about one FLOP per element per op. perfmodel's hardware FLOPs count the
matmuls as executed (all L x L scores), the remat recomputation and AdamW at OPTIMIZER_FLOPS_PER_PARAM; it leaves
out the other elementwise work. The shape is chosen so that this omission stays small (D = 256, F = 1024: matmuls
are ~97% of the work), and the two must agree within 5%.
"""

import pytest

from maxperf import aot, perfmodel

SHAPE = ["d_model=256", "d_ff=1024", "num_heads=4", "num_kv_heads=2", "head_dim=64", "seq_len=128",
         "per_device_batch_size=2", "scan_layers=false",
         "attention=dot_product"]  # XLA counts no FLOPs inside Pallas kernels (flash)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_hardware_flops_match_xla_cost_analysis(tmp_path, remat):
    result = aot.compile("v5p-8", "tiny", [*SHAPE, f"remat_policy={remat}"], out=tmp_path / remat)
    xla = result.cost["xla_flops_per_device"]
    assert xla, "the TPU compiler gives a cost analysis"
    p = result.plan
    est = perfmodel.estimate(p)
    assert est.hardware_flops_per_device == pytest.approx(xla, rel=0.05)


@pytest.mark.slow
def test_full_remat_adds_the_forward_again_in_both_counts(tmp_path):
    flops = {}
    for remat in ("none", "full"):
        result = aot.compile("v5p-8", "tiny", [*SHAPE, f"remat_policy={remat}"], out=tmp_path / remat)
        p = result.plan
        est = perfmodel.estimate(p)
        flops[remat] = (result.cost["xla_flops_per_device"], est.flops.recompute_flops)
    xla_extra = flops["full"][0] - flops["none"][0]
    assert xla_extra == pytest.approx(flops["full"][1], rel=0.10)


@pytest.mark.slow
def test_a_one_hot_embedding_adds_its_matmul_and_the_tables_gradient_in_both_counts(tmp_path):
    """use_iota_embed (MaxText's): the lookup as a one-hot [tokens, V] by [V, D] matmul, its backward the table's
    gradient alone. A vocabulary of 8192 makes it a fifth of the step's work."""
    flops = {}
    for iota in ("false", "true"):
        words = [*SHAPE, "vocab_size=8192", f"use_iota_embed={iota}"]
        result = aot.compile("v5p-8", "tiny", words, out=tmp_path / iota)
        est = perfmodel.estimate(result.plan)
        flops[iota] = (result.cost["xla_flops_per_device"], est.hardware_flops_per_device, est.flops.embedding_flops)
    tokens, V, D = 2 * 128, 8192, 256
    assert flops["true"][2] == 4 * tokens * V * D
    assert flops["true"][0] - flops["false"][0] == pytest.approx(flops["true"][2], rel=0.05)
    assert flops["true"][1] - flops["false"][1] == flops["true"][2]
