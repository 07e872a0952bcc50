"""Keras 3's own `fit` on the TensorFlow-cluster runtime (#30): run once, as the chief, by
`dapple launch --runtime=tensorflow` over 2 tasks. `mlp_with_skip` on a 1:1 plan (stage 1 on
task 1) is fit for 2 epochs of 3 global batches with validation data, a CSVLogger and a
ModelCheckpoint saving weights each epoch, beside the plain Keras 3 model's `fit` on the same
data in this process (the reference).

Prints one `DAPPLE_RESULT <json>` line with the largest differences; the test asserts.
"""
import csv
import json
import os
import sys

import tensorflow as tf  # noqa: F401  (before dapple, as a user may)

import dapple
import keras
import numpy as np

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

assert not keras.__version__.startswith(("1.", "2.")), keras.__version__
GLOBAL_BATCH, M, EPOCHS = 24, 4, 2
folder = sys.argv[1]


def compiled(model):
    return dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"],
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def callbacks(who):
    os.makedirs(os.path.join(folder, who))
    return [keras.callbacks.CSVLogger(os.path.join(folder, who, "log.csv")),
            keras.callbacks.ModelCheckpoint(os.path.join(folder, who, "w{epoch}.weights.h5"),
                                            save_weights_only=True)]


def max_diff(a_list, b_list):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(a_list, b_list))


rng = np.random.RandomState(11)
x = (rng.randn(3 * GLOBAL_BATCH, 6) * 2.0 + 1.5).astype("float32")
y = rng.randint(0, 5, size=3 * GLOBAL_BATCH).astype("int32")
val = (x[:GLOBAL_BATCH] * 0.5, y[:GLOBAL_BATCH])

model, reference = models.mlp_with_skip(3, keras=keras), models.mlp_with_skip(3, keras=keras)
initial = [np.array(w) for w in model.get_weights()]
plan = straight_plan([2], len(layer_order(model)), M, GLOBAL_BATCH, schedule="1f1b")
pm = dapple.PipelinedModel(model, plan)
pm.compile(**compiled(model))
reference.compile(jit_compile=False, **compiled(reference))
got = pm.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
             validation_data=val, callbacks=callbacks("got"))
want = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                     validation_data=val, callbacks=callbacks("want"))


def read_csv(who):
    with open(os.path.join(folder, who, "log.csv")) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def checkpoint(who, epoch):
    plain = models.mlp_with_skip(5, keras=keras)
    plain.load_weights(os.path.join(folder, who, f"w{epoch}.weights.h5"))
    return plain.get_weights()


got_rows, want_rows = read_csv("got"), read_csv("want")
report = {
    "runtime": type(pm.runtime).__name__,
    "home": pm.pipeline_step.functions[1].copies.home,
    "history_keys": sorted(got.history) == sorted(want.history),
    "history_diff": max(max_diff(got.history[k], want.history[k]) for k in want.history),
    "csv_columns": [list(r) for r in got_rows] == [list(r) for r in want_rows],
    "csv_rows": len(got_rows),
    "csv_diff": max(max_diff(list(g.values()), list(w.values()))
                    for g, w in zip(got_rows, want_rows)),
    "checkpoint_diff": max(max_diff(checkpoint("got", e), checkpoint("want", e))
                           for e in range(1, EPOCHS + 1)),
    "weight_diff": max_diff(model.get_weights(), reference.get_weights()),
    "moved": min(float(np.max(np.abs(a - b))) for a, b in zip(reference.get_weights(), initial)),
}
print("DAPPLE_RESULT " + json.dumps(report), flush=True)
