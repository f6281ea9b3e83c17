"""`maxperf plan`: the enumeration and its pruning, pins, the ranking against a brute-force grid, the memory margin,
no fit (exit 3 with the closest miss), plan.json, verification by real compiles, the report page, and bad input."""

import csv
import json
import math
import re
from pathlib import Path

import pytest
from reports_browser import CHROMIUM, check_in_chromium

from maxperf import perfmodel
from maxperf.cli import main
from maxperf.reports.plan import pareto
from maxperf.reports.render import render
from maxperf.search import candidates, commands, margin, plan, verify
from maxperf.spec import presets
from maxperf.spec.logical_axes import MESH_AXES, undivided_axes
from maxperf.spec.mesh import Mesh
from maxperf.spec.params import param_arrays
from maxperf.spec.request import Request, resolve

TINY = plan.PlanRequest("tiny", "cpu-8", per_device_batch=1, pins=("seq_len=64",))


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny():
    return plan.search(TINY)


def test_factorizations_are_every_ordered_split_once():
    found = candidates.factorizations(8, 6)
    assert len(found) == math.comb(3 + 5, 5)  # 2^3 over 6 axes: stars and bars
    assert len(set(found)) == len(found) and all(math.prod(f) == 8 for f in found)


def test_enumeration_counts_on_cpu_8(tiny):
    # 56 meshes over 8 devices; tiny has H=4, K=2, no experts: tensor must be 1 or 2 and expert 1, which leaves
    # 35 - 5 = 30 meshes (tensor=4: 4 ways, tensor=8: 1), each with 11 remat policies x 2 kernels x one batch; the
    # 26 meshes that do not divide are never enumerated
    d = tiny.as_dict()["counts"]
    assert d["enumerated"] == len(tiny.candidates) == 30 * 22 and d["indivisible"] == 0
    assert all(c.axes["tensor"] in (1, 2) and c.axes["expert"] == 1 for c in tiny.candidates)


def _indivisible(model, seq_len: int, axes: dict[str, int], rows: int) -> bool:
    """What the enumeration must never produce, checked on the whole mesh: an axis that does not divide E (1 for a
    dense model), H and K, L, a microbatch's rows or any dimension of a weight or activation it shards."""
    experts = model.num_experts if model.is_moe else 1
    arrays = [(x.shape, x.logical) for x in param_arrays(model)] + [
        ((model.num_heads,), ("activation_heads",)), ((model.num_kv_heads,), ("activation_kv_heads",)),
        ((model.d_ff,), ("activation_mlp",)), ((model.vocab_size,), ("activation_vocab",))]
    return bool(experts % axes["expert"] or model.num_heads % axes["tensor"] or model.num_kv_heads % axes["tensor"]
                or seq_len % axes["sequence"] or rows % candidates.batch_axes(axes)
                or any(undivided_axes(shape, logical, axes) for shape, logical in arrays))


@pytest.mark.parametrize("model, topology, slices, batch, pins", [
    ("tiny", "cpu-8", 1, None, ("seq_len=64",)),
    ("tiny-moe", "cpu-8", 1, None, ("seq_len=64",)),
    ("tiny-mla", "cpu-8", 1, None, ("seq_len=64",)),
    ("tiny", "v5e-4", 2, 8 * 64, ("seq_len=64", "dcn_tensor=2")),
    ("llama3-70b", "v5p-256", 1, None, ()),
    ("mixtral-8x7b", "v5p-64", 1, 256 * 4096, ()),
    ("deepseek-v2-lite", "v5p-16", 2, None, ()),
])
def test_the_enumeration_is_every_factorization_that_divides_and_no_other(model, topology, slices, batch, pins):
    space = candidates.space(model, topology, num_slices=slices, pins=pins,
                             global_batch_tokens=None if batch is None else batch)
    topo, m, seq_len = space.topology, space.model, space.train.seq_len
    devices = topo.num_devices
    # every (ici, dcn) factorization in order, filtered afterwards by the whole-mesh rules
    pinned_dcn = {a: 1 for a in MESH_AXES if a not in candidates.DCN_SEARCHED}
    pinned_dcn |= {k.removeprefix("dcn_").split("=")[0]: int(k.split("=")[1]) for k in pins if k.startswith("dcn_")}
    dcns = [d for d in candidates.factorizations(topo.ici_domains, len(MESH_AXES))
            if all(d[MESH_AXES.index(a)] == n for a, n in pinned_dcn.items())]
    expected = []
    for ici in candidates.factorizations(topo.devices_per_ici_domain, len(MESH_AXES)):
        if ici[MESH_AXES.index("stage")] != 1:  # pipeline stages only where pinned
            continue
        for dcn in dcns:
            axes = {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn)}
            pairs = [(b, a) for b, a in space.pairs if not _indivisible(m, seq_len, axes, round(b * devices))]
            expected += [(ici, dcn, p) for p in pairs]
    found = [(tuple(c.ici.values()), tuple(c.dcn.values()), (b, a)) for c in space.meshes for b, a in c.pairs]
    assert found == expected and found
    for c in space.candidates:  # and none of them is indivisible
        assert not _indivisible(m, seq_len, c.axes, round(c.per_device_batch_size * devices))
    if not m.is_moe:  # a dense model's expert axis is never anything but 1
        assert {c.axes["expert"] for c in space.candidates} == {1}


