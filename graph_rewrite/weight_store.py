"""Slots: copies of one stage's trainable variables holding the weight versions its variables do
not (relaxed schedules), and AvgPipe's reference weights z.

Made when the step is made, never inside the traced step (a `tf.function` that creates
variables traces twice), as many slots as `graph_rewrite.version_book` found the longest run
needs. They are plain non-trainable `tf.Variable`s outside the Keras model, so checkpoints and
`model.variables` do not see them. Copies are assignments; inside the traced step TensorFlow's
automatic control dependencies order every read and write of one variable as they were built,
which is the schedule's order.
"""
from __future__ import annotations

from typing import List, Sequence

import tensorflow as tf

from graph_rewrite.keras_adapter import tf_variables
from graph_rewrite.version_book import MODEL, Move, Place


class WeightStore:
    def __init__(self, variables: Sequence[tf.Variable], slots: int, device: str, name: str,
                 reference: bool = False):
        self.variables = tf_variables(variables)    # a Keras 3 variable's own tf.Variable
        with tf.init_scope(), tf.device(device):
            self.slots = [[tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                       name=f"{name}_slot{i}_{k}")
                           for k, v in enumerate(self.variables)] for i in range(slots)]
            self.reference = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                          name=f"{name}_reference_{k}")
                              for k, v in enumerate(self.variables)] if reference else []

    def place(self, where: Place) -> List[tf.Variable]:
        if where == MODEL:
            return self.variables
        if not 0 <= where < len(self.slots):
            raise IndexError(f"slot {where} of {len(self.slots)}: the run needs more weight "
                             f"copies than were made for it (a longer run than the step was "
                             f"built for?)")
        return self.slots[where]

    def move(self, moves: Sequence[Move]) -> None:
        """The moves one after another."""
        for m in moves:
            for target, source in zip(self.place(m.target), self.place(m.source)):
                target.assign(source.read_value())

    def permute(self, moves: Sequence[Move]) -> None:
        """The moves at once: every source is read before any target is written."""
        values = [[v.read_value() for v in self.place(m.source)] for m in moves]
        for m, vs in zip(moves, values):
            for target, value in zip(self.place(m.target), vs):
                target.assign(value)

    def load_reference(self) -> None:
        for v, z in zip(self.variables, self.reference):
            v.assign(z.read_value())

    def fill(self) -> None:
        """Every slot and the reference := the variables (eagerly: training starts afresh)."""
        for copy in self.slots + ([self.reference] if self.reference else []):
            for target, v in zip(copy, self.variables):
                target.assign(v)
