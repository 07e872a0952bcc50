"""Keras 3 weight regularizers (`kernel_regularizer`, `bias_regularizer`: Keras 3 computes the
penalty from `variable.regularizer`) count once per step, as in Keras 3, also for a layer
called in two stages. References: a `tf.GradientTape` of the plain Keras 3 model's loss plus
`model.losses`, and plain Keras 3's `train_on_batch` (the Keras 2 twin is
tests/graph_rewrite/test_transparency.py `test_weight_regularizers_count_once_per_step`).
Losses computed from activations stay refused by name."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan

keras = pytest.importorskip("keras")
if keras.__version__.startswith(("1.", "2.")):
    pytest.skip("`import keras` is not Keras 3 here", allow_module_level=True)

BATCH = 16


def regularized(seed=0):
    """d1 (L2 kernel) -> shared (L2 kernel, L1 bias) -> d2 -> shared again -> out (L2)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    shared = keras.layers.Dense(8, activation="tanh", name="shared",
                                kernel_regularizer=keras.regularizers.L2(0.05),
                                bias_regularizer=keras.regularizers.L1(0.1),
                                bias_initializer="ones")
    h = keras.layers.Dense(8, activation="relu", name="d1",
                           kernel_regularizer=keras.regularizers.L2(0.02))(x)
    h = keras.layers.Dense(8, activation="tanh", name="d2")(shared(h))
    out = keras.layers.Dense(5, name="out",
                             kernel_regularizer=keras.regularizers.L1L2(0.01, 0.03))(shared(h))
    return keras.Model(x, out, name="k3_regularized")


def data(seed):
    rng = np.random.RandomState(seed)
    return (rng.randn(BATCH, 6).astype("float32"),
            rng.randint(0, 5, size=BATCH).astype("int32"))


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def plan_for(model, cuts, replicas, loop=False):
    return straight_plan(cuts, len(layer_order(model)), 4, BATCH, replicas=replicas)


PLANS = [([2], [1, 1], False),      # the shared layer's calls in both stages
         ([1], [2, 1], False),      # 2:1: the penalties once, not per replica
         ([], [2], True)]           # data parallel, lanes as loops


@pytest.mark.parametrize("cuts,replicas,loop", PLANS)
def test_gradients_include_each_weight_penalty_once(cuts, replicas, loop):
    model, reference = regularized(), regularized()
    pm = dapple.PipelinedModel(model, plan_for(model, cuts, replicas), micro_batch_loop=loop)
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    x, y = data(seed=5)
    got = pm.gradients(x, y)
    with tf.GradientTape() as tape:
        total = loss_fn()(y, reference(x, training=True)) + tf.add_n(reference.losses)
    want = tape.gradient(total, reference.trainable_variables)
    assert len(reference.losses) == 4
    for g, w, v in zip(got, want, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=v.path)
    # the test can fail: without the penalties the gradients differ
    with tf.GradientTape() as tape:
        plain = loss_fn()(y, reference(x, training=True))
    without = tape.gradient(plain, reference.trainable_variables)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(without, want)) > 1e-3


@pytest.mark.parametrize("cuts,replicas,loop", PLANS[:2])
def test_weights_and_losses_after_three_steps_equal_train_on_batch(cuts, replicas, loop):
    model, reference = regularized(), regularized()
    pm = dapple.PipelinedModel(model, plan_for(model, cuts, replicas), micro_batch_loop=loop)
    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn())
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn(),
                      jit_compile=False)
    for step in range(3):
        x, y = data(seed=50 + step)
        got, want = float(pm.train_step(x, y)), float(reference.train_on_batch(x, y))
        assert abs(got - want) < 1e-5, step      # the loss includes the penalties, as Keras's
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_activity_regularizers_and_add_loss_are_refused_by_name():
    x = keras.Input((4,))
    h = keras.layers.Dense(4, name="d", activity_regularizer=keras.regularizers.L2(0.1))(x)
    model = keras.Model(x, keras.layers.Dense(2, name="out")(h), name="k3_activity")
    with pytest.raises(ValueError, match=r"layer 'd' \(Dense\): activity_regularizer"):
        dapple.PipelinedModel(model, straight_plan([1], 2, 2, 8))

    class AddsLoss(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(keras.ops.sum(inputs))
            return inputs
    x = keras.Input((4,))
    h = AddsLoss(name="adds")(keras.layers.Dense(4, name="d")(x))
    model = keras.Model(x, keras.layers.Dense(2, name="out")(h), name="k3_add_loss")
    pm = dapple.PipelinedModel(model, straight_plan([1], 3, 2, 8))
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    x, y = np.ones((8, 4), "float32"), np.zeros(8, "int32")
    # Keras 3 lists no such loss in `model.losses`: the stage's call names it
    with pytest.raises(ValueError, match=r"layer 'adds' \(AddsLoss\) adds a loss in its call"):
        pm.train_step(x, y)
