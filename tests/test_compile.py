"""`maxperf compile` and `maxperf.aot.load`: artifacts for each platform, loading, and every kind of refusal."""

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from maxperf import aot, spec
from maxperf.aot import artifacts
from maxperf.aot.artifacts import ArtifactError
from maxperf.spec.errors import MaxperfError

TINY = ["seq_len=64", "per_device_batch_size=2"]
ARTIFACT_FILES = {"compiled.pkl", "manifest.json", "memory.json", "cost.json", "estimate.json",
                  "hlo/lowered.stablehlo.mlir", "hlo/optimized.hlo.txt"}


def maxperf(*args, cwd=None, env=None):
    environment = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "maxperf.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=environment, timeout=600)


@pytest.fixture(scope="module")
def cpu8(tmp_path_factory):
    return aot.compile("cpu-8", "tiny", TINY, out=tmp_path_factory.mktemp("c") / "cpu8")


def test_cpu_artifact_has_every_file_and_field(cpu8):
    d = cpu8.out_dir
    assert {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()} == ARTIFACT_FILES
    manifest = json.loads((d / "manifest.json").read_text())
    assert set(manifest["files"]) == ARTIFACT_FILES - {"manifest.json"}
    for key in ("model", "train", "parallelism", "topology", "versions", "compile_seconds", "peak_rss_bytes"):
        assert key in manifest
    assert manifest["versions"]["jax"] == jax.__version__
    memory = json.loads((d / "memory.json").read_text())
    parts = memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]
    assert memory["per_device_total_bytes"] == parts + memory["generated_code_bytes"]
    assert memory["fits"] is True and memory["headroom_bytes"] > 0
    # what XLA holds at the step's peak: the state and batch (all live in the backward, but for a few scalars) and
    # the step's own buffers, the largest first, each named by its jax operation
    peak = memory["peak"]
    assert peak["argument_bytes"] == pytest.approx(memory["argument_bytes"], rel=0.01)
    assert peak["argument_bytes"] < peak["live_bytes"] <= parts
    sizes = [b["bytes"] for b in peak["buffers"]]
    assert sizes == sorted(sizes, reverse=True) and not any(b["argument"] for b in peak["buffers"])
    assert any("transpose(jvp())" in b["operation"] for b in peak["buffers"])  # the backward's
    assert all(b["shape"].startswith(("f32[", "bf16[", "s32[", "u32[")) for b in peak["buffers"])
    cost = json.loads((d / "cost.json").read_text())
    assert cost["flops_per_device"] > 0 and "flops_source" in cost
    assert "module @" in (d / "hlo/lowered.stablehlo.mlir").read_text()
    assert "HloModule" in (d / "hlo/optimized.hlo.txt").read_text()


def test_cpu_artifact_loads_and_runs_one_step(cpu8):
    from maxperf.models import train_step

    artifact = aot.load(cpu8.out_dir / "compiled.pkl")
    spec, step = artifact.step(jax.devices()[:8])
    state = train_step.init_state(spec, seed=0)
    batch = train_step.synthetic_batch(spec, seed=0)
    _, metrics = step(state, batch)
    assert math.isfinite(float(metrics["loss"]))
    assert int(metrics["tokens"]) == 8 * 2 * 64


MAXTEXT_ACCUMULATION = ["seq_len=16", "per_device_batch_size=8", "gradient_accumulation_steps=4"]


def test_the_lowered_step_takes_a_microbatches_of_b_per_device():
    # MaxText: global batch = devices x per_device_batch_size x gradient_accumulation_steps = 8 x 8 x 4
    from maxperf.aot import targets
    from maxperf.models import train_step
    from maxperf.spec.request import resolve

    p = resolve("cpu-8", "tiny", MAXTEXT_ACCUMULATION)
    assert p.configs.train.global_batch(8) == 256 and p.configs.train.micro_batch(8) == 64
    mesh = targets.jax_mesh(p.topology, p.mesh, jax.devices()[:8])
    spec = train_step.abstract_step(p.configs.model, p.configs.train, mesh)
    assert spec.batch["inputs"].shape == (256, 16) and spec.micro_batch == 64
    with jax.set_mesh(mesh):
        lowered = train_step.jit_step(spec).lower(spec.state, spec.batch).as_text()
    main = next(line for line in lowered.splitlines() if "func.func public @main" in line)
    assert main.count("tensor<256x16xi32>") == 2 and "tensor<256x16xi1>" in main  # inputs, targets, mask
    assert "tensor<4x64x16xi32>" in lowered  # 4 microbatches of 64 rows


