"""PipelinedModel behaves like the plain Keras model: fit (History, callbacks, progress bar,
tf.data), evaluate, predict, gradients, checkpoints, and clear errors on bad input.

Every reference is plain Keras on a second model built with the same seed (same initial
weights), never dapple's own code.
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from dapple.devices import DeviceError
from dapple.checks import PlanMismatchError
from dapple.pipelined_model import PipelinedModel
from graph_rewrite.model_graph import layer_order, model_signature
from planner.formats.plan import straight_plan
from planner.formats.slicing import BatchSplitError
from tests.models import data_for, losses_for, mlp_with_skip, small_conv, two_in_two_out
from tests.paths import REPO as ROOT

BATCH = 16
ROWS = 64
SCE = "sparse_categorical_crossentropy"


def sgd():
    return tf.keras.optimizers.SGD(0.1)


def compiled_pair(builder, plan, metrics=("accuracy",), loss=None):
    """(pipelined, plain) models with identical initial weights, compiled alike."""
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = builder(seed=3)
    plain.compile(sgd(), loss, metrics=list(metrics))
    pm = PipelinedModel(builder(seed=3), plan)
    pm.compile(sgd(), loss, metrics=list(metrics))
    return pm, plain


def assert_same_weights(a, b, tol=1e-6):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def assert_same_history(h1, h2, tol=1e-5):
    assert sorted(h1.history) == sorted(h2.history)
    assert h1.epoch == h2.epoch
    for key in h2.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], rtol=tol, atol=tol,
                                   err_msg=key)


# ---- fit ---------------------------------------------------------------------------------------

def test_fit_history_matches_plain_fit_single_stage():
    x, y = data_for(mlp_with_skip(), ROWS, seed=1)
    pm, plain = compiled_pair(mlp_with_skip, straight_plan([], 5, 1, BATCH))
    h_pm = pm.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    h_plain = plain.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    assert sorted(h_pm.history) == ["accuracy", "loss"]
    assert_same_history(h_pm, h_plain)
    assert h_pm.params["steps"] == ROWS // BATCH and h_pm.params["epochs"] == 3
    assert_same_weights(pm.model, plain)


def test_fit_history_matches_plain_fit_pipelined_with_validation():
    x, y = data_for(mlp_with_skip(), ROWS, seed=1)
    xv, yv = data_for(mlp_with_skip(), 2 * BATCH, seed=2)
    pm, plain = compiled_pair(mlp_with_skip, straight_plan([1, 3], 5, 4, BATCH))
    h_pm = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  validation_data=(xv, yv))
    h_plain = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(xv, yv), validation_batch_size=BATCH)
    assert sorted(h_pm.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert_same_history(h_pm, h_plain)
    assert_same_weights(pm.model, plain)


def test_fit_on_tf_data_equals_fit_on_numpy_two_outputs():
    x, y = data_for(two_in_two_out(), ROWS, seed=4)
    plan = straight_plan([2, 4], 6, 2, BATCH, replicas=[2, 1, 1])
    pm, plain = compiled_pair(two_in_two_out, plan, metrics=(), loss=losses_for(two_in_two_out()))
    ds = tf.data.Dataset.from_tensor_slices((x, tuple(y))).batch(BATCH, drop_remainder=True)
    h_pm = pm.fit(ds, epochs=2, verbose=0)
    h_plain = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert h_pm.history.keys() == h_plain.history.keys() >= {"loss", "cls_loss", "reg_loss"}
    for key in h_plain.history:
        np.testing.assert_allclose(h_pm.history[key], h_plain.history[key], rtol=1e-5,
                                   err_msg=key)
    assert_same_weights(pm.model, plain)


def test_fit_calls_callbacks_and_honours_stop_training():
    class Recorder(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.events = []

        def on_epoch_begin(self, epoch, logs=None):
            self.events.append(("epoch_begin", epoch))

        def on_train_batch_end(self, batch, logs=None):
            self.events.append(("batch_end", batch, sorted(logs)))
            if batch == 1 and self.model is not None:
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            self.events.append(("epoch_end", epoch))

    x, y = data_for(mlp_with_skip(), ROWS, seed=1)
    pm, _ = compiled_pair(mlp_with_skip, straight_plan([2], 5, 2, BATCH))
    rec = Recorder()
    history = pm.fit(x, y, epochs=5, verbose=0, callbacks=[rec])
    assert rec.events == [("epoch_begin", 0), ("batch_end", 0, ["accuracy", "loss"]),
                          ("batch_end", 1, ["accuracy", "loss"]), ("epoch_end", 0)]
    assert history.epoch == [0]


def test_fit_prints_keras_progress_bar_with_epoch_means(capsys):
    x, y = data_for(mlp_with_skip(), ROWS, seed=1)
    pm, _ = compiled_pair(mlp_with_skip, straight_plan([2], 5, 2, BATCH))
    history = pm.fit(x, y, epochs=2, verbose=1, shuffle=False)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out
    # The bar's final loss of each epoch must be the epoch mean in History (a progress bar that
    # averaged our running means again would print another number).
    epochs = out.split("Epoch ")[1:]
    for text, loss in zip(epochs, history.history["loss"]):
        final = text.rsplit("loss: ", 1)[1][:6]
        assert final == f"{loss:.4f}"


def test_fit_rejects_a_batch_size_other_than_the_plans():
    x, y = data_for(mlp_with_skip(), ROWS, seed=1)
    pm, _ = compiled_pair(mlp_with_skip, straight_plan([2], 5, 2, BATCH))
    with pytest.raises(ValueError, match="batch size 32 differs from the plan's global_batch_size 16"):
        pm.fit(x, y, batch_size=32, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices((x[:40], y[:40])).batch(BATCH)
    with pytest.raises(ValueError, match="drop_remainder=True"):
        pm.fit(ds, verbose=0)


# ---- evaluate / predict / gradients -------------------------------------------------------------

def test_evaluate_matches_plain_evaluate():
    x, y = data_for(small_conv(), 3 * BATCH, seed=5)
    pm, plain = compiled_pair(small_conv, straight_plan([2], 5, 4, BATCH, replicas=[1, 2]))
    got = pm.evaluate(x, y)
    want = plain.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert pm.evaluate(x, y, return_dict=True).keys() == {"loss", "accuracy"}
    with pytest.raises(ValueError, match="not a multiple of the plan's global batch 16"):
        pm.evaluate(x[:40], y[:40])


def test_predict_equals_model_predict_for_every_row_even_uncompiled():
    model = small_conv(seed=7)
    x, _ = data_for(model, 40, seed=6)           # 40 rows: two full batches and a partial one
    pm = PipelinedModel(model, straight_plan([1, 3], 5, 2, BATCH, replicas=[2, 1, 2]))
    got = pm.predict(x)
    assert got.shape == (40, 3)
    np.testing.assert_allclose(got, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_predict_two_outputs_dict_inputs():
    model = two_in_two_out(seed=2)
    x, _ = data_for(model, 2 * BATCH, seed=3)
    pm = PipelinedModel(model, straight_plan([3], 6, 4, BATCH))
    got = pm.predict(x)
    want = model.predict(x, verbose=0)
    assert len(got) == 2
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_gradients_align_with_trainable_variables():
    model = two_in_two_out(seed=1)
    loss = losses_for(model)
    x, y = data_for(model, BATCH, seed=2)
    pm = PipelinedModel(model, straight_plan([1, 4], 6, 2, BATCH, replicas=[1, 2, 1]))
    pm.compile(sgd(), loss)
    grads = pm.gradients(x, y)
    with tf.GradientTape() as tape:
        preds = model(x, training=True)
        total = loss[0](y[0], preds[0]) + loss[1](y[1], preds[1])
    want = tape.gradient(total, model.trainable_variables)
    assert len(grads) == len(model.trainable_variables)
    for g, w, v in zip(grads, want, model.trainable_variables):
        assert g.shape == v.shape, v.name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=v.name)


# ---- checkpoints --------------------------------------------------------------------------------

@pytest.mark.parametrize("filename", ["ckpt.h5", "ckpt"])
def test_checkpoint_from_two_stages_loads_into_plain_model_and_three_stages(tmp_path, filename):
    x, y = data_for(mlp_with_skip(), ROWS, seed=1)
    pm, _ = compiled_pair(mlp_with_skip, straight_plan([2], 5, 2, BATCH))
    pm.fit(x, y, epochs=1, verbose=0)
    path = str(tmp_path / filename)
    pm.save_weights(path)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".dapple-ckpt-")]

    plain = mlp_with_skip(seed=9)                 # other initial weights
    plain.load_weights(path)
    assert_same_weights(plain, pm.model, tol=0)

    other = PipelinedModel(mlp_with_skip(seed=11), straight_plan([1, 3], 5, 4, BATCH))
    other.load_weights(path)
    assert_same_weights(other.model, pm.model, tol=0)
    np.testing.assert_allclose(other.predict(x), pm.predict(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("filename", ["ckpt.h5", "ckpt"])
def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, filename, monkeypatch):
    pm, _ = compiled_pair(mlp_with_skip, straight_plan([2], 5, 2, BATCH))
    path = str(tmp_path / filename)
    pm.save_weights(path)
    saved = [w.copy() for w in pm.model.get_weights()]
    files_before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}

    x, y = data_for(mlp_with_skip(), ROWS, seed=1)
    pm.fit(x, y, epochs=1, verbose=0)              # weights change

    def crash_midway(self, filepath, *args, **kwargs):
        with open(filepath + (".index" if not filepath.endswith(".h5") else ""), "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(tf.keras.Model, "save_weights", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        pm.save_weights(path)
    monkeypatch.undo()

    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == files_before
    plain = mlp_with_skip(seed=9)
    plain.load_weights(path)
    for a, b in zip(plain.get_weights(), saved):
        np.testing.assert_array_equal(a, b)


# ---- bad input ----------------------------------------------------------------------------------

def test_plan_for_a_model_with_another_layer_count_is_refused():
    with pytest.raises(PlanMismatchError, match="covers 6 layers but model 'mlp_with_skip' has 5"):
        PipelinedModel(mlp_with_skip(), straight_plan([3], 6, 2, BATCH))


def test_plan_with_a_schedule_the_runtime_does_not_run_is_refused():
    plan = straight_plan([2], 5, 2, BATCH)
    plan.schedule = "dualpipe"          # a name this dapple does not know
    with pytest.raises(ValueError, match="schedule 'dualpipe'"):
        PipelinedModel(mlp_with_skip(), plan)


def test_plan_with_other_layer_names_is_refused():
    plan = straight_plan([2], 5, 2, BATCH)
    plan.stages[1].layer_names = ["add", "d3", "logits"]
    with pytest.raises(PlanMismatchError, match="layer 4 is 'logits' in the plan but 'out'"):
        PipelinedModel(mlp_with_skip(), plan)


def test_plan_from_another_models_profile_is_refused():
    model = mlp_with_skip()
    plan = straight_plan([2], 5, 2, BATCH)
    plan.profile = {"name": "x", "model_signature": model_signature(small_conv())}
    with pytest.raises(PlanMismatchError, match="measured on another model"):
        PipelinedModel(model, plan)
    plan.profile = {"name": "x", "model_signature": model_signature(model)}
    PipelinedModel(model, plan)                      # the right signature is accepted


def test_plan_needing_more_devices_than_exist_is_refused():
    plan = straight_plan([], 5, 1, 9 * 2, replicas=[9])
    with pytest.raises(DeviceError, match="needs 9 devices .* DAPPLE_NUM_CPU_DEVICES=9"):
        PipelinedModel(mlp_with_skip(), plan)


def test_an_unknown_runtime_is_refused():
    with pytest.raises(ValueError, match="runtime must be one of"):
        PipelinedModel(mlp_with_skip(), straight_plan([2], 5, 2, BATCH), runtime="mpi")


def test_one_process_running_every_unit_is_rank_0_of_no_single_stage():
    pm = PipelinedModel(mlp_with_skip(), straight_plan([2], 5, 2, BATCH), runtime="local")
    assert (pm.rank, pm.stage, pm.replica) == (0, None, None)
    pm.gather_weights()              # one copy of every variable: nothing to gather


def test_global_batch_not_divisible_by_micro_batches_times_replicas():
    plan = straight_plan([2], 5, 3, None, replicas=[2, 1])
    pm = PipelinedModel(mlp_with_skip(), plan)
    pm.compile(sgd(), losses_for(mlp_with_skip()))
    x, y = data_for(mlp_with_skip(), BATCH, seed=1)
    with pytest.raises(BatchSplitError, match="global batch 16 does not divide into 3"):
        pm.gradients(x, y)


def test_model_with_add_loss_is_refused():
    tf.keras.utils.set_random_seed(0)
    i = tf.keras.Input((4,))
    h = tf.keras.layers.Dense(4, name="d")(i)
    o = tf.keras.layers.Dense(2, name="o")(h)
    model = tf.keras.Model(i, o)
    model.add_loss(tf.reduce_mean(h))      # depends on activations: not supported
    n = len(layer_order(model))
    with pytest.raises(ValueError, match="computed from activations"):
        PipelinedModel(model, straight_plan([1], n, 1, 4))


def run_python(script, **env):
    """`python -c script` in a fresh process at the repository's root, with 8 CPU devices."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, DAPPLE_NUM_CPU_DEVICES="8", **env), cwd=ROOT,
                          timeout=300)


