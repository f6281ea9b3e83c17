"""One resolution of a request into configs and a mesh (maxperf/spec/request.py), and every command on top of it."""

import json

import pytest

from maxperf import perfmodel
from maxperf.cli import main
from maxperf.spec import gpu_targets, overrides, presets
from maxperf.spec import topology as T
from maxperf.spec.errors import MaxperfError
from maxperf.spec.logical_axes import MESH_AXES
from maxperf.spec.mesh import Mesh
from maxperf.spec.mesh import resolve as resolve_mesh
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.request import resolve

needs_cuda_plugin = pytest.mark.skipif(gpu_targets.plugin_library() is None,
                                       reason="needs the gpu extra: pip install 'maxperf[gpu]'")

# --- the mesh over fast-interconnect domains -------------------------------------------------------------------

# name -> (ICI devices per domain, DCN domains): HGX hosts of 8 GPUs, GB200 NVL72 racks of 72
MULTI_HOST_GPUS = {"h100-8x2": (8, 2), "h100-8x4": (8, 4), "a100-8x2": (8, 2), "b200-8x2": (8, 2),
                   "gb200-72x2": (72, 2)}


@pytest.mark.parametrize("name", sorted(MULTI_HOST_GPUS))
def test_multi_host_gpu_mesh_spans_nvlink_domains_and_perfmodel_takes_it(name):
    per_domain, domains = MULTI_HOST_GPUS[name]
    p = resolve(name, "llama3-8b", ["ici_fsdp=8", f"ici_data={per_domain // 8}"])
    assert p.mesh.ici["fsdp"] * p.mesh.ici["data"] == per_domain
    assert p.mesh.dcn == {**dict.fromkeys(MESH_AXES, 1), "data": domains}
    est = perfmodel.estimate(p)
    assert est.chips == per_domain * domains and est.step_time_s > 0


def test_dcn_axes_must_cover_the_nvlink_domains():
    with pytest.raises(MaxperfError, match=r"multiply to 1 but there are 2 NVLink domains \(hosts\) in h100-8x2"):
        resolve("h100-8x2", "tiny", ["dcn_data=1"])
    with pytest.raises(MaxperfError, match=r"ici_fsdp=3 multiply to 3 but there are 8 devices in each NVLink"):
        resolve("h100-8x2", "tiny", ["ici_fsdp=3"])
    p = resolve("h100-8x2", "tiny", ["dcn_data=1", "dcn_fsdp=2"])
    assert p.mesh.axes["fsdp"] == 16 and p.mesh.dcn == {**dict.fromkeys(MESH_AXES, 1), "fsdp": 2}


def test_perfmodel_checks_dcn_axes_against_the_domains_not_the_slices():
    t = T.get("h100-8x2")
    assert t.num_slices == 1 and t.ici_domains == 2
    mesh = Mesh.of({"data": 2, "fsdp": 8}, {"data": 2}).check(t)
    assert mesh.ici["data"] == 1 and mesh.ici["fsdp"] == 8
    with pytest.raises(MaxperfError, match="multiply to 1 but the topology has 2 DCN domain"):
        Mesh.of({"fsdp": 16}, {}).check(t)


def test_resolve_fills_the_minus_one_axes_and_refuses_what_does_not_cover_the_devices():
    with pytest.raises(MaxperfError, match="does not divide 8"):
        resolve_mesh(ParallelismConfig(ici_tensor=3), T.get("cpu-8"))
    with pytest.raises(MaxperfError, match="multiply to 4 but there are 8 devices in each slice of cpu-8"):
        resolve_mesh(ParallelismConfig(ici_fsdp=2, ici_tensor=2), T.get("cpu-8"))
    shape = resolve_mesh(ParallelismConfig(ici_tensor=2), T.get("v5p-16", num_slices=2))
    assert shape.axes == {"data": 2, "stage": 1, "fsdp": 4, "fsdp_transpose": 1, "sequence": 1, "tensor": 2,
                          "expert": 1}
    assert shape.ici["data"] == 1 and shape.dcn["data"] == 2


