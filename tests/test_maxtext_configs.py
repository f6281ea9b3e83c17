"""bench/maxtext_configs.py reads MaxText's published TPU scripts into maxperf command lines, and maxperf takes every
flag of them (no compile here: the bench compiles)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from maxperf.spec import overrides, presets

ROOT = Path(__file__).resolve().parent.parent
TPU_DIR = Path(__file__).resolve().parent / "data" / "maxtext_configs" / "tpu"


def _bench():
    spec = importlib.util.spec_from_file_location("maxtext_configs", ROOT / "bench" / "maxtext_configs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _bench()


def _parse(path: str):
    return bench.parse(TPU_DIR / path, TPU_DIR)


def test_scaled_script_becomes_scaled_preset_on_its_slice():
    config = _parse("v5p/32b.sh")
    assert config.argv() == [
        "compile", "--topology", "v5p-128", "--model", "scaled-32", "per_device_batch_size=6",
        "remat_policy=minimal", "ici_fsdp_parallelism=-1", "ici_tensor_parallelism=4", "max_target_length=2048",
        "use_iota_embed=true", "attention=flash", "--json"]
    assert {w.partition("=")[0] for w, _ in config.dropped} == {
        "steps", "enable_checkpointing", "base_output_directory", "reuse_example_batch", "dataset_type",
        "gcs_metrics", "quantization"}
    assert config.skip is None


def test_script_variables_and_stated_batch_topology():
    """$DATASET_TYPE and $REUSE_EXAMPLE_BATCH come from the script's exports; "on 1 x v5p-512" is the topology."""
    config = _parse("v5p/llama2_7b.sh")
    assert (config.model, config.topology, config.num_slices) == ("llama2-7b", "v5p-512", 1)
    assert config.flags == ("remat_policy=minimal", "per_device_batch_size=4", "use_iota_embed=true",
                            "max_target_length=4096")
    dropped = dict(config.dropped)
    assert "dataset_type=synthetic" in dropped and "reuse_example_batch=1" in dropped
    assert "profiler=xplane" in dropped


def test_trillium_script_keeps_fsdp_transpose_and_splash_blocks():
    config = _parse("v6e/gemma2_27b.sh")
    assert (config.model, config.topology) == ("gemma2-27b", "v6e-256")
    assert config.flags == ("per_device_batch_size=2", "remat_policy=full", "ici_fsdp_transpose_parallelism=256",
                            "ici_fsdp_parallelism=-1", "max_target_length=8192", "attention=flash", "sa_block_q=2048",
                            "sa_block_q_dkv=2048", "sa_block_q_dq=2048")


@pytest.mark.parametrize("path", ["v5p/32b.sh", "v5p/llama2_7b.sh", "v6e/gemma2_27b.sh"])
def test_maxperf_takes_every_flag_passed(path):
    config = _parse(path)
    configs = overrides.apply(presets.get(config.model), list(config.flags))
    flags = dict(w.split("=", 1) for w in config.flags)
    assert configs.train.per_device_batch_size == float(flags["per_device_batch_size"])
    assert configs.train.remat_policy == flags["remat_policy"]


def test_folder_lists_every_script():
    assert [c.path for c in bench.configs(TPU_DIR)] == ["v5p/32b.sh", "v5p/llama2_7b.sh", "v6e/gemma2_27b.sh"]


def test_expand_nested_defaults_and_positional_arguments():
    env = {"1": "4", "B": "x"}
    assert bench._expand("${1:-${PER_DEVICE_BATCH_SIZE:-8}}", env) == "4"
    assert bench._expand("${2:-${REMAT:-full}}", env) == "full"
    assert bench._expand("$B/${UNSET}y", env) == "x/y"


def test_wrapper_script_passes_its_arguments_to_the_base_script(tmp_path):
    folder = tmp_path / "v5p" / "big"
    folder.mkdir(parents=True)
    (folder / "base.sh").write_text(
        'B=${1:-${B:-4}}\nREMAT=${2:-${REMAT:-full}}\n'
        'python3 -m maxtext.trainers.pre_train.train base.yml model_name=llama2-7b \\\n'
        '  per_device_batch_size="${B}" remat_policy="${REMAT}" steps=5\n')
    (folder / "v5p_256.sh").write_text("# Train on v5p-256 slice.\n./big/base.sh 2 minimal\n")
    config = bench.parse(folder / "v5p_256.sh", tmp_path, {"llama2-7b"})
    assert (config.topology, config.flags) == ("v5p-256", ("per_device_batch_size=2", "remat_policy=minimal"))


