"""What the step is fed reaching its first stage (`PipelineCosts.start_ms`; on a TensorFlow
cluster, the chief's rows crossing to the first stage's other replicas): hand-timed runs in
each of the simulator's clocks, and the cost model's figures against hand computation."""
import json

import pytest

from planner.estimate import compute_pass
from planner.estimate import cost_model as cm
from planner.estimate.pipeline_costs import PipelineCosts
from planner.estimate.simulator import simulate
from planner.formats.plan import Plan, Stage
from planner.formats.profile import parse_native_json
from planner.schedules.by_name import build_schedule
from topology import parse_topology


def gpipe_costs(start_ms):
    return PipelineCosts(forward_ms=[1.0, 1.0], backward_ms=[2.0, 2.0], send_forward_ms=[0.0],
                         send_backward_ms=[0.0], allreduce_ms=[0.0, 0.0], start_ms=start_ms)


@pytest.mark.parametrize("duplex", ["full", "half", "serial"])
def test_a_hand_timed_gpipe_waits_for_its_rows(duplex):
    """GPipe, 2 stages, 2 micro-batches, F = 1, B = 2, free links, rows arriving at 4: stage 0
    forwards 4-5, 5-6; stage 1 forwards 5-6, 6-7, backwards 7-9, 9-11; stage 0 backwards
    9-11, 11-13. Without the rows' wait: 9."""
    schedule = build_schedule("gpipe", 2, 2)
    result = simulate(schedule, gpipe_costs([4.0, 0.0]), link_duplex=duplex)
    assert result.iteration_ms == 13.0
    forwards = sorted((e.stage, e.start_ms) for e in result.events if e.kind == "forward")
    assert forwards == [(0, 4.0), (0, 5.0), (1, 5.0), (1, 6.0)]
    assert simulate(schedule, gpipe_costs([]), link_duplex=duplex).iteration_ms == 9.0


def test_the_compute_pass_waits_for_the_rows_too():
    timing = compute_pass.iteration(build_schedule("gpipe", 2, 2), gpipe_costs([4.0, 0.0]),
                                    "full", False)
    assert timing == (13.0, 9.0, 6.0)


def test_a_later_stage_waits_only_when_its_own_inputs_come_later():
    """start_ms of stage 1 at 5.5: its forwards 5.5-6.5, 6.5-7.5 (its input is there at 5)."""
    result = simulate(build_schedule("gpipe", 2, 2), gpipe_costs([4.0, 5.5]))
    assert sorted(e.start_ms for e in result.events if e.kind == "forward" and e.stage == 1) \
        == [5.5, 6.5]
    assert result.iteration_ms == 13.5


def test_negative_or_misshapen_start_times_are_refused():
    with pytest.raises(ValueError, match="start_ms"):
        gpipe_costs([1.0])
    with pytest.raises(ValueError, match=r"start_ms\[0\]"):
        simulate(build_schedule("gpipe", 2, 2), gpipe_costs([-1.0, 0.0]))


# ---- the cost model ----------------------------------------------------------------------

INPUT_BYTES = 3e6          # at the profile's batch of 8


def profile(input_bytes=INPUT_BYTES):
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": 1.0, "backward_ms": 2.0,
               "output_bytes": 1e5, "parameter_bytes": 4e5, "inputs": [i - 1]}
              for i in range(4)]
    return parse_native_json(json.dumps({"format": "dapple-profile", "version": 1,
                                         "name": "toy", "batch_size": 8,
                                         "input_bytes": input_bytes, "layers": layers}))


def plan(devices, transfers, M=2, second=None, **fields):
    stages = [Stage(layers=[0, 3 if second is None else 1], devices=devices)]
    if second is not None:
        stages.append(Stage(layers=[2, 3], devices=second))
    return Plan(stages=stages, micro_batches=M, global_batch_size=32, transfers=transfers,
                **fields)


def test_the_rows_of_a_data_parallel_plan_across_two_hosts_by_hand():
    """Global batch 32 (4 profile batches: 12 MB of rows) over 2 replicas: device 1, on the
    other host, gets 6 MB over the network link, all micro-batches' at once."""
    p, t = profile(), parse_topology("2x1,net=100Mbps,mem=16GB")
    costs = cm.PlanCosts(plan([0, 1], "tensorflow"), p, t).pipeline
    bw, lat = t.inter_host_bandwidth, t.inter_host_latency
    assert costs.start_ms == pytest.approx([6e6 / bw * 1e3 + lat * 1e3])
    assert costs.start_ms[0] > 400      # 6 MB at 12.5 MB/s


def test_replicas_on_the_chiefs_host_and_beyond_by_hand():
    """2 hosts of 2: replicas on devices 0-3 get 3 MB each; device 1 (the chief's host, another
    process) over the intra-host link, devices 2 and 3 over the chief host's one network link
    (6 MB out of it): the later of the two."""
    p, t = profile(), parse_topology("2x2,net=1Gbps,mem=16GB")
    got = cm.PlanCosts(plan([0, 1, 2, 3], "tensorflow"), p, t).pipeline.start_ms
    intra = 3e6 / t.intra_host_bandwidth * 1e3 + t.intra_host_latency * 1e3
    inter = 6e6 / t.inter_host_bandwidth * 1e3 + t.inter_host_latency * 1e3
    assert got == pytest.approx([max(intra, inter)])
    assert inter > intra


def test_a_first_stage_on_the_chiefs_device_alone_waits_for_nothing():
    p, t = profile(), parse_topology("2x1,net=100Mbps,mem=16GB")
    costs = cm.PlanCosts(plan([0], "tensorflow", second=[1]), p, t).pipeline
    assert costs.start_ms == [0.0, 0.0]


@pytest.mark.parametrize("transfers", ["async", "horovod"])
def test_other_runtimes_feed_each_process_its_own_rows(transfers):
    p, t = profile(), parse_topology("2x1,net=100Mbps,mem=16GB")
    assert cm.PlanCosts(plan([0, 1], transfers), p, t).pipeline.start_ms == []


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_the_estimate_counts_the_rows_once(schedule):
    """The same plan with and without rows to send (a profile without input bytes): eq. 1
    (1F1B, GPipe) and the simulated estimate (zb-h1) both move by the rows' time, as every
    action waits for them."""
    p, t = profile(), parse_topology("2x1,net=100Mbps,mem=16GB")
    warmup = None if schedule == "gpipe" else [4]
    fed = plan([0, 1], "tensorflow", M=4, schedule=schedule, warmup=warmup)
    start = cm.PlanCosts(fed, p, t).pipeline.start_ms[0]
    assert start > 400 and cm.PlanCosts(fed, profile(0.0), t).pipeline.start_ms == [0.0]
    assert cm.evaluate(fed, p, t).latency_ms == \
        pytest.approx(cm.evaluate(fed, profile(0.0), t).latency_ms + start)
