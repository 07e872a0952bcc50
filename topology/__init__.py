"""topology: the cluster a plan runs on: hosts, devices per host, device memory, and the links
inside a host and between hosts (bandwidth, latency). Presets for the DAPPLE paper's configs A,
B and C, a spec-string parser and a JSON form, and `local_topology(n)` for one host of n
logical CPU devices.

    from topology import parse_topology, local_topology
    topo = parse_topology("A")                       # or "4x8,net=25Gbps", or "topo.json"
    topo.num_devices, topo.host_of(9), topo.to_dict()

Modules: `model` (the Topology type), `errors`, `constants` (every hardware constant and its source),
`parse` (presets, spec strings, JSON files), `units` (sizes and rates).

Depends on nothing else in dapple; never imports TensorFlow or Horovod.
"""

from topology.errors import TopologyError
from topology.model import Topology
from topology.parse import PRESETS, local_topology, parse_spec, parse_topology

__all__ = ["Topology", "TopologyError", "PRESETS", "parse_topology", "parse_spec",
           "local_topology"]
