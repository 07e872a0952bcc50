"""A user's script with Keras callbacks under horovodrun: ModelCheckpoint (weights only, best
only, and whole model), EarlyStopping restoring the best epoch's weights, CSVLogger. `argv[1]`
is `all` (the same callbacks on every rank) or `rank0` (Horovod's habit: callbacks on rank 0
only); `argv[2]` the directory for their files; `argv[3]` fit's verbose.

The monitored score is set by hand per epoch (best after epoch 1, patience 2: fit stops after
epoch 3 and restores epoch 1's weights), so the plain reference is plain Keras trained 2 epochs.
Prints `DAPPLE_RESULT <json>` per rank."""
import json
import os
import sys

import dapple
import numpy as np
import tensorflow as tf

from planner.formats.plan import Plan
from tests import models

where, folder, verbose = sys.argv[1], sys.argv[2], int(sys.argv[3])
plan = Plan.load(os.environ["DAPPLE_PLAN"])
batch = plan.global_batch_size
model, reference = models.mlp_with_skip(seed=5), models.mlp_with_skip(seed=5)
x, y = models.data_for(model, 4 * batch, seed=9)
loss = models.losses_for(model)
SCORES = [3.0, 1.0, 2.0, 2.0, 2.0, 2.0]


class HandScore(tf.keras.callbacks.Callback):
    """Puts `score` into the epoch's logs, for the callbacks after it."""
    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = SCORES[epoch]


pm = dapple.PipelinedModel(model, plan)
pm.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss)
callbacks = []
if where == "all" or pm.rank == 0:
    callbacks = [
        HandScore(),
        tf.keras.callbacks.ModelCheckpoint(os.path.join(folder, "last.weights.h5"),
                                           save_weights_only=True),
        tf.keras.callbacks.ModelCheckpoint(os.path.join(folder, "best.weights.h5"),
                                           save_weights_only=True, save_best_only=True,
                                           monitor="score", mode="min"),
        tf.keras.callbacks.ModelCheckpoint(os.path.join(folder, "model.h5")),
        tf.keras.callbacks.EarlyStopping(monitor="score", mode="min", patience=2,
                                         restore_best_weights=True),
        tf.keras.callbacks.CSVLogger(os.path.join(folder, "log.csv")),
    ]
history = pm.fit(x, y, batch_size=batch, epochs=6, shuffle=False, verbose=verbose,
                 callbacks=callbacks)
predicted = pm.predict(x)                   # with the weights each stage trains on

reference.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss)
reference.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
want = reference.predict(x, batch_size=batch, verbose=0)

result = {"rank": pm.rank, "epochs": len(history.history["loss"]),
          "predict_diff": float(np.max(np.abs(predicted - want)))}
if pm.rank == 0:
    # Each file into a fresh plain model: does it predict what the pipelined model predicts?
    best = models.mlp_with_skip(seed=1)
    best.load_weights(os.path.join(folder, "best.weights.h5"))
    result["best_file_diff"] = float(np.max(np.abs(best.predict(x, verbose=0) - predicted)))
    whole = tf.keras.models.load_model(os.path.join(folder, "model.h5"), compile=False)
    last = models.mlp_with_skip(seed=1)
    last.load_weights(os.path.join(folder, "last.weights.h5"))
    # Both were written after the last epoch (3), before EarlyStopping restored epoch 1.
    result["last_files_agree"] = float(np.max(np.abs(whole.predict(x, verbose=0)
                                                     - last.predict(x, verbose=0))))
    last_ref = models.mlp_with_skip(seed=5)
    last_ref.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss)
    last_ref.fit(x, y, batch_size=batch, epochs=4, shuffle=False, verbose=0)
    result["last_file_diff"] = float(np.max(np.abs(last.predict(x, verbose=0)
                                                   - last_ref.predict(x, verbose=0))))
    result["csv_rows"] = len(open(os.path.join(folder, "log.csv")).read().splitlines()) - 1
result["files"] = sorted(os.listdir(folder))
print("DAPPLE_RESULT " + json.dumps(result), flush=True)