def test_pins_fix_what_they_name(tiny):
    pinned = plan.search(plan.PlanRequest("tiny", "cpu-8", per_device_batch=1,
                                          pins=("seq_len=64", "ici_tensor_parallelism=2", "remat_policy=full")))
    assert pinned.candidates and all(c.ici["tensor"] == 2 and c.remat_policy == "full" for c in pinned.candidates)
    # with tensor=2 the other 4 devices spread over five axes, expert pruned: 4 x 2 ways... counted directly
    assert len(pinned.candidates) == sum(1 for c in tiny.candidates if c.ici["tensor"] == 2
                                         and c.remat_policy == "full")
    assert pinned.fixed == ("seq_len=64",)


def test_the_winner_is_as_good_as_a_brute_force_grid_through_plan():
    req = plan.PlanRequest("tiny", "cpu-8", global_batch_tokens=16 * 64, pins=("seq_len=64", "attention=flash"))
    result = plan.search(req)
    best = None
    hbm, factor = result.hbm_bytes, 1 + result.margin.value
    for c in result.candidates:  # every candidate through resolve() and estimate(), no ordering shortcut
        p = resolve("cpu-8", "tiny", ["seq_len=64", *c.overrides()])
        assert p.mesh.ici == c.ici and p.mesh.dcn == c.dcn
        est = perfmodel.estimate(p)
        if est.memory_per_device_bytes * factor <= hbm and (best is None or est.tokens_per_s > best):
            best = est.tokens_per_s
        if c.step_time_s:  # where the search estimated, it agrees with resolve() + estimate() exactly
            assert c.step_time_s == est.step_time_s and c.memory_bytes == est.memory_per_device_bytes
    assert result.winner.tokens_per_s == pytest.approx(best, rel=1e-12)
    ranked = [c.tokens_per_s for c in result.fitting]
    assert ranked == sorted(ranked, reverse=True) and result.candidates[0] is result.winner


def test_the_margin_comes_from_measured_error(tmp_path):
    path = tmp_path / "memory_error.json"
    # the margin is the largest underestimate (compiler over analytical), not the largest error either way: an
    # over-estimate as large as kimi-k2's +48% needs no margin
    path.write_text(json.dumps({"tpu": {"median": 0.05, "worst": 0.48, "worst_underestimate": 0.21, "cases": 7},
                                "cpu": {"median": 0.05, "worst": 0.3, "worst_underestimate": -0.02, "cases": 3}}))
    tpu = margin.load_margin("tpu", path)
    assert tpu.value == pytest.approx(0.21) and "7 cases" in tpu.source and path.name in tpu.source
    assert margin.load_margin("cpu", path).value == 0.0
    gpu = margin.load_margin("gpu", path)
    assert gpu.value == pytest.approx(0.21) and "no gpu figure" in gpu.source
    assert margin.load_margin("tpu", path, chip="tpu-v5p").value == pytest.approx(0.21)
    path.write_text(json.dumps({"tpu": {"median": 0.05, "worst": 0.48, "worst_underestimate": 0.21, "cases": 7},
                                "tpu7x": {"median": 0.1, "worst": 0.2, "worst_underestimate": 0.18, "cases": 6}}))
    own = margin.load_margin("tpu", path, chip="tpu7x")  # a generation measured apart takes its own figure
    assert own.value == pytest.approx(0.18) and "tpu7x" in own.source and "6 cases" in own.source
    missing = margin.load_margin("tpu", tmp_path / "absent.json")
    assert missing.value == margin.FALLBACK_MARGIN and "not found" in missing.source
    # the GPU grid is of mixtures of experts: its figure is theirs, a dense step's margin is carried over as before
    path.write_text(json.dumps({"tpu": {"median": 0.05, "worst": 0.15, "worst_underestimate": 0.12, "cases": 7},
                                "gpu moe": {"median": 0.03, "worst": 0.22, "worst_underestimate": 0.29, "cases": 19}}))
    assert margin.load_margin("gpu", path, moe=True).value == pytest.approx(0.29)
    assert margin.load_margin("gpu", path).value == pytest.approx(0.12)
    assert margin.measured_error("gpu", "h100-sxm", path, moe=True).under == pytest.approx(0.29)
    assert margin.measured_error("gpu", "h100-sxm", path) is None