@pytest.mark.slow
def test_per_device_batch_size_is_one_microbatch_as_in_maxtext(tmp_path):
    from maxperf.models import train_step

    result = aot.compile("cpu-8", "tiny", MAXTEXT_ACCUMULATION, out=tmp_path / "a")
    assert result.global_batch == 256
    manifest = json.loads((result.out_dir / "manifest.json").read_text())
    assert (manifest["global_batch"], manifest["micro_batch"], manifest["tokens_per_step"]) == (256, 64, 256 * 16)
    lowered = (result.out_dir / "hlo/lowered.stablehlo.mlir").read_text()
    main = next(line for line in lowered.splitlines() if "func.func public @main" in line)
    assert main.count("tensor<256x16xi32>") == 2 and "tensor<256x16xi1>" in main  # inputs, targets, mask
    assert "tensor<4x64x16xi32>" in lowered  # 4 microbatches of 64 rows
    spec, step = aot.load(result.out_dir / "compiled.pkl").step(jax.devices()[:8])
    assert spec.batch["inputs"].shape == (256, 16) and spec.micro_batch == 64
    _, metrics = step(train_step.init_state(spec, seed=0), train_step.synthetic_batch(spec, seed=0))
    assert int(metrics["tokens"]) == 256 * 16


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_altered_compiled_pkl_is_refused(cpu8, tmp_path):
    d = _copy(cpu8.out_dir, tmp_path / "altered")
    data = bytearray((d / "compiled.pkl").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "compiled.pkl").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        aot.load(d)


