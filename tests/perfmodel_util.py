"""Topologies for perfmodel's tests that the catalog does not name: a chip, a count and a layout."""

from maxperf.spec.hardware import CHIPS
from maxperf.spec.topology import Topology


def Topo(chip: str, chips: int, chips_per_host: int = 4, num_slices: int = 1, hosts: int = 1, torus: tuple = (),
         devices_per_chip: int = 1) -> Topology:
    """`chips` chips of `chip` over `num_slices` slices and `hosts` hosts; a GPU's NVLink domain is one host, or as many
    hosts as the chip's domain holds (GB200 NVL72)."""
    spec = CHIPS[chip]
    platform = spec.kind
    per_domain = (spec.nvlink_domain or chips_per_host) // chips_per_host
    hosts_per_nvlink_domain = max(1, min(hosts // num_slices, per_domain)) if platform == "gpu" else 1
    return Topology(name=f"{chip}-{chips}", platform=platform, chip=chip, chips_per_slice=chips // num_slices,
                    hosts_per_slice=max(1, hosts // num_slices), chips_per_host=chips_per_host, num_slices=num_slices,
                    torus=tuple(torus), devices_per_chip=devices_per_chip,
                    hosts_per_nvlink_domain=hosts_per_nvlink_domain)
