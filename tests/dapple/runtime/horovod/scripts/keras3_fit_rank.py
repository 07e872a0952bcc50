"""One rank of Keras 3's own `fit` under horovodrun (#30 item 3): `tests.models.mlp_with_skip`
built with `import keras`, each rank starting from other weights. `argv[1]`:

* `fit`: ModelCheckpoint (weights every epoch), EarlyStopping (stops after epoch 2, best
  weights restored), CSVLogger and TensorBoard in `argv[2]`, given on every rank or (`argv[3]`
  `rank0`) on rank 0 only, validation every 2nd epoch, the
  progress bar on; the plain Keras 3 model's `fit` with the same callbacks (files in a folder
  of the rank's own) is the reference; then `predict` of 2.5 global batches.
* `interrupt` / `resume`: BackupAndRestore in `argv[2]`, Adam; `interrupt` stops every rank at
  the start of epoch 2 (as a killed job would: the script ends there), `resume` is a fresh
  process that goes on; its reference is the plain model interrupted and resumed alike, here.

Prints `DAPPLE_RESULT <json>` per rank; the test asserts.
"""
import json
import os
import sys
import tempfile

import tensorflow as tf   # noqa: F401  (before dapple, on purpose: #30)

import dapple
import keras
import numpy as np

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

mode, folder = sys.argv[1], sys.argv[2]
where = sys.argv[3] if len(sys.argv) > 3 else "all"      # fit's callbacks: "all" or "rank0"
BATCH = 12
rank = int(os.environ.get("HOROVOD_RANK", "0"))
model = models.mlp_with_skip(seed=3 + rank, keras=keras)   # the broadcast makes them rank 0's
plan = straight_plan([2], len(layer_order(model)), 2, BATCH, replicas=[2, 1], schedule="1f1b")
rng = np.random.RandomState(9)
x = rng.randn(3 * BATCH, 6).astype("float32")
y = rng.randint(0, 5, size=3 * BATCH).astype("int32")
val = (x[:BATCH] * 0.5, y[:BATCH])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def max_diff(a_weights, b_weights):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(a_weights, b_weights))


pm = dapple.PipelinedModel(model, plan)
if mode == "fit":
    def callbacks(where):
        return [keras.callbacks.ModelCheckpoint(os.path.join(where, "w{epoch}.weights.h5"),
                                                save_weights_only=True),
                keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1,
                                              restore_best_weights=True),
                keras.callbacks.CSVLogger(os.path.join(where, "log.csv")),
                keras.callbacks.TensorBoard(os.path.join(where, "tb"))]

    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss(),
               metrics=["accuracy"])
    history = pm.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=1,
                     validation_data=val, validation_freq=2,
                     callbacks=callbacks(folder) if rank == 0 or where == "all" else [])
    reference = models.mlp_with_skip(seed=3, keras=keras)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss(),
                      metrics=["accuracy"])
    mine = tempfile.mkdtemp()
    want = reference.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0,
                         validation_data=val, validation_freq=2, callbacks=callbacks(mine))
    # predict across processes: every rank gets every row (the last batch padded)
    predict_diff = float(np.max(np.abs(pm.predict(x[:2 * BATCH + 5])
                                       - reference.predict(x[:2 * BATCH + 5], verbose=0))))
    history_diff = max(abs(a - b) for key in want.history
                       for a, b in zip(history.history[key], want.history[key]))
    file_diff = {}
    if rank == 0:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".weights.h5"):
                got_file, want_file = (models.mlp_with_skip(seed=8, keras=keras)
                                       for _ in range(2))
                got_file.load_weights(os.path.join(folder, name))
                want_file.load_weights(os.path.join(mine, name))
                file_diff[name] = max_diff(got_file.get_weights(), want_file.get_weights())
    print("DAPPLE_RESULT " + json.dumps({
        "rank": pm.rank, "epochs": history.epoch, "want_epochs": want.epoch,
        "keys": sorted(history.history), "want_keys": sorted(want.history),
        "history_diff": history_diff, "file_diff": file_diff, "predict_diff": predict_diff,
        "weight_diff": max_diff(model.get_weights(), reference.get_weights())}), flush=True)
    sys.exit(0)

pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
backup = keras.callbacks.BackupAndRestore(folder)
if mode == "interrupt":
    try:
        pm.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
               callbacks=[backup, Interrupt()])
    except RuntimeError as e:
        print("DAPPLE_RESULT " + json.dumps({"rank": pm.rank, "stopped": str(e)}), flush=True)
    sys.exit(0)

history = pm.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
pm.gather_weights()
plain_backup = tempfile.mkdtemp()
reference = models.mlp_with_skip(seed=3, keras=keras)
reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
try:
    reference.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(plain_backup), Interrupt()])
except RuntimeError:
    pass
reference = models.mlp_with_skip(seed=4, keras=keras)      # the restarted job's model
reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
want = reference.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                     callbacks=[keras.callbacks.BackupAndRestore(plain_backup)])
print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank, "epochs": history.epoch, "want_epochs": want.epoch,
    "history_diff": max(abs(a - b) for a, b in zip(history.history["loss"],
                                                   want.history["loss"])),
    "weight_diff": max_diff(model.get_weights(), reference.get_weights())}), flush=True)