def test_tensorflow_initialized_before_dapple_gives_a_clear_error():
    script = (
        "import tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"                # initializes TensorFlow: one CPU device
        "import dapple\n"
        "from planner.formats.plan import straight_plan\n"
        "i = tf.keras.Input((3,)); o = tf.keras.layers.Dense(2)(tf.keras.layers.Dense(3)(i))\n"
        "dapple.PipelinedModel(tf.keras.Model(i, o), straight_plan([1], 2, 1, 4))\n")
    proc = run_python(script, TF_CPP_MIN_LOG_LEVEL="3")
    assert proc.returncode != 0
    assert "DeviceError" in proc.stderr
    assert "needs 2 devices" in proc.stderr
    assert "import dapple` before anything initializes TensorFlow" in proc.stderr


# ---- dapple verify ------------------------------------------------------------------------------


def batchnorm_model():
    """BatchNormalization normalizes each micro-batch slice on its own in a pipeline."""
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((6,))
    h = tf.keras.layers.Dense(8, name="d1")(x)
    h = tf.keras.layers.BatchNormalization(name="bn")(h)
    h = tf.keras.layers.Dense(4, name="d2")(h)
    h = tf.keras.layers.BatchNormalization(name="bn2")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(2, name="out")(h), name="batchnorm_model")


