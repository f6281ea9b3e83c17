"""MaxText command lines as they are: `maxperf compile maxtext/configs/base.yml model_name=llama2-7b
compile_topology=v5p-256 compile_topology_num_slices=2 steps=10 run_name=x ...` names the same request as
`maxperf compile --model llama2-7b --topology v5p-256 --num-slices 2`. MaxText's config file (base.yml, whose defaults
are maxperf's), its model and topology keys are read here; its keys that change nothing of the step (where it writes,
what it logs, checkpoints and profiles, which data it reads, how long it trains) are accepted and named once as
ignored, and those that tune its own kernels' and collectives' scheduling (TUNING_KEYS) named once as not
reproduced; every other word is a key=value override as before."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from maxperf.spec import presets
from maxperf.spec.errors import MaxperfError, closest

# MaxText's keys (configs/base.yml) that change nothing of the compiled step or its time: the run's name and output,
# its length and schedule of side work, checkpointing, logging and metrics, profiling, the input pipeline and its
# data, evaluation, and how the job reaches its devices.
RUN_KEYS = frozenset("""
    run_name base_output_directory steps log_period enable_checkpointing async_checkpointing checkpoint_period
    max_checkpoints_to_keep load_parameters_path load_full_state_path checkpoint_storage_use_ocdbt
    checkpoint_storage_use_zarr3 enable_single_replica_ckpt_restoring enable_emergency_checkpoint
    local_checkpoint_directory local_checkpoint_period enable_continuous_checkpointing save_config_to_gcs
    dataset_type dataset_path dataset_name eval_dataset_name train_split eval_split hf_path hf_data_dir
    hf_train_files hf_eval_files hf_access_token grain_train_files grain_eval_files grain_worker_count
    tokenizer_path tokenizer_type add_bos add_eos packing shuffle data_shuffle_seed reuse_example_batch
    eval_interval eval_steps target_eval_loss eval_per_device_batch_size
    profiler profiler_steps skip_first_n_steps_for_profiler profile_periodically_period upload_all_profiler_results
    profile_cleanly hide_profiler_step_metric
    metrics_file gcs_metrics enable_tensorboard use_vertex_tensorboard vertex_tensorboard_project
    vertex_tensorboard_region enable_goodput_recording monitor_goodput goodput_upload_interval_seconds
    enable_pathways_goodput monitor_step_time_deviation step_deviation_interval_seconds
    skip_jax_distributed_system enable_single_controller hardware jax_cache_dir jax_distributed_initialization_timeout
    compiled_trainstep_file compile_topology_slice_type enable_data_shuffling max_train_steps save_final_checkpoint
    start_step_to_checkpoint checkpoint_storage_concurrent_gb checkpoint_storage_target_data_file_size_bytes
    grain_file_type output_dir
""".split())
# MaxText's keys that tune how its own kernels and collectives run without changing the step's shapes, shardings or
# (beyond rounding) its arithmetic: tokamax's splash scheduler, its cost hints and dq reduction, a max-logit estimate,
# the tiles of local (sliding-window) layers, tokamax's grouped matmul and megablox's tiles, its sort's custom VJP,
# two-stage FSDP all-gathers, how the device mesh is laid over the chips, random routing for benchmarks, the packed
# segments cuDNN's attention is built for (max_segments_per_seq; maxperf's batches are unpacked), the MoE
# combine's float32 sum (maxperf's sums in float32) and FP8 scale calibration. maxperf compiles jax's splash and
# megablox kernels and XLA's collectives as they come: these are accepted and named once as not reproduced.
_TILES = [f"{w}_tile_{p}_{d}" for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")
          for d in ("batch_seq", "embed_dim", "mlp_dim", "buffer_count")]
# and their names before MaxText split them per kernel (one set for every grouped matmul; the v5p configs of its
# benchmarks/maxtext_v5p_model_configs.py still set them)
_TILES += ["tile_batch_seq", "tile_embed_dim", "tile_mlp_dim"]
TUNING_KEYS = frozenset("""
    use_splash_scheduler local_use_splash_scheduler cost_estimate_flops_fwd cost_estimate_flops_bwd dq_reduction_steps
    use_max_logit_estimate use_tokamax_gmm use_custom_sort_vjp moe_fsdp_use_two_stage_all_gather
    dense_fsdp_use_two_stage_all_gather allow_split_physical_axes custom_mesh use_random_routing max_segments_per_seq
    float32_weight_sum
    weight_quantization_calibration_method act_quantization_calibration_method bwd_quantization_calibration_method
    local_sa_block_q local_sa_block_kv local_sa_block_kv_compute local_sa_block_q_dkv local_sa_block_kv_dkv
    local_sa_block_kv_dkv_compute local_sa_block_q_dq local_sa_block_kv_dq
