"""A pipeline's schedule as MaxText resolves it (configs/types.py): stages from the `stage` mesh axis, the layers each
stage runs per repeat, the repeats (circular pipelining, NVIDIA's virtual stages), the microbatches, and the
iterations of the loop that runs them (layers/pipeline.py). Everything that counts a pipelined step reads this."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maxperf.spec.errors import MaxperfError
from maxperf.spec.memo import model_memo
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.train import TrainConfig


@dataclass(frozen=True)
class Schedule:
    stages: int  # S: ici_pipeline_parallelism x dcn_pipeline_parallelism
    microbatches: int  # M: num_pipeline_microbatches, a multiple of S
    repeats: int  # R: num_pipeline_repeats; > 1 is a circular pipeline
    units_per_stage: int  # U: the stack's units each stage runs per repeat (num_layers_per_pipeline_stage)
    delay: int = 1  # 2 with pipeline_delay_activation_forwarding
    fsdp_gather_once: bool = False  # pipeline_fsdp_ag_once
    # places that hold no unit, before the first unit (the embedding's, account_for_embedding_in_pipeline_split) and
    # after the last (the loss's, account_for_loss_in_pipeline_split): S x R x U places hold the units and these
    empty_first: int = 0
    empty_last: int = 0
    one_f_one_b: bool = False  # pipeline_schedule=1f1b: Megatron-LM's order (held_iterations)

    @property
    def places(self) -> int:
        """S x R x U: the unit slots of the stored stack, empty ones included."""
        return self.stages * self.repeats * self.units_per_stage

    @property
    def units(self) -> int:
        """The model's units the places hold."""
        return self.places - self.empty_first - self.empty_last

    def live(self) -> np.ndarray:
        """bool [places] in the model's order: whether each place holds a unit (place p holds unit p - empty_first)."""
        at = np.arange(self.places)
        return (at >= self.empty_first) & (at < self.empty_first + self.units)

    @property
    def iterations(self) -> int:
        """The loop's iterations: M x R carry work, delay x (S - 1) more drain the pipeline (the bubble)."""
        return self.microbatches * self.repeats + self.bubble_iterations

    @property
    def held_iterations(self) -> int:
        """The loop iterations whose activations the busiest (first) stage holds at once. MaxText's schedule (gpipe)
        runs the backward after every forward: all of them. Megatron-LM's 1F1B starts a microbatch's backward when it
        leaves the last stage, so the first stage holds the S microbatches in flight; interleaved over R repeats
        (virtual stages), its warm-up runs 2 (S - 1) + (R - 1) S forward chunks before the first backward, one more in
        the steady state (Narayanan et al., SC'21, section 2.2; Megatron-LM's
        forward_backward_pipelining_with_interleaving), each chunk a stage's layers of one repeat on one
        microbatch as one iteration here is. The bubble is the same either way: (S - 1) / (M R) of the work."""
        if not self.one_f_one_b:
            return self.iterations
        S, M, R = self.stages, self.microbatches, self.repeats
        in_flight = S if R == 1 else 2 * (S - 1) + (R - 1) * S + 1
        return min(M * R, in_flight)

    @property
    def bubble_iterations(self) -> int:
        return self.delay * (self.stages - 1)

    @property
    def bubble_fraction(self) -> float:
        """The share of each stage's iterations that compute nothing of use: delay (S - 1) / (M R + delay (S - 1)),
        MaxText's base.yml formula."""
        return self.bubble_iterations / self.iterations

    @property
    def circular_storage(self) -> bool:
        """Whether the last stage's outputs wait in a buffer of the whole batch before the next repeat (R > 1 and
        more microbatches than delay x S)."""
        return self.repeats > 1 and self.microbatches > self.stages * self.delay

    def as_dict(self) -> dict:
        return {"stages": self.stages, "microbatches": self.microbatches, "repeats": self.repeats,
                "layers_per_stage": self.units_per_stage, "iterations": self.iterations,
                "bubble_fraction": round(self.bubble_fraction, 4), "delay": self.delay,
                "fsdp_gather_once": self.fsdp_gather_once, "empty_places": [self.empty_first, self.empty_last],
                "schedule": "1f1b" if self.one_f_one_b else "gpipe", "held_iterations": self.held_iterations}


