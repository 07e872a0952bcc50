"""A unit's rows of a tensor made elsewhere, cut where the tensor is, then moved to the unit.

Two kinds of tensor reach a unit whole and are cut to its rows: what the step is fed (inputs
for the first stage, labels and sample weights for the last), which the caller feeds on its
own device (the host's CPU; on a TensorFlow cluster, the chief's), and a boundary between
stages of different replica counts (a sender's outputs, a receiver's gradients,
`local_transport`). Cut inside the unit's device scope, TensorFlow moved the whole tensor to
the unit's device first and cut it there: every task of a cluster received the chief's whole
batch, and each replica of a stage after a stage of fewer replicas the whole activation. Cut
beside the tensor, only the unit's rows move; they are then moved once, to the unit's device (a
loop reading them where they were cut would fetch them again every iteration). What the step is
fed moves once a step, every micro-batch's rows together (`micro_batch_rows`): between tasks
each transfer is a call of its own, and a feed's slices are small.

The cut waits for nothing: an action's control dependencies (its lane's order) would hold the
rows back until the lane's previous action is done, so the transfer could not start early. Nor
is it named in the action's scope (it is made under `cut_rows/`): what orders and times a
lane's actions reads their scopes.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import tensorflow as tf


def beside(t: tf.Tensor):
    """A context in which new ops run where `t` does: colocated with it, whatever the
    enclosing device scope. Eagerly (no graph), a context that changes nothing."""
    if tf.executing_eagerly() or not hasattr(t, "graph"):
        return contextlib.nullcontext()
    return t.graph.colocate_with(t)


def cut(t: tf.Tensor, part: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """`part(t)`, computed beside `t` with no control dependencies, then moved to the enclosing
    scope's device."""
    with beside(t), tf.control_dependencies(None), tf.name_scope("cut_rows/"):
        rows = part(t)
    return tf.identity(rows)


def rows(t: tf.Tensor, lo: int, hi: int) -> tf.Tensor:
    """Rows [lo, hi) of `t` (`cut`)."""
    return cut(t, lambda t: t[lo:hi])


def micro_batch_rows(t: tf.Tensor, micro_batches: int, lo: int, hi: int) -> tf.Tensor:
    """Rows [lo, hi) of each of `t`'s `micro_batches` equal slices, as one tensor
    [micro_batches, hi - lo, ...] (`cut`)."""
    shape = t.shape.as_list()
    return cut(t, lambda t: tf.reshape(
        t, [micro_batches, shape[0] // micro_batches] + shape[1:])[:, lo:hi])