""".split() + _TILES)
# MaxText's switches of the experts' weights' sharding that maxperf compiles at MaxText's default only: at it they
# change nothing; another value is refused (shard_exp_on_fsdp is a model key, ModelConfig.shard_exp_on_fsdp)
DEFAULT_ONLY: dict[str, str] = {}
# MaxText's keys and model configs that lay the weights out over fsdp and fsdp_transpose by rules of their own ("2D
# FSDP"): the experts' use_2d_fsdp_sharding, and DeepSeek-V3's deepseek3-671b-2dfsdp, its model config with its own
# logical-axis rules (configs/models/deepseek3-671b-2dfsdp.yml). Each device holds and gathers the same bytes by
# maxperf's rules, every weight gathered whole before its matmuls either way: accepted, the model as its plain config,
# and named once as not reproduced.
LAYOUT_KEYS = frozenset({"use_2d_fsdp_sharding"})
LAYOUT_MODELS = {"deepseek3-671b-2dfsdp": "deepseek3-671b"}
MODEL_KEY, SCALE_KEY = "model_name", "global_parameter_scale"
TOPOLOGY_KEY, SLICES_KEY = "compile_topology", "compile_topology_num_slices"


@dataclass(frozen=True)
class Line:
    """A command line's words once MaxText's own are read: the key=value overrides left, and the topology, model and
    slice count MaxText's keys named (None where they named none), and the words ignored."""

    overrides: tuple[str, ...]
    topology: str | None = None
    model: str | None = None
    num_slices: int | None = None
    ignored: tuple[str, ...] = ()
    untuned: tuple[str, ...] = ()  # TUNING_KEYS given
    layouts: tuple[str, ...] = ()  # LAYOUT_KEYS and LAYOUT_MODELS given (the model as its plain config)


def read(words: Sequence[str]) -> Line:
    """The request MaxText's words in `words` name; a MaxperfError, one line, for a value maxperf cannot take."""
    overrides, ignored, untuned, layouts = [], [], [], []
    found: dict[str, str] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq:
            if word.endswith((".yml", ".yaml")):  # MaxText's config file: its defaults are maxperf's
                ignored.append(word)
                continue
            overrides.append(word)  # not MaxText's: the overrides say what is wrong with it
        elif key in RUN_KEYS:
            ignored.append(key)
        elif key in TUNING_KEYS:
            untuned.append(key)
        elif key in LAYOUT_KEYS:
            if value.strip().lower() == "true":
                layouts.append(key)
            else:
                ignored.append(key)
        elif key in DEFAULT_ONLY:
            if value.strip().lower() != DEFAULT_ONLY[key]:
                raise MaxperfError(f"{key}={value}: maxperf shards the experts' weights by MaxText's default rules "
                                   f"only ({key}={DEFAULT_ONLY[key]})")
            ignored.append(key)
        elif key in (MODEL_KEY, SCALE_KEY, TOPOLOGY_KEY, SLICES_KEY):
            if key == MODEL_KEY and value in LAYOUT_MODELS:
                layouts.append(f"{MODEL_KEY}={value}")
                value = LAYOUT_MODELS[value]
            found[key] = value
        else:
            overrides.append(word)
    return Line(tuple(overrides), found.get(TOPOLOGY_KEY), _model(found), _slices(found), tuple(ignored),
                tuple(untuned), tuple(layouts))


def _model(found: dict[str, str]) -> str | None:
    name, scale = found.get(MODEL_KEY), found.get(SCALE_KEY)
    if scale is not None:
        if not scale.isdigit() or int(scale) < 1 or int(scale) & (int(scale) - 1):
            raise MaxperfError(f"{SCALE_KEY}={scale}: maxperf's scaled family takes a power of two (1, 2, 4, ...)")
        if name in (None, "default"):
            return f"scaled-{int(scale)}"
        if int(scale) != 1:
            raise MaxperfError(f"{SCALE_KEY}={scale} grows MaxText's default model; with {MODEL_KEY}={name} leave it "
                               "out (or at 1)")
    if name is None:
        return None
    if name == "default":
        return "scaled-1"
    if presets.canonical(name) in presets.names():
        return presets.canonical(name)
    hits = closest(name, sorted({*presets.FROM_MAXTEXT, *presets.names()}))
    raise MaxperfError(f"{MODEL_KEY}={name} names no model maxperf has; "
                       + (f"did you mean {', '.join(hits[:3])}? " if hits else "") + "`maxperf models` lists them")


def _slices(found: dict[str, str]) -> int | None:
    value = found.get(SLICES_KEY)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise MaxperfError(f"{SLICES_KEY}={value} must be a whole number of slices, 1 or more")
    return int(value)
