"""Building a Topology from a preset name, a spec string, or a JSON file.

Spec grammar (one string, comma-separated):

    HOSTSxDEVICES[,nvlink=BW][,net=BW][,mem=SIZE][,nvlink_latency=T][,net_latency=T]
                 [,transfer_cpu_latency=T][,transfer_cpu_bandwidth=BW]

e.g. `4x8,nvlink=130GB/s,net=25Gbps,mem=16GB`. Heterogeneous hosts list their device counts
joined by `+` instead: `8+8+4,net=10Gbps`. Omitted keys take the defaults of
`topology.constants` (V100 16 GB, NVLink 130 GB/s, 25 Gbps Ethernet). Bandwidths accept bits
(`25Gbps`) or bytes (`130GB/s`) per second; `mem` is binary (`16GB` = 16 GiB). The
`transfer_cpu_*` keys are for CPU hosts: what one end of a transfer takes of its device's
compute (`Topology`; default 0, a GPU cluster).

Presets: `A` (2 x 8 V100, NVLink, 25 Gbps), `B` (16 x 1 V100, 25 Gbps), `C` (16 x 1 V100,
10 Gbps): the DAPPLE paper's Table III. A JSON file holds `Topology.to_dict()`.
"""
from __future__ import annotations

import json
import os
import re
from typing import Union

from topology import constants as C
from topology.errors import TopologyError
from topology.model import Topology
from topology.units import parse_bandwidth, parse_latency, parse_memory


def _preset(name: str, hosts: int, per_host: int, net: float) -> Topology:
    return Topology(devices_per_host=(per_host,) * hosts, device_memory_bytes=C.V100_MEMORY,
                    intra_host_bandwidth=C.NVLINK_BANDWIDTH, inter_host_bandwidth=net,
                    intra_host_latency=C.NVLINK_LATENCY, inter_host_latency=C.ETHERNET_LATENCY,
                    name=name)


PRESETS = {
    "A": _preset("A", 2, 8, C.ETHERNET_25G_BANDWIDTH),
    "B": _preset("B", 16, 1, C.ETHERNET_25G_BANDWIDTH),
    "C": _preset("C", 16, 1, C.ETHERNET_10G_BANDWIDTH),
}

_SHAPE = re.compile(r"^(\d+)x(\d+)$|^(\d+(?:\+\d+)+)$")
_KEYS = ("nvlink", "net", "mem", "nvlink_latency", "net_latency", "transfer_cpu_latency",
         "transfer_cpu_bandwidth")


def parse_spec(spec: str) -> Topology:
    parts = [p.strip() for p in spec.split(",")]
    m = _SHAPE.match(parts[0].lower())
    if not m:
        raise TopologyError(
            f"cannot read topology {spec!r}: expected a preset ({', '.join(PRESETS)}), a JSON "
            f"file, or HOSTSxDEVICES[,nvlink=BW][,net=BW][,mem=SIZE] such as "
            f"'4x8,nvlink=130GB/s,net=25Gbps,mem=16GB' (or '8+4' for unequal hosts)")
    if m.group(1):
        hosts, per_host = int(m.group(1)), int(m.group(2))
        if hosts < 1 or per_host < 1:
            raise TopologyError(f"topology {spec!r}: hosts and devices per host must be >= 1")
        counts = (per_host,) * hosts
    else:
        counts = tuple(int(n) for n in m.group(3).split("+"))
    values = {}
    for part in parts[1:]:
        if "=" not in part:
            raise TopologyError(f"topology {spec!r}: {part!r} should be key=value with key one "
                                f"of {', '.join(_KEYS)}")
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in _KEYS:
            raise TopologyError(f"topology {spec!r}: unknown key {key!r}; use "
                                f"{', '.join(_KEYS)}")
        values[key] = value
    return Topology(
        devices_per_host=counts,
        device_memory_bytes=parse_memory(values["mem"]) if "mem" in values
        else C.DEFAULT_DEVICE_MEMORY,
        intra_host_bandwidth=parse_bandwidth(values["nvlink"]) if "nvlink" in values
        else C.DEFAULT_INTRA_HOST_BANDWIDTH,
        inter_host_bandwidth=parse_bandwidth(values["net"]) if "net" in values
        else C.DEFAULT_INTER_HOST_BANDWIDTH,
        intra_host_latency=parse_latency(values["nvlink_latency"]) if "nvlink_latency" in values
        else C.NVLINK_LATENCY,
        inter_host_latency=parse_latency(values["net_latency"]) if "net_latency" in values
        else C.ETHERNET_LATENCY,
        transfer_cpu_latency=parse_latency(values["transfer_cpu_latency"])
        if "transfer_cpu_latency" in values else 0.0,
        transfer_cpu_bandwidth=parse_bandwidth(values["transfer_cpu_bandwidth"])
        if "transfer_cpu_bandwidth" in values else 0.0,
        name=spec)


def parse_topology(spec: Union[str, Topology, dict]) -> Topology:
    """A Topology from a preset name, a spec string, a JSON file path, a dict, or a Topology."""
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, dict):
        return Topology.from_dict(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise TopologyError(f"topology must be a preset, spec string or JSON file, got {spec!r}")
    text = spec.strip()
    key = text.upper()
    if key.startswith("CONFIG-") or key.startswith("CONFIG_"):
        key = key[7:]
    if key in PRESETS:
        return PRESETS[key]
    if text.endswith(".json") or os.path.isfile(text):
        try:
            with open(text) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise TopologyError(f"topology file {text!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise TopologyError(f"{text}: not valid JSON: {e}") from None
        try:
            return Topology.from_dict(data)
        except TopologyError as e:
            raise TopologyError(f"{text}: {e}") from None
    if re.match(r"^[A-Za-z]+$", text):
        raise TopologyError(f"unknown topology preset {text!r}; presets are "
                            f"{', '.join(PRESETS)} (the DAPPLE paper's Table III), or write a "
                            f"spec such as '2x8,net=25Gbps'")
    return parse_spec(text)


def local_topology(num_devices: int, device_memory_bytes: float = None) -> Topology:
    """One host of `num_devices` logical CPU devices (the single-machine runtime demo).

    Links are in-process tensor copies (`LOCAL_CPU_COPY_*`); memory is the machine's RAM split
    evenly, or `LOCAL_CPU_FALLBACK_MEMORY` each when RAM cannot be read.
    """
    if num_devices < 1:
        raise TopologyError(f"local topology needs at least one device, got {num_devices}")
    if device_memory_bytes is None:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            device_memory_bytes = ram / num_devices
        except (ValueError, OSError, AttributeError):
            device_memory_bytes = C.LOCAL_CPU_FALLBACK_MEMORY
    return Topology(devices_per_host=(num_devices,), device_memory_bytes=device_memory_bytes,
                    intra_host_bandwidth=C.LOCAL_CPU_COPY_BANDWIDTH,
                    inter_host_bandwidth=C.LOCAL_CPU_COPY_BANDWIDTH,
                    intra_host_latency=C.LOCAL_CPU_COPY_LATENCY,
                    inter_host_latency=C.LOCAL_CPU_COPY_LATENCY,
                    name=f"local-{num_devices}cpu")
