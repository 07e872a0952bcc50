"""On CPU hosts a transfer takes compute from both its ends (`Topology.transfer_cpu_*`): the
cost model charges each end to the forward or backward that sends or receives, against hand
computation; a split backward's I takes them all; the search still finds the least plan."""
import json

import pytest

from planner.estimate import cost_model as cm
from planner.formats.plan import Plan, Stage
from planner.formats.profile import parse_native_json
from topology import parse_topology

OV = cm.TASK_OVERHEAD_MS
CPU = ",transfer_cpu_latency=0.1ms,transfer_cpu_bandwidth=1GB/s"    # 0.1 ms + 1 ms a MB


def chain(forward=(1.0, 2.0, 1.0, 1.0), outputs=(1e6, 2e6, 3e6, 4e6)):
    """Layer i: F forward[i], B twice that, output outputs[i] bytes, at a batch of 8."""
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": f, "backward_ms": 2 * f,
               "output_bytes": out, "parameter_bytes": 4e5, "inputs": [i - 1]}
              for i, (f, out) in enumerate(zip(forward, outputs))]
    return parse_native_json(json.dumps({"format": "dapple-profile", "version": 1,
                                         "name": "chain", "batch_size": 8,
                                         "input_bytes": 1e5, "layers": layers}))


def plan(stages, transfers="async", micro_batches=2):
    return Plan(stages=[Stage(list(layers), list(devices)) for layers, devices in stages],
                micro_batches=micro_batches, global_batch_size=16, transfers=transfers)


STRAIGHT = [((0, 0), (0,)), ((1, 2), (1,)), ((3, 3), (2,))]


@pytest.mark.parametrize("transfers", ["async", "tensorflow"])
def test_each_end_of_a_boundary_is_charged_to_its_stage(transfers):
    """Micro-batches of 8 rows, the profile's batch. Stage 0 sends layer 0's 1 MB: 0.1 + 1.0;
    stage 1 receives it and sends layer 2's 3 MB: 1.1 + 3.1; stage 2 receives those: 3.1.
    The same both ways (a gradient has its activation's bytes)."""
    costs = cm.PlanCosts(plan(STRAIGHT, transfers), chain(), parse_topology("1x3" + CPU))
    assert costs.pipeline.forward_ms == pytest.approx([1 + OV + 1.1, 3 + OV + 4.2,
                                                       1 + OV + 3.1], abs=1e-12)
    assert costs.pipeline.backward_ms == pytest.approx([2 + OV + 1.1, 6 + OV + 4.2,
                                                        2 + OV + 3.1], abs=1e-12)


def test_a_replica_sends_and_receives_its_slice():
    """Stage 1 on 2 replicas: 4 rows each, so half of each boundary's bytes an end, and half
    the layers' time: F = 1.5 + 0.5 + (0.1 + 0.5) + (0.1 + 1.5); its neighbours' ends are
    those of the whole micro-batch (one replica each)."""
    stages = [((0, 0), (0,)), ((1, 2), (1, 2)), ((3, 3), (3,))]
    costs = cm.PlanCosts(plan(stages), chain(), parse_topology("1x4" + CPU))
    assert costs.pipeline.forward_ms == pytest.approx([1 + OV + 1.1, 1.5 + OV + 2.2,
                                                       1 + OV + 3.1], abs=1e-12)


def test_gpu_hosts_take_no_compute_for_transfers():
    with_cpu = cm.PlanCosts(plan(STRAIGHT), chain(), parse_topology("1x3" + CPU)).pipeline
    without = cm.PlanCosts(plan(STRAIGHT), chain(), parse_topology("1x3")).pipeline
    assert without.forward_ms == [1 + OV, 3 + OV, 1 + OV]
    assert with_cpu.send_forward_ms == without.send_forward_ms      # the links' own time
    assert with_cpu.send_backward_ms == without.send_backward_ms


def test_a_split_backwards_input_gradient_takes_every_end():
    """I is half of the layers' backward (a profile without input gradients) and sends and
    receives everything; W moves nothing, so B - I is the same as without transfer CPU."""
    with_cpu = cm.PlanCosts(plan(STRAIGHT), chain(), parse_topology("1x3" + CPU)).pipeline
    without = cm.PlanCosts(plan(STRAIGHT), chain(), parse_topology("1x3")).pipeline
    assert with_cpu.input_gradient_ms == pytest.approx([(2 + OV) / 2 + 1.1, (6 + OV) / 2 + 4.2,
                                                        (2 + OV) / 2 + 3.1], abs=1e-12)
    assert [b - i for b, i in zip(with_cpu.backward_ms, with_cpu.input_gradient_ms)] == \
        pytest.approx([b - i for b, i in zip(without.backward_ms, without.input_gradient_ms)],
                      abs=1e-12)


def test_a_hand_timed_gpipe_step():
    """2 stages of one layer, 1 MB between them, GPipe over 2 micro-batches, links of a
    microsecond: each end 1.1 ms, so f = 1 + OV + 1.1, b = 2 + OV + 1.1 on both stages and the
    step is 3f + 3b plus one forward and one backward transfer on the critical path, each
    L = 1 us + 1 MB at 1000 GB/s."""
    profile = chain(forward=(1.0, 1.0), outputs=(1e6, 1e6))
    topo = parse_topology("1x2,nvlink=1000GB/s,nvlink_latency=1us" + CPU)
    p = plan([((0, 0), (0,)), ((1, 1), (1,))])
    p.schedule = "gpipe"
    f, b, L = 1 + OV + 1.1, 2 + OV + 1.1, 1e-3 + 1e6 / 1e9
    assert cm.PlanCosts(p, profile, topo).timing().iteration_ms == \
        pytest.approx(3 * f + 3 * b + 2 * L, abs=1e-9)
    assert cm.PlanCosts(p, profile, topo).simulation().iteration_ms == \
        pytest.approx(3 * f + 3 * b + 2 * L, abs=1e-9)
