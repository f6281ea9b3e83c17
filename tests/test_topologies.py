"""The topology catalog, its compile-only devices and meshes (tests/conftest.py gives jax 8 CPU devices)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from maxperf.aot import targets
from maxperf.spec import gpu_targets
from maxperf.spec import topology as T
from maxperf.spec.errors import MaxperfError
from maxperf.spec.mesh import Mesh

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAVE_CUDA_PLUGIN = gpu_targets.plugin_library() is not None
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (maxperf[tpu])")
needs_cuda_plugin = pytest.mark.skipif(not HAVE_CUDA_PLUGIN, reason="CUDA plugin not installed (maxperf[gpu])")

# cloud.google.com/tpu/docs/v5p, "Configurations": accelerator type -> (topology, chips, hosts)
CLOUD_V5P_TABLE = {
    "v5p-8": ("2x2x1", 4, 1), "v5p-16": ("2x2x2", 8, 2), "v5p-64": ("2x4x4", 32, 8), "v5p-128": ("4x4x4", 64, 16),
    "v5p-256": ("4x4x8", 128, 32), "v5p-512": ("4x8x8", 256, 64), "v5p-1024": ("8x8x8", 512, 128),
    "v5p-2048": ("8x8x16", 1024, 256), "v5p-4096": ("8x16x16", 2048, 512), "v5p-8192": ("16x16x16", 4096, 1024),
    "v5p-12288": ("16x16x24", 6144, 1536),
}


# --- catalog facts ------------------------------------------------------------------------------------------------


def test_v5p_1024_is_512_chips_on_128_hosts():
    t = T.get("v5p-1024")
    assert (t.platform, t.chip, t.chips, t.hosts, t.chips_per_host) == ("tpu", "tpu-v5p", 512, 128, 4)
    assert t.libtpu_topology == "v5p:8x8x8" and t.torus == (8, 8, 8)


@pytest.mark.parametrize("name", sorted(CLOUD_V5P_TABLE))
def test_v5p_matches_cloud_table(name):
    shape, chips, hosts = CLOUD_V5P_TABLE[name]
    t = T.get(name)
    assert (t.libtpu_topology, t.chips, t.hosts) == (f"v5p:{shape}", chips, hosts)


def test_largest_slice_per_family():
    largest = {}
    for t in T.catalog():
        if t.platform == "tpu":
            family = t.name.split("-")[0]
            largest[family] = max(largest.get(family, 0), t.chips)
    assert largest == {"v4": 2048, "v5e": 256, "v5p": 6144, "v6e": 256, "tpu7x": 9216}


def test_names_count_tensorcores_for_v4_v5p_tpu7x_and_chips_for_v5e_v6e():
    assert T.get("v4-8").chips == 4
    assert T.get("tpu7x-8").chips == 4
    one = T.get("tpu7x-2")  # one chip, its two TensorCores (GKE's 1x1x1 node)
    assert (one.chips, one.hosts, one.libtpu_topology, one.num_devices) == (1, 1, "tpu7x:1x1x1", 2)
    assert T.get("v5e-256").chips == 256 and T.get("v5e-256").hosts == 64
    assert T.get("v6e-8").chips == 8


def test_v5e_and_v6e_up_to_8_chips_are_one_host():
    for name in ("v5e-1", "v5e-4", "v5e-8", "v6e-8"):
        assert T.get(name).hosts == 1, name
    assert T.get("v5e-16").hosts == 4


def test_whole_cube_slices_take_the_most_cubic_shape():
    assert T.get("v5p-768").libtpu_topology == "v5p:4x8x12"  # 6 cubes
    assert T.get("v5p-9216").libtpu_topology == "v5p:12x16x24"  # 72 cubes
    assert T.get("v4-384").libtpu_topology == "v4:4x4x12"


def test_v5litepod_is_an_alias_of_v5e():
    assert T.get("v5litepod-16") == T.get("v5e-16")
    assert T.get("V5P-8") == T.get("v5p-8")


@pytest.mark.parametrize("grid, name", [("tpu7x-4x4x4", "tpu7x-128"), ("tpu7x-8x4x4", "tpu7x-256"),
                                        ("v5p-2x2x1", "v5p-8"), ("v6e-16x16", "v6e-256"), ("v6e-4x4", "v6e-16"),
                                        ("v5litepod-2x4", "v5e-8"), ("v4-4x4x8", "v4-256")])
def test_a_tpu_slice_may_be_named_by_its_chip_grid(grid, name):
    """xpk's --device-type and GKE's topology name a slice by its chips' grid, sides in any order."""
    assert T.get(grid) == T.get(name)


