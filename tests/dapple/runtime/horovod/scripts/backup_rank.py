"""BackupAndRestore under horovodrun: `argv[1]` is `interrupt` (every rank stops at the start
of epoch 2, as a killed job would) or `resume` (the same script again: training goes on from
epoch 2); `argv[2]` the backup directory. Adam, so each rank's optimizer slots must come back.
Prints `DAPPLE_RESULT <json>` per rank after resuming."""
import json
import os
import sys

import dapple
import numpy as np
import tensorflow as tf

from planner.formats.plan import Plan
from tests import models

phase, backup = sys.argv[1], sys.argv[2]
plan = Plan.load(os.environ["DAPPLE_PLAN"])
batch = plan.global_batch_size
model = models.mlp_with_skip(seed=5)
x, y = models.data_for(model, 4 * batch, seed=9)
loss = models.losses_for(model)


class Interrupt(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise SystemExit(3)


pm = dapple.PipelinedModel(model, plan)
pm.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss=loss)
callbacks = [tf.keras.callbacks.BackupAndRestore(backup)]
history = pm.fit(x, y, batch_size=batch, epochs=4, shuffle=False, verbose=0,
                 callbacks=callbacks + ([Interrupt()] if phase == "interrupt" else []))

reference = models.mlp_with_skip(seed=5)
reference.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss=loss)
reference.fit(x, y, batch_size=batch, epochs=4, shuffle=False, verbose=0)
print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank, "epochs": history.epoch,
    "predict_diff": float(np.max(np.abs(pm.predict(x)
                                        - reference.predict(x, batch_size=batch, verbose=0))))
}), flush=True)
