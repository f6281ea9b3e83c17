"""MaxText's optimizer_memory_host_offload and parameter_memory_host_offload: the state in pinned host memory between
steps, in the compiled step (memory kinds) and in perfmodel (host memory, HBM, the host link)."""

import importlib.util
import json
from dataclasses import replace

import pytest
from perfmodel_util import Topo

from maxperf.perfmodel import estimate
from maxperf.perfmodel.chips import CHIPS
from maxperf.perfmodel.memory import OFFLOADED_OPTIMIZER_STAGED, params_per_device
from maxperf.spec import overrides, presets
from maxperf.spec.mesh import Mesh
from maxperf.spec.request import Request
from maxperf.spec.train import OPTIMIZER_STATES_PER_PARAM, TrainConfig

LLAMA = presets.get("llama2-7b")
TRAIN = TrainConfig(per_device_batch_size=4, seq_len=2048)
V5P_128 = Topo("tpu-v5p", 64, hosts=16, torus=(4, 4, 4))


def _estimate(**offload):
    return estimate(Request.of(V5P_128, LLAMA, replace(TRAIN, **offload), {"fsdp": 64}, {}))


def _state_bytes():
    return params_per_device(LLAMA, Mesh.of({"fsdp": 64}, {}).check(V5P_128)) * 4  # float32 parameters


def test_maxtext_keys_parse():
    cfg = overrides.apply(presets.get("tiny"), ["optimizer_memory_host_offload=true",
                                                 "parameter_memory_host_offload=true"])
    assert cfg.train.optimizer_memory_host_offload and cfg.train.parameter_memory_host_offload


def test_offloaded_optimizer_state_moves_from_hbm_to_host_memory():
    base, off = _estimate().memory, _estimate(optimizer_memory_host_offload=True).memory
    optimizer = OPTIMIZER_STATES_PER_PARAM * _state_bytes()
    assert base.optimizer == pytest.approx(optimizer) and base.host_state == 0
    assert off.optimizer == 0 and off.host_state == pytest.approx(optimizer)
    assert off.optimizer_staged == pytest.approx(OFFLOADED_OPTIMIZER_STAGED * optimizer)
    assert base.per_device_total_bytes - off.per_device_total_bytes == pytest.approx(
        (1 - OFFLOADED_OPTIMIZER_STAGED) * optimizer)
    assert off.as_dict()["host_bytes"] == off.host_bytes == off.host_state


def test_offloaded_parameters_are_in_host_memory_and_in_hbm_for_the_step():
    base, off = _estimate().memory, _estimate(parameter_memory_host_offload=True).memory
    assert off.host_state == pytest.approx(_state_bytes())
    assert off.per_device_total_bytes == base.per_device_total_bytes  # the forward and backward read them on device


@pytest.mark.parametrize("offload, states", [
    ({"optimizer_memory_host_offload": True}, 2),
    ({"parameter_memory_host_offload": True}, 1),
    ({"optimizer_memory_host_offload": True, "parameter_memory_host_offload": True}, 3),
])
def test_offloaded_state_crosses_the_host_link_both_ways(offload, states):
    rows = {row.name: row for row in _estimate(**offload).breakdown}
    moved = 2 * states * _state_bytes()
    row = rows["state offload (host link)"]
    assert row.kind == "host" and row.bytes == pytest.approx(moved)
    assert row.seconds == pytest.approx(moved / CHIPS["tpu-v5p"].host_link_bandwidth)
    assert "state offload (host link)" not in {row.name for row in _estimate().breakdown}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs the tpu extra: pip install 'maxperf[tpu]'")
def test_offloaded_state_compiles_for_tpu_in_pinned_host_memory(tmp_path):
    from maxperf.aot import compiler

    def memory(*keys):
        return compiler.compile("v5p-8", "tiny", ["seq_len=256", *keys], out=tmp_path / str(len(keys))).memory

    base = memory()
    opt = memory("optimizer_memory_host_offload=true")
    both = memory("optimizer_memory_host_offload=true", "parameter_memory_host_offload=true")
    assert base["host_argument_bytes"] == 0
    # what leaves the device's arguments is what pinned host memory holds, donated and updated in place
    for m in (opt, both):
        assert m["host_argument_bytes"] == base["argument_bytes"] - m["argument_bytes"] == m["host_alias_bytes"]
    params = both["host_argument_bytes"] - opt["host_argument_bytes"]
    assert params == opt["argument_bytes"] - both["argument_bytes"]
    # AdamW's two moments per parameter, beside the step counts (scalars, a padded tile each at most)
    assert abs(opt["host_argument_bytes"] - OPTIMIZER_STATES_PER_PARAM * params) <= 1024


def test_a_moe_layer_offloads_its_experts_rows_across_the_host_link():
    """remat_policy=custom mlpwo=offload: a MoE layer's experts' output is top-k rows of D per token, and the step
    time carries them over the host link both ways (the memory model counts them already: saved.over_layers)."""
    from maxperf.spec.request import resolve

    words = ["per_device_batch_size=2", "seq_len=256", "remat_policy=custom"]
    cfg = resolve("v5p-8", "tiny-moe", words).configs
    m, T = cfg.model, 2 * 256
    host = {}
    for extra in ((), ("mlpwo=offload",)):
        e = estimate(resolve("v5p-8", "tiny-moe", [*words, "decoder_layer_input=offload", *extra]))
        host[extra] = next(b.bytes for b in e.breakdown if b.name == "remat offload (host link)")
    rows = m.num_experts_per_tok * m.d_model * 2  # bf16 rows of the k experts each token went to
    assert host[("mlpwo=offload",)] - host[()] == pytest.approx(2 * m.num_layers * T * rows, rel=1e-9)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs the tpu extra: pip install 'maxperf[tpu]'")
def test_compile_says_the_pinned_host_memory_beside_perfmodels(tmp_path):
    from cli_util import maxperf

    proc = maxperf("compile", "--topology", "v5p-8", "--model", "tiny", "seq_len=256",
                   "optimizer_memory_host_offload=true", "--out", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    memory = json.loads((tmp_path / "a" / "memory.json").read_text())
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("host memory"))
    assert f"{memory['host_argument_bytes'] / 2**30:.2f} GiB pinned per device (perfmodel " in line
    plain = maxperf("compile", "--topology", "v5p-8", "--model", "tiny", "seq_len=256", "--out", str(tmp_path / "b"))
    assert plain.returncode == 0 and "host memory" not in plain.stdout