def test_a_candidate_fits_only_with_the_margin_to_spare(tiny):
    result = plan.search(plan.PlanRequest("tiny", "cpu-8", per_device_batch=1,
                                          pins=("seq_len=64", "remat_policy=none", "attention=dot_product")))
    memory = sorted(c.memory_bytes for c in result.candidates)
    # an HBM between the smallest and largest need, with the margin: those above it do not fit
    result.hbm_bytes = memory[len(memory) // 2] * (1 + result.margin.value)
    plan.rank(result)
    factor = 1 + result.margin.value
    assert all(c.memory_bytes * factor <= result.hbm_bytes for c in result.fitting)
    missed = [c for c in result.candidates if c.status == "does not fit"]
    assert missed and all(c.memory_bytes * factor > result.hbm_bytes for c in missed)


def test_a_compiler_no_fit_drops_the_candidate_and_the_next_is_chosen(tiny):
    result = plan.search(TINY)
    first, second = result.fitting[:2]
    first.verified, first.compiler_memory_bytes = False, 2 * result.hbm_bytes
    second.verified, second.compiler_memory_bytes = True, 1e6
    plan.rank(result)
    assert first.status == "does not fit" and first.reason.startswith("compiler:")
    assert result.winner is second and second.memory_shown_bytes() == 1e6
    second.verified, second.compile_error = False, "compile failed: ValueError: bad"
    plan.rank(result)
    assert second.status == "compile failed" and result.candidates[-1] is second
    assert result.winner is result.fitting[0] and result.winner.verified is None


def test_a_mesh_whose_state_alone_does_not_fit_is_left_out_whole_and_fits_at_no_batch():
    result = plan.search(plan.PlanRequest("llama3-8b", "v5p-8", per_device_batch=1))
    assert result.pruned and result.fitting
    left_out = sum(p["candidates"] for p in result.pruned)
    n = result.counts()
    assert n["enumerated"] == len(result.candidates) + left_out and n["state_does_not_fit"] == left_out
    assert not any(c.reason.startswith(plan.STATE_ALONE) for c in result.candidates)
    factor = 1 + result.margin.value
    for p in result.pruned:
        assert p["reason"].startswith(plan.STATE_ALONE) and p["candidates"] > 0
        # the least memory any of its candidates could need, the whole estimate with the policy that keeps least
        words = [f"ici_{a}={k}" for a, k in p["ici"].items()] + [
            "remat_policy=full", f"attention={p['attention']}", "per_device_batch_size=1"]
        memory = perfmodel.estimate(resolve("v5p-8", "llama3-8b", words)).memory
        assert memory.per_device_total_bytes * factor > result.hbm_bytes
        state = memory.params + memory.optimizer + memory.optimizer_staged
        assert f"{state / (1 << 30):.2f} GiB a device" in p["reason"]
    # the meshes kept are those whose state fits
    kept = {c.mesh_shown() for c in result.candidates}
    assert not kept & {p["mesh"] for p in result.pruned}


def test_where_every_mesh_is_pruned_the_closest_miss_needs_the_least_memory_of_its_mesh():
    result = plan.search(plan.PlanRequest("deepseek-v2-lite", "v5e-8", per_device_batch=1))
    assert result.winner is None and len(result.candidates) == 1 and result.pruned
    miss = result.closest_miss["candidate"]
    # the policy that keeps least, with the flash kernel, on the same mesh: the closest miss needs no more
    words = [f"ici_{a}={n}" for a, n in miss["ici"].items()] + [
        "remat_policy=full", "attention=flash", "per_device_batch_size=1"]
    least = perfmodel.estimate(resolve("v5e-8", "deepseek-v2-lite", words)).memory_per_device_bytes
    assert miss["analytical_memory_bytes"] <= least


def test_no_fit_exits_3_with_the_closest_miss(capsys, tmp_path):
    code, out, err = run_main(capsys, "plan", "--model", "llama3-70b", "--topology", "v5p-8", "--verify", "0",
                              "--out", str(tmp_path / "p"))
    assert code == 3, err
    assert "no candidate fits. closest:" in err and "more chips" in err and "offload" in err and "seq_len" in err
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    miss = doc["closest_miss"]
    assert doc["chosen"] is None and miss["memory_with_margin_bytes"] > miss["hbm_bytes"]
    assert len(miss["would_need"]) == 3
    # the closest miss needs the least memory of every candidate estimated: here every mesh's state alone is over
    # HBM, so the one with the least state is estimated whole, and it is the one candidate listed
    needs = [c["analytical_memory_bytes"] for c in doc["candidates"] if c["analytical_memory_bytes"]]
    assert miss["candidate"]["analytical_memory_bytes"] == min(needs)
    state = {p["mesh"]: float(p["reason"].split(" take ")[1].split(" GiB")[0]) for p in doc["pruned"]}
    assert state[miss["candidate"]["mesh"]] == min(state.values()) and len(doc["candidates"]) == 1
    assert doc["counts"]["enumerated"] == 1 + sum(p["candidates"] for p in doc["pruned"])


def test_plan_json_schema(capsys, tmp_path):
    code, out, _ = run_main(capsys, "plan", "--model", "tiny", "--topology", "cpu-8", "--per-device-batch", "1",
                            "--verify", "0", "--out", str(tmp_path / "p"), "--json", "seq_len=64")
    assert code == 0
    summary = json.loads(out)
    assert summary["schema"] == "maxperf.plan-result/2" and summary["winner"]["status"] == "chosen"
    doc = json.loads(Path(summary["plan_json"]).read_text())
    assert doc["schema"] == "maxperf.plan/2" and not list((tmp_path / "p").glob(".*partial"))
    n = doc["counts"]
    assert n["indivisible"] == 0 and len(doc["candidates"]) + sum(p["candidates"] for p in doc["pruned"]) == n[
        "enumerated"]
    assert {c["status"] for c in doc["candidates"]} <= {"chosen", "slower", "does not fit", "compile failed"}
    chosen = doc["candidates"][doc["chosen"]]
    assert chosen["status"] == "chosen" and "--model tiny --topology cpu-8" in doc["command"]["maxperf"]
    assert doc["command"]["maxtext"] is None  # MaxText has no tiny model
    assert doc["command"]["maxtext_note"] == "no equivalent: MaxText has no config of tiny"
    assert doc["margin"]["value"] > 0 and doc["margin"]["source"]


def _maxtext_at_scale(scale: int) -> tuple[int, ...]:
    """(D, H, K, F, N, Dh, V) of MaxText's model at global_parameter_scale=scale: its base.yml dims (base_emb_dim 2048,
    base_num_query_heads and base_num_kv_heads 16, base_mlp_dim 7168, base_num_decoder_layers 16, head_dim 128,
    vocab_size 32000) grown as its get_individual_scales (src/maxtext/configs/types.py) grows them."""
    b, r = divmod(int(math.log2(scale)), 3)
    heads, emb = b + int(r > 0), b + int(r > 1)
    return 2048 * 2**emb, 16 * 2**heads, 16 * 2**heads, 7168 * 2**heads, 16 * 2**b, 128, 32000


def test_the_scaled_family_is_maxtexts_global_parameter_scale():
    for k in range(11):
        m = presets.get(f"scaled-{2**k}")
        assert (m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.num_layers, m.head_dim,
                m.vocab_size) == _maxtext_at_scale(2**k)
        assert presets.maxtext_model(m.name) == (f"global_parameter_scale={2**k}",)


def test_plan_gives_maxtexts_model_or_says_there_is_none(capsys, tmp_path):
    result = plan.search(plan.PlanRequest("scaled-8", "v5p-8", per_device_batch=1, pins=("seq_len=256",)))
    words = result.command(result.winner)["maxtext"].split()
    assert "global_parameter_scale=8" in words and "max_target_length=256" in words
    # MaxText's AOT module and config as its repository lays them out (src/maxtext/trainers/pre_train/train_compile.py)
    assert words[:4] == ["python3", "-m", "maxtext.trainers.pre_train.train_compile", "src/maxtext/configs/base.yml"]
    assert not [w for w in words if w.startswith("model_name=")]
    # a pinned dim is not multiplied by MaxText's scale: scale 1, every dim given
    pinned = plan.search(plan.PlanRequest("scaled-8", "v5p-8", per_device_batch=1, pins=("seq_len=256",
                                                                                          "d_model=2048")))
    words = pinned.command(pinned.winner)["maxtext"].split()
    D, H, K, F, N, _, _ = _maxtext_at_scale(8)
    assert {"global_parameter_scale=1", "base_emb_dim=2048", f"base_num_query_heads={H}", f"base_num_kv_heads={K}",
            f"base_mlp_dim={F}", f"base_num_decoder_layers={N}"} <= set(words)
    assert presets.maxtext_model("deepseek-v3") == ("model_name=deepseek3-671b",)
    assert presets.maxtext_model("llama2-7b") == ("model_name=llama2-7b",)
    assert [n for n in presets.names() if presets.maxtext_model(n) is None] == [
        "gemma3-1b", "tiny", "tiny-mla", "tiny-moe"]
    code, out, _ = run_main(capsys, "plan", "--model", "tiny", "--topology", "cpu-8", "--per-device-batch", "1",
                            "--verify", "0", "--out", str(tmp_path / "p"), "seq_len=64")
    assert code == 0 and "  MaxText: no equivalent: MaxText has no config of tiny\n" in out
    assert "model_name=tiny" not in out


def test_maxtext_and_maxperf_spell_the_same_microbatch():
    c = candidates.Candidate({"data": 1, "fsdp": 4, "fsdp_transpose": 1, "sequence": 2, "tensor": 1, "expert": 1},
                         {a: 1 for a in MESH_AXES}, "full", "flash", 2, 4)
    flags = commands.maxtext_flags(c)
    assert "per_device_batch_size=2" in flags and "gradient_accumulation_steps=4" in flags
    assert "ici_context_parallelism=2" in flags
    assert "per_device_batch_size=2" in c.overrides() and "grad_accum_steps=4" in c.overrides()


def test_plan_splits_the_global_batch_into_microbatches_of_b():
    # 256 rows of L=64 on 8 devices: 32 examples per device per step, A microbatches of B = 32 / A
    result = plan.search(plan.PlanRequest("tiny", "cpu-8", global_batch_tokens=256 * 64,
                                          pins=("seq_len=64", "grad_accum_steps=4", "remat_policy=full",
                                                "attention=flash")))
    assert result.global_batch_rows == 256
    assert {(c.per_device_batch_size, c.grad_accum_steps) for c in result.candidates} == {(8, 4)}
    command = result.command(result.winner)
    assert "per_device_batch_size=8" in command["maxperf"].split() and "grad_accum_steps=4" in command["maxperf"]
    assert "per_device_batch_size=8" in commands.maxtext_flags(result.winner)
    assert "gradient_accumulation_steps=4" in commands.maxtext_flags(result.winner)
    # a pinned B (MaxText's meaning) gives the A that reaches the global batch
    pinned = plan.search(plan.PlanRequest("tiny", "cpu-8", global_batch_tokens=256 * 64,
                                          pins=("seq_len=64", "per_device_batch_size=4", "remat_policy=full",
                                                "attention=flash")))
    assert {(c.per_device_batch_size, c.grad_accum_steps) for c in pinned.candidates} == {(4, 8)}
    p = resolve("cpu-8", "tiny", [*pinned.fixed, *pinned.winner.overrides()])
    assert p.configs.train.global_batch(p.mesh.devices) == 256


def test_every_searched_accumulation_keeps_the_global_batch():
    result = plan.search(plan.PlanRequest("tiny", "cpu-8", per_device_batch=4,
                                          pins=("seq_len=64", "remat_policy=full", "attention=flash")))
    pairs = {(c.per_device_batch_size, c.grad_accum_steps) for c in result.candidates}
    assert pairs == {(4, 1), (2, 2), (1, 4)}


@pytest.mark.slow
def test_verify_compiles_the_best_and_the_report_shows_it(capsys, tmp_path):
    code, out, err = run_main(capsys, "plan", "--model", "tiny", "--topology", "cpu-8", "--per-device-batch", "1",
                              "--verify", "1", "--workers", "1", "--out", str(tmp_path / "p"), "seq_len=64",
                              "remat_policy=full", "attention=flash")
    assert code == 0, err
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    chosen = doc["candidates"][doc["chosen"]]
    assert chosen["verified"] is True and chosen["compiler_memory_bytes"] > 0
    assert (Path(chosen["artifact"]) / "manifest.json").is_file() and doc["counts"]["compiled"] == 1
    assert "compiled and fits" in out and "*" in out  # the compiler's memory in the table
    result = render([tmp_path / "p"], tmp_path / "r" / "plan.html")
    html = result.html_path.read_text()
    assert "Pareto" in html and html.count("<svg ") == 1 and "compiled and fits" in html
    with open(next(p for p in result.csv_paths if "pareto" in p.name), newline="") as f:
        front = list(csv.DictReader(f))
    assert [r["chosen"] for r in front].count("True") <= 1 and front
    memory = [float(r["memory GiB"]) for r in front]
    tokens = [float(r["tokens/s"]) for r in front]
    assert memory == sorted(memory) and tokens == sorted(tokens)  # a front: more memory buys more speed
    if CHROMIUM:
        check_in_chromium(result.html_path, tmp_path)


def test_the_report_counts_each_rejection_by_the_rule_that_made_it(capsys, tmp_path):
    code, _, err = run_main(capsys, "plan", "--model", "llama3-8b", "--topology", "v5p-8", "--per-device-batch", "1",
                            "--verify", "0", "--out", str(tmp_path / "p"))
    assert code == 0, err
    n = json.loads((tmp_path / "p" / "plan.json").read_text())["counts"]
    result = render([tmp_path / "p"], tmp_path / "r" / "plan.html")
    with open(next(p for p in result.csv_paths if "rejections" in p.name), newline="") as f:
        rows = {(r["status"], r["reason"]): int(r["candidates"]) for r in csv.DictReader(f)}
    assert rows.get(("slower", "another remat policy keeps more and fits"), 0) == n["keeps_less_than_fitting"] > 0
    assert rows[("does not fit", "parameters and optimizer state alone over HBM")] == n["state_does_not_fit"] > 0
    assert rows.get(("slower", "fits, lower objective"), 0) == n["fit"] - 1  # every ranked one but the chosen
    assert sum(rows.values()) == n["enumerated"] - 1


def test_a_plan_into_an_earlier_plans_directory_leaves_only_its_own_compiles(capsys, tmp_path):
    """An earlier plan's compiled points that this one does not compile are removed once it is written, and the
    counts line adds up to the candidates enumerated."""
    stale = tmp_path / "p" / "points" / "v5p-8_ici_fsdp=4_remat_policy=full"
    stale.mkdir(parents=True)
    (stale / "point.json").write_text("{}")
    code, out, err = run_main(capsys, "plan", "--model", "llama3-8b", "--topology", "v5p-8", "--per-device-batch", "1",
                              "--verify", "0", "--out", str(tmp_path / "p"))
    assert code == 0, err
    assert not (tmp_path / "p" / "points").exists() and "removed 1 compiled point(s)" in err
    n = json.loads((tmp_path / "p" / "plan.json").read_text())["counts"]
    line = next(x for x in out.splitlines() if " candidates: " in x)
    parts = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) [a-z]", line.split(":", 1)[1].split(";")[0])]
    assert sum(parts) == n["enumerated"]


