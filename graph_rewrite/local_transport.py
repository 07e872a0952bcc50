"""Moving boundary tensors when every unit lives in this process, each on its own device.

A transport moves one micro-batch's boundary tensors across one boundary (a `Crossing`: which
tensors, their specs, and the rows every replica of both stages holds) and sums a stage's
gradients over its replicas. It takes all it needs as arguments; `graph_rewrite.pipeline` calls
it from the send, receive and allreduce actions of the lowered schedule.

Here a receiver reads the senders' tensors directly and concatenates on its own device the row
ranges it needs (`planner.formats.slicing.overlaps`), each cut beside its sender's tensor
(`graph_rewrite.cut_rows`, so only those rows cross): split, concat, both, or nothing when
replica counts are equal. Replica gradients are added on the stage's first device, or where
every replica trains its own weights on every replica's (`graph_rewrite.replica_sums`). Across
processes, `dapple.runtime.horovod.transport` implements the same methods with Horovod.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from graph_rewrite import cut_rows, replica_sums
from planner.formats.slicing import overlaps

Unit = Tuple[int, int]                 # (stage, replica)
Tensors = Dict[str, tf.Tensor]         # boundary tensors by Keras tensor id
Rows = Tuple[Tuple[int, int], ...]     # per replica: [lo, hi) rows of the global batch


@dataclass(frozen=True)
class Crossing:
    """One micro-batch's boundary tensors between stage `boundary` and stage `boundary + 1`."""
    boundary: int
    micro_batch: int
    ids: Tuple[str, ...]                # in the receiving stage's input order
    specs: Dict[str, tf.TensorSpec]
    sender_rows: Rows                   # stage `boundary`'s replicas
    receiver_rows: Rows                 # stage `boundary + 1`'s replicas
    # Inside a loop the same transfer op carries a micro-batch per iteration: it is named by
    # its slot in the loop's period (`schedule_loop`), not by a micro-batch.
    slot: Optional[str] = None

    @property
    def label(self) -> str:
        """What names this crossing's transfers among a step's: its micro-batch, or its slot."""
        return self.slot if self.slot is not None else str(self.micro_batch)

    @property
    def rows(self) -> int:
        return sum(hi - lo for lo, hi in self.sender_rows)


class LocalTransport:
    """All units live in this process, on its devices. Boundaries slice and concatenate rows."""

    def __init__(self, replicas: Sequence[int]):
        self.replicas = list(replicas)

    def local_units(self) -> List[Unit]:
        return [(s, r) for s, n in enumerate(self.replicas) for r in range(n)]

    # Senders' side of a boundary. Locally the receiver reads the sender's tensors directly, so
    # there is nothing to do; a transport between processes sends here (and returns nothing).
    def send_activations(self, crossing: Crossing, replica: int, outputs: Tensors) -> None:
        return None

    def send_gradients(self, crossing: Crossing, replica: int, grads: Tensors) -> None:
        return None

    def receive_activations(self, crossing: Crossing, replica: int,
                            sent: Dict[int, Tensors]) -> Tensors:
        """Inputs of the receiving stage's `replica`, from the sending stage's outputs."""
        return _gather(crossing.receiver_rows[replica], sent, crossing.sender_rows, crossing.ids)

    def receive_gradients(self, crossing: Crossing, replica: int, sent: Dict[int, Tensors],
                          ids: Sequence[str]) -> Tensors:
        """Gradients of the sending stage's `replica`'s outputs `ids`, from the receiving
        stage's replicas."""
        return _gather(crossing.sender_rows[replica], sent, crossing.receiver_rows, ids)

    def sum_replicas(self, stage: int, grads_by_replica: Dict[int, List[tf.Tensor]],
                     device: str, tag: str = "ar") -> List[tf.Tensor]:
        """Elementwise sums over the stage's replicas, on `device` (`tag` names the ops)."""
        replicas = sorted(grads_by_replica)
        if len(replicas) == 1:
            return grads_by_replica[replicas[0]]
        return replica_sums.added_on(device, [grads_by_replica[r] for r in replicas],
                                     f"stage{stage}/{tag}")

    def sums_on_every_replica(self, stage: int, grads_by_replica: Dict[int, List[tf.Tensor]],
                              devices: Dict[int, str]) -> Dict[int, List[tf.Tensor]]:
        """The sums over the stage's replicas on each replica's device
        (`graph_rewrite.replica_sums`)."""
        return replica_sums.on_every_replica(grads_by_replica, devices, f"stage{stage}/ar")


def _gather(want_rows, pieces: Dict[int, Tensors], piece_rows: Rows,
            ids: Sequence[str]) -> Tensors:
    parts = overlaps(want_rows, list(piece_rows))
    out = {}
    for tid in ids:
        taken = []
        for i, lo, hi in parts:
            t = pieces[i][tid]
            full = piece_rows[i][1] - piece_rows[i][0]
            taken.append(t if (lo, hi) == (0, full) else cut_rows.rows(t, lo, hi))
        out[tid] = taken[0] if len(taken) == 1 else tf.concat(taken, axis=0)
    return out