def test_every_analytical_command_runs_on_a_multi_host_gpu_topology(tmp_path, capsys):
    assert main(["estimate", "--topology", "h100-8x2", "--model", "llama3-8b"]) == 0
    assert "mesh data=2 x fsdp=8" in capsys.readouterr().out
    assert main(["estimate-memory", "--analytical-only", "--topology", "h100-8x2", "--model", "llama3-8b"]) == 0
    assert "mesh data=2 x fsdp=8" in capsys.readouterr().out
    assert main(["sweep", "--analytical-only", "--model", "tiny", "--topologies", "h100-8x2,b200-8x2",
                 "--out", str(tmp_path / "sweep"), "--workers", "1"]) == 0
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").rglob("point.json"))]
    assert [(r["topology"], r["status"]) for r in rows] == [("b200-8x2", "ok"), ("h100-8x2", "ok")]


@pytest.mark.slow
@needs_cuda_plugin
def test_compile_for_two_gpu_hosts(tmp_path, capsys):
    out = tmp_path / "h100"
    assert main(["compile", "--topology", "h100-8x2", "--model", "tiny", "seq_len=128", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mesh"]["dcn"] == {"data": 2, "stage": 1, "fsdp": 1, "fsdp_transpose": 1, "sequence": 1,
                                       "tensor": 1, "expert": 1}
    assert manifest["mesh"]["ici"]["fsdp"] == 8
    assert manifest["devices"]["count"] == 16 and manifest["devices"]["processes"] == 2
    assert json.loads((out / "estimate.json").read_text())["chips"] == 16


@needs_cuda_plugin
def test_the_compiled_mesh_keeps_each_gpu_host_on_the_ici_axes():
    from maxperf.aot import targets

    p = resolve("h100-8x2", "tiny")
    mesh = targets.jax_mesh(p.topology, p.mesh)
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 8, "fsdp_transpose": 1, "sequence": 1, "tensor": 1,
                                "expert": 1}
    hosts = [[d.process_index for d in row] for row in mesh.devices.reshape(2, 8)]
    assert hosts == [[0] * 8, [1] * 8]


# --- mesh axes that do not divide a dimension ------------------------------------------------------------------


def test_a_dividing_mesh_has_no_warnings():
    assert resolve("v5p-64", "llama3-8b", ["ici_tensor=4"]).warnings == ()


def test_heads_that_tensor_does_not_divide_are_named_with_their_cost():
    p = resolve("v5p-64", "llama3-8b", ["num_heads=36", "num_kv_heads=4", "ici_tensor=8"])
    assert p.mesh.axes["tensor"] == 8
    heads = [w for w in p.warnings if "does not divide H=36" in w]
    assert len(heads) == 1 and heads[0].startswith("tensor=8 does not divide H=36: H is replicated along tensor")
    assert "6.09 GiB per device (2.80 GiB if split over all 32 devices)" in heads[0]
    assert "e.g. ici_tensor=4 ici_data=2" in heads[0]
    assert any(w.startswith("tensor=8 does not divide K=4") for w in p.warnings)


def test_a_batch_the_batch_axes_do_not_divide_names_a_batch_that_they_do():
    """Moving a batch axis to data would not help (data splits the batch too): the warning names a batch the batch
    axes divide, and that batch resolves without one."""
    p = resolve("v5p-128", "llama2-7b", ["per_device_batch_size=0.5"])
    assert p.warnings == ("fsdp=64 does not divide B=32: B is replicated along fsdp, not split; each device holds all "
                          "32 of it; a microbatch of a multiple of 64 examples splits over them "
                          "(per_device_batch_size=1 or a multiple of it)",)
    assert resolve("v5p-128", "llama2-7b", ["per_device_batch_size=1"]).warnings == ()


