"""Mixed precision trains as plain Keras does: each micro-batch's loss term is scaled by the
LossScaleOptimizer's current scale, gradients are unscaled once after accumulation, and a
non-finite gradient skips the step and halves the scale. The reference is plain Keras
`train_on_batch` with the same policy and optimizer, on the same batches."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from dapple.pipelined_model import PipelinedModel
from planner.formats.plan import straight_plan
from tests import models
from tests.models import assert_ran_as_loops, float32_logits_mlp as mlp, loss_scale_steps

BATCH, STEPS, BAD_STEP = 16, 20, 7
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture
def policy(request):
    tf.keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    tf.keras.mixed_precision.set_global_policy("float32")


def optimizer(clipnorm=None):
    inner = tf.keras.optimizers.SGD(0.05, global_clipnorm=clipnorm)
    # growth every 4 finite steps, so 20 steps grow and shrink the scale
    return tf.keras.mixed_precision.LossScaleOptimizer(inner, dynamic_growth_steps=4)


def batches(seed=0):
    return models.overflowing_batches(STEPS, BATCH, BAD_STEP, seed)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("cuts,replicas,schedule,loop", [([2], [1, 1], "1f1b", False),
                                                         ([2], [2, 1], "1f1b", False),
                                                         ([2], [2, 1], "zb-h1", False),
                                                         ([], [2], "1f1b", True),
                                                         ([2], [2, 1], "1f1b", True),
                                                         ([2], [2, 1], "zb-h1", True)])
def test_loss_scale_and_weights_follow_plain_keras_over_20_steps(policy, cuts, replicas,
                                                                 schedule, loop):
    """zb-h1: W reaches the float32 weights through their reads' float16 casts."""
    plain, model = mlp(), mlp()
    plain.compile(optimizer(), LOSS)
    pm = PipelinedModel(model, straight_plan(cuts, 4, 4, BATCH, replicas=replicas,
                                             schedule=schedule), micro_batch_loop=loop,
                        pipeline_loop=loop)
    pm.compile(optimizer(), LOSS)
    assert isinstance(pm.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
    scales = loss_scale_steps(pm, plain, batches(), BAD_STEP,
                              lambda opt: float(opt.loss_scale))
    assert_ran_as_loops(pm, loop)
    assert [g for g, _ in scales] == [w for _, w in scales]
    assert len(set(w for _, w in scales)) > 2      # the scale grew and was halved
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_boundary_tensors_travel_in_the_compute_dtype(policy):
    pm = PipelinedModel(mlp(), straight_plan([2], 4, 2, BATCH))
    assert [pm_spec.dtype for pm_spec in _boundary_specs(pm)] == [tf.float16]


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_bfloat16_trains_like_plain_keras(policy):
    plain, model = mlp(), mlp()
    plain.compile(tf.keras.optimizers.SGD(0.05), LOSS)
    pm = PipelinedModel(model, straight_plan([2], 4, 4, BATCH, replicas=[1, 2]))
    pm.compile(tf.keras.optimizers.SGD(0.05), LOSS)
    for step, (x, y) in enumerate(batches()):
        if step == BAD_STEP:
            continue
        pm.train_step(x, y)
        plain.train_on_batch(x, y)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)   # bfloat16: 8 bits of mantissa


def _boundary_specs(pm):
    from graph_rewrite.model_graph import cut_model
    stages = cut_model(pm.model, [tuple(s.layers) for s in pm.plan.stages])
    return [stages[1].specs[tid] for tid in stages[1].input_ids]