def test_truncated_compiled_pkl_is_refused(cpu8, tmp_path):
    d = _copy(cpu8.out_dir, tmp_path / "truncated")
    data = (d / "compiled.pkl").read_bytes()
    (d / "compiled.pkl").write_bytes(data[: len(data) // 3])
    with pytest.raises(ArtifactError, match="altered or truncated"):
        aot.load(d)


def _rehash(d: Path) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"] = {name: artifacts.sha256(d / name) for name in manifest["files"]}
    (d / "manifest.json").write_text(json.dumps(manifest))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_crafted_pickle_is_refused_without_running_anything(cpu8, tmp_path):
    d = _copy(cpu8.out_dir, tmp_path / "crafted")
    (d / "compiled.pkl").write_bytes(pickle.dumps({"schema": artifacts.COMPILED_SCHEMA, "executable": _RunsCode()}))
    _rehash(d)  # even with matching hashes
    with pytest.raises(ArtifactError, match="posix.system|os.system"):
        aot.load(d)
    assert not Path("pwned").exists()


def test_crafted_executable_payload_is_refused(cpu8, tmp_path):
    d = _copy(cpu8.out_dir, tmp_path / "payload")
    blob = artifacts.read_plain_pickle((d / "compiled.pkl").read_bytes())
    blob["executable"] = pickle.dumps(_RunsCode())
    (d / "compiled.pkl").write_bytes(pickle.dumps(blob))
    _rehash(d)
    with pytest.raises(ArtifactError, match="never writes"):
        aot.load(d)


def test_other_library_versions_are_refused(cpu8, tmp_path):
    d = _copy(cpu8.out_dir, tmp_path / "versions")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["versions"]["jaxlib"] = "0.0.1"
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="jaxlib 0.0.1"):
        aot.load(d)


def test_missing_artifact_is_a_clear_error(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        aot.load(tmp_path / "nothing" / "compiled.pkl")


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology, slices, devices",
    [("v5p-8", 1, 4), ("v5e-4", 1, 4), ("v5p-8", 2, 8), ("h100-8", 1, 8)],
)
def test_compiles_for_virtual_topologies(tmp_path, topology, slices, devices):
    result = aot.compile(topology, "tiny", TINY, num_slices=slices, out=tmp_path / "out")
    assert result.fits
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["topology"]["devices"] == devices
    assert math.prod(manifest["mesh"]["axes"].values()) == devices
    assert result.global_batch == 2 * devices
    cost = json.loads((tmp_path / "out" / "cost.json").read_text())
    assert cost["flops_per_device"] > 0
    peak = json.loads((tmp_path / "out" / "memory.json").read_text())["peak"]  # XLA's live ranges on every target
    assert peak["live_bytes"] > peak["argument_bytes"] > 0 and peak["buffers"]
    if topology.startswith("h100"):
        assert cost["xla_flops_per_device"] is None  # the GPU compiler gives none without a GPU
        assert any("cost analysis" in note for note in result.limitations)
    else:
        assert cost["xla_flops_per_device"] > 0
    if slices > 1:
        assert manifest["mesh"]["dcn"]["data"] == slices


def test_tpu_slices_are_the_tori_maxtext_compiles_for():
    """The ICI rings MaxText's accelerator_to_spec_map gives libtpu (its `wrap`): every side of whole 4x4x4 cubes,
    the 16-chip sides of v5e/v6e slices; smaller slices are open lines."""
    from maxperf.aot import targets
    from maxperf.spec import topology as topologies

    def wrap(name):
        return targets.torus_wrap(topologies.get(name).torus)

    assert wrap("v5p-64") == wrap("v6e-8") == wrap("v5e-64") == (False, False, False)
    assert wrap("v5p-128") == wrap("v5p-1024") == wrap("v4-128") == wrap("tpu7x-128") == (True, True, True)
    assert wrap("v5e-128") == (False, True, False) and wrap("v6e-256") == (True, True, False)
    assert len(targets.devices(topologies.get("v5p-128"))) == 64  # libtpu takes the rings


def test_bad_plans_are_errors_before_compiling():
    with pytest.raises(MaxperfError, match="v5p-1024"):
        spec.resolve("v5p-1023", "tiny")
    with pytest.raises(MaxperfError, match="llama3-8b"):
        spec.resolve("v5p-8", "llama3-8")
    with pytest.raises(MaxperfError, match="does not divide 4"):
        spec.resolve("v5p-8", "tiny", ["ici_tensor=3"])


@pytest.mark.slow
def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    for args, needle in [
        (["compile", "--topology", "v5p-1023"], "did you mean"),
        (["compile", "--topology", "v5p-8", "--model", "lama2-7b"], "llama2-7b"),
        (["compile", "--topology", "cpu-8", "--model", "tiny", "ici_tensor=3"], "ici_tensor=3"),
        (["compile", "--topology", "cpu-8", "--model", "tiny", "remat_policy=fulll"], "did you mean full"),
        (["compile", "--topology", "cpu-8", "--model", "tiny", "per_device_batch_size=-1"],
         "> 0 (a fraction such as 0.5 is allowed), got -1"),
    ]:
        proc = maxperf(*args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("maxperf: error:")
    assert not any(tmp_path.iterdir())  # nothing half-written


VMEM_FORMS = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of memory in memory space vmem while "
              "allocating on stack for %splash_mha_fwd_residuals.17",
              "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem. Used "
              "286.25M of 127.94M vmem. Exceeded vmem capacity by 158.32M.")


@pytest.mark.parametrize("message", VMEM_FORMS)
def test_a_kernel_out_of_vmem_is_not_called_out_of_device_memory(message):
    """libtpu's two forms of a kernel whose blocks overflow the TensorCore's vector memory: not an HBM verdict (the
    second's 'Used 286.25M of 127.94M' is VMEM, not the device's memory)."""
    from maxperf.aot import compiler

    assert compiler.scoped_vmem_exhausted(message) and compiler.out_of_memory_figures(message) is None
    line = compiler.vmem_error(message)
    assert "VMEM" in line and "not HBM" in line and "sa_block_q" in line and "xla_tpu_scoped_vmem_limit_kib" in line
    hbm = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 103.53G "
           "of 95.74G hbm.")
    assert not compiler.scoped_vmem_exhausted(hbm) and compiler.out_of_memory_figures(hbm)


def test_a_flag_libtpu_refuses_on_the_chip_is_named_with_what_to_set():
    """MaxText's v5p 64b.sh sets continuation fusion of all-gathers, which this libtpu refuses on v5p: the error names
    the flag and what to set instead, and is neither an out-of-memory verdict nor a VMEM one."""
    from maxperf.aot import compiler

    message = ("FAILED_PRECONDITION: Continuation fusion for AllGather is enabled on platform viperfish (variant: ), "
               "but it is not supported/recommended on platforms other than TPU v5e, and this might lead to many "
               "errors including but not limited to: incorrect results, hang, SDC, etc. Please disable it.")
    line = compiler.refused_flag_error(message)
    assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true" in line and "=false" in line
    assert "TPU v5e alone" in line and "\n" not in line
    assert compiler.out_of_memory_figures(message) is None and not compiler.scoped_vmem_exhausted(message)
    assert compiler.refused_flag_error(VMEM_FORMS[0]) is None
    assert compiler.known_failure_line(message) == line
    assert compiler.known_failure_line(VMEM_FORMS[0]) == compiler.vmem_error(VMEM_FORMS[0])


