"""The split of a backward into I and W as the profile measures it: carried by the native
profile format, the cost model and the simulator (I and W durations), half and half where a
profile does not have it (graph.txt). References are hand-computed numbers."""
import json

import pytest

from planner.estimate.cost_model import pipeline_costs
from planner.estimate.pipeline_costs import PipelineCosts
from planner.formats.plan import straight_plan
from planner.formats.profile import ProfileError
from planner.formats.profile_readers import parse_native_json
from planner.estimate.simulator import simulate
from planner.schedules.zb_h1 import zb_h1_schedule
from topology.parse import parse_spec


def native(inputs=(0.5, None, 3.0)):
    layers = []
    for i, ig in enumerate(inputs):
        layer = {"name": f"l{i}", "type": "Dense", "forward_ms": 1.0, "backward_ms": 4.0,
                 "output_bytes": 100.0, "parameter_bytes": 10.0, "inputs": [i - 1]}
        if ig is not None:
            layer["input_gradient_ms"] = ig
        layers.append(layer)
    return {"format": "dapple-profile", "version": 1, "name": "split", "batch_size": 8,
            "input_bytes": 100.0, "layers": layers}


def test_the_profile_carries_the_measured_input_gradient():
    p = parse_native_json(json.dumps(native()))
    assert [l.input_gradient_ms for l in p.layers] == [0.5, None, 3.0]
    again = parse_native_json(json.dumps(p.to_dict()))
    assert [l.input_gradient_ms for l in again.layers] == [0.5, None, 3.0]
    assert again.content_hash == p.content_hash
    # By hand: layer 1 unmeasured counts half its backward.
    assert p.input_gradient_fraction(0, 2) == pytest.approx((0.5 + 2.0 + 3.0) / 12.0)
    assert p.input_gradient_fraction(1, 1) == pytest.approx(0.5)
    assert p.scaled(16).layers[0].input_gradient_ms == pytest.approx(1.0)
    unmeasured = parse_native_json(json.dumps(native((None, None, None))))
    assert "input_gradient_ms" not in unmeasured.to_dict()["layers"][0]
    assert unmeasured.content_hash != p.content_hash


def test_an_input_gradient_longer_than_the_backward_is_refused():
    with pytest.raises(ProfileError, match="input_gradient_ms 5.0 must be between 0 and "
                                           "backward_ms"):
        parse_native_json(json.dumps(native((5.0, None, None))))


def test_the_cost_model_splits_each_stage_backward_by_its_layers():
    p = parse_native_json(json.dumps(native()))
    plan = straight_plan([1], 3, 2, 16, schedule="zb-h1")
    costs = pipeline_costs(plan, p, parse_spec("1x2"))
    # Stage 0: layer 0, I = 0.5 of B = 4; stage 1: layers 1-2, I = (2 + 3) of 8.
    assert costs.input_gradient_ms[0] == pytest.approx(costs.backward_ms[0] * 0.5 / 4)
    assert costs.input_gradient_ms[1] == pytest.approx(costs.backward_ms[1] * 5 / 8)


def test_the_simulator_runs_i_and_w_for_their_measured_times():
    costs = PipelineCosts(forward_ms=[1.0, 1.0], backward_ms=[3.0, 3.0], send_forward_ms=[0.0],
                          send_backward_ms=[0.0], allreduce_ms=[0.0, 0.0],
                          input_gradient_ms=[1.0, 2.0])
    result = simulate(zb_h1_schedule(2, 2), costs)
    I, W = "backward_input", "backward_weight"
    want = {(I, 0): 1.0, (W, 0): 2.0, (I, 1): 2.0, (W, 1): 1.0}
    seen = set()
    for e in result.events:
        key = (e.kind, e.stage)
        if key in want:
            assert e.duration_ms == pytest.approx(want[key]), e
            seen.add(key)
    assert seen == set(want)
    halves = simulate(zb_h1_schedule(2, 2), PipelineCosts(
        forward_ms=[1.0, 1.0], backward_ms=[3.0, 3.0], send_forward_ms=[0.0],
        send_backward_ms=[0.0], allreduce_ms=[0.0, 0.0]))
    assert {e.duration_ms for e in halves.events if e.kind in (I, W)} == {1.5}
