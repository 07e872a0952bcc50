"""A data-parallel plan's lanes as loops over their micro-batches (the default:
`graph_rewrite.micro_batch_loop`): the step's graph does not grow with M, and what the loop
computes is what plain Keras computes. The references: the traced graph's own ops (counted), the
plain model's `fit`, `evaluate` and `predict`, and the plain model run slice by slice; the
BatchNormalization, regularizer and mixed-precision tests have looped cases too."""
import collections

import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite import in_flight
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests.models import (assert_ran_as_loops, conv_batchnorm, data_for,
                          ghost_batch_loss_and_grads, losses_for, mlp_with_skip, two_in_two_out)
from tests.dapple.test_sample_weights import BATCH, ROWS, assert_same, pair, weights_for

CALLS = ("StatefulPartitionedCall", "PartitionedCall")


def step_graph(m, schedule, replicas=2, loop=True, warmup=None):
    """The traced step's GraphDef (its functions in its library)."""
    model = mlp_with_skip()
    plan = straight_plan([], 5, m, 8 * m, replicas=[replicas], schedule=schedule)
    plan.warmup = warmup
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=loop)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, 8 * m, seed=0)
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    return fn.get_concrete_function(x, y).graph.as_graph_def()


def step_ops(m, schedule, replicas=2, loop=True):
    """Op types of the traced step, its loop bodies and every function it calls."""
    graph_def = step_graph(m, schedule, replicas, loop)
    outer = collections.Counter(n.op for n in graph_def.node)
    every = outer + collections.Counter(n.op for f in graph_def.library.function
                                        for n in f.node_def)
    return outer, every


def test_as_many_calls_and_loops_whatever_the_micro_batches():
    outer2, every2 = step_ops(2, "1f1b")
    outer8, every8 = step_ops(8, "1f1b")
    assert every2["While"] == every8["While"] == 1            # one loop, called per replica
    assert sum(outer2[c] for c in CALLS) == sum(outer8[c] for c in CALLS) >= 2
    assert sum(every2[c] for c in CALLS) == sum(every8[c] for c in CALLS)
    # Unrolled, the calls grow with M: the count sees it.
    _, unrolled2 = step_ops(2, "1f1b", loop=False)
    _, unrolled8 = step_ops(8, "1f1b", loop=False)
    assert unrolled2["While"] == unrolled8["While"] == 0
    assert sum(unrolled8[c] for c in CALLS) > sum(unrolled2[c] for c in CALLS)


def lane_loop_parallel_iterations(graph_def):
    """`parallel_iterations` of every While op in the step's functions."""
    return [n.attr["parallel_iterations"].i for f in graph_def.library.function
            for n in f.node_def if n.op == "While"]


@pytest.mark.parametrize("schedule,warmup,depth", [("1f1b", [2], 2), ("1f1b", [3], 3),
                                                   ("gpipe", None, 4)],
                         ids=["1f1b-K2", "1f1b-K3", "gpipe"])
def test_a_lane_warming_up_k_deep_loops_k_micro_batches_at_once(schedule, warmup, depth):
    # The list F0 .. F(K-1) B0 FK B1 ... (GPipe's one stage: K = M) is one loop running K
    # iterations at once.
    assert lane_loop_parallel_iterations(step_graph(4, schedule, warmup=warmup)) == [depth]


def test_a_cpu_lane_alone_in_its_process_keeps_two_micro_batches_in_flight(monkeypatch):
    # One lane in this process (a Horovod rank's, a cluster task's): two in flight where the
    # plan says one, more where it says more.
    assert lane_loop_parallel_iterations(step_graph(4, "1f1b", replicas=1)) == [2]
    assert lane_loop_parallel_iterations(step_graph(4, "1f1b", 1, warmup=[3])) == [3]
    # Two lanes in one process already fill its threads: the plan's K = 1, each micro-batch
    # after the previous backward (an ordering dependency, TensorFlow's default
    # parallel_iterations).
    assert lane_loop_parallel_iterations(step_graph(4, "1f1b")) == [10]    # one function
    monkeypatch.setattr(in_flight, "CPU_LANE_DEPTH", 1)      # the plan's K everywhere
    assert lane_loop_parallel_iterations(step_graph(4, "1f1b", replicas=1)) == [10]


@pytest.mark.parametrize("schedule,warmup", [("1f1b", [2]), ("gpipe", None)],
                         ids=["1f1b-K2", "gpipe"])
