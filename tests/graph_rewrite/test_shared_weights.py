"""Weights shared across stages: a tied input embedding and output projection (two layers, one
variable) and a layer called on both sides of a cut. The reference is the plain Keras model's
gradients on the whole global batch."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import cut_model, layer_order, variable_holders
from planner.formats.plan import straight_plan
from tests.models import plain_loss_and_grads, tied_language_model, token_batch

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BATCH = 16


def max_diff(a, b):
    dense = lambda t: np.asarray(tf.convert_to_tensor(t))     # embedding grads are sparse
    return max(float(np.max(np.abs(dense(x) - dense(y)))) for x, y in zip(a, b))


@pytest.mark.parametrize("replicas,m", [([1, 1], 4), ([2, 1], 2), ([1, 2], 4)])
def test_tied_embedding_gradients_equal_plain_model(replicas, m):
    model, reference = tied_language_model(), tied_language_model()
    plan = straight_plan([5], len(layer_order(model)), m, BATCH, replicas=replicas)
    stages = cut_model(model, [tuple(s.layers) for s in plan.stages])
    embed = model.get_layer("embed").embeddings
    assert variable_holders(stages)[id(embed)] == [0, 1]      # the tie spans the cut
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer="sgd", loss=LOSS)
    x, y = token_batch(BATCH, seed=1)
    got = pm.gradients(x, y)
    _, want = plain_loss_and_grads(reference, LOSS, x, y)
    assert max_diff(got, want) < 1e-5


def shared_dense(seed=0):
    """One Dense layer called twice; its second call reads an output produced after the cut."""
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,))
    shared = tf.keras.layers.Dense(6, activation="tanh", name="shared",
                                   kernel_regularizer=tf.keras.regularizers.L2(0.1))
    h = shared(x)
    h = tf.keras.layers.Dense(6, activation="relu", name="middle")(h)
    h = shared(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("replicas", [[1, 1], [2, 1]])
def test_a_layer_called_in_two_stages_trains_like_keras(replicas):
    model, reference = shared_dense(), shared_dense()
    plan = straight_plan([1], len(layer_order(model)), 2, BATCH, replicas=replicas)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    reference.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    rng = np.random.RandomState(0)
    for _ in range(3):
        x, y = rng.randn(BATCH, 6).astype("float32"), rng.randint(0, 3, BATCH)
        got, want = float(pm.train_step(x, y)), float(reference.train_on_batch(x, y))
        assert abs(got - want) < 1e-5          # the regularizer counts once, as in Keras
    assert max_diff(model.get_weights(), reference.get_weights()) < 1e-5
