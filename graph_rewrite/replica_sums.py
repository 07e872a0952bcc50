"""A stage's gradients summed over its replicas, the sums wanted on every replica's device.

Where each replica trains its own copy of the stage's weights (a TensorFlow cluster,
`dapple.runtime.tf_cluster.stage_weights`), every replica needs the sums. Two replicas exchange
their gradients: each adds the other's, one round, each device receiving one gradient's bytes.
With R > 2 that exchange makes each device receive R - 1 gradients, so here the replicas
reduce-scatter, then all-gather, as a ring does but in two rounds of direct transfers: each
replica packs its gradients of one dtype into one flat vector cut into R pieces, replica k's
device adds piece k of every replica's, and every device concatenates the R sums. A device
receives 2 (R - 1) / R gradients' bytes, whatever R. Every piece is added once, in replica
order, so every replica gets the same sums bit for bit.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import tensorflow as tf


def on_every_replica(grads_by_replica: Dict[int, List[tf.Tensor]], devices: Dict[int, str],
                     name: str) -> Dict[int, List[tf.Tensor]]:
    """{replica: the elementwise sums over the replicas of `grads_by_replica`, on
    `devices[replica]`}; the gradients are lists in one order on every replica."""
    replicas = sorted(grads_by_replica)
    if len(replicas) == 1:
        return dict(grads_by_replica)
    first = grads_by_replica[replicas[0]]
    if len(replicas) == 2 or not all(_dense_and_shaped(g) for g in first):
        return {r: added_on(devices[r], [grads_by_replica[q] for q in replicas],
                             f"{name}/{r}") for r in replicas}
    out: Dict[int, List[tf.Tensor]] = {r: [None] * len(first) for r in replicas}
    by_dtype: Dict[tf.DType, List[int]] = {}
    for i, g in enumerate(first):
        by_dtype.setdefault(g.dtype, []).append(i)
    for dtype, positions in by_dtype.items():
        sums = _scatter_gather([[grads_by_replica[r][i] for i in positions] for r in replicas],
                               [devices[r] for r in replicas], f"{name}/{dtype.name}")
        for r, summed in zip(replicas, sums):
            for i, s in zip(positions, summed):
                out[r][i] = s
    return out


def _dense_and_shaped(g) -> bool:
    return isinstance(g, tf.Tensor) and g.shape.is_fully_defined()


def added_on(device: str, lists: Sequence[List[tf.Tensor]], name: str) -> List[tf.Tensor]:
    """The elementwise sums of `lists` (one list of tensors per replica), on `device`."""
    with tf.device(device), tf.name_scope(name):
        return [tf.add_n(list(terms)) for terms in zip(*lists)]


def _scatter_gather(lists: Sequence[List[tf.Tensor]], devices: Sequence[str], name: str
                    ) -> List[List[tf.Tensor]]:
    """Per replica, the sums of `lists` (a list of tensors per replica, same shapes and dtype),
    on its device: reduce-scatter then all-gather over one flat vector."""
    R = len(lists)
    shapes = [g.shape for g in lists[0]]
    sizes = [s.num_elements() for s in shapes]
    total = sum(sizes)
    cuts = [total * k // R for k in range(R + 1)]
    pieces = []
    for grads, device in zip(lists, devices):
        with tf.device(device), tf.name_scope(f"{name}/pack"):
            flat = tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)
            pieces.append(tf.split(flat, [cuts[k + 1] - cuts[k] for k in range(R)]))
    summed = []
    for k, device in enumerate(devices):
        with tf.device(device), tf.name_scope(f"{name}/reduce{k}"):
            summed.append(tf.add_n([pieces[r][k] for r in range(R)]))
    out = []
    for device in devices:
        with tf.device(device), tf.name_scope(f"{name}/gather"):
            parts = tf.split(tf.concat(summed, axis=0), sizes)
            out.append([tf.reshape(p, s) for p, s in zip(parts, shapes)])
    return out
