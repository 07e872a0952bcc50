"""What `dapple emulate --topology=...` asks for: hosts, ranks per host, and the NIC's rate.

Spec grammar (one string, comma-separated), close to `topology.parse`'s:

    HOSTSxRANKS,net=RATE[,burst=SIZE]        e.g. 2x2,net=200Mbps
    RANKS+RANKS+...,net=RATE[,burst=SIZE]    e.g. 2+1,net=1Gbps (hosts of unequal size)

RATE is bits (`200Mbps`, `1Gbps`) or bytes (`25MB/s`) per second, read by
`topology.units.parse_bandwidth`. Each host's network interface is shaped to RATE in both
directions with a token bucket (`tc ... tbf`); `burst` is the bucket's size (default
`default_burst_bytes(rate)`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Tuple

from topology.errors import TopologyError
from topology.units import parse_bandwidth

# The bucket's size trades two errors. Too small, and the link runs below its rate: tbf
# sleeps until enough tokens exist, and on a loaded machine its timer wakes late (1 Gbit/s
# with a 64 KiB bucket carried 570-730 Mbit/s). Too large, and a transfer after an idle
# moment (every ping-pong, every pipeline boundary) starts with a full bucket and its first
# `burst` bytes pass at memory speed (1 Gbit/s with 1.25 MB carried 8 MiB messages at 1114
# Mbit/s). A bucket of BURST_SECONDS at the rate, at least MIN_BURST_BYTES (one TSO/GSO
# segment), carried 985 Mbit/s at 1 Gbit/s and 192 at 200 Mbit/s (TCP payload; the rest is
# headers), measured with Python sockets between two namespaces.
BURST_SECONDS = 0.002
MIN_BURST_BYTES = 64 * 1024
# How long a packet may wait in the bucket's queue before tbf drops it: long enough that TCP
# sees a deep buffer (few drops, the rate it measures is the shaped rate), short enough that
# a stalled run does not queue for seconds.
QUEUE_LATENCY = "50ms"

_SHAPE = re.compile(r"^(\d+)x(\d+)$|^(\d+(?:\+\d+)+)$")
_KEYS = ("net", "burst")
EXAMPLE = "2x2,net=200Mbps"


class EmulateError(ValueError):
    """The emulated cluster cannot be built or run as asked; the message says why."""


@dataclass(frozen=True)
class EmulatedCluster:
    ranks_per_host: Tuple[int, ...]      # host by host, as `horovodrun -H h0:2,h1:2`
    rate_bytes_per_s: float              # every host's NIC, each direction
    burst_bytes: int                     # token bucket size of each shaped interface

    @property
    def num_hosts(self) -> int:
        return len(self.ranks_per_host)

    @property
    def num_ranks(self) -> int:
        return sum(self.ranks_per_host)

    @property
    def tc_rate(self) -> str:
        return tc_rate(self.rate_bytes_per_s)

    def describe(self) -> str:
        counts = self.ranks_per_host
        shape = (f"{len(counts)}x{counts[0]}" if len(set(counts)) == 1
                 else "+".join(map(str, counts)))
        return (f"{shape} ({self.num_ranks} ranks on {self.num_hosts} hosts), NICs at "
                f"{format_rate(self.rate_bytes_per_s)} (tbf burst {self.burst_bytes // 1024} KiB)")


def tc_rate(bytes_per_s: float) -> str:
    """The `tc` rate argument for a rate in bytes/s: whole bits per second ('200000000bit')."""
    bits = int(round(bytes_per_s * 8))
    if bits < 8000:
        raise EmulateError(f"a link rate of {bits} bit/s is below what tc's token bucket "
                           f"shapes (8 kbit/s); give at least 8kbps")
    return f"{bits}bit"


def format_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def default_burst_bytes(rate_bytes_per_s: float) -> int:
    """A bucket of BURST_SECONDS at the rate, but at least `MIN_BURST_BYTES`."""
    return max(MIN_BURST_BYTES, int(rate_bytes_per_s * BURST_SECONDS))


def _size_bytes(text: str, spec: str) -> int:
    m = re.match(r"^\s*(\d+)\s*(b|kb|kib|mb|mib)?\s*$", text.lower())
    if not m:
        raise EmulateError(f"--topology={spec!r}: burst={text!r} should be a size such as "
                           f"256KiB or 1MiB")
    scale = {None: 1, "b": 1, "kb": 1000, "kib": 1024, "mb": 10 ** 6, "mib": 2 ** 20}[m.group(2)]
    value = int(m.group(1)) * scale
    if value < MIN_BURST_BYTES:
        raise EmulateError(f"--topology={spec!r}: burst={text} is below 64 KiB, the size of "
                           f"one TCP segment (TSO/GSO)")
    return value


def parse_emulated_cluster(spec: str) -> EmulatedCluster:
    """`2x2,net=200Mbps` -> EmulatedCluster((2, 2), 25e6 bytes/s, burst 64 KiB)."""
    if not isinstance(spec, str) or not spec.strip():
        raise EmulateError(f"--topology is required, e.g. --topology={EXAMPLE}")
    parts = [p.strip() for p in spec.split(",")]
    m = _SHAPE.match(parts[0].lower())
    if not m:
        raise EmulateError(f"--topology={spec!r}: start with HOSTSxRANKS (ranks per host) or "
                           f"RANKS+RANKS for hosts of unequal size, as in {EXAMPLE}")
    if m.group(1):
        counts = (int(m.group(2)),) * int(m.group(1))
    else:
        counts = tuple(int(n) for n in m.group(3).split("+"))
    if not counts or min(counts) < 1:
        raise EmulateError(f"--topology={spec!r}: every host needs at least one rank and "
                           f"there must be at least one host")
    values = {}
    for part in parts[1:]:
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or key not in _KEYS:
            raise EmulateError(f"--topology={spec!r}: {part!r} should be key=value with key "
                               f"one of {', '.join(_KEYS)}")
        if key in values:
            raise EmulateError(f"--topology={spec!r} gives {key}= twice")
        values[key] = value
    if "net" not in values:
        raise EmulateError(f"--topology={spec!r} needs the hosts' link rate, net=RATE, as in "
                           f"{EXAMPLE}")
    try:
        rate = parse_bandwidth(values["net"])
    except TopologyError as e:
        raise EmulateError(f"--topology={spec!r}: net={values['net']}: {e}") from None
    tc_rate(rate)                                  # refuse rates tc cannot shape, here
    burst = (_size_bytes(values["burst"], spec) if "burst" in values
             else default_burst_bytes(rate))
    return EmulatedCluster(ranks_per_host=counts, rate_bytes_per_s=rate, burst_bytes=burst)
