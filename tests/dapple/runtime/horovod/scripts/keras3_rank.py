"""One rank of a pipelined Keras 3 job (#30): `tests.models.residual_bn_shared` built with
`import keras` (BatchNormalization, a residual across the cut, a layer called in both stages).
TensorFlow is imported before dapple, and the test runs the ranks without TF_USE_LEGACY_KERAS
(#30 item 2: no import-order rule, no variable). Each rank trains it 3 steps (SGD with momentum, a new global
batch each step) through `dapple.PipelinedModel`, which detects horovodrun, and the plain Keras
3 model right here: its gradients slice by slice (each slice normalizes with its own statistics,
as the pipeline's do), its moving statistics moved by a training forward of the whole batch,
and its own optimizer (`tests.models.ghost_batch_train_step`). After gathering every stage's
variables it prints one `DAPPLE_RESULT <json>` line with the largest differences; the test
asserts.
"""
import argparse
import json
import os

import tensorflow as tf   # before dapple, on purpose (#30)

import dapple
import keras
import numpy as np

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

parser = argparse.ArgumentParser()
parser.add_argument("--cuts", default="3")
parser.add_argument("--replicas", default="2,1")
parser.add_argument("--micro_batches", type=int, default=4)
parser.add_argument("--global_batch", type=int, default=24)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--checkpoint", default="")
args = parser.parse_args()

assert not keras.__version__.startswith(("1.", "2.")), keras.__version__
assert "TF_USE_LEGACY_KERAS" not in os.environ and tf.keras.Model is keras.Model
# Each rank's model starts from other weights: the runtime's broadcast makes them rank 0's.
model = models.residual_bn_shared(seed=3 + int(os.environ.get("HOROVOD_RANK", "0")),
                                  keras=keras)
reference = models.residual_bn_shared(seed=3, keras=keras)
cuts = [int(c) for c in args.cuts.split(",") if c]
replicas = [int(r) for r in args.replicas.split(",")]
plan = straight_plan(cuts, len(layer_order(model)), args.micro_batches, args.global_batch,
                     replicas=replicas, schedule="1f1b")
slice_rows = args.global_batch // (args.micro_batches * replicas[0])   # bn is in stage 0


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


pm = dapple.PipelinedModel(model, plan)
pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss())
optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
initial = [np.array(w) for w in reference.get_weights()]
loss_diff = 0.0
for step in range(args.steps):
    rng = np.random.RandomState(100 + step)
    x = (rng.randn(args.global_batch, 6) * 2.0 + 1.5).astype("float32")
    y = rng.randint(0, 5, size=args.global_batch).astype("int32")
    got_loss = pm.train_step(x, y)
    want_loss = models.ghost_batch_train_step(reference, loss(), optimizer, x, y, slice_rows)
    loss_diff = max(loss_diff, abs(float(got_loss) - want_loss))
    print(f"rank {pm.rank}: step {step} done", flush=True)

pm.gather_weights()
weight_diff = {v.path: float(np.max(np.abs(a - b)))
               for v, a, b in zip(model.weights, model.get_weights(), reference.get_weights())}
moved = {v.path: float(np.max(np.abs(b - a)))
         for v, a, b in zip(reference.weights, initial, reference.get_weights())}
checkpoint_diff = None
if args.checkpoint:
    pm.save_weights(args.checkpoint)
    fresh = models.residual_bn_shared(seed=11, keras=keras)      # other initial weights
    fresh.load_weights(args.checkpoint)
    checkpoint_diff = max(float(np.max(np.abs(a - b)))
                          for a, b in zip(fresh.get_weights(), reference.get_weights()))
print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank, "stage": pm.stage, "replica": pm.replica, "loss_diff": loss_diff,
    "weight_diff": weight_diff, "moved": moved, "checkpoint_diff": checkpoint_diff}), flush=True)
