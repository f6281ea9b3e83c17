"""MaxText command lines as they are: `maxperf compile maxtext/configs/base.yml model_name=llama2-7b
compile_topology=v5p-256 compile_topology_num_slices=2 steps=10 run_name=x ...` names the same request as
`maxperf compile --model llama2-7b --topology v5p-256 --num-slices 2`. MaxText's config file (base.yml, whose defaults
are maxperf's), its model and topology keys are read here; its keys that change nothing of the step (where it writes,
what it logs, checkpoints and profiles, which data it reads, how long it trains) are accepted and named once as
ignored, and those that tune its own kernels' and collectives' scheduling (TUNING_KEYS) named once as not
reproduced; every other word is a key=value override as before."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
    save_checkpoint_on_start save_checkpoint_on_completion max_num_checkpoints_to_keep checkpoint_todelete_subdir
    enable_nnx pure_nnx pure_nnx_decoder check_vma max_checkify
    checkpoint_todelete_full_path enable_orbax_v1 checkpoint_conversion_fn source_checkpoint_layout
    colocated_python_checkpointing enable_autocheckpoint enable_multi_tier_checkpointing mtc_data_parallelism
    enable_checkpoint_cloud_logger enable_wandb wandb_project_name wandb_run_name
    use_chat_template chat_template_path chat_template tokenize_train_data tokenize_eval_data use_truncation
    expansion_factor_real_data max_corpus_chars train_image_column eval_image_column default_prompt num_epoch
    generate_padding_batch_train generate_padding_batch_eval hf_name hf_eval_split grain_train_mixture_config_path
    grain_packing_type grain_per_worker_buffer_size grain_num_threads grain_prefetch_buffer_size
    grain_worker_count_eval grain_per_worker_buffer_size_eval grain_ram_budget_mb grain_num_threads_eval
    grain_prefetch_buffer_size_eval grain_data_source_max_workers grain_shuffle_buffer_size grain_use_elastic_iterator
    colocated_python_data_input olmo_index_path olmo_path_remap_from olmo_path_remap_to olmo_apply_ngram_filter
    eval_start_step abort_on_nan_loss abort_on_inf_loss write_estimator_result
    jax_debug_log_modules log_config debug_sharding enable_tpu_profiling_options tpu_num_chips_to_profile_per_task
    tpu_num_sparse_core_tiles_to_trace tpu_num_sparse_cores_to_trace managed_mldiagnostics
    managed_mldiagnostics_on_demand_profiling managed_mldiagnostics_run_group managed_mldiagnostics_region
    managed_mldiagnostics_storage_path dump_hlo dump_step dump_hlo_local_dir dump_hlo_delete_local_after
    dump_hlo_gcs_dir dump_hlo_local_module_name dump_hlo_module_name dump_hlo_xla_flags dump_hlo_upload_all dump_jaxpr
    dump_jaxpr_local_dir dump_jaxpr_delete_local_after dump_jaxpr_gcs_dir enable_jax_profiler jax_profiler_port
    xprof_tpu_power_trace_level xprof_e2e_enable_fw_throttle_event xprof_e2e_enable_fw_power_level_event
    xprof_e2e_enable_fw_thermal_event profile_power_events prometheus_port enable_gcp_goodput_metrics
    enable_gcp_step_deviation_metrics report_heartbeat_metric_for_gcp_monitoring
    heartbeat_reporting_interval_in_seconds report_performance_metric_for_gcp_monitoring
    elastic_enabled elastic_backup_kind elastic_timeout_seconds elastic_max_retries elastic_min_slice_count
    decode_sampling_strategy decode_sampling_nucleus_p decode_sampling_top_k decode_sampling_temperature
    inference_microbenchmark_prefill_lengths inference_microbenchmark_stages inference_microbenchmark_loop_iters
    inference_microbenchmark_log_file_path inference_metadata_file inference_server inference_benchmark_test
    enable_model_warmup enable_llm_inference_pool autoregressive_decode_assert load_from_prefill_dir prefill_cache_dir
    warmup_steps_fraction wsd_decay_steps_fraction sharding_tolerance override_model_config
""".split())
# MaxText's dropout (configs/base.yml: dropout_rate 0.0 by default, enable_dropout true): maxperf's steps have none,
# which is MaxText's step at dropout_rate=0 whatever enable_dropout says
DROPOUT_RATE, DROPOUT_SWITCH = "dropout_rate", "enable_dropout"
# MaxText's keys whose values at or below zero mean "off" or "the run's own" (configs/base.yml): no gradient clipping
# at gradient_clipping_threshold <= 0, a schedule as long as the run (its `steps`) at learning_rate_schedule_steps=-1,
# the slices found at run time at num_slices=-1
CLIP_KEY, SCHEDULE_KEY, RUNTIME_SLICES_KEY = "gradient_clipping_threshold", "learning_rate_schedule_steps", "num_slices"
# MaxText's logit soft caps, off at 0.0 (base.yml's default; layers/attentions.py caps only when the value is > 0):
# maxperf's keys hold no cap as none
SOFT_CAPS = {"attn_logits_soft_cap": "attn_logit_softcap", "final_logits_soft_cap": "final_logit_softcap"}
# mlp_activations as MaxText lists them (base.yml: ["silu", "linear"], a gated unit's two branches): maxperf's names
ACTIVATION_LISTS = {("silu", "linear"): "swiglu", ("gelu", "linear"): "geglu", ("gelu",): "gelu"}
# gpt-oss's clamp (mlp_activations_limit), off at -1 (base.yml's default): only activation=clamped_swiglu reads it
ACTIVATION_LIMIT = "mlp_activations_limit"
# The decoder block MaxText's model config (configs/models/*.yml) sets for each preset it has; base.yml's default,
# llama2, for its default model (maxperf's scaled family). `decoder_block=` restating it changes nothing.
DECODER_BLOCKS = {
    **dict.fromkeys(("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3.1-8b", "llama3.1-70b",
                     "llama3.1-405b", "llama3.3-70b", "llama3-405b"), "llama2"),
    "mistral-7b": "mistral", "mixtral-8x7b": "mixtral", "mixtral-8x22b": "mixtral",
    "gemma-2b": "gemma", "gemma-7b": "gemma", "gemma2-2b": "gemma2", "gemma2-9b": "gemma2", "gemma2-27b": "gemma2",
    "gemma3-4b": "gemma3", "gemma3-12b": "gemma3", "gemma3-27b": "gemma3",
    "qwen3-0.6b": "qwen3", "qwen3-8b": "qwen3", "qwen3-32b": "qwen3", "qwen3-30b-a3b": "qwen3_moe",
    "qwen3-235b-a22b": "qwen3_moe", "qwen3-480b-a35b": "qwen3_moe", "gpt3-175b": "gpt3", "gpt-oss-20b": "gpt_oss",
    "gpt-oss-120b": "gpt_oss",
    "deepseek-v2-lite": "deepseek", "deepseek-v3": "deepseek", "kimi-k2": "deepseek",
    "llama4-scout-17b-16e": "llama4", "llama4-maverick-17b-128e": "llama4",
}
DECODER_BLOCK_KEY = "decoder_block"
# MaxText's keys that tune how its own kernels and collectives run without changing the step's shapes, shardings or
# (beyond rounding) its arithmetic: tokamax's splash scheduler, its cost hints and dq reduction, a max-logit estimate,
# the tiles of local (sliding-window) layers, tokamax's grouped matmul and how many tiles its kernels keep in
# flight (the *_buffer_count keys; the tiles themselves are train keys), its sort's custom VJP,
# two-stage FSDP all-gathers, how the device mesh is laid over the chips, random routing for benchmarks, the packed
# segments cuDNN's attention is built for (max_segments_per_seq; maxperf's batches are unpacked), the MoE
# combine's float32 sum (maxperf's sums in float32) and FP8 scale calibration; splash's exponent and reciprocal
# tricks, its megacore dkv split and which build of it runs, the local layers' splash settings, the grouped matmul's
# second version, merged gating and ragged sort, the partitioner (Shardy) and how mesh axes are ordered and typed,
# how many computations are in flight, and loop unrolling. maxperf compiles jax's splash and
# megablox kernels and XLA's collectives as they come: these are accepted and named once as not reproduced.
_TILES = [f"{w}_tile_{p}_buffer_count" for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")]
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
    local_sa_use_fused_bwd_kernel local_sa_q_layout local_sa_k_layout local_sa_v_layout local_sa_fuse_reciprocal
    local_sa_use_base2_exp sa_bwd_dkv_megacore sa_fuse_reciprocal sa_use_base2_exp use_jax_splash
    use_gmm_v2 merge_gating_gmm use_ragged_sort shardy optimize_mesh_for_tpu_v6e remove_size_one_mesh_axis_from_type
    max_inflight_computations force_unroll ring_scan_unroll
    prefill_cache_dir inference_metadata_file inference_server inference_benchmark_test enable_model_warmup
    decode_sampling_nucleus_p decode_sampling_top_k decode_sampling_temperature prefill_chunk_size
""".split() + _TILES)
# MaxText's switches of features maxperf's steps do not build, at the value (configs/base.yml's default) that leaves
# each off: there they change nothing and are named once as ignored; another value is refused, one line. Matmuls at
# XLA's default precision, activations in the compute dtype and logits cast to float32 for the loss, no z-loss, plain
# pre-training (no SFT or DPO, no batch ramp-up, no skipped steps), Adam without eps_root, no DiLoCo, no multimodal
# encoders, no ring of experts, batch splitting, QK clipping, FP8 splash inputs, extra post-norms or Transformer
# Engine's GEMM overlap, MaxText's automatic sharding mode and its cosine learning-rate schedule.
DEFAULT_ONLY: dict[str, str] = {
    "matmul_precision": "default", "activations_in_float32": "false", "z_loss_multiplier": "0", "use_sft": "false",
    "use_dpo": "false", "enable_rampup_batch_size": "false", "skip_step_on_spikes": "false", "adam_eps_root": "0",
    "enable_diloco": "false", "enable_streaming_diloco": "false", "use_multimodal": "false", "use_audio": "false",
    "training_objective": "causal_lm", "lr_schedule_type": "cosine", "record_internal_nn_metrics": "0",
    "use_ring_of_experts": "false", "use_batch_split_schedule": "false", "experimental_sa_quant_q_fp8": "false",
    "experimental_sa_quant_k_fp8": "false", "use_qk_clip": "false", "shard_mode": "auto", "cast_logits_to_fp32": "true",
    "use_post_attn_norm": "false", "use_post_ffw_norm": "false", "te_comm_gemm_overlap": "disabled",
    # the pipeline's scans and gathers as maxperf's pipeline runs them (models/pipeline.py)
    "scan_pipeline_iterations": "true", "scan_pipeline_repeats": "false", "scan_layers_per_stage": "false",
    "set_remat_policy_on_layers_per_stage": "false", "pipeline_fsdp_ag_per_repeat": "false",
    # serving: no autoregressive mesh axis, the cache laid out as each platform's compiler reads it
    # (models/layers/kv_cache.py), greedy decoding, no chunked or stacked prefill
    "ici_autoregressive_parallelism": "1", "dcn_autoregressive_parallelism": "1",
    "prefill_cache_axis_order": "1,2,0,3", "ar_cache_axis_order": "1,2,0,3", "compute_axis_order": "0,1,2,3",
    "reshape_q": "false", "model_call_mode": "", "decode_sampling_strategy": "greedy",
    "stack_prefill_result_cache": "false", "use_chunked_prefill": "false",
    # no tensor-sequence mesh axis; context parallelism gathers the keys and values whole (models/layers/attention.py),
    # MaxText's default strategy; the causal mask as MaxText's default builds it; one kind of layer throughout
    "ici_tensor_sequence_parallelism": "1", "dcn_tensor_sequence_parallelism": "1",
    "ici_tensor_transpose_parallelism": "1", "dcn_tensor_transpose_parallelism": "1", "rope_min_timescale": "1",
    "context_parallel_strategy": "all_gather", "enable_padding_causal_mask": "true",
    "inhomogeneous_layer_cycle_interval": "1",
    # remat_policy=custom's names of the experts' and MLA's tensors: maxperf recomputes them (MaxText's default)
    **dict.fromkeys(("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "kv_proj", "query_wa_proj", "kv_wa_proj", "mla_q",
                     "mla_kv"), "remat"),
}
# MaxText's keys and model configs that lay the weights out over fsdp and fsdp_transpose by rules of their own ("2D
# FSDP"): the experts' use_2d_fsdp_sharding, and DeepSeek-V3's deepseek3-671b-2dfsdp, its model config with its own
# logical-axis rules (configs/models/deepseek3-671b-2dfsdp.yml). Each device holds and gathers the same bytes by
# maxperf's rules, every weight gathered whole before its matmuls either way: accepted, the model as its plain config,
# and named once as not reproduced.
LAYOUT_KEYS = frozenset({"use_2d_fsdp_sharding"})
LAYOUT_MODELS = {"deepseek3-671b-2dfsdp": "deepseek3-671b"}
# configs/base.yml's values of the keys whose maxperf defaults differ: a line that names MaxText's config file takes
# them (base.yml: per_device_batch_size 12.0, learning_rate 3.e-5, load_balance_loss_weight 0.0), before its own words
BASE_YML_DEFAULTS = ("per_device_batch_size=12", "learning_rate=3e-5", "load_balance_loss_weight=0")
MODEL_KEY, SCALE_KEY = "model_name", "global_parameter_scale"
QUANTIZED_CHECKPOINT = "checkpoint_is_quantized"
TOPOLOGY_KEY, SLICES_KEY = "compile_topology", "compile_topology_num_slices"
# MaxText's GPU machines for train_compile (accelerator_to_spec_map: 8 GPUs a host, compile_topology_num_slices hosts;
# `maxperf plan` writes them so): maxperf's topology of one host, --num-slices hosts (a3-high-8 x N is a3-high-8xN:
# Google Cloud's A3, an A3 High VM of 8 H100s)
GPU_HOSTS = {"a3": "a3-high-8", "a4": "b200-8"}


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
    decoder_block: str | None = None  # MaxText's decoder_block=, checked against the model's (check_decoder_block)
    model_word: str = ""  # the word that named the model ("model_name=llama2-7b"), where one did
    slices_word: str = ""  # and the slice count
    config_file: str = ""  # MaxText's config file, where the line names one (its defaults are the line's)


def read(words: Sequence[str]) -> Line:
    """The request MaxText's words in `words` name; a MaxperfError, one line, for a value maxperf cannot take."""
    overrides, ignored, untuned, layouts = [], [], [], []
    config_file = ""
    found: dict[str, str] = {}
    for word in _with_config_files(words):
        key, eq, value = word.partition("=")
        if not eq:
            if word.endswith((".yml", ".yaml")):  # MaxText's config file: its defaults (BASE_YML_DEFAULTS)
                config_file = word
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
            if not _same(value, DEFAULT_ONLY[key]):
                raise MaxperfError(f"{key}={value}: maxperf builds MaxText's step at {key}={DEFAULT_ONLY[key]} (its "
                                   "default) only")
            ignored.append(key)
        elif key == QUANTIZED_CHECKPOINT:
            # the serving steps hold int8 (fp8) weights as a quantized checkpoint gives them (models/serving.py):
            # the same step, its weights read rather than quantized when built
            quantization = next((w.partition("=")[2].strip().lower() for w in reversed(words)
                                 if w.partition("=")[0] == "quantization"), "")
            if _same(value, "true") and quantization not in ("int8", "fp8"):
                raise MaxperfError(f"{key}={value} reads int8 or fp8 weights: give quantization=int8 (or fp8) with it")
            ignored.append(key)
        elif key == DROPOUT_RATE:
            if _number(key, value) != 0:
                raise MaxperfError(f"{key}={value}: maxperf's steps have no dropout, as MaxText's at {key}=0 (its "
                                   "default)")
            ignored.append(key)
        elif key == DROPOUT_SWITCH:  # moot at dropout_rate=0, the only rate maxperf takes
            ignored.append(key)
        elif key == CLIP_KEY and _number(key, value) <= 0:  # MaxText clips only above zero
            overrides.append("grad_clip_norm=none")
        elif key in SOFT_CAPS and _number(key, value) <= 0:  # MaxText caps only above zero
            overrides.append(f"{SOFT_CAPS[key]}=none")
        elif key == ACTIVATION_LIMIT and _number(key, value) < 0:
            ignored.append(key)
        elif key == "mlp_activations" and value.strip().startswith("["):
            overrides.append(f"{key}={_activation_list(value)}")
        elif key in (SCHEDULE_KEY, RUNTIME_SLICES_KEY) and _number(key, value) == -1:
            ignored.append(key)
        elif key == RUNTIME_SLICES_KEY:
            _found(found, key, value)
        elif key == DECODER_BLOCK_KEY:
            _found(found, key, value.strip().strip("'\""))
        elif key in (MODEL_KEY, SCALE_KEY, TOPOLOGY_KEY, SLICES_KEY):
            if key == MODEL_KEY and value in LAYOUT_MODELS:
                layouts.append(f"{MODEL_KEY}={value}")
            _found(found, key, value)
        else:
            overrides.append(word)
    if found.get(TOPOLOGY_KEY) in GPU_HOSTS:  # a GPU machine: its hosts are MaxText's slices
        found[TOPOLOGY_KEY] = GPU_HOSTS[found[TOPOLOGY_KEY]]
    model_key = SCALE_KEY if SCALE_KEY in found and found.get(MODEL_KEY) in (None, "default") else MODEL_KEY
    slices_key = SLICES_KEY if SLICES_KEY in found else RUNTIME_SLICES_KEY
    if config_file:
        overrides[:0] = BASE_YML_DEFAULTS
    return Line(tuple(overrides), found.get(TOPOLOGY_KEY), _model(found), _slices(found), tuple(ignored),
                tuple(untuned), tuple(layouts), found.get(DECODER_BLOCK_KEY),
                f"{model_key}={found[model_key]}" if model_key in found else "",
                f"{slices_key}={found[slices_key]}" if slices_key in found else "", config_file)


BASE_FILES = ("base.yml", "base.yaml")


def _with_config_files(words: Sequence[str]) -> list[str]:
    """The words with each MaxText config file other than base.yml followed by its keys (`key=value`, after the
    files its `base_config` names, before the line's own words, which override them as in MaxText); base.yml stands
    for its defaults (BASE_YML_DEFAULTS), read or not. A config file that is not there is a MaxperfError."""
    out: list[str] = []
    for word in words:
        out.append(word)
        if "=" in word or not word.endswith((".yml", ".yaml")) or Path(word).name in BASE_FILES:
            continue
        out.extend(f"{k}={_yaml_word(v)}" for k, v in _config_keys(Path(word), ()).items() if v is not None)
    return out


def _config_keys(path: Path, seen: tuple[Path, ...]) -> dict:
    """A MaxText config file's keys over those of the files its `base_config` names (base.yml's: its defaults)."""
    import yaml

    if not path.is_file():
        raise MaxperfError(f"{path}: no such MaxText config file; give its path (maxperf reads its keys), or name "
                           "configs/base.yml with the keys as words")
    if path.resolve() in seen:
        raise MaxperfError(f"{path}: its base_config names itself again ({' -> '.join(map(str, seen))})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise MaxperfError(f"{path}: not a readable YAML config ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise MaxperfError(f"{path}: a MaxText config is a mapping of keys to values, got a {type(data).__name__}")
    base = data.pop("base_config", None)
    keys: dict = {}
    if base and Path(str(base)).name not in BASE_FILES:
        keys.update(_config_keys(path.parent / str(base), (*seen, path.resolve())))
    keys.update(data)
    return keys


def _yaml_word(value) -> str:
    """A YAML value as a key=value word's value: true/false, a list as JSON, anything else as it prints."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return str(value)


def _activation_list(value: str) -> str:
    """MaxText's mlp_activations list (["silu", "linear"]) as maxperf's activation name; a MaxperfError naming the
    lists maxperf builds for any other."""
    try:
        names = tuple(str(v).strip().lower() for v in json.loads(value.replace("'", '"')))
    except (ValueError, TypeError):
        names = tuple(v.strip().strip("'\"").lower() for v in value.strip().strip("[]").split(",") if v.strip())
    if names not in ACTIVATION_LISTS:
        known = ", ".join(f"[{', '.join(k)}]" for k in ACTIVATION_LISTS)
        raise MaxperfError(f"mlp_activations={value}: maxperf builds {known} (or activation=clamped_swiglu)")
    return ACTIVATION_LISTS[names]


def _found(found: dict[str, str], key: str, value: str) -> None:
    """Records one of the keys that name the request; the same key twice with two values is a MaxperfError."""
    if key in found and found[key] != value:
        raise MaxperfError(f"{key}={found[key]} and {key}={value} disagree: give one")
    found[key] = value


def check_decoder_block(block: str, model: str) -> None:
    """MaxText's `decoder_block=BLOCK` beside the model it builds: restating the model's own block changes nothing; any
    other block is a MaxperfError, one line (maxperf builds each preset's block and no other)."""
    own = DECODER_BLOCKS.get(model, "llama2" if model.startswith("scaled-") else None)
    if own is None:
        raise MaxperfError(f"{DECODER_BLOCK_KEY}={block}: {model} is not one of MaxText's model configs; maxperf "
                           f"builds its own decoder block: leave {DECODER_BLOCK_KEY} out")
    if block != own:
        raise MaxperfError(f"{DECODER_BLOCK_KEY}={block}: MaxText builds {model} with {DECODER_BLOCK_KEY}={own}, and "
                           f"maxperf builds each model's own block: leave {DECODER_BLOCK_KEY} out or give {own}")


def _same(value: str, default: str) -> bool:
    """Whether MaxText's `value` is `default` as its config reads it (True/true/1, 0/0.0, quoted or not)."""
    text, default = value.strip().strip("'\"").lower(), default.lower()
    words = {"true": "1", "false": "0"}
    text, default = words.get(text, text), words.get(default, default)
    try:
        return float(text) == float(default)
    except ValueError:
        return text == default


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise MaxperfError(f"{key}={value} is not valid; {key} takes a number") from None


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
    name = LAYOUT_MODELS.get(name, name)
    if name == "default":
        return "scaled-1"
    if presets.canonical(name) in presets.names():
        return presets.canonical(name)
    hits = closest(name, sorted({*presets.FROM_MAXTEXT, *presets.names()}))
    raise MaxperfError(f"{MODEL_KEY}={name} names no model maxperf has; "
                       + (f"did you mean {', '.join(hits[:3])}? " if hits else "") + "`maxperf models` lists them")


def _slices(found: dict[str, str]) -> int | None:
    value, runtime = found.get(SLICES_KEY), found.get(RUNTIME_SLICES_KEY)
    if runtime is not None and value is not None and runtime != value:
        raise MaxperfError(f"{SLICES_KEY}={value} and {RUNTIME_SLICES_KEY}={runtime} disagree: give one")
    key = SLICES_KEY if value is not None else RUNTIME_SLICES_KEY
    value = value if value is not None else runtime
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise MaxperfError(f"{key}={value} must be a whole number of slices, 1 or more")
    return int(value)
