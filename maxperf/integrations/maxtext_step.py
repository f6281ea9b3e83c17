"""MaxText's own train step as a user's step: the state, batch, shardings and step function that MaxText's
`train_compile` builds, made by MaxText's functions over maxperf's mesh.

    maxperf compile --step maxperf.integrations.maxtext_step:make_step --topology v5p-256 \\
        model_name=llama2-7b per_device_batch_size=4 remat_policy=full attention=flash

It runs where MaxText is installed (`pip install maxtext[tpu]`; ../shared/peer/maxtext_aot.sh makes such a
venv), with maxperf installed beside it. Every `key=value` word but the mesh's (`ici_*`, `dcn_*`, which size
maxperf's mesh as for its own steps) is a MaxText config key passed to MaxText's `pyconfig.initialize` with its
configs/base.yml, as `train_compile` takes them. The mesh's sizes become MaxText's `ici_*_parallelism` and
`dcn_*_parallelism` (maxperf's `sequence` axis is MaxText's `context`), and MaxText lays out its own mesh over the
same devices (`maxtext_utils.create_device_mesh`), as `train_compile` does; the batch is MaxText's, per device
`per_device_batch_size`. What `train_compile.main` sets beside its config is set too: the `unsafe_rbg` PRNG and,
on TPUs, `xla_tpu_spmd_rng_bit_generator_unsafe` (here a compiler option of the step), and the config's
`compile_xla_flags`.

MaxText's model FLOPs (`calculate_tflops_training_per_device`) and tokens per step give the step's TFLOP/s and MFU.
`maxperf run` cannot run it: MaxText's train.py runs its own step (Step.init is not given).
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from pathlib import Path

from maxperf.aot.user_step import Step

# maxperf's mesh axes as MaxText's parallelism keys (its `context` is maxperf's `sequence`)
MAXTEXT_AXES = {"data": "data", "stage": "pipeline", "fsdp": "fsdp", "fsdp_transpose": "fsdp_transpose",
                "sequence": "context", "tensor": "tensor", "expert": "expert"}
INSTALL_HINT = "install MaxText beside maxperf (pip install 'maxtext[tpu]'; ../shared/peer/maxtext_aot.sh makes a venv)"


def base_config() -> str:
    """MaxText's configs/base.yml, from the installed package."""
    spec = importlib.util.find_spec("maxtext")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"MaxText is not installed here: {INSTALL_HINT}")
    return str(Path(next(iter(spec.submodule_search_locations))) / "configs" / "base.yml")


def mesh_words(mesh) -> list[str]:
    """MaxText's ici_* / dcn_* keys for maxperf's jax Mesh: each axis's size within a slice and across slices (the
    devices' slice_index along the axis)."""
    import numpy as np

    words = []
    devices = mesh.devices
    for i, axis in enumerate(mesh.axis_names):
        if axis not in MAXTEXT_AXES:
            raise ValueError(f"maxperf's mesh has an axis {axis!r} MaxText's keys do not name")
        line = np.moveaxis(devices, i, 0).reshape(devices.shape[i], -1)[:, 0]
        across = len({getattr(d, "slice_index", 0) for d in line})
        words += [f"ici_{MAXTEXT_AXES[axis]}_parallelism={devices.shape[i] // across}",
                  f"dcn_{MAXTEXT_AXES[axis]}_parallelism={across}"]
    return words


def with_shardings(tree, shardings):
    """`tree`'s arrays as jax.ShapeDtypeStructs carrying `shardings`, a tree of shardings or a prefix of `tree`
    (MaxText gives its batch one sharding for every array)."""
    import jax
    from jax.sharding import Sharding

    def attach(sharding, subtree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree)

    return jax.tree.map(attach, shardings, tree, is_leaf=lambda s: s is None or isinstance(s, Sharding))


def make_step(mesh, model_name: str = "default", **overrides: str) -> Step:
    """MaxText's train step for `model_name` with its config keys `overrides` (see the module docstring)."""
    config_path = base_config()  # says how to install MaxText where it is missing
    import jax
    from flax.core.spmd import logical_axis_rules
    from jax.sharding import AxisType
    from jax.sharding import Mesh as JaxMesh
    from maxtext.common.common_types import ShardMode
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import max_utils, maxtext_utils, sharding

    devices = list(mesh.devices.flat)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    platform = devices[0].platform
    work = tempfile.mkdtemp(prefix="maxperf-maxtext-")
    argv = ["maxtext", config_path, f"model_name={model_name}", "internal_compile=true",
            f"internal_compile_num_devices={len(devices)}", f"compile_topology_num_slices={slices}",
            "run_name=maxperf", f"base_output_directory={work}", "jax_cache_dir=", "log_config=false",
            "enable_checkpointing=false", *mesh_words(mesh),
            *([] if platform == "tpu" else ["hardware=gpu"]),
            *(f"{k}={v}" for k, v in overrides.items())]
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # as train_compile.main
    config = pyconfig.initialize(argv)
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
    maxtext_mesh = JaxMesh(maxtext_utils.create_device_mesh(config, devices), config.mesh_axes,
                           axis_types=(axis_type,) * len(config.mesh_axes))

    # train_compile.main, up to its jit: shaped inputs, shardings, and the functional train step
    shaped_args, _, state_shardings, _, model = train_compile.get_shaped_inputs(maxtext_mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    input_state_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings,
                                                                             params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, maxtext_mesh)
    fn, in_shardings, out_shardings, _, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_state_shardings, model, config, params_shardings)
    args = tuple(with_shardings(arg, shardings) for arg, shardings in zip(shaped_args, in_shardings))

    @contextlib.contextmanager
    def context():
        with jax.set_mesh(maxtext_mesh), logical_axis_rules(config.logical_axis_rules):
            yield

    options = dict(max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags))
    if platform == "tpu":
        options["xla_tpu_spmd_rng_bit_generator_unsafe"] = True
    total_tflops, _, _ = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
    tokens = config.global_batch_size_to_train_on * config.max_target_length
    return Step(fn=fn, args=args, donate=(donate,) if isinstance(donate, int) else tuple(donate),
                out_shardings=out_shardings, model_flops=total_tflops * 1e12 * len(devices),
                tokens_per_step=tokens, unit="tokens", compiler_options=options, context=context,
                name=f"MaxText {model_name}")

