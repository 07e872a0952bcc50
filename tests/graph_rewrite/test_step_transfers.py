"""What crosses between devices in one step, read from the graphs TensorFlow partitions the step
into (a `_Recv` per tensor a device receives; between tasks each is a call of its own). Only the
stage boundaries cross once per micro-batch: the feeds (inputs, labels) move to a unit once a
step and the loss terms are added where they are made, so a step of 4 micro-batches receives,
on every device, the boundary tensors of 2 more micro-batches than a step of 2 and nothing
else. The reference is the plan's own boundaries, counted by hand below."""
import collections

import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from planner.formats.plan import straight_plan
from tests.graph_rewrite.test_gradient_sums import LOSS, data, dense_mlp

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"

# plan(M) and, per device, the tensors it receives per micro-batch: the boundary's activation
# (the receiving stage) or input gradient (the sending stage), one a replica; dense_mlp's
# boundary is one tensor.
PLANS = {
    "1f1b": (lambda M: straight_plan([2], 4, M, 32, schedule="1f1b"), {0: 1, 1: 1}),
    # stage 0 on devices 0 and 1, stage 1 on device 2: each replica sends its rows and
    # receives its rows' gradients; device 2 receives both replicas' rows
    "gpipe-2:1": (lambda M: straight_plan([2], 4, M, 32, replicas=[2, 1], schedule="gpipe"),
                  {0: 1, 1: 1, 2: 2}),
    # no boundary: replica 1 receives its inputs and labels once a step whatever M
    "data-parallel": (lambda M: straight_plan([], 4, M, 32, replicas=[2]), {0: 0, 1: 0}),
}


def step_graphs(plan):
    """(received tensors by device, device of each result) of one traced training step."""
    pm = dapple.PipelinedModel(dense_mlp(), plan, micro_batch_loop=False)
    pm.compile(optimizer="sgd", loss=LOSS)
    context.enable_run_metadata()       # before the step's function is instantiated
    try:
        pm.train_step(*data(32, 0))
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    # the step's function: the one calling stages (the first call also builds the optimizer)
    steps = [f for f in metadata.function_graphs
             if any(n.name.startswith("stage0/") for n in f.pre_optimization_graph.node)]
    assert len(steps) == 1, f"{len(steps)} step functions were instantiated"
    received, results = collections.Counter(), []
    for function in steps:
        for graph in function.partition_graphs:
            for node in graph.node:
                if node.op == "_Recv":
                    received[node.device] += 1
                elif node.op == "_Retval":
                    results.append(node.device)
    return received, results


@pytest.mark.parametrize("name", sorted(PLANS))
def test_only_the_boundaries_cross_once_per_micro_batch(name):
    plan, per_micro_batch = PLANS[name]
    two, _ = step_graphs(plan(2))
    four, _ = step_graphs(plan(4))
    grown = {d: four[CPU.format(d)] - two[CPU.format(d)] for d in per_micro_batch}
    assert grown == {d: 2 * n for d, n in per_micro_batch.items()}, (two, four)


def test_the_loss_is_returned_on_the_callers_device():
    # 1f1b: every loss term is made on device 1; the step's result is not left there
    _, results = step_graphs(PLANS["1f1b"][0](4))
    assert results == [CPU.format(0)]
