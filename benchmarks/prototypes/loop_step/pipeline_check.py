"""Task 3 correctness: the looped 1F1B pipeline's gradients against the plain model's tape.

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/prototypes/loop_step/pipeline_check.py
"""
import importlib.util
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("DAPPLE_NUM_CPU_DEVICES", "2")
if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
import dapple  # noqa: F401
import numpy as np
import tensorflow as tf

from dapple.devices import local_devices
from graph_rewrite.model_graph import cut_model, layer_order
from benchmarks.prototypes.loop_step.pipeline_loop import LoopPipeline, schedule_lists


def mlp(seed=0, width=256, depth=4):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((64,))
    h = x
    for i in range(depth):
        h = tf.keras.layers.Dense(width, activation="relu", name=f"d{i}")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(10, activation="softmax", name="out")(h))


def check(M, rows=4, use_loop=True, cut=3, peel=0):
    model, reference = mlp(), mlp()
    n = len(layer_order(model))
    plan, lists = schedule_lists(2, M, n, cut, rows)
    stages = cut_model(model, [tuple(s.layers) for s in plan.stages])
    pipe = LoopPipeline(stages, lists, local_devices(2), M, rows, use_loop=use_loop, peel=peel)
    rng = np.random.RandomState(M)
    x = tf.constant(rng.randn(rows * M, 64).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=rows * M).astype("int32"))
    loss, grads = pipe.gradients(x, y)
    with tf.GradientTape() as tape:
        ref_loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, reference(x, training=True)))
    ref = tape.gradient(ref_loss, reference.trainable_variables)
    diff = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(grads, ref))
    warm, body, t0, T, cool = pipe.plan_loop()
    ok = diff < 1e-5 and abs(float(loss) - float(ref_loss)) < 1e-5
    print(f"M={M} loop={use_loop} peel={peel}: iterations t in [{t0}, {T}), warm-up {warm}, body {body}, cool-down {cool}"
          f"\n    max|grad - plain tape grad| = {diff:.2e}, loss {float(loss):.6f} vs "
          f"{float(ref_loss):.6f}: {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    oks = [check(M, use_loop=u, peel=p) for M in (1, 2, 3, 4, 7, 9)
           for u, p in ((False, 0), (True, 0), (True, 1))]
    print("ALL PASS" if all(oks) else "SOME FAILED")


def check_resnet(M=4, rows=2):
    """ResNet-50 (BatchNormalization) cut in two: against the plain tape slice by slice."""
    from benchmarks.prototypes.loop_step.pipe_timing import middle_cut
    build = lambda: tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3),
                                                   classes=10)
    tf.keras.utils.set_random_seed(0)
    model = build()
    tf.keras.utils.set_random_seed(0)
    reference = build()
    cut, n = middle_cut(model)
    plan, lists = schedule_lists(2, M, n, cut, rows)
    stages = cut_model(model, [tuple(s.layers) for s in plan.stages])
    pipe = LoopPipeline(stages, lists, local_devices(2), M, rows)
    rng = np.random.RandomState(3)
    x = tf.constant(rng.rand(rows * M, 32, 32, 3).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=rows * M).astype("int32"))
    loss, grads = pipe.gradients(x, y)
    ref = [tf.zeros_like(v) for v in reference.trainable_variables]
    for lo in range(0, rows * M, rows):
        with tf.GradientTape() as tape:
            term = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(
                y[lo:lo + rows], reference(x[lo:lo + rows], training=True))) / (rows * M)
        ref = [a + g for a, g in zip(ref, tape.gradient(term, reference.trainable_variables))]
    by_id = {id(v): g for v, g in zip(pipe.variables, grads)}
    ours = [by_id[id(v)] for v in model.trainable_variables]
    diff = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(ours, ref))
    scale = max(float(tf.reduce_max(tf.abs(b))) for b in ref)
    ok = diff / scale < 1e-6
    print(f"ResNet50 cut at layer {cut}/{n}, M={M}: max|grad - plain tape grad| = {diff:.2e} "
          f"(largest {scale:.2e}, relative {diff / scale:.1e}): {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__" and os.environ.get("CHECK_RESNET"):
    print("RESNET PASS" if check_resnet() else "RESNET FAIL")
