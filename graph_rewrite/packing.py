"""Several boundary tensors as one byte matrix, so one collective carries them all.

Between processes every collective on the critical path costs a round of coordination (far
more than the bytes of a small tensor: docs/cluster.md, "What a boundary transfer costs"), so
all tensors that cross one boundary for one micro-batch travel
together: each tensor's rows are reinterpreted as bytes (`tf.bitcast`, no arithmetic) and the
tensors put side by side, row by row; splitting by rows (split, concat) works on the matrix as
on each tensor. Shapes after the batch dimension must be static.

`PackedElements` packs a stage's residuals the same way, flat, one tensor per dtype, inside the
functions that make and read them (`graph_rewrite.stage_split`), so that a loop carries and
collects few tensors and a call site holds no per-tensor ops.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

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


# Tensors up to this many elements (64 KiB of float32) are packed into one tensor per dtype:
# each loop variable costs a few executor nodes per iteration (tens of microseconds), about
# what copying 64 KiB costs.
PACKED_ELEMENTS = 1 << 14


class PackedElements:
    """A collection's element (one micro-batch's residuals) as one flat tensor per dtype, so a
    loop writes and carries one array per dtype, not one per residual: each array is a loop
    variable whose control nodes run every iteration. Only small tensors are packed (up to
    `PACKED_ELEMENTS`), where those nodes cost more than copying them; larger ones and those of
    a shape not fully known keep an array of their own."""

    def __init__(self, specs: Sequence[tf.TensorSpec]):
        self.specs = list(specs)
        groups: Dict[object, List[int]] = {}
        self.groups: List[List[int]] = []
        self.packed: List[bool] = []        # per group: joined (else one tensor as it is)
        for i, spec in enumerate(self.specs):
            if spec.shape.is_fully_defined() and spec.shape.num_elements() <= PACKED_ELEMENTS:
                if spec.dtype not in groups:
                    groups[spec.dtype] = []
                    self.groups.append(groups[spec.dtype])
                    self.packed.append(True)
                groups[spec.dtype].append(i)
            else:
                self.groups.append([i])
                self.packed.append(False)

    def arrays(self, device: Optional[str], size: int) -> List[tf.TensorArray]:
        with tf.device(device):
            return [tf.TensorArray(self.specs[g[0]].dtype, size=size,
                                   element_shape=[sum(self.specs[i].shape.num_elements()
                                                      for i in g)] if packed
                                   else self.specs[g[0]].shape)
                    for g, packed in zip(self.groups, self.packed)]

    def pack(self, values: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        """One tensor per group: the group's tensors flattened and joined."""
        return [tf.concat([tf.reshape(values[i], [-1]) for i in g], 0) if packed
                else values[g[0]] for g, packed in zip(self.groups, self.packed)]

    def unpack(self, packed: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        out: List[Optional[tf.Tensor]] = [None] * len(self.specs)
        for element, g, joined in zip(packed, self.groups, self.packed):
            if not joined:
                out[g[0]] = element
                continue
            parts = tf.split(element, [self.specs[i].shape.num_elements() for i in g])
            for i, part in zip(g, parts):
                out[i] = tf.reshape(part, self.specs[i].shape)
        return out

    def packed_specs(self) -> List[tf.TensorSpec]:
        """The specs of what `pack` returns."""
        return [tf.TensorSpec([sum(self.specs[i].shape.num_elements() for i in g)],
                              self.specs[g[0]].dtype) if packed else self.specs[g[0]]
                for g, packed in zip(self.groups, self.packed)]

    def write(self, arrays: List[tf.TensorArray], index, values: Sequence[tf.Tensor]
              ) -> List[tf.TensorArray]:
        return [a.write(index, p) for a, p in zip(arrays, self.pack(values))]

    def read(self, arrays: List[tf.TensorArray], index) -> List[tf.Tensor]:
        return self.unpack([a.read(index) for a in arrays])