def test_a_chip_grid_no_slice_has_names_the_nearest_shapes():
    with pytest.raises(MaxperfError, match=r"no tpu7x slice has the chip grid 4x4x5 \(80 chips\); the nearest are "
                                           r"4x4x4 \(tpu7x-128\), 4x4x8 \(tpu7x-256\)"):
        T.get("tpu7x-4x4x5")
    assert T.get("h100-8x2").chip == "h100-sxm"  # a GPU system's count of hosts, not a chip grid


def test_unknown_topology_suggests_close_names():
    with pytest.raises(MaxperfError, match="did you mean.*v5p-1024"):
        T.get("v5p-1023")
    with pytest.raises(MaxperfError, match="unknown topology"):
        T.get("v9-8")


def test_num_slices_multiplies_chips_and_hosts():
    t = T.get("v5e-256", num_slices=32)
    assert (t.chips, t.hosts, t.num_slices, t.ici_domains) == (8192, 2048, 32, 32)
    for bad in (0, -1, 1.5):
        with pytest.raises(MaxperfError, match="num_slices"):
            T.get("v5p-8", num_slices=bad)


def test_num_slices_is_bounded_by_what_exists():
    assert T.get("v5e-256", num_slices=T.MAX_SLICES).chips == 256 * T.MAX_SLICES
    assert 199 <= T.MAX_SLICES < 1000  # at least the largest multislice job published (199 slices of v5e-256)
    with pytest.raises(MaxperfError, match=f"at most {T.MAX_SLICES} slices"):
        T.get("v5p-64", num_slices=T.MAX_SLICES + 1)
    from cli_util import maxperf

    for command in (["estimate", "--model", "tiny"], ["plan", "--model", "tiny", "--verify", "0"]):
        proc = maxperf(*command, "--topology", "v5p-64", "--num-slices", "100000000")
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("maxperf: error: num_slices 100000000 is beyond any machine") \
            and f"at most {T.MAX_SLICES} slices" in proc.stderr


def test_gpu_and_cpu_names():
    h = T.get("h100-8x16")
    assert (h.platform, h.chip, h.chips, h.hosts, h.torus) == ("gpu", "h100-sxm", 128, 16, (16, 8))
    assert h.ici_domains == 16  # NVLink inside a host, InfiniBand across
    assert T.get("a100-8").chip == "a100-80gb" and T.get("a100-40gb-8x2").chip == "a100-40gb"
    g = T.get("gb200-72x2")
    assert (g.chips, g.hosts, g.chips_per_host, g.ici_domains) == (144, 36, 4, 2)
    # part of a rack: its trays in one NVLink domain; racks of which a job takes 64 GPUs each
    p = T.get("gb200-8")
    assert (p.chips, p.hosts, p.ici_domains, p.devices_per_ici_domain) == (8, 2, 1, 8)
    r = T.get("gb200-64x4")
    assert (r.chips, r.hosts, r.ici_domains, r.devices_per_ici_domain) == (256, 64, 4, 64)
    c = T.get("cpu-3")
    assert (c.platform, c.chip, c.chips) == ("cpu", "cpu", 3)


def test_as_dict_has_the_listed_fields():
    d = T.get("h200-8x4").as_dict()
    for key in ("name", "platform", "chips", "hosts", "hbm_bytes_per_chip", "peak_bf16_flops_per_chip"):
        assert key in d
    assert (d["name"], d["chips"], d["hosts"]) == ("h200-8x4", 32, 4)


def test_chip_specs_come_from_the_perfmodel():
    from maxperf.perfmodel import chips

    for t in (T.get("v5p-8"), T.get("tpu7x-8"), T.get("cpu-1")):
        # a TPU's memory is what libtpu lets a program hold, a little under the chip's HBM
        usable = chips.get(t.chip).usable_hbm_bytes
        assert t.target_hbm_bytes == (None if usable is None else int(usable))
        assert t.hbm_bytes_per_chip == (t.target_hbm_bytes or chips.get(t.chip).hbm_bytes)
        assert t.peak_bf16_flops_per_chip == chips.get(t.chip).peak_bf16_flops
    assert 0.97 * 96 * 2**30 < T.get("tpu7x-8").hbm_bytes_per_device < 96 * 2**30
    tpu7x = T.get("tpu7x-8")
    assert tpu7x.hbm_bytes_per_device * 2 == pytest.approx(tpu7x.hbm_bytes_per_chip, abs=1)