def test_a_context_split_the_sequence_refuses_suggests_one_load_balancing_takes():
    """Load balancing cuts the sequence into 2 x context chunks: a length they do not divide is one line naming the
    lengths near it that they do, and the context sizes that fit it, which resolve."""
    with pytest.raises(MaxperfError, match=r"2 x 8 chunks \(context_parallel_load_balance\): seq_len=2052 must be "
                                           r"a multiple of 16 \(e.g. 2048 or 2064\), or ici_context_parallelism one "
                                           r"of 2$"):
        resolve("v5p-128", "llama3-8b", ["ici_context_parallelism=8", "seq_len=2052"])
    assert resolve("v5p-128", "llama3-8b", ["ici_context_parallelism=2", "seq_len=2052"]).mesh.axes["sequence"] == 2


def test_a_sequence_that_the_context_axis_does_not_divide_is_refused():
    with pytest.raises(MaxperfError, match=r"seq_len=4095 must be a multiple of 8 \(e.g. 4088 or 4096\)$"):
        resolve("v5p-64", "llama3-8b", ["seq_len=4095", "ici_sequence=4"])
    with pytest.raises(MaxperfError, match=r"splits each sequence into 4 shards: seq_len=130 must be a multiple of 4"):
        resolve("v5p-64", "llama3-8b", ["seq_len=130", "ici_sequence=4", "context_parallel_load_balance=false"])


def test_explicit_fsdp_that_does_not_divide_the_width_warns_with_the_state_per_device():
    p = resolve("gb200-72", "llama3-8b", ["ici_fsdp=72"])
    assert p.mesh.axes["fsdp"] == 72
    state = perfmodel.count_params(p.model).total * 12 / (1 << 30)  # float32 parameters and two Adam moments
    assert p.warnings == (f"fsdp=72 does not divide D=4096: D is replicated along fsdp, not split; parameters and "
                          f"optimizer state take {state:.2f} GiB per device ({state / 72:.2f} GiB if split over all 72 "
                          f"devices); e.g. ici_fsdp=8 ici_data=9",)
    assert f"{state:.2f}" == "89.75"


def test_the_default_mesh_divides_the_model_width():
    p = resolve("gb200-72", "llama3-8b")
    assert {a: n for a, n in p.mesh.axes.items() if n > 1} == {"data": 9, "fsdp": 8}
    assert p.configs.parallelism == ParallelismConfig(ici_data=-1, ici_fsdp=8)
    assert p.warnings == ("the default fsdp=72 does not divide D=4096: planned ici_fsdp=8 ici_data=9 instead, which "
                          "does (set ici_fsdp to choose)",)
    memory = perfmodel.estimate(p).memory
    assert memory.params == pytest.approx(perfmodel.count_params(p.model).total * 4 / 8, rel=1e-3)


