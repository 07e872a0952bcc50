"""Working copies (`graph_rewrite.working_copies`): units on a device other than their
variables' read per-device copies refreshed at every step (the TensorFlow-cluster runtime's
step, `dapple.runtime.local.copying_step.CopyingStep`), run here on logical CPU devices of one process,
where the model's variables live on the first. Training equals plain Keras's (3 steps, 1e-5) on
every path that reads weights (SGD: Adam would scale up the float noise of the gradient of
the bias before BatchNormalization, zero in exact arithmetic): unrolled, looped data
parallelism, the split backward of zb-h1, BatchNormalization, pipeline loops; and the copies
are what is read, unrolled and looped (stale copies change the loss)."""
import dapple  # noqa: F401  (Keras 2 and logical devices first)
import pytest
import tensorflow as tf

from dapple.runtime.local.runtime import LocalRuntime
from dapple.runtime.local.copying_step import CopyingStep
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models


class CopyingRuntime(LocalRuntime):
    def make_step(self, model, plan, loss, micro_batch_loop=False, pipeline_loop=False,
                  inline_stage_calls=None):
        return CopyingStep(model, plan, loss, self.devices, micro_batch_loop=micro_batch_loop,
                           pipeline_loop=pipeline_loop, inline_stage_calls=bool(inline_stage_calls))


def pipelined(model, plan, pipeline_loop=False):
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=pipeline_loop)
    pm.runtime = CopyingRuntime(plan)
    return pm


@pytest.mark.parametrize("builder, cuts, replicas, schedule, micro_batches", [
    (models.mlp_with_skip, [2], [1, 1], "1f1b", 4),
    (models.mlp_with_skip, [2], [1, 2], "gpipe", 2),
    (models.mlp_with_skip, [], [2], "1f1b", 2),               # lanes as loops
    (models.mlp_with_skip, [2], [1, 1], "zb-h1", 4),          # split backward
    (models.dense_batchnorm, [2], [1, 1], "1f1b", 1),         # M = 1: slices are the batch
], ids=["2-stage", "1:2", "dp2-loop", "zb-h1", "batchnorm"])
def test_training_with_copies_equals_plain_keras(builder, cuts, replicas, schedule,
                                                 micro_batches):
    model, reference = builder(seed=3), builder(seed=3)
    plan = straight_plan(cuts, len(layer_order(model)), micro_batches, 24, replicas=replicas,
                         schedule=schedule)
    pm = pipelined(model, plan)
    models.assert_trains_like_plain_model(pm, model, reference, models.losses_for(model),
                                          lambda: tf.keras.optimizers.SGD(0.1), 24)
    step = pm.pipeline_step
    made = [step.functions[s].copies.on(step.device(s, r))
            for s, n in enumerate(replicas) for r in range(n)]
    assert any(made), "no unit got working copies"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_pipeline_loops_with_copies_train_as_plain_keras(schedule):
    """The steady periods as loops whose stage splits read the copies (as on a cluster)."""
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    plan = straight_plan([2], len(layer_order(model)), 4, 24, schedule=schedule)
    pm = pipelined(model, plan, pipeline_loop=True)
    models.assert_trains_like_plain_model(pm, model, reference, models.losses_for(model),
                                          lambda: tf.keras.optimizers.SGD(0.1), 24)
    models.assert_ran_as_loops(pm)
    assert pm.pipeline_step.functions[1].copies.on(pm.pipeline_step.device(1, 0))


@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "pipeline-loop"])
def test_units_read_the_copies(monkeypatch, loop):
    model = models.mlp_with_skip(seed=3)
    plan = straight_plan([2], len(layer_order(model)), 4, 24)
    pm = pipelined(model, plan, pipeline_loop=loop)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss=models.losses_for(model))
    x, y = models.data_for(model, 24, seed=1)
    fresh = float(pm.train_step(x, y))
    copies = pm.pipeline_step.functions[1].copies
    assert copies.on(pm.pipeline_step.device(1, 0)), "stage 1 (on the second device) has no copies"
    monkeypatch.setattr(type(copies), "refresh", lambda self: None)
    pm.make_train_function(force=True)       # trace again, without the refresh
    for c in copies.on(pm.pipeline_step.device(1, 0)):
        c.assign(tf.zeros_like(c))
    assert abs(float(pm.train_step(x, y)) - fresh) > 1e-3
    models.assert_ran_as_loops(pm, loop)


def test_no_copies_where_a_read_could_bypass_them():
    regularized = tf.keras.Sequential([
        tf.keras.Input((4,)), tf.keras.layers.Dense(3),
        tf.keras.layers.Dense(2, kernel_regularizer=tf.keras.regularizers.l2(0.1))])
    plan = straight_plan([1], 2, 2, 8)
    pm = pipelined(regularized, plan)
    pm.compile(optimizer="sgd", loss="mse")
    assert not pm.pipeline_step.functions[1].copies.possible          # the penalty reads the variable
    assert pm.pipeline_step.functions[0].copies.on(pm.pipeline_step.device(0, 0)) == []   # variables live there
    assert [id(v) for v in pm.pipeline_step.unit_variables((1, 0))] == [
        id(v) for v in regularized.layers[1].trainable_variables]