# --- GPU target specs ---------------------------------------------------------------------------------------------


@needs_cuda_plugin
def test_embedded_gpu_specs_are_found_for_every_catalog_gpu():
    for chip, device in gpu_targets.CHIP_TO_DEVICE.items():
        text = gpu_targets.gpu_target_config(chip)
        assert text.startswith("# proto-message: stream_executor.GpuTargetConfigProto")
        assert f'device_description_str: "{device}"' in text
    assert gpu_targets.device_memory_bytes(gpu_targets.gpu_target_config("h100-sxm")) == 84942979072


@needs_cuda_plugin
def test_gpu_memory_comes_from_the_target_spec_compiled_for():
    from maxperf.aot.compiler import device_memory_bytes
    from maxperf.perfmodel import estimate
    from maxperf.spec.request import resolve

    t = T.get("h100-8x2")
    spec = gpu_targets.device_memory_bytes(gpu_targets.gpu_target_config("h100-sxm"))
    assert t.target_hbm_bytes == t.hbm_bytes_per_chip == spec == 84942979072  # not the datasheet's 80e9
    p = resolve("h100-8", "tiny")
    est = estimate(p)
    # the estimate's verdict and the compiler's memory.json divide the same memory
    assert est.memory.hbm_bytes == device_memory_bytes(p.topology) == spec and est.notes == ()


def test_gpu_memory_without_the_plugin_is_the_datasheets_and_says_so(monkeypatch, capsys):
    from maxperf.spec import notes

    monkeypatch.setattr(notes, "_said", set())  # said once per process: this test must see it said
    monkeypatch.setattr(gpu_targets, "plugin_library", lambda: None)
    t = T.get("b200-8")
    assert t.target_hbm_bytes is None and t.hbm_bytes_per_chip == 180e9
    assert "b200: GPU memory from the datasheet, not the target spec compiled for" in capsys.readouterr().err


@needs_cuda_plugin
def test_unknown_gpu_target_suggests_names():
    with pytest.raises(MaxperfError, match="unknown GPU target 'h100-sxn'; did you mean h100-sxm"):
        gpu_targets.gpu_target_config("h100-sxn")


def test_target_config_file_is_validated(tmp_path):
    bad = tmp_path / "bad.txtpb"
    bad.write_text("name: 'not a gpu'\n")
    with pytest.raises(MaxperfError, match="not a stream_executor.GpuTargetConfigProto"):
        T.get("h100-8", target_config_path=str(bad))
    with pytest.raises(MaxperfError, match="cannot read target config"):
        T.get("h100-8", target_config_path=str(tmp_path / "missing.txtpb"))
    with pytest.raises(MaxperfError, match="GPU topologies only"):
        T.get("v5p-8", target_config_path=str(bad))


@needs_cuda_plugin
def test_target_config_file_sets_the_device(tmp_path):
    spec = tmp_path / "h200.txtpb"
    spec.write_text(gpu_targets.gpu_target_config("h200"))
    t = T.get("h100-8x2", target_config_path=str(spec))
    assert t.gpu_target == "NVIDIA H200 141GB HBM3e"
    assert t.hbm_bytes_per_chip == 151397597184
    assert targets.devices(t)[0].device_kind == "NVIDIA H200 141GB HBM3e"


def test_missing_plugins_say_what_to_install(monkeypatch):
    monkeypatch.setattr(gpu_targets, "plugin_library", lambda: None)
    with pytest.raises(MaxperfError, match=r"pip install 'maxperf\[gpu\]'"):
        targets._gpu_devices.__wrapped__("1x1x8", "h100-sxm", None)
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    with pytest.raises(MaxperfError, match=r"pip install 'maxperf\[tpu\]'"):
        targets._tpu_devices.__wrapped__("v5p:2x2x1", None, None, 1, "v5p-8")


# --- devices ------------------------------------------------------------------------------------------------------


