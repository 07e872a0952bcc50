"""`PipelinedModel.fit` of a Keras 3 model is Keras 3's own `Model.fit` (#30 item 3,
`dapple/keras3_model.py`): with ModelCheckpoint, EarlyStopping, BackupAndRestore resumed after an
interrupt, TensorBoard and CSVLogger, `initial_epoch`, `validation_freq`, `validation_split`
and a `tf.data` input it behaves as the plain Keras 3 model's `fit` on the same data. Every
reference is plain Keras 3 (`fit` of the plain model, its files read by its own
`load_weights`), never dapple's code. 2 stages (1:1), M=4, global batch 24.
"""
import os

import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from planner.formats.plan import straight_plan
from tests.fit_comparisons import (GLOBAL_BATCH, assert_callbacks_fit_as_plain,
                                   assert_tf_data_fit_as_plain,
                                   assert_validation_split_fit_as_plain,
                                   assert_same_history, assert_same_weights,
                                   assert_two_outputs_log_as_plain, data)
from tests.keras3_models import keras, loss_fn, mlp_with_skip as mlp, two_in_two_out


def pair(optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9), seed=0, metrics=True):
    """(PipelinedModel, its plain model, the plain twin compiled alike)."""
    model, reference = mlp(seed), mlp(seed)
    from graph_rewrite.model_graph import layer_order
    plan = straight_plan([2], len(layer_order(model)), 4, GLOBAL_BATCH, schedule="1f1b")
    pm = dapple.PipelinedModel(model, plan)
    extra = lambda: dict(metrics=["accuracy"]) if metrics else {}     # noqa: E731
    pm.compile(optimizer=optimizer(), loss=loss_fn(), **extra())
    reference.compile(optimizer=optimizer(), loss=loss_fn(), jit_compile=False, **extra())
    return pm, model, reference


def test_callbacks_initial_epoch_and_validation_freq_as_plain_keras3_fit(tmp_path):
    assert_callbacks_fit_as_plain(keras, pair, mlp, tmp_path)

class Interrupt(keras.callbacks.Callback):
    """Stops the run at the start of `epoch`, as a preempted job would stop."""
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_as_plain_keras3(tmp_path):
    """Interrupted at epoch 2, then a fresh model (other initial weights, a new Adam) resumes:
    the weights and Adam's state come from the backup, so the final weights equal plain Keras
    3's interrupted-and-resumed run."""
    x, y = data(2)
    runs = {}
    for who in ("got", "want"):
        backup = str(tmp_path / who)
        adam = lambda: keras.optimizers.Adam(0.01)          # noqa: E731
        pm, model, reference = pair(adam, metrics=False)
        fit = pm.fit if who == "got" else reference.fit
        with pytest.raises(RuntimeError, match="interrupted"):
            fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt(2)])
        assert sorted(os.listdir(backup)) == ["latest.weights.h5", "training_metadata.json"]
        pm, model, reference = pair(adam, seed=7, metrics=False)   # a restarted job
        fit = pm.fit if who == "got" else reference.fit
        history = fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, shuffle=False, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup)])
        assert history.epoch == [2, 3]
        assert not os.path.exists(backup)                 # deleted at the end, as Keras does
        runs[who] = (model if who == "got" else reference), history
    assert_same_history(runs["got"][1], runs["want"][1])
    assert_same_weights(runs["got"][0], runs["want"][0])


def test_tf_data_steps_per_epoch_and_class_weight_as_plain_keras3_fit():
    assert_tf_data_fit_as_plain(pair)


def test_validation_split_and_partial_last_batch_as_plain_keras3_fit(capsys):
    """Batches other than the plan's are refused before training, as today; validation_split
    takes the last rows (and sample weights) before shuffling, as Keras's; the rows past the
    last whole global batch are left out (the plain model is given the same rows)."""
    pm, model, reference = pair()
    x, y = data(5)
    with pytest.raises(ValueError, match="batch size 48 differs from the plan's "
                                         "global_batch_size 24"):
        pm.fit(x, y, batch_size=48, verbose=0)
    with pytest.raises(ValueError, match="drop_remainder=True"):
        pm.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), verbose=0)
    assert_validation_split_fit_as_plain(pm, model, reference, capsys)


def test_fit_traces_the_pipeline_once_for_training_and_once_for_validation():
    from tests.dapple.test_trace_once import counting_runs
    pm, _, _ = pair(lambda: keras.optimizers.Adam(0.01))
    calls = counting_runs(pm)
    x, y = data(2)
    pm.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, validation_data=data(1, 4))
    pm.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    assert len(calls) == 2                  # Keras's train function and its test function


def test_two_outputs_log_each_outputs_loss_as_plain_keras3():
    assert_two_outputs_log_as_plain(keras, two_in_two_out, lambda: dict(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=[loss_fn(), keras.losses.MeanSquaredError()], loss_weights=[1.0, 0.5],
        metrics=[["accuracy"], ["mae"]]), jit_compile=False)
