"""Several boundary tensors as one byte matrix, so one collective carries them all.

Between processes every collective on the critical path costs a round of coordination (far
more than the bytes of a small tensor: docs/cluster.md, "What a boundary transfer costs"), so
all tensors that cross one boundary for one micro-batch travel
together: each tensor's rows are reinterpreted as bytes (`tf.bitcast`, no arithmetic) and the
tensors put side by side, row by row; splitting by rows (split, concat) works on the matrix as
on each tensor. Shapes after the batch dimension must be static.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import tensorflow as tf


def row_bytes(spec: tf.TensorSpec) -> int:
    """Bytes of one row of a tensor of `spec` (every dimension but the first static)."""
    shape = list(spec.shape)[1:]
    if any(d is None for d in shape):
        raise ValueError(f"boundary tensor {spec.name!r} has shape {spec.shape}: transfers "
                         f"between processes need every dimension but the batch to be static; "
                         f"give the model's inputs fixed shapes")
    return int(np.prod(shape, dtype=np.int64)) * _byte_dtype(spec.dtype).size


def _byte_dtype(dtype: tf.DType) -> tf.DType:
    return tf.uint8 if dtype == tf.bool else dtype


def pack(tensors: Sequence[tf.Tensor], specs: Sequence[tf.TensorSpec]) -> tf.Tensor:
    """[rows, sum of row bytes] uint8 holding `tensors` (of `specs`) side by side."""
    parts = []
    for t, spec in zip(tensors, specs):
        if t.dtype == tf.bool:
            t = tf.cast(t, tf.uint8)
        if t.dtype != tf.uint8:
            t = tf.bitcast(t, tf.uint8)       # adds a trailing axis of the item's bytes
        parts.append(tf.reshape(t, [-1, row_bytes(spec)]))
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)


def unpack(packed: tf.Tensor, specs: Sequence[tf.TensorSpec]) -> List[tf.Tensor]:
    """The tensors `pack` put into `packed`, with their dtypes and shapes."""
    widths = [row_bytes(s) for s in specs]
    columns = tf.split(packed, widths, axis=1) if len(specs) > 1 else [packed]
    out = []
    for column, spec in zip(columns, specs):
        shape = [-1] + list(spec.shape)[1:]
        dtype = _byte_dtype(spec.dtype)
        if dtype.size > 1:
            t = tf.bitcast(tf.reshape(column, shape + [dtype.size]), dtype)
        else:
            t = tf.reshape(column, shape)
            t = t if dtype == tf.uint8 else tf.bitcast(t, dtype)
        out.append(tf.cast(t, tf.bool) if spec.dtype == tf.bool else t)
    return out