@needs_libtpu
@pytest.mark.parametrize("name, count, hosts, kind", [
    ("v5p-8", 4, 1, "TPU v5"), ("v4-8", 4, 1, "TPU v4"), ("v5e-8", 8, 1, "TPU v5 lite"),
    ("v6e-16", 16, 4, "TPU v6 lite"), ("tpu7x-8", 8, 1, "TPU7x"), ("v5p-1024", 512, 128, "TPU v5"),
])
def test_tpu_device_counts(name, count, hosts, kind):
    found = targets.devices(T.get(name))
    assert len(found) == count and found[0].device_kind == kind
    assert len({d.process_index for d in found}) == hosts


@needs_libtpu
def test_two_slices_carry_their_slice_index():
    found = targets.devices(T.get("v5p-8", num_slices=2))
    assert len(found) == 8
    assert sorted(d.slice_index for d in found) == [0] * 4 + [1] * 4


@needs_cuda_plugin
@pytest.mark.parametrize("name, hosts", [("h100-8", 1), ("h100-8x16", 16), ("b200-8x2", 2), ("gb200-72", 18),
                                         ("gb200-8", 2), ("gb200-64x4", 64)])
def test_gpu_devices_span_hosts(name, hosts):
    t = T.get(name)
    found = targets.devices(t)
    assert len(found) == t.chips and found[0].device_kind == t.gpu_target
    assert len({d.process_index for d in found}) == hosts


def test_cpu_devices_are_this_process():
    found = targets.devices(T.get("cpu-8"))
    assert len(found) == 8 and all(d.platform == "cpu" for d in found)
    assert targets.devices(T.get("cpu-4")) == found[:4]


def test_cpu_devices_beyond_the_started_count_are_refused():
    targets.devices(T.get("cpu-1"))  # jax is started by now
    with pytest.raises(MaxperfError, match="xla_force_host_platform_device_count=64"):
        targets.devices(T.get("cpu-64"))


