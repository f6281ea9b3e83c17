"""A plan's candidate as command lines: maxperf's `compile` and MaxText's train_compile (plan.json's `command`)."""

from __future__ import annotations

from collections.abc import Sequence

from maxperf.search.candidates import Candidate, number, precision_words
from maxperf.spec import overrides as overrides_mod
from maxperf.spec import presets
from maxperf.spec import topology as topologies

_MAXTEXT_NAMES = {v: k for k, v in overrides_mod.ALIASES.items() if not k.startswith(("ici_", "dcn_"))}
MAXTEXT_AXES = {"sequence": "context", "stage": "pipeline"}  # maxperf's mesh axes MaxText names otherwise


def maxtext_flags(c: Candidate) -> tuple[str, ...]:
    """The candidate's words in MaxText's spellings: per_device_batch_size (one microbatch, in both), its
    gradient_accumulation_steps the microbatches (A); mesh axes as *_parallelism, sequence as context, stage as
    pipeline."""
    words = []
    for prefix, sizes in (("ici", c.ici), ("dcn", c.dcn)):
        for a, n in sizes.items():
            if n > 1 or (prefix == "ici" and a == "fsdp"):  # MaxText's ici_fsdp defaults to -1: always say it
                words.append(f"{prefix}_{MAXTEXT_AXES.get(a, a)}_parallelism={n}")
    words += [f"remat_policy={c.remat_policy}", f"attention={c.attention}",
              f"per_device_batch_size={number(c.per_device_batch_size)}"]
    if c.grad_accum_steps > 1:
        words.append(f"gradient_accumulation_steps={c.grad_accum_steps}")
    if c.pipeline_microbatches:
        words.append(f"num_pipeline_microbatches={c.pipeline_microbatches}")
    return (*words, *precision_words(c.quantization))


def command(c: Candidate, *, model: str, topology: str, platform: str, num_slices: int, seq_len: int,
            fixed: Sequence[str]) -> dict[str, str | None]:
    """`c` as a maxperf compile command line and as MaxText's (None, with `maxtext_note` saying why, where MaxText
    has no config of the model)."""
    slices = f" --num-slices {num_slices}" if num_slices > 1 else ""
    pins = "".join(f" {w}" for w in fixed)
    out = {"maxperf": f"maxperf compile --model {model} --topology {topology}{slices}{pins} " + " ".join(c.overrides())}
    pinned = {overrides_mod.ALIASES.get(k, k) for k in (w.partition("=")[0] for w in fixed)}
    maxtext_model = presets.maxtext_model(model, pinned)
    if maxtext_model is None:
        return out | {"maxtext": None, "maxtext_note": f"no equivalent: MaxText has no config of {model}"}
    places = [w for w in fixed if w.partition("=")[0] in MEGATRON_PLACES and w.partition("=")[2].lower() == "true"]
    if places and c.ici["stage"] * c.dcn["stage"] > 1:
        return out | {"maxtext": None, "maxtext_note": "no equivalent: MaxText's pipeline stages hold equal numbers "
                                                       f"of layers ({', '.join(places)} are Megatron-LM's)"}
    schedule = [w for w in fixed if w.partition("=")[0] == "pipeline_schedule" and w.partition("=")[2] == "1f1b"]
    if schedule and c.ici["stage"] * c.dcn["stage"] > 1:
        return out | {"maxtext": None, "maxtext_note": "no equivalent: MaxText's pipeline runs its own schedule "
                                                       "(pipeline_schedule=1f1b is Megatron-LM's)"}
    maxtext_fixed = "".join(f" {w}" for w in _maxtext_fixed(fixed))
    flags = f"max_target_length={seq_len}{maxtext_fixed} " + " ".join(maxtext_flags(c))
    # MaxText's train_compile names TPU topologies as maxperf does, and GPU hosts by their machine type (run on one
    # such host, which it needs for the compile), one slice a host; a GPU it names no machine of, its flags alone
    train_compile = "python3 -m maxtext.trainers.pre_train.train_compile src/maxtext/configs/base.yml"
    if platform == "tpu":
        start = (f"{train_compile} {' '.join(maxtext_model)} compile_topology={topology} "
                 f"compile_topology_num_slices={num_slices} ")
    elif (machine := GPU_MACHINES.get((topo := topologies.get(topology)).chip)) is not None:
        if topo.chips_per_host != GPU_MACHINE_CHIPS:  # part of a host: no machine of MaxText's is that
            return out | {"maxtext": f"{' '.join(maxtext_model)} {flags}",
                          "maxtext_note": f"MaxText's flags alone: its train_compile's {machine} is a host of "
                                          f"{GPU_MACHINE_CHIPS} GPUs, and {topology} is {topo.chips_per_host} of "
                                          "one, so give them to its train on those GPUs"}
        start = (f"{train_compile} {' '.join(maxtext_model)} hardware=gpu compile_topology={machine} "
                 f"compile_topology_num_slices={topo.hosts * num_slices} ")
    else:
        return out | {"maxtext": f"{' '.join(maxtext_model)} {flags}",
                      "maxtext_note": f"MaxText's flags alone: its train_compile names no machine of {topology}'s "
                                      "GPUs, so give them to its train on the GPU hosts"}
    return out | {"maxtext": start + flags}


# MaxText's names of GPU machines (its accelerator_to_spec_map, which train_compile's compile_topology takes): A3,
# eight H100s a host; A4, eight B200s
GPU_MACHINES = {"h100-sxm": "a3", "b200": "a4"}
GPU_MACHINE_CHIPS = 8


# maxperf's keys of Megatron-LM's uneven pipeline stages, which MaxText has not
MEGATRON_PLACES = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def _maxtext_fixed(words: Sequence[str]) -> list[str]:
    out = []
    for w in words:
        key, _, value = w.partition("=")
        if key in ("seq_len", "max_target_length", "pipeline_schedule") or key in MEGATRON_PLACES:
            # said as max_target_length already; without stages the places and the schedule change nothing, and
            # gpipe is MaxText's own
            continue
        out.append(f"{_MAXTEXT_NAMES.get(key, key)}={value}")
    return out
