"""A simulated iteration (`planner.estimate.simulator`): its timeline of events and per-position
statistics (busy, idle, bubbles, activations held over time)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from planner.schedules.actions import Schedule

# Timeline event kinds (also the legend of the pictures).
FORWARD_KIND = "forward"
BACKWARD_KIND = "backward"
BACKWARD_INPUT_KIND = "backward_input"      # I of a split backward
BACKWARD_WEIGHT_KIND = "backward_weight"    # W of a split backward
SEND_FORWARD_KIND = "send_forward"     # activations, boundary s -> s+1
SEND_BACKWARD_KIND = "send_backward"   # gradients, boundary s+1 -> s
ALLREDUCE_KIND = "allreduce"
COMPUTE_EVENTS = (FORWARD_KIND, BACKWARD_KIND, BACKWARD_INPUT_KIND, BACKWARD_WEIGHT_KIND)


@dataclass(frozen=True)
class TimelineEvent:
    kind: str                  # one of the *_KIND constants
    stage: int                 # compute/allreduce: the chunk; transfers: boundary c (c <-> c+1)
    micro_batch: Optional[int]  # None for allreduce
    start_ms: float
    end_ms: float
    position: Optional[int] = None   # compute/allreduce: where it ran; transfers: the sender

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class StageStats:
    """One position: a stage, or the devices running chunks of an interleaved schedule."""
    stage: int                 # the position
    busy_ms: float
    idle_ms: float
    allreduce_ms: float
    bubble_fraction: float
    peak_held_micro_batches: int         # full activations, forward to B or I (all its chunks)
    peak_held_bytes: float               # held and awaiting W, at their bytes
    end_ms: float              # when the position's allreduce (or last task) ends
    peak_awaiting_weight_micro_batches: int = 0     # past I, before W
    chunks: List[int] = field(default_factory=list)
    weight_copies: int = 1      # weight versions resident at once (and AvgPipe's reference)
    staleness: int = 0          # most updates between a gradient's weights and those it updates


@dataclass
class SimulationResult:
    iteration_ms: float
    stages: List[StageStats]
    events: List[TimelineEvent]
    schedule: Optional[Schedule] = None          # lowered: what ran
    link_duplex: str = "full"
    rendezvous: bool = False
    batches: int = 1            # consecutive global batches in the run (per pipeline)
    pipelines: int = 1          # AvgPipe: pipelines running the same lists, each its own batch

    @property
    def batch_ms(self) -> float:
        """Time per global batch consumed: the iteration over batches x pipelines."""
        return self.iteration_ms / (self.batches * self.pipelines)

    @property
    def batches_per_second(self) -> float:
        return 1000.0 / self.batch_ms if self.batch_ms > 0 else float("inf")

    @property
    def num_stages(self) -> int:
        """Positions (stages; with interleaving, device groups holding several chunks)."""
        return len(self.stages)

    @property
    def num_boundaries(self) -> int:
        """Chunk boundaries c <-> c+1 (transfer events' `stage`)."""
        return sum(len(s.chunks) for s in self.stages) - 1

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time (each stage weighted equally)."""
        return sum(s.idle_ms for s in self.stages) / (self.iteration_ms * self.num_stages) \
            if self.iteration_ms > 0 else 0.0

    def stage_events(self, stage: int) -> List[TimelineEvent]:
        """Compute and allreduce events of position `stage`, in time order."""
        return [e for e in self.events if e.position == stage and
                e.kind in COMPUTE_EVENTS + (ALLREDUCE_KIND,)]

    def link_events(self, boundary: int) -> List[TimelineEvent]:
        return [e for e in self.events if e.stage == boundary and
                e.kind in (SEND_FORWARD_KIND, SEND_BACKWARD_KIND)]

    def held_over_time(self, stage: int) -> List[Tuple[float, int]]:
        """Micro-batches held on position `stage`: [(time, count from then on)]."""
        return [(t, int(round(c))) for t, c in _held_steps(self.events, stage)]

    def to_dict(self, with_timeline: bool = False) -> Dict:
        d = {
            "iteration_ms": self.iteration_ms,
            "batches": self.batches,
            "pipelines": self.pipelines,
            "batch_ms": self.batch_ms,
            "batches_per_second": self.batches_per_second,
            "bubble_fraction": self.bubble_fraction,
            "link_duplex": self.link_duplex,
            "stages": [asdict(s) for s in self.stages],
        }
        if with_timeline:
            d["timeline"] = [asdict(e) for e in self.events]
        return d


# Order of events starting at one instant (the simulator sorts its timeline by it).
KIND_ORDER = {BACKWARD_KIND: 0, BACKWARD_WEIGHT_KIND: 0, BACKWARD_INPUT_KIND: 1, FORWARD_KIND: 1,
              SEND_FORWARD_KIND: 2, SEND_BACKWARD_KIND: 3, ALLREDUCE_KIND: 4}


def _held_steps(events: Sequence[TimelineEvent], position: int,
                held_weight: Optional[Sequence[float]] = None,
                awaiting_weight: Optional[Sequence[float]] = None) -> List[Tuple[float, float]]:
    """Step function [(time, amount from then on)] of what `position` keeps: per micro-batch of
    chunk c, `held_weight[c]` from a forward's start to its B's or I's end, then
    `awaiting_weight[c]` until its W's end (defaults: count held micro-batches)."""
    changes = []   # (time, order, delta): releases (order 0) before acquisitions (order 1)
    for e in events:
        if e.position != position:
            continue
        held = 1.0 if held_weight is None else held_weight[e.stage]
        awaiting = 0.0 if awaiting_weight is None else awaiting_weight[e.stage]
        if e.kind == FORWARD_KIND:
            changes.append((e.start_ms, 1, +held))
        elif e.kind in (BACKWARD_KIND, BACKWARD_INPUT_KIND):
            changes.append((e.end_ms, 0, -held))
            if e.kind == BACKWARD_INPUT_KIND:
                changes.append((e.end_ms, 1, +awaiting))
        elif e.kind == BACKWARD_WEIGHT_KIND:
            changes.append((e.end_ms, 0, -awaiting))
    changes.sort()
    steps, amount = [(0.0, 0.0)], 0.0
    for time, _, delta in changes:
        amount += delta
        if steps[-1][0] == time:
            steps[-1] = (time, amount)
        else:
            steps.append((time, amount))
    # Entries at one instant collapse to the last amount: a backward ending at t and the next
    # forward starting at t leave the count unchanged, never one above it.
    return steps


def peak_held(events, position, held_weight, awaiting_weight) -> float:
    """The most `position` holds at once, weighted as in `_held_steps`."""
    return max(amount for _, amount in _held_steps(events, position, held_weight,
                                                   awaiting_weight))


def peaks(events: Sequence[TimelineEvent], held_bytes: Sequence[float],
          awaiting_bytes: Sequence[float]) -> Tuple[float, float, float]:
    """(peak_held(events, p, ones, zeros), peak_held(events, p, held_bytes, awaiting_bytes),
    peak_held(events, p, zeros, ones)) of one position's `events` (all on it), in one sort:
    the byte amounts are summed in `_held_steps`'s order (its sort key leads this one's); a
    count is a sum of small integers, exact in any order, and within one instant its changes
    all go one way (releases, then acquisitions), so its largest running sum is its peak."""
    changes = []   # (time, order, bytes, held count, awaiting count)
    for e in events:
        kind, c = e.kind, e.stage
        if kind == FORWARD_KIND:
            changes.append((e.start_ms, 1, +held_bytes[c], 1.0, 0.0))
        elif kind == BACKWARD_KIND:
            changes.append((e.end_ms, 0, -held_bytes[c], -1.0, -0.0))
        elif kind == BACKWARD_INPUT_KIND:
            changes.append((e.end_ms, 0, -held_bytes[c], -1.0, -0.0))
            changes.append((e.end_ms, 1, +awaiting_bytes[c], 0.0, 1.0))
        elif kind == BACKWARD_WEIGHT_KIND:
            changes.append((e.end_ms, 0, -awaiting_bytes[c], -0.0, -1.0))
    changes.sort()
    # `_held_steps` starts from (0.0, 0.0) and keeps the last amount at each instant.
    last_time = amount = last_amount = held = most_held = awaiting = most_awaiting = 0.0
    most = None
    for time, _, delta, d_held, d_awaiting in changes:
        amount += delta
        held += d_held
        awaiting += d_awaiting
        if held > most_held:
            most_held = held
        if awaiting > most_awaiting:
            most_awaiting = awaiting
        if last_time != time:
            if most is None or last_amount > most:
                most = last_amount
            last_time = time
        last_amount = amount
    if most is None or last_amount > most:
        most = last_amount
    return most_held, most, most_awaiting
