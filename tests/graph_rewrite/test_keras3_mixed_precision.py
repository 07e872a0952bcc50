"""Keras 3 mixed precision (`mixed_float16`, Keras 3's `LossScaleOptimizer`) trains as plain
Keras 3 does: each micro-batch's loss term is scaled by the optimizer's `dynamic_scale`, the
accumulated gradients go to the optimizer still scaled (Keras 3 unscales inside `apply`), and
a non-finite gradient skips the step and halves the scale. The reference is plain Keras 3's
`train_on_batch` with the same policy and optimizer on the same batches (the Keras 2 twin is
tests/dapple/test_mixed_precision.py)."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest

from planner.formats.plan import straight_plan
from tests import models

keras = pytest.importorskip("keras")
if keras.__version__.startswith(("1.", "2.")):
    pytest.skip("`import keras` is not Keras 3 here", allow_module_level=True)

BATCH, STEPS, BAD_STEP = 16, 12, 7


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer():
    # growth every 4 finite steps, so 12 steps with one bad one grow and halve the scale
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.5),
                                               dynamic_growth_steps=4)


def batches(seed=0):
    return models.overflowing_batches(STEPS, BATCH, BAD_STEP, seed)


@pytest.mark.parametrize("cuts,replicas,loop", [([2], [1, 1], False),
                                                ([2], [2, 1], False),
                                                ([], [2], True)])
def test_loss_scale_and_weights_follow_plain_keras3(mixed_float16, cuts, replicas, loop):
    plain, model = (models.float32_logits_mlp(keras=keras) for _ in range(2))
    plain.compile(optimizer(), loss_fn(), jit_compile=False)
    pm = dapple.PipelinedModel(model, straight_plan(cuts, 4, 4, BATCH, replicas=replicas),
                               micro_batch_loop=loop, pipeline_loop=loop)
    pm.compile(optimizer(), loss_fn())
    assert isinstance(pm.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.get_layer("d1").compute_dtype == "float16"
    start = [w.copy() for w in model.get_weights()]
    scales = models.loss_scale_steps(pm, plain, batches(), BAD_STEP,
                                     lambda opt: float(opt.dynamic_scale))
    models.assert_ran_as_loops(pm, loop)
    assert [g for g, _ in scales] == [w for _, w in scales]
    wanted = [w for _, w in scales]
    assert wanted[BAD_STEP] == wanted[BAD_STEP - 1] / 2     # halved at the skipped step
    assert max(wanted[:BAD_STEP]) > wanted[0]               # and grew before it
    assert int(pm.optimizer.iterations) == int(plain.optimizer.iterations)
    for a, b, s in zip(model.get_weights(), plain.get_weights(), start):
        assert np.max(np.abs(b - s)) > 1e-2            # the weights did train
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def test_compile_wraps_the_optimizer_in_a_loss_scale_optimizer_as_keras3_does(mixed_float16):
    """Keras 3's compile makes the LossScaleOptimizer (initial scale 2**15); one step of
    dapple's scales as plain Keras 3's does (gradients of a float16 model with the scale)."""
    plain, model = (models.float32_logits_mlp(keras=keras) for _ in range(2))
    plain.compile(keras.optimizers.SGD(0.05), loss_fn(), jit_compile=False)
    pm = dapple.PipelinedModel(model, straight_plan([2], 4, 4, BATCH, replicas=[1, 1]))
    pm.compile(keras.optimizers.SGD(0.05), loss_fn())
    assert isinstance(pm.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = next(batches(seed=3))
    pm.train_step(x, y)
    plain.train_on_batch(x, y)
    assert float(pm.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale) == 2.0**15
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def test_a_plain_optimizers_loss_scale_factor_scales_like_keras3():
    """Keras 3's `loss_scale_factor` on any optimizer (float32 here): the trainer multiplies
    the loss by it, `apply` divides the gradients by it."""
    def sgd():
        return keras.optimizers.SGD(0.05, momentum=0.5, loss_scale_factor=1024.0)
    plain, model = (models.float32_logits_mlp(keras=keras) for _ in range(2))
    plain.compile(sgd(), loss_fn(), jit_compile=False)
    pm = dapple.PipelinedModel(model, straight_plan([2], 4, 4, BATCH, replicas=[2, 1]))
    pm.compile(sgd(), loss_fn())
    start = [w.copy() for w in model.get_weights()]
    for step, (x, y) in enumerate(batches(seed=5)):
        if step == 3:
            break
        assert abs(float(pm.train_step(x, y)) - float(plain.train_on_batch(x, y))) < 1e-5
    for a, b, s in zip(model.get_weights(), plain.get_weights(), start):
        assert np.max(np.abs(b - s)) > 1e-3
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
