"""Keras 3 models on the TensorFlow-cluster runtime (#30): working copies of a stage's weights
found through the adapter (Keras 3's Dense keeps its kernel in `_kernel`; a `keras.Variable`
wraps a `tf.Variable`), each stage's weights kept and trained on its own device. References
are plain Keras 3's: `train_on_batch` with the same optimizer, or a `tf.GradientTape` step
slice by slice where BatchNormalization normalizes per slice; never dapple's code.

First on logical CPU devices of this process (`StageWeightsRuntime`, the cluster runtime's
weights on any devices), then on 2 processes under `dapple launch --runtime=tensorflow`
(`scripts/keras3_cluster.py`)."""
import json

import dapple  # noqa: F401  (logical devices first)
import numpy as np
import pytest
import tensorflow as tf

from dapple.runtime.tf_cluster.stage_weights import StageWeightsRuntime
from graph_rewrite.keras_adapter import tf_variables
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

keras = pytest.importorskip("keras")
if keras.__version__.startswith(("1.", "2.")):
    pytest.skip("`import keras` is not Keras 3 here", allow_module_level=True)

BATCH = 24


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def momentum():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def data(seed):
    rng = np.random.RandomState(seed)
    return ((rng.randn(BATCH, 6) * 2.0 + 1.5).astype("float32"),
            rng.randint(0, 5, size=BATCH).astype("int32"))


def mlp_with_skip(seed=3):
    return models.mlp_with_skip(seed, keras=keras)


def dense_bn(seed=3):
    """Dense -> BatchNormalization -> Dense -> Dense, no layer shared: its BN stage's weights
    (gamma and beta among them) are copies on the stage's device."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    h = keras.layers.BatchNormalization(momentum=0.8, name="bn")(
        keras.layers.Dense(8, name="d1")(x))
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    return keras.Model(x, keras.layers.Dense(5, name="out")(h), name="k3_dense_bn")


def pipelined(model, cuts, replicas, schedule, micro_batches):
    plan = straight_plan(cuts, len(layer_order(model)), micro_batches, BATCH,
                         replicas=replicas, schedule=schedule)
    pm = dapple.PipelinedModel(model, plan)
    pm.runtime = StageWeightsRuntime(plan)
    pm.compile(optimizer=momentum(), loss=loss_fn())
    return pm


@pytest.mark.parametrize("builder, cuts, replicas, schedule, micro_batches", [
    (mlp_with_skip, [2], [1, 1], "1f1b", 4),
    (mlp_with_skip, [2], [1, 2], "gpipe", 2),      # stage 1's second replica trains its own
    (mlp_with_skip, [1], [2, 1], "1f1b", 2),       # 2:1
    (mlp_with_skip, [2], [1, 1], "zb-h1", 4),      # split backward, read from the copies
    (dense_bn, [1], [1, 1], "1f1b", 1),            # BN's gamma and beta on stage 1's device
], ids=["2-stage", "1:2", "2:1", "zb-h1", "batchnorm"])
def test_each_stage_trains_on_its_device_like_plain_keras3(builder, cuts, replicas, schedule,
                                                            micro_batches):
    model, reference = builder(), builder()
    reference.compile(optimizer=momentum(), loss=loss_fn(), jit_compile=False)
    pm = pipelined(model, cuts, replicas, schedule, micro_batches)
    step = pm.pipeline_step
    copies = step.functions[1].copies
    stage1_device = step.device(1, 0)
    assert copies.home == stage1_device                   # the copies are stage 1's weights
    stage1 = step.stages[1].trainable_variables
    before = [v.numpy() for v in stage1]
    initial = [np.array(w) for w in model.get_weights()]
    for s in range(3):
        x, y = data(seed=s)
        assert abs(float(pm.train_step(x, y)) - float(reference.train_on_batch(x, y))) < 1e-5
    for v, old in zip(stage1, before):                    # trained elsewhere: not read back yet
        np.testing.assert_array_equal(v.numpy(), old, err_msg=v.path)
    index = tf.DeviceSpec.from_string(stage1_device).device_index
    slots = [s for s in tf_variables(pm.optimizer.variables)
             if tf.DeviceSpec.from_string(s.device).device_index == index]
    assert len(slots) >= len(stage1)                      # momentum beside stage 1's weights
    pm.gather_weights()
    for got, want, start, v in zip(model.get_weights(), reference.get_weights(), initial,
                                   model.weights):
        if not v.path.endswith("d1/bias"):                # d1 feeds a BN: its gradient is 0
            assert np.max(np.abs(want - start)) > 1e-3, v.path
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=v.path)


def test_changes_to_the_keras3_model_between_calls_reach_the_stages():
    model = mlp_with_skip()
    pm = pipelined(model, [2], [1, 1], "1f1b", 4)
    pm.train_step(*data(seed=1))
    pm.gather_weights()
    other = mlp_with_skip(seed=7)
    model.set_weights(other.get_weights())               # the user's code, between calls
    x, _ = data(seed=2)
    np.testing.assert_allclose(pm.predict(x), other.predict(x, verbose=0), rtol=1e-5,
                               atol=1e-6)


def stage_copies(model):
    """Working copies of the last two layers' weights, as a stage would make them."""
    from graph_rewrite.working_copies import WorkingCopies
    layers = [model.get_layer("d3"), model.get_layer("out")]
    return WorkingCopies(layers, [v for layer in layers for v in layer.trainable_variables],
                         penalized=False)


