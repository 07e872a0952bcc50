"""From link measurements to the Topology the planner reads (plain Python, no TensorFlow).

`dapple.link_measure` times transfers between pairs of Horovod ranks,
`dapple.tf_link_measure` between tasks of a TensorFlow cluster; this module turns the
timings into link figures and a `Topology` whose `measured` record keeps every pair's numbers
and when they were taken:

* A link's latency is the median time one small transfer takes (Horovod's negotiation
  included, as in every transfer dapple makes); its bandwidth is what the extra bytes of a
  large transfer cost: (large - small bytes) / (large - small seconds), from the fastest call
  of each size. Fastest, because on a shared machine the delays of being scheduled late only
  add time, and they swamp the difference of two medians on a fast link (docs/cluster.md,
  "Measuring the links", has the spread seen).
* A link class (inside hosts, between hosts) takes the median over its measured pairs. A class
  with no pair to measure (one host; one rank per host) keeps the figure of
  `topology.constants` and is listed under `measured["assumed"]`.
"""
from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from topology import constants as C
from topology.model import Topology

Pair = Tuple[int, int]


@dataclass(frozen=True)
class PairTiming:
    """Seconds per transfer between ranks `ranks`, for a small and a large message."""
    ranks: Pair
    hosts: Pair
    small_bytes: int
    small_seconds: float                # median
    small_fastest: float
    large_bytes: int
    large_seconds: float
    large_fastest: float

    @property
    def latency(self) -> float:
        return self.small_seconds

    @property
    def bandwidth(self) -> float:
        extra_seconds = self.large_fastest - self.small_fastest
        if extra_seconds <= 0:          # noise swamped the difference: the plain rate
            return self.large_bytes / self.large_fastest
        return (self.large_bytes - self.small_bytes) / extra_seconds

    def to_dict(self) -> Dict[str, Any]:
        return {"ranks": list(self.ranks), "hosts": list(self.hosts),
                "bandwidth": self.bandwidth, "latency": self.latency,
                "seconds_per_transfer": {
                    str(size): {"median": median, "fastest": fastest}
                    for size, median, fastest in (
                        (self.small_bytes, self.small_seconds, self.small_fastest),
                        (self.large_bytes, self.large_seconds, self.large_fastest))}}


def host_starts(devices_per_host: Sequence[int]) -> List[int]:
    starts, rank = [], 0
    for n in devices_per_host:
        starts.append(rank)
        rank += n
    return starts


def pairs_to_measure(devices_per_host: Sequence[int]) -> Tuple[List[Pair], List[Pair]]:
    """(pairs inside hosts, pairs between hosts): the first two ranks of every host with two or
    more, and the first ranks of neighbouring hosts."""
    starts = host_starts(devices_per_host)
    inside = [(s, s + 1) for s, n in zip(starts, devices_per_host) if n >= 2]
    between = [(starts[h], starts[h + 1]) for h in range(len(starts) - 1)]
    return inside, between


def hosts_of(devices_per_host: Sequence[int], pair: Pair) -> Pair:
    """The hosts of the pair's ranks (ranks numbered host by host)."""
    starts = host_starts(devices_per_host)

    def host(rank: int) -> int:
        return max(h for h, s in enumerate(starts) if s <= rank)

    return host(pair[0]), host(pair[1])


def devices_per_host_of(local_ranks: Sequence[int], local_sizes: Sequence[int]) -> List[int]:
    """Ranks per host from every rank's (local rank, local size), in rank order; ranks must be
    numbered host by host, as horovodrun and `dapple emulate` number them."""
    counts, rank = [], 0
    while rank < len(local_ranks):
        size = local_sizes[rank]
        expected = list(range(size))
        if list(local_ranks[rank:rank + size]) != expected:
            raise ValueError(f"ranks {rank}..{rank + size - 1} have local ranks "
                             f"{list(local_ranks[rank:rank + size])}, not {expected}: ranks are "
                             f"not numbered host by host, so hosts cannot be told apart")
        counts.append(size)
        rank += size
    return counts


def _median(values: List[float], fallback: float) -> float:
    return float(statistics.median(values)) if values else fallback


def measured_topology(devices_per_host: Sequence[int], device_memory_bytes: float,
                      inside: Sequence[PairTiming], between: Sequence[PairTiming],
                      details: Optional[Dict[str, Any]] = None,
                      at: Optional[datetime.datetime] = None,
                      transfer_cpu: Tuple[float, float] = (0.0, 0.0)) -> Topology:
    """The Topology of these measurements (see the module doc); `details` join the record;
    `transfer_cpu`: (seconds, bytes/s) of `Topology.transfer_cpu_*`, where a method measures
    them."""
    when = (at or datetime.datetime.now(datetime.timezone.utc)).replace(microsecond=0)
    assumed = []
    if not inside:
        assumed.append("in-host link (no host has two ranks): topology.constants NVLink "
                       "figures")
    if not between:
        assumed.append("link between hosts (one host): topology.constants 25 Gbps Ethernet "
                       "figures")
    record: Dict[str, Any] = {
        "at": when.isoformat(),
        "by": "dapple topology --measure",
        "intra_host": [p.to_dict() for p in inside],
        "inter_host": [p.to_dict() for p in between],
    }
    if assumed:
        record["assumed"] = assumed
    record.update(details or {})
    return Topology(
        devices_per_host=tuple(devices_per_host), device_memory_bytes=device_memory_bytes,
        intra_host_bandwidth=_median([p.bandwidth for p in inside], C.NVLINK_BANDWIDTH),
        inter_host_bandwidth=_median([p.bandwidth for p in between], C.ETHERNET_25G_BANDWIDTH),
        intra_host_latency=_median([p.latency for p in inside], C.NVLINK_LATENCY),
        inter_host_latency=_median([p.latency for p in between], C.ETHERNET_LATENCY),
        transfer_cpu_latency=transfer_cpu[0], transfer_cpu_bandwidth=transfer_cpu[1],
        name="measured", measured=record)


def summary_lines(topology: Topology) -> List[str]:
    """Human-readable lines: the topology, then one line per measured pair."""
    lines = [topology.describe(), f"{topology.links_source()}"]
    record = topology.measured or {}
    for kind in ("intra_host", "inter_host"):
        for pair in record.get(kind, []):
            a, b = pair["ranks"]
            lines.append(f"  {kind.replace('_', '-')} ranks {a}<->{b}: "
                         f"{pair['bandwidth'] * 8 / 1e6:,.1f} Mbit/s, latency "
                         f"{pair['latency'] * 1e3:.3f} ms")
    for note in record.get("assumed", []):
        lines.append(f"  assumed: {note}")
    return lines
