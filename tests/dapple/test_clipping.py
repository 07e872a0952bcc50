"""Gradient clipping sees the whole model's gradient, as on the plain model: `clipnorm` (per
variable), `global_clipnorm` (over all variables, across stages) and `clipvalue`. The reference
is plain Keras `train_on_batch` with the same optimizer (across processes:
tests/dapple/runtime/horovod/test_training_semantics_horovod.py)."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from dapple.pipelined_model import PipelinedModel
from planner.formats.plan import straight_plan
from tests.models import data_for, losses_for, mlp_with_skip

BATCH = 24


@pytest.mark.parametrize("clip", [dict(clipnorm=0.05), dict(global_clipnorm=0.1),
                                  dict(clipvalue=0.01)], ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("legacy", [False, True], ids=["optimizer", "legacy"])
def test_clipping_equals_plain_keras(clip, legacy):
    make = tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD
    model, reference, unclipped = mlp_with_skip(3), mlp_with_skip(3), mlp_with_skip(3)
    loss = losses_for(model)
    pm = PipelinedModel(model, straight_plan([2], 5, 2, BATCH, replicas=[2, 1]))
    pm.compile(make(0.5, **clip), loss)
    reference.compile(make(0.5, **clip), loss)
    unclipped.compile(make(0.5), loss)
    for step in range(3):
        x, y = data_for(model, BATCH, seed=100 + step)
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
        unclipped.train_on_batch(x, y)
    for got, want, free in zip(model.get_weights(), reference.get_weights(),
                               unclipped.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(reference.get_weights(),
                                                            unclipped.get_weights())) > 1e-3
