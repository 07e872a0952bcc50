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