def test_a_lane_with_micro_batches_in_flight_trains_as_plain_keras(schedule, warmup):
    plan = straight_plan([], 5, 4, BATCH, replicas=[2], schedule=schedule)
    plan.warmup = warmup
    plain = mlp_with_skip(seed=3)
    plain.compile(tf.keras.optimizers.SGD(0.1), losses_for(plain))
    pm = dapple.PipelinedModel(mlp_with_skip(seed=3), plan)
    pm.compile(tf.keras.optimizers.SGD(0.1), losses_for(plain))
    x, y = data_for(plain, ROWS, seed=5)
    h1 = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_same(pm, plain, h1, h2)
    assert_ran_as_loops(pm, True)


def test_looped_fit_evaluate_predict_equal_plain_keras_two_outputs_sample_weights():
    loss = [tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            tf.keras.losses.MeanSquaredError()]
    pm, plain = pair(two_in_two_out, replicas=(2,), m=4, loss=loss, cuts=(),
                     weighted_metrics=["mae"], loop=True)
    x, y = data_for(plain, ROWS, seed=9)
    sw = [weights_for(ROWS, 1), weights_for(ROWS, 2)]
    h1 = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    h2 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    logged = ["cls_loss", "cls_mae", "loss", "reg_loss", "reg_mae"]   # as plain tf_keras's
    assert_same(pm, plain, h1, h2, keys=logged)
    got = pm.evaluate(x, y, batch_size=BATCH, sample_weight=sw, return_dict=True)
    want = plain.evaluate(x, y, batch_size=BATCH, sample_weight=sw, return_dict=True, verbose=0)
    assert set(logged) <= set(got)
    for k in logged:
        assert abs(got[k] - want[k]) < 1e-5, k
    for a, b in zip(pm.predict(x, batch_size=BATCH), plain.predict(x, batch_size=BATCH,
                                                                   verbose=0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert_ran_as_loops(pm)


@pytest.mark.parametrize("m", [2, 4])
def test_looped_batch_normalization_gradients_equal_the_plain_model_slice_by_slice(m):
    model, reference = conv_batchnorm(), conv_batchnorm()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batch, replicas = 16, 2
    plan = straight_plan([], len(layer_order(model)), m, batch, replicas=[replicas])
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=True)
    pm.compile(optimizer="sgd", loss=loss)
    rng = np.random.RandomState(0)
    x = (rng.randn(batch, *model.input.shape[1:]) * 2.0 + 1.5).astype("float32")
    y = rng.randint(0, 3, batch).astype("int32")
    got = pm.gradients(x, y)
    _, want = ghost_batch_loss_and_grads(reference, loss, x, y, batch // (m * replicas))
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, want)) < 1e-5
    assert_ran_as_loops(pm)


class Doubler(tf.keras.layers.Layer):
    """Python control flow on a tensor: runs only if Keras converts `call` (AutoGraph)."""

    def call(self, x):
        if tf.reduce_sum(x) > 0.0:
            return x * 2.0
        return -x


@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "loops"])
def test_a_layer_with_python_control_flow_runs_as_in_keras(loop):
    # The loop's own code is not converted by AutoGraph (seconds per trace); the layers inside
    # still are, as Keras converts them in its own train step.
    def branchy(seed=0):
        tf.keras.utils.set_random_seed(seed)
        x = tf.keras.Input((4,))
        h = Doubler(name="doubler")(tf.keras.layers.Dense(4, name="d")(x))
        return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))
    model, reference = branchy(), branchy()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plan = straight_plan([], len(layer_order(model)), 2, 8, replicas=[2])
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=loop)
    pm.compile(optimizer="sgd", loss=loss)
    rng = np.random.RandomState(0)
    x, y = rng.randn(8, 4).astype("float32"), rng.randint(0, 3, 8).astype("int32")
    got = pm.gradients(x, y)
    _, want = ghost_batch_loss_and_grads(reference, loss, x, y, 2)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, want)) < 1e-5
    assert_ran_as_loops(pm, loop)


@pytest.mark.parametrize("cuts,m,looped", [([], 2, True), ([], 1, False), ([2], 2, False)],
                         ids=["data-parallel", "one-micro-batch", "two-stages"])
def test_by_default_a_data_parallel_plan_loops_and_others_unroll(cuts, m, looped):
    model = mlp_with_skip()
    plan = straight_plan(cuts, 5, m, 8 * m, replicas=[2] * (len(cuts) + 1))
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    pm.train_step(*data_for(model, 8 * m, seed=0))
    assert_ran_as_loops(pm, looped)
