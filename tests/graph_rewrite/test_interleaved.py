"""Interleaved 1F1B in the runtime: a device group runs several chunks of the model.

References: the plain Keras model's gradients and weights (tests.models), and the schedule's
own lists for the order the traced graph must enforce (the checker of
tests/graph_rewrite/test_schedule_lowering.py, keyed by chunk)."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.search.chunking import interleaved_plan
from planner.schedules.by_name import plan_schedule
from tests.models import (assert_trains_like_plain_model, data_for, dense_batchnorm, losses_for,
                          mlp_with_skip, plain_loss_and_grads, two_in_two_out)
from tests.graph_rewrite.test_schedule_lowering import unenforced_edges

GLOBAL_BATCH = 48

CASES = [
    # (builder, first layers of chunks 1.., replicas per device group, M, virtual stages)
    (mlp_with_skip, [1, 2, 3], [1, 1], 4, 2),       # skip d1 -> add relayed through chunk 1
    (mlp_with_skip, [1, 2, 3], [1, 1], 1, 2),
    (mlp_with_skip, [1, 2, 3], [1, 1], 8, 2),
    (mlp_with_skip, [1, 2, 3], [2, 1], 2, 2),       # 2:1 forward, then 1:2 back to group 0
    (mlp_with_skip, [1, 2, 3], [1, 2], 4, 2),       # 1:2 forward, then 2:1 back
    (mlp_with_skip, [2], [3], 4, 2),                # data parallel: both chunks on 3 devices
    (mlp_with_skip, [1, 2, 3, 4], [1] * 5, 6, 1),   # v = 1: policy B's order
    (two_in_two_out, [1, 2, 3, 4, 5], [1, 1, 1], 3, 2),   # input b enters chunk 1, 3 groups
]


def case_id(case):
    builder, cuts, reps, m, v = case
    return f"{builder.__name__}-{':'.join(map(str, reps))}-cuts{cuts}-M{m}-v{v}"


def max_abs_diff(a_list, b_list):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(a_list, b_list))


def plan_for(model, case):
    _, cuts, reps, m, v = case
    return interleaved_plan(cuts, len(layer_order(model)), m, v, GLOBAL_BATCH, reps)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gradients_equal_plain_model(case):
    builder = case[0]
    model, reference = builder(), builder()
    pm = dapple.PipelinedModel(model, plan_for(model, case))
    loss = losses_for(model)
    pm.compile(optimizer="sgd", loss=loss)
    x, y = data_for(model, GLOBAL_BATCH, seed=7)
    got = pm.gradients(x, y)
    _, want = plain_loss_and_grads(reference, loss, x, y)
    assert len(got) == len(want)
    assert max_abs_diff(got, want) < 1e-5


def test_weights_and_batch_statistics_after_three_steps_equal_plain_model():
    """BatchNormalization in chunk 1, on device group 1 with chunk 3: the moving
    statistics move once per step from the global batch, as in the plain model (one slice
    per micro-batch: M = 1 keeps the plain model's whole-batch normalization). SGD, not Adam:
    d1's bias feeds BatchNormalization, so its true gradient is 0 and Adam would turn
    round-off into full steps."""
    model, reference = dense_batchnorm(), dense_batchnorm()
    n = len(layer_order(model))
    plan = interleaved_plan([1, 2, 3], n, 1, 2, GLOBAL_BATCH, [1, 1])
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, plan)
    assert_trains_like_plain_model(pm, model, reference, loss,
                                   lambda: tf.keras.optimizers.SGD(0.1), GLOBAL_BATCH)


ORDER_CASES = [CASES[0], CASES[3], CASES[5]]


@pytest.mark.parametrize("case", ORDER_CASES, ids=[case_id(c) for c in ORDER_CASES])
def test_every_schedule_edge_is_enforced_per_device(case):
    model = case[0]()
    plan = plan_for(model, case)
    # The unrolled lowering's ops, named per action (a loop's order tokens: test_schedule_loop)
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=False)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, GLOBAL_BATCH, seed=0)
    graph = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients) \
        .get_concrete_function(x, y).graph
    replicas = [s.replicas for s in plan.stages[:plan.num_positions]]
    assert unenforced_edges(graph, plan_schedule(plan), replicas) == []


