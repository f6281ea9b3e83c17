"""What a pipelined step does on one device (models/pipeline.py, MaxText's layers/pipeline.py), for the step time and
memory models: the loop's iterations each run the device's stage on one microbatch, so a layer's work is counted per
iteration on a microbatch's tokens, bubble iterations included (they compute, on nothing of use); the embeddings,
the logits and the loss split the batch over the stages too; and each iteration moves its stages' outputs one stage
on over the `stage` axis's network."""

from __future__ import annotations

from dataclasses import dataclass

from maxperf.perfmodel.network import AxisNetwork, CollectiveTime
from maxperf.perfmodel.sharding import activation_split
from maxperf.spec.logical_axes import local_size, split
from maxperf.spec.memo import model_memo
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.params import param_arrays, stage_share
from maxperf.spec.pipeline import Schedule
from maxperf.spec.pipeline import of as schedule_of
from maxperf.spec.train import TrainConfig

# Each iteration's permutes depend on the stages' outputs and feed the next iteration's inputs, so without the
# forwarding delay little of them hides behind compute; with it (pipeline_delay_activation_forwarding) an
# iteration's communication is independent of its compute (MaxText's base.yml note), assumed to hide whole. Assumed:
# no published row pipelines with a measured split between the two.
STAGE_OVERLAP = {1: 0.0, 2: 0.9}


@dataclass(frozen=True)
class View:
    """How a pipelined step scales the unpipelined counts: layer work `layer_scale` times a layer per microbatch, on
    `token_scale` of the microbatch's tokens; the logits on `logits_scale` of them; the layers' saved activations
    `held_scale` of that work's (the iterations a stage holds at once, Schedule.held_iterations). All 1 without a
    pipeline."""

    schedule: Schedule | None
    layer_scale: float = 1.0
    token_scale: float = 1.0
    logits_scale: float = 1.0
    held_scale: float = 1.0

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None


NONE = View(None)


def view(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> View:
    """The view of this step on this mesh (NONE without a pipeline)."""
    s = schedule_of(model, train, mesh)
    if s is None:
        return NONE
    # a device runs its U places on one microbatch per iteration, every iteration: iterations x U units' work over
    # the model's units (an empty place computes its unit and passes its input on, models/pipeline.py)
    return View(s, layer_scale=s.iterations * s.units_per_stage / s.units,
                token_scale=microbatch_rows(model, train, mesh, s.microbatches),
                logits_scale=1 / s.stages, held_scale=s.held_iterations / s.iterations)


def microbatch_rows(model: ModelConfig, train: TrainConfig, mesh: Mesh, microbatches: int) -> float:
    """A pipeline microbatch's rows on one device over the device's rows of the whole microbatch (1 / microbatches
    where the batch axes divide the pipeline microbatch): where they do not, its rows are replicated along those
    axes, as the compiled step holds them (spec.logical_axes), and every device along them computes the same rows."""
    rows = train.micro_batch(mesh.devices) / microbatches
    whole = activation_split(model, train.per_device_batch_size, train.seq_len, mesh).B
    if not float(rows).is_integer() or not whole:
        return 1 / microbatches
    sizes = dict(mesh.sizes)
    return rows / split((int(rows),), ("activation_batch",), sizes)[0] / whole


def empty_place_params(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> float:
    """The parameters one device stores for its stack's empty places (Schedule.empty_first, empty_last): a unit's
    weights each, as every stage holds the same shapes; 0 without them."""
    s = schedule_of(model, train, mesh)
    if s is None or s.places == s.units:
        return 0.0
    memo = model_memo(model)  # one sum per mesh, asked at every candidate of it
    if (decoder := memo.get(("decoder params per device", mesh.sizes))) is None:
        axes = dict(mesh.sizes)
        decoder = memo["decoder params per device", mesh.sizes] = sum(
            x.count * local_size(x.shape, x.logical, axes) * stage_share(x, axes) for x in param_arrays(model)
            if x.block)
    return decoder * (s.places / s.units - 1)


def permute_time(nbytes: float, net: AxisNetwork) -> CollectiveTime:
    """One collective permute along an axis (each member sends `nbytes` to the next), the slowest member's time:
    inside the fast network over one direction of one link (a torus) or the member's switch bandwidth (NVLink); where
    the axis spans slices or hosts, the members at their edges send over the host network."""
    if net.outer > 1:  # the members at a slice's or host's edge send over the host network, the slowest
        return CollectiveTime(0.0, nbytes / net.outer_bandwidth, 1.0)
    if net.inner <= 1:
        return CollectiveTime(0.0, 0.0)
    bw = net.inner_bandwidth / net.links if net.torus else net.inner_bandwidth
    return CollectiveTime(nbytes / (bw * net.efficiency("all-gather")) + net.inner_latency, 0.0)


def transfers_per_iteration(s: Schedule) -> int:
    """The permutes of one iteration's forward: the stages' outputs to the next stage, the last stage's output into
    the input-output buffer (its column moved one stage back), and with circular storage the parked output."""
    return 2 + s.circular_storage


__all__ = ["NONE", "STAGE_OVERLAP", "View", "empty_place_params", "permute_time", "transfers_per_iteration", "view"]