def test_pareto_front():
    points = [(1.0, 10.0), (2.0, 5.0), (2.0, 20.0), (3.0, 15.0), (4.0, 30.0)]
    assert [points[i] for i in pareto(points)] == [(1.0, 10.0), (2.0, 20.0), (4.0, 30.0)]


@pytest.mark.parametrize("argv, words", [
    (["--objective", "speed"], ["speed", "tokens_per_s", "mfu"]),
    (["--global-batch", "1000", "seq_len=64"], ["1000", "not reachable", "L=64"]),
    (["--global-batch", "lots"], ["lots", "4M"]),
    (["--verify", "-1"], ["--verify", ">= 0"]),
    (["remat_policy=fast"], ["remat_policy=fast", "full"]),
    (["--per-device-batch", "4", "grad_accum_steps=3"], ["grad_accum_steps=3", "valid: 1, 2, 4"]),
    (["--per-device-batch", "4", "per_device_batch_size=3"], ["per_device_batch_size=3", "B x A must be 4"]),
    (["ici_tensor=3"], ["ici_tensor=3", "does not divide the 8 devices"]),
])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, words):
    code, out, err = run_main(capsys, "plan", "--model", "tiny", "--topology", "cpu-8", "--verify", "0",
                              "--out", str(tmp_path / "p"), *argv)
    lines = [line for line in err.splitlines() if line.startswith("maxperf: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]


def test_a_compile_that_needs_more_than_predicted_raises_the_margin_and_searches_again():
    result = plan.search(TINY)
    first = result.fitting[0]
    first.verified, first.compiler_memory_bytes = False, first.memory_bytes * 3  # perfmodel 67% under
    assert verify.raise_margin(result, [first])
    verify.search_again(result, {first.overrides(): first}, None)
    plan.rank(result)
    assert result.margin.value == pytest.approx(2.0) and "this plan's compile" in result.margin.source
    assert "margin raised from" in result.notes[0] and first in result.candidates and first.status == "does not fit"
    assert all(c.memory_bytes * 3 <= result.hbm_bytes for c in result.fitting)


# A mid-sized case: llama2-7b over v5p-8's 4 chips, 8 rows of 4,096 tokens, A of 1, 2, 4 or 8: 1,386 candidates,
# 990 after divisibility, all three of the search's shortcuts taken
MID = plan.PlanRequest("llama2-7b", "v5p-8", global_batch_tokens=8 * 4096)


@pytest.fixture(scope="module")
def mid():
    return plan.search(MID)


def _fresh_estimate(result, c):
    """perfmodel.estimate() of a candidate with every cache perfmodel keeps emptied first."""
    from maxperf.perfmodel import flops, moe
    from maxperf.spec import logical_axes, memo, params

    for cached in (moe.moe_shape, params._param_arrays, flops.count_params, memo.model_memo, logical_axes._split,
                   logical_axes._assign_cached):
        cached.cache_clear()
    p = resolve(result.topology_name, result.model_name, list(c.overrides()))
    return perfmodel.estimate(p)


def test_the_search_with_its_shortcuts_equals_an_exhaustive_one_on_a_mid_sized_case(mid):
    # every candidate estimated afresh, none skipped: the same best, and no candidate the search did not time beats it
    hbm, factor = mid.hbm_bytes, 1 + mid.margin.value
    p = resolve(mid.topology_name, mid.model_name, [])
    exhaustive = {}
    for c in mid.candidates:
        q = resolve(mid.topology_name, mid.model_name, list(c.overrides()))
        assert q.configs.train.grad_accum_steps == c.grad_accum_steps and q.mesh.ici == c.ici
        exhaustive[c] = perfmodel.estimate(Request.of(p.topology, p.configs.model, q.configs.train, q.mesh.axes,
                                                      q.mesh.dcn))
    fitting = [c for c, est in exhaustive.items() if est.memory_per_device_bytes * factor <= hbm]
    best = max(fitting, key=lambda c: exhaustive[c].tokens_per_s)
    counts = mid.as_dict()["counts"]
    assert counts["more_accumulation"] and counts["keeps_less_than_fitting"] and counts["keeps_more_than_unfit"]
    assert mid.winner.tokens_per_s == exhaustive[best].tokens_per_s
    assert (mid.winner.mesh_shown(), mid.winner.remat_policy, mid.winner.attention, mid.winner.grad_accum_steps) == \
        (best.mesh_shown(), best.remat_policy, best.attention, best.grad_accum_steps)
    assert {c for c in fitting if not c.skipped} == set(mid.fitting)  # unfit ones the search skipped do not fit
    for c in mid.fitting:  # what the search timed, it timed exactly as estimate() does
        assert (c.step_time_s, c.memory_bytes) == (exhaustive[c].step_time_s, exhaustive[c].memory_per_device_bytes)


def test_a_free_batch_search_equals_an_exhaustive_one():
    # the per-device batch free (B from 0.25 to 32 on 4 chips of 16 GiB): every candidate estimated afresh, none
    # skipped; the search times each configuration only at the largest B that fits it, and finds the same best
    result = plan.search(plan.PlanRequest("qwen3-0.6b", "v5e-4", pins=("attention=flash",)))
    hbm, factor = result.hbm_bytes, 1 + result.margin.value
    exhaustive = {c: perfmodel.estimate(resolve("v5e-4", "qwen3-0.6b", list(c.overrides())))
                  for c in result.candidates}
    fits = {c for c, est in exhaustive.items() if est.memory_per_device_bytes * factor <= hbm}
    counts = result.as_dict(rows=False)["counts"]
    assert counts["smaller_batch"] and counts["keeps_more_than_unfit"] and not counts["more_accumulation"]
    assert result.winner.tokens_per_s == max(exhaustive[c].tokens_per_s for c in fits)
    larger = {(c.mesh_shown(), c.remat_policy, c.per_device_batch_size): c for c in result.candidates}
    for c in result.candidates:
        if c.skipped.startswith("B="):  # a larger B of the same configuration fits, and is at least as fast
            top = larger[(c.mesh_shown(), c.remat_policy, float(c.skipped.split()[0][2:]))]
            assert c in fits and top in fits
            assert exhaustive[c].tokens_per_s <= exhaustive[top].tokens_per_s
        elif c.unfit or c.status == "does not fit":
            assert c not in fits
    assert {c for c in fits if not c.skipped} == set(result.fitting)
    for c in result.fitting:
        assert (c.step_time_s, c.memory_bytes) == (exhaustive[c].step_time_s, exhaustive[c].memory_per_device_bytes)


def test_perfmodel_caches_change_no_figure(mid):
    # one model estimated over many meshes, batches and policies fills perfmodel's caches as a search does; each
    # estimate then agrees to the last bit with one made with every cache emptied: none is keyed on less than its
    # result depends on
    model = resolve(mid.topology_name, mid.model_name, []).configs.model
    sample = [c for c in mid.candidates if c.memory_bytes][::4]
    assert len({(c.mesh_shown(), c.per_device_batch_size) for c in sample}) > 20
    warm = []
    for c in sample:
        q = resolve(mid.topology_name, mid.model_name, list(c.overrides()))
        request = Request.of(q.topology, model, q.configs.train, q.mesh.axes, q.mesh.dcn)
        warm.append(perfmodel.estimate(request).as_dict())
    assert [_fresh_estimate(mid, c).as_dict() for c in sample] == warm


def test_estimate_with_the_callers_memory_equals_estimate_alone():
    from maxperf.perfmodel.estimate import device_for
    from maxperf.perfmodel.flops import resolve_attention

    p = resolve("v5p-8", "llama2-7b", ["ici_fsdp=4", "remat_policy=full"])
    m, t, axes = p.configs.model, p.configs.train, p.mesh.axes
    alone = perfmodel.estimate(Request.of(p.topology, m, t, axes, p.mesh.dcn))
    chip = device_for(p.topology)
    resolved = resolve_attention(m, t, chip.kind)
    memory = perfmodel.estimate_memory(m, resolved, Mesh.of(axes, p.mesh.dcn).check(p.topology),
                                       chip.hbm_bytes, chip.kind)
    given = perfmodel.estimate(Request.of(p.topology, m, t, axes, p.mesh.dcn), memory=memory)
    assert given.as_dict() == alone.as_dict()


def _candidate(tokens_per_s: float, **axes: int) -> candidates.Candidate:
    ici = {a: axes.get(a, 1) for a in MESH_AXES}
    return candidates.Candidate(ici=ici, dcn=dict.fromkeys(MESH_AXES, 1), remat_policy="full", attention="flash",
                                per_device_batch_size=1, grad_accum_steps=1, tokens_per_s=tokens_per_s,
                                memory_bytes=1e9)


def _ranked(tie: float, *cs: candidates.Candidate) -> plan.SearchResult:
    result = plan.SearchResult(plan.PlanRequest("tiny", "v5p-64"), "tiny", "v5p-64", "tpu", 32, 32, 64, None, 95e9,
                               margin.Margin(0.0, "none"), (), list(cs), 0.0, tie=tie)
    plan.rank(result)
    return result


def test_candidates_within_the_uncertainty_are_ties_won_by_the_simplest_layout():
    """llama3-8b on v5p-64 put 24 candidates within 1% of each other and fsdp=2 x fsdp_transpose=16 won by 0.1% over
    plain fsdp=32: inside perfmodel's held-out error, plain FSDP (MaxText's default) is the answer."""
    twin = _candidate(1001.0, fsdp=2, fsdp_transpose=16)
    plain = _candidate(1000.0, fsdp=32)
    tensor = _candidate(995.0, fsdp=8, tensor=4)
    slow = _candidate(800.0, fsdp=32)
    result = _ranked(0.08, twin, tensor, slow, plain)
    assert result.winner is plain and result.candidates[:3] == [plain, twin, tensor]
    assert "within 8% of the fastest (0.999x the fastest's tokens_per_s)" in plain.reason and "a tie" in twin.reason
    assert slow.reason == "1.250x slower by tokens_per_s"
    assert any("3 candidates lie within 8%" in n for n in result.notes)
    # where the model can tell them apart (no uncertainty, as on CPU devices), the fastest wins; equal predictions
    # are ties without an error to quote
    again = [_candidate(1001.0, fsdp=2, fsdp_transpose=16), _candidate(1000.0, fsdp=32)]
    assert _ranked(0.0, *again).winner is again[0]
    same = _ranked(0.0, _candidate(1000.0, fsdp=2, fsdp_transpose=16), _candidate(1000.0, fsdp=32))
    tied = "2 candidates predict the same tokens_per_s: ties, ranked simplest layout first"
    assert tied in same.notes
    assert not any("held-out error" in n for n in same.notes)


def test_plan_ties_use_the_chips_held_out_error_and_verification_proves_distinct_layouts():
    from maxperf.perfmodel import get_chip, work

    assert work.uncertainty(get_chip("tpu-v5p"), work.SHIPPED).relative == work.HELD_OUT_ERROR["source"][0]
    assert work.uncertainty(get_chip("b200"), work.SHIPPED).relative == work.HELD_OUT_ERROR["generation"][0]
    # an FP8 step quotes the FP8 rows' held-out error, the larger
    fp8 = work.uncertainty(get_chip("h100-sxm"), work.SHIPPED, fp8=True)
    assert (fp8.relative, fp8.worst) == work.HELD_OUT_ERROR["fp8"] and "train in FP8" in fp8.basis
    assert work.uncertainty(get_chip("h100-sxm"), work.SHIPPED).relative == work.HELD_OUT_ERROR["source"][0]
    # a chip measured on published runs none of which were fitted quotes that measure (bench/recipes.py's Trillium runs)
    assert work.uncertainty(get_chip("tpu-v6e"), work.SHIPPED).relative == work.UNFITTED_RUNS_ERROR["tpu-v6e"][0]
    assert work.uncertainty(get_chip("cpu"), work.SHIPPED) is None
    # a mixture of experts on a TPU: what MaxText's MoE recipes measure, on any TPU
    for name in ("tpu-v5p", "tpu-v6e", "tpu7x"):
        assert work.uncertainty(get_chip(name), work.SHIPPED, moe=True).relative == work.UNFITTED_MOE_ERROR["tpu"][0]
    assert work.uncertainty(get_chip("h100-sxm"), work.SHIPPED, moe=True) == work.uncertainty(get_chip("h100-sxm"),
                                                                                               work.SHIPPED)
    a, b, c = _candidate(3.0, fsdp=32), _candidate(2.9, fsdp=32), _candidate(2.8, fsdp=16, tensor=2)
    b.remat_policy = "minimal"
    assert verify.distinct_layouts([a, b, c], [], 2) == [a, c]  # not two of the same mesh
    assert verify.distinct_layouts([a, b, c], [], 3) == [a, c, b]
    # fsdp and fsdp_transpose shard alike: their splits of one product are near-twins, proved after other layouts
    d, e, f = (_candidate(2.7, fsdp=2, fsdp_transpose=16), _candidate(2.7, fsdp=8, fsdp_transpose=4),
               _candidate(2.6, fsdp=8, sequence=4))
    assert verify.distinct_layouts([a, d, e, f], [], 3) == [a, f, d]
    assert verify.distinct_layouts([d, e, f], [a], 2) == [f, d]
    assert verify.layout_family(d) == verify.layout_family(a) != verify.layout_family(c)


def test_the_measured_error_says_when_a_verdict_is_too_close_to_call(tmp_path):
    path = tmp_path / "memory_error.json"
    path.write_text(json.dumps({"tpu": {"median": 0.05, "worst": 0.15, "worst_underestimate": 0.125, "cases": 59},
                                "tpu7x": {"median": 0.07, "worst": 0.18, "worst_underestimate": 0.21, "cases": 6}}))
    tpu = margin.measured_error("tpu", "tpu-v5p", path)
    assert (tpu.name, tpu.under, tpu.over, tpu.cases) == ("tpu", 0.125, 0.15, 59)
    assert margin.measured_error("tpu", "tpu7x", path).under == 0.21  # a generation measured apart: its own
    assert margin.measured_error("gpu", "h100-sxm", path) is None  # not carried to a platform it was not measured on
    assert margin.measured_error("tpu", None, tmp_path / "absent.json") is None
    # under HBM: close while the compiler's worst excess would pass it; over HBM: close while its worst shortfall
    # would bring it back under
    assert not tpu.close_call(80.0, 95.0) and tpu.close_call(85.0, 95.0)
    assert tpu.close_call(105.0, 95.0) and not tpu.close_call(110.0, 95.0)


def test_estimate_says_when_its_memory_verdict_is_too_close_to_call(capsys):
    from maxperf.cli import main

    error = margin.measured_error("tpu", "tpu-v5p")
    words = ["estimate", "--topology", "v5p-8", "--model", "llama2-13b"]
    for batch, fits, close in ((8, True, False), (32, True, True), (40, False, True)):
        code = main([*words, f"per_device_batch_size={batch}", "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert code == (0 if fits else 3) and doc["fits"] is fits and doc["memory_close_call"] is close
        assert doc["memory_error"]["cases"] == error.cases
        total, hbm = doc["memory_per_device_bytes"], doc["memory"]["hbm_bytes"]
        assert close == (total * (1 + error.under) > hbm if fits else total / (1 + error.over) <= hbm)
        main([*words, f"per_device_batch_size={batch}"])
        out = capsys.readouterr().out
        assert ("memory check     too close to call" in out) is close
        if close:
            assert f"{error.cases} TPU steps of bench/memory_accuracy.py" in out
    main(["estimate", "--topology", "cpu-2", "--model", "tiny", "--json"])  # nothing measured on CPU: nothing said
    assert json.loads(capsys.readouterr().out)["memory_error"] is None
    # a mixture of experts on GPUs, measured apart (mixtral's experts gathered whole over FSDP 8: the compiler counts
    # up to 29% more): 77.8 of 79.1 GiB said to fit, and too close to call (the compiler: 79.8, it does not)
    moe = margin.measured_error("gpu", "h100-sxm", moe=True)
    main(["estimate", "--topology", "h100-8", "--model", "mixtral-8x7b", "num_layers=2", "per_device_batch_size=18",
          "ici_fsdp_parallelism=8", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["memory_close_call"] and doc["memory_error"]["entry"] == "gpu moe"
    assert moe.under > 0.2 and moe.cases >= 19


def test_with_the_batch_fixed_a_policy_unfit_at_its_smallest_microbatch_fits_at_no_batch_with_accumulation():
    # llama2-13b on v5p-8, 16 rows of 4,096 tokens: A of 1, 2, 4 and 8. A policy keeping least that does not fit at
    # one A > 1 is estimated at A=8 (the smallest B) next; where it does not fit there, the search rules it out at
    # every A > 1 unestimated. Every candidate estimated afresh: those it ruled out so do not fit, the best is the same
    result = plan.search(plan.PlanRequest("llama2-13b", "v5p-8", global_batch_tokens=16 * 4096))
    hbm, factor = result.hbm_bytes, 1 + result.margin.value
    exhaustive = {c: perfmodel.estimate(resolve("v5p-8", "llama2-13b", list(c.overrides())))
                  for c in result.candidates}
    ruled_out = [c for c in result.candidates if c.unfit.startswith("does not fit at A=8, its smallest microbatch")]
    assert ruled_out and result.as_dict(rows=False)["counts"]["unfit_at_smallest_batch"] == len(ruled_out)
    assert {c.grad_accum_steps for c in ruled_out} <= {2, 4}  # never A=1, nor A=8, where it was estimated
    assert all(exhaustive[c].memory_per_device_bytes * factor > hbm for c in ruled_out)
    fits = [c for c, est in exhaustive.items() if est.memory_per_device_bytes * factor <= hbm]
    assert max(c.tokens_per_s for c in result.fitting) == max(exhaustive[c].tokens_per_s for c in fits)


def test_a_pinned_custom_policy_is_searched_as_its_keys_place_tensors(tmp_path):
    """remat_policy=custom pinned with its per-tensor keys: the search ranks it as what those keys keep and offload
    (no fixed policy table names it), and its winner's line keeps them."""
    from maxperf.search import plan

    result = plan.search(plan.PlanRequest("llama2-7b", "v5p-8", pins=("remat_policy=custom",
                                                                      "decoder_layer_input=offload")))
    assert result.winner is not None and result.winner.remat_policy == "custom"
    assert "decoder_layer_input=offload" in result.command(result.winner)["maxperf"]


def test_pinned_axes_that_cannot_split_the_model_are_named():
    """ici_tensor_parallelism=16 on 16 devices leaves nothing to search and does not divide llama3.1-8b's 8 key/value
    heads: the error says that, not that a batch of 16 rows divides over no data or fsdp axis."""
    from maxperf.search.candidates import space
    from maxperf.spec.errors import MaxperfError

    with pytest.raises(MaxperfError, match="pinned axes divides llama3.1-8b: tensor=16 does not divide the 8 "
                                           "key/value heads"):
        space("llama3.1-8b", "v5p-32", global_batch_tokens=65536, pins=["ici_tensor_parallelism=16"])


def test_a_batch_no_layout_divides_names_the_factor_left_and_a_batch_that_would():
    """144 GB200s (two NVL72 racks) and 256 rows share only 16: the error names the 9 left and a batch of 288 rows,
    not "a batch of 1 row" (the most accumulation tried)."""
    from maxperf.search.candidates import space
    from maxperf.spec.errors import MaxperfError

    why = (r"256 rows a microbatch without accumulation .*shares only a factor of 16 with the 144 devices \(the "
           r"factor 9 .*a multiple of 144 rows \(e.g. 288\)")
    with pytest.raises(MaxperfError, match=why):
        space("llama3-8b", "gb200-72x2", global_batch_tokens=2 << 20, pins=["seq_len=8192"])
