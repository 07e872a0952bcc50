"""One rank of a multi-process job checking Keras training semantics against the plain model,
which every rank computes itself (same seed, same data). Prints `DAPPLE_RESULT <json>`.

--case=batchnorm  Dense-input and Conv2D BatchNormalization, 2:1 plan, M = 4, learning rate 0,
                  2 steps (--steps): moving statistics against plain `train_on_batch`;
                  with --pipeline_loop, its steady periods as a loop (`schedule_loops` counts
                  the traces that built one).
--case=tied       tied input/output embedding across a 2-stage cut, 3 SGD steps: weights
                  against 3 plain steps, and this rank's copy of the embedding.
--case=clip       `global_clipnorm=0.1`, 2:1 plan, 3 SGD steps: weights against plain steps.
--case=mixed      mixed_float16, 2:1 plan, M = 4, 12 steps with an overflow in step 5:
                  loss scale and weights against plain `train_on_batch`.
--case=keras3_mixed  the same with Keras 3 (`import keras`): its LossScaleOptimizer around an
                  SGD with `global_clipnorm=0.1` (clipped after unscaling, over the whole model).
--case=noweights  a last stage without trainable variables (a softmax), Adam, 3 steps: weights
                  and the optimizer's iteration count on every rank against plain steps.
"""
import argparse
import json

import dapple
import numpy as np
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True)
parser.add_argument("--steps", type=int, default=2, help="--case=batchnorm: steps")
parser.add_argument("--pipeline_loop", action="store_true", help="--case=batchnorm: loop")
args = parser.parse_args()
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def pipelined(model, cuts, replicas, m, batch, optimizer, pipeline_loop=False):
    plan = straight_plan(cuts, len(layer_order(model)), m, batch, replicas=replicas)
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=pipeline_loop)
    pm.compile(optimizer=optimizer, loss=LOSS)
    return pm


report = {}
if args.case == "batchnorm":
    for builder, cut in ((models.dense_batchnorm, 2), (models.conv_batchnorm, 3)):
        model, reference = builder(), builder()
        pm = pipelined(model, [cut], [2, 1], 4, 16, tf.keras.optimizers.SGD(0.0),
                       args.pipeline_loop)
        reference.compile(tf.keras.optimizers.SGD(0.0), LOSS)
        rng = np.random.RandomState(0)
        for _ in range(args.steps):
            x = (rng.randn(16, *model.input.shape[1:]) * 2.0 + 1.5).astype("float32")
            y = rng.randint(0, 3, 16).astype("int32")
            pm.train_step(x, y)
            reference.train_on_batch(x, y)
        pm.gather_weights()
        initial = builder()
        report[builder.__name__] = diff(model.non_trainable_variables,
                                        reference.non_trainable_variables)
        report[builder.__name__ + "_moved"] = diff(initial.non_trainable_variables,
                                                   reference.non_trainable_variables)
        report[builder.__name__ + "_schedule_loops"] = pm.pipeline_step.schedule_loops
elif args.case == "tied":
    model, reference = models.tied_language_model(), models.tied_language_model()
    pm = pipelined(model, [5], [1, 1], 4, 16, tf.keras.optimizers.SGD(0.5))
    ref_opt = tf.keras.optimizers.SGD(0.5)
    for step in range(3):
        x, y = models.token_batch(16, seed=step)
        pm.train_step(x, y)
        _, grads = models.plain_loss_and_grads(reference, LOSS, x, y)
        ref_opt.apply_gradients(zip(grads, reference.trainable_variables))
    own = model.get_layer("embed").embeddings.numpy()      # before gathering: this rank's copy
    want = reference.get_layer("embed").embeddings.numpy()
    report["own_embedding_diff"] = float(np.max(np.abs(own - want)))
    report["embedding_moved"] = float(np.max(np.abs(
        models.tied_language_model().get_layer("embed").embeddings.numpy() - want)))
    pm.gather_weights()
    report["weight_diff"] = diff(model.get_weights(), reference.get_weights())
