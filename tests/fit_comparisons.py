"""Comparisons of `PipelinedModel.fit` with the plain model's own `fit`, for either Keras
(tests/dapple/test_keras3_fit.py: Keras 3; tests/dapple/test_tf_keras_fit.py: tf_keras): the
reference is always the plain model of the same Keras, trained on the same batches."""
import csv
import os

import numpy as np

GLOBAL_BATCH = 24
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def data(batches, seed=11):
    """`batches` global batches of mlp_with_skip's inputs and 5-class labels."""
    rng = np.random.RandomState(seed)
    x = rng.randn(batches * GLOBAL_BATCH, 6).astype("float32")
    return x, rng.randint(0, 5, size=batches * GLOBAL_BATCH).astype("int32")


def assert_same_history(got, want):
    assert got.epoch == want.epoch
    assert sorted(got.history) == sorted(want.history)
    for key in want.history:
        np.testing.assert_allclose(got.history[key], want.history[key], err_msg=key,
                                   **TOLERANCE)


def assert_same_weights(got_model, want_model):
    for g, w, v in zip(got_model.get_weights(), want_model.get_weights(), want_model.weights):
        np.testing.assert_allclose(g, w, err_msg=getattr(v, "path", v.name), **TOLERANCE)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def assert_same_csv_logs(got_path, want_path, epochs: int):
    """CSVLogger's files: `epochs` rows each, the same columns, the same values ("NA" where an
    epoch had no validation)."""
    got_rows, want_rows = read_csv(got_path), read_csv(want_path)
    assert len(got_rows) == len(want_rows) == epochs
    assert [list(r) for r in got_rows] == [list(r) for r in want_rows]     # same columns
    for g, w in zip(got_rows, want_rows):
        for key in w:
            if w[key] == "NA":
                assert g[key] == "NA", key
            else:
                np.testing.assert_allclose(float(g[key]), float(w[key]), err_msg=key,
                                           **TOLERANCE)


def tensorboard_event_files(folder):
    return [f for _, _, files in os.walk(folder) for f in files
            if f.startswith("events.out.tfevents")]


def assert_two_outputs_log_as_plain(keras, build, compile_kwargs, **plain_only):
    """Dict inputs, two outputs with loss_weights (3 stages, 1:2:1), built by `build(seed)`
    with `keras`, compiled by `compile_kwargs()` (the plain twin too, with `plain_only`):
    fit's History and
    evaluate's dict carry the plain model's `<output>_loss` (each output's unweighted loss
    mean), `loss`, a metric per output and their `val_`, with its values."""
    import dapple
    from graph_rewrite.model_graph import layer_order
    from planner.formats.plan import straight_plan
    model, reference = build(0), build(0)
    plan = straight_plan([1, 4], len(layer_order(model)), 4, GLOBAL_BATCH, replicas=[1, 2, 1])
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(**compile_kwargs())
    reference.compile(**compile_kwargs(), **plain_only)

    def two_output_data(batches, seed):
        rng = np.random.RandomState(seed)
        n = batches * GLOBAL_BATCH
        return ({"a": rng.randn(n, 4).astype("float32"), "b": rng.randn(n, 3).astype("float32")},
                [rng.randint(0, 3, size=n).astype("int32"), rng.randn(n, 1).astype("float32")])

    x, y = two_output_data(3, seed=21)
    val = two_output_data(1, seed=22)
    got = pm.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                 validation_data=val)
    want = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                         validation_data=val)
    assert {"cls_loss", "reg_loss", "val_cls_loss", "val_reg_loss"} <= set(want.history)
    assert_same_history(got, want)
    got_eval = pm.evaluate(*val, return_dict=True)
    want_eval = reference.evaluate(*val, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    assert sorted(got_eval) == sorted(want_eval)
    for key in want_eval:
        np.testing.assert_allclose(got_eval[key], want_eval[key], err_msg=key, **TOLERANCE)
    assert_same_weights(model, reference)


def assert_callbacks_fit_as_plain(keras, pair, mlp, tmp_path):
    """ModelCheckpoint (weights each epoch, and the whole model), EarlyStopping with best
    weights restored, CSVLogger, TensorBoard; starting at epoch 1, validating every 2nd:
    `pair()` gives (PipelinedModel, its plain model, the plain twin compiled alike) of `keras`,
    `mlp(seed)` the model whose files are read back."""
    pm, model, reference = pair()
    x, y = data(3)
    val = data(1, seed=12)

    def callbacks(folder):
        os.makedirs(folder)
        return [keras.callbacks.ModelCheckpoint(os.path.join(folder, "w{epoch}.weights.h5"),
                                                save_weights_only=True),
                keras.callbacks.ModelCheckpoint(os.path.join(folder, "last.keras")),
                # min_delta no epoch reaches: the baseline epoch, then `patience` more
                keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=2,
                                              restore_best_weights=True),
                keras.callbacks.CSVLogger(os.path.join(folder, "log.csv")),
                keras.callbacks.TensorBoard(os.path.join(folder, "tb"))]

    got_cb, want_cb = callbacks(str(tmp_path / "got")), callbacks(str(tmp_path / "want"))
    got = pm.fit(x, y, batch_size=GLOBAL_BATCH, epochs=8, initial_epoch=1, shuffle=False,
                 verbose=0, validation_data=val, validation_freq=2, callbacks=got_cb)
    want = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=8, initial_epoch=1,
                         shuffle=False, verbose=0, validation_data=val, validation_freq=2,
                         callbacks=want_cb)
    assert got.epoch == [1, 2, 3]                         # EarlyStopping stopped both there
    assert got_cb[2].stopped_epoch == want_cb[2].stopped_epoch == 3
    assert_same_history(got, want)
    assert len(got.history["val_loss"]) == 2 < len(got.history["loss"])   # epochs 1 and 3
    assert_same_weights(model, reference)                 # the best (first) epoch's, restored
    for epoch in (2, 3, 4):                               # each checkpoint: the plain model's
        got_file, want_file = mlp(seed=5), mlp(seed=5)
        got_file.load_weights(str(tmp_path / "got" / f"w{epoch}.weights.h5"))
        want_file.load_weights(str(tmp_path / "want" / f"w{epoch}.weights.h5"))
        assert_same_weights(got_file, want_file)
    loaded = keras.models.load_model(str(tmp_path / "got" / "last.keras"))
    want_loaded = keras.models.load_model(str(tmp_path / "want" / "last.keras"))
    assert_same_weights(loaded, want_loaded)
    assert_same_csv_logs(str(tmp_path / "got" / "log.csv"), str(tmp_path / "want" / "log.csv"),
                         epochs=3)
    assert len(tensorboard_event_files(str(tmp_path / "got" / "tb"))) >= 2   # train, validation
    assert sorted(os.listdir(str(tmp_path / "got"))) == sorted(
        os.listdir(str(tmp_path / "want")))               # no temporary files left behind


