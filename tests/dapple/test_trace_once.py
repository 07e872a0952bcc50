"""The pipelined step is traced once, and its graph grows by a few call ops per micro-batch.

Keras makes optimizer slots and metric variables on first use; inside the step's tf.function
that makes TensorFlow trace the whole pipeline twice. And a unit's per-variable work (gradient
accumulation, BatchNormalization statistics) must not put per-variable ops into the step's graph
for every micro-batch: at ResNet-50 scale that was most of the graph.
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)

import numpy as np
import pytest
import tensorflow as tf

from dapple.pipelined_model import PipelinedModel
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests.models import mlp_with_skip


def deep_mlp(seed=0, depth=8):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,))
    h = x
    for i in range(depth - 1):
        h = tf.keras.layers.Dense(8, activation="relu", name=f"d{i}")(h)
        h = tf.keras.layers.BatchNormalization(name=f"bn{i}")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))


def counting_runs(pm):
    """Wrap the step's `run` (what the step function traces) to count traces."""
    calls = []
    run = pm.pipeline_step.run

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)
    pm.pipeline_step.run = counted
    return calls


OPTIMIZERS = {
    "sgd_momentum": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "loss_scale": lambda: tf.keras.mixed_precision.LossScaleOptimizer(
        tf.keras.optimizers.Adam(0.01)),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("metrics", [(), ("accuracy",)])
def test_train_step_traces_the_pipeline_once(optimizer, metrics):
    model = mlp_with_skip(seed=1)
    plan = straight_plan([2], len(layer_order(model)), 2, 8, replicas=[2, 1])
    pm = PipelinedModel(model, plan)
    pm.compile(OPTIMIZERS[optimizer](), tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=list(metrics))
    calls = counting_runs(pm)
    x = np.random.RandomState(0).rand(8, 6).astype("float32")
    y = np.arange(8) % 5
    pm.train_step(x, y)
    pm.train_step(x, y)
    assert len(calls) == 1


def test_fit_traces_the_pipeline_once():
    model = mlp_with_skip(seed=1)
    plan = straight_plan([2], len(layer_order(model)), 2, 8, replicas=[1, 2])
    pm = PipelinedModel(model, plan)
    pm.compile(tf.keras.optimizers.Adam(0.01), tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    calls = counting_runs(pm)
    x = np.random.RandomState(0).rand(32, 6).astype("float32")
    pm.fit(x, np.arange(32) % 5, batch_size=8, epochs=2, verbose=0)
    assert len(calls) == 1


@pytest.mark.parametrize("schedule,cuts,m", [("1f1b", [2], 4), ("gpipe", [2], 4),
                                             ("zb-h1", [2], 4), ("interleaved", [1, 2, 3], 6)])
def test_a_looped_pipeline_traces_once(schedule, cuts, m):
    """A loop adds its gradients into variables; made while the step traced, they made
    TensorFlow trace the whole pipeline twice (MobileNetV2 on two devices: 3 s of a 21 s first
    call at M = 16)."""
    from tests.graph_rewrite.test_schedule_loop import assert_looped, plan_of
    model = mlp_with_skip(seed=1)
    plan = plan_of(cuts, m, schedule, [2, 1])
    pm = PipelinedModel(model, plan, pipeline_loop=True)
    pm.compile(tf.keras.optimizers.Adam(0.01), tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    calls = counting_runs(pm)
    x = np.random.RandomState(0).rand(8 * m, 6).astype("float32")
    pm.train_step(x, np.arange(8 * m) % 5)
    pm.train_step(x, np.arange(8 * m) % 5)
    assert len(calls) == 1
    assert_looped(pm)


def step_graph_nodes(micro_batches: int) -> int:
    model = deep_mlp()
    batch = 4 * micro_batches
    plan = straight_plan([], len(layer_order(model)), micro_batches, batch, replicas=[2])
    pm = PipelinedModel(model, plan)
    pm.compile(tf.keras.optimizers.SGD(0.1), "mse")
    x, y = tf.zeros((batch, 6)), tf.zeros((batch, 3))

    @tf.function
    def step(x, y):
        return pm.pipeline_step.run(x, y).gradients
    return len(step.get_concrete_function(x, y).graph.as_graph_def().node), \
        len(model.trainable_variables)


def test_step_graph_grows_by_call_ops_not_per_variable():
    # A unit is (replica, micro-batch): 2 replicas, so M 2 -> 4 adds 4 units. Per-variable
    # ops per unit (an add per gradient, per-layer statistics) would add >= 30 nodes a unit.
    small, variables = step_graph_nodes(2)
    large, _ = step_graph_nodes(4)
    per_unit = (large - small) / 4
    assert variables == 30
    assert per_unit < variables / 2, (small, large)
