"""A Keras 3 job on the TensorFlow-cluster runtime (#30): run once, as the chief, by `dapple
launch --runtime=tensorflow` over 2 tasks; `PipelinedModel(model, plan)` finds the cluster. Two
models on a 1:1 plan (stage 1 on task 1), each trained 3 steps of SGD with momentum (a new
global batch each step) beside the plain Keras 3 model in this process:

- `mlp_with_skip` (the skip crosses the cut): stage 1's weights are working copies on task 1,
  trained there (the model's variables stay as they were until gathered); the reference is
  the plain model's `train_on_batch`;
- `residual_bn_shared` (BatchNormalization, a layer called in both stages: its stages keep the
  model's variables, copies refreshed every step); the reference is plain Keras 3 slice by
  slice (`tests.models.ghost_batch_train_step`: each slice normalizes with its own statistics).

Prints one `DAPPLE_RESULT <json>` line with the largest differences; the test asserts.
"""
import json
import os

import tensorflow as tf   # before dapple, as a user may

import dapple
import keras
import numpy as np

from graph_rewrite.keras_adapter import tf_variables
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

assert not keras.__version__.startswith(("1.", "2.")), keras.__version__
assert "TF_USE_LEGACY_KERAS" not in os.environ and tf.keras.Model is keras.Model
GLOBAL_BATCH, M, STEPS = 24, 4, 3


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def momentum():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def batch(step):
    rng = np.random.RandomState(100 + step)
    return ((rng.randn(GLOBAL_BATCH, 6) * 2.0 + 1.5).astype("float32"),
            rng.randint(0, 5, size=GLOBAL_BATCH).astype("int32"))


def max_diff(a_list, b_list):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(a_list, b_list))


def pipelined(model, cut):
    plan = straight_plan([cut], len(layer_order(model)), M, GLOBAL_BATCH, schedule="1f1b")
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=momentum(), loss=loss())
    return pm


report = {"runtime": None}

# mlp_with_skip: stage 1's weights live and train on task 1
model, reference = models.mlp_with_skip(3, keras=keras), models.mlp_with_skip(3, keras=keras)
reference.compile(optimizer=momentum(), loss=loss(), jit_compile=False)
pm = pipelined(model, 2)
report["runtime"] = type(pm.runtime).__name__
stage1 = pm.pipeline_step.stages[1].trainable_variables
stage1_before = [v.numpy() for v in stage1]
initial = [np.array(w) for w in model.get_weights()]
loss_diff = 0.0
for step in range(STEPS):
    x, y = batch(step)
    loss_diff = max(loss_diff, abs(float(pm.train_step(x, y)) - float(reference.train_on_batch(x, y))))
copies = pm.pipeline_step.functions[1].copies
report["mlp"] = {
    "home": copies.home,
    "home_copies": len(copies.home_copies()),
    "stage1_variables": len(stage1),
    # trained on task 1, not read back yet
    "stage1_unchanged_before_gather": max_diff([v.numpy() for v in stage1], stage1_before),
    "slots_on_task1": sum("/task:1/" in s.device
                          for s in tf_variables(pm.optimizer.variables)),
    "loss_diff": loss_diff,
}
pm.gather_weights()
report["mlp"]["weight_diff"] = max_diff(model.get_weights(), reference.get_weights())
report["mlp"]["moved"] = min(float(np.max(np.abs(a - b)))
                             for a, b in zip(reference.get_weights(), initial))

# residual_bn_shared: BatchNormalization and a layer called in both stages
model = models.residual_bn_shared(3, keras=keras)
reference = models.residual_bn_shared(3, keras=keras)
optimizer = momentum()
pm = pipelined(model, 3)
initial = [np.array(w) for w in model.get_weights()]
loss_diff = 0.0
for step in range(STEPS):
    x, y = batch(step)
    got = float(pm.train_step(x, y))
    want = models.ghost_batch_train_step(reference, loss(), optimizer, x, y, GLOBAL_BATCH // M)
    loss_diff = max(loss_diff, abs(got - want))
pm.gather_weights()
report["bn"] = {
    "loss_diff": loss_diff,
    "weight_diff": max_diff(model.get_weights(), reference.get_weights()),
    "moving_moved": min(float(np.max(np.abs(v.numpy() - a)))
                        for v, a in zip(model.weights, initial) if not v.trainable),
}
print("DAPPLE_RESULT " + json.dumps(report), flush=True)
