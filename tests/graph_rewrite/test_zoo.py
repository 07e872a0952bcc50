"""A zoo of real Keras models, each profiled, planned by the planner for 2 local devices, and
trained through the pipeline; the references are plain Keras:

* `tf.keras.applications` families at 32x32 (BatchNormalization active): the gradients equal the
  plain model run slice by slice (each slice normalizes on its own, as in the pipeline), and
  after one step every moving mean and variance equals what Keras's own layer computes when
  called once on all the rows that reached it in that step.
* A transformer language model with tied input/output embeddings: gradients equal the plain
  model's on the whole batch (its horovodrun check: tests/dapple/runtime/horovod/test_training_semantics_horovod).
* A model with seeded Dropout: gradients equal the plain model run slice by slice with the same
  seeds (same masks); recomputation is refused for it, with the reason.

The application models are large for this machine; the slowest are marked `slow`.
"""
import dapple
import numpy as np
import pytest
import tensorflow as tf

from dapple.profiler import measure_profile
from graph_rewrite.batch_statistics import is_batch_normalization
from graph_rewrite.keras_adapter import keras_module_of
from planner.search.baselines import best_straight_plan
from tests.models import ghost_batch_loss_and_grads, tied_language_model, token_batch
from topology import local_topology

BATCH, MICRO_BATCHES = 8, 2
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
APPS = {
    "mobilenet": lambda: tf.keras.applications.MobileNet(
        input_shape=(32, 32, 3), alpha=0.25, dropout=0.0, weights=None, classes=4,
        classifier_activation=None),
    "mobilenet_v2": lambda: tf.keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=4, classifier_activation=None),
    "resnet50": lambda: tf.keras.applications.ResNet50(
        input_shape=(32, 32, 3), weights=None, classes=4, classifier_activation=None),
    "densenet121": lambda: tf.keras.applications.DenseNet121(
        input_shape=(32, 32, 3), weights=None, classes=4, classifier_activation=None),
    "efficientnet_b0": lambda: _with_head(tf.keras.applications.EfficientNetB0(
        input_shape=(32, 32, 3), weights=None, include_top=False, pooling="avg",
        drop_connect_rate=0.0)),     # without its unseeded Dropout: see the Dropout test
}
SLOW = {"densenet121"}


def _with_head(base):
    return tf.keras.Model(base.input, tf.keras.layers.Dense(4, name="head")(base.output),
                          name=base.name)


def build(name, seed=0):
    tf.keras.utils.set_random_seed(seed)
    return APPS[name]()


def planned(model, x, y):
    """Profile the model and let the planner choose the best 2-stage pipeline for it."""
    profile = measure_profile(model, x, warmup=0, runs=1)
    plan = best_straight_plan(profile, local_topology(2), BATCH, even_slices=True)
    plan.micro_batches, plan.global_batch_size = MICRO_BATCHES, BATCH
    plan.validate(num_layers=profile.num_layers)
    return plan


def relative_difference(got, want):
    dense = lambda t: np.asarray(tf.convert_to_tensor(t))
    scale = max(float(np.max(np.abs(dense(w)))) for w in want)
    return max(float(np.max(np.abs(dense(g) - dense(w)))) for g, w in zip(got, want)) / scale


def assert_gradients_and_statistics_as_slices(pm, x, y, want, nudged, whole, want_stats):
    """`pm`'s gradients on (x, y) equal the plain model's run slice by slice (`want`) within
    the reference's own noise (`nudged`: its gradients on x nudged by 1e-7), and differ from
    the whole batch's (`whole`) by more; every BN's moving statistics after that step equal
    `want_stats` (`expected_moving_statistics`), and some moved."""
    tolerance = max(1e-4, 4 * relative_difference(nudged, want))
    got = pm.gradients(x, y)         # one training step's statistics update (learning rate 0)
    assert relative_difference(got, want) < tolerance
    moved = 0.0
    for layer in pm.model.layers:
        if is_batch_normalization(layer):
            mean, variance = want_stats[layer.name]
            np.testing.assert_allclose(np.asarray(layer.moving_mean), mean, rtol=1e-4,
                                       atol=1e-5, err_msg=layer.name)
            np.testing.assert_allclose(np.asarray(layer.moving_variance), variance, rtol=1e-4,
                                       atol=1e-5, err_msg=layer.name)
            moved = max(moved, float(np.max(np.abs(mean))))
    assert moved > 1e-3
    assert relative_difference(whole, want) > tolerance      # slices matter: not vacuous