def test_warnings_reach_stderr_and_the_json(capsys):
    assert main(["estimate", "--topology", "gb200-72", "--model", "llama3-8b", "ici_fsdp=72", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("maxperf: warning: fsdp=72 does not divide D=4096")
    assert json.loads(out)["warnings"][0].startswith("fsdp=72 does not divide D=4096")
    assert main(["estimate-memory", "--analytical-only", "--topology", "gb200-72", "--model", "llama3-8b",
                 "ici_fsdp=72"]) in (0, 3)
    assert "maxperf: warning: fsdp=72 does not divide D=4096" in capsys.readouterr().err


@pytest.mark.slow
def test_compiler_holds_the_replicated_state_perfmodel_counts(tmp_path):
    """fsdp=8 does not divide D=516: the compiled step's arguments are the replicated state perfmodel counts."""
    from maxperf.search import memory_fit

    words = ["d_model=516", "head_dim=64", "d_ff=2048", "seq_len=128", "ici_fsdp=8"]
    cmp = memory_fit.compare("cpu-8", "tiny", words, out=tmp_path / "c")
    assert cmp.plan.warnings[0].startswith("fsdp=8 does not divide D=516")
    a = cmp.analytical
    assert cmp.compiler["argument_bytes"] == pytest.approx(a.params + a.optimizer, rel=1e-4)
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["warnings"] == list(cmp.plan.warnings)


# --- bounds of the numeric keys --------------------------------------------------------------------------------


def _numeric_keys():
    import typing

    for name, (part, kind) in overrides._fields().items():
        options = set(typing.get_args(kind)) or {kind}
        if options & {int, float} and bool not in options:
            yield name, part, int if int in options else float


@pytest.mark.parametrize("name, part, kind", list(_numeric_keys()))
def test_every_numeric_key_has_an_upper_bound(name, part, kind):
    top = overrides.limit(name, part, kind(1))
    too_big = kind(top * 10)
    with pytest.raises(MaxperfError, match=f"{name}={too_big} is too large; {name} takes at most"):
        overrides.apply(presets.get("tiny"), [f"{name}={too_big}"])


def test_absurd_batch_is_one_line_and_exit_2(capsys):
    assert main(["estimate", "--topology", "v5p-8", "--model", "llama3-8b",
                 "per_device_batch_size=99999999999999999999"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("maxperf: error: per_device_batch_size=99999999999999999999 is too large; "
                                 "per_device_batch_size takes at most 65536\n")


def test_infinite_and_nan_numbers_are_refused():
    for word in ("learning_rate=inf", "adam_eps=nan", "rope_theta=-inf"):
        with pytest.raises(MaxperfError, match="takes a finite number"):
            overrides.apply(presets.get("tiny"), [word])


def test_a_config_object_holds_to_the_same_bounds():
    import dataclasses

    huge = dataclasses.replace(presets.get("tiny"), num_layers=1 << 20)
    with pytest.raises(MaxperfError, match="num_layers=1048576 is too large; num_layers takes at most 4096"):
        resolve("cpu-8", huge)


def test_planning_and_its_warnings_start_no_jax():
    import subprocess
    import sys

    code = ("import sys; from maxperf.spec import resolve; p = resolve('gb200-72', 'llama3-8b', ['ici_fsdp=72']); "
            "assert p.warnings; print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_rules_name_each_axis_they_leave_out_for_not_dividing():
    from maxperf.spec.logical_axes import mesh_axes_for, undivided_axes

    shape, logical, sizes = (4096, 36, 128), ("embed", "heads", "head_dim"), {"fsdp": 72, "tensor": 8}
    assert mesh_axes_for(shape, logical, sizes) == (None, None, None)
    assert undivided_axes(shape, logical, sizes) == [(0, "fsdp"), (1, "tensor")]
    # fsdp divides 12, fsdp x sequence does not: sequence is the one left out
    assert mesh_axes_for((12,), ("embed",), {"fsdp": 4, "sequence": 2}) == ("fsdp",)
    assert undivided_axes((12,), ("embed",), {"fsdp": 4, "sequence": 2}) == [(0, "sequence")]


def test_a_dropless_moe_step_on_gpu_is_warned_of_its_dense_expansion():
    """XLA:GPU multiplies every routed row by each local expert: said with the local expert count, and not where the
    dispatch is dense, the platform a TPU, or each device holds one expert."""
    (line,) = resolve("h100-8", "qwen3-30b-a3b", ["ici_expert_parallelism=8"]).warnings
    assert "16 local experts" in line and "16x" in line and "sparse_matmul=false" in line
    assert resolve("h100-8", "qwen3-30b-a3b", ["sparse_matmul=false", "capacity_factor=1.25"]).warnings == ()
    assert resolve("v5p-8", "qwen3-30b-a3b").warnings == ()
    assert resolve("h100-8", "mixtral-8x7b", ["ici_expert_parallelism=8"]).warnings == ()


def test_plan_searches_pipeline_stages_across_hosts_where_left_to_it():
    """dcn_pipeline_parallelism=-1: the stage counts over the hosts that split the layers into whole stages are
    searched with their microbatch counts; by default none are (the space stays as it was)."""
    from maxperf.search import candidates

    left = candidates.space("llama2-7b", "h100-8x4", global_batch_tokens=1 << 20,
                            pins=("dcn_pipeline_parallelism=-1",))
    staged = [c for c in left.candidates if c.dcn["stage"] > 1]
    assert {c.dcn["stage"] for c in staged} == {2, 4}  # 32 layers over 4 hosts
    assert all(c.pipeline_microbatches % c.dcn["stage"] == 0 for c in staged)
    assert all(c.ici["stage"] == 1 for c in left.candidates)
    default = candidates.space("llama2-7b", "h100-8x4", global_batch_tokens=1 << 20)
    assert not [c for c in default.candidates if c.dcn["stage"] > 1]
    assert len(left.candidates) > len(default.candidates)
    # a pipeline runs MaxText's remat of its iterations: remat_policy=none recomputes as full, so it is not searched
    # apart; with set_remat_policy_on_pipeline_iterations=false every policy is none's
    assert {c.remat_policy for c in staged} == set(candidates.REMAT_POLICIES) - {"none"}
    assert "none" in {c.remat_policy for c in left.candidates if c.dcn["stage"] == 1}
    off = candidates.space("llama2-7b", "h100-8x4", global_batch_tokens=1 << 20,
                           pins=("dcn_pipeline_parallelism=-1", "set_remat_policy_on_pipeline_iterations=false"))
    assert {c.remat_policy for c in off.candidates if c.dcn["stage"] > 1} == {"none"}


def test_plan_keeps_the_embeddings_and_losss_places_for_its_pipelined_meshes():
    """Llama 3.1 405B's 126 layers over 8 stages across hosts need the two places (Megatron's uneven stages): pinned,
    the plan makes pipelined candidates of 128 places, each of whose requests keeps them, and unpipelined ones
    without them; without the places the stage count is refused, naming them."""
    from maxperf.search import candidates
    from maxperf.spec.request import Request

    pins = ("seq_len=8192", "dcn_pipeline_parallelism=8", "account_for_embedding_in_pipeline_split=true",
            "account_for_loss_in_pipeline_split=true")
    found = candidates.space("llama3.1-405b", "h100-8x128", global_batch_tokens=1 << 22, pins=pins)
    staged = [c for c in found.candidates if c.dcn["stage"] == 8]
    assert staged and len(staged) == len(found.candidates)
    c = staged[0]
    request = Request.of(found.topology, found.model, found.train, {a: c.ici[a] * c.dcn[a] for a in MESH_AXES}, c.dcn)
    assert request.train.account_for_embedding_in_pipeline_split and request.train.account_for_loss_in_pipeline_split
    # MaxText has no such stages: its command line is none, and says why
    from maxperf.search.commands import command

    line = command(c, model="llama3.1-405b", topology="h100-8x128", platform="gpu", num_slices=1, seq_len=8192,
                   fixed=found.fixed)
    assert line["maxtext"] is None and "Megatron-LM's" in line["maxtext_note"]
    assert "account_for_loss_in_pipeline_split=true" in line["maxperf"]
    with pytest.raises(MaxperfError, match="give the embedding and the loss a layer's place each"):
        candidates.space("llama3.1-405b", "h100-8x128", global_batch_tokens=1 << 22, pins=pins[:2])


def test_a_plan_pinning_megatrons_schedule_writes_no_maxtext_line_for_its_pipelined_candidates():
    """pipeline_schedule=1f1b is maxperf's key for Megatron-LM's order: a pipelined winner has no MaxText command (its
    pipeline runs MaxText's schedule), an unpipelined one has MaxText's line without the key."""
    from maxperf.search import candidates
    from maxperf.search.commands import command

    found = candidates.space("llama3-70b", "h100-8x8", global_batch_tokens=1 << 20,
                             pins=("seq_len=8192", "dcn_pipeline_parallelism=-1", "pipeline_schedule=1f1b"))
    lines = {c.dcn["stage"] > 1: command(c, model="llama3-70b", topology="h100-8x8", platform="gpu", num_slices=1,
                                          seq_len=8192, fixed=found.fixed) for c in found.candidates}
    assert set(lines) == {True, False}
    assert lines[True]["maxtext"] is None and "pipeline_schedule=1f1b is Megatron-LM's" in lines[True]["maxtext_note"]
    assert "pipeline_schedule=1f1b" in lines[True]["maxperf"]
    assert lines[False]["maxtext"] and "pipeline_schedule" not in lines[False]["maxtext"]


def test_a_plan_pinning_remat_none_times_the_pipelined_meshes_as_full(tmp_path):
    """remat_policy=none pinned with pipeline stages searched across hosts: the pipelined meshes run it as full
    (MaxText's remat of the pipeline's iterations), and those candidates are timed as such, none left unpriced."""
    import json

    from maxperf import cli

    out = tmp_path / "plan"
    assert cli.main(["plan", "--model", "llama2-7b", "--topology", "h100-8x4", "--global-batch", "1M",
                     "dcn_pipeline_parallelism=-1", "remat_policy=none", "--verify", "0", "--out", str(out)]) == 0
    candidates = json.loads((out / "plan.json").read_text())["candidates"]
    staged = [c for c in candidates if c["dcn"]["stage"] > 1]
    assert staged and {c["remat_policy"] for c in staged} == {"full"}
    assert {c["remat_policy"] for c in candidates if c["dcn"]["stage"] == 1} == {"none"}
    timed = [c for c in candidates if c["status"] not in ("does not fit", "slower")]
    assert timed and all(c["step_time_s"] > 0 for c in timed)


def test_a_gpu_plans_maxtext_line_is_maxtexts_train_compile_where_it_names_the_machine():
    """MaxText compiles GPU steps ahead of time for its machine types (compile_topology=a3, eight H100s a host, one
    slice a host); for a GPU it names no machine of, the line is its flags alone and says so."""
    from maxperf.search.candidates import Candidate
    from maxperf.search.commands import command
    from maxperf.spec.logical_axes import MESH_AXES

    ici = dict.fromkeys(MESH_AXES, 1) | {"fsdp": 8}
    dcn = dict.fromkeys(MESH_AXES, 1) | {"fsdp": 8}
    c = Candidate(ici, dcn, "full", "flash", 2, 1)
    h100 = command(c, model="llama3.1-70b", topology="h100-8x8", platform="gpu", num_slices=1, seq_len=2048,
                   fixed=())
    assert h100["maxtext"].startswith("python3 -m maxtext.trainers.pre_train.train_compile src/maxtext/configs/"
                                      "base.yml model_name=llama3.1-70b hardware=gpu compile_topology=a3 "
                                      "compile_topology_num_slices=8 ")
    a100 = command(c, model="llama3.1-70b", topology="a100-8x8", platform="gpu", num_slices=1, seq_len=2048,
                   fixed=())
    assert a100["maxtext"].startswith("model_name=llama3.1-70b ") and "names no machine" in a100["maxtext_note"]
    # part of a host: a3 is eight H100s, so a plan of four names no machine (it named a3, which compiles 8)
    ici4 = dict.fromkeys(MESH_AXES, 1) | {"fsdp": 4}
    part = command(Candidate(ici4, dict.fromkeys(MESH_AXES, 1), "full", "flash", 2, 1), model="llama3.1-70b",
                   topology="h100-4", platform="gpu", num_slices=1, seq_len=2048, fixed=())
    assert "compile_topology" not in part["maxtext"] and "a host of 8 GPUs" in part["maxtext_note"]


def test_a_gpu_plan_of_a_sliding_window_model_searches_the_dot_product_and_its_maxtext_line_counts_every_host():
    """GPU flash serves no sliding window: gemma2-9b on h100-8x4 searched flash and was refused as a whole; now its
    candidates are the dot product's. A GPU plan over --num-slices names all the hosts in its MaxText line (it named
    one slice's, which MaxText's train_compile then refused for the dcn axes)."""
    from maxperf.search import candidates
    from maxperf.search.commands import command

    found = candidates.space("gemma2-9b", "h100-8x4", global_batch_tokens=1 << 20)
    assert found.candidates and {c.attention for c in found.candidates} == {"dot_product"}
    multi = candidates.space("llama3-70b", "h100-8x8", num_slices=3, global_batch_tokens=6 << 20,
                             pins=("seq_len=8192",))
    c = next(c for c in multi.candidates if c.dcn["data"] * c.dcn["fsdp"] == 24)
    line = command(c, model="llama3-70b", topology="h100-8x8", platform="gpu", num_slices=3, seq_len=8192,
                   fixed=multi.fixed)
    assert "compile_topology=a3 compile_topology_num_slices=24" in line["maxtext"]


def test_plan_refuses_ici_pipeline_left_to_the_search():
    from maxperf.search import candidates

    with pytest.raises(MaxperfError, match="ici_pipeline_parallelism=-1: plan searches pipeline stages across"):
        candidates.space("llama3-70b", "v5p-256", global_batch_tokens=1 << 22, pins=("ici_pipeline_parallelism=-1",))


@pytest.mark.parametrize("per_device", [2**30, 300 * 2**30])
def test_a_compile_jax_cannot_serialize_keeps_its_memory_verdict_in_a_sweep_point(tmp_path, monkeypatch, per_device):
    """A step that compiles but whose executable jax cannot pickle (te_mxfp8's block-scaled products) writes its
    memory without compiled.pkl: a sweep point (what plan's verification compiles) keeps the compiler's verdict, it
    fits or does not, where it recorded a failed compile."""
    from maxperf import aot
    from maxperf.search import sweep
    from maxperf.spec.errors import Unserializable

    def compile_(topology, model, words, *, out, **kw):
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.json").write_text(json.dumps({"per_device_total_bytes": per_device, "hbm_bytes": 178 * 2**30,
                                                     "fits": per_device < 178 * 2**30}))
        raise Unserializable("jax cannot serialize this compiled step (AttributeError: x): te_mxfp8; the compiler's "
                             f"memory and optimized HLO are in {out}, but no compiled.pkl")

    monkeypatch.setattr(aot, "compile", compile_)
    point = sweep.Point("b200-8", 1, ("num_layers=2", "quantization=te_mxfp8"))
    row = sweep.run_point("llama3-8b", point, str(tmp_path / "p"), analytical_only=False)
    fits = per_device < 178 * 2**30
    assert (row["status"], row["fits"], row["compiler_memory_bytes"]) == ("ok" if fits else "does not fit", fits,
                                                                          per_device)
    assert row["executable"] is False and "cannot serialize" in row["reason"]


@pytest.mark.slow
def test_plan_verifies_a_te_mxfp8_layout_whose_executable_cannot_be_kept(tmp_path):
    """plan --verify on a B200 in te_mxfp8: the compile fits (its executable does not pickle), so the plan has its
    verified winner, where it said no candidate fits and exited 3."""
    code = main(["plan", "--model", "llama3-8b", "--topology", "b200-8", "--global-batch", "64K", "seq_len=2048",
                 "num_layers=2", "quantization=te_mxfp8", "--verify", "1", "--workers", "1", "--out",
                 str(tmp_path / "plan")])
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert code == 0 and plan["chosen"] is not None
    assert plan["candidates"][plan["chosen"]]["verified"] and plan["command"]


def test_plan_searches_fp8_for_a_dropless_mixture_of_experts_only_where_the_step_quantizes_it():
    """The train step quantizes a mixture of experts' capacity einsums, not its dropless grouped matmul (compile
    refuses that pair): under quantization=auto a dropless MoE is searched in bf16 with a note saying why, a pinned
    FP8 recipe is refused in compile's one line, and with sparse_matmul=false the FP8 recipe is searched."""
    from maxperf.search.candidates import space

    auto = space("mixtral-8x7b", "h100-8", global_batch_tokens=1 << 18,
                 pins=["seq_len=2048", "num_layers=2", "quantization=auto"])
    assert auto.precisions == ["none"] and "sparse_matmul=false" in auto.notes[0]
    assert {c.quantization for c in auto.candidates} == {"none"}
    with pytest.raises(MaxperfError, match="needs sparse_matmul=false"):
        space("mixtral-8x7b", "h100-8", global_batch_tokens=1 << 18,
              pins=["seq_len=2048", "num_layers=2", "quantization=te_fp8_currentscaling"])
    einsums = space("mixtral-8x7b", "h100-8", global_batch_tokens=1 << 18,
                    pins=["seq_len=2048", "num_layers=2", "quantization=auto", "sparse_matmul=false"])
    assert einsums.precisions == ["none", "te_fp8_currentscaling"] and not einsums.notes
