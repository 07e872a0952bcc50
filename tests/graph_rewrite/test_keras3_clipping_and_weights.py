"""Keras 3 optimizers' gradient clipping (`clipnorm`, `global_clipnorm`, `clipvalue`; under
mixed precision too) and sample and class weights train as plain Keras 3 does: the optimizer
clips the whole model's gradient (one `apply_gradients`), and the weighted loss and metrics
are Keras 3's. References: plain Keras 3's `train_on_batch`, `fit` and `evaluate` on a twin
with the same initial weights (the Keras 2 twins are tests/dapple/test_clipping.py and
tests/dapple/test_sample_weights.py)."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest

from planner.formats.plan import straight_plan
from tests import models
from tests.keras3_models import data, keras, loss_fn


BATCH, ROWS = 16, 48
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.0, 3: 0.1, 4: 3.0}


def sample_weights(rows, seed):
    return np.random.RandomState(seed).uniform(0.0, 3.0, rows).astype("float32")


def pair(optimizer, replicas=(2, 1), micro_batches=4, **compile_args):
    """(PipelinedModel of mlp_with_skip cut after d2, the plain twin), compiled alike."""
    plain = models.mlp_with_skip(3, keras=keras)
    plain.compile(optimizer(), loss_fn(), jit_compile=False, **compile_args)
    pm = dapple.PipelinedModel(models.mlp_with_skip(3, keras=keras),
                               straight_plan([2], 5, micro_batches, BATCH,
                                             replicas=list(replicas)))
    pm.compile(optimizer(), loss_fn(), **compile_args)
    return pm, plain


@pytest.mark.parametrize("clip", [dict(clipnorm=0.05), dict(global_clipnorm=0.1),
                                  dict(clipvalue=0.01)], ids=lambda c: next(iter(c)))
def test_clipping_equals_plain_keras3(clip):
    pm, plain = pair(lambda: keras.optimizers.SGD(0.5, **clip))
    unclipped = models.mlp_with_skip(3, keras=keras)
    unclipped.compile(keras.optimizers.SGD(0.5), loss_fn(), jit_compile=False)
    for step in range(3):
        x, y = data(BATCH, seed=100 + step)
        got, want = float(pm.train_step(x, y)), float(plain.train_on_batch(x, y))
        unclipped.train_on_batch(x, y)
        assert abs(got - want) < 1e-5
    for got, want in zip(pm.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(plain.get_weights(),
                                                            unclipped.get_weights())) > 1e-3


def test_global_clipnorm_under_mixed_precision_clips_the_unscaled_gradient():
    """Keras 3's LossScaleOptimizer unscales, then its inner optimizer clips."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        def optimizer():
            return keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.5, global_clipnorm=0.1), dynamic_growth_steps=2)
        plain = models.float32_logits_mlp(keras=keras)
        plain.compile(optimizer(), loss_fn(), jit_compile=False)
        model = models.float32_logits_mlp(keras=keras)
        pm = dapple.PipelinedModel(model, straight_plan([2], 4, 4, BATCH, replicas=[2, 1]))
        pm.compile(optimizer(), loss_fn())
        start = [w.copy() for w in model.get_weights()]
        for step in range(4):
            x, y = data(BATCH, seed=10 + step)
            pm.train_step(x, y % 4)
            plain.train_on_batch(x, y % 4)
        assert float(pm.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale)
        moved = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in
                            zip(plain.get_weights(), start)))
        assert moved <= 4 * 0.5 * 0.1 + 1e-3        # clipped: 4 steps of at most lr * 0.1
        for a, b in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def assert_same(pm, plain, got, want, tol=1e-5):
    for a, b in zip(pm.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    assert sorted(got.history) == sorted(want.history)
    for k in want.history:
        np.testing.assert_allclose(got.history[k], want.history[k], rtol=tol, atol=tol,
                                   err_msg=k)


def test_train_step_with_sample_weight_equals_train_on_batch():
    pm, plain = pair(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    for step in range(3):
        x, y = data(BATCH, seed=20 + step)
        sw = sample_weights(BATCH, seed=30 + step)
        got = float(pm.train_step(x, y, sample_weight=sw))
        want = float(plain.train_on_batch(x, y, sample_weight=sw))
        assert abs(got - want) < 1e-5
    for a, b in zip(pm.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fit_with_sample_weight_and_weighted_metrics_equals_plain_fit():
    pm, plain = pair(lambda: keras.optimizers.SGD(0.1), weighted_metrics=["accuracy"])
    x, y = data(ROWS, seed=1)
    sw = sample_weights(ROWS, seed=4)
    got = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    want = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                     sample_weight=sw)
    assert_same(pm, plain, got, want)
    unweighted = models.mlp_with_skip(3, keras=keras)
    unweighted.compile(keras.optimizers.SGD(0.1), loss_fn(), jit_compile=False)
    free = unweighted.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert abs(free.history["loss"][-1] - want.history["loss"][-1]) > 1e-3   # weights matter


def test_fit_with_class_weight_equals_plain_fit():
    pm, plain = pair(lambda: keras.optimizers.SGD(0.1), replicas=(1, 2), micro_batches=2,
                     metrics=["accuracy"])
    x, y = data(ROWS, seed=2)
    got = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                 class_weight=CLASS_WEIGHT)
    want = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                     class_weight=CLASS_WEIGHT)
    assert_same(pm, plain, got, want)


def test_evaluate_with_sample_weight_and_weighted_metrics_equals_plain():
    pm, plain = pair(lambda: keras.optimizers.SGD(0.1), metrics=["accuracy"],
                     weighted_metrics=["accuracy"])
    x, y = data(ROWS, seed=7)
    sw = sample_weights(ROWS, seed=8)
    got = pm.evaluate(x, y, batch_size=BATCH, sample_weight=sw, return_dict=True)
    want = plain.evaluate(x, y, batch_size=BATCH, sample_weight=sw, return_dict=True,
                          verbose=0)
    assert sorted(got) == sorted(want)
    for k in want:
        assert abs(got[k] - want[k]) < 1e-5, k
