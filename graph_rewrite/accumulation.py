"""A unit's variable gradients summed over its micro-batches, one call op per micro-batch.

ResNet-50 has 161 gradient tensors per stage: adding them op by op put 161 add ops per unit and
micro-batch into the step's graph, which then dominated its size (two thirds of the nodes at
4 replicas x 8 micro-batches) and with it tracing and graph-optimization time. One
non-inlined function (`_noinline`, as the stage functions) adds the whole list; it is traced
once per list of shapes and runs on the device of the call site.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import tensorflow as tf


def _add_lists(accumulated, gradients):
    return [a + g for a, g in zip(accumulated, gradients)]


class Accumulator:
    def __init__(self):
        self._add = tf.function(_add_lists, experimental_attributes={"_noinline": True})

    def __call__(self, accumulated: Optional[List[Optional[tf.Tensor]]],
                 gradients: List[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        """`accumulated` + `gradients` elementwise (None: no gradient yet / none here)."""
        if accumulated is None:
            return list(gradients)
        both = [i for i, (a, g) in enumerate(zip(accumulated, gradients))
                if a is not None and g is not None]
        out = [g if a is None else a for a, g in zip(accumulated, gradients)]
        if both:
            sums = self._add([accumulated[i] for i in both], [gradients[i] for i in both])
            for i, s in zip(both, sums):
                out[i] = s
        return out


def model_gradients(model, stages, reduced: Dict[int, List[tf.Tensor]]):
    """Every stage's summed gradients (`reduced`, by stage), aligned with the model's trainable
    variables: a variable used by several stages gets the sum, one no stage here holds None."""
    by_var: Dict[int, tf.Tensor] = {}
    for stage, graph in enumerate(stages):
        if stage not in reduced:
            continue
        for v, g in zip(graph.trainable_variables, reduced[stage]):
            by_var[id(v)] = g if id(v) not in by_var else by_var[id(v)] + g
    return [by_var.get(id(v)) for v in model.trainable_variables]
