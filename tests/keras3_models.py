"""Keras 3 (`import keras`) for the Keras 3 test modules: `keras` itself (the importing module
is skipped where `import keras` is not Keras 3), tests/models.py's models built with it, the
loss and the random classification data they share."""
import numpy as np
import pytest

from tests import models

keras = pytest.importorskip("keras")
if keras.__version__.startswith(("1.", "2.")):
    pytest.skip("`import keras` is not Keras 3 here", allow_module_level=True)


def mlp_with_skip(seed=0):
    """tests/models.py's, built with Keras 3."""
    return models.mlp_with_skip(seed, keras=keras)


def two_in_two_out(seed=0):
    return models.two_in_two_out(seed, keras=keras)


def residual_bn_shared(seed=0):
    """BatchNormalization, a residual across a cut at 3, `shared` called in both stages."""
    return models.residual_bn_shared(seed, keras=keras)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(rows, seed):
    """`rows` rows of 6 features and class ids below 5 (mlp_with_skip's)."""
    rng = np.random.RandomState(seed)
    return (rng.randn(rows, 6).astype("float32"),
            rng.randint(0, 5, size=rows).astype("int32"))
