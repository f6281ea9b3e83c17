"""A topology for perfmodel's tests: the attributes of perfmodel.shapes.TopologyShape, without maxperf.aot."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Topo:
    chip: str
    chips: int
    chips_per_host: int = 4
    num_slices: int = 1
    hosts: int = 1
    torus: tuple = ()
