"""The schedule (planner.schedules.by_name task lists) is what the traced graph enforces.

We trace the pipelined step, read the graph back, and check that for every unit (stage,
replica) and every consecutive pair of tasks (t, t+1) in its list, every op of t+1 is reachable
from an op of t through data or control edges: the executor cannot start t+1 before t has run.
The checker is also shown to reject an order the graph does not enforce.
"""
import collections
import functools
import re

import dapple  # noqa: F401
import pytest
import tensorflow as tf

from planner.formats.plan import straight_plan
from planner.schedules.by_name import plan_schedule, pipeline_schedule
from tests.models import data_for, losses_for, mlp_with_skip

SCOPE = re.compile(r"stage(\d+)/replica(\d+)/([FB])(\d+)/")


def traced_graph(plan):
    model = mlp_with_skip()
    # Unrolled: every action in a name scope of its own (a looped pipeline runs its steady
    # periods in a loop body, `graph_rewrite.schedule_loop`, ordered by tokens per lane).
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=False)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, plan.global_batch_size, seed=0)
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    return fn.get_concrete_function(x, y).graph


def ops_by_task(graph):
    tasks = collections.defaultdict(list)
    for op in graph.get_operations():
        m = SCOPE.search(op.name + "/")
        # A Placeholder is a captured input (a variable handle the stage function captures,
        # named after the scope of its first call): fed before anything runs, nothing to order.
        if m and op.type != "Placeholder":
            s, r, kind, mb = m.groups()
            # TF names a tape's gradient ops "gradient_tape/<forward op name>": backward work.
            if op.name.startswith("gradient_tape/"):
                kind = "B"
            tasks[(int(s), int(r), kind, int(mb))].append(op)
    return tasks


@functools.lru_cache(maxsize=4)
def control_consumers(graph):
    """op -> the ops that wait for it (`Operation.control_inputs`, inverted: TensorFlow has no
    public accessor for this direction)."""
    consumers = collections.defaultdict(list)
    for op in graph.get_operations():
        for before in op.control_inputs:
            consumers[before].append(op)
    return consumers


def descendants(ops):
    seen, frontier = set(), list(ops)
    waiting = control_consumers(ops[0].graph) if ops else {}
    while frontier:
        op = frontier.pop()
        for out in op.outputs:
            for consumer in out.consumers():
                if consumer not in seen:
                    seen.add(consumer)
                    frontier.append(consumer)
        for consumer in waiting.get(op, ()):
            if consumer not in seen:
                seen.add(consumer)
                frontier.append(consumer)
    return seen


def unenforced_edges(graph, schedule, replicas, gap=1):
    """Actions `gap` apart in a position's list (on each of its `replicas`; 1: consecutive ones)
    whose order the graph does not enforce. Ops are named by chunk (`stage{chunk}`)."""
    tasks = ops_by_task(graph)
    missing = []
    for s, task_list in enumerate(schedule.lists):
        for r in range(replicas[s]):
            for before, after in zip(task_list, task_list[gap:]):
                a = tasks[(before.chunk, r, before.kind, before.micro_batch)]
                b = tasks[(after.chunk, r, after.kind, after.micro_batch)]
                assert a and b, f"no ops traced for stage {s} replica {r} {before} / {after}"
                reach = descendants(a)
                if not all(op in reach for op in b):
                    missing.append(f"stage{s}/replica{r}: {before} -> {after}")
    return missing


@pytest.mark.parametrize("policy,reps", [("A", [1, 1, 1]), ("B", [2, 1, 1]), ("gpipe", [1, 2, 1])])
def test_every_schedule_edge_is_enforced(policy, reps):
    plan = straight_plan([1, 3], 5, 4, 48, replicas=reps, schedule=policy)
    graph = traced_graph(plan)
    assert unenforced_edges(graph, plan_schedule(plan), reps) == []


def test_checker_rejects_an_order_the_graph_does_not_enforce():
    plan = straight_plan([2], 5, 4, 48, schedule="A")           # early backward graph
    graph = traced_graph(plan)
    gpipe = pipeline_schedule(2, 4, "gpipe")                     # claims F3 runs before B0
    missing = unenforced_edges(graph, gpipe, [1, 1])
    assert "stage0/replica0: 0F3 -> 0B0" in missing
