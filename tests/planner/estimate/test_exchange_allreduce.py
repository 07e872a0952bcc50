"""On a TensorFlow cluster a replicated stage's replicas exchange their gradients (each sums
every replica's on its own device): the cost model's rate against hand computation, beside the
ring it prices for the other runtimes."""
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


@pytest.mark.parametrize("spec,into_a_host,into_a_device", [
    ("2x1,net=10Gbps", 1, 0),     # each host gets the other's gradients: as the ring
    ("4x1,net=10Gbps", 3, 0),     # each host gets the 3 others': twice the ring's 1.5
    ("2x2,net=10Gbps", 4, 1),     # 2 replicas a host, each getting the other host's 2
    ("1x4", 0, 3),                # one host: each device gets its 3 peers'
])
def test_an_exchange_by_hand(spec, into_a_host, into_a_device):
    got, t = allreduce_ms(spec, "tensorflow")
    network = ms(into_a_host * G, t.inter_host_bandwidth) + t.inter_host_latency * 1e3 \
        if into_a_host else 0.0
    in_host = ms(into_a_device * G, t.intra_host_bandwidth) + t.intra_host_latency * 1e3 \
        if into_a_device else 0.0
    if into_a_host and into_a_device:      # the slower link's bytes and the slower latency
        want = max(ms(into_a_host * G, t.inter_host_bandwidth),
                   ms(into_a_device * G, t.intra_host_bandwidth)) + \
            max(t.inter_host_latency, t.intra_host_latency) * 1e3
    else:
        want = max(network, in_host)
    assert got == pytest.approx(want)


def test_the_other_runtimes_keep_the_ring():
    """4 hosts of 1: the ring moves 2 (4 - 1) / 4 = 1.5 gradients through each host's link,
    with 2 (4 - 1) latencies; the exchange 3 with one."""
    ring, t = allreduce_ms("4x1,net=10Gbps", "async")
    assert ring == pytest.approx(ms(1.5 * G, t.inter_host_bandwidth) +
                                 6 * t.inter_host_latency * 1e3)
    assert allreduce_ms("4x1,net=10Gbps", "horovod")[0] == ring
