"""What `maxperf run` does for GPU artifacts before jax starts, and how it reports a step that runs out of memory."""

import types

from maxperf.aot import gpu_targets, topologies
from maxperf.cli import run as run_cli


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
    assert topologies.compiles_on_attached_gpus(topologies.get("h100-1")) is None
    assert any("without a GPU" in note for note in topologies.limitations(topologies.get("h100-1")))