def test_ensure_cpu_devices_before_jax_starts():
    code = (
        "from maxperf.aot import targets\n"
        "targets.ensure_cpu_devices(3)\n"
        "import jax; print(len(jax.devices()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


@needs_libtpu
def test_libtpu_startup_warnings_are_hidden():
    code = (
        "from maxperf.aot import targets\n"
        "from maxperf.spec import topology as T\n"
        "print(len(targets.devices(T.get('v5p-8'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")} | {"JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4"
    assert "TPU_ACCELERATOR_TYPE" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr


# --- meshes -------------------------------------------------------------------------------------------------------


@needs_libtpu
def test_hybrid_mesh_puts_slices_on_the_dcn_axis():
    t = T.get("v5p-8", num_slices=2)
    mesh = targets.jax_mesh(t, Mesh(ici={"fsdp": 4}, dcn={"data": 2}))
    assert (mesh.shape["data"], mesh.shape["fsdp"], mesh.devices.size) == (2, 4, 8)
    assert [{d.slice_index for d in row} for row in mesh.devices.reshape(2, 4)] == [{0}, {1}]


@needs_cuda_plugin
def test_gpu_mesh_keeps_each_host_on_the_ici_axes():
    mesh = targets.jax_mesh(T.get("h100-8x4"), Mesh(ici={"fsdp": 8}, dcn={"fsdp": 4}))
    assert mesh.shape["fsdp"] == 32 and mesh.devices.size == 32
    hosts = [d.process_index for d in mesh.devices.flat]
    assert hosts == sorted(hosts) and len(set(hosts)) == 4


def test_mesh_that_does_not_divide_the_devices_is_refused():
    with pytest.raises(MaxperfError, match="multiply to 3 but the topology has 8 devices"):
        targets.jax_mesh(T.get("cpu-8"), Mesh(ici={"data": 3}, dcn={}))
    with pytest.raises(MaxperfError, match="unknown mesh axes model"):
        targets.jax_mesh(T.get("cpu-8"), Mesh.of({"model": 8}))


# --- what a compile needs -----------------------------------------------------------------------------------------


def test_compiler_options_and_limitations():
    no_gpu = targets.compiles_on_attached_gpus(T.get("h100-8")) is None
    cub = {"xla_gpu_enable_cub_radix_sort": False} if no_gpu else {}
    assert targets.compiler_options(T.get("h100-8x16")) == {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": False,
                                                      "xla_gpu_enable_cub_radix_sort": False}
    assert targets.compiler_options(T.get("h100-8")) == cub
    assert targets.compiler_options(T.get("v5p-1024")) == {}
    notes = " ".join(targets.limitations(T.get("h100-8x16")))
    assert "cost analysis" in notes and "autotuning" in notes and "not the production step" in notes
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in notes
    assert any("2 JAX devices" in n for n in targets.limitations(T.get("tpu7x-8")))


@needs_cuda_plugin
def test_a_large_sort_compiles_for_a_gpu_without_the_gpu():
    """XLA's CUB radix sort asks the CUDA runtime for its scratch size while compiling: without a GPU the compile
    failed ("invalid device ordinal") until compiler_options turned it off there."""
    import jax
    import jax.numpy as jnp

    t = T.get("h100-1")
    if targets.compiles_on_attached_gpus(t) is not None:
        pytest.skip("a GPU is attached: the compile uses CUB's sort")
    mesh = targets.jax_mesh(t, Mesh(ici={"data": 1}, dcn={}))
    keys = jax.ShapeDtypeStruct((1 << 20,), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
    lowered = jax.jit(lambda k: jnp.argsort(k, stable=True)).lower(keys)
    with pytest.raises(Exception, match="invalid device ordinal"):
        lowered.compile()
    assert lowered.compile(compiler_options=targets.compiler_options(t)).memory_analysis() is not None


def _toy_compile(topology, mesh):
    """A sharded matmul step with donation, compiled for the topology; returns the compiled executable."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def step(w_DxF, x_BxD):
        y_BxF = x_BxD @ w_DxF
        return w_DxF - 1e-3 * jnp.mean(y_BxF) * w_DxF, jnp.sum(y_BxF)

    n = len(mesh.devices.flat)
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "tensor")))
    x = jax.ShapeDtypeStruct((4 * n, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "tensor"), None)))
    lowered = jax.jit(step, donate_argnums=0).lower(w, x)
    return lowered.compile(compiler_options=targets.compiler_options(topology) or None)


@pytest.mark.parametrize("name, num_slices, ici, dcn", [
    pytest.param("v5p-8", 2, {"tensor": 4}, {"data": 2}, marks=needs_libtpu),
    pytest.param("h100-8x2", 1, {"tensor": 8}, {"data": 2}, marks=needs_cuda_plugin),
    pytest.param("cpu-8", 1, {"data": 2, "tensor": 4}, {}, marks=()),
])
def test_toy_step_compiles_and_serializes(name, num_slices, ici, dcn):
    from jax.experimental.serialize_executable import serialize

    t = T.get(name, num_slices=num_slices)
    mesh = targets.jax_mesh(t, Mesh(ici=ici, dcn=dcn))
    compiled = _toy_compile(t, mesh)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes > 0 and memory.alias_size_in_bytes > 0  # w is donated into the output
    payload, _, _ = serialize(compiled)
    assert len(payload) > 1000


def test_a_gpu_system_takes_any_host_count():
    """Clusters have 3 or 24 hosts, not only powers of two: `h100-8x24` is 24 HGX hosts (it was an unknown
    topology), `gb200-72x6` six racks; past MAX_GPU_UNITS it is refused."""
    t = T.get("h100-8x24")
    assert (t.chips, t.hosts, t.chips_per_host, t.chip) == (192, 24, 8, "h100-sxm")
    assert T.get("gb200-72x6").chips == 432 and T.get("b200-8x3").hosts == 3
    with pytest.raises(MaxperfError, match="unknown topology"):
        T.get(f"h100-8x{T.MAX_GPU_UNITS + 1}")


def test_google_clouds_a3_vms_are_h100_hosts_with_their_own_network():
    """A3 High and A3 Mega: 8 H100s a VM, whose GPUs reach other VMs over 4 and 8 NICs of 200 Gbps
    (cloud.google.com/compute/docs/gpus/gpu-network-bandwidth), where an HGX H100 host has a 400 Gbps NIC per GPU; a
    VM is whole (no `a3-high-4`), and any VM count is a topology as for HGX hosts."""
    high, mega, hgx = T.get("a3-high-8x16"), T.get("a3-mega-8x3"), T.get("h100-8x16")
    assert (high.chip, high.chips, high.hosts, high.ici_domains) == ("h100-sxm", 128, 16, 16)
    assert (high.host_network_bandwidth, mega.host_network_bandwidth) == (800e9 / 8, 1600e9 / 8)
    assert hgx.host_network_bandwidth is None and mega.chips == 24
    assert T.get("a3-high-8").gpu_target == hgx.gpu_target
    with pytest.raises(MaxperfError, match="did you mean a3-high-8"):
        T.get("a3-high-4")
