"""`PipelinedModel.fit` of a tf_keras (Keras 2) model is tf_keras's own `Model.fit` (#30 item 3,
`dapple/tf_keras_model.py`): with ModelCheckpoint, EarlyStopping, TensorBoard and CSVLogger,
`initial_epoch`, `validation_freq`, `validation_split`, `steps_per_epoch` and `class_weight` on
a `tf.data` input it behaves as the plain tf_keras model's `fit` on the same data. Every
reference is plain tf_keras (`fit` of the plain model, its files read by its own
`load_weights`), never dapple's code. 2 stages (1:1), M=4, global batch 24. (BackupAndRestore:
tests/dapple/test_callbacks.py; the same for Keras 3: tests/dapple/test_keras3_fit.py.)
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.keras_adapter import is_keras3
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models
from tests.fit_comparisons import (GLOBAL_BATCH, assert_callbacks_fit_as_plain,
                                   assert_tf_data_fit_as_plain,
                                   assert_validation_split_fit_as_plain,
                                   assert_same_history, assert_same_weights,
                                   assert_two_outputs_log_as_plain, data)

keras = tf.keras          # tf_keras: the suite sets TF_USE_LEGACY_KERAS=1 (tests/conftest.py)
if is_keras3(keras.layers.Dense(1)):
    pytest.skip("tf.keras is not tf_keras here", allow_module_level=True)


def mlp(seed=0):
    return models.mlp_with_skip(seed, keras=keras)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def pair(optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9), seed=0, schedule="1f1b"):
    """(PipelinedModel, its plain model, the plain twin compiled alike)."""
    model, reference = mlp(seed), mlp(seed)
    plan = straight_plan([2], len(layer_order(model)), 4, GLOBAL_BATCH, schedule=schedule)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=optimizer(), loss=loss_fn(), metrics=["accuracy"])
    reference.compile(optimizer=optimizer(), loss=loss_fn(), metrics=["accuracy"])
    return pm, model, reference


def test_callbacks_initial_epoch_and_validation_freq_as_plain_tf_keras_fit(tmp_path):
    assert_callbacks_fit_as_plain(keras, pair, mlp, tmp_path)


def test_tf_data_steps_per_epoch_and_class_weight_as_plain_tf_keras_fit():
    assert_tf_data_fit_as_plain(pair)


def test_validation_split_and_partial_last_batch_as_plain_tf_keras_fit(capsys):
    assert_validation_split_fit_as_plain(*pair(), capsys)

def test_evaluate_and_predict_as_plain_tf_keras():
    """tf_keras's own evaluate (loss first, then metrics; or a dict) and predict (a last
    partial batch padded, its padding dropped)."""
    pm, model, reference = pair()
    x, y = data(2)
    w = np.random.RandomState(4).uniform(0.2, 2.0, size=len(x)).astype("float32")
    got = pm.evaluate(x, y, sample_weight=w)
    want = reference.evaluate(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, verbose=0)
    assert len(got) == 2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    logs = pm.evaluate(x, y, return_dict=True)
    assert sorted(logs) == ["accuracy", "loss"]
    np.testing.assert_allclose(pm.predict(x[:30]), reference.predict(x[:30], verbose=0),
                               rtol=1e-5, atol=1e-5)


def test_two_outputs_log_each_outputs_loss_as_plain_tf_keras():
    assert_two_outputs_log_as_plain(keras, lambda seed: models.two_in_two_out(seed, keras=keras),
                                    lambda: dict(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=[loss_fn(), keras.losses.MeanSquaredError()], loss_weights=[1.0, 0.5],
        metrics=[["accuracy"], ["mae"]]))