def test_a_mixed_precision_layer_reads_the_variables_themselves():
    """A `keras.Variable` is read in its layer's compute dtype; a plain tf.Variable copy would
    not be, so such a stage keeps reading the model's variables."""
    assert stage_copies(mlp_with_skip()).possible
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = mlp_with_skip()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert not stage_copies(model).possible


@pytest.mark.horovod
def test_keras3_on_two_server_processes_trains_like_plain_keras3(tmp_path):
    """`dapple launch --runtime=tensorflow` over 2 tasks, 1:1 (stage 1 on task 1), without
    TF_USE_LEGACY_KERAS: 3 steps of SGD with momentum equal plain Keras 3's within 1e-5."""
    from tfrun import plan_file, tf_launch
    result = tf_launch(plan_file(tmp_path, 2), ["keras3_cluster.py"],
                       env={"TF_USE_LEGACY_KERAS": None}, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    assert rep["runtime"] == "TFClusterRuntime", rep
    mlp, bn = rep["mlp"], rep["bn"]
    assert "/task:1/" in mlp["home"] and mlp["home_copies"] == mlp["stage1_variables"] == 4, rep
    assert mlp["stage1_unchanged_before_gather"] == 0.0, rep   # trained on task 1's copies
    assert mlp["slots_on_task1"] == 4, rep                      # momentum beside them
    assert mlp["moved"] > 1e-3 and bn["moving_moved"] > 1e-2, rep
    for case in (mlp, bn):
        assert case["loss_diff"] < 1e-5 and case["weight_diff"] < 1e-5, rep


@pytest.mark.horovod
def test_keras3_fit_on_two_server_processes_equals_plain_keras3_fit(tmp_path):
    """Keras 3's own `fit` under `dapple launch --runtime=tensorflow` over 2 tasks, 1:1 (stage 1
    on task 1): 2 epochs with validation data, CSVLogger and ModelCheckpoint: History, the CSV,
    each epoch's checkpoint (read by the plain model) and the weights equal plain Keras 3's
    `fit` within 1e-5 (`scripts/keras3_cluster_fit.py`)."""
    from tfrun import plan_file, tf_launch
    result = tf_launch(plan_file(tmp_path, 2), ["keras3_cluster_fit.py", str(tmp_path / "files")],
                       env={"TF_USE_LEGACY_KERAS": None}, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    assert rep["runtime"] == "TFClusterRuntime" and "/task:1/" in rep["home"], rep
    assert rep["history_keys"] and rep["csv_columns"] and rep["csv_rows"] == 2, rep
    assert rep["moved"] > 1e-3, rep
    for key in ("history_diff", "csv_diff", "checkpoint_diff", "weight_diff"):
        assert rep[key] < 1e-5, (key, rep)