def test_iota_embed_matches_the_gather_and_its_gradient():
    """use_iota_embed (MaxText's one-hot matmul lookup) gives the gather's rows and the same table gradient."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxperf.models.layers.embedding import Embed

    embed = Embed(50, 8, jnp.float32, nnx.Rngs(0))
    tokens_BxL = jnp.array([[1, 3, 49], [0, 3, 3]])
    weights_BxLxD = jax.random.normal(jax.random.key(1), (2, 3, 8))

    def loss(module, iota):
        return jnp.sum(module(tokens_BxL, jnp.float32, iota=iota) * weights_BxLxD)

    with jax.numpy_rank_promotion("raise"):
        (gather, d_gather), (iota, d_iota) = (nnx.value_and_grad(loss)(embed, i) for i in (False, True))
    d_gather, d_iota = d_gather["table_VxD"][...], d_iota["table_VxD"][...]
    assert jnp.allclose(gather, iota, rtol=1e-6)
    assert jnp.allclose(d_gather, d_iota, atol=1e-6)
    assert float(jnp.abs(d_iota[3]).sum()) > 0 and float(jnp.abs(d_iota[2]).sum()) == 0


def test_script_compiler_flags_are_read():
    """The XLA flags a script exports (LIBTPU_INIT_ARGS), which --with-libtpu-args compiles under."""
    args = _parse("v6e/gemma2_27b.sh").libtpu_args.split()
    assert "--xla_tpu_scoped_vmem_limit_kib=122880" in args and len(args) == 8


def test_maxtexts_sequence_and_context_keys_set_maxperfs_one_sequence_axis_where_the_other_is_1():
    """A pasted base.yml gives ici_sequence_parallelism: 1 beside ici_context_parallelism: 4; MaxText's two axes over
    1 at once are refused (maxperf's sequence axis is MaxText's context axis), even at equal sizes, which before
    merged silently into one axis."""
    from maxperf.spec.errors import MaxperfError
    from maxperf.spec.request import resolve

    base = ["per_device_batch_size=1", "max_target_length=32768"]
    for words in (["ici_sequence_parallelism=1", "ici_context_parallelism=2"],
                  ["ici_context_parallelism=2", "ici_sequence_parallelism=1"]):
        assert resolve("v5p-16", "llama3-8b", [*base, *words]).mesh.axes["sequence"] == 2
    with pytest.raises(MaxperfError, match="are two mesh axes in MaxText"):
        resolve("v5p-16", "llama3-8b", [*base, "ici_sequence_parallelism=2", "ici_context_parallelism=2"])


def test_maxtexts_schedule_and_check_keys_are_ignored_and_its_deprecated_remat_name_read():
    """warmup_steps_fraction, wsd_decay_steps_fraction, sharding_tolerance and override_model_config change nothing
    of the step: named once as ignored, not refused; remat_policy=minimal_flash is MaxText's deprecated name of
    minimal_with_context (its decoders.py still takes it), not an unknown value."""
    from maxperf.spec import maxtext_line
    from maxperf.spec.request import resolve

    assert {"warmup_steps_fraction", "wsd_decay_steps_fraction", "sharding_tolerance",
            "override_model_config"} <= maxtext_line.RUN_KEYS
    assert str(resolve("h100-8", "llama3-8b", ["remat_policy=minimal_flash"]).configs.train.remat_policy) == \
        "minimal_with_context"


def test_a_quantized_dropless_moe_is_priced_as_maxtext_runs_it_and_says_compile_refuses_it():
    from maxperf.spec.request import resolve

    notes = resolve("v5p-128", "mixtral-8x7b", ["quantization=int8"]).warnings
    assert any("dropless" in n and "of the train step does not build that kernel" in n
               and "the serving steps (--step prefill|decode) compile it" in n for n in notes), notes
    assert not any("dropless" in n for n in resolve("v5p-128", "mixtral-8x7b", []).warnings)


def test_scan_layers_false_with_pipeline_stages_is_maxtexts_pipeline():
    """MaxText's base.yml recommends scan_layers=false with pipeline parallelism (its pipeline scans the iterations
    and holds its layers by stage whatever the key says): the same step, said in a note, not a refusal."""
    from maxperf.spec.request import resolve

    words = ["per_device_batch_size=4", "ici_pipeline_parallelism=2"]
    unscanned = resolve("v5p-16", "llama2-7b", [*words, "scan_layers=false"])
    assert unscanned.configs.train == resolve("v5p-16", "llama2-7b", words).configs.train
    assert any(w.startswith("scan_layers=false with pipeline stages") for w in unscanned.warnings)


def test_maxtexts_soft_caps_at_zero_are_off_and_its_activation_lists_and_defaults_are_read():
    """MaxText caps logits only above zero (base.yml's 0.0 is no cap: applied as a cap of 0 every logit was 0 and the
    loss NaN); its mlp_activations are lists; its transpose-tensor axes, rope_min_timescale and a clamp of -1 are
    its defaults; local_rope_max_timescale is the sliding layers' RoPE base."""
    from maxperf.spec import maxtext_line
    from maxperf.spec.errors import MaxperfError
    from maxperf.spec.request import resolve

    line = maxtext_line.read(["attn_logits_soft_cap=0.0", "final_logits_soft_cap=0",
                              'mlp_activations=["gelu","linear"]',
                              "mlp_activations_limit=-1", "ici_tensor_transpose_parallelism=1", "rope_min_timescale=1"])
    assert line.overrides == ("attn_logit_softcap=none", "final_logit_softcap=none", "mlp_activations=geglu")
    assert set(line.ignored) == {"mlp_activations_limit", "ici_tensor_transpose_parallelism", "rope_min_timescale"}
    model = resolve("cpu-2", "gemma2-2b", list(line.overrides)).model
    assert model.attn_logit_softcap is None and model.final_logit_softcap is None and str(model.activation) == "geglu"
    assert maxtext_line.read(["attn_logits_soft_cap=50"]).overrides == ("attn_logits_soft_cap=50",)
    with pytest.raises(MaxperfError, match="builds \\[silu, linear\\]"):
        maxtext_line.read(['mlp_activations=["relu"]'])
    assert resolve("cpu-2", "gemma3-1b", ["local_rope_max_timescale=20000"]).model.local_rope_theta == 20000


