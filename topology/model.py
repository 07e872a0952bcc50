"""The Topology data type: hosts, their devices, device memory and the two link classes.

Decisions a newcomer needs:

* Devices are numbered host by host: host 0 holds devices 0..n0-1, host 1 the next n1, and so
  on. That is how `horovodrun -H h1:8,h2:8` numbers ranks, so a plan's device ids are ranks.
* Two link classes: inside a host (NVLink, PCIe or shared memory) and between hosts (the
  network interface of each host). Each has a bandwidth in bytes/s and a latency in seconds.
  Hosts may hold different numbers of devices (heterogeneous hosts); all devices share one
  memory size.
* Bandwidths are the rates one transfer achieves on that link class; the cost model
  (`planner.estimate.cost_model`) decides how collectives and split/concat transfers use them.
* On CPU hosts a transfer also costs the compute of both its ends: serializing, copying and
  the transport's threads share the cores the layers run on (a GPU's copy engines and NICs
  take none of its compute). `transfer_cpu_latency` (seconds) and `transfer_cpu_bandwidth`
  (bytes/s; 0: no per-byte cost) give what one end, the send or the receive, takes of its
  device's time; both 0 (the default, and every preset) is a GPU cluster.
* Links are assumed (presets, spec strings: `topology.constants`) unless the topology carries
  `measured`, the record `dapple topology --measure` writes: when (`at`, ISO 8601), how, each
  measured rank pair, and which link classes it could not measure (`assumed`, in words). Files
  without it load as before; the planner reads only the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from topology.errors import TopologyError


@dataclass(frozen=True)
class Topology:
    devices_per_host: tuple                 # e.g. (8, 8); heterogeneous hosts allowed
    device_memory_bytes: float
    intra_host_bandwidth: float             # bytes/s between two devices of one host
    inter_host_bandwidth: float             # bytes/s of a host's network interface
    intra_host_latency: float = 0.0         # seconds per transfer inside a host
    inter_host_latency: float = 0.0         # seconds per transfer between hosts
    transfer_cpu_latency: float = 0.0       # seconds of an end's compute per transfer
    transfer_cpu_bandwidth: float = 0.0     # bytes/s an end copies (0: no per-byte cost)
    name: str = ""
    # how the link figures were measured ({"at": ISO time, ...}); None: assumed. Not compared:
    # two topologies with the same figures plan the same.
    measured: Optional[Dict[str, Any]] = field(default=None, compare=False)
    # derived (filled in __post_init__)
    _host_of: tuple = field(default=(), repr=False, compare=False)
    _host_start: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = tuple(int(n) for n in self.devices_per_host)
        object.__setattr__(self, "devices_per_host", counts)
        if not counts:
            raise TopologyError("a topology needs at least one host")
        for h, n in enumerate(counts):
            if n < 1:
                raise TopologyError(f"host {h} has {n} devices; every host needs at least one")
        for label, value in (("device memory", self.device_memory_bytes),
                             ("intra-host bandwidth", self.intra_host_bandwidth),
                             ("inter-host bandwidth", self.inter_host_bandwidth)):
            if not value > 0:
                raise TopologyError(f"{label} must be positive, got {value!r}: a link of zero "
                                    f"bandwidth can never move data")
        for label, value in (("intra-host latency", self.intra_host_latency),
                             ("inter-host latency", self.inter_host_latency),
                             ("transfer CPU latency", self.transfer_cpu_latency)):
            if not value >= 0:
                raise TopologyError(f"{label} must be >= 0 seconds, got {value!r}")
        if not self.transfer_cpu_bandwidth >= 0:
            raise TopologyError(f"transfer CPU bandwidth must be >= 0 bytes/s (0: no per-byte "
                                f"cost), got {self.transfer_cpu_bandwidth!r}")
        if self.measured is not None and not (isinstance(self.measured, dict)
                                              and isinstance(self.measured.get("at"), str)):
            raise TopologyError(f"'measured' must be an object with 'at' (when, ISO 8601), got "
                                f"{self.measured!r}")
        host_of, starts = [], []
        for h, n in enumerate(counts):
            starts.append(len(host_of))
            host_of.extend([h] * n)
        object.__setattr__(self, "_host_of", tuple(host_of))
        object.__setattr__(self, "_host_start", tuple(starts))

    # ---- shape -------------------------------------------------------------------
    @property
    def num_hosts(self) -> int:
        return len(self.devices_per_host)

    @property
    def num_devices(self) -> int:
        return len(self._host_of)

    def host_of(self, device: int) -> int:
        if not 0 <= device < self.num_devices:
            raise TopologyError(f"device {device} does not exist: the topology has devices "
                                f"0..{self.num_devices - 1}")
        return self._host_of[device]

    def devices_of_host(self, host: int) -> List[int]:
        start = self._host_start[host]
        return list(range(start, start + self.devices_per_host[host]))

    def devices_by_host(self, devices: Sequence[int]) -> Dict[int, List[int]]:
        """{host: [devices of `devices` on that host]}, hosts in order."""
        out: Dict[int, List[int]] = {}
        for d in sorted(devices):
            out.setdefault(self.host_of(d), []).append(d)
        return out

    # ---- links -------------------------------------------------------------------
    def link(self, a: int, b: int):
        """(bandwidth bytes/s, latency s) of a transfer from device a to device b."""
        if self.host_of(a) == self.host_of(b):
            return self.intra_host_bandwidth, self.intra_host_latency
        return self.inter_host_bandwidth, self.inter_host_latency

    def transfer_cpu_seconds(self, nbytes: float) -> float:
        """What one end of a transfer of `nbytes` takes of its device's compute (0 on GPUs)."""
        per_byte = nbytes / self.transfer_cpu_bandwidth if self.transfer_cpu_bandwidth else 0.0
        return self.transfer_cpu_latency + per_byte

    def links_source(self) -> str:
        """Where the link figures come from, in words: measured (when) or assumed."""
        if self.measured is None:
            return "links assumed (preset or spec figures, not measured)"
        assumed = self.measured.get("assumed") or []
        return f"links measured at {self.measured['at']}" + "".join(
            f"; {note} assumed" for note in assumed)

    # ---- (de)serialisation -------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        out = {
            "name": self.name,
            "devices_per_host": list(self.devices_per_host),
            "device_memory_bytes": self.device_memory_bytes,
            "intra_host_bandwidth": self.intra_host_bandwidth,
            "inter_host_bandwidth": self.inter_host_bandwidth,
            "intra_host_latency": self.intra_host_latency,
            "inter_host_latency": self.inter_host_latency,
        }
        if self.transfer_cpu_latency or self.transfer_cpu_bandwidth:
            out["transfer_cpu_latency"] = self.transfer_cpu_latency
            out["transfer_cpu_bandwidth"] = self.transfer_cpu_bandwidth
        if self.measured is not None:
            out["measured"] = self.measured
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Topology":
        if not isinstance(d, dict):
            raise TopologyError(f"a topology is a JSON object, got {type(d).__name__}")
        known = {"name", "devices_per_host", "device_memory_bytes", "intra_host_bandwidth",
                 "inter_host_bandwidth", "intra_host_latency", "inter_host_latency",
                 "transfer_cpu_latency", "transfer_cpu_bandwidth", "measured"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TopologyError(f"topology has unknown field(s) {unknown}; known: {sorted(known)}")
        from topology import constants as C
        try:
            return cls(devices_per_host=tuple(d["devices_per_host"]),
                       device_memory_bytes=float(d.get("device_memory_bytes",
                                                       C.DEFAULT_DEVICE_MEMORY)),
                       intra_host_bandwidth=float(d.get("intra_host_bandwidth", C.NVLINK_BANDWIDTH)),
                       inter_host_bandwidth=float(d.get("inter_host_bandwidth",
                                                        C.ETHERNET_25G_BANDWIDTH)),
                       intra_host_latency=float(d.get("intra_host_latency", C.NVLINK_LATENCY)),
                       inter_host_latency=float(d.get("inter_host_latency", C.ETHERNET_LATENCY)),
                       transfer_cpu_latency=float(d.get("transfer_cpu_latency", 0.0)),
                       transfer_cpu_bandwidth=float(d.get("transfer_cpu_bandwidth", 0.0)),
                       name=str(d.get("name", "")), measured=d.get("measured"))
        except KeyError:
            raise TopologyError("topology needs 'devices_per_host', e.g. [8, 8]") from None
        except (TypeError, ValueError) as e:
            raise TopologyError(f"topology field has the wrong type: {e}") from None

    def describe(self) -> str:
        from topology.units import format_bandwidth, format_bytes
        counts = self.devices_per_host
        if len(set(counts)) == 1:
            shape = f"{len(counts)}x{counts[0]}"
        else:
            shape = "+".join(str(n) for n in counts)
        label = f"{self.name} " if self.name else ""
        cpu = ""
        if self.transfer_cpu_latency or self.transfer_cpu_bandwidth:
            cpu = f"; a transfer end takes {self.transfer_cpu_latency * 1e3:.3g} ms of compute" + (
                f" + its bytes at {format_bandwidth(self.transfer_cpu_bandwidth)}"
                if self.transfer_cpu_bandwidth else "")
        return (f"{label}{shape} ({self.num_devices} devices, {format_bytes(self.device_memory_bytes)}"
                f" each; in-host {format_bandwidth(self.intra_host_bandwidth)}, between hosts "
                f"{format_bandwidth(self.inter_host_bandwidth)}{cpu})")
