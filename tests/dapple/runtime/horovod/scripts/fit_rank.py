"""A user's training script, unchanged between one machine and horovodrun: `fit` (with a
metric, sample weights and validation data), `evaluate` (weighted) and `predict` on the plan in
$DAPPLE_PLAN (set by `dapple launch`), compared with plain Keras on the same data (no
shuffling, same batches).
Prints `DAPPLE_RESULT <json>` per rank."""
import json
import os

import dapple
import numpy as np
import tensorflow as tf

from planner.formats.plan import Plan
from tests import models

plan = Plan.load(os.environ["DAPPLE_PLAN"])
batch = plan.global_batch_size
model, reference = models.mlp_with_skip(seed=5), models.mlp_with_skip(seed=5)
x, y = models.data_for(model, 4 * batch, seed=9)
x_val, y_val = models.data_for(model, 2 * batch, seed=10)
weights = np.random.RandomState(11).uniform(0.0, 3.0, len(y)).astype("float32")
val_weights = np.random.RandomState(12).uniform(0.0, 3.0, len(y_val)).astype("float32")
loss = models.losses_for(model)

pm = dapple.PipelinedModel(model, plan)
pm.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
history = pm.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                 validation_data=(x_val, y_val), sample_weight=weights)
got_eval = pm.evaluate(x_val, y_val, sample_weight=val_weights, return_dict=True)
got_pred = pm.predict(x[:batch + 5])                     # a padded last batch

reference.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
want = reference.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                     validation_data=(x_val, y_val), sample_weight=weights)
want_eval = reference.evaluate(x_val, y_val, batch_size=batch, sample_weight=val_weights,
                               return_dict=True, verbose=0)
want_pred = reference.predict(x[:batch + 5], batch_size=batch, verbose=0)

pm.gather_weights()
print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank,
    "weight_diff": max(float(np.max(np.abs(a - b)))
                       for a, b in zip(model.get_weights(), reference.get_weights())),
    "history_keys": sorted(history.history),
    "history_diff": max(abs(a - b) for k in want.history
                        for a, b in zip(history.history[k], want.history[k])),
    "eval_diff": max(abs(got_eval[k] - want_eval[k]) for k in want_eval),
    "predict_diff": float(np.max(np.abs(got_pred - want_pred))),
    "predict_rows": int(got_pred.shape[0])}), flush=True)