def run_verify(plan, builder, tmp_path, *extra):
    path = str(tmp_path / "plan.json")
    plan.save(path)
    return subprocess.run([sys.executable, "-m", "dapple.cli", "verify", f"--plan={path}",
                           f"--model={builder}", *extra], capture_output=True, text=True, cwd=ROOT)


def test_verify_passes_a_transparent_plan(tmp_path):
    proc = run_verify(straight_plan([1, 3], 5, 4, None, replicas=[2, 1, 1]),
                      "tests.models:mlp_with_skip",
                      tmp_path, "--batch_size=16")
    assert proc.returncode == 0, proc.stderr
    assert "largest gradient difference" in proc.stdout and "OK" in proc.stdout


def test_verify_compares_a_batchnorm_model_with_the_plain_model_slice_by_slice(tmp_path):
    proc = run_verify(straight_plan([2], 5, 4, 16), "tests.dapple.test_keras_api:batchnorm_model",
                      tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 slices of 4 rows (ghost batches)" in proc.stdout
    assert "BatchNormalization layers (e.g. 'bn')" in proc.stdout


def test_verify_explains_batchnorm_stages_with_different_slice_sizes(tmp_path):
    proc = run_verify(straight_plan([2], 5, 4, 16, replicas=[2, 1]),
                      "tests.dapple.test_keras_api:batchnorm_model", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "slices of [2, 4] rows in different stages" in proc.stderr


def test_verify_explains_a_plan_for_another_model(tmp_path):
    proc = run_verify(straight_plan([2], 6, 2, 16), "tests.models:mlp_with_skip", tmp_path)
    assert proc.returncode == 2
    assert "covers 6 layers but model 'mlp_with_skip' has 5" in proc.stderr


def test_embedding_gradients_accumulate_over_micro_batches():
    """Embedding gradients are tf.IndexedSlices; summing them over micro-batches must work."""
    tf.keras.utils.set_random_seed(0)
    ids = tf.keras.Input((5,), dtype="int32")
    h = tf.keras.layers.Embedding(10, 3, name="emb")(ids)
    h = tf.keras.layers.Flatten(name="flat")(h)
    model = tf.keras.Model(ids, tf.keras.layers.Dense(2, name="out")(h))
    x = np.random.RandomState(0).randint(0, 10, size=(8, 5)).astype("int32")
    y = np.random.RandomState(1).randint(0, 2, size=8).astype("int32")
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pm = PipelinedModel(model, straight_plan([1], 3, 4, 8, replicas=[2, 1]))
    pm.compile(sgd(), loss)
    grads = pm.gradients(x, y)
    with tf.GradientTape() as tape:
        total = loss(y, model(x, training=True))
    want = tape.gradient(total, model.trainable_variables)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(w),
                                   rtol=1e-5, atol=1e-6)


def dropout_model():
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((6,))
    h = tf.keras.layers.Dense(8, activation="relu", name="d1")(x)
    h = tf.keras.layers.Dropout(0.5, name="drop")(h)
    h = tf.keras.layers.Dense(4, name="d2")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(2, name="out")(h), name="dropout_model")