def schedule(stages: int, pipelined_units: int, batch: int, *, microbatches: int = -1, repeats: int = -1,
             units_per_stage: int = 1, delay: bool = False, fsdp_gather_once: bool = False,
             unit_name: str = "layers", empty_first: int = 0, empty_last: int = 0,
             one_f_one_b: bool = False) -> Schedule | None:
    """The schedule of `pipelined_units` units over `stages` stages for a batch of `batch` examples per step's
    microbatch (MaxText's micro_batch_size_to_train_on), or None without a pipeline (one stage); `empty_first`,
    `empty_last`: places before and after the units that hold none (Megatron's embedding and loss places);
    `one_f_one_b`: Megatron-LM's order (Schedule.held_iterations). Every
    mistake is one MaxperfError naming what would be valid."""
    if stages <= 1:
        return None
    if units_per_stage < 1:
        raise MaxperfError(f"num_layers_per_pipeline_stage={units_per_stage} must be at least 1")
    per_repeat = stages * units_per_stage
    places = pipelined_units + empty_first + empty_last
    what = f"{pipelined_units} pipelined {unit_name}"
    if places != pipelined_units:
        what += " and the " + " and ".join(n for n, k in (("embedding's", empty_first), ("loss's", empty_last)) if k)
        what += f" place{'s' * (empty_first + empty_last > 1)} ({places})"
    if repeats == -1:
        if places % per_repeat:
            valid = [u for u in range(1, places + 1) if places % (stages * u) == 0]
            raise MaxperfError(
                f"{stages} pipeline stages x num_layers_per_pipeline_stage={units_per_stage} do not divide the "
                f"{what}; " + (f"num_layers_per_pipeline_stage can be {', '.join(map(str, valid))}" if valid else
                               f"choose a stage count that divides {places} ("
                               + ", ".join(str(n) for n in range(2, places + 1) if places % n == 0) + ")")
                + ("" if (pipelined_units + 2) % per_repeat or empty_first + empty_last == 2 else
                   "; or give the embedding and the loss a layer's place each (account_for_embedding_in_pipeline_"
                   "split=true, account_for_loss_in_pipeline_split=true), as Megatron-LM's uneven stages do"))
        repeats = places // per_repeat
    elif repeats < 1 or stages * repeats * units_per_stage != places:
        raise MaxperfError(
            f"stages ({stages}) x num_pipeline_repeats ({repeats}) x num_layers_per_pipeline_stage "
            f"({units_per_stage}) must equal the {what}; num_pipeline_repeats=-1 derives it")
    if delay and one_f_one_b:
        raise MaxperfError("pipeline_delay_activation_forwarding delays MaxText's schedule; pipeline_schedule=1f1b "
                           "(Megatron-LM's) has no such delay: drop one of them")
    gap = 2 if delay else 1
    derived = microbatches == -1
    if derived:
        microbatches = gap * stages
    if microbatches < 1 or microbatches % stages:
        raise MaxperfError(f"num_pipeline_microbatches={microbatches} must be a positive multiple of the {stages} "
                           f"pipeline stages, e.g. {stages} or {2 * stages}")
    if delay and microbatches < 2 * stages:
        raise MaxperfError(f"pipeline_delay_activation_forwarding needs at least 2 x {stages} = {2 * stages} "
                           f"microbatches, got num_pipeline_microbatches={microbatches}")
    if batch % microbatches:
        # counts the batch splits into that the schedule also takes (at least 2 x stages with the delay)
        fits = [m for m in range(gap * stages, batch + 1, stages) if batch % m == 0]
        said = (f"num_pipeline_microbatches={microbatches}" if not derived else
                f"num_pipeline_microbatches={microbatches} ({'2 x ' if delay else ''}the {stages} stages, its default"
                + (" with pipeline_delay_activation_forwarding" if delay else "") + ")")
        fix = (f"choose one of {', '.join(map(str, fits[:8]))}" if fits else
               f"make the batch (per_device_batch_size x devices) a multiple of {microbatches}"
               + (" or drop pipeline_delay_activation_forwarding" if delay else ""))
        raise MaxperfError(f"the batch of {batch} examples does not split into {said}; {fix}")
    return Schedule(stages, microbatches, repeats, units_per_stage, gap, fsdp_gather_once, empty_first, empty_last,
                    one_f_one_b)


