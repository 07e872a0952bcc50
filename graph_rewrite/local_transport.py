"""Moving boundary tensors when every unit lives in this process, each on its own device.

A receiver reads the senders' tensors directly and slices and concatenates the row ranges it
needs on its own device (`planner.slicing.overlaps`): split, concat, both, or nothing when
replica counts are equal. Replica gradients are added on the stage's first device. Across
processes, `graph_rewrite.horovod_transport` implements the same methods with Horovod.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from planner.slicing import overlaps

Unit = Tuple[int, int]                 # (stage, replica)
Tensors = Dict[str, tf.Tensor]         # boundary tensors by Keras tensor id


class LocalTransport:
    """All units live in this process, on its devices. Boundaries slice and concatenate rows."""

    def __init__(self, pipeline):       # a graph_rewrite.pipeline.PipelineStep
        self.p = pipeline

    def local_units(self) -> List[Unit]:
        return [(s, r) for s, st in enumerate(self.p.plan.stages) for r in range(st.replicas)]

    # Senders' side of a boundary. Locally the receiver reads the sender's tensors directly, so
    # there is nothing to do; a transport between processes sends here (and returns nothing).
    def send_activations(self, stage: int, replica: int, micro_batch: int, outputs: Tensors) -> None:
        return None

    def send_gradients(self, stage: int, replica: int, micro_batch: int, grads: Tensors) -> None:
        return None

    def _gather(self, want_rows, pieces: Dict[int, Tensors], piece_rows: List[Tuple[int, int]],
                ids: Sequence[str]) -> Tensors:
        parts = overlaps(want_rows, piece_rows)
        out = {}
        for tid in ids:
            taken = []
            for i, lo, hi in parts:
                t = pieces[i][tid]
                full = piece_rows[i][1] - piece_rows[i][0]
                taken.append(t if (lo, hi) == (0, full) else t[lo:hi])
            out[tid] = taken[0] if len(taken) == 1 else tf.concat(taken, axis=0)
        return out

    def receive_activations(self, stage: int, replica: int, micro_batch: int,
                            sent: Dict[int, Tensors]) -> Tensors:
        """Inputs of (stage, replica) for `micro_batch`, from stage-1's replicas' outputs."""
        prev = stage - 1
        piece_rows = [self.p.rows(prev, r, micro_batch) for r in range(self.p.replicas[prev])]
        return self._gather(self.p.rows(stage, replica, micro_batch), sent, piece_rows,
                            self.p.stages[stage].input_ids)

    def receive_gradients(self, stage: int, replica: int, micro_batch: int,
                          sent: Dict[int, Tensors], ids: Sequence[str]) -> Tensors:
        """Gradients of (stage, replica)'s outputs `ids`, from stage+1's replicas."""
        nxt = stage + 1
        piece_rows = [self.p.rows(nxt, r, micro_batch) for r in range(self.p.replicas[nxt])]
        return self._gather(self.p.rows(stage, replica, micro_batch), sent, piece_rows, ids)

    def sum_replicas(self, stage: int, grads_by_replica: Dict[int, List[tf.Tensor]],
                     tag: str = "ar") -> List[tf.Tensor]:
        """Elementwise sums over the stage's replicas (`tag` names the collective)."""
        replicas = sorted(grads_by_replica)
        if len(replicas) == 1:
            return grads_by_replica[replicas[0]]
        with tf.device(self.p.device(stage, 0)), tf.name_scope(f"stage{stage}/{tag}"):
            return [tf.add_n([grads_by_replica[r][i] for r in replicas])
                    for i in range(len(grads_by_replica[replicas[0]]))]