elif args.case == "clip":
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    pm = pipelined(model, [2], [2, 1], 2, 24, tf.keras.optimizers.SGD(0.5, global_clipnorm=0.1))
    reference.compile(tf.keras.optimizers.SGD(0.5, global_clipnorm=0.1), LOSS)
    for step in range(3):
        x, y = models.data_for(model, 24, seed=100 + step)
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
    pm.gather_weights()
    report["weight_diff"] = diff(model.get_weights(), reference.get_weights())
    # the same run clipped per stage would differ by more than this
    report["clip_changed_weights"] = diff(models.mlp_with_skip(seed=3).get_weights(),
                                          reference.get_weights())
elif args.case == "mixed":
    tf.keras.mixed_precision.set_global_policy("mixed_float16")

    def lso():
        return tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.05),
                                                           dynamic_growth_steps=3)
    model, reference = models.float32_logits_mlp(), models.float32_logits_mlp()
    pm = pipelined(model, [2], [2, 1], 4, 16, lso())
    reference.compile(lso(), LOSS)
    rng = np.random.RandomState(0)
    scales = []
    for step in range(12):
        x = rng.randn(16, 6).astype("float32")
        if step == 5:
            x[3] = 1e6
        y = rng.randint(0, 4, 16).astype("int32")
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
        scales.append([float(pm.optimizer.loss_scale), float(reference.optimizer.loss_scale)])
    pm.gather_weights()
    report["scales"] = scales
    # np.allclose(rtol=1e-3, atol=1e-3) holds when this is at most 1
    report["weight_closeness"] = max(float(np.max(np.abs(a - b) / (1e-3 + 1e-3 * np.abs(b))))
                                     for a, b in zip(model.get_weights(), reference.get_weights()))
elif args.case == "keras3_mixed":
    import keras
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    k3_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def k3_lso():
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.5, global_clipnorm=0.1), dynamic_growth_steps=3)
    model = models.float32_logits_mlp(keras=keras)
    reference = models.float32_logits_mlp(keras=keras)
    pm = dapple.PipelinedModel(model, straight_plan([2], 4, 4, 16, replicas=[2, 1]))
    pm.compile(optimizer=k3_lso(), loss=k3_loss)
    reference.compile(k3_lso(), k3_loss, jit_compile=False)
    rng = np.random.RandomState(0)
    scales = []
    for step in range(12):
        x = rng.randn(16, 6).astype("float32")
        if step == 5:
            x[3] = 1e6          # one slice, on replica 0's rank only
        y = rng.randint(0, 4, 16).astype("int32")
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
        scales.append([float(pm.optimizer.dynamic_scale),
                       float(reference.optimizer.dynamic_scale)])
    pm.gather_weights()
    report["scales"] = scales
    report["weight_closeness"] = max(float(np.max(np.abs(a - b) / (1e-3 + 1e-3 * np.abs(b))))
                                     for a, b in zip(model.get_weights(), reference.get_weights()))
    # the same run clipped per rank's share would differ by more than fp16's tolerance
    report["moved"] = diff(models.float32_logits_mlp(keras=keras).get_weights(),
                           reference.get_weights())
elif args.case == "noweights":
    def softmax_last(seed=0):
        tf.keras.utils.set_random_seed(seed)
        x = tf.keras.Input((6,))
        h = tf.keras.layers.Dense(8, activation="tanh", name="d1")(x)
        h = tf.keras.layers.Dense(3, name="d2")(h)
        return tf.keras.Model(x, tf.keras.layers.Softmax(name="probabilities")(h))
    model, reference = softmax_last(), softmax_last()
    plan = straight_plan([2], 3, 2, 16)
    pm = dapple.PipelinedModel(model, plan)
    probabilities = tf.keras.losses.SparseCategoricalCrossentropy()
    pm.compile(optimizer=tf.keras.optimizers.Adam(1e-2), loss=probabilities)
    reference.compile(optimizer=tf.keras.optimizers.Adam(1e-2), loss=probabilities)
    rng = np.random.RandomState(0)
    for _ in range(3):
        x, y = rng.randn(16, 6).astype("float32"), rng.randint(0, 3, 16)
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
    report["iterations"] = int(pm.optimizer.iterations)
    pm.gather_weights()
    report["weight_diff"] = diff(model.get_weights(), reference.get_weights())
else:
    raise SystemExit(f"unknown case {args.case}")

report["rank"] = pm.rank      # under horovodrun, this rank's; the chief under a TF cluster
print("DAPPLE_RESULT " + json.dumps(report), flush=True)
