"""Task 1: the fwd/bwd split equals the plain tape's gradients, with no recomputation.

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/prototypes/loop_step/check_split.py
"""
import importlib.util
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
import dapple  # noqa: F401
import numpy as np
import tensorflow as tf

from benchmarks.prototypes.loop_step.split import op_counts, split_stage


def mlp(seed=0):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input((16,))] + [
        tf.keras.layers.Dense(32, activation="relu") for _ in range(3)] + [
        tf.keras.layers.Dense(5)])


def conv_bn_dropout(seed=0):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((8, 8, 3))
    h = tf.keras.layers.Conv2D(8, 3, padding="same")(x)
    h = tf.keras.layers.BatchNormalization()(h)
    h = tf.keras.layers.ReLU()(h)
    h = tf.keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(h)
    h = tf.keras.layers.BatchNormalization()(h)
    h = tf.keras.layers.Activation("relu")(h)
    h = tf.keras.layers.MaxPooling2D()(h)
    h = tf.keras.layers.Flatten()(h)
    h = tf.keras.layers.Dropout(0.5, seed=7)(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(4)(h))


def embedding(seed=0):
    tf.keras.utils.set_random_seed(seed)
    ids = tf.keras.Input((6,), dtype="int32")
    h = tf.keras.layers.Embedding(20, 8)(ids)
    h = tf.keras.layers.Flatten()(h)
    h = tf.keras.layers.Dense(16, activation="tanh")(h)
    return tf.keras.Model(ids, tf.keras.layers.Dense(3)(h))


def moving(model):
    return [v.numpy().copy() for v in model.non_trainable_variables]


def check(name, build, x, dy_seed=1, differentiate_x=True):
    # Two identical models: the plain reference and the split (a Dropout's seed moves per trace,
    # so each is traced once, from the same seed: both draw the same first mask).
    model, twin = build(), build()
    model(x[:1], training=False)
    twin(x[:1], training=False)
    variables = model.trainable_variables
    before = moving(model)
    x_spec = tf.TensorSpec(x.shape, x.dtype)
    # Reference: plain tape in a fresh tf.function (same global/op seeds -> same first mask).
    tf.random.set_seed(123)
    rng = np.random.RandomState(dy_seed)

    @tf.function
    def plain(x, dy):
        with tf.GradientTape() as tape:
            if differentiate_x:
                tape.watch(x)
            y = model(x, training=True)
        src = ([x] if differentiate_x else []) + variables
        return y, tape.gradient(y, src, output_gradients=dy,
                                unconnected_gradients=tf.UnconnectedGradients.ZERO)

    y_shape = model.compute_output_shape(x.shape)
    dy = tf.constant(rng.randn(*y_shape).astype("float32"))
    ref_y, ref_g = plain(x, dy)
    ref_moving = moving(model)

    tf.random.set_seed(123)
    split = split_stage(lambda x: twin(x, training=True), x_spec, [], twin.trainable_variables,
                        differentiate_x=differentiate_x,
                        y_spec=tf.TensorSpec(y_shape, tf.float32))
    out = split.fwd(x)
    y, residuals = out[0][0], out[0][1:]
    grads = split.unpack(split.bwd(*residuals, dy))
    split_moving = moving(twin)
    dy_max = float(np.max(np.abs(y - ref_y)))
    g_max = max(float(np.max(np.abs(tf.convert_to_tensor(a) - tf.convert_to_tensor(b))))
                for a, b in zip(grads, ref_g))
    kinds = [type(g).__name__ for g in ref_g]
    m_max = max([float(np.max(np.abs(a - b))) for a, b in zip(split_moving, ref_moving)] or [0])
    moved = max([float(np.max(np.abs(a - b))) for a, b in zip(split_moving, before)] or [0])
    c_fused = op_counts(split.fused.graph, fetches=split.fused_fetches)   # its live ops
    c_fwd, c_bwd = op_counts(split.fwd.graph), op_counts(split.bwd.graph)
    c_sum = {k: c_fwd.get(k, 0) + c_bwd.get(k, 0) for k in set(c_fwd) | set(c_bwd)}
    random_in_bwd = [op.type for op in split.bwd.graph.get_operations() if "Random" in op.type]
    print(f"== {name}: residuals {len(residuals)} "
          f"({sum(int(np.prod(r.shape)) for r in residuals)} floats), grads {kinds}")
    print(f"   residuals: {split.residual_names}")
    print(f"   max|y - plain y| = {dy_max:.2e}; max|grad - plain tape grad| = {g_max:.2e}")
    print(f"   moving statistics: max|split - plain| = {m_max:.2e} (moved by {moved:.2e}); "
          f"update ops in fwd: {len(split.updates_in_fwd)}")
    print(f"   compute ops fused {sum(c_fused.values())} = fwd {sum(c_fwd.values())} + bwd "
          f"{sum(c_bwd.values())}: {'EQUAL' if c_sum == c_fused else ('DIFFER', c_sum, c_fused)}")
    print(f"   random ops in bwd: {random_in_bwd}; fwd graph ops {len(split.fwd.graph.get_operations())}"
          f", bwd {len(split.bwd.graph.get_operations())}, fused "
          f"{len(split.fused.graph.get_operations())}")
    ok = dy_max < 1e-5 and g_max < 1e-5 and m_max < 1e-5 and c_sum == c_fused and not random_in_bwd
    print(f"   {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    rng = np.random.RandomState(0)
    oks = [check("mlp", mlp, tf.constant(rng.randn(8, 16).astype("float32"))),
           check("conv+BN+Dropout", conv_bn_dropout,
                 tf.constant(rng.randn(4, 8, 8, 3).astype("float32"))),
           check("embedding", embedding,
                 tf.constant(rng.randint(0, 20, size=(5, 6)).astype("int32")),
                 differentiate_x=False)]
    print("ALL PASS" if all(oks) else "SOME FAILED")
