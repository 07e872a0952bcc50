"""Transparency: the pipelined step computes the plain model's gradients, and training with it
gives the plain model's weights. The reference is the plain Keras model on the whole global
batch (GradientTape + the same optimizer), never dapple's own code.

Shapes covered: straight 2 and 3 stages; replicas 2:1, 1:2, 2:2, 3:1; data parallel only
(1 stage on 4 devices); skip connections crossing cuts; M in {1, 2, 4, 8}; policies A, B and
GPipe; recomputation on and off; dict inputs entering late and two outputs.
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests.models import (assert_ran_as_loops, assert_trains_like_plain_model, data_for,
                          losses_for, mlp_with_skip, plain_loss_and_grads, small_conv,
                          two_in_two_out)

GLOBAL_BATCH = 48


def max_abs_diff(a_list, b_list):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(a_list, b_list))


CASES = [
    # (builder, cut positions (first layer of stages 1..), replicas, M, policy, recompute)
    (mlp_with_skip, [2], [1, 1], 1, "A", False),          # straight 2 stages, one micro-batch
    (mlp_with_skip, [2], [1, 1], 2, "A", False),
    (mlp_with_skip, [1], [1, 1], 4, "B", False),          # skip d1 -> add crosses the cut
    (mlp_with_skip, [1, 3], [1, 1, 1], 8, "A", False),    # straight 3 stages, skip relayed
    (mlp_with_skip, [1, 3], [1, 1, 1], 4, "gpipe", False),
    (mlp_with_skip, [2], [2, 1], 2, "A", False),          # 2:1 (concat)
    (mlp_with_skip, [3], [1, 2], 4, "B", False),          # 1:2 (split)
    (mlp_with_skip, [2], [2, 2], 2, "gpipe", True),       # 2:2 (nothing), recomputed
    (mlp_with_skip, [1], [3, 1], 2, "A", True),           # 3:1
    (mlp_with_skip, [], [4], 4, "A", False),              # data parallel only
    (mlp_with_skip, [2], [2, 3], 8, "A", False),          # 2:3 (split and concat)
    (two_in_two_out, [1, 4], [1, 2, 1], 4, "B", False),   # input b enters late, two outputs
    (small_conv, [2], [1, 1], 4, "A", True),
]


def case_id(case):
    builder, cuts, reps, m, policy, rc = case
    return f"{builder.__name__}-{':'.join(map(str, reps))}-cuts{cuts}-M{m}-{policy}" + ("-rc" if rc else "")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gradients_equal_plain_model(case):
    builder, cuts, reps, m, policy, recompute = case
    model, reference = builder(), builder()
    n_layers = len(dapple_layers(model))
    plan = straight_plan(cuts, n_layers, m, GLOBAL_BATCH, replicas=reps, schedule=policy)
    plan.recompute = recompute
    x, y = data_for(model, GLOBAL_BATCH, seed=7)
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer="sgd", loss=loss)
    got = pm.gradients(x, y)
    _, want = plain_loss_and_grads(reference, loss, x, y)
    assert len(got) == len(want)
    assert max_abs_diff(got, want) < 1e-5


def dapple_layers(model):
    from graph_rewrite.model_graph import layer_order
    return layer_order(model)


@pytest.mark.parametrize("case", [CASES[3], CASES[6], CASES[7], CASES[9], CASES[11]],
                         ids=[case_id(c) for c in [CASES[3], CASES[6], CASES[7], CASES[9], CASES[11]]])
def test_weights_after_three_steps_equal_plain_model(case):
    builder, cuts, reps, m, policy, recompute = case
    model, reference = builder(), builder()
    plan = straight_plan(cuts, len(dapple_layers(model)), m, GLOBAL_BATCH, replicas=reps,
                         schedule=policy)
    plan.recompute = recompute
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, plan)
    assert_trains_like_plain_model(pm, model, reference, loss,
                                   lambda: tf.keras.optimizers.Adam(1e-2), GLOBAL_BATCH)


def test_pipeline_differs_from_plain_model_when_data_differs():
    """Guards the comparison itself: a different batch must give different gradients."""
    model, reference = mlp_with_skip(), mlp_with_skip()
    plan = straight_plan([2], 5, 2, GLOBAL_BATCH)
    pm = dapple.PipelinedModel(model, plan)
    loss = losses_for(model)
    pm.compile(optimizer="sgd", loss=loss)
    x, y = data_for(model, GLOBAL_BATCH, seed=1)
    x2, y2 = data_for(model, GLOBAL_BATCH, seed=2)
    _, want = plain_loss_and_grads(reference, loss, x2, y2)
    assert max_abs_diff(pm.gradients(x, y), want) > 1e-3


def regularized_mlp(seed=0):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,))
    h = tf.keras.layers.Dense(12, activation="tanh", name="d1",
                              kernel_regularizer=tf.keras.regularizers.L2(0.05))(x)
    h = tf.keras.layers.Dense(12, activation="relu", name="d2")(h)
    out = tf.keras.layers.Dense(5, name="out", bias_regularizer=tf.keras.regularizers.L1(0.1),
                                kernel_regularizer=tf.keras.regularizers.L2(0.02))(h)
    return tf.keras.Model(x, out)


@pytest.mark.parametrize("cuts,reps,m,recompute,loop,schedule", [
    ([1], [2, 1], 4, False, False, "1f1b"),
    ([1], [1, 2], 2, True, False, "1f1b"),
    ([], [3], 4, False, True, "1f1b"),
    # zb-h1's split forward has no penalty: the step differentiates it apart, once
    ([1], [2, 1], 4, False, False, "zb-h1"),
    ([1], [1, 2], 2, True, False, "zb-h1")])
def test_weight_regularizers_count_once_per_step(cuts, reps, m, recompute, loop, schedule):
    model, reference = regularized_mlp(), regularized_mlp()
    plan = straight_plan(cuts, 3, m, GLOBAL_BATCH, replicas=reps, schedule=schedule)
    plan.recompute = recompute
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=loop)
    pm.compile(optimizer="sgd", loss=loss)
    x, y = data_for(model, GLOBAL_BATCH, seed=3)
    with tf.GradientTape() as tape:
        want_loss = loss(y, reference(x, training=True)) + tf.add_n(reference.losses)
    want = tape.gradient(want_loss, reference.trainable_variables)
    assert max_abs_diff(pm.gradients(x, y), want) < 1e-5
    assert abs(float(pm.train_step(x, y)) - float(want_loss)) < 1e-5
    assert_ran_as_loops(pm, loop)


def masked_lstm():
    """Embedding(mask_zero) -> LSTM -> Dense -> Dense: the mask lives from the embedding to the
    LSTM, which consumes it."""
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((7,), dtype="int32")
    h = tf.keras.layers.Embedding(20, 8, mask_zero=True, name="embedding")(x)
    h = tf.keras.layers.LSTM(6, name="lstm")(h)
    h = tf.keras.layers.Dense(6, activation="relu", name="hidden")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))


def padded_tokens(rows, seed):
    rng = np.random.RandomState(seed)
    x = rng.randint(1, 20, (rows, 7)).astype("int32")
    x[::2, 4:] = 0                          # every other row padded: the mask matters
    return x, rng.randint(0, 3, rows).astype("int32")


def test_a_mask_inside_a_stage_is_kept_and_one_crossing_a_cut_is_refused_by_name():
    model = masked_lstm()
    n = len(layer_order(model))
    with pytest.raises(ValueError, match="'embedding' carries a Keras mask"):
        dapple.PipelinedModel(model, straight_plan([1], n, 2, 8))      # after the embedding
    pm = dapple.PipelinedModel(model, straight_plan([2], n, 2, 8))     # after the LSTM
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pm.compile(tf.keras.optimizers.SGD(0.1), loss)
    x, y = padded_tokens(8, seed=1)
    with tf.GradientTape() as tape:       # the plain model, micro-batch by micro-batch
        want_loss = (loss(y[:4], model(x[:4], training=True))
                     + loss(y[4:], model(x[4:], training=True))) / 2
    want = [tf.convert_to_tensor(g)      # the embedding's: IndexedSlices
            for g in tape.gradient(want_loss, model.trainable_variables)]
    assert max_abs_diff([tf.convert_to_tensor(g) for g in pm.gradients(x, y)], want) < 1e-5
    unmasked = masked_lstm()
    unmasked.get_layer("embedding").supports_masking = False
    unmasked.get_layer("embedding").mask_zero = False
    with tf.GradientTape() as tape:       # not vacuous: without the mask the loss differs
        other = (loss(y[:4], unmasked(x[:4], training=True))
                 + loss(y[4:], unmasked(x[4:], training=True))) / 2
    assert abs(float(other) - float(want_loss)) > 1e-4


def test_activity_regularizers_are_refused_with_the_reason():
    x = tf.keras.Input((4,))
    out = tf.keras.layers.Dense(2, activity_regularizer="l2", name="act")(x)
    model = tf.keras.Model(x, out)
    with pytest.raises(ValueError, match="computed from activations"):
        dapple.PipelinedModel(model, straight_plan([], 1, 1, 8))
