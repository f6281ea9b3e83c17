"""What `maxperf run` does for GPU artifacts before jax starts, and how it reports a step that runs out of memory."""

import types

import pytest

from maxperf.aot import targets
from maxperf.cli import run as run_cli
from maxperf.spec import gpu_targets
from maxperf.spec import topology as topologies
from maxperf.spec.errors import MaxperfError


def _gpu_artifact(tmp_path, monkeypatch):
    from maxperf.aot import artifacts

    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.setattr(artifacts, "read_manifest",
                        lambda directory: {"devices": {"platform": "gpu", "count": 1, "processes": 1}})
    return types.SimpleNamespace(artifact=str(tmp_path), num_processes=None)


def test_a_gpu_run_gives_the_allocator_the_memory_the_verdict_assumed(tmp_path, monkeypatch):
    for name in run_cli._GPU_ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert run_cli._prepare(_gpu_artifact(tmp_path, monkeypatch)) == "gpu"
    import os

    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"


def test_a_users_allocator_setting_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    run_cli._prepare(_gpu_artifact(tmp_path, monkeypatch))
    import os

    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_out_of_memory_is_one_line_with_the_allocators_share(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    error = RuntimeError("Traceback noise\nRESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.57GiB with "
                         "allocator GPU_0_bfc on device 0.\nmore noise")
    oom = run_cli.out_of_memory(error)
    assert oom is not None and oom.exit_code == 1
    assert "\n" not in str(oom) and "17.57GiB" in str(oom) and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in str(oom)
    assert run_cli.out_of_memory(RuntimeError("INTERNAL: something else")) is None


def test_part_host_gpu_topologies_are_one_host_of_fewer_gpus():
    one = topologies.get("h100-1")
    assert (one.num_devices, one.hosts, one.chips_per_host, one.platform) == (1, 1, 1, "gpu")
    four = topologies.get("a100-4")
    assert (four.num_devices, four.hosts, four.gpu_target) == (4, 1, "NVIDIA A100-SXM4-80GB")
    assert "h100-1" in [t.name for t in topologies.catalog()]


def test_no_attached_gpu_means_a_compile_without_one(monkeypatch):
    monkeypatch.setattr(gpu_targets, "driver_present", lambda: False)
    assert gpu_targets.attached_gpus("h100-sxm", 1) is None
    assert targets.compiles_on_attached_gpus(topologies.get("h100-1")) is None
    assert any("without a GPU" in note for note in targets.limitations(topologies.get("h100-1")))


def test_attached_gpus_are_recognised_by_every_name_the_runtime_gives_their_chip(monkeypatch):
    class Gpu:
        def __init__(self, kind):
            self.device_kind = kind

    import jax

    monkeypatch.setattr(gpu_targets, "driver_present", lambda: True)
    for kind, chip in [("NVIDIA H200", "h200"), ("NVIDIA H200 141GB HBM3e", "h200"), ("NVIDIA H100 80GB HBM3",
                                                                                       "h100-sxm")]:
        monkeypatch.setattr(jax, "devices", lambda backend=None, kind=kind: [Gpu(kind)])
        assert [g.device_kind for g in gpu_targets.attached_gpus(chip, 1)] == [kind]
        assert gpu_targets.attached_gpus(chip, 2) is None  # fewer attached than the topology has
    monkeypatch.setattr(jax, "devices", lambda backend=None: [Gpu("NVIDIA H200")])
    assert gpu_targets.attached_gpus("h100-sxm", 1) is None and not gpu_targets.is_chip("NVIDIA H20", "h200")


def test_attached_gpus_that_do_not_serve_the_topology_are_named(monkeypatch):
    """A GPU host whose GPUs are another chip, or too few, compiles without them: the notes say why, and where no
    target spec is at hand either the error names both reasons."""
    class Gpu:
        device_kind = "NVIDIA H200"

    import jax

    monkeypatch.setattr(gpu_targets, "driver_present", lambda: True)
    monkeypatch.setattr(jax, "devices", lambda backend=None: [Gpu()])
    assert gpu_targets.chip_of_kind("NVIDIA H200") == "h200" and gpu_targets.chip_of_kind("NVIDIA L4") is None
    assert gpu_targets.unserved_by_attached("h200", 1) is None
    assert gpu_targets.unserved_by_attached("h200", 8) == ("this machine's 1 GPU is an NVIDIA H200 (h200): a topology "
                                                          "of 8 needs 8 attached")
    assert gpu_targets.unserved_by_attached("h100-sxm", 1) == (
        "this machine's 1 GPU is an NVIDIA H200 (h200), not the topology's NVIDIA H100 80GB HBM3 (h100-sxm)")
    assert any(n == "compiled without the attached GPUs: this machine's 1 GPU is an NVIDIA H200 (h200), not the "
               "topology's NVIDIA H100 80GB HBM3 (h100-sxm)" for n in targets.limitations(topologies.get("h100-1")))

    def no_specs(*args):
        raise MaxperfError("no GPU target specs found in plugin.so; this plugin version embeds none")

    monkeypatch.setattr(targets, "_gpu_devices", no_specs)
    with pytest.raises(MaxperfError) as e:
        targets.devices(topologies.get("h200-8"))
    assert str(e.value) == ("no GPU target specs found in plugin.so; this plugin version embeds none; and the step "
                            "cannot compile on the attached GPUs instead: this machine's 1 GPU is an NVIDIA H200 "
                            "(h200): a topology of 8 needs 8 attached")
    monkeypatch.setattr(gpu_targets, "driver_present", lambda: False)  # no GPU here: the error as it was
    with pytest.raises(MaxperfError, match="^no GPU target specs found in plugin.so; this plugin version embeds none$"):
        targets.devices(topologies.get("h200-8"))


def test_an_autotuner_failure_is_not_called_out_of_memory():
    from maxperf.aot.compiler import out_of_memory_figures

    assert out_of_memory_figures("NOT_FOUND: All configs failed during profiling or were excluded from selection. "
                                 "(one config: RESOURCE_EXHAUSTED: out of memory)") is None
    assert out_of_memory_figures("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
                                 "space hbm. Used 103.53G of 95.74G hbm.") == {
        "per_device_total_bytes": int(103.53 * 2**30), "compiler_available_bytes": int(95.74 * 2**30)}


def test_a_gpu_step_compiled_without_the_gpu_says_its_timings_are_not_productions(capsys):
    from maxperf.profiler.run import untuned_gpu_step

    notes = untuned_gpu_step({"gpu_autotuned": False})
    assert len(notes) == 1 and "without a GPU" in notes[0] and "13-24x" in notes[0]
    assert "without a GPU" in capsys.readouterr().err
    assert untuned_gpu_step({"gpu_autotuned": True}) == [] and untuned_gpu_step({"gpu_autotuned": None}) == []
    assert untuned_gpu_step({}) == []