def assert_tf_data_fit_as_plain(pair):
    """A repeated tf.data input with steps_per_epoch (Keras continues one iterator across
    epochs), class weights, and a tf.data validation set; `pair()` as above."""
    import tensorflow as tf
    pm, model, reference = pair()
    x, y = data(3)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH,
                                                          drop_remainder=True).repeat()
    val = tf.data.Dataset.from_tensor_slices(data(2, seed=3)).batch(GLOBAL_BATCH,
                                                                    drop_remainder=True)
    weights = {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.0, 4: 3.0}
    got = pm.fit(ds, epochs=3, steps_per_epoch=2, verbose=0, validation_data=val,
                 class_weight=weights)
    want = reference.fit(ds, epochs=3, steps_per_epoch=2, verbose=0, validation_data=val,
                         class_weight=weights)
    assert_same_history(got, want)
    assert_same_weights(model, reference)


def assert_validation_split_fit_as_plain(pm, model, reference, capsys):
    """validation_split takes the last rows (and sample weights) before shuffling, as Keras's,
    and is refused before training when they are not whole global batches; the rows past the
    last whole global batch are left out (the plain model is given the same rows). `pm`,
    `model`, `reference` as `pair()` gives them, with a progress bar of the model's Keras."""
    import pytest
    x, y = data(4)
    x7, y7 = np.concatenate([x, x[:7]]), np.concatenate([y, y[:7]])
    # 25% of 103 rows: the last 26 validate (not whole batches): refused before training
    with pytest.raises(ValueError, match=r"validation_data has 26 rows.*whole global "
                                         r"batches of 24"):
        pm.fit(x7, y7, batch_size=GLOBAL_BATCH, epochs=1, validation_split=0.25)
    w = np.random.RandomState(2).uniform(0.2, 2.0, size=len(x)).astype("float32")
    longer = lambda a: np.concatenate([a[:3 * GLOBAL_BATCH], a[:5], a[3 * GLOBAL_BATCH:]])  # noqa
    train, held = slice(0, 3 * GLOBAL_BATCH), slice(3 * GLOBAL_BATCH, None)
    got = pm.fit(longer(x), longer(y), sample_weight=longer(w), batch_size=GLOBAL_BATCH,
                 epochs=2, shuffle=False, verbose=1,
                 validation_split=0.2376)     # floor(101 * 0.7624) = 77 = 3 * 24 + 5
    want = reference.fit(x[train], y[train], sample_weight=w[train], batch_size=GLOBAL_BATCH,
                         epochs=2, shuffle=False, verbose=0,
                         validation_data=(x[held], y[held], w[held]))
    assert "3/3" in capsys.readouterr().out                # the progress bar, 3 steps
    assert_same_history(got, want)
    assert_same_weights(model, reference)
