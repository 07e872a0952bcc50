"""Keras's lazily made variables, made before the step function is traced.

Keras creates an optimizer's slots on its first `apply_gradients` and compiled metrics' variables
on their first update. Inside a `tf.function` that means the first call creates variables, and a
`tf.function` that creates variables is traced twice: the whole pipelined step twice (seconds
per trace at many micro-batches). Built eagerly beforehand, the step is traced once.
"""
from __future__ import annotations

import tensorflow as tf

from dapple.data import rows
from graph_rewrite import keras_adapter


def build_optimizer(optimizer, variables) -> None:
    """Keras's optimizer `build` for `variables` (what `apply_gradients` does on its first
    call); legacy optimizers have none and build in the trace."""
    keras_adapter.for_model(optimizer).build_optimizer(optimizer, variables)


def build_metrics(model: tf.keras.Model, y, outputs=None) -> None:
    """Build `model`'s compiled metrics for labels like `y`: one update with zero predictions
    (only shapes and dtypes matter: they choose which accuracy a string names), then reset.
    `outputs`: the symbolic outputs the predictions are shaped like (`model.outputs`)."""
    metrics = keras_adapter.for_model(model).compiled_metrics(model)
    if metrics is None or metrics.built or not _user_metrics(metrics):
        return
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    n = rows(y)
    y_pred = [tf.zeros([n] + list(out.shape[1:]), out.dtype)
              for out in (model.outputs if outputs is None else outputs)]
    metrics.update_state(y, y_pred[0] if len(y_pred) == 1 else y_pred)
    for m in metrics.metrics:
        m.reset_state()


def _user_metrics(metrics) -> bool:
    return bool(getattr(metrics, "_user_metrics", None)
                or getattr(metrics, "_user_weighted_metrics", None))
