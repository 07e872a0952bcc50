"""ZB-H1 in the runtime, unrolled (the default): each stage's forward, I and W are the split
functions of graph_rewrite.stage_split, one call op per action.

References: the plain Keras model's gradients and weights; for the graph's size, the unrolled
1F1B step of the same model and M (test_schedule_loop.py checks that I + W do the fused
backward's work once)."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests.models import (assert_trains_like_plain_model, data_for, dense_batchnorm,
                          integer_boundary, losses_for, mlp_with_skip, plain_loss_and_grads,
                          small_conv, two_in_two_out)
from tests.graph_rewrite.test_schedule_lowering import descendants

GLOBAL_BATCH = 48
CALLS = ("StatefulPartitionedCall", "PartitionedCall")

CASES = [
    # (builder, cut positions, replicas, M, recompute)
    (mlp_with_skip, [2], [1, 1], 1, False),
    (mlp_with_skip, [1], [1, 1], 4, False),          # skip crosses the cut
    (mlp_with_skip, [1, 3], [1, 1, 1], 8, False),
    (mlp_with_skip, [2], [2, 1], 4, False),          # 2:1
    (mlp_with_skip, [3], [1, 2], 4, False),          # 1:2
    (mlp_with_skip, [], [3], 4, False),              # data parallel
    (mlp_with_skip, [2], [1, 1], 4, True),           # recomputed forward, then split
    (two_in_two_out, [1, 4], [1, 2, 1], 4, False),
    (small_conv, [2], [1, 1], 4, False),
    (integer_boundary, [1], [2, 1], 2, False),       # embedding: a ResourceGather weight use
]


def case_id(case):
    builder, cuts, reps, m, rc = case
    return f"{builder.__name__}-{':'.join(map(str, reps))}-cuts{cuts}-M{m}" + ("-rc" if rc else "")


def max_abs_diff(a_list, b_list):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(tf.convert_to_tensor(b)))))
               for a, b in zip(a_list, b_list))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gradients_equal_plain_model(case):
    builder, cuts, reps, m, recompute = case
    model, reference = builder(), builder()
    plan = straight_plan(cuts, len(layer_order(model)), m, GLOBAL_BATCH, replicas=reps,
                         schedule="zb-h1")
    plan.recompute = recompute
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer="sgd", loss=loss)
    x, y = data_for(model, GLOBAL_BATCH, seed=7)
    got = pm.gradients(x, y)
    _, want = plain_loss_and_grads(reference, loss, x, y)
    assert max_abs_diff(got, want) < 1e-5


def test_weights_and_batch_statistics_after_three_steps_equal_plain_model():
    model, reference = dense_batchnorm(), dense_batchnorm()
    plan = straight_plan([2], len(layer_order(model)), 1, GLOBAL_BATCH, schedule="zb-h1")
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, plan)
    assert_trains_like_plain_model(pm, model, reference, loss,
                                   lambda: tf.keras.optimizers.SGD(0.1), GLOBAL_BATCH)


def step_graph(builder, schedule, m):
    """(nodes of the traced unrolled step's own graph, nodes with its library functions,
    its call ops the optimizer may not inline, its gradients, the model) for `builder`'s
    model cut in two at M = m."""
    model = builder()
    plan = straight_plan([2], len(layer_order(model)), m, GLOBAL_BATCH, schedule=schedule)
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=False)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, GLOBAL_BATCH, seed=7)
    step = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    traced = step.get_concrete_function(x, y)
    graph_def = traced.graph.as_graph_def()
    every = len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
    kept = {f.signature.name for f in graph_def.library.function if f.attr["_noinline"].b}
    calls = sum(n.op in CALLS and n.attr["f"].func.name in kept for n in graph_def.node)
    return len(graph_def.node), every, calls, traced(x, y), model


@pytest.mark.parametrize("builder", [mlp_with_skip, small_conv])
def test_unrolled_step_is_about_the_size_of_1f1b_and_trains_like_the_plain_model(builder):
    """Three calls per micro-batch (F, I, W) against 1F1B's two: the inline split this
    replaced built 5.7x 1F1B's step graph at M = 8 (903 against 159 nodes). The calls stay
    calls: inlined, the optimizer would rewrite a copy of the stage per call."""
    nodes_1f1b, every_1f1b, _, _, _ = step_graph(builder, "1f1b", 8)
    nodes_zb, every_zb, calls, got, model = step_graph(builder, "zb-h1", 8)
    assert nodes_zb <= 1.5 * nodes_1f1b and every_zb <= 1.5 * every_1f1b
    assert calls >= 3 * 8 * 2            # F, I and W of 8 micro-batches on 2 stages
    reference = builder()
    reference.set_weights(model.get_weights())
    x, y = data_for(model, GLOBAL_BATCH, seed=7)
    _, want = plain_loss_and_grads(reference, losses_for(model), x, y)
    assert max_abs_diff(got, want) < 1e-5


def ops_by_action(pm, x, y):
    """The ops each action built, from the executor's own dispatch (tape gradient ops are
    named after their forward, so names cannot tell I from W): (chunk, replica, kind, m)."""
    step, built = pm.pipeline_step, {}
    graph_of = {}

    def recording(kind, method):
        def run(state, unit, action):
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            out = method(state, unit, action)
            graph_of["graph"] = graph
            built[(unit[0], unit[1], kind, action.micro_batch)] = graph.get_operations()[first:]
            return out
        return run

    step.dispatch = {k: recording(k, m) for k, m in step.dispatch.items()}
    tf.function(lambda x, y: step.run(x, y).gradients).get_concrete_function(x, y)
    # Captured inputs are fed before anything runs; zeros are built once for the whole step;
    # rows are cut where their tensor is, waiting for nothing (`graph_rewrite.cut_rows`).
    return {k: [op for op in ops if op.type != "Placeholder"
                and not op.name.startswith(("dapple_zeros/", "cut_rows/"))]
            for k, ops in built.items()}


@pytest.mark.parametrize("reps,m", [([1, 1], 4), ([2, 1], 3)])
def test_the_graph_enforces_every_position_order(reps, m):
    from planner.schedules.by_name import plan_schedule
    model = mlp_with_skip()
    plan = straight_plan([2], 5, m, GLOBAL_BATCH, replicas=reps, schedule="zb-h1")
    # The unrolled lowering's actions (a loop orders its tasks by tokens: test_schedule_loop)
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=False)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, GLOBAL_BATCH, seed=0)
    tasks = ops_by_action(pm, x, y)
    missing, checked = [], 0
    for s, lst in enumerate(plan_schedule(plan).lists):
        for r in range(reps[s]):
            for before, after in zip(lst, lst[1:]):
                a = tasks[(before.chunk, r, before.kind, before.micro_batch)]
                b = tasks[(after.chunk, r, after.kind, after.micro_batch)]
                if not a or not b:      # W of micro-batch 0 only hands its gradients on
                    continue
                checked += 1
                reach = descendants(a)
                if not all(op in reach for op in b):
                    missing.append(f"position {s} replica {r}: {before} -> {after}")
    assert missing == [] and checked > 0
