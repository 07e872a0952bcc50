"""Keras callbacks on the local runtime see the whole model and write what plain Keras writes:
checkpoints that load into the plain model, EarlyStopping's best weights, BackupAndRestore
resumed after an interrupt, CSVLogger and TensorBoard. References: plain Keras on a second model
built with the same seed, trained on the same batches.

The same under horovodrun, across ranks: tests/dapple/runtime/horovod/test_callbacks_horovod.py."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import os

import numpy as np
import pytest
import tensorflow as tf

from dapple.pipelined_model import PipelinedModel
from planner.formats.plan import straight_plan
from tests.models import data_for, losses_for, mlp_with_skip

BATCH = 8
PLAN = straight_plan([2], 5, 2, BATCH)        # two stages, two micro-batches


def pair(optimizer):
    model, plain = mlp_with_skip(seed=4), mlp_with_skip(seed=4)
    loss = losses_for(model)
    pm = PipelinedModel(model, PLAN)
    pm.compile(optimizer(), loss)
    plain.compile(optimizer(), loss)
    return pm, plain


def data():
    return data_for(mlp_with_skip(), 4 * BATCH, seed=2)


class HandScore(tf.keras.callbacks.Callback):
    """`score` in each epoch's logs: best after epoch 1."""
    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = [3.0, 1.0, 2.0, 2.0, 2.0, 2.0][epoch]


def test_checkpoints_load_into_the_plain_model_and_best_weights_are_restored(tmp_path):
    x, y = data()
    pm, plain = pair(lambda: tf.keras.optimizers.SGD(0.1))
    callbacks = [HandScore(),
                 tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "best.weights.h5"),
                                                    save_weights_only=True, monitor="score",
                                                    save_best_only=True, mode="min"),
                 tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "whole.h5")),
                 tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "whole.keras")),
                 tf.keras.callbacks.EarlyStopping(monitor="score", mode="min", patience=2,
                                                  restore_best_weights=True),
                 tf.keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                 tf.keras.callbacks.TensorBoard(str(tmp_path / "tb"))]
    history = pm.fit(x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0,
                     callbacks=callbacks)
    assert len(history.history["loss"]) == 4            # stopped after epoch 3
    plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)   # the best epoch
    want = plain.predict(x, verbose=0)
    np.testing.assert_allclose(pm.predict(x), want, atol=1e-5)
    best = mlp_with_skip(seed=1)
    best.load_weights(str(tmp_path / "best.weights.h5"))
    np.testing.assert_allclose(best.predict(x, verbose=0), pm.predict(x), atol=1e-6)
    # The whole-model files were written after epoch 3: plain Keras after 4 epochs.
    plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for name in ("whole.h5", "whole.keras"):
        whole = tf.keras.models.load_model(str(tmp_path / name))
        np.testing.assert_allclose(whole.predict(x, verbose=0), plain.predict(x, verbose=0),
                                   atol=1e-5, err_msg=name)
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 5
    assert os.listdir(tmp_path / "tb")
    # Written atomically: nothing but the files themselves is left beside them.
    assert sorted(os.listdir(tmp_path)) == ["best.weights.h5", "log.csv", "tb", "whole.h5",
                                            "whole.keras"]


class Interrupt(tf.keras.callbacks.Callback):
    def __init__(self, at_epoch):
        super().__init__()
        self.at_epoch = at_epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at_epoch:
            raise KeyboardInterrupt("interrupted")


def test_backup_and_restore_resumes_after_an_interrupt(tmp_path):
    x, y = data()
    backup = str(tmp_path / "backup")
    pm, plain = pair(lambda: tf.keras.optimizers.Adam(0.01))     # slots must come back too
    with pytest.raises(KeyboardInterrupt):
        pm.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
               callbacks=[tf.keras.callbacks.BackupAndRestore(backup), Interrupt(2)])
    # A new process: a fresh model and optimizer, the same script.
    resumed, _ = pair(lambda: tf.keras.optimizers.Adam(0.01))
    history = resumed.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                          callbacks=[tf.keras.callbacks.BackupAndRestore(backup)])
    assert history.epoch == [2, 3]
    plain.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(resumed.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert os.listdir(backup) == []          # the backup removed once training finished


def test_fit_checks_validation_data_and_datasets_before_the_first_step():
    x, y = data()
    pm, _ = pair(lambda: tf.keras.optimizers.SGD(0.1))
    before = [w.copy() for w in pm.model.get_weights()]
    with pytest.raises(ValueError, match=r"validation_data has 12 rows.*multiple of 8.*first 8"):
        pm.fit(x, y, batch_size=BATCH, validation_data=(x[:12], y[:12]), verbose=0)
    unbatched = tf.data.Dataset.from_tensor_slices((x, y))
    with pytest.raises(ValueError, match=r"not batched.*\.batch\(8, drop_remainder=True\)"):
        pm.fit(unbatched, verbose=0)
    ragged = tf.data.Dataset.from_tensor_slices((x[:20], y[:20])).batch(BATCH)
    with pytest.raises(ValueError, match=r"unknown size.*drop_remainder=True"):
        pm.fit(ragged, verbose=0)
    other = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    with pytest.raises(ValueError, match="batch size 16 of fit's data differs"):
        pm.fit(other, verbose=0)
    with pytest.raises(ValueError, match="not batched"):
        pm.fit(x, y, batch_size=BATCH, validation_data=unbatched, verbose=0)
    # Nothing trained before the errors.
    for a, b in zip(before, pm.model.get_weights()):
        np.testing.assert_array_equal(a, b)
