"""A lane alone in its process on a CPU keeps two actions in flight (`graph_rewrite.in_flight`):
what it waits for (a hand-computed table), the order the traced graph then enforces (read back
as test_schedule_lowering.py reads it) and the gradients, against the plain Keras model's."""
import types

import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest

from graph_rewrite import in_flight
from planner.formats.plan import straight_plan
from planner.search.chunking import interleaved_plan
from planner.schedules.by_name import plan_schedule
from tests.graph_rewrite.test_gradient_sums import LOSS, data, dense_mlp, plain_gradients
from tests.graph_rewrite.test_schedule_lowering import traced_graph, unenforced_edges

A, B, C, D, E, F = "abcdef"


@pytest.mark.parametrize("history,depth,expected", [
    ([], 1, []), ([[A]], 1, [A]), ([[A], [B, C]], 1, [B, C]),
    ([], 2, []), ([[A]], 2, []), ([[A], [B]], 2, [A]), ([[A], [B], [C]], 2, [A, B]),
    ([[A], [B], [C], [D]], 2, [B, C]),
    ([[A], [B], [C], [D], [E], [F]], 3, [B, C, D]),   # actions 6 - 3 down to 6 - 5
])
def test_an_action_waits_for_the_actions_depth_to_twice_depth_minus_one_back(history, depth,
                                                                             expected):
    assert in_flight.waits(history, depth) == expected


@pytest.fixture
def alone(monkeypatch):
    """Every lane as if alone in its process (as on Horovod's ranks or a cluster's tasks)."""
    monkeypatch.setattr(in_flight, "alone_on_cpu", lambda step, unit: True)


def test_by_default_lanes_sharing_a_process_keep_their_plans_order():
    plan = straight_plan([2], 5, 4, 48, schedule="1f1b")
    assert unenforced_edges(traced_graph(plan), plan_schedule(plan), [1, 1]) == []


def test_a_lane_alone_runs_a_forward_beside_the_previous_backward(alone):
    plan = straight_plan([2], 5, 4, 48, schedule="1f1b")
    graph, schedule = traced_graph(plan), plan_schedule(plan)
    # Every action two on is ordered after this one; consecutive ones not always.
    assert unenforced_edges(graph, schedule, [1, 1], gap=2) == []
    missing = unenforced_edges(graph, schedule, [1, 1])
    assert "stage1/replica0: 1B0 -> 1F1" in missing, missing


def test_relaxed_schedules_keep_their_lists_order(alone):
    # Their weight versions move between actions in the list's order.
    step = types.SimpleNamespace(plan=types.SimpleNamespace(
        schedule=types.SimpleNamespace(relaxed=True)))
    assert in_flight.order_depth(step, (0, 0)) == 1
    step.plan.schedule.relaxed = False
    assert in_flight.order_depth(step, (0, 0)) == 2


PLANS = {
    "1f1b": lambda: straight_plan([2], 4, 4, 32, schedule="1f1b"),
    "gpipe": lambda: straight_plan([2], 4, 4, 32, schedule="gpipe"),
    "zb-h1": lambda: straight_plan([2], 4, 4, 32, schedule="zb-h1"),
    "2:1": lambda: straight_plan([2], 4, 4, 32, replicas=[2, 1], schedule="1f1b"),
    "interleaved": lambda: interleaved_plan([1, 2, 3], 4, 4, 2, 32, [1, 1]),
    "data-parallel-unrolled": lambda: straight_plan([], 4, 4, 32, replicas=[2]),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_lanes_alone_compute_the_plain_models_gradients_step_after_step(alone, name):
    pm = dapple.PipelinedModel(dense_mlp(), PLANS[name](), micro_batch_loop=False)
    pm.compile(optimizer="sgd", loss=LOSS)
    for seed in (1, 2):
        x, y = data(32, seed)
        for a, b in zip(pm.gradients(x, y), plain_gradients(x, y)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