def empty_places(train: TrainConfig) -> tuple[int, int]:
    """The places before and after a pipelined stack's units that hold none: (the embedding's, the loss's)."""
    return int(train.account_for_embedding_in_pipeline_split), int(train.account_for_loss_in_pipeline_split)


def pipelined_units(model: ModelConfig) -> tuple[int, int]:
    """(units, layers per unit) of the stack a pipeline runs: the decoder's repeating unit (a layer; a block of the
    model's layer cycle, as Gemma 3's six layers or Llama 4 Maverick's dense-then-MoE pairs), every layer of the
    model; a MaxperfError where layers stand outside it."""
    step = model.layer_cycle()
    first = model.first_num_dense_layers if model.is_moe else 0
    if first:
        raise MaxperfError(
            f"pipeline parallelism over {model.name}: its {first} leading dense layers would run outside the "
            "pipeline (MaxText pipelines only the MoE layers of such a model); maxperf pipelines whole decoders; "
            "use ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    units, rest = divmod(model.num_layers, step)
    if rest:
        raise MaxperfError(f"pipeline parallelism over {model.name}: its {model.num_layers} layers are not whole "
                           f"blocks of its {step}-layer cycle; choose num_layers a multiple of {step}")
    return units, step


def of(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> Schedule | None:
    """The step's schedule on `mesh` (None with one stage): its microbatch (MaxText's micro_batch_size_to_train_on)
    is B x devices examples."""
    stages = mesh.axes["stage"]
    if stages <= 1:
        return None
    micro = train.micro_batch(mesh.devices)
    key = ("pipeline schedule", stages, micro, train.scan_layers,
           train.pipeline_parallel_layers, train.num_pipeline_microbatches, train.num_pipeline_repeats,
           train.num_layers_per_pipeline_stage, train.pipeline_delay_activation_forwarding,
           train.pipeline_fsdp_ag_once, empty_places(train), str(train.pipeline_schedule))
    memo = model_memo(model)  # a search asks for the same schedule at every candidate of a mesh
    if (found := memo.get(key)) is None:
        found = memo[key] = _of(model, train, stages, micro)
    return found


def _of(model: ModelConfig, train: TrainConfig, stages: int, micro: int) -> Schedule:
    units, step = pipelined_units(model)
    if not train.scan_layers:
        raise MaxperfError(f"pipeline parallelism ({stages} stages) runs the decoder as one scanned stack: set "
                           "scan_layers=true, or ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    if train.pipeline_parallel_layers not in (-1, units * step):
        raise MaxperfError(f"pipeline_parallel_layers={train.pipeline_parallel_layers}: maxperf pipelines all "
                           f"{units * step} layers of {model.name}; leave it at -1")
    first, last = empty_places(train)
    return schedule(stages, units, micro, microbatches=train.num_pipeline_microbatches,
                    repeats=train.num_pipeline_repeats, units_per_stage=train.num_layers_per_pipeline_stage,
                    delay=train.pipeline_delay_activation_forwarding, fsdp_gather_once=train.pipeline_fsdp_ag_once,
                    unit_name="layers" if step == 1 else f"blocks of {step} layers",
                    empty_first=first, empty_last=last, one_f_one_b=str(train.pipeline_schedule) == "1f1b")
