"""One fresh process of tests/dapple/test_keras2.py (#30 item 2: no import-order rule).

TensorFlow is imported BEFORE dapple, always. The Keras is the user's choice:

- `keras3`: no TF_USE_LEGACY_KERAS (the test strips it): `import keras`. #30's model
  (`tests.models.residual_bn_shared`: BatchNormalization, a residual across the cut, a layer
  called in both stages) on a 2:1 plan over 3 devices at M=4. Prints the largest difference of
  its gradients from plain Keras 3's (a `tf.GradientTape` run slice by slice: each slice
  normalizes with its own statistics, as the pipeline's do; `tests.models.
  ghost_batch_loss_and_grads`), and of the moving statistics after one step (learning rate 0)
  from plain Keras 3's `train_on_batch`.
- `tf_keras_env` (the test sets TF_USE_LEGACY_KERAS=1: `tf.keras` is tf_keras) and
  `tf_keras_import` (no variable: `tf.keras` is Keras 3, the model is `import tf_keras`'s): the
  same model built with tf_keras, 3 steps of SGD with momentum against plain tf_keras
  (`tests.models.ghost_batch_train_step`), and `fit` of `mlp_with_skip` for 2 epochs with a
  tf_keras callback against the plain model's `fit`.
- `mixed`: a tf_keras model compiled with a Keras 3 optimizer; prints the error.

Prints one `DAPPLE_RESULT <json>` line; the test asserts.
"""
import json
import os
import sys

import tensorflow as tf   # first, on purpose

import dapple
import numpy as np

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

MODE = sys.argv[1]
BATCH, M = 24, 4


def keras_name(module):
    root = module.Model.__module__.split(".")[0]
    return f"{root} {sys.modules[root].__version__}"


def plan_for(model, cuts, replicas, micro_batches=M):
    return straight_plan(cuts, len(layer_order(model)), micro_batches, BATCH,
                         replicas=replicas, schedule="1f1b")


def data(model, seed):
    rng = np.random.RandomState(seed)
    return ((rng.randn(BATCH, *model.input.shape[1:]) * 2.0 + 1.5).astype("float32"),
            rng.randint(0, 5, size=BATCH).astype("int32"))


def largest(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


result = {"env": os.environ.get("TF_USE_LEGACY_KERAS", "unset"), "tf.keras": keras_name(tf.keras)}

if MODE == "keras3":
    import keras
    result["keras"] = keras_name(keras)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = models.residual_bn_shared(keras=keras)
    pm = dapple.PipelinedModel(model, plan_for(model, [3], [2, 1]))
    pm.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
    x, y = data(model, seed=3)
    got = pm.gradients(x, y)
    reference = models.residual_bn_shared(keras=keras)
    _, want = models.ghost_batch_loss_and_grads(reference, loss, x, y, BATCH // (M * 2))
    result["grad_diff"] = largest(got, want)
    result["grad_largest"] = {v.path: float(np.max(np.abs(np.asarray(w))))
                              for v, w in zip(model.trainable_variables, want)}
    result["grads"] = [len(got), len(want), len(model.trainable_variables)]
    # The moving statistics after one step, from fresh models (learning rate 0: the weights a
    # step trains differ by design, per-slice normalization, and so would the statistics).
    model, reference = (models.residual_bn_shared(keras=keras),
                        models.residual_bn_shared(keras=keras))
    pm = dapple.PipelinedModel(model, plan_for(model, [3], [2, 1]))
    pm.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
    reference.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss, jit_compile=False)
    start = [v.numpy() for v in model.non_trainable_variables]
    pm.train_step(x, y)
    reference.train_on_batch(x, y)
    result["moving_paths"] = [v.path for v in model.non_trainable_variables]
    result["moving_diff"] = largest([v.numpy() for v in model.non_trainable_variables],
                                    [v.numpy() for v in reference.non_trainable_variables])
    result["moving_moved"] = largest([v.numpy() for v in reference.non_trainable_variables],
                                     start)
elif MODE in ("tf_keras_env", "tf_keras_import"):
    if MODE == "tf_keras_env":
        api = tf.keras
    else:
        import tf_keras as api
    result["model_keras"] = keras_name(api)
    loss = api.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = models.residual_bn_shared(seed=3, keras=api)
    reference = models.residual_bn_shared(seed=3, keras=api)
    pm = dapple.PipelinedModel(model, plan_for(model, [3], [2, 1]))
    pm.compile(optimizer=api.optimizers.SGD(0.1, momentum=0.9), loss=loss)
    optimizer = api.optimizers.SGD(0.1, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = data(model, seed=40 + step)
        got_loss = float(pm.train_step(x, y))
        want_loss = models.ghost_batch_train_step(reference, loss, optimizer, x, y,
                                                  BATCH // (M * 2))
        losses.append(abs(got_loss - want_loss))
    result["loss_diff"] = max(losses)
    result["weight_diff"] = largest(model.get_weights(), reference.get_weights())
    result["weights_moved"] = largest(model.get_weights(),
                                      models.residual_bn_shared(seed=3, keras=api).get_weights())

    # fit with a callback of the model's Keras, against the plain model's fit
    seen = []

    class Epochs(api.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(epoch)

    model, reference = models.mlp_with_skip(keras=api), models.mlp_with_skip(keras=api)
    pm = dapple.PipelinedModel(model, plan_for(model, [2], [1, 1], micro_batches=2))
    pm.compile(optimizer=api.optimizers.SGD(0.1), loss=loss)
    reference.compile(optimizer=api.optimizers.SGD(0.1), loss=loss)
    rng = np.random.RandomState(5)
    x = rng.randn(2 * BATCH, 6).astype("float32")
    y = rng.randint(0, 5, size=2 * BATCH).astype("int32")
    got = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                 callbacks=[Epochs()]).history
    want = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    result["fit_keys"] = [sorted(got), sorted(want)]
    result["fit_loss_diff"] = largest(got["loss"], want["loss"])
    result["fit_weight_diff"] = largest(model.get_weights(), reference.get_weights())
    result["callback_epochs"] = seen
elif MODE == "mixed":
    import keras
    import tf_keras
    model = models.mlp_with_skip(keras=tf_keras)
    pm = dapple.PipelinedModel(model, plan_for(model, [2], [1, 1]))
    try:
        pm.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        result["error"] = None
    except TypeError as e:
        result["error"] = str(e)
    result["versions"] = [keras_name(tf_keras), keras_name(keras)]

print("DAPPLE_RESULT " + json.dumps(result))
