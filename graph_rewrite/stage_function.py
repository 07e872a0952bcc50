"""A stage's forward as one traced function, called once per micro-batch.

Tracing Keras layers is the slow part of building a pipelined step (seconds per ResNet-50
stage), so each stage's forward is a `tf.function` traced once (per input signature: the
training flag, the slice's row count) and called for every micro-batch and replica. A tape
around a call records one op; its gradient is one call of a backward function that TensorFlow
also derives once per traced forward. The step's graph then grows by a few call ops per
micro-batch, not by a copy of the stage.

Unless `inlined`, the calls stay out of the step's graph (`_noinline`): the optimizer rewrites
the stage once, not a copy per micro-batch (inlined, a first call several times slower in one
process), and each call op is one node the schedule's control dependencies can order. The
runtimes across processes inline them by default, where the steady step measured faster
(docs/runtime.md, "Inlined stage calls"). A call runs on the device of the `tf.device` scope it
is made in; so one function serves every replica.

The function returns, beside the stage's outputs and (on the last stage) the micro-batch's
loss term, the statistics of every BatchNormalization call (`graph_rewrite.batch_statistics`),
keyed by the call's node; their row counts are static and kept in `statistics_rows` when the
function is traced. Keras's own per-call updates of those layers' moving statistics write the
calling device's scratch variables, passed with each call (`batch_statistics.ScratchStatistics`),
so calls on different devices share no written variable and may run at the same time.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import tensorflow as tf

from graph_rewrite import batch_statistics as bstats
from graph_rewrite.local_transport import Tensors
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.model_graph import StageGraph
from graph_rewrite.working_copies import WorkingCopies

Statistics = Dict[str, Tuple[tf.Tensor, tf.Tensor]]     # node key -> (mean, m2)


class StageFunction:
    def __init__(self, graph: StageGraph, loss: Optional[PipelineLoss],
                 output_ids: Sequence[str], last: bool, penalized: bool = False,
                 inlined: bool = False):
        """`inlined`: calls may be inlined into the caller's graph (for a stage called once a
        step: its gradients then appear one by one during the backward, not all at its end)."""
        self.graph = graph
        self.loss = loss
        self.output_ids = list(output_ids)
        self.last = last
        self.inlined = inlined
        self.statistics_rows: Dict[str, int] = {}
        self.nodes = {str(id(n)): n for n in graph.nodes}
        self.scratch = bstats.ScratchStatistics(bstats.normalization_layers(graph.nodes))
        # Made per device only when a runtime asks (`graph_rewrite.working_copies`).
        self.copies = WorkingCopies(graph.called_layers, graph.trainable_variables, penalized)
        self._function = tf.function(self._forward, experimental_attributes=(
            {} if inlined else {"_noinline": True}))

    def __call__(self, inputs: Tensors, training: bool, labels=None, weights=None,
                 rows: int = 0, global_rows: int = 0, scratch=()
                 ) -> Tuple[Tensors, Optional[tf.Tensor], Statistics]:
        """(outputs by id, loss term or None, BatchNormalization statistics by node key);
        `scratch`: the calling device's `self.on(device)`."""
        return self._function(inputs, training, labels, weights, rows, global_rows,
                              [list(s) for s in scratch])

    def on(self, device: str):
        """What a call on `device` passes as `scratch`: its BatchNormalization scratch pairs
        and its working copies (either may be empty)."""
        return [self.scratch.on(device), self.copies.on(device)]

    def inline(self, inputs: Tensors, training: bool, labels=None, weights=None, rows: int = 0,
               global_rows: int = 0, scratch=()
               ) -> Tuple[Tensors, Optional[tf.Tensor], Statistics]:
        """The same, with the stage's ops built into the calling graph (`stage_split` cuts
        them into forward, backward, I and W)."""
        return self._forward(inputs, training, labels, weights, rows, global_rows, scratch)

    def _forward(self, inputs, training, labels, weights, rows, global_rows, scratch):
        recorder = bstats.StatisticsRecorder() if training else None
        statistics_scratch, copies = scratch if scratch else ((), ())
        with self.scratch.redirect(statistics_scratch, self.graph.nodes, training), \
                self.copies.redirect(copies):
            outs = self.graph.call(inputs, training=training, observe=recorder)
        # A relayed tensor must be a new tensor so the tape sees output != input.
        outs = {tid: (tf.identity(t) if tid in inputs else t) for tid, t in outs.items()}
        term = None
        if self.last and labels is not None:
            term = self.loss.micro_batch_term(labels, [outs[t] for t in self.output_ids],
                                              rows=rows, global_rows=global_rows,
                                              sample_weights=weights)
        statistics = {}
        for node_id, (stats,) in (recorder.by_node.items() if recorder else ()):
            key = str(node_id)
            self.statistics_rows[key] = stats.count
            statistics[key] = (stats.mean, stats.m2)
        return outs, term, statistics

    def slice_statistics(self, statistics: Statistics) -> Dict[int, bstats.SliceStatistics]:
        """A call's returned statistics as `SliceStatistics` by id(node)."""
        return {id(self.nodes[k]): bstats.SliceStatistics(self.statistics_rows[k], mean, m2)
                for k, (mean, m2) in statistics.items()}
