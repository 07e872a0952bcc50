"""Which Horovod rank runs which plan unit, and which rows each boundary transfer moves.

Plain Python (no TensorFlow, no Horovod), so it can be checked on its own.

* Rank r runs plan device r. Device ids are ordered host by host, and so are the ranks of
  `horovodrun -H h1:8,h2:8`, so a plan made for that topology lands where it was planned. The
  plan must therefore use exactly the devices 0..N-1 for a world of N ranks.
* Process sets: every replicated stage has one (its ranks), for the gradient allreduce; every
  boundary s -> s+1 has one (the ranks of both stages), for the transfers. A set equal to the
  whole world is Horovod's global set (Horovod refuses to register it twice).
* A boundary transfer is one `alltoall` inside the boundary's set: each sender replica sends
  every receiver replica the rows of the micro-batch that both hold (DAPPLE §V-B2: split,
  concat or both), receivers send nothing. Rows are relative to the micro-batch; replica k of
  R holds rows [k n/R, (k+1) n/R) (`planner.formats.slicing`). Splits are listed in the
  set's rank order (ascending global rank), which is also the order an alltoall concatenates
  what it receives. A stage may list its devices out of replica order (a hand-made plan), so a
  sender orders its rows by destination rank (`send_row_order`), and a receiver puts the pieces
  back in row order (`received_pieces`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from planner.formats.plan import Plan, PlanError
from planner.formats.slicing import overlap as _overlap, replica_rows


class WorldSizeError(PlanError):
    """The plan's devices do not match the Horovod world it is run in."""


@dataclass(frozen=True)
class Piece:
    """A run of received rows: from which replica of the sending stage, how many."""
    sender_replica: int
    rows: int


class RankLayout:
    """The plan seen from a Horovod world of `size` ranks."""

    def __init__(self, plan: Plan, size: int):
        self.plan = plan
        self.size = size
        # An interleaved plan's chunks repeat its device groups' devices: count the groups.
        used = sorted(d for s in plan.stages[:plan.num_positions] for d in s.devices)
        if len(used) != size:
            raise WorldSizeError(
                f"the plan uses {len(used)} devices but Horovod runs {size} processes: start "
                f"one process per plan device (`dapple launch --plan=...` derives -np "
                f"{len(used)}), or use a plan made for {size} devices")
        if used != list(range(size)):
            raise WorldSizeError(
                f"the plan's device ids are {used}; under Horovod rank r runs device r, so a "
                f"plan for {size} processes must use devices 0..{size - 1}: renumber them")
        self._units = {d: [] for d in used}
        for s, stage in enumerate(plan.stages):
            for k, d in enumerate(stage.devices):
                self._units[d].append((s, k))

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    def unit(self, rank: int) -> Tuple[int, int]:
        """(device group, replica) of `rank`: its (stage, replica) unless the plan interleaves
        chunks, when the group is the position along the pipeline."""
        stage, replica = self._units[rank][0]
        return stage % self.plan.num_positions, replica

    def units(self, rank: int) -> List[Tuple[int, int]]:
        """Every (stage, replica) `rank` runs: one, or an interleaved group's chunks."""
        return list(self._units[rank])

    def stage_ranks(self, stage: int) -> List[int]:
        """Ranks of a stage, in replica order."""
        return list(self.plan.stages[stage].devices)

    def rank(self, stage: int, replica: int) -> int:
        return self.plan.stages[stage].devices[replica]

    def boundary_ranks(self, boundary: int) -> List[int]:
        """Ranks of the process set for boundary `boundary` -> `boundary + 1`, ascending."""
        return sorted(set(self.stage_ranks(boundary) + self.stage_ranks(boundary + 1)))

    def ranks_of_stages(self, stages) -> List[int]:
        """Every rank of the given stages, ascending, each once (chunks share ranks)."""
        return sorted({r for s in stages for r in self.stage_ranks(s)})

    def process_sets(self, stage_groups=()) -> List[List[int]]:
        """Every process set the plan needs besides the global one, each once, in a fixed
        order (every rank must register the same sets in the same order). `stage_groups`:
        groups of stages that share variables; each gets the set of all their ranks."""
        wanted: List[List[int]] = []
        for s in range(self.num_stages):
            if self.plan.stages[s].replicas > 1:
                wanted.append(sorted(self.stage_ranks(s)))
        for b in range(self.num_stages - 1):
            wanted.append(self.boundary_ranks(b))
        for group in stage_groups:
            wanted.append(self.ranks_of_stages(group))
        out, seen = [], {tuple(range(self.size))}
        for ranks in wanted:
            if tuple(ranks) not in seen:
                seen.add(tuple(ranks))
                out.append(ranks)
        return out

    # ---- boundary transfers ----------------------------------------------------------------
    def send_splits(self, sender_stage: int, sender_replica: int, receiver_stage: int,
                    rows: int) -> List[int]:
        """Rows `sender_replica` of `sender_stage` sends to each rank of the boundary set
        (ascending rank order), for a micro-batch of `rows` rows. Works in both directions:
        activations go to `sender_stage + 1`, gradients to `sender_stage - 1`."""
        if abs(receiver_stage - sender_stage) != 1:
            raise ValueError("transfers go between consecutive stages")
        boundary = min(sender_stage, receiver_stage)
        mine = replica_rows(rows, self.plan.stages[sender_stage].replicas, sender_replica)
        receivers = self.plan.stages[receiver_stage]
        by_rank = {}
        for j, d in enumerate(receivers.devices):
            by_rank[d] = _overlap(mine, replica_rows(rows, receivers.replicas, j))
        return [by_rank.get(r, 0) for r in self.boundary_ranks(boundary)]

    def send_row_order(self, sender_stage: int, sender_replica: int, receiver_stage: int,
                       rows: int) -> List[Tuple[int, int]]:
        """[start, stop) ranges of the sender's own rows (relative to its share), in the
        order the alltoall must receive them: by destination rank, which is not replica order
        when a stage's devices are listed out of order. Matches `send_splits`."""
        boundary = min(sender_stage, receiver_stage)
        mine = replica_rows(rows, self.plan.stages[sender_stage].replicas, sender_replica)
        receivers = self.plan.stages[receiver_stage]
        ranges = []
        for rank in self.boundary_ranks(boundary):
            if rank not in receivers.devices:
                continue
            want = replica_rows(rows, receivers.replicas, receivers.devices.index(rank))
            lo, hi = max(mine[0], want[0]), min(mine[1], want[1])
            if lo < hi:
                ranges.append((lo - mine[0], hi - mine[0]))
        return ranges

    def received_pieces(self, sender_stage: int, receiver_stage: int, receiver_replica: int,
                        rows: int) -> List[Piece]:
        """What an alltoall delivers to `receiver_replica`: pieces in the order they arrive
        (ascending sender rank). Concatenating them sorted by `sender_replica` gives the
        receiver's rows in row order (a sender with a lower replica index holds lower rows)."""
        want = replica_rows(rows, self.plan.stages[receiver_stage].replicas, receiver_replica)
        senders = self.plan.stages[sender_stage]
        pieces = []
        for rank in sorted(senders.devices):
            k = senders.devices.index(rank)
            n = _overlap(want, replica_rows(rows, senders.replicas, k))
            if n:
                pieces.append(Piece(k, n))
        return pieces