def test_verify_runs_random_layers_at_rate_zero_unless_asked_to_keep_them(tmp_path):
    plan = straight_plan([2], 4, 4, 16)
    proc = run_verify(plan, "tests.dapple.test_keras_api:dropout_model", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 layer(s) that draw random numbers in training (e.g. 'drop') run at rate 0" \
        in proc.stdout and "OK" in proc.stdout
    proc = run_verify(plan, "tests.dapple.test_keras_api:dropout_model", tmp_path,
                      "--random_layers=train")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "draw random numbers in training (e.g. 'drop')" in proc.stderr
    assert "--random_layers=inference checks the rest" in proc.stderr


def test_fit_evaluate_predict_read_no_dataset_past_its_end():
    """Reading a dataset past its end has TensorFlow log 'Local rendezvous is aborting ... End
    of sequence' (at its default log level) on every fit."""
    script = (
        "import dapple, numpy as np, tensorflow as tf\n"
        "from planner.formats.plan import straight_plan\n"
        "from tests.models import data_for, mlp_with_skip\n"
        "m = mlp_with_skip(seed=1); x, y = data_for(m, 32, seed=1)\n"
        "pm = dapple.PipelinedModel(m, straight_plan([2], 5, 2, 16))\n"
        "pm.compile('sgd', tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "pm.fit(x, y, epochs=2, verbose=0, validation_data=(x, y))\n"
        "ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)\n"
        "pm.fit(ds, epochs=1, verbose=0); pm.evaluate(ds); pm.predict(ds.map(lambda a, b: a))\n"
        "print('done')\n")
    proc = run_python(script, TF_CPP_MIN_LOG_LEVEL="0")
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    assert "Local rendezvous is aborting" not in proc.stderr, proc.stderr[-3000:]