def expected_moving_statistics(reference, x, slice_rows):
    """Keras's own update (the model's Keras's): each BN layer (a fresh copy with the step's starting weights) called
    once, in training mode, on the rows that reached it in the pipeline: the plain model's
    inputs to it, computed slice by slice (earlier BNs normalize per slice, as in the pipeline)."""
    bns = [l for l in reference.layers if is_batch_normalization(l)]
    start = {l.name: l.get_weights() for l in bns}
    probe = keras_module_of(reference).Model(reference.inputs, [l.input for l in bns])
    pieces = [probe(x[lo:lo + slice_rows], training=True) for lo in range(0, len(x), slice_rows)]
    want = {}
    for i, layer in enumerate(bns):
        inputs = tf.concat([p[i] for p in pieces], axis=0)
        fresh = layer.__class__.from_config(layer.get_config())
        fresh.build(inputs.shape)
        fresh.set_weights(start[layer.name])
        fresh(inputs, training=True)
        want[layer.name] = (fresh.moving_mean.numpy(), fresh.moving_variance.numpy())
    return want


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in APPS])
def test_application_trains_through_the_pipeline_like_keras(name):
    model, reference = build(name), build(name)
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, 32, 32, 3).astype("float32")
    y = rng.randint(0, 4, BATCH).astype("int32")
    plan = planned(model, x, y)
    assert plan.num_stages == 2
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss=LOSS)
    slice_rows = BATCH // MICRO_BATCHES
    want_stats = expected_moving_statistics(reference, x, slice_rows)
    _, want = ghost_batch_loss_and_grads(reference, LOSS, x, y, slice_rows)
    # BN over a few rows of tiny feature maps amplifies rounding (EfficientNet: a 1e-7 change
    # of the input moves the gradients by 5e-4): the tolerance is the reference's own noise.
    _, nudged = ghost_batch_loss_and_grads(reference, LOSS, x * (1 + 1e-7), y, slice_rows)
    _, whole = ghost_batch_loss_and_grads(reference, LOSS, x, y, BATCH)
    assert_gradients_and_statistics_as_slices(pm, x, y, want, nudged, whole, want_stats)


def test_tied_language_model_is_planned_and_trains_like_keras():
    model, reference = tied_language_model(), tied_language_model()
    x, y = token_batch(BATCH, seed=3)
    plan = planned(model, x, y)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss=LOSS)
    reference.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss=LOSS)
    for step in range(3):
        x, y = token_batch(BATCH, seed=10 + step)
        got, want = float(pm.train_step(x, y)), float(reference.train_on_batch(x, y))
        assert abs(got - want) < 1e-5
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def dropout_mlp(seed=0):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,))
    h = tf.keras.layers.Dense(16, activation="relu", name="d1")(x)
    h = tf.keras.layers.Dropout(0.5, seed=11, name="drop1")(h)
    h = tf.keras.layers.Dense(16, activation="relu", name="d2")(h)
    h = tf.keras.layers.Dropout(0.3, seed=23, name="drop2")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("micro_batches,replicas", [(2, 1), (1, 2)])
def test_dropout_draws_new_masks_for_every_micro_batch_and_replica(micro_batches, replicas):
    # A stage's forward is traced once and called for every micro-batch and replica: its
    # random ops must still draw a new mask each call. Both halves of the batch hold the same
    # rows: shared masks would give them equal training-mode outputs.
    from planner.formats.plan import straight_plan
    model = dropout_mlp()
    pm = dapple.PipelinedModel(model, straight_plan([2], 5, micro_batches, 8,
                                                    replicas=[replicas, 1]))
    pm.compile("sgd", LOSS)
    half = np.random.RandomState(0).randn(4, 6).astype("float32")
    x = tf.constant(np.concatenate([half, half]))
    tf.keras.utils.set_random_seed(5)
    out = tf.function(lambda x: tf.concat(pm.pipeline_step.run(x, None).predictions[0], 0))(x)
    assert relative_difference([out[:4]], [out[4:]]) > 1e-2
    without = tf.concat([model(half, training=False)] * 2, 0)
    assert relative_difference([out], [without]) > 1e-2          # dropout did run


def test_recomputation_is_refused_for_a_model_that_draws_random_numbers():
    from planner.formats.plan import straight_plan
    plan = straight_plan([2], 5, 4, BATCH * 2)
    plan.recompute = True
    with pytest.raises(ValueError, match="drop1.*recompute"):
        dapple.PipelinedModel(dropout_mlp(), plan)
