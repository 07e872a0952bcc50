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


@pytest.fixture
def bounded(alone, monkeypatch):
    """Lanes alone and bounded, as on the TensorFlow cluster runtime's tasks."""
    from graph_rewrite.pipeline import PipelineStep
    monkeypatch.setattr(PipelineStep, "bounded_lanes", True)


def enforced(graph, stage, before, after):
    """Whether the traced graph runs all of action `after`'s ops after all of `before`'s."""
    from tests.graph_rewrite.test_schedule_lowering import descendants, ops_by_task
    tasks = ops_by_task(graph)
    reach = descendants(tasks[(stage, 0) + before])
    return all(op in reach for op in tasks[(stage, 0) + after])


def test_a_bounded_lane_orders_a_forward_only_after_the_backwards_its_bound_needs(bounded):
    # 1F1B on 2 stages, M = 6: stage 0 holds 2 micro-batches, stage 1 one; bounded, one more
    # each. So (hand-computed) stage 0's F m waits for B m - 3 and stage 1's for B m - 2, and
    # nothing else: for micro-batches k < m of a stage, F m runs after B k (and so after F k)
    # exactly when k <= m - bound.
    plan = straight_plan([2], 5, 6, 48, schedule="1f1b")
    graph = traced_graph(plan)
    for stage, bound in ((0, 3), (1, 2)):
        for m in range(6):
            for k in range(m):
                for pair in ((("B", k), ("F", m)), (("F", k), ("F", m))):
                    assert enforced(graph, stage, *pair) == (k <= m - bound), (stage, pair)
    # 1F1B's list puts B 0 before F 2 on stage 0 and F 1 on stage 1: neither waits here.
    assert not enforced(graph, 0, ("B", 0), ("F", 2))
    assert not enforced(graph, 1, ("B", 0), ("F", 1))


def test_a_lane_sharing_its_process_keeps_its_plans_order_though_bounded(monkeypatch):
    from graph_rewrite.pipeline import PipelineStep
    monkeypatch.setattr(PipelineStep, "bounded_lanes", True)
    plan = straight_plan([2], 5, 4, 48, schedule="1f1b")
    assert unenforced_edges(traced_graph(plan), plan_schedule(plan), [1, 1]) == []


@pytest.mark.parametrize("name", sorted(PLANS))
def test_bounded_lanes_compute_the_plain_models_gradients_step_after_step(bounded, name):
    pm = dapple.PipelinedModel(dense_mlp(), PLANS[name](), micro_batch_loop=False)
    pm.compile(optimizer="sgd", loss=LOSS)
    for seed in (1, 2):
        x, y = data(32, seed)
        for a, b in zip(pm.gradients(x, y), plain_gradients(x, y)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
