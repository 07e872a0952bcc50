"""Keras 3 models on the other synchronous schedules (#30): zero-bubble ZB-H1 (each backward
split into I and W, graph_rewrite/split_backward.py) and interleaved 1F1B (a device group runs
several chunks). The Keras 2 twins are test_zero_bubble.py and test_interleaved.py; the
references here are Keras 3's own: a `tf.GradientTape` of the plain Keras 3 model (slice by
slice where BatchNormalization normalizes per slice) and its `train_on_batch`.
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from planner.search.chunking import interleaved_plan
from tests import models
from tests.keras3_models import keras, loss_fn, mlp_with_skip, residual_bn_shared, two_in_two_out


GLOBAL_BATCH = 24


def shared_twice(seed=0):
    """`shared` called twice in a row (both calls in one stage: two reads of its kernel)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    h = keras.layers.Dense(6, activation="relu", name="d1")(x)
    h = shared(shared(h))
    return keras.Model(x, keras.layers.Dense(5, name="out")(h), name="k3_shared_twice")


def sequential_conv(seed=0):
    """A built Sequential with Conv2D (W is Conv2DBackpropFilter) and an Embedding-free MLP."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4, 4, 2)),
                             keras.layers.Conv2D(3, 3, padding="same", activation="relu",
                                                 name="c1"),
                             keras.layers.Conv2D(3, 1, activation="tanh", name="c2"),
                             keras.layers.Flatten(name="flat"),
                             keras.layers.Dense(5, name="out")], name="k3_sequential_conv")


def zb(cuts, replicas, m, recompute=False):
    def plan(model):
        p = straight_plan(cuts, len(layer_order(model)), m, GLOBAL_BATCH, replicas=replicas,
                          schedule="zb-h1")
        p.recompute = recompute
        return p
    return plan


def interleaved(first_layers, replicas, m, virtual_stages=2):
    def plan(model):
        return interleaved_plan(first_layers, len(layer_order(model)), m, virtual_stages,
                                GLOBAL_BATCH, replicas)
    return plan


def losses_for(model):
    return loss_fn() if len(model.outputs) == 1 else [loss_fn(), keras.losses.MeanSquaredError()]


def data_for(model, seed):
    """Float inputs with an offset and scale (BatchNormalization's statistics move visibly),
    labels per output (class ids for several units, reals for one)."""
    rng = np.random.RandomState(seed)

    def values(t):
        return (rng.randn(GLOBAL_BATCH, *t.shape[1:]) * 2.0 + 1.5).astype("float32")
    inputs = model.inputs[0] if len(model.inputs) == 1 else model.input
    x = {k: values(t) for k, t in inputs.items()} if isinstance(inputs, dict) else values(inputs)
    ys = [rng.randint(0, out.shape[-1], size=GLOBAL_BATCH).astype("int32")
          if out.shape[-1] > 1 else rng.randn(GLOBAL_BATCH, 1).astype("float32")
          for out in model.outputs]
    return x, (ys[0] if len(ys) == 1 else ys)


CASES = [
    # (name, builder, plan, rows a BatchNormalization normalizes at once, or None)
    ("zb-h1 2:1 skip crosses", mlp_with_skip, zb([1], [2, 1], 4), None),
    ("zb-h1 1:1 M=1", mlp_with_skip, zb([2], [1, 1], 1), None),
    ("zb-h1 three stages", mlp_with_skip, zb([1, 3], [1, 1, 1], 4), None),
    ("zb-h1 recomputed", mlp_with_skip, zb([2], [1, 1], 4, recompute=True), None),
    ("zb-h1 dict in two out 1:2:1", two_in_two_out, zb([1, 4], [1, 2, 1], 4), None),
    ("zb-h1 a layer called twice in a stage", shared_twice, zb([1], [1, 2], 4), None),
    ("zb-h1 sequential conv 1:2", sequential_conv, zb([1], [1, 2], 4), None),
    ("zb-h1 bn and a shared layer 2:1", residual_bn_shared, zb([3], [2, 1], 4),
     GLOBAL_BATCH // 8),
    ("interleaved skip relayed", mlp_with_skip, interleaved([1, 2, 3], [1, 1], 4), None),
    ("interleaved 2:1 then 1:2", mlp_with_skip, interleaved([1, 2, 3], [2, 1], 2), None),
    ("interleaved data parallel", mlp_with_skip, interleaved([2], [3], 4), None),
    ("interleaved dict in, 3 groups", two_in_two_out, interleaved([1, 2, 3, 4, 5], [1, 1, 1], 3),
     None),
    ("interleaved bn and a shared layer", residual_bn_shared, interleaved([1, 3, 4], [1, 1], 4),
     GLOBAL_BATCH // 4),
]


def reference_gradients(builder, loss, x, y, slice_rows):
    reference = builder()
    if slice_rows is not None:          # per-slice normalization, as in Keras 2's twins
        return models.ghost_batch_loss_and_grads(reference, loss, x, y, slice_rows)[1]
    with tf.GradientTape() as tape:
        preds = reference(x, training=True)
        preds = preds if isinstance(preds, (list, tuple)) else [preds]
        losses = loss if isinstance(loss, list) else [loss]
        ys = y if isinstance(y, list) else [y]
        total = tf.add_n([f(t, p) for f, t, p in zip(losses, ys, preds)])
    return tape.gradient(total, reference.trainable_variables)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradients_equal_plain_keras3_model(case):
    _, builder, make_plan, slice_rows = case
    model = builder()
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, make_plan(model))
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    x, y = data_for(model, seed=7)
    got = pm.gradients(x, y)
    want = reference_gradients(builder, loss, x, y, slice_rows)
    assert len(got) == len(want) == len(model.trainable_variables)
    for g, w, v in zip(got, want, model.trainable_variables):
        if not v.path.endswith("d1/bias"):                 # d1 feeds a BN: its gradient is 0
            assert float(np.max(np.abs(np.asarray(w)))) > 0, v.path    # the test can fail
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                   err_msg=v.path)


TRAIN_CASES = [
    # M = 1 on one device per stage: the plain model's whole-batch normalization, so the
    # moving statistics and every weight follow `train_on_batch` exactly.
    ("zb-h1", residual_bn_shared, zb([3], [1, 1], 1)),
    ("zb-h1 dict in two out", two_in_two_out, zb([1, 4], [1, 2, 1], 4)),
    ("interleaved", residual_bn_shared, interleaved([1, 3, 4], [1, 1], 1)),
    ("interleaved 2:1", mlp_with_skip, interleaved([1, 2, 3], [2, 1], 2)),
]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] + "-" + c[1].__name__
                                                     for c in TRAIN_CASES])
def test_weights_after_three_steps_equal_train_on_batch(case):
    _, builder, make_plan = case
    model, reference = builder(), builder()
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, make_plan(model))
    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss,
                      jit_compile=False)
    before = [np.array(w) for w in model.get_weights()]
    for step in range(3):
        x, y = data_for(model, seed=100 + step)          # different data every step
        got_loss = pm.train_step(x, y)
        want_loss = reference.train_on_batch(x, y)
        want_loss = want_loss[0] if isinstance(want_loss, list) else want_loss
        assert abs(float(got_loss) - float(want_loss)) < 1e-5, f"step {step + 1}"
    for got, want, start, v in zip(model.get_weights(), reference.get_weights(), before,
                                   model.weights):
        if not v.path.endswith("d1/bias"):                 # d1 feeds a BN: its gradient is 0
            assert np.max(np.abs(want - start)) > 1e-3, v.path      # every other weight moved
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=v.path)
