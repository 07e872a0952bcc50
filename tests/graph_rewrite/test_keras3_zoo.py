"""Keras 3's zoo (`import keras`), as tests/graph_rewrite/test_zoo.py is tf_keras's: each model
profiled (`dapple.profile`), planned by the planner for 2 local devices, pipelined and checked
against the plain Keras 3 model:

* `keras.applications` MobileNetV2, ResNet50 and EfficientNetB0 at 32x32 (weights=None,
  BatchNormalization active; EfficientNetB0's per-sample Dropout too, the same masks): gradients equal the plain model run slice by slice (each slice
  normalizes on its own, as in the pipeline), and after one step every moving mean and
  variance equals what Keras 3's own layer computes when called once on all the rows that
  reached it;
* a transformer block (MultiHeadAttention, seeded Dropout, LayerNormalization, a residual
  across the cut): gradients equal the plain model run slice by slice from the same seed
  states (Keras 3's Dropout draws from its SeedGenerator, advanced once per call: the same
  masks), and 3 training steps of SGD with momentum equal that reference's.

ResNet50 and EfficientNetB0 are large for this machine: marked `slow`.
"""
import dapple
import numpy as np
import pytest
import tensorflow as tf

from dapple.profiler import measure_profile
from planner.search.baselines import best_straight_plan
from tests.graph_rewrite.test_zoo import (assert_gradients_and_statistics_as_slices,
                                          expected_moving_statistics, relative_difference)
from tests.models import ghost_batch_loss_and_grads
from topology import local_topology

keras = pytest.importorskip("keras")
if keras.__version__.startswith(("1.", "2.")):
    pytest.skip("`import keras` is not Keras 3 here", allow_module_level=True)

BATCH, MICRO_BATCHES = 8, 2
APPS = {
    "mobilenet_v2": lambda: keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=4,
        classifier_activation=None),
    "resnet50": lambda: keras.applications.ResNet50(
        input_shape=(32, 32, 3), weights=None, classes=4, classifier_activation=None),
    # Keras 3's B0 takes no drop_connect_rate: its blocks' Dropout (0.2, per sample) stays,
    # seeded alike in both builds; without its top (another Dropout)
    "efficientnet_b0": lambda: _with_head(keras.applications.EfficientNetB0(
        input_shape=(32, 32, 3), weights=None, include_top=False, pooling="avg")),
}
SLOW = {"resnet50", "efficientnet_b0"}


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _with_head(base):
    return keras.Model(base.input, keras.layers.Dense(4, name="head")(base.output),
                       name=base.name)


def build(name, seed=0):
    keras.utils.set_random_seed(seed)
    return APPS[name]()


def planned(model, x):
    """Profile the model and let the planner choose the best 2-stage pipeline for it."""
    profile = measure_profile(model, x, warmup=0, runs=1)
    plan = best_straight_plan(profile, local_topology(2), BATCH, even_slices=True)
    plan.micro_batches, plan.global_batch_size = MICRO_BATCHES, BATCH
    plan.validate(num_layers=profile.num_layers)
    assert plan.num_stages == 2
    return plan


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in APPS])
def test_keras3_application_trains_through_the_pipeline_like_keras3(name):
    model, reference = build(name), build(name)
    assert type(model).__module__.startswith("keras.")
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, 32, 32, 3).astype("float32")
    y = rng.randint(0, 4, BATCH).astype("int32")
    pm = dapple.PipelinedModel(model, planned(model, x))
    pm.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss_fn())
    slice_rows = BATCH // MICRO_BATCHES
    # Each reference run restores the non-trainable variables (the Dropout seed states too),
    # so every one draws the masks the pipeline draws; the statistics' probe, which does not,
    # comes last.
    _, want = ghost_batch_loss_and_grads(reference, loss_fn(), x, y, slice_rows)
    # BN over a few rows of tiny feature maps amplifies rounding: the tolerance is the
    # reference's own noise (as in test_zoo.py).
    _, nudged = ghost_batch_loss_and_grads(reference, loss_fn(), x * (1 + 1e-7), y, slice_rows)
    _, whole = ghost_batch_loss_and_grads(reference, loss_fn(), x, y, BATCH)
    want_stats = expected_moving_statistics(reference, x, slice_rows)
    assert_gradients_and_statistics_as_slices(pm, x, y, want, nudged, whole, want_stats)


TOKENS, WIDTH, CLASSES = 6, 16, 5


def transformer_block(seed=0):
    """Embedding projection -> MultiHeadAttention -> Dropout -> residual + LayerNormalization
    -> feed-forward -> Dropout -> residual + LayerNormalization -> pooled classifier."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((TOKENS, 8), name="x")
    h = keras.layers.Dense(WIDTH, name="embed")(x)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="attention")(h, h)
    a = keras.layers.Dropout(0.2, seed=11, name="drop1")(a)
    h = keras.layers.LayerNormalization(name="norm1")(keras.layers.Add(name="add1")([h, a]))
    f = keras.layers.Dense(2 * WIDTH, activation="relu", name="ff1")(h)
    f = keras.layers.Dense(WIDTH, name="ff2")(f)
    f = keras.layers.Dropout(0.2, seed=23, name="drop2")(f)
    h = keras.layers.LayerNormalization(name="norm2")(keras.layers.Add(name="add2")([h, f]))
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(CLASSES, name="out")(h), name="transformer_block")


def token_data(seed):
    rng = np.random.RandomState(seed)
    return (rng.randn(BATCH, TOKENS, 8).astype("float32"),
            rng.randint(0, CLASSES, BATCH).astype("int32"))


def test_keras3_transformer_block_is_planned_and_trains_like_keras3():
    model, reference = transformer_block(), transformer_block()
    x, y = token_data(seed=3)
    plan = planned(model, x)
    pm = dapple.PipelinedModel(model, plan)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn())
    slice_rows = BATCH // MICRO_BATCHES
    start = [np.array(w) for w in model.get_weights()]
    for step in range(3):
        x, y = token_data(seed=10 + step)
        got = float(pm.train_step(x, y))
        # ghost_batch_loss_and_grads restores the seed states: advance them as the step does
        seeds = [np.array(g.state) for g in _seed_generators(reference)]
        want, grads = ghost_batch_loss_and_grads(reference, loss_fn(), x, y, slice_rows)
        for g, s in zip(_seed_generators(reference), seeds):
            g.state.assign(s + np.array([0, MICRO_BATCHES], s.dtype))
        optimizer.apply_gradients(zip(grads, reference.trainable_variables))
        assert abs(got - want) < 1e-5, step
        for g_pm, g_ref in zip(_seed_generators(model), _seed_generators(reference)):
            np.testing.assert_array_equal(np.asarray(g_pm.state), np.asarray(g_ref.state))
    for v, want, before in zip(model.weights, reference.get_weights(), start):
        got = np.asarray(v)
        if not v.path.endswith("key/bias"):      # softmax ignores it: its gradient is 0
            assert np.max(np.abs(want - before)) > 1e-4, v.path
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=v.path)
    # not vacuous: the masks differ from the whole batch's
    _, whole = ghost_batch_loss_and_grads(reference, loss_fn(), x, y, BATCH)
    _, sliced = ghost_batch_loss_and_grads(reference, loss_fn(), x, y, slice_rows)
    assert relative_difference(whole, sliced) > 1e-3


def _seed_generators(model):
    return [layer.seed_generator for layer in model.layers
            if getattr(layer, "seed_generator", None) is not None]
