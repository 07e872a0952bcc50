"""`sample_weight`, `class_weight` and `weighted_metrics` weigh the loss and metrics as in Keras:
the reference is plain Keras `fit`/`evaluate` on a second model with the same initial weights."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from dapple.pipelined_model import PipelinedModel
from planner.formats.plan import straight_plan
from tests.models import data_for, mlp_with_skip, two_in_two_out

BATCH, ROWS = 16, 64
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def pair(builder=mlp_with_skip, replicas=(2, 1), m=4, loss=LOSS, cuts=(2,), loop=False,
         **compile_args):
    plan = straight_plan(list(cuts), 5 if builder is mlp_with_skip else 6, m, BATCH,
                         replicas=list(replicas))
    plain = builder(seed=3)
    plain.compile(tf.keras.optimizers.SGD(0.1), loss, **compile_args)
    pm = PipelinedModel(builder(seed=3), plan, micro_batch_loop=loop, pipeline_loop=loop)
    pm.compile(tf.keras.optimizers.SGD(0.1), loss, **compile_args)
    return pm, plain


def assert_same(pm, plain, h1, h2, tol=1e-5, keys=None):
    for a, b in zip(pm.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    keys = keys or sorted(h2.history)
    assert sorted(h1.history) == keys
    for k in keys:
        np.testing.assert_allclose(h1.history[k], h2.history[k], rtol=tol, atol=tol, err_msg=k)


def weights_for(rows, seed=4):
    return np.random.RandomState(seed).uniform(0.0, 3.0, rows).astype("float32")


def test_fit_with_sample_weight_equals_plain_fit():
    pm, plain = pair(weighted_metrics=["accuracy"])
    x, y = data_for(plain, ROWS, seed=1)
    sw = weights_for(ROWS)
    h1 = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    h2 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    assert_same(pm, plain, h1, h2)
    unweighted = pair()[0]
    h3 = unweighted.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert abs(h3.history["loss"][-1] - h2.history["loss"][-1]) > 1e-3   # weights matter


def test_fit_with_class_weight_equals_plain_fit():
    pm, plain = pair(replicas=(1, 2), m=2, metrics=["accuracy"])
    x, y = data_for(plain, ROWS, seed=2)
    cw = {0: 0.5, 1: 2.0, 2: 1.0, 3: 0.1, 4: 3.0}
    h1 = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, class_weight=cw)
    h2 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, class_weight=cw)
    assert_same(pm, plain, h1, h2)


def test_class_and_sample_weights_multiply_and_tf_data_triples_work():
    pm, plain = pair()
    x, y = data_for(plain, ROWS, seed=5)
    sw = weights_for(ROWS, seed=6)
    cw = {0: 0.5, 1: 2.0, 2: 1.0, 3: 0.1, 4: 3.0}
    ds = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(BATCH, drop_remainder=True)
    h1 = pm.fit(ds, epochs=1, verbose=0, class_weight=cw)
    h2 = plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                   sample_weight=sw, class_weight=cw)
    assert_same(pm, plain, h1, h2)


def test_evaluate_with_sample_weight_and_weighted_metrics_equals_plain():
    pm, plain = pair(metrics=["accuracy"], weighted_metrics=["accuracy"])
    x, y = data_for(plain, ROWS, seed=7)
    sw = weights_for(ROWS, seed=8)
    got = pm.evaluate(x, y, batch_size=BATCH, sample_weight=sw, return_dict=True)
    want = plain.evaluate(x, y, batch_size=BATCH, sample_weight=sw, return_dict=True, verbose=0)
    assert sorted(got) == sorted(want)
    for k in want:
        assert abs(got[k] - want[k]) < 1e-5, k


def test_per_output_sample_weights_and_column_weights():
    """Two outputs, a list of per-output weights, one of them a column vector (Keras squeezes
    it)."""
    loss = [tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            tf.keras.losses.MeanSquaredError()]
    pm, plain = pair(two_in_two_out, replicas=(1, 2), m=2, loss=loss)
    x, y = data_for(plain, ROWS, seed=9)
    sw = [weights_for(ROWS, 1), weights_for(ROWS, 2)[:, None]]
    h1 = pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, sample_weight=sw)
    h2 = plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, sample_weight=sw)
    assert {"cls_loss", "reg_loss"} <= set(h2.history)
    assert_same(pm, plain, h1, h2)                  # per-output losses too


def test_class_weight_missing_a_class_is_refused_with_the_fix():
    pm, plain = pair()
    x, y = data_for(plain, ROWS, seed=1)
    with pytest.raises(ValueError, match="every class id"):
        pm.fit(x, y, batch_size=BATCH, verbose=0, class_weight={0: 1.0, 2: 1.0})