def test_a_maxtext_config_file_is_read_with_its_base_and_the_line_overrides_it(tmp_path):
    """A config other than base.yml (MaxText's configs/models/gpu/*.yml) gives its keys, after those of the file its
    base_config names and before the line's own words; a file that is not there is refused, not taken as base.yml."""
    from maxperf.spec import maxtext_line
    from maxperf.spec.errors import MaxperfError

    (tmp_path / "parent.yml").write_text('base_config: "base.yml"\nmax_target_length: 4096\nremat_policy: "full"\n')
    child = tmp_path / "child.yml"
    child.write_text('base_config: "parent.yml"\nmodel_name: "llama3-70b"\nper_device_batch_size: 4\n'
                     'max_target_length: 8192\nuse_iota_embed: True\nsteps: 30\n')
    line = maxtext_line.read([str(child), "per_device_batch_size=2", "compile_topology=a3",
                              "compile_topology_num_slices=2"])
    assert line.model == "llama3-70b" and line.topology == "a3-high-8" and line.num_slices == 2
    words = list(line.overrides)
    assert "max_target_length=8192" in words and "max_target_length=4096" not in words  # the child's value
    assert words[-1] == "per_device_batch_size=2" and "remat_policy=full" in words and "use_iota_embed=true" in words
    assert "steps" in line.ignored
    with pytest.raises(MaxperfError, match="no such MaxText config file"):
        maxtext_line.read([str(tmp_path / "missing.yml")])
    assert maxtext_line.read(["maxtext/configs/base.yml"]).overrides == maxtext_line.BASE_YML_DEFAULTS


def test_mixtral_experts_are_base_mlp_dim_wide_as_in_maxtexts_mixtral_block():
    from maxperf.spec.errors import MaxperfError
    from maxperf.spec.request import resolve

    assert resolve("v5p-64", "mixtral-8x7b", ["base_mlp_dim=7168"]).model.moe_mlp_dim == 7168
    with pytest.raises(MaxperfError, match="mixtral block"):
        resolve("v5p-64", "mixtral-8x7b", ["shared_experts=1"])
