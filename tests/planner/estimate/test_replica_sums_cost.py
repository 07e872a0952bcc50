"""On a TensorFlow cluster every replica of a replicated stage sums the gradients on its own
device (`graph_rewrite.replica_sums`: 2 replicas exchange theirs, more reduce-scatter then
all-gather): the cost model's rate against hand computation, beside the ring it prices for
the other runtimes."""
import json

import pytest

from planner.estimate import cost_model as cm
from planner.formats.plan import Plan, Stage
from planner.formats.profile import parse_native_json
from topology import parse_topology

G = 8e6      # gradient bytes of the toy model (2 layers of 4 MB)


def profile():
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": 1.0, "backward_ms": 2.0,
               "output_bytes": 1e5, "parameter_bytes": G / 2, "inputs": [i - 1]}
              for i in range(2)]
    return parse_native_json(json.dumps({"format": "dapple-profile", "version": 1,
                                         "name": "toy", "batch_size": 8, "layers": layers}))


def allreduce_ms(spec, transfers):
    t = parse_topology(spec + ",mem=16GB")
    plan = Plan(stages=[Stage(layers=[0, 1], devices=list(range(t.num_devices)))],
                micro_batches=1, global_batch_size=8 * t.num_devices, transfers=transfers)
    return cm.PlanCosts(plan, profile(), t).pipeline.allreduce_ms[0], t


def ms(nbytes, bandwidth):      # bytes over bytes/s, in ms
    return nbytes / bandwidth * 1e3


@pytest.mark.parametrize("spec,into_a_host,into_a_device,rounds", [
    ("2x1,net=10Gbps", 1, 0, 1),      # each gets the other's gradients, in one round
    ("4x1,net=10Gbps", 1.5, 0, 2),    # a piece from each of 3 (3/4 G), then 3 sums (3/4 G)
    ("2x2,net=10Gbps", 2, 0.5, 2),    # 2 replicas a host, each 1/2 G from the other host
    ("1x4", 0, 1.5, 2),               # one host: each device 3/4 G twice from its peers
    ("3x1,net=10Gbps", 4 / 3, 0, 2),
])
def test_the_replica_sums_by_hand(spec, into_a_host, into_a_device, rounds):
    got, t = allreduce_ms(spec, "tensorflow")
    inter, intra = t.inter_host_latency * 1e3, t.intra_host_latency * 1e3
    per_byte = max(ms(into_a_host * G, t.inter_host_bandwidth),
                   ms(into_a_device * G, t.intra_host_bandwidth))
    latency = max(inter if into_a_host else 0.0, intra if into_a_device else 0.0)
    assert got == pytest.approx(per_byte + rounds * latency)


def test_the_other_runtimes_keep_the_ring():
    """2 hosts of 2: the ring adds in-host first, so 1 gradient crosses each host's link
    (2 (2 - 1) / 2), with 2 in-host and 2 network latencies."""
    ring, t = allreduce_ms("2x2,net=10Gbps", "async")
    assert ring == pytest.approx(ms(G, t.inter_host_bandwidth) + ms(G, t.intra_host_bandwidth)
                                 + 2 * (t.inter_host_latency + t.intra_host_latency) * 1e3)
    assert allreduce_ms("2x2,net=10Gbps", "horovod")[0] == ring
