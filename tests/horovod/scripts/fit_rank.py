"""A user's training script, unchanged between one machine and horovodrun: `fit` for 2 epochs
on the plan in $DAPPLE_PLAN (set by `dapple launch`), then compare with plain Keras `fit` on
the same data (no shuffling, same batches). Prints `DAPPLE_RESULT <json>` per rank."""
import json
import os

import dapple
import numpy as np
import tensorflow as tf

from planner.plan import Plan
from tests import models

plan = Plan.load(os.environ["DAPPLE_PLAN"])
model, reference = models.mlp_with_skip(seed=5), models.mlp_with_skip(seed=5)
x, y = models.data_for(model, 4 * plan.global_batch_size, seed=9)
loss = models.losses_for(model)

pm = dapple.PipelinedModel(model, plan)
pm.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss)
history = pm.fit(x, y, batch_size=plan.global_batch_size, epochs=2, shuffle=False, verbose=0)

reference.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss)
want = reference.fit(x, y, batch_size=plan.global_batch_size, epochs=2, shuffle=False, verbose=0)

pm.gather_weights()
print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank,
    "weight_diff": max(float(np.max(np.abs(a - b)))
                       for a, b in zip(model.get_weights(), reference.get_weights())),
    "loss_diff": max(abs(a - b) for a, b in zip(history.history["loss"],
                                                 want.history["loss"]))}), flush=True)
