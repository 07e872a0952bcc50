"""What one traced pipelined step builds, passed explicitly to every action's method."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from graph_rewrite import batch_statistics as bstats
from graph_rewrite.local_transport import Tensors, Unit


@dataclass
class Stashed:
    """What a forward leaves for its backward."""
    inputs: Tensors
    outputs: Tensors
    tape: Optional[tf.GradientTape]       # None under recomputation, or when split
    term: Optional[tf.Tensor]             # loss term and/or weight penalty
    untargeted: List[tf.Tensor]           # outputs the backward does not differentiate
    residuals: Optional[list] = None     # a split forward's, for its I (None: recomputed)


@dataclass
class StepState:
    """Everything one traced step builds, passed to every action's method."""
    inputs: Dict[str, tf.Tensor]                 # model inputs by id, whole global batch
    labels: Optional[List[tf.Tensor]]
    sample_weights: List[Optional[tf.Tensor]]
    global_batch: int
    training: bool
    backward: bool
    loss_scale: Optional[tf.Tensor]
    one: Optional[tf.Tensor] = None                  # 1.0 and 0.0 the optimizer cannot fold
    zero: Optional[tf.Tensor] = None
    zeros: Dict[Tuple, tf.Tensor] = field(default_factory=dict)   # by (shape, dtype)

    def zeros_like(self, t: tf.Tensor) -> tf.Tensor:
        """Zeros like `t` from `zero`, built once per shape for the whole step (outside every
        action's scope and control dependencies, which it must not carry)."""
        if not t.shape.is_fully_defined():
            return tf.fill(tf.shape(t), tf.cast(self.zero, t.dtype))
        key = (tuple(t.shape), t.dtype)
        if key not in self.zeros:
            with tf.control_dependencies(None), tf.name_scope("dapple_zeros/"):
                self.zeros[key] = tf.fill(t.shape, tf.cast(self.zero, t.dtype))
        return self.zeros[key]
    previous: Dict[Unit, List[list]] = field(default_factory=dict)  # a lane's last actions' tensors
    received: Dict[Tuple[Unit, str, int], Tensors] = field(default_factory=dict)
    stash: Dict[Tuple[Unit, int], Stashed] = field(default_factory=dict)
    input_gradients: Dict[Tuple[Unit, int], Tensors] = field(default_factory=dict)
    awaiting_weight: Dict[Tuple[Unit, int], tuple] = field(default_factory=dict)  # (split, I's)
    sent: Dict[Tuple[str, int, int], Dict[int, Tensors]] = field(default_factory=dict)
    accumulated: Dict[Unit, List[Optional[tf.Tensor]]] = field(default_factory=dict)
    reduced: Dict[int, List[Optional[tf.Tensor]]] = field(default_factory=dict)   # by stage
    replica_reduced: Dict[Unit, List[Optional[tf.Tensor]]] = field(default_factory=dict)
    loss_terms: List[tf.Tensor] = field(default_factory=list)
    fed: Dict[Unit, tuple] = field(default_factory=dict)   # `PipelineStep.fed`'s, by unit
    predictions: Dict[Tuple[int, int], List[tf.Tensor]] = field(default_factory=dict)
    statistics: Dict[Unit, bstats.StatisticsRecorder] = field(default_factory=dict)