def test_an_out_of_memory_compile_counts_the_arguments_once():
    """libtpu's "HLO temporaries" figure at least as large as the arguments holds them (a decode step one sequence
    past fitting: 15.94 GiB beside 15.77 of arguments needs about 16, not 31.7); a smaller one cannot, and they add."""
    from maxperf.aot import compiler

    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
               "HLO temporaries (15.94G) exceeds available HBM (15.75G). HLO module: jit_decode.")
    figures = compiler.out_of_memory_figures(message)
    assert figures["temp_bytes"] == int(15.94 * 2**30) and figures["compiler_available_bytes"] == int(15.75 * 2**30)
    args = 16927813056
    assert compiler.oom_total(figures["temp_bytes"], args) == {
        "argument_bytes": args, "temp_bytes": figures["temp_bytes"] - args,
        "per_device_total_bytes": figures["temp_bytes"]}
    assert compiler.oom_total(2 * 2**30, 10 * 2**30) == {"argument_bytes": 10 * 2**30, "temp_bytes": 2 * 2**30,
                                                         "per_device_total_bytes": 12 * 2**30}


def test_the_compile_cache_keys_the_environments_compiler_flags(monkeypatch):
    from maxperf.aot import compiler

    monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    plain = compiler.cache_versions()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert compiler.cache_versions() == plain  # the host device count is the topology's
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=131072")
    raised = compiler.cache_versions()
    assert raised != plain and raised["LIBTPU_INIT_ARGS"] == "--xla_tpu_scoped_vmem_limit_kib=131072"


@pytest.mark.slow
def test_splash_blocks_beyond_the_vmem_limit_are_one_line_and_the_limit_raised_compiles(tmp_path):
    """Splash blocks of 4096 overflow v6e's default scoped VMEM: one line naming VMEM and what to change, exit 2,
    nothing written, no 'does not fit'; with the limit raised as the line says, the same step compiles."""
    argv = ["compile", "--topology", "v6e-1", "--model", "tiny", "seq_len=4096", "attention=flash",
            "sa_use_fused_bwd_kernel=true", *(f"{k}=4096" for k in ("sa_block_q", "sa_block_kv", "sa_block_kv_compute",
                                                                    "sa_block_q_dkv", "sa_block_kv_dkv",
                                                                    "sa_block_kv_dkv_compute"))]
    env = {**os.environ, "MAXPERF_NO_CACHE": "1", "LIBTPU_INIT_ARGS": ""}
    proc = maxperf(*argv, "--out", str(tmp_path / "small"), cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr  # the blocks asked for: bad input
    assert "VMEM" in proc.stderr and "does not fit" not in proc.stderr and "Traceback" not in proc.stderr
    assert [line.startswith("maxperf: error:") for line in proc.stderr.splitlines()].count(True) == 1
    assert not (tmp_path / "small").exists()
    raised = {**env, "LIBTPU_INIT_ARGS": "--xla_tpu_scoped_vmem_limit_kib=131072"}
    proc = maxperf(*argv, "--out", str(tmp_path / "raised"), cwd=tmp_path, env=raised)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "raised" / "manifest.json").read_text())
    assert manifest["compiler_environment"]["LIBTPU_INIT_ARGS"] == "--xla_tpu_scoped_vmem_limit_kib=131072"


@pytest.mark.slow
def test_out_of_memory_is_a_verdict_with_exit_code_3(tmp_path):
    proc = maxperf("compile", "--topology", "v5e-1", "--model", "tiny", "--out", str(tmp_path / "oom"),
                   "d_model=8192", "d_ff=32768", "num_heads=64", "num_kv_heads=64", "head_dim=128",
                   "vocab_size=256000", "num_layers=4", "seq_len=128", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "does not fit" in proc.stderr and "Traceback" not in proc.stderr
    memory = json.loads((tmp_path / "oom" / "memory.json").read_text())
    assert memory["fits"] is False
    assert memory["per_device_total_bytes"] > memory["hbm_bytes"]
    assert not (tmp_path / "oom" / "compiled.pkl").exists()
    with pytest.raises(ArtifactError, match="did not compile"):
        aot.load(tmp_path / "oom")
